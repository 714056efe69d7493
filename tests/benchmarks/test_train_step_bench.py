"""The training-step benchmark (``python -m pallas_flash.bench.train_step``).

One run of the tiny preset checks the JSON, the step-0 loss against XLA attention and the
Markdown; one child process that compiles nothing checks the round trip through a child; the
other tests check the arithmetic, the XLA memory rule and the command line.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import statistics

import jax.numpy as jnp
import pytest
from helpers import tolerance

from pallas_flash.bench import llama, train_step
from pallas_flash.bench.train_step import main, markdown_train_step

SEQ = 256
STEPS = 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    # In this process (the default on a CPU, asked for so a GPU run checks the same JSON);
    # test_child_round_trip covers the child processes.
    result = main(["--preset", "tiny", "--impls", "pallas_flash,xla,tokamax", "--isolate", "no",
                   "--out", str(out)])
    (path,) = out.glob("train_step_*.json")
    return result, json.loads(path.read_text())


def _rows(saved):
    return {r["impl"]: r for r in saved["train_step"]["runs"]}


def test_tiny_run_writes_its_json(tiny):
    result, saved = tiny
    assert saved == json.loads(json.dumps(result))
    assert saved["complete"] is True
    meta = saved["meta"]
    for key in ("gpu", "backend", "jax_version", "git_commit", "date_utc", "argv", "flops"):
        assert key in meta
    assert meta["dtype"] == "float32" and meta["jax_version"]
    section = saved["train_step"]
    assert section["model"] == dataclasses.asdict(llama.PRESETS["tiny"])
    assert section["seqs"] == [SEQ] and section["steps"] == STEPS
    assert section["baseline"] == "xla" and section["isolated"] is False
    rows = _rows(saved)
    assert set(rows) == {"pallas_flash", "xla", "tokamax"}
    for impl in ("pallas_flash", "xla"):
        r = rows[impl]
        assert r["status"] == "ok", r
        assert r["seq"] == SEQ and r["batch"] == 1 and r["loss_finite"] is True
        assert len(r["step_times_ms"]) == STEPS
        assert r["step_ms"] == pytest.approx(statistics.median(r["step_times_ms"]))
        for key in ("compile_s", "first_step_s", "pipelined_step_ms", "model_tflops",
                    "peak_bytes", "state_bytes"):
            assert r[key] > 0, (impl, key)
        assert r["tokens_per_s"] == pytest.approx(SEQ / (r["step_ms"] * 1e-3))
        assert r["step_flops"] == llama.step_flops(llama.PRESETS["tiny"], 1, SEQ)
        # The peak holds at least the parameters and the Adam state it updates.
        assert r["peak_bytes"] >= r["state_bytes"]
        assert r["peak_source"] == "memory_analysis"
    assert rows["xla"]["speedup_vs_baseline"] == 1.0
    assert rows["pallas_flash"]["speedup_vs_baseline"] == pytest.approx(
        rows["xla"]["step_ms"] / rows["pallas_flash"]["step_ms"])
    assert rows["pallas_flash"]["peak_vs_baseline"] == pytest.approx(
        rows["pallas_flash"]["peak_bytes"] / rows["xla"]["peak_bytes"])
    if importlib.util.find_spec("tokamax") is None:
        assert rows["tokamax"]["status"] == "skipped"
        assert "not importable" in rows["tokamax"]["error"]


def test_step0_loss_matches_xla_attention(tiny):
    # Same parameters and batch in both processes; only the attention differs.
    rows = _rows(tiny[1])
    ours, xla = rows["pallas_flash"]["loss_first"], rows["xla"]["loss_first"]
    assert math.isfinite(ours) and math.isfinite(xla)
    assert abs(ours - xla) / abs(xla) <= tolerance(jnp.float32), (ours, xla)
    assert rows["pallas_flash"]["loss_vs_baseline"] == pytest.approx(abs(ours - xla) / abs(xla))
    # Adam moved the parameters: the last loss is another number.
    assert rows["xla"]["loss_last"] != xla


def test_markdown_table(tiny):
    saved = tiny[1]
    body = markdown_train_step([("results/train_step_x.json", saved)])
    assert body.startswith("Source: `results/train_step_x.json`: ")
    assert "2 layers, d_model 64, 4 q / 2 kv heads of 16, SwiGLU 128, vocab 256 (untied)" in body
    header = ("| sequence | implementation | step | back to back | tokens/s | TFLOP/s "
              "| × xla speed | peak memory | peak / xla | compile | step-0 loss |")
    assert header in body
    table = [line for line in body.splitlines() if line.startswith("| 256 |")]
    assert [line.split(" | ")[1] for line in table] == ["pallas_flash", "tokamax", "xla"]
    # Every row has the header's cells, a skipped one included.
    assert {line.count(" | ") for line in table} == {header.count(" | ")}
    assert "| 256 | xla |" in body and "| 1.00 |" in body
    text = train_step.format_table(saved["train_step"])
    assert "pallas_flash" in text and "× xla speed" in text


def test_child_round_trip():
    # An unknown implementation fails in the child before anything compiles; the longer length
    # is then skipped. Both rows come back through the child's output.
    spec = {"impl": "flash9", "seqs": [128, 64], "batch": 1, "steps": 1, "warmup": 1, "seed": 0,
            "lr": 1e-4, "device_peak": True,
            "model": dataclasses.asdict(llama.PRESETS["tiny"])}
    rows = train_step.run_child(spec, timeout=300)
    assert [(r["seq"], r["status"]) for r in rows] == [(64, "error"), (128, "skipped")], rows
    assert "impl must be one of" in rows[0]["error"] and rows[1]["error"] == "failed at 64"


def test_markdown_without_a_run():
    body = markdown_train_step([("bench.json", {"meta": {}, "results": []})])
    assert body == "Not measured yet: `bench.json` holds no training-step run.\n"


def test_xla_is_skipped_where_its_scores_cannot_fit(monkeypatch):
    cfg = llama.PRESETS["llama8b-4l"]
    # 32 heads x 32k^2 scores, each layer keeping float32 and bf16 probabilities.
    assert train_step.xla_score_bytes(cfg, 1, 32768) == 32 * 32768**2 * (4 * 6 + 4)
    monkeypatch.setattr(train_step, "_device_stats", lambda: {"bytes_limit": 100 << 30})
    row = train_step.measure_point(cfg, "xla", 1, 32768, steps=1, warmup=1)
    assert row["status"] == "skipped" and "896 GiB" in row["error"], row


def test_step_flops_by_hand():
    cfg = llama.ModelConfig(d_model=8, n_layers=2, q_heads=2, kv_heads=1, head_dim=4,
                            mlp_dim=16, vocab=32)
    # per layer: wq 8x8, wk 8x4, wv 8x4, wo 8x8, three 8x16 = 576; head 8x32 = 256.
    matmul = 6 * 3 * 10 * (2 * 576 + 256)
    attention = 2 * 3.5 * 4 * 3 * 2 * 10 * 10 * 4 / 2
    assert llama.step_flops(cfg, 3, 10) == matmul + attention


def test_ratios_against_the_baseline():
    rows = [{"impl": "cudnn", "seq": 8192, "status": "ok", "step_ms": 100.0, "peak_bytes": 50,
             "loss_first": 10.0},
            {"impl": "pallas_flash", "seq": 8192, "status": "ok", "step_ms": 80.0,
             "peak_bytes": 40, "loss_first": 10.01},
            {"impl": "pallas_flash", "seq": 32768, "status": "ok", "step_ms": 500.0,
             "peak_bytes": 90, "loss_first": 10.0},
            {"impl": "cudnn", "seq": 32768, "status": "error", "error": "OOM"}]
    assert train_step.baseline_of(["pallas_flash", "xla", "cudnn"]) == "cudnn"
    train_step.add_ratios(rows, "cudnn")
    assert rows[1]["speedup_vs_baseline"] == 1.25 and rows[1]["peak_vs_baseline"] == 0.8
    assert rows[1]["loss_vs_baseline"] == pytest.approx(1e-3)
    assert rows[2]["speedup_vs_baseline"] is None  # the baseline failed at that length


@pytest.mark.parametrize("argv, message", [
    (["--impls", "pallas_flash,flash9"], "unknown impls"),
    (["--steps", "0"], "at least 1"),
    (["--heads", "6", "--kv-heads", "4"], "not a multiple of kv_heads"),
    (["--seqs", "1"], "at least 2"),
])
def test_cli_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err
