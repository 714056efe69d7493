"""decode_attention: split-KV attention of a few new tokens against contiguous and paged caches.

The reference is reference_attention on the same keys, each sequence's cache shifted so that its
kv_length keys end the array (bottom-right alignment then puts token t at kv_length - q_len + t)
and the positions before them masked off by segment ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_flash as pf
from pallas_flash import decode
from helpers import ON_GPU, assert_close, kernel_names, tolerance

IS_HOPPER = ON_GPU and str(getattr(jax.devices()[0], "compute_capability", "")) == "9.0"


def _normal(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def make_cache(key, batch, max_len, kv_heads, head_dim, dtype, page_size=None):
    """(k_cache, v_cache, block_table, contiguous k, contiguous v).

    Paged: each sequence's pages are a random permutation of the physical pages, with extra
    physical pages no sequence uses (filled with NaN: they must never be read)."""
    kk, kv, kp = jax.random.split(key, 3)
    k = _normal(kk, (batch, max_len, kv_heads, head_dim), dtype)
    v = _normal(kv, (batch, max_len, kv_heads, head_dim), dtype)
    if page_size is None:
        return k, v, None, k, v
    pages_per_seq = max_len // page_size
    used = batch * pages_per_seq
    num_pages = used + 3
    perm = jax.random.permutation(kp, num_pages)[:used].astype(jnp.int32)
    table = perm.reshape(batch, pages_per_seq)

    def scatter(x):
        paged = jnp.full((num_pages, page_size, kv_heads, head_dim), jnp.nan, dtype)
        pages = x.reshape(used, page_size, kv_heads, head_dim)
        return paged.at[perm].set(pages)

    return scatter(k), scatter(v), table, k, v


def pages_past_lengths_out_of_range(table, kv_lengths, page_size):
    """The table with the entries of pages past each sequence's length set to an id outside
    the cache: they are never read, so any value must do."""
    past = jnp.arange(table.shape[1])[None, :] * page_size >= kv_lengths[:, None]
    return jnp.where(past, jnp.int32(10 ** 6), table)


def gather_pages(cache, table):
    """The contiguous [batch, max_len, kv_heads, head_dim] view of a paged cache."""
    pages = cache[table]  # [batch, pages_per_seq, page_size, kv_heads, head_dim]
    b, p, s, h, d = pages.shape
    return pages.reshape(b, p * s, h, d)


def check_traced_bad_pages(q, cache, lengths, options, bad, ignored, **call):
    """decode_attention under jit on make_cache's paged `cache` whose table has page ids
    outside the cache at the (sequence, page, "past" | "minus") entries of `bad` and `ignored`:
    the sequences in `bad` must come out with all-NaN O and lse, the others match the
    reference. `call` goes to decode_attention (backend, interpret)."""
    k_cache, v_cache, table, k, v = cache
    # Zeros, not NaN, in the pages no sequence uses: a read of a page outside the cache that
    # lands on one (an index that wraps or clamps) may not pass for the NaN asked for here.
    k_cache, v_cache = jnp.nan_to_num(k_cache), jnp.nan_to_num(v_cache)
    ids = {"past": k_cache.shape[0], "minus": -1}
    table = np.array(table)
    for b, p, value in bad + ignored:
        table[b, p] = ids[value]
    kv_lengths = jnp.array(lengths, jnp.int32)
    step = jax.jit(lambda t, n: pf.decode_attention(q, k_cache, v_cache, kv_lengths=n,
                                                    block_table=t, return_lse=True, **options,
                                                    **call))
    # Waited for before anything else is dispatched (tests/helpers.py, outputs_and_grads).
    out, lse = jax.block_until_ready(step(jnp.asarray(table), kv_lengths))
    poisoned = sorted({b for b, _, _ in bad})
    for b in poisoned:
        assert np.isnan(np.asarray(out[b], np.float32)).all(), f"sequence {b}: O is not all NaN"
        assert np.isnan(np.asarray(lse[b])).all(), f"sequence {b}: lse is not all NaN"
    good = np.array([b for b in range(q.shape[0]) if b not in poisoned])
    ref_opts = {name: value for name, value in options.items() if name != "num_splits"}
    ref_out, ref_lse = reference(q, k, v, kv_lengths, **ref_opts)
    check(out[good], lse[good], ref_out[good], ref_lse[good], q.dtype)


def reference(q, k, v, kv_lengths, **opts):
    """reference_attention in float32 with each sequence's keys moved to the end of the array."""
    max_len = k.shape[1]
    shift = max_len - kv_lengths
    roll = jax.vmap(lambda x, s: jnp.roll(x, s, axis=0))
    k, v = roll(k, shift), roll(v, shift)
    # Positions kept: the last kv_length of the shifted cache (segment 1); query rows are 1.
    kv_ids = (jnp.arange(max_len)[None, :] >= shift[:, None]).astype(jnp.int32)
    q_ids = jnp.ones(q.shape[:2], jnp.int32)
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    return pf.reference_attention(up(q), up(k), up(v), causal=True,
                                  causal_alignment="bottom_right", q_segment_ids=q_ids,
                                  kv_segment_ids=kv_ids, return_lse=True, **opts)


