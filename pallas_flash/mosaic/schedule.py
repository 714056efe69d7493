"""The order in which the Mosaic kernels' CTAs take their work.

Pallas hands its grid to CUDA reversed (Mosaic GPU's lowering.py), so the *last* grid axis is
the one CUDA launches fastest. Three rules follow from L2 locality and load balance:

* Tiles of one head launch together (`TileGrid`): the CTAs in flight stream the K / V (or Q /
  dO) of a few heads, which then stay in L2.
* Under a causal bound, query tiles run last-first: the last rows see the most keys, and
  starting the longest CTAs first keeps the grid's tail short. A head has fewer tiles than a
  wave, so FlashAttention-3's L2 sections interleave a few heads tile by tile
  (`launch_head_chunk`), keeping longest-first across the wave.
* The fused backward adds dQ across the key tiles of a q block in increasing tile order, so
  the tiles of one (head, batch) must launch in increasing order (`fused_grid`).
"""

from __future__ import annotations

import dataclasses
import heapq

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_flash.mosaic.config import (FUSED_BLOCK_Q, FUSED_CTA_KEYS, FUSED_MAX_LAUNCHES,
                                        FUSED_MIN_WAVES, FUSED_SPLIT_BYTES, HANDOUTS,
                                        HOPPER_SMS)

CLUSTER_AXIS = "pair"   # the CTAs of a cluster along the tile axis (forward, config.cluster)
# Streamed bytes that one L2 section of heads may share (FlashAttention-3's tile scheduler:
# 32 MB of the H100's 50 MB of L2).
L2_SECTION_BYTES = 32 << 20
# CUDA's limit on a grid's y and z sizes (x takes up to 2^31 - 1).
MAX_GRID_YZ = 65535


