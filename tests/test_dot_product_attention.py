"""pallas_flash.dot_product_attention, the jax.nn drop-in: kernel path, masks, fallbacks, errors.

Every numerical case is compared twice, on the output and on dq, dk, dv for a random output
cotangent: against ``jax.nn.dot_product_attention(implementation="xla")`` given the same
arguments, and against `reference_attention` given the equivalent `flash_attention` options,
written out by hand in each case (so that the argument mapping itself is under test). Dense
masks are compared with jax.nn on the rows that see a key (the documented difference: rows that
see none give 0 here), and with the reference everywhere. A per-head mask or a random bias,
which `reference_attention` has no option for, is compared with `_dense_reference` (float32 at
HIGHEST precision) instead. Exceptions: the soft cap, which jax.nn lacks, is compared with the
reference only; and the fallbacks whose contract is to hand the call to jax.nn unchanged (a
negative window, scale 0, head_dim 288, int8, implementation="xla"/"cudnn") must equal jax.nn
exactly.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
import pallas_flash.nn as pf_nn
from pallas_flash import xla_attention
from helpers import TOLERANCE, assert_close, random_inputs

# (batch, seq_q, seq_kv, q_heads, kv_heads, head_dim): seq_q < seq_kv keeps every query row of
# the windows below non-empty (test_rows_that_see_no_key covers the empty ones). The kernels are
# compiled once per shape and option set (about 5 s in interpret mode on two cores), so the
# tests share shapes and options where they can, and call eagerly so that the compiled kernels
# are reused across tests.
# MQA is covered by the unbatched test, MHA by tests/test_flax.py (nnx.MultiHeadAttention's
# default).
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


def _dense_reference(q, k, v, *, mask=None, bias=None):
    """softmax(q k^T / sqrt(head_dim) + bias, where mask) v in float32 at HIGHEST precision, on
    [B, T, N, H] inputs with GQA (query head n reads kv head n // group, as in jax.nn): for the
    masks and biases that reference_attention has no option for. Every row must see a key."""
    highest = jax.lax.Precision.HIGHEST
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k, precision=highest) / np.sqrt(q.shape[-1])
    if bias is not None:
        logits = logits + bias
    if mask is not None:
        logits = jnp.where(mask, logits, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), v, precision=highest)


def _check(q, k, v, do, ref_kwargs, *, xla_tol=None, fallback=False, empty_rows_differ=False,
           **kwargs):
    """dot_product_attention(**kwargs) against jax.nn (xla) and reference_attention(**ref_kwargs).

    Compares the output, the residual (the logsumexp, whose gradient must be stopped: it gets
    a random cotangent, and dq, dk, dv must still match the reference's, which has none) and
    dq, dk, dv. The table's tolerance applies against the reference; against jax.nn, xla_tol.
    fallback: the call goes to jax.nn, whose residual is finite (about -2.4e38) on empty rows.
    empty_rows_differ: rows that see no key (from a mask) are 0 here and the mean of the values
    in jax.nn; jax.nn then runs with zero cotangents on them, as under a loss that ignores
    padding, and its output and residual are compared on the other rows only.
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
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = run(lambda q, k, v: _reference(q, k, v, **ref_kwargs), up(q), up(k), up(v), up(do),
              jnp.zeros_like(dres))
    # Rows that see no key: residual -inf here (about -2.4e38 in jax.nn; see the docstring).
    seen = np.isfinite(np.asarray(ref[1]))
    if empty_rows_differ:
        do, dres = do * seen[..., None], dres * seen
    xla = run(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, implementation="xla", return_residual=True, **kwargs), q, k, v, do, dres)

    out, res = ours[:2]
    assert out.shape == q.shape and out.dtype == q.dtype
    assert res.shape == q.shape[:-1] and res.dtype == xla[1].dtype == k.dtype
    if not fallback:
        np.testing.assert_array_equal(np.isfinite(np.asarray(res, np.float32)), seen)
    for name, a, x, r, inp in zip(("out", "residual", "dq", "dk", "dv"), ours, xla, ref,
                                  (q, k, q, k, v), strict=True):
        assert a.dtype == inp.dtype, f"{name}: dtype {a.dtype} != {inp.dtype}"
        floor = 0.0
        if name == "residual":  # a log: absolute error in units of the logits
            a, x, r = (np.where(seen, np.asarray(t, np.float32), 0.0) for t in (a, x, r))
            floor = 1.0
        if name == "out" and empty_rows_differ:
            np.testing.assert_array_equal(np.asarray(a)[~seen], 0.0)
            x = np.where(seen[..., None], np.asarray(x), 0.0)
        assert_close(f"{name} vs reference_attention", a, r, tol, floor)
        assert_close(f"{name} vs jax.nn.dot_product_attention", a, x, xla_tol, floor)
    return ours


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test starts as a fresh process would, with no fallback warned about yet."""
    monkeypatch.setattr(pf_nn, "_WARNED", set())


def _fallback_warnings(record):
    return [w for w in record if issubclass(w.category, pf_nn.FallbackWarning)]


def _lengths(*values):
    return jnp.array(values, jnp.int32)


def _valid(lengths, n):
    """[B, n] boolean: position < length (trailing padding)."""
    return jnp.arange(n)[None, :] < lengths[:, None]


def _causal(t, s):
    """[1, 1, t, s]: query i sees keys j <= i (jnp.tril, as nn.make_causal_mask)."""
    return jnp.tril(jnp.ones((t, s), bool))[None, None]


def _attention_mask(q_valid, kv_valid):
    """[B, 1, T, S], as flax's nn.make_attention_mask(q_valid, kv_valid)."""
    return q_valid[:, None, :, None] & kv_valid[:, None, None, :]


def _window_mask(t, s, left):
    """[1, 1, t, s]: query i sees keys i - left <= j <= i, a pattern the kernels take only
    as local_window_size, not as a mask."""
    i, j = jnp.arange(t)[:, None], jnp.arange(s)[None, :]
    return ((j <= i) & (j >= i - left))[None, None]


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
    # A random bias per head: the drop-in must be jax.nn exactly, and match the dense reference
    # (reference_attention takes no bias).
    bias = jax.random.normal(jax.random.PRNGKey(9), (1, 4, t, s))
    ours = _outputs_and_grads(lambda q, k, v: pf.dot_product_attention(q, k, v, bias), q, k, v, do)
    xla = _outputs_and_grads(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, bias, implementation="xla"),
        q, k, v, do)
    ref = _outputs_and_grads(lambda q, k, v: _dense_reference(q, k, v, bias=bias), q, k, v, do)
    for name, a, x, r in zip(("out", "dq", "dk", "dv"), ours, xla, ref, strict=True):
        np.testing.assert_array_equal(a, x)
        assert_close(f"{name} vs the dense float32 reference", a, r, TOLERANCE[jnp.dtype(q.dtype)])
    assert not kernel_calls


