"""Ring attention (pallas_flash/ring.py) on a mesh of host devices: the zig-zag layout, the
checks, and the ring against single-device attention.

conftest.py forces four CPU devices, so these run anywhere (interpret mode on the CPU); on a
machine with fewer devices the multi-device tests skip (`make_mesh`), and on one GPU the
one-device ring and every call of a multi-device plan run compiled. Each
case compiles forward and backward in one jit and compares O, lse, dq, dk and dv, under random
cotangents for both outputs, with single-device `flash_attention` and with
`reference_attention`, and counts the kernel calls each ring position runs. Shapes are tiny:
compiling the interpreted kernels dominates the time.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import pallas_flash as pf
from helpers import (ON_GPU, assert_close, compare_results, make_mesh,
                     outputs_and_grads, random_inputs, single_device, tolerance)
from pallas_flash import attention, ring, ring_plan, ring_steps
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import forward as mosaic_forward
from pallas_flash.sharding import ID_OPTIONS
from pallas_flash.stats import to_lse as stats_to_lse

F32 = jnp.float32


def _dlse(key, q):
    return jax.random.normal(key, (q.shape[0], q.shape[2], q.shape[1]), F32)


def test_zigzag_order_and_round_trip():
    tokens = jnp.arange(8)
    # Two devices, four chunks of two: device 0 holds chunks 0 and 3, device 1 chunks 1 and 2.
    np.testing.assert_array_equal(pf.zigzag_permute(tokens, 2, axis=0),
                                  [0, 1, 6, 7, 2, 3, 4, 5])
    x = np.random.default_rng(0).normal(size=(2, 24, 3)).astype(np.float32)
    for devices, axis in ((1, 1), (3, -2), (4, 1)):
        permuted = pf.zigzag_permute(x, devices, axis=axis)
        assert devices == 1 or not np.array_equal(permuted, x)
        np.testing.assert_array_equal(pf.zigzag_unpermute(permuted, devices, axis=axis), x)
    # Device i's shard of the permuted positions is chunks i and 2P-1-i.
    positions = pf.zigzag_permute(jnp.arange(32), 4, axis=0).reshape(4, 8)
    for i in range(4):
        np.testing.assert_array_equal(positions[i, :4], np.arange(4 * i, 4 * i + 4))
        np.testing.assert_array_equal(positions[i, 4:], np.arange(4 * (7 - i), 4 * (7 - i) + 4))
    with pytest.raises(ValueError, match="divisible by 2 \\* num_devices"):
        pf.zigzag_permute(jnp.arange(10), 2, axis=0)


def test_ring_errors():
    mesh = make_mesh((2,), ("x",))
    q = jax.ShapeDtypeStruct((2, 32, 4, 16), F32)
    k = v = jax.ShapeDtypeStruct((2, 32, 1, 16), F32)
    short = jax.ShapeDtypeStruct((2, 16, 1, 16), F32)
    with pytest.raises(ValueError, match="used twice"):
        pf.ring_attention(q, k, v, mesh=mesh, axis_name="x", batch_axis="x")
    with pytest.raises(ValueError, match="layout must be one of"):
        pf.ring_attention(q, k, v, mesh=mesh, axis_name="x", layout="striped")
    with pytest.raises(ValueError, match="divisible by 4 for the zigzag layout"):
        cut = [jax.ShapeDtypeStruct((2, 30, *x.shape[2:]), F32) for x in (q, k, v)]
        pf.ring_attention(*cut, mesh=mesh, axis_name="x", layout="zigzag")
    with pytest.raises(ValueError, match="self-attention"):
        pf.ring_attention(q, short, short, mesh=mesh, axis_name="x")
    # The local entry outside a shard_map over its axis: a ValueError naming axis_name, not
    # JAX's NameError from deep inside.
    with pytest.raises(ValueError, match="axis_name 'x' is not a mesh axis of this shard_map"):
        pf.ring_attention_local(q, k, v, axis_name="x")


def test_ring_segment_id_errors(monkeypatch):
    """Bad segment ids or lengths raise a ValueError naming the argument, on both entries,
    before any kernel is traced."""
    mesh = make_mesh((2,), ("x",))

    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel was traced before the arguments were checked")

    monkeypatch.setattr(ring_steps, "_kernel_forward", no_kernel)
    monkeypatch.setattr(ring_steps, "_kernel_backward", no_kernel)
    _fresh_traces(monkeypatch)
    q = jax.ShapeDtypeStruct((2, 32, 4, 16), F32)
    k = v = jax.ShapeDtypeStruct((2, 32, 2, 16), F32)
    ids = jax.ShapeDtypeStruct((2, 32), jnp.int32)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
    cases = [
        (dict(q_segment_ids=ids), "q_segment_ids and kv_segment_ids must be given together"),
        (dict(kv_segment_ids=ids), "q_segment_ids and kv_segment_ids must be given together"),
        # The per-device shard's shape, given to the global entry.
        (dict(q_segment_ids=jax.ShapeDtypeStruct((2, 16), jnp.int32), kv_segment_ids=ids),
         "q_segment_ids must have shape \\[batch, seq\\] = \\(2, 32\\), got \\(2, 16\\)"),
        (dict(q_segment_ids=ids, kv_segment_ids=jax.ShapeDtypeStruct((2, 32), F32)),
         "kv_segment_ids must have an integer dtype, got float32"),
        (dict(q_segment_ids=[[0] * 32] * 2, kv_segment_ids=ids),
         "q_segment_ids must be an array, got list"),
        (dict(q_lengths=ids), "q_lengths must have shape \\[batch\\] = \\(2,\\)"),
        (dict(kv_lengths=jax.ShapeDtypeStruct((2,), F32)),
         "kv_lengths must have an integer dtype"),
    ]
    for options, message in cases:
        for layout in ("contiguous", "zigzag"):
            with pytest.raises(ValueError, match=message):
                pf.ring_attention(q, k, v, mesh=mesh, axis_name="x", layout=layout, **options)
    # The local entry checks against the local shard: [batch, seq / P] ids, [batch] lengths.
    q_local = jax.ShapeDtypeStruct((2, 16, 4, 16), F32)
    kv_local = jax.ShapeDtypeStruct((2, 16, 2, 16), F32)
    with pytest.raises(ValueError, match="kv_segment_ids must have shape .* = \\(2, 16\\), "
                                         "got \\(2, 32\\)"):
        pf.ring_attention_local(q_local, kv_local, kv_local, axis_name="x",
                                q_segment_ids=jax.ShapeDtypeStruct((2, 16), jnp.int32),
                                kv_segment_ids=ids)
    with pytest.raises(ValueError, match="must be given together"):
        pf.ring_attention_local(q_local, kv_local, kv_local, axis_name="x", kv_segment_ids=ids)
    with pytest.raises(ValueError, match="q_lengths must have shape \\[batch\\]"):
        pf.ring_attention_local(q_local, kv_local, kv_local, axis_name="x", q_lengths=ids)
    # Well-formed ids pass the checks, and tracing goes on to the kernels.
    with pytest.raises(AssertionError, match="a kernel was traced"):
        pf.ring_attention(q, k, v, mesh=mesh, axis_name="x", q_segment_ids=ids,
                          kv_segment_ids=ids, q_lengths=lengths, kv_lengths=lengths)


def _ring_fn(mesh, layout, ring_size, *, entry="global", **ring_options):
    """A flash_attention-like fn(q, k, v, return_lse, causal, **ids) in natural token order.

    Segment ids are passed the way q, k, v are: permuted into the layout (and, for the local
    entry, split along the sequence); lengths stay in natural positions and are not split.
    """
    if layout == "zigzag":
        into = functools.partial(pf.zigzag_permute, num_devices=ring_size)
        back = functools.partial(pf.zigzag_unpermute, num_devices=ring_size)
    else:
        into = back = lambda x, axis=1: x  # noqa: E731

    def attend(q, k, v, return_lse=False, causal=False, **options):
        q, k, v = (into(x, axis=1) for x in (q, k, v))
        ids = {name: into(x, axis=1) if name.endswith("segment_ids") else x
               for name, x in options.items() if name in ID_OPTIONS}
        opts = {**ring_options,
                **{name: x for name, x in options.items() if name not in ID_OPTIONS}}
        if entry == "global":
            out, lse = pf.ring_attention(q, k, v, mesh=mesh, axis_name="ring", causal=causal,
                                         layout=layout, return_lse=True, **ids, **opts)
        else:
            # The per-device function inside the caller's own shard_map.
            tokens, rows = P(None, "ring", None, None), P(None, None, "ring")
            names = tuple(ids)
            id_specs = tuple(P(None, "ring") if name.endswith("segment_ids") else P(None)
                             for name in names)

            def local(q, k, v, *id_values):
                return pf.ring_attention_local(q, k, v, axis_name="ring", causal=causal,
                                               layout=layout, return_lse=True,
                                               **dict(zip(names, id_values)), **opts)

            out, lse = jax.shard_map(local, mesh=mesh, in_specs=(tokens,) * 3 + id_specs,
                                     out_specs=(tokens, rows), check_vma=False)(
                                         q, k, v, *ids.values())
        out, lse = back(out, axis=1), back(lse, axis=2)
        return (out, lse) if return_lse else out

    return attend


def _packed_ids(batch, seq, ring_size, kind):
    """Segment-id and length options for flash_attention: kind "docs", "docs+lengths" or
    "lengths" (padding only).

    Docs: every batch row gets its own documents with random boundaries (ids not starting at 0,
    so nothing relies on that), and some document runs across a shard boundary of the zig-zag
    layout (whose chunks are also the contiguous layout's shard boundaries and their midpoints),
    so one document's keys are on several devices. Lengths: q and kv lengths differ and cut
    through zig-zag chunks, so padded queries see no key, and with docs so do some real queries
    (their document's keys are all padding).
    """
    options = {}
    ids = np.zeros((batch, seq), np.int32)
    if "docs" in kind:
        rng = np.random.default_rng(seq + batch)
        chunk = seq // (2 * ring_size)
        for b in range(batch):
            starts = np.zeros(seq, bool)
            starts[rng.choice(np.arange(1, seq), size=5, replace=False)] = True
            ids[b] = 3 * np.cumsum(starts) + 7 + b
            crosses = [ids[b, c * chunk - 1] == ids[b, c * chunk]
                       for c in range(1, 2 * ring_size)]
            assert any(crosses), "no document crosses a shard boundary"
        options.update(q_segment_ids=jnp.asarray(ids), kv_segment_ids=jnp.asarray(ids))
    if "lengths" in kind:
        assert seq % 16 == 0
        q_lengths = np.array([seq, seq * 11 // 16 + 1][:batch], np.int32)
        kv_lengths = np.array([seq * 13 // 16 + 3, seq][:batch], np.int32)
        if "docs" in kind:
            real_q = np.arange(seq)[None, :] < q_lengths[:, None]
            real_kv = np.arange(seq)[None, :] < kv_lengths[:, None]
            sees = ((ids[:, :, None] == ids[:, None, :]) & real_kv[:, None, :]).any(-1)
            assert (real_q & ~sees).any(), "no real query whose document has only padded keys"
        options.update(q_lengths=jnp.asarray(q_lengths), kv_lengths=jnp.asarray(kv_lengths))
    return options


@functools.lru_cache(maxsize=None)
def _inputs_and_expected(shape, causal, packing=None):
    """Inputs, cotangents, the segment-id options, and the single-device flash and reference
    results (cached: several ring cases share them, and each costs a compile). packing: None,
    or (ring size, kind) for `_packed_ids`."""
    batch, seq, q_heads, kv_heads, head_dim = shape
    q, k, v, do = random_inputs(jax.random.PRNGKey(7), batch, seq, seq, q_heads, kv_heads,
                                head_dim, F32)
    dlse = _dlse(jax.random.PRNGKey(8), q)
    ids = {} if packing is None else _packed_ids(batch, seq, *packing)
    flash, ref = single_device(q, k, v, do, dlse, causal=causal, **ids)
    return (q, k, v, do, dlse), ids, jax.device_get(flash), jax.device_get(ref)


def _fresh_traces(monkeypatch):
    """Traces made with the real kernels must not be reused while a test swaps them, nor the
    test's traces kept after it."""
    ring._sharded_fn.cache_clear()
    monkeypatch.setattr(ring, "_sharded_fn",
                        functools.lru_cache(maxsize=None)(ring._sharded_fn.__wrapped__))


def _count_kernel_calls(monkeypatch, axis_name):
    """Wraps the ring's kernels so that every call that actually executes (not merely traced:
    a lax.cond branch not taken never runs its callback) records (ring position, q rows,
    kv rows)."""
    calls = {"forward": collections.Counter(), "backward": collections.Counter()}

    def counted(kind, kernel):
        def record(device, rows, cols):
            calls[kind][(int(device), int(rows), int(cols))] += 1

        def wrapper(spec, q, k, *args, **kwargs):
            jax.debug.callback(record, jax.lax.axis_index(axis_name), q.shape[1], k.shape[1])
            return kernel(spec, q, k, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(ring_steps, "_kernel_forward",
                        counted("forward", ring_steps._kernel_forward))
    monkeypatch.setattr(ring_steps, "_kernel_backward",
                        counted("backward", ring_steps._kernel_backward))
    _fresh_traces(monkeypatch)
    return calls


def _expected_pairs(ring_size, layout, causal, seq):
    """The (q rows, kv rows) kernel calls each ring position must run, sorted."""
    local = seq // ring_size
    half = local // 2
    pairs = {}
    for d in range(ring_size):
        if not causal:
            want = [(local, local)] * ring_size
        elif layout == "contiguous":
            # Position d sees the K/V of positions 0..d: d + 1 pairs (the diagonal one causal);
            # the P - 1 - d later ones are fully masked and must not run at all.
            want = [(local, local)] * (d + 1)
        else:
            # Zig-zag: the diagonal plus P - 1 half pairs, the same work on every position.
            want = [(local, local)] + [(local, half)] * d + [(half, local)] * (ring_size - 1 - d)
        pairs[d] = sorted(want)
    return pairs


RING_CASES = {
    # name: (ring size, layout, causal, (batch, seq, q_heads, kv_heads, head_dim), extra)
    "4_contiguous": (4, "contiguous", False, (1, 64, 4, 2, 16), {}),
    "4_contiguous_causal": (4, "contiguous", True, (1, 64, 4, 2, 16), {}),
    "4_zigzag_causal": (4, "zigzag", True, (1, 64, 4, 2, 16), {}),
    "2_zigzag_causal_mqa_local": (2, "zigzag", True, (1, 64, 3, 1, 32), {"entry": "local"}),
    "2x2_contiguous_causal_data_explicit": (2, "contiguous", True, (2, 64, 4, 2, 16),
                                            {"data": 2, "explicit": True}),
    # Packed documents (segment ids), GQA, each layout causal and not, with and without
    # padding lengths; and lengths alone (ids made of padding only).
    "4_contiguous_docs": (4, "contiguous", False, (2, 64, 4, 2, 16), {"ids": "docs"}),
    "4_contiguous_causal_docs_lengths": (4, "contiguous", True, (2, 64, 4, 2, 16),
                                         {"ids": "docs+lengths"}),
    "4_zigzag_causal_docs": (4, "zigzag", True, (2, 64, 4, 2, 16), {"ids": "docs"}),
    "2_zigzag_docs_lengths_local": (2, "zigzag", False, (2, 64, 4, 2, 16),
                                    {"ids": "docs+lengths", "entry": "local"}),
    "2_zigzag_causal_lengths_only": (2, "zigzag", True, (2, 32, 2, 1, 16), {"ids": "lengths"}),
    # Ids split over the data axis too (segment ids by batch and sequence, lengths by batch).
    "2x2_contiguous_causal_docs_data_explicit": (2, "contiguous", True, (2, 64, 4, 2, 16),
                                                 {"data": 2, "explicit": True,
                                                  "ids": "docs+lengths"}),
}


@pytest.mark.parametrize("name", list(RING_CASES))
def test_ring_attention(monkeypatch, name):
    """O, lse, dq, dk, dv against single-device flash_attention and the reference, and the
    kernel calls that actually ran on each ring position: fully masked chunk pairs never run,
    and zig-zag gives every position the same work. With segment ids (and lengths) both sides
    get the same ids, in natural order; the ring gets them in its layout."""
    ring_size, layout, causal, shape, extra = RING_CASES[name]
    extra = dict(extra)
    data = extra.pop("data", 1)
    explicit = extra.pop("explicit", False)
    ids_kind = extra.pop("ids", None)
    if data > 1:
        mesh = make_mesh((data, ring_size), ("data", "ring"), explicit)
        extra["batch_axis"] = "data"
    else:
        mesh = make_mesh((ring_size,), ("ring",), explicit)
    packing = None if ids_kind is None else (ring_size, ids_kind)
    (q, k, v, do, dlse), ids, flash, ref = _inputs_and_expected(shape, causal, packing)
    calls = _count_kernel_calls(monkeypatch, "ring")

    got = outputs_and_grads(_ring_fn(mesh, layout, ring_size, **extra), q, k, v, do, dlse,
                             dict(causal=causal, **ids))
    jax.block_until_ready(got)
    jax.effects_barrier()
    compare_results("vs flash_attention", got, flash, F32)
    compare_results("vs reference", got, ref, F32)

    expected = _expected_pairs(ring_size, layout, causal, shape[1])
    for kind in ("forward", "backward"):
        ran = {d: sorted((rows, cols) for (dev, rows, cols), n in calls[kind].items()
                         if dev == d for _ in range(n)) for d in range(ring_size)}
        # Every data-parallel replica of a ring position runs the same calls.
        want = {d: sorted(pairs * data) for d, pairs in expected.items()}
        assert ran == want, (kind, ran, want)
        if causal and layout == "zigzag":
            work = {d: sum(r * c for r, c in pairs) for d, pairs in ran.items()}
            assert len(set(work.values())) == 1, (kind, work)


@pytest.mark.skipif(ON_GPU, reason="float64 runs in interpret mode only (CPU)")
def test_ring_check_grads_float64(x64):
    mesh = make_mesh((2,), ("ring",))
    keys = jax.random.split(jax.random.PRNGKey(11), 4)
    q = jax.random.normal(keys[0], (1, 32, 4, 16), jnp.float64)
    k = jax.random.normal(keys[1], (1, 32, 2, 16), jnp.float64)
    v = jax.random.normal(keys[2], (1, 32, 2, 16), jnp.float64)
    w = jax.random.normal(keys[3], (1, 4, 32), jnp.float64)

    def f(q, k, v):
        out, lse = pf.ring_attention(q, k, v, mesh=mesh, axis_name="ring", causal=True,
                                     layout="zigzag", return_lse=True)
        # lse is in the output, so the lse cotangent path of the backward ring is checked too.
        return out, lse * w

    check_grads(f, (q, k, v), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)


def test_ring_with_sinks_matches_reference():
    """Sinks apply to the ring's merged (O, lse): O, lse and every gradient, the sinks'
    included, against the float32 reference_attention under random cotangents for O and lse,
    elementwise at the float32 tolerance."""
    mesh = make_mesh((2,), ("ring",))
    keys = jax.random.split(jax.random.PRNGKey(13), 6)
    q, k, v, do = random_inputs(keys[0], 1, 32, 32, 4, 2, 16, F32)
    sinks = 2.0 * jax.random.normal(keys[1], (4,), F32)
    dlse = _dlse(keys[2], q)

    def run(fn):
        @jax.jit
        def outputs_and_all_grads(q, k, v, sinks):
            (out, lse), vjp = jax.vjp(fn, q, k, v, sinks)
            return out, lse, vjp((do, dlse))
        out, lse, (dq, dk, dv, dsinks) = outputs_and_all_grads(q, k, v, sinks)
        return (out, lse, (dq, dk, dv)), dsinks

    ring_fn = lambda q, k, v, s: pf.ring_attention(  # noqa: E731
        q, k, v, mesh=mesh, axis_name="ring", causal=True, sinks=s, return_lse=True)
    # The inputs are float32 and reference_attention computes with HIGHEST-precision matmuls.
    ref_fn = lambda q, k, v, s: pf.reference_attention(  # noqa: E731
        q, k, v, causal=True, sinks=s, return_lse=True)
    got, got_dsinks = run(ring_fn)
    want, want_dsinks = run(ref_fn)
    compare_results("ring with sinks", got, want, F32)
    assert got_dsinks.dtype == sinks.dtype
    assert_close("ring with sinks dsinks", got_dsinks, want_dsinks, tolerance(F32))


# ================================================================================================
# Strategies and masks: every variant against the reference
# ================================================================================================

VARIANT_CASES = {
    # name: (ring size, layout, strategy, causal, (batch, seq, q_heads, kv_heads, head_dim),
    #        options for both sides, extra options for the ring only)
    # A two-sided window: some pairs of later shards are seen, the far ones skipped.
    "ring_4_contiguous_window": (4, "contiguous", "ring", False, (1, 128, 4, 2, 32),
                                 {"window": (10, 40)}, {}),
    "ring_2_zigzag_causal_window_bottom_right_softcap": (
        2, "zigzag", "ring", True, (1, 128, 4, 2, 32),
        {"window": (24, None), "causal_alignment": "bottom_right", "softcap": 5.0}, {}),
    "allgather_4_zigzag_causal_mqa_docs_lengths": (
        4, "zigzag", "allgather", True, (2, 64, 4, 1, 32), {"ids": "docs+lengths"}, {}),
    # "auto" takes the all-gather here: 4 q heads per kv head on 2 devices (byte model).
    "auto_2_contiguous_window_softcap_sinks_local": (
        2, "contiguous", "auto", False, (1, 64, 4, 1, 64),
        {"window": (16, 8), "softcap": 4.0, "sinks": True}, {"entry": "local"}),
}


@functools.lru_cache(maxsize=None)
def _reference_case(shape, causal, packing, options):
    batch, seq, q_heads, kv_heads, head_dim = shape
    q, k, v, do = random_inputs(jax.random.PRNGKey(seq + head_dim), batch, seq, seq, q_heads,
                                kv_heads, head_dim, F32)
    dlse = _dlse(jax.random.PRNGKey(3), q)
    kwargs = dict(options, causal=causal)
    if kwargs.pop("sinks", False):
        kwargs["sinks"] = 1.5 * jax.random.normal(jax.random.PRNGKey(5), (q_heads,), F32)
    if packing is not None:
        kwargs.update(_packed_ids(batch, seq, *packing))
    ref = outputs_and_grads(pf.reference_attention, q, k, v, do, dlse, kwargs)
    return (q, k, v, do, dlse), kwargs, jax.device_get(ref)


@pytest.mark.parametrize("name", list(VARIANT_CASES))
def test_strategies_and_variants_match_reference(name):
    """O, lse, dq, dk, dv of each strategy against reference_attention under random
    cotangents, with windows, bottom-right alignment, softcap, GQA/MQA, packed documents,
    padding lengths and sinks; the global and the per-device entry."""
    ring_size, layout, strategy, causal, shape, options, extra = VARIANT_CASES[name]
    options = dict(options)
    ids_kind = options.pop("ids", None)
    packing = None if ids_kind is None else (ring_size, ids_kind)
    inputs, kwargs, ref = _reference_case(shape, causal, packing, tuple(sorted(options.items())))
    mesh = make_mesh((ring_size,), ("ring",))
    fn = _ring_fn(mesh, layout, ring_size, strategy=strategy, **extra)
    got = outputs_and_grads(fn, *inputs, kwargs)
    compare_results(name, got, ref, F32)
    if strategy == "auto":
        jaxpr = str(jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*inputs[:3]))
        assert "all_gather" in jaxpr and "ppermute" not in jaxpr


# name: (ring size, layout, strategy, options for both sides)
MLA_CASES = {
    "ring_4_zigzag_causal": (4, "zigzag", "ring", {"causal": True}),
    "allgather_4_zigzag_causal": (4, "zigzag", "allgather", {"causal": True}),
    # A causal window narrower than a shard: the ring stops after one step.
    "ring_4_contiguous_causal_window": (4, "contiguous", "ring",
                                        {"causal": True, "window": (12, None)}),
}


@pytest.mark.parametrize("name", list(MLA_CASES))
def test_v_head_dim_differs_matches_reference(name):
    """V with a head_dim of its own (MLA: here 32 for Q/K, 16 for V; GQA): O [.., 16], lse and
    dq, dk, dv against reference_attention under random cotangents, for both strategies."""
    ring_size, layout, strategy, options = MLA_CASES[name]
    mesh = make_mesh((ring_size,), ("ring",))
    q, k, v, do = random_inputs(jax.random.PRNGKey(41), 1, 64, 64, 4, 2, 32, F32, head_dim_v=16)
    dlse = _dlse(jax.random.PRNGKey(42), q)
    got = outputs_and_grads(_ring_fn(mesh, layout, ring_size, strategy=strategy), q, k, v, do,
                            dlse, options)
    assert got[0].shape == (1, 64, 4, 16)
    ref = outputs_and_grads(pf.reference_attention, q, k, v, do, dlse, options)
    compare_results(name, got, ref, F32)


def test_window_skips_shards_it_does_not_reach(monkeypatch):
    """With a window narrower than a shard only the neighbouring shard travels (one step), and
    the kernel calls that run are exactly the visible pairs; the result matches the
    reference."""
    ring_size, seq = 4, 128
    mesh = make_mesh((ring_size,), ("ring",))
    q, k, v, do = random_inputs(jax.random.PRNGKey(21), 1, seq, seq, 2, 1, 32, F32)
    dlse = _dlse(jax.random.PRNGKey(22), q)
    options = dict(causal=True, window=(20, None))
    fn = _ring_fn(mesh, "contiguous", ring_size)
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: fn(q, k, v, **options))(q, k, v))
    # Forward: K, V move one step; backward: K, V again and the pair's dK, dV back home.
    assert jaxpr.count("ppermute") == 2, jaxpr.count("ppermute")
    calls = _count_kernel_calls(monkeypatch, "ring")
    got = outputs_and_grads(fn, q, k, v, do, dlse, options)
    jax.block_until_ready(got)
    jax.effects_barrier()
    ref = outputs_and_grads(pf.reference_attention, q, k, v, do, dlse, options)
    compare_results("window", got, ref, F32)
    local = seq // ring_size
    # Device 0 sees its own shard only; every other device also its left neighbour's.
    want = collections.Counter({(d, local, local): 1 + (d > 0) for d in range(ring_size)})
    assert calls["forward"] == want and calls["backward"] == want


