"""attention_fn for Flax: the flash kernels behind nnx and linen attention modules.

    from flax import nnx
    import pallas_flash.flax

    attn = nnx.MultiHeadAttention(num_heads=8, in_features=512, decode=False,
                                  attention_fn=pallas_flash.flax.attention_fn, rngs=nnx.Rngs(0))
    y = attn(x, mask=nnx.combine_masks(nnx.make_causal_mask(tokens),
                                       nnx.make_attention_mask(tokens > 0, tokens > 0)))

`attention_fn` takes the arguments of `flax.nnx.dot_product_attention` and of
`flax.linen.dot_product_attention` (so it also fits
``linen.MultiHeadDotProductAttention(attention_fn=...)``) and calls
`pallas_flash.dot_product_attention`, which serves causal, padding and packed-segment masks
on the kernels and anything else on XLA, with a warning; its docstring has the details,
including the one numerical difference from Flax's default: query rows that see no key (the
padded rows of a padding mask) give 0, not the mean of the values.

This module does not import Flax: it needs only JAX, and ``import pallas_flash`` never loads it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallas_flash.nn import dot_product_attention

__all__ = ["attention_fn"]


def attention_fn(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    promote_dtype: Callable[..., Any] | None = None,
    is_causal: bool = False,
    force_fp32_for_softmax: bool = False,
    einsum_dot_general: Callable[..., jax.Array] | None = None,
    qk_attn_weights_einsum: Callable[..., jax.Array] | None = None,
    attn_weights_value_einsum: Callable[..., jax.Array] | None = None,
) -> jax.Array:
    """Flax's `dot_product_attention` (nnx and linen signatures), served by `pallas_flash`.

    Args:
      query: [batch..., q_length, num_heads, head_dim].
      key, value: [batch..., kv_length, num_kv_heads, head_dim]; num_heads must be a multiple
        of num_kv_heads (GQA, as in nnx).
      bias: broadcastable to [batch..., num_heads, q_length, kv_length]; served by XLA.
      mask: broadcastable to [batch..., num_heads, q_length, kv_length], any dtype (nonzero =
        attend, as in Flax); causal, padding and packed-segment masks and their products run
        on the kernels, others on XLA.
      broadcast_dropout, dropout_rng: unused: there is no dropout (next).
      dropout_rate, deterministic: the kernels have no attention dropout, so
        ``dropout_rate > 0`` with ``deterministic=False`` raises ValueError; with
        ``deterministic=True`` (evaluation) dropout is off anyway.
      dtype: q, k and v are promoted to it (default: their common dtype).
      precision: matmul precision for float32 inputs on the kernels (None, "default", "high",
        "highest" or a jax.lax.Precision).
      module: must be None: the kernels never form the attention weights, so
        ``sow_weights=True`` raises ValueError.
      promote_dtype: nnx's hook, called as ``promote_dtype((query, key, value), dtype=dtype)``.
      is_causal: causal attention (nnx's ``attn(x, is_causal=True)``), served by the kernels.
      force_fp32_for_softmax: accepted for linen; the kernels always take the softmax in
        float32.
      einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum: linen's hooks for
        custom matmuls; the kernels cannot use them, so anything but None raises ValueError.

    Returns:
      [batch..., q_length, num_heads, head_dim] in the promoted dtype.
    """
    del broadcast_dropout, dropout_rng, force_fp32_for_softmax
    if dropout_rate > 0.0 and not deterministic:
        raise ValueError(
            f"pallas_flash.flax.attention_fn has no attention dropout, got "
            f"dropout_rate={dropout_rate} with deterministic=False; use dropout_rate=0.0, or "
            f"deterministic=True for evaluation"
        )
    if module is not None:
        raise ValueError(
            "pallas_flash.flax.attention_fn cannot sow attention weights (module was given, "
            "i.e. sow_weights=True): the flash kernels never form them"
        )
    hooks = {"einsum_dot_general": einsum_dot_general,
             "qk_attn_weights_einsum": qk_attn_weights_einsum,
             "attn_weights_value_einsum": attn_weights_value_einsum}
    given = [name for name, hook in hooks.items() if hook is not None]
    if given:
        raise ValueError(
            f"pallas_flash.flax.attention_fn cannot use custom matmuls ({', '.join(given)}): "
            f"the flash kernels do their own"
        )
    if promote_dtype is not None:
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
    else:
        dtype = jnp.result_type(query, key, value) if dtype is None else dtype
        query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))

    if not (query.ndim == key.ndim == value.ndim) or query.ndim < 3:
        raise ValueError(
            f"query, key and value must have one rank >= 3 ([batch..., length, heads, "
            f"head_dim]), got shapes {query.shape}, {key.shape}, {value.shape}"
        )
    batch_dims = query.shape[:-3]
    if key.shape[:-3] != batch_dims or value.shape[:-3] != batch_dims:
        raise ValueError(
            f"query, key and value must share their batch dims, got shapes {query.shape}, "
            f"{key.shape}, {value.shape}"
        )
    if mask is not None:
        mask = jnp.asarray(mask).astype(jnp.bool_)
    if len(batch_dims) > 1:
        flat = math.prod(batch_dims)
        query, key, value = (x.reshape(flat, *x.shape[-3:]) for x in (query, key, value))
        bias = _flatten_batch("bias", bias, batch_dims)
        mask = _flatten_batch("mask", mask, batch_dims)

    out = dot_product_attention(query, key, value, bias, mask, is_causal=is_causal,
                                precision=precision)
    return out.reshape(*batch_dims, *out.shape[-3:])


def _flatten_batch(name, x, batch_dims):
    """[batch..., heads, q, kv] (broadcastable) -> [prod(batch), heads, q, kv]."""
    if x is None:
        return None
    x = jnp.asarray(x)
    # Broadcasting aligns trailing axes: a [q, kv] mask is [1, q, kv] to the heads axis.
    x = x.reshape((1,) * (3 - x.ndim) + x.shape)
    x = jnp.broadcast_to(x, (*batch_dims, *x.shape[-3:]))
    return x.reshape(math.prod(batch_dims), *x.shape[-3:])
