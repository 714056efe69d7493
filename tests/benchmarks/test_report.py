"""The Markdown report (``python -m pallas_flash.bench --report``): the committed tables are the
ones the committed results files give, and the block rewriting touches nothing else."""

from __future__ import annotations

import json
import os
import re

import pytest

from pallas_flash.bench import report
from pallas_flash.bench.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGETS = ("docs/performance.md", "README.md")


def _blocks(text):
    return {m.group("name"): m.group("attrs") for m in report._BLOCK_RE.finditer(text)}


def test_committed_tables_are_generated_from_committed_results():
    """Regenerating every block from the files its marker names changes nothing, so no table
    can drift from its JSON (run the report, never edit a table by hand)."""
    with open(os.path.join(ROOT, "docs/performance.md"), encoding="utf-8") as f:
        blocks = _blocks(f.read())
    assert {"speed", "memory"} <= set(blocks), blocks
    for target in TARGETS:
        with open(os.path.join(ROOT, target), encoding="utf-8") as f:
            for name, attrs in _blocks(f.read()).items():
                sources = report._sources_of(attrs)
                assert sources, f"{target}: block {name} names no results file"
                for path in sources:
                    assert os.path.isfile(os.path.join(ROOT, path)), f"{target}: {path}"
    result = report.run_report([], check=True, plot=False, root=ROOT)
    assert result["changed"] == [], (
        "out of date; run python -m pallas_flash.bench --report:\n" + "\n".join(result["notes"]))


def _row(case, causal, impl, fwd_ms, bwd_ms, **extra):
    b, s, hq, hkv, d = (int(x) for x in case.split("x"))
    flops = 4.0 * b * hq * s * s * d / (2 if causal else 1)
    return {"case": case, "variant": None, "batch": b, "seq": s, "q_heads": hq,
            "kv_heads": hkv, "head_dim": d, "causal": causal, "impl": impl, "status": "ok",
            "error": None, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms,
            "fwd_tflops": flops / fwd_ms / 1e9, "bwd_tflops": 2.5 * flops / bwd_ms / 1e9,
            "err_vs_ref": 2.1e-3, **extra}


META = {"gpu": "NVIDIA H200", "backend": "gpu", "jax_version": "0.11.2", "git_commit": "abc1234",
        "dtype": "bf16", "timer": "pipelined", "iters_fwd": 20, "iters_fwdbwd": 10}


@pytest.fixture
def tree(tmp_path):
    """A repository-like folder: results, docs/performance.md with blocks, a README."""
    rows = [_row("2x8192x16x16x128", False, "cudnn", 1.8, 5.3),
            _row("2x8192x16x16x128", False, "pallas_flash", 1.7, 5.6,
                 fwd_vs_cudnn=1.8 / 1.7, bwd_vs_cudnn=5.3 / 5.6),
            {**_row("2x8192x8x8x256", True, "cudnn", 1.0, 1.0), "status": "error",
             "error": "OOM: a | b"}]
    sweep = {"shape": {"batch": 1, "q_heads": 16, "kv_heads": 16, "head_dim": 128,
                       "causal": True, "dtype": "bf16"},
             "longest_seq_ok": {"pallas_flash": 65536},
             "points": [
                 {"impl": "pallas_flash", "seq": 32768, "status": "ok", "peak_bytes": 5 << 28,
                  "floor_bytes": 1 << 30, "peak_over_floor": 1.25, "step_s": 0.1},
                 {"impl": "pallas_flash", "seq": 65536, "status": "ok", "peak_bytes": 5 << 29,
                  "floor_bytes": 2 << 30, "peak_over_floor": 1.25, "step_s": 0.4},
                 {"impl": "xla", "seq": 32768, "status": "error", "floor_bytes": 1 << 30,
                  "error": "OOM: RESOURCE_EXHAUSTED: out of memory"},
                 {"impl": "xla", "seq": 65536, "status": "skipped", "floor_bytes": 2 << 30,
                  "error": "failed at 32k"}]}
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "bench_h200_abc1234.json").write_text(
        json.dumps({"meta": META, "complete": True, "results": rows}))
    (results / "memory_h200_abc1234.json").write_text(
        json.dumps({"meta": META, "complete": True, "memory": sweep}))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "performance.md").write_text(
        "# Title\n\nkept\n<!-- bench-report:speed -->\nold table\n<!-- /bench-report:speed -->\n"
        "between\n<!-- bench-report:memory -->\n<!-- /bench-report:memory -->\nend\n")
    (tmp_path / "README.md").write_text(
        "intro\n<!-- bench-report:headline -->\n<!-- /bench-report:headline -->\noutro\n")
    return tmp_path


