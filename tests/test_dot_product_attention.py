"""pallas_flash.dot_product_attention (the jax.nn drop-in) and the Flax adapter example.

Every numerical case is compared twice, on the output and on dq, dk, dv for a random output
cotangent: against ``jax.nn.dot_product_attention(implementation="xla")`` given the same
arguments, and against `reference_attention` given the equivalent `flash_attention` options,
written out by hand in each case (so that the argument mapping itself is under test).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
import pallas_flash.nn as pf_nn
from helpers import TOLERANCE, assert_close, random_inputs

_ADAPTER = Path(__file__).resolve().parents[1] / "examples" / "flax_adapter.py"

# (batch, seq_q, seq_kv, q_heads, kv_heads, head_dim): seq_q < seq_kv keeps every query row of
# the windows below non-empty (test_rows_that_see_no_key covers the empty ones). The kernels are
# compiled once per shape and option set (about 5 s in interpret mode on two cores), so the
# tests share shapes and options where they can, and call eagerly so that the compiled kernels
# are reused across tests.
# MQA is covered by the unbatched test, MHA by the Flax test (nnx.MultiHeadAttention's default).
GQA = (2, 20, 24, 4, 2, 16)
MQA = (1, 20, 24, 4, 1, 16)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _inputs(shape=GQA, dtype=jnp.float32, seed=0):
    return random_inputs(jax.random.PRNGKey(seed), *shape, dtype)


def _outputs_and_grads(fn, q, k, v, do):
    """fn(q, k, v) and the vjp (dq, dk, dv) for cotangent do.

    Eager, not jitted: the kernels compiled for one test are then reused by every later test
    with the same shapes and options (about 5 s each in interpret mode on two cores), and so
    are XLA's per-operation compilations.
    """
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(do.astype(out.dtype)))


def _reference(q, k, v, **ref_kwargs):
    """reference_attention (out, lse [B, T, N]) on [B, T, N, H] or unbatched [T, N, H]."""
    unbatched = q.ndim == 3
    if unbatched:
        q, k, v = q[None], k[None], v[None]
    out, lse = pf.reference_attention(q, k, v, return_lse=True, **ref_kwargs)
    lse = jnp.swapaxes(lse, 1, 2)
    return (out[0], lse[0]) if unbatched else (out, lse)


def _check(q, k, v, do, ref_kwargs, *, xla_tol=None, fallback=False, **kwargs):
    """dot_product_attention(**kwargs) against jax.nn (xla) and reference_attention(**ref_kwargs).

    Compares the output, the residual (the logsumexp, whose gradient must be stopped: it gets
    a random cotangent, and dq, dk, dv must still match the reference's, which has none) and
    dq, dk, dv. The table's tolerance applies against the reference; against jax.nn, xla_tol.
    fallback: the call goes to XLA, whose residual is finite (about -2.4e38) on empty rows.
    """
    dtype = jnp.dtype(q.dtype)
    tol = TOLERANCE[dtype]
    xla_tol = tol if xla_tol is None else xla_tol
    dres = jax.random.normal(jax.random.PRNGKey(5), do.shape[:-1], jnp.float32)

    def run(fn, q, k, v, do, dres):
        (out, res), vjp = jax.vjp(fn, q, k, v)
        return (out, res, *vjp((do.astype(out.dtype), dres.astype(res.dtype))))

    ours = run(lambda q, k, v: pf.dot_product_attention(q, k, v, return_residual=True, **kwargs),
               q, k, v, do, dres)
    xla = run(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, implementation="xla", return_residual=True, **kwargs), q, k, v, do, dres)
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = run(lambda q, k, v: _reference(q, k, v, **ref_kwargs), up(q), up(k), up(v), up(do),
              jnp.zeros_like(dres))

    out, res = ours[:2]
    assert out.shape == q.shape and out.dtype == q.dtype
    assert res.shape == q.shape[:-1] and res.dtype == xla[1].dtype == k.dtype
    # Rows that see no key: residual -inf here (about -2.4e38 in jax.nn; see the docstring).
    seen = np.isfinite(np.asarray(ref[1]))
    if not fallback:
        np.testing.assert_array_equal(np.isfinite(np.asarray(res, np.float32)), seen)
    for name, a, x, r, inp in zip(("out", "residual", "dq", "dk", "dv"), ours, xla, ref,
                                  (q, k, q, k, v), strict=True):
        assert a.dtype == inp.dtype, f"{name}: dtype {a.dtype} != {inp.dtype}"
        floor = 0.0
        if name == "residual":  # a log: absolute error in units of the logits
            a, x, r = (np.where(seen, np.asarray(t, np.float32), 0.0) for t in (a, x, r))
            floor = 1.0
        assert_close(f"{name} vs reference_attention", a, r, tol, floor)
        assert_close(f"{name} vs jax.nn.dot_product_attention", a, x, xla_tol, floor)
    return ours


@pytest.fixture
def kernel_calls(monkeypatch):
    """Records every flash_attention call the drop-in makes (i.e. the kernel path)."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return pf.flash_attention(*args, **kwargs)

    monkeypatch.setattr(pf_nn, "flash_attention", spy)
    return calls


def _lengths(*values):
    return jnp.array(values, jnp.int32)


def _shapes(fn, *args, **kwargs):
    """Traces fn without compiling or running anything."""
    return jax.eval_shape(lambda *a: fn(*a, **kwargs), *args)


# --------------------------------------------------------------------------------------------
# Kernel path
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
def test_plain_and_causal_gqa(causal, kernel_calls):
    q, k, v, do = _inputs(GQA)
    _check(q, k, v, do, dict(causal=causal), is_causal=causal)
    assert kernel_calls and kernel_calls[0]["causal"] is causal


# All length tests below share one compiled kernel: GQA, causal, lengths.
def test_seq_lengths(kernel_calls):
    # Batch 0 is unpadded, batch 1 padded on both sides. Padded query rows must be 0 with zero
    # gradient, as in jax.nn (which multiplies them by 0).
    q, k, v, do = _inputs()
    ql, kl = _lengths(20, 9), _lengths(24, 13)
    out, _, dq, _, _ = _check(q, k, v, do, dict(causal=True, q_lengths=ql, kv_lengths=kl),
                              is_causal=True, query_seq_lengths=ql, key_value_seq_lengths=kl)
    assert kernel_calls
    np.testing.assert_array_equal(out[1, 9:], 0.0)
    np.testing.assert_array_equal(dq[1, 9:], 0.0)


def test_query_lengths_only():
    q, k, v, do = _inputs()
    ql = _lengths(5, 17)
    _check(q, k, v, do, dict(causal=True, q_lengths=ql), is_causal=True, query_seq_lengths=ql)


def test_key_value_lengths_only_any_integer_dtype():
    # jax.nn wants int32; the drop-in takes any integer dtype.
    q, k, v, do = _inputs()
    kl = jnp.array([3, 24], jnp.int16)
    ours = _outputs_and_grads(lambda q, k, v: pf.dot_product_attention(
        q, k, v, is_causal=True, key_value_seq_lengths=kl), q, k, v, do)
    xla = _outputs_and_grads(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, key_value_seq_lengths=kl.astype(jnp.int32)), q, k, v, do)
    for name, a, x in zip(("out", "dq", "dk", "dv"), ours, xla, strict=True):
        assert_close(f"{name} vs jax.nn", a, x, TOLERANCE[jnp.dtype(jnp.float32)])
    _check(q, k, v, do, dict(causal=True, kv_lengths=kl), is_causal=True,
           key_value_seq_lengths=kl.astype(jnp.int32))


