"""The context-parallel scaling benchmark (benchmarks/scaling.py) on CPU devices.

conftest.py forces four host devices, so the --smoke run times the ring over all four, checks it
against one device and compiles the memory predictions, in-process (interpret mode). It runs
once per module; the tests read its rows.
"""

import dataclasses
import json
import math
from pathlib import Path

import jax
import pytest

from helpers import example_module

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "scaling.py"
NUM_DEVICES = len(jax.devices())
pytestmark = pytest.mark.skipif(NUM_DEVICES < 2, reason="the ring needs at least 2 devices")


@pytest.fixture(scope="module")
def scaling():
    with example_module(SCRIPT, "scaling_bench") as module:
        yield module


@pytest.fixture(scope="module")
def smoke(scaling, tmp_path_factory):
    out = tmp_path_factory.mktemp("scaling")
    result = scaling.main(["--smoke", "--out", str(out)])
    return result, out


def _rows(result, kind, impl):
    return [r for r in result["rows"] if r["kind"] == kind and r["impl"] == impl]


def test_smoke_writes_json_with_every_row(smoke):
    result, out = smoke
    files = list(out.glob("scaling_*.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    assert saved["complete"] is True
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    assert saved["meta"]["devices"] == NUM_DEVICES
    kinds = [(r["kind"], r["impl"], r["seq"]) for r in saved["rows"]]
    assert kinds == [("time", "flash_attention", 256), ("time", "ring_attention", 256),
                     ("fit", "flash_attention", 256), ("fit", "flash_attention", 512),
                     ("fit", "ring_attention", 512), ("fit", "ring_attention", 1024)]


def test_smoke_times_are_finite_and_positive(smoke):
    result, _ = smoke
    single, = _rows(result, "time", "flash_attention")
    ring, = _rows(result, "time", "ring_attention")
    assert single["devices"] == 1 and ring["devices"] == NUM_DEVICES
    for row in (single, ring):
        assert row["status"] == "ok", row["error"]
        for name in ("ms", "tflops_total", "tflops_per_gpu"):
            assert math.isfinite(row[name]) and row[name] > 0, (name, row[name])
        assert len(row["times_ms"]) == 1 and all(t > 0 for t in row["times_ms"])
    assert ring["tflops_per_gpu"] == pytest.approx(ring["tflops_total"] / NUM_DEVICES)
    # The timed step's own memory analysis: each ring device holds 1/P of the inputs.
    assert ring["argument_bytes"] * NUM_DEVICES == single["argument_bytes"]
    assert ring["strategy"] == "ring" and ring["predicted_bytes"] > 0
    assert ring["efficiency"] == pytest.approx(single["ms"] / (NUM_DEVICES * ring["ms"]))


def test_smoke_ring_matches_one_device(smoke):
    result, _ = smoke
    ring, = _rows(result, "time", "ring_attention")
    assert ring["match"] is True
    assert ring["tolerance"] == 2e-2
    assert 0 <= ring["out_rel_err"] <= 2e-2
    assert 0 <= ring["grad_rel_err"] <= 2e-2


def test_smoke_fit_rows_are_per_device_predictions(smoke):
    result, _ = smoke
    fits = _rows(result, "fit", "flash_attention") + _rows(result, "fit", "ring_attention")
    for row in fits:
        assert row["status"] == "ok", row["error"]
        assert row["predicted_bytes"] == (row["argument_bytes"] + row["output_bytes"]
                                          + row["temp_bytes"] - row["alias_bytes"])
        if jax.default_backend() == "cpu":
            # The CPU reports no memory limit, so nothing is claimed to fit or not.
            assert row["limit_bytes"] is None and row["fits"] is None
        else:   # a GPU's limit; these tiny shapes fit
            assert row["limit_bytes"] > 0 and row["fits"] is True
        assert "not run" in row["method"]
    one_512, = [r for r in fits if r["impl"] == "flash_attention" and r["seq"] == 512]
    ring_512, = [r for r in fits if r["impl"] == "ring_attention" and r["seq"] == 512]
    # q, k, v and the cotangent: the ring holds 1/P of them on each device.
    assert one_512["argument_bytes"] == 4 * 512 * 2 * 16 * 2
    assert ring_512["argument_bytes"] * NUM_DEVICES == one_512["argument_bytes"]


def test_fit_stops_at_the_first_length_over_the_limit(scaling, smoke, tmp_path):
    """With a limit between the predictions for 256 and 512: 256 fits, 512 does not, and 1024
    is skipped without compiling."""
    result, _ = smoke
    pred = {r["seq"]: r["predicted_bytes"] for r in _rows(result, "fit", "flash_attention")}
    limit_gib = (pred[256] + pred[512]) / 2 / scaling.GIB
    args = scaling.build_parser().parse_args(["--smoke", "--mem-limit-gib", str(limit_gib)])
    scaling.resolve_defaults(args)
    shape = scaling.Shape(args.batch, args.heads, args.head_dim, args.causal, args.dtype)
    rec = scaling.Recorder({}, str(tmp_path), budget_s=600)
    scaling.run_fit(args, shape, scaling.SINGLE, [256, 512, 1024],
                    scaling.make_mesh(jax.devices()), rec)
    assert [(r["seq"], r["status"], r["fits"]) for r in rec.rows] == [
        (256, "ok", True), (512, "ok", False), (1024, "skipped", False)]
    table = scaling.format_table(rec.rows, NUM_DEVICES)
    assert "NOT run" in table and "longest predicted to fit, flash_attention: 256" in table


def test_spent_time_budget_gives_skipped_rows(scaling, tmp_path):
    """Nothing runs after the budget; every item still gets its row."""
    rows = scaling.main(["--smoke", "--time-budget", "0", "--out", str(tmp_path)])["rows"]
    assert len(rows) == 6
    assert all(r["status"] == "skipped" and "budget" in r["error"] for r in rows)


def test_devices_option(scaling):
    """--devices lists the ring sizes; each must fit the visible devices."""
    args = scaling.build_parser().parse_args(["--smoke", "--devices", "1,2"])
    scaling.resolve_defaults(args)
    assert args.devices == [1, 2]
    args = scaling.build_parser().parse_args(["--smoke", "--devices", str(NUM_DEVICES + 1)])
    with pytest.raises(SystemExit, match="--devices"):
        scaling.resolve_defaults(args)


def test_run_child_runs_the_one_device_ring(scaling):
    """Part 3's child: one step of the P=1 ring (what one GPU can show), with its memory
    analysis; the CPU reports no peak."""
    shape = scaling.Shape(batch=1, heads=2, head_dim=32, causal=True, dtype="fp32")
    row = scaling.run_child({"impl": scaling.RING, "seq": 64, "devices": 1, "strategy": "ring",
                             "shape": dataclasses.asdict(shape)})
    assert row["status"] == "ok", row["error"]
    assert row["step_s"] > 0 and row["argument_bytes"] == 4 * 64 * 2 * 32 * 4
    if jax.default_backend() == "cpu":
        assert row["peak_bytes"] is None


def test_run_fit_stops_at_the_first_length_that_fails(scaling, tmp_path):
    """Lengths run in order until one fails; longer ones are skipped, and the table names the
    longest that ran for each ring size."""
    args = scaling.build_parser().parse_args(["--smoke", "--devices", "2"])
    scaling.resolve_defaults(args)
    shape = scaling.Shape(args.batch, args.heads, args.head_dim, args.causal, args.dtype)
    rec = scaling.Recorder({}, str(tmp_path), budget_s=600)
    ran = []

    def runner(point, timeout_s):
        ran.append((point["impl"], point["devices"], point["seq"]))
        if point["seq"] > 512:
            return {"status": "oom", "error": "RESOURCE_EXHAUSTED", "peak_bytes": None}
        return {"status": "ok", "error": None, "peak_bytes": point["seq"] * 1000}

    mesh = scaling.make_mesh(jax.devices()[:2])
    scaling.run_measured(args, shape, scaling.RING, [256, 512, 1024, 2048], mesh, rec, runner)
    assert ran == [(scaling.RING, 2, 256), (scaling.RING, 2, 512), (scaling.RING, 2, 1024)]
    assert [(r["seq"], r["status"], r["fits"]) for r in rec.rows] == [
        (256, "ok", True), (512, "ok", True), (1024, "oom", False), (2048, "skipped", False)]
    table = scaling.format_table(rec.rows, 2)
    assert "longest that ran, ring_attention (2 dev): 512" in table
