"""The cold-start figure (``python -m pallas_flash.bench --cold-start``): fresh child processes,
their JSON, and the report's ``cold-start`` block.

One test runs the real thing on a tiny case (seven child processes, each importing jax); the
others check the arithmetic and the rendering on hand-made runs.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from pallas_flash.bench import cold_start, report
from pallas_flash.bench.__main__ import main

STEPS = 4


def _positive(x):
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_cold_start_runs_children_and_reports(tmp_path):
    out = tmp_path / "results"
    result = main(["--cold-start", "--cases", "1x128x2x2x32", "--impls", "pallas_flash,xla",
                   "--cold-start-steps", str(STEPS), "--out", str(out)])
    (path,) = out.glob("cold_start_*.json")
    saved = json.loads(path.read_text())
    assert saved == json.loads(json.dumps(result))
    assert saved["complete"] is True and saved["meta"]["jax_version"]
    section = saved["cold_start"]
    assert section["steps"] == STEPS and section["baseline"] == "xla"
    runs = {(r["impl"], r["cache"]): r for r in section["runs"]}
    assert set(runs) == {(i, c) for i in ("pallas_flash", "xla") for c in cold_start.CACHES}
    for (impl, cache), r in runs.items():
        assert r["status"] == "ok", r
        assert r["case"] == "1x128x2x2x32" and r["causal"] is True
        steps = r["step_s"]
        assert len(steps) == STEPS and all(_positive(t) for t in steps), r
        assert [r["step1_s"], r["step2_s"], r["step3_s"], r["stepN_s"]] == [*steps[:3], steps[-1]]
        assert r["step2_over_stepN"] == pytest.approx(steps[1] / steps[-1])
        assert r["step3_over_stepN"] == pytest.approx(steps[2] / steps[-1])
        # The clock starts before the child does: the three steps fit inside the figure,
        # after the imports and the inputs.
        at = r["at_s"]
        assert _positive(r["start_to_third_s"]) and r["start_to_third_s"] == at["third_step"]
        assert r["start_to_third_s"] >= sum(steps[:3]) + at["inputs"] - 1e-6
        stages = [at[k] for k in ("interpreter", "jax_imported", "devices", "impl_imported",
                                  "inputs", "third_step", "last_step")]
        assert stages == sorted(stages) and stages[0] > 0, at
        base = runs["xla", cache]["start_to_third_s"]
        assert r["minus_baseline_s"] == pytest.approx(r["start_to_third_s"] - base)
    # The cache settings reach the children: none has no folder, fill finds it empty, warm
    # finds what fill wrote.
    for impl in ("pallas_flash", "xla"):
        assert runs[impl, "none"]["jax_compilation_cache_dir"] is None
        assert "cache_files_at_start" not in runs[impl, "none"]
        assert runs[impl, "warm"]["jax_compilation_cache_dir"] == (
            runs[impl, "fill"]["jax_compilation_cache_dir"])
        assert runs[impl, "fill"]["cache_files_at_start"] == 0
        assert runs[impl, "warm"]["cache_files_at_start"] > 0

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "performance.md").write_text(
        "intro\n<!-- bench-report:cold-start -->\n<!-- /bench-report:cold-start -->\nend\n")
    report.run_report([str(path)], docs=str(docs), readme=str(tmp_path / "none.md"),
                      plot=False, root=str(tmp_path))
    block = (docs / "performance.md").read_text()
    assert "<!-- bench-report:cold-start source=results/cold_start_" in block
    rows = [line for line in block.splitlines() if re.match(r"\| (pallas_flash|xla) \|", line)]
    assert len(rows) == 6
    assert rows[0].startswith("| pallas_flash | off |") and rows[-1].startswith("| xla | warm |")
    assert "| step 2 / step 4 | step 3 / step 4 |" in block


def _run(impl, cache, start, steps, case="1x8192x16x16x128", causal=True):
    run = {"impl": impl, "cache": cache, "case": case, "causal": causal, "status": "ok",
           "step_s": steps, "start_to_third_s": start}
    cold_start.summarize(run)
    return run


def _section(runs, baseline="cudnn", steps=10):
    cold_start.add_baseline_differences(runs, baseline)
    return {"steps": steps, "dtype": "bf16", "baseline": baseline, "clock": cold_start.CLOCK,
            "runs": runs}


META = {"gpu": "NVIDIA H200", "backend": "gpu", "jax_version": "0.11.2", "git_commit": "abc1234",
        "dtype": "bf16"}
TENTH = [0.0025] * 7


def test_markdown_against_cudnn():
    runs = [_run("cudnn", "none", 5.0, [1.5, 0.0024, 0.0024, *TENTH]),
            _run("pallas_flash", "none", 17.5, [11.9, 0.003, 0.00275, *TENTH]),
            _run("pallas_flash", "warm", 7.5, [3.9, 0.0025, 0.0025, *TENTH]),
            {"impl": "cudnn", "cache": "warm", "case": "1x8192x16x16x128", "causal": True,
             "status": "error", "error": "exit 1: boom | bang"}]
    body = report.markdown_cold_start([("results/cs.json", {"meta": META,
                                                            "cold_start": _section(runs)})])
    assert "case 1 × 8192 × 16 × 16 × 128, causal, bf16, called 10 times" in body
    assert ("| implementation | cache | start → 3rd step | − cudnn | step 1 | step 2 | step 3 "
            "| step 10 | step 2 / step 10 | step 3 / step 10 |") in body
    # Ours first, by cache; the baseline's own difference is a dash; a failed run keeps its row.
    assert body.index("| pallas_flash | off |") < body.index("| pallas_flash | warm |") \
        < body.index("| cudnn | off |")
    assert ("| pallas_flash | off | 17.50 s | +12.50 s | 11.90 s | 3.000 ms | 2.750 ms "
            "| 2.500 ms | 1.20 | 1.10 |") in body
    assert "| pallas_flash | warm | 7.50 s | – | 3.90 s |" in body  # no warm cuDNN to compare
    assert "| cudnn | off | 5.00 s | – | 1.50 s | 2.400 ms |" in body
    assert "| cudnn | warm | error: exit 1: boom \\| bang | – | – |" in body
    text = report.format_cold_start_table(_section(runs))
    assert "+12.50 s" in text and "error: exit 1: boom | bang" in text


def test_markdown_of_several_cases_has_case_columns():
    runs = [_run("pallas_flash", "none", 9.0, [4.0, 0.01, 0.01, 0.01], case="1x128x2x2x32"),
            _run("pallas_flash", "none", 9.0, [4.0, 0.01, 0.01, 0.01], case="1x128x2x2x32",
                 causal=False)]
    body = report.markdown_cold_start([("cs.json", {"meta": META,
                                                    "cold_start": _section(runs, None, 4)})])
    assert "| case | mask | implementation | cache | start → 3rd step | step 1 |" in body
    assert "| 1 × 128 × 2 × 2 × 32 | full | pallas_flash | off | 9.00 s | 4.00 s |" in body


def test_block_without_cold_start_data_says_not_measured(tmp_path):
    (tmp_path / "bench.json").write_text(json.dumps({"meta": META, "results": []}))
    (tmp_path / "docs").mkdir()
    perf = tmp_path / "docs" / "performance.md"
    perf.write_text("<!-- bench-report:cold-start source=bench.json -->\n"
                    "<!-- /bench-report:cold-start -->\n")
    result = report.run_report([], plot=False, root=str(tmp_path))
    assert result["changed"] == ["docs/performance.md"]
    assert "Not measured yet: `bench.json` holds no cold-start run.\n" in perf.read_text()


def test_ratios_and_differences():
    run = _run("pallas_flash", "fill", 3.0, [2.0, 0.02, 0.03, 0.01])
    assert (run["step1_s"], run["stepN_s"]) == (2.0, 0.01)
    assert run["step2_over_stepN"] == pytest.approx(2.0)
    assert run["step3_over_stepN"] == pytest.approx(3.0)
    failed = {"impl": "xla", "cache": "fill", "case": run["case"], "status": "error"}
    cold_start.summarize(failed)
    assert "step1_s" not in failed
    cold_start.add_baseline_differences([run, failed], "xla")
    assert run["minus_baseline_s"] is None  # the baseline failed: nothing to compare with


def test_defaults_and_child_environment(monkeypatch):
    assert cold_start.default_impls("gpu") == ["pallas_flash", "cudnn"]
    assert cold_start.default_impls("cpu") == ["pallas_flash", "xla"]
    assert cold_start.baseline_of(["pallas_flash", "xla", "cudnn"]) == "cudnn"
    assert cold_start.baseline_of(["pallas_flash"]) is None
    env = cold_start.child_env({"JAX_COMPILATION_CACHE_DIR": "/tmp/c", "HOME": "/h",
                                "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    assert "JAX_COMPILATION_CACHE_DIR" not in env and env["HOME"] == "/h"
    # A user's allocator: the reservation at start that gpu.sh turns off for other jobs.
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in env
    assert env["PYTHONPATH"]


@pytest.mark.parametrize("argv, message", [
    (["--cold-start", "--cold-start-steps", "2"], "at least 3"),
    (["--cold-start", "--memory"], "separate runs"),
])
def test_cli_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err
