"""benchmarks/step_trace.py: the case syntax, the chained program, and one small run of each pass
(on a CPU, in interpret mode, the trace has no stream tracks, so there it checks the plumbing,
not the breakdown, which tests/benchmarks/test_decode_trace.py checks on a hand-made trace)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import example_module

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_trace.py"


@pytest.fixture(scope="module")
def step_trace():
    with example_module(SCRIPT, "step_trace") as module:
        yield module


def test_parse_case(step_trace):
    impl, case, pass_ = step_trace.parse_case("cudnn:2x8kx32x8x128:causal:bwd")
    assert (impl, pass_) == ("cudnn", "bwd")
    assert (case.batch, case.seq, case.q_heads, case.kv_heads, case.head_dim, case.causal) == (
        2, 8192, 32, 8, 128, True)
    assert not step_trace.parse_case("pallas_flash:1x128x2x1x32:full:step")[1].causal


@pytest.mark.parametrize("text", [
    "flash:1x128x2x1x32:causal:fwd",          # not an implementation of the benchmark
    "pallas_flash:1x128x2x1x32:causal",       # no pass
    "pallas_flash:1x128x2x1x32:window:fwd",   # not a mask
    "pallas_flash:1x128x2x1x32:causal:grad",  # not a pass
])
def test_parse_case_rejects(step_trace, text):
    with pytest.raises(ValueError, match="IMPL:SHAPE:MASK:PASS"):
        step_trace.parse_case(text)


def test_parse_case_rejects_a_short_shape(step_trace):
    with pytest.raises(ValueError, match="BATCHxSEQxQ_HEADSxKV_HEADSxHEAD_DIM"):
        step_trace.parse_case("pallas_flash:1x128x2x32:causal:fwd")


def test_chained_calls_run_in_order_and_stay_apart(step_trace):
    # Each call sees `first` (not the previous output), and the program keeps every call: the
    # barrier stops XLA from merging equal calls into one.
    run = jax.jit(step_trace.chained(lambda x, y: jnp.sin(x) * y, 3))
    x, y = jax.random.normal(jax.random.key(0), (2, 8, 8))
    outs = run(x, y)
    assert len(outs) == 3
    for out in outs:
        np.testing.assert_allclose(out, np.sin(x) * y, rtol=1e-6)
    # Compiled, the three sines stay three; without the barriers XLA keeps one.
    assert run.lower(x, y).compile().as_text().count("sine(") == 3
    merged = jax.jit(lambda x, y: tuple(jnp.sin(x) * y for _ in range(3)))
    assert merged.lower(x, y).compile().as_text().count("sine(") == 1


def test_run_reports_stream_kernels_only_on_a_gpu(step_trace, tmp_path):
    cases = [f"pallas_flash:1x128x2x1x32:causal:{p}" for p in step_trace.PASSES]
    report = step_trace.main(["--cases", ",".join(cases), "--calls", "2", "--out", str(tmp_path)])
    assert [row["pass"] for row in report["cases"]] == list(step_trace.PASSES)
    for row in report["cases"]:
        assert row["shape"] == "1x128x2x1x32" and row["causal"]
        if jax.default_backend() == "gpu":
            assert row["per_call_us"] > 0 and row["kernels"]
        else:  # interpret mode: the trace has no stream tracks
            assert row["per_call_us"] is None and row["kernels"] == []
    assert list(tmp_path.glob("step_trace_*.json"))


def test_a_bad_case_fails_before_any_case_runs(step_trace, tmp_path):
    with pytest.raises(ValueError, match="IMPL:SHAPE:MASK:PASS"):
        step_trace.main(["--cases", "pallas_flash:1x128x2x1x32:causal:fwd,nope", "--out",
                         str(tmp_path)])
    assert not list(tmp_path.glob("step_trace_*"))