def check(out, lse, ref_out, ref_lse, dtype):
    tol = tolerance(dtype)
    assert out.dtype == dtype
    empty = ~np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.asarray(lse) == -np.inf, empty,
                                  err_msg="rows with lse = -inf differ from the reference")
    assert_close("out", out, ref_out, tol)
    assert_close("lse", np.where(empty, 0.0, lse), np.where(empty, 0.0, ref_lse), tol, floor=1.0)


CASES = [
    # (dtype, batch, q_len, q_heads, kv_heads, head_dim, max_len, page_size, lengths, options)
    pytest.param(jnp.float32, 2, 1, 2, 2, 32, 96, None, [96, 37], dict(num_splits=1),
                 id="f32-contiguous-mha-q1-one-split"),
    pytest.param(jnp.bfloat16, 2, 4, 8, 2, 64, 200, None, [200, 3], dict(num_splits=3),
                 id="bf16-contiguous-gqa4-q4-splits"),
    pytest.param(jnp.float32, 3, 3, 8, 1, 40, 128, 16, [128, 35, 48], dict(num_splits=4),
                 id="f32-paged16-mqa8-q3-headdim40"),
    pytest.param(jnp.bfloat16, 2, 2, 4, 4, 32, 256, 64, [130, 64], dict(),
                 id="bf16-paged64-mha-q2-auto-splits"),
    pytest.param(jnp.float32, 2, 5, 4, 1, 32, 192, None, [150, 190],
                 dict(num_splits=2, window=(20, 3)), id="f32-window"),
    pytest.param(jnp.float32, 2, 2, 4, 2, 32, 128, 32, [100, 77],
                 dict(num_splits=2, softcap=3.0, scale=0.3), id="f32-paged-softcap-scale"),
    pytest.param(jnp.bfloat16, 2, 3, 8, 2, 32, 128, 16, [0, 2],
                 dict(num_splits=2, sinks=True), id="bf16-paged-sinks-empty-rows"),
    pytest.param(jnp.float32, 1, 16, 2, 2, 16, 64, None, [40], dict(num_splits=1, sinks=True),
                 id="f32-q16-sinks"),
    pytest.param(jnp.float32, 1, 16, 8, 1, 16, 128, 32, [100], dict(num_splits=2),
                 id="f32-paged-q16-gqa8-two-row-tiles"),
    # More splits than the combine merges per round (COMBINE_SPLITS), the second sequence's
    # keys ending inside the first round, and a head_dim that is not a power of two.
    pytest.param(jnp.float32, 2, 2, 4, 2, 48, 1344, None, [1344, 300], dict(num_splits=21),
                 id="f32-21-splits-two-combine-rounds"),
]


NEEDS_HOPPER = pytest.mark.skipif(not IS_HOPPER, reason="the Mosaic GPU kernels run compiled on "
                                                         "sm_90")
BACKENDS = [pytest.param("triton"), pytest.param("mosaic", marks=NEEDS_HOPPER)]


