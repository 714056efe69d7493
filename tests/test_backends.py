"""Backend dispatch: "triton" runs the Triton kernels; "mosaic" runs the Mosaic GPU forward, and
the Mosaic GPU backward where it serves the call, else the Triton backward; "auto" runs the
Mosaic kernels behind a finiteness check (pallas_flash/guarded.py) on an sm_90 GPU when they
serve the call, the Triton kernels otherwise (always in interpret mode); any forward's row
statistics feed any backward.

On the CPU the Mosaic kernel runs in Mosaic GPU's interpret mode (slow: the shapes are the
smallest it takes, 128 query rows); on an H100/H200 it runs compiled.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import attention, guarded
from pallas_flash.mosaic import forward as mosaic_forward
from pallas_flash.triton import backward as triton_backward
from pallas_flash.triton import forward as triton_forward
from backends import IS_HOPPER, ON_GPU
from helpers import (TOLERANCE, all_eqns, assert_close, kernel_names, make_spec, random_inputs,
                     tolerance)

needs_mosaic = pytest.mark.skipif(ON_GPU and not IS_HOPPER, reason="Mosaic GPU needs sm_90")

# 128 query rows (two 64-row warpgroups), 128 keys, GQA.
SHAPE = (1, 128, 128, 4, 2, 64)


def test_triton_and_auto_stage_their_kernels():
    q, k, v, _ = random_inputs(jax.random.PRNGKey(83), *SHAPE, jnp.bfloat16)
    names = kernel_names(lambda q: pf.flash_attention(q, k, v, backend="triton"), q)
    assert names == {"pallas_flash_fwd"}, names
    # auto: on an H100/H200 both forwards are staged (the Triton one predicated on the finiteness
    # flag, guarded.py); elsewhere, and in interpret mode, Triton alone.
    names = kernel_names(lambda q: pf.flash_attention(q, k, v), q)
    want = {"pallas_flash_fwd", "pallas_flash_mosaic_fwd"} if IS_HOPPER else {"pallas_flash_fwd"}
    assert names == want, names


@pytest.mark.parametrize("sm90", [True, False], ids=["sm90", "other_gpu"])
def test_auto_choice(monkeypatch, sm90):
    # The decision alone (no launch), as on a compiled GPU of each kind.
    monkeypatch.setattr(attention, "_is_sm90", lambda: sm90)

    def choice(shape=(1, 128, 128, 4, 2, 64), dtype=jnp.bfloat16, interpret=False, **kw):
        q, k, v, _ = random_inputs(jax.random.PRNGKey(88), *shape, dtype)
        spec = make_spec(shape[1], shape[2], shape[-1], dtype, interpret=interpret)
        return attention._choose_backends("auto", spec, q, k, v, **kw)

    mosaic = ("guarded", "guarded") if sm90 else ("triton", "triton")
    assert choice() == mosaic
    assert choice(shape=(1, 100, 37, 8, 1, 256), dtype=jnp.float16) == mosaic
    # Cases the Mosaic kernels do not take, explicit Triton tiles, and interpret mode: Triton.
    assert choice(dtype=jnp.float32) == ("triton", "triton")
    assert choice(shape=(1, 128, 128, 4, 2, 80)) == mosaic   # a head_dim between the tuned ones
    assert choice(shape=(1, 128, 128, 4, 2, 72)) == ("triton", "triton")
    assert choice(shape=(1, 128, 128, 4, 2, 144)) == mosaic  # dK/dV in uneven column slices
    assert choice(explicit_config=True) == ("triton", "triton")
    assert choice(interpret=True) == ("triton", "triton")
    if not sm90:
        q, k, v, _ = random_inputs(jax.random.PRNGKey(88), *SHAPE, jnp.bfloat16)
        with pytest.raises(ValueError, match=r"backend='mosaic' needs an sm_90 GPU"):
            attention._choose_backends(
                "mosaic", make_spec(128, 128, 64, jnp.bfloat16, interpret=False), q, k, v)


def test_auto_is_told_whether_the_caller_chose_tiles(monkeypatch):
    # flash_attention must pass "was a config given?" as the caller made it, not after the
    # default is filled in (which would send every auto call to Triton).
    seen = []
    real = attention._choose_backends

    def spy(*args, **kwargs):
        seen.append(kwargs.get("explicit_config"))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "_choose_backends", spy)
    q, k, v, _ = random_inputs(jax.random.PRNGKey(91), *SHAPE, jnp.bfloat16)
    pf.flash_attention(q, k, v)
    pf.flash_attention(q, k, v, config=pf.default_config(64, jnp.bfloat16))
    assert seen == [False, True]


def test_guarded_forward_runs_mosaic_default_then_predicated_triton(monkeypatch):
    # guarded.forward: the Mosaic forward with its own default tiles (clusters of two where
    # they pay), then the Triton forward launched with the finiteness flag and the Mosaic
    # result to keep.
    seen = []

    def mosaic_spy(spec, q, k, v, q_ids=None, kv_ids=None, sinks=None, *, config=None):
        seen.append(("mosaic", config))
        return triton_forward.forward(spec, q, k, v, q_ids, kv_ids, sinks)

    def triton_spy(spec, q, k, v, q_ids=None, kv_ids=None, sinks=None, *, skip=None,
                   into=None):
        seen.append(("triton", skip.dtype, skip.shape, jax.tree.map(jnp.shape, into)))
        return triton_forward.forward(spec, q, k, v, q_ids, kv_ids, sinks, skip=skip, into=into)

    monkeypatch.setattr(guarded, "mosaic_forward", types.SimpleNamespace(forward=mosaic_spy))
    monkeypatch.setattr(guarded, "triton_forward", types.SimpleNamespace(forward=triton_spy))
    q, k, v, _ = random_inputs(jax.random.PRNGKey(93), 1, 128, 128, 2, 2, 64, jnp.bfloat16)
    spec = make_spec(128, 128, 64, jnp.bfloat16, interpret=False)
    jax.eval_shape(lambda q, k, v: guarded.forward(spec, q, k, v), q, k, v)
    out_shapes = ((1, 128, 2, 64), ((1, 2, 128), (1, 2, 128)))
    assert seen == [("mosaic", None), ("triton", jnp.dtype(bool), (), out_shapes)], seen


@pytest.mark.parametrize("skip", [True, False])
def test_predicated_triton_forward_keeps_into_or_overwrites_all(skip):
    # triton.forward with skip / into: skipped, the result is `into` bit for bit; not
    # skipped, every output entry is the kernel's own (into is filled with values no
    # attention result holds).
    q, k, v, _ = random_inputs(jax.random.PRNGKey(94), 1, 100, 100, 2, 1, 64, jnp.bfloat16)
    spec = make_spec(100, 100, 64, jnp.bfloat16, causal=True)
    want_out, want_stats = triton_forward.forward(spec, q, k, v)
    into = (jnp.full_like(want_out, 7.0),
            type(want_stats)(jnp.full_like(want_stats.m, 3.0), jnp.full_like(want_stats.r, 5.0)))
    got_out, got_stats = jax.jit(
        lambda s, q, k, v, i: triton_forward.forward(spec, q, k, v, skip=s, into=i))(
            jnp.bool_(skip), q, k, v, into)
    expect = jax.tree.leaves(into if skip else (want_out, want_stats))
    for got, want in zip(jax.tree.leaves((got_out, got_stats)), expect):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("skip", [True, False])
def test_predicated_triton_backward_keeps_into_or_overwrites_all(skip):
    # triton.backward with skip / into (both kernels predicated), as the forward above; GQA, a
    # partial last block.
    q, k, v, do = random_inputs(jax.random.PRNGKey(96), 1, 100, 100, 4, 2, 64, jnp.bfloat16)
    spec = make_spec(100, 100, 64, jnp.bfloat16, causal=True)
    out, stats = triton_forward.forward(spec, q, k, v)
    dlse = jax.random.normal(jax.random.PRNGKey(97), stats.m.shape)
    want = triton_backward.backward(spec, q, k, v, out, stats, do, dlse)
    into = tuple(jnp.full_like(g, 7.0) for g in want)
    got = jax.jit(lambda s, *a: triton_backward.backward(spec, *a, skip=s, into=into))(
        jnp.bool_(skip), q, k, v, out, stats, do, dlse)
    for g, w in zip(got, into if skip else want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_predicated_triton_forward_checks_its_arguments():
    q, k, v, _ = random_inputs(jax.random.PRNGKey(95), 1, 16, 16, 1, 1, 64, jnp.bfloat16)
    spec = make_spec(16, 16, 64, jnp.bfloat16)
    out, stats = triton_forward.forward(spec, q, k, v)
    with pytest.raises(ValueError, match="skip and into"):
        triton_forward.forward(spec, q, k, v, skip=jnp.bool_(True))
    with pytest.raises(ValueError, match="into holds"):
        triton_forward.forward(spec, q, k, v, skip=jnp.bool_(True),
                               into=(out.astype(jnp.float32), stats))


def _leaky_stand_in():
    """Stands in for the Mosaic kernels on machines without an sm_90 GPU: the Triton result plus
    `mark` (1 lets a test tell which branch ran; read when traced), and NaN everywhere once any
    operand holds a NaN (the worst leak a kernel could have). Its forward keeps the Mosaic
    forward's contract: a row whose O holds an inf or NaN has r = NaN."""
    def poison(*xs):
        return sum(0.0 * jnp.sum(x.astype(jnp.float32)) for x in xs)

    def forward(spec, q, k, v, q_ids=None, kv_ids=None, sinks=None, *, config=None):
        del config
        out, row_stats = triton_forward.forward(spec, q, k, v, q_ids, kv_ids, sinks)
        out = (out + stand_in.mark + poison(v)).astype(out.dtype)
        bad = ~jnp.isfinite(out).all(axis=-1).transpose(0, 2, 1)   # [batch, q_heads, seq_q]
        return out, row_stats._replace(r=jnp.where(bad, jnp.nan, row_stats.r))

    def backward(spec, q, k, v, out, row_stats, do, dlse, q_ids=None, kv_ids=None, delta=None):
        grads = triton_backward.backward(spec, q, k, v, out, row_stats, do, dlse, q_ids, kv_ids,
                                         delta=delta)
        return tuple((g + stand_in.mark + poison(q, k, v, do)).astype(g.dtype) for g in grads)

    def backward_checked(*args, **kwargs):
        # The Mosaic backward's contract: clean unless an inf or NaN reached the gradients.
        grads = backward(*args, **kwargs)
        return grads, jnp.stack([jnp.isfinite(g).all() for g in grads]).all()

    stand_in = types.SimpleNamespace(
        forward=forward, backward=backward, backward_checked=backward_checked, mark=1.0,
        default_forward_config=mosaic_forward.default_forward_config)
    return stand_in


