"""flash_attention under the transforms a training loop uses, and its memory contract."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

import pallas_flash as pf
from helpers import TOLERANCE, assert_close, random_inputs
from pallas_flash.triton import forward as triton_forward

F32 = jnp.float32


def _tiny_model(attention):
    """x -> q, k, v projections (GQA) -> causal attention -> output projection -> loss."""

    def loss(params, x, target):
        b, s, _ = x.shape
        q = (x @ params["wq"]).reshape(b, s, 4, 16)
        k = (x @ params["wk"]).reshape(b, s, 2, 16)
        v = (x @ params["wv"]).reshape(b, s, 2, 16)
        h = attention(q, k, v, causal=True).reshape(b, s, 64)
        return jnp.mean((h @ params["wo"] - target) ** 2)

    return loss


def test_grad_of_small_model_inside_jit():
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    params = {"wq": jax.random.normal(keys[0], (32, 64)) / 6,
              "wk": jax.random.normal(keys[1], (32, 32)) / 6,
              "wv": jax.random.normal(keys[2], (32, 32)) / 6,
              "wo": jax.random.normal(keys[3], (64, 32)) / 8}
    x = jax.random.normal(keys[4], (2, 45, 32))
    target = jax.random.normal(keys[5], (2, 45, 32))
    flash = jax.jit(jax.value_and_grad(_tiny_model(pf.flash_attention)))
    ref = jax.jit(jax.value_and_grad(_tiny_model(pf.reference_attention)))
    (loss, grads), (ref_loss, ref_grads) = flash(params, x, target), ref(params, x, target)
    assert_close("loss", loss, ref_loss, 1e-5)
    for name in params:
        assert_close(name, grads[name], ref_grads[name], TOLERANCE[jnp.dtype(F32)])


def test_vmap_over_extra_leading_axis():
    q, k, v, _ = random_inputs(jax.random.PRNGKey(1), 3, 33, 40, 2, 1, 16, F32)
    stacked = jax.vmap(lambda q, k, v: pf.flash_attention(q[None], k[None], v[None],
                                                          causal=True)[0])(q, k, v)
    for i in range(3):
        ref = pf.reference_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], causal=True)
        assert_close(f"slice {i}", stacked[i], ref[0], TOLERANCE[jnp.dtype(F32)])


def test_vmap_of_grad():
    q, k, v, do = random_inputs(jax.random.PRNGKey(2), 2, 20, 20, 2, 2, 16, F32)

    def dq(fn, q, k, v, do):
        return jax.grad(lambda q: jnp.sum(fn(q[None], k[None], v[None])[0] * do))(q)

    got = jax.vmap(lambda *a: dq(pf.flash_attention, *a))(q, k, v, do)
    want = jax.vmap(lambda *a: dq(pf.reference_attention, *a))(q, k, v, do)
    assert_close("vmapped dq", got, want, TOLERANCE[jnp.dtype(F32)])


def test_works_with_x64_enabled(x64):
    # float32 inputs while jax_enable_x64 is on: all index arithmetic must stay int32.
    q, k, v, do = random_inputs(jax.random.PRNGKey(3), 1, 50, 70, 2, 1, 16, F32)
    out, vjp = jax.vjp(lambda q, k, v: pf.flash_attention(q, k, v, causal=True), q, k, v)
    ref, ref_vjp = jax.vjp(lambda q, k, v: pf.reference_attention(q, k, v, causal=True), q, k, v)
    assert_close("out", out, ref, TOLERANCE[jnp.dtype(F32)])
    for name, g, rg in zip("qkv", vjp(do), ref_vjp(do)):
        assert_close(f"d{name}", g, rg, TOLERANCE[jnp.dtype(F32)])


def test_backward_is_bitwise_deterministic():
    q, k, v, do = random_inputs(jax.random.PRNGKey(4), 2, 97, 130, 4, 1, 32, jnp.bfloat16)
    step = jax.jit(lambda q, k, v, do: jax.vjp(
        lambda q, k, v: pf.flash_attention(q, k, v, causal=True), q, k, v)[1](do))
    first = step(q, k, v, do)
    for _ in range(2):
        again = step(q, k, v, do)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(np.asarray(a.astype(F32)), np.asarray(b.astype(F32)))


def test_eval_shape_and_ahead_of_time_compile():
    q, k, v, _ = random_inputs(jax.random.PRNGKey(5), 1, 40, 40, 2, 2, 16, jnp.bfloat16)
    fn = lambda q, k, v: pf.flash_attention(q, k, v, causal=True, return_lse=True)  # noqa: E731
    out, lse = jax.eval_shape(fn, q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (1, 2, 40) and lse.dtype == F32
    compiled = jax.jit(fn).lower(q, k, v).compile()
    got, _ = compiled(q, k, v)
    assert_close("aot out", got, pf.reference_attention(q, k, v, causal=True),
                 TOLERANCE[jnp.dtype(jnp.bfloat16)])


def test_repeated_calls_trace_once(monkeypatch):
    calls = []
    real = triton_forward.forward

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_forward, "forward", counting)
    q, k, v, _ = random_inputs(jax.random.PRNGKey(6), 1, 24, 24, 2, 2, 16, F32)
    for _ in range(3):
        pf.flash_attention(q, k, v, causal=True, window=(5, None))
    assert len(calls) == 1
    # Fresh values of the same shapes reuse the trace too.
    pf.flash_attention(q + 1.0, k, v, causal=True, window=(5, None))
    assert len(calls) == 1


def _live_kernel_calls(jaxpr, name):
    """pallas_call equations named `name` whose outputs are used, counted through nested jaxprs.

    Liveness, not presence: rematerialisation can leave a dead copy of a kernel in the staged
    jaxpr (pallas_call's own DCE rule keeps it; XLA drops it), and a dead copy costs nothing.
    """
    from jax._src import core

    live = {v for v in jaxpr.outvars if isinstance(v, core.Var)}
    count = 0
    for eqn in reversed(jaxpr.eqns):
        if not any(v in live for v in eqn.outvars):
            continue
        if eqn.primitive.name == "pallas_call":
            count += eqn.params.get("name") == name
        else:
            for sub in core.jaxprs_in_params(eqn.params):
                count += _live_kernel_calls(sub, name)
        live.update(v for v in eqn.invars if isinstance(v, core.Var))
    return count


def test_checkpoint_policy_keeps_forward_outputs():
    q, k, v, _ = random_inputs(jax.random.PRNGKey(7), 1, 32, 32, 2, 2, 16, F32)
    policy = jax.checkpoint_policies.save_only_these_names(pf.OUT_NAME, pf.LSE_NAME)

    def layer(q, k, v):
        return jnp.sum(jnp.sin(pf.flash_attention(q, k, v, causal=True)))

    def step(fn):
        return jax.value_and_grad(fn, argnums=(0, 1, 2))

    def forward_calls(fn):
        return _live_kernel_calls(jax.make_jaxpr(step(fn))(q, k, v).jaxpr, "pallas_flash_fwd")

    # With out and lse saved, the forward kernel runs once; with nothing saved it runs again in
    # the backward pass (the control shows the count can tell the two apart).
    assert forward_calls(jax.checkpoint(layer, policy=policy)) == 1
    assert forward_calls(jax.checkpoint(layer)) == 2
    saved = step(jax.checkpoint(layer, policy=policy))(q, k, v)
    plain = step(layer)(q, k, v)
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(plain)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_scan_over_layers():
    q, k, v, _ = random_inputs(jax.random.PRNGKey(8), 1, 30, 30, 2, 2, 16, F32)
    ws = jax.random.normal(jax.random.PRNGKey(9), (3, 16, 16)) / 4

    def model(attn, ws, x):
        def body(h, w):
            return attn(h @ w, k, v, causal=True), None
        return jnp.sum(jax.lax.scan(jax.checkpoint(body), x, ws)[0] ** 2)

    g = jax.jit(jax.grad(lambda ws: model(pf.flash_attention, ws, q)))(ws)
    rg = jax.grad(lambda ws: model(pf.reference_attention, ws, q))(ws)
    assert_close("scan grads", g, rg, TOLERANCE[jnp.dtype(F32)])


def test_forward_kernel_outputs_pass_an_optimization_barrier():
    # attention.py's forward: without the barrier XLA can launch the Mosaic forward twice per
    # layer of a scanned training step. Structural here: every forward kernel's outputs feed
    # an optimization_barrier, in the forward scan of a step's gradient.
    import jax.extend

    q, _, _, _ = random_inputs(jax.random.PRNGKey(11), 1, 30, 30, 2, 2, 16, F32)

    def loss(x):
        def layer(h, _):
            return h + pf.flash_attention(h, h, h, causal=True), None
        return jnp.sum(jax.lax.scan(layer, x, None, length=2)[0] ** 2)

    kernels, fenced = set(), set()

    def is_forward_kernel(eqn):
        return eqn.primitive.name == "pallas_call" and "_fwd" in eqn.params["name"]

    def walk(jaxpr):
        made = {}  # id(var) -> id(the forward kernel equation that made it)
        for eqn in jaxpr.eqns:
            if is_forward_kernel(eqn):
                kernels.add(id(eqn))
                made.update((id(o), id(eqn)) for o in eqn.outvars)
            if eqn.primitive.name in ("pjit", "jit"):  # a kernel staged inside a jit
                inner = [e for e in eqn.params["jaxpr"].jaxpr.eqns if is_forward_kernel(e)]
                if inner:
                    made.update((id(o), id(inner[0])) for o in eqn.outvars)
            if eqn.primitive.name == "optimization_barrier":
                fenced.update(made[id(v)] for v in eqn.invars if id(v) in made)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(jax.grad(loss))(q).jaxpr)
    assert kernels and fenced == kernels, (len(kernels), len(fenced))


def test_output_dot_matches_float64_rowsum():
    # stats.output_dot, the backward's preprocess D = rowsum(dO * O) - dlse in [b, h, s].
    from pallas_flash.stats import output_dot

    keys = jax.random.split(jax.random.PRNGKey(12), 3)
    out = jax.random.normal(keys[0], (2, 37, 3, 24), jnp.bfloat16)
    do = jax.random.normal(keys[1], (2, 37, 3, 24), jnp.bfloat16)
    dlse = jax.random.normal(keys[2], (2, 3, 37), F32)
    got = output_dot(out, do, dlse, F32)
    want = (np.einsum("bshd,bshd->bhs", np.asarray(out, np.float64), np.asarray(do, np.float64))
            - np.asarray(dlse, np.float64))
    assert got.shape == (2, 3, 37) and got.dtype == F32
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5)


# ---- memory: nothing of size seq_q x seq_kv is saved or materialised --------------------------

def test_residuals_are_inputs_output_and_row_statistics_only():
    b, s, hq, hkv, d = 1, 200, 4, 2, 16
    q, k, v, _ = random_inputs(jax.random.PRNGKey(10), b, s, s, hq, hkv, d, jnp.bfloat16)
    res = saved_residuals(lambda q, k, v: pf.flash_attention(q, k, v, causal=True), q, k, v)
    shapes = sorted((tuple(aval.shape), str(aval.dtype)) for aval, _ in res)
    assert all(np.prod(shape) < s * s for shape, _ in shapes), shapes
    assert shapes == sorted([
        ((b, s, hq, d), "bfloat16"),   # q
        ((b, s, hkv, d), "bfloat16"),  # k
        ((b, s, hkv, d), "bfloat16"),  # v
        ((b, s, hq, d), "bfloat16"),   # out
        ((b, hq, s), "float32"),       # M: each row's max logit (stats.py)
        ((b, hq, s), "float32"),       # L: log2 of each row's softmax denominator
    ]), shapes
    # The plain-jnp reference, by contrast, saves seq x seq arrays: the check can fail.
    ref = saved_residuals(lambda q, k, v: pf.reference_attention(q, k, v, causal=True), q, k, v)
    assert any(np.prod(aval.shape) >= s * s for aval, _ in ref)


def _temp_bytes(fn, s):
    q, k, v, do = random_inputs(jax.random.PRNGKey(11), 1, s, s, 2, 2, 32, jnp.bfloat16)
    step = jax.jit(lambda q, k, v: jax.vjp(fn, q, k, v)[1](do))
    return step.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("fn,linear", [
    (lambda q, k, v: pf.flash_attention(q, k, v, causal=True), True),
    (lambda q, k, v: pf.reference_attention(q, k, v, causal=True), False),
], ids=["flash", "reference"])
def test_temporary_memory_grows_linearly(fn, linear):
    small, large = _temp_bytes(fn, 512), _temp_bytes(fn, 2048)
    growth = large / max(small, 1)
    # 4x the sequence: linear memory grows ~4x, quadratic ~16x.
    if linear:
        assert growth <= 5.0, (small, large)
    else:
        assert growth >= 10.0, (small, large)