def run_backend(backend, *args, **kwargs):
    """decode_attention on one backend; a case the Mosaic kernel does not serve is skipped."""
    try:
        return pf.decode_attention(*args, backend=backend, **kwargs)
    except ValueError as e:
        if backend == "mosaic" and "cannot serve" in str(e):
            pytest.skip(str(e))
        raise


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,batch,q_len,q_heads,kv_heads,head_dim,max_len,page_size,"
                         "lengths,options", CASES)
def test_matches_reference(dtype, batch, q_len, q_heads, kv_heads, head_dim, max_len, page_size,
                           lengths, options, backend):
    key = jax.random.PRNGKey(sum(lengths) + q_len)
    kq, kc, ks = jax.random.split(key, 3)
    q = _normal(kq, (batch, q_len, q_heads, head_dim), dtype)
    k_cache, v_cache, table, k, v = make_cache(kc, batch, max_len, kv_heads, head_dim, dtype,
                                               page_size)
    kv_lengths = jnp.array(lengths, jnp.int32)
    if table is not None:
        np.testing.assert_array_equal(gather_pages(k_cache, table), k)
        table = pages_past_lengths_out_of_range(table, kv_lengths, page_size)
    options = dict(options)
    if options.pop("sinks", False):
        options["sinks"] = 2.0 * jax.random.normal(ks, (q_heads,), jnp.float32)
    out, lse = run_backend(backend, q, k_cache, v_cache, kv_lengths=kv_lengths,
                           block_table=table, return_lse=True, **options)
    assert out.shape == q.shape and lse.shape == (batch, q_heads, q_len)
    assert lse.dtype == jnp.float32
    options.pop("num_splits", None)
    ref_out, ref_lse = reference(q, k, v, kv_lengths, **options)
    check(out, lse, ref_out, ref_lse, dtype)


def test_tokens_that_see_no_key_give_zero_and_minus_inf():
    # kv_length 0, and kv_length 2 < q_len 4: tokens 0 and 1 sit at negative positions.
    q = _normal(jax.random.PRNGKey(0), (2, 4, 2, 16), jnp.float32)
    k, v, *_ = make_cache(jax.random.PRNGKey(1), 2, 64, 2, 16, jnp.float32)
    out, lse = pf.decode_attention(q, k, v, kv_lengths=jnp.array([0, 2], jnp.int32),
                                   return_lse=True, num_splits=1)
    np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_array_equal(lse[0], -np.inf)
    np.testing.assert_array_equal(out[1, :2], 0.0)
    np.testing.assert_array_equal(lse[1, :, :2], -np.inf)
    assert np.isfinite(np.asarray(lse[1, :, 2:])).all()
    sinks = jnp.array([0.5, -1.0], jnp.float32)
    out, lse = pf.decode_attention(q, k, v, kv_lengths=jnp.array([0, 2], jnp.int32),
                                   sinks=sinks, return_lse=True)
    np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_array_equal(lse[0], np.broadcast_to(sinks[:, None], (2, 4)))


def test_split_count_does_not_change_the_result():
    q = _normal(jax.random.PRNGKey(2), (1, 2, 4, 32), jnp.float32)
    k, v, *_ = make_cache(jax.random.PRNGKey(3), 1, 256, 1, 32, jnp.float32)
    lengths = jnp.array([250], jnp.int32)
    one = pf.decode_attention(q, k, v, kv_lengths=lengths, num_splits=1, return_lse=True)
    four = pf.decode_attention(q, k, v, kv_lengths=lengths, num_splits=4, return_lse=True)
    for a, b in zip(one, four):
        assert_close("split", b, a, tolerance(jnp.float32))


