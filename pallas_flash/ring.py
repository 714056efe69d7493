"""Context parallelism: exact attention with the sequence split over one mesh axis of P devices.

Two strategies share one static plan (ring_plan.py) and one set of per-device passes
(ring_steps.py):

* "ring": K/V shards travel between the devices with `lax.ppermute`; at step t device i holds
  the shard of device (i - t) mod P. The send of the next shard is issued before the current
  step's kernels and consumed after them, so it can overlap them. A device holds its own shard,
  the one in use and at most one in flight; dK/dV go back to their owner in the input dtype
  and are summed there in float32. Memory per device falls as 1/P.
* "allgather": K/V are all-gathered once and every device attends its rows to them (as
  MaxText does); the backward reduce-scatters dK/dV. It sends fewer bytes and makes fewer
  transfers, and holds the whole sequence's K/V: the right choice when K/V are small beside Q
  (GQA with few K/V heads).
* "auto" picks by a byte-count model, `ring_plan.choose_strategy`: the all-gather when it sends
  fewer bytes and the K/V it gathers fit in the size of the local query shard.

Each kernel call of a step picks its backend as `flash_attention` does: the Mosaic kernels on
Hopper ("auto", behind the finiteness guard), the Triton kernels elsewhere, interpret mode on
the CPU. Partial results merge exactly through the lse, forward (`ring_steps._merge`) and
backward (global O and lse in every pair's backward).

Masks: every (query piece, key piece) pair of a step has a static position mask: causal, a
window (left, right) in natural positions, top-left or bottom-right alignment (the same mask
here: this is self-attention, seq_q = seq_kv). A pair in which no key is visible is skipped,
not computed and masked; a step that no device needs is not taken at all, so with a sliding
window the shards travel only as far as the window reaches.

Layouts: with "contiguous" device i holds the i-th of P chunks; under a causal mask the devices
at the end of the sequence then see far more keys than those at the start. "zigzag" balances
that: the sequence is cut into 2P chunks and device i holds chunks i and 2P-1-i, so every
off-diagonal step costs the same half pair on every device. `zigzag_permute` /
`zigzag_unpermute` reorder tokens into and out of this layout; a model permutes its tokens (and
position ids) once at the input, and everything but attention is position-wise.

Packed documents: segment ids are sharded like the tokens (in the same layout), and the kv ids
travel with their K/V shard, so every call gets the ids of its exact rows and columns. Padding
lengths count natural positions; each device folds them into its ids from the natural positions
of its chunks, so no global array is built. Sinks apply to the merged (O, lse).

`ring_attention` takes and returns global arrays and runs shard_map inside;
`ring_attention_local` is the per-device function for code that is already inside a
`jax.shard_map` (with check_vma=False; sharding.py says why).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from pallas_flash import attention, validation
from pallas_flash.config import FlashConfig
from pallas_flash.masking import CausalAlignment, fold_lengths, make_mask_spec
from pallas_flash.ring_plan import (LAYOUTS, STRATEGIES, Plan, choose_strategy, make_plan,
                                    strategy_bytes)
from pallas_flash.ring_steps import attention_vjp
from pallas_flash.sinks import apply_sinks, check_sinks
from pallas_flash.sharding import (ID_OPTIONS, AxisNames, check_axes, check_divisible,
                                   check_heads, freeze_axes, partition_entry, place)
from pallas_flash.spec import AttentionSpec

__all__ = ["ring_attention", "ring_attention_local", "strategy_bytes", "zigzag_permute",
           "zigzag_unpermute"]


# ================================================================================================
# Zig-zag layout
# ================================================================================================


def _split_axis(x, axis: int, num_devices: int):
    """x with `axis` split into (2, num_devices, chunk): a first and a second half of P chunks.

    Every argument is checked first (ValueError naming it): `axis % x.ndim` would turn an
    out-of-range axis into another axis, and num_devices divides the axis length."""
    if not hasattr(x, "shape") or not hasattr(x, "ndim"):
        raise ValueError(f"x must be an array, got {type(x).__name__}")
    if not (validation.is_int(axis) and -x.ndim <= axis < x.ndim):
        raise ValueError(f"axis must be an int with {-x.ndim} <= axis < {x.ndim} for x of shape "
                         f"{tuple(x.shape)}, got {axis!r}")
    if not (validation.is_int(num_devices) and num_devices >= 1):
        raise ValueError(f"num_devices must be a positive int, got {num_devices!r}")
    axis = int(axis) % x.ndim
    n = x.shape[axis]
    if n % (2 * num_devices):
        raise ValueError(f"the length of axis {axis} ({n}) must be divisible by 2 * num_devices "
                         f"({2 * num_devices}) for the zig-zag layout")
    chunk = n // (2 * num_devices)
    return axis, x.reshape(*x.shape[:axis], 2, num_devices, chunk, *x.shape[axis + 1:])


def zigzag_permute(x, num_devices: int, axis: int = 1):
    """Reorders a sequence axis from natural order into the zig-zag layout of `ring_attention`.

    The axis is cut into 2P equal chunks (P = num_devices) and laid out as chunks
    0, 2P-1, 1, 2P-2, ..., P-1, P, so that splitting the result evenly over P devices gives
    device i the chunks i and 2P-1-i. Apply it to tokens, targets and position ids alike,
    before they are sharded (it is a static reshape / reverse / stack, no gather).
    """
    axis, halves = _split_axis(x, axis, num_devices)
    first = lax.index_in_dim(halves, 0, axis, keepdims=False)  # chunks 0 .. P-1
    # Chunks P .. 2P-1 reversed: position i holds chunk 2P-1-i.
    second = jnp.flip(lax.index_in_dim(halves, 1, axis, keepdims=False), axis=axis)
    return jnp.stack([first, second], axis=axis + 1).reshape(x.shape)


def zigzag_unpermute(x, num_devices: int, axis: int = 1):
    """Inverse of `zigzag_permute`: zig-zag layout back to natural sequence order."""
    axis, pairs = _split_axis(x, axis, num_devices)
    # Read as (P devices, 2 chunks each) instead of (2 halves, P chunks).
    pairs = pairs.reshape(*x.shape[:axis], num_devices, 2, *pairs.shape[axis + 2:])
    first = lax.index_in_dim(pairs, 0, axis + 1, keepdims=False)
    second = jnp.flip(lax.index_in_dim(pairs, 1, axis + 1, keepdims=False), axis=axis)
    return jnp.stack([first, second], axis=axis).reshape(x.shape)


# ================================================================================================
# Options and the plan
# ================================================================================================


def _plan(q, k, v, *, axis_name: str, axis_size: int | None, where: str, causal, scale, softcap,
          window, causal_alignment, layout, strategy, backend, precision, config, interpret,
          ids) -> Plan:
    """Validates every option (ValueError naming it) and builds the static plan for the local
    shards of q, k, v; `where` says whether the shapes given are "global" or "local" (inside a
    shard_map: axis_size None, read from the axis once the arguments are checked).

    ids: the segment-id and length arguments by name (None where not given), checked against
    the shapes of q and k as `flash_attention` checks them.
    """
    opts = validation.validate(
        q, k, v, causal=causal, scale=scale, causal_alignment=causal_alignment, window=window,
        softcap=softcap, v_head_dim_may_differ=True, **ids)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if backend not in attention._BACKENDS:
        raise ValueError(f"backend must be one of {attention._BACKENDS}, got {backend!r}")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"ring attention is self-attention: q and k need one sequence length, "
                         f"got q {tuple(q.shape)} and k {tuple(k.shape)}")
    parts = axis_size if where == "global" else 1
    if axis_size is None:
        try:
            axis_size = lax.axis_size(axis_name)
        except NameError:
            raise ValueError(f"axis_name {axis_name!r} is not a mesh axis of this shard_map: "
                             f"ring_attention_local runs inside jax.shard_map over that axis "
                             f"(ring_attention builds the shard_map itself)") from None
    chunks = parts * (2 if layout == "zigzag" else 1)
    if q.shape[1] % chunks:
        raise ValueError(f"the {where} sequence length ({q.shape[1]}) must be divisible by "
                         f"{chunks} for the {layout} layout")
    explicit_config = config is not None
    precision, config, interpret = attention.kernel_options(
        q, precision=precision, config=config, interpret=interpret, head_dim_v=v.shape[-1])
    # Lengths are folded into ids too (masking.fold_lengths), so either kind needs the ids path.
    has_segments = any(x is not None for x in ids.values())

    def spec_of(mask):
        return AttentionSpec(mask=mask, scale=opts.scale, softcap=opts.softcap,
                             has_segments=has_segments, precision=precision, config=config,
                             interpret=interpret)

    local = [jax.ShapeDtypeStruct((x.shape[0], x.shape[1] // parts, *x.shape[2:]), x.dtype)
             for x in (q, k, v)]
    if backend == "mosaic":
        # The whole local call is checked as flash_attention checks it (ValueError: which
        # backend can serve it); single blocks the Mosaic kernels cannot take run on Triton.
        attention._choose_backends(
            "mosaic", spec_of(make_mask_spec(local[0].shape[1], local[1].shape[1],
                                             causal=bool(causal))), *local)
    plan = make_plan(axis_name, axis_size, *local, layout=layout, causal=bool(causal),
                     window=opts.window, spec_of=spec_of, backend=backend,
                     explicit_config=explicit_config)
    if strategy == "auto":
        batch, seq, q_heads, head_dim = q.shape
        strategy = choose_strategy(devices=axis_size, seq=local[0].shape[1] * axis_size,
                                   q_heads=q_heads, kv_heads=k.shape[2], head_dim=head_dim,
                                   head_dim_v=v.shape[-1], dtype=q.dtype, batch=batch,
                                   ring_steps=plan.ring_steps)
    return dataclasses.replace(plan, strategy=strategy)


def _given_ids(**ids):
    """The id arguments that were given, by name, in ID_OPTIONS order."""
    return {name: ids[name] for name in ID_OPTIONS if ids[name] is not None}


# ================================================================================================
# The public functions
# ================================================================================================


def ring_attention(q, k, v, *, mesh: Mesh, axis_name: str, causal: bool = False,
                   layout: str = "contiguous", strategy: str = "ring",
                   batch_axis: AxisNames = None, head_axis: AxisNames = None,
                   scale: float | None = None, window: tuple[int | None, int | None] | None = None,
                   causal_alignment: CausalAlignment = "top_left", softcap: float | None = None,
                   sinks=None, return_lse: bool = False, q_segment_ids=None, kv_segment_ids=None,
                   q_lengths=None, kv_lengths=None, precision=None,
                   config: FlashConfig | None = None, backend: str = "auto",
                   interpret: bool | None = None):
    """Exact attention with the sequence split over the mesh axis `axis_name`.

    Args:
      q: [batch, seq, q_heads, head_dim]; k: [batch, seq, kv_heads, head_dim]; v: [batch, seq,
        kv_heads, head_dim_v] (global arrays; self-attention, so one seq). head_dim_v may differ
        from head_dim (DeepSeek's MLA: 192 and 128), as in `flash_attention`. With
        layout="zigzag" the seq axis must already be in zig-zag order (`zigzag_permute`); the
        output then is too.
      mesh: the device mesh; axis_name: the mesh axis that splits the sequence.
      causal: causal self-attention (query i sees keys j <= i, in natural positions).
      layout: "contiguous" (device i holds the i-th of P equal chunks) or "zigzag" (2P chunks,
        device i holds chunks i and 2P-1-i: balanced causal work). seq must be divisible by P
        or 2P respectively.
      strategy: "ring" (K/V shards travel; memory falls as 1/P), "allgather" (K/V gathered
        once, dK/dV reduce-scattered) or "auto" (the byte model of `strategy_bytes`; see the
        module docstring).
      batch_axis, head_axis: optional mesh axes that also split the batch / the heads (data
        and head parallelism, as in `sharded_flash_attention`).
      window: (left, right) in natural positions, as for `flash_attention`; shard pairs
        outside it are skipped. causal_alignment: as for `flash_attention` (for self-attention
        both alignments give the same mask).
      q_segment_ids, kv_segment_ids: int [batch, seq], given together: packed documents, a
        query sees only keys with its id, as in `flash_attention`. They are laid out like q and
        k (already zig-zag permuted with layout="zigzag", by the same `zigzag_permute`) and
        sharded with them.
      q_lengths, kv_lengths: int [batch] valid lengths in natural positions (also with
        layout="zigzag": tokens at natural positions >= length are padding), as in
        `flash_attention`: padded rows give 0 output and 0 gradient.
      scale, softcap, return_lse, precision, config, interpret: as for `flash_attention`.
      backend: "auto", "triton" or "mosaic", chosen per kernel call as `flash_attention`
        chooses; "mosaic" raises a ValueError when the Mosaic kernels cannot serve the call.
      sinks: float [q_heads] sink logits, as for `flash_attention`: applied to the merged
        (O, lse) of the whole sequence, so no shard pair needs to know of them.

    Returns:
      out [batch, seq, q_heads, head_dim_v] in q's dtype, or (out, lse) with return_lse (lse
      [batch, q_heads, seq], float32). Both are differentiable; gradients are deterministic.
    """
    if not isinstance(axis_name, str):
        raise ValueError(f"axis_name must be one mesh axis name, got {axis_name!r}")
    check_axes(mesh, axis_name=axis_name, batch_axis=batch_axis, head_axis=head_axis)
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse must be a bool, got {return_lse!r}")
    ids = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_lengths=q_lengths,
               kv_lengths=kv_lengths)
    plan = _plan(q, k, v, axis_name=axis_name, axis_size=mesh.shape[axis_name], where="global",
                 causal=causal, scale=scale, softcap=softcap, window=window,
                 causal_alignment=causal_alignment, layout=layout, strategy=strategy,
                 backend=backend, precision=precision, config=config, interpret=interpret,
                 ids=ids)
    check_divisible("the batch size", q.shape[0], mesh, batch_axis, "batch_axis")
    check_heads(q, k, mesh, head_axis)
    if sinks is not None:  # checked before the kernels, applied after them
        sinks = check_sinks(sinks, q.shape[2])
    ids = _given_ids(**ids)
    fn = _sharded_fn(mesh, plan, freeze_axes(batch_axis), freeze_axes(head_axis), tuple(ids))
    out, lse = fn(q, k, v, *ids.values())
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out


def ring_attention_local(q, k, v, *, axis_name: str, causal: bool = False,
                         layout: str = "contiguous", strategy: str = "ring",
                         scale: float | None = None,
                         window: tuple[int | None, int | None] | None = None,
                         causal_alignment: CausalAlignment = "top_left",
                         softcap: float | None = None, sinks=None, return_lse: bool = False,
                         q_segment_ids=None, kv_segment_ids=None, q_lengths=None,
                         kv_lengths=None, precision=None, config: FlashConfig | None = None,
                         backend: str = "auto", interpret: bool | None = None):
    """The per-device function, for use inside `jax.shard_map(..., check_vma=False)`.

    q, k, v are this device's shards [batch, seq / P, heads, head_dim] (V's head_dim may differ)
    of a sequence split over the manual mesh axis `axis_name`, in the given layout (for
    "zigzag": this device's chunk i followed by its chunk 2P-1-i). q_segment_ids and
    kv_segment_ids are this device's shards [batch, seq / P] of the ids, split like q and k;
    q_lengths and kv_lengths are not split along the sequence: [batch] lengths in natural
    positions of the whole sequence. Other arguments and the result are as in `ring_attention`,
    per device.
    """
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse must be a bool, got {return_lse!r}")
    ids = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_lengths=q_lengths,
               kv_lengths=kv_lengths)
    plan = _plan(q, k, v, axis_name=axis_name, axis_size=None, where="local", causal=causal,
                 scale=scale, softcap=softcap, window=window, causal_alignment=causal_alignment,
                 layout=layout, strategy=strategy, backend=backend, precision=precision,
                 config=config, interpret=interpret, ids=ids)
    if sinks is not None:  # this device's heads: [local q_heads]; applied after the kernels
        sinks = check_sinks(sinks, q.shape[2])
    ids = _given_ids(**ids)
    out, lse = _per_device(plan, tuple(ids), q, k, v, *ids.values())
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out


@functools.lru_cache(maxsize=None)
def _sharded_fn(mesh, plan: Plan, batch_axis, head_axis, id_names=()):
    b, h = partition_entry(batch_axis), partition_entry(head_axis)
    tokens = PartitionSpec(b, plan.axis_name, h, None)
    rows = PartitionSpec(b, h, plan.axis_name)
    # Segment ids are split along the sequence like the tokens; lengths only over the batch.
    id_specs = tuple(PartitionSpec(b, plan.axis_name) if name.endswith("segment_ids")
                     else PartitionSpec(b) for name in id_names)
    in_specs = (tokens,) * 3 + id_specs
    mapped = jax.shard_map(functools.partial(_per_device, plan, id_names), mesh=mesh,
                           in_specs=in_specs, out_specs=(tokens, rows), check_vma=False)

    def run(*args):
        return mapped(*(place(mesh, x, s) for x, s in zip(args, in_specs)))

    return jax.jit(run)


def _per_device(plan: Plan, id_names, q, k, v, *ids):
    """One device's attention: folds the id arguments (named by id_names) into kernel ids,
    then runs the custom_vjp passes."""
    q_ids = kv_ids = None
    if id_names:
        q_ids, kv_ids = _local_ids(plan, q.shape[0], q.shape[1], **dict(zip(id_names, ids)))
    return attention_vjp(plan)(q, k, v, q_ids, kv_ids)


def _local_ids(plan: Plan, batch: int, seq: int, q_segment_ids=None, kv_segment_ids=None,
               q_lengths=None, kv_lengths=None):
    """This device's int32 kernel ids [batch, seq] for q and k, with padding folded in.

    fold_lengths marks the tokens at positions >= length, counting from the start of the arrays
    it is given. A local chunk that starts at natural position `start` is therefore folded with
    its lengths shifted by -start: the zig-zag layout holds two chunks far apart, so each is
    folded on its own. Without lengths the positions do not matter and one call does it all.
    """
    if q_lengths is None and kv_lengths is None:
        return fold_lengths(q_segment_ids, kv_segment_ids, None, None, batch=batch, seq_q=seq,
                            seq_kv=seq)
    me = lax.axis_index(plan.axis_name)
    if plan.layout == "zigzag":
        chunk = seq // 2
        spans = [((0, chunk), me * chunk), ((chunk, seq), (2 * plan.axis_size - 1 - me) * chunk)]
    else:
        spans = [((0, seq), me * seq)]
    def shift(lengths, start):
        return None if lengths is None else lengths.astype(jnp.int32) - start

    parts = []
    for span, start in spans:
        n = span[1] - span[0]
        parts.append(fold_lengths(_span(q_segment_ids, span), _span(kv_segment_ids, span),
                                  shift(q_lengths, start), shift(kv_lengths, start), batch=batch,
                                  seq_q=n, seq_kv=n))
    return tuple(jnp.concatenate(chunks, axis=1) for chunks in zip(*parts))



def _span(x, span):
    """Static slice [span) of x along the sequence axis (None stays None)."""
    return None if x is None else lax.slice_in_dim(x, span[0], span[1], axis=1)
