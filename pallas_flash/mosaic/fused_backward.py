"""The backward in one kernel for Hopper: dK/dV per key tile, dQ added across key tiles in a
fixed order. Lowered through Pallas Mosaic GPU.

Why: the two-kernel backward recomputes S and dP in its dQ kernel, 7 matmul units where 5 do.
Here the dK/dV CTA also forms dQ_partial = dS K for each q block it visits, and the partials
are summed in global memory in a fixed order (FlashAttention-3's deterministic mode): 5 units,
bitwise-reproducible gradients.

Grid: schedule.fused_grid, (head chunk, key tile, head in chunk x batch); or, persistent
(config.fused_persistent), one CTA per SM running the items schedule.persistent_plan hands it,
each a (key tile, kv head, batch), with the stream's step counters carried from one item to the
next (docs/design.md says why that cannot deadlock). A CTA owns 128 keys at a time:
  * two compute warpgroups, 64 keys each, in backward.py's transposed orientation
    (S^T = K Q^T, P^T, dP^T = V dO^T, dS^T; dV += P^T dO, dK += dS^T Q). Both write their dS^T
    (64 keys x 64 queries) to shared memory and then share dQ_partial = dS K over all 128 keys
    (`dq_columns`), stored to a float32 dQ tile (`fused_dq_slots` slots; dS^T is
    double-buffered by step parity);
  * a copy warpgroup streams Q, dO and the row statistics;
  * a writer warpgroup moves each dQ tile to global memory: semaphore wait, TMA store (first
    tile) or TMA reduce-add (float32, in L2), wait for the read, free the slot, wait for the
    landing, signal.
With dK and dV each compute warpgroup stores one mark per key, NaN where the key's dK, dV or K
row holds an inf or NaN (`fused_backward`): guarded.py's check reads those instead of the
operands.
The order: the key tiles that see q block j are a range [first(j), last(j)) (MaskSpec.kv_blocks
with 128-key blocks); tile t waits on a semaphore per (batch, q head, q block) until it counts
t - first(j) adds. A tile waits only on lower tiles, which launch first, so the spin cannot
deadlock (the persistent grid: docs/design.md). Tiles walk their q blocks last first: under a
causal mask every tile then starts on blocks all tiles see, one step behind the tile below.

float16: dS (up to |dO| |V| + |D|) can pass float16's range, so it is cast twice, each time
divided by a factor fixed before the kernel runs from a bound on |dS|, and multiplied back on
the float32 sum: per key for dK (`dk_cast_scales`, read once per warpgroup, so a step pays one
multiply and no running maximum or rescale of dK), per query for dQ's product, which sums over
the 128 keys of both warpgroups (`dq_cast_scales`, streamed as a fourth statistic).

Serves bfloat16 and float16, head_dim 32 to 128 in steps of 16, no segment ids
(`unsupported_reason`): segment ids make the contributing tiles data-dependent, and above 128
the operands do not fit shared memory.
Interpret mode has no semaphores and no reduce-add; it runs CTAs in index order, so its writer
reads the previous sum, adds and stores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import custom_batching, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash.mosaic.common import (await_last_frees, clamp_range, interpret_params,
                                       pad_seq, profile_params, step_after,
                                       stream_through_slots)
from pallas_flash.mosaic.config import FUSED_BLOCK_Q as BLOCK_Q
from pallas_flash.mosaic.config import FUSED_CTA_KEYS as CTA_KEYS
from pallas_flash.mosaic.config import FUSED_DS_BUFFERS as DS_BUFFERS
from pallas_flash.mosaic.config import WG_ROWS
from pallas_flash.mosaic.tiles import (F16_CAST_LIMIT, bcast_cols, bcast_rows, product,
                                      tile_visibility, transposed_weights, zeros_acc)
from pallas_flash.mosaic.schedule import (device_sms, fused_first_tiles, fused_grid,
                                         fused_head_chunk, fused_item, fused_launches,
                                         fused_position, persistent_plan)
from pallas_flash.spec import AttentionSpec
from pallas_flash.stats import LOG2E, logit_scale

__all__ = ["FUSED_KERNEL_NAME", "dk_cast_scales", "dq_cast_scales", "fused_backward",
           "stat_rows", "unsupported_reason"]

FUSED_KERNEL_NAME = "pallas_flash_mosaic_bwd_fused"
HEAD_DIMS = tuple(range(32, 129, 16))   # above 128 the operands do not fit shared memory
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def stat_rows(dtype) -> int:
    """Rows of statistics streamed per query: m, r, D, and for float16 dQ's cast factor."""
    return 4 if jnp.dtype(dtype) == jnp.float16 else 3


