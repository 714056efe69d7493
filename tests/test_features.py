"""The feature matrix: every case against every backend that serves it (tests/backends.py).

Each case is a shape, a dtype and flash_attention's options (masks, softcap, segment ids and
lengths), the passes it tests, and the Mosaic tiles it runs at: small tiles, so that the small
shapes interpret mode affords still give several blocks per warpgroup, drains, partial tiles and
empty rows. Triton reads its tiles from the spec.

A backend's forward is compared with the float32 reference on O and lse; its backward, fed that
forward's O and row statistics (the Triton forward's when the backend tests only the backward),
on dq, dk and dv under random cotangents for O and lse. Rows that see no key must give O = 0,
lse = -inf, statistics m = 0 and dq = 0 exactly.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from backends import BACKENDS, BOTH, KEY176, MOSAIC, ON_GPU
from helpers import outputs_and_grads, assert_close, make_spec, random_inputs, tolerance
from pallas_flash import stats
from pallas_flash.masking import fold_lengths
from pallas_flash.mosaic import backward as mosaic_backward
from pallas_flash.mosaic.config import (MosaicBackwardConfig, MosaicForwardConfig,
                                        default_backward_config, default_forward_config)
from pallas_flash.triton import forward as triton_forward

C = MosaicForwardConfig
B = MosaicBackwardConfig
# The fused backward below head_dim 64, where the default runs the two kernels: 64's settings.
FUSED_BELOW_64 = default_backward_config(64)
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
FORWARD = frozenset({"forward"})
BACKWARD = frozenset({"backward"})
# lse is float32 arithmetic on exact products of the inputs, whatever their dtype.
LSE_TOLERANCE = 1e-4


@dataclasses.dataclass(frozen=True)
class Case:
    """group/name: the id. shape: (batch, seq_q, seq_kv, q_heads, kv_heads, head_dim).
    options: flash_attention's (causal, causal_alignment, window, softcap, scale, precision).
    ids(rng, batch, seq_q, seq_kv): segment ids and lengths as flash_attention takes them.
    forward_tiles / backward_tiles: {label: Mosaic config}; a label runs as its own test.
    interpret: False for a size meant for the GPU only, on every backend.
    expect: the Mosaic backward design the case exists for ("fused"; "paired"; "two": the two
      kernels, dK/dV unpaired); asserted.
    """

    group: str
    name: str
    shape: tuple
    dtype: Any
    passes: frozenset = BOTH
    options: dict = dataclasses.field(default_factory=dict)
    ids: Callable | None = None
    forward_tiles: dict = dataclasses.field(default_factory=dict)
    backward_tiles: dict = dataclasses.field(default_factory=dict)
    interpret: bool = True
    expect: str | None = None
    do_scale: float = 1.0

    def key(self, label=""):
        return f"{self.group}/{self.name}" + (f"-{label}" if label else "")


def _tiles(tiles):
    return tiles if isinstance(tiles, dict) else {"": tiles}


def case(group, name, shape, dtype, passes=BOTH, *, fwd=None, bwd=None, **kwargs):
    fields = {f.name for f in dataclasses.fields(Case)}
    options = {key: kwargs.pop(key) for key in list(kwargs) if key not in fields}
    return Case(group, name, shape, dtype, passes, options,
                forward_tiles=_tiles(fwd) if fwd is not None else {},
                backward_tiles=_tiles(bwd) if bwd is not None else {}, **kwargs)


# ---- segment ids and lengths -------------------------------------------------------------------

def _sorted(rng, batch, seq, n):
    return jnp.asarray(np.sort(rng.randint(0, n, (batch, seq)), axis=1), jnp.int32)


def _lengths(values):
    return None if values is None else jnp.asarray(values, jnp.int32)


def sorted_ids(n, q_lengths=None, kv_lengths=None):
    """Sorted random ids of n documents, drawn apart for q and kv; lengths(seq) -> [batch]."""
    def make(rng, batch, seq_q, seq_kv):
        ids = dict(q_segment_ids=_sorted(rng, batch, seq_q, n),
                   kv_segment_ids=_sorted(rng, batch, seq_kv, n))
        if q_lengths:
            ids["q_lengths"] = _lengths(q_lengths(seq_q))
        if kv_lengths:
            ids["kv_lengths"] = _lengths(kv_lengths(seq_kv))
        return ids
    return make


def shifted_ids(n, q_cut, kv_cut):
    """n even documents, shifted along each batch row, and lengths cut by q_cut / kv_cut more
    on each row."""
    def make(rng, batch, seq_q, seq_kv):
        del rng

        def ids(seq, shift):
            pos = jnp.arange(seq)[None, :] + jnp.arange(batch)[:, None] * shift
            return jnp.minimum(pos * n // seq, n - 1).astype(jnp.int32)

        return dict(q_segment_ids=ids(seq_q, 17), kv_segment_ids=ids(seq_kv, 23),
                    q_lengths=_lengths([seq_q - q_cut * (i + 1) for i in range(batch)]),
                    kv_lengths=_lengths([seq_kv - kv_cut * (i + 1) for i in range(batch)]))
    return make


def packed_ids(n_docs, q_lengths=None, kv_lengths=None):
    """n_docs documents of random lengths, one id array for q and kv (self-attention)."""
    def make(rng, batch, seq_q, seq_kv):
        assert seq_q == seq_kv
        rows = [np.searchsorted(np.sort(rng.choice(np.arange(1, seq_q), n_docs - 1,
                                                   replace=False)),
                                np.arange(seq_q), side="right") for _ in range(batch)]
        ids = jnp.asarray(np.stack(rows), jnp.int32)
        return dict(q_segment_ids=ids, kv_segment_ids=ids, q_lengths=_lengths(q_lengths),
                    kv_lengths=_lengths(kv_lengths))
    return make


def unsorted_ids(n_q, n_kv):
    """Random unsorted ids, different sets for q and kv: the block ranges are a superset."""
    def make(rng, batch, seq_q, seq_kv):
        return dict(q_segment_ids=jnp.asarray(rng.randint(0, n_q, (batch, seq_q)), jnp.int32),
                    kv_segment_ids=jnp.asarray(rng.randint(0, n_kv, (batch, seq_kv)), jnp.int32))
    return make


def lengths_only(q_lengths, kv_lengths):
    def make(rng, batch, seq_q, seq_kv):
        return dict(q_lengths=_lengths(q_lengths), kv_lengths=_lengths(kv_lengths))
    return make


def half_unseen(rng, batch, seq_q, seq_kv):
    """The second half of the queries has an id no key has: they see nothing."""
    return dict(q_segment_ids=jnp.asarray([[0] * (seq_q // 2) + [5] * (seq_q - seq_q // 2)]
                                          * batch, jnp.int32),
                kv_segment_ids=jnp.zeros((batch, seq_kv), jnp.int32))


# ---- the cases ---------------------------------------------------------------------------------

CASES = [
    # The Mosaic forward's warpgroup schedule: causal GQA (drained blocks above the diagonal),
    # three stages, and seq_q > seq_kv bottom-right, where the first 256 rows see no key and
    # the first warpgroup of the last CTA drains blocks it does not use.
    case("forward", "causal-gqa", (2, 256, 256, 4, 2, 64), BF16, FORWARD, causal=True,
         fwd={"": C(block_kv=64), "overlap": C(block_kv=64, overlap=True)}),
    case("forward", "full-mqa-3stages", (1, 256, 256, 2, 1, 64), F16, FORWARD,
         fwd=C(block_kv=64, stages=3)),
    case("forward", "bottom-right-empty", (1, 512, 256, 2, 2, 64), BF16, FORWARD, causal=True,
         causal_alignment="bottom_right", fwd=C(block_kv=64, pingpong=False)),
    case("forward", "bottom-right-empty-f16", (1, 512, 256, 2, 2, 64), F16, FORWARD,
         causal=True, causal_alignment="bottom_right",
         fwd={"overlap": C(block_kv=64, pingpong=False, overlap=True)}),

    # Every option of the forward at once or in turn; the config variants of backends.py run
    # this group. "overlap" tiles lag P V by one block (config.overlap).
    case("features", "softcap-full-mqa", (1, 128, 128, 2, 1, 64), BF16, FORWARD, softcap=5.0,
         fwd=C(block_kv=64)),
    # A narrow band: the two warpgroups' key ranges are disjoint (each drains the other's).
    case("features", "window-band", (1, 384, 384, 1, 1, 64), BF16, FORWARD, window=(32, 32),
         fwd={"": C(block_kv=64), "overlap": C(block_kv=64, overlap=True)}),
    case("features", "window-causal-softcap", (1, 256, 256, 2, 2, 64), F16, FORWARD,
         causal=True, window=(70, None), softcap=20.0, fwd=C(block_kv=64, stages=3)),
    # A partial last query tile (200 = 128 + 72: the second warpgroup of tile 1 holds 8 rows)
    # and key block (136 = 2 * 64 + 8), both multiples of 8: no padding copy.
    case("features", "partial-tiles", (1, 200, 136, 2, 1, 64), F16, FORWARD,
         fwd=C(block_kv=64)),
    # Lengths that are not multiples of 8 (padded in XLA), a window and softcap, bottom-right.
    case("features", "odd-lengths-window", (1, 100, 100, 1, 1, 64), BF16, FORWARD, causal=True,
         causal_alignment="bottom_right", window=(30, 10), softcap=20.0,
         fwd=C(block_kv=64, pingpong=False)),
    # 40 query rows (the second warpgroup wholly past the end), 300 keys (block 3 partial),
    # seq_q < seq_kv bottom-right with a left bound: the tile starts at key block 1.
    case("features", "short-q", (1, 40, 300, 1, 1, 64), BF16, FORWARD, causal=True,
         causal_alignment="bottom_right", window=(100, None), fwd=C(block_kv=128)),
    # seq_q > seq_kv bottom-right with 20 keys: most rows see nothing.
    case("features", "short-kv-empty", (1, 136, 20, 2, 1, 64), F16, FORWARD, causal=True,
         causal_alignment="bottom_right", softcap=10.0,
         fwd={"": C(block_kv=64), "overlap": C(block_kv=64, overlap=True)}),
    case("features", "segments-lengths", (2, 200, 264, 2, 1, 64), BF16, FORWARD, causal=True,
         causal_alignment="bottom_right",
         ids=sorted_ids(3, lambda s: [s - 20, s], lambda s: [s - 14, s // 2]),
         fwd={"": C(block_kv=64), "overlap": C(block_kv=64, stages=3, overlap=True)}),

    # Three compute warpgroups (backends.THREE_WGS) at their own sizes: GQA with 400 rows (two
    # whole tiles and 16 rows: the last tile's warpgroups 1 and 2 only drain) at
    # FlashAttention-3's causal key block, and 456 keys at its non-causal one with the lagged
    # P V (this one hung in interpret mode with XLA's CPU pool at 2 threads: conftest.py).
    case("three-wgs", "gqa-causal", (1, 400, 400, 4, 2, 64), BF16, FORWARD, causal=True,
         fwd=C(block_kv=128)),
    case("three-wgs", "gqa-full", (1, 384, 456, 4, 2, 64), F16, FORWARD,
         fwd={"overlap": C(block_kv=192, overlap=True)}),

    # Sizes for clusters of CTAs (the cluster variants): odd tile counts pad the last cluster
    # with empty tiles (300 rows: 3 tiles; 600: 5), at the default tiles, at 176-key blocks,
    # with segment ids, and at head_dim 256's 64-key blocks (the smallest multicast slices).
    *[case("clusters", f"tiles3-gqa-d128-{'causal' if c else 'full'}", (2, 300, 300, 4, 2, 128),
           BF16, FORWARD, causal=c, interpret=False,
           fwd={"": default_forward_config(128), "key176": C(**KEY176)}) for c in (True, False)],
    *[case("clusters", f"tiles5-gqa-d128-{'causal' if c else 'full'}", (2, 600, 520, 4, 2, 128),
           BF16, FORWARD, causal=c, interpret=False, fwd=default_forward_config(128))
      for c in (True, False)],
    case("clusters", "tiles5-segments", (2, 600, 600, 2, 1, 64), F16, FORWARD, causal=True,
         causal_alignment="bottom_right", interpret=False,
         ids=sorted_ids(3, lambda s: [s - 20, s], lambda s: [s - 14, s // 2]),
         fwd={"overlap": C(block_kv=64, overlap=True)}),
    case("clusters", "tiles5-d256-softcap", (1, 600, 600, 2, 2, 256), BF16, FORWARD,
         softcap=20.0, interpret=False, fwd=default_forward_config(256)),

    # Key blocks that are multiples of 16 but not of 64: V's shared memory takes a narrower
    # swizzle (forward._v_transforms). 400 keys = 2 x 176 + 48: a partial last block.
    case("key-blocks", "d128-gqa-partial", (1, 300, 400, 4, 2, 128), BF16, FORWARD,
         fwd={"176": C(**KEY176)}),
    case("key-blocks", "d128-causal", (1, 200, 200, 2, 1, 128), F16, FORWARD, causal=True,
         fwd={"160": C(block_kv=160, pingpong=False, overlap=True)}),
    case("key-blocks", "d64-segments", (2, 200, 264, 2, 1, 64), BF16, FORWARD, causal=True,
         causal_alignment="bottom_right",
         ids=sorted_ids(3, lambda s: [s - 20, s], lambda s: [s - 14, s // 2]),
         fwd={"144": C(block_kv=144)}),

    # The forward's launch order with heads interleaved tile by tile (config.head_chunk; the
    # default sections hold every head at these sizes).
    case("launch-order", "segments-gqa", (2, 200, 264, 4, 2, 64), BF16, FORWARD, causal=True,
         causal_alignment="bottom_right",
         ids=sorted_ids(3, lambda s: [s - 20, s], lambda s: [s - 14, s // 2]),
         fwd={f"chunk{n}": C(block_kv=64, head_chunk=n) for n in (1, 2, 4)}),
    case("launch-order", "full-mha", (2, 200, 136, 4, 4, 64), F16, FORWARD,
         fwd={"chunk2-overlap": C(block_kv=64, overlap=True, head_chunk=2)}),
    case("launch-order", "window-mqa-d128", (1, 200, 200, 4, 1, 128), BF16, FORWARD,
         causal=True, window=(90, None),
         fwd={"chunk4-overlap": C(block_kv=64, overlap=True, pingpong=False, head_chunk=4)}),

    # The two-kernel Mosaic backward. Causal GQA: the second 64-key warpgroup of the first CTA
    # drains q blocks it cannot see; the dQ kernel masks diagonal blocks and drains the rest.
    case("backward", "causal-gqa", (1, 256, 256, 4, 2, 64), BF16, BACKWARD, causal=True,
         bwd=B(dq_block_kv=64)),
    case("backward", "full-3stages", (1, 128, 256, 2, 2, 64), F16, BACKWARD,
         bwd=B(dq_block_kv=128, dkdv_stages=3)),
    # seq_q > seq_kv bottom-right: the first 128 query rows see no key.
    case("backward", "bottom-right-mqa-1wg", (1, 256, 128, 2, 1, 64), BF16, BACKWARD,
         causal=True, causal_alignment="bottom_right", bwd=B(dq_block_kv=64, dq_compute_wgs=1)),
    # head_dim 256 at its default tiles: the dK/dV warpgroups paired (one forms P^T, the other
    # dS^T); unpaired, they split the columns of dK and dV.
    case("backward", "causal-d256", (1, 128, 128, 2, 1, 256), BF16, BACKWARD, causal=True,
         expect="paired"),
    case("backward", "causal-gqa-d256-unpaired", (1, 136, 128, 4, 2, 256), BF16, BACKWARD,
         causal=True, expect="two",
         bwd=B(dkdv_block_q=64, dq_block_kv=64, dq_compute_wgs=1, dkdv_paired=False)),
    case("backward", "window-softcap-d192-unpaired", (2, 200, 180, 2, 1, 192), F16, BACKWARD,
         window=(50, 20), softcap=2.5, expect="two", interpret=False,
         bwd=B(dkdv_block_q=64, dq_block_kv=64, dq_compute_wgs=1, dkdv_paired=False)),
    # Small softcaps: with logits ~N(0, 1), t^2 ~ 0.2, so a missing (1 - t^2) factor of dS
    # shows far above the bfloat16 tolerance.
    case("backward", "softcap-causal-gqa", (1, 256, 256, 4, 2, 64), BF16, BACKWARD,
         causal=True, softcap=2.0, bwd=B(dq_block_kv=64)),
    # A left bound that cuts blocks: masked leading and trailing edges, skipped blocks on both
    # sides of each warpgroup's range.
    case("backward", "window-causal", (1, 256, 256, 2, 1, 64), BF16, BACKWARD, causal=True,
         window=(70, 0), bwd=B(dq_block_kv=64)),
    # A two-sided window with softcap at head_dim 256 (paired dK/dV), partial tiles and a
    # length not a multiple of 8.
    case("backward", "window-softcap-d256-partial", (1, 136, 100, 2, 1, 256), BF16, BACKWARD,
         window=(30, 20), softcap=2.5, expect="paired"),
    # seq_q 100 (padded to 104), seq_kv 150 (a 22-key last block), bottom-right.
    case("backward", "partial-f16", (1, 100, 150, 2, 1, 64), F16, BACKWARD, causal=True,
         causal_alignment="bottom_right", expect="two", bwd=B(dq_block_kv=64)),
    # Shorter than one tile: the second dQ warpgroup and the second 64-key dK/dV warpgroup lie
    # wholly past the end.
    case("backward", "partial-tiny", (1, 40, 50, 2, 1, 64), BF16, BACKWARD, causal=True,
         causal_alignment="bottom_right", expect="two", bwd=B(dq_block_kv=64)),
    case("backward", "segments-window-softcap", (2, 200, 180, 2, 2, 128), F16, BACKWARD,
         causal=True, window=(50, None), softcap=3.0, ids=shifted_ids(3, 7, 20),
         bwd=B(dq_compute_wgs=1, dkdv_stages=3)),
    case("backward", "segments-lengths-full", (1, 256, 192, 2, 1, 64), BF16, BACKWARD,
         ids=shifted_ids(4, 30, 50), bwd=B(dq_block_kv=64)),

    # The two backward kernels' launch order with explicit head chunks (config.head_chunk).
    case("launch-order-bwd", "bottom-right-gqa-causal", (2, 200, 136, 4, 2, 64), BF16,
         BACKWARD, causal=True, causal_alignment="bottom_right",
         bwd={f"chunk{n}": B(dq_block_kv=64, head_chunk=n) for n in (1, 2)}),
    case("launch-order-bwd", "bottom-right-gqa-full", (2, 200, 136, 4, 2, 64), BF16, BACKWARD,
         causal_alignment="bottom_right", bwd={"chunk2": B(dq_block_kv=64, head_chunk=2)}),

    # The one-kernel backward (fused_backward.py) at its default tiles. Partial tiles (seq_kv
    # 150: a 22-key last tile), bottom-right: q blocks 0-1 see no key, so no tile writes their
    # dQ; a two-sided window (the tiles that see a q block start past tile 0); no mask (every
    # tile adds to every q block, three deep); head_dim 64, where the warpgroups take turns at
    # the dQ product, with the head-major stream of a GQA call without a mask.
    case("fused", "causal-gqa", (1, 256, 256, 4, 2, 128), BF16, BACKWARD, causal=True,
         expect="fused"),
    case("fused", "partial-bottom-right-mqa", (2, 200, 150, 2, 1, 128), BF16, BACKWARD,
         causal=True, causal_alignment="bottom_right", expect="fused"),
    case("fused", "window-softcap", (1, 320, 384, 2, 2, 128), BF16, BACKWARD, window=(70, 90),
         softcap=2.5, expect="fused"),
    case("fused", "full", (1, 192, 384, 2, 1, 128), BF16, BACKWARD, expect="fused"),
    case("fused", "turns-d64", (1, 200, 250, 4, 2, 64), BF16, BACKWARD, causal=True,
         expect="fused"),
    case("fused", "full-partial-gqa-d64", (1, 136, 200, 4, 2, 64), BF16, BACKWARD,
         expect="fused"),
    # float16: dS cast twice, per key for dK and per query for dQ (fused_backward.py).
    case("fused", "causal-gqa-f16", (1, 256, 256, 4, 2, 128), F16, BACKWARD, causal=True,
         expect="fused", interpret=False),
    case("fused", "window-softcap-d64-f16", (1, 200, 250, 4, 2, 64), F16, BACKWARD,
         window=(70, 90), softcap=2.5, expect="fused"),
    # Below 128: dQ by turns, as at 64, on head dims whose rows take narrower swizzles; at 112
    # by columns, 64 and 48 (fused_backward.dq_columns).
    case("fused", "turns-causal-d32", (1, 200, 250, 2, 2, 32), BF16, BACKWARD, causal=True,
         expect="fused", bwd=FUSED_BELOW_64),
    case("fused", "turns-full-mqa-d48-f16", (1, 136, 200, 4, 1, 48), F16, BACKWARD,
         expect="fused", bwd=FUSED_BELOW_64),
    case("fused", "turns-causal-gqa-d80", (1, 200, 250, 4, 2, 80), BF16, BACKWARD, causal=True,
         expect="fused"),
    case("fused", "turns-full-partial-gqa-d96", (1, 136, 200, 4, 2, 96), BF16, BACKWARD,
         expect="fused"),
    case("fused", "columns-window-softcap-d112-f16", (1, 200, 250, 4, 2, 112), F16, BACKWARD,
         window=(70, 90), softcap=2.5, expect="fused"),

    # Head_dim 256 with the dK/dV warpgroups paired (one forms P^T, the other dS^T).
    *[case("paired", name, shape, dtype, BACKWARD, expect="paired", bwd={"paired": B(
        dkdv_block_q=64, dq_block_kv=64, dq_compute_wgs=1, dkdv_paired=True)}, **options)
      for name, shape, dtype, options in [
          ("causal-gqa", (2, 384, 384, 4, 2, 256), BF16, dict(causal=True)),
          ("partial-f16", (1, 200, 264, 2, 1, 256), F16, {}),
          ("window-f16", (1, 256, 256, 2, 2, 256), F16, dict(causal=True, window=(70, 0))),
          ("segments-window", (2, 200, 180, 2, 1, 256), BF16,
           dict(window=(50, 20), ids=shifted_ids(3, 7, 20)))]],

    # Head dims between and around 64 / 128 / 256, at the default tiles: the Mosaic kernels'
    # swizzles and wgmma widths follow the head_dim; above 128 dK/dV's columns go in two
    # slices of whole 16s (even halves at 160-256 in steps of 32, 80 + 64 at 144, 128 + 112 at
    # 240). Three run in interpret mode too; the rest are for the GPU.
    *[case("head-dims", f"d{d}-causal-gqa", (1, 200, 200, 4, 2, d), BF16, causal=True,
           interpret=d in (96, 176, 192))
      for d in (32, 48, 80, 96, 112, 144, 160, 176, 192, 208, 224, 240)],
    *[case("head-dims", f"d{d}-window-softcap-f16", (2, 136, 100, 2, 1, d), F16,
           window=(30, 20), softcap=2.5, interpret=False) for d in (80, 144, 160, 240)],
    # Without a position mask, compiled: 192-key blocks at 96, three stages at 112, each in
    # clusters of two; three stages of 64-key blocks at 208.
    *[case("head-dims", f"d{d}-full-gqa", (2, 200, 456, 4, 2, d), BF16, interpret=False)
      for d in (80, 96, 112, 208)],

    # Both passes at every backend's default tiles.
    case("defaults", "gqa-full", (1, 128, 128, 4, 2, 64), BF16),
    case("defaults", "gqa-causal", (1, 128, 128, 4, 2, 64), BF16, causal=True),
    case("defaults", "gqa-causal-f16", (1, 128, 128, 4, 2, 64), F16, FORWARD, causal=True),

    # Masks, softcap, packed documents and padding, alone and combined, in full float32.
    *[case("variants", f"window-{left}-{right}-{'causal' if c else 'full'}",
           (1, 97, 130, 4, 2, 32), F32, causal=c, window=(left, right), precision="highest")
      for left, right in [(16, 0), (0, 9), (23, 40), (None, 5), (7, None)] for c in (False, True)],
    case("variants", "window-bottom-right-cross", (1, 50, 120, 2, 1, 32), F32, causal=True,
         window=(30, 0), causal_alignment="bottom_right", precision="highest"),
    *[case("variants", f"softcap-{cap:g}-{'causal' if c else 'full'}", (1, 80, 70, 2, 2, 64),
           F32, causal=c, softcap=cap, scale=0.5, precision="highest", do_scale=3.0)
      for cap in (1.0, 30.0) for c in (False, True)],
    *[case("variants", f"segments-gqa-{'causal' if c else 'full'}", (2, 150, 150, 4, 2, 32),
           F32, causal=c, ids=packed_ids(5), precision="highest") for c in (False, True)],
    case("variants", "unsorted-cross-segments", (1, 70, 90, 2, 1, 32), F32,
         ids=unsorted_ids(3, 4), precision="highest"),
    # Padded rows give exactly zero output and gradient; batch row 2 is all padding.
    case("variants", "padding-lengths", (3, 60, 75, 2, 2, 32), F32,
         ids=lengths_only([60, 13, 0], [75, 40, 75]), precision="highest"),
    case("variants", "padding-and-segments", (2, 90, 90, 2, 1, 32), F32, causal=True,
         ids=packed_ids(3, [90, 51], [77, 51]), precision="highest"),
    *[case("variants", f"everything-{jnp.dtype(dtype).name}", (2, 140, 140, 4, 2, 64), dtype,
           causal=True, window=(40, 0), softcap=20.0, ids=packed_ids(4, None, [140, 100]))
      for dtype in (BF16, F16)],
    case("variants", "rows-that-see-nothing", (1, 40, 20, 2, 2, 16), F32, ids=half_unseen,
         precision="highest"),
]


# ---- the matrix --------------------------------------------------------------------------------

def _params(backends, cases):
    params = []
    for backend in backends:
        for c in cases:
            if not backend.supports(c):
                continue
            for label in backend.tiles(c):
                params.append(pytest.param(backend, c, label,
                                           id=f"{backend.name}-{c.key(label)}",
                                           marks=backend.marks(c, label)))
    return params


MATRIX = _params(BACKENDS, CASES)


def _inputs(case: Case):
    """q, k, v, the cotangents dO and dlse, and the id options; seeded by the case's key."""
    b, sq, skv, hq, _, _ = case.shape
    seed = zlib.crc32(case.key().encode())
    q, k, v, do = random_inputs(jax.random.PRNGKey(seed), *case.shape, case.dtype)
    do = (do.astype(jnp.float32) * case.do_scale).astype(case.dtype)
    dlse = jax.random.normal(jax.random.PRNGKey(seed + 1), (b, hq, sq), jnp.float32)
    ids = case.ids(np.random.RandomState(seed % 2**31), b, sq, skv) if case.ids else {}
    ids = {name: value for name, value in ids.items() if value is not None}
    return q, k, v, do, dlse, ids


