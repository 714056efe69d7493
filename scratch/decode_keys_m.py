"""Prototype: the Mosaic decode split kernel with keys as the wgmma M axis.

S^T = K Q^T ([block_kv, N]), the softmax over axis 0 (keys), O^T += V^T P^T ([d, N]), N = the
packed rows rounded up to 8. Contiguous caches, no softcap / window, rows <= 8, one row tile.
Same contract as pallas_flash.mosaic.decode.partial.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash.mosaic.common import stream_through_slots
from pallas_flash.mosaic.tiles import accumulate
from pallas_flash.stats import LOG2E

N = 8
BLOCK_KV = 64
STAGES = 2


def _bcast_cols(x, shape):
    return lax.broadcast_in_dim(x, shape, [1])


def _kernel(q_ref, k_ref, v_ref, lens_ref, o_ref, lse_ref, q_smem, k_smem, v_smem, p_smem,
            o_smem, lse_smem, q_loaded, k_loaded, v_loaded, free, *, plan):
    head_dim, q_len, group = plan.head_dim, plan.q_len, plan.group
    dtype = q_ref.dtype
    c = plan.scale * LOG2E
    split = lax.axis_index("cell")
    kv_head = lax.axis_index("head")
    batch = lax.axis_index("batch")
    wg = lax.axis_index("wg")
    n_splits = plan.num_splits
    kv_len = lens_ref[batch]
    key_lo = split * plan.chunk
    key_hi = jnp.minimum(key_lo + plan.chunk, kv_len)
    lo = lax.div(key_lo, jnp.int32(BLOCK_KV))
    hi = jnp.maximum(lax.div(key_hi + (BLOCK_KV - 1), jnp.int32(BLOCK_KV)), lo)
    n_steps = hi - lo

    @pl.when(wg == 0)
    def _compute():
        plgpu.copy_gmem_to_smem(q_ref.at[batch * plan.kv_heads + kv_head, pl.ds(0, N)], q_smem, q_loaded)
        last_full = jnp.minimum(key_hi, kv_len - q_len + 1)
        full_hi = jnp.clip(lax.div(jnp.maximum(last_full, 0), jnp.int32(BLOCK_KV)), lo, hi)

        def step(i, carry, masked: bool):
            acc, m, l = carry
            j = lo + i
            slot = lax.rem(i, jnp.int32(STAGES))
            plgpu.barrier_wait(k_loaded.at[slot])

            def logits(s_ref):
                plgpu.wgmma(s_ref, k_smem.at[slot], q_smem.T)
                return s_ref[...]

            s = pl.run_scoped(logits, plgpu.ACC((BLOCK_KV, N), jnp.float32))
            if masked:
                shape = (BLOCK_KV, N)
                key = plgpu.broadcasted_iota(jnp.int32, shape, 0,
                                             layout=plgpu.Layout.WGMMA) + j * BLOCK_KV
                row = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
                q_pos = lax.div(row, jnp.int32(group)) + (kv_len - q_len)
                s = jnp.where((key >= key_lo) & (key < key_hi) & (key <= q_pos), s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=0))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2((m - m_safe) * c)
            p = jnp.exp2(s * c - _bcast_cols(m_safe * c, s.shape))
            l = l * alpha + jnp.sum(p, axis=0)
            acc = acc * _bcast_cols(alpha, acc.shape)
            p_smem.T[...] = p.astype(dtype)
            plgpu.commit_smem()
            plgpu.barrier_wait(v_loaded.at[slot])
            if masked:
                v_tile = v_smem.at[slot]
                vkey = plgpu.broadcasted_iota(jnp.int32, (BLOCK_KV, head_dim), 0,
                                              layout=plgpu.Layout.WGMMA) + j * BLOCK_KV
                v = v_tile[...]
                v_tile[...] = jnp.where((vkey >= key_lo) & (vkey < key_hi), v,
                                        jnp.zeros_like(v))
                plgpu.commit_smem()

            acc = accumulate(acc, v_smem.at[slot].T, p_smem.T, interpret=plan.interpret)
            plgpu.barrier_arrive(free.at[slot])
            return acc, m_new, l

        acc = plgpu.layout_cast(jnp.zeros((head_dim, N), jnp.float32), plgpu.Layout.WGMMA)
        m = plgpu.layout_cast(jnp.full((N,), -jnp.inf, jnp.float32),
                              plgpu.Layout.WGMMA.reduce(0))
        l = plgpu.layout_cast(jnp.zeros((N,), jnp.float32), plgpu.Layout.WGMMA.reduce(0))
        plgpu.barrier_wait(q_loaded)
        carry = lax.fori_loop(jnp.int32(0), full_hi - lo, functools.partial(step, masked=False),
                              (acc, m, l))
        acc, m, l = lax.fori_loop(full_hi - lo, n_steps, functools.partial(step, masked=True),
                                  carry)
        seen = l != 0.0
        out = jnp.where(_bcast_cols(seen, acc.shape),
                        acc / _bcast_cols(jnp.where(seen, l, 1.0), acc.shape), 0.0)
        lse_smem[...] = jnp.where(m == -jnp.inf, 0.0, m) * plan.scale + jnp.log(l)
        o_smem[...] = out
        plgpu.commit_smem()
        cell_out = (batch * plan.kv_heads + kv_head) * n_splits + split
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[cell_out])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[cell_out])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _copy():
        def issue(i, slot):
            j = lo + i
            rows = (batch, pl.ds(j * BLOCK_KV, BLOCK_KV), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_loaded.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_loaded.at[slot])

        stream_through_slots(issue, free, STAGES, n_steps)


def partial(plan, q_packed, k_cache, v_cache, kv_lengths, block_table=None):
    assert not plan.paged and plan.softcap is None and plan.window_left is None
    assert plan.rows <= N and plan.chunk % BLOCK_KV == 0
    batch, kv_heads, rows, head_dim = q_packed.shape
    dtype = q_packed.dtype
    splits = plan.num_splits
    cells = batch * kv_heads * splits
    scratch = [
        plgpu.SMEM((N, head_dim), dtype),
        plgpu.SMEM((STAGES, BLOCK_KV, head_dim), dtype),
        plgpu.SMEM((STAGES, BLOCK_KV, head_dim), dtype),
        plgpu.SMEM((N, BLOCK_KV), dtype),
        plgpu.SMEM((head_dim, N), jnp.float32),
        plgpu.SMEM((N,), jnp.float32),
        plgpu.Barrier(),
        plgpu.Barrier(num_barriers=STAGES),
        plgpu.Barrier(num_barriers=STAGES),
        plgpu.Barrier(num_barriers=STAGES),
    ]
    call = plgpu.kernel(
        functools.partial(_kernel, plan=plan),
        out_type=(jax.ShapeDtypeStruct((cells, head_dim, N), jnp.float32),
                  jax.ShapeDtypeStruct((cells, N), jnp.float32)),
        scratch_types=scratch,
        grid=(splits, kv_heads, batch),
        grid_names=("cell", "head", "batch"),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if plan.interpret else None,
        kernel_name="pallas_flash_decode_mosaic_keys_m",
    )
    q = q_packed.reshape(batch * kv_heads, rows, head_dim)
    ot, lse = call(q, k_cache, v_cache, kv_lengths.astype(jnp.int32))
    o_part = ot.transpose(0, 2, 1)[:, :rows].reshape(batch, kv_heads, splits, rows, head_dim)
    lse_part = lse[:, :rows].reshape(batch, kv_heads, splits, rows)
    return o_part, lse_part
