"""Split-KV decode kernel for Hopper (sm_90), lowered through Pallas Mosaic GPU.

Contract of `pallas_flash.decode.partial_contract`: per (batch, kv head, split) the split's
softmax-normalised O (float32 [batch, kv_heads, num_splits, rows, head_dim]) and its natural-log
lse (float32 [batch, kv_heads, num_splits, rows]); the caller merges the splits.

Two orientations of the products (`DecodeTiles.keys_as_m`):
- keys as the wgmma M axis (the default where the packed rows are at most 64, head_dim is a
  multiple of 64 and the tiles fit shared memory: 64, 128 and 192): S^T = K Q^T is [block_kv, n] with the n packed rows (rounded up to 8) as
  wgmma N, each row's softmax runs down a column, P^T goes through shared memory, and
  O^T += V^T P^T is [head_dim, n]. A decoding step has 4 to 16 rows per kv head, so nothing is
  computed for padding rows beyond the round-up to 8, and the float32 accumulator is
  head_dim x n, not 64 x head_dim. The partials come out d-major (`d_major`), which the
  combine reads as they are.
- rows as the wgmma M axis (more than 64 rows, or head_dim not a multiple of 64): a CTA owns
  `compute_wgs` 64-row pieces of the packed query rows, one wgmma M tile each.

Grid: (row tile * num_splits + split, kv head, batch), one compute warpgroup a row piece and
one copy warpgroup that streams the split's K and V blocks of `block_kv` keys through `stages`
shared-memory slots. Q is read in place: a piece's rows past plan.rows lie outside the array
(rounded up to 8 rows where it has more), which the TMA fills with zeros, and only rows below
plan.rows are stored (rows never mix, so the spare rows cost neither bandwidth nor, in the
common cases, a padding pass). Decoding is bandwidth-bound; docs/tuning.md ("Mosaic decode")
has the measured slot counts and occupancy. "auto" sends grids of more than one program per SM
to the Triton kernel.

Blocks: contiguous caches are cut into block_kv rows at position j * block_kv. Paged caches
read one page per copy: a block of several pages takes one copy per page into consecutive
rows of the slot (the slot's "loaded" barrier then expects that many arrivals), and a page
larger than a block is read block by block. Logical page indices are clamped to the last page
that holds a key below kv_length, so no block-table entry past it is read.

Page ids outside [0, num_pages) (a traced block table is not checked before the call): the
copy warpgroup copies page 0 in their place, so no copy reads outside the cache, and gives each
slot a page flag, NaN where a page the sequence reads (one holding a key in [the window's first
key, kv_length)) had such an id, else 0. It stores the flag in shared memory (rows of the lse
staging buffer past the compute warpgroups' own, in the slack of its 1 KB allocation) before
the slot's copies. Every copy-warpgroup thread stores it and then arrives on the slot's K
barrier (mbarrier.arrive.expect_tx, release semantics), and the compute warpgroups read it
only after their wait on that barrier (try_wait, acquire): the barrier that hands them the K
block hands them its flag. They read it before arriving on the slot's `free` barrier, which
the copy warpgroup awaits before it writes the slot's next flag. Each compute warpgroup sums
its slots' flags in one float and adds it to O and lse at the end: one scalar add a block on
the healthy path, and NaN in every row of a sequence that read a page outside the cache.

Math: the online softmax of forward.py in base 2, c = logit_scale * log2(e), S in logit units
(q.k, or tanh(q.k * scale / softcap) with a softcap); lse = m * logit_scale + ln(l). Keys are
masked (by an iota compare) only in the blocks at the split's edges, at kv_length and at the
causal / window bounds; every other block runs unmasked.

Unseen rows: a masked block may hold cache rows no query of the CTA sees (stale rows past
kv_length in a recycled cache, the rest of a clamped page, rows before the window), whose
contents are arbitrary. Their K only reaches masked logits, which a select replaces by -inf.
Their V would reach every row through the P V product, where P = 0 does not help (0 * NaN is
NaN on the tensor cores), so in a masked block that holds any (`_zero_unseen_values`) those
V rows are set to 0 in shared memory before the product; other blocks run as they are.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash.mosaic.common import (SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, interpret_params,
                                       softcap_tanh, stream_through_slots)
from pallas_flash.mosaic.config import SMEM_LIMIT, SMEM_RESERVED, WG_ROWS
from pallas_flash.mosaic.tiles import accumulate, product
from pallas_flash.stats import LOG2E

__all__ = ["KERNEL_NAME", "DecodeTiles", "d_major", "default_tiles", "partial",
           "unsupported_reason"]

KERNEL_NAME = "pallas_flash_decode_mosaic"


@dataclasses.dataclass(frozen=True)
class DecodeTiles:
    """Tiles of the decode kernel (docs/tuning.md, "Mosaic decode").

    block_kv: keys per K / V slot, a multiple of 64 dividing plan.chunk; with pages smaller
      than a block, a whole number of pages.
    stages: K / V slots in flight.
    compute_wgs: 64-row pieces of the packed rows per CTA (the rest go to more row tiles).
    """

    block_kv: int
    stages: int
    compute_wgs: int
    keys_as_m: bool = False   # S^T = K Q^T and O^T += V^T P^T, the rows as wgmma N (<= 64)

    def __post_init__(self):
        if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
            raise ValueError(f"DecodeTiles.block_kv must be 64, 128, 192 or 256, got "
                             f"{self.block_kv}")
        if self.stages < 2:
            raise ValueError(f"DecodeTiles.stages must be >= 2, got {self.stages}")
        if self.compute_wgs not in (1, 2):
            raise ValueError(f"DecodeTiles.compute_wgs must be 1 or 2, got {self.compute_wgs}")

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        # The page flags of a paged cache (one float a slot) lie in the slack of the lse
        # buffer's 1 KB allocation: they add nothing here.
        rows = self.compute_wgs * WG_ROWS
        kv = 2 * self.stages * self.block_kv * head_dim * itemsize
        if self.keys_as_m:
            # Q and P (at most 64 columns), O^T and lse in float32, and the reductions'
            # scratch beyond the 2 KB that SMEM_RESERVED holds.
            return (kv + WG_ROWS * (head_dim + self.block_kv) * itemsize
                    + WG_ROWS * head_dim * 4 + WG_ROWS * 4
                    + reduction_scratch_bytes(WG_ROWS) - _DEFAULT_REDUCTION_SCRATCH
                    + SMEM_RESERVED)
        # Q in the input dtype; O and lse staged in float32 for their TMA stores.
        own = rows * head_dim * itemsize + rows * _o_cols(head_dim) * 4 + rows * 4
        return kv + own + SMEM_RESERVED


# Bytes of K and V an SM keeps in flight: the H200's copy rate times its loaded memory latency,
# spread over its 132 SMs, is about half of this.
_SM_IN_FLIGHT = 128 * 1024
# Columns of O staged at a time for its TMA store (at most; `_o_cols`).
_O_COLS = 64
# Cache rows wider than 64 elements are loaded whole into registers when a masked block's
# unseen V rows are zeroed, which Mosaic GPU's swizzled tiles allow for whole 32-element
# groups: head_dim is at most 64, or a multiple of 32. The training kernels' other head dims
# (80, 112, 144, 176, 208, 240) decode on the Triton kernel.
DECODE_HEAD_DIMS = tuple(d for d in SUPPORTED_HEAD_DIMS if d <= 64 or d % 32 == 0)


def _o_cols(head_dim: int) -> int:
    """Columns of each O piece: whole pieces that cover head_dim exactly."""
    if head_dim <= _O_COLS:
        return head_dim
    return next(w for w in (_O_COLS, 32, 16) if head_dim % w == 0)
# Half an SM's shared memory (the hardware keeps 1 KB per CTA): the tiles' size target.
_HALF_SM = (SMEM_LIMIT - 1024) // 2


# Mosaic GPU's default shared memory for cross-warp reductions.
_DEFAULT_REDUCTION_SCRATCH = plgpu.CompilerParams().reduction_scratch_bytes


def reduction_scratch_bytes(n: int) -> int:
    """Shared memory for the keys-as-M softmax's reductions down the columns of a
    [block_kv, n] tile in one round. Mosaic GPU reduces across a warpgroup's four warps through
    this scratch, 1 KB for each 8 columns (a register pair of every thread), and in as many
    rounds, each closed by two barriers, as the scratch needs to take them all: the default
    (2 KB) takes two rounds a block at n = 32 (four new tokens at GQA 8)."""
    return max(_DEFAULT_REDUCTION_SCRATCH, 128 * n)


def keys_n(rows: int) -> int:
    """The wgmma N of the keys-as-M orientation: the packed rows, rounded up to 8."""
    return -(-rows // 8) * 8


def reads_queries_unpacked(plan, tiles: DecodeTiles | None = None) -> bool:
    """Whether `partial` takes the queries as the caller gave them, [batch, q_len, q_heads,
    head_dim], instead of packed: with keys as M where the group is a multiple of 8.

    Then one TMA copy a new token brings its kv head's `group` query heads into rows
    t * group.. of Q's tile, the packed order, so the partials are the same; the caller packs
    nothing, which with more than one new token is a transpose, one more kernel launch before
    every call. Q's tile takes the 128-byte swizzle, into which Mosaic GPU copies only from
    rows that are multiples of 8: a smaller group would need 8 rows a token, and at GQA 4
    those spare columns cost the kernel more than the transpose (docs/tuning.md)."""
    tiles = tiles or default_tiles(plan)
    return tiles.keys_as_m and plan.group % 8 == 0


def default_tiles(plan) -> DecodeTiles:
    """The decode tiles for `plan` (docs/tuning.md has the reasons)."""
    itemsize = jnp.dtype(plan.dtype).itemsize
    # O^T's rows are head_dim, a wgmma M: whole 64s.
    if plan.rows <= WG_ROWS and plan.head_dim % 64 == 0:
        block_kv = 128 if plan.head_dim <= 64 and plan.chunk % 128 == 0 else 64
        tiles = DecodeTiles(block_kv, 2, 1, keys_as_m=True)
        if tiles.smem_bytes(plan.head_dim, itemsize) <= SMEM_LIMIT:
            return tiles
    # 64 keys a block, 128 at head_dim 64: 16 KB copies, and every chunk is a whole number of
    # blocks (a chunk is a multiple of 64 keys).
    block_kv = 128 if plan.head_dim <= 64 and plan.chunk % 128 == 0 else 64
    # Rows past 64 take a second compute warpgroup up to head_dim 128, and above it a second
    # row tile (at 256 the shared memory of two Q tiles and two K / V slots does not fit).
    compute_wgs = 2 if plan.rows > WG_ROWS and plan.head_dim <= 128 else 1
    slot = 2 * block_kv * plan.head_dim * itemsize
    # Slots sized for two CTAs a SM where they fit half its shared memory (registers keep one
    # resident; measured at least as fast as more stages), else one CTA's worth.
    pair = DecodeTiles(block_kv, max(2, _SM_IN_FLIGHT // 2 // slot), compute_wgs)
    if pair.smem_bytes(plan.head_dim, itemsize) <= _HALF_SM:
        return pair
    tiles = DecodeTiles(block_kv, max(2, _SM_IN_FLIGHT // slot), compute_wgs)
    while tiles.stages > 2 and tiles.smem_bytes(plan.head_dim, itemsize) > SMEM_LIMIT:
        tiles = dataclasses.replace(tiles, stages=tiles.stages - 1)
    return tiles


def unsupported_reason(plan, tiles: DecodeTiles | None = None) -> str | None:
    """Why this kernel cannot take the call, or None if it can."""
    dtype = jnp.dtype(plan.dtype)
    if dtype not in SUPPORTED_DTYPES:
        return f"mosaic decode: dtype {dtype.name} (only bfloat16 and float16)"
    if plan.head_dim not in DECODE_HEAD_DIMS:
        return f"mosaic decode: head_dim {plan.head_dim} (only {DECODE_HEAD_DIMS})"
    tiles = tiles or default_tiles(plan)
    if tiles.keys_as_m and (plan.rows > WG_ROWS or plan.head_dim % 64 or tiles.compute_wgs > 1):
        return (f"mosaic decode: keys_as_m needs at most {WG_ROWS} rows, head_dim a multiple "
                f"of 64 and one compute warpgroup (rows {plan.rows}, head_dim {plan.head_dim})")
    if plan.chunk % tiles.block_kv:
        return f"mosaic decode: chunk {plan.chunk} is not a multiple of block_kv {tiles.block_kv}"
    if plan.paged and (max(plan.page_size, tiles.block_kv)
                       % min(plan.page_size, tiles.block_kv)):
        return (f"mosaic decode: page_size {plan.page_size} and block_kv {tiles.block_kv} do not "
                "tile each other")
    if not plan.paged and plan.max_len % 8:
        # Mosaic GPU's TMA takes the cache's sequence axis in whole 8-row tiles, and a cache
        # is never copied to pad it.
        return (f"mosaic decode: a contiguous cache's max_len {plan.max_len} is not a multiple "
                "of 8")
    smem = tiles.smem_bytes(plan.head_dim, dtype.itemsize)
    if smem > SMEM_LIMIT:
        return (f"mosaic decode: tiles {tiles} need {smem} bytes of shared memory at head_dim "
                f"{plan.head_dim} (limit {SMEM_LIMIT})")
    return None


def _bcast_rows(x, shape):
    return lax.broadcast_in_dim(x, shape, [0])


def _clip(x, lo, hi):
    return jnp.minimum(jnp.maximum(x, lo), hi)


def _bcast_cols(x, shape):
    return lax.broadcast_in_dim(x, shape, [1])


def lse_buffer_shape(plan, tiles: DecodeTiles) -> tuple[int, int]:
    """The float32 lse staging buffer: a row per compute warpgroup (one row of the n packed
    rows with keys as M), then, for a paged cache, rows holding one page flag a slot
    (`_page_flags`)."""
    width = keys_n(plan.rows) if tiles.keys_as_m else WG_ROWS
    own = 1 if tiles.keys_as_m else tiles.compute_wgs
    return own + (-(-tiles.stages // width) if plan.paged else 0), width


def _page_flags(buffer, first_row: int, stages: int):
    """slot -> the 0-d ref of that slot's page flag: rows first_row.. of `buffer`, the lse
    staging buffer, whose 1 KB shared-memory allocation has room to spare (every scratch
    buffer starts on a 1 KB boundary), so the flags take no shared memory of their own."""
    width = buffer.shape[-1]

    def at(slot):
        if stages <= width:
            return buffer.at[first_row, slot]
        return buffer.at[first_row + lax.div(slot, jnp.int32(width)),
                         lax.rem(slot, jnp.int32(width))]

    return at


def _poisoned(out, lse, poison):
    """(O, lse) + poison: the NaN of a page outside the cache reaches every element."""
    return out + poison, lse + poison


def _full_blocks(plan, block_kv: int, kv_len, key_lo, key_hi, lo, hi):
    """(full_lo, full_hi): the blocks of [lo, hi) that hold only keys every query row sees:
    inside the split, below kv_len, at or before query 0's position, at or after the last
    query's window. The blocks on either side take the mask."""
    need = key_lo
    if plan.window_left is not None:
        need = jnp.maximum(need, kv_len - 1 - plan.window_left)
    last_full = jnp.minimum(key_hi, kv_len - plan.q_len + 1)
    full_lo = _clip(lax.div(jnp.maximum(need, 0) + (block_kv - 1), jnp.int32(block_kv)), lo, hi)
    full_hi = _clip(lax.div(jnp.maximum(last_full, 0), jnp.int32(block_kv)), full_lo, hi)
    return full_lo, full_hi