def test_mask_and_structured_options_together(kernel_calls):
    # jax.nn ANDs a mask with is_causal, the lengths and the window; the mask is checked within
    # what those allow. A causal & key padding mask with query lengths and a window on top.
    q, k, v, do = _inputs()
    kl, ql = _lengths(24, 10), _lengths(20, 10)
    dense = (_causal(20, 24) & _valid(kl, 24)[:, None, None, :])             # [B, 1, T, S]
    _check(q, k, v, do, dict(causal=True, q_lengths=ql, kv_lengths=kl, window=(3, 0)),
           mask=dense, query_seq_lengths=ql, key_value_seq_lengths=kl, local_window_size=(3, 2),
           is_causal=True, empty_rows_differ=True)
    assert kernel_calls[0]["causal"] is True and kernel_calls[0]["window"] == (3, 2)


@pytest.mark.parametrize("case", ["negative-window", "zero-scale", "negative-scale",
                                  "subnormal-scale", "head-dim-288", "int8"])
def test_other_fallbacks_match_jax_nn(case, kernel_calls):
    q, k, v, _ = _inputs()
    kw = {}
    if case == "negative-window":
        kw = dict(local_window_size=(3, -1), is_causal=True)   # strictly earlier keys
    elif case == "zero-scale":
        kw = dict(scale=0.0)
    elif case == "negative-scale":   # the kernels' running maximum assumes a positive scale
        kw = dict(scale=-0.5)
    elif case == "subnormal-scale":
        kw = dict(scale=1e-40)
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
    ref = pf.reference_attention(q, k, v, scale=0.3, causal=True)
    tol = TOLERANCE[jnp.dtype(q.dtype)]
    assert_close("out vs jax.nn", ours, xla, tol)
    assert_close("out vs reference_attention", ours, ref, tol)
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


