"""The decode benchmark (``python -m pallas_flash.bench --decode``) on the CPU.

One smoke run in interpret mode goes through the whole pipeline (copy bandwidth, the contiguous
and paged caches, the comparators, the reference, the JSON, the text table); the report block is
built from its JSON. cuDNN is missing on a CPU, and tokamax where it is not installed: both must
come out as n.a. rows, not crashes.
"""

from __future__ import annotations

import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flash.bench import decode, report
from pallas_flash.bench.__main__ import main

ON_GPU = jax.default_backend() == "gpu"
TOKAMAX = importlib.util.find_spec("tokamax") is not None


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("decode")
    # Two compile threads: the threaded ahead-of-time compilation a GPU run uses.
    result = main(["--decode", "--smoke", "--out", str(out), "--timer", "call",
                   "--impls", "pallas_flash,cudnn", "--decode-copy-mib", "8",
                   "--decode-compile-workers", "2"])
    (path,) = [os.path.join(out, f) for f in os.listdir(out) if f.endswith(".json")]
    return result, path


def test_smoke_run_rows_and_bandwidth(smoke):
    result, path = smoke
    with open(path) as f:
        saved = json.load(f)
    assert saved == json.loads(json.dumps(result))
    assert saved["complete"] is True and saved["meta"]["iters"] == 1
    section = saved["decode"]
    copy = section["copy"]
    assert copy["bytes"] == 2 * (8 << 20) and copy["gbps"] == pytest.approx(
        copy["bytes"] / copy["ms"] / 1e6)
    assert section["page_size"] == decode.SMOKE_PAGE_SIZE and section["q_lens"] == [1, 4]
    # --impls pallas_flash,cudnn still brings the XLA and tokamax comparators.
    assert section["impls"] == ["pallas_flash", "xla", "cudnn", "tokamax"]
    (group,) = section["groups"]
    assert group["batch"] == decode.SMOKE_CASES[0][0] and section["compile_workers"] == 2
    assert 0 < group["compile_s"] < group["seconds"]
    rows = section["rows"]
    by = {(r["q_len"], r["layout"], r["impl"]): r for r in rows}
    assert len(by) == len(rows) == 2 * 4 + 2 * 1  # comparators on the contiguous cache only
    b, ctx, hq, hkv, d = decode.SMOKE_CASES[0]
    for q_len in (1, 4):
        for layout in ("contiguous", "paged"):
            r = by[q_len, layout, "pallas_flash"]
            assert r["status"] == "ok", r
            assert (r["batch"], r["context"], r["q_heads"], r["kv_heads"]) == (b, ctx, hq, hkv)
            assert r["kv_bytes"] == b * ctx * hkv * d * 2 * 2  # bf16 K and V
            assert r["gbps"] == pytest.approx(r["kv_bytes"] / r["ms"] / 1e6)
            # The smaller of the wall clock's median and, on a GPU, the median of the programs'
            # GPU times from a trace.
            wall = float(np.median(r["times_ms"]))
            assert r["wall_ms"] == pytest.approx(wall)
            if ON_GPU:
                gpu = float(np.median(r["gpu_times_ms"]))
                assert len(r["gpu_times_ms"]) == 3
                assert r["ms"] == pytest.approx(min(gpu, wall))
                assert r["timer"] == ("gpu" if gpu < wall else "wall")
            else:
                assert r["gpu_times_ms"] is None and r["timer"] == "wall"
                assert r["ms"] == r["wall_ms"]
            assert r["frac_of_copy"] == pytest.approx(r["gbps"] / copy["gbps"])
            assert r["err_vs_ref"] < 2e-2
            # On a CPU two calls over two copies; on a GPU, as many as a real run makes.
            assert (r["calls_per_program"], r["cache_copies"]) == (
                (64, 8) if ON_GPU else (2, 2))
        paged = by[q_len, "paged", "pallas_flash"]
        assert paged["page_size"] == decode.SMOKE_PAGE_SIZE
        assert paged["paged_over_contiguous"] == pytest.approx(
            paged["ms"] / by[q_len, "contiguous", "pallas_flash"]["ms"])
        assert paged["paged_out_vs_contiguous"] < 2e-2
        xla = by[q_len, "contiguous", "xla"]
        assert xla["status"] == "ok" and xla["err_vs_ref"] < 2e-2
        assert xla["vs_pallas_flash"] == pytest.approx(
            by[q_len, "contiguous", "pallas_flash"]["ms"] / xla["ms"])
        # On a GPU cuDNN runs or declines the shape; it never fails the run.
        assert by[q_len, "contiguous", "cudnn"]["status"] in (("ok", "n.a.") if ON_GPU
                                                              else ("n.a.",))
        # tokamax is timed where it is importable (the GPU runs carry it), else an n.a. row.
        tokamax = by[q_len, "contiguous", "tokamax"]
        if TOKAMAX:
            assert tokamax["status"] in ("ok", "n.a."), tokamax
        else:
            assert tokamax["status"] == "n.a."
            assert "tokamax is not importable" in tokamax["error"]