@pytest.fixture
def mosaic_kernels(monkeypatch, request):
    """The Mosaic kernels for the guarded backend's tests: the real ones on an H100/H200, else
    `_leaky_stand_in()` (returned, so a test can set its mark).

    Off Hopper a stand-in: Mosaic GPU's interpreter, run inside the guard, can hang a 2-core
    machine (each simulated warpgroup holds a thread of its own). The guard's logic is what
    these tests test; on an H100/H200 the real kernels run them compiled.
    """
    if IS_HOPPER:
        return None
    stand_in = _leaky_stand_in()
    monkeypatch.setitem(attention._FORWARDS, "mosaic", stand_in)
    monkeypatch.setitem(attention._BACKWARDS, "mosaic", stand_in)
    monkeypatch.setattr(guarded, "mosaic_forward", stand_in)
    monkeypatch.setattr(guarded, "mosaic_backward", stand_in)
    # Fresh custom_vjp functions, so no trace made with the real kernels is reused (and none made
    # with the stand-in outlives the test).
    attention._custom_vjp_attention.cache_clear()
    request.addfinalizer(attention._custom_vjp_attention.cache_clear)
    return stand_in


@needs_mosaic
@pytest.mark.parametrize("which", ["v", "q", "k", "do"])
def test_guarded_backend_confines_nonfinite_inputs_like_triton(which, mosaic_kernels):
    # The "auto" backend of an sm_90 GPU, run as a whole (forward and backward). A NaN at one
    # position that half of the rows do not see (causal: query 40 and key 40 are seen only by
    # rows / keys on one side of the diagonal): the guarded backend must give exactly Triton's
    # NaN pattern (the rows that depend on it) and Triton's values elsewhere; with finite
    # inputs it must give exactly the Mosaic kernels' result.
    stand_in = mosaic_kernels
    q, k, v, do = random_inputs(jax.random.PRNGKey(89), *SHAPE, jnp.bfloat16)
    spec = make_spec(128, 128, 64, jnp.bfloat16, causal=True)

    def run(backend, q, k, v, do):
        fn = attention._custom_vjp_attention(spec, backend, backend)
        (out, lse), vjp = jax.vjp(lambda q, k, v: fn(q, k, v, None, None, None), q, k, v)
        dlse = jax.random.normal(jax.random.PRNGKey(90), lse.shape)
        return [np.asarray(x, np.float32) for x in (out, lse, *vjp((do, dlse)))]

    if which == "v":  # the finite half is the same for every poisoned operand: run it once
        fast = run("guarded", q, k, v, do)
        for got, want in zip(fast, run("mosaic", q, k, v, do)):
            np.testing.assert_array_equal(got, want)
        if stand_in is not None:  # the stand-in's mark: the fast branch ran
            assert not np.array_equal(fast[0], run("triton", q, k, v, do)[0])
    if stand_in is not None:  # from here on the stand-in's values are Triton's
        stand_in.mark = 0.0
        attention._custom_vjp_attention.cache_clear()
    poisoned = dict(q=q, k=k, v=v, do=do)
    poisoned[which] = poisoned[which].at[0, 40, 0, 3].set(jnp.nan)
    args = [poisoned[n] for n in ("q", "k", "v", "do")]
    names = ("out", "lse", "dq", "dk", "dv")
    tol = TOLERANCE[jnp.dtype(jnp.bfloat16)]
    checked, triton = run("guarded", *args), run("triton", *args)
    for name, got, want in zip(names, checked, triton):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=name)
        keep = ~np.isnan(want)
        assert_close(name, np.where(keep, got, 0), np.where(keep, want, 0), tol)
    # Not vacuous: the NaN reached some results, and the rows before the diagonal are clean.
    assert any(np.isnan(x).any() for x in triton)
    assert np.isfinite(triton[0][0, :40]).all()


