"""Per-row softmax statistics: what a forward kernel saves for the backward kernels.

Every backend speaks this contract, so either backend's forward can feed either's backward.
For each query row there are two float32 numbers, M and L of the FlashAttention papers:

  m: the row's largest logit, in *logit units* u: the raw product q.k, or, with a softcap,
     tanh(q.k * scale / softcap). The natural-log logit is u * logit_scale(spec).
  r: log2 of the row's softmax denominator, sum_j 2^((u_j - m) * logit_scale * log2(e)).

The backward recomputes each weight as P_ij = 2^((u_ij - m_i) * logit_scale * log2(e) - r_i).

Why two numbers and not one fused lse: with logits near 1e4, a float32 lse rounds at ~1e-3, and
every P of the row inherits that as a relative error; it showed as a 7.6e-4 error in float32
gradients (tests/test_extremes.py). u - m is exact near the row's maximum (both are float32
products of the same kernel), and r is small, so this pair keeps P at float32 accuracy at any
logit magnitude. The public lse is derived from it, outside the kernels.

A row that sees no key has m = 0 and r = -inf, hence lse = -inf; a NaN row has r = NaN.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_flash.spec import AttentionSpec

__all__ = ["RowStats", "logit_scale", "to_lse", "from_lse", "output_dot", "sink_epilogue",
           "sink_weights"]

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


class RowStats(NamedTuple):
    """m and r, each float32 [batch, q_heads, seq_q] (float64 for float64 inputs)."""

    m: jax.Array
    r: jax.Array


def logit_scale(spec: AttentionSpec) -> float:
    """Natural-log logit per logit unit: scale, or softcap when soft-capping."""
    return spec.scale if spec.softcap is None else spec.softcap


def to_lse(spec: AttentionSpec, stats: RowStats) -> jax.Array:
    """The natural-log logsumexp of each row (the public lse)."""
    return stats.m * logit_scale(spec) + stats.r * LN2


def from_lse(lse: jax.Array) -> RowStats:
    """Statistics that reproduce a given lse (m = 0, r = lse in base 2).

    For callers that only have a merged lse, such as ring attention after combining partial
    results. It is exact in real arithmetic, and as precise as the lse itself.
    """
    return RowStats(jnp.zeros_like(lse), lse * LOG2E)


def sink_epilogue(m, l, sink, c):
    """A forward kernel's last step with an attention sink (sinks.py), per row.

    m, l: the row's running max (logit units, -inf if it saw no key) and its denominator
    relative to m; sink: the head's sink logit (natural log); c = logit_scale * log2(e).
    Returns (w, r): O = acc * w, and r = log2 of the denominator with the sink's term, so that
    (m, r) stay the statistics of the whole softmax, sink included. The sink's exponent
    relative to m, t, may be far above the row's logits; both sums are taken relative to
    max(t, 0), so nothing overflows; a sink of -inf leaves the row as it was, and a NaN sink makes
    it NaN.
    """
    t = jnp.where(m == -jnp.inf, sink * LOG2E, sink * LOG2E - m * c)
    shift = jnp.maximum(t, 0.0)
    down = jnp.exp2(-shift)
    denom = l * down + jnp.exp2(jnp.minimum(t, 0.0))   # t - shift
    # Triton lowers maximum / minimum to maxnum / minnum, which return the other operand for a
    # NaN: a NaN sink would silently drop out of the row. It reaches the row, as in the reference.
    denom = jnp.where(jnp.isnan(t), t, denom)
    return down / denom, jnp.log2(denom) + shift


def sink_weights(spec: AttentionSpec, stats: RowStats, sinks: jax.Array) -> jax.Array:
    """exp(sink - lse') per row, [batch, q_heads, seq_q]: the weight the softmax gives the sink.
    The sink's gradient is -sum over batch and rows of this times D (output_dot)."""
    s = sinks.astype(stats.m.dtype)[None, :, None] * LOG2E
    return jnp.exp2(s - stats.m * logit_scale(spec) * LOG2E - stats.r)


def output_dot(out, do, dlse, dtype) -> jax.Array:
    """D = rowsum(dO * O) - dlse in `dtype`, [batch, q_heads, seq_q]: the backward's preprocess
    (dS = P (dP - D); dlse enters here because lse's gradient is P itself).

    The sum runs over head_dim in the operands' own [batch, seq, heads, head_dim] layout and
    is only then transposed, with an optimization barrier between: left to itself XLA fuses the
    transpose into the reduction and reads O and dO in a pattern several times slower
    (docs/tuning.md).
    """
    d = jnp.sum(out.astype(dtype) * do.astype(dtype), axis=-1)
    d = lax.optimization_barrier(d)
    return jnp.transpose(d, (0, 2, 1)) - dlse.astype(dtype)
