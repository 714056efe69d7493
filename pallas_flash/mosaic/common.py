"""Pieces shared by the Mosaic GPU forward and backward kernels."""

from __future__ import annotations

from jax import lax

from pallas_flash.masking import with_segment_range


def narrowed(bounds, seg_ref, batch, block):
    """Loop bounds (lo, full_lo, full_hi, hi) tightened by the segment range precomputed in XLA
    for (batch, block), read as two scalars; unchanged without segment ids (seg_ref None)."""
    if seg_ref is None:
        return bounds
    return with_segment_range(bounds, seg_ref[batch, block, 0], seg_ref[batch, block, 1])


def streamed_range(bounds, seg_ref, batch, block):
    """[lo, hi): the blocks a CTA's copy warpgroup streams, i.e. the outer bounds only. Every one
    is consumed by each compute warpgroup (computed or drained), so the barriers stay in step."""
    lo, _, _, hi = bounds
    lo, _, _, hi = narrowed((lo, lo, hi, hi), seg_ref, batch, block)
    return lo, hi


def grid_position(mask, n_tiles: int):
    """(tile, head, batch, warpgroup) of this program. With a causal bound (mask.right set),
    tiles run last-first: the last query rows see the most keys, and starting the longest CTAs
    first keeps the tail of the grid short."""
    tile = lax.axis_index("tile")
    if mask.right is not None:
        tile = (n_tiles - 1) - tile
    return tile, lax.axis_index("head"), lax.axis_index("batch"), lax.axis_index("wg")
