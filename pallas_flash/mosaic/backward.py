"""Backward kernels for Hopper (sm_90), lowered through Pallas Mosaic GPU: dK/dV, then dQ.

Contract of `triton.backward.backward`: (dq, dk, dv) in the dtypes and layouts of q, k, v, from
the forward's stats.RowStats. V may have a head_dim below Q/K's (MLA): V, dO and dV take it,
Q, K, dQ and dK Q/K's; the two kernels below serve it, the fused one does not. Tile by tile,
with c = logit_scale * log2(e), u in logit units and D = rowsum(dO * O) - dlse (one XLA pass
before the kernels):
    P = 2^((u - m) c - r),  dP = dO V^T,  dS = P (dP - D)   (times 1 - t^2 with a softcap).
Where fused_backward.py serves the call (config.fused), it runs instead of these two kernels.

* dK/dV `pallas_flash_mosaic_bwd_dkdv`: grid (kv tile, kv head, batch). A CTA keeps its K and
  V rows in shared memory and loops over the q heads of its GQA group (inside the CTA: no
  atomics, deterministic) and the q blocks that see its keys, in the transposed orientation
  (key rows are the wgmma M dimension; m, r, D index columns):
      S^T = K Q^T,  P^T,  dP^T = V dO^T,  dS^T,  dV += P^T dO,  dK += dS^T Q.
  Two compute warpgroups own 64 key rows each; above head_dim 128 (registers) they own the
  same 64 rows and split the columns of dK and dV, and `dkdv_paired` divides the recomputation.
* dQ `pallas_flash_mosaic_bwd_dq`: grid (q tile, q head, batch), dq_compute_wgs warpgroups of
  64 q rows, looping over key blocks:  S = Q K^T,  P,  dP,  dS,  dQ += dS K.

Each CTA also has a copy warpgroup streaming through `stages` slots with "loaded" and "free"
barriers, and warpgroups drain the blocks outside their own range, as in the forward. The
loop bounds are MaskSpec's (q_blocks for dK/dV, kv_blocks for dQ), narrowed by segment ids.
Rows past seq_q have (m, r, D) = (0, +inf, 0), hence P = 0 with no mask; keys past seq_kv are
masked. float16 dS is scaled per row before its cast (`tiles.cast_rows`). Interpret mode
stages the register operands (P^T, dS^T, dS) through shared memory.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash.masking import PAD_KEY_ID, PAD_QUERY_ID, segment_block_ranges
from pallas_flash.mosaic import fused_backward
from pallas_flash.mosaic.common import (clamp_range, interpret_params, logit_units, narrowed,
                                       pad_seq, query_tile_position, stream_through_slots,
                                       streamed_range, unsupported_operands)
from pallas_flash.mosaic.config import (MAX_SETMAXNREG, SMEM_LIMIT, WG_ROWS,
                                       MosaicBackwardConfig, default_backward_config)
from pallas_flash.mosaic.tiles import (accumulate, bcast_cols, bcast_rows, cast_rows, idiv,
                                      matmul, nonfinite_rows, product, row_vector,
                                      tile_visibility, transposed_probabilities,
                                      transposed_score_grads, transposed_weights, zeros_acc)
from pallas_flash.mosaic.schedule import TileGrid, backward_orders, grid_position
from pallas_flash.spec import AttentionSpec
from pallas_flash.stats import LOG2E, RowStats, logit_scale, output_dot

__all__ = ["DKDV_KERNEL_NAME", "DQ_KERNEL_NAME", "MosaicBackwardConfig",
           "default_backward_config", "backward", "backward_checked", "unsupported_reason"]

DKDV_KERNEL_NAME = "pallas_flash_mosaic_bwd_dkdv"
DQ_KERNEL_NAME = "pallas_flash_mosaic_bwd_dq"


def unsupported_reason(spec: AttentionSpec, q, k, v,
                       config: MosaicBackwardConfig | None = None):
    """Why these kernels cannot take the call, or None if they can."""
    reason = unsupported_operands("backward", q, k, v, v_head_dim_may_differ=True)
    if reason is not None:
        return reason
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    cfg = config or default_backward_config(head_dim)
    if uses_fused(spec, q, k, cfg, head_dim_v):
        kernels = (("fused", cfg.fused_smem_bytes(
            head_dim, stat_rows=fused_backward.stat_rows(q.dtype))),)
    else:
        kernels = (("dK/dV", cfg.dkdv_smem_bytes(head_dim, head_dim_v=head_dim_v)),
                   ("dQ", cfg.dq_smem_bytes(head_dim, head_dim_v=head_dim_v)))
    for name, need in kernels:
        if need > SMEM_LIMIT:
            return (f"mosaic backward: config {cfg} needs {need} bytes of shared memory in the "
                    f"{name} kernel at head_dim {head_dim} (limit {SMEM_LIMIT})")
    return None


def uses_fused(spec: AttentionSpec, q, k, cfg: MosaicBackwardConfig,
               head_dim_v: int | None = None) -> bool:
    """Whether `backward` runs the one-kernel path (fused_backward.py) for this call; never
    with V's own head_dim (head_dim_v)."""
    if head_dim_v is not None and head_dim_v != q.shape[-1]:
        return False
    return cfg.fused and fused_backward.unsupported_reason(spec, q) is None


