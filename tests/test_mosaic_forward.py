"""The Mosaic GPU forward (pallas_flash/mosaic/forward.py) beyond the feature matrix.

test_features.py compares the kernel with the reference at every option and config variant.
Here: the Python half of the sm_90 compile (Pallas lowering, layout inference, dialect
lowering), which runs on any machine and so covers the compiled-only tiles on the CPU; what the
kernel refuses; its name in the jaxpr; and the fused exponent at large logits.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from backends import IS_HOPPER, KEY176, ON_GPU, THREE_WGS
from helpers import TOLERANCE, assert_close, make_spec, random_inputs, relative_error
from pallas_flash import stats
from pallas_flash.mosaic import forward as mosaic
from pallas_flash.mosaic.config import MosaicForwardConfig, default_forward_config

C = MosaicForwardConfig


def _inputs(b, sq, skv, hq, hkv, d, dtype, seed=0):
    return random_inputs(jax.random.PRNGKey(seed), b, sq, skv, hq, hkv, d, dtype)[:3]


def _sorted_ids(seed, batch, seq, n_segments):
    rng = np.random.RandomState(seed)
    return jnp.asarray(np.sort(rng.randint(0, n_segments, (batch, seq)), axis=1), jnp.int32)


def _lowers(spec, cfg, q, k, v, *ids):
    fn = jax.jit(lambda q, k, v, *ids: mosaic.forward(spec, q, k, v, *ids, config=cfg))
    text = fn.trace(q, k, v, *ids).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("d,dtype,causal,overlap", [
    (64, jnp.bfloat16, True, False), (128, jnp.float16, False, False),
    (256, jnp.bfloat16, True, False), (128, jnp.bfloat16, True, True),
    (64, jnp.float16, False, True), (96, jnp.bfloat16, True, True),
    (192, jnp.float16, False, True)])
def test_lowers_for_sm90(d, dtype, causal, overlap):
    q, k, v = _inputs(2, 1024, 1024, 4, 2, d, dtype)
    spec = make_spec(1024, 1024, d, dtype, causal=causal, interpret=False)
    cfg = dataclasses.replace(default_forward_config(d), overlap=overlap)
    if overlap:  # two P tiles in registers: the smaller key block at head_dim 64
        cfg = dataclasses.replace(cfg, block_kv=min(cfg.block_kv, 128))
    _lowers(spec, cfg, q, k, v)


@pytest.mark.parametrize("d,causal,fields", [
    (128, True, {}), (64, False, dict(overlap=True, block_kv=128, ctas=3)),
    (256, True, dict(pingpong=False)), (128, False, dict(q_prefetch=True))])
def test_persistent_lowers_for_sm90(d, causal, fields):
    """The persistent grid (items looped per CTA, the plan read from global memory)."""
    q, k, v = _inputs(2, 1024, 1024, 4, 2, d, jnp.bfloat16)
    spec = make_spec(1024, 1024, d, jnp.bfloat16, causal=causal, interpret=False)
    cfg = dataclasses.replace(default_forward_config(d), persistent=True, cluster=1, **fields)
    _lowers(spec, cfg, q, k, v)


@pytest.mark.parametrize("sq,skv,opts", [
    (200, 136, dict(causal=True, window=(64, None), softcap=30.0)),
    (100, 300, dict(causal=True, causal_alignment="bottom_right", has_segments=True)),
])
def test_features_lower_for_sm90(sq, skv, opts):
    q, k, v = _inputs(2, sq, skv, 4, 2, 128, jnp.bfloat16)
    spec = make_spec(sq, skv, 128, jnp.bfloat16, interpret=False, **opts)
    ids = ()
    if spec.has_segments:
        ids = (_sorted_ids(3, 2, sq, 4), _sorted_ids(4, 2, skv, 4))
    _lowers(spec, None, q, k, v, *ids)


@pytest.mark.parametrize("d,block_kv,causal,cluster,overlap,has_segments", [
    (64, 128, True, 1, False, False),
    (64, 192, False, 2, False, False),
    (128, 64, True, 1, True, True),
])
def test_three_wgs_lower_for_sm90(d, block_kv, causal, cluster, overlap, has_segments):
    sq = skv = 1000    # 6 tiles of 192 rows, the last partial (3 clusters of 2)
    q, k, v = _inputs(2, sq, skv, 4, 2, d, jnp.bfloat16)
    spec = make_spec(sq, skv, d, jnp.bfloat16, causal=causal, has_segments=has_segments,
                     interpret=False)
    cfg = C(block_kv=block_kv, overlap=overlap, cluster=cluster, **THREE_WGS)
    ids = (_sorted_ids(3, 2, sq, 4), _sorted_ids(4, 2, skv, 4)) if has_segments else ()
    _lowers(spec, cfg, q, k, v, *ids)


@pytest.mark.parametrize("d,causal,has_segments,cluster,sq", [
    (128, True, True, 2, 1000),     # 8 tiles of 128 rows: 4 clusters of 2, 2 of 4
    (64, False, False, 2, 1000),
    (128, True, True, 4, 1000),
    (64, False, False, 4, 1000),
    (128, False, False, 4, 600),    # 5 tiles: 3 empty ones pad the second cluster
    (256, True, False, 4, 300),     # block_kv 64: 16-row multicast slices; 1 empty tile
    (64, True, True, 4, 600),
])
def test_cluster_lowers_for_sm90(d, causal, has_segments, cluster, sq):
    skv = sq
    q, k, v = _inputs(2, sq, skv, 4, 2, d, jnp.bfloat16)
    spec = make_spec(sq, skv, d, jnp.bfloat16, causal=causal, has_segments=has_segments,
                     interpret=False)
    cfg = dataclasses.replace(default_forward_config(d), cluster=cluster)
    ids = (_sorted_ids(3, 2, sq, 4), _sorted_ids(4, 2, skv, 4)) if has_segments else ()
    _lowers(spec, cfg, q, k, v, *ids)
    # Not in the interpreter: refused up front, with the reason.
    interp = make_spec(sq, skv, d, jnp.bfloat16, causal=causal, interpret=True)
    assert "cluster" in mosaic.unsupported_reason(interp, q, k, v, cfg)


@pytest.mark.parametrize("d,block_kv,causal,cluster", [
    (128, 176, False, 2), (128, 176, True, 1), (128, 160, False, 4), (64, 144, True, 1)])
def test_key_blocks_of_16_lower_for_sm90(d, block_kv, causal, cluster):
    sq = skv = 1000
    q, k, v = _inputs(2, sq, skv, 4, 2, d, jnp.bfloat16)
    spec = make_spec(sq, skv, d, jnp.bfloat16, causal=causal, interpret=False)
    _lowers(spec, C(**{**KEY176, "block_kv": block_kv, "cluster": cluster}), q, k, v)


def test_staged_kernel_carries_its_name():
    q, k, v = _inputs(1, 128, 128, 1, 1, 64, jnp.bfloat16)
    spec = make_spec(128, 128, 64, jnp.bfloat16, interpret=False)
    jaxpr = jax.make_jaxpr(lambda q, k, v: mosaic.forward(spec, q, k, v))(q, k, v)
    assert mosaic.KERNEL_NAME in str(jaxpr)


@pytest.mark.parametrize("change,match", [
    (dict(dtype=jnp.float32), "dtype"),
    (dict(d=72), "head_dim"),
    (dict(d=120), "head_dim"),
    (dict(hq=3, hkv=2), "multiple of kv_heads"),
])
def test_unsupported_raises(change, match):
    shape = dict(b=1, sq=256, skv=256, hq=2, hkv=1, d=64, dtype=jnp.bfloat16)
    shape.update(change)
    q, k, v = _inputs(*shape.values())
    spec = make_spec(256, 256, shape["d"], shape["dtype"], causal=True)
    assert mosaic.unsupported_reason(spec, q, k, v) is not None
    with pytest.raises(NotImplementedError, match=match):
        mosaic.forward(spec, q, k, v)


def test_segment_ids_must_match_the_spec():
    q, k, v = _inputs(1, 256, 256, 2, 1, 64, jnp.bfloat16)
    ids = jnp.zeros((1, 256), jnp.int32)
    with pytest.raises(ValueError, match="has_segments"):
        mosaic.forward(make_spec(256, 256, 64, jnp.bfloat16), q, k, v, ids, ids)


# config.fused_exponent (the default) forms each exponent as one multiply-add, u c - (m c); its
# rounding of m c is largest at large logits: q scaled by 30 gives logits of several hundred.
@pytest.mark.skipif(ON_GPU and not IS_HOPPER, reason="Mosaic GPU kernel needs sm_90")
@pytest.mark.parametrize("causal", [False, True])
def test_fused_exponent_with_large_logits(causal):
    q, k, v = _inputs(1, 200, 260, 2, 1, 128, jnp.bfloat16, seed=7)
    q = (q.astype(jnp.float32) * 30.0).astype(q.dtype)
    spec = make_spec(200, 260, 128, jnp.bfloat16, causal=causal)
    cfg = default_forward_config(128, spec)
    assert cfg.fused_exponent
    out, row_stats = mosaic.forward(spec, q, k, v, config=cfg)
    ref, ref_lse = pf.reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                          causal=causal, return_lse=True)
    assert np.abs(np.asarray(row_stats.m)).max() > 100     # the regime this is about
    assert_close("O", out.astype(jnp.float32), ref, TOLERANCE[jnp.dtype(q.dtype)])
    assert relative_error(stats.to_lse(spec, row_stats), ref_lse) < 1e-4


# guarded.py decides from r whether the Triton forward must redo a call, so every row whose O
# holds an inf or NaN must leave with r = NaN, and no other row may.
@pytest.mark.skipif(ON_GPU and not IS_HOPPER, reason="Mosaic GPU kernel needs sm_90")
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_rows_with_a_non_finite_output_leave_r_nan(bad):
    q, k, v = _inputs(1, 192, 192, 2, 1, 128, jnp.bfloat16, seed=11)
    spec = make_spec(192, 192, 128, jnp.bfloat16, causal=True)
    cfg = default_forward_config(128, spec)
    out, row_stats = mosaic.forward(spec, q, k, v, config=cfg)
    assert not np.isnan(np.asarray(row_stats.r)).any()
    # Key 180 is seen by rows 180 and later only; rows before it may meet it as 0 * bad where
    # they visit its block, and the first rows' tiles stop short of it.
    out, row_stats = mosaic.forward(spec, q, k, v.at[0, 180, 0, 5].set(bad), config=cfg)
    bad_rows = ~np.isfinite(np.asarray(out, np.float32)).all(axis=-1).transpose(0, 2, 1)
    np.testing.assert_array_equal(np.isnan(np.asarray(row_stats.r)), bad_rows)
    assert bad_rows[:, :, 180:].all()   # the rows that see key 180
    # The rows that keep a finite O do not see key 180: they match the clean V's reference.
    ref = pf.reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)), causal=True)
    keep = ~bad_rows.transpose(0, 2, 1)[..., None]
    assert keep.any()
    assert_close("O", np.where(keep, np.asarray(out, np.float32), 0.0),
                 np.where(keep, np.asarray(ref), 0.0), TOLERANCE[jnp.dtype(q.dtype)])


def _softcap_tanh_in_a_kernel(x):
    """common.softcap_tanh applied inside a Mosaic GPU kernel compiled as the attention kernels
    are (approx_math), so that on the GPU it is the hardware's approximation; interpreted on
    the CPU. x: float32 [192, 128] (in and out fit shared memory)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_flash.mosaic.common import interpret_params, softcap_tanh

    def kernel(x_gmem, o_gmem, x_smem, o_smem, loaded):
        plgpu.copy_gmem_to_smem(x_gmem, x_smem, loaded)
        plgpu.barrier_wait(loaded)
        o_smem[...] = softcap_tanh(x_smem[...])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem)
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct(x.shape, jnp.float32),
        scratch_types=[plgpu.SMEM(x.shape, jnp.float32), plgpu.SMEM(x.shape, jnp.float32),
                       plgpu.Barrier(num_arrivals=1)],
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params(not ON_GPU, 1), kernel_name="pallas_flash_test_softcap_tanh",
    )(x)


