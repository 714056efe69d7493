"""benchmarks/guard_cost.py on the CPU: the many-layer step it times runs, for every backend a
machine can serve, and its JSON holds what it printed (the timings themselves mean nothing
here: interpret mode)."""

from __future__ import annotations

import json

import jax.numpy as jnp
from pathlib import Path

from helpers import example_module

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "guard_cost.py"


def test_smoke_runs_and_records_every_backend(tmp_path):
    with example_module(_SCRIPT, "guard_cost_script") as gc:
        record = gc.main(["--shape", "1x40x2x64", "--layers", "2", "--iters", "1",
                          "--backends", "auto,triton", "--causal", "0,1",
                          "--guarded-cluster", "1,2", "--out", str(tmp_path)])
    rows = record["rows"]
    assert [(r["causal"], r["backend"], r["guarded_cluster"]) for r in rows] == [
        (False, "auto", 1), (False, "auto", 2), (False, "triton", 1),
        (True, "auto", 1), (True, "auto", 2), (True, "triton", 1)]
    assert all(r["step_ms"] > 0 and r["per_layer_ms"] == r["step_ms"] / 2 for r in rows)
    assert json.loads((tmp_path / "guard_cost.json").read_text())["rows"] == rows


def test_guarded_cluster_switches_autos_forward_and_restores_it():
    from pallas_flash import guarded
    real = guarded.mosaic_forward
    with example_module(_SCRIPT, "guard_cost_script") as gc:
        with gc.guarded_cluster(1):
            assert guarded.mosaic_forward.default_forward_config(128).cluster == 1
            assert guarded.mosaic_forward.default_forward_config(64).cluster == 1
        seen = []
        with gc.guarded_cluster(2):
            real_forward = real.forward
            try:
                real.forward = lambda spec, q, *a, config=None: seen.append(config.cluster)
                guarded.mosaic_forward.forward(None, jnp.zeros((1, 8, 1, 128)))
                guarded.mosaic_forward.forward(None, jnp.zeros((1, 8, 1, 64)))
            finally:
                real.forward = real_forward
        assert seen == [2, 1], seen
        assert guarded.mosaic_forward is real