def _norms(x):
    """Euclidean norms over the last axis, in float32."""
    return jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=-1))


def _cast_factor(bound):
    """s >= 1 with bound / s within F16_CAST_LIMIT; 1 where the bound is not finite (the
    values are then passed on unscaled, as the two-kernel path does)."""
    return jnp.where((bound > F16_CAST_LIMIT) & (bound < jnp.inf),
                     bound * (1.0 / F16_CAST_LIMIT), 1.0)


def dq_cast_scales(v, do, delta, group: int):
    """Per query, float32 [b, hq, seq_q]: the factor s >= 1 by which the fused kernel divides
    dS before its float16 cast for dQ's product (and multiplies the float32 dQ sum after).

    |dS_ij| = P_ij |dP_ij - D_i| (times 1 - t^2 <= 1 with a softcap) <= |dO_i| max_j |V_j|
    + |D_i|, by Cauchy-Schwarz with P <= 1: a bound over every key, so the tiles and both
    warpgroups of a CTA scale query i alike.
    """
    v_max = jnp.repeat(jnp.max(_norms(v), axis=1), group, axis=1)     # [b, hq]
    return _cast_factor(jnp.swapaxes(_norms(do), 1, 2) * v_max[:, :, None] + jnp.abs(delta))


def dk_cast_scales(v, do, delta, group: int, keys: int):
    """Per key, float32 [b, hkv, keys]: the factor by which the fused kernel divides dS before
    its float16 cast for dK's product (and multiplies the float32 dK after); keys >= v's
    sequence length, the rest padded with 1.

    The bound of `dq_cast_scales` taken the other way: |dS_ij| <= max_i |dO_i| |V_j| +
    max_i |D_i|, the maxima over every query of the kv head's q heads.
    """
    b, seq_q, hq, _ = do.shape
    hkv = v.shape[2]
    do_max = jnp.max(_norms(do).reshape(b, seq_q, hkv, group), axis=(1, 3))       # [b, hkv]
    d_max = jnp.max(jnp.abs(delta).reshape(b, hkv, group * seq_q), axis=2)        # [b, hkv]
    bound = jnp.swapaxes(_norms(v), 1, 2) * do_max[:, :, None] + d_max[:, :, None]
    return pad_seq(_cast_factor(bound), keys, axis=2, value=1.0)


