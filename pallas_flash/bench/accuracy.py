"""Accuracy of each forward output, measured in the same run as its speed.

The relative error ``||out - x|| / ||x||`` against cuDNN's output and against a float32
reference evaluated on a random subset of query rows (``--ref-rows``) with the full keys and
values, so that the reference stays cheap at long sequence lengths.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_flash.bench.cases import PLAIN
from pallas_flash.bench.impls import short_error


def sample_rows(seq: int, count: int, key) -> jax.Array:
    """Sorted distinct query rows to check; all rows when count >= seq."""
    if count >= seq:
        return jnp.arange(seq)
    return jnp.sort(jax.random.choice(key, seq, (count,), replace=False))


def reference_rows(q, k, v, rows, *, causal: bool, scale: float | None = None,
                   window=None, softcap=None, q_segment_ids=None,
                   kv_segment_ids=None, sinks=None) -> jax.Array:
    """Attention output for query rows `rows` only, in float32, plain jnp.

    Uses q[:, rows] against all keys, so memory is O(len(rows) * Skv), not
    O(Sq * Skv). The mask is built from the absolute row indices: with the
    top-left causal convention query i sees keys j <= i (the cases here have
    Sq == Skv, where top-left and bottom-right agree); window (left, right)
    keeps i - left <= j <= i + right (None = unbounded); sinks [q_heads] join each row's
    softmax denominator with no value row. Returns [batch, len(rows), q_heads, V's head_dim].
    """
    batch, _, q_heads, head_dim = q.shape
    seq_kv, kv_heads = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    hi = jax.lax.Precision.HIGHEST  # GPUs would otherwise use TF32 for f32

    # GQA: query head h uses kv head h // group (same grouping as jax.nn).
    qr = q[:, rows].astype(jnp.float32).reshape(batch, len(rows), kv_heads, group, head_dim)
    s = jnp.einsum("brkgd,bskd->bkgrs", qr, k.astype(jnp.float32), precision=hi) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)

    i = rows[:, None]
    j = jnp.arange(seq_kv)[None, :]
    keep = jnp.ones((len(rows), seq_kv), bool)
    if causal:
        keep &= j <= i
    if window is not None:
        left, right = window
        if left is not None:
            keep &= j >= i - left
        if right is not None:
            keep &= j <= i + right
    keep = jnp.broadcast_to(keep, (batch, len(rows), seq_kv))
    if q_segment_ids is not None:
        keep &= q_segment_ids[:, rows][:, :, None] == kv_segment_ids[:, None, :]
    keep = keep[:, None, None]  # broadcast over kv heads and groups

    s = jnp.where(keep, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    sink = None
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(kv_heads, group)[None, :, :, None, None]
        m = jnp.maximum(m, sink)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # fully masked rows give 0, not NaN
    p = jnp.where(keep, jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + jnp.exp(sink - m)
    p = p / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("bkgrs,bskd->brkgd", p, v.astype(jnp.float32), precision=hi)
    return out.reshape(batch, len(rows), q_heads, v.shape[-1])


def rel_err(x, ref) -> float:
    """||x - ref|| / ||ref|| in float32."""
    x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm((x - ref).ravel()) / jnp.linalg.norm(ref.ravel()))


def add_accuracy(rows, outputs, case, q, k, v, kw, ref_rows, key) -> None:
    """Relative error of each forward output vs cuDNN and vs the f32 reference."""
    rows_idx = sample_rows(case.seq, ref_rows, key)
    refs: dict[bool, jax.Array] = {}
    for r in rows:
        r["ref_rows"] = int(len(rows_idx))
        r["err_vs_cudnn"] = r["err_vs_ref"] = None
        out = outputs.get(r["impl"])
        if out is None:
            continue
        plain = r["impl"] == PLAIN
        # Our plain row computes different attention than the variant.
        if "cudnn" in outputs and r["impl"] != "cudnn" and not plain:
            r["err_vs_cudnn"] = rel_err(out, outputs["cudnn"])
        try:
            if plain not in refs:
                refs[plain] = reference_rows(q, k, v, rows_idx, causal=case.causal,
                                             **({} if plain else kw))
            r["err_vs_ref"] = rel_err(out[:, rows_idx], refs[plain])
        except Exception as e:  # noqa: BLE001 - e.g. reference OOM
            r["err_vs_ref_error"] = short_error(e)
