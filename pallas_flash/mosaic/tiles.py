"""Register-tile helpers of the Mosaic backward kernels: wgmma-layout broadcasts and
accumulators, the two wgmma forms, the transposed recomputation of P^T and dS^T, and float16's
scaled cast of dS."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash.mosaic.common import logit_units


def bcast_rows(x, shape):
    """A per-row vector (WGMMA.reduce(1) layout) broadcast along the columns."""
    return lax.broadcast_in_dim(x, shape, [0])


def bcast_cols(x, shape):
    """A per-column vector (WGMMA.reduce(0) layout) broadcast along the rows."""
    return lax.broadcast_in_dim(x, shape, [1])


F16_CAST_LIMIT = 2.0 ** 14       # |dS| above this is scaled down before the float16 cast


def cast_rows(x, scale, dtype):
    """x cast to dtype; for float16 with a per-row running scale guarding against overflow.

    Returns (x_cast, rescale, scale_new): the accumulator must be multiplied by `rescale`
    (per row) before the new product is added; None / unchanged outside float16.
    """
    if jnp.dtype(dtype) != jnp.float16:
        return x.astype(dtype), None, scale
    amax = jnp.max(jnp.abs(x), axis=1)
    want = jnp.where((amax > F16_CAST_LIMIT) & (amax < jnp.inf), amax * (1.0 / F16_CAST_LIMIT),
                     1.0)
    scale_new = jnp.maximum(scale, want)
    x = x * bcast_rows(1.0 / scale_new, x.shape)
    return x.astype(dtype), scale / scale_new, scale_new


def nonfinite_rows(*tiles):
    """float32 per row: 0 where every tile's row is finite, NaN where one holds an inf or NaN
    (0 * x is 0 for a finite x and NaN otherwise): the backward's marks (guarded.py)."""
    marks = None
    for tile in tiles:
        row = jnp.sum(tile.astype(jnp.float32) * 0.0, axis=1)
        marks = row if marks is None else marks + row
    return marks

# No layout hints here (forward.py says why): the wgmmas fix every layout.
def row_vector(value, n):
    return jnp.full((n,), value, jnp.float32)


def zeros_acc(rows, cols):
    return jnp.zeros((rows, cols), jnp.float32)


def product(acc, a, b_ref, *, interpret: bool, stage_ref=None):
    """acc + a @ b_ref by wgmma, a in registers, accumulating in place. Interpret mode takes
    neither: a goes through `stage_ref` in shared memory and a fresh product is added."""
    if not interpret:
        def accumulate(acc_ref):
            plgpu.wgmma(acc_ref, a, b_ref)
        return pl.run_state(accumulate)(plgpu.ACC.init(acc))
    stage_ref[...] = a
    plgpu.commit_smem()

    def fresh(acc_ref):
        plgpu.wgmma(acc_ref, stage_ref, b_ref)
        return acc_ref[...]

    return acc + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))


def accumulate(acc, a_ref, b_ref, *, interpret: bool):
    """acc + a_ref @ b_ref by wgmma, both operands in shared memory (in place when compiled)."""
    if not interpret:
        def run(acc_ref):
            plgpu.wgmma(acc_ref, a_ref, b_ref)
        return pl.run_state(run)(plgpu.ACC.init(acc))
    return acc + matmul(a_ref, b_ref, acc.shape)


def matmul(a_ref, b_ref, shape):
    """a_ref @ b_ref, both in shared memory, into a fresh float32 accumulator."""
    def run(acc_ref):
        plgpu.wgmma(acc_ref, a_ref, b_ref)
        return acc_ref[...]
    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def positions(shape, row0, col0):
    """(row, column) positions of a tile's entries, as iotas in the WGMMA layout of the tiles
    they mask. Stated, not inferred: ptxas spilled more beside layout-free iotas in the causal
    backward (`benchmarks/sm90_compile.py`), and row and column vectors broadcast across the
    tile instead left the layout inference of the paired float16 softcap dK/dV kernel past
    its budget."""
    rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) + row0
    cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) + col0
    return rows, cols


def tile_visibility(mask, shape, row0, col0, kv_len, *, keys_as_rows: bool):
    """mask.visible over a tile whose first entry is (row0, col0), keys along its rows or its
    columns; None where nothing masks (no position mask, no key bound), so that no kernel
    carries iotas it never reads."""
    if not mask.has_position_mask and kv_len is None:
        return None
    rows, cols = positions(shape, row0, col0)
    k_pos, q_pos = (rows, cols) if keys_as_rows else (cols, rows)
    return mask.visible(q_pos, k_pos, kv_len)


def idiv(x, d: int):
    return lax.div(x, jnp.int32(d))


def transposed_weights(spec, c, k_tile, v_tile, q_blk, do_blk, st, shape, *, wait_q, wait_do,
                       visible_fn=None):
    """(P^T, dS^T), float32, for one step of a dK/dV loop (rows: keys; columns: queries):
        S^T = K Q^T,  P^T = 2^((S^T - m) c - r),  dP^T = V dO^T,  dS^T = P^T (dP^T - D).
    st: the step's [3, block_q] m / r / D in shared memory; wait_q / wait_do: called just before
    Q (with st) and dO are read; visible_fn: None for a block seen whole, else a function giving
    the visibility (or None), outside which P^T and dS^T are zero. The products run one after
    the other: issuing dP^T behind S^T to form P^T meanwhile is slower (docs/tuning.md)."""
    wait_q()
    p_t, t_t = transposed_probabilities(spec, c, k_tile, q_blk, st, shape, visible_fn)
    wait_do()
    return p_t, transposed_score_grads(p_t, matmul(v_tile, do_blk.T, shape), st, t_t)


def transposed_probabilities(spec, c, k_tile, q_blk, st, shape, visible_fn=None):
    """(P^T, t^T or None): the first half of `transposed_weights`."""
    u_t, t_t = logit_units(spec, matmul(k_tile, q_blk.T, shape))
    m = plgpu.load(st.at[0])
    r = plgpu.load(st.at[1])
    p_t = jnp.exp2((u_t - bcast_cols(m, shape)) * c - bcast_cols(r, shape))
    visible = None if visible_fn is None else visible_fn()
    if visible is not None:
        p_t = jnp.where(visible, p_t, 0.0)
    return p_t, t_t


def transposed_score_grads(p_t, dp_t, st, t_t=None):
    """dS^T = P^T (dP^T - D) (times 1 - t^2 with a softcap): the second half of
    `transposed_weights`.

    No mask here: P^T is already zero outside the visible entries, so dS^T is too wherever
    dP^T is finite. A second select would only matter for a non-finite V or dO entry that the
    mask hides, which reaches the gradients through dV's and dQ's products anyway (guarded.py),
    and it would keep the mask live in registers across the dP^T product (ptxas spilled there
    in the causal fused kernel)."""
    delta = plgpu.load(st.at[2])
    ds_t = p_t * (dp_t - bcast_cols(delta, dp_t.shape))
    if t_t is not None:
        ds_t = ds_t * (1.0 - t_t * t_t)  # softcap: d(c tanh(x / c)) = 1 - tanh^2
    return ds_t