def dq_columns(head_dim: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """How the two compute warpgroups share dQ_partial = dS K: each warpgroup's (first column,
    columns) of it, every step, or None where they take turns (the warpgroup of the step's
    parity computes all of it).

    By columns at 128 (halves) and 112 (64 and 48: Mosaic's layout inference refuses 56-column
    halves of K, no 8 x 16 tiling), where a whole float32 accumulator beside dK and dV exceeds
    a compute warpgroup's registers (at 112 ptxas spills). By turns below: halves of 32, 40 or
    48 columns are refused or split K's swizzle tile, and the whole accumulator fits."""
    if head_dim == 128:
        return (0, 64), (64, 64)
    if head_dim == 112:
        return (0, 64), (64, 48)
    return None


def unsupported_reason(spec: AttentionSpec, q) -> str | None:
    """Why the fused kernel cannot serve this call (the two-kernel path then does), or None."""
    head_dim = q.shape[-1]
    if spec.has_segments:
        return "segment ids (the tiles that see a q block are data-dependent)"
    if jnp.dtype(q.dtype) not in DTYPES:
        return (f"dtype {jnp.dtype(q.dtype).name} (the fused kernel takes bfloat16 and "
                "float16)")
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (the fused kernel takes {HEAD_DIMS})"
    return None


class _Item:
    """One work item of the fused kernel, a (key tile, kv head, batch): the q blocks its keys see
    and the order of its stream steps. kv_head counts within the launch (it indexes dQ and the
    semaphores); kv_global from the whole call's first kv head (K, V, dK, dV)."""

    def __init__(self, mask, group: int, tile, kv_head, batch, head0):
        self.tile, self.kv_head, self.batch = tile, kv_head, batch
        self.kv_global = kv_head if head0 is None else kv_head + head0
        self.kv_start = tile * CTA_KEYS
        self.group = group
        # The tile's q blocks, last first, once per q head of the group. With a position mask
        # tiles see different numbers of blocks: block-major (at each block the group's heads
        # in turn) keeps every tile one add behind the tile below; head-major would make a tile
        # wait at each head change. Without one both orders are the same schedule, and
        # head-major is faster.
        self.block_major = group > 1 and mask.has_position_mask
        self.cta_lo, _, _, self.cta_hi = mask.q_blocks(self.kv_start, CTA_KEYS, BLOCK_Q,
                                                       mask.seq_kv, mask.seq_q)
        n_cta = self.cta_hi - self.cta_lo
        self.n_cta = n_cta
        if group > 1 and not self.block_major:
            self.per_head = jnp.maximum(n_cta, 1)
        self.total = group * n_cta

    def step_of(self, h, j):
        """The stream step of q head h (within the group) at q block j."""
        if self.group == 1:
            return self.cta_hi - 1 - j
        if self.block_major:
            return (self.cta_hi - 1 - j) * self.group + h
        return h * self.n_cta + (self.cta_hi - 1 - j)

    def block_of(self, t):
        """(q head, q block) of stream step t."""
        group = self.group
        if group == 1:
            return self.kv_head, self.cta_hi - 1 - t
        if self.block_major:
            return (self.kv_head * group + lax.rem(t, jnp.int32(group)),
                    self.cta_hi - 1 - lax.div(t, jnp.int32(group)))
        return (self.kv_head * group + lax.div(t, self.per_head),
                self.cta_hi - 1 - lax.rem(t, self.per_head))


def _fused_body(q_ref, k_ref, v_ref, do_ref, st_ref, dk_ref, dv_ref, dq_ref, marks_ref,
                k_smem, v_smem, q_smem, do_smem, st_smem, ds_smem, dq_smem, mark_smem,
                k_loaded, v_loaded, q_loaded, do_loaded, st_loaded, slot_free,
                ds_ready, dq_ready, dq_free, both_done, *more_smem,
                spec: AttentionSpec, cfg, group: int, head_dim: int, q_heads: int,
                n_qblocks: int, n_tiles: int, chunk: int, batch_size: int, head0_ref=None,
                kf_ref=None, plan_ref=None):
    mask = spec.mask
    dtype = q_ref.dtype
    stages, slots = cfg.fused_stages, cfg.fused_dq_slots
    columns = dq_columns(head_dim)
    by_turns = columns is None
    f16 = jnp.dtype(dtype) == jnp.float16
    c = logit_scale(spec) * LOG2E
    kv_len = mask.seq_kv if mask.seq_kv % WG_ROWS else None
    persistent = plan_ref is not None
    # The persistent grid's extra barrier: K and V's buffers free for the next item.
    kv_free = more_smem[0] if persistent else None
    interp_smem = more_smem[1:] if persistent else more_smem

    # K, V, dK, dV, Q, dO and the statistics are indexed from the launch's first kv head on,
    # read from head0_ref (data, so that every launch runs one compiled kernel).
    head0 = None if head0_ref is None else head0_ref[0]
    if persistent:
        # This CTA's items, in the order it runs them (schedule.persistent_plan).
        wg = lax.axis_index("wg")
        cta = lax.axis_index("cta")
        n_items = plan_ref[cta, 0]

        def item(n):
            tile, kv_head, batch = fused_item(plan_ref[cta, n + 1], n_tiles, chunk, batch_size)
            return _Item(mask, group, tile, kv_head, batch, head0)

        def over_items(fn):
            """fn(n, t0) for this CTA's items n, t0 the stream steps of the items before n;
            fn returns t0 plus its item's steps. Returns the CTA's steps."""
            return lax.fori_loop(jnp.int32(0), n_items, fn, jnp.int32(0))
    else:
        tile, kv_head, batch, wg = fused_position(mask, chunk, batch_size)
        only = _Item(mask, group, tile, kv_head, batch, head0)

        def item(n):
            return only

        def over_items(fn):
            return fn(0, 0)

    def compute(w: int):
        plgpu.set_max_registers(cfg.compute_registers, action="increase")
        my_k, my_v = k_smem.at[w], v_smem.at[w]
        stage = interp_smem[0].at[w] if spec.interpret else None
        shape = (WG_ROWS, BLOCK_Q)
        # dQ columns this warpgroup computes, from col0 (all of them on its turns).
        col0, cols = (0, head_dim) if by_turns else columns[w]

        def exchange(t, ds_t):
            """Share dS^T, then this warpgroup's share of dQ_partial = dS K over the CTA's 128
            keys: its columns (column split) or, on its turn, all of it (`dq_columns`)."""
            par = lax.rem(t, jnp.int32(2))      # the step's parity: whose turn it is
            ds_smem.at[par, w][...] = ds_t
            plgpu.commit_smem()
            plgpu.barrier_arrive(ds_ready.at[par])
            with jax.named_scope("ds_wait"):
                plgpu.barrier_wait(ds_ready.at[par])

            def run(acc_ref):
                for rt in range(2):
                    k_tile = k_smem.at[rt] if by_turns else k_smem.at[rt].at[:, pl.ds(col0, cols)]
                    plgpu.wgmma(acc_ref, ds_smem.at[par, rt].T, k_tile)
                return acc_ref[...]

            def slot_released():
                dslot = lax.rem(t, jnp.int32(slots))
                # Barrier phases are counted per waiter: in turns both warpgroups wait.
                with jax.named_scope("slot_wait"):
                    pl.when(t >= slots)(lambda: plgpu.barrier_wait(dq_free.at[dslot]))
                return dslot

            def product_to_slot():
                dq = pl.run_scoped(run, plgpu.ACC((BLOCK_Q, cols), jnp.float32)) * spec.scale
                dslot = slot_released()
                dq_smem.at[dslot].at[:, pl.ds(col0, cols)][...] = dq
                plgpu.commit_smem()
                return dslot

            if by_turns:
                @pl.when(par == w)
                def _my_turn():
                    product_to_slot()

                @pl.when(par != w)
                def _not_my_turn():
                    slot_released()

                dslot = lax.rem(t, jnp.int32(slots))
            else:
                dslot = product_to_slot()
            plgpu.barrier_arrive(dq_ready.at[dslot])

        def item_work(n, t0):
            it = item(n)
            key0 = it.kv_start + w * WG_ROWS
            lo, full_lo, full_hi, hi = clamp_range(
                mask.q_blocks(key0, WG_ROWS, BLOCK_Q, mask.seq_kv, mask.seq_q), it.cta_lo,
                it.cta_hi)
            cta_hi = it.cta_hi
            if f16:
                # dK's cast factor of each of this warpgroup's keys (`dk_cast_scales`).
                kf = plgpu.load(kf_ref.at[it.batch, it.kv_global, pl.ds(key0, WG_ROWS)],
                                optimized=False)
                inv_kf = 1.0 / kf
            # The dQ product reads both key tiles.
            with jax.named_scope("kv_wait"):
                plgpu.barrier_wait(k_loaded.at[0])
                plgpu.barrier_wait(k_loaded.at[1])
                plgpu.barrier_wait(v_loaded.at[w])

            def step(h, i, carry, masked: bool):
                dk, dv = carry
                t = step_after(t0, it.step_of(h, i))
                slot = lax.rem(t, jnp.int32(stages))
                q_blk, do_blk, st = q_smem.at[slot], do_smem.at[slot], st_smem.at[slot]

                def wait_q():
                    plgpu.barrier_wait(q_loaded.at[slot])
                    plgpu.barrier_wait(st_loaded.at[slot])

                def visible_fn():
                    return tile_visibility(mask, shape, key0, i * BLOCK_Q, kv_len,
                                           keys_as_rows=True)

                p_t, ds_t = transposed_weights(
                    spec, c, my_k, my_v, q_blk, do_blk, st, shape, wait_q=wait_q,
                    wait_do=lambda: plgpu.barrier_wait(do_loaded.at[slot]),
                    visible_fn=visible_fn if masked else None)
                dv = product(dv, p_t.astype(dtype), do_blk, interpret=spec.interpret,
                             stage_ref=stage)
                if f16:
                    # Two scaled casts (module docstring): per key for dK, per query for dQ.
                    inv_s = plgpu.load(st.at[3])
                    ds_k = (ds_t * bcast_rows(inv_kf, shape)).astype(dtype)
                    ds_t = (ds_t * bcast_cols(inv_s, shape)).astype(dtype)
                else:
                    ds_t = ds_k = ds_t.astype(dtype)
                dk = product(dk, ds_k, q_blk, interpret=spec.interpret, stage_ref=stage)
                plgpu.barrier_arrive(slot_free.at[slot])  # Q, dO, stats of this step are read
                exchange(t, ds_t)
                return dk, dv

            def drain(h, i):
                # A block only the other warpgroup sees: the exchange still needs a (zero) half.
                t = step_after(t0, it.step_of(h, i))
                slot = lax.rem(t, jnp.int32(stages))
                plgpu.barrier_wait(q_loaded.at[slot])
                plgpu.barrier_wait(st_loaded.at[slot])
                plgpu.barrier_wait(do_loaded.at[slot])
                plgpu.barrier_arrive(slot_free.at[slot])
                # No layout hint (forward.py says why): the dS^T store's layout is the steps'.
                exchange(t, jnp.zeros((WG_ROWS, BLOCK_Q), dtype))

            def downward(a, b, fn, carry):
                """fn(j, carry) for j = b - 1 down to a."""
                return lax.fori_loop(0, b - a, lambda n, cr: fn(b - 1 - n, cr), carry)

            def heads(fn):
                """fn(h, i, carry) for the group's q heads in turn, at block i."""
                if group == 1:
                    return lambda i, cr: fn(0, i, cr)
                return lambda i, cr: lax.fori_loop(0, group, lambda h, c: fn(h, i, c), cr)

            def drained(h, i, _):
                drain(h, i)

            def head_loop(h, carry):
                """Head-major: every block of q head h, last first."""
                downward(hi, cta_hi, lambda i, _: drain(h, i), None)
                carry = downward(full_hi, hi, lambda i, cr: step(h, i, cr, True), carry)
                carry = downward(full_lo, full_hi, lambda i, cr: step(h, i, cr, False), carry)
                carry = downward(lo, full_lo, lambda i, cr: step(h, i, cr, True), carry)
                downward(it.cta_lo, lo, lambda i, _: drain(h, i), None)
                return carry

            carry = (zeros_acc(WG_ROWS, head_dim), zeros_acc(WG_ROWS, head_dim))
            with jax.named_scope("steps"):
                if group > 1 and not it.block_major:
                    dk, dv = lax.fori_loop(0, group, head_loop, carry)
                else:
                    downward(hi, cta_hi, heads(drained), None)
                    carry = downward(full_hi, hi,
                                     heads(lambda h, i, cr: step(h, i, cr, True)), carry)
                    carry = downward(full_lo, full_hi,
                                     heads(lambda h, i, cr: step(h, i, cr, False)), carry)
                    carry = downward(lo, full_lo,
                                     heads(lambda h, i, cr: step(h, i, cr, True)), carry)
                    downward(it.cta_lo, lo, heads(drained), None)
                    dk, dv = carry
            if not persistent:
                writer_tail(it.total)
            # Both warpgroups' last dQ products read both K tiles before K's buffer carries dK
            # out.
            with jax.named_scope("store"):
                plgpu.barrier_arrive(both_done)
                plgpu.barrier_wait(both_done)
                rows = (it.batch, pl.ds(key0, WG_ROWS), it.kv_global)
                if f16:
                    dk = dk * bcast_rows(kf * spec.scale, dk.shape)
                else:
                    dk = dk * spec.scale
                dk, dv = dk.astype(dtype), dv.astype(dtype)
                # The key's mark (`fused_backward`): 0 * x is 0 for a finite x and NaN for an
                # inf or NaN, so the row sum is NaN where the key's dK, dV or K row holds one.
                # K is read before its buffer takes dK.
                probe = ((dk.astype(jnp.float32) * 0.0 + dv.astype(jnp.float32) * 0.0)
                         + my_k[...].astype(jnp.float32) * 0.0)
                mark_smem.at[w][...] = jnp.sum(probe, axis=1)
                my_k[...] = dk
                my_v[...] = dv
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(my_k, dk_ref.at[rows])
                plgpu.copy_smem_to_gmem(my_v, dv_ref.at[rows])
                plgpu.copy_smem_to_gmem(
                    mark_smem.at[w], marks_ref.at[it.batch, it.kv_head, pl.ds(key0, WG_ROWS)])
                if persistent:
                    # Read out: the copy warpgroup may load the next item's K and V.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    pl.when(n + 1 < n_items)(lambda: plgpu.barrier_arrive(kv_free))
                else:
                    plgpu.wait_smem_to_gmem(0)
            return step_after(t0, it.total)

        def writer_tail(total):
            # Await the writer's last releases (interpret mode checks every phase is awaited).
            with jax.named_scope("writer_tail"):
                await_last_frees(dq_free, slots, total)

        steps = over_items(item_work)
        if persistent:
            writer_tail(steps)
            plgpu.wait_smem_to_gmem(0)

    for w in range(2):
        # Static warpgroup index: static column slices of K and of the dQ tile.
        pl.when(wg == w)(functools.partial(compute, w))

    @pl.when(wg == 2)
    def _copy():
        plgpu.set_max_registers(cfg.fused_side_registers(), action="decrease")

        def load_kv(it):
            for rt in range(2):
                rows = (it.batch, pl.ds(it.kv_start + rt * WG_ROWS, WG_ROWS), it.kv_global)
                plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[rt], k_loaded.at[rt])
                plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[rt], v_loaded.at[rt])

        def issuer(it):
            def issue(t, slot):
                q_head, j = it.block_of(t)
                if head0 is not None:
                    q_head = q_head + head0 * group
                rows = (it.batch, pl.ds(j * BLOCK_Q, BLOCK_Q), q_head)
                plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], q_loaded.at[slot])
                plgpu.copy_gmem_to_smem(
                    st_ref.at[it.batch, q_head, :, pl.ds(j * BLOCK_Q, BLOCK_Q)],
                    st_smem.at[slot], st_loaded.at[slot])
                plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], do_loaded.at[slot])
            return issue

        if not persistent:
            load_kv(only)
            with jax.named_scope("stream"):
                stream_through_slots(issuer(only), slot_free, stages, only.total)
            return

        def item_copies(n, t0):
            """An item's stream: its first steps as soon as slots free (under the previous
            item's last steps and dK / dV store), its K and V once their buffers are free."""
            it = item(n)
            issue = issuer(it)

            def refill(t, _):
                slot = lax.rem(t0 + t, jnp.int32(stages))
                pl.when(t0 + t >= stages)(lambda: plgpu.barrier_wait(slot_free.at[slot]))
                issue(t, slot)

            ahead = jnp.minimum(it.total, stages)
            lax.fori_loop(jnp.int32(0), ahead, refill, None)
            pl.when(n > 0)(lambda: plgpu.barrier_wait(kv_free))
            load_kv(it)
            lax.fori_loop(ahead, it.total, refill, None)
            return t0 + it.total

        with jax.named_scope("stream"):
            await_last_frees(slot_free, stages, over_items(item_copies))

    @pl.when(wg == 3)
    def _write():
        plgpu.set_max_registers(cfg.fused_side_registers(), action="decrease")
        sem = None
        if not spec.interpret:
            sem = pl.get_global(plgpu.SemaphoreType.REGULAR((dq_ref.shape[0] * q_heads
                                                              * n_qblocks,)))

        def item_writes(n, t0):
            it = item(n)

            def write(t, _):
                q_head, j = it.block_of(t)
                dslot = lax.rem(step_after(t0, t), jnp.int32(slots))
                src = dq_smem.at[dslot]
                rows = (it.batch, pl.ds(j * BLOCK_Q, BLOCK_Q), q_head)
                first = mask.kv_blocks(j * BLOCK_Q, BLOCK_Q, CTA_KEYS, mask.seq_kv)[0]
                rank = it.tile - first  # tiles that add to this q block before this one
                plgpu.barrier_wait(dq_ready.at[dslot])
                if spec.interpret:
                    acc_smem, acc_loaded = interp_smem[1], interp_smem[2]

                    def add_previous():
                        plgpu.copy_gmem_to_smem(dq_ref.at[rows], acc_smem, acc_loaded)
                        plgpu.barrier_wait(acc_loaded)
                        src[...] = src[...] + acc_smem[...]
                        plgpu.commit_smem()

                    if persistent:
                        # The interpreter runs CTAs one after another, so a tile's CTA may run
                        # before the CTA of the tile below: every tile adds, onto zeros.
                        add_previous()
                    else:
                        pl.when(rank > 0)(add_previous)
                    plgpu.copy_smem_to_gmem(src, dq_ref.at[rows])
                    plgpu.wait_smem_to_gmem(0)
                else:
                    flag = sem.at[(it.batch * q_heads + q_head) * n_qblocks + j]
                    with jax.named_scope("chain_wait"):
                        plgpu.semaphore_wait(flag, rank, decrement=False, memory_scope="gpu")
                    pl.when(rank == 0)(lambda: plgpu.copy_smem_to_gmem(src, dq_ref.at[rows]))
                    pl.when(rank > 0)(lambda: plgpu.copy_smem_to_gmem(
                        src, dq_ref.at[rows], reduction_op="add"))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    plgpu.barrier_arrive(dq_free.at[dslot])
                    plgpu.wait_smem_to_gmem(0)  # the sum has landed
                    plgpu.semaphore_signal(flag, 1, memory_scope="gpu")  # the next tile may add
                if spec.interpret:
                    plgpu.barrier_arrive(dq_free.at[dslot])

            lax.fori_loop(jnp.int32(0), it.total, write, None)
            return step_after(t0, it.total)

        over_items(item_writes)