def launch_head_chunk(bytes_per_head: int, heads: int, longest_first: bool) -> int:
    """How many heads a kernel interleaves tile by tile (`TileGrid.head_chunk`).

    1 without a causal bound (every tile of a head is equally long). With one, the largest
    divisor of `heads` whose streamed operands (`bytes_per_head` each) fit L2_SECTION_BYTES.
    """
    if not longest_first:
        return 1
    fit = max(1, L2_SECTION_BYTES // max(1, bytes_per_head))
    return max(d for d in range(1, heads + 1) if heads % d == 0 and d <= fit)


@dataclasses.dataclass(frozen=True)
class TileGrid:
    """The launch order of a kernel of (tile, head, batch) programs.

    head_chunk 1: grid (batch, head, tile), consecutive CTAs are tiles of one (batch, head).
    head_chunk G > 1: grid (section, tile, head_in), G heads interleaved tile by tile.
    n_tiles counts grid entries along the tile axis: clusters of `cluster` adjacent tiles when
    cluster > 1 (axis CLUSTER_AXIS; head_chunk 1 only). A grid whose slowest axis would exceed
    MAX_GRID_YZ (batch x head sections) falls back to (tile, head, batch), batch on CUDA's x,
    and ignores head_chunk.
    """

    n_tiles: int
    heads: int
    batch: int
    head_chunk: int = 1
    cluster: int = 1

    def __post_init__(self):
        if self.heads % self.head_chunk:
            raise ValueError(f"head_chunk {self.head_chunk} must divide the {self.heads} heads")
        if self.cluster > 1 and self.head_chunk > 1:
            raise ValueError("clusters run with head_chunk 1 (tiles on the fastest axis)")

    @property
    def tiles_slowest(self) -> bool:
        """Whether this grid falls back to the (tile, head, batch) order (class docstring)."""
        return self.batch * (self.heads // self.head_chunk) > MAX_GRID_YZ

    def params(self) -> dict:
        """plgpu.kernel's grid (and cluster) arguments."""
        if self.tiles_slowest:
            params = dict(grid=(self.n_tiles, self.heads, self.batch),
                          grid_names=("tile", "head", "batch"))
            if self.cluster > 1:
                params.update(cluster=(self.cluster, 1, 1),
                              cluster_names=(CLUSTER_AXIS, "pair_head", "pair_batch"))
            return params
        if self.head_chunk == 1:
            params = dict(grid=(self.batch, self.heads, self.n_tiles),
                          grid_names=("batch", "head", "tile"))
        else:
            params = dict(grid=(self.batch * (self.heads // self.head_chunk), self.n_tiles,
                                self.head_chunk),
                          grid_names=("section", "tile", "head_in"))
        if self.cluster > 1:
            params.update(cluster=(1, 1, self.cluster),
                          cluster_names=("pair_batch", "pair_head", CLUSTER_AXIS))
        return params

    def head_batch(self):
        """(head, batch) of this program."""
        if self.head_chunk == 1 or self.tiles_slowest:
            return lax.axis_index("head"), lax.axis_index("batch")
        chunks = jnp.int32(self.heads // self.head_chunk)
        section = lax.axis_index("section")
        return (lax.rem(section, chunks) * self.head_chunk + lax.axis_index("head_in"),
                lax.div(section, chunks))


def _tile_of(index, mask, n_tiles: int | None):
    """The tile that grid index `index` works on: last-first for query tiles (n_tiles given)
    under a causal bound. Key tiles (n_tiles None) run first-first: their first are longest."""
    if n_tiles is not None and mask.right is not None:
        return (n_tiles - 1) - index
    return index


def _grid_tile_index(cluster: int):
    """This CTA's index along the tile axis, counting CTAs, not clusters."""
    index = lax.axis_index("tile")
    if cluster > 1:
        index = index * cluster + lax.axis_index(CLUSTER_AXIS)
    return index


def grid_position(mask, n_tiles: int | None = None, cluster: int = 1,
                  order: TileGrid | None = None):
    """(tile, head, batch, warpgroup) of this program. n_tiles: given for query-tile kernels
    (`_tile_of`); cluster: CTAs per grid entry on the tile axis; order: the grid's TileGrid,
    None for a grid named ("head", "tile", "batch") (`fused_grid`)."""
    tile = _tile_of(_grid_tile_index(cluster), mask, n_tiles)
    if order is None:
        head, batch = lax.axis_index("head"), lax.axis_index("batch")
    else:
        head, batch = order.head_batch()
    return tile, head, batch, lax.axis_index("wg")


def cluster_tiles(mask, n_tiles: int, cluster: int):
    """The tiles of this CTA's cluster, in cluster order (a generator)."""
    base = lax.axis_index("tile") * cluster
    for i in range(cluster):
        yield _tile_of(base + i, mask, n_tiles)


def forward_order(spec, cfg, q, k, n_tiles: int, v_head_dim: int | None = None) -> TileGrid:
    """The forward's launch order: config.head_chunk, else L2 sections under a causal bound
    (each section's q heads share their kv heads' K and V; v_head_dim: V's, if not K's)."""
    batch, _, q_heads, head_dim = q.shape
    chunk = cfg.head_chunk
    if chunk is None:
        group = q_heads // k.shape[2]
        head_dim_v = head_dim if v_head_dim is None else v_head_dim
        kv_bytes = spec.mask.seq_kv * (head_dim + head_dim_v) * q.dtype.itemsize
        longest_first = spec.mask.right is not None and cfg.cluster == 1
        chunk = (group * launch_head_chunk(kv_bytes, k.shape[2], longest_first)
                 if longest_first else 1)
    elif q_heads % chunk:
        raise ValueError(f"MosaicForwardConfig.head_chunk ({chunk}) must divide the number "
                         f"of q heads ({q_heads})")
    return TileGrid(n_tiles // cfg.cluster, q_heads, batch, chunk, cfg.cluster)


def backward_orders(spec, cfg, q, k, n_kv_tiles: int, n_q_tiles: int
                    ) -> tuple[TileGrid, TileGrid]:
    """The dK/dV and dQ kernels' launch orders: config.head_chunk kv heads a section, else L2
    sections under a causal bound, on what each streams (a kv head's group of q heads' Q and
    dO; a q head's K and V)."""
    batch, seq_q, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = q_heads // kv_heads
    chunk = cfg.head_chunk
    if chunk is None:
        causal = spec.mask.right is not None
        item = q.dtype.itemsize
        dkdv = launch_head_chunk(group * 2 * seq_q * head_dim * item, kv_heads, causal)
        dq = launch_head_chunk(2 * k.shape[1] * head_dim * item, kv_heads, causal)
    elif kv_heads % chunk:
        raise ValueError(f"MosaicBackwardConfig.head_chunk ({chunk}) must divide the number "
                         f"of kv heads ({kv_heads})")
    else:
        dkdv = dq = chunk
    return (TileGrid(n_kv_tiles, kv_heads, batch, dkdv),
            TileGrid(n_q_tiles, q_heads, batch, dq * group if dq > 1 else 1))


# ---- the fused backward -----------------------------------------------------------------------

def fused_head_chunk(cfg, batch: int, kv_heads: int) -> int:
    """How many kv heads' key tiles the fused grid interleaves tile by tile: the config's
    `fused_head_chunk`, else at batch 1 the largest of 4, 2, 1 dividing the kv heads, else 1.
    Batch is the fastest axis, so at batch >= 2 neighbouring CTAs already belong to different
    chains of ordered dQ adds; at batch 1 they would be consecutive links of one chain."""
    chunk = cfg.fused_head_chunk
    if chunk is None:
        if batch > 1:
            return 1
        return next(c for c in (4, 2, 1) if kv_heads % c == 0)
    if kv_heads % chunk:
        raise ValueError(f"MosaicBackwardConfig.fused_head_chunk={chunk} must divide the "
                         f"number of kv heads, {kv_heads}")
    return chunk


def fused_launches(cfg, batch: int, seq_q: int, q_heads: int, kv_heads: int, head_dim: int,
                   n_tiles: int) -> int:
    """Launches over which the fused backward splits its kv heads: the config's
    `fused_launches`, else 1 while the float32 dQ sum (batch x seq_q x q_heads x head_dim) is
    under FUSED_SPLIT_BYTES, and from there the most launches, up to FUSED_MAX_LAUNCHES and
    dividing the kv heads, that keep FUSED_MIN_WAVES waves of CTAs in each. A launch's sum is
    cast into dQ before the next launch starts, so the float32 alive is 1 / launches of it."""
    launches = cfg.fused_launches
    if launches is not None:
        if kv_heads % launches:
            raise ValueError(f"MosaicBackwardConfig.fused_launches={launches} must divide the "
                             f"number of kv heads, {kv_heads}")
        return launches
    if batch * seq_q * q_heads * head_dim * 4 < FUSED_SPLIT_BYTES:
        return 1
    min_ctas = FUSED_MIN_WAVES * HOPPER_SMS
    return max(n for n in range(1, FUSED_MAX_LAUNCHES + 1)
               if kv_heads % n == 0 and (n == 1 or kv_heads // n * n_tiles * batch >= min_ctas))


def fused_grid(kv_heads: int, n_tiles: int, batch: int, chunk: int):
    """The fused grid (head chunk, tile, head in chunk x batch), named ("head", "tile",
    "batch"): within a tile the chunk's heads and the batch, then the next tile. A wave holds
    the tiles of a head or two, whose float32 dQ sums stay in L2."""
    return (kv_heads // chunk, n_tiles, chunk * batch)


def fused_position(mask, chunk: int, batch_size: int):
    """(tile, kv head, batch, warpgroup) of this CTA in `fused_grid`."""
    tile, head, inner, wg = grid_position(mask)
    if chunk == 1:
        return tile, head, inner, wg
    return (tile, head * chunk + lax.div(inner, jnp.int32(batch_size)),
            lax.rem(inner, jnp.int32(batch_size)), wg)


def fused_first_tiles(mask, n_qblocks: int):
    """first(j), last(j): the key tiles that see q block j, numpy int32 [n]; tile t adds to q
    block j's dQ after the t - first(j) tiles below it. Static, so in numpy (MaskSpec.kv_blocks'
    xp): no jax op runs while tracing."""
    starts = np.arange(n_qblocks, dtype=np.int32) * FUSED_BLOCK_Q
    lo, _, _, hi = mask.kv_blocks(starts, FUSED_BLOCK_Q, FUSED_CTA_KEYS, mask.seq_kv, xp=np)
    return np.broadcast_to(lo, starts.shape), np.broadcast_to(hi, starts.shape)


# ---- the persistent fused backward ----------------------------------------------------------

def device_sms() -> int:
    """The SMs of the default device (HOPPER_SMS where it reports none: a CPU, interpreting)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or HOPPER_SMS)


# What an item costs beyond its q-block steps, in steps: the K / V load and the dK / dV store.
ITEM_OVERHEAD_STEPS = 2


def fused_item(index, n_tiles: int, chunk: int, batch_size: int):
    """(tile, kv head, batch) of item `index`, counted in `fused_grid`'s launch order."""
    inner_size = jnp.int32(chunk * batch_size)
    inner = lax.rem(index, inner_size)
    outer = lax.div(index, inner_size)
    tile = lax.rem(outer, jnp.int32(n_tiles))
    head = lax.div(outer, jnp.int32(n_tiles)) * chunk + lax.div(inner, jnp.int32(batch_size))
    return tile, head, lax.rem(inner, jnp.int32(batch_size))


def fused_tile_blocks(mask, n_qblocks: int) -> np.ndarray:
    """The q blocks each key tile of the fused kernel sees, int64 [n_tiles]: those j with
    first(j) <= t < last(j), counted through the ranges' ends (linear in the lengths; a tile x
    block table would be quadratic, gigabytes at 4M tokens)."""
    first, last = fused_first_tiles(mask, n_qblocks)
    n_tiles = -(-mask.seq_kv // FUSED_CTA_KEYS)
    ends = np.zeros(n_tiles + 1, np.int64)
    np.add.at(ends, np.clip(first, 0, n_tiles), 1)
    np.add.at(ends, np.clip(np.maximum(last, first), 0, n_tiles), -1)
    return np.cumsum(ends[:-1])


def persistent_plan(mask, n_qblocks: int, kv_heads: int, group: int, batch: int, chunk: int,
                    ctas: int, handout: str = "longest_first") -> np.ndarray:
    """The persistent fused grid's work: int32 [ctas, 1 + most items], per CTA its item count
    and then its items (`fused_item` indices), in the order it runs them.

    Items are handed out in `fused_grid`'s order, each to the CTA with the least work so far
    (in q-block steps, plus ITEM_OVERHEAD_STEPS), ties to the lowest index. Under a causal
    bound a head's low key tiles are its longest, so that order is also longest first. The
    handout "reversed" mirrors the CTA indices (CTA ctas - 1 takes the first item): a test of
    the deadlock argument, which must not depend on which CTA launches first.

    Deadlock-freedom (docs/design.md): a CTA runs its items in handout order, and an item waits
    only on items before it in that order (lower key tiles of its chain). The earliest unfinished
    item is then the current item of its CTA, and everything it waits on is finished: it can
    always proceed, provided all `ctas` CTAs are resident at once (at most one per SM).
    """
    cost = group * fused_tile_blocks(mask, n_qblocks) + ITEM_OVERHEAD_STEPS
    n_tiles = cost.size
    n_items = kv_heads * n_tiles * batch
    tile_of = (np.arange(n_items) // (chunk * batch)) % n_tiles
    return _hand_out(np.arange(n_items), cost[tile_of], ctas, handout)


def _hand_out(items, costs, ctas: int, handout: str) -> np.ndarray:
    """`items` in handout order, each to the CTA with the least work so far (`costs`, ties to
    the lowest index), as the int32 [ctas, 1 + most items] plan of `persistent_plan`."""
    if handout not in HANDOUTS:
        raise ValueError(f"handout must be one of {HANDOUTS}, got {handout!r}")
    loads = [(0, c) for c in range(ctas)]     # a heap of (work so far, CTA)
    owned = [[] for _ in range(ctas)]
    for item, cost in zip(items.tolist(), costs.tolist()):
        load, c = heapq.heappop(loads)
        owned[c].append(item)
        heapq.heappush(loads, (load + cost, c))
    if handout == "reversed":
        owned.reverse()
    width = 1 + max(len(o) for o in owned)
    plan = np.full((ctas, width), -1, np.int32)
    for c, mine in enumerate(owned):
        plan[c, 0] = len(mine)
        plan[c, 1:1 + len(mine)] = mine
    return plan


def forward_item(index, n_tiles: int, q_heads: int):
    """(tile, q head, batch) of persistent forward item `index` (`persistent_forward_plan`)."""
    tile = lax.rem(index, jnp.int32(n_tiles))
    rest = lax.div(index, jnp.int32(n_tiles))
    return tile, lax.rem(rest, jnp.int32(q_heads)), lax.div(rest, jnp.int32(q_heads))


def persistent_forward_plan(mask, n_tiles: int, cta_rows: int, block_kv: int, q_heads: int,
                            batch: int, ctas: int, handout: str = "longest_first") -> np.ndarray:
    """The persistent forward's work, as `persistent_plan` lays it out: items (tile, q head,
    batch), numbered (batch x q_heads + head) x n_tiles + tile, longest first (no item waits
    on another, so any order is safe; a head's tiles stay together among equals, for L2)."""
    starts = np.arange(n_tiles, dtype=np.int32) * cta_rows
    lo, _, _, hi = mask.kv_blocks(starts, cta_rows, block_kv, mask.seq_kv, xp=np)
    steps = np.broadcast_to(np.maximum(hi - lo, 0), starts.shape)
    cost = np.tile(steps + ITEM_OVERHEAD_STEPS, q_heads * batch)
    order = np.argsort(-cost, kind="stable")
    return _hand_out(order, cost[order], ctas, handout)