# ================================================================================================
# The static plan, the backend choice and the byte model (no kernel runs)
# ================================================================================================


def _plan(layout, causal, window=None, *, size=4, dtype=F32, head_dim=32, backend="auto",
          interpret=True, head_dim_v=None):
    q = jax.ShapeDtypeStruct((1, 64, 4, head_dim), dtype)
    k = jax.ShapeDtypeStruct((1, 64, 2, head_dim), dtype)
    v = jax.ShapeDtypeStruct((1, 64, 2, head_dim if head_dim_v is None else head_dim_v), dtype)
    return ring._plan(q, k, v, axis_name="ring", axis_size=size, where="global", causal=causal,
                      scale=None, softcap=None, window=window, causal_alignment="top_left",
                      layout=layout, strategy="ring", backend=backend, precision=None,
                      config=None, interpret=interpret, ids={name: None for name in ID_OPTIONS})


def _calls(plan):
    return [[[(c.rows, c.cols, c.spec.mask) for c in kind] for kind in step.kinds]
            for step in plan.steps]


def test_plan_zigzag_causal_is_one_call_per_pair():
    """The zig-zag diagonal is one causal call over both pieces; every other step has two
    kinds: an earlier device's first piece (all rows) and a later device (second rows)."""
    plan = _plan("zigzag", True)
    assert [s.shift for s in plan.steps] == [0, 1, 2, 3]
    (diagonal,), = plan.steps[0].kinds
    assert (diagonal.rows, diagonal.cols) == ((0, 16), (0, 16))
    assert diagonal.spec.mask == MaskSpec(16, 16, 0, None, 0)
    for step in plan.steps[1:]:
        kinds = {tuple((c.rows, c.cols, c.spec.mask.has_position_mask) for c in kind)
                 for kind in step.kinds}
        assert kinds == {(((0, 16), (0, 8), False),), (((8, 16), (0, 16), False),)}
        # Device i holds an earlier shard exactly when shift <= i.
        assert [step.kinds[k][0].rows for k in step.table] == [
            (0, 16) if step.shift <= i else (8, 16) for i in range(4)]


