"""Block skipping: the key tiles a kernel visits for each query tile (masking.visited_kv_blocks).

The loop bounds must cover every tile that holds a visible pair (or answers would be wrong) and,
without segment ids, nothing else (or masks would cost what dense attention costs).
test_features.py checks the kernels' answers under the same masks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import check_against_reference, random_inputs
from pallas_flash.masking import (make_mask_spec, segment_block_ranges, visited_kv_blocks,
                                  with_segment_range)


def packed_ids(key, batch, seq, n_docs):
    """Sorted segment ids: n_docs documents of random lengths per row."""
    rows = []
    for b in range(batch):
        cuts = np.sort(np.asarray(jax.random.choice(jax.random.fold_in(key, b),
                                                    np.arange(1, seq), (n_docs - 1,),
                                                    replace=False)))
        rows.append(np.searchsorted(cuts, np.arange(seq), side="right"))
    return jnp.asarray(np.stack(rows), jnp.int32)


def test_causal_visits_about_half_the_tiles():
    spec_full = make_mask_spec(1024, 1024, causal=False)
    spec_causal = make_mask_spec(1024, 1024, causal=True)
    full = int(visited_kv_blocks(spec_full, 64, 64))
    causal = int(visited_kv_blocks(spec_causal, 64, 64))
    assert full == 16 * 16
    assert causal == 16 * 17 // 2       # the diagonal tiles and everything below, nothing above


def test_window_cost_is_linear_in_sequence():
    def tiles(seq):
        return int(visited_kv_blocks(make_mask_spec(seq, seq, causal=True, window=(256, 0)),
                                     64, 64))
    # Each of the seq/64 query blocks visits at most ceil((256 + 63) / 64) + 1 = 6 tiles, so the
    # count grows by the same amount per doubling (linear), never with seq^2.
    assert tiles(16384) - tiles(8192) == 2 * (tiles(8192) - tiles(4096))
    assert tiles(8192) <= (8192 // 64) * 6


def test_packed_documents_visit_only_their_own_tiles():
    seq, block = 2048, 64
    lengths = [512, 256, 1024, 256]
    ids = jnp.asarray(np.repeat(np.arange(4), lengths)[None], jnp.int32)
    spec = make_mask_spec(seq, seq, causal=True)
    visited = int(visited_kv_blocks(spec, block, block, ids, ids)[0])
    own = sum((n // block) * (n // block + 1) // 2 for n in lengths)
    whole = int(visited_kv_blocks(spec, block, block))
    assert visited == own                   # document boundaries fall on tile boundaries here
    assert visited < 0.45 * whole           # sum of squares, far under one causal 2048 document
    # The kernels with these bounds compute the right answer (test_features.py); here, that
    # a flash_attention call with these ids agrees with the reference at this size too.
    q, k, v, do = random_inputs(jax.random.PRNGKey(9), 1, 256, 256, 2, 2, 16, jnp.bfloat16)
    small = jnp.asarray(np.repeat(np.arange(4), [64, 32, 128, 32])[None], jnp.int32)
    check_against_reference(q, k, v, do, causal=True, q_segment_ids=small,
                            kv_segment_ids=small)


def _needed_ranges(dense, bq, bk):
    """Brute force from the dense mask: per query block, the key blocks [lo, hi) from the first
    to the last one holding a visible pair, or None for a query block that sees no key."""
    ranges = []
    for i in range(0, dense.shape[0], bq):
        cols = np.nonzero(dense[i:i + bq].any(0))[0]
        ranges.append((int(cols[0]) // bk, int(cols[-1]) // bk + 1) if cols.size else None)
    return ranges


def _loop_ranges(spec, bq, bk, q_ids=None, kv_ids=None):
    """The [lo, hi) key-block range the forward kernel loops over, per query block, as
    visited_kv_blocks evaluates it: spec.kv_blocks, intersected with the segment range when
    ids are given (batch row 0)."""
    starts = jnp.arange(-(-spec.seq_q // bq), dtype=jnp.int32) * bq
    bounds = jax.vmap(lambda s: spec.kv_blocks(s, bq, bk, spec.seq_kv))(starts)
    if q_ids is not None:
        seg_lo, seg_hi = segment_block_ranges(q_ids, kv_ids, bq, bk)
        bounds = with_segment_range(bounds, seg_lo[0], seg_hi[0])
    return list(zip(np.asarray(bounds[0]).tolist(), np.asarray(bounds[3]).tolist()))


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("window", [None, (40, None), (9, 30), (0, 0)])
def test_position_bounds_are_exact(window, alignment):
    # Without ids, each query block's loop range is exactly its first to its last key block
    # with a visible pair, and a query block that sees nothing loops over nothing.
    for causal in (False, True):
        spec = make_mask_spec(150, 170, causal=causal, window=window,
                              causal_alignment=alignment)
        dense = np.asarray(spec.dense() if spec.has_position_mask
                           else np.ones((150, 170), bool))
        needed = _needed_ranges(dense, 32, 16)
        got = _loop_ranges(spec, 32, 16)
        assert len(got) == len(needed)
        for block, ((lo, hi), want) in enumerate(zip(got, needed)):
            where = f"causal={causal}, query block {block}"
            if want is None:
                assert hi == lo, f"{where}: sees no key but loops over [{lo}, {hi})"
            else:
                assert (lo, hi) == want, f"{where}: loops over [{lo}, {hi}), needs {want}"
        # The cost model sums these same ranges.
        assert int(visited_kv_blocks(spec, 32, 16)) == sum(hi - lo for lo, hi in got)


@pytest.mark.parametrize("seed", range(4))
def test_bounds_never_skip_a_visible_tile(seed):
    # With ids as well, the bounds may be a superset (position and id ranges are intersected
    # separately) but must cover every tile with a visible pair, or answers would be wrong; and
    # the ids only ever shrink the position range.
    key = jax.random.PRNGKey(seed)
    q_ids = packed_ids(key, 1, 150, 4)
    kv_ids = packed_ids(jax.random.fold_in(key, 1), 1, 170, 3)
    spec = make_mask_spec(150, 170, causal=True, window=(40, None),
                          causal_alignment="bottom_right")
    dense = np.asarray(spec.dense()) & (np.asarray(q_ids[0])[:, None]
                                        == np.asarray(kv_ids[0])[None])
    needed = _needed_ranges(dense, 32, 16)
    got = _loop_ranges(spec, 32, 16, q_ids, kv_ids)
    position = _loop_ranges(spec, 32, 16)
    assert len(got) == len(needed) == len(position)
    # Some query block sees a key and some tile of its position range is skipped for its ids,
    # so both the coverage and the shrinking below are exercised.
    assert any(want is not None for want in needed)
    assert sum(hi - lo for lo, hi in got) < sum(hi - lo for lo, hi in position)
    for block, ((lo, hi), want, (pos_lo, pos_hi)) in enumerate(zip(got, needed, position)):
        if want is not None:
            assert lo <= want[0] and want[1] <= hi, (
                f"query block {block}: loops over [{lo}, {hi}), skipping visible tiles of "
                f"[{want[0]}, {want[1]})")
        if hi > lo:
            assert pos_lo <= lo and hi <= pos_hi, (
                f"query block {block}: [{lo}, {hi}) leaves the position range "
                f"[{pos_lo}, {pos_hi})")
    assert int(visited_kv_blocks(spec, 32, 16, q_ids, kv_ids)[0]) == sum(
        hi - lo for lo, hi in got)
