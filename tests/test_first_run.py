"""What a first run meets: one trace and compile per step, the interpret-mode warning, and the
warning of a CPU thread pool too small for the Mosaic interpreter."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest

import pallas_flash as pf
from pallas_flash import attention
from pallas_flash.mosaic import common as mosaic_common

from helpers import assert_close, tolerance

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


@needs_cpu
def test_mosaic_interpret_warns_once_when_the_cpu_pool_is_too_small(monkeypatch):
    """The warning reads NPROC at call time; XLA's own pool (conftest's floor) is untouched."""
    monkeypatch.setattr(mosaic_common, "_threads_warned", False)
    monkeypatch.setenv("NPROC", "2")
    assert mosaic_common.interpret_params(False, 4) is None   # compiled: no interpreter
    q, k, v = (x.astype(jnp.bfloat16) for x in _inputs())
    with pytest.warns(mosaic_common.InterpretThreadsWarning, match=r"has 2 threads.*NPROC=16"):
        out = pf.flash_attention(q, k, v, backend="mosaic", interpret=True)
    ref = pf.reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)))
    assert_close("o", out, ref, tolerance(jnp.bfloat16))
    with warnings.catch_warnings():
        warnings.simplefilter("error", mosaic_common.InterpretThreadsWarning)
        mosaic_common.interpret_params(True, 4)                 # once per process


def test_mosaic_interpret_is_silent_with_enough_pool_threads(monkeypatch):
    monkeypatch.setattr(mosaic_common, "_threads_warned", False)
    monkeypatch.setenv("NPROC", "4")
    with warnings.catch_warnings():
        warnings.simplefilter("error", mosaic_common.InterpretThreadsWarning)
        assert mosaic_common.interpret_params(True, 4) is not None