def _spec(case: Case, has_segments: bool, **kwargs):
    _, sq, skv, _, _, d = case.shape
    return make_spec(sq, skv, d, case.dtype, has_segments=has_segments, **case.options, **kwargs)


def _check_forward(spec, case, out, row_stats, ref_out, ref_lse, tol):
    q_shape = case.shape[:2] + (case.shape[3], case.shape[5])
    assert out.dtype == jnp.dtype(case.dtype) and out.shape == q_shape, (out.dtype, out.shape)
    lse = np.asarray(stats.to_lse(spec, row_stats))
    empty = ~np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(lse == -np.inf, empty,
                                  err_msg="rows with lse = -inf differ from the reference")
    assert not np.isnan(lse).any(), "lse has NaN"
    assert_close("out", out, ref_out, tol)
    assert_close("lse", np.where(empty, 0.0, lse), np.where(empty, 0.0, ref_lse),
                 min(tol, LSE_TOLERANCE))
    # A row that sees no key: O exactly 0 (O is [b, s, h, d], lse [b, h, s]) and m = 0.
    assert not np.asarray(out, np.float32).transpose(0, 2, 1, 3)[empty].any()
    assert not np.asarray(row_stats.m)[empty].any()
    if spec.softcap is not None:      # m is in logit units, tanh(...): within [-1, 1]
        assert np.all(np.abs(np.asarray(row_stats.m)) <= 1.0)