def test_kernels_are_named():
    q = _normal(jax.random.PRNGKey(4), (1, 1, 2, 16), jnp.float32)
    k, v, *_ = make_cache(jax.random.PRNGKey(5), 1, 128, 1, 16, jnp.float32)
    lengths = jnp.array([100], jnp.int32)

    def fn(q, k, v):
        return pf.decode_attention(q, k, v, kv_lengths=lengths, num_splits=2)

    assert {"pallas_flash_decode", "pallas_flash_decode_combine"} <= kernel_names(fn, q, k, v)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_sampling_loop_under_jit(paged):
    """A jitted lax.scan writes each step's K/V into the cache with dynamic_update_slice and
    decodes against it, as a sampler does."""
    batch, kv_heads, q_heads, d, max_len, page, steps, start = 2, 1, 2, 16, 64, 16, 3, 30
    dtype = jnp.float32
    k_cache, v_cache, table, k, v = make_cache(jax.random.PRNGKey(6), batch, max_len, kv_heads,
                                               d, dtype, page if paged else None)
    new = _normal(jax.random.PRNGKey(7), (steps, 3, batch, kv_heads, d), dtype)  # q, k, v rows
    q_all = jnp.repeat(new[:, 0], q_heads // kv_heads, axis=2)[:, :, None]  # [steps, b, 1, h, d]

    def write(cache, rows, pos):
        if not paged:
            return jax.vmap(lambda c, r, p: lax.dynamic_update_slice(c, r[None], (p, 0, 0)))(
                cache, rows, pos)
        phys = table[jnp.arange(batch), pos // page]
        return cache.at[phys, pos % page].set(rows)

    @jax.jit
    def sample(k_cache, v_cache):
        def step(carry, xs):
            k_cache, v_cache, lengths = carry
            q, k_row, v_row = xs
            k_cache = write(k_cache, k_row, lengths)
            v_cache = write(v_cache, v_row, lengths)
            lengths = lengths + 1
            out = pf.decode_attention(q, k_cache, v_cache, kv_lengths=lengths,
                                      block_table=table, num_splits=2)
            return (k_cache, v_cache, lengths), out

        lengths = jnp.full((batch,), start, jnp.int32)
        return lax.scan(step, (k_cache, v_cache, lengths), (q_all, new[:, 1], new[:, 2]))[1]

    outs = sample(k_cache, v_cache)
    for t in range(steps):
        k = k.at[:, start + t].set(new[t, 1])
        v = v.at[:, start + t].set(new[t, 2])
        lengths = jnp.full((batch,), start + t + 1, jnp.int32)
        ref_out, _ = reference(q_all[t], k, v, lengths)
        assert_close(f"step {t}", outs[t], ref_out, tolerance(dtype))


def test_differentiating_raises():
    q = _normal(jax.random.PRNGKey(8), (1, 1, 2, 16), jnp.float32)
    k, v, *_ = make_cache(jax.random.PRNGKey(9), 1, 64, 2, 16, jnp.float32)
    lengths = jnp.array([9], jnp.int32)

    def fn(q):
        return pf.decode_attention(q, k, v, kv_lengths=lengths).sum()

    with pytest.raises(TypeError, match="forward only.*flash_attention"):
        jax.grad(fn)(q)
    with pytest.raises(TypeError, match="forward only"):
        jax.jvp(fn, (q,), (q,))


@pytest.mark.parametrize("batch,kv_heads,max_len,sms,align,want", [
    (1, 8, 131072, 132, 64, 16),     # batch 1: split until one CTA per SM
    (16, 8, 131072, 132, 64, 3),     # 128 programs: two per SM, over three splits
    (4, 8, 131072, 132, 64, 4),      # four splits give every SM one program
    (64, 8, 131072, 132, 64, 1),     # the grid already fills the GPU
    (1, 8, 1024, 132, 64, 4),        # short cache: chunks keep 4 blocks of 64
    (1, 1, 100, 132, 64, 1),         # shorter than 4 blocks: one split
    (1, 1, 10 ** 7, 1000, 64, 256),  # capped
    (4, 2, 8192, 16, 256, 2),        # paged, page 256: one program per SM
    (8, 2, 8192, 16, 256, 2),        # one split would give each SM one: two per SM
    (1, 1, 8192, 132, 256, 8),       # paged, page 256: chunks of >= 4 pages
])
def test_choose_num_splits(batch, kv_heads, max_len, sms, align, want):
    assert decode.choose_num_splits(batch, kv_heads, max_len, sms, align) == want


@pytest.mark.parametrize("max_len,splits,align,want", [
    (200, 3, 64, (2, 128)),  # 67 rounds up to 128: two chunks cover 200
    (256, 4, 64, (4, 64)),
    (100, 1, 64, (1, 128)),
    (1000, 7, 256, (4, 256)),
])
def test_split_geometry(max_len, splits, align, want):
    got = decode.split_geometry(max_len, splits, align)
    assert got == want
    n, chunk = got
    assert chunk % align == 0 and n * chunk >= max_len > (n - 1) * chunk


def _valid():
    q = jnp.zeros((2, 1, 4, 16), jnp.float32)
    cache = jnp.zeros((5, 16, 2, 16), jnp.float32)
    return dict(q=q, k_cache=cache, v_cache=cache, kv_lengths=jnp.zeros((2,), jnp.int32),
                block_table=jnp.zeros((2, 3), jnp.int32))


@pytest.mark.parametrize("change,match", [
    (dict(q=jnp.zeros((2, 4, 16), jnp.float32)), "q must have rank 4"),
    (dict(q=jnp.zeros((2, 17, 4, 16), jnp.float32)), "q_len"),
    (dict(q=jnp.zeros((2, 1, 4, 16), jnp.int32)), "q must be bfloat16"),
    (dict(q=jnp.zeros((2, 1, 3, 16), jnp.float32)), "multiple of the cache's kv heads"),
    (dict(k_cache=jnp.zeros((5, 16, 2, 16), jnp.bfloat16)), "k_cache must have q's dtype"),
    (dict(k_cache=jnp.zeros((5, 16, 2, 8)), v_cache=jnp.zeros((5, 16, 2, 8))), "k_cache head_dim"),
    (dict(v_cache=jnp.zeros((5, 16, 1, 16), jnp.float32)), "v_cache must have k_cache's shape"),
    (dict(k_cache=jnp.zeros((5, 16, 2), jnp.float32)), "k_cache must have rank 4"),
    (dict(v_cache=jnp.zeros((5, 16, 2, 16), jnp.float16)), "v_cache must have q's dtype"),
    (dict(k_cache=jnp.zeros((5, 16, 0, 16)), v_cache=jnp.zeros((5, 16, 0, 16))), ">= 1"),
    (dict(kv_lengths=[0, 0]), "kv_lengths must be an array"),
    (dict(kv_lengths=jnp.zeros((2, 1), jnp.int32)), "kv_lengths must have rank 1"),
    (dict(kv_lengths=jnp.zeros((3,), jnp.int32)), "kv_lengths must have shape"),
    (dict(kv_lengths=jnp.zeros((2,), jnp.float32)), "kv_lengths must have an integer dtype"),
    (dict(block_table=jnp.zeros((3, 3), jnp.int32)), "block_table must have shape"),
    (dict(block_table=jnp.zeros((2, 3), jnp.int16)), "block_table must have dtype int32"),
    (dict(block_table=jnp.zeros((2,), jnp.int32)), "block_table must have rank 2"),
    (dict(k_cache=jnp.zeros((5, 24, 2, 16)), v_cache=jnp.zeros((5, 24, 2, 16))), "page_size"),
    (dict(k_cache=jnp.zeros((5, 8, 2, 16)), v_cache=jnp.zeros((5, 8, 2, 16))), "page_size"),
    (dict(block_table=None), "contiguous cache must have q's batch"),
    (dict(sinks=jnp.zeros((2,), jnp.float32)), "sinks must have shape"),
    (dict(num_splits=0), "num_splits"),
    (dict(num_splits=2.0), "num_splits"),
    (dict(return_lse="yes"), "return_lse"),
    (dict(backend="cuda"), "backend must be one of"),
    (dict(scale=0.0), "scale"),
    (dict(softcap=-1.0), "softcap"),
    (dict(window=(3,)), "window"),
    (dict(interpret="yes"), "interpret"),
])
def test_bad_arguments_raise(change, match):
    # Every case names its argument: the message is matched, not just the exception type.
    args = _valid() | change
    q, k, v = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    with pytest.raises(ValueError, match=match):
        pf.decode_attention(q, k, v, **args)


NUM_PAGES = 6


def _paged_cache():
    """q for 2 sequences of 2 new tokens, and a paged cache of NUM_PAGES pages of 16 keys."""
    q = _normal(jax.random.PRNGKey(20), (2, 2, 4, 16), jnp.float32)
    k, v = (_normal(jax.random.PRNGKey(i), (NUM_PAGES, 16, 2, 16), jnp.float32)
            for i in (21, 22))
    return q, k, v


def _paged_call(table, kv_lengths, **opts):
    """decode_attention on `_paged_cache` with 4 pages a sequence, and the reference's operands
    (pages outside the cache clipped into it: those are the entries no sequence reads)."""
    q, k, v = _paged_cache()
    table = jnp.asarray(table, jnp.int32)
    lengths = jnp.asarray(kv_lengths, jnp.int32)
    run = lambda: pf.decode_attention(q, k, v, kv_lengths=lengths, block_table=table,  # noqa: E731
                                      return_lse=True, **opts)
    pages = jnp.clip(table, 0, NUM_PAGES - 1)
    return run, (q, gather_pages(k, pages), gather_pages(v, pages), lengths)


@pytest.mark.parametrize("table,kv_lengths,opts,where", [
    ([[0, 1, 6, -1], [2, 3, 4, 5]], [40, 64], {}, r"block_table\[0, 2\] = 6"),
    ([[0, 1, 2, 3], [-1, 4, 5, 0]], [33, 20], {}, r"block_table\[1, 0\] = -1"),
    # The window's keys start at 50 - 2 - 10 = 38, in page 2: page 1 is not read, page 2 is.
    ([[0, -1, 9, 3], [1, 2, 4, 5]], [50, 64], {"window": (10, 0)}, r"block_table\[0, 2\] = 9"),
])
def test_page_outside_the_cache_raises(table, kv_lengths, opts, where):
    run, _ = _paged_call(table, kv_lengths, **opts)
    with pytest.raises(ValueError, match=where + r" is not a page of the cache"):
        run()


@pytest.mark.parametrize("table,kv_lengths,opts", [
    # Entries past a sequence's length, and before its window, hold sentinels: never read.
    ([[3, 0, -1, 99], [5, 4, 2, 1]], [20, 64], {}),
    ([[-1, -1, 2, 3], [0, 1, 4, 5]], [60, 17], {"window": (12, 0)}),
])
def test_pages_not_read_may_hold_anything(table, kv_lengths, opts):
    run, (q, k, v, lengths) = _paged_call(table, kv_lengths, **opts)
    out, lse = run()
    ref_out, ref_lse = reference(q, k, v, lengths, **opts)
    check(out, lse, ref_out, ref_lse, jnp.float32)


def test_traced_block_table_is_not_read_on_the_host():
    # Under jit the table's values are unknown when the call is staged: the check stands aside.
    q, k_cache, v_cache = _paged_cache()
    table = jnp.asarray([[5, 1, 2, 3], [4, 0, 3, 1]], jnp.int32)
    lengths = jnp.asarray([57, 30], jnp.int32)
    step = jax.jit(lambda t, n: pf.decode_attention(q, k_cache, v_cache, kv_lengths=n,
                                                    block_table=t, return_lse=True))
    out, lse = step(table, lengths)
    ref_out, ref_lse = reference(q, gather_pages(k_cache, table), gather_pages(v_cache, table),
                                 lengths)
    check(out, lse, ref_out, ref_lse, jnp.float32)


def test_auto_runs_triton_in_interpret_mode(monkeypatch):
    chosen = []
    monkeypatch.setattr(decode, "_backend_module",
                        lambda name: chosen.append(name) or decode.triton_decode)
    decode._decode_fn.cache_clear()
    q = _normal(jax.random.PRNGKey(10), (1, 1, 2, 16), jnp.float32)
    k, v, *_ = make_cache(jax.random.PRNGKey(11), 1, 64, 2, 16, jnp.float32)
    pf.decode_attention(q, k, v, kv_lengths=jnp.array([5], jnp.int32), num_splits=1,
                        interpret=True)
    decode._decode_fn.cache_clear()
    assert chosen == ["triton"]


@NEEDS_HOPPER
@pytest.mark.parametrize("page_size", [None, 64], ids=["contiguous", "paged"])
@pytest.mark.parametrize("q_len,q_heads", [(1, 8), (4, 16)])
def test_mosaic_matches_reference(page_size, q_len, q_heads):
    if decode._mosaic_module() is None:
        pytest.skip("no Mosaic decode kernel")
    dtype, batch, kv_heads, d, max_len = jnp.bfloat16, 2, 2, 128, 1024
    kq, kc = jax.random.split(jax.random.PRNGKey(12))
    q = _normal(kq, (batch, q_len, q_heads, d), dtype)
    k_cache, v_cache, table, k, v = make_cache(kc, batch, max_len, kv_heads, d, dtype, page_size)
    lengths = jnp.array([1000, 131], jnp.int32)
    out, lse = run_backend("mosaic", q, k_cache, v_cache, kv_lengths=lengths,
                           block_table=table, return_lse=True)
    check(out, lse, *reference(q, k, v, lengths), dtype)


@pytest.mark.skipif(IS_HOPPER, reason="on sm_90 the Mosaic kernel can run")
def test_forced_mosaic_off_hopper_raises():
    q = jnp.zeros((1, 1, 2, 64), jnp.bfloat16)
    cache = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="backend='mosaic'"):
        pf.decode_attention(q, cache, cache, kv_lengths=jnp.array([3], jnp.int32),
                            backend="mosaic", interpret=False)


@pytest.mark.parametrize("lengths,options,bad,ignored", [
    # A read page of sequence 1 past the cache, with four splits (the combine merges the NaN
    # split); sequence 0's entries past its length (200 keys: pages 0 to 12) hold ids outside
    # the cache too, and are not read.
    ([200, 77, 130], dict(num_splits=4), [(1, 2, "past")], [(0, 13, "past"), (0, 15, "minus")]),
    # A negative id in the last page of sequence 2 (130 keys: its ninth page holds key 128),
    # one split (no combine); sequence 1 (77 keys) does not read its pages 5 and 9.
    ([200, 77, 130], dict(num_splits=1), [(2, 8, "minus")], [(1, 5, "minus"), (1, 9, "past")]),
    # A window of 40: sequence 0's keys start at 200 - 2 - 40 = 158, in page 9. Its pages 0 to
    # 8 are not read, page 8 sharing a 64-key block with page 9; sequence 2 reads page 5
    # (keys 80 to 95, its window starting at 88), not page 4 in the same block.
    ([200, 77, 130], dict(num_splits=4, window=(40, 0)), [(2, 5, "past")],
     [(0, 8, "minus"), (0, 3, "past"), (2, 4, "minus")]),
])
def test_traced_page_outside_the_cache_gives_nan(lengths, options, bad, ignored):
    """Under jit the table is not checked before the call: a page a sequence reads that is not
    a page of the cache makes that sequence's O and lse NaN (never an answer from other
    memory); entries a sequence does not read are ignored, and other sequences are exact.
    float32 goes to the Triton kernel under "auto" (interpret mode on the CPU)."""
    batch, q_len, q_heads, kv_heads, d, max_len, page = 3, 2, 4, 2, 16, 256, 16
    dtype = jnp.float32
    kq, kc = jax.random.split(jax.random.PRNGKey(30))
    q = _normal(kq, (batch, q_len, q_heads, d), dtype)
    cache = make_cache(kc, batch, max_len, kv_heads, d, dtype, page)
    check_traced_bad_pages(q, cache, lengths, options, bad, ignored)


def test_wide_lengths_are_clipped_not_wrapped(x64):
    """kv_lengths past max_len are clipped to it, also in a dtype wider than int32, whose
    values would wrap to small lengths if cast first."""
    q = jax.random.normal(jax.random.PRNGKey(91), (1, 1, 2, 16), jnp.float32)
    cache = jax.random.normal(jax.random.PRNGKey(92), (1, 32, 2, 16), jnp.float32)
    run = lambda n: pf.decode_attention(q, cache, cache, kv_lengths=n, interpret=True)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(run(jnp.array([2**32 + 4], jnp.int64))),
                                  np.asarray(run(jnp.array([32], jnp.int32))))


