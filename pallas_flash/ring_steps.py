"""The per-device forward and backward passes of context-parallel attention, both strategies.

A `ring_plan.Plan` lists the steps; this module runs them. Step t gives device i the K/V shard
of device (i - t) mod P:

* ring: the shard travels. The send that brings the next step's shard is issued before the
  current step's kernels and only consumed by the next step, so the transfer can run under
  them; at any time a device holds its own shard, the one in use and at most one in flight.
* allgather: one `all_gather` of K/V (and their segment ids) before the first step; each step
  slices its shard out of it. The gathered K/V are the backward's residuals.

Forward: each call's (O, lse) is merged into the rows' running result exactly through the lse,

    lse = logaddexp(lse_acc, lse_t),   O = exp(lse_acc - lse) O_acc + exp(lse_t - lse) O_t,

in float32 (a row with no key yet has lse = -inf and weight 0, never NaN).

Backward: given the global O and lse of its rows, the backward kernel returns one pair's exact
share of dQ, dK and dV (P = exp(S - lse) with the global lse; D = rowsum(dO * O) - dlse with the
global O, so the lse cotangent reaches every pair). dQ stays home, summed in float32 and kept
in the input dtype: no float32 dQ lives beside the one a Mosaic kernel keeps. The pair's dK, dV
come out of the kernel in the input dtype and go straight to their owner:

* ring: a `ppermute` by -t, issued after the step's kernels and added by the owner after the
  next step's kernels (so it too can overlap); the owner sums in float32, locally, in step
  order, and rounds once at the end (with two steps, P = 2, the one sum is kept in the input
  dtype: a single float32 add rounds the same);
* allgather: written into the gathered-size dK/dV, then one `psum_scatter` (reduce-scatter)
  sums them over the devices and hands each its shard.

Both are deterministic: every sum has a fixed order. Steps are unrolled in Python: their masks
are static and differ by step under a window. Each distinct kernel call is one jitted function,
so a call repeated at several steps is traced and lowered once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from pallas_flash import attention, stats
from pallas_flash.ring_plan import Call, Plan, Step

__all__ = ["attention_vjp"]


# The kernels, looked up by name when a call is traced (tests wrap them to count the calls that
# run on each device).
def _kernel_forward(spec, q, k, v, q_ids, kv_ids, *, backend):
    return attention._FORWARDS[backend].forward(spec, q, k, v, q_ids, kv_ids)


def _kernel_backward(spec, q, k, v, out, row_stats, d_out, d_lse, q_ids, kv_ids, *, backend):
    return attention._BACKWARDS[backend].backward(spec, q, k, v, out, row_stats, d_out, d_lse,
                                                  q_ids, kv_ids)


@functools.lru_cache(maxsize=None)
def _jitted(kernel, spec, backend):
    # The barrier keeps XLA from duplicating a forward kernel into a fusion (attention.py).
    return jax.jit(lambda *args: lax.optimization_barrier(kernel(spec, *args, backend=backend)))


def _forward_call(call: Call, *args):
    return _jitted(_kernel_forward, call.spec, call.forward)(*args)


def _backward_call(call: Call, *args):
    return _jitted(_kernel_backward, call.spec, call.backward)(*args)


# ================================================================================================
# Helpers
# ================================================================================================


def _acc_dtype(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _span(x, span, axis: int = 1):
    """Static slice [span) along axis (None stays None: absent ids)."""
    return None if x is None else lax.slice_in_dim(x, span[0], span[1], axis=axis)


def _add(acc, part, span, length: int, axis: int = 1):
    """acc (`length` rows along axis) with part added to its rows [span): the sum in float32
    (or float64), stored in the part's dtype. acc None stands for zeros, so a part that covers
    all rows becomes acc unchanged."""
    if acc is None:
        if span == (0, length):
            return part
        acc = jnp.zeros((*part.shape[:axis], length, *part.shape[axis + 1:]), part.dtype)
    wide = _acc_dtype(part.dtype)
    total = _span(acc, span, axis).astype(wide) + part.astype(wide)
    return lax.dynamic_update_slice_in_dim(acc, total.astype(acc.dtype), span[0], axis=axis)


def _shift(plan: Plan, tree, shift: int):
    """Every array of tree moved `shift` places along the ring (device i -> i + shift)."""
    shift %= plan.axis_size
    if not shift:
        return tree
    perm = [(i, (i + shift) % plan.axis_size) for i in range(plan.axis_size)]
    return jax.tree.map(lambda x: lax.ppermute(x, plan.axis_name, perm), tree)


def _run_step(plan: Plan, step: Step, kind_fn, state, zeros):
    """kind_fn(calls, state) for this device's kind. One kind: called directly (state may be
    None); several: a lax.switch on the device's kind, so only its own calls run."""
    if len(step.kinds) == 1:
        return kind_fn(step.kinds[0], state)
    state = zeros() if state is None else state
    index = jnp.asarray(step.table, jnp.int32)[lax.axis_index(plan.axis_name)]
    return lax.switch(index, [functools.partial(kind_fn, calls) for calls in step.kinds], state)


