"""The Mosaic GPU backward (pallas_flash/mosaic/backward.py).

On the CPU both kernels run in Mosaic GPU interpret mode (shared memory, barriers, TMA and wgmma
simulated; seconds per call, so the shapes are small). dq, dk, dv are compared with the vjp of
the float32 reference (random output and lse cotangents) and with the Triton backward fed the
same row statistics (from the Triton forward). On a GPU they run compiled (Hopper only). The
lowering test runs the Python half of the sm_90 compile on any machine, which covers the
compiled-only path (wgmma operands in registers, in-place accumulation, shared-memory limit).
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (TOLERANCE, assert_close, backward_args, kernel_names, mosaic_spec,
                     random_inputs, reference_grads)
from pallas_flash.masking import fold_lengths
from pallas_flash.triton import backward as triton_backward
from pallas_flash.triton import forward as triton_forward

mosaic = importlib.import_module("pallas_flash.mosaic.backward")
Config = mosaic.MosaicBackwardConfig

ON_GPU = jax.default_backend() == "gpu"
IS_HOPPER = ON_GPU and str(getattr(jax.devices()[0], "compute_capability", "")) == "9.0"
needs_hopper = pytest.mark.skipif(ON_GPU and not IS_HOPPER, reason="Mosaic GPU kernel needs sm_90")


def _check(grads, tri, ref, inputs, dtype):
    tol = TOLERANCE[jnp.dtype(dtype)]
    for name, g, t, r, x in zip(("dq", "dk", "dv"), grads, tri, ref, inputs):
        assert g.dtype == x.dtype and g.shape == x.shape, (name, g.dtype, g.shape)
        assert_close(f"{name} vs reference", g, r, tol)
        assert_close(f"{name} vs triton", g, t, tol)


CASES = [
    # (b, sq, skv, hq, hkv, d, dtype, causal, alignment, config)
    # Causal GQA: the second 64-key warpgroup of the first CTA drains q blocks it cannot see;
    # the dQ kernel masks diagonal blocks and drains the rest.
    pytest.param(1, 256, 256, 4, 2, 64, jnp.bfloat16, True, "top_left",
                 Config(dq_block_kv=64), id="causal-gqa-bf16"),
    pytest.param(1, 128, 256, 2, 2, 64, jnp.float16, False, "top_left",
                 Config(dq_block_kv=128, dkdv_stages=3), id="full-f16-3stages"),
    # seq_q > seq_kv, bottom-right: the first 128 query rows see no key (r = -inf: P = 0).
    pytest.param(1, 256, 128, 2, 1, 64, jnp.bfloat16, True, "bottom_right",
                 Config(dq_block_kv=64, dq_compute_wgs=1), id="bottom-right-mqa-1wg"),
    # head_dim 256: the two dK/dV warpgroups split the columns of dK and dV.
    pytest.param(1, 128, 128, 2, 1, 256, jnp.bfloat16, True, "top_left", None,
                 id="causal-d256-bf16"),
]


@needs_hopper
@pytest.mark.parametrize("b,sq,skv,hq,hkv,d,dtype,causal,alignment,config", CASES)
def test_matches_reference_and_triton(b, sq, skv, hq, hkv, d, dtype, causal, alignment, config):
    q, k, v, do = random_inputs(jax.random.PRNGKey(91), b, sq, skv, hq, hkv, d, dtype)
    dlse = jax.random.normal(jax.random.PRNGKey(92), (b, hq, sq), jnp.float32)
    spec = mosaic_spec(sq, skv, d, dtype, causal=causal, alignment=alignment)
    out, stats = triton_forward.forward(spec, q, k, v)
    grads = mosaic.backward(spec, q, k, v, out, stats, do, dlse, config=config)
    tri = triton_backward.backward(spec, q, k, v, out, stats, do, dlse)
    ref = reference_grads(q, k, v, do, dlse, causal=causal, causal_alignment=alignment)
    _check(grads, tri, ref, (q, k, v), dtype)


def _segments(b, sq, skv, n_segments, q_cut, kv_cut):
    """Sorted ids (packed documents, a different split per batch row) and padding lengths."""
    def ids(seq, shift):
        pos = jnp.arange(seq)[None, :] + jnp.arange(b)[:, None] * shift
        return jnp.minimum(pos * n_segments // seq, n_segments - 1).astype(jnp.int32)

    q_lengths = jnp.asarray([sq - q_cut * (i + 1) for i in range(b)], jnp.int32)
    kv_lengths = jnp.asarray([skv - kv_cut * (i + 1) for i in range(b)], jnp.int32)
    return dict(q_segment_ids=ids(sq, 17), kv_segment_ids=ids(skv, 23), q_lengths=q_lengths,
                kv_lengths=kv_lengths)


VARIANTS = [
    # (b, sq, skv, hq, hkv, d, dtype, options, config)
    # (1) softcap: P from tanh logit units, dS times (1 - t^2); causal GQA, drains included.
    # Small softcaps: the scaled logits here are ~N(0, 1), so t^2 is large enough (~0.2) that
    # a missing chain-rule factor shows far above the bfloat16 tolerance.
    pytest.param(1, 256, 256, 4, 2, 64, jnp.bfloat16, dict(causal=True, softcap=2.0),
                 Config(dq_block_kv=64), id="softcap-causal-gqa"),
    # (2) sliding window: a left bound that cuts blocks (masked leading and trailing edges,
    # blocks skipped on both sides of each warpgroup's range) ...
    pytest.param(1, 256, 256, 2, 1, 64, jnp.bfloat16, dict(causal=True, window=(70, 0)),
                 Config(dq_block_kv=64), id="window-causal"),
    # ... and a two-sided window with softcap at head_dim 256 (column-split dK/dV), with
    # partial tiles (136 % 64, 100 % 64) and a length not a multiple of 8 padded.
    pytest.param(1, 136, 100, 2, 1, 256, jnp.bfloat16, dict(window=(30, 20), softcap=2.5),
                 None, id="window-softcap-d256-partial"),
    # (3) partial tiles: seq_q 100 (padded to 104), seq_kv 150 (a 22-key last block),
    # bottom-right, so the first queries see nothing.
    pytest.param(1, 100, 150, 2, 1, 64, jnp.float16,
                 dict(causal=True, causal_alignment="bottom_right"), None, id="partial-f16"),
    # Shorter than one tile: the second dQ warpgroup and the second 64-key dK/dV warpgroup lie
    # wholly past the end.
    pytest.param(1, 40, 50, 2, 1, 64, jnp.bfloat16,
                 dict(causal=True, causal_alignment="bottom_right"), None, id="partial-tiny"),
    # (4) segment ids and padding lengths, with a window, softcap, one dQ warpgroup, 3 stages.
    pytest.param(2, 200, 180, 2, 2, 128, jnp.float16,
                 dict(causal=True, window=(50, None), softcap=3.0, segments=(3, 7, 20)),
                 Config(dq_compute_wgs=1, dkdv_stages=3), id="segments-window-softcap"),
    pytest.param(1, 256, 192, 2, 1, 64, jnp.bfloat16, dict(segments=(4, 30, 50)),
                 Config(dq_block_kv=64), id="segments-lengths-full"),
]


def _variant_matches(b, sq, skv, hq, hkv, d, dtype, options, config, *, seed, check_spec):
    """Gradients of a variant (options as flash_attention takes them, `segments` as
    `_segments` args) against the reference and the Triton backward; check_spec(spec, q, k, v)
    asserts what the case is meant to exercise."""
    options = dict(options)
    q, k, v, do = random_inputs(jax.random.PRNGKey(seed), b, sq, skv, hq, hkv, d, dtype)
    dlse = jax.random.normal(jax.random.PRNGKey(seed + 1), (b, hq, sq), jnp.float32)
    segments = options.pop("segments", None)
    q_ids = kv_ids = None
    if segments is not None:
        seg_kwargs = _segments(b, sq, skv, *segments)
        options.update(seg_kwargs)
        q_ids, kv_ids = fold_lengths(**seg_kwargs, batch=b, seq_q=sq, seq_kv=skv)
    spec = mosaic_spec(sq, skv, d, dtype, causal=options.get("causal", False),
                       alignment=options.get("causal_alignment", "top_left"),
                       window=options.get("window"), softcap=options.get("softcap"),
                       has_segments=segments is not None)
    check_spec(spec, q, k, v)
    out, stats = triton_forward.forward(spec, q, k, v, q_ids, kv_ids)
    grads = mosaic.backward(spec, q, k, v, out, stats, do, dlse, q_ids, kv_ids, config=config)
    tri = triton_backward.backward(spec, q, k, v, out, stats, do, dlse, q_ids, kv_ids)
    ref = reference_grads(q, k, v, do, dlse, **options)
    _check(grads, tri, ref, (q, k, v), dtype)


@needs_hopper
@pytest.mark.parametrize("b,sq,skv,hq,hkv,d,dtype,options,config", VARIANTS)
def test_variants_match_reference_and_triton(b, sq, skv, hq, hkv, d, dtype, options, config):
    def served(spec, q, k, v):
        assert mosaic.unsupported_reason(spec, q, k, v, config) is None

    _variant_matches(b, sq, skv, hq, hkv, d, dtype, options, config, seed=97,
                     check_spec=served)


@needs_hopper
def test_float16_ds_does_not_overflow():
    # v at the top of float16's range and a unit cotangent: |dP| = |dO . v| reaches ~1e5-1e6, so
    # dS cast to float16 unscaled would be inf and would spread inf / NaN over whole rows of dq
    # and dk. Some exact gradients do exceed 65504 themselves; the check covers the ones that
    # fit (with a margin): finite there, and equal to the reference at the float16 tolerance.
    b, s, h, d = 1, 128, 1, 64
    f16_max = 65504.0
    q, k, _, do = random_inputs(jax.random.PRNGKey(93), b, s, s, h, h, d, jnp.float16)
    k1, k2 = jax.random.split(jax.random.PRNGKey(95))
    steps = jax.random.randint(k1, k.shape, 0, 15)
    sign = jnp.where(jax.random.bernoulli(k2, 0.5, k.shape), 1.0, -1.0)
    v = (sign * (f16_max - 32.0 * steps)).astype(jnp.float16)
    dlse = jax.random.normal(jax.random.PRNGKey(96), (b, h, s), jnp.float32)
    spec = mosaic_spec(s, s, d, jnp.float16, causal=True)
    out, stats = triton_forward.forward(spec, q, k, v)
    grads = mosaic.backward(spec, q, k, v, out, stats, do, dlse)
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


def test_staged_kernels_carry_their_names():
    # float16: the two-kernel backward (bfloat16 at head_dim 64 and 128 runs the fused kernel).
    args = backward_args(1, 128, 128, 2, 1, 64, jnp.float16)
    spec = mosaic_spec(128, 128, 64, jnp.float16, causal=True, interpret=False)
    names = kernel_names(lambda *a: mosaic.backward(spec, *a), *args)
    assert names == {mosaic.DKDV_KERNEL_NAME, mosaic.DQ_KERNEL_NAME}, names
    assert mosaic.DKDV_KERNEL_NAME == "pallas_flash_mosaic_bwd_dkdv"
    assert mosaic.DQ_KERNEL_NAME == "pallas_flash_mosaic_bwd_dq"


PAIRED = Config(dkdv_block_q=64, dq_block_kv=64, dq_compute_wgs=1, dkdv_paired=True)


@needs_hopper
@pytest.mark.parametrize("b,sq,skv,hq,hkv,dtype,options", [
    (2, 384, 384, 4, 2, jnp.bfloat16, dict(causal=True)),
    (1, 200, 264, 2, 1, jnp.float16, {}),
    (1, 256, 256, 2, 2, jnp.float16, dict(causal=True, window=(70, 0))),
    (2, 200, 180, 2, 1, jnp.bfloat16, dict(window=(50, 20), segments=(3, 7, 20))),
], ids=["causal-gqa-bf16", "partial-f16", "window-f16", "segments-window-bf16"])
def test_paired_dkdv_matches_reference_and_triton(b, sq, skv, hq, hkv, dtype, options):
    """Head_dim 256 with the dK/dV warpgroups paired (one forms P^T, the other dS^T)."""
    def pairs(spec, *_):
        assert PAIRED.dkdv_pairs(spec, 256)

    _variant_matches(b, sq, skv, hq, hkv, 256, dtype, options, PAIRED, seed=71,
                     check_spec=pairs)


@pytest.mark.parametrize("dtype,options", [
    (jnp.bfloat16, dict(causal=True)),
    (jnp.float16, dict(window=(100, 50), has_segments=True)),
])
def test_paired_dkdv_lowers_for_sm90(dtype, options):
    seq, d = 1001, 256
    args = backward_args(2, seq, seq, 4, 2, d, dtype)
    spec = mosaic_spec(seq, seq, d, dtype, interpret=False, **options)
    assert PAIRED.dkdv_pairs(spec, d)
    if spec.has_segments:
        ids = jnp.zeros((2, seq), jnp.int32)
        args = args + (ids, ids)
    fn = jax.jit(lambda *a: mosaic.backward(spec, *a, config=PAIRED))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    # Not with a softcap (the unpaired kernel serves it); in the interpreter too.
    assert not PAIRED.dkdv_pairs(mosaic_spec(seq, seq, d, dtype, interpret=False,
                                             softcap=30.0), d)
    assert PAIRED.dkdv_pairs(mosaic_spec(seq, seq, d, dtype, interpret=True), d)


@pytest.mark.parametrize("d,dtype,causal,seq,options", [
    (64, jnp.bfloat16, True, 1024, {}),
    (256, jnp.float16, False, 1024, {}),
    # Every option the backward serves at once: softcap, a window, segment ids (with padding
    # lengths folded in) and a length that is neither a multiple of the tiles nor of 8.
    (128, jnp.bfloat16, True, 1001, dict(window=(200, None), softcap=30.0, has_segments=True)),
    (256, jnp.bfloat16, False, 1001, dict(window=(100, 50), softcap=30.0, has_segments=True)),
], ids=["causal-d64", "full-d256", "all-options-d128", "all-options-d256"])
def test_lowers_for_sm90(d, dtype, causal, seq, options):
    args = backward_args(2, seq, seq, 4, 2, d, dtype)
    spec = mosaic_spec(seq, seq, d, dtype, causal=causal, interpret=False, **options)
    if spec.has_segments:
        ids = jnp.zeros((2, seq), jnp.int32)
        args = args + (ids, ids)
    fn = jax.jit(lambda *a: mosaic.backward(spec, *a))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("change,match", [
    (dict(dtype=jnp.float32), "dtype"),
    (dict(d=96), "head_dim"),
    (dict(hq=3, hkv=2), "multiple of kv_heads"),
    (dict(config=Config(dkdv_stages=4)), "shared memory"),
])
def test_unsupported_raises(change, match):
    shape = dict(b=1, sq=256, skv=256, hq=2, hkv=1, d=64, dtype=jnp.bfloat16)
    if "config" in change:
        shape["d"] = 256
    shape.update({key: val for key, val in change.items() if key in shape})
    args = backward_args(shape["b"], shape["sq"], shape["skv"], shape["hq"], shape["hkv"], shape["d"],
                  shape["dtype"])
    opts = {key: val for key, val in change.items() if key not in shape and key != "config"}
    spec = mosaic_spec(shape["sq"], shape["skv"], shape["d"], shape["dtype"], causal=True, **opts)
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
    spec = mosaic_spec(sq, skv, 64, jnp.bfloat16, causal=True, **opts)
    assert mosaic.unsupported_reason(spec, q, k, v) is None


def test_segment_ids_must_match_the_spec():
    args = backward_args(1, 256, 256, 2, 1, 64, jnp.bfloat16)
    ids = jnp.zeros((1, 256), jnp.int32)
    spec = mosaic_spec(256, 256, 64, jnp.bfloat16, causal=False)
    with pytest.raises(ValueError, match="has_segments"):
        mosaic.backward(spec, *args, ids, ids)
    spec = mosaic_spec(256, 256, 64, jnp.bfloat16, causal=False, has_segments=True)
    with pytest.raises(ValueError, match="has_segments"):
        mosaic.backward(spec, *args)


def test_config_validation():
    with pytest.raises(ValueError, match="dq_block_kv"):
        Config(dq_block_kv=96)
    with pytest.raises(ValueError, match="stages"):
        Config(dq_stages=1)
    with pytest.raises(ValueError, match="dq_compute_wgs"):
        Config(dq_compute_wgs=3)
    for d in (64, 128, 256):
        cfg = mosaic.default_backward_config(d)
        assert cfg.dkdv_smem_bytes(d) <= mosaic.SMEM_LIMIT
        assert cfg.dq_smem_bytes(d) <= mosaic.SMEM_LIMIT


# config.head_chunk: the two kernels' launch order (common.TileGrid). The causal CASES above
# run the default's sections (every kv head at these sizes), the non-causal ones one head a
# section; here explicit chunks of batch-2 GQA calls, causal and not.
@needs_hopper
@pytest.mark.parametrize("chunk,causal", [(1, True), (2, True), (2, False)])
def test_launch_order_matches_reference_and_triton(chunk, causal):
    b, sq, skv, hq, hkv, d, dtype = 2, 200, 136, 4, 2, 64, jnp.bfloat16
    q, k, v, do = random_inputs(jax.random.PRNGKey(95), b, sq, skv, hq, hkv, d, dtype)
    dlse = jax.random.normal(jax.random.PRNGKey(96), (b, hq, sq), jnp.float32)
    spec = mosaic_spec(sq, skv, d, dtype, causal=causal, alignment="bottom_right")
    config = Config(dq_block_kv=64, head_chunk=chunk)
    out, stats = triton_forward.forward(spec, q, k, v)
    grads = mosaic.backward(spec, q, k, v, out, stats, do, dlse, config=config)
    tri = triton_backward.backward(spec, q, k, v, out, stats, do, dlse)
    ref = reference_grads(q, k, v, do, dlse, causal=causal, causal_alignment="bottom_right")
    _check(grads, tri, ref, (q, k, v), dtype)


def test_launch_orders():
    q = jnp.zeros((2, 8192, 8, 256), jnp.bfloat16)
    k = jnp.zeros((2, 8192, 4, 256), jnp.bfloat16)
    for causal, chunks in ((True, (2, 8)), (False, (1, 1))):
        spec = mosaic_spec(8192, 8192, 256, jnp.bfloat16, causal=causal)
        dkdv, dq = mosaic._launch_orders(spec, Config(), q, k, 128, 64)
        # dK/dV streams the group's Q and dO (2 x 8 MB a kv head): two kv heads a section;
        # dQ streams K and V (8 MB a kv head): four kv heads, their eight q heads.
        assert (dkdv.head_chunk, dq.head_chunk) == chunks
    spec = mosaic_spec(8192, 8192, 256, jnp.bfloat16, causal=True)
    assert [o.head_chunk for o in mosaic._launch_orders(spec, Config(head_chunk=1), q, k,
                                                        128, 64)] == [1, 1]
    with pytest.raises(ValueError, match=r"head_chunk \(3\) must divide the number of kv"):
        mosaic._launch_orders(spec, Config(head_chunk=3), q, k, 128, 64)
    with pytest.raises(ValueError, match=r"MosaicBackwardConfig\.head_chunk must be"):
        Config(head_chunk=0)