def test_error_rank_checked_before_shapes_are_read():
    q, k, _, _ = _inputs()
    with pytest.raises(ValueError, match=r"value must have rank 4 .* got shape \(\)"):
        pf.dot_product_attention(q, k, jnp.float32(1.0))


def test_error_empty_dimension():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match=r"query must have every dimension >= 1"):
        pf.dot_product_attention(q[:, :0], k, v)


@pytest.mark.parametrize("scale", ["abc", True, [0.5], jnp.ones(2)])
def test_error_scale_not_a_real_number(scale):
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match=r"scale must be None or a real number"):
        pf.dot_product_attention(q, k, v, scale=scale)


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
    _raises(r"implementation='pallas' cannot serve this call \(a dense bias; dtype int8\); "
            r"use implementation=None", q.astype(jnp.int8), k.astype(jnp.int8),
            v.astype(jnp.int8), bias, implementation="pallas")
    window = _window_mask(4, 4, 1)
    _raises(r"implementation='pallas' cannot serve this call \(a mask that is not causal, "
            r"padding, packed segments or their product\)", q, k, v, mask=window,
            implementation="pallas")
    with pytest.raises(ValueError, match=r"implementation='pallas' cannot serve a traced mask"):
        jax.jit(lambda m: pf.dot_product_attention(q, k, v, mask=m, implementation="pallas"))(
            jnp.ones((4, 4), bool))


def test_error_mask():
    q, k, v = _small()
    _raises(r"mask must be a boolean array \(True = attend\), got dtype float32", q, k, v,
            mask=jnp.ones((4, 4)))
    _raises(r"mask must be broadcastable to \[B, N, T, S\] = \(1, 2, 4, 4\) with rank at most "
            r"4, got shape \(1, 1, 1, 4, 4\)", q, k, v, mask=jnp.ones((1, 1, 1, 4, 4), bool))
    _raises(r"mask must be broadcastable .* got shape \(3, 4\)", q, k, v,
            mask=jnp.ones((3, 4), bool))
    _raises(r"mask must be broadcastable .* got shape \(1, 4, 4, 4\)", q, k, v,
            mask=jnp.ones((1, 4, 4, 4), bool))


def test_error_bias():
    """A bias that does not broadcast to the logits fails before jax.nn's arithmetic does."""
    q, k, v = _small()
    _raises(r"bias must be broadcastable to \[B, N, T, S\] = \(1, 2, 4, 4\) with rank at most "
            r"4, got shape \(4, 5\)", q, k, v, bias=jnp.ones((4, 5)))
    _raises(r"bias must be broadcastable .* got shape \(1, 1, 1, 4, 4\)", q, k, v,
            bias=jnp.ones((1, 1, 1, 4, 4)))


@pytest.mark.parametrize("cap", [0.0, -1.0, float("inf"), float("nan"), True, "5", (5.0,)])
def test_error_logits_soft_cap(cap):
    _raises(r"logits_soft_cap must be None or a positive float", *_small(), logits_soft_cap=cap)


def test_error_logits_soft_cap_traced_or_xla_only():
    q, k, v = _small()
    with pytest.raises(ValueError, match=r"logits_soft_cap must be a static Python float, got a "
                                         r"traced value"):
        jax.jit(lambda c: pf.dot_product_attention(q, k, v, logits_soft_cap=c))(5.0)
    _raises(r"logits_soft_cap is served by the Pallas kernels only; implementation='xla' "
            r"\(jax.nn.dot_product_attention\) has no soft cap", q, k, v, logits_soft_cap=5.0,
            implementation="xla")
    _raises(r"logits_soft_cap is served by the Pallas kernels only, and they cannot serve this "
            r"call \(a dense bias\); jax.nn.dot_product_attention, which would, has no soft cap",
            q, k, v, jnp.zeros((1, 1, 4, 4)), logits_soft_cap=5.0)


