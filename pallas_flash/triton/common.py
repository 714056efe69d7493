"""In-kernel pieces shared by the Triton forward and backward kernels.

Tile reads are unchecked pointer offsets: every load and store of a partial tile is row-masked.
head_dim is padded to a power of two, the only size the lowering builds; V (with dO and O) may
have a head_dim of its own, padded and masked apart from Q/K's. On masked tiles,
non-finite operand entries are zeroed before a block matmul (0 * NaN is NaN) and the visible
pairs that used them marked NaN: a NaN input reaches exactly the rows that depend on it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flash.masking import with_segment_range
from pallas_flash.spec import AttentionSpec
from pallas_flash.stats import LOG2E, logit_scale

MIN_TILE = 16
F16_MAX = 65504.0


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


def value_column_mask(cols, head_dim: int, head_dim_v: int, padded_v: int):
    """The column mask of V, dO and O: `cols` itself when V's head_dim is Q/K's (one mask in
    the kernel), else V's own (MLA: Q/K 192, V 128)."""
    return cols if head_dim_v == head_dim else column_mask(head_dim_v, padded_v)


def row_positions(start, block: int):
    return start + jnp.arange(block, dtype=jnp.int32)


def _tile(ref, start, block: int, head=None):
    # One indexer (no chained `.at`), int32 starts (a bare `:` is int64 under x64).
    rows = pl.ds(start, block)
    cols = pl.ds(jnp.int32(0), ref.shape[-1])
    return ref.at[rows, cols] if head is None else ref.at[rows, head, cols]


def load_tile(ref, start, block: int, n_rows: int, cols, *, head=None, other=0.0):
    """Rows [start, start + block) of a [seq, (heads,) d] ref; rows >= n_rows read `other`."""
    rows_ok = (row_positions(start, block) < n_rows)[:, None]
    mask = rows_ok if cols is None else rows_ok & cols
    return plgpu.load(_tile(ref, start, block, head), mask=mask, other=other)


def store_tile(ref, start, block: int, n_rows: int, cols, value):
    rows_ok = (row_positions(start, block) < n_rows)[:, None]
    mask = rows_ok if cols is None else rows_ok & cols
    plgpu.store(_tile(ref, start, block), value.astype(ref.dtype), mask=mask)


def load_vector(ref, start, block: int, n_rows: int, *, head=None, other):
    """Entries [start, start + block) of a [seq] ref, or of row `head` of a [heads, seq] one."""
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


def exp2_factor(spec: AttentionSpec) -> float:
    """c in P = 2^((u - m) * c): one logit unit, in base-2 logits."""
    return logit_scale(spec) * LOG2E


def logits(spec: AttentionSpec, q, k):
    """(u, t): a tile's logits in logit units, and t = tanh(q.k scale / softcap) or None."""
    s = dot(spec, q, k, trans_b=True)
    if spec.softcap is None:
        return s, None
    t = jnp.tanh(s * (spec.scale / spec.softcap))
    return t, t


def tile_visible(spec: AttentionSpec, q_pos, k_pos, q_ids=None, kv_ids=None):
    """Which (query, key) pairs of a tile may attend: position, the key bound, segments."""
    vis = spec.mask.visible(q_pos[:, None], k_pos[None, :], spec.mask.seq_kv)
    if q_ids is not None:
        vis = vis & (q_ids[:, None] == kv_ids[None, :])
    return vis


def split_refs(refs, n_inputs: int, has_segments: bool):
    """Kernel refs -> (inputs, segment refs, outputs): with segment ids four refs follow the
    inputs (query ids, key ids, the tile's [lo, hi) block range); else four Nones."""
    inputs, rest = refs[:n_inputs], refs[n_inputs:]
    if has_segments:
        return inputs, rest[:4], rest[4:]
    return inputs, (None,) * 4, rest


def segment_operands(q_ids, kv_ids, lo, hi):
    """BlockSpecs and operands that `split_refs` expects, for grids (tile, batch, head)."""
    whole_row = lambda seq: pl.BlockSpec((None, seq), lambda t, b, h: (b, 0))  # noqa: E731
    per_tile = pl.BlockSpec((None, None), lambda t, b, h: (b, t))
    specs = [whole_row(q_ids.shape[1]), whole_row(kv_ids.shape[1]), per_tile, per_tile]
    return specs, [q_ids, kv_ids, lo, hi]