def test_report_block_from_the_smoke_json(smoke, tmp_path):
    _, path = smoke
    docs = tmp_path / "docs"
    docs.mkdir()
    target = docs / "performance.md"
    target.write_text("# Performance\n\n<!-- bench-report:decode -->\n<!-- /bench-report:decode "
                      "-->\n\nAfter.\n")
    result = report.run_report([path], docs=str(docs), readme="README.md", plot=False,
                               root=str(tmp_path))
    assert result["changed"] == [str(docs / "performance.md")]
    text = target.read_text()
    assert text.endswith("<!-- /bench-report:decode -->\n\nAfter.\n")
    assert f"<!-- bench-report:decode source={path} -->" in text
    assert "| GQA | q_len | batch | context | µs | % of copy | paged µs |" in text
    assert "| 4:2 | 1 | 2 | 256 |" in text and "| 4:2 | 4 | 2 | 256 |" in text
    assert "cuDNN µs | XLA µs | tokamax µs | × fastest other |" in text
    assert ON_GPU or "- cuDNN: n.a. in 2 cases: cuDNN needs a GPU" in text
    assert "- pallas_flash paged within 5% of contiguous:" in text
    assert "copy bandwidth" in text and "pages of 16 keys" in text
    # Regenerated from the file its marker names, the block is up to date.
    again = report.run_report([], docs=str(docs), readme="README.md", check=True, plot=False,
                              root=str(tmp_path))
    assert again["changed"] == []


def test_report_block_not_measured_yet(tmp_path):
    results = tmp_path / "bench.json"
    results.write_text(json.dumps({"meta": {}, "results": []}))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "performance.md").write_text(
        "<!-- bench-report:decode source=bench.json -->\nold\n<!-- /bench-report:decode -->\n")
    report.run_report([], docs=str(docs), plot=False, root=str(tmp_path))
    assert "Not measured yet: `bench.json` holds no decode run." in (
        docs / "performance.md").read_text()


def _row(impl, layout, q_len, batch, context, ms, **extra):
    kv_bytes = batch * context * 8 * 128 * 2 * 2
    gbps = kv_bytes / ms / 1e6
    return {"batch": batch, "context": context, "q_len": q_len, "q_heads": 32, "kv_heads": 8,
            "head_dim": 128, "layout": layout, "impl": impl, "status": "ok", "error": None,
            "ms": ms, "kv_bytes": kv_bytes, "gbps": gbps, "frac_of_copy": gbps / 4000,
            **extra}


