"""The Mosaic kernels' launch order (pallas_flash/mosaic/schedule.py).

The order changes which CTAs run together, never the result: test_features.py runs the kernels
at explicit head chunks against the reference. Here, the rules that pick the order, the grids
they give, and the fused backward's premise that the tiles adding to a q block's dQ are one
contiguous range.
"""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from backends import IS_HOPPER, ON_GPU
from helpers import (TOLERANCE, assert_close, backward_args, make_spec, random_inputs,
                     reference_grads, relative_error)
from pallas_flash import stats
from pallas_flash.masking import make_mask_spec
from pallas_flash.mosaic import backward as mosaic_backward
from pallas_flash.mosaic import forward as mosaic_forward
from pallas_flash.mosaic import fused_backward
from pallas_flash.mosaic import schedule
from pallas_flash.mosaic.config import (FUSED_BLOCK_Q, FUSED_CTA_KEYS, MosaicBackwardConfig,
                                        MosaicForwardConfig, default_forward_config)
from pallas_flash.triton import forward as triton_forward

C = MosaicForwardConfig
B = MosaicBackwardConfig
FUSED = B(dkdv_block_q=64, fused=True)
needs_hopper = pytest.mark.skipif(ON_GPU and not IS_HOPPER, reason="Mosaic GPU kernel needs sm_90")


# ---- the forward and the two-kernel backward ---------------------------------------------------

