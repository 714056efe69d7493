"""jax.test_util.check_grads in float64, through the real kernels (interpret mode).

check_grads compares the custom VJP with finite differences of the forward kernel, so it tests
the backward kernels against the forward kernel, independently of the reference.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.test_util import check_grads

import pallas_flash as pf
from helpers import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="float64 runs in interpret mode only (CPU)")

CASES = {
    # name: (batch, seq_q, seq_kv, q_heads, kv_heads, head_dim, options)
    "full": (1, 37, 45, 2, 2, 16, {}),
    "causal": (1, 45, 37, 2, 2, 16, dict(causal=True)),
    "gqa_causal": (1, 33, 33, 4, 2, 24, dict(causal=True)),
    "mqa_bottom_right": (1, 17, 40, 3, 1, 16, dict(causal=True, causal_alignment="bottom_right")),
    "window_softcap": (1, 40, 40, 2, 1, 16, dict(window=(9, 3), softcap=2.0)),
    "segments_lengths": (2, 30, 30, 2, 2, 16, "segments"),
}


def _options(batch, seq_q, seq_kv, options):
    if options != "segments":
        return options
    q_ids = jnp.array([[0] * 10 + [1] * 12 + [2] * 8, [0] * 30])
    return dict(causal=True, q_segment_ids=q_ids, kv_segment_ids=q_ids,
                kv_lengths=jnp.array([30, 21]), q_lengths=jnp.array([25, 30]))


@pytest.mark.parametrize("name", list(CASES))
def test_check_grads_float64(x64, name):
    batch, seq_q, seq_kv, q_heads, kv_heads, head_dim, options = CASES[name]
    options = _options(batch, seq_q, seq_kv, options)
    keys = jax.random.split(jax.random.PRNGKey(11), 4)
    q = jax.random.normal(keys[0], (batch, seq_q, q_heads, head_dim), jnp.float64)
    k = jax.random.normal(keys[1], (batch, seq_kv, kv_heads, head_dim), jnp.float64)
    v = jax.random.normal(keys[2], (batch, seq_kv, kv_heads, head_dim), jnp.float64)
    w = jax.random.normal(keys[3], (batch, q_heads, seq_q), jnp.float64)

    def f(q, k, v):
        out, lse = pf.flash_attention(q, k, v, return_lse=True, **options)
        # Include lse (where finite) so its VJP is checked too.
        return out, jnp.where(jnp.isfinite(lse), lse, 0.0) * w

    check_grads(f, (q, k, v), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)
