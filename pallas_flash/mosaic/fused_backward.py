"""The backward in one kernel for Hopper: dK/dV per key tile, dQ added across key tiles in a
fixed order. Lowered through Pallas Mosaic GPU.

Why. The two-kernel backward (backward.py) stays deterministic without atomics by computing dQ
in a kernel of its own, which recomputes S and dP: 7 matmul units where 5 would do. At the
rate the forward reaches that caps it near 5/7 of the forward's speed (NOTES.md, "The
backward's ceiling"). Here the dK/dV kernel also forms dQ_partial = dS K for each q block it
visits, and these partials are summed in global memory in a fixed order (FlashAttention-3's
deterministic mode): 5 matmul units, bitwise-reproducible gradients.

The order. For q block j, the key tiles that see it form a contiguous range [first(j), last(j))
(MaskSpec.kv_blocks with the CTA's 128 keys as the block; tests/test_mosaic_fused.py checks that
this is exactly the set of tiles whose MaskSpec.q_blocks range holds j). They add in increasing
tile order: tile t waits on a global semaphore per (batch, q head, q block) until it counts
t - first(j) earlier contributions, then adds (the first one stores, so the buffer needs no
zeroing), waits for its write to land and signals. A tile only ever waits on lower tiles, which
the grid launches first (grid (head, tile, batch); Pallas launches the last axis fastest), so
the spin cannot deadlock. Every tile walks its q blocks from the last down: with causal masks
all tiles then start on the last q blocks, which every tile sees, and a tile trails the one
below it by one step instead of by the two-step diagonal offset per tile that an upward walk
would build up (reasoned from the dependency chain; the upward walk was not timed). With GQA a
CTA streams the blocks of every q head of its group; `_fused_body` says in which order.
Interleaving a few heads' tiles in the launch order, to start a causal grid's long tiles
first, gained 1.4% at 8k and lost 2% at 16k at batch 2 (NOTES.md run 25): not kept there. At
batch 1 four heads are interleaved by default (`head_chunk`), so that consecutive launches
alternate between chains of adds, as batch 2's do (NOTES.md run 59).

The CTA. 128 key rows, four warpgroups:
  * two compute warpgroups, 64 key rows each, in the transposed orientation of backward.py
    (S^T = K Q^T, P^T, dP^T = V dO^T, dS^T; dV += P^T dO, dK += dS^T Q). Each writes its dS^T
    (64 keys x 64 queries) to shared memory, and after a barrier both halves are there, each
    computes half the *columns* of dQ_partial = dS K over all 128 keys (64 x head_dim / 2,
    float32) and stores it to the shared dQ tile (at head_dim 64 they take turns instead, one
    step each, the whole tile: `alternates`);
  * one copy warpgroup streams Q, dO and the row statistics (as in backward.py);
  * one writer warpgroup moves each finished dQ tile to global memory in turn: semaphore wait,
    TMA store or TMA reduce-add (float32, in L2), wait, signal.
dS^T is double-buffered by step parity (a warpgroup may start step s + 1 while the other still
reads step s's halves); the dQ tile has `fused_dq_slots` slots.

Where it serves: bfloat16, head_dim 128 and 64, no segment ids (backward.py falls back to the
two-kernel path otherwise; see `unsupported_reason`); the default at both head_dims
(backward.py's default_backward_config). float16 would
need the per-row rescale of dS (backward.py's `_cast_rows`) folded into dQ; segment ids make
the contributing tiles of a q block data-dependent, not a range the kernel can compute;
head_dim 256 does not fit shared memory in this layout.

Speed (H200, batch 2, seq 8192, kernel alone, non-causal / causal TFLOP/s; NOTES.md runs
19-27): 16 heads at head_dim 128 492-504 / 443-447 (0.87-0.93 / 0.86-0.88x cuDNN; the two
kernels 413-428 / 421-429); 32 heads at head_dim 64 389 / 352 (0.85 / 0.86x; two kernels 329 /
333); GQA 32:8 at head_dim 128 causal 460 (0.90x; two kernels 429).

The writer hands a dQ slot back as soon as the TMA has read it, and signals the next tile only
once the sum has landed: +0.2-3.0% non-causal, equal causal, against freeing the slot after the
landing (NOTES.md run 33). Also timed there and dropped, each a loss somewhere: one dS^T buffer
with a second dQ slot (-6% / -19% non-causal / causal at 8k), the dQ product deferred a step so
that the compute warpgroups need not meet every step (0 / -0.7%), and P^T formed while dP^T
runs (+1.6% / -16%).

The partials are scaled before they are summed; the float32 sum is cast in XLA after the
kernel, and q blocks no tile sees (never written) are zeroed there.

CPU testing: the Mosaic GPU interpreter allocates no semaphores and has no TMA reduction. It
runs the grid one CTA after another in index order, so the tiles of a q block arrive in the
kernel's order anyway; there the writer reads the previous sum, adds, and stores. The compiled
path (semaphores, reduce-add, registers) is covered on the CPU by the sm_90 lowering test only,
and ran the same tests compiled on the H200 (NOTES.md runs 19-28).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import custom_batching, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash.mosaic.common import clamp_range, profile_params, stream_through_slots
from pallas_flash.mosaic.config import FUSED_BLOCK_Q as BLOCK_Q
from pallas_flash.mosaic.config import FUSED_CTA_KEYS as CTA_KEYS
from pallas_flash.mosaic.config import FUSED_DS_BUFFERS as DS_BUFFERS
from pallas_flash.mosaic.config import WG_ROWS
from pallas_flash.mosaic.tiles import positions, product, transposed_weights, zeros_acc
from pallas_flash.mosaic.schedule import (fused_first_tiles, fused_grid, fused_head_chunk,
                                         fused_position)
from pallas_flash.mosaic.schedule import fused_first_tiles as _first_tiles  # noqa: F401
from pallas_flash.mosaic.schedule import fused_grid as _grid  # noqa: F401
from pallas_flash.mosaic.schedule import fused_head_chunk as head_chunk  # noqa: F401
from pallas_flash.spec import AttentionSpec
from pallas_flash.stats import LOG2E, logit_scale

__all__ = ["FUSED_KERNEL_NAME", "fused_backward", "head_chunk", "unsupported_reason"]

FUSED_KERNEL_NAME = "pallas_flash_mosaic_bwd_fused"
HEAD_DIMS = (64, 128)


def alternates(head_dim: int) -> bool:
    """How the two compute warpgroups share the dQ product dS K (64 q rows x head_dim, over
    the CTA's 128 keys), once both have put their dS^T in shared memory.

    By columns (head_dim 128): each takes head_dim / 2 columns, every step. By turns (head_dim
    64): the warpgroup whose index is the step's parity takes the whole product, the other
    none. The column split would slice K into 32-column halves at head_dim 64, which Mosaic's
    layout inference refuses (jax 0.11.2); turns at head_dim 128 would hold a 64 x 128 float32
    accumulator beside dK and dV, over the register budget. (A split by keys, each warpgroup
    summing over its own 64 keys and the writer adding both partials, ran slower than the
    two-kernel backward at head_dim 64: 254 / 272 TFLOP/s causal / not against 334 / 326,
    NOTES.md run 25; its writer made two ordered adds per step.)"""
    return head_dim < 128


def unsupported_reason(spec: AttentionSpec, q, k, cfg) -> str | None:
    """Why the fused kernel cannot serve this call (the two-kernel path then does), or None."""
    head_dim = q.shape[-1]
    if spec.has_segments:
        return "segment ids (the tiles that see a q block are data-dependent)"
    if jnp.dtype(q.dtype) != jnp.dtype(jnp.bfloat16):
        return f"dtype {jnp.dtype(q.dtype).name} (the fused kernel takes bfloat16)"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (the fused kernel takes {HEAD_DIMS})"
    del k
    return None


def _fused_body(q_ref, k_ref, v_ref, do_ref, st_ref, dk_ref, dv_ref, dq_ref,
                k_smem, v_smem, q_smem, do_smem, st_smem, ds_smem, dq_smem,
                k_loaded, v_loaded, q_loaded, do_loaded, st_loaded, slot_free,
                ds_ready, dq_ready, dq_free, both_done, *interp_smem,
                spec: AttentionSpec, cfg, group: int, head_dim: int, q_heads: int,
                n_qblocks: int, chunk: int, batch_size: int):
    mask = spec.mask
    dtype = q_ref.dtype
    stages, slots = cfg.fused_stages, cfg.fused_dq_slots
    by_turns = alternates(head_dim)
    c = logit_scale(spec) * LOG2E
    kv_len = mask.seq_kv if mask.seq_kv % WG_ROWS else None

    tile, kv_head, batch, wg = fused_position(mask, chunk, batch_size)
    kv_start = tile * CTA_KEYS

    # The q blocks any key of the CTA sees, last block first, once per q head of the group.
    # With a position mask (causal, windows) tiles see different numbers of blocks, and the
    # stream is block-major (at each block the group's q heads in turn), so that every tile
    # reaches a given (q head, q block) at the same step index and trails the tile below it by
    # one add, as without GQA. Head-major, a tile with fewer blocks per head would reach the
    # next head two steps sooner than the tile below it and wait for it there: causal GQA 32:8
    # ran at 0.59x cuDNN that way (NOTES.md run 26), block-major at 0.86x (run 27). Without a
    # position mask every tile sees every block and the orders are the same schedule; there the
    # stream stays head-major, which ran faster (0.84x against 0.72x, runs 26-27; the
    # block-major loop nest is the only difference).
    block_major = group > 1 and mask.has_position_mask
    cta_lo, _, _, cta_hi = mask.q_blocks(kv_start, CTA_KEYS, BLOCK_Q, mask.seq_kv, mask.seq_q)
    n_cta = cta_hi - cta_lo
    if group > 1 and not block_major:
        per_head = jnp.maximum(n_cta, 1)
    total = group * n_cta

    def step_of(h, j):
        if group == 1:
            return cta_hi - 1 - j
        if block_major:
            return (cta_hi - 1 - j) * group + h
        return h * n_cta + (cta_hi - 1 - j)

    def block_of(t):
        """(q head, q block) of stream step t."""
        if group == 1:
            return kv_head, cta_hi - 1 - t
        if block_major:
            return (kv_head * group + lax.rem(t, jnp.int32(group)),
                    cta_hi - 1 - lax.div(t, jnp.int32(group)))
        return kv_head * group + lax.div(t, per_head), cta_hi - 1 - lax.rem(t, per_head)

    def compute(w: int):
        plgpu.set_max_registers(cfg.compute_registers, action="increase")
        key0 = kv_start + w * WG_ROWS
        lo, full_lo, full_hi, hi = clamp_range(
            mask.q_blocks(key0, WG_ROWS, BLOCK_Q, mask.seq_kv, mask.seq_q), cta_lo, cta_hi)
        my_k, my_v = k_smem.at[w], v_smem.at[w]
        stage = interp_smem[0].at[w] if spec.interpret else None
        shape = (WG_ROWS, BLOCK_Q)
        # dQ columns this warpgroup computes, from col0 (all of them on its turns).
        cols = head_dim if by_turns else head_dim // 2
        col0 = 0 if by_turns else w * cols
        # The dQ product reads both key tiles.
        with jax.named_scope("kv_wait"):
            plgpu.barrier_wait(k_loaded.at[0])
            plgpu.barrier_wait(k_loaded.at[1])
            plgpu.barrier_wait(v_loaded.at[w])

        def exchange(t, ds_t):
            """Share dS^T, then this warpgroup's share of dQ_partial = dS K over the CTA's 128
            keys: its columns (column split) or, on its turn, all of it (`alternates`)."""
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
                # Every waiter observes every release (barrier phases are counted per waiter),
                # so in turns both warpgroups wait, the one that writes and the one that does not.
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

        def step(h, i, carry, masked: bool):
            dk, dv = carry
            t = step_of(h, i)
            slot = lax.rem(t, jnp.int32(stages))
            q_blk, do_blk, st = q_smem.at[slot], do_smem.at[slot], st_smem.at[slot]
            def wait_q():
                plgpu.barrier_wait(q_loaded.at[slot])
                plgpu.barrier_wait(st_loaded.at[slot])

            def visible_fn():
                k_pos, q_pos = positions(shape, key0, i * BLOCK_Q)
                return mask.visible(q_pos, k_pos, kv_len)

            p_t, ds_t = transposed_weights(
                spec, c, my_k, my_v, q_blk, do_blk, st, shape, wait_q=wait_q,
                wait_do=lambda: plgpu.barrier_wait(do_loaded.at[slot]),
                visible_fn=visible_fn if masked else None)
            dv = product(dv, p_t.astype(dtype), do_blk, interpret=spec.interpret,
                         stage_ref=stage)
            ds_t = ds_t.astype(dtype)
            dk = product(dk, ds_t, q_blk, interpret=spec.interpret, stage_ref=stage)
            plgpu.barrier_arrive(slot_free.at[slot])  # Q, dO, stats of this step are read
            exchange(t, ds_t)
            return dk, dv

        def drain(h, i):
            # A block only the other warpgroup sees: release the stream slot and add nothing
            # to dQ (the exchange still needs this half).
            t = step_of(h, i)
            slot = lax.rem(t, jnp.int32(stages))
            plgpu.barrier_wait(q_loaded.at[slot])
            plgpu.barrier_wait(st_loaded.at[slot])
            plgpu.barrier_wait(do_loaded.at[slot])
            plgpu.barrier_arrive(slot_free.at[slot])
            exchange(t, plgpu.layout_cast(jnp.zeros((WG_ROWS, BLOCK_Q), dtype),
                                          plgpu.Layout.WGMMA))

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
            downward(cta_lo, lo, lambda i, _: drain(h, i), None)
            return carry

        carry = (zeros_acc(WG_ROWS, head_dim), zeros_acc(WG_ROWS, head_dim))
        with jax.named_scope("steps"):
            if group > 1 and not block_major:
                dk, dv = lax.fori_loop(0, group, head_loop, carry)
            else:
                downward(hi, cta_hi, heads(drained), None)
                carry = downward(full_hi, hi, heads(lambda h, i, cr: step(h, i, cr, True)),
                                 carry)
                carry = downward(full_lo, full_hi,
                                 heads(lambda h, i, cr: step(h, i, cr, False)), carry)
                carry = downward(lo, full_lo, heads(lambda h, i, cr: step(h, i, cr, True)),
                                 carry)
                downward(cta_lo, lo, heads(drained), None)
                dk, dv = carry
        # Observe the writer's last releases (interpret mode checks every phase is awaited).
        with jax.named_scope("writer_tail"):
            lax.fori_loop(
                jnp.maximum(total - slots, 0), total,
                lambda t, _: plgpu.barrier_wait(dq_free.at[lax.rem(t, jnp.int32(slots))]), None)
        # Both warpgroups' last dQ products read both K tiles: only then may K's buffer carry
        # dK out.
        with jax.named_scope("store"):
            plgpu.barrier_arrive(both_done)
            plgpu.barrier_wait(both_done)
            rows = (batch, pl.ds(key0, WG_ROWS), kv_head)
            my_k[...] = (dk * spec.scale).astype(dtype)
            my_v[...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(my_k, dk_ref.at[rows])
            plgpu.copy_smem_to_gmem(my_v, dv_ref.at[rows])
            plgpu.wait_smem_to_gmem(0)

    for w in range(2):
        # Static warpgroup index: static column slices of K and of the dQ tile.
        pl.when(wg == w)(functools.partial(compute, w))

    @pl.when(wg == 2)
    def _copy():
        plgpu.set_max_registers(cfg.fused_side_registers(), action="decrease")
        for rt in range(2):
            rows = (batch, pl.ds(kv_start + rt * WG_ROWS, WG_ROWS), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[rt], k_loaded.at[rt])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[rt], v_loaded.at[rt])

        def issue(t, slot):
            q_head, j = block_of(t)
            rows = (batch, pl.ds(j * BLOCK_Q, BLOCK_Q), q_head)
            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], q_loaded.at[slot])
            plgpu.copy_gmem_to_smem(st_ref.at[batch, q_head, :, pl.ds(j * BLOCK_Q, BLOCK_Q)],
                                    st_smem.at[slot], st_loaded.at[slot])
            plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], do_loaded.at[slot])

        with jax.named_scope("stream"):
            stream_through_slots(issue, slot_free, stages, total)

    @pl.when(wg == 3)
    def _write():
        plgpu.set_max_registers(cfg.fused_side_registers(), action="decrease")
        sem = None
        if not spec.interpret:
            sem = pl.get_global(plgpu.SemaphoreType.REGULAR((dq_ref.shape[0] * q_heads
                                                              * n_qblocks,)))

        def write(t, _):
            q_head, j = block_of(t)
            dslot = lax.rem(t, jnp.int32(slots))
            src = dq_smem.at[dslot]
            rows = (batch, pl.ds(j * BLOCK_Q, BLOCK_Q), q_head)
            first = mask.kv_blocks(j * BLOCK_Q, BLOCK_Q, CTA_KEYS, mask.seq_kv)[0]
            rank = tile - first  # tiles that add to this q block before this one
            plgpu.barrier_wait(dq_ready.at[dslot])
            if spec.interpret:
                acc_smem, acc_loaded = interp_smem[1], interp_smem[2]

                def add_previous():
                    plgpu.copy_gmem_to_smem(dq_ref.at[rows], acc_smem, acc_loaded)
                    plgpu.barrier_wait(acc_loaded)
                    src[...] = src[...] + acc_smem[...]
                    plgpu.commit_smem()

                pl.when(rank > 0)(add_previous)
                plgpu.copy_smem_to_gmem(src, dq_ref.at[rows])
                plgpu.wait_smem_to_gmem(0)
            else:
                flag = sem.at[(batch * q_heads + q_head) * n_qblocks + j]
                with jax.named_scope("chain_wait"):
                    plgpu.semaphore_wait(flag, rank, decrement=False, memory_scope="gpu")
                pl.when(rank == 0)(lambda: plgpu.copy_smem_to_gmem(src, dq_ref.at[rows]))
                pl.when(rank > 0)(lambda: plgpu.copy_smem_to_gmem(
                    src, dq_ref.at[rows], reduction_op="add"))
                # The slot may take the next partial once the copy has read it; the next tile
                # may add only once the sum has landed.
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.barrier_arrive(dq_free.at[dslot])
                plgpu.wait_smem_to_gmem(0)  # the sum has landed
                plgpu.semaphore_signal(flag, 1, memory_scope="gpu")  # the next tile may add
            if spec.interpret:
                plgpu.barrier_arrive(dq_free.at[dslot])

        lax.fori_loop(jnp.int32(0), total, write, None)


def fused_backward(spec: AttentionSpec, q, k, v, do, rows, cfg):
    """(dq, dk, dv) for operands already padded as backward.py pads them (sequence axes to a
    multiple of 8; rows = the [b, hq, 3, *] m / r / D statistics padded to whole q blocks).

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
        plgpu.SMEM((stages, 3, BLOCK_Q), jnp.float32),       # m, r, D stream
        plgpu.SMEM((DS_BUFFERS, 2, WG_ROWS, BLOCK_Q), dtype),  # dS^T [parity, key tile]
        plgpu.SMEM((slots, BLOCK_Q, head_dim), jnp.float32), # dQ tiles
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
    if spec.interpret:
        scratch += [plgpu.SMEM((2, WG_ROWS, BLOCK_Q), dtype),
                    plgpu.SMEM((BLOCK_Q, head_dim), jnp.float32),
                    plgpu.Barrier()]
    kv_shape = jax.ShapeDtypeStruct(k.shape, dtype)
    chunk = fused_head_chunk(cfg, batch, kv_heads)
    dk, dv, dq_sum = plgpu.kernel(
        functools.partial(_fused_body, spec=spec, cfg=cfg, group=group, head_dim=head_dim,
                          q_heads=q_heads, n_qblocks=n_qblocks, chunk=chunk,
                          batch_size=batch),
        out_type=(kv_shape, kv_shape, jax.ShapeDtypeStruct(q.shape, jnp.float32)),
        scratch_types=scratch,
        # Pallas launches the last grid axis fastest: here batch, then tile, then head. Tiles
        # of one (head, batch) launch in increasing order (a tile waits only on lower ones),
        # and a wave holds all tiles of a head or two, which add into the same float32 dQ
        # rows while those stay in L2. Measured on the H200 (2x8192x16, non-causal / causal
        # TFLOP/s): this order 503.6 / 443.1 (run 19); tile slowest 450.4 / 450.6 (run 21: a
        # wave spans 32 heads, and their dQ sums, 128 MB, no longer fit L2); tile fastest
        # 494.1 / 412.5 (run 20). With a head chunk (`head_chunk`), the chunk's heads take
        # turns within each tile as the batch does.
        grid=fused_grid(kv_heads, n_tiles, batch, chunk),
        grid_names=("head", "tile", "batch"),
        num_threads=4,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            # Scopes entered once a step (slot_wait, ds_wait), and a few more.
            **profile_params(cfg.fused_profile_dir, 2 * n_qblocks * group + 8)),
        interpret=plgpu.InterpretGPUParams() if spec.interpret else None,
        kernel_name=FUSED_KERNEL_NAME,
    )(q, k, v, do, rows)
    # q blocks that no tile sees were never written: their dQ is 0. (The ranges are static:
    # computed here at trace time, so the select exists only for masks that need it.)
    with jax.ensure_compile_time_eval():
        first, last = fused_first_tiles(mask, n_qblocks)
        seen = np.repeat(np.asarray(last > first), BLOCK_Q)[:seq_q8]
    if not seen.all():
        dq_sum = jnp.where(jnp.asarray(seen)[None, :, None, None], dq_sum, 0.0)
    return dq_sum.astype(dtype), dk, dv

