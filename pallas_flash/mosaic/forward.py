"""Forward kernel for Hopper (sm_90), lowered through Pallas Mosaic GPU. DRAFT (issue 4, step 1).

Same contract as `pallas_flash.triton.forward.forward`: O in q's layout and dtype
[batch, seq_q, q_heads, head_dim], and `stats.RowStats(m, r)`, each float32
[batch, q_heads, seq_q], with m the row maximum in logit units (the raw q.k) and r = log2 of the
row's softmax denominator in base 2 (stats.py). A row that sees no key leaves with O = 0, m = 0
and r = -inf.

Structure (one CTA = three warpgroups):

* CTA (tile, head, batch) owns 2 * block_q query rows of one (batch, head). Warpgroups 0 and 1
  each own block_q of them (a 64-row wgmma M tile per warpgroup); warpgroup 2 only issues TMA
  copies. GQA reads kv head = head // group straight from the [batch, seq, heads, dim] arrays.
* Warpgroup 2 streams K and V blocks of the kv head through `stages` shared-memory slots. Each
  slot has a "loaded" barrier (completed by the TMA transaction count) and a "free" barrier that
  needs one arrival from each compute warpgroup before the slot is refilled.
* Each compute warpgroup runs the online softmax of FlashAttention-2 in base 2 and logit units:
  S = Q K^T by wgmma (Q and K from shared memory), then
      m' = max(m, rowmax S),  m_safe = (m' if finite else 0),  a = 2^((m - m_safe) c),
      P = 2^((S - m_safe) c),  l = l a + rowsum P,  acc = acc a + P V   (P from registers),
  with c = scale * log2(e). S - m is formed before the scaling, as stats.py asks.
* Causal (any static right bound and offset, from masking.MaskSpec): key blocks that no row of a
  warpgroup sees are never computed; blocks that every row sees fully skip the mask; the few
  diagonal blocks in between are masked with an iota compare. The producer loads the blocks the
  *later* warpgroup needs; the earlier warpgroup, once done, still waits for each remaining block
  and releases it ("drain" steps). Waiting before releasing is what keeps each slot's "free"
  barrier at exactly one arrival per warpgroup per phase. CTAs run heaviest (last) tiles first.
* Optional ping-pong (config.pingpong): a two-arrival barrier used as a rendezvous twice per step
  offsets the two warpgroups by half a step, so one warpgroup's softmax overlaps the other's
  wgmmas. Warpgroup 1 rendezvouses once before its loop, warpgroup 0 once after, and drain steps
  rendezvous too, so both always make 2 * n_steps + 1 rendezvous.

Supported in this draft: bfloat16 and float16, head_dim 64/128/256, seq_q a multiple of
2 * block_q and seq_kv a multiple of block_kv, no softcap, no left window bound (so: full or
causal attention, top-left or bottom-right), no segment ids or lengths. Everything else raises
NotImplementedError (`unsupported_reason` says why without raising), for the dispatcher to route
to Triton. Unlike the Triton kernel, a non-finite V entry in a *masked-out* position of a
diagonal block is not isolated (0 * inf = NaN reaches that row).

CPU testing (jax 0.11.2): Mosaic GPU has a real interpret mode that simulates shared memory,
barriers, TMA and wgmma on the CPU: `interpret=plgpu.InterpretGPUParams()` on `plgpu.kernel`
(also `plgpu.force_gpu_interpret_mode()`). `spec.interpret=True` selects it here; it is slow
(seconds for a few hundred rows), so tests use small shapes. Two deviations there, both in
the P.V product (spec.interpret only): the interpreter takes no wgmma operand in registers and no
`run_state` over an accumulator, so P is staged through shared memory and the product is added to
acc; the compiled path (P from registers, accumulating in place) is not covered on the CPU. The
interpreter also insists that every barrier phase be waited for, which is why the copy
warpgroup waits for the last releases. In addition
`jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))` runs on a CPU-only machine all the
Python passes (Pallas lowering, Mosaic GPU layout inference, dialect lowering, for sm_90): what
is left untested without a GPU is the C++/LLVM/ptxas compile, shared-memory limits at launch,
and speed.

The kernel is built with `plgpu.kernel` (warp specialization needs its thread axis); the staged
primitive is `mpmd_map` with params name == KERNEL_NAME, not `pallas_call`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash.spec import AttentionSpec
from pallas_flash.stats import LOG2E, RowStats

__all__ = ["KERNEL_NAME", "MosaicForwardConfig", "default_forward_config", "forward",
           "unsupported_reason"]

KERNEL_NAME = "pallas_flash_mosaic_fwd"
COMPUTE_WGS = 2  # compute warpgroups per CTA; one more warpgroup issues the copies
F16_MAX = 65504.0
_SUPPORTED_HEAD_DIMS = (64, 128, 256)
_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class MosaicForwardConfig:
    """Tiles of the Mosaic forward kernel.

    block_q: query rows per compute warpgroup (a CTA holds COMPUTE_WGS * block_q rows).
    block_kv: key rows per step.
    stages: K/V shared-memory slots in flight (>= 2).
    pingpong: offset the two compute warpgroups so softmax and wgmma overlap.
    compute_registers / copy_registers: per-thread register budgets after the split.
    """

    block_q: int = 64
    block_kv: int = 128
    stages: int = 2
    pingpong: bool = True
    compute_registers: int = 232
    copy_registers: int = 40

    def __post_init__(self):
        if self.block_q != 64:
            # One wgmma M tile per warpgroup; 128 would need two accumulators per warpgroup.
            raise ValueError(f"MosaicForwardConfig.block_q must be 64, got {self.block_q}")
        if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
            raise ValueError(
                f"MosaicForwardConfig.block_kv must be 64, 128, 192 or 256, got {self.block_kv}")
        if self.stages < 2:
            raise ValueError(f"MosaicForwardConfig.stages must be >= 2, got {self.stages}")

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        q = COMPUTE_WGS * self.block_q * head_dim * itemsize
        kv = 2 * self.stages * self.block_kv * head_dim * itemsize
        stats = 2 * COMPUTE_WGS * self.block_q * 4
        return q + kv + stats


def default_forward_config(head_dim: int) -> MosaicForwardConfig:
    """Untuned first guesses that fit the 227 KiB of shared memory of an H100/H200."""
    if head_dim <= 128:
        return MosaicForwardConfig(block_q=64, block_kv=128, stages=2)
    return MosaicForwardConfig(block_q=64, block_kv=64, stages=2)


def unsupported_reason(spec: AttentionSpec, q, k, v, config: MosaicForwardConfig | None = None):
    """Why this draft kernel cannot take the call, or None if it can."""
    batch, seq_q, q_heads, head_dim = q.shape
    seq_kv, kv_heads = k.shape[1], k.shape[2]
    cfg = config or default_forward_config(head_dim)
    mask = spec.mask
    if jnp.dtype(q.dtype) not in _SUPPORTED_DTYPES:
        return f"mosaic forward: dtype {jnp.dtype(q.dtype).name} (only bfloat16 and float16)"
    if not (q.dtype == k.dtype == v.dtype):
        return "mosaic forward: q, k and v must share one dtype"
    if head_dim not in _SUPPORTED_HEAD_DIMS or v.shape[-1] != head_dim:
        return f"mosaic forward: head_dim {head_dim} (only {_SUPPORTED_HEAD_DIMS})"
    if q_heads % kv_heads:
        return f"mosaic forward: q_heads {q_heads} not a multiple of kv_heads {kv_heads}"
    if spec.softcap is not None:
        return "mosaic forward: softcap is not supported yet"
    if mask.left is not None:
        return "mosaic forward: sliding window (left bound) is not supported yet"
    if spec.has_segments:
        return "mosaic forward: segment ids / padding lengths are not supported yet"
    rows = COMPUTE_WGS * cfg.block_q
    if seq_q % rows:
        return f"mosaic forward: seq_q {seq_q} must be a multiple of {rows} (2 * block_q)"
    if seq_kv % cfg.block_kv:
        return f"mosaic forward: seq_kv {seq_kv} must be a multiple of block_kv {cfg.block_kv}"
    if cfg.smem_bytes(head_dim) > 227 * 1024:
        return (f"mosaic forward: config {cfg} needs {cfg.smem_bytes(head_dim)} bytes of shared "
                "memory at this head_dim (limit 227 KiB)")
    return None


def _bcast_rows(x, shape):
    return lax.broadcast_in_dim(x, shape, [0])


def _kernel(q_ref, k_ref, v_ref, o_ref, m_ref, r_ref,
            q_smem, k_smem, v_smem, m_smem, r_smem,
            q_loaded, k_loaded, v_loaded, k_free, v_free, rendezvous_bar, *p_smem,
            spec: AttentionSpec, cfg: MosaicForwardConfig, group: int, n_tiles: int,
            head_dim: int):
    mask = spec.mask
    block_q, block_kv, stages = cfg.block_q, cfg.block_kv, cfg.stages
    dtype = q_ref.dtype
    n_kv = mask.seq_kv // block_kv
    c = spec.scale * LOG2E
    bounded = mask.right is not None
    reach_shift = 0 if not bounded else mask.offset + mask.right + 1

    tile = lax.axis_index("tile")
    if bounded:
        tile = (n_tiles - 1) - tile  # the longest rows first
    head = lax.axis_index("head")
    batch = lax.axis_index("batch")
    wg = lax.axis_index("wg")
    cta_start = tile * (COMPUTE_WGS * block_q)

    def blocks_reached(first_row, round_up: bool):
        """Key blocks [0, n) that row `first_row` sees (round_up: partly; else wholly)."""
        if not bounded:
            return n_kv
        keys = jnp.clip(first_row + reach_shift, 0, mask.seq_kv)
        if round_up:
            keys = keys + (block_kv - 1)
        return lax.div(keys, jnp.int32(block_kv))

    # Blocks the CTA needs at all: those the last row of the CTA reaches.
    n_steps = blocks_reached(cta_start + (COMPUTE_WGS * block_q - 1), True)

    def rendezvous():
        if cfg.pingpong:
            plgpu.barrier_arrive(rendezvous_bar)
            plgpu.barrier_wait(rendezvous_bar)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(cfg.compute_registers, action="increase")
        q_start = cta_start + wg * block_q
        my_q = q_smem.at[wg]
        plgpu.copy_gmem_to_smem(
            q_ref.at[batch, pl.ds(q_start, block_q), head], my_q, q_loaded.at[wg])

        hi = blocks_reached(q_start + (block_q - 1), True)
        full = blocks_reached(q_start, False)

        def step(s, carry, masked: bool):
            acc, m, l = carry
            slot = lax.rem(s, jnp.int32(stages))
            plgpu.barrier_wait(k_loaded.at[slot])

            def logits(s_ref):
                plgpu.wgmma(s_ref, my_q, k_smem.at[slot].T)
                rendezvous()
                return s_ref[...]

            u = pl.run_scoped(logits, plgpu.ACC((block_q, block_kv), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            if masked:
                shape = (block_q, block_kv)
                rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
                cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
                visible = (cols + s * block_kv) <= (rows + (q_start + reach_shift - 1))
                u = jnp.where(visible, u, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(u, axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2((m - m_safe) * c)
            p = jnp.exp2((u - _bcast_rows(m_safe, u.shape)) * c)
            l = l * alpha + jnp.sum(p, axis=1)
            acc = acc * _bcast_rows(alpha, acc.shape)
            p_in = p.astype(dtype)
            plgpu.barrier_wait(v_loaded.at[slot])
            rendezvous()

            def weighted_values(acc_ref):
                plgpu.wgmma(acc_ref, p_in, v_smem.at[slot])

            if spec.interpret:
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

                acc = acc + pl.run_scoped(fresh, plgpu.ACC((block_q, head_dim), jnp.float32))
            else:
                acc = pl.run_state(weighted_values)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        def drain(s, _):
            slot = lax.rem(s, jnp.int32(stages))
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

        plgpu.barrier_wait(q_loaded.at[wg])
        if cfg.pingpong:
            pl.when(wg == 1)(rendezvous)
        unmasked = functools.partial(step, masked=False)
        masked = functools.partial(step, masked=True)
        carry = lax.fori_loop(0, full, unmasked, carry)
        if bounded:
            carry = lax.fori_loop(full, hi, masked, carry)
            lax.fori_loop(hi, n_steps, drain, None)
        if cfg.pingpong:
            pl.when(wg == 0)(rendezvous)
        acc, m, l = carry

        seen = l != 0.0
        out = acc / _bcast_rows(jnp.where(seen, l, 1.0), acc.shape)
        if jnp.dtype(dtype) == jnp.float16:
            big = (jnp.abs(out) > F16_MAX) & (jnp.abs(out) < jnp.inf)
            out = jnp.where(big, jnp.where(out > 0, F16_MAX, -F16_MAX), out)
        my_q[...] = out.astype(dtype)
        m_smem.at[wg][...] = jnp.where(m == -jnp.inf, 0.0, m)
        r_smem.at[wg][...] = jnp.log2(l)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(my_q, o_ref.at[batch, pl.ds(q_start, block_q), head])
        plgpu.copy_smem_to_gmem(m_smem.at[wg], m_ref.at[batch, head, pl.ds(q_start, block_q)])
        plgpu.copy_smem_to_gmem(r_smem.at[wg], r_ref.at[batch, head, pl.ds(q_start, block_q)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _copy():
        plgpu.set_max_registers(cfg.copy_registers, action="decrease")
        kv_head = lax.div(head, jnp.int32(group))

        def issue(s, slot):
            rows = (batch, pl.ds(s * block_kv, block_kv), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_loaded.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_loaded.at[slot])

        # Static starts are bounds-checked when traced, even under pl.when: never name a block
        # past the end of K/V (a short sequence can have fewer blocks than slots).
        for s in range(min(stages, k_ref.shape[1] // block_kv)):
            pl.when(s < n_steps)(functools.partial(issue, s, s))

        def refill(s, _):
            slot = lax.rem(s, jnp.int32(stages))
            rows = (batch, pl.ds(s * block_kv, block_kv), kv_head)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_loaded.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_loaded.at[slot])

        lax.fori_loop(stages, n_steps, refill, None)

        # Observe the last releases too, so every phase of every barrier is waited for (GPU
        # interpret mode checks this when the barriers are freed; on the GPU it costs nothing,
        # this warpgroup has no work left).
        def last_release(s, _):
            slot = lax.rem(s, jnp.int32(stages))
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])

        lax.fori_loop(jnp.maximum(n_steps - stages, 0), n_steps, last_release, None)


def forward(spec: AttentionSpec, q, k, v, q_ids=None, kv_ids=None, *,
            config: MosaicForwardConfig | None = None):
    """O [batch, seq_q, q_heads, head_dim] and stats.RowStats (each [batch, q_heads, seq_q]).

    Raises NotImplementedError for anything this draft does not serve (`unsupported_reason`).
    """
    batch, seq_q, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    cfg = config or default_forward_config(head_dim)
    if q_ids is not None or kv_ids is not None:
        raise NotImplementedError("mosaic forward: segment ids / padding lengths are not "
                                  "supported yet")
    reason = unsupported_reason(spec, q, k, v, cfg)
    if reason is not None:
        raise NotImplementedError(reason)
    group = q_heads // kv_heads
    n_tiles = seq_q // (COMPUTE_WGS * cfg.block_q)
    dtype = q.dtype

    stats_shape = jax.ShapeDtypeStruct((batch, q_heads, seq_q), jnp.float32)
    scratch = [
        plgpu.SMEM((COMPUTE_WGS, cfg.block_q, head_dim), dtype),
        plgpu.SMEM((cfg.stages, cfg.block_kv, head_dim), dtype),
        plgpu.SMEM((cfg.stages, cfg.block_kv, head_dim), dtype),
        plgpu.SMEM((COMPUTE_WGS, cfg.block_q), jnp.float32),
        plgpu.SMEM((COMPUTE_WGS, cfg.block_q), jnp.float32),
        plgpu.Barrier(num_barriers=COMPUTE_WGS),
        plgpu.Barrier(num_barriers=cfg.stages),
        plgpu.Barrier(num_barriers=cfg.stages),
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=cfg.stages),
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=cfg.stages),
        plgpu.Barrier(num_arrivals=COMPUTE_WGS),
    ]
    if spec.interpret:
        scratch.append(plgpu.SMEM((COMPUTE_WGS, cfg.block_q, cfg.block_kv), dtype))
    body = functools.partial(_kernel, spec=spec, cfg=cfg, group=group, n_tiles=n_tiles,
                             head_dim=head_dim)
    call = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct(q.shape, dtype), stats_shape, stats_shape),
        scratch_types=scratch,
        grid=(n_tiles, q_heads, batch),
        grid_names=("tile", "head", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if spec.interpret else None,
        kernel_name=KERNEL_NAME,
    )
    out, m, r = call(q, k, v)
    return out, RowStats(m, r)
