"""What a query may see: the one description that the kernels, their loop bounds and the reference share.

Query row i may see key row j when all of these hold:

* position: ``i + offset - left <= j <= i + offset + right``, where ``offset`` aligns the two
  sequences (0 for top-left alignment, as in `jax.nn.dot_product_attention`; ``seq_kv - seq_q``
  for bottom-right, as in FlashAttention, for decoding and chunked prefill), ``left`` and
  ``right`` come from the sliding window (None = unbounded), and causal clamps ``right`` to 0;
* bounds: ``j < kv_len`` (the array length, or the per-batch valid length) and ``i < q_len``;
* segments: ``q_segment_ids[i] == kv_segment_ids[j]`` when segment ids are given.

The position rule is static (Python ints), so the kernels can derive from it, per tile, which
key blocks hold any visible key (the loop bounds: everything else is skipped, not masked) and
which hold only visible keys (no mask needed: the fast path). Lengths and segment ids are data,
so they always go through the mask, and they only ever shrink the loop bounds.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["MaskSpec", "make_mask_spec", "CausalAlignment", "segment_ids_from_cu_seqlens"]

CausalAlignment = Literal["top_left", "bottom_right"]


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """Static part of the mask. Hashable; the kernels close over it.

    Attributes:
      seq_q, seq_kv: the array lengths.
      offset: key index aligned with query 0 (see the module docstring).
      left, right: how far a query sees before / after its aligned key; None = unbounded.
    """

    seq_q: int
    seq_kv: int
    offset: int = 0
    left: int | None = None
    right: int | None = None

    @property
    def has_position_mask(self) -> bool:
        return self.left is not None or self.right is not None

    # ---- element level -------------------------------------------------------------------

    def visible(self, q_pos, k_pos, kv_len=None):
        """Boolean mask from broadcastable int32 positions (plus the key bound, if given)."""
        ok = None

        def _and(a, b):
            return b if a is None else a & b

        if self.right is not None:
            ok = _and(ok, k_pos <= q_pos + (self.offset + self.right))
        if self.left is not None:
            ok = _and(ok, k_pos >= q_pos + (self.offset - self.left))
        if kv_len is not None:
            ok = _and(ok, k_pos < kv_len)
        return ok

    # ---- block level: loop bounds ------------------------------------------------------------
    # All arguments may be traced int32 scalars (program ids, per-batch lengths). Every division
    # is done on values clamped to >= 0 first, because lax.div truncates toward zero and the
    # Triton lowering has no floor division; where the true result would be negative, the clamp
    # to the [lo, hi] range makes the answer the same.

    def kv_blocks(self, q_start, block_q: int, block_kv: int, kv_len, xp=jnp):
        """Key-block ranges for the query rows [q_start, q_start + block_q).

        Returns int32 scalars (lo, full_lo, full_hi, hi): blocks [lo, hi) may hold a visible
        key; blocks [full_lo, full_hi), a sub-range, hold only visible keys for every query row
        of the tile, and lie wholly below kv_len.
        xp=numpy: the same ranges from static values while tracing, with no jax op run (an
        eager op would be compiled on a process's first step); q_start may be an array.
        """
        q_last = xp.minimum(q_start + block_q, self.seq_q) - 1
        zero = xp.int32(0)
        if self.left is None:
            lo = zero
            full_lo = zero
        else:
            lo = _div(_relu(q_start + (self.offset - self.left), xp), block_kv, xp)
            full_lo = _cdiv(_relu(q_last + (self.offset - self.left), xp), block_kv, xp)
        if self.right is None:
            hi = _cdiv(kv_len, block_kv, xp)
            full_hi = _div(kv_len, block_kv, xp)
        else:
            reach = _relu(q_last + (self.offset + self.right + 1), xp)
            hi = _cdiv(xp.minimum(reach, kv_len), block_kv, xp)
            first_reach = _relu(q_start + (self.offset + self.right + 1), xp)
            full_hi = _div(xp.minimum(first_reach, kv_len), block_kv, xp)
        return _order(lo, full_lo, full_hi, hi, xp)

    def q_blocks(self, kv_start, block_kv: int, block_q: int, kv_len, q_len):
        """Query-block ranges for the key rows [kv_start, kv_start + block_kv).

        Returns int32 scalars (lo, full_lo, full_hi, hi) as in `kv_blocks`. A key block that
        straddles kv_len has no full blocks: its keys past kv_len need the mask.
        """
        kv_end = jnp.minimum(kv_start + block_kv, kv_len)
        k_last = kv_end - 1
        zero = jnp.int32(0)
        if self.right is None:
            lo = zero
            full_lo = zero
        else:
            lo = _div(_relu(kv_start - (self.offset + self.right)), block_q)
            full_lo = _cdiv(_relu(k_last - (self.offset + self.right)), block_q)
        if self.left is None:
            hi = _cdiv(q_len, block_q)
            full_hi = _div(q_len, block_q)
        else:
            reach = _relu(k_last - (self.offset - self.left) + 1)
            hi = _cdiv(jnp.minimum(reach, q_len), block_q)
            first_reach = _relu(kv_start - (self.offset - self.left) + 1)
            full_hi = _div(jnp.minimum(first_reach, q_len), block_q)
        # Keys at or past kv_len exist in this block: no query block is free of the mask.
        straddles = kv_start + block_kv > kv_len
        full_hi = jnp.where(straddles, zero, full_hi)
        # A block wholly past kv_len sees nothing: an empty range gives dK = dV = 0.
        hi = jnp.where(kv_start >= kv_len, zero, hi)
        return _order(lo, full_lo, full_hi, hi)

    # ---- dense, for the reference only ----------------------------------------------------------

    def dense(self, kv_len=None):
        """[seq_q, seq_kv] boolean mask (or None if everything is visible). Reference only."""
        q_pos = jnp.arange(self.seq_q, dtype=jnp.int32)[:, None]
        k_pos = jnp.arange(self.seq_kv, dtype=jnp.int32)[None, :]
        return self.visible(q_pos, k_pos, kv_len)


def make_mask_spec(
    seq_q: int,
    seq_kv: int,
    *,
    causal: bool,
    causal_alignment: CausalAlignment = "top_left",
    window: tuple[int | None, int | None] | None = None,
) -> MaskSpec:
    """Folds the user's options into a MaskSpec. Assumes they were validated."""
    offset = seq_kv - seq_q if causal_alignment == "bottom_right" else 0
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(right, 0)
    return MaskSpec(seq_q=seq_q, seq_kv=seq_kv, offset=offset, left=left, right=right)


def with_segment_range(bounds, seg_lo, seg_hi):
    """Intersects loop bounds with a segment-derived block range [seg_lo, seg_hi).

    With segment ids every visited block is masked (ids are data), so the unmasked middle range
    collapses to empty.
    """
    lo, _, _, hi = bounds
    lo = jnp.maximum(lo, seg_lo)
    hi = jnp.maximum(jnp.minimum(hi, seg_hi), lo)
    return lo, lo, lo, hi


def visited_kv_blocks(spec: MaskSpec, block_q: int, block_kv: int, q_ids=None, kv_ids=None):
    """Cost model: how many (query block, key block) tiles the forward kernel visits.

    It evaluates the very bounds the kernel loops over, for every query block (and batch row,
    with segment ids), so a test can show that masked-out tiles are skipped, not computed.
    Returns an int array [batch] (or a scalar without ids).
    """
    n_q = -(-spec.seq_q // block_q)
    starts = jnp.arange(n_q, dtype=jnp.int32) * block_q
    bounds = jax.vmap(lambda s: spec.kv_blocks(s, block_q, block_kv, spec.seq_kv))(starts)
    if q_ids is None:
        return jnp.sum(bounds[3] - bounds[0])
    seg_lo, seg_hi = segment_block_ranges(q_ids, kv_ids, block_q, block_kv)
    per_batch = jax.vmap(lambda lo, hi: with_segment_range(bounds, lo, hi))(seg_lo, seg_hi)
    return jnp.sum(per_batch[3] - per_batch[0], axis=1)


# xp: jnp (traced or concrete jax values) or numpy (static values, `MaskSpec.kv_blocks`). The
# divisions see values >= 0 only, where numpy's floor division and lax.div agree.
def _relu(x, xp=jnp):
    return xp.maximum(x, xp.int32(0))


def _div(x, d: int, xp=jnp):
    if xp is np:
        return np.asarray(x, np.int32) // np.int32(d)
    return lax.div(jnp.asarray(x, jnp.int32), jnp.int32(d))


def _cdiv(x, d: int, xp=jnp):
    if xp is np:
        return (np.asarray(x, np.int32) + np.int32(d - 1)) // np.int32(d)
    return lax.div(jnp.asarray(x, jnp.int32) + jnp.int32(d - 1), jnp.int32(d))


def _order(lo, full_lo, full_hi, hi, xp=jnp):
    """Clamps so that lo <= full_lo <= full_hi <= hi always holds."""
    hi = xp.maximum(hi, lo)
    full_lo = xp.clip(full_lo, lo, hi)
    full_hi = xp.clip(full_hi, full_lo, hi)
    return lo, full_lo, full_hi, hi


# Padding lengths are folded into segment ids, so the kernels have one data-dependent mask, not
# two. A padded query row gets an id no key has; a padded key gets an id no query has. The two
# largest int32 values keep sorted ids sorted, which keeps the block ranges below tight.
PAD_QUERY_ID = 2**31 - 1
PAD_KEY_ID = 2**31 - 2


def fold_lengths(q_segment_ids, kv_segment_ids, q_lengths, kv_lengths, *, batch, seq_q, seq_kv):
    """int32 ids [batch, seq_q] and [batch, seq_kv] that encode segments and padding together."""
    def ids(segment_ids, lengths, seq, pad_id):
        out = (jnp.zeros((batch, seq), jnp.int32) if segment_ids is None
               else segment_ids.astype(jnp.int32))
        if lengths is not None:
            pos = jnp.arange(seq, dtype=jnp.int32)[None, :]
            out = jnp.where(pos < lengths.astype(jnp.int32)[:, None], out, jnp.int32(pad_id))
        return out

    return (ids(q_segment_ids, q_lengths, seq_q, PAD_QUERY_ID),
            ids(kv_segment_ids, kv_lengths, seq_kv, PAD_KEY_ID))


def _block_min_max(ids, block: int):
    batch, seq = ids.shape
    n = -(-seq // block)
    # Repeating the last id keeps a partial block's range the range of its real rows.
    tiles = jnp.pad(ids, ((0, 0), (0, n * block - seq)), mode="edge").reshape(batch, n, block)
    return tiles.min(-1), tiles.max(-1)


def segment_block_ranges(row_ids, col_ids, block_row: int, block_col: int):
    """For each (batch, row block): the column blocks [lo, hi) whose ids may equal a row's id.

    A column block can match a row block only if their [min, max] id ranges overlap. With a
    running max of the column maxima (non-decreasing) and a running min of the column minima
    taken from the right (non-decreasing too), both ends become binary searches: O(seq) work and
    memory, no block-by-block matrix. The range is exact for sorted ids (packed documents) and a
    safe superset otherwise; the in-kernel mask keeps the answer right either way.

    Returns int32 [batch, n_row_blocks] lo and hi.
    """
    row_min, row_max = _block_min_max(row_ids, block_row)
    col_min, col_max = _block_min_max(col_ids, block_col)
    max_so_far = lax.cummax(col_max, axis=1)
    min_from_right = lax.cummin(col_min, axis=1, reverse=True)
    lo = jax.vmap(lambda a, x: jnp.searchsorted(a, x, side="left"))(max_so_far, row_min)
    hi = jax.vmap(lambda a, x: jnp.searchsorted(a, x, side="right"))(min_from_right, row_max)
    return lo.astype(jnp.int32), hi.astype(jnp.int32)


def segment_ids_from_cu_seqlens(
    cu_seqlens: jax.typing.ArrayLike,
    seq_q: int,
    cu_seqlens_kv: jax.typing.ArrayLike | None = None,
    seq_kv: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Segment ids for packed sequences given flash-attn style cumulative lengths.

        q_ids, kv_ids = segment_ids_from_cu_seqlens(cu_seqlens, total)
        out = flash_attention(q[None], k[None], v[None], causal=True,
                              q_segment_ids=q_ids, kv_segment_ids=kv_ids)

    Sequence i occupies rows ``cu_seqlens[i] <= p < cu_seqlens[i + 1]`` and gets id i. Rows
    before ``cu_seqlens[0]`` or from ``cu_seqlens[-1]`` on are padding: a padded query gets an
    id no key has and a padded key one no query has (the ids `fold_lengths` uses), so padded
    queries see nothing (output 0, zero gradients) and padded keys are never seen. With one
    shared packing (self-attention), ``causal=True`` is causal within each sequence, as in
    flash-attn's varlen functions.

    Args:
      cu_seqlens: int [num_seqs + 1] (one packed row) or [batch, num_seqs + 1] (a packed row
        per batch element), non-decreasing, usually starting at 0; checked when concrete.
      seq_q: the packed query length (total tokens, padding included), a static int.
      cu_seqlens_kv, seq_kv: the same for the keys when they are packed differently (cross
        attention), with as many sequences as cu_seqlens; default: those of the queries.

    Returns:
      int32 q_ids [1 or batch, seq_q] and kv_ids [1 or batch, seq_kv], for the
      `q_segment_ids` and `kv_segment_ids` of `flash_attention`.
    """
    if cu_seqlens_kv is None:
        if seq_kv is not None:
            raise ValueError("seq_kv is given without cu_seqlens_kv")
        cu_seqlens_kv, seq_kv = cu_seqlens, seq_q
    elif seq_kv is None:
        raise ValueError("cu_seqlens_kv needs seq_kv, its packed length")
    cu_q = _check_cu_seqlens("cu_seqlens", cu_seqlens, "seq_q", seq_q)
    cu_kv = _check_cu_seqlens("cu_seqlens_kv", cu_seqlens_kv, "seq_kv", seq_kv)
    # Query sequence i attends to key sequence i: with other counts the ids would not line up.
    if cu_q.shape[-1] != cu_kv.shape[-1]:
        raise ValueError(f"cu_seqlens and cu_seqlens_kv must hold the same number of sequences, "
                         f"got {cu_q.shape[-1] - 1} and {cu_kv.shape[-1] - 1} (shapes "
                         f"{cu_q.shape} and {cu_kv.shape})")
    return (_ids_from_cu_seqlens(cu_q, seq_q, PAD_QUERY_ID),
            _ids_from_cu_seqlens(cu_kv, seq_kv, PAD_KEY_ID))


def _check_cu_seqlens(name, cu_seqlens, length_name, length):
    """cu_seqlens as an array, or a ValueError naming it (its values are checked when
    concrete)."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"{length_name} must be a positive int, got {length!r}")
    cu = jnp.asarray(cu_seqlens)
    if cu.ndim not in (1, 2) or cu.shape[-1] < 2 or not jnp.issubdtype(cu.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array [num_seqs + 1] or [batch, num_seqs "
                         f"+ 1] with num_seqs >= 1, got shape {cu.shape} and dtype {cu.dtype}")
    if not isinstance(cu, jax.core.Tracer):
        values = jax.device_get(cu)
        if (values[..., 1:] < values[..., :-1]).any() or values.min() < 0:
            raise ValueError(f"{name} must be non-negative and non-decreasing, got {values}")
        if values.max() > length:
            raise ValueError(f"{name} ends at {values.max()}, past {length_name} = {length}")
    return cu


def _ids_from_cu_seqlens(cu, length, pad_id):
    rows = jnp.atleast_2d(cu).astype(jnp.int32)
    pos = jnp.arange(length, dtype=jnp.int32)
    # Row p belongs to the last sequence that starts at or before it.
    seq = jax.vmap(lambda c: jnp.searchsorted(c, pos, side="right"))(rows) - 1
    inside = (seq >= 0) & (seq < rows.shape[1] - 1)
    return jnp.where(inside, seq, jnp.int32(pad_id)).astype(jnp.int32)
