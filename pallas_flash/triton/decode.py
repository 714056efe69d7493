"""Split-KV decode kernels, lowered through Pallas Triton: the partial pass and the combine.

Partial ("pallas_flash_decode"). Grid: (batch, kv_heads * row tiles, num_splits). A program
holds up to MAX_ROW_TILE packed query rows of one kv head (the query heads of its group times
the q_len tokens, padded to a power of two >= 16; one tile unless q_len * group is large) and
walks the BLOCK_KV-key blocks of its split's chunk, up to the sequence's kv_length, with the
online softmax of forward.py in natural-log logits u and base 2 (c = log2 e):
    m_j = max(m_{j-1}, rowmax(U_j)),  alpha_j = 2^((m_{j-1} - m_j) c),  P_j = 2^((U_j - m_j) c)
    l_j = l_{j-1} alpha_j + rowsum(P_j),  acc_j = acc_{j-1} alpha_j + P_j V_j
and writes O = acc / l and lse = m + ln(l), float32 (an empty chunk: O = 0, lse = -inf).
A paged cache is read by a gather: each key row of a block takes its physical page from the
block table, so a block may span several pages smaller than itself. In the masked blocks a key
row outside [the window's first key, the chunk's end) reads 0 without looking at its table
entry or its cache row, which may hold anything. A page id outside [0, num_pages) on a key row
that is read (a traced block table is not checked before the call) is gathered as page 0, so
the gather stays inside the cache, and the program adds NaN to its O and lse: every row of
that sequence comes out NaN instead of an answer from the wrong page.

Combine ("pallas_flash_decode_combine"). Merges the splits exactly: lse = log sum_s exp(lse_s),
O = sum_s exp(lse_s - lse) O_s, a block of splits per round of loads against a running max, with
the weights taken against 0 while every split is empty, so such a row stays O = 0, lse = -inf.
A split whose lse is NaN (a page outside the cache) makes the row's O and lse NaN. Row-major
partials [..., rows, head_dim] (this module's): grid (batch, kv_heads * rows), a packed row
each, whose O row is contiguous. d-major partials [..., head_dim, n] (the Mosaic keys-as-M
kernel's): grid (batch, kv_heads * q_len, head_dim blocks), one new token's group of packed rows
each, which are adjacent columns there: a program reading a single row would take one element
per row of O^T, a memory sector each.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flash.triton import common

__all__ = ["partial", "combine", "d_major", "unsupported_reason"]

# Keys per block: a power of two that divides every chunk (decode.CHUNK_ALIGN).
BLOCK_KV = 64
# Packed rows per program at most: a 64 x 256 float32 accumulator is 128 registers a thread.
MAX_ROW_TILE = 64
_LOG2E = math.log2(math.e)


def unsupported_reason(plan) -> str | None:
    """Triton serves every plan that validation lets through."""
    del plan
    return None


def _positions(start, block: int):
    return start + jnp.arange(block, dtype=jnp.int32)


def _bounds(plan, kv_len, split, block: int):
    """Key blocks (lo, full_lo, full_hi, hi) of this split: [lo, hi) may hold a visible key,
    [full_lo, full_hi) only keys that every packed row sees (no mask needed)."""
    start = split * plan.chunk
    end = jnp.minimum(start + plan.chunk, kv_len)
    relu = lambda x: jnp.maximum(x, jnp.int32(0))  # noqa: E731  (lax.div truncates to 0)
    first_pos = kv_len - plan.q_len  # position of token 0; the last token's is kv_len - 1
    lo = start
    full_lo = start
    if plan.window_left is not None:
        lo = jnp.maximum(start, relu(first_pos - plan.window_left))
        full_lo = jnp.maximum(start, relu(kv_len - 1 - plan.window_left))
    lo = lax.div(lo, jnp.int32(block))
    full_lo = lax.div(full_lo + (block - 1), jnp.int32(block))
    hi = lax.div(relu(end) + (block - 1), jnp.int32(block))
    full_hi = lax.div(relu(jnp.minimum(end, first_pos + 1)), jnp.int32(block))
    hi = jnp.maximum(hi, lo)
    full_lo = jnp.clip(full_lo, lo, hi)
    full_hi = jnp.clip(full_hi, full_lo, hi)
    return lo, full_lo, full_hi, hi


def row_tiling(plan) -> tuple[int, int]:
    """(rows per program, programs per kv head): one tile of all packed rows, padded to a power
    of two >= 16, unless that passes MAX_ROW_TILE (q_len 16 with a large group), whose float32
    accumulator would not fit in registers; then K/V is read once per row tile."""
    tile = min(MAX_ROW_TILE, max(common.MIN_TILE, pl.next_power_of_2(plan.rows)))
    return tile, pl.cdiv(plan.rows, tile)


def _partial_kernel(*refs, plan, rows_pad: int, n_tiles: int, d_pad: int, block: int):
    if plan.paged:
        q_ref, k_ref, v_ref, len_ref, table_ref, o_ref, lse_ref = refs
    else:
        q_ref, k_ref, v_ref, len_ref, o_ref, lse_ref = refs
        table_ref = None
    # Program ids are read up front: interpret mode substitutes them only outside control flow.
    b, split = pl.program_id(0), pl.program_id(2)
    row_start = lax.rem(pl.program_id(1), jnp.int32(n_tiles)) * rows_pad
    kv_len = len_ref[b]
    acc_dtype = common.accumulator_dtype(q_ref.dtype)
    cols = common.column_mask(plan.head_dim, d_pad)
    # Decoding is bandwidth-bound: float32 operands get full-precision (not tf32) products.
    precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None
    q = common.load_tile(q_ref, row_start, rows_pad, plan.rows, cols)
    # Packed row r is token r // group, at position kv_len - q_len + r // group.
    row_pos = kv_len - plan.q_len + lax.div(_positions(row_start, rows_pad),
                                            jnp.int32(plan.group))

    chunk_end = jnp.minimum((split + 1) * plan.chunk, kv_len)
    # The window's first key (token 0's): keys before it reach no row, so a masked block reads
    # them as 0 (their cache rows, or their pages, may hold anything).
    first_key = (None if plan.window_left is None
                 else jnp.maximum(kv_len - plan.q_len - plan.window_left, 0))

    def key_rows(start, masked):
        """(rows, read): the block's key positions, and which of them hold keys this split
        reads ([first_key, chunk_end)); None in an unmasked block, which lies wholly inside."""
        rows = _positions(start, block)
        if not masked:
            return rows, None
        read = rows < chunk_end
        if first_key is not None:
            read = read & (rows >= first_key)
        return rows, read

    def physical_pages(rows, read):
        """(page, offset, outside): each key row's physical page from the block table and its
        row there, and 1 where a page the split reads is outside the cache (a traced table is
        not checked before the call), else 0. Such an id is read as page 0, so the gather stays
        inside the cache, and `outside` makes every row of the program NaN. Rows not read
        (past the chunk, before the window) take page 0 and are never flagged, whatever their
        entry holds."""
        logical = lax.div(rows, jnp.int32(plan.page_size))
        # Rows past the chunk may index past the table: masked.
        page = (plgpu.load(table_ref.at[logical]) if read is None
                else plgpu.load(table_ref.at[logical], mask=read, other=0))
        bad = (page < 0) | (page >= k_ref.shape[0])
        return (jnp.where(bad, 0, page), rows - logical * plan.page_size,
                jnp.max(bad.astype(jnp.int32)))

    def load_kv(ref, start, read, pages):
        mask = None if read is None else read[:, None]
        if cols is not None:
            mask = cols if mask is None else mask & cols
        if pages is None:
            view = ref.at[pl.ds(start, block), pl.ds(jnp.int32(0), d_pad)]
        else:
            # A gather: each key row finds its own physical page, so a block may span pages
            # smaller than itself. Array indices on every axis (interpret mode gathers no mix
            # of slices and arrays).
            page, offset = pages
            view = ref.at[page[:, None], offset[:, None],
                          jnp.arange(d_pad, dtype=jnp.int32)[None, :]]
        if mask is None:  # the lowering takes `other` only with a mask
            return plgpu.load(view)
        return plgpu.load(view, mask=mask, other=0.0)

    def step(j, carry, masked):
        acc, m, l, outside = carry
        start = j * block
        rows, read = key_rows(start, masked)
        pages = None
        if table_ref is not None:
            page, offset, bad = physical_pages(rows, read)
            pages = (page, offset)
            outside = jnp.maximum(outside, bad)
        # Positions outside [first_key, chunk_end) read 0: whatever a cache holds there (stale
        # rows, NaN) never reaches P V.
        k = load_kv(k_ref, start, read, pages)
        v = load_kv(v_ref, start, read, pages)
        # Logits in natural units (the scale applied to the tile, not folded into exp2): the
        # row max is then the max logit for any sign of scale.
        u = plgpu.dot(q, k, trans_b=True, precision=precision) * plan.scale
        if plan.softcap is not None:
            u = plan.softcap * jnp.tanh(u * (1.0 / plan.softcap))
        if masked:
            k_pos = rows[None, :]
            vis = (k_pos <= row_pos[:, None]) & (k_pos < chunk_end)
            if plan.window_left is not None:
                vis = vis & (k_pos >= row_pos[:, None] - plan.window_left)
            u = jnp.where(vis, u, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(u, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2((m - m_safe) * _LOG2E)
        p = jnp.exp2((u - m_safe[:, None]) * _LOG2E)
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
        return acc, m_new, l, outside

    init = (jnp.zeros((rows_pad, d_pad), acc_dtype),
            jnp.full((rows_pad,), -jnp.inf, acc_dtype),
            jnp.zeros((rows_pad,), acc_dtype),
            jnp.int32(0))
    acc, m, l, outside = common.three_phase_loop(_bounds(plan, kv_len, split, block), step, init)
    seen = l > 0
    out = acc / jnp.where(seen, l, 1.0)[:, None]
    lse = jnp.where(seen, jnp.where(seen, m, 0.0) + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    if table_ref is not None:
        # NaN + x is NaN: a page outside the cache poisons every row's O and lse, never leaving
        # a finite answer computed from page 0.
        poison = jnp.where(outside > 0, jnp.float32(jnp.nan), jnp.float32(0.0))
        out = out + poison
        lse = lse + poison
    common.store_tile(o_ref, row_start, rows_pad, plan.rows, cols, out)
    ok = _positions(row_start, rows_pad) < plan.rows
    plgpu.store(lse_ref.at[pl.ds(row_start, rows_pad)], lse.astype(lse_ref.dtype), mask=ok)


def d_major(plan, tiles=None) -> bool:
    """Whether `partial` returns d-major partials: never here (O [..., rows, head_dim])."""
    return False


def reads_queries_unpacked(plan, tiles=None) -> bool:
    """Whether `partial` takes the queries unpacked: never here (pallas_flash.decode's
    partial_contract)."""
    return False


def partial(plan, q_packed, k_cache, v_cache, kv_lengths, block_table):
    """Per-split (O, lse); shapes and meaning in pallas_flash.decode.partial_contract."""
    rows_pad, n_tiles = row_tiling(plan)
    d_pad = common.padded_head_dim(plan.head_dim)
    stats = common.accumulator_dtype(plan.dtype)
    # Grid axis 1 is (kv head, row tile); every row tile of a head shares its blocks.
    grid = (plan.batch, plan.kv_heads * n_tiles, plan.num_splits)
    q_spec = pl.BlockSpec((None, None, plan.rows, d_pad), lambda b, i, s: (b, i // n_tiles, 0, 0))
    if plan.paged:
        num_pages = k_cache.shape[0]
        kv_spec = pl.BlockSpec((num_pages, plan.page_size, None, d_pad),
                               lambda b, i, s: (0, 0, i // n_tiles, 0))
    else:
        kv_spec = pl.BlockSpec((None, plan.max_len, None, d_pad),
                               lambda b, i, s: (b, 0, i // n_tiles, 0))
    len_spec = pl.BlockSpec((plan.batch,), lambda b, i, s: (0,))
    in_specs = [q_spec, kv_spec, kv_spec, len_spec]
    args = [q_packed, k_cache, v_cache, kv_lengths]
    if plan.paged:
        in_specs.append(pl.BlockSpec((None, plan.pages_per_seq), lambda b, i, s: (b, 0)))
        args.append(block_table)
    kernel = functools.partial(_partial_kernel, plan=plan, rows_pad=rows_pad, n_tiles=n_tiles,
                               d_pad=d_pad, block=BLOCK_KV)
    parts = (plan.batch, plan.kv_heads, plan.num_splits, plan.rows)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, plan.rows, d_pad),
                         lambda b, i, s: (b, i // n_tiles, s, 0, 0)),
            pl.BlockSpec((None, None, None, plan.rows), lambda b, i, s: (b, i // n_tiles, s, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((*parts, plan.head_dim), stats),
                   jax.ShapeDtypeStruct(parts, stats)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=plan.interpret,
        name="pallas_flash_decode",
    )(*args)


def _merge_round(carry, part_lse, part):
    """The ring's merge against the running max, one round of splits (axis 0 of part_lse and
    part) into (acc, top, total); a row's statistics broadcast along axis 1 of part (head_dim).
    Weights are taken against 0 while every split so far is empty, so exp(-inf) gives 0, never
    NaN."""
    acc, top, total = carry
    new_top = jnp.maximum(top, jnp.max(part_lse, axis=0))
    anchor = jnp.where(new_top == -jnp.inf, 0.0, new_top)
    old = jnp.exp(top - anchor)
    weight = jnp.exp(part_lse - anchor)
    return (acc * old + jnp.sum(part * jnp.expand_dims(weight, 1), axis=0), new_top,
            total * old + jnp.sum(weight, axis=0))


def _merge_finish(acc, top, total):
    """(O, lse) from the merged (acc, top, total).

    A NaN split lse (a page outside the cache) makes its weight NaN whatever the max made of it,
    and NaN stays NaN through every later `* old` and `+`: total and acc end NaN. Only a total of
    exactly 0 is an empty row, so the NaN reaches O and lse (a `total > 0` test would turn it
    into an empty row's -inf)."""
    empty = total == 0.0
    out = acc / jnp.where(empty, 1.0, total)
    lse = jnp.where(empty, -jnp.inf,
                    jnp.where(top == -jnp.inf, 0.0, top) + jnp.log(jnp.where(empty, 1.0, total)))
    return out, lse


def _combine_kernel(o_ref, lse_ref, out_ref, out_lse_ref, *, plan, split_block: int,
                    d_pad: int):
    # One packed row per program: its splits' lse and O rows are read split_block at a time,
    # so a few splits need one round of loads, not one load after another per split.
    row = lax.rem(pl.program_id(1), jnp.int32(plan.rows))
    cols = jnp.arange(d_pad, dtype=jnp.int32) < plan.head_dim
    all_cols = pl.ds(jnp.int32(0), d_pad)

    def add(chunk, carry):
        first = chunk * split_block
        ok = _positions(first, split_block) < plan.num_splits
        splits = pl.ds(first, split_block)
        part_lse = plgpu.load(lse_ref.at[splits, row], mask=ok, other=-jnp.inf)
        part = plgpu.load(o_ref.at[splits, row, all_cols], mask=ok[:, None] & cols[None, :],
                          other=0.0)
        return _merge_round(carry, part_lse, part)

    init = (jnp.zeros((d_pad,), jnp.float32), jnp.float32(-jnp.inf), jnp.float32(0.0))
    out, lse = _merge_finish(*lax.fori_loop(0, pl.cdiv(plan.num_splits, split_block), add, init))
    plgpu.store(out_ref.at[all_cols], out.astype(out_ref.dtype), mask=cols)
    plgpu.store(out_lse_ref.at[pl.ds(row, 1)], lse[None])


def _combine_columns_kernel(o_ref, lse_ref, out_ref, out_lse_ref, *, plan, split_block: int,
                            d_block: int, g_pad: int):
    # Program (b, h * q_len + t, c): new token t of kv head h, head_dim columns
    # [c * d_block, (c + 1) * d_block). Its packed rows t * group + j (j < group) are adjacent
    # columns of the d-major partials, so each load reads g_pad of them side by side.
    i, c = pl.program_id(1), pl.program_id(2)
    group = plan.group
    first_col = lax.rem(i, jnp.int32(plan.q_len)) * group
    cols = pl.ds(first_col, g_pad)
    col_ok = jnp.arange(g_pad, dtype=jnp.int32) < group
    dims = pl.ds(c * d_block, d_block)
    dim_ok = _positions(c * d_block, d_block) < plan.head_dim

    def add(chunk, carry):
        # One running max per column.
        first = chunk * split_block
        ok = _positions(first, split_block) < plan.num_splits
        splits = pl.ds(first, split_block)
        part_lse = plgpu.load(lse_ref.at[splits, cols], mask=ok[:, None] & col_ok[None, :],
                              other=-jnp.inf)
        part = plgpu.load(o_ref.at[splits, dims, cols],
                          mask=ok[:, None, None] & dim_ok[None, :, None] & col_ok[None, None, :],
                          other=0.0)
        return _merge_round(carry, part_lse, part)

    init = (jnp.zeros((d_block, g_pad), jnp.float32), jnp.full((g_pad,), -jnp.inf, jnp.float32),
            jnp.zeros((g_pad,), jnp.float32))
    out, lse = _merge_finish(*lax.fori_loop(0, pl.cdiv(plan.num_splits, split_block), add, init))
    # Row t * group + j is query head h * group + j of token t (the out block is token t's).
    heads = pl.ds(lax.div(i, jnp.int32(plan.q_len)) * group, g_pad)
    plgpu.store(out_ref.at[heads, dims], out.T.astype(out_ref.dtype),
                mask=col_ok[:, None] & dim_ok[None, :])

    @pl.when(c == 0)
    def _lse():
        plgpu.store(out_lse_ref.at[cols], lse, mask=col_ok)


def _query_row(b, i, *, rows: int, g: int):
    """The output block (one row of head_dim) of the combine's program (b, i): packed row
    r = i % rows of kv head h = i // rows is new token r // g, query head h * g + r % g."""
    h, r = i // rows, i % rows
    return b, r // g, h * g + r % g, 0


# Splits merged per round of loads in the combine: 16 rows of O (8 KB at head_dim 128) stay in
# registers; the default split counts need one round from batch x kv_heads = 8 up, more below
# (33 splits at batch 1 with 4 kv heads and 128k keys: three rounds).
COMBINE_SPLITS = 16
# float32 elements of O^T a d-major combine program loads per round (16 a thread at 4 warps):
# head_dim is cut into blocks to keep the splits' round whole, and the blocks spread the merge
# over more programs (at GQA 8 with 4 new tokens, 16 columns of 8 rows by 16 splits).
COLUMNS_ROUND = 2048


def combine(plan, o_part, lse_part, out_dtype, d_major: bool = False):
    """(O [batch, q_len, q_heads, head_dim] in out_dtype, lse float32 [batch, kv_heads, rows])
    from the per-split partials; d_major: O^T partials [..., head_dim, n] and lse [..., n],
    n >= rows (the Mosaic keys-as-M kernel's), read in place.

    O comes out in the caller's layout: packed row t * group + g of kv head h is query head
    h * group + g of new token t, and each program writes its rows there, so that no transpose
    follows the kernel when q_len > 1. lse stays packed (it is needed only with return_lse)."""
    d_pad = common.padded_head_dim(plan.head_dim)
    split_block = min(COMBINE_SPLITS, pl.next_power_of_2(plan.num_splits))
    s, rows, g = plan.num_splits, plan.rows, plan.group
    out_shape = [jax.ShapeDtypeStruct((plan.batch, plan.q_len, plan.q_heads, plan.head_dim),
                                      out_dtype),
                 jax.ShapeDtypeStruct((plan.batch, plan.kv_heads, rows), lse_part.dtype)]
    if d_major:
        n = o_part.shape[-1]
        g_pad = pl.next_power_of_2(g)
        split_block = max(1, min(split_block, COLUMNS_ROUND // (common.MIN_TILE * g_pad)))
        d_block = min(d_pad, max(common.MIN_TILE, COLUMNS_ROUND // (split_block * g_pad)))
        kernel = functools.partial(_combine_columns_kernel, plan=plan, split_block=split_block,
                                   d_block=d_block, g_pad=g_pad)
        q_len = plan.q_len
        grid = (plan.batch, plan.kv_heads * q_len, d_pad // d_block)
        in_specs = [pl.BlockSpec((None, None, s, d_pad, n), lambda b, i, c: (b, i // q_len, 0, 0, 0)),
                    pl.BlockSpec((None, None, s, n), lambda b, i, c: (b, i // q_len, 0, 0))]
        out_specs = [pl.BlockSpec((None, None, plan.q_heads, d_pad),
                                  lambda b, i, c: (b, i % q_len, 0, 0)),
                     pl.BlockSpec((None, None, rows), lambda b, i, c: (b, i // q_len, 0))]
    else:
        kernel = functools.partial(_combine_kernel, plan=plan, split_block=split_block,
                                   d_pad=d_pad)
        grid = (plan.batch, plan.kv_heads * rows)
        in_specs = [pl.BlockSpec((None, None, s, rows, d_pad), lambda b, i: (b, i // rows, 0, 0, 0)),
                    pl.BlockSpec((None, None, s, rows), lambda b, i: (b, i // rows, 0, 0))]
        out_specs = [pl.BlockSpec((None, None, None, d_pad),
                                  functools.partial(_query_row, rows=rows, g=g)),
                     pl.BlockSpec((None, None, rows), lambda b, i: (b, i // rows, 0))]
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=plan.interpret,
        name="pallas_flash_decode_combine",
    )(o_part, lse_part)