# --------------------------------------------------------------------------------------------
# Dense masks the kernels serve
# --------------------------------------------------------------------------------------------

# Batch 0 unpadded, batch 1 padded on both sides (as in test_seq_lengths).
_QL, _KL = (20, 9), (24, 13)
# Packed documents: per batch row, where each segment starts (queries, keys).
_Q_STARTS, _KV_STARTS = ((0, 6, 14), (0, 11, 11)), ((0, 6, 15), (0, 3, 12))


def _segment_ids(starts, n):
    pos = jnp.arange(n)
    return jnp.stack([jnp.searchsorted(jnp.array(s), pos, side="right") - 1 for s in starts])


def _mask_case(kind):
    """(mask, the equivalent reference_attention options, whether the causal kernel serves)."""
    ql, kl = _lengths(*_QL), _lengths(*_KL)
    padding = _attention_mask(_valid(ql, 20), _valid(kl, 24))
    lengths = dict(q_lengths=ql, kv_lengths=kl)
    if kind == "causal":
        return _causal(20, 24), dict(causal=True), True
    if kind == "padding":
        return padding, lengths, False
    if kind == "causal-and-padding":
        return _causal(20, 24) & padding, dict(causal=True, **lengths), True
    if kind == "key-padding":
        return _valid(kl, 24)[:, None, None, :], dict(kv_lengths=kl), False
    if kind == "per-head-copies":
        return jnp.broadcast_to(padding, (2, 4, 20, 24)), lengths, False
    if kind == "leading-padding-causal":
        starts = _lengths(0, 6)
        q_valid = jnp.arange(20)[None] >= starts[:, None]
        kv_valid = jnp.arange(24)[None] >= starts[:, None]
        ids = dict(q_segment_ids=jnp.where(q_valid, 0, 1), kv_segment_ids=jnp.where(kv_valid, 0, 2))
        return _causal(20, 24) & _attention_mask(q_valid, kv_valid), dict(causal=True, **ids), True
    if kind == "packed-documents":
        q_ids, kv_ids = _segment_ids(_Q_STARTS, 20), _segment_ids(_KV_STARTS, 24)
        mask = (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
        return mask, dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids), False
    if kind == "packed-documents-causal":
        mask, ids, _ = _mask_case("packed-documents")
        return mask & _causal(20, 24), dict(causal=True, **ids), True
    raise ValueError(kind)


MASK_KINDS = ["causal", "padding", "causal-and-padding", "key-padding", "per-head-copies",
              "leading-padding-causal", "packed-documents", "packed-documents-causal"]


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_mask_served_by_the_kernels(kind, kernel_calls):
    q, k, v, do = _inputs()
    mask, ref_kwargs, causal = _mask_case(kind)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _check(q, k, v, do, ref_kwargs, mask=mask, empty_rows_differ=True)
    assert not _fallback_warnings(record)
    assert kernel_calls and all(c["causal"] is causal for c in kernel_calls)
    assert kernel_calls[0]["q_segment_ids"].shape == (2, 20)
    assert kernel_calls[0]["kv_segment_ids"].shape == (2, 24)


def test_mask_rank_2_and_unbatched(kernel_calls):
    # A [T, S] mask, as jax.nn takes it, on [T, N, H] inputs.
    q, k, v, do = _inputs(MQA)
    q, k, v, do = q[0], k[0], v[0], do[0]
    _check(q, k, v, do, dict(causal=True), mask=_causal(20, 24)[0, 0])
    assert kernel_calls[0]["causal"] is True


def test_mask_with_is_causal_needs_only_its_causal_part(kernel_calls):
    # With is_causal, only the causal region of the mask counts: a padding mask without a
    # causal factor is served by the causal kernel.
    q, k, v, do = _inputs()
    mask, ref_kwargs, _ = _mask_case("padding")
    _check(q, k, v, do, dict(causal=True, **ref_kwargs), mask=mask, is_causal=True,
           empty_rows_differ=True)
    assert kernel_calls[0]["causal"] is True


