"""The Mosaic GPU kernels behind a finiteness check, with the Triton kernels as the fallback.

This is what ``backend="auto"`` runs on an sm_90 GPU. It has the forward / backward contract of
the kernel modules (`triton.forward.forward`, `triton.backward.backward`), so attention.py treats
it as one more backend.

Why a check: the Triton kernels confine a NaN or inf input to exactly the rows (and gradient
rows) that depend on it, also when it sits at a position a row does not see (a future key, a
padded key, another document): they zero non-finite operands on masked tiles and mark the rows
that really see them. The Mosaic kernels are built for speed and skip that
work: their products run on the tensor cores straight from shared memory, where a masked-out
entry still meets its operand as 0 * inf = NaN. In the forward pass only V can leak that way (a
non-finite q or k entry lands in S, which every mask overwrites); in the backward pass any of q,
k, v and dO can. So when the Mosaic result cannot have been touched by a non-finite value,
which is every healthy training step, it stands; otherwise the Triton kernels redo the call
and give the exact per-row NaNs.

The forward checks the Mosaic forward's own result: a leak ends in O, and the kernel marks
every row whose O holds an inf or NaN with r = NaN (mosaic/forward.py), so the check reads r,
one float a row, instead of V (head_dim times as many values, and V's read is a pass of its
own). A row with a non-finite q or k gets r = NaN too and also sends the call to Triton, which
gives the same NaNs; no healthy row has r = NaN (r is log2 of a positive sum, or -inf for a
row that sees no key). The backward does the same: the Mosaic backward kernels mark every key
whose dK or dV holds an inf or NaN and (two-kernel path) every query whose dQ does, or (fused
kernel) every key whose K row does, which every non-finite operand the kernels read reaches,
hidden or not (mosaic/backward.py, `backward_checked`); the check reads those marks, one float
a row, instead of q, k, v and dO.

Both kernels are launched, the Triton one predicated on the flag (triton.common.predicated):
when the check passes its programs return at once, and its outputs, aliased to the Mosaic
kernels', keep theirs. No branch, so no host round trip for a predicate, and the Mosaic
kernels launch at the top level of the program (a `lax.cond` between the two costs more,
docs/tuning.md). A failed check pays for both kernels. Under jax.vmap one flag covers the
whole vmapped batch. The benchmark shows the cost as the gap between its `pallas_flash`
(auto) and `pallas_flash_mosaic` (forced, unchecked) rows. ``backend="mosaic"`` skips the
check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import custom_batching

from pallas_flash.mosaic import backward as mosaic_backward
from pallas_flash.mosaic import forward as mosaic_forward
from pallas_flash.spec import AttentionSpec
from pallas_flash.stats import output_dot
from pallas_flash.triton import backward as triton_backward
from pallas_flash.triton import forward as triton_forward

__all__ = ["backward", "forward"]


def _predicated(check, fast, safe):
    """A function of *args: into = fast(*args), then safe(skip=check(into, *args), into,
    *args), which keeps fast's result when the check passes.

    Under vmap the rule takes one flag for the whole vmapped batch: a per-example flag would
    batch the predicated kernel's flag, which Pallas's batching would fold into a grid axis
    of its own. One non-finite example sends the whole batch to the safe kernels, which are
    right for every example.
    """

    @custom_batching.custom_vmap
    def run(*args):
        into = fast(*args)
        return safe(check(into, *args), into, *args)

    @run.def_vmap
    def _batched(axis_size, in_batched, *args):
        del axis_size
        in_axes = tuple(jax.tree.map(lambda b: 0 if b else None, in_batched))
        into = jax.vmap(fast, in_axes=in_axes)(*args)
        out = jax.vmap(safe, in_axes=(None, 0) + in_axes)(check(into, *args), into, *args)
        return out, jax.tree.map(lambda _: True, out)

    return run


def forward(spec: AttentionSpec, q, k, v, q_ids=None, kv_ids=None, sinks=None):
    """(O, RowStats): the Mosaic forward's when no row of it has r = NaN, else the Triton
    forward's.

    The Mosaic forward takes its own default tiles (clusters of two where they pay,
    `mosaic.forward.default_forward_config`): it launches outside any branch.
    """
    return _predicated(
        lambda into, *_: ~jnp.isnan(into[1].r).any(),
        lambda *a: mosaic_forward.forward(spec, *a),
        lambda skip, into, *a: triton_forward.forward(spec, *a, skip=skip, into=into),
    )(q, k, v, q_ids, kv_ids, sinks)


def backward(spec: AttentionSpec, q, k, v, out, stats, do, dlse, q_ids=None, kv_ids=None, *,
             delta=None):
    """(dq, dk, dv): the Mosaic backward's when no inf or NaN reached them, else the Triton
    one's.

    The kernels' marks say whether one did (module docstring); O, the row statistics and dlse
    enter the kernels through D = rowsum(dO * O) - dlse, which both backwards take, formed once
    (here, unless the caller has it).
    """
    if delta is None:
        delta = output_dot(out, do, dlse, jnp.float32)

    def fast(q, k, v, out, stats, do, dlse, q_ids, kv_ids, delta):
        return mosaic_backward.backward_checked(spec, q, k, v, out, stats, do, dlse, q_ids,
                                                kv_ids, delta=delta)

    def check(into, *_):
        return jnp.all(into[1])

    def safe(skip, into, q, k, v, out, stats, do, dlse, q_ids, kv_ids, delta):
        return triton_backward.backward(spec, q, k, v, out, stats, do, dlse, q_ids, kv_ids,
                                        delta=delta, skip=skip, into=into[0])

    return _predicated(check, fast, safe)(q, k, v, out, stats, do, dlse, q_ids, kv_ids, delta)