def test_rows_that_see_no_key():
    """The one documented numerical difference from jax.nn: a row that sees no key.

    key_value_seq_lengths 0 for batch 1: the kernels give 0 (and residual -inf); jax.nn, which
    masks with a large finite negative number, gives the mean of all S values. Padded query rows
    are 0 in both.
    """
    q, k, v, do = _inputs()
    ql, kl = _lengths(20, 6), _lengths(24, 0)
    kw = dict(is_causal=True, query_seq_lengths=ql, key_value_seq_lengths=kl)
    (out, res), _ = jax.vjp(lambda q, k, v: pf.dot_product_attention(
        q, k, v, return_residual=True, **kw), q, k, v)
    xla_out, xla_res = jax.nn.dot_product_attention(q, k, v, implementation="xla",
                                                    return_residual=True, **kw)
    tol = TOLERANCE[jnp.dtype(jnp.float32)]
    assert_close("batch 0 out", out[0], xla_out[0], tol)
    np.testing.assert_array_equal(out[1], 0.0)
    assert np.all(np.asarray(res[1]) == -np.inf)
    # jax.nn: padded query rows 0 too, the other rows the mean of the (padded) values.
    np.testing.assert_array_equal(xla_out[1, 6:], 0.0)
    mean_v = jnp.repeat(v[1].mean(axis=0), 2, axis=0)  # [K, H] -> [N, H], GQA group of 2
    assert_close("jax.nn empty rows", xla_out[1, :6], jnp.broadcast_to(mean_v, (6, 4, 16)), tol)
    assert np.all(np.asarray(xla_res[1]) < -1e38)
    # The reference agrees with the kernels everywhere, gradients included.
    ours = _outputs_and_grads(lambda q, k, v: pf.dot_product_attention(q, k, v, **kw),
                              q, k, v, do)
    ref = _outputs_and_grads(lambda q, k, v: pf.reference_attention(
        q, k, v, causal=True, q_lengths=ql, kv_lengths=kl), q, k, v, do)
    for name, a, r in zip(("out", "dq", "dk", "dv"), ours, ref, strict=True):
        assert_close(f"{name} vs reference_attention", a, r, tol)
    np.testing.assert_array_equal(ours[1][1], 0.0)  # dq of batch 1: no key seen, no gradient