FILES = ["benchmarks/results/bench_h200_abc1234.json",
         "benchmarks/results/memory_h200_abc1234.json"]


def test_report_rewrites_only_the_blocks(tree):
    result = report.run_report(FILES, plot=False, root=str(tree))
    assert result["changed"] == ["docs/performance.md", "README.md"]
    perf = (tree / "docs" / "performance.md").read_text()
    outside = re.sub(r"<!-- bench-report:.*?<!-- /bench-report:\w+ -->", "#", perf, flags=re.S)
    assert outside == "# Title\n\nkept\n#\nbetween\n#\nend\n"
    assert "old table" not in perf
    assert ("<!-- bench-report:speed source=benchmarks/results/bench_h200_abc1234.json -->"
            in perf)
    # Our row before the baseline; ratios and TFLOP/s as computed; an error row escaped.
    speed = perf[perf.index("| case |"):]
    assert speed.index("| pallas_flash |") < speed.index("| cudnn | 1.800")
    assert "| 2 × 8192 × 16 × 16 × 128 | full | pallas_flash | 1.700 | 646.8 | 5.600 | 490.9 |" \
           " 1.06 | 0.95 |" in speed
    assert "| causal | cudnn | error: OOM: a \\| b | – |" in speed
    assert "commit `abc1234`, pipelined timer" in perf
    # The memory table: the floor, peaks with their ratio, an OOM, a skipped point.
    assert "| floor | 1.00 | 2.00 | – |" in perf
    assert "| pallas_flash | 1.25 (1.25×) | 2.50 (1.25×) | 64k |" in perf
    assert "| xla | out of memory | – | none |" in perf
    readme = (tree / "README.md").read_text()
    assert readme.startswith("intro\n<!-- bench-report:headline source=") and readme.endswith(
        "<!-- /bench-report:headline -->\noutro\n")
    assert "| 2 × 8192, 16 heads, d 128 | full | 647 / 611 | 1.06 | 491 / 519 | 0.95 |" in readme


def test_report_without_files_regenerates_from_the_markers(tree):
    report.run_report(FILES, plot=False, root=str(tree))
    before = {t: (tree / t).read_text() for t in TARGETS}
    assert report.run_report([], check=True, plot=False, root=str(tree))["changed"] == []
    # A hand edit inside a block is found by --check and undone by a plain run.
    perf = tree / "docs" / "performance.md"
    perf.write_text(perf.read_text().replace("646.8", "700.0"))
    assert report.run_report([], check=True, plot=False,
                             root=str(tree))["changed"] == ["docs/performance.md"]
    assert "700.0" in perf.read_text()  # --check writes nothing
    report.run_report([], plot=False, root=str(tree))
    assert {t: (tree / t).read_text() for t in TARGETS} == before


def test_blocks_without_results_and_files_without_blocks_are_left_alone(tree):
    (tree / "README.md").write_text("no blocks here\n")
    result = report.run_report([], plot=False, root=str(tree))
    assert result["changed"] == []
    assert "README.md: no bench-report block, skipped" in result["notes"]
    assert any("no bench results given or named: left as it is" in n for n in result["notes"])
    assert (tree / "README.md").read_text() == "no blocks here\n"


def test_cli_report_check_and_plots(tree, monkeypatch):
    monkeypatch.chdir(tree)
    with pytest.raises(SystemExit, match="out of date"):
        main(["--report", *FILES, "--check"])
    main(["--report", *FILES])
    main(["--report", "--check"])
    pytest.importorskip("matplotlib")
    assert (tree / "docs" / "performance_speed.png").stat().st_size > 0
    assert (tree / "docs" / "performance_memory.png").stat().st_size > 0


def test_a_results_file_of_the_wrong_kind_is_refused(tree):
    perf = tree / "docs" / "performance.md"
    perf.write_text("<!-- bench-report:memory source=benchmarks/results/bench_h200_abc1234.json"
                    " -->\n<!-- /bench-report:memory -->\n")
    with pytest.raises(ValueError, match="needs memory results"):
        report.run_report([], plot=False, root=str(tree))


def test_a_case_measured_again_replaces_the_earlier_row():
    """Two files with the same (case, mask, implementation): the later measurement stands, in
    the earlier one's place, and a case only the earlier file has stays."""
    old = {"meta": META, "results": [_row("2x8192x8x8x256", True, "pallas_flash", 0.785, 3.760),
                                     _row("2x8192x8x8x64", True, "pallas_flash", 1.1, 3.7)]}
    new = {"meta": META, "results": [_row("2x8192x8x8x256", True, "pallas_flash", 0.789, 3.881)]}
    rows = [line for line in report.markdown_speed([("a.json", old), ("b.json", new)]).splitlines()
            if line.startswith("| 2 × 8192")]
    assert len(rows) == 2
    assert "| 0.789 |" in rows[0] and "0.785" not in rows[0]
    assert "| 2 × 8192 × 8 × 8 × 64 |" in rows[1]