def test_logits_soft_cap(kernel_calls):
    q, k, v, do = _inputs()
    # Without a mask, and with one (causal & padding) on the kernels.
    _check_reference(q, k, v, do, dict(causal=True, softcap=2.5), is_causal=True,
                     logits_soft_cap=2.5)
    mask, ref_kwargs, _ = _mask_case("causal-and-padding")
    _check_reference(q, k, v, do, dict(softcap=2.5, **ref_kwargs), mask=mask,
                     logits_soft_cap=2.5)
    assert [c["softcap"] for c in kernel_calls] == [2.5, 2.5]


def _check_reference(q, k, v, do, ref_kwargs, **kwargs):
    """Output, residual, dq, dk, dv against reference_attention only (jax.nn has no soft cap)."""
    dres = jax.random.normal(jax.random.PRNGKey(5), do.shape[:-1], jnp.float32)

    def run(fn, dres):
        (out, res), vjp = jax.vjp(fn, q, k, v)
        return (out, res, *vjp((do, dres)))

    # The residual's gradient is stopped: its random cotangent must change nothing.
    ours = run(lambda q, k, v: pf.dot_product_attention(q, k, v, return_residual=True, **kwargs),
               dres)
    ref = run(lambda q, k, v: _reference(q, k, v, **ref_kwargs), jnp.zeros_like(dres))
    tol = TOLERANCE[jnp.dtype(q.dtype)]
    seen = np.isfinite(np.asarray(ref[1]))
    np.testing.assert_array_equal(np.isfinite(np.asarray(ours[1])), seen)
    for name, a, r in zip(("out", "residual", "dq", "dk", "dv"), ours, ref, strict=True):
        floor = 0.0
        if name == "residual":
            a, r, floor = np.where(seen, a, 0.0), np.where(seen, r, 0.0), 1.0
        assert_close(f"{name} vs reference_attention", a, r, tol, floor)


# --------------------------------------------------------------------------------------------
# Dense masks the kernels cannot serve: XLA, chunked, with a warning
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_unserved_mask_falls_back_and_warns_once(chunked, kernel_calls, monkeypatch):
    # A sliding window given as a mask (the kernels take it only as local_window_size).
    # Chunked: the fallback takes 8 query rows at a time (20 rows: the last chunk padded).
    if chunked:
        monkeypatch.setattr(xla_attention, "FALLBACK_CHUNK_ELEMENTS", 8 * 2 * 4 * 24)
        assert xla_attention.chunk_rows(2, 4, 20, 24) == 8
    q, k, v, do = _inputs()
    mask = _window_mask(20, 24, 3)
    with pytest.warns(pf_nn.FallbackWarning, match=r"falls back to XLA \(a mask that is not "
                      r"causal, padding, packed segments or their product\), which materialises "
                      r"the attention logits") as record:
        _check(q, k, v, do, dict(causal=True, window=(3, 0)), mask=mask)
        _check_reference(q, k, v, do, dict(causal=True, window=(3, 0), softcap=4.0),
                         mask=mask, logits_soft_cap=4.0)
    assert len(_fallback_warnings(record)) == 1
    assert not kernel_calls


@pytest.mark.parametrize("kind", ["per-head", "bottom-right-causal"])
def test_other_unserved_masks(kind, kernel_calls):
    q, k, v, do = _inputs()
    if kind == "per-head":   # heads 0 and 1 causal, heads 2 and 3 see everything
        mask = jnp.concatenate([_causal(20, 24)] * 2 + [jnp.ones((1, 2, 20, 24), bool)], axis=1)
        ours = _outputs_and_grads(lambda q, k, v: pf.dot_product_attention(q, k, v, mask=mask),
                                  q, k, v, do)
        xla = _outputs_and_grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask),
                                 q, k, v, do)
        # reference_attention has no per-head mask: the dense float32 reference takes it.
        ref = _outputs_and_grads(lambda q, k, v: _dense_reference(q, k, v, mask=mask),
                                 q, k, v, do)
        tol = TOLERANCE[jnp.dtype(q.dtype)]
        for name, a, x, r in zip(("out", "dq", "dk", "dv"), ours, xla, ref, strict=True):
            assert_close(f"{name} vs the dense float32 reference", a, r, tol)
            assert_close(f"{name} vs jax.nn", a, x, tol)
    else:
        mask = jnp.tril(jnp.ones((20, 24), bool), k=4)
        _check(q, k, v, do, dict(causal=True, causal_alignment="bottom_right"), mask=mask)
    assert not kernel_calls


