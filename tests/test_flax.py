"""pallas_flash.flax.attention_fn: Flax's attention_fn signatures (nnx and linen) on the kernels.

The module itself needs no Flax; the tests that build Flax modules skip where Flax is missing.
They compare a module using our attention_fn with the same module (same weights) using Flax's
default, on the output and on the parameter gradients, in float32, with masks Flax code builds.
The loss ignores padded query positions, as a training loss does: those rows are the one place
where the two differ (0 here, the mean of the values in Flax; see dot_product_attention).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import pallas_flash as pf
import pallas_flash.flax
import pallas_flash.nn as pf_nn
from helpers import TOLERANCE, assert_close, random_inputs

ROOT = Path(__file__).resolve().parents[1]
TOL = TOLERANCE[jnp.dtype(jnp.float32)]
# (batch, seq_q, seq_kv, q_heads, kv_heads, head_dim), as in test_dot_product_attention.py, so
# that the kernels compiled there are reused here when both run in one process.
GQA = (2, 20, 24, 4, 2, 16)


def _inputs(shape=GQA, dtype=jnp.float32):
    return random_inputs(jax.random.PRNGKey(0), *shape, dtype)


def _outputs_and_grads(fn, q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(do.astype(out.dtype)))


def _nnx_kwargs(**overrides):
    """The keyword arguments nnx.MultiHeadAttention passes to its attention_fn."""
    kwargs = dict(mask=None, dropout_rng=None, dropout_rate=0.0, broadcast_dropout=True,
                  deterministic=True, dtype=None, precision=None, module=None, is_causal=False)
    kwargs.update(overrides)
    return kwargs


def test_importing_pallas_flash_does_not_import_flax():
    code = ("import sys, pallas_flash, pallas_flash.flax; "
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'flax'); "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=300)


# --------------------------------------------------------------------------------------------
# The function, called as nnx.MultiHeadAttention calls it
# --------------------------------------------------------------------------------------------


def test_causal_with_two_batch_dims(kernel_calls):
    # is_causal goes to the kernels; two batch dims are flattened and restored; dropout_rate > 0
    # is fine when deterministic (evaluation).
    q, k, v, do = _inputs()
    split = lambda x: x.reshape(1, *x.shape)  # noqa: E731
    fn = lambda q, k, v: pallas_flash.flax.attention_fn(  # noqa: E731
        q, k, v, **_nnx_kwargs(is_causal=True, dropout_rate=0.1, deterministic=True))
    ours = _outputs_and_grads(fn, split(q), split(k), split(v), split(do))
    ref = _outputs_and_grads(lambda q, k, v: pf.reference_attention(q, k, v, causal=True),
                             q, k, v, do)
    xla = _outputs_and_grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                             q, k, v, do)
    for name, a, r, x in zip(("out", "dq", "dk", "dv"), ours, ref, xla, strict=True):
        assert a.shape == (1, *r.shape), name
        assert_close(f"{name} vs reference", a[0], r, TOL)
        assert_close(f"{name} vs jax.nn", a[0], x, TOL)
    assert kernel_calls and kernel_calls[0]["causal"] is True


def test_dtype_is_promoted(kernel_calls):
    q, k, v, do = _inputs(dtype=jnp.bfloat16)
    fn = lambda q, k, v: pallas_flash.flax.attention_fn(  # noqa: E731
        q, k, v, **_nnx_kwargs(is_causal=True, dtype=jnp.float32))
    out = _outputs_and_grads(fn, q, k, v, do)[0]
    assert out.dtype == jnp.float32 and kernel_calls
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    assert_close("out", out, pf.reference_attention(up(q), up(k), up(v), causal=True), TOL)


def test_promote_dtype_hook():
    q, k, v, _ = _inputs((1, 4, 4, 2, 1, 8))
    seen = []

    def promote(arrays, *, dtype):
        seen.append(dtype)
        return tuple(x.astype(jnp.float32) for x in arrays)

    out = pallas_flash.flax.attention_fn(q.astype(jnp.float16), k, v, dtype="marker",
                                         promote_dtype=promote, is_causal=True)
    assert seen == ["marker"] and out.dtype == jnp.float32


def test_masks_with_two_batch_dims_and_none(kernel_calls):
    # A key padding mask broadcast over the second batch dim and the heads, [2, 1, 1, 1, S],
    # in float32 as nn.make_attention_mask makes it; with is_causal. Served by the kernels.
    q, k, v, do = _inputs()
    kl = jnp.array([24, 5])
    valid = (jnp.arange(24)[None, :] < kl[:, None]).astype(jnp.float32)
    mask = valid[:, None, None, None, :]
    split = lambda x: x.reshape(2, 1, *x.shape[1:])  # noqa: E731
    fn = lambda q, k, v: pallas_flash.flax.attention_fn(  # noqa: E731
        q, k, v, **_nnx_kwargs(mask=mask, is_causal=True))
    ours = _outputs_and_grads(fn, split(q), split(k), split(v), split(do))
    ref = _outputs_and_grads(lambda q, k, v: pf.reference_attention(q, k, v, causal=True,
                                                                    kv_lengths=kl), q, k, v, do)
    for name, a, r in zip(("out", "dq", "dk", "dv"), ours, ref, strict=True):
        assert_close(f"{name} vs reference", a.reshape(r.shape), r, TOL)
    assert kernel_calls and kernel_calls[0]["causal"] is True
    # No batch dims at all: [length, heads, head_dim], and a [T, S] mask.
    kernel_calls.clear()
    out = pallas_flash.flax.attention_fn(q[1], k[1], v[1], **_nnx_kwargs(mask=mask[1, 0, 0]))
    assert_close("unbatched out", out, pf.reference_attention(q[1:], k[1:], v[1:],
                                                              kv_lengths=kl[1:])[0], TOL)
    assert kernel_calls


def test_error_dropout():
    q, k, v, _ = _inputs((1, 4, 4, 2, 1, 8))
    with pytest.raises(ValueError, match=r"pallas_flash.flax.attention_fn has no attention "
                                         r"dropout, got dropout_rate=0.1 with deterministic=False"):
        pallas_flash.flax.attention_fn(q, k, v, **_nnx_kwargs(dropout_rate=0.1,
                                                              deterministic=False))


def test_error_sow_weights():
    q, k, v, _ = _inputs((1, 4, 4, 2, 1, 8))
    with pytest.raises(ValueError, match=r"cannot sow attention weights"):
        pallas_flash.flax.attention_fn(q, k, v, **_nnx_kwargs(module=object()))


def test_error_custom_matmuls():
    q, k, v, _ = _inputs((1, 4, 4, 2, 1, 8))
    with pytest.raises(ValueError, match=r"cannot use custom matmuls \(qk_attn_weights_einsum, "
                                         r"attn_weights_value_einsum\)"):
        pallas_flash.flax.attention_fn(q, k, v, qk_attn_weights_einsum=jnp.einsum,
                                       attn_weights_value_einsum=jnp.einsum)
    with pytest.raises(ValueError, match=r"cannot use custom matmuls \(einsum_dot_general\)"):
        pallas_flash.flax.attention_fn(q, k, v, einsum_dot_general=jax.lax.dot_general)


def test_error_rank():
    q, k, v, _ = _inputs((1, 4, 4, 2, 1, 8))
    with pytest.raises(ValueError, match=r"query, key and value must have one rank >= 3"):
        pallas_flash.flax.attention_fn(q, k[0], v[0])


def test_error_batch_dims():
    q, k, v, _ = _inputs((1, 4, 4, 2, 1, 8))
    with pytest.raises(ValueError, match=r"query, key and value must share their batch dims"):
        pallas_flash.flax.attention_fn(q, jnp.concatenate([k, k]), jnp.concatenate([v, v]))


def test_a_two_dim_mask_broadcasts_over_two_batch_dims(kernel_calls):
    """A [T, S] mask is broadcastable to [batch..., heads, T, S], as Flax takes it: a causal
    one over two batch dims runs on the kernels and matches the causal reference."""
    q, k, v, _ = _inputs((2, 6, 6, 2, 1, 8))
    split = lambda x: x.reshape(2, 1, *x.shape[1:])  # noqa: E731
    causal = jnp.tril(jnp.ones((6, 6), bool))
    out = pallas_flash.flax.attention_fn(split(q), split(k), split(v), mask=causal)
    assert_close("out", out.reshape(q.shape), pf.reference_attention(q, k, v, causal=True), TOL)
    assert kernel_calls and kernel_calls[0]["causal"] is True


# --------------------------------------------------------------------------------------------
# Flax modules
# --------------------------------------------------------------------------------------------


def _relative(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _flat(tree):
    return jnp.concatenate([leaf.ravel() for leaf in jax.tree.leaves(tree)])


def test_example_nnx_causal_and_padding_masks():
    # The example: nnx.MultiHeadAttention with combine_masks(make_causal_mask,
    # make_attention_mask) of a padded batch, against Flax's default attention_fn.
    pytest.importorskip("flax.nnx", exc_type=ImportError)
    spec = importlib.util.spec_from_file_location("flax_example", ROOT / "examples" /
                                                  "flax_adapter.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        diffs = example.main()
        jax.effects_barrier()
    assert not [w for w in record if issubclass(w.category, pf_nn.FallbackWarning)]
    assert diffs["output"] < TOL and diffs["gradients"] < TOL, diffs


def test_nnx_gqa_is_causal_and_key_padding(kernel_calls):
    nnx = pytest.importorskip("flax.nnx", exc_type=ImportError)
    batch, seq, features = 2, 24, 32
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, seq, features))
    kv_valid = jnp.arange(seq)[None, :] < jnp.array([seq, 9])[:, None]
    mask = kv_valid[:, None, None, :]       # keys only: every query row sees a key

    def layer(attention_fn):
        return nnx.MultiHeadAttention(num_heads=4, num_kv_heads=2, in_features=features,
                                      decode=False, attention_fn=attention_fn,
                                      rngs=nnx.Rngs(0))

    @nnx.jit
    def output_and_grads(model):
        def loss(model):
            y = model(x, mask=mask, is_causal=True)
            return jnp.sum(jnp.sin(y)), y
        (_, y), grads = nnx.value_and_grad(loss, has_aux=True)(model)
        return y, grads

    y_ours, g_ours = output_and_grads(layer(pallas_flash.flax.attention_fn))
    y_flax, g_flax = output_and_grads(layer(nnx.dot_product_attention))
    assert _relative(y_ours, y_flax) < TOL
    assert _relative(_flat(g_ours), _flat(g_flax)) < TOL
    assert kernel_calls and all(c["causal"] is True for c in kernel_calls)


def test_linen_multi_head_attention_padding_mask(kernel_calls):
    linen = pytest.importorskip("flax.linen", exc_type=ImportError)
    batch, seq, features = 2, 20, 32
    x = jax.random.normal(jax.random.PRNGKey(2), (batch, seq, features))
    valid = jnp.arange(seq)[None, :] < jnp.array([seq, 11])[:, None]
    mask = linen.make_attention_mask(valid, valid)

    def module(attention_fn):
        return linen.MultiHeadDotProductAttention(num_heads=4, qkv_features=features,
                                                  attention_fn=attention_fn)

    params = module(linen.dot_product_attention).init(jax.random.PRNGKey(0), x, mask=mask)

    def output_and_grads(attention_fn):
        def loss(params):
            y = module(attention_fn).apply(params, x, mask=mask)
            return jnp.sum(jnp.where(valid[..., None], jnp.sin(y), 0.0)), y
        (_, y), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        return jnp.where(valid[..., None], y, 0.0), grads

    y_ours, g_ours = output_and_grads(pallas_flash.flax.attention_fn)
    y_flax, g_flax = output_and_grads(linen.dot_product_attention)
    assert _relative(y_ours, y_flax) < TOL
    assert _relative(_flat(g_ours), _flat(g_flax)) < TOL
    assert kernel_calls
