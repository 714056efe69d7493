"""The Mosaic GPU kernels behind a finiteness check, with the Triton kernels as the fallback.

This is what ``backend="auto"`` runs on an sm_90 GPU. It has the forward / backward contract of
the kernel modules (`triton.forward.forward`, `triton.backward.backward`), so attention.py treats
it as one more backend.

Why a check: the Triton kernels confine a NaN or inf input to exactly the rows (and gradient
rows) that depend on it, also when it sits at a position a row does not see (a future key, a
padded key, another document): they zero non-finite operands on masked tiles and mark the rows
that really see them (issue 7's contract). The Mosaic kernels are built for speed and skip that
work: their products run on the tensor cores straight from shared memory, where a masked-out
entry still meets its operand as 0 * inf = NaN. In the forward pass only V can leak that way (a
non-finite q or k entry lands in S, which every mask overwrites); in the backward pass any of q,
k, v and dO can. So when those operands are all finite, which is every healthy training step,
the Mosaic kernels run; otherwise the Triton kernels do, and give the exact per-row NaNs.

Cost: one read of V in the forward pass and of q, k, v, dO in the backward pass, reduced to one
flag by XLA. The forward then launches both kernels, the Triton one predicated on the flag (its
programs return at once when V is finite: `forward`); the backward takes a `lax.cond` between
two compiled kernels (one runs). Under jax.vmap one flag covers the whole vmapped batch. The
benchmark shows it as the gap between its `pallas_flash` (auto) and `pallas_flash_mosaic`
(forced, unchecked) rows. ``backend="mosaic"`` skips the check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import custom_batching, lax

from pallas_flash.mosaic import backward as mosaic_backward
from pallas_flash.mosaic import forward as mosaic_forward
from pallas_flash.spec import AttentionSpec
from pallas_flash.triton import backward as triton_backward
from pallas_flash.triton import forward as triton_forward

__all__ = ["all_finite", "backward", "forward"]


def all_finite(*arrays) -> jnp.ndarray:
    """One boolean scalar: every entry of every array is finite."""
    flags = [jnp.isfinite(x).all() for x in arrays]
    return flags[0] if len(flags) == 1 else jnp.stack(flags).all()


def _checked(check, fast, safe):
    """A function of *args that runs fast(*args) if check(*args) else safe(*args): one branch
    only, also under jax.vmap.

    Why a cond before the kernels: the alternative, the Mosaic kernel always and the Triton one in
    a loop of zero or one trips after it (no kernel inside a branch, and no copy of the result),
    ran 0.06-0.07 ms slower a forward call on the H200 (NOTES.md run 52: the loop's predicate is
    read on the host only after the Mosaic kernel ends, where the cond's is read after the short
    check) and no faster in an 8-layer training step (run 48).

    Plain `lax.cond` under vmap gets a per-example flag and becomes a select that runs both
    kernels on the whole batch. The vmap rule instead takes one flag for the whole vmapped batch
    and vmaps the chosen kernel: one non-finite example sends the batch to the safe kernels,
    which are right for every example.
    """

    @custom_batching.custom_vmap
    def run(*args):
        return lax.cond(check(*args), fast, safe, *args)

    @run.def_vmap
    def _batched(axis_size, in_batched, *args):
        del axis_size
        in_axes = tuple(jax.tree.map(lambda b: 0 if b else None, in_batched))
        out = lax.cond(check(*args), jax.vmap(fast, in_axes=in_axes),
                       jax.vmap(safe, in_axes=in_axes), *args)
        return out, jax.tree.map(lambda _: True, out)

    return run


def forward(spec: AttentionSpec, q, k, v, q_ids=None, kv_ids=None):
    """(O, RowStats): the Mosaic forward's when V is finite, else the Triton forward's.

    No branch: the Mosaic forward runs, then the Triton forward is launched predicated on the
    flag (`triton.forward`'s skip / into): with a finite V its programs return at once and its
    outputs, aliased to the Mosaic kernel's, keep them. A branch would cost a host round trip
    for its predicate (0.03-0.09 ms a call on the H200, NOTES.md run 52) and made a clustered
    launch slower still (run 47); here the Mosaic forward runs outside any branch with its own
    default tiles, clusters included. A non-finite V pays for both kernels.
    Under vmap one flag covers the whole vmapped batch (as `_checked`'s).
    """
    def fast(q, k, v, q_ids, kv_ids):
        return mosaic_forward.forward(spec, q, k, v, q_ids, kv_ids)

    def safe(skip, into, q, k, v, q_ids, kv_ids):
        return triton_forward.forward(spec, q, k, v, q_ids, kv_ids, skip=skip, into=into)

    @custom_batching.custom_vmap
    def run(q, k, v, q_ids, kv_ids):
        args = (q, k, v, q_ids, kv_ids)
        return safe(all_finite(v), fast(*args), *args)

    @run.def_vmap
    def _batched(axis_size, in_batched, q, k, v, q_ids, kv_ids):
        del axis_size
        in_axes = tuple(jax.tree.map(lambda b: 0 if b else None, in_batched))
        args = (q, k, v, q_ids, kv_ids)
        into = jax.vmap(fast, in_axes=in_axes)(*args)
        out = jax.vmap(safe, in_axes=(None, 0) + in_axes)(all_finite(v), into, *args)
        return out, jax.tree.map(lambda _: True, out)

    return run(q, k, v, q_ids, kv_ids)


def backward(spec: AttentionSpec, q, k, v, out, stats, do, dlse, q_ids=None, kv_ids=None):
    """(dq, dk, dv): the Mosaic backward when q, k, v and dO are finite, else the Triton one.

    A non-finite O or row statistic follows from a non-finite q, k or v (O is a convex combination
    of v), so those are not checked separately; dlse enters one row's D and stays in that row.
    """
    return _checked(lambda q, k, v, out, stats, do, *_: all_finite(q, k, v, do),
                    lambda *a: mosaic_backward.backward(spec, *a),
                    lambda *a: triton_backward.backward(spec, *a))(
                        q, k, v, out, stats, do, dlse, q_ids, kv_ids)
