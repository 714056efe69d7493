"""Attention sinks: one extra softmax logit per query head with no value row (gpt-oss)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import pallas_flash as pf
from helpers import ON_GPU, assert_close, check_against_reference, random_inputs, tolerance
from backends import IS_HOPPER

COMPILED_ONLY = pytest.mark.skipif(not ON_GPU, reason="the Mosaic kernels run compiled on sm_90")


def _sinks(key, heads, dtype=jnp.float32):
    # Spread around the logits' own range, so the sink sometimes dominates a row and sometimes not.
    return (2.0 * jax.random.normal(key, (heads,), jnp.float32)).astype(dtype)


VARIANTS = [
    pytest.param(dict(), id="full"),
    pytest.param(dict(causal=True), id="causal"),
    pytest.param(dict(causal=True, causal_alignment="bottom_right"), id="bottom-right"),
    pytest.param(dict(window=(9, 3)), id="window"),
    pytest.param(dict(causal=True, softcap=5.0), id="softcap"),
    pytest.param(dict(lengths=True), id="lengths"),
    pytest.param(dict(segments=True, causal=True), id="segments"),
]


def _mask_kwargs(opts, key, batch, seq_q, seq_kv):
    opts = dict(opts)
    if opts.pop("lengths", False):
        # Batch 0 keeps a few queries and no keys at all: rows that see nothing but the sink.
        opts["q_lengths"] = jnp.array([seq_q - 5, seq_q], jnp.int32)[:batch]
        opts["kv_lengths"] = jnp.array([0, seq_kv - 3], jnp.int32)[:batch]
    if opts.pop("segments", False):
        ids = jnp.sort(jax.random.randint(key, (batch, seq_q), 0, 3), axis=1)
        opts["q_segment_ids"] = ids
        opts["kv_segment_ids"] = ids
    return opts


@pytest.mark.parametrize("backend", ["triton", pytest.param("auto", marks=COMPILED_ONLY),
                                     pytest.param("mosaic", marks=COMPILED_ONLY)])
@pytest.mark.parametrize("opts", VARIANTS)
def test_matches_reference(opts, backend):
    """O, lse and dq, dk, dv against reference_attention(sinks=...), random cotangents."""
    dtype = jnp.bfloat16 if ON_GPU else jnp.float32
    d = 64 if ON_GPU else 32
    seq = 200 if ON_GPU else 45
    keys = jax.random.split(jax.random.key(3), 3)
    q, k, v, do = random_inputs(keys[0], 2, seq, seq, 4, 2, d, dtype)
    kwargs = _mask_kwargs(opts, keys[1], 2, seq, seq)
    check_against_reference(q, k, v, do, sinks=_sinks(keys[2], 4), backend=backend, **kwargs)


@pytest.mark.parametrize("opts", VARIANTS[:2] + VARIANTS[5:6])
def test_sink_gradient_matches_reference_and_the_closed_form(opts):
    keys = jax.random.split(jax.random.key(5), 4)
    q, k, v, do = random_inputs(keys[0], 2, 33, 40, 4, 1, 16, jnp.float32)
    kwargs = _mask_kwargs(opts, keys[1], 2, 33, 40)
    sinks = _sinks(keys[2], 4)
    dlse = jax.random.normal(keys[3], (2, 4, 33), jnp.float32)

    got = _sink_grads(pf.flash_attention, q, k, v, do, dlse, sinks, kwargs)
    want = _sink_grads(pf.reference_attention, q, k, v, do, dlse, sinks, kwargs)
    assert_close("d sinks", got, want, tolerance(jnp.float32))
    closed = jnp.sum(_sink_grad_terms(q, k, v, do, dlse, sinks, kwargs), axis=(0, 2))
    assert_close("d sinks, closed form", got, closed, tolerance(jnp.float32))


def _sink_grads(fn, q, k, v, do, dlse, sinks, kwargs):
    def loss(sinks):
        out, lse = fn(q, k, v, sinks=sinks, return_lse=True, **kwargs)
        return (jnp.sum(out.astype(jnp.float32) * do)
                + jnp.sum(jnp.where(jnp.isfinite(lse), lse * dlse, 0.0)))
    # Waited for, so that nothing is dispatched while an interpreted Mosaic kernel still runs
    # (tests/helpers.py, outputs_and_grads).
    return jax.block_until_ready(jax.grad(loss)(sinks))


def _sink_grad_terms(q, k, v, do, dlse, sinks, kwargs):
    """The reference's terms of the sinks' gradient, [batch, q_heads, seq_q] in float32: the
    closed form -exp(sink - lse_i) * D_i, with D_i = rowsum(dO_i * O_i) - dlse_i, whose sum
    over batch and rows is the gradient."""
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    out, lse = pf.reference_attention(up(q), up(k), up(v), sinks=sinks, return_lse=True,
                                      **kwargs)
    big_d = jnp.einsum("bqhd,bqhd->bhq", up(do), out) - dlse
    return -jnp.exp(sinks[None, :, None] - lse) * big_d


def assert_sink_grads_close(got, q, k, v, do, dlse, sinks, kwargs, tol):
    """The sinks' gradient `got` against the float32 reference's, for inputs in a low dtype.

    A head's gradient is a sum of terms of either sign (`_sink_grad_terms`), whose D_i is
    formed from O as the forward stored it, in the input dtype (as every FlashAttention
    backward forms it). That rounding errs by a fraction of the terms' magnitudes, and the sum
    can cancel to far less than them (PINNED["sink_gradient_cancels"] in test_properties), so
    the error is measured against the norm of each head's sum of |terms| at the dtype's usual
    tolerance, not against the sum."""
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = _sink_grads(pf.reference_attention, up(q), up(k), up(v), up(do), dlse, sinks, kwargs)
    magnitude = jnp.sum(jnp.abs(_sink_grad_terms(q, k, v, do, dlse, sinks, kwargs)), axis=(0, 2))
    floor = float(jnp.linalg.norm(magnitude)) / np.sqrt(magnitude.size)
    assert_close("d sinks", got, want, tol, floor=floor)


@pytest.mark.skipif(ON_GPU and not IS_HOPPER, reason="Mosaic GPU kernel needs sm_90")
@pytest.mark.parametrize("opts", VARIANTS[1:2] + VARIANTS[5:6])
def test_mosaic_matches_reference(opts):
    """The Mosaic kernels' sink epilogue (compiled on Hopper, interpreted on CPU): O, lse, dq,
    dk, dv and the sinks' gradient, with rows that see only the sink (lengths)."""
    keys = jax.random.split(jax.random.key(11), 4)
    q, k, v, do = random_inputs(keys[0], 2, 100, 100, 4, 2, 64, jnp.bfloat16)
    kwargs = _mask_kwargs(opts, keys[1], 2, 100, 100)
    sinks = _sinks(keys[2], 4)
    run = dict(backend="mosaic", interpret=not ON_GPU)
    check_against_reference(q, k, v, do, sinks=sinks, **run, **kwargs)
    dlse = jax.random.normal(keys[3], (2, 4, 100), jnp.float32)
    got = _sink_grads(pf.flash_attention, q, k, v, do, dlse, sinks, kwargs | run)
    assert_sink_grads_close(got, q, k, v, do, dlse, sinks, kwargs, tolerance(jnp.bfloat16))


