"""benchmarks/guard_cost.py on the CPU: the many-layer step it times runs, for every backend a
machine can serve, and its JSON holds what it printed (the timings themselves mean nothing
here: interpret mode)."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import example_module

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "guard_cost.py"


def test_smoke_runs_and_records_every_backend(tmp_path):
    with example_module(_SCRIPT, "guard_cost_script") as gc:
        record = gc.main(["--shape", "1x40x2x64", "--layers", "2", "--iters", "1",
                          "--backends", "auto,triton", "--causal", "0,1",
                          "--out", str(tmp_path)])
    rows = record["rows"]
    assert [(r["causal"], r["backend"]) for r in rows] == [
        (False, "auto"), (False, "triton"), (True, "auto"), (True, "triton")]
    assert all(r["step_ms"] > 0 and r["per_layer_ms"] == r["step_ms"] / 2 for r in rows)
    assert json.loads((tmp_path / "guard_cost.json").read_text())["rows"] == rows