def test_plan_window_positions():
    """Each call's mask is the window in natural positions, shifted by the distance of its
    pieces; steps no device needs are dropped, and a pair with no visible key has no call."""
    plan = _plan("contiguous", False, (10, 12))  # local length 16: reaches one shard
    assert [s.shift for s in plan.steps] == [0, 1, 3]  # shift 2: every pair is too far
    _, (skip, earlier), (later, skip2) = _calls(plan)[0], _calls(plan)[1], _calls(plan)[2]
    assert skip == [] and skip2 == []
    assert earlier == [((0, 16), (0, 16), MaskSpec(16, 16, 16, 10, None))]
    assert later == [((0, 16), (0, 16), MaskSpec(16, 16, -16, None, 12))]
    assert plan.steps[1].table == (0, 1, 1, 1) and plan.steps[2].table == (0, 0, 0, 1)
    # A window wider than the sequence is no mask at all: one unmasked call per step.
    wide = _plan("zigzag", False, (1000, 1000))
    assert all(len(s.kinds) == 1 and not s.kinds[0][0].spec.mask.has_position_mask
               for s in wide.steps)


def test_plan_backends(monkeypatch):
    """Calls choose their backends as flash_attention does: on sm_90 the guarded Mosaic
    kernels; Triton for what the Mosaic kernels do not take (float32, a head_dim), for a
    block they refuse under backend="mosaic", and everywhere in interpret mode."""
    monkeypatch.setattr(attention, "_is_sm90", lambda: True)
    compiled = dict(interpret=False, dtype=jnp.bfloat16, head_dim=64)

    def backends(plan):
        return {(c.forward, c.backward) for s in plan.steps for kind in s.kinds for c in kind}

    assert backends(_plan("zigzag", True, **compiled)) == {("guarded", "guarded")}
    assert backends(_plan("zigzag", True, **compiled, backend="mosaic")) == {("mosaic", "mosaic")}
    assert backends(_plan("zigzag", True, **compiled, backend="triton")) == {("triton", "triton")}
    assert backends(_plan("zigzag", True, **dict(compiled, head_dim=40))) == {("triton",
                                                                               "triton")}
    assert backends(_plan("zigzag", True)) == {("triton", "triton")}
    # A V head_dim above Q/K's only the Triton kernels take; "mosaic" refuses it. One below
    # (MLA) takes the Mosaic kernels.
    assert backends(_plan("zigzag", True, **dict(compiled, head_dim_v=128))) == {("triton",
                                                                                 "triton")}
    with pytest.raises(ValueError, match="backend='mosaic' cannot serve .*v head_dim 128"):
        _plan("zigzag", True, **dict(compiled, head_dim_v=128), backend="mosaic")
    assert backends(_plan("zigzag", True, **dict(compiled, head_dim_v=32))) == {("guarded",
                                                                                "guarded")}
    # A block the Mosaic forward refuses (here: any with a position offset) runs on Triton.
    real = mosaic_forward.unsupported_reason
    monkeypatch.setattr(mosaic_forward, "unsupported_reason", lambda spec, *a, **kw: (
        "offset" if spec.mask.offset else real(spec, *a, **kw)))
    plan = _plan("contiguous", False, (10, 12), **compiled, backend="mosaic")
    chosen = {c.spec.mask.offset == 0: (c.forward, c.backward)
              for s in plan.steps for kind in s.kinds for c in kind}
    assert chosen == {True: ("mosaic", "mosaic"), False: ("triton", "triton")}
    with pytest.raises(ValueError, match="backend='mosaic' cannot serve"):
        _plan("zigzag", True, interpret=False, backend="mosaic")  # float32