@needs_mosaic
def test_guarded_backend_under_vmap_takes_one_flag(mosaic_kernels):
    # Under jax.vmap a per-example flag would be batched into the predicated Triton launches;
    # the guard's vmap rule keeps one flag for the whole vmapped batch. With a NaN
    # in one example the whole batch takes Triton's kernels, so every example equals Triton's.
    stand_in = mosaic_kernels
    q, k, v, do = random_inputs(jax.random.PRNGKey(92), 2, 128, 128, 4, 2, 64, jnp.bfloat16)
    spec = make_spec(128, 128, 64, jnp.bfloat16, causal=True)

    def grads(backend):
        fn = attention._custom_vjp_attention(spec, backend, backend)

        def one(q, k, v, do):
            out, vjp = jax.vjp(lambda q, k, v: fn(q[None], k[None], v[None], None, None, None)[0],
                               q, k, v)
            return (out, *vjp(do[None]))

        return jax.vmap(one)

    jaxpr = jax.make_jaxpr(grads("guarded"))(q, k, v, do).jaxpr
    # Each predicated Triton launch reads one flag for the batch, not one per example (a
    # batched flag would be [2, 1]).
    flags = {eqn.params["name"]: var.aval.shape for eqn in all_eqns(jaxpr)
             if eqn.primitive.name == "pallas_call" and eqn.params["name"].startswith(
                 "pallas_flash_") and "mosaic" not in eqn.params["name"]
             for var in eqn.invars if var.aval.dtype == jnp.int32}
    assert flags == {"pallas_flash_fwd": (1,), "pallas_flash_bwd_dkdv": (1,),
                     "pallas_flash_bwd_dq": (1,)}, flags
    for got, want in zip(grads("guarded")(q, k, v, do), grads("mosaic")(q, k, v, do)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    if stand_in is not None:
        stand_in.mark = 0.0
        attention._custom_vjp_attention.cache_clear()
    v = v.at[1, 100, 0, 5].set(jnp.nan)
    tol = TOLERANCE[jnp.dtype(jnp.bfloat16)]
    got, want = grads("guarded")(q, k, v, do), grads("triton")(q, k, v, do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=name)
        assert_close(name, np.where(np.isnan(w), 0, g), np.where(np.isnan(w), 0, w), tol)
    assert np.isfinite(np.asarray(want[0][0], np.float32)).all()  # example 0 is clean
    assert np.isnan(np.asarray(want[0][1], np.float32)).any()


@needs_mosaic
def test_mosaic_stages_the_mosaic_forward():
    q, k, v, _ = random_inputs(jax.random.PRNGKey(84), *SHAPE, jnp.bfloat16)
    names = kernel_names(lambda q: pf.flash_attention(q, k, v, backend="mosaic"), q)
    assert names == {"pallas_flash_mosaic_fwd"}, names
    grad_names = kernel_names(
        jax.grad(lambda q: pf.flash_attention(q, k, v, backend="mosaic").astype(
            jnp.float32).sum()), q)
    # bfloat16 without segment ids: the one-kernel backward (fused_backward.py).
    assert grad_names == {"pallas_flash_mosaic_fwd", "pallas_flash_mosaic_bwd_fused"}, grad_names
    # The Mosaic backward serves everything the Mosaic forward does (softcap, windows, any
    # length, segment ids / lengths), so no Triton kernel follows it; lengths become
    # segment ids, which take the two-kernel backward.
    softcap_names = kernel_names(
        jax.grad(lambda q: pf.flash_attention(
            q[:, :100], k, v, backend="mosaic", softcap=20.0, window=(40, 0),
            q_lengths=jnp.asarray([90], jnp.int32)).astype(jnp.float32).sum()), q)
    assert softcap_names == {"pallas_flash_mosaic_fwd", "pallas_flash_mosaic_bwd_dkdv",
                             "pallas_flash_mosaic_bwd_dq"}, softcap_names


@needs_mosaic
@pytest.mark.parametrize("pair", [("triton", "mosaic"), ("mosaic", "mosaic"),
                                  ("mosaic", "triton")], ids="-".join)
def test_any_forward_feeds_any_backward(pair):
    # The row statistics are the whole contract between the passes: each forward's must give
    # each backward the reference's gradients (triton-triton is every other test).
    q, k, v, do = random_inputs(jax.random.PRNGKey(86), *SHAPE, jnp.bfloat16)
    spec = make_spec(128, 128, 64, jnp.bfloat16, causal=True)
    fn = attention._custom_vjp_attention(spec, *pair)
    (out, lse), vjp = jax.vjp(lambda q, k, v: fn(q, k, v, None, None, None), q, k, v)
    dlse = jax.random.normal(jax.random.PRNGKey(87), lse.shape)
    grads = vjp((do, dlse))
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    (ref_out, ref_lse), ref_vjp = jax.vjp(
        lambda q, k, v: pf.reference_attention(q, k, v, causal=True, return_lse=True),
        up(q), up(k), up(v))
    ref_grads = ref_vjp((up(do), dlse))
    tol = TOLERANCE[jnp.dtype(jnp.bfloat16)]
    assert_close("out", out, ref_out, tol)
    assert_close("lse", lse, ref_lse, tol, floor=1.0)
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(name, g, rg, tol)


@pytest.mark.parametrize("change,match", [
    # softcap, windows, any seq_q / seq_kv and segment ids / lengths are served now; these
    # head_dims and dtypes are not, with or without those options.
    (dict(shape=(1, 128, 128, 4, 2, 24), softcap=30.0), r"head_dim 24"),
    (dict(shape=(1, 128, 128, 4, 2, 72), window=(16, 0)), r"head_dim 72"),
    (dict(shape=(1, 100, 128, 4, 2, 120)), r"head_dim 120"),
    (dict(shape=(1, 128, 128, 4, 2, 40)), r"head_dim 40"),
    (dict(dtype=jnp.float32), r"dtype float32"),
    (dict(dtype=jnp.float32, q_lengths=jnp.asarray([100], jnp.int32)), r"dtype float32"),
])
def test_forced_mosaic_refuses_what_it_cannot_serve(change, match):
    change = dict(change)
    shape = change.pop("shape", SHAPE)
    dtype = change.pop("dtype", jnp.bfloat16)
    q, k, v, _ = random_inputs(jax.random.PRNGKey(85), *shape, dtype)
    if ON_GPU and not IS_HOPPER:
        match = r"needs an sm_90 GPU"
    with pytest.raises(ValueError, match=r"backend='mosaic'.*" + match):
        pf.flash_attention(q, k, v, backend="mosaic", **change)
    # "auto" serves every one of these cases (through Triton), as the reference computes them.
    out = pf.flash_attention(q, k, v, backend="auto", **change)
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = pf.reference_attention(up(q), up(k), up(v), **change)
    assert_close("out", out, ref, tolerance(dtype))