def test_softcap_tanh_accuracy():
    """The softcap's tanh as the kernels compute it, against float64 tanh over the logit range
    a softcap sees, its saturated ends included: within the PTX ISA's bound for tanh.approx.f32
    (2^-10.987 relative) on the GPU, float32-exact interpreted; odd-symmetric, in [-1, 1], and
    NaN carried through."""
    n = 4 * 192 * 128
    x = np.linspace(-30.0, 30.0, n - 6, dtype=np.float32)
    x = np.concatenate([x, np.float32([-1e4, -90.0, 0.0, 90.0, 1e4, np.nan])])
    got = np.concatenate([
        np.asarray(_softcap_tanh_in_a_kernel(jnp.asarray(chunk).reshape(192, 128)),
                   np.float64).reshape(-1) for chunk in x.reshape(4, -1)])
    want = np.tanh(x.astype(np.float64))
    bound = 2.0 ** -10.987 if ON_GPU else 1e-6
    finite = ~np.isnan(x)
    assert np.all(np.abs(got - want)[finite] <= bound * np.abs(want[finite]) + 1e-7)
    assert np.all(np.abs(got[finite]) <= 1.0)
    k = n - 6   # x[:k] is symmetric about 0
    assert np.max(np.abs(got[:k] + got[:k][::-1])) <= (bound if ON_GPU else 1e-6)
    assert np.isnan(got[-1])