def test_decode_table_counts_the_targets():
    rows = [
        # 16k: 3.2 TB/s of 4 TB/s (80%), faster than both comparators.
        _row("pallas_flash", "contiguous", 1, 4, 16384, 0.0838),
        _row("pallas_flash", "paged", 1, 4, 16384, 0.0881, paged_over_contiguous=1.05),
        _row("xla", "contiguous", 1, 4, 16384, 0.5),
        {**_row("cudnn", "contiguous", 1, 4, 16384, 0.1), "status": "error", "ms": None,
         "error": "XlaRuntimeError: no"},
        # Batch 1, 4k: 50%, slower than XLA.
        _row("pallas_flash", "contiguous", 1, 1, 4096, 0.0084),
        _row("pallas_flash", "paged", 1, 1, 4096, 0.0100, paged_over_contiguous=1.19),
        _row("xla", "contiguous", 1, 1, 4096, 0.008),
    ]
    section = {"rows": rows, "skipped": [{"batch": 64, "context": 131072}],
               "copy": {"gbps": 4000.0, "what": "x + 1", "bytes": 2 << 30, "ms": 1.0}}
    header, table, notes = report.decode_table(section)
    assert header[-3:] == ["cuDNN µs", "XLA µs", "× fastest other"]
    assert table[0][:9] == ["32:8", "1", "1", "4k", "8.4", "50%", "10.0", "42%", "1.19"]
    assert table[0][-3:] == ["–", "8.0", "0.95"]
    assert table[1][:6] == ["32:8", "1", "4", "16k", "83.8", "80%"]
    assert table[1][-3:] == ["error", "500.0", "5.97"]
    assert notes == [
        "cuDNN: error in 1 cases: XlaRuntimeError: no",
        "pallas_flash at least 80% of the copy bandwidth at contexts of 16k and more: "
        "contiguous 1 of 1, paged 0 of 1 cases",
        "pallas_flash at least 60% of the copy bandwidth at batch 1 with a 4k context: "
        "contiguous 0 of 1, paged 0 of 1 cases",
        "pallas_flash faster than every comparator that ran: 1 of 2 contiguous cases",
        "pallas_flash paged within 5% of contiguous: 1 of 2 cases",
        "not run (time budget): 1 cache shapes, from 64 × 128k",
    ]
    text = report.format_decode_table(section)
    assert text.splitlines()[0].startswith("copy bandwidth 4000 GB/s")


def test_full_matrix_and_case_parsing():
    shapes = decode.parse_cases(None, smoke=False)
    assert len(shapes) == 4 * 4 * 2
    assert {(s[2], s[3], s[4]) for s in shapes} == {(32, 8, 128), (64, 8, 128)}
    groups = decode.make_groups(shapes)
    # One cache per (batch, context), serving both head counts.
    assert len(groups) == 16 and all(g.q_heads == (32, 64) for g in groups)
    sizes = [g.batch * g.context for g in groups]
    assert sizes == sorted(sizes)  # smallest first, for a run cut short by its budget
    assert decode.parse_cases("4x32kx32x8x128, 1x300x4x2x64", False) == [
        (4, 32768, 32, 8, 128), (1, 300, 4, 2, 64)]
    assert decode.parse_cases(None, smoke=True) == list(decode.SMOKE_CASES)
    with pytest.raises(ValueError, match="batch x context"):
        decode.parse_cases("4x32k", False)


def test_calls_and_copies():
    # 1 x 4k x 8 x 128 bf16: 16 MiB a call; 64 calls (1 GiB) over 8 copies (128 MiB).
    assert decode.calls_and_copies(16 << 20) == (64, 8)
    assert decode.calls_and_copies(128 << 20) == (8, 2)
    assert decode.calls_and_copies(2 << 30) == (1, 1)


def test_decode_impls_follow_impls():
    assert decode.decode_impls(None) == ["pallas_flash", "xla", "cudnn", "tokamax"]
    assert decode.decode_impls(["cudnn", "pallas_flash_triton"]) == [
        "pallas_flash", "pallas_flash_triton", "xla", "cudnn", "tokamax"]


def test_bottom_right_mask():
    mask = decode.bottom_right_mask(jnp.array([5, 3]), 2, 6)
    assert mask.shape == (2, 1, 2, 6)
    want = np.zeros((2, 2, 6), bool)
    for b, n in enumerate((5, 3)):
        for t in range(2):
            want[b, t, : n - 2 + t + 1] = True
    np.testing.assert_array_equal(np.asarray(mask[:, 0]), want)


def test_paged_pool_follows_the_block_table():
    cache = jax.random.normal(jax.random.key(0), (3, 40, 2, 4))
    perm = np.random.default_rng(0).permutation(3 * 3)
    pool = decode.page(cache, 16, perm)
    assert pool.shape == (9, 16, 2, 4)
    table = perm.reshape(3, 3)
    padded = np.pad(np.asarray(cache), ((0, 0), (0, 8), (0, 0), (0, 0)))
    for b in range(3):
        for j in range(3):
            np.testing.assert_array_equal(np.asarray(pool[table[b, j]]),
                                          padded[b, 16 * j: 16 * (j + 1)])


def test_budget_skips_groups_and_marks_the_run_incomplete(tmp_path):
    result = main(["--decode", "--smoke", "--out", str(tmp_path), "--decode-budget", "0",
                   "--decode-copy-mib", "1"])
    assert result["complete"] is False
    assert result["decode"]["rows"] == []
    assert json.loads(json.dumps(result["decode"]["skipped"])) == [
        {"batch": 2, "context": 256, "kv_heads": 2, "head_dim": 32, "q_heads": [4]}]


