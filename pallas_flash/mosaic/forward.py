"""Forward kernel for Hopper (sm_90), lowered through Pallas Mosaic GPU.

Same contract as `pallas_flash.triton.forward.forward`: O in q's layout and dtype
[batch, seq_q, q_heads, head_dim], and `stats.RowStats(m, r)`, each float32
[batch, q_heads, seq_q], with m the row maximum in logit units (the raw q.k, or
tanh(q.k * scale / softcap) with a softcap) and r = log2 of the
row's softmax denominator in base 2 (stats.py). A row that sees no key leaves with O = 0, m = 0
and r = -inf.

Structure (one CTA = config.compute_wgs compute warpgroups, 2 or 3, and one copy warpgroup):

* CTA (tile, head, batch) owns compute_wgs * block_q query rows of one (batch, head) (128 or
  192). Compute warpgroups 0 .. compute_wgs - 1 each own block_q of them (a 64-row wgmma M tile
  per warpgroup); the last warpgroup (index compute_wgs) only issues TMA copies. GQA reads kv
  head = head // group straight from the [batch, seq, heads, dim] arrays.
* The copy warpgroup streams K and V blocks of the kv head through `stages` shared-memory slots.
  Each slot has a "loaded" barrier (completed by the TMA transaction count) and a "free" barrier
  that needs one arrival from each compute warpgroup before the slot is refilled.
* Each compute warpgroup runs the online softmax of FlashAttention-2 in base 2 and logit units:
  S = Q K^T by wgmma (Q and K from shared memory), then
      m' = max(m, rowmax S),  m_safe = (m' if finite else 0),  a = 2^((m - m_safe) c),
      P = 2^((S - m_safe) c),  l = l a + rowsum P,  acc = acc a + P V   (P from registers),
  with c = logit_scale * log2(e) (scale, or softcap with S replaced by tanh(S scale / softcap)).
  S - m is formed before the scaling, as stats.py asks.
* Masks (causal, sliding window, alignment offset: masking.MaskSpec; the key bound; segment
  ids): the loop bounds are MaskSpec.kv_blocks, per warpgroup and for the whole CTA. Key blocks
  that no row of a warpgroup sees are never computed; blocks that every row sees fully skip the
  mask; the edge blocks (diagonal, window start and end, a partial last key block) are masked
  with an iota compare. The producer loads every block the CTA needs, [cta_lo, cta_hi); each
  warpgroup still waits for and releases the blocks outside its own range ("drain" steps).
  Waiting before releasing is what keeps each slot's "free" barrier at exactly one arrival per
  warpgroup per phase. With a right bound, CTAs run heaviest (last) tiles first.
* Segment ids (padding lengths folded in, masking.fold_lengths): block ranges per CTA and per
  warpgroup come from masking.segment_block_ranges (XLA, before the kernel) and tighten the
  bounds; every visited block is then masked, the query ids of a warpgroup and the key ids of a
  block read from global memory into the wgmma row / column layouts.
* Partial tiles: the TMA reads rows past the end of q, k, v as zeros and drops stores past the
  end of O (the interpreter models both); keys past seq_kv are masked to -inf. Mosaic GPU tiles
  a descriptor's sequence axis by 8 rows, so a length that is not a multiple of 8 is
  zero-padded in XLA first (one copy). The row statistics are allocated for whole tiles and
  sliced.
* Launch order (config.head_chunk, `common.TileGrid`): the tiles of one head launch together,
  so the CTAs in flight share a few heads' K / V in L2; with a causal bound, FlashAttention-3's
  L2 sections (as many heads as share 32 MB of K / V, interleaved tile by tile, longest first).
* Optional clusters (config.cluster = n, 2 or 4): n CTAs of adjacent tiles stream the union of
  their key ranges, each copy warpgroup loading 1/n of every K / V block into all n CTAs (TMA
  multicast); the "free" barriers are cluster barriers, so a slot is refilled only once all
  n * compute_wgs compute warpgroups have released it. The grid's tile axis then counts
  clusters, padded to whole clusters with tiles past seq_q that compute nothing.
* Optional ping-pong (config.pingpong, two compute warpgroups only): a two-arrival barrier used
  as a rendezvous twice per step offsets the two warpgroups by half a step, so one warpgroup's
  softmax overlaps the other's wgmmas. Warpgroup 1 rendezvouses once before its loop,
  warpgroup 0 once after, and drain steps rendezvous too, so both always make 2 * n_steps + 1
  rendezvous.
* Optional intra-warpgroup overlap (config.overlap, FlashAttention-3's pipelining; the default
  at head_dim 128 and 256): the P V product lags one block, so each step issues S_j = Q K_j^T
  and P_{j-1} V_{j-1} back to back, waits for S_j alone, and runs the softmax of block j while
  P V is still on the tensor cores. P is cast to the operand dtype only after P V has landed
  (else ptxas serializes every wgmma). With overlap, ping-pong lost speed in the sweep.

Supported: bfloat16 and float16, head_dim 64/128/256, any seq_q and seq_kv,
full, causal (top-left or bottom-right), sliding window, softcap, segment ids and padding
lengths. Everything else (other dtypes and head_dims) raises NotImplementedError
(`unsupported_reason` says why without raising), for the dispatcher to route to Triton. Unlike
the Triton kernel, a non-finite V entry in a *masked-out* position of a visited block is not
isolated (0 * inf = NaN reaches that row; with config.overlap, the first step's zero P times
its V block reaches every row of the warpgroup): pallas_flash/guarded.py routes calls with a
non-finite V to Triton under backend="auto".

CPU testing (jax 0.11.2): Mosaic GPU has a real interpret mode that simulates shared memory,
barriers, TMA and wgmma on the CPU: `interpret=plgpu.InterpretGPUParams()` on `plgpu.kernel`
(also `plgpu.force_gpu_interpret_mode()`). `spec.interpret=True` selects it here; it is slow
(seconds for a few hundred rows), so tests use small shapes. Two deviations there, both in
the P.V product (spec.interpret only): the interpreter takes no wgmma operand in registers and no
`run_state` over an accumulator, so P is staged through shared memory and the product is added to
acc; the compiled path (P from registers, accumulating in place) is not covered on the CPU. The
interpreter also insists that every barrier phase be waited for, which is why the copy
warpgroup waits for the last releases. Each simulated warpgroup is an XLA computation on its own
thread that also runs parts on XLA:CPU's intra-op pool (NPROC threads, else one per core); a
warpgroup blocked at a barrier holds a pool thread, so with compute_wgs=3 (four warpgroups) the
pool needs 3 threads or a CTA can hang (it did on 2 cores; tests/conftest.py sets NPROC). In
addition
`jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))` runs on a CPU-only machine all the
Python passes (Pallas lowering, Mosaic GPU layout inference, dialect lowering, for sm_90): what
is left untested without a GPU is the C++/LLVM/ptxas compile, shared-memory limits at launch,
and speed.

The kernel is built with `plgpu.kernel` (warp specialization needs its thread axis); the staged
primitive is `mpmd_map` with params name == KERNEL_NAME, not `pallas_call`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash.masking import PAD_KEY_ID, PAD_QUERY_ID, segment_block_ranges
from pallas_flash.mosaic.common import (clamp_range, logit_units, narrowed, pad_seq,
                                       query_tile_position, profile_params, unsupported_operands)
from pallas_flash.mosaic.config import (SMEM_LIMIT, MosaicForwardConfig, default_forward_config,
                                       register_budget)
from pallas_flash.mosaic.schedule import CLUSTER_AXIS, TileGrid, forward_order
from pallas_flash.mosaic.schedule import forward_order as _launch_order  # noqa: F401
from pallas_flash.spec import AttentionSpec
from pallas_flash.stats import LOG2E, RowStats, logit_scale

__all__ = ["KERNEL_NAME", "MosaicForwardConfig", "default_forward_config", "forward",
           "register_budget", "unsupported_reason"]

KERNEL_NAME = "pallas_flash_mosaic_fwd"
F16_MAX = 65504.0


def unsupported_reason(spec: AttentionSpec, q, k, v, config: MosaicForwardConfig | None = None):
    """Why this kernel cannot take the call, or None if it can."""
    reason = unsupported_operands("forward", q, k, v)
    if reason is not None:
        return reason
    head_dim = q.shape[-1]
    cfg = config or default_forward_config(head_dim, spec)
    if cfg.cluster > 1 and spec.interpret:
        return ("mosaic forward: config.cluster > 1 runs compiled only (the GPU interpreter "
                "does not model TMA multicast)")
    if cfg.smem_bytes(head_dim) > SMEM_LIMIT:
        return (f"mosaic forward: config {cfg} needs {cfg.smem_bytes(head_dim)} bytes of shared "
                f"memory at this head_dim (limit {SMEM_LIMIT})")
    return None


def _bcast_rows(x, shape):
    return lax.broadcast_in_dim(x, shape, [0])


def _kernel(*refs, spec: AttentionSpec, cfg: MosaicForwardConfig, group: int, n_tiles: int,
            head_dim: int, order: TileGrid):
    if spec.has_segments:
        (q_ref, k_ref, v_ref, q_ids_ref, kv_ids_ref, cta_seg_ref, wg_seg_ref), rest = (
            refs[:7], refs[7:])
    else:
        (q_ref, k_ref, v_ref), rest = refs[:3], refs[3:]
        q_ids_ref = kv_ids_ref = cta_seg_ref = wg_seg_ref = None
    _kernel_body(q_ref, k_ref, v_ref, q_ids_ref, kv_ids_ref, cta_seg_ref, wg_seg_ref, *rest,
                 spec=spec, cfg=cfg, group=group, n_tiles=n_tiles, head_dim=head_dim,
                 order=order)


def _kernel_body(q_ref, k_ref, v_ref, q_ids_ref, kv_ids_ref, cta_seg_ref, wg_seg_ref,
                 o_ref, m_ref, r_ref,
                 q_smem, k_smem, v_smem, m_smem, r_smem,
            q_loaded, k_loaded, v_loaded, k_free, v_free, rendezvous_bar, *extra,
            spec: AttentionSpec, cfg: MosaicForwardConfig, group: int, n_tiles: int,
            head_dim: int, order: TileGrid):
    mask = spec.mask
    p_smem = extra   # P's staging, interpret mode only
    block_q, block_kv, stages = cfg.block_q, cfg.block_kv, cfg.stages
    cta_rows = cfg.cta_rows
    dtype = q_ref.dtype
    c = logit_scale(spec) * LOG2E
    # Keys past seq_kv only exist in a partial last block (read as zeros by the TMA); they need
    # the mask exactly when such a block exists.
    kv_len = mask.seq_kv if mask.seq_kv % block_kv else None

    tile, head, batch, wg, cta_start, cta_lo, cta_hi = query_tile_position(
        mask, n_tiles, cta_rows, block_kv, cta_seg_ref, cfg.cluster, order)
    n_steps = cta_hi - cta_lo

    def slot_of(j):
        return lax.rem(j - cta_lo, jnp.int32(stages))

    def rendezvous():
        if cfg.pingpong:
            plgpu.barrier_arrive(rendezvous_bar)
            plgpu.barrier_wait(rendezvous_bar)

    @pl.when(wg < cfg.compute_wgs)
    def _compute():
        plgpu.set_max_registers(cfg.compute_registers, action="increase")
        q_start = cta_start + wg * block_q
        my_q = q_smem.at[wg]
        # Rows past seq_q (a partial last tile) are read as zeros by the TMA and never stored.
        plgpu.copy_gmem_to_smem(
            q_ref.at[batch, pl.ds(q_start, block_q), head], my_q, q_loaded.at[wg])

        bounds = mask.kv_blocks(q_start, block_q, block_kv, mask.seq_kv)
        q_ids = None
        if wg_seg_ref is not None:
            # With ids every visited block is masked (ids are data): no unmasked middle.
            bounds = narrowed(bounds, wg_seg_ref, batch, tile * cfg.compute_wgs + wg)
            q_ids = plgpu.load(q_ids_ref.at[batch, pl.ds(q_start, block_q)],
                               layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
        # A warpgroup wholly past seq_q (a later one of a short last tile) computes nothing.
        bounds = tuple(jnp.where(q_start < mask.seq_q, b, cta_lo) for b in bounds)
        lo, full_lo, full_hi, hi = clamp_range(bounds, cta_lo, cta_hi)

        def visible_logits(j, u, masked: bool):
            """The raw S tile of key block j in logit units, masked (-inf) where the block's
            edge or the segment ids hide a key; `masked` False: a block every row sees fully."""
            u, _ = logit_units(spec, u)
            if not masked:
                return u
            shape = (block_q, block_kv)
            rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
            cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
            visible = mask.visible(rows + q_start, cols + j * block_kv, kv_len)
            if q_ids is not None:
                kv_ids = plgpu.load(kv_ids_ref.at[batch, pl.ds(j * block_kv, block_kv)],
                                    layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
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
            # GPU interpret mode (jax 0.11.2) takes neither `run_state` over an accumulator
            # ("Cannot lower jaxpr with effects: ... _WGMMAPipelineEffect") nor a wgmma
            # operand in registers ("Expected shape (6,) but got (64, 64)"): there, P goes
            # through shared memory and the product is added to acc afterwards.
            my_p = p_smem[0].at[wg]
            my_p[...] = p_in
            plgpu.commit_smem()

            def fresh(acc_ref):
                plgpu.wgmma(acc_ref, my_p, v_smem.at[slot])
                return acc_ref[...]

            return acc + pl.run_scoped(fresh, plgpu.ACC((block_q, head_dim), jnp.float32))

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

        # cfg.overlap: the P V product lags one block. Step j issues S_j = Q K_j^T and then
        # acc += P_prev V_prev (two wgmma groups; prev = j - 1), waits for the first group only,
        # and runs the softmax of S_j while the second is in flight; acc (scaled to m_prev) is
        # rescaled to m_j once P V lands. The first step has no previous block: it multiplies a
        # zero P by its own V block (prev == j) and releases nothing; `finish_lagged` issues
        # the last block's P V after the loop. V_prev is waited for just before its P V (one
        # step after its K), so each V slot is held one step longer; `waited` marks the one
        # case where it already was (the step after the first, whose zero P V read it). With
        # ping-pong, waiting for V_j in step j instead would deadlock at 2 stages: V_j's load
        # needs both warpgroups' release of V_{j-2}, which the lagging warpgroup only gives
        # after the rendezvous that the leading one would then never reach.
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
                    # P stays in float32 here: its cast to the operand dtype would write
                    # the registers that the P V in flight reads (the loop carries P in
                    # them), and ptxas then serializes every wgmma (warning C7513; NOTES.md,
                    # session 4). FlashAttention-3 converts P after the wait for the same reason.
                    new = online_softmax(visible_logits(j, u, masked), m, l)
                    # Keep the softmax before the wait that ends run_state (LLVM may otherwise
                    # sink this pure arithmetic past it, losing the overlap).
                    new = lax.optimization_barrier(new)
                    rendezvous()
                    for ref, x in zip(out_ref, new):
                        ref[...] = x

                # The second element only carries the softmax's results out of run_state;
                # its initial values just give them their shapes and layouts.
                p0 = plgpu.layout_cast(jnp.zeros((block_q, block_kv), jnp.float32),
                                       plgpu.Layout.WGMMA)
                init = (plgpu.ACC.init(acc), (m, m, p0, l))
                acc, (m_new, alpha, p, l) = pl.run_state(both)(init)
            p_in = p.astype(dtype)
            pl.when(prev != j)(lambda: plgpu.barrier_arrive(v_free.at[prev_slot]))
            acc = acc * _bcast_rows(alpha, acc.shape)
            return acc, m_new, l, p_in, j, prev == j

        def finish_lagged(carry):
            """The last block's P V; (acc, m, l). With no block computed, P is zero and the V
            slot is not read for anything that is kept (rows with l = 0 are written as 0)."""
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

        acc = plgpu.layout_cast(jnp.zeros((block_q, head_dim), jnp.float32), plgpu.Layout.WGMMA)
        m = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1))
        l = plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        carry = (acc, m, l)
        body = step
        if cfg.overlap:
            p0 = plgpu.layout_cast(jnp.zeros((block_q, block_kv), dtype), plgpu.Layout.WGMMA)
            carry = (acc, m, l, p0, lo, jnp.bool_(False))
            body = step_lagged

        with jax.named_scope("q_wait"):
            plgpu.barrier_wait(q_loaded.at[wg])
        unmasked = functools.partial(body, masked=False)
        masked = functools.partial(body, masked=True)
        # Blocks before this warpgroup's range (the other one needs them), the masked leading
        # edge (window start), the unmasked middle, the masked trailing edge (diagonal, window
        # end, partial last key block), blocks after its range.
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

        # A row that saw no key has l = 0 and leaves with O = 0 (acc is not read: with
        # cfg.overlap its last, zero, P V product may have read a V slot nobody loaded).
        seen = l != 0.0
        out = jnp.where(_bcast_rows(seen, acc.shape),
                        acc / _bcast_rows(jnp.where(seen, l, 1.0), acc.shape), 0.0)
        if jnp.dtype(dtype) == jnp.float16:
            big = (jnp.abs(out) > F16_MAX) & (jnp.abs(out) < jnp.inf)
            out = jnp.where(big, jnp.where(out > 0, F16_MAX, -F16_MAX), out)
        my_q[...] = out.astype(dtype)
        m_smem.at[wg][...] = jnp.where(m == -jnp.inf, 0.0, m)
        r_smem.at[wg][...] = jnp.log2(l)
        plgpu.commit_smem()
        # A TMA store drops the rows past seq_q; the statistics are padded to whole tiles.
        plgpu.copy_smem_to_gmem(my_q, o_ref.at[batch, pl.ds(q_start, block_q), head])
        plgpu.copy_smem_to_gmem(m_smem.at[wg], m_ref.at[batch, head, pl.ds(q_start, block_q)])
        plgpu.copy_smem_to_gmem(r_smem.at[wg], r_ref.at[batch, head, pl.ds(q_start, block_q)])
        with jax.named_scope("store_wait"):
            plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == cfg.compute_wgs)
    def _copy():
        plgpu.set_max_registers(cfg.copy_registers, action="decrease")
        kv_head = lax.div(head, jnp.int32(group))
        # config.cluster: each CTA of the cluster loads 1/cluster of every block into all of
        # them (Mosaic GPU splits the block along its rows, whole 8-row tiles).
        multicast = dict(collective_axes=CLUSTER_AXIS) if cfg.cluster > 1 else {}

        def load(i, _):
            # Block j of the CTA's range goes to slot i % stages once all compute warpgroups
            # have released the block that used the slot before. Every start is dynamic: a
            # partial last block reaches past seq_kv, which the TMA reads as zeros (a static
            # start would be bounds-checked when traced and refused).
            j = cta_lo + i
            slot = lax.rem(i, jnp.int32(stages))
            rows = (batch, pl.ds(j * block_kv, block_kv), kv_head)
            refill = i >= stages
            pl.when(refill)(lambda: plgpu.barrier_wait(k_free.at[slot]))
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_loaded.at[slot],
                                    **multicast)
            pl.when(refill)(lambda: plgpu.barrier_wait(v_free.at[slot]))
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_loaded.at[slot],
                                    **multicast)

        with jax.named_scope("stream"):
            lax.fori_loop(jnp.int32(0), n_steps, load, None)

        # Observe the last releases too, so every phase of every barrier is waited for (GPU
        # interpret mode checks this when the barriers are freed; on the GPU it costs nothing,
        # this warpgroup has no work left).
        def last_release(i, _):
            slot = lax.rem(i, jnp.int32(stages))
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])

        lax.fori_loop(jnp.maximum(n_steps - stages, 0), n_steps, last_release, None)


def forward(spec: AttentionSpec, q, k, v, q_ids=None, kv_ids=None, *,
            config: MosaicForwardConfig | None = None):
    """O [batch, seq_q, q_heads, head_dim] and stats.RowStats (each [batch, q_heads, seq_q]).

    Raises NotImplementedError for anything this kernel does not serve (`unsupported_reason`).
    """
    batch, seq_q, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    cfg = config or default_forward_config(head_dim, spec)
    if (q_ids is not None) != spec.has_segments or (kv_ids is not None) != spec.has_segments:
        raise ValueError("mosaic forward: q_ids and kv_ids are given exactly when "
                         "spec.has_segments")
    reason = unsupported_reason(spec, q, k, v, cfg)
    if reason is not None:
        raise NotImplementedError(reason)
    group = q_heads // kv_heads
    # Mosaic GPU tiles the sequence axis of a TMA descriptor by 8 rows and refuses a length
    # that is not a multiple of 8. Such lengths are zero-padded to the next multiple of 8 here
    # (a copy of the array, only for these lengths); the kernel bounds everything by the true
    # lengths in spec.mask, so the padding is never seen, and O is sliced back.
    q = pad_seq(q, 8)
    k = pad_seq(k, 8)
    v = pad_seq(v, 8)
    n_tiles = pl.cdiv(seq_q, cfg.cta_rows)
    # Whole clusters: a tile past seq_q computes nothing and stores nothing (config.cluster).
    n_tiles = pl.cdiv(n_tiles, cfg.cluster) * cfg.cluster
    dtype = q.dtype

    # The row statistics are written in whole 64-row pieces, so they are allocated for whole
    # tiles and sliced here (float32 per row: cheap next to O). O itself is written in place:
    # the TMA store drops rows past seq_q.
    stats_shape = jax.ShapeDtypeStruct((batch, q_heads, n_tiles * cfg.cta_rows), jnp.float32)
    # A slot's "free" barrier: one arrival per compute warpgroup (num_arrivals counts a CTA's);
    # with config.cluster, a cluster barrier that counts the releases of every CTA's compute
    # warpgroups (each CTA's copy writes into all of them).
    wgs = cfg.compute_wgs
    free_barrier = (functools.partial(plgpu.ClusterBarrier, collective_axes=(CLUSTER_AXIS,))
                    if cfg.cluster > 1 else plgpu.Barrier)
    scratch = [
        plgpu.SMEM((wgs, cfg.block_q, head_dim), dtype),
        plgpu.SMEM((cfg.stages, cfg.block_kv, head_dim), dtype),
        plgpu.SMEM((cfg.stages, cfg.block_kv, head_dim), dtype, **_v_transforms(cfg, dtype)),
        plgpu.SMEM((wgs, cfg.block_q), jnp.float32),
        plgpu.SMEM((wgs, cfg.block_q), jnp.float32),
        plgpu.Barrier(num_barriers=wgs),
        plgpu.Barrier(num_barriers=cfg.stages),
        plgpu.Barrier(num_barriers=cfg.stages),
        free_barrier(num_arrivals=wgs, num_barriers=cfg.stages),
        free_barrier(num_arrivals=wgs, num_barriers=cfg.stages),
        # The ping-pong rendezvous: only with pingpong, which needs exactly two warpgroups.
        plgpu.Barrier(num_arrivals=wgs),
    ]
    if spec.interpret:
        scratch.append(plgpu.SMEM((wgs, cfg.block_q, cfg.block_kv), dtype))
    order = forward_order(spec, cfg, q, k, n_tiles)
    body = functools.partial(_kernel, spec=spec, cfg=cfg, group=group, n_tiles=n_tiles,
                             head_dim=head_dim, order=order)
    call = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct(q.shape, dtype), stats_shape, stats_shape),
        scratch_types=scratch,
        **order.params(),
        num_threads=wgs + 1,   # the copy warpgroup last (index compute_wgs)
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            # k_wait and v_wait once a key block, and five more scopes.
            **profile_params(cfg.profile_dir,
                             2 * pl.cdiv(spec.mask.seq_kv, cfg.block_kv) + 8)),
        interpret=plgpu.InterpretGPUParams() if spec.interpret else None,
        kernel_name=KERNEL_NAME,
    )
    args = [q, k, v]
    if spec.has_segments:
        args += _segment_operands(q_ids, kv_ids, cfg, n_tiles)
    out, m, r = call(*args)
    return out[:, :seq_q], RowStats(m[..., :seq_q], r[..., :seq_q])


def _v_transforms(cfg: MosaicForwardConfig, dtype) -> dict:
    """V's shared-memory layout when block_kv is not a multiple of 64.

    Mosaic GPU issues a wgmma's K dimension in groups as wide as the B operand's swizzle (64
    16-bit elements at the 128-byte swizzle it picks by itself), and K of the P V product is
    block_kv. A narrower swizzle on V alone (tiles of 8 keys x swizzle / itemsize columns)
    takes K in groups of 32 (64 bytes) or 16 (32 bytes), so 160 and 176 key blocks lower; K
    (the N of Q K^T, tiled by 8) keeps the default.
    """
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = next(s for s in (128, 64, 32) if cfg.block_kv % (s // itemsize) == 0)
    if swizzle == 128:
        return {}   # Mosaic GPU's own choice: the layout every default was timed with
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
    # A warpgroup block wholly past seq_q has no range of its own (the kernel skips it).
    wg = jnp.pad(wg, ((0, 0), (0, n_tiles * cfg.compute_wgs - wg.shape[1]), (0, 0)))
    # Padding ids match nothing (masking.py); rows past seq_q are never stored either way.
    q_ids = jnp.pad(q_ids, ((0, 0), (0, n_tiles * rows - q_ids.shape[1])),
                    constant_values=PAD_QUERY_ID)
    kv_ids = jnp.pad(kv_ids, ((0, 0), (0, n_kv * cfg.block_kv - kv_ids.shape[1])),
                     constant_values=PAD_KEY_ID)
    return [q_ids, kv_ids, cta, wg]