def combine_plan(batch, q_len, q_heads, kv_heads, head_dim, num_splits, interpret):
    """A DecodePlan for the combine alone (its other fields are never read there)."""
    group = q_heads // kv_heads
    return decode.DecodePlan(
        batch=batch, q_len=q_len, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
        group=group, rows=q_len * group, max_len=num_splits * 64, pages_per_seq=None,
        page_size=None, num_splits=num_splits, chunk=64, scale=head_dim ** -0.5, softcap=None,
        window_left=None, dtype=jnp.dtype(jnp.bfloat16), interpret=interpret)


@pytest.mark.parametrize("d_major", [False, True], ids=["row-major", "d-major"])
@pytest.mark.parametrize("batch,q_len,q_heads,kv_heads,head_dim,num_splits", [
    (2, 3, 16, 2, 80, 5),     # GQA 8, three tokens, head_dim short of its power of two
    (1, 2, 12, 2, 64, 21),    # GQA 6 (not a power of two), two rounds of splits
    (1, 4, 64, 1, 128, 16),   # MQA: 64 columns a token, fewer splits a round
    (2, 5, 4, 4, 32, 3),      # MHA: one column a token
])
def test_combine_merges_partials_exactly(d_major, batch, q_len, q_heads, kv_heads, head_dim,
                                         num_splits):
    # The combine alone, on random partials: empty splits (lse -inf, O 0) here and there, one
    # row empty in every split, and NaN in the d-major padding columns past the packed rows,
    # which it must never read. Against the merge written out in float64 numpy.
    from pallas_flash.mosaic.decode import keys_n
    from pallas_flash.triton import decode as triton_decode
    plan = combine_plan(batch, q_len, q_heads, kv_heads, head_dim, num_splits, not ON_GPU)
    rows, splits = plan.rows, num_splits
    ko, kl, ke = jax.random.split(jax.random.key(7), 3)
    o = jax.random.normal(ko, (batch, kv_heads, splits, rows, head_dim), jnp.float32)
    lse = 4.0 * jax.random.normal(kl, (batch, kv_heads, splits, rows), jnp.float32)
    empty = jax.random.bernoulli(ke, 0.3, lse.shape).at[0, 0, :, rows - 1].set(True)
    lse = jnp.where(empty, -jnp.inf, lse)
    o = jnp.where(empty[..., None], 0.0, o)
    if d_major:
        n = keys_n(rows) + 8   # wider than the rows, as the keys-as-M kernel's n can be
        o_in = jnp.full((batch, kv_heads, splits, head_dim, n), jnp.nan, jnp.float32)
        o_in = o_in.at[..., :rows].set(jnp.swapaxes(o, -1, -2))
        lse_in = jnp.full((batch, kv_heads, splits, n), jnp.nan, jnp.float32)
        lse_in = lse_in.at[..., :rows].set(lse)
    else:
        o_in, lse_in = o, lse
    out, out_lse = triton_decode.combine(plan, o_in, lse_in, jnp.float32, d_major=d_major)
    out, out_lse = jax.block_until_ready((out, out_lse))

    o64, lse64 = np.asarray(o, np.float64), np.asarray(lse, np.float64)
    with np.errstate(invalid="ignore"):
        want_lse = np.logaddexp.reduce(lse64, axis=2)          # [batch, kv_heads, rows]
        weights = np.nan_to_num(np.exp(lse64 - want_lse[:, :, None]))
    want = np.einsum("bhsr,bhsrd->bhrd", weights, o64)
    # Packed row t * group + j of kv head h is query head h * group + j of token t.
    want = want.reshape(batch, kv_heads, q_len, plan.group, head_dim)
    want = want.transpose(0, 2, 1, 3, 4).reshape(batch, q_len, q_heads, head_dim)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out_lse), want_lse, rtol=1e-5, atol=1e-5)
    assert np.isneginf(np.asarray(out_lse)[0, 0, rows - 1])
    assert not np.isnan(np.asarray(out)).any()
