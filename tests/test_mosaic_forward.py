"""The draft Mosaic GPU forward (pallas_flash/mosaic/forward.py).

On the CPU it runs in Mosaic GPU interpret mode (shared memory, barriers, TMA and wgmma
simulated; seconds per call, so the shapes are small) and is compared with the reference. On a
GPU it runs compiled (Hopper only). The lowering test runs the Python half of the sm_90 compile
(Pallas lowering, layout inference, dialect lowering) on any machine.
"""

import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_flash as pf
from pallas_flash import stats
from pallas_flash.masking import make_mask_spec
from pallas_flash.spec import AttentionSpec

mosaic = importlib.import_module("pallas_flash.mosaic.forward")

ON_GPU = jax.default_backend() == "gpu"
IS_HOPPER = ON_GPU and str(getattr(jax.devices()[0], "compute_capability", "")) == "9.0"


def _spec(q, k, *, causal, alignment="top_left", window=None, softcap=None, has_segments=False,
          interpret=None):
    return AttentionSpec(
        mask=make_mask_spec(q.shape[1], k.shape[1], causal=causal, causal_alignment=alignment,
                            window=window),
        scale=1.0 / math.sqrt(q.shape[-1]), softcap=softcap, has_segments=has_segments,
        precision=lax.Precision.DEFAULT, config=pf.default_config(q.shape[-1], q.dtype),
        interpret=(not ON_GPU) if interpret is None else interpret)


def _inputs(b, sq, skv, hq, hkv, d, dtype, seed=0):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(kq, (b, sq, hq, d), dtype),
            jax.random.normal(kk, (b, skv, hkv, d), dtype),
            jax.random.normal(kv, (b, skv, hkv, d), dtype))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ok = np.isfinite(b)
    assert np.array_equal(np.isfinite(a), ok)
    return np.linalg.norm(np.where(ok, a - b, 0)) / np.linalg.norm(np.where(ok, b, 0))


CASES = [
    # (b, sq, skv, hq, hkv, d, dtype, causal, alignment, config)
    pytest.param(2, 256, 256, 4, 2, 64, jnp.bfloat16, True, "top_left",
                 mosaic.MosaicForwardConfig(block_kv=64), id="causal-gqa-bf16"),
    pytest.param(1, 256, 256, 2, 1, 64, jnp.float16, False, "top_left",
                 mosaic.MosaicForwardConfig(block_kv=64, stages=3), id="full-mqa-f16-3stages"),
    # seq_q > seq_kv, bottom-right: the first 256 rows see no key (O = 0, lse = -inf), and the
    # first warpgroup of the last CTA drains blocks it does not use.
    pytest.param(1, 512, 256, 2, 2, 64, jnp.bfloat16, True, "bottom_right",
                 mosaic.MosaicForwardConfig(block_kv=64, pingpong=False), id="bottom-right-empty"),
]


@pytest.mark.skipif(ON_GPU and not IS_HOPPER, reason="Mosaic GPU kernel needs sm_90")
@pytest.mark.parametrize("b,sq,skv,hq,hkv,d,dtype,causal,alignment,config", CASES)
def test_matches_reference(b, sq, skv, hq, hkv, d, dtype, causal, alignment, config):
    q, k, v = _inputs(b, sq, skv, hq, hkv, d, dtype)
    spec = _spec(q, k, causal=causal, alignment=alignment)
    out, st = mosaic.forward(spec, q, k, v, config=config)
    ref, ref_lse = pf.reference_attention(q, k, v, causal=causal, causal_alignment=alignment,
                                          return_lse=True)
    tol = 2e-2 if dtype == jnp.bfloat16 else 4e-3
    assert _rel(out.astype(jnp.float32), ref.astype(jnp.float32)) < tol
    lse = stats.to_lse(spec, st)
    assert _rel(lse, ref_lse) < 1e-4
    empty = np.isneginf(np.asarray(ref_lse))
    assert np.all(np.asarray(st.m)[empty] == 0)
    # A row that sees no key: O exactly 0 (the reference's layout is [b, s, h, d], lse [b, h, s]).
    assert np.all(np.asarray(out.astype(jnp.float32)).transpose(0, 2, 1, 3)[empty] == 0)


@pytest.mark.parametrize("d,dtype,causal", [(64, jnp.bfloat16, True), (128, jnp.float16, False),
                                            (256, jnp.bfloat16, True)])
def test_lowers_for_sm90(d, dtype, causal):
    q, k, v = _inputs(2, 1024, 1024, 4, 2, d, dtype)
    spec = _spec(q, k, causal=causal, interpret=False)
    fn = jax.jit(lambda q, k, v: mosaic.forward(spec, q, k, v))
    text = fn.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_staged_kernel_carries_its_name():
    q, k, v = _inputs(1, 128, 128, 1, 1, 64, jnp.bfloat16)
    spec = _spec(q, k, causal=False, interpret=False)
    jaxpr = jax.make_jaxpr(lambda q, k, v: mosaic.forward(spec, q, k, v))(q, k, v)
    assert mosaic.KERNEL_NAME in str(jaxpr)


@pytest.mark.parametrize("change,match", [
    (dict(dtype=jnp.float32), "dtype"),
    (dict(d=96), "head_dim"),
    (dict(sq=200), "seq_q"),
    (dict(skv=200), "seq_kv"),
    (dict(softcap=30.0), "softcap"),
    (dict(window=(64, 0)), "window"),
    (dict(has_segments=True), "segment"),
])
def test_unsupported_raises(change, match):
    shape = dict(b=1, sq=256, skv=256, hq=2, hkv=1, d=64, dtype=jnp.bfloat16)
    shape.update({key: val for key, val in change.items() if key in shape})
    q, k, v = _inputs(shape["b"], shape["sq"], shape["skv"], shape["hq"], shape["hkv"],
                      shape["d"], shape["dtype"])
    opts = {key: val for key, val in change.items() if key not in shape}
    spec = _spec(q, k, causal=True, **opts)
    assert mosaic.unsupported_reason(spec, q, k, v) is not None
    with pytest.raises(NotImplementedError, match=match):
        mosaic.forward(spec, q, k, v)


def test_segment_ids_raise():
    q, k, v = _inputs(1, 256, 256, 2, 1, 64, jnp.bfloat16)
    ids = jnp.zeros((1, 256), jnp.int32)
    with pytest.raises(NotImplementedError, match="segment"):
        mosaic.forward(_spec(q, k, causal=False), q, k, v, ids, ids)
