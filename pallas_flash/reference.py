"""reference_attention: plain jnp, float32 or better, every option the kernels have.

It materialises the [batch, heads, seq_q, seq_kv] logits, so it is for tests and small checks
only. It computes in float32 (float64 when the inputs are float64) at HIGHEST matmul precision,
so that it is the more accurate side of every comparison, on the CPU and on the GPU alike.
"""

from __future__ import annotations

from typing import Literal, overload

import jax
import jax.numpy as jnp
from jax import lax

from pallas_flash import validation
from pallas_flash.masking import make_mask_spec
from pallas_flash.sinks import check_sinks

__all__ = ["reference_attention"]


@overload
def reference_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    return_lse: Literal[False] = ...,
    causal_alignment: str = ...,
    window: tuple[int | None, int | None] | None = ...,
    softcap: float | None = ...,
    sinks: jax.Array | None = ...,
    q_segment_ids: jax.Array | None = ...,
    kv_segment_ids: jax.Array | None = ...,
    q_lengths: jax.Array | None = ...,
    kv_lengths: jax.Array | None = ...,
) -> jax.Array: ...


@overload
def reference_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    return_lse: Literal[True],
    causal_alignment: str = ...,
    window: tuple[int | None, int | None] | None = ...,
    softcap: float | None = ...,
    sinks: jax.Array | None = ...,
    q_segment_ids: jax.Array | None = ...,
    kv_segment_ids: jax.Array | None = ...,
    q_lengths: jax.Array | None = ...,
    kv_lengths: jax.Array | None = ...,
) -> tuple[jax.Array, jax.Array]: ...


@overload
def reference_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    return_lse: bool = ...,
    causal_alignment: str = ...,
    window: tuple[int | None, int | None] | None = ...,
    softcap: float | None = ...,
    sinks: jax.Array | None = ...,
    q_segment_ids: jax.Array | None = ...,
    kv_segment_ids: jax.Array | None = ...,
    q_lengths: jax.Array | None = ...,
    kv_lengths: jax.Array | None = ...,
) -> jax.Array | tuple[jax.Array, jax.Array]: ...


def reference_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_lengths: jax.Array | None = None,
    kv_lengths: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention computed the obvious way. Same arguments and conventions as `flash_attention`.

    Args:
      q: [batch, seq_q, q_heads, head_dim].
      k: [batch, seq_kv, kv_heads, head_dim]; q_heads is a multiple of kv_heads.
      v: [batch, seq_kv, kv_heads, head_dim_v]; head_dim_v may differ from head_dim (MLA).

    Returns:
      out [batch, seq_q, q_heads, head_dim_v] in q's dtype, and with ``return_lse`` also
      lse [batch, q_heads, seq_q] float32 (float64 for float64 inputs). Rows that see no key
      give out = 0 and lse = -inf.
    """
    opts = validation.validate(
        q, k, v, causal=causal, scale=scale, causal_alignment=causal_alignment, window=window,
        softcap=softcap, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        q_lengths=q_lengths, kv_lengths=kv_lengths, v_head_dim_may_differ=True,
    )
    batch, seq_q, q_heads, _ = q.shape
    seq_kv, kv_heads = k.shape[1], k.shape[2]
    compute = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    group = q_heads // kv_heads
    qf = q.astype(compute)
    kf = jnp.repeat(k.astype(compute), group, axis=2)
    vf = jnp.repeat(v.astype(compute), group, axis=2)

    logits = jnp.einsum("bqhd,bkhd->bhqk", qf, kf, precision=lax.Precision.HIGHEST)
    logits = logits * opts.scale
    if opts.softcap is not None:
        logits = opts.softcap * jnp.tanh(logits / opts.softcap)

    spec = make_mask_spec(seq_q, seq_kv, causal=causal, causal_alignment=causal_alignment,
                          window=opts.window)
    mask = jnp.ones((batch, 1, seq_q, seq_kv), bool)
    position = spec.dense()
    if position is not None:
        mask = mask & position[None, None]
    if kv_lengths is not None:
        mask = mask & (jnp.arange(seq_kv)[None, None, None, :] < kv_lengths[:, None, None, None])
    if q_lengths is not None:
        mask = mask & (jnp.arange(seq_q)[None, None, :, None] < q_lengths[:, None, None, None])
    if q_segment_ids is not None:
        same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
        mask = mask & same[:, None]

    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    if sinks is not None:
        # The sink is one more logit per head in every row's softmax, with no value row.
        sink = check_sinks(sinks, q_heads).astype(compute)[None, :, None, None]
        row_max = jnp.maximum(row_max, sink)
    # A row that sees nothing has max -inf; subtracting 0 instead keeps exp() at exactly 0
    # and the gradient free of inf - inf.
    row_max = lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    p = jnp.exp(logits - row_max)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - row_max)
    # A row that sees no key has denom 0; a NaN denom (a NaN sink) stays NaN, as in the kernels.
    seen = (denom > 0) | jnp.isnan(denom)
    safe_denom = jnp.where(seen, denom, 1.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", p / safe_denom, vf, precision=lax.Precision.HIGHEST)
    lse = jnp.where(seen, row_max + jnp.log(safe_denom), -jnp.inf)[..., 0]
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out