def _lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)


# ---- helpers used inside the kernels ------------------------------------------------------------

def _same_segment(row_ids, col_ids, shape):
    return bcast_rows(row_ids, shape) == bcast_cols(col_ids, shape)


def _and_mask(a, b):
    return b if a is None else (a if b is None else a & b)


# ---- dK / dV ----------------------------------------------------------------------------------

def _with_segment_refs(body):
    """A kernel taking its refs as plgpu.kernel passes them, calling `body` with the four
    segment refs (q ids, kv ids, CTA ranges, warpgroup ranges) always in place: None without
    segment ids, so one body serves both."""

    def kernel(*refs, spec: AttentionSpec, **kwargs):
        if spec.has_segments:
            ins, rest = refs[:9], refs[9:]
        else:
            ins, rest = refs[:5] + (None,) * 4, refs[5:]
        body(*ins, *rest, spec=spec, **kwargs)

    return kernel


def _dkdv_body(q_ref, k_ref, v_ref, do_ref, st_ref, q_ids_ref, kv_ids_ref, cta_seg_ref,
               wg_seg_ref, dk_ref, dv_ref, marks_ref,
               k_smem, v_smem, q_smem, do_smem, st_smem, mark_smem,
               k_loaded, v_loaded, q_loaded, do_loaded, st_loaded, slot_free, halves_done,
               *extra_smem,
               spec: AttentionSpec, cfg: MosaicBackwardConfig, group: int, head_dim: int,
               head_dim_v: int, order: TileGrid):
    mask = spec.mask
    paired = cfg.dkdv_pairs(head_dim)
    if paired:
        (pt_smem, ds_smem, fk_smem, pt_ready, pt_free, ds_ready,
         ds_free), stage_smem = extra_smem[:7], extra_smem[7:]
    else:
        stage_smem = extra_smem
    dtype = q_ref.dtype
    block_q, stages = cfg.dkdv_block_q, cfg.dkdv_stages
    wgs = cfg.dkdv_compute_wgs()
    splits = cfg.dkdv_col_splits(head_dim)
    row_tiles = wgs // splits
    cta_rows = row_tiles * WG_ROWS
    # Each split's columns of dK (and Q) and of dV (and dO): (first, count).
    k_slices = cfg.dkdv_col_slices(head_dim, splits)
    v_slices = cfg.dkdv_col_slices(head_dim_v, splits)
    c = logit_scale(spec) * LOG2E
    # Keys past seq_kv exist only in a partial 64-row tile, which then needs the mask.
    kv_len = mask.seq_kv if mask.seq_kv % WG_ROWS else None

    tile, kv_head, batch, wg = grid_position(mask, order=order)
    kv_start = tile * cta_rows

    # The copy warpgroup streams [cta_lo, cta_hi) for each q head of the group.
    cta_lo, cta_hi = streamed_range(
        mask.q_blocks(kv_start, cta_rows, block_q, mask.seq_kv, mask.seq_q), cta_seg_ref, batch,
        tile)
    n_cta = cta_hi - cta_lo  # q blocks per head that the CTA streams
    total = group * n_cta

    def compute(split: int, row_tile):
        plgpu.set_max_registers(cfg.compute_registers, action="increase")
        (col_k, cols_k), (col_v, cols_v) = k_slices[split], v_slices[split]
        key0 = kv_start + row_tile * WG_ROWS
        bounds = mask.q_blocks(key0, WG_ROWS, block_q, mask.seq_kv, mask.seq_q)
        kv_ids = None
        if wg_seg_ref is not None:
            bounds = narrowed(bounds, wg_seg_ref, batch, tile * row_tiles + row_tile)
            kv_ids = plgpu.load(kv_ids_ref.at[batch, pl.ds(key0, WG_ROWS)], optimized=False)
        lo, full_lo, full_hi, hi = clamp_range(bounds, cta_lo, cta_hi)
        my_k, my_v = k_smem.at[row_tile], v_smem.at[row_tile]
        q_cols = (slice(None),) if splits == 1 else (slice(None), pl.ds(col_k, cols_k))
        do_cols = (slice(None),) if splits == 1 else (slice(None), pl.ds(col_v, cols_v))
        stage = stage_smem[0].at[wg] if spec.interpret else None
        plgpu.barrier_wait(k_loaded.at[row_tile])
        plgpu.barrier_wait(v_loaded.at[row_tile])

        def paired_step(dk, dv, fk, slot, q_blk, do_blk, st, shape, wait_q, visible_fn):
            """A step of `dkdv_paired`: warpgroup 0 forms P^T and hands it over, warpgroup 1
            forms dP^T and dS^T and hands that back; each adds its columns of dV and dK.

            With a softcap, dS^T needs P^T (1 - t^2) and dV needs P^T: warpgroup 0 hands over
            the first in float32 and the second in the input dtype, through the dS^T buffer,
            which holds nothing until warpgroup 1 writes this step's dS^T there (a third tile
            does not fit shared memory at head_dim 256)."""
            wait_do = lambda: plgpu.barrier_wait(do_loaded.at[slot])
            if split == 0:
                wait_q()
                p_t, t_t = transposed_probabilities(spec, c, my_k, q_blk, st, shape,
                                                       visible_fn)
                plgpu.barrier_wait(pt_free)
                if t_t is None:
                    pt_smem[...] = p_t
                else:
                    pt_smem[...] = p_t * (1.0 - t_t * t_t)
                    ds_smem[...] = p_t.astype(dtype)
                    plgpu.commit_smem()  # read by the partner's wgmma (the async proxy)
                plgpu.barrier_arrive(pt_ready)
                wait_do()
                dv = product(dv, p_t.astype(dtype), do_blk.at[do_cols],
                             interpret=spec.interpret, stage_ref=stage)
                plgpu.barrier_wait(ds_ready)
                if jnp.dtype(dtype) == jnp.float16:
                    fk_new = plgpu.load(fk_smem)
                    dk = dk * bcast_rows(fk / fk_new, dk.shape)
                    fk = fk_new
                dk = accumulate(dk, ds_smem, q_blk.at[q_cols], interpret=spec.interpret)
                plgpu.barrier_arrive(ds_free)
                return dk, dv, fk
            wait_q()
            wait_do()
            dp_t = matmul(my_v, do_blk.T, shape)
            plgpu.barrier_wait(pt_ready)
            p_t = plgpu.load(pt_smem)  # P^T, or P^T (1 - t^2) with a softcap
            plgpu.barrier_arrive(pt_free)
            ds_t = transposed_score_grads(p_t, dp_t, st)
            ds_in, rescale, fk = cast_rows(ds_t, fk, dtype)
            if spec.softcap is not None:
                # P^T waits in the dS^T buffer: into dV before dS^T takes its place.
                dv = accumulate(dv, ds_smem, do_blk.at[do_cols], interpret=spec.interpret)
            plgpu.barrier_wait(ds_free)
            ds_smem[...] = ds_in
            if rescale is not None:
                fk_smem[...] = fk
            plgpu.commit_smem()  # dS^T is read by the partner's wgmma (the async proxy)
            plgpu.barrier_arrive(ds_ready)
            if spec.softcap is None:
                dv = product(dv, p_t.astype(dtype), do_blk.at[do_cols],
                             interpret=spec.interpret, stage_ref=stage)
            if rescale is not None:
                dk = dk * bcast_rows(rescale, dk.shape)
            dk = product(dk, ds_in, q_blk.at[q_cols], interpret=spec.interpret,
                         stage_ref=stage)
            return dk, dv, fk

        def slot_of(h, i):
            return lax.rem(h * n_cta + (i - cta_lo), jnp.int32(stages))

        def step(h, i, carry, masked: bool):
            dk, dv, fk = carry
            slot = slot_of(h, i)
            q_blk, do_blk, st = q_smem.at[slot], do_smem.at[slot], st_smem.at[slot]
            shape = (WG_ROWS, block_q)
            def wait_q():
                plgpu.barrier_wait(q_loaded.at[slot])
                plgpu.barrier_wait(st_loaded.at[slot])

            def visible_fn():
                visible = tile_visibility(mask, shape, key0, i * block_q, kv_len,
                                          keys_as_rows=True)
                if kv_ids is not None:
                    q_ids = plgpu.load(q_ids_ref.at[batch, pl.ds(i * block_q, block_q)],
                                       optimized=False)
                    visible = _and_mask(visible, _same_segment(kv_ids, q_ids, shape))
                # None: queries past seq_q alone make it an edge; their r = +inf gives P = 0.
                return visible

            if paired:
                dk, dv, fk = paired_step(dk, dv, fk, slot, q_blk, do_blk, st, shape, wait_q,
                                         visible_fn if masked else None)
                plgpu.barrier_arrive(slot_free.at[slot])
                return dk, dv, fk
            p_t, ds_t = transposed_weights(
                spec, c, my_k, my_v, q_blk, do_blk, st, shape, wait_q=wait_q,
                wait_do=lambda: plgpu.barrier_wait(do_loaded.at[slot]),
                visible_fn=visible_fn if masked else None)
            dv = product(dv, p_t.astype(dtype), do_blk.at[do_cols],
                          interpret=spec.interpret, stage_ref=stage)
            ds_in, rescale, fk = cast_rows(ds_t, fk, dtype)
            if rescale is not None:
                dk = dk * bcast_rows(rescale, dk.shape)
            dk = product(dk, ds_in, q_blk.at[q_cols], interpret=spec.interpret,
                          stage_ref=stage)
            plgpu.barrier_arrive(slot_free.at[slot])
            return dk, dv, fk

        def drain(h, i):
            slot = slot_of(h, i)
            plgpu.barrier_wait(q_loaded.at[slot])
            plgpu.barrier_wait(st_loaded.at[slot])
            plgpu.barrier_wait(do_loaded.at[slot])
            plgpu.barrier_arrive(slot_free.at[slot])

        def head_loop(h, carry):
            # Drain, masked leading edge, unmasked middle, masked trailing edge, drain.
            lax.fori_loop(cta_lo, lo, lambda i, _: drain(h, i), None)
            carry = lax.fori_loop(lo, full_lo, lambda i, cr: step(h, i, cr, True), carry)
            carry = lax.fori_loop(full_lo, full_hi, lambda i, cr: step(h, i, cr, False), carry)
            carry = lax.fori_loop(full_hi, hi, lambda i, cr: step(h, i, cr, True), carry)
            lax.fori_loop(hi, cta_hi, lambda i, _: drain(h, i), None)
            return carry

        carry = (zeros_acc(WG_ROWS, cols_k), zeros_acc(WG_ROWS, cols_v),
                 row_vector(1.0, WG_ROWS))
        if paired:
            # Each side starts with its buffer free: one arrival ahead, awaited after the loop.
            plgpu.barrier_arrive(ds_free if split == 0 else pt_free)
        dk, dv, fk = lax.fori_loop(0, group, head_loop, carry)
        if paired:
            plgpu.barrier_wait(pt_free if split == 0 else ds_free)
        dk = dk * bcast_rows(fk * spec.scale, dk.shape)
        dk, dv = dk.astype(dtype), dv.astype(dtype)

        # The keys' marks (`backward_checked`): NaN where the key's dK or dV columns hold an
        # inf or NaN.
        mark_smem.at[wg][...] = nonfinite_rows(dk, dv)
        mark_rows = marks_ref.at[batch, kv_head, split, pl.ds(key0, WG_ROWS)]

        # K and V are no longer read: their buffers carry dK and dV out.
        rows = (batch, pl.ds(key0, WG_ROWS), kv_head)
        if splits == 1:
            my_k[...] = dk
            my_v[...] = dv
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(my_k, dk_ref.at[rows])
            plgpu.copy_smem_to_gmem(my_v, dv_ref.at[rows])
            plgpu.copy_smem_to_gmem(mark_smem.at[wg], mark_rows)
            plgpu.wait_smem_to_gmem(0)
            return

        # Column halves: both warpgroups read all of K and V, so each writes its half only
        # once both have finished; then one stores dK and the other dV.
        def both_arrived():
            plgpu.barrier_arrive(halves_done)
            plgpu.barrier_wait(halves_done)

        both_arrived()
        my_k.at[:, pl.ds(col_k, cols_k)][...] = dk
        my_v.at[:, pl.ds(col_v, cols_v)][...] = dv
        plgpu.commit_smem()
        both_arrived()
        plgpu.copy_smem_to_gmem(mark_smem.at[wg], mark_rows)  # awaited with dK's or dV's store

        @pl.when(wg == 0)
        def _():
            plgpu.copy_smem_to_gmem(my_k, dk_ref.at[rows])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 1)
        def _():
            plgpu.copy_smem_to_gmem(my_v, dv_ref.at[rows])
            plgpu.wait_smem_to_gmem(0)

    for col_split in range(splits):
        pl.when((wg < wgs) & (lax.rem(wg, jnp.int32(splits)) == col_split))(
            functools.partial(compute, col_split, idiv(wg, splits)))

    @pl.when(wg == wgs)
    def _copy():
        plgpu.set_max_registers(cfg.copy_registers, action="decrease")
        for rt in range(row_tiles):
            rows = (batch, pl.ds(kv_start + rt * WG_ROWS, WG_ROWS), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[rt], k_loaded.at[rt])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[rt], v_loaded.at[rt])

        def issue(t, slot):
            per_head = jnp.maximum(n_cta, 1)
            q_head = kv_head * group + lax.div(t, per_head)
            q0 = (cta_lo + lax.rem(t, per_head)) * block_q
            rows = (batch, pl.ds(q0, block_q), q_head)
            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], q_loaded.at[slot])
            plgpu.copy_gmem_to_smem(st_ref.at[batch, q_head, :, pl.ds(q0, block_q)],
                                    st_smem.at[slot], st_loaded.at[slot])
            plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], do_loaded.at[slot])

        stream_through_slots(issue, slot_free, stages, total)