def test_launch_head_chunk_rule():
    mib = 1 << 20
    # FlashAttention-3's sections: as many heads as share 32 MB of streamed K / V.
    assert schedule.launch_head_chunk(4 * mib, 16, True) == 8     # head_dim 128, 8k keys
    assert schedule.launch_head_chunk(8 * mib, 16, True) == 4     # 16k keys
    assert schedule.launch_head_chunk(8 * mib, 6, True) == 3      # the largest divisor that fits
    assert schedule.launch_head_chunk(64 * mib, 16, True) == 1    # one head overflows L2
    assert schedule.launch_head_chunk(1 * mib, 32, False) == 1    # no causal bound: one head
    q = jnp.zeros((2, 8192, 32, 128), jnp.bfloat16)               # GQA 4: sections of kv heads
    k = jnp.zeros((2, 8192, 8, 128), jnp.bfloat16)
    for causal, cluster, chunk in ((True, 1, 32), (False, 1, 1), (False, 2, 1)):
        spec = make_spec(8192, 8192, 128, jnp.bfloat16, causal=causal, interpret=False)
        order = schedule.forward_order(spec, C(cluster=cluster), q, k, n_tiles=64)
        assert order.head_chunk == chunk
        assert order.params()["grid"] == ((2, 32, 64 // cluster) if chunk == 1 else (2, 64, 32))


def test_backward_launch_orders():
    q = jnp.zeros((2, 8192, 8, 256), jnp.bfloat16)
    k = jnp.zeros((2, 8192, 4, 256), jnp.bfloat16)
    for causal, chunks in ((True, (2, 8)), (False, (1, 1))):
        spec = make_spec(8192, 8192, 256, jnp.bfloat16, causal=causal)
        dkdv, dq = schedule.backward_orders(spec, B(), q, k, 128, 64)
        # dK/dV streams the group's Q and dO (2 x 8 MB a kv head): two kv heads a section;
        # dQ streams K and V (8 MB a kv head): four kv heads, their eight q heads.
        assert (dkdv.head_chunk, dq.head_chunk) == chunks
    spec = make_spec(8192, 8192, 256, jnp.bfloat16, causal=True)
    assert [o.head_chunk for o in schedule.backward_orders(spec, B(head_chunk=1), q, k,
                                                           128, 64)] == [1, 1]
    with pytest.raises(ValueError, match=r"head_chunk \(3\) must divide the number of kv"):
        schedule.backward_orders(spec, B(head_chunk=3), q, k, 128, 64)


def test_head_chunk_must_divide_the_heads():
    q, k, v, _ = random_inputs(jax.random.PRNGKey(0), 1, 128, 128, 6, 2, 64, jnp.bfloat16)
    spec = make_spec(128, 128, 64, jnp.bfloat16, causal=True)
    with pytest.raises(ValueError, match=r"head_chunk \(4\) must divide the number of q heads"):
        mosaic_forward.forward(spec, q, k, v, config=C(head_chunk=4))
    with pytest.raises(ValueError, match="must divide"):
        schedule.TileGrid(4, 6, 1, head_chunk=4)


def test_huge_batches_stay_on_cudas_x_axis():
    # CUDA's grid y and z stop at 65535: past that many (batch, head section) pairs the grid
    # falls back to (tile, head, batch), whose batch is CUDA's x.
    big = schedule.TileGrid(4, 2, 40000, head_chunk=1, cluster=2)
    assert big.tiles_slowest
    assert big.params() == dict(grid=(4, 2, 40000), grid_names=("tile", "head", "batch"),
                                cluster=(2, 1, 1),
                                cluster_names=(schedule.CLUSTER_AXIS, "pair_head", "pair_batch"))
    assert not schedule.TileGrid(4, 2, 32767, head_chunk=1).tiles_slowest
    assert schedule.TileGrid(4, 4, 20000, head_chunk=1).tiles_slowest
    assert not schedule.TileGrid(4, 4, 20000, head_chunk=2).tiles_slowest
    q, k, v, _ = random_inputs(jax.random.PRNGKey(1), 70000, 8, 8, 1, 1, 64, jnp.bfloat16)
    spec = make_spec(8, 8, 64, jnp.bfloat16, causal=True, interpret=False)
    fn = jax.jit(lambda q, k, v: mosaic_forward.forward(spec, q, k, v))
    text = fn.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.skipif(not IS_HOPPER, reason="a size where an L2 section holds fewer heads than "
                    "the call: too slow for interpret mode")
def test_default_sections_match_reference():
    # 8 kv heads of 65536 keys: 32 MB of K / V each, so one kv head (and its two q heads) a
    # section; causal bottom-right with 512 queries.
    q, k, v, _ = random_inputs(jax.random.PRNGKey(11), 1, 512, 65536, 16, 8, 128, jnp.bfloat16)
    spec = make_spec(512, 65536, 128, jnp.bfloat16, causal=True,
                     causal_alignment="bottom_right", interpret=False)
    assert schedule.forward_order(spec, default_forward_config(128, spec), q, k,
                                  n_tiles=4).head_chunk == 2
    out, row_stats = mosaic_forward.forward(spec, q, k, v)
    ref, ref_lse = pf.reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                          causal=True, causal_alignment="bottom_right",
                                          return_lse=True)
    assert_close("O", out.astype(jnp.float32), ref, TOLERANCE[jnp.dtype(q.dtype)])
    assert relative_error(stats.to_lse(spec, row_stats), ref_lse) < 1e-4


# ---- the fused backward: ordered dQ adds ------------------------------------------------------

@pytest.mark.parametrize("sq,skv,causal,alignment,window", [
    (1000, 1000, False, "top_left", None),
    (1000, 1000, True, "top_left", None),
    (700, 1300, True, "bottom_right", None),
    (1300, 700, True, "bottom_right", None),
    (1300, 700, True, "top_left", None),
    (1024, 1024, True, "top_left", (300, 0)),
    (999, 1111, False, "top_left", (70, 200)),
    (640, 896, False, "bottom_right", (0, 0)),
    (100, 5000, True, "bottom_right", (130, 0)),
])
def test_contributing_tiles_are_the_kernels_ranges(sq, skv, causal, alignment, window):
    """The writer waits for `tile - first(j)` earlier sums. That is right (and cannot hang)
    only if the tiles whose streamed range holds q block j are exactly [first(j), last(j))."""
    mask = make_mask_spec(sq, skv, causal=causal, causal_alignment=alignment, window=window)
    n_tiles = -(-skv // FUSED_CTA_KEYS)
    n_blocks = -(-sq // FUSED_BLOCK_Q)
    starts = jnp.arange(n_tiles, dtype=jnp.int32) * FUSED_CTA_KEYS
    lo, _, _, hi = jax.vmap(
        lambda s: mask.q_blocks(s, FUSED_CTA_KEYS, FUSED_BLOCK_Q, skv, sq))(starts)
    streams = np.zeros((n_tiles, n_blocks), bool)
    for t in range(n_tiles):
        streams[t, int(lo[t]):int(hi[t])] = True
    first, last = schedule.fused_first_tiles(mask, n_blocks)
    for j in range(n_blocks):
        expected = np.zeros(n_tiles, bool)
        expected[int(first[j]):int(last[j])] = True
        np.testing.assert_array_equal(streams[:, j], expected, err_msg=f"q block {j}")
    assert streams.any()


def _fused_grid(spec, args, cfg):
    """The grid of the fused kernel's launch (from the staged jaxpr)."""
    jaxpr = jax.make_jaxpr(lambda *a: mosaic_backward.backward(spec, *a, config=cfg))(*args)
    grids = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.params.get("name") == fused_backward.FUSED_KERNEL_NAME:
                grids.append(tuple(eqn.params["meshes"][0].grid))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    assert len(grids) == 1, grids
    return grids[0]


@pytest.mark.parametrize("chunk,batch,kv_heads,expected", [
    (None, 1, 4, 4), (None, 1, 6, 2), (None, 1, 3, 1), (None, 2, 4, 1), (None, 1, 1, 1),
    (1, 1, 4, 1), (4, 1, 8, 4), (2, 3, 2, 2)])
def test_fused_head_chunk_rule(chunk, batch, kv_heads, expected):
    """By default four heads interleave at batch 1 (two, or one, where four do not divide the
    kv heads), none at batch >= 2, whose launch order already alternates between chains of dQ
    adds."""
    cfg = dataclasses.replace(FUSED, fused_head_chunk=chunk)
    assert schedule.fused_head_chunk(cfg, batch, kv_heads) == expected
    # The grid: (head chunks, tiles, chunk x batch), 2 key tiles at seq 256.
    q, k, v, _, row_stats, do, _ = backward_args(batch, 256, 256, 2 * kv_heads, kv_heads, 128,
                                                 jnp.bfloat16)
    spec = make_spec(256, 256, 128, jnp.bfloat16, causal=True, interpret=False)
    assert _fused_grid(spec, (q, k, v, q, row_stats, do, row_stats.m), cfg) == (
        kv_heads // expected, 2, expected * batch)


def test_fused_head_chunk_must_divide_the_kv_heads():
    with pytest.raises(ValueError, match="fused_head_chunk=4 must divide .* 6"):
        schedule.fused_head_chunk(dataclasses.replace(FUSED, fused_head_chunk=4), 1, 6)


def _causal_fused_grads(seed, b, s, hq, hkv, d=128, dtype=jnp.bfloat16):
    """grads(**fields): the fused backward's (dq, dk, dv) at FUSED with `fields` replaced, on
    fresh causal inputs and random cotangents (the Triton forward's O and statistics); the
    first call's gradients are checked against the float32 reference."""
    q, k, v, do = random_inputs(jax.random.PRNGKey(seed), b, s, s, hq, hkv, d, dtype)
    dlse = jax.random.normal(jax.random.PRNGKey(seed + 1), (b, hq, s), jnp.float32)
    spec = make_spec(s, s, d, dtype, causal=True)
    out, row_stats = triton_forward.forward(spec, q, k, v)
    checked = []

    def grads(**fields):
        cfg = dataclasses.replace(FUSED, **fields)
        got = jax.jit(lambda *a: mosaic_backward.backward(spec, *a, config=cfg))(
            q, k, v, out, row_stats, do, dlse)
        if not checked:
            ref = reference_grads(q, k, v, do, dlse, causal=True)
            for name, g, r in zip(("dq", "dk", "dv"), got, ref):
                assert_close(f"{name} vs reference", g, r, TOLERANCE[jnp.dtype(dtype)])
            checked.append(True)
        return got

    return grads


@needs_hopper
def test_fused_head_chunks_give_the_same_bits():
    """The adds into a q block's dQ run in tile order whatever order the CTAs launch in: every
    chunk gives the same gradients, bit for bit, and they match the reference. Compiled, the
    CTAs of interleaved heads run at once and their semaphores interlock; in interpret mode
    (one CTA at a time) this checks the grid's index arithmetic."""
    grads = _causal_fused_grads(65, 1, 256, 4, 4)
    unchunked = grads(fused_head_chunk=1)
    for chunk in (2, 4):
        for name, g, h in zip(("dq", "dk", "dv"), grads(fused_head_chunk=chunk), unchunked):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(h), err_msg=f"{name} {chunk}")


# ---- the persistent fused backward ------------------------------------------------------------

def _plan_case(sq, skv, causal, window=None, kv_heads=2, group=2, batch=2, chunk=1):
    mask = make_mask_spec(sq, skv, causal=causal, window=window)
    n_blocks = -(-sq // FUSED_BLOCK_Q)
    return mask, n_blocks, dict(kv_heads=kv_heads, group=group, batch=batch, chunk=chunk)


def _items_of(plan):
    return [list(row[1:1 + row[0]]) for row in plan]


def _waits(mask, n_blocks, n_tiles, chunk, batch):
    """For each item (fused_item's numbering, from schedule.fused_item) the items it waits on:
    in each q block it adds to, the lower tiles of its (kv head, batch) that add there first."""
    first, last = schedule.fused_first_tiles(mask, n_blocks)

    def item_of(tile, head, b):
        return ((head // chunk) * n_tiles + tile) * (chunk * batch) + (head % chunk) * batch + b

    def waits(item):
        inner = item % (chunk * batch)
        tile = (item // (chunk * batch)) % n_tiles
        head = (item // (chunk * batch * n_tiles)) * chunk + inner // batch
        b = inner % batch
        lows = [int(first[j]) for j in range(n_blocks) if first[j] <= tile < last[j]]
        low = min(lows, default=tile)
        return {item_of(t, head, b) for t in range(low, tile)}

    return waits


def _finishes(plan, waits):
    """Runs the plan as resident CTAs would: each CTA's current item finishes once every item
    it waits on has. True if all finish, False at a deadlock (no CTA can move)."""
    queues = _items_of(plan)
    done, pos = set(), [0] * len(queues)
    while True:
        moved = False
        for c, queue in enumerate(queues):
            while pos[c] < len(queue) and waits(queue[pos[c]]) <= done:
                done.add(queue[pos[c]])
                pos[c] += 1
                moved = True
        if all(p == len(q) for p, q in zip(pos, queues)):
            return True
        if not moved:
            return False


@pytest.mark.parametrize("sq,skv,causal,window,ctas,handout", [
    (1000, 1000, True, None, 132, "longest_first"),
    (1000, 1000, True, None, 3, "reversed"),
    (700, 1500, False, (200, 100), 5, "longest_first"),
    (640, 640, False, None, 1, "longest_first"),
    (2048, 2048, True, None, 7, "reversed"),
])
def test_persistent_plan_hands_out_every_item_once(sq, skv, causal, window, ctas, handout):
    """Every item exactly once, each CTA's in handout order, the counts in column 0, and a
    plan that runs to the end as resident CTAs run it; "reversed" is "longest_first" with the
    CTAs mirrored."""
    mask, n_blocks, kw = _plan_case(sq, skv, causal, window)
    plan = schedule.persistent_plan(mask, n_blocks, ctas=ctas, handout=handout, **kw)
    n_tiles = -(-skv // FUSED_CTA_KEYS)
    n_items = kw["kv_heads"] * n_tiles * kw["batch"]
    items = _items_of(plan)
    assert plan.shape[0] == ctas
    assert sorted(i for row in items for i in row) == list(range(n_items))
    assert all(row == sorted(row) for row in items)
    forward = schedule.persistent_plan(mask, n_blocks, ctas=ctas, **kw)
    if handout == "reversed":
        np.testing.assert_array_equal(plan, forward[::-1])
    waits = _waits(mask, n_blocks, n_tiles, kw["chunk"], kw["batch"])
    assert _finishes(plan, waits)


@pytest.mark.parametrize("sq,skv,options", [
    (1000, 1000, dict(causal=True)), (700, 1500, dict(causal=False, window=(200, 100))),
    (640, 896, dict(causal=True, causal_alignment="bottom_right")),
    (100, 5000, dict(causal=True, causal_alignment="bottom_right", window=(130, 0))),
    (999, 1111, dict(causal=False))])
def test_fused_tile_blocks_counts_each_tiles_blocks(sq, skv, options):
    """The plan's cost of a key tile: how many q blocks' ranges [first(j), last(j)) hold it."""
    mask = make_mask_spec(sq, skv, **options)
    n_blocks = -(-sq // FUSED_BLOCK_Q)
    first, last = schedule.fused_first_tiles(mask, n_blocks)
    tiles = np.arange(-(-skv // FUSED_CTA_KEYS))
    table = (first[None, :] <= tiles[:, None]) & (tiles[:, None] < last[None, :])
    np.testing.assert_array_equal(schedule.fused_tile_blocks(mask, n_blocks), table.sum(axis=1))


def test_deadlock_check_can_fail():
    """The simulation above finds a deadlock where there is one: each CTA running its items
    in the reverse of handout order, a tile then waits on a lower tile queued behind it."""
    mask, n_blocks, kw = _plan_case(1000, 1000, True)
    plan = schedule.persistent_plan(mask, n_blocks, ctas=3, **kw)
    backwards = plan.copy()
    for row in backwards:
        row[1:1 + row[0]] = row[1:1 + row[0]][::-1]
    waits = _waits(mask, n_blocks, -(-1000 // FUSED_CTA_KEYS), kw["chunk"], kw["batch"])
    assert _finishes(plan, waits)
    assert not _finishes(backwards, waits)


def test_persistent_plan_balances_causal_work():
    """Greedy least-loaded in longest-first order: no CTA's work exceeds the mean by more than
    one item's (list scheduling's bound), on a causal mask where tile costs differ 16-fold."""
    mask, n_blocks, kw = _plan_case(2048, 2048, True, kv_heads=4, group=4, batch=1)
    ctas = 13
    plan = schedule.persistent_plan(mask, n_blocks, ctas=ctas, **kw)
    n_tiles = 2048 // FUSED_CTA_KEYS
    cost = kw["group"] * schedule.fused_tile_blocks(mask, n_blocks) + schedule.ITEM_OVERHEAD_STEPS
    assert cost.max() >= 8 * cost.min()
    tile_of = lambda item: (item // kw["batch"]) % n_tiles  # noqa: E731
    loads = [sum(int(cost[tile_of(i)]) for i in row) for row in _items_of(plan)]
    assert max(loads) <= sum(loads) / ctas + cost.max()


def test_persistent_plan_checks_its_handout():
    mask, n_blocks, kw = _plan_case(256, 256, True)
    with pytest.raises(ValueError, match="handout"):
        schedule.persistent_plan(mask, n_blocks, ctas=2, handout="random", **kw)
    with pytest.raises(ValueError, match="fused_handout"):
        dataclasses.replace(FUSED, fused_handout="random")
    with pytest.raises(ValueError, match="fused_ctas"):
        dataclasses.replace(FUSED, fused_ctas=0)


@pytest.mark.parametrize("ctas,expected", [(None, 16), (3, 3), (100, 16)])
def test_persistent_grid_is_one_row_of_ctas(ctas, expected):
    """One CTA per SM (HOPPER_SMS off a GPU), never more than the items: 2 kv heads x 4 key
    tiles x batch 2 = 16."""
    cfg = dataclasses.replace(FUSED, fused_persistent=True, fused_ctas=ctas)
    q, k, v, _, row_stats, do, _ = backward_args(2, 512, 512, 4, 2, 128, jnp.bfloat16)
    spec = make_spec(512, 512, 128, jnp.bfloat16, causal=True, interpret=False)
    assert _fused_grid(spec, (q, k, v, q, row_stats, do, row_stats.m), cfg) == (expected,)


@pytest.mark.skipif(not IS_HOPPER, reason=(
    "compiled only: the interpreter runs a persistent CTA's items before the next CTA's, so "
    "its dQ adds run in another order"))
def test_persistent_gives_the_grids_bits():
    """The persistent grid adds each q block's dQ in the same tile order as the launch-order
    grid: its gradients are those of the grid, bit for bit, for every CTA count and handout,
    and match the reference."""
    grads = _causal_fused_grads(67, 2, 640, 4, 2)
    grid = grads()
    for fields in (dict(), dict(fused_ctas=1), dict(fused_ctas=3, fused_handout="reversed"),
                   dict(fused_ctas=7)):
        for name, g, h in zip(("dq", "dk", "dv"), grads(fused_persistent=True, **fields), grid):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(h),
                                          err_msg=f"{name} {fields}")


@pytest.mark.parametrize("sq,causal,ctas", [(1000, True, 132), (1000, False, 5), (4096, True, 7)])
def test_persistent_forward_plan(sq, causal, ctas):
    """Every (tile, head, batch) once, the longest in the first wave, and no CTA's work past
    the mean by more than one item's."""
    mask = make_mask_spec(sq, sq, causal=causal)
    cta_rows, block_kv, heads, batch = 128, 128, 3, 2
    n_tiles = -(-sq // cta_rows)
    plan = schedule.persistent_forward_plan(mask, n_tiles, cta_rows, block_kv, heads, batch,
                                            ctas)
    items = _items_of(plan)
    assert sorted(i for row in items for i in row) == list(range(n_tiles * heads * batch))
    tile_of = lambda item: item % n_tiles  # noqa: E731
    starts = np.arange(n_tiles) * cta_rows
    lo, _, _, hi = mask.kv_blocks(starts, cta_rows, block_kv, sq, xp=np)
    cost = np.broadcast_to(hi - lo, starts.shape) + schedule.ITEM_OVERHEAD_STEPS
    loads = [sum(int(cost[tile_of(i)]) for i in row) for row in items]
    assert max(loads) <= sum(loads) / ctas + cost.max()
    # The first wave takes the longest items.
    first = sorted((int(cost[tile_of(row[0])]) for row in items if row), reverse=True)
    every = sorted((int(cost[tile_of(i)]) for row in items for i in row), reverse=True)
    assert first == every[:len(first)]
    with pytest.raises(ValueError, match="persistent runs without clusters"):
        MosaicForwardConfig(persistent=True, cluster=2)