def test_extreme_sinks_stay_finite():
    """A sink far above every logit (the row's weight all on it) or far below (no effect)
    overflows nothing: O, lse and the gradients match the reference."""
    keys = jax.random.split(jax.random.key(12), 2)
    q, k, v, do = random_inputs(keys[0], 1, 24, 24, 4, 2, 16, jnp.float32)
    sinks = jnp.array([1e4, -1e4, 0.0, 80.0], jnp.float32)
    out, lse, _ = check_against_reference(q, k, v, do, sinks=sinks, causal=True)
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(lse)).all()
    dlse = jax.random.normal(keys[1], (1, 4, 24), jnp.float32)
    got = _sink_grads(pf.flash_attention, q, k, v, do, dlse, sinks, dict(causal=True))
    want = _sink_grads(pf.reference_attention, q, k, v, do, dlse, sinks, dict(causal=True))
    assert np.isfinite(np.asarray(got)).all()
    assert_close("d sinks", got, want, tolerance(jnp.float32))


def _arithmetic_on(jaxpr, shape):
    """Primitives of `jaxpr` and its sub-jaxprs, outside any kernel, that compute an array of
    `shape` elementwise."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            continue
        if eqn.primitive.name in ("mul", "div", "exp", "exp2", "sub", "add"):
            found += [eqn.primitive.name for o in eqn.outvars if o.aval.shape == shape]
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                found += _arithmetic_on(inner, shape)
            elif hasattr(value, "eqns"):
                found += _arithmetic_on(value, shape)
    return found


def test_a_nan_sink_gives_nan_in_its_head_only():
    """A NaN sink logit reaches every row of its head, in the kernels and in the reference
    alike (the reference's denominator is NaN, not an empty row's 0); the other head is clean."""
    q, k, v, _ = random_inputs(jax.random.PRNGKey(41), 1, 24, 24, 2, 1, 16, jnp.float32)
    sinks = jnp.array([jnp.nan, 0.5], jnp.float32)
    for fn in (pf.flash_attention, pf.reference_attention):
        out, lse = fn(q, k, v, causal=True, sinks=sinks, return_lse=True)
        out, lse = np.asarray(out), np.asarray(lse)
        assert np.isnan(out[:, :, 0]).all() and np.isnan(lse[:, 0]).all(), fn.__name__
        assert np.isfinite(out[:, :, 1]).all() and np.isfinite(lse[:, 1]).all(), fn.__name__


def test_sinks_fold_into_the_forward_kernel():
    """No pass over O outside the kernels: the forward kernel's last step takes the sink."""
    q, k, v, _ = random_inputs(jax.random.key(13), 1, 16, 16, 2, 2, 16, jnp.float32)
    sinks = jnp.array([0.5, -1.0], jnp.float32)
    jaxpr = jax.make_jaxpr(lambda q, k, v, s: pf.flash_attention(q, k, v, sinks=s))(
        q, k, v, sinks)
    assert _arithmetic_on(jaxpr.jaxpr, q.shape) == []
    # The check sees such a pass where there is one: the same output rescaled outside.
    rescaled = jax.make_jaxpr(lambda q, k, v, s: pf.flash_attention(q, k, v, sinks=s) * 2.0)(
        q, k, v, sinks)
    assert _arithmetic_on(rescaled.jaxpr, q.shape) == ["mul"]


