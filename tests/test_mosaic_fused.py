"""The one-kernel Mosaic backward (pallas_flash/mosaic/fused_backward.py).

On the CPU the kernel runs in Mosaic GPU interpret mode, where the grid runs one CTA at a time
in index order and the writer adds to the previous sum itself (the interpreter has neither
semaphores nor TMA reductions); on an H200 it runs compiled, with both. Gradients are compared
with the vjp of the float32 reference for random inputs and random output and lse cotangents.
"""

import dataclasses
import importlib

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (TOLERANCE, assert_close, backward_args, kernel_names, mosaic_spec,
                     random_inputs, reference_grads)
import pallas_flash as pf
from pallas_flash.masking import make_mask_spec
from pallas_flash.stats import RowStats
from pallas_flash.triton import forward as triton_forward

mosaic = importlib.import_module("pallas_flash.mosaic.backward")
fused = importlib.import_module("pallas_flash.mosaic.fused_backward")
FUSED = mosaic.MosaicBackwardConfig(dkdv_block_q=64, fused=True)

ON_GPU = jax.default_backend() == "gpu"
IS_HOPPER = ON_GPU and str(getattr(jax.devices()[0], "compute_capability", "")) == "9.0"
needs_hopper = pytest.mark.skipif(ON_GPU and not IS_HOPPER, reason="Mosaic GPU kernel needs sm_90")


# ---- the order's premise: the tiles that see a q block are one contiguous range ---------------

MASKS = [
    # (seq_q, seq_kv, causal, alignment, window)
    (1000, 1000, False, "top_left", None),
    (1000, 1000, True, "top_left", None),
    (700, 1300, True, "bottom_right", None),
    (1300, 700, True, "bottom_right", None),
    (1300, 700, True, "top_left", None),
    (1024, 1024, True, "top_left", (300, 0)),
    (999, 1111, False, "top_left", (70, 200)),
    (640, 896, False, "bottom_right", (0, 0)),
    (100, 5000, True, "bottom_right", (130, 0)),
]


