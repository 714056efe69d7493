"""The marks the Mosaic backward kernels write beside their gradients, which "auto"'s guard
reads instead of the operands (pallas_flash/guarded.py, mosaic.backward.backward_checked).

A mark is NaN where an inf or NaN reached a gradient row. The guard is only as good as the
claim that every non-finite operand the kernels read reaches a mark, also one the mask hides
(0 * inf = NaN in a masked product): here for each operand, on the fused kernel and on the two
kernels, and for the values that only one of the two kernels meets. test_backends.py runs the
guard as a whole.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from backends import IS_HOPPER, ON_GPU
from helpers import TOLERANCE, assert_close, make_spec, random_inputs
from pallas_flash.mosaic import backward as mosaic
from pallas_flash.mosaic.config import MosaicBackwardConfig, default_backward_config
from pallas_flash.triton import forward as triton_forward

needs_hopper = pytest.mark.skipif(ON_GPU and not IS_HOPPER, reason="Mosaic GPU kernel needs sm_90")
FUSED = MosaicBackwardConfig(dkdv_block_q=64, fused=True)
TWO_KERNELS = MosaicBackwardConfig(dkdv_block_q=64, dq_block_kv=64)


@needs_hopper
@pytest.mark.parametrize("poison,path,d,d_v,dtype", [
    (None, "fused", 64, 64, jnp.bfloat16), ("q", "fused", 64, 64, jnp.bfloat16),
    ("k_hidden", "fused", 64, 64, jnp.bfloat16), ("v", "fused", 64, 64, jnp.bfloat16),
    ("do", "fused", 64, 64, jnp.bfloat16), ("k_hidden", "fused", 64, 64, jnp.float16),
    (None, "fused", 96, 96, jnp.bfloat16), ("k_hidden", "fused", 96, 96, jnp.bfloat16),
    (None, "two", 64, 64, jnp.bfloat16), ("q", "two", 64, 64, jnp.bfloat16),
    ("k_hidden", "two", 64, 64, jnp.bfloat16), ("v", "two", 64, 64, jnp.bfloat16),
    ("do", "two", 64, 64, jnp.float16),
    (None, "two", 256, 256, jnp.bfloat16), ("do", "two", 256, 256, jnp.bfloat16),
    (None, "two", 64, 32, jnp.bfloat16), ("v", "two", 64, 32, jnp.bfloat16)])
def test_checked_backward_marks_every_nonfinite_operand(poison, path, d, d_v, dtype):
    """backward_checked's flag is False whenever an inf or NaN the kernels read reached the
    gradients, also one the mask hides: "k_hidden" is key 110 of 128, seen by none of the 100
    causal queries, whose NaN the dQ product (dS K) still spreads over a column of the dQ rows
    whose blocks meet its block. Both paths: the fused kernel and the two kernels (at head_dim 256 their dK/dV
    warpgroups split the columns; 64 / 32 is MLA). With clean operands the flag is True (every
    mark was written) and the gradients are `backward`'s, bit for bit, and the reference's."""
    b, sq, skv, hq, hkv = 1, 100, 128, 2, 1
    q, k, v, do = random_inputs(jax.random.PRNGKey(57), b, sq, skv, hq, hkv, d, dtype,
                                head_dim_v=d_v)
    dlse = jax.random.normal(jax.random.PRNGKey(58), (b, hq, sq), jnp.float32)
    spec = make_spec(sq, skv, d, dtype, causal=True)
    out, stats = triton_forward.forward(spec, q, k, v)
    cfg = dict(fused=FUSED, two=TWO_KERNELS)[path] if d <= 128 else default_backward_config(d)
    assert mosaic.uses_fused(spec, q, k, cfg, d_v) is (path == "fused")
    where = {"q": ("q", 5), "k_hidden": ("k", 110), "v": ("v", 40), "do": ("do", 5)}
    ops = dict(q=q, k=k, v=v, do=do)
    if poison is not None:
        name, row = where[poison]
        ops[name] = ops[name].at[0, row, 0, 3].set(jnp.nan)
    args = (ops["q"], ops["k"], ops["v"], out, stats, ops["do"], dlse)
    grads, clean = jax.jit(lambda *a: mosaic.backward_checked(spec, *a, config=cfg))(*args)
    if poison is not None:
        assert not bool(clean)
        if poison == "k_hidden":  # the leak the flag must catch: a NaN column in dQ
            assert np.isnan(np.asarray(grads[0], np.float32)[..., 3]).any()
        return
    assert bool(clean)
    plain = jax.jit(lambda *a: mosaic.backward(spec, *a, config=cfg))(*args)
    for g, p in zip(grads, plain):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(p))
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    _, ref_vjp = jax.vjp(lambda q, k, v: pf.reference_attention(q, k, v, causal=True,
                                                                return_lse=True),
                         up(q), up(k), up(v))
    tol = TOLERANCE[jnp.dtype(dtype)]
    for name, g, w in zip(("dq", "dk", "dv"), grads, ref_vjp((up(do), dlse))):
        assert_close(name, g, w, tol)


@needs_hopper
@pytest.mark.parametrize("poison", ["k", "q", "do", None])
def test_two_kernel_marks_a_value_only_one_kernel_meets(poison):
    """A NaN that reaches one kernel's gradients only, each kernel's marks tested alone (with
    either left out of the flag, one case fails). "k": key 110's segment holds no query, so
    every query masks it (P = dS = 0: dK, dV finite), but the dQ kernel's dS K still meets its
    NaN (0 * NaN). "q": query 20's segment holds no key (P = dS = 0: dQ finite), but the dK/dV
    kernel's dS^T Q meets it. "do": the same query's dO meets both kernels and reaches every
    gradient: dV through P^T dO, dK and dQ through dP and dS (0 * NaN: no second select hides
    it, tiles.transposed_score_grads). None: the same segments with clean operands leave every
    mark clear, the empty query and key included."""
    b, s, hq, hkv, d, dtype = 1, 128, 2, 1, 64, jnp.bfloat16
    q, k, v, do = random_inputs(jax.random.PRNGKey(59), b, s, s, hq, hkv, d, dtype)
    dlse = jax.random.normal(jax.random.PRNGKey(60), (b, hq, s), jnp.float32)
    q_ids = kv_ids = jnp.zeros((b, s), jnp.int32)
    kv_ids = kv_ids.at[0, 110].set(1)
    q_ids = q_ids.at[0, 20].set(2)
    spec = make_spec(s, s, d, dtype, has_segments=True)
    out, stats = triton_forward.forward(spec, q, k, v, q_ids, kv_ids)
    if poison == "k":
        k = k.at[0, 110, 0, 3].set(jnp.nan)
    elif poison == "q":
        q = q.at[0, 20, 0, 3].set(jnp.nan)
    elif poison == "do":
        do = do.at[0, 20, 0, 3].set(jnp.nan)
    grads, clean = jax.jit(lambda *a: mosaic.backward_checked(spec, *a))(
        q, k, v, out, stats, do, dlse, q_ids, kv_ids)
    reached = {"k": {"dq"}, "q": {"dk"}, "do": {"dq", "dk", "dv"}, None: set()}[poison]
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert np.isnan(np.asarray(g, np.float32)).any() == (name in reached), name
    assert bool(clean) == (poison is None)