def _zero_unseen_values(v_tile, j, seen_lo, seen_hi):
    """Zeroes the rows of block j's V slot whose keys lie outside [seen_lo, seen_hi), in shared
    memory, where the block holds any. A block masked only by the causal bound of the earlier
    new tokens (the last block of a full cache with q_len > 1) holds none, since the last token
    sees all its keys, and its slot is left as it is."""
    block_kv, head_dim = v_tile.shape

    @pl.when((j * block_kv < seen_lo) | ((j + 1) * block_kv > seen_hi))
    def _zero():
        key = plgpu.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0,
                                     layout=plgpu.Layout.WGMMA) + j * block_kv
        v = v_tile[...]
        v_tile[...] = jnp.where((key >= seen_lo) & (key < seen_hi), v, jnp.zeros_like(v))
        # The product reads the slot through the async proxy.
        plgpu.commit_smem()


def _online_softmax(step, init, *, lo, full_lo, full_hi, n_steps):
    """step(i, carry, masked) over the split's blocks i = 0 .. n_steps - 1 (block lo + i): the
    masked leading edge, the unmasked middle, the masked trailing edge."""
    masked = functools.partial(step, masked=True)
    carry = lax.fori_loop(jnp.int32(0), full_lo - lo, masked, init)
    carry = lax.fori_loop(full_lo - lo, full_hi - lo, functools.partial(step, masked=False),
                          carry)
    return lax.fori_loop(full_hi - lo, n_steps, masked, carry)


