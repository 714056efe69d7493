"""What a first run meets: one trace and compile per step, and the interpret-mode warning."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest

import pallas_flash as pf
from pallas_flash import attention

needs_cpu = pytest.mark.skipif(jax.default_backend() == "gpu",
                               reason="interpret mode is chosen only without a GPU")


def _inputs():
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(kk, (1, 16, 2, 32), jnp.float32) for kk in keys]


@needs_cpu
def test_automatic_interpret_mode_warns_once(monkeypatch):
    monkeypatch.setattr(attention, "_interpret_warned", False)
    q, k, v = _inputs()
    with pytest.warns(attention.InterpretModeWarning, match=r"interpret mode.*\[cuda\]"):
        pf.flash_attention(q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error", attention.InterpretModeWarning)
        pf.flash_attention(q, k, v, causal=True)  # a second call, a new trace: silent


@needs_cpu
def test_explicit_interpret_is_silent(monkeypatch):
    monkeypatch.setattr(attention, "_interpret_warned", False)
    q, k, v = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error", attention.InterpretModeWarning)
        out = pf.flash_attention(q, k, v, interpret=True)
    ref = pf.reference_attention(q, k, v)
    assert float(jnp.max(jnp.abs(out - ref))) < 1e-4
    assert attention._interpret_warned is False


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_training_step_traces_and_compiles_once(backend):
    """Calls two and three of a jitted forward+backward step reuse the first call's executable:
    nothing the kernels do on a first call (imports, config options, caches) may change what
    jit keys its cache on, or every later process would pay a second compile."""
    traces = []

    def loss(q, k, v, do):
        traces.append(1)
        out, vjp = jax.vjp(lambda q, k, v: pf.flash_attention(q, k, v, causal=True,
                                                               backend=backend), q, k, v)
        return out, vjp(do)

    step = jax.jit(loss)
    keys = jax.random.split(jax.random.key(1), 4)
    q, k, v, do = [jax.random.normal(kk, (1, 64, 2, 32), jnp.float32) for kk in keys]
    for _ in range(3):
        jax.block_until_ready(step(q, k, v, do))
    assert len(traces) == 1
    assert step._cache_size() == 1


def test_first_step_traces_each_kernel_once_and_compiles_nothing(monkeypatch):
    """Tracing a Hopper training step (the Mosaic forward and the fused backward, lowered for
    sm_90 without a GPU) builds each forward once, although JAX traces both the primal
    function and the forward rule, and compiles no program on the way: an eager op run while
    tracing is compiled on the first step of every process."""
    from pallas_flash.mosaic import forward as mosaic_forward
    monkeypatch.setattr(attention, "_is_sm90", lambda: True)
    monkeypatch.setattr(attention, "_capability", lambda: "9.0")
    built = []
    real = mosaic_forward.forward
    monkeypatch.setattr(mosaic_forward, "forward",
                        lambda *a, **kw: built.append(1) or real(*a, **kw))
    x = jax.ShapeDtypeStruct((1, 1000, 2, 128), jnp.bfloat16)

    def step(q, k, v, do):
        return jax.vjp(lambda q, k, v: pf.flash_attention(
            q, k, v, causal=True, window=(300, 0), backend="mosaic", interpret=False),
            q, k, v)[1](do)

    compiles = []
    monkeypatch.setattr(jax._src.compiler, "backend_compile_and_load",
                        lambda *a, **kw: compiles.append(1))
    jax.jit(step).trace(x, x, x, x)
    assert len(built) == 1
    assert not compiles