def _source_start(plan: Plan, step: Step):
    """Where the shard this device holds at `step` starts in the all-gathered arrays."""
    me = lax.axis_index(plan.axis_name)
    return lax.rem(me - step.shift + plan.axis_size, plan.axis_size) * plan.seq


def _sources(plan: Plan, kv, gathered):
    """(step, K/V of that step) for every step, the ring's sends issued before each step's
    kernels: the generator hands out step n's shard only after issuing step n + 1's send."""
    steps = plan.steps
    for n, step in enumerate(steps):
        if gathered is not None:
            start = _source_start(plan, step)
            yield step, jax.tree.map(
                lambda x: lax.dynamic_slice_in_dim(x, start, plan.seq, axis=1), gathered)
        else:
            current = kv
            if n + 1 < len(steps):
                kv = _shift(plan, kv, steps[n + 1].shift - step.shift)
            yield step, current


def _gather(plan: Plan, tree):
    return jax.tree.map(lambda x: lax.all_gather(x, plan.axis_name, axis=1, tiled=True), tree)


# ================================================================================================
# Forward
# ================================================================================================


def _forward(plan: Plan, q, kv, q_ids, gathered=None):
    """(out, lse) of the local rows; kv = (k, v, kv_ids) of this device, or `gathered`, the
    all-gathered ones."""
    acc = _acc_dtype(q.dtype)
    batch, seq, heads, _ = q.shape

    v_dim = (kv if gathered is None else gathered)[1].shape[-1]

    def zeros():
        return (jnp.zeros((batch, seq, heads, v_dim), acc),
                jnp.full((batch, heads, seq), -jnp.inf, acc))

    def visit(kv_t, calls, state):
        k_t, v_t, ids_t = kv_t
        for call in calls:
            out, row_stats = _forward_call(call, _span(q, call.rows), _span(k_t, call.cols),
                                           _span(v_t, call.cols), _span(q_ids, call.rows),
                                           _span(ids_t, call.cols))
            out, lse = out.astype(acc), stats.to_lse(call.spec, row_stats).astype(acc)
            if state is None and call.rows == (0, seq):
                state = (out, lse)
                continue
            out_acc, lse_acc = zeros() if state is None else state
            out, lse = _merge(_span(out_acc, call.rows), _span(lse_acc, call.rows, 2), out, lse)
            state = (lax.dynamic_update_slice_in_dim(out_acc, out, call.rows[0], axis=1),
                     lax.dynamic_update_slice_in_dim(lse_acc, lse, call.rows[0], axis=2))
        return state

    state = None
    for step, kv_t in _sources(plan, kv, gathered):
        state = _run_step(plan, step, functools.partial(visit, kv_t), state, zeros)
    out, lse = zeros() if state is None else state
    return out.astype(q.dtype), lse


def _merge(out_a, lse_a, out_b, lse_b):
    """Exact combination of two partial softmax results over disjoint key sets.

    out_*: [batch, seq, heads, dim], lse_*: [batch, heads, seq]. A row that saw no key in either
    part keeps lse = -inf and out = 0: its weights are taken against 0 instead of -inf, so
    exp() gives exactly 0, never NaN.
    """
    lse = jnp.logaddexp(lse_a, lse_b)
    anchor = jnp.where(jnp.isfinite(lse), lse, 0.0)

    def weight(part_lse):
        return jnp.exp(part_lse - anchor).transpose(0, 2, 1)[..., None]

    return weight(lse_a) * out_a + weight(lse_b) * out_b, lse


# ================================================================================================
# Backward
# ================================================================================================


