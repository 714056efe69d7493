"""Property-based tests: random shapes and options against the reference.

`flash_attention`: each example draws one `Case`: batch 1-2, seq_q and seq_kv in 1..300,
kv_heads 1..3 with a group of 1..3 q heads each (MHA, GQA, MQA), head_dim 16..256 (powers of two
and not), causal or not, either causal alignment, an optional sliding window with None sides, an
optional softcap, optional sinks, optional segment ids (sorted packed documents, or unsorted ids)
and optional per-batch lengths (0 allowed: every row padded). The test runs
`check_against_reference` on it: O, lse, dq, dk, dv (and the sinks' gradient) against
`reference_attention` at the shared per-dtype tolerance, and lse = -inf on exactly the rows that
see no key. The default dispatch runs every dtype; the Mosaic kernels run bf16 and f16 at the
head dims they take (interpret mode on a CPU, compiled on sm_90).

`decode_attention`: each example draws one `DecodeCase`: batch 1-3, 1..16 new tokens, GQA groups
1..16, a contiguous cache of up to 600 positions or a paged one (pages of 16, 32 or 64 in a
random order, spare pages of NaN), per-sequence lengths from 0 (every token sees nothing) to the
whole cache, and optional window, softcap, scale, sinks and split count; O and lse against
test_decode's reference. Triton's kernel runs at every head_dim; the Mosaic kernel (interpret
mode on a CPU) at the head dims it takes.

Dense masks of the `dot_product_attention` drop-in: masks of segments, padding and causality
must be served by the kernels, and any mask that is served must be exactly what the kernels see.

Budget: every attention example compiles its kernels in interpret mode (about 2-5 s on one CPU
core), so the examples are few and fixed (`derandomize=True`: the same draws on every run, no
database), and the tests are split by dtype, so that pytest-xdist spreads them over its workers
(8 flash_attention examples per dtype: about 35 s per dtype on one core). The shrink phase is
off: a failure reports the drawn case as it is (its repr is valid Python); paste it into PINNED
below so that it stays covered. The `_deep` tests (marked slow) draw 50 per dtype. Set
PALLAS_FLASH_FUZZ_EXAMPLES=N to run N flash_attention examples per dtype in the fast test
instead (and half as many decode examples), PALLAS_FLASH_FUZZ_SHRINK=1 to let Hypothesis
shrink a failure to a smaller case first, and PALLAS_FLASH_FUZZ_FRESH=1 to draw new cases on
every run instead of the fixed ones (for a long hunt, with a large N).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

import pallas_flash as pf
from pallas_flash import dense_mask
from pallas_flash.mosaic.common import SUPPORTED_HEAD_DIMS
from pallas_flash.mosaic.decode import DECODE_HEAD_DIMS
from helpers import ON_GPU, check_against_reference, random_inputs, tolerance
# decode_attention's cache and reference (each sequence's keys moved to the end of the array).
from test_decode import (IS_HOPPER, _normal, check, make_cache, pages_past_lengths_out_of_range,
                         reference)
from test_sinks import _sink_grads, assert_sink_grads_close

DTYPES = ("float32", "bfloat16", "float16")
MAX_SEQ = 300

# Examples per dtype in the default (fast) run, and in the opt-in deep run (marked slow).
FAST_EXAMPLES = int(os.environ.get("PALLAS_FLASH_FUZZ_EXAMPLES", "8"))
DEEP_EXAMPLES = 50
# decode_attention's examples per dtype in the fast run: a decode call compiles two kernels.
DECODE_EXAMPLES = max(1, FAST_EXAMPLES // 2)

_PHASES = (Phase.explicit, Phase.reuse, Phase.generate)
if os.environ.get("PALLAS_FLASH_FUZZ_SHRINK") == "1":
    _PHASES += (Phase.shrink,)


_FRESH = os.environ.get("PALLAS_FLASH_FUZZ_FRESH") == "1"


def _settings(max_examples):
    return settings(max_examples=max_examples, deadline=None, derandomize=not _FRESH,
                    database=None, phases=_PHASES, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclasses.dataclass(frozen=True)
class Case:
    """One drawn call. Everything random in it is derived from `seed`, so its repr reproduces it.

    segments: "none", "packed" (sorted ids: each batch row is a few documents laid end to end;
    with seq_q == seq_kv the keys carry the queries' ids, as in packed self-attention) or
    "unsorted" (random ids in 0..2 per position).
    """

    dtype: str
    batch: int
    seq_q: int
    seq_kv: int
    kv_heads: int
    group: int
    head_dim: int
    causal: bool = False
    causal_alignment: str = "top_left"
    window: tuple | None = None
    softcap: float | None = None
    segments: str = "none"
    q_lengths: tuple | None = None
    kv_lengths: tuple | None = None
    sinks: bool = False
    backend: str = "auto"
    seed: int = 0

    def inputs(self):
        return random_inputs(jax.random.PRNGKey(self.seed), self.batch, self.seq_q, self.seq_kv,
                             self.kv_heads * self.group, self.kv_heads, self.head_dim,
                             jnp.dtype(self.dtype))

    def kwargs(self):
        kwargs = dict(causal=self.causal, causal_alignment=self.causal_alignment,
                      window=self.window, softcap=self.softcap)
        if self.segments != "none":
            q_ids, kv_ids = self._segment_ids()
            kwargs.update(q_segment_ids=q_ids, kv_segment_ids=kv_ids)
        if self.q_lengths is not None:
            kwargs["q_lengths"] = jnp.asarray(self.q_lengths, jnp.int32)
        if self.kv_lengths is not None:
            kwargs["kv_lengths"] = jnp.asarray(self.kv_lengths, jnp.int32)
        if self.sinks:
            heads = self.kv_heads * self.group
            kwargs["sinks"] = 2.0 * jax.random.normal(jax.random.PRNGKey(self.seed + 1), (heads,))
        return kwargs

    def _segment_ids(self):
        rng = np.random.default_rng(self.seed)
        if self.segments == "unsorted":
            return (jnp.asarray(rng.integers(0, 3, (self.batch, self.seq_q)), jnp.int32),
                    jnp.asarray(rng.integers(0, 3, (self.batch, self.seq_kv)), jnp.int32))
        assert self.segments == "packed", self.segments

        def packed(seq, n_docs):
            # n_docs - 1 sorted cut points in [0, seq]: documents of random (possibly 0) length.
            cuts = np.sort(rng.integers(0, seq + 1, n_docs - 1))
            return np.searchsorted(cuts, np.arange(seq), side="right")

        q_rows, kv_rows = [], []
        for _ in range(self.batch):
            n_docs = int(rng.integers(1, 5))
            q_row = packed(self.seq_q, n_docs)
            kv_row = q_row if self.seq_q == self.seq_kv else packed(self.seq_kv, n_docs)
            q_rows.append(q_row)
            kv_rows.append(kv_row)
        return jnp.asarray(np.stack(q_rows), jnp.int32), jnp.asarray(np.stack(kv_rows), jnp.int32)


def check_case(case: Case):
    q, k, v, do = case.inputs()
    # float32 runs at precision="highest", its tolerance float32 rounding only: under the GPU's
    # default tf32, dQ of a one-key row is a cancellation (dP - D with dP from tf32 operands)
    # that fails any tolerance tight enough to catch kernel bugs (seen on our H200: 2.4e-3 for a
    # 1x1 case). tf32 has its own test in test_attention.py.
    extra = dict(precision="highest") if case.dtype == "float32" else {}
    if case.backend != "auto":
        extra["backend"] = case.backend
    kwargs = case.kwargs()
    check_against_reference(q, k, v, do, **kwargs, **extra)
    if case.sinks:
        sinks = kwargs.pop("sinks")
        dlse = jax.random.normal(jax.random.PRNGKey(case.seed + 2),
                                 (case.batch, sinks.shape[0], case.seq_q), jnp.float32)
        got = _sink_grads(pf.flash_attention, q, k, v, do, dlse, sinks, dict(kwargs, **extra))
        assert_sink_grads_close(got, q, k, v, do, dlse, sinks, kwargs,
                                tolerance(jnp.dtype(case.dtype)))


# ---- the strategy ------------------------------------------------------------------------------

# Sequence lengths: mostly short (interpret time grows with the tile count), often around a tile
# edge (16, 32, 64, 128 rows), sometimes anything up to MAX_SEQ.
_TILE_EDGES = sorted({n + d for n in (16, 32, 64, 128, 256) for d in (-1, 0, 1)})
_SEQ = st.one_of(st.integers(1, 80), st.sampled_from(_TILE_EDGES), st.integers(1, MAX_SEQ))
_HEAD_DIM = st.one_of(st.sampled_from([16, 32, 64, 128, 256]), st.integers(16, 256))
_WINDOW_SIDE = st.one_of(st.none(), st.integers(0, 40), st.integers(0, MAX_SEQ + 20))


# The Mosaic kernels' draws: the head dims they take, and sequences cut to MOSAIC_MAX_SEQ (their
# interpret mode simulates every warpgroup and barrier: a few seconds a call at that size).
MOSAIC_MAX_SEQ = 160


@st.composite
def cases(draw, dtype: str, backend: str = "auto"):
    batch = draw(st.integers(1, 2))
    seq_q = draw(_SEQ)
    seq_kv = draw(st.one_of(st.just(seq_q), _SEQ))
    if backend == "mosaic":
        seq_q, seq_kv = min(seq_q, MOSAIC_MAX_SEQ), min(seq_kv, MOSAIC_MAX_SEQ)
    window = draw(st.one_of(st.none(), st.tuples(_WINDOW_SIDE, _WINDOW_SIDE)))
    segments = draw(st.sampled_from(["none", "none", "packed", "packed", "unsorted"]))
    lengths = lambda seq: st.one_of(  # noqa: E731
        st.none(), st.tuples(*[st.integers(0, seq)] * batch))
    return Case(
        dtype=dtype,
        batch=batch,
        seq_q=seq_q,
        seq_kv=seq_kv,
        kv_heads=draw(st.integers(1, 3)),
        group=draw(st.integers(1, 3)),
        head_dim=draw(_HEAD_DIM if backend != "mosaic" else st.sampled_from(SUPPORTED_HEAD_DIMS)),
        causal=draw(st.booleans()),
        causal_alignment=draw(st.sampled_from(["top_left", "bottom_right"])),
        window=window,
        softcap=draw(st.one_of(st.none(), st.floats(1.0, 50.0))),
        sinks=draw(st.booleans()),
        segments=segments,
        q_lengths=draw(lengths(seq_q)),
        kv_lengths=draw(lengths(seq_kv)),
        backend=backend,
        seed=draw(st.integers(0, 2**16)),
    )


def fuzz_tests(check, strategy, dtypes, examples, marks=()):
    """A test drawing `examples` cases per dtype from strategy(dtype) into check, and its deep
    twin (marked slow) drawing DEEP_EXAMPLES."""
    def make(n, slow):
        @pytest.mark.parametrize("dtype", dtypes)
        @given(data=st.data())
        @_settings(n)
        def test(dtype, data):
            check(data.draw(strategy(dtype), label="case"))
        for mark in (*marks, *([pytest.mark.slow] if slow else [])):
            test = mark(test)
        return test
    return make(examples, False), make(DEEP_EXAMPLES, True)


test_matches_reference, test_matches_reference_deep = fuzz_tests(
    check_case, cases, DTYPES, FAST_EXAMPLES)

# The Mosaic kernels (the default on sm_90): interpret mode on a CPU, compiled on sm_90, where
# random shapes also reach the edge blocks that only compiled kernels can get wrong.
MOSAIC_DTYPES = ("bfloat16", "float16")
MOSAIC_EXAMPLES = 3
NEEDS_MOSAIC = pytest.mark.skipif(ON_GPU and not IS_HOPPER,
                                  reason="the Mosaic kernels run compiled on sm_90 only")

test_mosaic_matches_reference, test_mosaic_matches_reference_deep = fuzz_tests(
    check_case, lambda dtype: cases(dtype, "mosaic"), MOSAIC_DTYPES, MOSAIC_EXAMPLES,
    marks=[NEEDS_MOSAIC])


# ---- pinned cases ------------------------------------------------------------------------------
# Explicit cases that always run: edges that random draws reach only rarely, and every failure
# the fuzzing finds (paste the reported Case or DecodeCase here, with what it caught). The
# float32 draws run at precision="highest": with one query and one key P = 1, so
# dS = P (dP - D) is a difference of two equal-sized terms, and tf32 rounding of dP alone can
# exceed the tf32 tolerance. Such a row is not pinned: it stays ill-conditioned in full float32
# too (dP and D are equal up to rounding and summed in different orders), so a pinned copy
# would test the rounding of a cancellation, not the kernels.

PINNED = {
    # Every query row and key padded (length 0) under packed segments: no key is seen anywhere.
    "all_padded_packed": Case(dtype="bfloat16", batch=2, seq_q=33, seq_kv=70, kv_heads=1,
                              group=3, head_dim=40, causal=True, segments="packed",
                              q_lengths=(0, 33), kv_lengths=(70, 0), seed=5),
    # One token against one key, head_dim not a power of two, softcap and a window of zero.
    "single_token_window_zero": Case(dtype="float16", batch=1, seq_q=1, seq_kv=1, kv_heads=1,
                                     group=1, head_dim=17, window=(0, 0), softcap=1.0),
    # Bottom-right causal with seq_q > seq_kv and a left window: the first rows see nothing;
    # head_dim 255 pads to 256; MHA with 3 heads.
    "bottom_right_empty_rows": Case(dtype="float32", batch=2, seq_q=129, seq_kv=65, kv_heads=3,
                                    group=1, head_dim=255, causal=True,
                                    causal_alignment="bottom_right", window=(7, None), seed=3),
    # Unsorted segment ids (the block ranges are then only a superset) with lengths, MQA x3.
    "unsorted_segments_lengths": Case(dtype="float16", batch=2, seq_q=97, seq_kv=161,
                                      kv_heads=1, group=3, head_dim=80, segments="unsorted",
                                      q_lengths=(97, 40), kv_lengths=(1, 160), seed=11),
    # Sinks whose gradient cancels: its 16 row terms sum to about a twentieth of their
    # magnitude, so O's rounding to bf16 moves it by more than the bf16 tolerance of its value
    # (test_sinks.assert_sink_grads_close).
    "sink_gradient_cancels": Case(dtype="bfloat16", batch=1, seq_q=16, seq_kv=275, kv_heads=1,
                                  group=1, head_dim=175, causal=True,
                                  causal_alignment="bottom_right", segments="packed",
                                  sinks=True, seed=1),
}


@pytest.mark.parametrize("name", list(PINNED))
def test_pinned(name):
    case = PINNED[name]
    (check_decode_case if isinstance(case, DecodeCase) else check_case)(case)


# ---- decode_attention --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """One drawn decode_attention call; its repr reproduces it, as Case's does.

    page_size None: a contiguous cache of max_len positions. Else a paged one: pages_per_seq
    pages of page_size per sequence, handed out in a random order among spare pages of NaN
    (test_decode.make_cache), max_len = pages_per_seq * page_size. Table entries of pages past
    a sequence's length hold an id outside the cache: they must never be read.
    """

    dtype: str
    batch: int
    q_len: int
    kv_heads: int
    group: int
    head_dim: int
    max_len: int
    lengths: tuple
    page_size: int | None = None
    window: tuple | None = None
    softcap: float | None = None
    scale: float | None = None
    sinks: bool = False
    num_splits: int | None = None
    backend: str = "auto"
    seed: int = 0

    def options(self):
        return dict(window=self.window, softcap=self.softcap, scale=self.scale)


def check_decode_case(case: DecodeCase):
    q_heads = case.kv_heads * case.group
    kq, kc, ks = jax.random.split(jax.random.PRNGKey(case.seed), 3)
    dtype = jnp.dtype(case.dtype)
    q = _normal(kq, (case.batch, case.q_len, q_heads, case.head_dim), dtype)
    k_cache, v_cache, table, k, v = make_cache(kc, case.batch, case.max_len, case.kv_heads,
                                               case.head_dim, dtype, case.page_size)
    kv_lengths = jnp.asarray(case.lengths, jnp.int32)
    if table is not None:
        table = pages_past_lengths_out_of_range(table, kv_lengths, case.page_size)
    options = case.options()
    if case.sinks:
        options["sinks"] = 2.0 * jax.random.normal(ks, (q_heads,), jnp.float32)
    try:
        # Waited for before the reference is dispatched (tests/helpers.py, outputs_and_grads).
        out, lse = jax.block_until_ready(pf.decode_attention(
            q, k_cache, v_cache, kv_lengths=kv_lengths, block_table=table,
            num_splits=case.num_splits, return_lse=True, backend=case.backend, **options))
    except ValueError as e:
        # A draw outside what the Mosaic kernel takes (head_dim, say) is not a failure.
        assume(not (case.backend == "mosaic" and "cannot serve" in str(e)))
        raise
    assert out.shape == q.shape and lse.shape == (case.batch, q_heads, case.q_len)
    ref_out, ref_lse = reference(q, k, v, kv_lengths, **options)
    check(out, lse, ref_out, ref_lse, dtype)


# Contexts: mostly short, often at a multiple of the 64-key chunk alignment, sometimes up to 600
# (several chunks, and more splits than a short context allows).
_CONTEXT = st.one_of(st.integers(1, 130), st.sampled_from(_TILE_EDGES), st.integers(1, 600))


@st.composite
def decode_cases(draw, dtype: str, backend: str = "auto"):
    batch = draw(st.integers(1, 3))
    page_size = draw(st.one_of(st.none(), st.sampled_from([16, 32, 64])))
    if page_size is None:
        max_len = draw(_CONTEXT)
        if backend == "mosaic":     # its TMA takes a contiguous cache in whole 8-row tiles
            max_len = -(-max_len // 8) * 8
    else:
        max_len = page_size * draw(st.integers(1, 6))
    # A length below q_len leaves the first tokens at negative positions (no key seen); 0 and
    # max_len are the edges.
    length = st.one_of(st.integers(0, max_len), st.sampled_from([0, max_len]))
    return DecodeCase(
        dtype=dtype,
        batch=batch,
        q_len=draw(st.one_of(st.just(1), st.integers(1, 16))),
        kv_heads=draw(st.integers(1, 3)),
        group=draw(st.sampled_from([1, 2, 3, 4, 8, 16])),
        head_dim=draw(_HEAD_DIM if backend != "mosaic" else st.sampled_from(DECODE_HEAD_DIMS)),
        max_len=max_len,
        lengths=tuple(draw(st.lists(length, min_size=batch, max_size=batch))),
        page_size=page_size,
        window=draw(st.one_of(st.none(), st.tuples(_WINDOW_SIDE, _WINDOW_SIDE))),
        softcap=draw(st.one_of(st.none(), st.floats(1.0, 50.0))),
        scale=draw(st.one_of(st.none(), st.floats(0.01, 1.0))),
        sinks=draw(st.booleans()),
        num_splits=draw(st.one_of(st.none(), st.integers(1, 12))),
        backend=backend,
        seed=draw(st.integers(0, 2**16)),
    )


test_decode_matches_reference, test_decode_matches_reference_deep = fuzz_tests(
    check_decode_case, decode_cases, DTYPES, DECODE_EXAMPLES)


# The Mosaic decode kernel: interpret mode on a CPU (a few seconds a call), compiled on sm_90.
MOSAIC_DECODE_EXAMPLES = 3


test_mosaic_decode_matches_reference, test_mosaic_decode_matches_reference_deep = fuzz_tests(
    check_decode_case, lambda dtype: decode_cases(dtype, "mosaic"), MOSAIC_DTYPES,
    MOSAIC_DECODE_EXAMPLES, marks=[NEEDS_MOSAIC])


# ---- dense masks of the dot_product_attention drop-in ------------------------------------------
# `dense_mask.recognise` reads segment ids off a dense mask and says which kernel serves it. No
# kernel runs here, so the examples are many: a mask built from segments (sorted or not),
# padding and an optional causal bound must be served by the kernels, and whatever mask is
# drawn, a served one must be exactly what the kernels see under the ids returned.

MASK_EXAMPLES = 60


@st.composite
def dense_masks(draw):
    """(mask [B or 1, N or 1, T, S] bool, is_causal, structured): structured masks are
    segments & padding & an optional causal bound, the others random bits or a structured mask
    with a few elements flipped."""
    batch = draw(st.integers(1, 2))
    seq_q, seq_kv = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    kind = draw(st.sampled_from(["segments", "segments", "flipped", "random"]))
    n_ids = draw(st.integers(1, 4))
    if draw(st.booleans()):     # packed documents: sorted ids
        q_ids = np.sort(rng.integers(0, n_ids, (batch, seq_q)), axis=1)
        kv_ids = np.sort(rng.integers(0, n_ids, (batch, seq_kv)), axis=1)
    else:
        q_ids = rng.integers(0, n_ids, (batch, seq_q))
        kv_ids = rng.integers(0, n_ids, (batch, seq_kv))
    mask = q_ids[:, :, None] == kv_ids[:, None, :]
    q_valid = np.arange(seq_q)[None] < rng.integers(0, seq_q + 1, (batch, 1))
    kv_valid = np.arange(seq_kv)[None] < rng.integers(0, seq_kv + 1, (batch, 1))
    mask &= q_valid[:, :, None] & kv_valid[:, None, :]
    if draw(st.booleans()):
        mask &= np.arange(seq_kv)[None, None, :] <= np.arange(seq_q)[None, :, None]
    if kind == "flipped":
        for _ in range(draw(st.integers(1, 3))):
            b, t, s = rng.integers(batch), rng.integers(seq_q), rng.integers(seq_kv)
            mask[b, t, s] = ~mask[b, t, s]
    elif kind == "random":
        mask = rng.random((batch, seq_q, seq_kv)) < draw(st.floats(0.05, 0.95))
    mask = mask[:, None]
    heads = draw(st.sampled_from(["one", "copies", "batch-broadcast"]))
    if heads == "copies":
        mask = np.broadcast_to(mask, (batch, 3, seq_q, seq_kv))
    elif heads == "batch-broadcast":
        mask = mask[:1]
    return mask, draw(st.booleans()), kind == "segments"


@given(drawn=dense_masks())
@_settings(MASK_EXAMPLES)
def test_dense_masks_are_served_exactly(drawn):
    mask, is_causal, structured = drawn
    _, _, seq_q, seq_kv = mask.shape
    batch = 2
    q_ids, kv_ids, branch = dense_mask.recognise(
        jnp.asarray(mask), None, None, batch=batch, seq_q=seq_q, seq_kv=seq_kv,
        is_causal=is_causal, window=None)
    branch = int(branch)
    causal = np.arange(seq_kv)[None, :] <= np.arange(seq_q)[:, None]
    wanted = np.broadcast_to(mask, (batch, mask.shape[1], seq_q, seq_kv))
    if is_causal:
        wanted = wanted & causal
    if structured:
        assert branch != dense_mask.FALLBACK, "a mask of segments, padding and causality"
    if branch == dense_mask.FALLBACK:
        return
    # What the kernels see under the returned ids (padding ids match nothing).
    q_ids, kv_ids = np.asarray(q_ids), np.asarray(kv_ids)
    seen = q_ids[:, :, None] == kv_ids[:, None, :]
    if branch == dense_mask.CAUSAL:
        seen = seen & causal
    np.testing.assert_array_equal(np.broadcast_to(seen[:, None], wanted.shape), wanted)