def test_local_window_size_tuple(kernel_calls):
    q, k, v, do = _inputs()
    _check(q, k, v, do, dict(window=(2, 1)), local_window_size=(2, 1))
    assert kernel_calls[0]["window"] == (2, 1) and kernel_calls[0]["causal"] is False


def test_local_window_size_int_causal_with_lengths(kernel_calls):
    # An int w is the window (w, w); with is_causal the right side is clamped to 0 (jax.nn ANDs
    # the two masks).
    q, k, v, do = _inputs()
    ql, kl = _lengths(20, 11), _lengths(24, 12)
    _check(q, k, v, do, dict(window=(4, 0), causal=True, q_lengths=ql, kv_lengths=kl),
           local_window_size=4, is_causal=True, query_seq_lengths=ql,
           key_value_seq_lengths=kl)
    assert kernel_calls[0]["window"] == (4, 4) and kernel_calls[0]["causal"] is True


def test_unbatched_rank3_mqa_scale(kernel_calls):
    # [T, N, H] inputs, as jax.nn accepts them (lengths then have shape [1]); MQA; a scale.
    q, k, v, do = _inputs(MQA)
    q, k, v, do = q[0], k[0], v[0], do[0]
    ql, kl = _lengths(15), _lengths(7)
    out = _check(q, k, v, do, dict(causal=True, scale=0.37, q_lengths=ql, kv_lengths=kl),
                 is_causal=True, scale=0.37, query_seq_lengths=ql, key_value_seq_lengths=kl)[0]
    assert out.shape == q.shape
    assert kernel_calls[0]["scale"] == 0.37 and kernel_calls[0]["causal"] is True


def test_bfloat16():
    # jax.nn rounds P to bfloat16 as the kernels do, but not at the same places: both are within
    # the table's tolerance of the float32 reference, so of each other within twice that.
    q, k, v, do = _inputs(dtype=jnp.bfloat16)
    ql = _lengths(20, 15)
    _check(q, k, v, do, dict(causal=True, q_lengths=ql), is_causal=True, query_seq_lengths=ql,
           xla_tol=2 * TOLERANCE[jnp.dtype(jnp.bfloat16)])


# --------------------------------------------------------------------------------------------
# Fallback to XLA, and implementation=
# --------------------------------------------------------------------------------------------


def _causal_additive_bias(t, s):
    return jnp.where(jnp.tril(jnp.ones((t, s), bool)), 0.0, -1e9)[None, None]