def test_strategy_byte_model():
    """The written-down counts, and the rule: the all-gather for GQA with few K/V heads; the
    ring with as many K/V heads as q heads, on many devices, or under a window that lets it
    stop early."""
    shape = dict(seq=8192, head_dim=128, dtype=jnp.bfloat16, batch=1)
    shard = 1 * 4096 * 8 * 128 * 2  # one local K (or V) shard: seq / 2 x 8 heads x 128 x 2 B
    b = ring_plan.strategy_bytes(devices=2, q_heads=64, kv_heads=8, **shape)
    assert b == {"ring": 6 * shard, "allgather": 4 * shard, "allgather_extra": 2 * shard,
                 "query": 8 * shard}
    assert pf.ring.strategy_bytes is ring_plan.strategy_bytes
    choose = ring_plan.choose_strategy
    assert choose(devices=2, q_heads=64, kv_heads=8, **shape) == "allgather"
    assert choose(devices=5, q_heads=64, kv_heads=8, **shape) == "allgather"
    assert choose(devices=8, q_heads=64, kv_heads=8, **shape) == "ring"   # 14 shards > q
    assert choose(devices=2, q_heads=16, kv_heads=16, **shape) == "ring"  # MHA
    assert choose(devices=4, q_heads=64, kv_heads=8, ring_steps=1, **shape) == "ring"
    assert choose(devices=1, q_heads=64, kv_heads=8, **shape) == "ring"   # nothing moves
    assert ring_plan.strategy_bytes(devices=4, q_heads=8, kv_heads=8, ring_steps=1,
                                    **shape)["ring"] == 6 * (shard // 2)
    # MLA: K counts with Q/K's head_dim, V with its own (192 and 128).
    mla = dict(shape, head_dim=192, head_dim_v=128)
    k_shard, v_shard = shard // 128 * 192, shard
    kv = k_shard + v_shard
    assert ring_plan.strategy_bytes(devices=2, q_heads=64, kv_heads=8, **mla) == {
        "ring": 3 * kv, "allgather": 2 * kv, "allgather_extra": kv, "query": 8 * k_shard}
    assert ring_plan.strategy_bytes(devices=2, q_heads=64, kv_heads=8, head_dim_v=128,
                                    **shape) == b   # head_dim_v equal to head_dim: the same
    # The memory bound counts V at its own width: on 4 devices with 40 q heads per 8 kv heads
    # the gathered K/V, 3 (k + v), just fit beside the query shard (5 k) with V 128 wide, not
    # with V as wide as K.
    assert choose(devices=4, q_heads=40, kv_heads=8, **mla) == "allgather"
    assert choose(devices=4, q_heads=40, kv_heads=8, **dict(mla, head_dim_v=192)) == "ring"


# ================================================================================================
# Memory and overlap, read off the per-device program
# ================================================================================================


def _per_device_jaxprs(strategy, layout="zigzag", causal=True, shape=(1, 256, 4, 2, 32)):
    """The jaxprs of one device's forward and backward passes (ring_steps), traced inside a
    shard_map over 4 devices: (forward, backward)."""
    ring_size = 4
    batch, seq, q_heads, kv_heads, head_dim = shape
    local = seq // ring_size
    q = jax.ShapeDtypeStruct((batch, seq, q_heads, head_dim), F32)
    k = jax.ShapeDtypeStruct((batch, seq, kv_heads, head_dim), F32)
    plan = ring._plan(q, k, k, axis_name="ring", axis_size=ring_size, where="global",
                      causal=causal, scale=None, softcap=None, window=None,
                      causal_alignment="top_left", layout=layout, strategy=strategy,
                      backend="auto", precision=None, config=None, interpret=True,
                      ids={name: None for name in ID_OPTIONS})
    mesh = make_mesh((ring_size,), ("ring",))
    tokens, rows = P(None, "ring", None, None), P(None, None, "ring")

    def kv_of(k, v):
        kv = (k, v, None)
        return (kv, None) if strategy == "ring" else (None, ring_steps._gather(plan, kv))

    def forward(q, k, v):
        kv, gathered = kv_of(k, v)
        return ring_steps._forward(plan, q, kv, None, gathered)

    def backward(q, k, v, out, lse, d_out, d_lse):
        kv, gathered = kv_of(k, v)
        return ring_steps._backward(plan, q, kv, out, lse, None, d_out, d_lse, gathered)

    def body(fn, in_specs, out_specs, *args):
        mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                               check_vma=False)
        eqn, = [e for e in jax.make_jaxpr(mapped)(*args).eqns if e.primitive.name == "shard_map"]
        return eqn.params["jaxpr"]

    lse = jax.ShapeDtypeStruct((batch, q_heads, seq), F32)
    fwd = body(forward, (tokens,) * 3, (tokens, rows), q, k, k)
    bwd = body(backward, (tokens,) * 4 + (rows, tokens, rows), (tokens,) * 3, q, k, k, q, lse,
               q, lse)
    return fwd, bwd, local