def fused_backward(spec: AttentionSpec, q, k, v, do, rows, cfg):
    """(dq, dk, dv, marks) for operands already padded as backward.py pads them (sequence
    axes to a multiple of 8; rows = the [b, hq, 3, *] m / r / D statistics padded to whole q
    blocks; float16 adds dQ's cast factors as a fourth row, `dq_cast_scales`).

    marks: float32 [b, kv heads, key tiles x 128], NaN for each key whose dK, dV or K row holds
    an inf or NaN, 0 elsewhere. A non-finite q, k, v, dO or D entry that the kernel reads,
    also at a position the mask hides, reaches a mark: through the products that carry it into
    dK and dV (dS^T Q, P^T dO, with dS from dO V^T and D). K's own reaches dK and dV only
    through the masked logits' arithmetic and dQ (dS K) in any case, so it is marked from K
    itself. So no NaN mark means that no non-finite value reached the gradients (guarded.py);
    an entry no tile reads (a key no query sees, in a tile that visits no q block) is left
    unmarked, and reaches nothing.

    Under jax.vmap the vmapped axis is folded into the batch axis (one kernel launch with a
    larger batch). The generic rule of plgpu.kernel would add a grid axis instead, and the
    semaphores, indexed by (batch, q head, q block) and shared by the whole grid, would then be
    counted by the tiles of every vmapped instance at once: a tile could add before the tile
    ahead of it had stored.
    """
    return _batch_folded(functools.partial(_fused, spec=spec, cfg=cfg))(q, k, v, do, rows)


