"""A V head_dim other than Q/K's (DeepSeek's MLA: Q/K 192, V 128), in both passes.

O and dV have V's head_dim, dQ and dK Q/K's; lse and the saved row statistics are unchanged.
Both backends serve both passes. The Mosaic kernels take a V head_dim below Q/K's when both
are Mosaic head dims (their two-kernel backward; the fused one keeps one head_dim); otherwise
"auto" takes Triton and backend="mosaic" refuses. Compared with reference_attention in float32
under random cotangents for O and lse (helpers.check_against_reference).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import pallas_flash as pf
from pallas_flash import attention, validation
from pallas_flash.config import check_shared_memory, shared_memory_bytes, shared_memory_limit
from backends import IS_HOPPER
from helpers import (ON_GPU, assert_close, check_against_reference, make_spec,
                     outputs_and_grads, random_inputs, tolerance)

F32 = jnp.float32

# name: ((batch, seq_q, seq_kv, q_heads, kv_heads), (d_qk, d_v), flash_attention options). Each
# case runs both passes; together they cover causal and not, GQA and MQA, d_v < d_qk and
# d_v > d_qk, padding, segment ids, softcap, sinks and rows that see no key.
CASES = {
    "mla-causal-gqa": ((1, 40, 40, 2, 1), (192, 128), dict(causal=True)),
    # Batch row 1 sees no key (kv_lengths 0): its rows hold only the sink.
    "d64-32-window-softcap-lengths-sinks": ((2, 37, 50, 2, 1), (64, 32),
                                            dict(window=(20, 9), softcap=5.0, q_lengths=[37, 20],
                                                 kv_lengths=[50, 0], sinks=[0.5, -1.0])),
    "d32-64-segments-bottom-right": ((1, 30, 45, 2, 2), (32, 64),
                                     dict(causal=True, causal_alignment="bottom_right",
                                          segments=True)),
}


def _options(shape, options):
    """Arrays for the id, length and sink options: sorted random documents for segments."""
    batch, seq_q, seq_kv = shape[:3]
    options = dict(options)
    for name in ("q_lengths", "kv_lengths", "sinks"):
        if name in options:
            options[name] = jnp.asarray(options[name], F32 if name == "sinks" else jnp.int32)
    if options.pop("segments", False):
        rng = np.random.RandomState(5)
        ids = lambda n: jnp.asarray(np.sort(rng.randint(0, 3, (batch, n)), axis=1))  # noqa: E731
        options.update(q_segment_ids=ids(seq_q), kv_segment_ids=ids(seq_kv))
    return options


def _arrays(q_shape, k_shape, v_shape, dtype=F32):
    """Shapes alone, for what never runs a kernel."""
    return [jax.ShapeDtypeStruct(s, dtype) for s in (q_shape, k_shape, v_shape)]


@pytest.mark.parametrize("name", list(CASES))
def test_flash_attention_matches_reference(name):
    shape, (d_qk, d_v), options = CASES[name]
    q, k, v, do = random_inputs(jax.random.PRNGKey(len(name)), *shape, d_qk, F32,
                                head_dim_v=d_v)
    out, _, (dq, dk, dv) = check_against_reference(q, k, v, do, **_options(shape, options))
    assert out.shape[-1] == dv.shape[-1] == d_v and dq.shape[-1] == dk.shape[-1] == d_qk


def test_dot_product_attention_matches_reference(kernel_calls):
    # The kernel path with the residual, then rank 3.
    q, k, v, do = random_inputs(jax.random.PRNGKey(3), 1, 24, 24, 4, 2, 48, F32, head_dim_v=16)
    kv_lengths = jnp.array([19], jnp.int32)
    dlse = jax.random.normal(jax.random.PRNGKey(4), (1, 4, 24), F32)

    def ours(q, k, v, return_lse):
        out, res = pf.dot_product_attention(q, k, v, is_causal=True, return_residual=True,
                                            key_value_seq_lengths=kv_lengths)
        return out, jnp.swapaxes(res, 1, 2)   # [B, N, T], as outputs_and_grads expects

    got = outputs_and_grads(ours, q, k, v, do, dlse, {})
    want = outputs_and_grads(pf.reference_attention, q, k, v, do, jnp.zeros_like(dlse),
                             dict(causal=True, kv_lengths=kv_lengths))
    assert len(kernel_calls) == 1 and got[0].shape == (1, 24, 4, 16)
    tol = tolerance(F32)
    assert_close("out", got[0], want[0], tol)
    assert_close("residual", got[1], want[1], tol, floor=1.0)
    for name, g, w in zip(("dq", "dk", "dv"), got[2], want[2]):   # the residual's is stopped
        assert_close(name, g, w, tol)
    rank3 = jax.eval_shape(lambda *a: pf.dot_product_attention(*a, is_causal=True),
                           q[0], k[0], v[0])
    assert rank3.shape == (24, 4, 16)


def test_dot_product_attention_mask_fallback():
    # A mask the kernels do not serve goes to our XLA path, which takes V's head_dim too.
    rng = np.random.RandomState(6)
    q, k, v = (jnp.asarray(rng.randn(*shape), F32)
               for shape in ((1, 12, 2, 24), (1, 20, 1, 24), (1, 20, 1, 8)))
    mask = jnp.asarray(rng.rand(1, 2, 12, 20) < 0.6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pf.nn.FallbackWarning)
        out = pf.dot_product_attention(q, k, v, mask=mask)
    logits = jnp.einsum("bqhd,bkd->bhqk", q, k[:, :, 0], precision="highest") / np.sqrt(24)
    p = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    want = jnp.einsum("bhqk,bkd->bqhd", p, v[:, :, 0], precision="highest")
    assert_close("out", out, jnp.where(jnp.isnan(want), 0.0, want), tolerance(F32))


@pytest.mark.skipif(ON_GPU, reason="float64 runs in interpret mode only (CPU)")
def test_check_grads_float64(x64):
    q, k, v, w = random_inputs(jax.random.PRNGKey(11), 1, 17, 13, 2, 1, 24, jnp.float64,
                               head_dim_v=8)
    w = jnp.moveaxis(w[..., 0], 1, 2)     # a weight per lse entry, [batch, q_heads, seq_q]

    def f(q, k, v):
        out, lse = pf.flash_attention(q, k, v, causal=True, return_lse=True)
        return out, jnp.where(jnp.isfinite(lse), lse, 0.0) * w

    check_grads(f, (q, k, v), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)


# ---- backend choice ----------------------------------------------------------------------------

@pytest.mark.parametrize("d", [128, 192])
def test_mosaic_takes_mla(monkeypatch, d):
    # As on a compiled H100 / H200: both Mosaic passes take V's own head_dim, on the
    # two-kernel backward (bf16 at head_dim 128 would otherwise run the fused one).
    monkeypatch.setattr(attention, "_is_sm90", lambda: True)
    q, k, v = _arrays((1, 128, 4, d), (1, 128, 2, d), (1, 128, 2, 64), jnp.bfloat16)
    spec = make_spec(128, 128, d, jnp.bfloat16, interpret=False)
    for module in (attention.mosaic_forward, attention.mosaic_backward):
        assert module.unsupported_reason(spec, q, k, v) is None
    cfg = attention.mosaic_backward.default_backward_config(d)
    assert not attention.mosaic_backward.uses_fused(spec, q, k, cfg, head_dim_v=64)
    assert attention._choose_backends("auto", spec, q, k, v) == ("guarded", "guarded")
    assert attention._choose_backends("mosaic", spec, q, k, v) == ("mosaic", "mosaic")


@pytest.mark.parametrize("dims,match", [
    ((128, 192), "v head_dim 192 (at most q and k's 128"),   # d_v > d_qk
    ((192, 72), "v head_dim 72 (at most q and k's 192"),     # not a Mosaic head dim
])
def test_mosaic_forward_refuses_other_v_head_dims(monkeypatch, dims, match):
    monkeypatch.setattr(attention, "_is_sm90", lambda: True)
    d, d_v = dims
    q, k, v = _arrays((1, 128, 4, d), (1, 128, 2, d), (1, 128, 2, d_v), jnp.bfloat16)
    spec = make_spec(128, 128, d, jnp.bfloat16, interpret=False)
    for module in (attention.mosaic_forward, attention.mosaic_backward):
        assert match in module.unsupported_reason(spec, q, k, v)
    assert attention._choose_backends("auto", spec, q, k, v) == ("triton", "triton")
    with pytest.raises(ValueError, match=r"backend='mosaic' cannot serve this call"):
        attention._choose_backends("mosaic", spec, q, k, v)


@pytest.mark.skipif(ON_GPU and not IS_HOPPER, reason="Mosaic GPU kernel needs sm_90")
@pytest.mark.parametrize("dims,options", [
    ((192, 128), dict(causal=True)),
    ((128, 64), dict(kv_lengths=[100, 0], sinks=[0.5, -1.0, 2.0, 0.0])),
], ids=["mla-causal-gqa", "d128-64-lengths-sinks"])
def test_mosaic_matches_reference(dims, options):
    """The Mosaic kernels with V's own head_dim (compiled on Hopper, interpreted on CPU), both
    passes: O, lse, dq, dk, dv against the float32 reference (192 splits dK/dV's columns in
    two)."""
    d, d_v = dims
    q, k, v, do = random_inputs(jax.random.PRNGKey(21), 2, 100, 100, 4, 2, d, jnp.bfloat16,
                                head_dim_v=d_v)
    check_against_reference(q, k, v, do, backend="mosaic", **_options((2, 100, 100), options))


@pytest.mark.parametrize("dims,softcap", [((192, 128), None), ((192, 128), 30.0),
                                          ((128, 64), None)],
                         ids=["mla-paired", "mla-softcap-unpaired", "d128-64"])
def test_mosaic_training_step_lowers_for_sm90(monkeypatch, dims, softcap):
    """Both MLA passes lower for the cuda platform (interpret mode does not model the TMA
    and wgmma layouts that a second head_dim touches)."""
    monkeypatch.setattr(attention, "_is_sm90", lambda: True)
    monkeypatch.setattr(attention, "_capability", lambda: "9.0")
    d, d_v = dims
    q, k, v = _arrays((1, 1024, 4, d), (1, 1024, 2, d), (1, 1024, 2, d_v), jnp.bfloat16)
    do = jax.ShapeDtypeStruct((1, 1024, 4, d_v), jnp.bfloat16)

    def step(q, k, v, do):
        fn = lambda q, k, v: pf.flash_attention(q, k, v, causal=True, softcap=softcap,  # noqa
                                                backend="mosaic", interpret=False)
        return jax.vjp(fn, q, k, v)[1](do)

    text = jax.jit(step).trace(q, k, v, do).lower(lowering_platforms=("cuda",)).as_text()
    for name in (attention.mosaic_forward.KERNEL_NAME, attention.mosaic_backward.DKDV_KERNEL_NAME,
                 attention.mosaic_backward.DQ_KERNEL_NAME):
        assert f"{name}_mosaic_gpu" in text, name


# ---- errors and tiles (no kernel runs) ---------------------------------------------------------

@pytest.mark.parametrize("shapes,match", [
    (((1, 8, 2, 32), (1, 8, 2, 32), (1, 9, 2, 16)), r"v must have the seq_kv and kv_heads of k"),
    (((1, 8, 2, 32), (1, 8, 2, 32), (1, 8, 1, 16)), r"v must have the seq_kv and kv_heads of k"),
    (((1, 8, 2, 32), (1, 8, 2, 32), (2, 8, 2, 16)), r"v batch size 2 does not match q batch"),
    (((1, 8, 2, 32), (1, 8, 2, 16), (1, 8, 2, 16)), r"k head_dim 16 does not match q head_dim"),
    (((1, 8, 2, 32), (1, 8, 2, 32), (1, 8, 2, 272)), r"v head_dim must be <= 256, got 272"),
    (((1, 8, 2, 32), (1, 8, 2, 32), (1, 8, 2, 0)), r"every dimension must be >= 1"),
])
def test_errors(shapes, match):
    for fn in (pf.flash_attention, pf.reference_attention):
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(fn, *_arrays(*shapes))


def test_errors_where_only_one_head_dim_is_served():
    q, k, v = _arrays((1, 8, 2, 32), (1, 8, 2, 32), (1, 8, 2, 16))
    # An entry point that does not opt in (validation.validate's default) keeps one head_dim.
    with pytest.raises(ValueError, match=r"v head_dim 16 does not match q head_dim 32 .*"
                                         r"this entry point takes one head_dim"):
        validation.validate(q, k, v, causal=False, scale=None, causal_alignment="top_left",
                            window=None, softcap=None, q_segment_ids=None, kv_segment_ids=None,
                            q_lengths=None, kv_lengths=None)
    q, k, v = (jnp.ones(x.shape, jnp.bfloat16) for x in (q, k, v))
    with pytest.raises(ValueError, match=r"backend='mosaic' cannot serve this call "
                                         r"\(mosaic forward: v head_dim 16 \(at most"):
        pf.flash_attention(q, k, v, backend="mosaic", interpret=True)
    q, k, v = (x.astype(F32) for x in (q, k, v))
    for implementation in ("xla", "cudnn"):
        with pytest.raises(ValueError, match=r"value head dim other than the query's is served "
                                             r"by the Pallas kernels only"):
            pf.dot_product_attention(q, k, v, implementation=implementation)
    with pytest.raises(ValueError, match=r"value head dim .* cannot serve this call "
                                         r"\(a dense bias\)"):
        pf.dot_product_attention(q, k, v, bias=jnp.zeros((1, 2, 8, 8)))
    with pytest.raises(ValueError, match=r"value must have the shape of key, got .* \(B, S and "
                                         r"K must match; its head dim may differ\)"):
        pf.dot_product_attention(q, k, v[:, :5])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, F32])
@pytest.mark.parametrize("d_qk,d_v", [(192, 128), (128, 256), (256, 128), (64, 32)])
def test_default_tiles_fit_shared_memory(dtype, d_qk, d_v):
    config = pf.default_config(d_qk, dtype, head_dim_v=d_v)
    assert config == pf.default_config(max(d_qk, d_v), dtype)   # the wider head_dim's row
    check_shared_memory(config, d_qk, dtype, shared_memory_limit(True), head_dim_v=d_v)
    # V's head_dim enters the estimate: a narrower V needs less, a wider one more.
    same = shared_memory_bytes(config, d_qk, dtype)
    mixed = shared_memory_bytes(config, d_qk, dtype, head_dim_v=d_v)
    for kernel in same:
        assert (mixed[kernel] < same[kernel]) == (d_v < d_qk), kernel


def test_shared_memory_error_names_both_head_dims():
    big = pf.KernelConfig(block_q=256, block_kv=256, num_stages=4)
    config = pf.FlashConfig(fwd=big, bwd_dkdv=big, bwd_dq=big)
    with pytest.raises(ValueError, match=r"at head_dim 192 \(V's 128\) and bfloat16"):
        check_shared_memory(config, 192, jnp.bfloat16, shared_memory_limit(True), head_dim_v=128)
