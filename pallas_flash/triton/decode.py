"""Split-KV decode kernels, lowered through Pallas Triton: the partial pass and the combine.

Partial ("pallas_flash_decode"). Grid: (batch, kv_heads, num_splits). A program holds the
plan.rows packed query rows of one kv head (all query heads of its group, all q_len tokens;
padded to a power of two >= 16) and walks the key blocks of its split's chunk, up to the
sequence's kv_length, with the online softmax of forward.py, in natural-log logits u and base 2 (c = log2 e):
    m_j = max(m_{j-1}, rowmax(U_j)),  l_j = l_{j-1} 2^((m_{j-1} - m_j) c) + rowsum(2^((U_j - m_j) c))
    acc_j = acc_{j-1} 2^((m_{j-1} - m_j) c) + 2^((U_j - m_j) c) V_j
and writes O = acc / l and lse = m + ln(l), float32 (an empty chunk: O = 0, lse = -inf).
A paged cache is read by a gather: each key row of a block takes its physical page from the
block table, so a block may span several pages smaller than itself.

Combine ("pallas_flash_decode_combine"). Grid: (batch, kv_heads). Merges the splits of one kv
head exactly: lse = log sum_s exp(lse_s), O = sum_s exp(lse_s - lse) O_s, with the weights taken
against 0 where every split is empty, so such a row stays O = 0, lse = -inf.
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

__all__ = ["partial", "combine", "unsupported_reason"]

# Keys per block: a power of two that divides every chunk (decode.CHUNK_ALIGN).
BLOCK_KV = 64
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


def _partial_kernel(*refs, plan, rows_pad: int, d_pad: int, block: int):
    if plan.paged:
        q_ref, k_ref, v_ref, len_ref, table_ref, o_ref, lse_ref = refs
    else:
        q_ref, k_ref, v_ref, len_ref, o_ref, lse_ref = refs
        table_ref = None
    # Program ids are read up front: interpret mode substitutes them only outside control flow.
    b, split = pl.program_id(0), pl.program_id(2)
    kv_len = len_ref[b]
    acc_dtype = common.accumulator_dtype(q_ref.dtype)
    cols = common.column_mask(plan.head_dim, d_pad)
    precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None
    q = common.load_tile(q_ref, jnp.int32(0), rows_pad, plan.rows, cols)
    # Packed row r is token r // group, at position kv_len - q_len + r // group.
    row_pos = kv_len - plan.q_len + lax.div(_positions(0, rows_pad), jnp.int32(plan.group))

    def load_kv(ref, start, masked, end):
        rows = _positions(start, block)
        mask = None
        if masked:
            mask = (rows < end)[:, None]
        if cols is not None:
            mask = cols if mask is None else mask & cols
        if table_ref is None:
            view = ref.at[pl.ds(start, block), pl.ds(jnp.int32(0), d_pad)]
        else:
            # A gather: each key row finds its own physical page, so a block may span pages
            # smaller than itself. Rows past `end` may index past the table: masked too.
            page = lax.div(rows, jnp.int32(plan.page_size))
            ok = rows < end
            phys = (plgpu.load(table_ref.at[page], mask=ok, other=0) if masked
                    else plgpu.load(table_ref.at[page]))
            # Array indices on every axis (interpret mode gathers no mix of slices and arrays).
            offset = rows - page * plan.page_size
            view = ref.at[phys[:, None], offset[:, None],
                          jnp.arange(d_pad, dtype=jnp.int32)[None, :]]
        if mask is None:  # the lowering takes `other` only with a mask
            return plgpu.load(view)
        return plgpu.load(view, mask=mask, other=0.0)

    chunk_end = jnp.minimum((split + 1) * plan.chunk, kv_len)

    def step(j, carry, masked):
        acc, m, l = carry
        start = j * block
        # Positions at or past the chunk's end read 0: whatever a cache holds there (stale
        # pages, NaN) never reaches P V.
        k = load_kv(k_ref, start, masked, chunk_end)
        v = load_kv(v_ref, start, masked, chunk_end)
        # Logits in natural units (the scale applied to the tile, not folded into exp2): the
        # row max is then the max logit for any sign of scale.
        u = plgpu.dot(q, k, trans_b=True, precision=precision) * plan.scale
        if plan.softcap is not None:
            u = plan.softcap * jnp.tanh(u * (1.0 / plan.softcap))
        if masked:
            k_pos = _positions(start, block)[None, :]
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
        return acc, m_new, l

    init = (jnp.zeros((rows_pad, d_pad), acc_dtype),
            jnp.full((rows_pad,), -jnp.inf, acc_dtype),
            jnp.zeros((rows_pad,), acc_dtype))
    acc, m, l = common.three_phase_loop(_bounds(plan, kv_len, split, block), step, init)
    seen = l > 0
    out = acc / jnp.where(seen, l, 1.0)[:, None]
    common.store_tile(o_ref, jnp.int32(0), rows_pad, plan.rows, cols, out)
    lse = jnp.where(seen, jnp.where(seen, m, 0.0) + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    ok = _positions(0, rows_pad) < plan.rows
    plgpu.store(lse_ref.at[pl.ds(jnp.int32(0), rows_pad)], lse.astype(lse_ref.dtype), mask=ok)


def partial(plan, q_packed, k_cache, v_cache, kv_lengths, block_table):
    """Per-split (O, lse); shapes and meaning in pallas_flash.decode.partial_contract."""
    rows_pad = max(common.MIN_TILE, pl.next_power_of_2(plan.rows))
    d_pad = common.padded_head_dim(plan.head_dim)
    block = BLOCK_KV
    stats = common.accumulator_dtype(plan.dtype)
    grid = (plan.batch, plan.kv_heads, plan.num_splits)
    q_spec = pl.BlockSpec((None, None, plan.rows, d_pad), lambda b, h, s: (b, h, 0, 0))
    if plan.paged:
        num_pages = k_cache.shape[0]
        kv_spec = pl.BlockSpec((num_pages, plan.page_size, None, d_pad),
                               lambda b, h, s: (0, 0, h, 0))
    else:
        kv_spec = pl.BlockSpec((None, plan.max_len, None, d_pad), lambda b, h, s: (b, 0, h, 0))
    len_spec = pl.BlockSpec((plan.batch,), lambda b, h, s: (0,))
    in_specs = [q_spec, kv_spec, kv_spec, len_spec]
    args = [q_packed, k_cache, v_cache, kv_lengths]
    if plan.paged:
        in_specs.append(pl.BlockSpec((None, plan.pages_per_seq), lambda b, h, s: (b, 0)))
        args.append(block_table)
    kernel = functools.partial(_partial_kernel, plan=plan, rows_pad=rows_pad, d_pad=d_pad,
                               block=block)
    parts = (plan.batch, plan.kv_heads, plan.num_splits, plan.rows)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, plan.rows, d_pad), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, plan.rows), lambda b, h, s: (b, h, s, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((*parts, plan.head_dim), stats),
                   jax.ShapeDtypeStruct(parts, stats)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=plan.interpret,
        name="pallas_flash_decode",
    )(*args)


def _combine_kernel(o_ref, lse_ref, out_ref, out_lse_ref, *, num_splits: int, rows: int,
                    head_dim: int, splits_pad: int, rows_pad: int, d_pad: int):
    cols = common.column_mask(head_dim, d_pad)
    split_ok = (_positions(0, splits_pad) < num_splits)[:, None]
    row_ok = _positions(0, rows_pad) < rows
    zero = jnp.int32(0)
    all_lse = plgpu.load(lse_ref.at[pl.ds(zero, splits_pad), pl.ds(zero, rows_pad)],
                         mask=split_ok & row_ok[None, :], other=-jnp.inf)
    top = jnp.max(all_lse, axis=0)
    anchor = jnp.where(top == -jnp.inf, 0.0, top)
    total = jnp.sum(jnp.exp(all_lse - anchor[None, :]), axis=0)
    lse = jnp.where(total > 0, anchor + jnp.log(total), -jnp.inf)
    # A row no split saw keeps weight exp(-inf - 0) = 0 for every split: O = 0, never NaN.
    lse_anchor = jnp.where(total > 0, lse, 0.0)

    def add(s, acc):
        part_lse = plgpu.load(lse_ref.at[s, pl.ds(zero, rows_pad)], mask=row_ok,
                              other=-jnp.inf)
        mask = row_ok[:, None] if cols is None else row_ok[:, None] & cols
        part = plgpu.load(o_ref.at[s, pl.ds(zero, rows_pad), pl.ds(zero, d_pad)], mask=mask,
                          other=0.0)
        return acc + jnp.exp(part_lse - lse_anchor)[:, None] * part

    acc = lax.fori_loop(0, num_splits, add, jnp.zeros((rows_pad, d_pad), all_lse.dtype))
    common.store_tile(out_ref, zero, rows_pad, rows, cols, acc)
    plgpu.store(out_lse_ref.at[pl.ds(zero, rows_pad)], lse, mask=row_ok)


def combine(plan, o_part, lse_part, out_dtype):
    """(O [batch, kv_heads, rows, head_dim] in out_dtype, lse float32 [batch, kv_heads, rows])
    from the per-split partials."""
    rows_pad = max(common.MIN_TILE, pl.next_power_of_2(plan.rows))
    splits_pad = pl.next_power_of_2(plan.num_splits)
    d_pad = common.padded_head_dim(plan.head_dim)
    kernel = functools.partial(_combine_kernel, num_splits=plan.num_splits, rows=plan.rows,
                               head_dim=plan.head_dim, splits_pad=splits_pad,
                               rows_pad=rows_pad, d_pad=d_pad)
    s, rows = plan.num_splits, plan.rows
    return pl.pallas_call(
        kernel,
        grid=(plan.batch, plan.kv_heads),
        in_specs=[pl.BlockSpec((None, None, s, rows, d_pad), lambda b, h: (b, h, 0, 0, 0)),
                  pl.BlockSpec((None, None, s, rows), lambda b, h: (b, h, 0, 0))],
        out_specs=[pl.BlockSpec((None, None, rows, d_pad), lambda b, h: (b, h, 0, 0)),
                   pl.BlockSpec((None, None, rows), lambda b, h: (b, h, 0))],
        out_shape=[jax.ShapeDtypeStruct((plan.batch, plan.kv_heads, rows, plan.head_dim),
                                        out_dtype),
                   jax.ShapeDtypeStruct((plan.batch, plan.kv_heads, rows), lse_part.dtype)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=plan.interpret,
        name="pallas_flash_decode_combine",
    )(o_part, lse_part)
