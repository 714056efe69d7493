"""The Mosaic kernels of a default training step lower for sm_90 through the public API, on any
machine (Mosaic GPU lowers for the cuda platform without a GPU).

Lowering is most of a fresh process's first step and is paid again on a warm persistent
compilation cache: this keeps it runnable on CPU, where it can be profiled
(jax.experimental.mosaic.gpu's layout inference and dialect lowering). test_mosaic_forward.py,
test_mosaic_backward.py and test_mosaic_fused.py lower each kernel alone over its options.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pallas_flash as pf
from backends import IS_HOPPER, ON_GPU
from helpers import lower_for_sm90
from pallas_flash import attention
from pallas_flash.mosaic import backward as mosaic_backward
from pallas_flash.mosaic import forward as mosaic_forward
from pallas_flash.mosaic import fused_backward
from pallas_flash.mosaic.config import default_backward_config

pytest.importorskip("jax.experimental.mosaic.gpu")
pytestmark = pytest.mark.skipif(ON_GPU and not IS_HOPPER,
                                reason="Mosaic GPU lowers for the GPU present: sm_90 only")


@pytest.mark.parametrize("dtype,causal,sinks,kernels", [
    (jnp.bfloat16, True, False, (mosaic_forward.KERNEL_NAME, fused_backward.FUSED_KERNEL_NAME)),
    (jnp.float16, False, False, (mosaic_forward.KERNEL_NAME, fused_backward.FUSED_KERNEL_NAME)),
    (jnp.bfloat16, True, True, (mosaic_forward.KERNEL_NAME, fused_backward.FUSED_KERNEL_NAME)),
], ids=["bf16-causal-fused", "f16-fused", "bf16-causal-sinks"])
def test_training_step_lowers_for_sm90(monkeypatch, dtype, causal, sinks, kernels):
    """flash_attention's forward and backward under jax.vjp, as a jitted training step stages
    them, lower for the cuda platform with every kernel in the module."""
    # The dispatch asks the local device; lowering for sm_90 needs no device.
    monkeypatch.setattr(attention, "_is_sm90", lambda: True)
    monkeypatch.setattr(attention, "_capability", lambda: "9.0")
    x = jax.ShapeDtypeStruct((1, 1024, 2, 128), dtype)
    s = jax.ShapeDtypeStruct((2,), jnp.float32) if sinks else None

    def step(q, k, v, do, s):
        def attend(q, k, v, s):
            return pf.flash_attention(q, k, v, causal=causal, sinks=s, backend="mosaic",
                                      interpret=False)
        return jax.vjp(attend, q, k, v, s)[1](do)

    text = jax.jit(step).trace(x, x, x, x, s).lower(lowering_platforms=("cuda",)).as_text()
    for name in kernels:
        assert f"{name}_mosaic_gpu" in text, name


@pytest.mark.parametrize("head_dim", range(32, 257, 16))
def test_auto_step_lowers_at_every_mosaic_head_dim(monkeypatch, head_dim):
    """backend="auto" on sm_90 at every head_dim the Mosaic kernels take (multiples of 16, 32 to
    256): the Mosaic forward and backward, and behind them the guard's Triton fallback, lowered
    in one training step on 1000 tokens (no tile multiple), GQA 2:1."""
    monkeypatch.setattr(attention, "_is_sm90", lambda: True)
    monkeypatch.setattr(attention, "_capability", lambda: "9.0")
    x = jax.ShapeDtypeStruct((1, 1000, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 1000, 2, head_dim), jnp.bfloat16)

    def step(q, k, v, do):
        def attend(q, k, v):
            return pf.flash_attention(q, k, v, causal=True, interpret=False)
        return jax.vjp(attend, q, k, v)[1](do)

    text = lower_for_sm90(step, x, kv, kv, x)
    mosaic = {name for name in (mosaic_forward.KERNEL_NAME, fused_backward.FUSED_KERNEL_NAME,
                                mosaic_backward.DKDV_KERNEL_NAME, mosaic_backward.DQ_KERNEL_NAME)
              if f"{name}_mosaic_gpu" in text}
    # The fused kernel where the default takes it (64 to 128), the two kernels at every other.
    fused = default_backward_config(head_dim).fused and head_dim in fused_backward.HEAD_DIMS
    assert fused == (64 <= head_dim <= 128)
    backward = ({fused_backward.FUSED_KERNEL_NAME} if fused else
                {mosaic_backward.DKDV_KERNEL_NAME, mosaic_backward.DQ_KERNEL_NAME})
    assert mosaic == {mosaic_forward.KERNEL_NAME} | backward
    for name in ("pallas_flash_fwd", "pallas_flash_bwd_dkdv", "pallas_flash_bwd_dq"):
        assert f'"{name}"' in text or f'\\"{name}\\"' in text, name