def _backward(plan: Plan, q, kv, out, lse, q_ids, d_out, d_lse, gathered=None):
    """(dq, dk, dv) of the local shards."""
    row_stats = stats.from_lse(lse)
    k, v = kv[:2] if gathered is None else gathered[:2]

    def zeros():
        return jnp.zeros(q.shape, q.dtype)

    def visit(kv_t, calls, d_q):
        k_t, v_t, ids_t = kv_t
        d_k = d_v = None
        for call in calls:
            rows = functools.partial(_span, span=call.rows)
            dq_part, dk_part, dv_part = _backward_call(
                call, rows(q), _span(k_t, call.cols), _span(v_t, call.cols), rows(out),
                stats.RowStats(*(rows(x, axis=2) for x in row_stats)), rows(d_out),
                rows(d_lse, axis=2), rows(q_ids), _span(ids_t, call.cols))
            d_q = _add(d_q, dq_part, call.rows, plan.seq)
            d_k = _add(d_k, dk_part, call.cols, plan.seq)
            d_v = _add(d_v, dv_part, call.cols, plan.seq)
        if d_k is None:  # a skipped pair: nothing to send but the shape's zeros
            d_k, d_v = (jnp.zeros((x.shape[0], plan.seq, *x.shape[2:]), x.dtype) for x in (k, v))
        return d_q, (d_k, d_v)

    d_q = None
    home = pending = None           # ring: float32 sums of this device's dK/dV; a part on its way
    gathered_grads = None           # allgather: the dK/dV of every shard, before the reduction
    for step, kv_t in _sources(plan, kv, gathered):
        d_q, parts = _run_step(plan, step, functools.partial(visit, kv_t), d_q, zeros)
        if gathered is not None:
            if gathered_grads is None:
                gathered_grads = tuple(jnp.zeros(x.shape, x.dtype) for x in gathered[:2])
            start = _source_start(plan, step)
            gathered_grads = tuple(lax.dynamic_update_slice_in_dim(g, p, start, axis=1)
                                   for g, p in zip(gathered_grads, parts))
        elif step.shift == 0:
            # With at most one part to come, one float32 add at the end rounds once, as a
            # float32 sum would: the sum is kept in the input dtype, at half the memory.
            home = parts if len(plan.steps) <= 2 else tuple(
                p.astype(_acc_dtype(p.dtype)) for p in parts)
        else:
            if pending is not None:
                home = _add_home(home, pending)
            pending = _shift(plan, parts, -step.shift)
    if gathered is not None:
        d_k, d_v = (lax.psum_scatter(g, plan.axis_name, scatter_dimension=1, tiled=True)
                    for g in gathered_grads)
    else:
        if pending is not None:
            home = _add_home(home, pending)
        d_k, d_v = (h.astype(k.dtype) for h in home)
    d_q = zeros() if d_q is None else d_q
    return d_q, d_k, d_v


def _add_home(home, parts):
    """The owner's sums of dK, dV plus a part that came home: added in float32 (or float64)."""
    return tuple((h.astype(_acc_dtype(h.dtype)) + p.astype(_acc_dtype(h.dtype))).astype(h.dtype)
                 for h, p in zip(home, parts))


# ================================================================================================
# The custom_vjp
# ================================================================================================


@functools.lru_cache(maxsize=None)
def attention_vjp(plan: Plan):
    """The per-device attention as a custom_vjp function (q, k, v, q_ids, kv_ids) -> (out, lse)
    of the local shards; the int32 ids (None without segments) get no cotangent. The forward
    saves q, k, v (the gathered ones for "allgather"), O, lse and the ids, as
    `flash_attention` does."""
    gather = plan.strategy == "allgather"

    def forward(q, k, v, q_ids, kv_ids):
        kv = (k, v, kv_ids)
        gathered = _gather(plan, kv) if gather else None
        out, lse = _forward(plan, q, kv, q_ids, gathered)
        return out, lse, (gathered if gather else kv)

    @jax.custom_vjp
    def run(q, k, v, q_ids, kv_ids):
        return forward(q, k, v, q_ids, kv_ids)[:2]

    def run_fwd(q, k, v, q_ids, kv_ids):
        out, lse, kv = forward(q, k, v, q_ids, kv_ids)
        # Same names as flash_attention, so one remat policy covers both.
        out = checkpoint_name(out, attention.OUT_NAME)
        lse = checkpoint_name(lse, attention.LSE_NAME)
        return (out, lse), (q, kv, out, lse, q_ids)

    def run_bwd(residuals, cotangents):
        q, kv, out, lse, q_ids = residuals
        d_out, d_lse = cotangents
        if gather:
            grads = _backward(plan, q, None, out, lse, q_ids, d_out, d_lse, gathered=kv)
        else:
            grads = _backward(plan, q, kv, out, lse, q_ids, d_out, d_lse)
        return (*grads, None, None)

    run.defvjp(run_fwd, run_bwd)
    return run
