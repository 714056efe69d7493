"""The Mosaic GPU decode kernel (pallas_flash/mosaic/decode.py) through decode_attention.

Compiled on an sm_90 GPU: contiguous and paged caches (random block tables whose entries past
each sequence point at a NaN page, which must never be read), lengths that are not page or
block multiples, empty sequences and tokens at negative positions, q_len 1 to 16, GQA 1 to 8,
bf16 / f16, head_dim 48 / 64 / 96 / 128 / 192 / 224 / 256, softcap, window, sinks; the same
cases with NaN and inf at every cache position no query sees. On any machine: the Python half
of the sm_90 compile, small cases in interpret mode, the tiles and what the kernel refuses.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from backends import IS_HOPPER, ON_GPU
from helpers import kernel_names
from pallas_flash import decode
from pallas_flash.mosaic import decode as mosaic
from pallas_flash.mosaic.config import SMEM_LIMIT
from test_decode import _normal, check, check_traced_bad_pages, make_cache, reference

compiled_only = pytest.mark.skipif(not IS_HOPPER, reason="the Mosaic GPU kernels run compiled "
                                   "on sm_90 (on the CPU: the lowering and interpret tests)")


def _poison_table(table, lengths, page_size, num_pages):
    """Entries past each sequence's last page pointed at a physical page no sequence uses
    (make_cache fills those with NaN): the kernel may not read them."""
    unused = sorted(set(range(num_pages)) - set(np.asarray(table).ravel().tolist()))
    table = np.array(table)
    for b, n in enumerate(lengths):
        table[b, -(-n // page_size):] = unused[0]
    return jnp.asarray(table)


def _poison_unseen(cache, table, lengths, q_len, window_left):
    """NaN, inf and -inf at every cache position no query sees: past each sequence's length
    (the rest of its last page or block, and further) and before its first query's window.
    A recycled cache holds anything there; the output may not depend on it."""
    cache = np.array(cache)
    values = np.array([np.nan, np.inf, -np.inf], np.float32)
    span = cache.shape[1] if table is None else table.shape[1] * cache.shape[1]
    for b, n in enumerate(lengths):
        pos = np.arange(span)
        unseen = pos >= n
        if window_left is not None:
            unseen |= pos < n - q_len - window_left
        pos = pos[unseen]
        fill = values[pos % 3][:, None, None].astype(cache.dtype)
        if table is None:
            cache[b, pos] = fill
        else:
            page_size = cache.shape[1]
            cache[np.asarray(table)[b, pos // page_size], pos % page_size] = fill
    return jnp.asarray(cache)


def _run(dtype, batch, q_len, q_heads, kv_heads, head_dim, max_len, page_size, lengths,
         options, interpret=None, poison=False):
    key = jax.random.PRNGKey(sum(lengths) + 7 * q_len + head_dim)
    kq, kc, ks = jax.random.split(key, 3)
    q = _normal(kq, (batch, q_len, q_heads, head_dim), dtype)
    k_cache, v_cache, table, k, v = make_cache(kc, batch, max_len, kv_heads, head_dim, dtype,
                                               page_size)
    if table is not None:
        table = _poison_table(table, lengths, page_size, k_cache.shape[0])
    if poison:
        # The reference below reads the clean k and v.
        window_left = options.get("window", (None,))[0]
        k_cache, v_cache = (_poison_unseen(c, table, lengths, q_len, window_left)
                            for c in (k_cache, v_cache))
    kv_lengths = jnp.array(lengths, jnp.int32)
    options = dict(options)
    if options.pop("sinks", False):
        options["sinks"] = 2.0 * jax.random.normal(ks, (q_heads,), jnp.float32)
    # Waited for before the reference is dispatched: an operation queued while an interpreted
    # Mosaic kernel still runs can deadlock with its callbacks (tests/helpers.py).
    out, lse = jax.block_until_ready(pf.decode_attention(
        q, k_cache, v_cache, kv_lengths=kv_lengths, block_table=table, return_lse=True,
        backend="mosaic", interpret=interpret, **options))
    options.pop("num_splits", None)
    check(out, lse, *reference(q, k, v, kv_lengths, **options), dtype)


CASES = [
    # (dtype, batch, q_len, q_heads, kv_heads, head_dim, max_len, page_size, lengths, options)
    pytest.param(jnp.bfloat16, 2, 1, 8, 2, 128, 1000, None, [1000, 131], dict(),
                 id="bf16-contiguous-gqa4-q1-max-len-past-last-block"),
    pytest.param(jnp.float16, 3, 4, 16, 2, 128, 2048, 16, [2048, 777, 5], dict(sinks=True),
                 id="f16-paged16-gqa8-q4-sinks"),
    pytest.param(jnp.bfloat16, 2, 4, 8, 2, 64, 1536, 256, [1500, 300], dict(softcap=20.0),
                 id="bf16-paged256-gqa4-q4-d64-softcap"),
    pytest.param(jnp.bfloat16, 2, 1, 32, 8, 128, 4096, 64, [4096, 2500],
                 dict(window=(300, 0), num_splits=5), id="bf16-paged64-gqa4-window"),
    pytest.param(jnp.bfloat16, 1, 16, 16, 2, 128, 1024, None, [1000],
                 dict(window=(100, None), softcap=30.0), id="bf16-q16-gqa8-two-warpgroups"),
    pytest.param(jnp.float16, 2, 4, 8, 1, 256, 768, 32, [700, 3], dict(),
                 id="f16-paged32-d256-negative-positions"),
    pytest.param(jnp.bfloat16, 1, 16, 8, 1, 256, 512, None, [512], dict(),
                 id="bf16-d256-two-row-tiles"),
    pytest.param(jnp.bfloat16, 2, 1, 4, 4, 64, 8192, 128, [8192, 0], dict(),
                 id="bf16-paged128-mha-empty-sequence"),
    pytest.param(jnp.bfloat16, 2, 4, 8, 2, 48, 1024, 32, [1000, 333], dict(window=(200, 0)),
                 id="bf16-paged32-d48-window"),
    pytest.param(jnp.bfloat16, 2, 4, 8, 2, 96, 1024, 32, [1000, 333], dict(window=(200, 0)),
                 id="bf16-paged32-d96-window"),
    pytest.param(jnp.float16, 1, 1, 4, 1, 224, 512, None, [300], dict(),
                 id="f16-d224-seven-o-pieces"),
    pytest.param(jnp.float16, 1, 16, 16, 2, 192, 768, None, [700], dict(softcap=25.0),
                 id="f16-d192-two-row-tiles-softcap"),
    pytest.param(jnp.float16, 2, 2, 8, 1, 128, 640, None, [640, 2], dict(num_splits=3),
                 id="f16-contiguous-mqa-q2-length-q-len"),
    # One split: the keys-as-M kernel's d-major O is transposed back without the combine.
    pytest.param(jnp.bfloat16, 2, 1, 32, 8, 128, 512, None, [512, 70], dict(num_splits=1),
                 id="bf16-contiguous-gqa4-one-split"),
    pytest.param(jnp.bfloat16, 2, 1, 8, 2, 192, 768, 64, [700, 65], dict(),
                 id="bf16-paged64-d192-keys-as-m"),
]


@compiled_only
@pytest.mark.parametrize("dtype,batch,q_len,q_heads,kv_heads,head_dim,max_len,page_size,"
                         "lengths,options", CASES)
def test_matches_reference(dtype, batch, q_len, q_heads, kv_heads, head_dim, max_len, page_size,
                           lengths, options):
    _run(dtype, batch, q_len, q_heads, kv_heads, head_dim, max_len, page_size, lengths, options)


@compiled_only
@pytest.mark.parametrize("dtype,batch,q_len,q_heads,kv_heads,head_dim,max_len,page_size,"
                         "lengths,options", CASES)
def test_unseen_non_finite_values_are_confined(dtype, batch, q_len, q_heads, kv_heads, head_dim,
                                               max_len, page_size, lengths, options):
    # NaN and inf in K and V wherever no query looks, read in the blocks at kv_length and at
    # the window: the output matches the reference on the clean cache.
    _run(dtype, batch, q_len, q_heads, kv_heads, head_dim, max_len, page_size, lengths, options,
         poison=True)


@pytest.mark.skipif(ON_GPU, reason="the interpret-mode check is for machines without a GPU")
# The interpreter's Q K^T (numpy) meets the NaN keys, which the mask then drops.
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
@pytest.mark.parametrize("head_dim,num_splits,q_len,q_heads,kv_heads", [
    (64, 2, 2, 4, 1), (64, 1, 2, 4, 1), (96, 2, 2, 4, 1),
    # GQA 8 and 16: the queries are read unpacked, one copy a token (reads_queries_unpacked).
    (64, 2, 3, 16, 2), (64, 1, 2, 32, 2),
])
def test_interpret_mode_matches_reference(head_dim, num_splits, q_len, q_heads, kv_heads):
    # Pages of 16 keys, four to a 64-key block; a window; a token at a negative position; NaN
    # and inf in K and V at every position no query sees (past each length, before the
    # window), which may not reach the output. At 64 the keys are the wgmma M axis (its d-major
    # partials go through the combine, or are transposed back with one split); at 96 the rows
    # are, and O leaves in three 32-column pieces.
    _run(jnp.bfloat16, 2, q_len, q_heads, kv_heads, head_dim, 192, 16, [150, 1],
         dict(window=(40, 0), num_splits=num_splits), interpret=True, poison=True)


def _plan(**changes):
    base = dict(batch=2, q_len=1, q_heads=8, kv_heads=2, head_dim=128, group=4, rows=4,
                max_len=1024, pages_per_seq=None, page_size=None, num_splits=4, chunk=256,
                scale=128 ** -0.5, softcap=None, window_left=None, dtype=jnp.dtype(jnp.bfloat16),
                interpret=False)
    return decode.DecodePlan(**(base | changes))


def _lowers(plan):
    b, h, d = plan.batch, plan.kv_heads, plan.head_dim
    q = decode.backend_queries(mosaic, plan, jnp.zeros((b, plan.q_len, plan.q_heads, d),
                                                       plan.dtype))
    if plan.paged:
        cache = jnp.zeros((b * plan.pages_per_seq, plan.page_size, h, d), plan.dtype)
        table = jnp.zeros((b, plan.pages_per_seq), jnp.int32)
    else:
        cache, table = jnp.zeros((b, plan.max_len, h, d), plan.dtype), None
    fn = jax.jit(lambda q, k, v, n, t: mosaic.partial(plan, q, k, v, n, t))
    lengths = jnp.zeros((b,), jnp.int32)
    text = fn.trace(q, cache, cache, lengths, table).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    return text


@pytest.mark.skipif(ON_GPU and not IS_HOPPER, reason="Mosaic GPU kernel needs sm_90")
@pytest.mark.parametrize("changes", [
    dict(),
    dict(page_size=16, pages_per_seq=64, softcap=30.0, window_left=100),
    dict(head_dim=64, page_size=256, pages_per_seq=4, q_len=16, rows=64),
    dict(q_len=16, rows=128, group=8, q_heads=16, dtype=jnp.dtype(jnp.float16)),
    dict(head_dim=256, q_len=16, rows=128, group=8, q_heads=16),
    dict(head_dim=48, page_size=32, pages_per_seq=32),
    dict(head_dim=192, q_len=16, rows=128, group=8, q_heads=16),
    dict(head_dim=96, page_size=32, pages_per_seq=32),
    dict(head_dim=160, q_len=16, rows=128, group=8, q_heads=16),
    dict(head_dim=224),
], ids=["contiguous", "paged16-softcap-window", "paged256-d64", "two-warpgroups-f16",
        "d256-two-row-tiles", "paged32-d48", "d192-two-row-tiles", "paged32-d96",
        "d160-two-row-tiles", "d224"])
def test_lowers_for_sm90(changes):
    _lowers(_plan(**changes))


def test_kernel_is_named():
    plan = _plan()
    q = jnp.zeros((2, 2, 4, 128), jnp.bfloat16)
    cache = jnp.zeros((2, 1024, 2, 128), jnp.bfloat16)
    fn = lambda q, k: mosaic.partial(plan, q, k, k, jnp.zeros((2,), jnp.int32), None)  # noqa: E731
    assert kernel_names(fn, q, cache) == {mosaic.KERNEL_NAME}


@pytest.mark.parametrize("head_dim", mosaic.DECODE_HEAD_DIMS)
@pytest.mark.parametrize("rows", [1, 4, 64, 65, 128, 256])
@pytest.mark.parametrize("page_size", [None, 16, 256])
def test_default_tiles_fit(head_dim, rows, page_size):
    plan = _plan(head_dim=head_dim, rows=rows, page_size=page_size,
                 pages_per_seq=None if page_size is None else 1024 // page_size,
                 chunk=256 if page_size is None else max(256, page_size))
    tiles = mosaic.default_tiles(plan)
    assert tiles.smem_bytes(head_dim) <= SMEM_LIMIT
    assert plan.chunk % tiles.block_kv == 0
    # The page flags share the lse buffer's 1 KB allocation, which smem_bytes does not count.
    lse_rows, lse_width = mosaic.lse_buffer_shape(plan, tiles)
    assert lse_rows * lse_width * 4 <= 1024
    assert mosaic.unsupported_reason(plan) is None
    # Keys as the wgmma M axis where the rows fit one N tile and O^T's rows (head_dim) are whole
    # 64-row M tiles, and the shared memory allows (not at 256); the partials' layout follows.
    assert tiles.keys_as_m == (rows <= 64 and head_dim in (64, 128, 192))
    assert mosaic.d_major(plan) == tiles.keys_as_m


@pytest.mark.parametrize("changes,match", [
    (dict(dtype=jnp.dtype(jnp.float32)), "dtype float32"),
    (dict(head_dim=72), "head_dim 72"),
    (dict(head_dim=80), "head_dim 80"),   # a training head dim, not whole 32-element groups
    (dict(max_len=1003, chunk=1024, num_splits=1), "max_len 1003 is not a multiple of 8"),
])
def test_unsupported_reason(changes, match):
    assert match in mosaic.unsupported_reason(_plan(**changes))


@pytest.mark.parametrize("head_dim,backend", [(80, "triton"), (112, "triton"), (96, "mosaic"),
                                              (160, "mosaic")])
def test_auto_sends_other_head_dims_to_triton_on_hopper(monkeypatch, head_dim, backend):
    # A head dim the training kernels take but this kernel does not still decodes, on Triton.
    monkeypatch.setattr(decode.attention, "_is_sm90", lambda: True)
    assert decode._choose_backend("auto", _plan(head_dim=head_dim)) == backend


@pytest.mark.parametrize("batch,kv_heads,num_splits,backend", [
    (1, 8, 16, "mosaic"),    # 128 programs: one wave on 132 SMs
    (4, 8, 4, "mosaic"),
    (1, 8, 17, "triton"),    # 136 programs: a second, nearly empty wave
    (16, 8, 3, "triton"),
    (64, 8, 1, "triton"),
])
def test_auto_takes_mosaic_only_for_one_wave(monkeypatch, batch, kv_heads, num_splits, backend):
    monkeypatch.setattr(decode.attention, "_is_sm90", lambda: True)
    monkeypatch.setattr(decode, "device_sms", lambda: 132)
    plan = _plan(batch=batch, kv_heads=kv_heads, q_heads=4 * kv_heads, num_splits=num_splits,
                 max_len=256 * num_splits)
    assert decode._choose_backend("auto", plan) == backend
    # An explicit backend is never overridden.
    assert decode._choose_backend("mosaic", plan) == "mosaic"


@pytest.mark.skipif(ON_GPU and not IS_HOPPER, reason="Mosaic GPU kernel needs sm_90")
@pytest.mark.parametrize("q_len,group,head_dim,padded", [
    (1, 4, 128, False), (1, 8, 128, False), (2, 8, 64, False), (4, 8, 128, False),
    (3, 4, 32, True), (3, 4, 128, True), (5, 4, 128, True),
])
def test_q_is_read_in_place(q_len, group, head_dim, padded):
    # The TMA zero-fills a 64-row piece past the packed rows, so no padding pass (one more
    # kernel launch per decoding step) comes before the kernel, except to whole 8-row tiles
    # where there are more than 8 rows (a 12-row Q fails to lower unpadded).
    plan = _plan(q_len=q_len, group=group, rows=q_len * group, q_heads=2 * group,
                 head_dim=head_dim, scale=head_dim ** -0.5)
    assert ("stablehlo.pad" in _lowers(plan)) == padded


def test_tiles_over_shared_memory_are_refused():
    plan = _plan(head_dim=256)
    tiles = mosaic.DecodeTiles(block_kv=64, stages=8, compute_wgs=2)
    assert "shared memory" in mosaic.unsupported_reason(plan, tiles)
    with pytest.raises(NotImplementedError, match="shared memory"):
        mosaic.partial(plan, None, None, None, None, None, tiles=tiles)


@pytest.mark.parametrize("fields,match", [
    (dict(block_kv=96), "block_kv"), (dict(stages=1), "stages"), (dict(compute_wgs=3), "wgs"),
])
def test_tiles_validate(fields, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(mosaic.DecodeTiles(64, 2, 1), **fields)


@pytest.mark.skipif(ON_GPU and not IS_HOPPER, reason="Mosaic GPU kernel needs sm_90")
@pytest.mark.parametrize("head_dim,page_size,lengths,options,bad,ignored", [
    # Keys as the wgmma M axis, 128-key blocks of eight 16-key pages, a window of 40 and two
    # splits. Sequence 0's keys start at 230 - 2 - 40 = 188 (page 11): page 9 shares a block
    # with it and is not read, nor is page 15 (past its length). Sequence 1 (keys from 108)
    # reads page 8, in its second split (the combine merges the NaN split), and not page 5.
    (64, 16, [230, 150], dict(window=(40, 0), num_splits=2), [(1, 8, "past")],
     [(0, 9, "minus"), (0, 15, "past"), (1, 5, "minus")]),
    # Rows as the wgmma M axis, a 64-key page per 64-key block: a negative id in a page of
    # sequence 0; sequence 1 (97 keys) does not read its pages 2 and 3.
    (96, 64, [200, 97], dict(num_splits=2), [(0, 1, "minus")], [(1, 2, "past"), (1, 3, "minus")]),
    # Rows as M, four 16-key pages a block, one split, a window: sequence 0's keys start at
    # 160 - 2 - 40 = 118 (page 7), whose block holds pages 4 to 6, not read.
    (96, 16, [160, 45], dict(window=(40, 0), num_splits=1), [(1, 2, "past")],
     [(0, 5, "minus"), (0, 10, "past"), (1, 3, "minus")]),
])
def test_traced_page_outside_the_cache_gives_nan(head_dim, page_size, lengths, options, bad,
                                                 ignored):
    # Under jit the table is not checked before the call: the copy warpgroup copies page 0 in
    # place of an id outside the cache and flags the slot, and the sequence's O and lse come
    # out NaN. Entries the sequence does not read are ignored; the other sequence is exact.
    # Compiled on sm_90, else in interpret mode.
    dtype, batch, q_len, q_heads, kv_heads, max_len = jnp.bfloat16, 2, 2, 4, 1, 256
    kq, kc = jax.random.split(jax.random.PRNGKey(head_dim + page_size))
    q = _normal(kq, (batch, q_len, q_heads, head_dim), dtype)
    cache = make_cache(kc, batch, max_len, kv_heads, head_dim, dtype, page_size)
    check_traced_bad_pages(q, cache, lengths, options, bad, ignored, backend="mosaic",
                           interpret=None if IS_HOPPER else True)


@pytest.mark.parametrize("q_len,q_heads,kv_heads,head_dim,unpacked", [
    (4, 64, 8, 128, True), (2, 128, 8, 128, True), (1, 64, 8, 128, True),
    (4, 32, 8, 128, False), (4, 64, 8, 96, False), (9, 64, 8, 128, False),
])
def test_queries_reach_the_kernel_unpacked(q_len, q_heads, kv_heads, head_dim, unpacked):
    # Keys as M with a group of 8 or 16: no transpose packs the queries before the kernel.
    # Elsewhere (GQA 4; rows as M at head_dim 96, or past 64 packed rows) they are packed, a
    # transpose where q_len > 1.
    # Only the program's structure is checked: shapes, no values.
    q = jax.ShapeDtypeStruct((1, q_len, q_heads, head_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 256, kv_heads, head_dim), jnp.bfloat16)
    lengths = jnp.full((1,), 256)
    plan = decode._validate(q, k, k, lengths, None, scale=None, softcap=None, window=None,
                            sinks=None, return_lse=False, num_splits=2, backend="mosaic",
                            interpret=True)[0]
    assert mosaic.reads_queries_unpacked(plan) == unpacked
    jaxpr = jax.make_jaxpr(lambda q, k: pf.decode_attention(
        q, k, k, kv_lengths=lengths, num_splits=2, backend="mosaic", interpret=True))(q, k)
    # A bf16 transpose is the queries' packing (the lse's unpacking is float32, and XLA drops it
    # without return_lse).
    assert _transposes(jaxpr.jaxpr, q.dtype) == (not unpacked and q_len > 1)


def _transposes(jaxpr, dtype) -> bool:
    """Whether jaxpr transposes an array of `dtype` outside the kernels (Triton's pallas_call,
    Mosaic GPU's mpmd_map)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "transpose" and eqn.outvars[0].aval.dtype == dtype:
            return True
        if eqn.primitive.name in ("pallas_call", "mpmd_map"):
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                if hasattr(sub, "eqns") and _transposes(sub, dtype):
                    return True
    return False
