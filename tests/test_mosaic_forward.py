"""The Mosaic GPU forward (pallas_flash/mosaic/forward.py).

On the CPU it runs in Mosaic GPU interpret mode (shared memory, barriers, TMA and wgmma
simulated; seconds per call, so the shapes are small) and is compared with the reference. On a
GPU it runs compiled (Hopper only). The lowering test runs the Python half of the sm_90 compile
(Pallas lowering, layout inference, dialect lowering) on any machine.
"""

import dataclasses
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_flash as pf
from pallas_flash import stats
from pallas_flash.masking import fold_lengths, make_mask_spec
from pallas_flash.spec import AttentionSpec
from pallas_flash.triton import forward as triton_forward

from helpers import TOLERANCE, assert_close

mosaic = importlib.import_module("pallas_flash.mosaic.forward")
common = importlib.import_module("pallas_flash.mosaic.common")

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
    # The lagged P V (cfg.overlap), with and without ping-pong.
    pytest.param(2, 256, 256, 4, 2, 64, jnp.bfloat16, True, "top_left",
                 mosaic.MosaicForwardConfig(block_kv=64, overlap=True), id="causal-gqa-overlap"),
    pytest.param(1, 512, 256, 2, 2, 64, jnp.float16, True, "bottom_right",
                 mosaic.MosaicForwardConfig(block_kv=64, pingpong=False, overlap=True),
                 id="bottom-right-empty-overlap"),
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


@pytest.mark.parametrize("d,dtype,causal,overlap", [
    (64, jnp.bfloat16, True, False), (128, jnp.float16, False, False),
    (256, jnp.bfloat16, True, False), (128, jnp.bfloat16, True, True), (64, jnp.float16, False, True)])
def test_lowers_for_sm90(d, dtype, causal, overlap):
    q, k, v = _inputs(2, 1024, 1024, 4, 2, d, dtype)
    spec = _spec(q, k, causal=causal, interpret=False)
    cfg = dataclasses.replace(mosaic.default_forward_config(d), overlap=overlap)
    if overlap:  # two P tiles in registers: the smaller key block at head_dim 64
        cfg = dataclasses.replace(cfg, block_kv=min(cfg.block_kv, 128))
    fn = jax.jit(lambda q, k, v: mosaic.forward(spec, q, k, v, config=cfg))
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
    (dict(hq=3, hkv=2), "multiple of kv_heads"),
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


def test_segment_ids_must_match_the_spec():
    q, k, v = _inputs(1, 256, 256, 2, 1, 64, jnp.bfloat16)
    ids = jnp.zeros((1, 256), jnp.int32)
    with pytest.raises(ValueError, match="has_segments"):
        mosaic.forward(_spec(q, k, causal=False), q, k, v, ids, ids)


def _sorted_ids(seed, batch, seq, n_segments):
    rng = np.random.RandomState(seed)
    return jnp.asarray(np.sort(rng.randint(0, n_segments, (batch, seq)), axis=1), jnp.int32)


