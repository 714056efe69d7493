"""Learnable attention sinks (gpt-oss): one logit per query head that joins every row's softmax
denominator but has no value row.

With a sink s, a row's weights are exp(x_j - m) / (exp(s - m) + sum_j exp(x_j - m)). Given the
sink-free output O and lse, the sink only rescales them:

    lse' = logaddexp(lse, s),   O' = O * exp(lse - lse')

`flash_attention` folds the sink into the forward kernels' last step instead
(stats.sink_epilogue), which saves this pass over O. `apply_sinks` serves the paths that only
have merged partial results (ring attention, decoding) and the drop-in's XLA fallback. The
gradient is the same either way: dL/ds = -sum_i exp(s - lse'_i) * D_i with
D_i = rowsum(dO'_i * O'_i), the D the backward kernels use; the cotangent that reaches lse is
folded into their D, as for any lse cotangent. A row that sees no key keeps O' = 0 (exp(-inf)
is 0) and gets lse' = s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["check_sinks", "apply_sinks"]


def check_sinks(sinks, q_heads: int) -> jax.Array:
    """sinks as an array of shape [q_heads] and a floating dtype, or a ValueError naming it."""
    if not hasattr(sinks, "shape") or not hasattr(sinks, "dtype"):
        raise ValueError(f"sinks must be an array of shape [q_heads], got {type(sinks).__name__}")
    if tuple(sinks.shape) != (q_heads,):
        raise ValueError(f"sinks must have shape [q_heads] = ({q_heads},), got "
                         f"{tuple(sinks.shape)}")
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise ValueError(f"sinks must have a floating dtype, got {sinks.dtype}")
    return jnp.asarray(sinks)


def apply_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array,
                heads_axis: int = 1) -> tuple[jax.Array, jax.Array]:
    """(O', lse') from the sink-free out [batch, seq_q, heads, head_dim] and lse, whose heads sit
    on `heads_axis` ([batch, heads, seq_q] by default)."""
    shape = [1] * lse.ndim
    shape[heads_axis] = sinks.shape[0]
    s = sinks.astype(lse.dtype).reshape(shape)
    new_lse = jnp.logaddexp(lse, s)
    weight = jnp.exp(lse - new_lse)  # in [0, 1]; 0 where the row sees no key
    if heads_axis == 1:
        weight = jnp.swapaxes(weight, 1, 2)  # [batch, seq_q, heads]
    compute = jnp.promote_types(out.dtype, jnp.float32)
    out = (out.astype(compute) * weight[..., None].astype(compute)).astype(out.dtype)
    return out, new_lse