def test_a_run_cut_short_keeps_only_the_cases_it_finished(tmp_path):
    """A results file of a run its time limit stopped (complete: false) loses the case it
    stopped in before our row: that case keeps the earlier file's rows, cuDNN's included, and
    the source line says the run was cut. A finished file keeps every row."""
    old = {"meta": META, "complete": True,
           "results": [_row("2x8192x8x8x256", True, "pallas_flash", 0.785, 3.760),
                       _row("2x8192x8x8x256", True, "cudnn", 0.912, 3.441)]}
    cut = {"meta": META, "complete": False,
           "results": [_row("2x8192x8x8x64", True, "pallas_flash", 1.1, 3.7),
                       _row("2x8192x8x8x64", True, "cudnn", 1.2, 3.6),
                       _row("2x8192x8x8x256", True, "cudnn", 0.919, 3.661)]}
    paths = []
    for name, data in (("old.json", old), ("cut.json", cut)):
        (tmp_path / name).write_text(json.dumps(data))
        paths.append(str(tmp_path / name))
    loaded = [(p, report.load_result(p)[1]) for p in paths]
    assert [r["case"] for r in loaded[1][1]["results"]] == ["2x8192x8x8x64"] * 2
    assert len(loaded[0][1]["results"]) == 2
    text = report.markdown_speed(loaded)
    rows = [line for line in text.splitlines() if line.startswith("| 2 × 8192 × 8 × 8 × 256")]
    assert len(rows) == 2 and "| 0.912 |" in rows[1] and "0.919" not in text
    sources = [line for line in text.splitlines() if line.startswith("Source:")]
    assert "cut by its time limit" not in sources[0] and "cut by its time limit" in sources[1]


def test_a_case_in_another_dtype_is_a_row_of_its_own():
    """The same case in fp16 neither replaces the bf16 row nor reads like it."""
    bf16 = {"meta": META, "results": [_row("2x8192x16x16x128", True, "pallas_flash", 0.9, 3.0)]}
    fp16_row = dict(_row("2x8192x16x16x128", True, "pallas_flash", 0.94, 3.3), dtype="fp16")
    fp16 = {"meta": META, "results": [fp16_row]}
    rows = [line for line in report.markdown_speed([("a.json", bf16), ("b.json", fp16)]
                                                   ).splitlines() if line.startswith("| 2 × 8192")]
    assert len(rows) == 2
    assert "(fp16)" not in rows[0] and "| 0.900 |" in rows[0]
    assert rows[1].startswith("| 2 × 8192 × 16 × 16 × 128 (fp16) |") and "| 0.940 |" in rows[1]


def test_speed_targets_count_rows_and_name_the_misses():
    """Under the speed table: rows meeting each target, the misses by name, and tokamax only
    where its row and ours come from one run."""
    def pair(case, causal, ours_ms, cudnn_ms, tokamax_ms=None):
        rows = [dict(_row(case, causal, "pallas_flash", *ours_ms),
                     fwd_vs_cudnn=cudnn_ms[0] / ours_ms[0], bwd_vs_cudnn=cudnn_ms[1] / ours_ms[1]),
                _row(case, causal, "cudnn", *cudnn_ms)]
        if tokamax_ms:
            rows.append(_row(case, causal, "tokamax", *tokamax_ms))
        return rows
    old = {"meta": META, "results": pair("2x8192x8x8x64", True, (1.0, 3.0), (1.2, 3.3),
                                         (0.9, 3.5))}
    new = {"meta": META, "results": (pair("2x8192x8x8x256", True, (1.0, 3.0), (1.04, 2.9),
                                          (1.1, 2.8))
                                     + pair("2x8192x8x8x64", True, (1.0, 3.0), (1.2, 3.3)))}
    text = report.markdown_speed([("a.json", old), ("b.json", new)])
    assert "forward at least 1.05× cuDNN: 1 of 2 rows; short: 2 × 8192 × 8 × 8 × 256 causal (1.040×)" in text
    assert "backward at least 1.00× cuDNN: 1 of 2 rows; short: 2 × 8192 × 8 × 8 × 256 causal (0.967×)" in text
    # The head_dim 64 row was measured again without tokamax: its older tokamax row does not count.
    assert "same run: 0 of 1 rows; short (tokamax's time over ours): 2 × 8192 × 8 × 8 × 256 causal (bwd 0.933×)" in text
