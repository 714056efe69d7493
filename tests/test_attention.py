"""Forward, lse and all three gradients against reference_attention over the awkward cases."""

import jax
import jax.numpy as jnp
import pytest

import pallas_flash as pf

from helpers import check_against_reference, random_inputs

# (batch, seq_q, seq_kv, q_heads, kv_heads, head_dim): single tokens, odd and unequal lengths,
# lengths one past and one short of a tile, MHA / GQA / MQA, head dims that are not powers of two.
SHAPES = [
    (1, 1, 1, 1, 1, 16),
    (2, 7, 7, 2, 2, 32),
    (1, 113, 203, 4, 1, 64),   # MQA, cross lengths
    (1, 203, 113, 4, 2, 40),   # GQA, seq_q > seq_kv
    (1, 129, 100, 2, 2, 72),
    (2, 100, 129, 6, 3, 96),
    (1, 65, 33, 2, 1, 80),
    (1, 130, 130, 2, 2, 128),
    (1, 70, 90, 2, 2, 256),
    (1, 20, 30, 2, 1, 8),      # head_dim under the 16-wide minimum tile: padded and masked
]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _ids(shape):
    return "x".join(map(str, shape))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_matches_reference_float32(shape, causal):
    # Full float32 matmuls, so that the kernel's own arithmetic is held to float32 accuracy on
    # every shape (on the CPU this is the only mode). The tf32 default is tested below.
    q, k, v, do = random_inputs(jax.random.PRNGKey(hash(shape) % 2**31), *shape, jnp.float32)
    check_against_reference(q, k, v, do, causal=causal, precision="highest")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [SHAPES[2], SHAPES[5], SHAPES[7]], ids=_ids)
def test_matches_reference_float32_default_precision(shape, causal):
    # The default lets the GPU run float32 matmuls as tf32, as XLA does; the table's float32
    # tolerance is the tf32 one there. (At seq 1 the backward's dP - D cancels to ~0 and tf32's
    # error in dP dominates dQ: a property of tf32, covered by the "highest" test above.)
    q, k, v, do = random_inputs(jax.random.PRNGKey(17), *shape, jnp.float32)
    check_against_reference(q, k, v, do, causal=causal)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [SHAPES[2], SHAPES[3], SHAPES[5], SHAPES[8]], ids=_ids)
def test_matches_reference_half(shape, causal, dtype):
    q, k, v, do = random_inputs(jax.random.PRNGKey(7), *shape, dtype)
    check_against_reference(q, k, v, do, causal=causal)


@pytest.mark.parametrize("seq_q,seq_kv", [(40, 100), (100, 40), (1, 77)])
def test_causal_bottom_right(seq_q, seq_kv):
    q, k, v, do = random_inputs(jax.random.PRNGKey(3), 1, seq_q, seq_kv, 4, 2, 32, jnp.float32)
    check_against_reference(q, k, v, do, causal=True, causal_alignment="bottom_right")


def test_causal_top_left_with_more_queries_than_keys_has_full_rows():
    # Top-left causal with seq_q > seq_kv: every row sees at least key 0, none are empty.
    q, k, v, do = random_inputs(jax.random.PRNGKey(4), 1, 90, 30, 2, 2, 32, jnp.float32)
    _, lse, _ = check_against_reference(q, k, v, do, causal=True)
    assert jnp.isfinite(lse).all()


def test_scale_is_used():
    q, k, v, do = random_inputs(jax.random.PRNGKey(5), 1, 50, 60, 2, 1, 32, jnp.float32)
    check_against_reference(q, k, v, do, causal=True, scale=0.37)




@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_long_unequal(causal):
    q, k, v, do = random_inputs(jax.random.PRNGKey(8), 1, 1023, 1024, 2, 1, 64, jnp.bfloat16)
    check_against_reference(q, k, v, do, causal=causal)


# Tiles other than the defaults must be just as correct: every tile the sweep (benchmarks/tune.py)
# may promote to a default is listed here, so the compiled GPU run has already checked it.
def _cfg(fwd, dkdv, dq):
    return pf.FlashConfig(fwd=pf.KernelConfig(*fwd), bwd_dkdv=pf.KernelConfig(*dkdv),
                          bwd_dq=pf.KernelConfig(*dq))


CONFIGS = {
    "d256_small": (256, _cfg((64, 32, 4, 2), (32, 32, 4, 2), (32, 32, 4, 2))),
    "d256_wide_q": (256, _cfg((128, 32, 8, 2), (16, 64, 4, 2), (64, 16, 4, 2))),
    "d256_square": (256, _cfg((32, 32, 4, 3), (32, 32, 8, 2), (64, 32, 4, 2))),
    "d256_tuned": (256, _cfg((128, 64, 8, 2), (64, 32, 8, 2), (32, 64, 4, 2))),
    # The largest tiles that fit shared memory (config.check_shared_memory): 128x128 dK/dV does
    # not (263168 bytes asked on our H200), and is refused in tests/test_errors.py.
    "d128_big": (128, _cfg((128, 128, 8, 3), (64, 128, 8, 2), (128, 64, 8, 2))),
    "d64_tall": (64, _cfg((16, 256, 4, 2), (256, 16, 4, 2), (16, 128, 2, 1))),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_explicit_tiles(name):
    head_dim, config = CONFIGS[name]
    q, k, v, do = random_inputs(jax.random.PRNGKey(9), 1, 150, 170, 2, 1, head_dim, jnp.bfloat16)
    check_against_reference(q, k, v, do, causal=True, config=config)
