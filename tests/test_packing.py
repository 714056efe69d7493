"""segment_ids_from_cu_seqlens: flash-attn style cumulative lengths to segment ids.

The end-to-end tests pack several sequences of different lengths into one row, run
flash_attention with the ids, and compare every sequence's slice of the output and of dq, dk,
dv with reference_attention run on that sequence alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from helpers import TOLERANCE, assert_close
from pallas_flash.masking import PAD_KEY_ID, PAD_QUERY_ID


def test_ids_of_one_packed_row():
    # Sequences [0, 3), [3, 3) (empty), [3, 8); rows 8 and 9 are padding.
    q_ids, kv_ids = pf.segment_ids_from_cu_seqlens(jnp.array([0, 3, 3, 8]), 10)
    want = [0, 0, 0, 2, 2, 2, 2, 2]
    np.testing.assert_array_equal(q_ids, [want + [PAD_QUERY_ID] * 2])
    np.testing.assert_array_equal(kv_ids, [want + [PAD_KEY_ID] * 2])
    assert q_ids.dtype == kv_ids.dtype == jnp.int32


def test_ids_batched_leading_padding_and_cross_packing():
    # A row per batch element; rows before cu_seqlens[0] are padding too.
    cu = np.array([[0, 2, 4], [1, 1, 3]], np.int64)
    cu_kv = np.array([[0, 3, 5], [0, 1, 2]], np.int32)
    q_ids, kv_ids = pf.segment_ids_from_cu_seqlens(cu, 4, cu_kv, 6)
    np.testing.assert_array_equal(q_ids, [[0, 0, 1, 1], [PAD_QUERY_ID, 1, 1, PAD_QUERY_ID]])
    np.testing.assert_array_equal(kv_ids, [[0, 0, 0, 1, 1, PAD_KEY_ID],
                                           [0, 1] + [PAD_KEY_ID] * 4])


def test_ids_under_jit():
    fn = jax.jit(lambda cu: pf.segment_ids_from_cu_seqlens(cu, 6))
    q_ids, kv_ids = fn(jnp.array([0, 4, 5]))
    np.testing.assert_array_equal(q_ids, [[0, 0, 0, 0, 1, PAD_QUERY_ID]])
    np.testing.assert_array_equal(kv_ids, [[0, 0, 0, 0, 1, PAD_KEY_ID]])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_sequences_equal_separate_attention(causal):
    lengths = [5, 1, 12, 7]           # 25 tokens, packed into 29 rows: 4 rows of padding
    total, heads, kv_heads, head_dim = 29, 4, 2, 16
    cu = np.concatenate([[0], np.cumsum(lengths)])
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    q = jax.random.normal(keys[0], (1, total, heads, head_dim))
    k = jax.random.normal(keys[1], (1, total, kv_heads, head_dim))
    v = jax.random.normal(keys[2], (1, total, kv_heads, head_dim))
    do = jax.random.normal(keys[3], q.shape)
    q_ids, kv_ids = pf.segment_ids_from_cu_seqlens(jnp.asarray(cu), total)

    def packed(q, k, v):
        return pf.flash_attention(q, k, v, causal=causal, q_segment_ids=q_ids,
                                  kv_segment_ids=kv_ids)

    out, vjp = jax.vjp(packed, q, k, v)
    grads = vjp(do)
    # Each sequence on its own, concatenated, zeros for the padding rows: compared as wholes
    # (the one-token sequence's dq is 0 in exact arithmetic, so it has no scale of its own).
    pad = lambda x: jnp.pad(x, ((0, 0), (0, total - cu[-1]), (0, 0), (0, 0)))  # noqa: E731
    refs = []
    for start, end in zip(cu[:-1], cu[1:]):
        part = lambda x: x[:, start:end]  # noqa: E731
        ref_out, ref_vjp = jax.vjp(
            lambda q, k, v: pf.reference_attention(q, k, v, causal=causal),
            part(q), part(k), part(v))
        refs.append((ref_out, *ref_vjp(part(do))))
    tol = TOLERANCE[jnp.dtype(jnp.float32)]
    for i, (name, actual) in enumerate(zip(("out", "dq", "dk", "dv"), (out, *grads))):
        expected = pad(jnp.concatenate([r[i] for r in refs], axis=1))
        assert_close(name, actual, expected, tol)
    # Padding: padded queries see nothing, padded keys are seen by nobody.
    for name, actual in zip(("out", "dq", "dk", "dv"), (out, *grads)):
        np.testing.assert_array_equal(actual[:, cu[-1]:], 0.0, err_msg=name)


def test_errors():
    with pytest.raises(ValueError, match=r"cu_seqlens must be an integer array \[num_seqs \+ 1\] "
                                         r"or \[batch, num_seqs \+ 1\] .* got shape \(1,\)"):
        pf.segment_ids_from_cu_seqlens(jnp.array([0]), 4)
    with pytest.raises(ValueError, match=r"cu_seqlens must be an integer array .* dtype float32"):
        pf.segment_ids_from_cu_seqlens(jnp.array([0.0, 2.0]), 4)
    with pytest.raises(ValueError, match=r"cu_seqlens_kv must be an integer array .* shape "
                                         r"\(1, 1, 2\)"):
        pf.segment_ids_from_cu_seqlens(jnp.array([0, 2]), 4, jnp.zeros((1, 1, 2), int), 4)
    with pytest.raises(ValueError, match=r"cu_seqlens must be non-negative and non-decreasing"):
        pf.segment_ids_from_cu_seqlens(jnp.array([0, 3, 2]), 4)
    with pytest.raises(ValueError, match=r"cu_seqlens must be non-negative and non-decreasing"):
        pf.segment_ids_from_cu_seqlens(jnp.array([-1, 3]), 4)
    with pytest.raises(ValueError, match=r"cu_seqlens ends at 5, past seq_q = 4"):
        pf.segment_ids_from_cu_seqlens(jnp.array([0, 5]), 4)
    with pytest.raises(ValueError, match=r"cu_seqlens_kv ends at 7, past seq_kv = 6"):
        pf.segment_ids_from_cu_seqlens(jnp.array([0, 4]), 4, jnp.array([0, 7]), 6)
    with pytest.raises(ValueError, match=r"seq_q must be a positive int, got 0"):
        pf.segment_ids_from_cu_seqlens(jnp.array([0, 0]), 0)
    with pytest.raises(ValueError, match=r"seq_kv must be a positive int, got 2.0"):
        pf.segment_ids_from_cu_seqlens(jnp.array([0, 1]), 4, jnp.array([0, 1]), 2.0)
    with pytest.raises(ValueError, match=r"cu_seqlens_kv needs seq_kv"):
        pf.segment_ids_from_cu_seqlens(jnp.array([0, 1]), 4, jnp.array([0, 1]))
    with pytest.raises(ValueError, match=r"seq_kv is given without cu_seqlens_kv"):
        pf.segment_ids_from_cu_seqlens(jnp.array([0, 1]), 4, seq_kv=4)