C = mosaic.MosaicForwardConfig
FEATURE_CASES = [
    # (b, sq, skv, hq, hkv, d, dtype, config, options for the spec and the reference)
    pytest.param(1, 128, 128, 2, 1, 64, jnp.bfloat16, C(block_kv=64),
                 dict(causal=False, softcap=5.0), id="softcap-full-mqa"),
    # Narrow band: the two warpgroups' key ranges are disjoint (each drains the other's).
    pytest.param(1, 384, 384, 1, 1, 64, jnp.bfloat16, C(block_kv=64),
                 dict(causal=False, window=(32, 32)), id="window-band"),
    pytest.param(1, 256, 256, 2, 2, 64, jnp.float16, C(block_kv=64, stages=3),
                 dict(causal=True, window=(70, None), softcap=20.0), id="window-causal-softcap"),
    # Partial last query tile (200 = 128 + 72: the second warpgroup of tile 1 holds 8 rows)
    # and partial last key block (136 = 2 * 64 + 8), both multiples of 8: no padding copy.
    pytest.param(1, 200, 136, 2, 1, 64, jnp.float16, C(block_kv=64),
                 dict(causal=False), id="partial-tiles"),
    # Lengths not multiples of 8 (zero-padded in XLA), window and softcap, bottom-right.
    pytest.param(1, 100, 100, 1, 1, 64, jnp.bfloat16, C(block_kv=64, pingpong=False),
                 dict(causal=True, alignment="bottom_right", window=(30, 10), softcap=20.0),
                 id="odd-lengths-window"),
    # 40 query rows (the second warpgroup is wholly past the end), 300 keys (block 3 partial),
    # seq_q < seq_kv bottom-right with a left bound: the tile starts at key block 1.
    pytest.param(1, 40, 300, 1, 1, 64, jnp.bfloat16, C(block_kv=128),
                 dict(causal=True, alignment="bottom_right", window=(100, None)), id="short-q"),
    # seq_q > seq_kv bottom-right, 20 keys: most rows see nothing (O = 0, lse = -inf).
    pytest.param(1, 136, 20, 2, 1, 64, jnp.float16, C(block_kv=64),
                 dict(causal=True, alignment="bottom_right", softcap=10.0), id="short-kv-empty"),
    # Segment ids and padding lengths (folded), partial tiles, causal bottom-right.
    pytest.param(2, 200, 264, 2, 1, 64, jnp.bfloat16, C(block_kv=64),
                 dict(causal=True, alignment="bottom_right", segments=True), id="segments-lengths"),
    # The lagged P V (cfg.overlap) across drains on both sides, one-block ranges and empty rows.
    pytest.param(1, 384, 384, 1, 1, 64, jnp.bfloat16, C(block_kv=64, overlap=True),
                 dict(causal=False, window=(32, 32)), id="window-band-overlap"),
    pytest.param(1, 136, 20, 2, 1, 64, jnp.float16, C(block_kv=64, overlap=True),
                 dict(causal=True, alignment="bottom_right", softcap=10.0),
                 id="short-kv-empty-overlap"),
    pytest.param(2, 200, 264, 2, 1, 64, jnp.bfloat16, C(block_kv=64, stages=3, overlap=True),
                 dict(causal=True, alignment="bottom_right", segments=True),
                 id="segments-lengths-overlap"),
]