@pytest.mark.parametrize("sq,skv,causal,alignment,window", MASKS)
def test_contributing_tiles_are_the_kernels_ranges(sq, skv, causal, alignment, window):
    """The writer waits for `tile - first(j)` earlier sums. That is right (and cannot hang)
    only if the tiles whose streamed range holds q block j are exactly [first(j), last(j))."""
    mask = make_mask_spec(sq, skv, causal=causal, causal_alignment=alignment, window=window)
    n_tiles = -(-skv // fused.CTA_KEYS)
    n_blocks = -(-sq // fused.BLOCK_Q)
    starts = jnp.arange(n_tiles, dtype=jnp.int32) * fused.CTA_KEYS
    lo, _, _, hi = jax.vmap(
        lambda s: mask.q_blocks(s, fused.CTA_KEYS, fused.BLOCK_Q, skv, sq))(starts)
    streams = np.zeros((n_tiles, n_blocks), bool)
    for t in range(n_tiles):
        streams[t, int(lo[t]):int(hi[t])] = True
    first, last = fused._first_tiles(mask, n_blocks)
    for j in range(n_blocks):
        expected = np.zeros(n_tiles, bool)
        expected[int(first[j]):int(last[j])] = True
        np.testing.assert_array_equal(streams[:, j], expected, err_msg=f"q block {j}")
    assert streams.any()


# ---- gradients ----------------------------------------------------------------------------------

CASES = [
    # (b, sq, skv, hq, hkv, head_dim, options)
    # Causal GQA: the q heads of a group in turn, diagonal blocks masked, the second key
    # warpgroup of each CTA draining the blocks above its diagonal.
    pytest.param(1, 256, 256, 4, 2, 128, dict(causal=True), id="causal-gqa"),
    # Partial tiles (seq_kv 150: a 22-key last tile, padded to 152 for the TMA; seq_q 200: a
    # partial last q block), bottom-right: q blocks 0-1 see no key, so no tile writes their dQ.
    pytest.param(2, 200, 150, 2, 1, 128, dict(causal=True, causal_alignment="bottom_right"),
                 id="partial-bottom-right-mqa"),
    # A two-sided window with softcap: tiles that see a q block start past tile 0.
    pytest.param(1, 320, 384, 2, 2, 128, dict(window=(70, 90), softcap=2.5),
                 id="window-softcap"),
    # No mask: every tile adds to every q block, three tiles deep.
    pytest.param(1, 192, 384, 2, 1, 128, dict(), id="full"),
    # head_dim 64: the warpgroups take turns at the whole dQ product (`alternates`); causal
    # GQA with partial tiles.
    pytest.param(1, 200, 250, 4, 2, 64, dict(causal=True), id="turns-d64"),
    # No mask, GQA: the head-major stream (block-major is for position masks), with turns and
    # partial tiles on both axes.
    pytest.param(1, 136, 200, 4, 2, 64, dict(), id="full-partial-gqa-d64"),
]


@needs_hopper
@pytest.mark.parametrize("b,sq,skv,hq,hkv,d,options", CASES)
def test_matches_reference(b, sq, skv, hq, hkv, d, options):
    dtype = jnp.bfloat16
    q, k, v, do = random_inputs(jax.random.PRNGKey(61), b, sq, skv, hq, hkv, d, dtype)
    dlse = jax.random.normal(jax.random.PRNGKey(62), (b, hq, sq), jnp.float32)
    spec = mosaic_spec(sq, skv, d, dtype, causal=options.get("causal", False),
                 alignment=options.get("causal_alignment", "top_left"),
                 window=options.get("window"), softcap=options.get("softcap"))
    cfg = mosaic.default_backward_config(d)   # what users run: the fused kernel at 64 and 128
    assert mosaic.uses_fused(spec, q, k, cfg)
    out, stats = triton_forward.forward(spec, q, k, v)
    run = jax.jit(lambda *a: mosaic.backward(spec, *a, config=cfg))
    grads = run(q, k, v, out, stats, do, dlse)
    ref = reference_grads(q, k, v, do, dlse, **options)
    for name, g, r, x in zip(("dq", "dk", "dv"), grads, ref, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape, (name, g.dtype, g.shape)
        assert_close(f"{name} vs reference", g, r, TOLERANCE[jnp.dtype(dtype)])
    # The sums run in a fixed order: a second call gives the same bits. Only compiled: the
    # interpreter runs one CTA at a time, so there the repeat would test nothing (and costs as
    # much as the first call).
    if ON_GPU:
        again = run(q, k, v, out, stats, do, dlse)
        for g, h in zip(grads, again):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(h))


# ---- the launch order at batch 1: heads interleaved tile by tile -------------------------------

def _fused_grid(spec, args, cfg):
    """The grid of the fused kernel's launch (from the staged jaxpr)."""
    jaxpr = jax.make_jaxpr(lambda *a: mosaic.backward(spec, *a, config=cfg))(*args).jaxpr
    grids = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.params.get("name") == fused.FUSED_KERNEL_NAME:
                grids.append(tuple(eqn.params["meshes"][0].grid))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr)
    assert len(grids) == 1, grids
    return grids[0]


@pytest.mark.parametrize("chunk,batch,kv_heads,expected", [
    (None, 1, 4, 4), (None, 1, 6, 2), (None, 1, 3, 1), (None, 2, 4, 1), (None, 1, 1, 1),
    (1, 1, 4, 1), (4, 1, 8, 4), (2, 3, 2, 2)])
def test_head_chunk_rule(chunk, batch, kv_heads, expected):
    """By default four heads interleave at batch 1 (two, or one, where four do not divide the
    kv heads), none at batch >= 2, whose launch order already alternates between chains of dQ
    adds (NOTES.md run 59)."""
    cfg = dataclasses.replace(FUSED, fused_head_chunk=chunk)
    assert fused.head_chunk(cfg, batch, kv_heads) == expected
    # The grid: (head chunks, tiles, chunk x batch), 2 key tiles at seq 256.
    q, k, v, _, stats, do, _ = backward_args(batch, 256, 256, 2 * kv_heads, kv_heads, 128,
                                             jnp.bfloat16)
    spec = mosaic_spec(256, 256, 128, jnp.bfloat16, causal=True, interpret=False)
    assert _fused_grid(spec, (q, k, v, q, stats, do, stats.m), cfg) == (
        kv_heads // expected, 2, expected * batch)


def test_head_chunk_is_checked():
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="fused_head_chunk"):
            mosaic.MosaicBackwardConfig(fused_head_chunk=bad)
    with pytest.raises(ValueError, match="fused_head_chunk=4 must divide .* 6"):
        fused.head_chunk(dataclasses.replace(FUSED, fused_head_chunk=4), 1, 6)


@needs_hopper
def test_head_chunks_give_the_same_bits():
    """The adds into a q block's dQ run in tile order whatever order the CTAs launch in: every
    chunk gives the same gradients, bit for bit, and they match the reference. Compiled, the
    CTAs of interleaved heads run at once and their semaphores interlock; in interpret mode
    (one CTA at a time) this checks the grid's index arithmetic."""
    b, s, hq, hkv, d, dtype = 1, 256, 4, 4, 128, jnp.bfloat16
    q, k, v, do = random_inputs(jax.random.PRNGKey(65), b, s, s, hq, hkv, d, dtype)
    dlse = jax.random.normal(jax.random.PRNGKey(66), (b, hq, s), jnp.float32)
    spec = mosaic_spec(s, s, d, dtype, causal=True)
    out, stats = triton_forward.forward(spec, q, k, v)
    ref = reference_grads(q, k, v, do, dlse, causal=True)
    def grads(chunk):
        cfg = dataclasses.replace(FUSED, fused_head_chunk=chunk)
        return jax.jit(lambda *a: mosaic.backward(spec, *a, config=cfg))(
            q, k, v, out, stats, do, dlse)

    unchunked = grads(1)
    for name, g, r in zip(("dq", "dk", "dv"), unchunked, ref):
        assert_close(f"{name} vs reference", g, r, TOLERANCE[jnp.dtype(dtype)])
    for chunk in (2, 4):
        for name, g, h in zip(("dq", "dk", "dv"), grads(chunk), unchunked):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(h), err_msg=f"{name} {chunk}")