# ---- dQ ---------------------------------------------------------------------------------------

def _dq_body(q_ref, k_ref, v_ref, do_ref, st_ref, q_ids_ref, kv_ids_ref, cta_seg_ref,
             wg_seg_ref, dq_ref, marks_ref,
             q_smem, do_smem, st_smem, k_smem, v_smem,
             own_loaded, k_loaded, v_loaded, k_free, v_free, *stage_smem,
             spec: AttentionSpec, cfg: MosaicBackwardConfig, group: int, n_tiles: int,
             head_dim: int, order: TileGrid):
    # dO's and V's head_dim come with their buffers: only dQ's (Q/K's) is named here.
    mask = spec.mask
    dtype = q_ref.dtype
    block_kv, stages, wgs = cfg.dq_block_kv, cfg.dq_stages, cfg.dq_compute_wgs
    cta_rows = wgs * WG_ROWS
    c = logit_scale(spec) * LOG2E
    # Keys past seq_kv exist only in a partial last key block.
    kv_len = mask.seq_kv if mask.seq_kv % block_kv else None

    tile, head, batch, wg, cta_start, cta_lo, cta_hi = query_tile_position(
        mask, n_tiles, cta_rows, block_kv, cta_seg_ref, order=order)
    n_steps = cta_hi - cta_lo

    def slot_of(j):
        return lax.rem(j - cta_lo, jnp.int32(stages))

    @pl.when(wg < wgs)
    def _compute():
        # One compute warpgroup (head_dim above 208) has a two-warpgroup CTA's registers to
        # share with the copy warpgroup alone: the most setmaxnreg gives, for its 64 x 256
        # float32 dQ beside S and dP (at compute_registers ptxas spilled twice as much).
        plgpu.set_max_registers(MAX_SETMAXNREG if wgs == 1 else cfg.compute_registers,
                                action="increase")
        q0 = cta_start + wg * WG_ROWS
        my_q, my_do, my_st = q_smem.at[wg], do_smem.at[wg], st_smem.at[wg]
        rows = (batch, pl.ds(q0, WG_ROWS), head)
        plgpu.copy_gmem_to_smem(q_ref.at[rows], my_q, own_loaded.at[wg])
        plgpu.copy_gmem_to_smem(do_ref.at[rows], my_do, own_loaded.at[wgs + wg])
        plgpu.copy_gmem_to_smem(st_ref.at[batch, head, :, pl.ds(q0, WG_ROWS)], my_st,
                                own_loaded.at[2 * wgs + wg])
        stage = stage_smem[0].at[wg] if spec.interpret else None
        shape = (WG_ROWS, block_kv)

        bounds = mask.kv_blocks(q0, WG_ROWS, block_kv, mask.seq_kv)
        q_ids = None
        if wg_seg_ref is not None:
            bounds = narrowed(bounds, wg_seg_ref, batch, tile * wgs + wg)
            q_ids = plgpu.load(q_ids_ref.at[batch, pl.ds(q0, WG_ROWS)], optimized=False)
        # A warpgroup wholly past seq_q computes nothing.
        bounds = tuple(jnp.where(q0 < mask.seq_q, b, cta_lo) for b in bounds)
        lo, full_lo, full_hi, hi = clamp_range(bounds, cta_lo, cta_hi)

        for j in range(3):
            plgpu.barrier_wait(own_loaded.at[j * wgs + wg])
        # No layout hints (forward.py says why): the wgmmas fix every layout.
        m = plgpu.load(my_st.at[0])
        r = plgpu.load(my_st.at[1])
        delta = plgpu.load(my_st.at[2])

        def step(s, carry, masked: bool):
            dq, fq = carry
            slot = slot_of(s)
            plgpu.barrier_wait(k_loaded.at[slot])
            u, t = logit_units(spec, matmul(my_q, k_smem.at[slot].T, shape))
            p = jnp.exp2((u - bcast_rows(m, shape)) * c - bcast_rows(r, shape))
            visible = None
            if masked:
                visible = tile_visibility(mask, shape, q0, s * block_kv, kv_len,
                                          keys_as_rows=False)
                if q_ids is not None:
                    kv_ids = plgpu.load(kv_ids_ref.at[batch, pl.ds(s * block_kv, block_kv)],
                                        optimized=False)
                    visible = _and_mask(visible, _same_segment(q_ids, kv_ids, shape))
                if visible is not None:
                    p = jnp.where(visible, p, 0.0)
            plgpu.barrier_wait(v_loaded.at[slot])
            dp = matmul(my_do, v_smem.at[slot].T, shape)
            plgpu.barrier_arrive(v_free.at[slot])
            ds = p * (dp - bcast_rows(delta, shape))
            if t is not None:
                ds = ds * (1.0 - t * t)  # softcap chain rule
            # P is zero outside `visible`, so dS is too (tiles.transposed_score_grads says why
            # no second select).
            ds_in, rescale, fq = cast_rows(ds, fq, dtype)
            if rescale is not None:
                dq = dq * bcast_rows(rescale, dq.shape)
            dq = product(dq, ds_in, k_smem.at[slot], interpret=spec.interpret, stage_ref=stage)
            plgpu.barrier_arrive(k_free.at[slot])
            return dq, fq

        def drain(s, _):
            slot = slot_of(s)
            plgpu.barrier_wait(k_loaded.at[slot])
            plgpu.barrier_wait(v_loaded.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])

        carry = (zeros_acc(WG_ROWS, head_dim), row_vector(1.0, WG_ROWS))
        lax.fori_loop(cta_lo, lo, drain, None)
        carry = lax.fori_loop(lo, full_lo, functools.partial(step, masked=True), carry)
        carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
        carry = lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), carry)
        lax.fori_loop(hi, cta_hi, drain, None)
        dq, fq = carry
        dq = (dq * bcast_rows(fq * spec.scale, dq.shape)).astype(dtype)
        my_q[...] = dq  # Q is no longer read: its buffer carries dQ out
        # The queries' marks (`backward_checked`), staged in this warpgroup's own statistics
        # buffer, which no step reads any more.
        my_st.at[0][...] = nonfinite_rows(dq)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(my_q, dq_ref.at[rows])
        plgpu.copy_smem_to_gmem(my_st.at[0], marks_ref.at[batch, head, pl.ds(q0, WG_ROWS)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == wgs)
    def _copy():
        plgpu.set_max_registers(cfg.copy_registers, action="decrease")
        kv_head = idiv(head, group)

        def load(i, _):
            # V first: it is released right after dP, K only after the dS K product.
            slot = lax.rem(i, jnp.int32(stages))
            rows = (batch, pl.ds((cta_lo + i) * block_kv, block_kv), kv_head)
            refill = i >= stages
            pl.when(refill)(lambda: plgpu.barrier_wait(v_free.at[slot]))
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_loaded.at[slot])
            pl.when(refill)(lambda: plgpu.barrier_wait(k_free.at[slot]))
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_loaded.at[slot])

        lax.fori_loop(jnp.int32(0), n_steps, load, None)

        def last_release(s, _):
            slot = lax.rem(s, jnp.int32(stages))
            plgpu.barrier_wait(v_free.at[slot])
            plgpu.barrier_wait(k_free.at[slot])

        lax.fori_loop(jnp.maximum(n_steps - stages, 0), n_steps, last_release, None)