def test_bias_falls_back_to_xla(kernel_calls):
    q, k, v, do = _inputs()
    t, s = q.shape[1], k.shape[1]
    # An additive causal mask as the bias: XLA's answer must equal the reference's causal one.
    _check(q, k, v, do, dict(causal=True), bias=_causal_additive_bias(t, s), fallback=True)
    # A random bias per head: no reference, but the drop-in must be jax.nn exactly.
    bias = jax.random.normal(jax.random.PRNGKey(9), (1, 4, t, s))
    ours = _outputs_and_grads(lambda q, k, v: pf.dot_product_attention(q, k, v, bias), q, k, v, do)
    xla = _outputs_and_grads(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, bias, implementation="xla"),
        q, k, v, do)
    for a, b in zip(ours, xla, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not kernel_calls


def test_mask_falls_back_to_xla(kernel_calls):
    q, k, v, do = _inputs()
    kl = _lengths(24, 10)
    t, s = q.shape[1], k.shape[1]
    dense = (jnp.tril(jnp.ones((t, s), bool))[None]
             & (jnp.arange(s)[None, None, :] < kl[:, None, None]))[:, None]  # [B, 1, T, S]
    _check(q, k, v, do, dict(causal=True, kv_lengths=kl), mask=dense, fallback=True)
    # Structured options on top of a mask: all of it goes to XLA. (Query lengths keep the
    # window from emptying rows past the key length, where jax.nn and the reference differ.)
    ql = _lengths(20, 10)
    _check(q, k, v, do, dict(causal=True, q_lengths=ql, kv_lengths=kl, window=(3, 0)),
           mask=dense, query_seq_lengths=ql, key_value_seq_lengths=kl, local_window_size=(3, 2),
           is_causal=True, fallback=True)
    assert not kernel_calls


@pytest.mark.parametrize("case", ["negative-window", "zero-scale", "head-dim-288", "int8"])
def test_other_fallbacks_match_jax_nn(case, kernel_calls):
    q, k, v, _ = _inputs()
    kw = {}
    if case == "negative-window":
        kw = dict(local_window_size=(3, -1), is_causal=True)   # strictly earlier keys
    elif case == "zero-scale":
        kw = dict(scale=0.0)
    elif case == "head-dim-288":
        q, k, v, _ = _inputs((1, 8, 8, 2, 1, 288))   # (a new shape: XLA only, cheap)
    else:
        q, k, v = (jnp.round(4 * x).astype(jnp.int8) for x in (q, k, v))
    np.testing.assert_array_equal(pf.dot_product_attention(q, k, v, **kw),
                                  jax.nn.dot_product_attention(q, k, v, **kw))
    assert not kernel_calls


def test_traced_scale_falls_back(kernel_calls):
    q, k, v, _ = _inputs()
    ours = jax.jit(lambda s: pf.dot_product_attention(q, k, v, scale=s, is_causal=True))(0.3)
    # Both jitted, so both run XLA's float32 matmuls the same way (tf32 on the GPU: an eager
    # jax.nn call differed from the jitted one by 3.4e-4 on our H200).
    xla = jax.jit(lambda s: jax.nn.dot_product_attention(q, k, v, scale=s, is_causal=True))(0.3)
    assert_close("out", ours, xla, TOLERANCE[jnp.dtype(jnp.float32)])
    assert not kernel_calls


@pytest.mark.parametrize("implementation", ["xla", "cudnn"])
def test_xla_and_cudnn_go_to_jax_nn_unchanged(implementation, kernel_calls, monkeypatch):
    seen = []
    original = jax.nn.dot_product_attention

    def fake(*args, **kwargs):
        seen.append(kwargs)
        return original(*args, **{**kwargs, "implementation": "xla"})

    monkeypatch.setattr(jax.nn, "dot_product_attention", fake)
    q, k, v, _ = _inputs()
    kl = _lengths(24, 3)
    out = pf.dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=kl,
                                   local_window_size=2, implementation=implementation)
    assert seen[0]["implementation"] == implementation
    assert seen[0]["local_window_size"] == 2 and seen[0]["key_value_seq_lengths"] is kl
    np.testing.assert_array_equal(out, original(q, k, v, is_causal=True, local_window_size=2,
                                                key_value_seq_lengths=kl))
    assert not kernel_calls


def test_implementation_pallas_and_none_use_the_kernels(kernel_calls):
    q, k, v, _ = _inputs()
    for implementation in ("pallas", None):
        out = _shapes(pf.dot_product_attention, q, k, v, implementation=implementation)
        assert out.shape == q.shape and out.dtype == q.dtype
    assert len(kernel_calls) == 2


def test_extensions_reach_the_kernel(kernel_calls):
    q, k, v, _ = _inputs()
    config = pf.default_config(16, jnp.float32)
    _shapes(pf.dot_product_attention, q, k, v, precision="highest", config=config)
    assert kernel_calls[0]["precision"] == "highest" and kernel_calls[0]["config"] is config
    # Also accepted, unlike jax.nn: numpy ints in local_window_size.
    _shapes(pf.dot_product_attention, q, k, v, local_window_size=(np.int64(3), np.int32(1)))
    assert kernel_calls[1]["window"] == (3, 1)


# --------------------------------------------------------------------------------------------
# Errors: one test per message
# --------------------------------------------------------------------------------------------


