"""Forward kernel for Hopper (sm_90), lowered through Pallas Mosaic GPU.

Contract of `triton.forward.forward`: O [batch, seq_q, q_heads, head_dim_v] in q's dtype and
stats.RowStats (m, r), float32 [batch, q_heads, seq_q], in logit units (stats.py). A row that
sees no key leaves with O = 0, m = 0 and r = -inf. With sinks, each head's sink logit joins
the denominator in the epilogue (stats.sink_epilogue), as in the Triton forward.

Grid: (tile, head, batch) in schedule.py's launch order. A CTA owns compute_wgs * block_q
query rows of one (batch, head): compute_wgs compute warpgroups of 64 rows (one wgmma M tile
each) and one copy warpgroup that streams the kv head's (head // group) K and V blocks of
block_kv keys through `stages` shared-memory slots. Each slot has a "loaded" barrier (the TMA
transaction count) and a "free" barrier (one arrival per compute warpgroup).

Math: FlashAttention-2's online softmax in base 2, c = logit_scale * log2(e), S in logit units:
    m' = max(m, rowmax S),  a = 2^((m - m') c),  P = 2^((S - m') c),
    l = l a + rowsum P,  acc = acc a + P V;  O = acc / l,  r = log2 l
with m' read as 0 while it is -inf, so no inf - inf is formed.

Masks: a warpgroup computes MaskSpec.kv_blocks of its rows, unmasked where every row sees the
whole block, masked by an iota compare on the edges; segment ids narrow the ranges
(masking.segment_block_ranges) and mask every block. The copy warpgroup streams the CTA's
range [cta_lo, cta_hi); a warpgroup waits for and releases the blocks outside its own ("drain"
steps), so each "free" barrier gets one arrival per warpgroup per phase.

Options (MosaicForwardConfig): ping-pong offsets the two warpgroups by half a step through a
rendezvous barrier; overlap lags P V by one block so the softmax runs while it is in flight;
clusters share each K / V block between adjacent tiles by TMA multicast ("free" barriers then
count the whole cluster's warpgroups).

Partial tiles: the TMA reads rows past the end as zeros and drops stores past it; lengths that
are not a multiple of 8 (the TMA's row tiling) are zero-padded in XLA first.
Unlike Triton, a non-finite V entry at a masked-out position of a visited block reaches its
row (0 * inf). So a row whose O holds an inf or NaN, leaked or genuine, leaves with r = NaN:
under backend="auto" guarded.py reads r (one float a row) to decide whether the Triton forward
redoes the call.
Interpret mode (`spec.interpret`) takes no wgmma operand in registers: P is staged through
shared memory and the product added to acc.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash.masking import PAD_KEY_ID, PAD_QUERY_ID, segment_block_ranges
from pallas_flash.mosaic.common import (clamp_range, interpret_params, logit_units, narrowed,
                                        pad_seq, profile_params, query_tile_position,
                                        step_after, streamed_range, unsupported_operands)
from pallas_flash.mosaic.config import (SMEM_LIMIT, MosaicForwardConfig, default_forward_config,
                                       register_budget)
from pallas_flash.mosaic.schedule import (CLUSTER_AXIS, TileGrid, device_sms, forward_item,
                                         forward_order, persistent_forward_plan)
from pallas_flash.mosaic.tiles import product
from pallas_flash.spec import AttentionSpec
from pallas_flash.stats import LOG2E, RowStats, logit_scale, sink_epilogue

__all__ = ["KERNEL_NAME", "MosaicForwardConfig", "default_forward_config", "forward",
           "register_budget", "unsupported_reason"]

KERNEL_NAME = "pallas_flash_mosaic_fwd"
F16_MAX = 65504.0


def unsupported_reason(spec: AttentionSpec, q, k, v, config: MosaicForwardConfig | None = None):
    """Why this kernel cannot take the call, or None if it can."""
    reason = unsupported_operands("forward", q, k, v, v_head_dim_may_differ=True)
    if reason is not None:
        return reason
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    cfg = config or default_forward_config(head_dim, spec)
    if cfg.cluster > 1 and spec.interpret:
        return ("mosaic forward: config.cluster > 1 runs compiled only (the GPU interpreter "
                "does not model TMA multicast)")
    smem = cfg.smem_bytes(head_dim, head_dim_v=head_dim_v)
    if smem > SMEM_LIMIT:
        return (f"mosaic forward: config {cfg} needs {smem} bytes of shared memory at this "
                f"head_dim (limit {SMEM_LIMIT})")
    return None


def _bcast_rows(x, shape):
    return lax.broadcast_in_dim(x, shape, [0])


def _kernel(*refs, spec: AttentionSpec, cfg: MosaicForwardConfig, group: int, n_tiles: int,
            head_dim: int, head_dim_v: int, order: TileGrid, has_sinks: bool):
    if spec.has_segments:
        (q_ref, k_ref, v_ref, q_ids_ref, kv_ids_ref, cta_seg_ref, wg_seg_ref), rest = (
            refs[:7], refs[7:])
    else:
        (q_ref, k_ref, v_ref), rest = refs[:3], refs[3:]
        q_ids_ref = kv_ids_ref = cta_seg_ref = wg_seg_ref = None
    sink_ref, rest = (rest[0], rest[1:]) if has_sinks else (None, rest)
    plan_ref, rest = (rest[0], rest[1:]) if cfg.persistent else (None, rest)
    _kernel_body(q_ref, k_ref, v_ref, q_ids_ref, kv_ids_ref, cta_seg_ref, wg_seg_ref, sink_ref,
                 *rest, spec=spec, cfg=cfg, group=group, n_tiles=n_tiles, head_dim=head_dim,
                 head_dim_v=head_dim_v, order=order, plan_ref=plan_ref)


def _kernel_body(q_ref, k_ref, v_ref, q_ids_ref, kv_ids_ref, cta_seg_ref, wg_seg_ref, sink_ref,
                 o_ref, m_ref, r_ref,
                 q_smem, k_smem, v_smem, m_smem, r_smem,
            q_loaded, k_loaded, v_loaded, k_free, v_free, rendezvous_bar, *extra,
            spec: AttentionSpec, cfg: MosaicForwardConfig, group: int, n_tiles: int,
            head_dim: int, head_dim_v: int, order: TileGrid, plan_ref=None):
    mask = spec.mask
    # O stages in Q's buffer, or with V's own head_dim (MLA) in one of its own; then P's
    # staging, interpret mode only.
    o_smem, p_smem = (extra[0], extra[1:]) if head_dim_v != head_dim else (q_smem, extra)
    block_q, block_kv, stages = cfg.block_q, cfg.block_kv, cfg.stages
    cta_rows = cfg.cta_rows
    dtype = q_ref.dtype
    c = logit_scale(spec) * LOG2E
    # Keys past seq_kv exist only in a partial last block, which then needs the mask.
    kv_len = mask.seq_kv if mask.seq_kv % block_kv else None

    if plan_ref is None:
        tile, head, batch, wg, cta_start, cta_lo, cta_hi = query_tile_position(
            mask, n_tiles, cta_rows, block_kv, cta_seg_ref, cfg.cluster, order)
        only = (tile, head, batch, cta_start, cta_lo, cta_hi, cta_hi - cta_lo)
        n_items = None

        def item(n):
            return only

        def over_items(fn):
            return fn(0, 0)
    else:
        # This CTA's items, in the order it runs them (schedule.persistent_forward_plan).
        wg = lax.axis_index("wg")
        cta = lax.axis_index("cta")
        n_items = plan_ref[cta, 0]

        def item(n):
            tile, head, batch = forward_item(plan_ref[cta, n + 1], n_tiles, o_ref.shape[2])
            start = tile * cta_rows
            lo, hi = streamed_range(mask.kv_blocks(start, cta_rows, block_kv, mask.seq_kv),
                                    cta_seg_ref, batch, tile)
            return tile, head, batch, start, lo, hi, hi - lo

        def over_items(fn):
            """fn(n, t0) for this CTA's items n, t0 the K / V steps of the items before n; fn
            returns t0 plus its item's steps."""
            return lax.fori_loop(jnp.int32(0), n_items, fn, jnp.int32(0))

    def q_buffer(n):
        """Warpgroup wg's Q buffer for item n (cfg.q_prefetch: two per warpgroup)."""
        return lax.rem(n, jnp.int32(2)) * cfg.compute_wgs + wg

    def rendezvous():
        if cfg.pingpong:
            plgpu.barrier_arrive(rendezvous_bar)
            plgpu.barrier_wait(rendezvous_bar)

    @pl.when(wg < cfg.compute_wgs)
    def _compute():
        plgpu.set_max_registers(cfg.compute_registers, action="increase")

        def compute_item(n, t0):
            tile, head, batch, cta_start, cta_lo, cta_hi, n_steps = item(n)

            def slot_of(j):
                return lax.rem(step_after(t0, j - cta_lo), jnp.int32(stages))

            q_start = cta_start + wg * block_q

            def load_q(at_batch, at_start, at_head, buffer):
                plgpu.copy_gmem_to_smem(
                    q_ref.at[at_batch, pl.ds(at_start, block_q), at_head], q_smem.at[buffer],
                    q_loaded.at[buffer])

            if cfg.q_prefetch:
                # Item n's Q sits in buffer n % 2; the first item loads its own, every later
                # one was loaded while the item before it ran (below).
                mine = q_buffer(n)
                pl.when(n == 0)(lambda: load_q(batch, q_start, head, mine))
            else:
                mine = wg
                load_q(batch, q_start, head, mine)
            my_q = q_smem.at[mine]

            bounds = mask.kv_blocks(q_start, block_q, block_kv, mask.seq_kv)
            q_ids = None
            if wg_seg_ref is not None:
                bounds = narrowed(bounds, wg_seg_ref, batch, tile * cfg.compute_wgs + wg)
                q_ids = plgpu.load(q_ids_ref.at[batch, pl.ds(q_start, block_q)], optimized=False)
            # A warpgroup wholly past seq_q computes nothing.
            bounds = tuple(jnp.where(q_start < mask.seq_q, b, cta_lo) for b in bounds)
            lo, full_lo, full_hi, hi = clamp_range(bounds, cta_lo, cta_hi)

            def visible_logits(j, u, masked: bool):
                """S of key block j in logit units, -inf where the mask or the ids hide a key."""
                u, _ = logit_units(spec, u)
                if not masked:
                    return u
                shape = (block_q, block_kv)
                rows = lax.broadcasted_iota(jnp.int32, shape, 0)
                cols = lax.broadcasted_iota(jnp.int32, shape, 1)
                visible = mask.visible(rows + q_start, cols + j * block_kv, kv_len)
                if q_ids is not None:
                    kv_ids = plgpu.load(kv_ids_ref.at[batch, pl.ds(j * block_kv, block_kv)],
                                        optimized=False)
                    same = (_bcast_rows(q_ids, shape)
                            == lax.broadcast_in_dim(kv_ids, shape, [1]))
                    visible = same if visible is None else visible & same
                if visible is None:  # nothing to mask (the masked ranges are empty)
                    return u
                return jnp.where(visible, u, -jnp.inf)

            def online_softmax(u, m, l):
                """(m', alpha, P in float32, l'): one step of the online softmax."""
                m_new = jnp.maximum(m, jnp.max(u, axis=1))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                alpha = jnp.exp2((m - m_safe) * c)
                if cfg.fused_exponent:
                    p = jnp.exp2(u * c - _bcast_rows(m_safe * c, u.shape))
                else:
                    p = jnp.exp2((u - _bcast_rows(m_safe, u.shape)) * c)
                l = l * alpha + jnp.sum(p, axis=1)
                return m_new, alpha, p, l

            def plus_pv_interpret(acc, p_in, slot):
                return product(acc, p_in, v_smem.at[slot], interpret=True,
                               stage_ref=p_smem[0].at[wg])

            def step(j, carry, masked: bool):
                acc, m, l = carry
                slot = slot_of(j)
                with jax.named_scope("k_wait"):
                    plgpu.barrier_wait(k_loaded.at[slot])

                def logits(s_ref):
                    plgpu.wgmma(s_ref, my_q, k_smem.at[slot].T)
                    rendezvous()
                    return s_ref[...]

                u = pl.run_scoped(logits, plgpu.ACC((block_q, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                m_new, alpha, p, l = online_softmax(visible_logits(j, u, masked), m, l)
                p_in = p.astype(dtype)
                acc = acc * _bcast_rows(alpha, acc.shape)
                with jax.named_scope("v_wait"):
                    plgpu.barrier_wait(v_loaded.at[slot])
                rendezvous()

                def weighted_values(acc_ref):
                    plgpu.wgmma(acc_ref, p_in, v_smem.at[slot])

                if spec.interpret:
                    acc = plus_pv_interpret(acc, p_in, slot)
                else:
                    acc = pl.run_state(weighted_values)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l

            # cfg.overlap: step j issues S_j = Q K_j^T and acc += P_{j-1} V_{j-1}, waits for S_j
            # alone and runs its softmax while P V is in flight. The first step multiplies a zero P
            # by its own V block (prev == j); `finish_lagged` issues the last P V. V_{j-1} is
            # awaited just before its product (`waited`: already awaited by the first step); waiting
            # for V_j in step j would deadlock ping-pong at 2 stages.
            def step_lagged(j, carry, masked: bool):
                acc, m, l, p_prev, prev, waited = carry
                slot, prev_slot = slot_of(j), slot_of(prev)
                with jax.named_scope("k_wait"):
                    plgpu.barrier_wait(k_loaded.at[slot])
                with jax.named_scope("v_wait"):
                    pl.when(jnp.logical_not(waited))(
                        lambda: plgpu.barrier_wait(v_loaded.at[prev_slot]))

                if spec.interpret:
                    def logits(s_ref):
                        plgpu.wgmma(s_ref, my_q, k_smem.at[slot].T)
                        return s_ref[...]

                    u = pl.run_scoped(logits, plgpu.ACC((block_q, block_kv), jnp.float32))
                    rendezvous()
                    acc = plus_pv_interpret(acc, p_prev, prev_slot)
                    plgpu.barrier_arrive(k_free.at[slot])
                    m_new, alpha, p, l = online_softmax(visible_logits(j, u, masked), m, l)
                    rendezvous()
                else:
                    def both(refs):
                        acc_ref, out_ref = refs

                        def logits(s_ref):
                            plgpu.wgmma(s_ref, my_q, k_smem.at[slot].T)
                            plgpu.wgmma(acc_ref, p_prev, v_smem.at[prev_slot])
                            rendezvous()
                            return plgpu.wgmma_accumulator_load(s_ref, wait_n=1)

                        u = pl.run_scoped(logits, plgpu.ACC((block_q, block_kv), jnp.float32))
                        plgpu.barrier_arrive(k_free.at[slot])
                        # P is cast only after P V has landed: casting into the registers the
                        # product in flight reads makes ptxas serialize every wgmma (C7513).
                        new = online_softmax(visible_logits(j, u, masked), m, l)
                        # Keep the softmax before the wait that ends run_state (else LLVM sinks it).
                        new = lax.optimization_barrier(new)
                        rendezvous()
                        for ref, x in zip(out_ref, new):
                            ref[...] = x

                    # The second element carries the softmax's results out (shapes).
                    p0 = jnp.zeros((block_q, block_kv), jnp.float32)
                    init = (plgpu.ACC.init(acc), (m, m, p0, l))
                    acc, (m_new, alpha, p, l) = pl.run_state(both)(init)
                p_in = p.astype(dtype)
                pl.when(prev != j)(lambda: plgpu.barrier_arrive(v_free.at[prev_slot]))
                acc = acc * _bcast_rows(alpha, acc.shape)
                return acc, m_new, l, p_in, j, prev == j

            def finish_lagged(carry):
                """The last block's P V; (acc, m, l)."""
                acc, m, l, p_prev, prev, waited = carry
                prev_slot = slot_of(prev)
                any_block = hi > lo
                pl.when(any_block & jnp.logical_not(waited))(
                    lambda: plgpu.barrier_wait(v_loaded.at[prev_slot]))
                if spec.interpret:
                    acc = plus_pv_interpret(acc, p_prev, prev_slot)
                else:
                    def last(acc_ref):
                        plgpu.wgmma(acc_ref, p_prev, v_smem.at[prev_slot])

                    acc = pl.run_state(last)(plgpu.ACC.init(acc))
                pl.when(any_block)(lambda: plgpu.barrier_arrive(v_free.at[prev_slot]))
                return acc, m, l

            def drain(j, _):
                slot = slot_of(j)
                plgpu.barrier_wait(k_loaded.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                rendezvous()
                plgpu.barrier_wait(v_loaded.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                rendezvous()

            # No layout hints here, on the iotas or on the id loads: the wgmma operands and
            # accumulators fix every register layout, and a hint (layout_cast, layout=) leaves its
            # operand's layout to a step of Mosaic's solver search over the whole kernel's
            # constraints, which is most of the lowering time.
            acc = jnp.zeros((block_q, head_dim_v), jnp.float32)
            m = jnp.full((block_q,), -jnp.inf, jnp.float32)
            l = jnp.zeros((block_q,), jnp.float32)
            carry = (acc, m, l)
            body = step
            if cfg.overlap:
                p0 = jnp.zeros((block_q, block_kv), dtype)
                carry = (acc, m, l, p0, lo, jnp.bool_(False))
                body = step_lagged

            with jax.named_scope("q_wait"):
                plgpu.barrier_wait(q_loaded.at[mine])
            if cfg.q_prefetch:
                # The other buffer's last reader, the previous item's O store, has read it.
                @pl.when(n + 1 < n_items)
                def _prefetch():
                    _, next_head, next_batch, next_start, *_ = item(n + 1)
                    load_q(next_batch, next_start + wg * block_q, next_head, q_buffer(n + 1))
            unmasked = functools.partial(body, masked=False)
            masked = functools.partial(body, masked=True)
            # Drain, masked leading edge, unmasked middle, masked trailing edge, drain.
            with jax.named_scope("steps"):
                if cfg.pingpong:
                    pl.when(wg == 1)(rendezvous)
                lax.fori_loop(cta_lo, lo, drain, None)
                carry = lax.fori_loop(lo, full_lo, masked, carry)
                carry = lax.fori_loop(full_lo, full_hi, unmasked, carry)
                carry = lax.fori_loop(full_hi, hi, masked, carry)
                if cfg.overlap:
                    carry = finish_lagged(carry)
                lax.fori_loop(hi, cta_hi, drain, None)
                if cfg.pingpong:
                    pl.when(wg == 0)(rendezvous)
            acc, m, l = carry

            # A row that saw no key (l = 0) leaves with O = 0; its acc may hold an unloaded
            # slot's V.
            seen = l != 0.0
            if sink_ref is None:
                out = acc / _bcast_rows(jnp.where(seen, l, 1.0), acc.shape)
                r = jnp.log2(l)
            else:
                weight, r = sink_epilogue(m, l, sink_ref[head], c)
                out = acc * _bcast_rows(weight, acc.shape)
            out = jnp.where(_bcast_rows(seen, acc.shape), out, 0.0)
            # 0 * x is 0 for a finite x and NaN for an inf or NaN: the row sum marks r.
            r = r + jnp.sum(out * 0.0, axis=1)
            if jnp.dtype(dtype) == jnp.float16:
                big = (jnp.abs(out) > F16_MAX) & (jnp.abs(out) < jnp.inf)
                out = jnp.where(big, jnp.where(out > 0, F16_MAX, -F16_MAX), out)
            # O stages in this item's Q buffer, or in its own (MLA).
            my_o = o_smem.at[mine if head_dim_v == head_dim else wg]
            my_o[...] = out.astype(dtype)
            m_smem.at[wg][...] = jnp.where(m == -jnp.inf, 0.0, m)
            r_smem.at[wg][...] = r
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(my_o, o_ref.at[batch, pl.ds(q_start, block_q), head])
            plgpu.copy_smem_to_gmem(m_smem.at[wg], m_ref.at[batch, head, pl.ds(q_start, block_q)])
            plgpu.copy_smem_to_gmem(r_smem.at[wg], r_ref.at[batch, head, pl.ds(q_start, block_q)])
            with jax.named_scope("store_wait"):
                # A persistent CTA's next item reloads these buffers as soon as the stores
                # have read them; the writes finish under that item's Q load.
                plgpu.wait_smem_to_gmem(0, wait_read_only=plan_ref is not None)
            return step_after(t0, n_steps)

        over_items(compute_item)
        if plan_ref is not None:
            plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == cfg.compute_wgs)
    def _copy():
        plgpu.set_max_registers(cfg.copy_registers, action="decrease")
        # In a cluster each CTA loads 1/cluster of every block's rows into all of them.
        multicast = dict(collective_axes=CLUSTER_AXIS) if cfg.cluster > 1 else {}

        def copy_item(n, t0):
            """An item's K / V blocks, through the slots as the previous item's steps free
            them (its first blocks load while that item's last steps and epilogue run)."""
            _, head, batch, _, cta_lo, _, n_steps = item(n)
            kv_head = lax.div(head, jnp.int32(group))

            def load(i, _):
                # Dynamic starts: a static one past seq_kv would be refused when traced.
                j = cta_lo + i
                step = step_after(t0, i)
                slot = lax.rem(step, jnp.int32(stages))
                rows = (batch, pl.ds(j * block_kv, block_kv), kv_head)
                refill = step >= stages
                pl.when(refill)(lambda: plgpu.barrier_wait(k_free.at[slot]))
                plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_loaded.at[slot],
                                        **multicast)
                pl.when(refill)(lambda: plgpu.barrier_wait(v_free.at[slot]))
                plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_loaded.at[slot],
                                        **multicast)

            with jax.named_scope("stream"):
                lax.fori_loop(jnp.int32(0), n_steps, load, None)
            return step_after(t0, n_steps)

        n_steps = over_items(copy_item)

        # Await the last releases too: interpret mode checks every barrier phase is awaited.
        def last_release(i, _):
            slot = lax.rem(i, jnp.int32(stages))
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])

        lax.fori_loop(jnp.maximum(n_steps - stages, 0), n_steps, last_release, None)