def _batch_folded(fn):
    """fn(*arrays), every array with the batch on axis 0, with jax.vmap folded into that axis."""
    @custom_batching.custom_vmap
    def run(*args):
        return fn(*args)

    @run.def_vmap
    def _rule(axis_size, in_batched, *args):
        merged = []
        for x, batched in zip(args, in_batched):
            if not batched:
                x = jnp.broadcast_to(x, (axis_size,) + x.shape)
            merged.append(x.reshape((axis_size * x.shape[1],) + x.shape[2:]))
        outs = run(*merged)
        outs = tuple(o.reshape((axis_size, o.shape[0] // axis_size) + o.shape[1:])
                     for o in outs)
        return outs, (True,) * len(outs)

    return run


def _fused(q, k, v, do, rows, *, spec: AttentionSpec, cfg):
    batch, seq_q8, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = q_heads // kv_heads
    dtype = q.dtype
    mask = spec.mask
    stages, slots = cfg.fused_stages, cfg.fused_dq_slots
    n_tiles = pl.cdiv(mask.seq_kv, CTA_KEYS)
    n_qblocks = pl.cdiv(mask.seq_q, BLOCK_Q)
    scratch = [
        plgpu.SMEM((2, WG_ROWS, head_dim), dtype),           # K
        plgpu.SMEM((2, WG_ROWS, head_dim), dtype),           # V
        plgpu.SMEM((stages, BLOCK_Q, head_dim), dtype),      # Q stream
        plgpu.SMEM((stages, BLOCK_Q, head_dim), dtype),      # dO stream
        plgpu.SMEM((stages, stat_rows(dtype), BLOCK_Q), jnp.float32),  # m, r, D (, s)
        plgpu.SMEM((DS_BUFFERS, 2, WG_ROWS, BLOCK_Q), dtype),  # dS^T [parity, key tile]
        plgpu.SMEM((slots, BLOCK_Q, head_dim), jnp.float32), # dQ tiles
        plgpu.SMEM((2, WG_ROWS), jnp.float32),               # the keys' marks
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=DS_BUFFERS),  # dS^T halves written
        plgpu.Barrier(num_arrivals=2, num_barriers=slots),   # dQ tile written
        plgpu.Barrier(num_barriers=slots),                   # dQ tile sent
        plgpu.Barrier(num_arrivals=2),                       # K no longer read
    ]
    persistent = cfg.fused_persistent
    if persistent:
        scratch.append(plgpu.Barrier(num_arrivals=2))        # dK, dV read out of K, V smem
    if spec.interpret:
        scratch += [plgpu.SMEM((2, WG_ROWS, BLOCK_Q), dtype),
                    plgpu.SMEM((BLOCK_Q, head_dim), jnp.float32),
                    plgpu.Barrier()]
    # q blocks no tile sees are never written: zeroed (static ranges: only where needed).
    first, last = fused_first_tiles(mask, n_qblocks)
    seen = np.repeat(last > first, BLOCK_Q)[:seq_q8]

    scales, extra = None, ()
    if jnp.dtype(dtype) == jnp.float16:
        # dQ's cast factors as the fourth statistic (as 1 / s), and undone on the sum; dK's as
        # one more operand, read once per warpgroup.
        delta = rows[:, :, 2, :seq_q8]
        scales = dq_cast_scales(v, do, delta, group)
        inv = pad_seq(1.0 / scales, rows.shape[-1], axis=2, value=1.0)
        rows = jnp.concatenate([rows, inv[:, :, None]], axis=2)
        extra = (dk_cast_scales(v, do, delta, group, n_tiles * CTA_KEYS),)

    def finish(dq_sum, head0: int = 0):
        if scales is not None:
            part = scales[:, head0:head0 + dq_sum.shape[2]]
            dq_sum = dq_sum * jnp.swapaxes(part, 1, 2)[..., None]
        if not seen.all():
            dq_sum = jnp.where(jnp.asarray(seen)[None, :, None, None], dq_sum, 0.0)
        return dq_sum.astype(dtype)

    def launch_kernel(heads: int, split: bool):
        """The kernel over `heads` kv heads and their q heads. Its operands: q, k, v, dO, the
        statistics and, for float16, dK's cast factors. split: then the index of its
        first kv head as an int32 [1] array, then dK and dV as refs written in place (every
        launch writes its own heads), then dQ's ref, which it does not touch: taking it orders
        each launch after the previous launch's sum has been cast into it, so that one float32
        sum is alive at a time."""
        chunk = fused_head_chunk(cfg, batch, heads)
        body = functools.partial(_fused_body, spec=spec, cfg=cfg, group=group,
                                 head_dim=head_dim, q_heads=heads * group, n_qblocks=n_qblocks,
                                 n_tiles=n_tiles, chunk=chunk, batch_size=batch)
        dq_type = jax.ShapeDtypeStruct((batch, seq_q8, heads * group, head_dim), jnp.float32)
        marks_type = jax.ShapeDtypeStruct((batch, heads, n_tiles * CTA_KEYS), jnp.float32)
        n_extra = len(extra)
        if persistent:
            items = heads * n_tiles * batch
            plan = persistent_plan(mask, n_qblocks, heads, group, batch, chunk,
                                   min(items, cfg.fused_ctas or device_sms()),
                                   cfg.fused_handout)
            grid = dict(grid=(plan.shape[0],), grid_names=("cta",))
        else:
            plan = None
            grid = dict(grid=fused_grid(heads, n_tiles, batch, chunk),
                        grid_names=("head", "tile", "batch"))

        def kernel_body(q_ref, k_ref, v_ref, do_ref, st_ref, *refs):
            kf_ref = refs[0] if n_extra else None
            refs = refs[n_extra:]
            plan_ref = refs[0] if persistent else None
            refs = refs[1:] if persistent else refs
            if split:
                head0_ref, dk_ref, dv_ref, _dq_state, dq_ref, marks_ref, *scratch_refs = refs
            else:
                head0_ref = None
                dk_ref, dv_ref, dq_ref, marks_ref, *scratch_refs = refs
            body(q_ref, k_ref, v_ref, do_ref, st_ref, dk_ref, dv_ref, dq_ref, marks_ref,
                 *scratch_refs,
                 head0_ref=head0_ref, kf_ref=kf_ref, plan_ref=plan_ref)

        if split:
            out_type = (dq_type, marks_type)
        else:
            kv_shape = jax.ShapeDtypeStruct(k.shape, dtype)
            out_type = (kv_shape, kv_shape, dq_type, marks_type)
        kernel = plgpu.kernel(
            kernel_body,
            out_type=out_type,
            scratch_types=scratch,
            **grid,
            num_threads=4,
            thread_name="wg",
            compiler_params=plgpu.CompilerParams(
                approx_math=True,
                **profile_params(cfg.fused_profile_dir, 2 * n_qblocks * group + 8)),
            # The persistent interpreted kernel adds every dQ tile onto zeros (`_fused_body`).
            interpret=interpret_params(spec.interpret, 4, zero_memory=persistent),
            kernel_name=FUSED_KERNEL_NAME,
        )
        if plan is None:
            return kernel
        plan_array = jnp.asarray(plan)
        return lambda *args: kernel(*args[:5 + n_extra], plan_array, *args[5 + n_extra:])

    launches = fused_launches(cfg, batch, mask.seq_q, q_heads, kv_heads, head_dim, n_tiles)
    if launches == 1:
        dk, dv, dq_sum, marks = launch_kernel(kv_heads, split=False)(q, k, v, do, rows, *extra)
        return finish(dq_sum), dk, dv, marks
    heads = kv_heads // launches
    # One jitted launch called `launches` times: lowered (Mosaic GPU's layout inference, seconds
    # per kernel) once, not once per launch.
    launch = jax.jit(launch_kernel(heads, split=True))
    dk_ref = jax.new_ref(jnp.zeros(k.shape, dtype))
    dv_ref = jax.new_ref(jnp.zeros(v.shape, dtype))
    dq_ref = jax.new_ref(jnp.zeros(q.shape, dtype))
    marks = []
    for n in range(launches):
        # Each launch's q heads are one contiguous range: q head = kv head x group + h.
        head0 = jnp.full((1,), n * heads, jnp.int32)
        dq_sum, launch_marks = launch(q, k, v, do, rows, *extra, head0, dk_ref, dv_ref, dq_ref)
        dq_ref[:, :, n * heads * group:(n + 1) * heads * group] = finish(dq_sum,
                                                                         n * heads * group)
        marks.append(launch_marks)
    return dq_ref[...], dk_ref[...], dv_ref[...], jnp.concatenate(marks, axis=1)