@pytest.mark.parametrize("backend,case,tiles", MATRIX)
def test_matches_reference(backend, case, tiles):
    """The case's passes on this backend at these tiles, against the reference."""
    q, k, v, do, dlse, ids = _inputs(case)
    spec = _spec(case, bool(ids))
    passes = backend.passes & case.passes
    fwd_config, bwd_config = backend.tiles(case)[tiles]
    reason = backend.unsupported_reason(spec, q, k, v, passes, fwd_config, bwd_config)
    assert reason is None, reason
    mosaic = backend.family == "mosaic"
    if mosaic and case.expect == "fused":
        assert mosaic_backward.uses_fused(spec, q, k,
                                          bwd_config or default_backward_config(case.shape[-1]))
    if mosaic and case.expect in ("paired", "two"):
        cfg = bwd_config or default_backward_config(case.shape[-1])
        assert not mosaic_backward.uses_fused(spec, q, k, cfg)
        assert cfg.dkdv_pairs(case.shape[-1]) is (case.expect == "paired")

    q_ids = kv_ids = None
    if ids:
        b, sq, skv = case.shape[:3]
        q_ids, kv_ids = fold_lengths(ids.get("q_segment_ids"), ids.get("kv_segment_ids"),
                                     ids.get("q_lengths"), ids.get("kv_lengths"), batch=b,
                                     seq_q=sq, seq_kv=skv)
    ref_options = dict(case.options, **ids)
    ref_options.pop("precision", None)
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    tol = tolerance(case.dtype, case.options.get("precision"))

    if "forward" in passes:
        # Waited for (here and below) before the reference is dispatched: an operation queued
        # while an interpreted Mosaic kernel still runs can deadlock with its callbacks.
        out, row_stats = jax.block_until_ready(jax.jit(
            lambda *a: backend.forward(spec, *a, fwd_config))(q, k, v, q_ids, kv_ids))
    else:   # the backward alone, fed the Triton forward
        out, row_stats = jax.jit(lambda *a: triton_forward.forward(spec, *a))(
            q, k, v, q_ids, kv_ids)
    if "backward" not in passes:
        ref_out, ref_lse = pf.reference_attention(up(q), up(k), up(v), return_lse=True,
                                                  **ref_options)
        _check_forward(spec, case, out, row_stats, ref_out, ref_lse, tol)
        return

    ref_out, ref_lse, ref_grads = outputs_and_grads(pf.reference_attention, up(q), up(k),
                                                    up(v), up(do), dlse, ref_options)
    if "forward" in passes:
        _check_forward(spec, case, out, row_stats, ref_out, ref_lse, tol)
    run = jax.jit(lambda *a: backend.backward(spec, *a, bwd_config))
    grads = jax.block_until_ready(run(q, k, v, out, row_stats, do, dlse, q_ids, kv_ids))
    empty = ~np.isfinite(np.asarray(ref_lse))
    for name, g, ref, x in zip(("dq", "dk", "dv"), grads, ref_grads, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape, (name, g.dtype, g.shape)
        assert_close(name, g, ref, tol)
    # A row that sees no key has dq = 0 exactly.
    assert not np.asarray(grads[0], np.float32).transpose(0, 2, 1, 3)[empty].any()
    if mosaic and case.expect == "fused" and ON_GPU:
        # The fused backward adds dQ in a fixed order: a second call gives the same bits.
        # (The interpreter runs one CTA at a time, so there a repeat would test nothing.)
        for g, again in zip(grads, run(q, k, v, out, row_stats, do, dlse, q_ids, kv_ids)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(again))


# ---- the flags against the kernels -------------------------------------------------------------

def _struct(shape, dtype):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


@pytest.mark.parametrize("backend,case", [
    pytest.param(b, c, id=f"{b.name}-{c.key()}") for b in BACKENDS if b.family == "mosaic"
    # The base backend's skipped groups are a choice of cases, not a limit of the kernels.
    for c in CASES if (b is MOSAIC and c.group not in b.skips) or b.supports(c)])
def test_flags_agree_with_the_kernels(backend, case):
    """Where a Mosaic backend declares a case supported, its kernels serve it at each of the
    case's tiles, in the mode the matrix runs it in (no launch; the CPU checks the compiled-only
    ones too); where the base backend declares it unsupported, they refuse it."""
    b, sq, skv, hq, hkv, d = case.shape
    q = _struct((b, sq, hq, d), case.dtype)
    k = v = _struct((b, skv, hkv, d), case.dtype)
    has_segments = case.ids is not None
    if not backend.supports(case):
        spec = _spec(case, has_segments, interpret=False)
        assert backend.unsupported_reason(spec, q, k, v, case.passes, None, None) is not None
        return
    for label, (fwd, bwd) in backend.tiles(case).items():
        interpret = not ON_GPU and case.interpret and backend.runs_interpreted(case, label)
        spec = _spec(case, has_segments, interpret=interpret)
        passes = backend.passes & case.passes
        reason = backend.unsupported_reason(spec, q, k, v, passes, fwd, bwd)
        assert reason is None, (label, reason)