# --------------------------------------------------------------------------------------------
# Traced masks: checked at run time
# --------------------------------------------------------------------------------------------


_TRACED = {}


def _traced_step(is_causal):
    """One jitted output-and-vjp per is_causal for every test here: the switch compiles every
    branch (both kernels and the fallback), which is what takes the time in interpret mode."""
    if is_causal not in _TRACED:
        @jax.jit
        def step(q, k, v, do, mask):
            out, vjp = jax.vjp(lambda q, k, v: pf.dot_product_attention(
                q, k, v, mask=mask, is_causal=is_causal), q, k, v)
            return (out, *vjp(do))
        _TRACED[is_causal] = step
    return _TRACED[is_causal]


def _compare_traced(is_causal, mask, ref_kwargs):
    q, k, v, do = _inputs()
    ours = _traced_step(is_causal)(q, k, v, do, mask)
    jax.effects_barrier()
    ref = _outputs_and_grads(lambda q, k, v: pf.reference_attention(q, k, v, **ref_kwargs),
                             q, k, v, do)
    for name, a, r in zip(("out", "dq", "dk", "dv"), ours, ref, strict=True):
        assert_close(f"{name} vs reference_attention", a, r, TOLERANCE[jnp.dtype(jnp.float32)])


def test_traced_mask_has_both_kernels_and_the_fallback():
    q, k, v, do = _inputs()
    jaxpr = str(jax.make_jaxpr(_traced_step(False))(q, k, v, do, _causal(20, 24)))
    assert "switch" in jaxpr or "cond" in jaxpr
    for name in ("pallas_flash_fwd", "pallas_flash_bwd_dkdv", "pallas_flash_bwd_dq"):
        assert name in jaxpr


@pytest.mark.parametrize("kind", ["causal-and-padding", "packed-documents", "padding"])
def test_traced_mask_served_by_the_kernels(kind):
    mask, ref_kwargs, _ = _mask_case(kind)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _compare_traced(False, mask, ref_kwargs)
    assert not _fallback_warnings(record)   # so the kernel branch ran


def test_traced_mask_falls_back_at_run_time_and_warns_once():
    with pytest.warns(pf_nn.FallbackWarning, match=r"a mask that is not causal, padding, "
                      r"packed segments or their product, found at run time") as record:
        for _ in range(2):
            _compare_traced(False, _window_mask(20, 24, 3), dict(causal=True, window=(3, 0)))
    assert len(_fallback_warnings(record)) == 1


def test_traced_mask_with_is_causal():
    # Two branches only (the causal kernel, the fallback); the mask's padding on the kernels.
    mask, ref_kwargs, _ = _mask_case("padding")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _compare_traced(True, mask, dict(causal=True, **ref_kwargs))
    assert not _fallback_warnings(record)
    with pytest.warns(pf_nn.FallbackWarning, match="found at run time"):
        _compare_traced(True, _window_mask(20, 24, 3), dict(causal=True, window=(3, 0)))


# --------------------------------------------------------------------------------------------
# Warnings for the other fallbacks
# --------------------------------------------------------------------------------------------


def test_fallback_warns_once_per_reason():
    q, k, v, _ = _inputs()
    bias = jnp.zeros((1, 1, 20, 24))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            pf.dot_product_attention(q, k, v, bias)
        pf.dot_product_attention(q, k, v, scale=0.0)
        pf.dot_product_attention(q, k, v, bias, scale=0.0)
        pf.dot_product_attention(q, k, v, is_causal=True)   # the kernels: no warning
    messages = [str(w.message) for w in _fallback_warnings(record)]
    assert len(messages) == 2, messages
    assert "falls back to XLA (a dense bias), which materialises the attention logits, T x S " \
           "per head, instead of running the flash kernels" in messages[0]
    assert ("falls back to XLA (scale 0.0 (the kernels need a static, positive float, normal "
            "in float32))") in messages[1]
    assert all("Shown once per process for each reason" in m for m in messages)