def _avals(jaxpr):
    """Shapes of every value the program makes outside the kernels' own bodies."""
    import jax.extend
    for eqn in jaxpr.eqns:
        yield from (v.aval.shape for v in eqn.outvars if hasattr(v.aval, "shape"))
        if eqn.primitive.name == "pallas_call":
            continue
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _avals(sub)


def _runs_kernel(eqn) -> bool:
    import jax.extend
    if eqn.primitive.name == "pallas_call":
        return True
    return any(_runs_kernel(e) for sub in jax.extend.core.jaxprs_in_params(eqn.params)
               for e in sub.eqns)


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_no_full_length_kv_and_no_score_matrix(strategy):
    """Outside the kernels no value holds a [seq_q, seq_kv] block, and the ring never holds more
    than a shard's length of anything: full-length K/V exist only in the all-gather."""
    fwd, bwd, local = _per_device_jaxprs(strategy)
    head_dim = 32
    for shape in [*_avals(fwd), *_avals(bwd)]:
        assert sum(d > head_dim for d in shape) <= 1, shape   # one sequence axis at most
        if strategy == "ring":
            assert max(shape, default=0) <= local, shape


def test_ring_sends_overlap_the_kernels():
    from jax.extend.core import Literal

    """Program order of the ring: each step's K/V send is issued before the step's kernels and
    consumed by the next step; in the backward each pair's dK/dV leave after its kernels and
    are added at home only after the next step's kernels."""
    fwd, bwd, _ = _per_device_jaxprs("ring")

    def trace(jaxpr):
        sent, events = set(), []
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "ppermute":
                sent.update(eqn.outvars)
                events.append("send")
            elif _runs_kernel(eqn):
                events.append("kernel")
            elif any(v in sent for v in eqn.invars if not isinstance(v, Literal)):
                events.append("use")
        # Consecutive sends (K and V, dK and dV) and uses count once.
        return [e for i, e in enumerate(events)
                if i == 0 or events[i - 1] != e or e == "kernel"]

    # Zig-zag causal on 4 devices: 4 steps; the kernels of steps 1-3 read the shard received.
    assert trace(fwd) == ["send", "kernel", "send", "kernel", "send", "kernel", "kernel"]
    assert trace(bwd) == [
        "send", "kernel",            # step 0 (own shard): step 1's K/V leave first
        "send", "kernel",            # step 1: step 2's K/V leave, then step 1's kernels
        "send", "kernel", "use",     # step 1's dK/dV and step 3's K/V leave; step 2's kernels,
                                     # and only then step 1's dK/dV are added at home
        "send", "kernel", "use",     # step 2's dK/dV leave; step 3; step 2's added
        "send", "use"]               # step 3's dK/dV go home last


