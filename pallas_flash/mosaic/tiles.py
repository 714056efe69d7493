"""Register-tile helpers shared by the Mosaic GPU backward kernels (backward.py, fused_backward.py):
broadcasts of per-row / per-column vectors in the wgmma layouts, fresh accumulators, and the two
wgmma forms (operand in registers accumulating in place; both operands in shared memory)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

WG_ROWS = 64                     # wgmma M tile: rows owned by one compute warpgroup


def bcast_rows(x, shape):
    """A per-row vector (WGMMA.reduce(1) layout) broadcast along the columns."""
    return lax.broadcast_in_dim(x, shape, [0])


def bcast_cols(x, shape):
    """A per-column vector (WGMMA.reduce(0) layout) broadcast along the rows."""
    return lax.broadcast_in_dim(x, shape, [1])


def row_vector(value, n):
    return plgpu.layout_cast(jnp.full((n,), value, jnp.float32), plgpu.Layout.WGMMA.reduce(1))


def zeros_acc(rows, cols):
    return plgpu.layout_cast(jnp.zeros((rows, cols), jnp.float32), plgpu.Layout.WGMMA)


def product(acc, a, b_ref, *, interpret: bool, stage_ref=None):
    """acc + a @ b_ref by wgmma; a is an array in registers (WGMMA layout, input dtype).

    Compiled: a stays in registers and the product accumulates in place. Interpret mode takes
    neither, so a goes through `stage_ref` in shared memory and a fresh product is added.
    """
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


def matmul(a_ref, b_ref, shape):
    """a_ref @ b_ref, both in shared memory, into a fresh float32 accumulator."""
    def run(acc_ref):
        plgpu.wgmma(acc_ref, a_ref, b_ref)
        return acc_ref[...]
    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def positions(shape, row0, col0):
    rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) + row0
    cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) + col0
    return rows, cols


def idiv(x, d: int):
    return lax.div(x, jnp.int32(d))