def _finish(acc, m, l, bcast, logit_scale: float):
    """(O, lse) of the split's rows from the loop's (acc, m, l); bcast spreads a row vector
    over acc. A row that saw no key (l = 0) leaves with O = 0 and lse = -inf."""
    seen = l != 0.0
    out = jnp.where(bcast(seen, acc.shape), acc / bcast(jnp.where(seen, l, 1.0), acc.shape), 0.0)
    return out, jnp.where(m == -jnp.inf, 0.0, m) * logit_scale + jnp.log(l)


def _compute_keys_as_m(*, plan, tiles, q_ref, o_ref, lse_ref, q_smem, k_smem, v_smem, p_smem,
                       o_smem, lse_smem, q_loaded, k_loaded, v_loaded, free, page_flag, wg, batch,
                       kv_head, split, row0, kv_len, key_lo, key_hi, lo, hi, n_steps):
    """The compute warpgroup with keys as the wgmma M axis and the n packed rows as N:
    S^T = K Q^T [block_kv, n], each row's softmax over axis 0, O^T += V^T P^T [head_dim, n]
    (P^T through shared memory, wgmma's B operand). The rows past plan.rows see whatever the
    TMA filled Q with and are never stored."""
    block_kv, stages = tiles.block_kv, tiles.stages
    head_dim, q_len, group = plan.head_dim, plan.q_len, plan.group
    n = keys_n(plan.rows)
    dtype = q_ref.dtype
    logit_scale = plan.scale if plan.softcap is None else plan.softcap
    c = logit_scale * LOG2E

    @pl.when(wg == 0)
    def _compute():
        if reads_queries_unpacked(plan, tiles):
            # One copy (one arrival on q_loaded) per new token.
            for t in range(q_len):
                plgpu.copy_gmem_to_smem(q_ref.at[batch * q_len + t, pl.ds(kv_head * group, group)],
                                        q_smem.at[0, pl.ds(t * group, group)], q_loaded.at[0])
        else:
            # The n-row box may reach past the array's rows (n rounds plan.rows up to 8), which
            # the TMA fills with zeros. row0 (0: these grids have one row tile) is traced, as in
            # the rows-as-M path: jax 0.12 refuses a static slice past an array's end at trace
            # time.
            plgpu.copy_gmem_to_smem(q_ref.at[batch * plan.kv_heads + kv_head, pl.ds(row0, n)],
                                    q_smem.at[0], q_loaded.at[0])
        full_lo, full_hi = _full_blocks(plan, block_kv, kv_len, key_lo, key_hi, lo, hi)
        seen_hi = jnp.minimum(key_hi, lax.div(plan.rows - 1, group) + (kv_len - q_len + 1))
        seen_lo = key_lo
        if plan.window_left is not None:
            seen_lo = jnp.maximum(seen_lo, kv_len - q_len - plan.window_left)

        def step(i, carry, masked: bool):
            acc, m, l, *poison = carry
            j = lo + i
            slot = lax.rem(i, jnp.int32(stages))
            plgpu.barrier_wait(k_loaded.at[slot])
            if page_flag is not None:
                # Written by the copy warpgroup before its arrivals on k_loaded[slot].
                poison = [poison[0] + page_flag(slot)[...]]

            def logits(s_ref):
                plgpu.wgmma(s_ref, k_smem.at[slot], q_smem.at[0].T)
                return s_ref[...]

            s = pl.run_scoped(logits, plgpu.ACC((block_kv, n), jnp.float32))
            if plan.softcap is not None:
                s = softcap_tanh(s * (plan.scale / plan.softcap))
            if masked:
                shape = (block_kv, n)
                key = plgpu.broadcasted_iota(jnp.int32, shape, 0,
                                             layout=plgpu.Layout.WGMMA) + j * block_kv
                row = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
                q_pos = lax.div(row, jnp.int32(group)) + (kv_len - q_len)
                ok = (key >= key_lo) & (key < key_hi) & (key <= q_pos)
                if plan.window_left is not None:
                    ok = ok & (key >= q_pos - plan.window_left)
                s = jnp.where(ok, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=0))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2((m - m_safe) * c)
            p = jnp.exp2(s * c - _bcast_cols(m_safe * c, s.shape))
            # The row sums stay per element until the loop ends: a sum down a column crosses
            # the warpgroup's four warps (through shared memory and a barrier), and the max
            # above is the only such reduction a block needs.
            l = l * _bcast_cols(alpha, l.shape) + p
            acc = acc * _bcast_cols(alpha, acc.shape)
            p_smem.T[...] = p.astype(dtype)
            plgpu.commit_smem()
            plgpu.barrier_wait(v_loaded.at[slot])
            if masked:
                _zero_unseen_values(v_smem.at[slot], j, seen_lo, seen_hi)
            acc = accumulate(acc, v_smem.at[slot].T, p_smem.T, interpret=plan.interpret)
            plgpu.barrier_arrive(free.at[slot])
            return acc, m_new, l, *poison

        acc = plgpu.layout_cast(jnp.zeros((head_dim, n), jnp.float32), plgpu.Layout.WGMMA)
        m = plgpu.layout_cast(jnp.full((n,), -jnp.inf, jnp.float32),
                              plgpu.Layout.WGMMA.reduce(0))
        l = plgpu.layout_cast(jnp.zeros((block_kv, n), jnp.float32), plgpu.Layout.WGMMA)
        poison = () if page_flag is None else (jnp.float32(0.0),)
        plgpu.barrier_wait(q_loaded.at[0])
        acc, m, l, *poison = _online_softmax(step, (acc, m, l, *poison), lo=lo, full_lo=full_lo,
                                             full_hi=full_hi, n_steps=n_steps)
        out, lse = _finish(acc, m, jnp.sum(l, axis=0), _bcast_cols, logit_scale)
        if poison:
            out, lse = _poisoned(out, lse, poison[0])
        lse_smem.at[0][...] = lse
        o_smem.at[0][...] = out
        plgpu.commit_smem()
        cell_out = (batch * plan.kv_heads + kv_head) * plan.num_splits + split
        plgpu.copy_smem_to_gmem(o_smem.at[0], o_ref.at[cell_out])
        plgpu.copy_smem_to_gmem(lse_smem.at[0], lse_ref.at[cell_out])
        plgpu.wait_smem_to_gmem(0)


