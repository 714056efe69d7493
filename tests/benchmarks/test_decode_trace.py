"""benchmarks/decode_trace.py: the per-call breakdown on a hand-made trace, the case syntax, and
one small run (on a CPU, in interpret mode, the trace has no stream tracks, so there it checks
the plumbing, not the breakdown)."""

from pathlib import Path

import jax
import pytest

from helpers import example_module

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_trace.py"


@pytest.fixture(scope="module")
def decode_trace():
    with example_module(SCRIPT, "decode_trace") as module:
        yield module


def _meta(pid, tid, name):
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def _span(tid, name, ts, dur):
    return {"ph": "X", "pid": 1, "tid": tid, "name": name, "ts": ts, "dur": dur}


def test_breakdown_counts_stream_kernels_per_call(decode_trace):
    # Two calls on stream 7: split kernel 10 us + combine 2 us each, 1 us gaps; the host
    # track's spans (which cover everything) must not count.
    events = [_meta(1, 7, "Stream #7(Compute)"), _meta(1, 3, "XLA Ops"),
              _span(7, "split", 100, 10), _span(7, "combine", 111, 2),
              _span(7, "split", 114, 10), _span(7, "combine", 125, 2),
              _span(3, "split", 0, 500)]
    result = decode_trace.breakdown(events, calls=2)
    assert result["per_call_us"] == pytest.approx((127 - 100) / 2)
    split, combine = result["kernels"]
    assert (split["name"], split["count"], split["mean_us"]) == ("split", 2, 10)
    assert split["per_call_us"] == pytest.approx(10)
    assert (combine["name"], combine["count"], combine["mean_us"]) == ("combine", 2, 2)
    assert decode_trace.breakdown([_span(3, "split", 0, 5)], calls=1)["per_call_us"] is None


@pytest.mark.parametrize("text,parsed", [
    ("mosaic:1:16k:1", ("mosaic", 1, 16384, 1)), ("xla:4:1000:2", ("xla", 4, 1000, 2)),
])
def test_parse_case(decode_trace, text, parsed):
    assert decode_trace.parse_case(text) == parsed


@pytest.mark.parametrize("text", ["cudnn:1:4k:1", "mosaic:1:4k"])
def test_parse_case_rejects(decode_trace, text):
    with pytest.raises(ValueError, match="BACKEND:BATCH:CONTEXT:Q_LEN"):
        decode_trace.parse_case(text)


def test_run_reports_stream_kernels_only_on_a_gpu(decode_trace, tmp_path):
    report = decode_trace.main(["--cases", "triton:1:256:1", "--calls", "2", "--q-heads", "4",
                                "--kv-heads", "2", "--head-dim", "32", "--out", str(tmp_path)])
    (row,) = report["cases"]
    assert row["context"] == 256
    assert row["cache_copies"] == 2   # the bench's copies for this cache, at most one a call
    if jax.default_backend() == "gpu":
        assert row["per_call_us"] > 0 and row["kernels"]
    else:  # interpret mode: the trace has no stream tracks
        assert row["per_call_us"] is None and row["kernels"] == []
    assert list(tmp_path.glob("decode_trace_*.json"))
