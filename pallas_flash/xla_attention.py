"""The drop-in's XLA path for a dense mask the kernels cannot serve.

jax.nn's arithmetic, a chunk of queries at a time: each chunk is rematerialised in the backward
pass, so neither pass holds more than one chunk's logits, where jax.nn holds all T x S of them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_flash import dense_mask
from pallas_flash.sinks import apply_sinks

__all__ = ["FALLBACK_CHUNK_ELEMENTS", "chunk_rows", "masked_attention", "rows_attention"]

# Chunks of at most this many float32 logits, or of a quarter of the mask's [B, T, S] elements
# (as many bytes as the mask), whichever is larger: under jit this path is a branch of a switch,
# and XLA reserves the memory of every branch, taken or not.
FALLBACK_CHUNK_ELEMENTS = 2**22


def chunk_rows(batch, heads, seq_q, seq_kv) -> int:
    """Query rows per chunk of the mask fallback: a power of two, or all of them."""
    budget = max(FALLBACK_CHUNK_ELEMENTS, batch * seq_q * seq_kv // 4)
    rows = max(1, budget // (batch * heads * seq_kv))
    return seq_q if rows >= seq_q else 1 << (rows.bit_length() - 1)


def masked_attention(q, k, v, mask, *, causal, window, q_lengths, kv_lengths, scale,
                          softcap, return_residual, sinks=None):
    """Attention with a dense mask in XLA, jax.nn's arithmetic, a chunk of queries at a time.

    q, k: [B, T, N, H], [B, S, K, H]; v: [B, S, K, H_v]; mask: [B|1, N|1, T|1, S|1]. Each chunk is
    rematerialised in the backward pass, so neither pass holds more than one chunk's logits.
    Returns (out,) or (out, residual [B, T, N] in k's dtype, gradient stopped).
    """
    batch, seq_q, heads, _ = q.shape
    seq_kv = k.shape[1]
    rows = chunk_rows(batch, heads, seq_q, seq_kv)
    chunks = -(-seq_q // rows)
    pad = chunks * rows - seq_q
    if pad:
        q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
        if mask.shape[2] != 1:
            mask = jnp.pad(mask, ((0, 0), (0, 0), (0, pad), (0, 0)))

    def chunk(start):
        qc = lax.dynamic_slice_in_dim(q, start, rows, axis=1)
        mc = mask if mask.shape[2] == 1 else lax.dynamic_slice_in_dim(mask, start, rows, axis=2)
        q_pos = start + jnp.arange(rows, dtype=jnp.int32)[:, None]
        k_pos = jnp.arange(seq_kv, dtype=jnp.int32)[None, :]
        allowed = dense_mask.allowed_by_options(q_pos, k_pos, is_causal=causal, window=window,
                                                seq_q=seq_q, seq_kv=seq_kv, q_lengths=q_lengths,
                                                kv_lengths=kv_lengths)
        visible = mc if allowed is None else mc & allowed
        return rows_attention(qc, k, v, visible, scale=scale, softcap=softcap)

    if chunks == 1:
        out, lse = chunk(0)
    else:
        out, lse = lax.map(jax.checkpoint(chunk), jnp.arange(chunks, dtype=jnp.int32) * rows)
        out = jnp.moveaxis(out, 0, 1).reshape(batch, chunks * rows, *out.shape[3:])
        lse = jnp.moveaxis(lse, 0, 1).reshape(batch, chunks * rows, heads)
    out, lse = out[:, :seq_q], lse[:, :seq_q]
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks, heads_axis=2)
    if not return_residual:
        return (out,)
    return out, lax.stop_gradient(lse.astype(k.dtype))


def rows_attention(q, k, v, visible, *, scale, softcap):
    """softmax(cap(scale * q k^T), visible) v for q [B, C, N, H], v [B, S, K, H_v], visible
    [B|1, N|1, C, S].

    jax.nn's arithmetic (float32 logits and softmax, masked logits set to a large negative
    number, P cast to v's dtype), except that a row that sees no key gives 0 and lse -inf.
    Returns out [B, C, N, H_v] in q's dtype and lse [B, C, N] float32.
    """
    batch, rows, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    compute = jnp.promote_types(q.dtype, jnp.float32)
    qg = q.reshape(batch, rows, kv_heads, group, head_dim).astype(compute)
    logits = jnp.einsum("bckgh,bskh->bkgcs", qg, k.astype(compute))
    logits = logits * (1.0 / math.sqrt(head_dim) if scale is None else scale)
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    vis_batch, vis_heads = visible.shape[:2]
    if vis_heads == 1:
        visible = visible[:, :, None]                                # [B|1, 1, 1, C, S]
    else:
        visible = visible.reshape(vis_batch, kv_heads, group, *visible.shape[2:])
    large_negative = -0.7 * float(jnp.finfo(jnp.float32).max)
    logits = jnp.where(visible, logits, large_negative)
    seen = jnp.any(visible, axis=-1)                                 # [B|1, K|1, G|1, C]
    lse = jax.nn.logsumexp(logits, axis=-1)
    probs = jnp.exp(logits - lse[..., None]).astype(v.dtype)
    out = jnp.einsum("bkgcs,bskh->bckgh", probs, v).astype(compute)
    out_seen = jnp.moveaxis(seen, -1, 1)[..., None]                  # [B|1, C, K|1, G|1, 1]
    out = jnp.where(out_seen, out, 0.0).astype(q.dtype).reshape(batch, rows, heads, v.shape[-1])
    lse = jnp.where(seen, lse, -jnp.inf)
    lse = jnp.broadcast_to(lse, (batch, kv_heads, group, rows))
    return out, jnp.moveaxis(lse.reshape(batch, heads, rows), 1, 2)
