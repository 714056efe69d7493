"""Pieces shared by the Mosaic GPU kernels: operand support, logit units, loop bounds."""

from __future__ import annotations

import functools
import os
import warnings

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash.masking import with_segment_range
from pallas_flash.mosaic.schedule import TileGrid, cluster_tiles, grid_position
from pallas_flash.spec import AttentionSpec


class InterpretThreadsWarning(UserWarning):
    """XLA's CPU thread pool is too small for a Mosaic kernel in interpret mode: it may hang."""


_threads_warned = False


def _cpu_pool_threads() -> int:
    """The threads of XLA:CPU's intra-op pool: NPROC where set, else the cores this process
    may run on. JAX reads it once, when its CPU backend starts."""
    for name in ("NPROC", "PORTABLE_NPROC"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)


def interpret_params(interpret: bool, threads: int, zero_memory: bool = False):
    """`interpret=` of a Mosaic kernel with `threads` warpgroups: None when compiled.
    zero_memory: outputs and scratch start as zeros (else NaNs, which expose unwritten rows).

    The interpreter runs each warpgroup of a CTA as its own XLA:CPU computation, and parts of
    each run on XLA's intra-op pool; a warpgroup waiting at a barrier holds its pool thread. With
    fewer pool threads than warpgroups the one that would arrive can starve, and the call hangs
    (seen with four warpgroups and two threads). Warned once per process, before the call."""
    if not interpret:
        return None
    global _threads_warned
    pool = _cpu_pool_threads()
    if pool < threads and not _threads_warned:
        _threads_warned = True
        warnings.warn(
            f"pallas_flash: a Mosaic kernel in interpret mode runs {threads} warpgroups as "
            f"concurrent XLA:CPU computations, but XLA's CPU thread pool has {pool} threads, so "
            "the call can hang. Set NPROC=16 in the environment before JAX starts.",
            InterpretThreadsWarning, stacklevel=2)
    return plgpu.InterpretGPUParams(uninitialized_memory="zero" if zero_memory else "nan")

# Multiples of 16 (a wgmma K step, and 32-byte rows for TMA) from 32 to 256; above 128 the
# dK/dV kernel splits the columns in two slices of whole 16s (80 + 64 at 144).
SUPPORTED_HEAD_DIMS = tuple(range(32, 257, 16))
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def unsupported_operands(which: str, q, k, v, *, v_head_dim_may_differ: bool = False):
    """Why the Mosaic `which` pass cannot take these operands, or None. With
    v_head_dim_may_differ, V's head_dim may be smaller than Q/K's (MLA) if it is a supported
    one too."""
    q_heads, head_dim = q.shape[2:]
    kv_heads = k.shape[2]
    head_dim_v = v.shape[-1]
    if head_dim_v != head_dim and not v_head_dim_may_differ:
        return (f"mosaic {which}: v head_dim {head_dim_v} differs from q and k's {head_dim}; "
                f"the Mosaic {which} takes one head_dim")
    if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
        return f"mosaic {which}: dtype {jnp.dtype(q.dtype).name} (only bfloat16 and float16)"
    if not (q.dtype == k.dtype == v.dtype):
        return f"mosaic {which}: q, k and v must share one dtype"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"mosaic {which}: head_dim {head_dim} (only {SUPPORTED_HEAD_DIMS})"
    if head_dim_v != head_dim and (head_dim_v > head_dim
                                   or head_dim_v not in SUPPORTED_HEAD_DIMS):
        return (f"mosaic {which}: v head_dim {head_dim_v} (at most q and k's {head_dim}, "
                f"and one of {SUPPORTED_HEAD_DIMS})")
    if q_heads % kv_heads:
        return f"mosaic {which}: q_heads {q_heads} not a multiple of kv_heads {kv_heads}"
    return None


def softcap_tanh(x):
    """tanh(x) for the softcap. The kernels compile with approx_math, which makes this one
    tanh.approx.f32 on the multi-function unit, the unit the softmax's exp2 already keeps busy;
    the exact form 1 - 2 / (2^(2x log2 e) + 1) costs an exp2 and a division there. Its error
    (PTX ISA: 2^-10.987 relative at most) does not show against float32 references at the
    operands' precision (docs/performance.md, "Variants"). In interpret mode it is jnp.tanh's
    exact value."""
    return jnp.tanh(x)


def logit_units(spec: AttentionSpec, s):
    """(u, t): raw q.k in logit units (stats.py), and t = tanh(s * scale / softcap) for the
    softcap's chain rule (None without one)."""
    if spec.softcap is None:
        return s, None
    t = softcap_tanh(s * (spec.scale / spec.softcap))
    return t, t