# ---- dispatch and lowering --------------------------------------------------------------------

@pytest.mark.parametrize("d,dtype,options,served", [
    (128, jnp.bfloat16, {}, True),
    (64, jnp.bfloat16, {}, True),
    (128, jnp.float16, {}, False),
    (256, jnp.bfloat16, {}, False),
    (128, jnp.bfloat16, dict(has_segments=True), False),
])
def test_runs_where_it_serves_and_falls_back_elsewhere(d, dtype, options, served):
    q, k, v, _, stats, do, _ = backward_args(1, 256, 256, 2, 1, d, dtype)
    spec = mosaic_spec(256, 256, d, dtype, causal=True, interpret=False, **options)
    assert mosaic.uses_fused(spec, q, k, FUSED) is served
    assert not mosaic.uses_fused(spec, q, k, mosaic.MosaicBackwardConfig(dkdv_block_q=64))
    args = (q, k, v, q, stats, do, stats.m)
    if spec.has_segments:
        ids = jnp.zeros((1, 256), jnp.int32)
        args = args + (ids, ids)
    cfg = FUSED if d <= 128 else dataclasses.replace(mosaic.default_backward_config(d), fused=True)
    names = kernel_names(lambda *a: mosaic.backward(spec, *a, config=cfg), *args)
    expected = ({fused.FUSED_KERNEL_NAME} if served
                else {mosaic.DKDV_KERNEL_NAME, mosaic.DQ_KERNEL_NAME})
    assert names == expected, names


def test_shared_memory_is_checked():
    q, k, v, *_ = backward_args(1, 256, 256, 2, 1, 128, jnp.bfloat16)
    spec = mosaic_spec(256, 256, 128, jnp.bfloat16, causal=True, interpret=False)
    cfg = mosaic.MosaicBackwardConfig(dkdv_block_q=64, fused_stages=3, fused=True,
                                      fused_dq_slots=2)
    assert "fused kernel" in mosaic.unsupported_reason(spec, q, k, v, cfg)
    assert mosaic.unsupported_reason(spec, q, k, v, FUSED) is None
    # A second dQ slot does not fit at head_dim 128 beside the two dS^T buffers.
    two = dataclasses.replace(FUSED, fused_dq_slots=2)
    assert "fused kernel" in mosaic.unsupported_reason(spec, q, k, v, two)
    with pytest.raises(ValueError, match="fused_dq_slots"):
        mosaic.MosaicBackwardConfig(fused_dq_slots=3)