def _raises(match, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        pf.dot_product_attention(*args, **kwargs)


def _small():
    q, k, v, _ = _inputs((1, 4, 4, 2, 1, 8))
    return q, k, v


def test_error_unknown_implementation():
    _raises(r"implementation must be one of \(None, 'pallas', 'xla', 'cudnn'\), got 'triton'",
            *_small(), implementation="triton")


def test_error_rank():
    q, k, v = _small()
    _raises(r"query must have rank 4 \[batch, seq, heads, head_dim\] or rank 3 .* got shape "
            r"\(2, 8\)", q[0, 0], k, v)
    _raises(r"value must have rank 4", q, k, v[..., None])


def test_error_value_shape():
    q, k, v = _small()
    _raises(r"value must have the shape of key, got key \(1, 4, 1, 8\) and value \(1, 3, 1, 8\)",
            q, k, v[:, :3])


def test_error_dtype_mismatch():
    q, k, v = _small()
    _raises(r"query, key and value must share one dtype, got query float32, key bfloat16",
            q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))


def test_error_batch_or_head_dim_mismatch():
    q, k, v = _small()
    _raises(r"query and key must agree on batch size and head dim .* got query \(1, 4, 2, 8\) "
            r"and key \(2, 4, 1, 8\)", q, jnp.concatenate([k, k]), jnp.concatenate([v, v]))
    _raises(r"query and key must agree on batch size and head dim", q[..., :4], k, v)


def test_error_heads_not_a_multiple():
    q, k, v = _small()
    k2 = jnp.concatenate([k, k], axis=2)
    _raises(r"the number of query heads \(3\) must be a multiple of the number of key/value "
            r"heads \(2\)", jnp.concatenate([q, q[:, :, :1]], axis=2), k2, k2)


def test_error_lengths():
    q, k, v = _small()
    _raises(r"query_seq_lengths must be an integer array of shape \[B\] = \(1,\), got shape "
            r"\(2,\)", q, k, v, query_seq_lengths=_lengths(1, 2))
    _raises(r"key_value_seq_lengths must be an integer array .* dtype float32", q, k, v,
            key_value_seq_lengths=jnp.array([2.0]))


@pytest.mark.parametrize("window", [(1, 2, 3), 2.5, (1, None), True])
def test_error_local_window_size(window):
    _raises(r"local_window_size must be None, an int or a \(left, right\) pair of ints",
            *_small(), local_window_size=window)


def test_error_pallas_cannot_serve():
    q, k, v = _small()
    bias = jnp.zeros((1, 1, 4, 4))
    mask = jnp.ones((1, 1, 4, 4), bool)
    _raises(r"implementation='pallas' cannot serve this call \(a dense bias; a dense mask\); "
            r"use implementation=None", q, k, v, bias, mask, implementation="pallas")


# --------------------------------------------------------------------------------------------
# Flax adapter (examples/flax_adapter.py)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter():
    """The example loaded by path, with Flax made unimportable: the adapter must not need it."""
    saved = sys.modules.get("flax", "missing")
    sys.modules["flax"] = None  # `import flax` now raises ImportError
    try:
        spec = importlib.util.spec_from_file_location("flax_adapter_example", _ADAPTER)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved == "missing":
            del sys.modules["flax"]
        else:
            sys.modules["flax"] = saved
    return module


def _nnx_kwargs(**overrides):
    """The keyword arguments nnx.MultiHeadAttention passes to its attention_fn."""
    kwargs = dict(mask=None, dropout_rng=None, dropout_rate=0.0, broadcast_dropout=True,
                  deterministic=True, dtype=None, precision=None, module=None, is_causal=False)
    kwargs.update(overrides)
    return kwargs


def _split(x):
    """[2, ...] -> [1, 2, ...]: two leading batch dims, as Flax allows."""
    return x.reshape(1, *x.shape)


def test_adapter_causal_with_two_batch_dims(adapter, kernel_calls):
    # is_causal goes to the kernels; two batch dims are flattened and restored; dropout_rate > 0
    # is fine when deterministic (evaluation).
    q, k, v, do = _inputs()
    fn = lambda q, k, v: adapter.flash_attention_fn(  # noqa: E731
        q, k, v, **_nnx_kwargs(is_causal=True, dropout_rate=0.1, deterministic=True))
    ours = _outputs_and_grads(fn, _split(q), _split(k), _split(v), _split(do))
    ref = _outputs_and_grads(lambda q, k, v: pf.reference_attention(q, k, v, causal=True),
                             q, k, v, do)
    xla = _outputs_and_grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                             q, k, v, do)
    tol = TOLERANCE[jnp.dtype(jnp.float32)]
    for name, a, r, x in zip(("out", "dq", "dk", "dv"), ours, ref, xla, strict=True):
        assert a.shape == (1, *r.shape), name
        assert_close(f"{name} vs reference", a[0], r, tol)
        assert_close(f"{name} vs jax.nn", a[0], x, tol)
    assert kernel_calls and kernel_calls[0]["causal"] is True


