"""Ring attention (context parallelism): the sequence split over one mesh axis of P devices.

Each device keeps its query shard and the key/value shards travel around the ring with
`lax.ppermute`: at step t device i holds the K/V shard of device (i - t) mod P, runs the forward
kernel on that (query shard, K/V shard) pair and merges the pair's result exactly through the
logsumexp:

    lse = logaddexp(lse_acc, lse_t)
    O   = exp(lse_acc - lse) O_acc + exp(lse_t - lse) O_t

(a row that has seen no key yet has lse = -inf, and is merged with weight 0, never NaN). The send
of the next K/V shard is issued before the current pair is computed, so XLA can overlap the
transfer with the kernel. Steps 1 .. P-1 are one `lax.fori_loop` body, so the program does not
grow with P; the price is one spare send per pass (the last K/V shard goes home).

The backward pass is a second trip around the ring. Given the global O and lse of its rows, the
backward kernel returns one pair's exact share of dQ, dK and dV (it recomputes P = exp(S - lse)
with the global lse, and D = rowsum(dO * O) - dlse from the global O). dQ stays home; dK and dV
accumulators travel with their K/V shard and, after the last step, take one more hop back to
their owner. The lse cotangent enters every pair through D (d lse_i / d S_ij = P_ij for every key
j, in every shard), so it is passed to every pair call. The forward saves only the local q, k,
v, O and lse, as `flash_attention` does.

Causal masking by chunk: a K/V shard from an earlier position is fully visible (no mask), the
device's own shard is the diagonal (causal mask), and a later one is fully masked: it is skipped
(a `lax.cond` branch that calls no kernel), not computed and masked.

With the contiguous layout the devices at the end of the sequence see far more keys than those
at the start. The zig-zag layout balances that: the sequence is cut into 2P chunks and device i
holds chunks i and 2P-1-i. Then every off-diagonal step costs the same half pair on every
device: a shard from an earlier device is seen by both local chunks in its first chunk only (all
local queries x first half of the keys), and a shard from a later device is seen by the second
local chunk only (second half of the queries x all keys). The diagonal step is a plain causal
mask over the local 2-chunk sequence, because the two local chunks are in global order.
`zigzag_permute` / `zigzag_unpermute` reorder tokens into and out of this layout; a model
permutes its tokens (and position ids) once at the input, and everything but attention is
position-wise, so nothing else changes.

Packed documents: segment ids are sharded like the tokens (in the same layout), and the kv ids
travel the ring with their K/V shard, forward and backward, so every pair call gets the ids of
its exact rows and columns and masks by document like `flash_attention`. A row that sees no key
of its document in one pair gets lse = -inf there and is merged with weight 0. Padding lengths
count natural positions; each device folds them into its ids (as `flash_attention` does) from
the natural positions of its chunks, so no global array is ever built.

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
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, PartitionSpec

from pallas_flash import attention, stats, validation
from pallas_flash.config import FlashConfig
from pallas_flash.masking import fold_lengths, make_mask_spec
from pallas_flash.sinks import apply_sinks, check_sinks
from pallas_flash.sharding import (ID_OPTIONS, AxisNames, check_axes, check_divisible,
                                   check_heads, freeze_axes, partition_entry, place)
from pallas_flash.spec import AttentionSpec
from pallas_flash.triton import backward as triton_backward
from pallas_flash.triton import forward as triton_forward

__all__ = ["ring_attention", "ring_attention_local", "zigzag_permute", "zigzag_unpermute"]

_LAYOUTS = ("contiguous", "zigzag")

# The kernels, looked up by name at trace time (tests wrap them to count which chunk pairs run).
_kernel_forward = triton_forward.forward
_kernel_backward = triton_backward.backward


# ================================================================================================
# Zig-zag layout
# ================================================================================================


def _split_axis(x, axis: int, num_devices: int):
    """x with `axis` split into (2, num_devices, chunk): a first and a second half of P chunks."""
    axis = axis % x.ndim
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
# Ring attention: the static plan
# ================================================================================================


@dataclasses.dataclass(frozen=True)
class _Block:
    """One kernel call of a ring step: local query rows [rows) against K/V rows [cols)."""

    rows: tuple[int, int]
    cols: tuple[int, int]
    spec: AttentionSpec


@dataclasses.dataclass(frozen=True)
class _RingPlan:
    """Everything static about one ring: which block a device computes at each kind of step.

    diagonal: step 0 (the device's own K/V shard).
    early: a step whose K/V shard comes from an earlier device in the sequence.
    late: one from a later device; None when it is fully masked (skipped).
    layout: "contiguous" or "zigzag": which natural positions the local rows hold.
    """

    axis_name: str
    axis_size: int
    layout: str
    diagonal: _Block
    early: _Block
    late: _Block | None


def _make_plan(axis_name: str, axis_size: int, seq: int, *, causal: bool, layout: str,
               spec_of) -> _RingPlan:
    """spec_of(seq_q, seq_kv, causal) builds the AttentionSpec of one kernel call; seq is the
    local (per-device) sequence length."""
    whole = (0, seq)

    def block(rows, cols, masked=False):
        return _Block(rows, cols, spec_of(rows[1] - rows[0], cols[1] - cols[0], masked))

    diagonal = block(whole, whole, causal)
    if not causal:
        # Every pair is fully visible, whatever the layout.
        early = late = block(whole, whole)
    elif layout == "contiguous":
        early, late = block(whole, whole), None
    else:
        half = seq // 2
        early = block(whole, (0, half))   # an earlier device's first chunk precedes both ours
        late = block((half, seq), whole)  # both chunks of a later device precede our second
    return _RingPlan(axis_name, axis_size, layout, diagonal, early, late)


def _kernel_options(q, k, v, *, causal, scale, softcap, precision, config, interpret, ids):
    """Validated options, as a function (seq_q, seq_kv, causal) -> AttentionSpec.

    ids: the segment-id and length arguments by name (None where not given), checked against
    the shapes of q and k as `flash_attention` checks them.
    """
    opts = validation.validate(
        q, k, v, causal=causal, scale=scale, causal_alignment="top_left", window=None,
        softcap=softcap, **ids)
    precision, config, interpret = attention.kernel_options(
        q, precision=precision, config=config, interpret=interpret)
    # Lengths are folded into ids too (masking.fold_lengths), so either kind needs the ids path.
    has_segments = any(x is not None for x in ids.values())

    def spec_of(seq_q, seq_kv, masked):
        return AttentionSpec(mask=make_mask_spec(seq_q, seq_kv, causal=masked), scale=opts.scale,
                             softcap=opts.softcap, has_segments=has_segments,
                             precision=precision, config=config, interpret=interpret)

    return spec_of


def _given_ids(**ids):
    """The id arguments that were given, by name, in ID_OPTIONS order."""
    return {name: ids[name] for name in ID_OPTIONS if ids[name] is not None}


def _check_ring_shapes(q, k, layout: str, parts: int, where: str) -> None:
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"ring attention is self-attention: q and k need one sequence length, "
                         f"got q {tuple(q.shape)} and k {tuple(k.shape)}")
    chunks = parts * (2 if layout == "zigzag" else 1)
    if q.shape[1] % chunks:
        raise ValueError(f"the {where} sequence length ({q.shape[1]}) must be divisible by "
                         f"{chunks} for the {layout} layout")


# ================================================================================================
# Ring attention: the public functions
# ================================================================================================


def ring_attention(q, k, v, *, mesh: Mesh, axis_name: str, causal: bool = False,
                   layout: str = "contiguous", batch_axis: AxisNames = None,
                   head_axis: AxisNames = None, scale: float | None = None,
                   softcap: float | None = None, sinks=None, return_lse: bool = False,
                   q_segment_ids=None, kv_segment_ids=None, q_lengths=None, kv_lengths=None,
                   precision=None, config: FlashConfig | None = None,
                   interpret: bool | None = None):
    """Exact attention with the sequence split over the mesh axis `axis_name` (a ring).

    Args:
      q: [batch, seq, q_heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim] (global
        arrays; self-attention, so one seq). With layout="zigzag" the seq axis must already be
        in zig-zag order (`zigzag_permute`); the output then is too.
      mesh: the device mesh; axis_name: the mesh axis that splits the sequence (the ring).
      causal: causal self-attention (query i sees keys j <= i, in natural positions).
      layout: "contiguous" (device i holds the i-th of P equal chunks) or "zigzag" (2P chunks,
        device i holds chunks i and 2P-1-i: balanced causal work). seq must be divisible by P
        or 2P respectively.
      batch_axis, head_axis: optional mesh axes that also split the batch / the heads (data
        and head parallelism, as in `sharded_flash_attention`).
      q_segment_ids, kv_segment_ids: int [batch, seq], given together: packed documents, a
        query sees only keys with its id, as in `flash_attention`. They are laid out like q and
        k (already zig-zag permuted with layout="zigzag", by the same `zigzag_permute`) and
        sharded with them.
      q_lengths, kv_lengths: int [batch] valid lengths in natural positions (also with
        layout="zigzag": tokens at natural positions >= length are padding), as in
        `flash_attention`: padded rows give 0 output and 0 gradient.
      scale, softcap, return_lse, precision, config, interpret: as for `flash_attention`.
      sinks: float [q_heads] sink logits, as for `flash_attention`: applied to the merged
        (O, lse) of the whole ring, so no shard pair needs to know of them.

    Returns:
      out [batch, seq, q_heads, head_dim] in q's dtype, or (out, lse) with return_lse (lse
      [batch, q_heads, seq], float32). Both are differentiable.
    """
    if not isinstance(axis_name, str):
        raise ValueError(f"axis_name must be one mesh axis name, got {axis_name!r}")
    check_axes(mesh, axis_name=axis_name, batch_axis=batch_axis, head_axis=head_axis)
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse must be a bool, got {return_lse!r}")
    parts = mesh.shape[axis_name]
    ids = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_lengths=q_lengths,
               kv_lengths=kv_lengths)
    spec_of = _kernel_options(q, k, v, causal=causal, scale=scale, softcap=softcap,
                              precision=precision, config=config, interpret=interpret, ids=ids)
    _check_ring_shapes(q, k, layout, parts, "global")
    check_divisible("the batch size", q.shape[0], mesh, batch_axis, "batch_axis")
    check_heads(q, k, mesh, head_axis)
    plan = _make_plan(axis_name, parts, q.shape[1] // parts, causal=bool(causal), layout=layout,
                      spec_of=spec_of)
    ids = _given_ids(**ids)
    fn = _sharded_ring_fn(mesh, plan, freeze_axes(batch_axis), freeze_axes(head_axis), tuple(ids))
    out, lse = fn(q, k, v, *ids.values())
    if sinks is not None:
        out, lse = apply_sinks(out, lse, check_sinks(sinks, q.shape[2]))
    return (out, lse) if return_lse else out


def ring_attention_local(q, k, v, *, axis_name: str, causal: bool = False,
                         layout: str = "contiguous", scale: float | None = None,
                         softcap: float | None = None, sinks=None, return_lse: bool = False,
                         q_segment_ids=None, kv_segment_ids=None, q_lengths=None,
                         kv_lengths=None, precision=None, config: FlashConfig | None = None,
                         interpret: bool | None = None):
    """The per-device ring, for use inside `jax.shard_map(..., check_vma=False)`.

    q, k, v are this device's shards [batch, seq / P, heads, head_dim] of a sequence split over
    the manual mesh axis `axis_name`, in the given layout (for "zigzag": this device's chunk i
    followed by its chunk 2P-1-i). q_segment_ids and kv_segment_ids are this device's shards
    [batch, seq / P] of the ids, split like q and k; q_lengths and kv_lengths are not split
    along the sequence: [batch] lengths in natural positions of the whole sequence. Other
    arguments and the result are as in `ring_attention`, per device.
    """
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse must be a bool, got {return_lse!r}")
    ids = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_lengths=q_lengths,
               kv_lengths=kv_lengths)
    spec_of = _kernel_options(q, k, v, causal=causal, scale=scale, softcap=softcap,
                              precision=precision, config=config, interpret=interpret, ids=ids)
    _check_ring_shapes(q, k, layout, 1, "local")
    plan = _make_plan(axis_name, lax.axis_size(axis_name), q.shape[1], causal=bool(causal),
                      layout=layout, spec_of=spec_of)
    ids = _given_ids(**ids)
    out, lse = _ring_per_device(plan, tuple(ids), q, k, v, *ids.values())
    if sinks is not None:  # this device's heads: [local q_heads]
        out, lse = apply_sinks(out, lse, check_sinks(sinks, q.shape[2]))
    return (out, lse) if return_lse else out


@functools.lru_cache(maxsize=None)
def _sharded_ring_fn(mesh, plan: _RingPlan, batch_axis, head_axis, id_names=()):
    b, h = partition_entry(batch_axis), partition_entry(head_axis)
    tokens = PartitionSpec(b, plan.axis_name, h, None)
    rows = PartitionSpec(b, h, plan.axis_name)
    # Segment ids are split along the sequence like the tokens; lengths only over the batch.
    id_specs = tuple(PartitionSpec(b, plan.axis_name) if name.endswith("segment_ids")
                     else PartitionSpec(b) for name in id_names)
    in_specs = (tokens,) * 3 + id_specs
    mapped = jax.shard_map(functools.partial(_ring_per_device, plan, id_names), mesh=mesh,
                           in_specs=in_specs, out_specs=(tokens, rows), check_vma=False)

    def run(*args):
        return mapped(*(place(mesh, x, s) for x, s in zip(args, in_specs)))

    return jax.jit(run)


def _ring_per_device(plan: _RingPlan, id_names, q, k, v, *ids):
    """The ring on one device: folds the id arguments (named by id_names) into kernel ids, then
    runs the custom_vjp ring."""
    q_ids = kv_ids = None
    if id_names:
        q_ids, kv_ids = _local_ids(plan, q.shape[0], q.shape[1], **dict(zip(id_names, ids)))
    return _ring_vjp(plan)(q, k, v, q_ids, kv_ids)


def _local_ids(plan: _RingPlan, batch: int, seq: int, q_segment_ids=None, kv_segment_ids=None,
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
        parts.append(fold_lengths(_rows(q_segment_ids, span, 1), _rows(kv_segment_ids, span, 1),
                                  shift(q_lengths, start), shift(kv_lengths, start), batch=batch,
                                  seq_q=n, seq_kv=n))
    return tuple(jnp.concatenate(chunks, axis=1) for chunks in zip(*parts))


@functools.lru_cache(maxsize=None)
def _ring_vjp(plan: _RingPlan):
    """The per-device ring as a custom_vjp function (q, k, v, q_ids, kv_ids) -> (out, lse); the
    int32 ids (None without segments) get no cotangent."""

    @jax.custom_vjp
    def ring(q, k, v, q_ids, kv_ids):
        return _ring_forward(plan, q, k, v, q_ids, kv_ids)

    def ring_fwd(q, k, v, q_ids, kv_ids):
        out, lse = _ring_forward(plan, q, k, v, q_ids, kv_ids)
        # Same names as flash_attention, so one remat policy covers both.
        out = checkpoint_name(out, attention.OUT_NAME)
        lse = checkpoint_name(lse, attention.LSE_NAME)
        return (out, lse), (q, k, v, out, lse, q_ids, kv_ids)

    def ring_bwd(residuals, cotangents):
        return (*_ring_backward(plan, *residuals, *cotangents), None, None)

    ring.defvjp(ring_fwd, ring_bwd)
    return ring


# ================================================================================================
# Ring attention: the loop, forward and backward
# ================================================================================================


def _rotate(plan: _RingPlan, tree):
    """Sends every array of tree to the next device of the ring (device i -> i + 1)."""
    if plan.axis_size == 1:
        return tree
    perm = [(i, (i + 1) % plan.axis_size) for i in range(plan.axis_size)]
    return jax.tree.map(lambda x: lax.ppermute(x, plan.axis_name, perm), tree)


def _ring_loop(plan: _RingPlan, kv, state, visit, after=None):
    """Runs state = after(visit(block, kv_t, state)) for t = 0 .. P-1, where kv_t is the K/V of
    device (i - t) mod P, and returns the final state.

    Each step first sends its K/V shard on and then computes with it, so the transfer can
    overlap the kernel. Step 0 is the diagonal; steps 1 .. P-1 share one traced loop body (the
    program, and its compile time, do not grow with P) that picks early or late by where the
    K/V came from: an earlier device exactly when t <= i. The price of one body is one spare
    send: the last step's K/V goes home unused, P sends instead of P - 1, overlapped with the
    last step like the others. (Peeling the last step off the loop saves that send but traces,
    and compiles, every off-diagonal kernel twice.) `after` runs outside the lax.cond, so its
    collectives are never inside one branch of a conditional.
    """
    me = lax.axis_index(plan.axis_name)
    after = after or (lambda s: s)

    def off_diagonal(t, kv, state):
        def run(block):
            return (lambda s: visit(block, kv, s)) if block is not None else (lambda s: s)

        if plan.early == plan.late:
            return after(run(plan.early)(state))
        # The skipped (fully masked) or other-shaped block is another branch: never computed.
        return after(lax.cond(t <= me, run(plan.early), run(plan.late), state))

    def step(t, carry):
        kv, state = carry
        return _rotate(plan, kv), off_diagonal(t, kv, state)

    following = _rotate(plan, kv)
    state = after(visit(plan.diagonal, kv, state))
    if plan.axis_size > 1:
        _, state = lax.fori_loop(1, plan.axis_size, step, (following, state))
    return state


def _rows(x, span, axis: int):
    """Static slice [span) of x along axis (None stays None: absent segment ids)."""
    return None if x is None else lax.slice_in_dim(x, span[0], span[1], axis=axis)


def _merge(out_a, lse_a, out_b, lse_b):
    """Exact combination of two partial softmax results over disjoint key sets.

    out_*: [batch, seq, heads, dim] (float32), lse_*: [batch, heads, seq]. A row that saw no key
    in either part keeps lse = -inf and out = 0: its weights are computed against 0 instead of
    -inf, so exp() gives exactly 0, never NaN.
    """
    lse = jnp.logaddexp(lse_a, lse_b)
    anchor = jnp.where(jnp.isfinite(lse), lse, 0.0)

    def weight(part_lse):
        return jnp.exp(part_lse - anchor).transpose(0, 2, 1)[..., None]

    return weight(lse_a) * out_a + weight(lse_b) * out_b, lse


def _ring_forward(plan: _RingPlan, q, k, v, q_ids=None, kv_ids=None):
    acc_dtype = jnp.float64 if q.dtype == jnp.float64 else jnp.float32

    def visit(block, kv, acc):
        out_acc, lse_acc = acc
        k_t, v_t, kv_ids_t = (_rows(x, block.cols, 1) for x in kv)
        # With segment ids, a row whose document has no key in this pair gets lse = -inf here,
        # and _merge gives it weight 0.
        out, row_stats = _kernel_forward(block.spec, _rows(q, block.rows, 1), k_t, v_t,
                                         _rows(q_ids, block.rows, 1), kv_ids_t)
        lse = stats.to_lse(block.spec, row_stats)
        out, lse = _merge(_rows(out_acc, block.rows, 1), _rows(lse_acc, block.rows, 2),
                          out.astype(acc_dtype), lse.astype(acc_dtype))
        start = block.rows[0]
        return (lax.dynamic_update_slice_in_dim(out_acc, out, start, axis=1),
                lax.dynamic_update_slice_in_dim(lse_acc, lse, start, axis=2))

    batch, seq, heads, _ = q.shape
    empty = (jnp.zeros(q.shape, acc_dtype), jnp.full((batch, heads, seq), -jnp.inf, acc_dtype))
    # The kv ids travel the ring with their K/V shard (None, without segments, is no array).
    out, lse = _ring_loop(plan, (k, v, kv_ids), empty, visit)
    return out.astype(q.dtype), lse


def _ring_backward(plan: _RingPlan, q, k, v, out, lse, q_ids, kv_ids, d_out, d_lse):
    acc_dtype = jnp.float64 if q.dtype == jnp.float64 else jnp.float32

    def visit(block, kv, grads):
        d_q, d_k, d_v = grads
        k_t, v_t, kv_ids_t = (_rows(x, block.cols, 1) for x in kv)
        rows = lambda x, axis=1: _rows(x, block.rows, axis)  # noqa: E731
        # The global out and lse make these the pair's exact share of the gradients.
        dq_part, dk_part, dv_part = _kernel_backward(
            block.spec, rows(q), k_t, v_t, rows(out), stats.from_lse(rows(lse, 2)), rows(d_out),
            rows(d_lse, 2), rows(q_ids), kv_ids_t)

        def add(acc, part, span):
            total = _rows(acc, span, 1) + part.astype(acc_dtype)
            return lax.dynamic_update_slice_in_dim(acc, total, span[0], axis=1)

        return add(d_q, dq_part, block.rows), add(d_k, dk_part, block.cols), add(d_v, dv_part,
                                                                                  block.cols)

    def pass_on(grads):
        # dK/dV follow their K/V shard; after the last step this hop brings them home.
        d_q, d_k, d_v = grads
        return (d_q, *_rotate(plan, (d_k, d_v)))

    zeros = lambda x: jnp.zeros(x.shape, acc_dtype)  # noqa: E731
    d_q, d_k, d_v = _ring_loop(plan, (k, v, kv_ids), (zeros(q), zeros(k), zeros(v)), visit,
                               pass_on)
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype)
