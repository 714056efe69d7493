"""decode_attention: attention of a few new queries against a K/V cache, for sampling.

Data flow: validate once (ValueError naming the argument) -> fold the static options into a
`DecodePlan` -> pack the q_heads // kv_heads query heads of each kv head, times the q_len new
tokens, into the rows of one tile (K/V is read once per group) -> a backend's split-KV kernel
writes one partial (O, lse) per (batch, kv head, split) -> the combine kernel merges the splits
through their lse -> sinks -> unpack to [batch, q_len, q_heads, head_dim].

Backend contract (pallas_flash/triton/decode.py, pallas_flash/mosaic/decode.py): each module
exposes `partial(plan, q_packed, k_cache, v_cache, kv_lengths, block_table)` (see
`partial_contract` below for its exact shapes) and `unsupported_reason(plan) -> str | None`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["decode_attention", "DecodePlan", "choose_num_splits"]


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """The static description of one decode call: hashable, closed over by the kernels.

    Attributes:
      batch, q_len, q_heads, kv_heads, head_dim: the call's sizes (q_len in 1..16).
      group: q_heads // kv_heads.
      rows: group * q_len, the packed query rows of one kv head (row r = t * group + g).
      max_len: key positions a sequence can hold: the contiguous cache's length, or
        pages_per_seq * page_size.
      pages_per_seq: block_table's second dimension; None for a contiguous cache.
      page_size: keys per page (a power of two >= 16); None for a contiguous cache.
      num_splits: chunks the key positions [0, max_len) are cut into; split s owns positions
        [s * chunk, min((s + 1) * chunk, max_len)). A split past a sequence's kv_length is
        empty for it.
      chunk: keys per split, a multiple of CHUNK_ALIGN and of page_size (a split never cuts a
        page); num_splits * chunk >= max_len > (num_splits - 1) * chunk.
      scale: logit multiplier.
      softcap: logits become softcap * tanh(scale * q.k / softcap); None for none.
      window_left: query t (at position p = kv_length - q_len + t) sees keys
        max(0, p - window_left) <= j <= p; None = unbounded. The right side of a window is
        clamped to 0 by causality, so only the left side is kept.
      dtype: the dtype of q and of the caches.
      interpret: Pallas interpret mode.
    """

    batch: int
    q_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    group: int
    rows: int
    max_len: int
    pages_per_seq: int | None
    page_size: int | None
    num_splits: int
    chunk: int
    scale: float
    softcap: float | None
    window_left: int | None
    dtype: jnp.dtype
    interpret: bool

    @property
    def paged(self) -> bool:
        return self.page_size is not None


# A chunk is a whole number of these keys, so that every backend's kv block (a power of two up
# to this size) tiles a chunk exactly.
CHUNK_ALIGN = 64


def partial_contract(plan: DecodePlan, q_packed: jax.Array, k_cache: jax.Array,
                     v_cache: jax.Array, kv_lengths: jax.Array,
                     block_table: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """The signature and meaning of every backend's `partial` (this function is documentation).

    Args:
      plan: the call's DecodePlan.
      q_packed: [batch, kv_heads, rows, head_dim] in plan.dtype; row r = t * group + g holds
        query token t of query head kv_head * group + g.
      k_cache, v_cache: contiguous [batch, max_len, kv_heads, head_dim], or paged
        [num_pages, page_size, kv_heads, head_dim]; plan.dtype.
      kv_lengths: int32 [batch], already clamped to [0, max_len]. Query token t sits at
        position kv_length - q_len + t and sees keys j <= that position (and j >= position -
        window_left); a token whose position is < 0 sees no key.
      block_table: int32 [batch, pages_per_seq] (logical page p of sequence b is physical page
        block_table[b, p]), or None for a contiguous cache. Only the entries of pages that hold
        a position < kv_length are read; the rest may hold anything.

    Returns:
      o_part: float32 [batch, kv_heads, num_splits, rows, head_dim], each split's softmax-
        normalised output over its own keys (0 for a row that sees no key of the split).
      lse_part: float32 [batch, kv_heads, num_splits, rows], the natural-log logsumexp of the
        row's scaled (soft-capped) logits over the split's visible keys; -inf when none.
    """
    raise NotImplementedError("documentation only")


def choose_num_splits(*args, **kwargs) -> int:
    raise NotImplementedError


def decode_attention(*args, **kwargs):
    raise NotImplementedError