@pytest.mark.parametrize("argv, message", [
    (["--decode", "--memory"], "separate runs"),
    (["--decode", "--decode-cases", "2x4k"], "batch x context"),
    (["--decode", "--decode-page-size", "0"], "positive page size"),
])
def test_decode_argument_errors(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(argv + ["--out", str(tmp_path)])
    assert message in capsys.readouterr().err


def test_repeated_calls_are_chained_not_merged():
    """Calls sharing a cache copy each depend on the previous call's output (through an
    optimization barrier), so XLA cannot merge their products into one read of the cache; the
    outputs are those of independent calls."""
    calls, copies = 5, 2
    keys = jax.random.split(jax.random.key(3), calls + 2 * copies)
    qs = [jax.random.normal(k, (1, 1, 4, 8)) for k in keys[:calls]]
    caches = [(jax.random.normal(keys[calls + 2 * c], (1, 16, 4, 8)),
               jax.random.normal(keys[calls + 2 * c + 1], (1, 16, 4, 8)))
              for c in range(copies)]

    def fn(q, k, v, lengths):
        del lengths
        return jnp.einsum("bqhd,bkhd->bqhk", q, k) @ v[0, :, 0, :]

    run = decode.repeated(fn, calls)
    lengths = jnp.full((1,), 16, jnp.int32)
    jaxpr = jax.make_jaxpr(run)(qs, caches, lengths).jaxpr
    barriers = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
    assert len(barriers) == calls - 1
    # Each barrier takes the previous call's output alongside the next call's query.
    produced = {v for e in jaxpr.eqns if e.primitive.name != "optimization_barrier"
                for v in e.outvars}
    assert all(any(v in produced for v in e.invars) for e in barriers)
    outs = jax.jit(run)(qs, caches, lengths)
    for i, out in enumerate(outs):
        want = fn(qs[i], *caches[i % copies], lengths)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_repeated_calls_share_no_work_on_the_cache():
    """Work that reads only the cache (a transpose of K, as jax.nn's XLA path does) runs once
    per call, not once per cache copy: every call sees its cache through the barrier."""
    calls, copies = 4, 2
    q = jnp.ones((1, 1, 4, 8))
    cache = (jnp.ones((1, 16, 4, 8)), jnp.ones((1, 16, 4, 8)))

    def fn(q, k, v, lengths):
        del lengths
        return jnp.sin(k).sum() * q

    run = decode.repeated(fn, calls)
    text = jax.jit(run).lower([q] * calls, [cache] * copies,
                              jnp.ones((1,), jnp.int32)).compile().as_text()
    assert text.count("sine(") == calls


def test_rows_alternate_layouts_and_reverse_from_case_to_case(smoke):
    """Each implementation's contiguous and paged rows sit side by side, and the order of a
    case's rows is the previous case's reversed: no layout or implementation is always first."""
    result, _ = smoke
    rows = result["decode"]["rows"]
    first = [(r["impl"], r["layout"]) for r in rows if r["q_len"] == 1]
    second = [(r["impl"], r["layout"]) for r in rows if r["q_len"] == 4]
    assert first[:2] == [("pallas_flash", "contiguous"), ("pallas_flash", "paged")]
    assert second == first[::-1]
    assert [r["q_len"] for r in rows] == [1] * len(first) + [4] * len(second)


def test_decode_table_says_where_the_host_set_the_pace():
    gpu = {"timer": "gpu"}
    rows = [_row("pallas_flash", "contiguous", 1, 1, 4096, 0.0105, wall_ms=0.0178, **gpu),
            _row("pallas_flash", "contiguous", 4, 1, 4096, 0.0140, wall_ms=0.0150, **gpu),
            _row("pallas_flash", "contiguous", 1, 1, 16384, 0.0282, wall_ms=0.0400,
                 timer="wall")]
    section = {"rows": rows, "copy": {"gbps": 4000.0, "what": "x + 1", "bytes": 1, "ms": 1.0}}
    _, _, notes = report.decode_table(section)
    (note,) = [n for n in notes if "wall-clock" in n]
    # Only the first row: the second is within HOST_BOUND, the third has no GPU time.
    assert note.endswith("in 32:8 1 × 4k q_len 1 (17.8 against 10.5 µs)")