def any_along(mask, axis: int):
    """jnp.any for kernels: the Triton lowering has no reduce_or, but has an int32 max."""
    return jnp.max(mask.astype(jnp.int32), axis=axis) > 0


def zero_unseen_rows(x, seen):
    """Rows of an operand tile that no pair of the tile uses, set to 0."""
    return jnp.where(seen[:, None], x, jnp.zeros_like(x))


def finite_or_zero(x):
    """x with its NaN and inf entries replaced by 0 (`|x| < inf` is False for both)."""
    return jnp.where(jnp.abs(x) < jnp.inf, x, jnp.zeros_like(x))


def nonfinite_rows(x):
    """[rows] bool: does row j of the tile hold a NaN or inf (an int32 max, as `any_along`)?"""
    return jnp.max(jnp.where(jnp.abs(x) < jnp.inf, 0, 1).astype(jnp.int32), axis=1) > 0


def scaled_for_cast(x, dtype):
    """(x / f, f), f >= 1: a float16 dS tile whose max |dS| passes 2^14 is divided down to it
    before its cast, and the product multiplied back (a non-finite max keeps f = 1)."""
    if jnp.dtype(dtype) != jnp.float16:
        return x.astype(dtype), None
    limit = 2.0 ** 14
    amax = jnp.max(jnp.max(jnp.abs(x), axis=1), axis=0)
    f = jnp.where((amax > limit) & (amax < jnp.inf), amax * (1.0 / limit), 1.0)
    return (x / f).astype(dtype), f


def unscale(x, f):
    return x if f is None else x * f


def clamp_to_dtype(x, dtype):
    """float16 O: finite values rounded just past 65504 clamped to +-65504."""
    if jnp.dtype(dtype) != jnp.float16:
        return x
    over = (jnp.abs(x) > F16_MAX) & (jnp.abs(x) < jnp.inf)
    return jnp.where(over, jnp.where(x > 0, F16_MAX, -F16_MAX), x)


def block_range(bounds, seg_lo_ref, seg_hi_ref):
    """The loop bounds, tightened by the segment-derived range when segment ids are given."""
    if seg_lo_ref is None:
        return bounds
    return with_segment_range(bounds, seg_lo_ref[()], seg_hi_ref[()])


def three_phase_loop(bounds, body, carry):
    """Runs body(j, carry, masked) over [lo, hi), unmasked on [full_lo, full_hi): only the
    edge blocks pay for the mask (the Triton tutorial's stage flag)."""
    lo, full_lo, full_hi, hi = bounds
    carry = jax.lax.fori_loop(lo, full_lo, lambda j, c: body(j, c, True), carry)
    carry = jax.lax.fori_loop(full_lo, full_hi, lambda j, c: body(j, c, False), carry)
    return jax.lax.fori_loop(full_hi, hi, lambda j, c: body(j, c, True), carry)


def predicated(kernel, in_specs, args, out_specs, out_shape, skip, into):
    """(kernel, in_specs, args, aliases) for a pallas_call whose programs return at once when
    `skip` is set, its outputs aliasing `into` (guarded.py: no branch). `kernel` takes `tile=`,
    read outside the branch (interpret mode substitutes program_id only outside control flow)."""
    if (skip is None) != (into is None):
        raise ValueError("skip and into are given together or not at all")
    if skip is None:
        return kernel, in_specs, args, {}
    into = list(into)
    for x, want in zip(into, out_shape, strict=True):
        if x.shape != want.shape or x.dtype != want.dtype:
            raise ValueError(f"into holds {x.dtype}{list(x.shape)} where the kernel gives "
                             f"{want.dtype}{list(want.shape)}")
    n_out = len(out_shape)

    def run(*refs):
        skip_ref, kernel_refs = refs[-2 * n_out - 1], refs[:-2 * n_out - 1] + refs[-n_out:]
        tile = pl.program_id(0)
        pl.when(skip_ref[0] == 0)(lambda: kernel(*kernel_refs, tile=tile))

    flag = jnp.asarray(skip, jnp.int32).reshape(1)
    flag_spec = pl.BlockSpec((1,), lambda *_: (0,))
    aliases = {len(args) + 1 + i: i for i in range(n_out)}
    return run, [*in_specs, flag_spec, *out_specs], [*args, flag, *into], aliases