def forward(spec: AttentionSpec, q, k, v, q_ids=None, kv_ids=None, sinks=None, *,
            config: MosaicForwardConfig | None = None):
    """O [batch, seq_q, q_heads, head_dim_v] and stats.RowStats (each [batch, q_heads, seq_q]).
    sinks: None, or float [q_heads] sink logits, folded into the softmax in the epilogue.

    Raises NotImplementedError for anything this kernel does not serve (`unsupported_reason`).
    """
    batch, seq_q, q_heads, head_dim = q.shape
    kv_heads, head_dim_v = k.shape[2], v.shape[3]
    cfg = config or default_forward_config(head_dim, spec)
    if (q_ids is not None) != spec.has_segments or (kv_ids is not None) != spec.has_segments:
        raise ValueError("mosaic forward: q_ids and kv_ids are given exactly when "
                         "spec.has_segments")
    reason = unsupported_reason(spec, q, k, v, cfg)
    if reason is not None:
        raise NotImplementedError(reason)
    group = q_heads // kv_heads
    # The TMA tiles the sequence axis by 8 rows; the kernel bounds everything by spec.mask.
    q = pad_seq(q, 8)
    k = pad_seq(k, 8)
    v = pad_seq(v, 8)
    n_tiles = pl.cdiv(seq_q, cfg.cta_rows)
    # Whole clusters: a tile past seq_q computes and stores nothing.
    n_tiles = pl.cdiv(n_tiles, cfg.cluster) * cfg.cluster
    dtype = q.dtype

    # The statistics are stored in whole 64-row pieces: allocated for whole tiles, sliced.
    stats_shape = jax.ShapeDtypeStruct((batch, q_heads, n_tiles * cfg.cta_rows), jnp.float32)
    # In a cluster a slot is free once every CTA's compute warpgroups released it.
    wgs = cfg.compute_wgs
    free_barrier = (functools.partial(plgpu.ClusterBarrier, collective_axes=(CLUSTER_AXIS,))
                    if cfg.cluster > 1 else plgpu.Barrier)
    q_buffers = wgs * (2 if cfg.q_prefetch else 1)
    scratch = [
        plgpu.SMEM((q_buffers, cfg.block_q, head_dim), dtype),
        plgpu.SMEM((cfg.stages, cfg.block_kv, head_dim), dtype),
        plgpu.SMEM((cfg.stages, cfg.block_kv, head_dim_v), dtype, **_v_transforms(cfg, dtype)),
        plgpu.SMEM((wgs, cfg.block_q), jnp.float32),
        plgpu.SMEM((wgs, cfg.block_q), jnp.float32),
        plgpu.Barrier(num_barriers=q_buffers),
        plgpu.Barrier(num_barriers=cfg.stages),
        plgpu.Barrier(num_barriers=cfg.stages),
        free_barrier(num_arrivals=wgs, num_barriers=cfg.stages),
        free_barrier(num_arrivals=wgs, num_barriers=cfg.stages),
        plgpu.Barrier(num_arrivals=wgs),
    ]
    if head_dim_v != head_dim:
        scratch.append(plgpu.SMEM((wgs, cfg.block_q, head_dim_v), dtype))
    if spec.interpret:
        scratch.append(plgpu.SMEM((wgs, cfg.block_q, cfg.block_kv), dtype))
    order = forward_order(spec, cfg, q, k, n_tiles, v_head_dim=head_dim_v)
    grid, plan = order.params(), None
    if cfg.persistent:
        items = n_tiles * q_heads * batch
        plan = persistent_forward_plan(spec.mask, n_tiles, cfg.cta_rows, cfg.block_kv, q_heads,
                                       batch, min(items, cfg.ctas or device_sms()))
        grid = dict(grid=(plan.shape[0],), grid_names=("cta",))
    body = functools.partial(_kernel, spec=spec, cfg=cfg, group=group, n_tiles=n_tiles,
                             head_dim=head_dim, head_dim_v=head_dim_v, order=order,
                             has_sinks=sinks is not None)
    call = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((*q.shape[:3], head_dim_v), dtype), stats_shape,
                  stats_shape),
        scratch_types=scratch,
        **grid,
        num_threads=wgs + 1,   # the copy warpgroup last (index compute_wgs)
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            **profile_params(cfg.profile_dir,
                             2 * pl.cdiv(spec.mask.seq_kv, cfg.block_kv) + 8)),
        interpret=interpret_params(spec.interpret, wgs + 1),
        kernel_name=KERNEL_NAME,
    )
    args = [q, k, v]
    if spec.has_segments:
        args += _segment_operands(q_ids, kv_ids, cfg, n_tiles)
    if sinks is not None:
        args.append(sinks.astype(jnp.float32))
    if plan is not None:
        args.append(jnp.asarray(plan))
    out, m, r = call(*args)
    return out[:, :seq_q], RowStats(m[..., :seq_q], r[..., :seq_q])


