"""The two-kernel Mosaic GPU backward (pallas_flash/mosaic/backward.py) beyond the matrix.

test_features.py compares dq, dk and dv with the reference at every option, tile and launch
order. Here: float16's range in dS, the kernels' names, the Python half of the sm_90 compile
(which covers the compiled-only path on the CPU: wgmma operands in registers, in-place
accumulation, the shared-memory limit), and what the kernels refuse.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from backends import IS_HOPPER, ON_GPU
from helpers import (TOLERANCE, assert_close, backward_args, kernel_names, make_spec,
                     random_inputs, reference_grads)
from pallas_flash.mosaic import backward as mosaic
from pallas_flash.mosaic import fused_backward
from pallas_flash.mosaic.config import MosaicBackwardConfig, default_backward_config
from pallas_flash.triton import backward as triton_backward
from pallas_flash.triton import forward as triton_forward

Config = MosaicBackwardConfig
PAIRED = Config(dkdv_block_q=64, dq_block_kv=64, dq_compute_wgs=1, dkdv_paired=True)
needs_hopper = pytest.mark.skipif(ON_GPU and not IS_HOPPER, reason="Mosaic GPU kernel needs sm_90")


def _f16_overflow_case():
    """Operands whose dS passes float16's range (v at its top, a unit cotangent)."""
    b, s, h, d = 1, 128, 1, 64
    f16_max = 65504.0
    q, k, _, do = random_inputs(jax.random.PRNGKey(93), b, s, s, h, h, d, jnp.float16)
    k1, k2 = jax.random.split(jax.random.PRNGKey(95))
    steps = jax.random.randint(k1, k.shape, 0, 15)
    sign = jnp.where(jax.random.bernoulli(k2, 0.5, k.shape), 1.0, -1.0)
    v = (sign * (f16_max - 32.0 * steps)).astype(jnp.float16)
    dlse = jax.random.normal(jax.random.PRNGKey(96), (b, h, s), jnp.float32)
    spec = make_spec(s, s, d, jnp.float16, causal=True)
    out, stats = triton_forward.forward(spec, q, k, v)
    return spec, (q, k, v, out, stats, do, dlse)


@needs_hopper
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two-kernel"])
def test_float16_ds_does_not_overflow(fused):
    # v at the top of float16's range and a unit cotangent: |dP| = |dO . v| reaches ~1e5-1e6, so
    # dS cast to float16 unscaled would be inf and would spread inf / NaN over whole rows of dq
    # and dk. Some exact gradients do exceed 65504 themselves; the check covers the ones that
    # fit (with a margin): finite there, and equal to the reference at the float16 tolerance.
    f16_max = 65504.0
    spec, args = _f16_overflow_case()
    q, k, v, out, stats, do, dlse = args
    cfg = dataclasses.replace(default_backward_config(64), fused=fused)
    assert mosaic.uses_fused(spec, q, k, cfg) is fused
    grads = mosaic.backward(spec, *args, config=cfg)
    tri = triton_backward.backward(spec, q, k, v, out, stats, do, dlse)
    ref = reference_grads(q, k, v, do, dlse, causal=True)
    tol = TOLERANCE[jnp.dtype(jnp.float16)]
    n_over = 0
    for name, g, t, r in zip(("dq", "dk", "dv"), grads, tri, ref):
        g, t, r = (np.asarray(x, np.float32) for x in (g, t, r))
        fits = np.abs(r) < f16_max * (1 - tol)
        n_over += int((~fits).sum())
        assert np.isfinite(g[fits]).all(), f"{name}: non-finite where the gradient fits"
        assert_close(f"{name} vs reference", np.where(fits, g, 0), np.where(fits, r, 0), tol)
        both = fits & np.isfinite(t)
        assert_close(f"{name} vs triton", np.where(both, g, 0), np.where(both, t, 0), tol)
    assert n_over > 0  # the premise: the scale of this test reaches float16's limit


@needs_hopper
def test_fused_float16_needs_its_dq_factors(monkeypatch):
    """The premise of the fused kernel's per-query dQ factors: with them all 1, dQ's cast of dS
    overflows on the operands above and dq is no longer finite (dk and dv keep their own
    per-key scaling and stay finite)."""
    monkeypatch.setattr(fused_backward, "dq_cast_scales",
                        lambda v, do, delta, group: jnp.ones(delta.shape, jnp.float32))
    spec, args = _f16_overflow_case()
    dq, dk, dv = mosaic.backward(spec, *args, config=default_backward_config(64))
    assert not np.isfinite(np.asarray(dq, np.float32)).all()
    assert np.isfinite(np.asarray(dv, np.float32)).all()


def test_staged_kernels_carry_their_names():
    # A config without the fused kernel: the two-kernel backward.
    args = backward_args(1, 128, 128, 2, 1, 64, jnp.float16)
    spec = make_spec(128, 128, 64, jnp.float16, causal=True, interpret=False)
    cfg = dataclasses.replace(default_backward_config(64), fused=False)
    names = kernel_names(lambda *a: mosaic.backward(spec, *a, config=cfg), *args)
    assert names == {mosaic.DKDV_KERNEL_NAME, mosaic.DQ_KERNEL_NAME}, names
    assert mosaic.DKDV_KERNEL_NAME == "pallas_flash_mosaic_bwd_dkdv"
    assert mosaic.DQ_KERNEL_NAME == "pallas_flash_mosaic_bwd_dq"


