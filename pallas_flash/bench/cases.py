"""The benchmark's cases: shapes, variants, random inputs and the FLOP formula.

A case is ``batch x seq x q_heads x kv_heads x head_dim`` plus the mask (causal or not) and an
optional variant (packed documents, a sliding window, a logit softcap or attention sinks). Its
inputs are random normal, never zeros: zeros make every softmax row uniform and hide bugs.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

# (batch, seq, q_heads, kv_heads, head_dim); each is run causal and non-causal.
DEFAULT_CASES = (
    (8, 2048, 16, 16, 128),
    (2, 8192, 16, 16, 128),
    (1, 16384, 16, 16, 128),
    (2, 8192, 32, 32, 64),
    (2, 8192, 32, 8, 128),
    (2, 8192, 8, 8, 256),
)
SMOKE_CASE = (1, 128, 2, 1, 32)
# The row of our own kernel run without the variant's option, for variants.
PLAIN = "pallas_flash[plain]"
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}

PACKED_DOCS = 12
WINDOW = (4096, 0)
SOFTCAP = 50.0


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    seq: int
    q_heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    variant: str | None = None  # None, "packed", "window", "softcap" or "sinks"
    head_dim_v: int | None = None  # V's head_dim where it is not Q/K's (MLA)

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def shape_name(self) -> str:
        v = "" if self.head_dim_v is None else f"x{self.head_dim_v}"
        return (f"{self.batch}x{self.seq}x{self.q_heads}x{self.kv_heads}"
                f"x{self.head_dim}{v}")

    @property
    def name(self) -> str:
        return f"{self.variant}:{self.shape_name}" if self.variant else self.shape_name


def parse_case(text: str) -> tuple[int, ...]:
    """'2x8192x16x16x128' -> (2, 8192, 16, 16, 128); a sixth field is V's head_dim (MLA:
    '1x8192x16x16x192x128')."""
    parts = text.strip().lower().split("x")
    if len(parts) not in (5, 6):
        raise argparse.ArgumentTypeError(
            f"case {text!r} is not batch x seq x q_heads x kv_heads x head_dim [x head_dim_v]")
    return tuple(int(p) for p in parts)


def parse_seq(text: str) -> int:
    """'32k' -> 32768, '1M' -> 1048576, '4096' -> 4096 (powers of two)."""
    text = text.strip()
    mult = {"k": 1 << 10, "K": 1 << 10, "m": 1 << 20, "M": 1 << 20}.get(text[-1:], 1)
    return int(text[:-1] if mult > 1 else text) * mult


def seq_label(seq: int) -> str:
    if seq % (1 << 20) == 0:
        return f"{seq >> 20}M"
    if seq % (1 << 10) == 0:
        return f"{seq >> 10}k"
    return str(seq)


def variant_cases() -> list[Case]:
    """The variant cases; all bf16 (or --dtype), causal, head_dim 128 unless noted."""
    return [
        Case(1, 16384, 16, 16, 128, True, "packed"),   # 12 documents in 16k tokens
        Case(1, 32768, 16, 16, 128, True, "window"),   # sliding window 4096
        Case(2, 8192, 16, 16, 128, True, "softcap"),   # logit softcap 50
        Case(2, 8192, 16, 8, 256, True, "softcap"),    # and at Gemma 2's head_dim and GQA
        Case(2, 8192, 16, 16, 128, True, "sinks"),     # one sink logit per head, N(0, 1)
    ]


def packed_segment_ids(key, seq: int, docs: int) -> jax.Array:
    """[1, seq] int32 ids of `docs` back-to-back documents of random lengths."""
    # Distinct random cut points give random lengths that sum to `seq`.
    cuts = jax.random.choice(key, jnp.arange(1, seq), (docs - 1,), replace=False)
    cuts = jnp.sort(cuts)
    ids = jnp.searchsorted(cuts, jnp.arange(seq), side="right")
    return ids.astype(jnp.int32)[None, :]


def variant_kwargs(case: Case, key) -> dict[str, Any]:
    """The flash_attention keyword arguments that make `case` a variant."""
    if case.variant is None:
        return {}
    if case.variant == "packed":
        ids = jnp.broadcast_to(packed_segment_ids(key, case.seq, PACKED_DOCS),
                               (case.batch, case.seq))
        return {"q_segment_ids": ids, "kv_segment_ids": ids}
    if case.variant == "window":
        return {"window": WINDOW}
    if case.variant == "softcap":
        return {"softcap": SOFTCAP}
    if case.variant == "sinks":
        return {"sinks": jax.random.normal(key, (case.q_heads,), jnp.float32)}
    raise ValueError(f"unknown variant {case.variant!r}")


def make_inputs(case: Case, dtype, key):
    """Random normal q, k, v and output cotangent."""
    kq, kk, kv, kd = jax.random.split(key, 4)
    b, s, hq, hkv, d = case.batch, case.seq, case.q_heads, case.kv_heads, case.head_dim
    q = jax.random.normal(kq, (b, s, hq, d), dtype)
    k = jax.random.normal(kk, (b, s, hkv, d), dtype)
    v = jax.random.normal(kv, (b, s, hkv, case.v_dim), dtype)
    do = jax.random.normal(kd, (b, s, hq, case.v_dim), dtype)
    return q, k, v, do


# --------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------

def attention_flops(batch: int, seq_q: int, seq_kv: int, q_heads: int,
                    head_dim: int, causal: bool, pass_: str = "fwd",
                    head_dim_v: int | None = None) -> float:
    """Conventional FLOP count of attention (the FlashAttention papers' convention).

    forward  = 4 * B * Hq * Sq * Skv * D    (two matmuls, QK^T and PV, 2 FLOPs
               per multiply-add), halved when causal; with V's own head_dim Dv (MLA)
               2 * B * Hq * Sq * Skv * (D + Dv);
    backward = 2.5 * forward               (five matmuls instead of two);
    fwd+bwd  = 3.5 * forward.

    Softmax exponentials are not counted; kv_heads does not matter (GQA shares
    K/V but each query head still does the full work).
    """
    pairs = seq_q * seq_kv / 2 if causal else seq_q * seq_kv
    return _pair_flops(batch, q_heads, pairs, head_dim, head_dim_v, pass_)


def _pair_flops(batch: int, q_heads: int, pairs: float, head_dim: int,
                head_dim_v: int | None, pass_: str) -> float:
    """attention_flops over `pairs` (query, key) pairs per batch row and head."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    fwd = 2.0 * batch * q_heads * pairs * (head_dim + head_dim_v)
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwdbwd": 3.5 * fwd}[pass_]


def attended_pairs(case: Case, kwargs: dict[str, Any]) -> float:
    """(query, key) pairs per batch row and head that the variant keeps."""
    s = case.seq
    if "window" in kwargs:  # causal window (left, 0): row i sees min(i, left)+1 keys
        left = kwargs["window"][0]
        w = min(left, s - 1)
        return w * (w + 1) / 2 + (w + 1) * (s - w)
    if "q_segment_ids" in kwargs:  # causal within each document
        ids = kwargs["q_segment_ids"][0]
        lengths = jnp.bincount(ids, length=int(ids.max()) + 1).tolist()
        return float(sum(n * (n + 1) // 2 for n in lengths))
    return s * s / 2 if case.causal else s * s


def case_flops(case: Case, kwargs: dict[str, Any], pass_: str) -> float:
    """FLOPs of `case` run with `kwargs`: the dense formula, or for a masking variant the same
    formula over the (query, key) pairs the mask keeps, so its TFLOP/s is useful work."""
    if not {"window", "q_segment_ids"} & kwargs.keys():
        return attention_flops(case.batch, case.seq, case.seq, case.q_heads,
                               case.head_dim, case.causal, pass_, case.head_dim_v)
    return _pair_flops(case.batch, case.q_heads, attended_pairs(case, kwargs), case.head_dim,
                       case.head_dim_v, pass_)
