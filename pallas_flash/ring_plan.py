"""The static plan of context-parallel attention, and the byte model that picks its strategy.

The sequence is split over P devices. At step t device i attends its query rows to the K/V
shard of device (i - t) mod P. Everything about that pair is static (Python ints): each device's
rows are one or two *pieces* of natural positions (the contiguous or the zig-zag layout), so
every (query piece, key piece) cell has a fixed position mask: the user's window and causal
bound shifted by the distance between the pieces. A cell in which no key is visible is dropped;
the others are merged into as few kernel calls as one `MaskSpec` can describe (a plain causal
mask over the two zig-zag pieces of the diagonal, one unmasked call over both pieces of an
earlier device, ...). Devices that make the same calls at a step share a *kind*; a step whose
kinds make no call on any device is dropped altogether: with a sliding window the ring only
visits the shards the window reaches. Each call carries its backends, chosen as
`flash_attention` chooses them (`attention._choose_backends`), per call.

`strategy_bytes` and `choose_strategy` are the written-down rule behind ``strategy="auto"``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_flash import attention
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import forward as mosaic_forward
from pallas_flash.spec import AttentionSpec

__all__ = ["Call", "Piece", "Plan", "Step", "choose_strategy", "layout_pieces", "make_plan",
           "strategy_bytes"]

LAYOUTS = ("contiguous", "zigzag")
STRATEGIES = ("auto", "ring", "allgather")


@dataclasses.dataclass(frozen=True)
class Piece:
    """Local rows [local, local + length) hold the natural positions [start, start + length)."""

    local: int
    start: int
    length: int


def layout_pieces(layout: str, devices: int, device: int, seq: int) -> tuple[Piece, ...]:
    """The pieces of `device` for a local (per-device) length `seq`."""
    if layout == "contiguous":
        return (Piece(0, device * seq, seq),)
    chunk = seq // 2
    return (Piece(0, device * chunk, chunk),
            Piece(chunk, (2 * devices - 1 - device) * chunk, chunk))


# ================================================================================================
# Mask algebra: one static position mask per cell, merged where one MaskSpec covers several
# ================================================================================================


def _normalize(seq_q: int, seq_kv: int, offset: int, left, right) -> MaskSpec | None:
    """The position mask on a seq_q x seq_kv rectangle in canonical form: None when no key is
    visible to any row, sides that never bind dropped (and the offset with them), so that two
    descriptions of one pattern compare equal."""
    lo_q = 0 if right is None else max(0, -offset - right)
    hi_q = seq_q - 1 if left is None else min(seq_q - 1, seq_kv - 1 - offset + left)
    if lo_q > hi_q:
        return None
    if left is not None and left >= seq_q - 1 + offset:
        left = None
    if right is not None and seq_kv - 1 <= offset + right:
        right = None
    if left is None and right is None:
        offset = 0
    return MaskSpec(seq_q=seq_q, seq_kv=seq_kv, offset=offset, left=left, right=right)


@dataclasses.dataclass(frozen=True)
class _Cell:
    rows: tuple[int, int]
    cols: tuple[int, int]
    mask: MaskSpec | None


def _fit(cells) -> _Cell | None:
    """One cell covering `cells` (which tile a rectangle) whose mask restricts to each cell's
    own, or None. The candidates are the unmasked mask and each masked cell's, re-anchored."""
    r0, r1 = min(c.rows[0] for c in cells), max(c.rows[1] for c in cells)
    c0, c1 = min(c.cols[0] for c in cells), max(c.cols[1] for c in cells)
    candidates = [(0, None, None)] + [
        (c.mask.offset - (c.rows[0] - r0) + (c.cols[0] - c0), c.mask.left, c.mask.right)
        for c in cells if c.mask is not None and c.mask.has_position_mask]
    for offset, left, right in candidates:
        if all(_normalize(c.rows[1] - c.rows[0], c.cols[1] - c.cols[0],
                          offset + (c.rows[0] - r0) - (c.cols[0] - c0), left, right) == c.mask
               for c in cells):
            mask = _normalize(r1 - r0, c1 - c0, offset, left, right)
            return None if mask is None else _Cell((r0, r1), (c0, c1), mask)
    return None


def _merge_cells(grid) -> tuple[_Cell, ...]:
    """The kernel calls for one (device, source) pair from its grid of cells (a row of cells
    per query piece): the whole grid as one call if possible, else one call per query piece
    (or per cell), then vertically adjacent calls over the same keys merged."""
    cells = [c for row in grid for c in row]
    if all(c.mask is None for c in cells):
        return ()
    whole = _fit(cells)
    if whole is not None:
        return (whole,)
    rows = []
    for row in grid:
        if all(c.mask is None for c in row):
            continue
        fit = _fit(row)
        rows += [fit] if fit is not None else [c for c in row if c.mask is not None]
    merged = []
    for cell in rows:
        last = merged[-1] if merged else None
        if last is not None and last.cols == cell.cols and last.rows[1] == cell.rows[0]:
            fit = _fit([last, cell])
            if fit is not None:
                merged[-1] = fit
                continue
        merged.append(cell)
    return tuple(merged)


# ================================================================================================
# The plan
# ================================================================================================


@dataclasses.dataclass(frozen=True)
class Call:
    """One kernel call: local query rows [rows) against the visiting shard's rows [cols)."""

    rows: tuple[int, int]
    cols: tuple[int, int]
    spec: AttentionSpec
    forward: str    # a key of attention._FORWARDS
    backward: str   # a key of attention._BACKWARDS