def clamp_range(bounds, lo_limit, hi_limit):
    """(lo, full_lo, full_hi, hi), each clipped into [lo_limit, hi_limit]: a warpgroup's
    range inside what the copy warpgroup streams, so its loops consume every streamed block."""
    return tuple(jnp.clip(b, lo_limit, hi_limit) for b in bounds)


def pad_seq(x, multiple: int, axis: int = 1, value=0):
    """x padded along `axis` to a multiple of `multiple` (no copy when it already is one)."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def narrowed(bounds, seg_ref, batch, block):
    """Loop bounds tightened by the segment range of (batch, block) (seg_ref None: none)."""
    if seg_ref is None:
        return bounds
    return with_segment_range(bounds, seg_ref[batch, block, 0], seg_ref[batch, block, 1])


def streamed_range(bounds, seg_ref, batch, block):
    """[lo, hi): the blocks a CTA's copy warpgroup streams (the outer bounds)."""
    lo, _, _, hi = bounds
    lo, _, _, hi = narrowed((lo, lo, hi, hi), seg_ref, batch, block)
    return lo, hi


def query_tile_position(mask, n_tiles: int, cta_rows: int, block_kv: int, seg_ref,
                        cluster: int = 1, order: TileGrid | None = None):
    """(tile, head, batch, warpgroup, cta_start, cta_lo, cta_hi) of a query-tile kernel's
    program (forward, dQ). A cluster's CTAs share every K / V block, so each streams the
    union of their ranges (a tile wholly past seq_q adds nothing)."""
    tile, head, batch, wg = grid_position(mask, n_tiles, cluster, order)
    cta_start = tile * cta_rows

    def tile_range(t, start):
        return streamed_range(mask.kv_blocks(start, cta_rows, block_kv, mask.seq_kv),
                              seg_ref, batch, t)

    if cluster == 1:
        cta_lo, cta_hi = tile_range(tile, cta_start)
        return tile, head, batch, wg, cta_start, cta_lo, cta_hi
    lo_u = jnp.int32(jnp.iinfo(jnp.int32).max)
    hi_u = jnp.int32(jnp.iinfo(jnp.int32).min)
    for t in cluster_tiles(mask, n_tiles, cluster):
        t_lo, t_hi = tile_range(t, t * cta_rows)
        counts = (t * cta_rows < mask.seq_q) & (t_hi > t_lo)
        lo_u = jnp.where(counts, jnp.minimum(lo_u, t_lo), lo_u)
        hi_u = jnp.where(counts, jnp.maximum(hi_u, t_hi), hi_u)
    empty = hi_u <= lo_u
    return (tile, head, batch, wg, cta_start, jnp.where(empty, 0, lo_u),
            jnp.where(empty, 0, hi_u))


def stream_through_slots(issue, slot_free, stages: int, total):
    """The copy warpgroup's loop: issue(t, slot) for `total` steps through `stages` slots,
    each refill once the compute warpgroups freed the slot, then await the last frees too
    (interpret mode checks every barrier phase is awaited)."""
    for s in range(stages):
        pl.when(s < total)(functools.partial(issue, jnp.int32(s), s))

    def refill(t, _):
        slot = lax.rem(t, jnp.int32(stages))
        plgpu.barrier_wait(slot_free.at[slot])
        issue(t, slot)

    lax.fori_loop(jnp.int32(stages), total, refill, None)
    await_last_frees(slot_free, stages, total)


def await_last_frees(free, slots: int, total):
    """Wait on `free` for the last `slots` of `total` steps, whose frees no later step awaited
    (interpret mode checks every barrier phase is awaited); step t frees free[t % slots]."""
    lax.fori_loop(jnp.maximum(total - slots, 0), total,
                  lambda t, _: plgpu.barrier_wait(free.at[lax.rem(t, jnp.int32(slots))]), None)


def step_after(t0, t):
    """Stream step t of a persistent CTA's item whose steps start at t0; t0 a Python 0 for the
    one item of a launch-order grid's CTA, which then traces no add."""
    return t if isinstance(t0, int) and t0 == 0 else t0 + t


def profile_params(directory: str, ranges: int) -> dict:
    """CompilerParams arguments recording the kernel's named scopes into a trace in
    `directory` ({} when empty; benchmarks/kernel_trace.py reads it). `ranges`: the most scopes
    a warpgroup enters in a CTA, 16 bytes of shared memory each."""
    if not directory:
        return {}
    return dict(profile_space=ranges, profile_dir=directory)