def test_row_that_sees_no_key_gives_zero_and_the_sink_as_lse():
    q, k, v, _ = random_inputs(jax.random.key(0), 1, 8, 8, 2, 2, 16, jnp.float32)
    sinks = jnp.array([0.5, -1.5], jnp.float32)
    out, lse = pf.flash_attention(q, k, v, sinks=sinks, kv_lengths=jnp.array([0]),
                                  return_lse=True)
    assert np.all(np.asarray(out) == 0)
    np.testing.assert_array_equal(np.asarray(lse), np.broadcast_to(sinks[None, :, None], lse.shape))
    # O' is 0 whatever the sink, so under a random cotangent its gradient is exactly 0.
    do = jax.random.normal(jax.random.key(1), q.shape, jnp.float32)
    grads = jax.grad(lambda s: jnp.sum(do * pf.flash_attention(
        q, k, v, sinks=s, kv_lengths=jnp.array([0]))))(sinks)
    np.testing.assert_array_equal(np.asarray(grads), 0.0)


def test_check_grads_float64(x64):
    keys = jax.random.split(jax.random.key(7), 2)
    q, k, v, _ = random_inputs(keys[0], 1, 13, 11, 2, 1, 8, jnp.float64)
    sinks = _sinks(keys[1], 2, jnp.float64)
    fn = lambda q, k, v, s: pf.flash_attention(q, k, v, sinks=s, causal=True,  # noqa: E731
                                               interpret=True)
    check_grads(fn, (q, k, v, sinks), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


def test_dot_product_attention_takes_sinks():
    keys = jax.random.split(jax.random.key(9), 3)
    q, k, v, _ = random_inputs(keys[0], 2, 24, 24, 4, 2, 32, jnp.float32)
    sinks = _sinks(keys[1], 4)
    want = pf.reference_attention(q, k, v, sinks=sinks, causal=True)
    got = pf.dot_product_attention(q, k, v, is_causal=True, sinks=sinks)
    assert_close("out, kernels", got, want, tolerance(jnp.float32))
    # A mask the kernels cannot serve runs on the query-chunked XLA path, sinks included.
    mask = jax.random.bernoulli(keys[2], 0.7, (2, 1, 24, 24))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's once-per-process warning
        got = pf.dot_product_attention(q, k, v, mask=mask, sinks=sinks)
    # The fallback runs at float32's default precision (tf32 on a GPU): the table's float32 row.
    assert_close("out, masked fallback", got, _masked_reference(q, k, v, mask, sinks),
                 tolerance(jnp.float32))


def _masked_reference(q, k, v, mask, sinks):
    """Plain jnp attention with a dense mask and sinks, float32."""
    group = q.shape[2] // k.shape[2]
    kf, vf = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, kf, precision="highest") / np.sqrt(q.shape[-1])
    logits = jnp.where(mask, logits, -jnp.inf)
    sink = jnp.broadcast_to(sinks[None, :, None, None], logits.shape[:3] + (1,))
    p = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bhqk,bkhd->bqhd", p, vf, precision="highest")


@pytest.mark.parametrize("sinks,match", [
    (jnp.zeros((3,)), r"sinks must have shape \[q_heads\]"),
    (jnp.zeros((4,), jnp.int32), "sinks must have a floating dtype"),
    ([0.0] * 4, "sinks must be an array"),
])
def test_bad_sinks_raise(sinks, match):
    q, k, v, _ = random_inputs(jax.random.key(0), 1, 8, 8, 4, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match=match):
        pf.flash_attention(q, k, v, sinks=sinks)


def test_jax_nn_implementations_refuse_sinks():
    q, k, v, _ = random_inputs(jax.random.key(0), 1, 8, 8, 4, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="sinks"):
        pf.dot_product_attention(q, k, v, sinks=jnp.zeros((4,)), implementation="xla")