@dataclasses.dataclass(frozen=True)
class Step:
    """Step `shift`: device i holds the K/V shard of device (i - shift) mod P and makes the
    calls of kinds[table[i]] (an empty kind: the pair is skipped)."""

    shift: int
    kinds: tuple[tuple[Call, ...], ...]
    table: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about one context-parallel call; hashable (it keys the caches).

    seq: the local (per-device) length; steps[0] is the device's own shard (shift 0).
    """

    axis_name: str
    axis_size: int
    layout: str
    seq: int
    strategy: str
    steps: tuple[Step, ...]

    @property
    def ring_steps(self) -> int:
        """Steps that need a shard from another device: the ring's transfers per pass."""
        return len(self.steps) - 1


def make_plan(axis_name: str, axis_size: int, q, k, v, *, layout: str, causal: bool, window,
              spec_of, backend: str, explicit_config: bool, strategy: str = "ring") -> Plan:
    """q, k, v: the local shards (arrays or ShapeDtypeStructs), [batch, seq / P, heads, dim]
    (V's dim may differ from Q and K's: MLA).

    spec_of(mask) -> AttentionSpec; window is the validated (left, right) or None.
    """
    seq = q.shape[1]
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(right, 0)
    pieces = [layout_pieces(layout, axis_size, d, seq) for d in range(axis_size)]

    def calls_of(device: int, source: int) -> tuple[Call, ...]:
        grid = [[_Cell((qp.local, qp.local + qp.length), (kp.local, kp.local + kp.length),
                       _normalize(qp.length, kp.length, qp.start - kp.start, left, right))
                 for kp in pieces[source]] for qp in pieces[device]]
        return tuple(_make_call(cell, q, k, v, spec_of, backend, explicit_config)
                     for cell in _merge_cells(grid))

    steps = []
    for shift in range(axis_size):
        per_device = [calls_of(d, (d - shift) % axis_size) for d in range(axis_size)]
        if shift and not any(per_device):
            continue  # no device sees a key of the shard it would hold: nothing moves
        kinds = tuple(dict.fromkeys(per_device))
        steps.append(Step(shift, kinds, tuple(kinds.index(c) for c in per_device)))
    return Plan(axis_name, axis_size, layout, seq, strategy, tuple(steps))


def _make_call(cell: _Cell, q, k, v, spec_of, backend: str, explicit_config: bool) -> Call:
    spec = spec_of(cell.mask)
    rows, cols = cell.rows[1] - cell.rows[0], cell.cols[1] - cell.cols[0]
    q_part, k_part, v_part = (jax.ShapeDtypeStruct((x.shape[0], n, *x.shape[2:]), x.dtype)
                              for x, n in ((q, rows), (k, cols), (v, cols)))
    if backend == "mosaic" and mosaic_forward.unsupported_reason(spec, q_part, k_part,
                                                                 v_part) is not None:
        # The call as a whole was checked (ring.py); a block the Mosaic kernels cannot serve
        # runs on Triton, like flash_attention's "auto".
        fwd, bwd = "triton", "triton"
    else:
        fwd, bwd = attention._choose_backends(backend, spec, q_part, k_part, v_part,
                                              explicit_config=explicit_config)
    return Call(cell.rows, cell.cols, spec, fwd, bwd)


# ================================================================================================
# The byte model behind strategy="auto"
# ================================================================================================


def strategy_bytes(*, devices: int, seq: int, q_heads: int, kv_heads: int, head_dim: int,
                   dtype, batch: int = 1, ring_steps: int | None = None,
                   head_dim_v: int | None = None) -> dict[str, int]:
    """Bytes each device sends in one forward+backward, and what the all-gather holds.

    seq is the total length, split evenly over `devices`; `ring_steps` the steps whose shard
    comes from another device (P - 1 unless a window lets the ring stop early: Plan.ring_steps);
    head_dim is Q and K's, head_dim_v V's (None: the same; MLA: 192 and 128). With k the bytes
    of one local K shard, B x seq/P x kv_heads x head_dim, and v those of one local V shard
    (head_dim_v in place of head_dim); dK and dV take the bytes of K and V:

      ring:      every step sends K and V forward, and K, V and the pair's dK, dV (all in the
                 input dtype) backward:                        ring_steps x 3 (k + v)
      allgather: one all-gather of K and V forward (kept for the backward), one reduce-scatter
                 of dK and dV backward:                        (P - 1) x 2 (k + v)

    Returns {"ring", "allgather", "allgather_extra", "query"}: the two counts, the bytes of the
    other devices' K/V that the all-gather holds from the forward to the backward,
    (P - 1) (k + v), and the bytes of the local query shard (head_dim wide).
    """
    itemsize = jnp.dtype(dtype).itemsize
    local = seq // devices
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    row = batch * local * kv_heads * itemsize        # one shard's bytes per head_dim column
    kv = row * (head_dim + head_dim_v)               # a K shard and a V shard
    steps = devices - 1 if ring_steps is None else ring_steps
    return {"ring": steps * 3 * kv, "allgather": (devices - 1) * 2 * kv,
            "allgather_extra": (devices - 1) * kv,
            "query": batch * local * q_heads * head_dim * itemsize}


def choose_strategy(**shape) -> str:
    """"allgather" when it sends fewer bytes than the ring and the K/V it gathers beyond the
    local shard take no more memory than the local query shard; else "ring".

    The memory bound keeps "auto" to the case the all-gather is made for: many query heads per
    K/V head (GQA), where the gathered K/V stay small beside the query-side activations. With as
    many K/V heads as query heads they would be (P - 1) (1 + head_dim_v / head_dim) times the
    query shard (2 (P - 1) with one head_dim), and the ring's memory falls as 1/P. A window
    that lets the ring stop early (few ring_steps) makes the ring send less. Keyword arguments
    are those of `strategy_bytes`.
    """
    b = strategy_bytes(**shape)
    if b["allgather"] < b["ring"] and b["allgather_extra"] <= b["query"]:
        return "allgather"
    return "ring"