def _kernel(*refs, plan, tiles: DecodeTiles):
    if plan.paged:
        q_ref, k_ref, v_ref, lens_ref, table_ref, *rest = refs
    else:
        q_ref, k_ref, v_ref, lens_ref, *rest = refs
        table_ref = None
    (o_ref, lse_ref, q_smem, k_smem, v_smem, o_smem, lse_smem,
     q_loaded, k_loaded, v_loaded, free, *extra) = rest
    v_clean = extra.pop(0) if tiles.compute_wgs > 1 else None
    p_smem = extra   # interpret mode only; with keys_as_m, P's staging buffer
    # Paged: each slot's page flag, in the rows of lse_smem past the compute warpgroups' lse.
    page_flag = (_page_flags(lse_smem, 1 if tiles.keys_as_m else tiles.compute_wgs,
                             tiles.stages) if plan.paged else None)
    block_kv, stages, wgs = tiles.block_kv, tiles.stages, tiles.compute_wgs
    head_dim, q_len, group = plan.head_dim, plan.q_len, plan.group
    dtype = q_ref.dtype
    logit_scale = plan.scale if plan.softcap is None else plan.softcap
    c = logit_scale * LOG2E

    cell = lax.axis_index("cell")
    kv_head = lax.axis_index("head")
    batch = lax.axis_index("batch")
    wg = lax.axis_index("wg")
    n_splits = jnp.int32(plan.num_splits)
    split = lax.rem(cell, n_splits)
    tile = lax.div(cell, n_splits)

    # The split's keys: [key_lo, key_hi), cut to kv_length and to the first key any query of
    # the window sees (query 0 sits at kv_len - q_len); blocks [lo, hi) cover them.
    kv_len = lens_ref[batch]
    key_lo = split * plan.chunk
    key_hi = jnp.minimum(key_lo + plan.chunk, kv_len)
    first = key_lo
    if plan.window_left is not None:
        first = jnp.maximum(first, kv_len - q_len - plan.window_left)
    lo = lax.div(jnp.maximum(first, 0), jnp.int32(block_kv))
    hi = jnp.maximum(lax.div(key_hi + (block_kv - 1), jnp.int32(block_kv)), lo)
    n_steps = hi - lo
    # The first key of the window (token 0's), or None: the pages before it are not read.
    first_key = None if plan.window_left is None else kv_len - q_len - plan.window_left

    if tiles.keys_as_m:
        _compute_keys_as_m(
            plan=plan, tiles=tiles, q_ref=q_ref, o_ref=o_ref, lse_ref=lse_ref, q_smem=q_smem,
            k_smem=k_smem, v_smem=v_smem, p_smem=p_smem[0], o_smem=o_smem, lse_smem=lse_smem,
            q_loaded=q_loaded, k_loaded=k_loaded, v_loaded=v_loaded, free=free,
            page_flag=page_flag, wg=wg, batch=batch, kv_head=kv_head, split=split,
            row0=tile * keys_n(plan.rows), kv_len=kv_len, key_lo=key_lo, key_hi=key_hi, lo=lo,
            hi=hi, n_steps=n_steps)

    def _compute():
        row0 = (tile * wgs + wg) * WG_ROWS
        my_q = q_smem.at[wg]
        plgpu.copy_gmem_to_smem(
            q_ref.at[batch * plan.kv_heads + kv_head, pl.ds(row0, WG_ROWS)], my_q,
            q_loaded.at[wg])

        full_lo, full_hi = _full_blocks(plan, block_kv, kv_len, key_lo, key_hi, lo, hi)

        # Keys [seen_lo, seen_hi) are the ones some query row of this CTA sees (its first row
        # has the earliest window, its last real row the latest causal bound): the only V rows
        # of a masked block that may reach O.
        cta_rows = wgs * WG_ROWS
        cta_first = tile * cta_rows
        cta_last = jnp.minimum(cta_first + cta_rows, plan.rows) - 1
        seen_hi = jnp.minimum(key_hi, lax.div(cta_last, jnp.int32(group)) + (kv_len - q_len + 1))
        seen_lo = key_lo
        if plan.window_left is not None:
            seen_lo = jnp.maximum(seen_lo, lax.div(cta_first, jnp.int32(group))
                                  + (kv_len - q_len - plan.window_left))

        def zero_unseen_values(j, slot):
            _zero_unseen_values(v_smem.at[slot], j, seen_lo, seen_hi)

        def clean_values(j, slot):
            if wgs == 1:
                zero_unseen_values(j, slot)
                return
            # The warpgroups share the slot: the first rewrites it (the unseen rows are those
            # of the whole CTA), the others wait for it before their products.
            @pl.when(wg == 0)
            def _first():
                zero_unseen_values(j, slot)
                plgpu.barrier_arrive(v_clean.at[slot])

            @pl.when(wg != 0)
            def _others():
                plgpu.barrier_wait(v_clean.at[slot])

        def visible_logits(j, s, masked: bool):
            if plan.softcap is not None:
                s = softcap_tanh(s * (plan.scale / plan.softcap))
            if not masked:
                return s
            shape = (WG_ROWS, block_kv)
            rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
            cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
            key = cols + j * block_kv
            q_pos = lax.div(rows + row0, jnp.int32(group)) + (kv_len - q_len)
            ok = (key >= key_lo) & (key < key_hi) & (key <= q_pos)
            if plan.window_left is not None:
                ok = ok & (key >= q_pos - plan.window_left)
            return jnp.where(ok, s, -jnp.inf)

        def step(i, carry, masked: bool):
            acc, m, l, *poison = carry
            j = lo + i
            slot = lax.rem(i, jnp.int32(stages))
            plgpu.barrier_wait(k_loaded.at[slot])
            if page_flag is not None:
                # Written by the copy warpgroup before its arrivals on k_loaded[slot].
                poison = [poison[0] + page_flag(slot)[...]]

            def logits(s_ref):
                plgpu.wgmma(s_ref, my_q, k_smem.at[slot].T)
                return s_ref[...]

            s = pl.run_scoped(logits, plgpu.ACC((WG_ROWS, block_kv), jnp.float32))
            u = visible_logits(j, s, masked)
            m_new = jnp.maximum(m, jnp.max(u, axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2((m - m_safe) * c)
            p = jnp.exp2(u * c - _bcast_rows(m_safe * c, u.shape))
            l = l * alpha + jnp.sum(p, axis=1)
            acc = acc * _bcast_rows(alpha, acc.shape)
            p_in = p.astype(dtype)
            plgpu.barrier_wait(v_loaded.at[slot])
            if masked:
                clean_values(j, slot)

            if plan.interpret:
                # The interpreter takes no wgmma operand in registers: P goes through smem.
                acc = product(acc, p_in, v_smem.at[slot], interpret=True,
                              stage_ref=p_smem[0].at[wg])
            else:
                def weighted_values(acc_ref):
                    plgpu.wgmma(acc_ref, p_in, v_smem.at[slot])

                acc = pl.run_state(weighted_values)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(free.at[slot])
            return acc, m_new, l, *poison

        acc = plgpu.layout_cast(jnp.zeros((WG_ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA)
        m = plgpu.layout_cast(jnp.full((WG_ROWS,), -jnp.inf, jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1))
        l = plgpu.layout_cast(jnp.zeros((WG_ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        poison = () if page_flag is None else (jnp.float32(0.0),)
        plgpu.barrier_wait(q_loaded.at[wg])
        acc, m, l, *poison = _online_softmax(step, (acc, m, l, *poison), lo=lo, full_lo=full_lo,
                                             full_hi=full_hi, n_steps=n_steps)
        out, lse = _finish(acc, m, l, _bcast_rows, logit_scale)
        if poison:
            out, lse = _poisoned(out, lse, poison[0])
        lse_smem.at[wg][...] = lse
        # Every store stays inside the outputs: whole 64-row pieces, then the last piece's
        # rows alone (a TMA box past the rows axis would reach the next cell's rows). O leaves
        # in column pieces through one float32 staging buffer (head_dim 256 fits no larger).
        cell_out = (batch * plan.kv_heads + kv_head) * n_splits + split
        width = _o_cols(head_dim)

        def store(n: int):
            for piece in range(head_dim // width):
                if piece:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                cols = slice(piece * width, (piece + 1) * width)
                o_smem.at[wg][...] = out if width == head_dim else out[:, cols]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    o_smem.at[wg, pl.ds(0, n)],
                    o_ref.at[cell_out, pl.ds(row0, n), pl.ds(piece * width, width)])
            n_lse = -n % 4 + n   # the lse rows are padded to a multiple of 4 (partial)
            plgpu.copy_smem_to_gmem(lse_smem.at[wg, pl.ds(0, n_lse)],
                                    lse_ref.at[cell_out, pl.ds(row0, n_lse)])

        whole, rest_rows = divmod(plan.rows, WG_ROWS)
        if whole:
            pl.when(tile * wgs + wg < whole)(lambda: store(WG_ROWS))
        if rest_rows:
            pl.when(tile * wgs + wg == whole)(lambda: store(rest_rows))
        plgpu.wait_smem_to_gmem(0)

    if not tiles.keys_as_m:
        pl.when(wg < wgs)(_compute)

    @pl.when(wg == wgs)
    def _copy():
        def issue(i, slot):
            j = lo + i
            if not plan.paged:
                rows = (batch, pl.ds(j * block_kv, block_kv), kv_head)
                plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_loaded.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_loaded.at[slot])
                return
            page_size = plan.page_size
            # The last logical page that holds a key below kv_len (lo < hi implies kv_len > 0).
            last_page = lax.div(kv_len - 1, jnp.int32(page_size))

            def checked(page):
                """(page, outside): an id outside the cache (a traced table is not checked
                before the call) is copied as page 0, so the TMA stays inside the cache."""
                outside = (page < 0) | (page >= k_ref.shape[0])
                return jnp.where(outside, 0, page), outside

            if page_size >= block_kv:
                # Block j holds a key in [first key of the window, kv_len): its page is read.
                page, poisoned = checked(
                    table_ref[batch, lax.div(j * block_kv, jnp.int32(page_size))])
                offset = lax.rem(j * block_kv, jnp.int32(page_size))
                copies = [((page, pl.ds(offset, block_kv), kv_head), slice(None))]
            else:
                per_block = block_kv // page_size
                copies, poisoned = [], jnp.bool_(False)
                for piece in range(per_block):
                    logical = j * per_block + piece
                    page, outside = checked(table_ref[batch, jnp.minimum(logical, last_page)])
                    # A piece past the last page repeats it; one wholly before the window is
                    # not read (its V rows are zeroed, its logits masked): neither is flagged.
                    read = logical <= last_page
                    if first_key is not None:
                        read = read & ((logical + 1) * page_size > first_key)
                    poisoned = poisoned | (outside & read)
                    copies.append(((page, pl.ds(0, page_size), kv_head),
                                   pl.ds(piece * page_size, page_size)))
            # Before the copies: their arrivals on k_loaded[slot] (each a release) publish the
            # flag to the compute warpgroups, whose wait on that barrier acquires it.
            page_flag(slot)[...] = jnp.where(poisoned, jnp.float32(jnp.nan), jnp.float32(0.0))
            for rows, dst in copies:
                plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot, dst], k_loaded.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot, dst], v_loaded.at[slot])

        stream_through_slots(issue, free, stages, n_steps)


def partial(plan, q_packed, k_cache, v_cache, kv_lengths, block_table, *,
            tiles: DecodeTiles | None = None):
    """(o_part, lse_part) of `pallas_flash.decode.partial_contract`; where
    `reads_queries_unpacked`, q_packed is the queries as the caller gave them.

    Raises NotImplementedError for anything this kernel does not serve (`unsupported_reason`).
    """
    tiles = tiles or default_tiles(plan)
    reason = unsupported_reason(plan, tiles)
    if reason is not None:
        raise NotImplementedError(reason)
    if tiles.keys_as_m:
        return _partial_keys_as_m(plan, tiles, q_packed, k_cache, v_cache, kv_lengths,
                                  block_table)
    wgs = tiles.compute_wgs
    n_tiles = pl.cdiv(plan.rows, wgs * WG_ROWS)
    batch, kv_heads, rows, head_dim = q_packed.shape
    splits = plan.num_splits
    dtype = q_packed.dtype
    # The lse rows are the minor axis of a TMA store, whose strides must be 16-byte multiples:
    # rows are padded to a multiple of 4 there and sliced off after.
    lse_rows = -rows % 4 + rows
    # A block of several pages is filled by one copy per page, each an arrival.
    pieces = (tiles.block_kv // plan.page_size
              if plan.paged and plan.page_size < tiles.block_kv else 1)
    scratch = [
        plgpu.SMEM((wgs, WG_ROWS, head_dim), dtype),
        plgpu.SMEM((tiles.stages, tiles.block_kv, head_dim), dtype),
        plgpu.SMEM((tiles.stages, tiles.block_kv, head_dim), dtype),
        plgpu.SMEM((wgs, WG_ROWS, _o_cols(head_dim)), jnp.float32),
        plgpu.SMEM(lse_buffer_shape(plan, tiles), jnp.float32),
        plgpu.Barrier(num_barriers=wgs),
        plgpu.Barrier(num_arrivals=pieces, num_barriers=tiles.stages),
        plgpu.Barrier(num_arrivals=pieces, num_barriers=tiles.stages),
        # A slot is free once every compute warpgroup is done with its K and V.
        plgpu.Barrier(num_arrivals=wgs, num_barriers=tiles.stages),
    ]
    if wgs > 1:
        # A masked block's V slot is rewritten by the first compute warpgroup (v_clean).
        scratch.append(plgpu.Barrier(num_barriers=tiles.stages))
    if plan.interpret:
        scratch.append(plgpu.SMEM((wgs, WG_ROWS, tiles.block_kv), dtype))
    # One leading axis per (batch, kv head, split) cell: each store is then a plain 2-D box.
    cells = batch * kv_heads * splits
    out_type = (jax.ShapeDtypeStruct((cells, rows, head_dim), jnp.float32),
                jax.ShapeDtypeStruct((cells, lse_rows), jnp.float32))
    call = plgpu.kernel(
        functools.partial(_kernel, plan=plan, tiles=tiles),
        out_type=out_type,
        scratch_types=scratch,
        grid=(n_tiles * splits, kv_heads, batch),
        grid_names=("cell", "head", "batch"),
        num_threads=wgs + 1,   # the copy warpgroup last (index compute_wgs)
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params(plan.interpret, wgs + 1),
        kernel_name=KERNEL_NAME,
    )
    # Not padded to whole 64-row pieces: the TMA zero-fills a piece's rows past `rows`, and a
    # padding fusion would be one more launch in every decoding step's chain of kernels. Mosaic
    # GPU's TMA takes an axis of more than 8 rows only in whole 8-row tiles, so such rows (q_len
    # 3 at GQA 4, say) are padded to the next multiple of 8.
    q_rows = rows if rows <= 8 else -(-rows // 8) * 8
    q = q_packed
    if q_rows > rows:
        q = jnp.pad(q, ((0, 0), (0, 0), (0, q_rows - rows), (0, 0)))
    q = q.reshape(batch * kv_heads, q_rows, head_dim)
    args = [q, k_cache, v_cache, kv_lengths.astype(jnp.int32)]
    if plan.paged:
        args.append(block_table.astype(jnp.int32))
    o_part, lse_part = call(*args)
    o_part = o_part.reshape(batch, kv_heads, splits, rows, head_dim)
    lse_part = lse_part.reshape(batch, kv_heads, splits, lse_rows)
    if lse_rows != rows:
        lse_part = lse_part[..., :rows]
    return o_part, lse_part


def _partial_keys_as_m(plan, tiles, q_packed, k_cache, v_cache, kv_lengths, block_table):
    batch, kv_heads, rows, head_dim = plan.batch, plan.kv_heads, plan.rows, plan.head_dim
    unpacked = reads_queries_unpacked(plan, tiles)
    splits = plan.num_splits
    dtype = q_packed.dtype
    n = keys_n(rows)
    pieces = (tiles.block_kv // plan.page_size
              if plan.paged and plan.page_size < tiles.block_kv else 1)
    scratch = [
        plgpu.SMEM((1, n, head_dim), dtype),
        plgpu.SMEM((tiles.stages, tiles.block_kv, head_dim), dtype),
        plgpu.SMEM((tiles.stages, tiles.block_kv, head_dim), dtype),
        plgpu.SMEM((1, head_dim, n), jnp.float32),
        plgpu.SMEM(lse_buffer_shape(plan, tiles), jnp.float32),
        plgpu.Barrier(num_arrivals=plan.q_len if unpacked else 1, num_barriers=1),
        plgpu.Barrier(num_arrivals=pieces, num_barriers=tiles.stages),
        plgpu.Barrier(num_arrivals=pieces, num_barriers=tiles.stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=tiles.stages),
        plgpu.SMEM((n, tiles.block_kv), dtype),
    ]
    cells = batch * kv_heads * splits
    # Pallas puts a warpgroup barrier before and after every store to shared memory; with a
    # contiguous cache this kernel needs neither, two barriers a block fewer. P^T's store is
    # followed by commit_smem (a fence and a barrier) before the product reads it, and comes
    # after the block's column max, whose cross-warp reduction holds barriers that every warp
    # reaches only after its previous product finished reading P^T. A masked block's V rewrite
    # stores, per element, a value of that element alone (itself or zero), so no interleaving
    # of the threads' loads and stores changes it. A paged cache keeps the barriers: there the
    # copy warpgroup's threads store each slot's page flag, which the barrier orders before
    # the copy's arrival publishes it.
    out_type = (jax.ShapeDtypeStruct((cells, head_dim, n), jnp.float32),
                jax.ShapeDtypeStruct((cells, n), jnp.float32))
    call = plgpu.kernel(
        functools.partial(_kernel, plan=plan, tiles=tiles),
        out_type=out_type,
        scratch_types=scratch,
        grid=(splits, kv_heads, batch),
        grid_names=("cell", "head", "batch"),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, reduction_scratch_bytes=reduction_scratch_bytes(n),
            unsafe_no_auto_barriers=not plan.paged),
        interpret=interpret_params(plan.interpret, 2),
        kernel_name=KERNEL_NAME,
    )
    if unpacked:
        q = q_packed.reshape(batch * plan.q_len, plan.q_heads, head_dim)  # free
    else:
        q_rows = rows if rows <= 8 else n
        q = q_packed
        if q_rows > rows:
            q = jnp.pad(q, ((0, 0), (0, 0), (0, q_rows - rows), (0, 0)))
        q = q.reshape(batch * kv_heads, q_rows, head_dim)
    args = [q, k_cache, v_cache, kv_lengths.astype(jnp.int32)]
    if plan.paged:
        args.append(block_table.astype(jnp.int32))
    o_t, lse = call(*args)
    return (o_t.reshape(batch, kv_heads, splits, head_dim, n),
            lse.reshape(batch, kv_heads, splits, n))


def d_major(plan, tiles: DecodeTiles | None = None) -> bool:
    """Whether `partial` returns d-major partials (O^T [..., head_dim, n], lse [..., n])."""
    return (tiles or default_tiles(plan)).keys_as_m