@pytest.mark.parametrize("b,d,causal,options", [
    (2, 128, True, {}), (2, 128, False, dict(window=(100, 50), softcap=30.0)),
    (2, 64, True, {}), (2, 64, False, dict(window=(100, 50), softcap=30.0)),
    (1, 128, True, {})],
    ids=["causal", "window-softcap", "causal-d64", "window-softcap-d64", "causal-b1-chunk"])
def test_lowers_for_sm90(b, d, causal, options):
    """The compiled kernel, semaphores and the writer's TMA reduce-add and early slot release
    included (the interpreter runs none of them), lowers for sm_90; at batch 1 with two heads
    interleaved (`fused_backward.head_chunk`)."""
    seq = 1001
    q, k, v, _, stats, do, _ = backward_args(b, seq, seq, 4, 2, d, jnp.bfloat16)
    spec = mosaic_spec(seq, seq, d, jnp.bfloat16, causal=causal, interpret=False, **options)
    fn = jax.jit(lambda *a: mosaic.backward(spec, *a, config=FUSED))
    text = fn.trace(q, k, v, q, stats, do, stats.m).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def _largest_value(jaxpr) -> int:
    """Elements of the largest array any equation of `jaxpr` (or of the jaxprs inside it, the
    kernel bodies included) produces."""
    largest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            largest = max(largest, int(np.prod(getattr(var.aval, "shape", ()))))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            largest = max(largest, _largest_value(sub))
    return largest


def test_materializes_nothing_quadratic():
    """The fused backward's extra buffers (the float32 dQ sum, the semaphores) are linear in the
    sequence: nothing it computes has seq_q x seq_kv elements."""
    seq = 2048
    args = backward_args(1, seq, seq, 2, 1, 128, jnp.bfloat16)
    spec = mosaic_spec(seq, seq, 128, jnp.bfloat16, causal=True, interpret=False)
    jaxpr = jax.make_jaxpr(lambda *a: mosaic.backward(spec, *a, config=FUSED))(*args).jaxpr
    largest = _largest_value(jaxpr)
    assert 0 < largest < seq * seq // 4, largest
    # The check can fail: the reference's backward holds seq x seq probabilities.
    ref = jax.make_jaxpr(lambda q, k, v: jax.vjp(
        lambda q, k, v: pf.reference_attention(q, k, v, causal=True), q, k, v)[1](q))(
        *args[:3]).jaxpr
    assert _largest_value(ref) >= seq * seq


@needs_hopper
def test_vmap_folds_into_the_batch():
    """jax.vmap (the guarded "auto" path vmaps the kernel it picks) becomes a larger batch of
    one launch: the semaphores are indexed by batch, so instances must not share them. Each
    vmapped example's gradients equal those of the example alone, bit for bit."""
    n, sq, skv, hq, hkv, d, dtype = 2, 128, 192, 2, 1, 128, jnp.bfloat16
    q, k, v, do = random_inputs(jax.random.PRNGKey(63), n, sq, skv, hq, hkv, d, dtype)
    dlse = jax.random.normal(jax.random.PRNGKey(64), (n, hq, sq), jnp.float32)
    spec = mosaic_spec(sq, skv, d, dtype, causal=True)
    out, stats = triton_forward.forward(spec, q, k, v)

    def one(q, k, v, out, m, r, do, dlse):  # a batch of one example
        return mosaic.backward(spec, q, k, v, out, RowStats(m, r), do, dlse, config=FUSED)

    args = [x[:, None] for x in (q, k, v, out, stats.m, stats.r, do, dlse)]
    vmapped = jax.jit(jax.vmap(one))
    got = vmapped(*args)
    for i in range(n):
        alone = jax.jit(one)(*(x[i] for x in args))
        for g, a in zip(got, alone):
            np.testing.assert_array_equal(np.asarray(g[i]), np.asarray(a))
    # One launch, its batch the vmapped axis times the batch.
    launches = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("pallas_call", "mpmd_map"):
                launches.append(eqn.invars[0].aval.shape)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(jax.vmap(one))(*args).jaxpr)
    assert launches == [(n, sq, hq, d)], launches