@pytest.mark.parametrize("dtype,options", [
    (jnp.bfloat16, dict(causal=True)),
    (jnp.float16, dict(window=(100, 50), has_segments=True)),
    # With a softcap P^T travels twice (times 1 - t^2 for dS^T, as is for dV).
    (jnp.bfloat16, dict(causal=True, softcap=30.0)),
    (jnp.float16, dict(softcap=30.0)),
], ids=["bf16-causal", "f16-window-segments", "bf16-causal-softcap", "f16-softcap"])
def test_paired_dkdv_lowers_for_sm90(dtype, options):
    seq, d = 1001, 256
    args = backward_args(2, seq, seq, 4, 2, d, dtype)
    spec = make_spec(seq, seq, d, dtype, interpret=False, **options)
    assert PAIRED.dkdv_pairs(d)
    if spec.has_segments:
        ids = jnp.zeros((2, seq), jnp.int32)
        args = args + (ids, ids)
    fn = jax.jit(lambda *a: mosaic.backward(spec, *a, config=PAIRED))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    # Never below head_dim 256, where the warpgroups own their rows.
    assert not PAIRED.dkdv_pairs(128)


@pytest.mark.parametrize("d,dtype,causal,seq,options", [
    (64, jnp.bfloat16, True, 1024, {}),
    (256, jnp.float16, False, 1024, {}),
    # Every option the backward serves at once: softcap, a window, segment ids (with padding
    # lengths folded in) and a length that is neither a multiple of the tiles nor of 8.
    (128, jnp.bfloat16, True, 1001, dict(window=(200, None), softcap=30.0, has_segments=True)),
    (256, jnp.bfloat16, False, 1001, dict(window=(100, 50), softcap=30.0, has_segments=True)),
    # Between the tuned head dims: 48 and 112 on one dK/dV warpgroup's columns, 160 in halves,
    # 144 and 240 in uneven slices (80 + 64, 128 + 112).
    (48, jnp.float16, True, 1001, dict(window=(200, None))),
    (112, jnp.bfloat16, False, 1024, dict(softcap=30.0)),
    (160, jnp.bfloat16, True, 1001, dict(has_segments=True)),
    (144, jnp.bfloat16, True, 1001, {}),
    (240, jnp.float16, False, 1001, dict(softcap=30.0)),
], ids=["causal-d64", "full-d256", "all-options-d128", "all-options-d256", "window-d48-f16",
        "softcap-d112", "segments-d160", "uneven-d144", "uneven-softcap-d240-f16"])
def test_lowers_for_sm90(d, dtype, causal, seq, options):
    """The two kernels at each head_dim's default tiles, the fused kernel turned off where it
    would serve the call."""
    args = backward_args(2, seq, seq, 4, 2, d, dtype)
    spec = make_spec(seq, seq, d, dtype, causal=causal, interpret=False, **options)
    if spec.has_segments:
        ids = jnp.zeros((2, seq), jnp.int32)
        args = args + (ids, ids)
    cfg = dataclasses.replace(default_backward_config(d), fused=False)
    fn = jax.jit(lambda *a: mosaic.backward(spec, *a, config=cfg))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    for name in (mosaic.DKDV_KERNEL_NAME, mosaic.DQ_KERNEL_NAME):
        assert f"{name}_mosaic_gpu" in text, name


@pytest.mark.parametrize("change,match", [
    (dict(dtype=jnp.float32), "dtype"),
    (dict(d=72), "head_dim"),
    (dict(d=120), "head_dim"),
    (dict(hq=3, hkv=2), "multiple of kv_heads"),
    (dict(config=Config(dkdv_stages=4)), "shared memory"),
])
def test_unsupported_raises(change, match):
    shape = dict(b=1, sq=256, skv=256, hq=2, hkv=1, d=64, dtype=jnp.bfloat16)
    if "config" in change:
        shape["d"] = 256
    shape.update({key: val for key, val in change.items() if key in shape})
    args = backward_args(*(shape[name] for name in ("b", "sq", "skv", "hq", "hkv", "d", "dtype")))
    opts = {key: val for key, val in change.items() if key not in shape and key != "config"}
    spec = make_spec(shape["sq"], shape["skv"], shape["d"], shape["dtype"], causal=True, **opts)
    config = change.get("config")
    q, k, v = args[:3]
    assert mosaic.unsupported_reason(spec, q, k, v, config) is not None
    with pytest.raises(NotImplementedError, match=match):
        mosaic.backward(spec, *args, config=config)


@pytest.mark.parametrize("opts", [dict(softcap=30.0), dict(window=(64, 0)),
                                  dict(has_segments=True), dict(sq=200, skv=100)],
                         ids=["softcap", "window", "segments", "partial"])
def test_served_options_have_no_reason(opts):
    opts = dict(opts)
    sq, skv = opts.pop("sq", 256), opts.pop("skv", 256)
    q, k, v = backward_args(1, sq, skv, 2, 1, 64, jnp.bfloat16)[:3]
    spec = make_spec(sq, skv, 64, jnp.bfloat16, causal=True, **opts)
    assert mosaic.unsupported_reason(spec, q, k, v) is None


def test_segment_ids_must_match_the_spec():
    args = backward_args(1, 256, 256, 2, 1, 64, jnp.bfloat16)
    ids = jnp.zeros((1, 256), jnp.int32)
    spec = make_spec(256, 256, 64, jnp.bfloat16, causal=False)
    with pytest.raises(ValueError, match="has_segments"):
        mosaic.backward(spec, *args, ids, ids)
    spec = make_spec(256, 256, 64, jnp.bfloat16, causal=False, has_segments=True)
    with pytest.raises(ValueError, match="has_segments"):
        mosaic.backward(spec, *args)