# ---- entry point ------------------------------------------------------------------------------

def _segment_operands(row_ids, col_ids, row_pad, col_pad, *, cta_rows: int, n_ctas: int,
                      block_col: int, pad_row_id: int, pad_col_id: int):
    """Segment inputs of one kernel, whose CTAs own `cta_rows` rows in 64-row warpgroup tiles
    and loop over column blocks of `block_col`: the ids padded (to row_pad / col_pad) so that
    no id read goes past the end, and the column block ranges [lo, hi) per (batch, CTA) and per
    (batch, warpgroup tile), int32 [batch, n, 2]."""
    cta = jnp.stack(segment_block_ranges(row_ids, col_ids, cta_rows, block_col), axis=-1)
    wg = jnp.stack(segment_block_ranges(row_ids, col_ids, WG_ROWS, block_col), axis=-1)
    wg = pad_seq(wg, n_ctas * (cta_rows // WG_ROWS))
    # Padding ids match nothing (masking.py).
    row_ids = pad_seq(row_ids, row_pad, value=pad_row_id)
    col_ids = pad_seq(col_ids, col_pad, value=pad_col_id)
    return row_ids, col_ids, cta, wg


def backward(spec: AttentionSpec, q, k, v, out, stats: RowStats, do, dlse, q_ids=None,
             kv_ids=None, *, config: MosaicBackwardConfig | None = None, delta=None):
    """(dq, dk, dv) in the dtypes of q, k, v (contract of triton.backward.backward).

    stats: the forward's row statistics; dlse: the cotangent of the public lse (zeros if unused).
    q_ids, kv_ids: int32 segment ids with padding lengths folded in (masking.fold_lengths),
    given exactly when spec.has_segments.
    delta: the preprocess's D (stats.output_dot, float32), if already formed.
    Raises NotImplementedError for anything these kernels do not serve (`unsupported_reason`).
    """
    return backward_checked(spec, q, k, v, out, stats, do, dlse, q_ids, kv_ids, config=config,
                            delta=delta)[0]


def backward_checked(spec: AttentionSpec, q, k, v, out, stats: RowStats, do, dlse, q_ids=None,
                     kv_ids=None, *, config: MosaicBackwardConfig | None = None, delta=None):
    """((dq, dk, dv), clean): `backward`'s gradients, and a boolean scalar that is True when
    no inf or NaN reached them from any operand the kernels read, also from positions the mask
    hides (guarded.py reads it).

    clean comes from marks the kernels write beside their gradients, one float a row: the fused
    kernel's per key (fused_backward.fused_backward); here the dK/dV kernel's per key and
    column split, NaN where the key's dK or dV holds an inf or NaN, and the dQ kernel's per
    query, from dQ. Every non-finite entry these kernels read reaches one of those gradients:
    q through dK = dS^T Q, k through dQ = dS K, v through dP and so dS, dO through dV = P^T dO
    and dS, D through dS, each also where the mask sets P to 0 (0 * inf is NaN).
    """
    batch, seq_q, q_heads, head_dim = q.shape
    seq_kv, kv_heads, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    cfg = config or default_backward_config(head_dim)
    if (q_ids is not None) != spec.has_segments or (kv_ids is not None) != spec.has_segments:
        raise ValueError("mosaic backward: q_ids and kv_ids are given exactly when "
                         "spec.has_segments")
    reason = unsupported_reason(spec, q, k, v, cfg)
    if reason is not None:
        raise NotImplementedError(reason)
    group = q_heads // kv_heads
    dtype = q.dtype
    do = do.astype(dtype)

    # m, r, D travel together, [b, hq, 3, seq_q], padded with (0, +inf, 0); r = -inf (a row
    # that saw no key) is read as +inf too, so such rows have P = 0 exactly.
    if delta is None:
        delta = output_dot(out, do, dlse, jnp.float32)
    r = stats.r.astype(jnp.float32)
    r = jnp.where(r == -jnp.inf, jnp.inf, r)
    q_mult = _lcm(cfg.dkdv_block_q, cfg.dq_block_q())
    rows = jnp.stack([pad_seq(stats.m.astype(jnp.float32), q_mult, axis=2),
                      pad_seq(r, q_mult, axis=2, value=jnp.inf),
                      pad_seq(delta, q_mult, axis=2)], axis=2)

    # The TMA tiles the sequence axis by 8 rows; the kernels bound everything by spec.mask.
    q, do = pad_seq(q, 8), pad_seq(do, 8)
    k, v = pad_seq(k, 8), pad_seq(v, 8)
    if uses_fused(spec, q, k, cfg, head_dim_v):
        dq, dk, dv, marks = fused_backward.fused_backward(spec, q, k, v, do, rows, cfg)
        return (dq[:, :seq_q], dk[:, :seq_kv], dv[:, :seq_kv]), ~jnp.isnan(marks).any()
    compiler = plgpu.CompilerParams(approx_math=True)

    # ---- dK, dV ------------------------------------------------------------------------------
    wgs = cfg.dkdv_compute_wgs()
    block_kv = cfg.dkdv_block_kv(head_dim)
    row_tiles = block_kv // WG_ROWS
    bq, st = cfg.dkdv_block_q, cfg.dkdv_stages
    n_kv_tiles = pl.cdiv(seq_kv, block_kv)
    orders = backward_orders(spec, cfg, q, k, n_kv_tiles, pl.cdiv(seq_q, cfg.dq_block_q()))
    scratch = [
        plgpu.SMEM((row_tiles, WG_ROWS, head_dim), dtype),     # K, then dK
        plgpu.SMEM((row_tiles, WG_ROWS, head_dim_v), dtype),   # V, then dV
        plgpu.SMEM((st, bq, head_dim), dtype),                 # Q
        plgpu.SMEM((st, bq, head_dim_v), dtype),               # dO
        plgpu.SMEM((st, 3, bq), jnp.float32),
        plgpu.SMEM((wgs, WG_ROWS), jnp.float32),               # the keys' marks
        plgpu.Barrier(num_barriers=row_tiles),
        plgpu.Barrier(num_barriers=row_tiles),
        plgpu.Barrier(num_barriers=st),
        plgpu.Barrier(num_barriers=st),
        plgpu.Barrier(num_barriers=st),
        plgpu.Barrier(num_arrivals=wgs, num_barriers=st),
        plgpu.Barrier(num_arrivals=wgs),
    ]
    if cfg.dkdv_pairs(head_dim):
        scratch += [plgpu.SMEM((WG_ROWS, bq), jnp.float32),  # P^T
                    plgpu.SMEM((WG_ROWS, bq), dtype),        # dS^T
                    plgpu.SMEM((WG_ROWS,), jnp.float32),     # dS^T's float16 row scales
                    plgpu.Barrier(), plgpu.Barrier(),        # P^T written, taken
                    plgpu.Barrier(), plgpu.Barrier()]        # dS^T written, taken
    if spec.interpret:
        scratch.append(plgpu.SMEM((wgs, WG_ROWS, bq), dtype))
    args = [q, k, v, do, rows]
    if spec.has_segments:
        kv_ids_p, q_ids_p, cta, wg = _segment_operands(
            kv_ids, q_ids, n_kv_tiles * block_kv, pl.cdiv(seq_q, bq) * bq, cta_rows=block_kv,
            n_ctas=n_kv_tiles, block_col=bq, pad_row_id=PAD_KEY_ID, pad_col_id=PAD_QUERY_ID)
        args += [q_ids_p, kv_ids_p, cta, wg]
    splits = cfg.dkdv_col_splits(head_dim)
    dk, dv, dkdv_marks = plgpu.kernel(
        functools.partial(_with_segment_refs(_dkdv_body), spec=spec, cfg=cfg, group=group,
                          head_dim=head_dim, head_dim_v=head_dim_v, order=orders[0]),
        out_type=(jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype),
                  jax.ShapeDtypeStruct((batch, kv_heads, splits, n_kv_tiles * block_kv),
                                       jnp.float32)),
        scratch_types=scratch,
        **orders[0].params(),
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=compiler,
        interpret=interpret_params(spec.interpret, wgs + 1),
        kernel_name=DKDV_KERNEL_NAME,
    )(*args)

    # ---- dQ ----------------------------------------------------------------------------------
    wgs = cfg.dq_compute_wgs
    bkv, st = cfg.dq_block_kv, cfg.dq_stages
    scratch = [
        plgpu.SMEM((wgs, WG_ROWS, head_dim), dtype),     # Q, then dQ
        plgpu.SMEM((wgs, WG_ROWS, head_dim_v), dtype),   # dO
        plgpu.SMEM((wgs, 3, WG_ROWS), jnp.float32),
        plgpu.SMEM((st, bkv, head_dim), dtype),          # K
        plgpu.SMEM((st, bkv, head_dim_v), dtype),        # V
        plgpu.Barrier(num_barriers=3 * wgs),
        plgpu.Barrier(num_barriers=st),
        plgpu.Barrier(num_barriers=st),
        plgpu.Barrier(num_arrivals=wgs, num_barriers=st),
        plgpu.Barrier(num_arrivals=wgs, num_barriers=st),
    ]
    if spec.interpret:
        scratch.append(plgpu.SMEM((wgs, WG_ROWS, bkv), dtype))
    n_tiles = pl.cdiv(seq_q, cfg.dq_block_q())
    args = [q, k, v, do, rows]
    if spec.has_segments:
        q_ids_p, kv_ids_p, cta, wg = _segment_operands(
            q_ids, kv_ids, n_tiles * cfg.dq_block_q(), pl.cdiv(seq_kv, bkv) * bkv,
            cta_rows=cfg.dq_block_q(), n_ctas=n_tiles, block_col=bkv, pad_row_id=PAD_QUERY_ID,
            pad_col_id=PAD_KEY_ID)
        args += [q_ids_p, kv_ids_p, cta, wg]
    dq, dq_marks = plgpu.kernel(
        functools.partial(_with_segment_refs(_dq_body), spec=spec, cfg=cfg, group=group,
                          n_tiles=n_tiles, head_dim=head_dim, order=orders[1]),
        out_type=(jax.ShapeDtypeStruct(q.shape, dtype),
                  jax.ShapeDtypeStruct((batch, q_heads, n_tiles * cfg.dq_block_q()),
                                       jnp.float32)),
        scratch_types=scratch,
        **orders[1].params(),
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=compiler,
        interpret=interpret_params(spec.interpret, wgs + 1),
        kernel_name=DQ_KERNEL_NAME,
    )(*args)
    clean = ~(jnp.isnan(dkdv_marks).any() | jnp.isnan(dq_marks).any())
    return (dq[:, :seq_q], dk[:, :seq_kv], dv[:, :seq_kv]), clean
