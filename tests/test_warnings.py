"""The warnings a first run may meet: interpret mode chosen for the user."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest

import pallas_flash as pf
from pallas_flash import attention

pytestmark = pytest.mark.skipif(jax.default_backend() == "gpu",
                                reason="interpret mode is chosen only without a GPU")


def _inputs():
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(kk, (1, 16, 2, 32), jnp.float32) for kk in keys]


def test_automatic_interpret_mode_warns_once(monkeypatch):
    monkeypatch.setattr(attention, "_interpret_warned", False)
    q, k, v = _inputs()
    with pytest.warns(attention.InterpretModeWarning, match=r"interpret mode.*\[cuda\]"):
        pf.flash_attention(q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error", attention.InterpretModeWarning)
        pf.flash_attention(q, k, v, causal=True)  # a second call, a new trace: silent


def test_explicit_interpret_is_silent(monkeypatch):
    monkeypatch.setattr(attention, "_interpret_warned", False)
    q, k, v = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error", attention.InterpretModeWarning)
        out = pf.flash_attention(q, k, v, interpret=True)
    ref = pf.reference_attention(q, k, v)
    assert float(jnp.max(jnp.abs(out - ref))) < 1e-4
    assert attention._interpret_warned is False
