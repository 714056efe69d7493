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
flag by XLA, and a loop of zero or one trips around the Triton kernel after the Mosaic one (both
are compiled; with finite inputs only the Mosaic kernel runs; under jax.vmap one flag covers the
whole vmapped batch; `_checked` says why not a `lax.cond`). The benchmark
shows it as the gap between its `pallas_flash` (auto) and `pallas_flash_mosaic` (forced,
unchecked) rows. ``backend="mosaic"`` skips the check.
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
    """A function of *args that returns fast(*args) if check(*args) else safe(*args), also under
    jax.vmap.

    The fast kernel runs unconditionally at the top level of the program; the safe one runs in a
    `lax.while_loop` of zero or one trips that overwrites the fast result. Why not `lax.cond`:
    a kernel inside a cond branch launched slower (a forward launched in clusters of two cost
    ~0.17 ms more a call there, NOTES.md run 47), and a cond whose one branch passes the fast
    result through copies it into the cond's own output buffer (one extra pass over O, or over
    dq, dk, dv), where a while loop's carry takes the fast result's buffer in place. A
    non-finite input (never a healthy training step) pays for both kernels.

    Under vmap the rule takes one flag for the whole vmapped batch: a per-example flag would
    make the loop's predicate batched, and vmap would run the safe kernel on the whole batch
    every time. One non-finite example sends the batch to the safe kernels, which are right
    for every example.
    """

    def run_checked(check_fn, fast_fn, safe_fn, args):
        result = fast_fn(*args)

        def redo(carry):
            return jnp.bool_(False), safe_fn(*args)

        return lax.while_loop(lambda carry: carry[0], redo,
                              (jnp.logical_not(check_fn(*args)), result))[1]

    @custom_batching.custom_vmap
    def run(*args):
        return run_checked(check, fast, safe, args)

    @run.def_vmap
    def _batched(axis_size, in_batched, *args):
        del axis_size
        in_axes = tuple(jax.tree.map(lambda b: 0 if b else None, in_batched))
        out = run_checked(check, jax.vmap(fast, in_axes=in_axes),
                          jax.vmap(safe, in_axes=in_axes), args)
        return out, jax.tree.map(lambda _: True, out)

    return run


def forward(spec: AttentionSpec, q, k, v, q_ids=None, kv_ids=None):
    """(O, RowStats): the Mosaic forward when V is finite, else the Triton forward.

    The Mosaic forward takes its default tiles for the spec (clusters of two where they pay,
    `mosaic.forward.default_forward_config`): outside any branch they launch as fast as
    unguarded (`_checked`).
    """
    return _checked(lambda q, k, v, *_: all_finite(v),
                    lambda *a: mosaic_forward.forward(spec, *a),
                    lambda *a: triton_forward.forward(spec, *a))(q, k, v, q_ids, kv_ids)


def backward(spec: AttentionSpec, q, k, v, out, stats, do, dlse, q_ids=None, kv_ids=None):
    """(dq, dk, dv): the Mosaic backward when q, k, v and dO are finite, else the Triton one.

    A non-finite O or row statistic follows from a non-finite q, k or v (O is a convex combination
    of v), so those are not checked separately; dlse enters one row's D and stays in that row.
    """
    return _checked(lambda q, k, v, out, stats, do, *_: all_finite(q, k, v, do),
                    lambda *a: mosaic_backward.backward(spec, *a),
                    lambda *a: triton_backward.backward(spec, *a))(
                        q, k, v, out, stats, do, dlse, q_ids, kv_ids)