def test_adapter_dtype_is_promoted(adapter, kernel_calls):
    q, k, v, do = _inputs(dtype=jnp.bfloat16)
    fn = lambda q, k, v: adapter.flash_attention_fn(  # noqa: E731
        q, k, v, **_nnx_kwargs(is_causal=True, dtype=jnp.float32))
    out = _outputs_and_grads(fn, q, k, v, do)[0]
    assert out.dtype == jnp.float32 and kernel_calls
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    assert_close("out", out, pf.reference_attention(up(q), up(k), up(v), causal=True),
                 TOLERANCE[jnp.dtype(jnp.float32)])


def test_adapter_mask_goes_to_xla(adapter, kernel_calls):
    q, k, v, _ = _inputs()
    split = lambda x: x.reshape(2, 1, *x.shape[1:])  # noqa: E731
    # A padding mask broadcast over the second batch dim and the heads: [2, 1, 1, T, S].
    valid = jnp.arange(24)[None, :] < jnp.array([24, 5])[:, None]
    mask = jnp.broadcast_to(valid[:, None, None, None, :], (2, 1, 1, 20, 24))
    out = adapter.flash_attention_fn(split(q), split(k), split(v),
                                     **_nnx_kwargs(mask=mask, is_causal=True))
    full_mask = mask.reshape(2, 1, 20, 24)
    xla = jax.nn.dot_product_attention(q, k, v, mask=full_mask, is_causal=True)
    np.testing.assert_array_equal(out.reshape(xla.shape), xla)
    # No batch dims at all: [length, heads, head_dim].
    out3 = adapter.flash_attention_fn(q[0], k[0], v[0], **_nnx_kwargs(mask=full_mask[0]))
    np.testing.assert_array_equal(out3, jax.nn.dot_product_attention(q[0], k[0], v[0],
                                                                     mask=full_mask[0]))
    assert not kernel_calls


def test_adapter_error_dropout(adapter):
    q, k, v = _small()
    with pytest.raises(ValueError, match=r"flash_attention_fn has no attention dropout, got "
                                         r"dropout_rate=0.1 with deterministic=False"):
        adapter.flash_attention_fn(q, k, v, **_nnx_kwargs(dropout_rate=0.1, deterministic=False))


def test_adapter_error_sow_weights(adapter):
    q, k, v = _small()
    with pytest.raises(ValueError, match=r"cannot sow attention weights"):
        adapter.flash_attention_fn(q, k, v, **_nnx_kwargs(module=object()))


def test_adapter_error_rank(adapter):
    q, k, v = _small()
    with pytest.raises(ValueError, match=r"query, key and value must have one rank >= 3"):
        adapter.flash_attention_fn(q, k[0], v[0], **_nnx_kwargs())


def test_adapter_error_batch_dims(adapter):
    q, k, v = _small()
    with pytest.raises(ValueError, match=r"query, key and value must share their batch dims"):
        adapter.flash_attention_fn(q, jnp.concatenate([k, k]), jnp.concatenate([v, v]),
                                   **_nnx_kwargs())


def test_adapter_error_mask_rank(adapter):
    q, k, v = _small()
    split = lambda x: x.reshape(1, 1, *x.shape[1:])  # noqa: E731
    with pytest.raises(ValueError, match=r"mask must be broadcastable to \[batch\.\.\., "
                                         r"num_heads, q_length, kv_length\] with at least 3 dims"):
        adapter.flash_attention_fn(split(q), split(k), split(v),
                                   **_nnx_kwargs(mask=jnp.ones((4, 4), bool)))


def test_adapter_with_flax_nnx(adapter):
    # Skips where Flax is missing (CI need not have it) or cannot import against this jax.
    pytest.importorskip("flax.nnx", exc_type=ImportError)
    result = adapter.main([])
    # Relative differences from nnx.MultiHeadAttention with Flax's own attention_fn.
    tol = TOLERANCE[jnp.dtype(jnp.float32)]
    assert result["causal_out"] < tol and result["causal_grad"] < tol, result
    assert result["mask_out"] == 0.0 and result["mask_grad"] == 0.0, result
