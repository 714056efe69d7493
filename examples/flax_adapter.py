"""Flax with the flash kernels: nnx.MultiHeadAttention with pallas_flash.flax.attention_fn.

    python examples/flax_adapter.py

Builds the same small causal self-attention layer twice, with Flax's default attention_fn and
with pallas_flash's, runs both on a padded batch (a causal mask combined with a padding mask,
as a decoder sees it) and prints how far apart their outputs and parameter gradients are. The
loss ignores padded positions, as a training loss does; those rows are the one place where the
two differ (see `pallas_flash.dot_product_attention`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

try:
    import pallas_flash.flax
except ImportError:  # a source checkout without an install: the package sits one level up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import pallas_flash.flax


def main() -> dict[str, float]:
    batch, seq, features, heads = 2, 24, 32, 4
    x = jax.random.normal(jax.random.PRNGKey(0), (batch, seq, features))
    valid = jnp.arange(seq)[None, :] < jnp.array([seq, 15])[:, None]       # [batch, seq]
    mask = nnx.combine_masks(nnx.make_causal_mask(valid), nnx.make_attention_mask(valid, valid))

    def layer(attention_fn):
        return nnx.MultiHeadAttention(num_heads=heads, in_features=features, decode=False,
                                      attention_fn=attention_fn, rngs=nnx.Rngs(0))

    @nnx.jit
    def output_and_grads(model):
        def loss(model):
            y = model(x, mask=mask)
            return jnp.sum(jnp.where(valid[..., None], jnp.sin(y), 0.0)), y
        (_, y), grads = nnx.value_and_grad(loss, has_aux=True)(model)
        return jnp.where(valid[..., None], y, 0.0), grads

    flat = lambda tree: jnp.concatenate([leaf.ravel() for leaf in jax.tree.leaves(tree)])  # noqa: E731
    y_flash, g_flash = output_and_grads(layer(pallas_flash.flax.attention_fn))
    y_flax, g_flax = output_and_grads(layer(nnx.dot_product_attention))
    diffs = {name: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
             for name, a, b in (("output", y_flash, y_flax),
                                ("gradients", flat(g_flash), flat(g_flax)))}
    for name, diff in diffs.items():
        print(f"relative difference of the {name}, pallas_flash vs Flax: {diff:.2e}")
    return diffs


if __name__ == "__main__":
    sys.exit(0 if max(main().values()) < 1e-4 else 1)