# ================================================================================================
# On one GPU: the ring's calls on the compiled kernels
# ================================================================================================


def _dense_attention(spec, q, k, v):
    """O and lse of one call with its exact static mask, in float32 with HIGHEST-precision
    matmuls (GQA by repeat). As in reference_attention, a row that sees no key gives O = 0 and
    lse = -inf, and its gradients stay free of inf - inf."""
    highest = jax.lax.Precision.HIGHEST
    group = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x.astype(F32), group, axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(F32), k, precision=highest) * spec.scale
    if spec.softcap is not None:
        s = spec.softcap * jnp.tanh(s / spec.softcap)
    mask = spec.mask.dense()
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    row_max = jnp.max(s, axis=-1, keepdims=True)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    p = jnp.exp(s - row_max)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    seen = denom > 0
    denom = jnp.where(seen, denom, 1.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", p / denom, v, precision=highest)
    lse = jnp.where(seen, row_max + jnp.log(denom), -jnp.inf)[..., 0]
    return out, lse


@pytest.mark.skipif(not ON_GPU, reason="the compiled kernels need a GPU")
def test_plan_calls_on_the_compiled_kernels():
    """Every distinct call of a 4-device zig-zag plan under a causal window (offset masks,
    half pieces), in bf16, on the backends the plan chose (the guarded Mosaic kernels on
    sm_90) and on Triton: forward (O, lse) and the vjp (dq, dk, dv) under random cotangents,
    each against a dense float32 attention with the call's exact mask."""
    q = jax.ShapeDtypeStruct((1, 1024, 4, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 1024, 2, 64), jnp.bfloat16)
    plan = ring._plan(q, k, k, axis_name="ring", axis_size=4, where="global", causal=True,
                      scale=None, softcap=None, window=(200, None),
                      causal_alignment="top_left", layout="zigzag", strategy="ring",
                      backend="auto", precision=None, config=None, interpret=None,
                      ids={name: None for name in ID_OPTIONS})
    calls = list(dict.fromkeys(c for s in plan.steps for kind in s.kinds for c in kind))
    assert len(calls) > 3 and any(c.spec.mask.offset for c in calls)
    if attention._is_sm90():
        assert {(c.forward, c.backward) for c in calls} == {("guarded", "guarded")}
    tol = tolerance(jnp.bfloat16)
    for n, call in enumerate(calls):
        rows, cols = call.rows[1] - call.rows[0], call.cols[1] - call.cols[0]
        cq, ck, cv, do = random_inputs(jax.random.PRNGKey(n), 1, rows, cols, 4, 2, 64,
                                       jnp.bfloat16)
        dlse = jax.random.normal(jax.random.PRNGKey(100 + n), (1, 4, rows), F32)
        (want_out, want_lse), dense_vjp = jax.vjp(
            lambda q, k, v, c=call: _dense_attention(c.spec, q, k, v),
            *(x.astype(F32) for x in (cq, ck, cv)))
        seen = np.isfinite(np.asarray(want_lse))
        # A row that sees no key has no lse to differentiate (the kernels ignore its dlse).
        want_grads = dense_vjp((do.astype(F32), jnp.where(seen, dlse, 0.0)))
        # The plan's backends and Triton, each once (a dict keeps the order and drops repeats).
        for backend in dict.fromkeys((call.forward, "triton")):
            out, row_stats = jax.jit(lambda *a, c=call, b=backend: ring_steps._kernel_forward(
                c.spec, *a, None, None, backend=b))(cq, ck, cv)
            where = f"call {n} ({backend} forward)"
            assert out.dtype == jnp.bfloat16, where
            assert_close(f"{where} out", out, want_out, tol)
            lse = np.asarray(stats_to_lse(call.spec, row_stats))
            np.testing.assert_array_equal(np.isneginf(lse), ~seen, err_msg=f"{where} lse=-inf")
            assert_close(f"{where} lse", np.where(seen, lse, 0), np.where(seen, want_lse, 0),
                         tol, floor=1.0)
        # Each backward runs on the statistics of the forward the plan pairs it with.
        out, row_stats = jax.jit(lambda *a, c=call: ring_steps._kernel_forward(
            c.spec, *a, None, None, backend=c.forward))(cq, ck, cv)
        for backend in dict.fromkeys((call.backward, "triton")):
            grads = jax.jit(lambda *a, c=call, b=backend: ring_steps._kernel_backward(
                c.spec, *a, None, None, backend=b))(cq, ck, cv, out, row_stats, do, dlse)
            for name, g, want, x in zip(("dq", "dk", "dv"), grads, want_grads, (cq, ck, cv)):
                where = f"call {n} ({backend} backward) {name}"
                assert g.dtype == x.dtype, where
                assert_close(where, g, want, tol)


@pytest.mark.skipif(not ON_GPU, reason="bf16 on the compiled (Mosaic on sm_90) kernels")
@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_gpu_ring_matches_reference(strategy, size):
    """The whole ring on the compiled kernels, bf16, causal with a window and GQA, against the
    reference: on one GPU (P = 1) and, where there are two, on both."""
    mesh = make_mesh((size,), ("ring",))
    q, k, v, do = random_inputs(jax.random.PRNGKey(31), 1, 512, 512, 4, 2, 64, jnp.bfloat16)
    dlse = _dlse(jax.random.PRNGKey(32), q)
    options = dict(causal=True, window=(100, None))
    got = outputs_and_grads(_ring_fn(mesh, "zigzag", size, strategy=strategy), q, k, v, do,
                            dlse, options)
    up = lambda x: x.astype(F32)  # noqa: E731
    ref = outputs_and_grads(pf.reference_attention, up(q), up(k), up(v), up(do), dlse, options)
    compare_results(strategy, got, ref, jnp.bfloat16)