def _v_transforms(cfg: MosaicForwardConfig, dtype) -> dict:
    """V's shared-memory layout: a wgmma takes its K (block_kv, in P V) in groups as wide as
    B's swizzle, so a block_kv that is not a multiple of 64 narrows V's swizzle to 64 or 32
    bytes (16-bit groups of 32 or 16 keys)."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = next(s for s in (128, 64, 32) if cfg.block_kv % (s // itemsize) == 0)
    if swizzle == 128:
        return {}   # Mosaic GPU's own layout
    return dict(transforms=(plgpu.TilingTransform((8, swizzle // itemsize)),
                            plgpu.SwizzleTransform(swizzle)))


def _segment_operands(q_ids, kv_ids, cfg: MosaicForwardConfig, n_tiles: int):
    """The kernel's segment inputs: ids padded so no id read goes past the end, and the key
    block ranges [lo, hi) per (batch, tile) and per (batch, warpgroup block), int32 [.., 2]."""
    rows = cfg.cta_rows
    n_kv = pl.cdiv(kv_ids.shape[1], cfg.block_kv)
    cta = jnp.stack(segment_block_ranges(q_ids, kv_ids, rows, cfg.block_kv), axis=-1)
    wg = jnp.stack(segment_block_ranges(q_ids, kv_ids, cfg.block_q, cfg.block_kv), axis=-1)
    if cta.shape[1] < n_tiles:  # a grid padded to whole clusters: an empty range
        cta = jnp.pad(cta, ((0, 0), (0, n_tiles - cta.shape[1]), (0, 0)))
    wg = jnp.pad(wg, ((0, 0), (0, n_tiles * cfg.compute_wgs - wg.shape[1]), (0, 0)))
    # Padding ids match nothing (masking.py).
    q_ids = jnp.pad(q_ids, ((0, 0), (0, n_tiles * rows - q_ids.shape[1])),
                    constant_values=PAD_QUERY_ID)
    kv_ids = jnp.pad(kv_ids, ((0, 0), (0, n_kv * cfg.block_kv - kv_ids.shape[1])),
                     constant_values=PAD_KEY_ID)
    return [q_ids, kv_ids, cta, wg]