@pytest.mark.skipif(ON_GPU and not IS_HOPPER, reason="Mosaic GPU kernel needs sm_90")
@pytest.mark.parametrize("b,sq,skv,hq,hkv,d,dtype,config,opts", FEATURE_CASES)
def test_features_match_reference_and_triton(b, sq, skv, hq, hkv, d, dtype, config, opts):
    opts = dict(opts)
    segments = opts.pop("segments", False)
    q, k, v = _inputs(b, sq, skv, hq, hkv, d, dtype, seed=sq + skv)
    mask_opts = dict(causal=opts["causal"], causal_alignment=opts.get("alignment", "top_left"),
                     window=opts.get("window"), softcap=opts.get("softcap"))
    ids = seg_kwargs = {}
    if segments:
        seg_kwargs = dict(q_segment_ids=_sorted_ids(1, b, sq, 3),
                          kv_segment_ids=_sorted_ids(2, b, skv, 3),
                          q_lengths=jnp.asarray([sq - 20, sq], jnp.int32),
                          kv_lengths=jnp.asarray([skv - 14, skv // 2], jnp.int32))
        q_ids, kv_ids = fold_lengths(*seg_kwargs.values(), batch=b, seq_q=sq, seq_kv=skv)
        ids = dict(q_ids=q_ids, kv_ids=kv_ids)
    spec = _spec(q, k, has_segments=segments, **opts)
    out, st = mosaic.forward(spec, q, k, v, **ids, config=config)
    lse = stats.to_lse(spec, st)
    ref, ref_lse = pf.reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                          **mask_opts, **seg_kwargs, return_lse=True)
    tri, tri_st = triton_forward.forward(spec, q, k, v, **ids)
    tri_lse = stats.to_lse(spec, tri_st)
    tol = TOLERANCE[jnp.dtype(dtype)]
    out32 = out.astype(jnp.float32)
    assert_close("O", out32, ref, tol)
    assert _rel(out32, tri.astype(jnp.float32)) < tol
    assert _rel(lse, ref_lse) < 1e-4
    assert _rel(lse, tri_lse) < 1e-4
    empty = np.isneginf(np.asarray(ref_lse))
    assert np.all(np.asarray(st.m)[empty] == 0)
    assert np.all(np.asarray(out32).transpose(0, 2, 1, 3)[empty] == 0)
    if opts.get("softcap") is not None:
        # m is in logit units, tanh(...): within [-1, 1].
        assert np.all(np.abs(np.asarray(st.m)) <= 1.0)


@pytest.mark.parametrize("sq,skv,opts", [
    (200, 136, dict(causal=True, window=(64, None), softcap=30.0)),
    (100, 300, dict(causal=True, alignment="bottom_right", has_segments=True)),
])
def test_features_lower_for_sm90(sq, skv, opts):
    q, k, v = _inputs(2, sq, skv, 4, 2, 128, jnp.bfloat16)
    spec = _spec(q, k, interpret=False, **opts)
    ids = ()
    if spec.has_segments:
        ids = (_sorted_ids(3, 2, sq, 4), _sorted_ids(4, 2, skv, 4))
    fn = jax.jit(lambda q, k, v, *ids: mosaic.forward(spec, q, k, v, *ids))
    text = fn.trace(q, k, v, *ids).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("fields,match", [
    (dict(block_q=128), "block_q"),
    (dict(block_kv=100), "block_kv"),
    (dict(block_kv=48), "block_kv"),
    (dict(block_kv=272), "block_kv"),
    (dict(block_kv=176, cluster=4), "cluster"),     # 44-row slices: not whole 8-row tiles
    (dict(stages=1), "stages"),
    (dict(cluster=3), "cluster"),
    (dict(cluster=8), "cluster"),
    (dict(cluster=0), "cluster"),
    (dict(compute_wgs=4, pingpong=False, compute_registers=120, copy_registers=24),
     "compute_wgs"),
    (dict(compute_wgs=3, compute_registers=160, copy_registers=32), "compute_wgs"),  # ping-pong
    # 3 * 232 + 40 and 3 * 168 + 32: past the 512 registers per thread of four warpgroups.
    (dict(compute_wgs=3, pingpong=False), "compute_registers"),
    (dict(compute_wgs=3, pingpong=False, compute_registers=168, copy_registers=32),
     "compute_registers"),
    (dict(compute_registers=240, copy_registers=40), "compute_registers"),
    # 2 * 240 + 32 = 512: within the register file, but past the 3 * 168 = 504 per thread a
    # launch of three warpgroups hands out (it hung on the H200).
    (dict(compute_registers=240, copy_registers=32), "compute_registers"),
])
def test_config_validation(fields, match):
    with pytest.raises(ValueError, match=rf"MosaicForwardConfig\.{match} must be"):
        C(**fields)


@pytest.mark.parametrize("block_kv", [64, 128, 160, 192, 256])
def test_config_accepts_cluster_4(block_kv):
    # Multiples of 32 split into 4 multicast slices of whole 8-row tiles (16 rows or more).
    assert C(block_kv=block_kv, cluster=4).cluster == 4


def _with(case, marks=(), **fields):
    """A FEATURE_CASES param with its config's `fields` replaced (same id), under `marks`."""
    return pytest.param(*case.values[:7], dataclasses.replace(case.values[7], **fields),
                        case.values[8], id=case.id, marks=marks)


def _in_clusters(n, cases):
    """FEATURE_CASES-style params with config.cluster = n (same ids)."""
    return [_with(case, cluster=n) for case in cases]


# config.compute_wgs=3: 192 query rows per CTA, FlashAttention-3's head_dim 64 tile. Interpret
# mode is slow on the 2-core CI machine (the suite has a time budget), so a few cases run there
# (a partial last tile, causal, segment ids, GQA, the lagged P V) and the rest compiled only.
THREE_WGS = dict(compute_wgs=3, pingpong=False, compute_registers=160, copy_registers=32)
THREE_WGS_ON_CPU = ("partial-tiles", "window-causal-softcap", "segments-lengths")
COMPILED_ONLY = pytest.mark.skipif(not IS_HOPPER, reason="compiled only (interpret-mode time "
                                   "budget; a few cases of the list run on the CPU)")


def _three_wgs(case):
    return _with(case, marks=() if case.id in THREE_WGS_ON_CPU else COMPILED_ONLY, **THREE_WGS)


@pytest.mark.skipif(ON_GPU and not IS_HOPPER, reason="Mosaic GPU kernel needs sm_90")
@pytest.mark.parametrize("b,sq,skv,hq,hkv,d,dtype,config,opts", [
    _three_wgs(case) for case in FEATURE_CASES] + [
    # GQA, 400 rows (two whole tiles and 16 rows: the last tile's warpgroups 1 and 2 only
    # drain), causal, FlashAttention-3's causal key block.
    pytest.param(1, 400, 400, 4, 2, 64, jnp.bfloat16, C(block_kv=128, **THREE_WGS),
                 dict(causal=True), id="gqa-causal"),
    # GQA, FlashAttention-3's non-causal key block with the lagged P V: 456 keys, the third
    # block partial. This one hung in interpret mode with XLA's CPU pool at 2 threads
    # (tests/conftest.py sets NPROC).
    pytest.param(1, 384, 456, 4, 2, 64, jnp.float16, C(block_kv=192, overlap=True, **THREE_WGS),
                 dict(causal=False), id="gqa-full-overlap"),
])
def test_three_wgs_match_reference_and_triton(b, sq, skv, hq, hkv, d, dtype, config, opts):
    test_features_match_reference_and_triton(b, sq, skv, hq, hkv, d, dtype, config, opts)


@pytest.mark.parametrize("d,block_kv,causal,cluster,overlap,has_segments", [
    (64, 128, True, 1, False, False),
    (64, 192, False, 2, False, False),
    (128, 64, True, 1, True, True),
])
def test_three_wgs_lower_for_sm90(d, block_kv, causal, cluster, overlap, has_segments):
    sq = skv = 1000    # 6 tiles of 192 rows, the last partial (3 clusters of 2)
    q, k, v = _inputs(2, sq, skv, 4, 2, d, jnp.bfloat16)
    spec = _spec(q, k, causal=causal, has_segments=has_segments, interpret=False)
    cfg = C(block_kv=block_kv, overlap=overlap, cluster=cluster, **THREE_WGS)
    ids = (_sorted_ids(3, 2, sq, 4), _sorted_ids(4, 2, skv, 4)) if has_segments else ()
    fn = jax.jit(lambda q, k, v, *ids: mosaic.forward(spec, q, k, v, *ids, config=cfg))
    text = fn.trace(q, k, v, *ids).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_three_wgs_config():
    cfg = C(**THREE_WGS)
    assert cfg.cta_rows == 192 and C().cta_rows == 128
    # One more 64-row Q tile and its statistics in shared memory.
    assert cfg.smem_bytes(64) - C().smem_bytes(64) == 64 * 64 * 2 + 2 * 64 * 4
    # Three by default only for compiled head_dim 64 calls (NOTES.md run 59).
    for d in (64, 128, 256):
        q, k, _ = _inputs(1, 256, 256, 1, 1, d, jnp.bfloat16)
        for causal in (False, True):
            compiled = mosaic.default_forward_config(
                d, _spec(q, k, causal=causal, interpret=False))
            assert compiled.compute_wgs == (3 if d == 64 else 2)
        for spec in (None, _spec(q, k, causal=False, interpret=True)):
            assert mosaic.default_forward_config(d, spec).compute_wgs == 2


# config.cluster=2: two CTAs of adjacent tiles share each K / V block by TMA multicast, each
# streaming the union of their key ranges; odd tile counts pad the grid with a tile past seq_q.
# Compiled only (jax 0.11.2's interpreter does not model the multicast, and hung on the
# lagged-P V cases with cluster barriers); the CPU checks that it lowers for sm_90.
@pytest.mark.skipif(not IS_HOPPER, reason="clusters and TMA multicast run compiled only "
                    "(test_cluster_lowers_for_sm90 covers the CPU)")
@pytest.mark.parametrize("b,sq,skv,hq,hkv,d,dtype,config,opts", _in_clusters(2, FEATURE_CASES) + [
    # 3 tiles of 128 rows (a fourth, empty, pads the last cluster), GQA, causal and not, at
    # the head_dim 128 default tiles.
    pytest.param(2, 300, 300, 4, 2, 128, jnp.bfloat16,
                 dataclasses.replace(mosaic.default_forward_config(128), cluster=2),
                 dict(causal=c), id=f"odd-tiles-gqa-d128-{'causal' if c else 'full'}")
    for c in (True, False)])
def test_cluster_matches_reference_and_triton(b, sq, skv, hq, hkv, d, dtype, config, opts):
    test_features_match_reference_and_triton(b, sq, skv, hq, hkv, d, dtype, config, opts)


# config.cluster=4: the same kernel, each copy warpgroup multicasting a quarter of every block
# (16 rows at block_kv 64), and up to 3 empty tiles padding the last cluster. Compiled only, as
# above; the tile counts 3 and 5 (sq 300 and 600) pad the grid with 1 and 3 empty tiles.
@pytest.mark.skipif(not IS_HOPPER, reason="clusters and TMA multicast run compiled only "
                    "(test_cluster_lowers_for_sm90 covers the CPU)")
@pytest.mark.parametrize("b,sq,skv,hq,hkv,d,dtype,config,opts", _in_clusters(4, FEATURE_CASES) + [
    pytest.param(2, sq, skv, 4, 2, 128, jnp.bfloat16,
                 dataclasses.replace(mosaic.default_forward_config(128), cluster=4),
                 dict(causal=c), id=f"tiles{sq // 128 + 1}-gqa-d128-{'causal' if c else 'full'}")
    for sq, skv in ((300, 300), (600, 520)) for c in (True, False)] + [
    # 5 tiles with segment ids and lengths: the padded tiles' segment ranges are empty.
    pytest.param(2, 600, 600, 2, 1, 64, jnp.float16, C(block_kv=64, overlap=True, cluster=4),
                 dict(causal=True, alignment="bottom_right", segments=True),
                 id="tiles5-segments-overlap"),
    # head_dim 256's block_kv 64: the smallest multicast slices (16 rows).
    pytest.param(1, 600, 600, 2, 2, 256, jnp.bfloat16,
                 dataclasses.replace(mosaic.default_forward_config(256), cluster=4),
                 dict(causal=False, softcap=20.0), id="tiles5-d256-softcap"),
])
def test_cluster4_matches_reference_and_triton(b, sq, skv, hq, hkv, d, dtype, config, opts):
    test_features_match_reference_and_triton(b, sq, skv, hq, hkv, d, dtype, config, opts)


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
    spec = _spec(q, k, causal=causal, has_segments=has_segments, interpret=False)
    cfg = dataclasses.replace(mosaic.default_forward_config(d), cluster=cluster)
    ids = (_sorted_ids(3, 2, sq, 4), _sorted_ids(4, 2, skv, 4)) if has_segments else ()
    fn = jax.jit(lambda q, k, v, *ids: mosaic.forward(spec, q, k, v, *ids, config=cfg))
    text = fn.trace(q, k, v, *ids).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    # Not in the interpreter: refused up front, with the reason.
    interp = _spec(q, k, causal=causal, interpret=True)
    assert "cluster" in mosaic.unsupported_reason(interp, q, k, v, cfg)


@pytest.mark.parametrize("d,causal,has_segments,interpret,expected", [
    (128, False, False, False, 2),
    (128, True, False, False, 1),     # causal: -1 to -2% in clusters (NOTES.md runs 38-39)
    (128, False, True, False, 1),     # segment ids: tiles stream different ranges (untimed)
    (128, False, False, True, 1),     # the interpreter has no clusters
    (64, False, False, False, 1),
    (256, False, False, False, 1),    # -4% in clusters
])
def test_default_cluster(d, causal, has_segments, interpret, expected):
    q, k, _ = _inputs(1, 256, 256, 1, 1, d, jnp.bfloat16)
    spec = _spec(q, k, causal=causal, has_segments=has_segments, interpret=interpret)
    assert mosaic.default_forward_config(d, spec).cluster == expected
    assert mosaic.default_forward_config(d).cluster == 1


# Key blocks that are multiples of 16 but not of 64, e.g. FlashAttention-3's 128 x 176 tile at
# head_dim 128: V's shared memory takes a narrower swizzle (forward._v_transforms) so that the
# P V product's K splits into its groups. Three cases run on the CPU (each key-block size, a
# partial last block, GQA, causal, segment ids), the feature cases and clusters compiled.
KEY176 = dict(block_kv=176, pingpong=False, overlap=True, compute_registers=240,
              copy_registers=24)


@pytest.mark.skipif(ON_GPU and not IS_HOPPER, reason="Mosaic GPU kernel needs sm_90")
@pytest.mark.parametrize("b,sq,skv,hq,hkv,d,dtype,config,opts", [
    # 400 keys = 2 x 176 + 48: a partial last block; GQA.
    pytest.param(1, 300, 400, 4, 2, 128, jnp.bfloat16, C(**KEY176), dict(causal=False),
                 id="d128-176-gqa-partial"),
    pytest.param(1, 200, 200, 2, 1, 128, jnp.float16, C(block_kv=160, pingpong=False,
                                                          overlap=True),
                 dict(causal=True), id="d128-160-causal"),
    pytest.param(2, 200, 264, 2, 1, 64, jnp.bfloat16, C(block_kv=144),
                 dict(causal=True, alignment="bottom_right", segments=True),
                 id="d64-144-segments"),
] + [_with(case, marks=COMPILED_ONLY, block_kv=176) for case in FEATURE_CASES] + [
    pytest.param(2, 300, 300, 4, 2, 128, jnp.bfloat16, C(cluster=2, **KEY176),
                 dict(causal=c), id=f"cluster2-odd-tiles-d128-176-{'causal' if c else 'full'}",
                 marks=COMPILED_ONLY)
    for c in (True, False)])
def test_key_blocks_of_16_match_reference_and_triton(b, sq, skv, hq, hkv, d, dtype, config, opts):
    test_features_match_reference_and_triton(b, sq, skv, hq, hkv, d, dtype, config, opts)


@pytest.mark.parametrize("d,block_kv,causal,cluster", [
    (128, 176, False, 2), (128, 176, True, 1), (128, 160, False, 4), (64, 144, True, 1)])
def test_key_blocks_of_16_lower_for_sm90(d, block_kv, causal, cluster):
    sq = skv = 1000
    q, k, v = _inputs(2, sq, skv, 4, 2, d, jnp.bfloat16)
    spec = _spec(q, k, causal=causal, interpret=False)
    cfg = C(**{**KEY176, "block_kv": block_kv, "cluster": cluster})
    fn = jax.jit(lambda q, k, v: mosaic.forward(spec, q, k, v, config=cfg))
    text = fn.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


# config.fused_exponent (the default): each weight's exponent as one multiply-add, u c - (m c).
# Every other forward test runs it; here the unfused (u - m) c, two cases on the CPU (softcap;
# window, causal and softcap) and all feature cases compiled, and the fused form with large
# logits (q scaled by 30: logits of several hundred), where its rounding of m c is largest.
UNFUSED_EXP_ON_CPU = ("softcap-full-mqa", "window-causal-softcap")


@pytest.mark.skipif(ON_GPU and not IS_HOPPER, reason="Mosaic GPU kernel needs sm_90")
@pytest.mark.parametrize("b,sq,skv,hq,hkv,d,dtype,config,opts", [
    _with(case, marks=() if case.id in UNFUSED_EXP_ON_CPU else COMPILED_ONLY,
          fused_exponent=False)
    for case in FEATURE_CASES])
def test_unfused_exponent_matches_reference_and_triton(b, sq, skv, hq, hkv, d, dtype, config,
                                                       opts):
    test_features_match_reference_and_triton(b, sq, skv, hq, hkv, d, dtype, config, opts)


@pytest.mark.skipif(ON_GPU and not IS_HOPPER, reason="Mosaic GPU kernel needs sm_90")
@pytest.mark.parametrize("causal", [False, True])
def test_fused_exponent_with_large_logits(causal):
    q, k, v = _inputs(1, 200, 260, 2, 1, 128, jnp.bfloat16, seed=7)
    q = (q.astype(jnp.float32) * 30.0).astype(q.dtype)
    spec = _spec(q, k, causal=causal)
    cfg = mosaic.default_forward_config(128, spec)
    assert cfg.fused_exponent
    out, st = mosaic.forward(spec, q, k, v, config=cfg)
    ref, ref_lse = pf.reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                          causal=causal, return_lse=True)
    assert np.abs(np.asarray(st.m)).max() > 100     # the regime this is about
    assert_close("O", out.astype(jnp.float32), ref, TOLERANCE[jnp.dtype(q.dtype)])
    assert _rel(stats.to_lse(spec, st), ref_lse) < 1e-4


def test_register_budget():
    # A launch of three warpgroups gives each thread 168 registers (504 / thread summed), of
    # four 128 (512): setmaxnreg can only redistribute those.
    assert mosaic.register_budget(3) == 504 and mosaic.register_budget(4) == 512
    C(compute_registers=240, copy_registers=24)
    C(compute_wgs=3, pingpong=False, compute_registers=160, copy_registers=32)


# config.head_chunk, the launch order (common.TileGrid): heads interleaved tile by tile. The
# default is 1 without a causal bound and FlashAttention-3's L2 sections with one, which at the
# small sizes of the other tests is every head (their causal GQA cases run the sectioned grid,
# their non-causal ones the tiles-fastest grid); here explicit chunks of 1, 2 and 4 of 4 heads,
# batch 2, partial tiles, causal GQA with segment ids, and the compiled default at a size
# where sections hold fewer heads than the call has.
@pytest.mark.skipif(ON_GPU and not IS_HOPPER, reason="Mosaic GPU kernel needs sm_90")
@pytest.mark.parametrize("b,sq,skv,hq,hkv,d,dtype,config,opts", [
    pytest.param(2, 200, 264, 4, 2, 64, jnp.bfloat16, C(block_kv=64, head_chunk=chunk),
                 dict(causal=True, alignment="bottom_right", segments=True),
                 id=f"segments-gqa-chunk{chunk}")
    for chunk in (1, 2, 4)] + [
    pytest.param(2, 200, 136, 4, 4, 64, jnp.float16, C(block_kv=64, overlap=True, head_chunk=2),
                 dict(causal=False), id="full-chunk2-overlap"),
    pytest.param(1, 200, 200, 4, 1, 128, jnp.bfloat16, C(block_kv=64, overlap=True,
                                                          pingpong=False, head_chunk=4),
                 dict(causal=True, window=(90, None)), id="window-mqa-chunk4")])
def test_launch_order_matches_reference_and_triton(b, sq, skv, hq, hkv, d, dtype, config, opts):
    test_features_match_reference_and_triton(b, sq, skv, hq, hkv, d, dtype, config, opts)


@pytest.mark.skipif(not IS_HOPPER, reason="a size where an L2 section holds fewer heads than "
                    "the call: too slow for interpret mode")
def test_default_sections_match_reference():
    # 8 kv heads of 65536 keys: 32 MB of K / V each, so one kv head (and its two q heads) a
    # section; causal bottom-right with 512 queries.
    q, k, v = _inputs(1, 512, 65536, 16, 8, 128, jnp.bfloat16, seed=11)
    spec = _spec(q, k, causal=True, alignment="bottom_right", interpret=False)
    assert mosaic._launch_order(spec, mosaic.default_forward_config(128, spec), q, k,
                                n_tiles=4).head_chunk == 2
    out, st = mosaic.forward(spec, q, k, v)
    ref, ref_lse = pf.reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                          causal=True, causal_alignment="bottom_right",
                                          return_lse=True)
    assert_close("O", out.astype(jnp.float32), ref, TOLERANCE[jnp.dtype(q.dtype)])
    assert _rel(stats.to_lse(spec, st), ref_lse) < 1e-4


