"""In-kernel pieces shared by the Triton forward and backward kernels.

Conventions every kernel here follows:

* Refs cover a whole sequence of one (batch, head); kernels slice tiles with `pl.ds` and mask
  the rows past the end themselves. The Triton lowering turns tile reads into raw pointer
  offsets with no bounds check (on our H200 an unmasked 100-row array read with 64-row tiles
  came back wrong), so every load and store of a possibly partial tile carries a row mask.
* head_dim is padded to a power of two (the lowering only builds power-of-two tensors) and the
  padding columns are masked on load (read as 0, which adds nothing to q.k) and on store.
* Logits are kept in base 2: s2 = (q.k * scale) * log2(e), so the softmax uses exp2, which is
  one instruction on the GPU. The lse that leaves the kernel is converted back to natural log.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flash.masking import with_segment_range
from pallas_flash.spec import AttentionSpec

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MIN_TILE = 16


def fit_block(block: int, seq: int) -> int:
    """The tile actually used: never (much) longer than the sequence, never under 16 rows."""
    return min(block, max(MIN_TILE, pl.next_power_of_2(seq)))


def padded_head_dim(head_dim: int) -> int:
    return max(MIN_TILE, pl.next_power_of_2(head_dim))


def accumulator_dtype(dtype) -> jnp.dtype:
    """float32 accumulators, except float64 inputs (interpret mode), which keep float64."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def column_mask(head_dim: int, padded: int):
    """[1, padded] mask of the real head_dim columns, or None when there is no padding."""
    if head_dim == padded:
        return None
    return (jnp.arange(padded, dtype=jnp.int32) < head_dim)[None, :]


def row_positions(start, block: int):
    return start + jnp.arange(block, dtype=jnp.int32)


def _tile(ref, start, block: int, head=None):
    # One indexer per access: the Triton lowering takes no chained `.at[...]` ("No support for
    # multiple indexers yet"). Every start is int32: under jax_enable_x64 a bare `:` would be an
    # int64 start next to our int32 ones, and Pallas rejects mixed index dtypes.
    rows = pl.ds(start, block)
    cols = pl.ds(jnp.int32(0), ref.shape[-1])
    return ref.at[rows, cols] if head is None else ref.at[rows, head, cols]


def load_tile(ref, start, block: int, n_rows: int, cols, *, head=None, other=0.0):
    """Rows [start, start + block) of a [seq, head_dim_padded] ref (or [seq, heads, hdp] at
    `head`); rows >= n_rows read `other`."""
    rows_ok = (row_positions(start, block) < n_rows)[:, None]
    mask = rows_ok if cols is None else rows_ok & cols
    return plgpu.load(_tile(ref, start, block, head), mask=mask, other=other)


def store_tile(ref, start, block: int, n_rows: int, cols, value):
    rows_ok = (row_positions(start, block) < n_rows)[:, None]
    mask = rows_ok if cols is None else rows_ok & cols
    plgpu.store(_tile(ref, start, block), value.astype(ref.dtype), mask=mask)


def load_vector(ref, start, block: int, n_rows: int, *, head=None, other):
    """Entries [start, start + block) of a [seq] ref (lse, delta, segment ids), or of row
    `head` of a [heads, seq] ref."""
    ok = row_positions(start, block) < n_rows
    index = pl.ds(start, block)
    view = ref.at[index] if head is None else ref.at[head, index]
    return plgpu.load(view, mask=ok, other=other)


def _dot_precision(spec: AttentionSpec, dtype):
    # Only float32 operands have a choice (tf32 or full ieee); bf16/f16/f64 have one path.
    return spec.precision if jnp.dtype(dtype) == jnp.float32 else None


def dot(spec: AttentionSpec, a, b, *, trans_a=False, trans_b=False):
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b,
                     precision=_dot_precision(spec, a.dtype))


def scores(spec: AttentionSpec, q, k):
    """Base-2 logits of a tile, and tanh(logits / softcap) for the backward's chain rule.

    Returns (s2 [block_q, block_kv], t or None).
    """
    s = dot(spec, q, k, trans_b=True)
    if spec.softcap is None:
        return s * (spec.scale * LOG2E), None
    t = jnp.tanh(s * (spec.scale / spec.softcap))
    return t * (spec.softcap * LOG2E), t


def tile_visible(spec: AttentionSpec, q_pos, k_pos, q_ids=None, kv_ids=None):
    """Which (query, key) pairs of a tile may attend: position, the key bound, segments."""
    vis = spec.mask.visible(q_pos[:, None], k_pos[None, :], spec.mask.seq_kv)
    if q_ids is not None:
        vis = vis & (q_ids[:, None] == kv_ids[None, :])
    return vis


def split_refs(refs, n_inputs: int, has_segments: bool):
    """Kernel refs -> (inputs, segment refs, outputs).

    Every kernel here takes its dense inputs first, then, with segment ids, four more refs (the
    query ids, the key ids, and this tile's [lo, hi) block range), then its outputs. The segment
    refs come back as four Nones without segment ids.
    """
    inputs, rest = refs[:n_inputs], refs[n_inputs:]
    if has_segments:
        return inputs, rest[:4], rest[4:]
    return inputs, (None,) * 4, rest


def segment_operands(q_ids, kv_ids, lo, hi):
    """BlockSpecs and operands that `split_refs` expects after the dense inputs.

    All grids here are (tile, batch, head): the id rows are per batch, the range per tile.
    """
    whole_row = lambda seq: pl.BlockSpec((None, seq), lambda t, b, h: (b, 0))  # noqa: E731
    per_tile = pl.BlockSpec((None, None), lambda t, b, h: (b, t))
    specs = [whole_row(q_ids.shape[1]), whole_row(kv_ids.shape[1]), per_tile, per_tile]
    return specs, [q_ids, kv_ids, lo, hi]


def any_along(mask, axis: int):
    """jnp.any for kernels: the Triton lowering has no reduce_or, but has an int32 max."""
    return jnp.max(mask.astype(jnp.int32), axis=axis) > 0


def zero_unseen_rows(x, seen):
    """Rows of an operand tile that no pair of the tile uses, set to 0.

    A masked weight is 0, but 0 * NaN is NaN: without this, garbage (NaN, inf) in padding or in
    rows a tile never attends would leak into the block matmuls. Only masked tiles pay for it.
    """
    return jnp.where(seen[:, None], x, jnp.zeros_like(x))


def block_range(bounds, seg_lo_ref, seg_hi_ref):
    """The loop bounds, tightened by the segment-derived range when segment ids are given."""
    if seg_lo_ref is None:
        return bounds
    return with_segment_range(bounds, seg_lo_ref[()], seg_hi_ref[()])


def three_phase_loop(bounds, body, carry):
    """Runs body(j, carry, masked) over [lo, hi), unmasked on [full_lo, full_hi).

    Paying for the mask only on the edge blocks, as the Triton tutorial does with its stage
    flag, is what lets the interior of a causal or windowed tile run at the dense speed.
    """
    lo, full_lo, full_hi, hi = bounds
    carry = jax.lax.fori_loop(lo, full_lo, lambda j, c: body(j, c, True), carry)
    carry = jax.lax.fori_loop(full_lo, full_hi, lambda j, c: body(j, c, False), carry)
    return jax.lax.fori_loop(full_hi, hi, lambda j, c: body(j, c, True), carry)
