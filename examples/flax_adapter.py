"""Plug pallas_flash into Flax: an `attention_fn` for `flax.nnx.MultiHeadAttention`.

    from flax import nnx
    from flax_adapter import flash_attention_fn

    attn = nnx.MultiHeadAttention(num_heads=8, in_features=512, decode=False,
                                  attention_fn=flash_attention_fn, rngs=nnx.Rngs(0))
    y = attn(x, is_causal=True)          # causal attention on the flash kernels

`flash_attention_fn` takes the arguments that nnx.MultiHeadAttention passes to its
`attention_fn` (those of `flax.nnx.dot_product_attention`) and calls
`pallas_flash.dot_product_attention`, the drop-in for `jax.nn.dot_product_attention` (which is
what Flax's own attention_fn calls when dropout is off). How each argument is served:

* ``is_causal=True`` (``attn(x, is_causal=True)``): the kernels, with no [T, S] mask built.
  This is the way to get causal attention on the kernels; a causal *mask*
  (``nnx.make_causal_mask``) is a dense array and goes to XLA, see next.
* ``mask`` / ``bias`` (padding masks, ``decode=True``'s cache mask, ...): dense arrays, which
  the kernels do not take; the call is served by XLA through
  ``jax.nn.dot_product_attention(..., implementation="xla")``, with the same results as
  Flax's default attention_fn. We do not try to recognise a causal pattern inside a mask: a
  mask is data, and inspecting it would need a host sync or would not work under jit.
* dropout: the kernels have none. ``dropout_rate > 0`` with ``deterministic=False`` raises a
  ValueError; with ``deterministic=True`` (evaluation) dropout is off and the kernels run.
* ``module`` (set by ``sow_weights=True``): the kernels never materialise the attention
  weights, so there is nothing to sow; raises a ValueError.
* ``dtype``: q, k and v are promoted to it (Flax's rule); ``precision``: passed to the kernels
  (None, "default", "high", "highest" or a jax.lax.Precision; ignored when XLA serves).
* Leading batch dimensions ``[batch..., length, heads, head_dim]`` are flattened to one and
  restored; ``[length, heads, head_dim]`` without a batch works too.

This module needs only JAX and pallas_flash; Flax is imported inside `main()`, the demo, which
builds a tiny nnx.MultiHeadAttention with and without the adapter and compares them:

    python examples/flax_adapter.py
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

try:
    import pallas_flash
except ImportError:
    # Run from a source checkout without an install: the package sits one directory up.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import pallas_flash

__all__ = ["flash_attention_fn"]


def flash_attention_fn(
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
    promote_dtype: Callable | None = None,
    is_causal: bool = False,
) -> jax.Array:
    """`flax.nnx.dot_product_attention`'s signature, served by `pallas_flash`.

    Args:
      query: [batch..., q_length, num_heads, head_dim].
      key, value: [batch..., kv_length, num_kv_heads, head_dim]; num_heads must be a multiple
        of num_kv_heads.
      bias, mask: broadcastable to [batch..., num_heads, q_length, kv_length]; either one
        sends the call to XLA (see the module docstring).
      broadcast_dropout, dropout_rng: unused (no dropout).
      dropout_rate, deterministic: dropout_rate > 0 with deterministic=False raises.
      dtype: compute dtype; q, k, v are promoted to it (default: their common dtype).
      precision: matmul precision for the kernels.
      module: must be None (sow_weights=False): the kernels have no attention weights to sow.
      promote_dtype: Flax's hook ``promote_dtype((q, k, v), dtype=dtype)``; default: cast to
        `dtype`, or to the inputs' common dtype.
      is_causal: causal attention, served by the kernels.

    Returns:
      [batch..., q_length, num_heads, head_dim].
    """
    del broadcast_dropout, dropout_rng  # Only meaningful with dropout, which is rejected below.
    if dropout_rate > 0.0 and not deterministic:
        raise ValueError(
            f"flash_attention_fn has no attention dropout, got dropout_rate={dropout_rate} with "
            f"deterministic=False; use dropout_rate=0.0, or deterministic=True for evaluation"
        )
    if module is not None:
        raise ValueError(
            "flash_attention_fn cannot sow attention weights (module was given, i.e. "
            "sow_weights=True): the flash kernels never materialise them"
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

    if len(batch_dims) > 1:
        flat = math.prod(batch_dims)
        query, key, value = (x.reshape(flat, *x.shape[-3:]) for x in (query, key, value))
        bias = _flatten_logits_array("bias", bias, batch_dims)
        mask = _flatten_logits_array("mask", mask, batch_dims)
    if mask is not None:
        mask = jnp.asarray(mask).astype(jnp.bool_)

    out = pallas_flash.dot_product_attention(
        query, key, value, bias, mask, is_causal=is_causal, precision=precision,
    )
    return out.reshape(*batch_dims, *out.shape[-3:])


def _relative(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


def _flatten_logits_array(name, x, batch_dims):
    """[batch..., heads, q, kv] (broadcastable) -> [prod(batch), heads, q, kv]."""
    if x is None:
        return None
    x = jnp.asarray(x)
    if x.ndim < 3:
        raise ValueError(
            f"{name} must be broadcastable to [batch..., num_heads, q_length, kv_length] with "
            f"at least 3 dims, got shape {x.shape}"
        )
    x = jnp.broadcast_to(x, (*batch_dims, *x.shape[-3:]))
    return x.reshape(math.prod(batch_dims), *x.shape[-3:])


def main(argv=None) -> dict:
    """Builds a tiny nnx.MultiHeadAttention (4 heads) twice, with the adapter and with
    Flax's default attention_fn (same weights), and returns the relative differences
    max|a - b| / max|b| of their outputs and of their parameter gradients (all as one vector),
    for causal attention (kernel path) and for a padding mask (XLA path)."""
    del argv
    from flax import nnx  # Imported here only: the adapter itself does not need Flax.

    batch, seq, features, heads = 2, 24, 32, 4
    x = jax.random.normal(jax.random.PRNGKey(0), (batch, seq, features), jnp.float32)

    def build(attention_fn):
        return nnx.MultiHeadAttention(
            num_heads=heads, in_features=features, qkv_features=features, decode=False,
            attention_fn=attention_fn, rngs=nnx.Rngs(0),  # same seed: same weights
        )

    flash = build(flash_attention_fn)
    default = build(nnx.dot_product_attention)

    def compare(**kwargs):
        @nnx.jit
        def output_and_grads(module):
            def loss(module):  # a non-trivial cotangent for the output
                y = module(x, **kwargs)
                return jnp.sum(jnp.sin(y)), y

            (_, y), grads = nnx.value_and_grad(loss, has_aux=True)(module)
            return y, grads

        y_flash, g_flash = output_and_grads(flash)
        y_default, g_default = output_and_grads(default)
        # All parameter gradients as one vector: the key projection's bias gets a gradient
        # that is zero in exact arithmetic (softmax ignores a per-row shift), so a per-leaf
        # ratio would divide rounding noise by rounding noise.
        flat = lambda g: jnp.concatenate(  # noqa: E731
            [leaf.ravel() for leaf in jax.tree.leaves(g)])
        return _relative(y_flash, y_default), _relative(flat(g_flash), flat(g_default))

    lengths = jnp.array([seq, seq // 2])
    valid = jnp.arange(seq)[None, :] < lengths[:, None]
    padding_mask = nnx.make_attention_mask(valid, valid)  # [batch, 1, seq, seq]

    results = {}
    results["causal_out"], results["causal_grad"] = compare(is_causal=True)
    results["mask_out"], results["mask_grad"] = compare(mask=padding_mask)
    for name, diff in results.items():
        print(f"relative difference, flash vs Flax default, {name:12s} {diff:.2e}")
    return results


if __name__ == "__main__":
    res = main(sys.argv[1:])
    sys.exit(0 if max(res.values()) < 1e-4 else 1)