def test_launch_head_chunk_rule():
    mib = 1 << 20
    # FlashAttention-3's sections: as many heads as share 32 MB of streamed K / V.
    assert common.launch_head_chunk(4 * mib, 16, True) == 8     # head_dim 128, 8k keys, bf16
    assert common.launch_head_chunk(8 * mib, 16, True) == 4     # 16k keys
    assert common.launch_head_chunk(8 * mib, 6, True) == 3      # the largest divisor that fits
    assert common.launch_head_chunk(64 * mib, 16, True) == 1    # one head overflows L2
    assert common.launch_head_chunk(1 * mib, 32, False) == 1    # no causal bound: one head
    q, k, _ = _inputs(2, 8192, 8192, 32, 8, 128, jnp.bfloat16)  # GQA 4: sections of kv heads
    for causal, cluster, chunk in ((True, 1, 32), (False, 1, 1), (False, 2, 1)):
        spec = _spec(q, k, causal=causal, interpret=False)
        order = mosaic._launch_order(spec, C(cluster=cluster), q, k, n_tiles=64)
        assert order.head_chunk == chunk
        assert order.params()["grid"] == ((2, 32, 64 // cluster) if chunk == 1 else (2, 64, 32))


def test_launch_order_validation():
    with pytest.raises(ValueError, match=r"MosaicForwardConfig\.head_chunk must be"):
        C(head_chunk=0)
    with pytest.raises(ValueError, match=r"MosaicForwardConfig\.head_chunk must be"):
        C(head_chunk=True)
    with pytest.raises(ValueError, match=r"MosaicForwardConfig\.head_chunk must be None or 1"):
        C(cluster=2, head_chunk=2)
    C(cluster=2, head_chunk=1)
    q, k, v = _inputs(1, 128, 128, 6, 2, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"head_chunk \(4\) must divide the number of q heads"):
        mosaic.forward(_spec(q, k, causal=True), q, k, v, config=C(head_chunk=4))
    with pytest.raises(ValueError, match="must divide"):
        common.TileGrid(4, 6, 1, head_chunk=4)


def test_launch_order_keeps_huge_batches_on_cudas_x_axis():
    # CUDA's grid y and z stop at 65535: past that many (batch, head section) pairs the grid
    # falls back to (tile, head, batch), whose batch is CUDA's x.
    big = common.TileGrid(4, 2, 40000, head_chunk=1, cluster=2)
    assert big.tiles_slowest
    assert big.params() == dict(grid=(4, 2, 40000), grid_names=("tile", "head", "batch"),
                                cluster=(2, 1, 1),
                                cluster_names=(common.CLUSTER_AXIS, "pair_head", "pair_batch"))
    assert not common.TileGrid(4, 2, 32767, head_chunk=1).tiles_slowest
    assert common.TileGrid(4, 4, 20000, head_chunk=1).tiles_slowest
    assert not common.TileGrid(4, 4, 20000, head_chunk=2).tiles_slowest
    q, k, v = _inputs(70000, 8, 8, 1, 1, 64, jnp.bfloat16)
    spec = _spec(q, k, causal=True, interpret=False)
    fn = jax.jit(lambda q, k, v: mosaic.forward(spec, q, k, v))
    text = fn.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
