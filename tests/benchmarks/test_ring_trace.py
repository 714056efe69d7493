"""benchmarks/ring_trace.py: the overlap measure on a hand-made trace, and one --smoke capture
on the CPU host devices of conftest.py (interpret mode: it checks that a trace with the ring's
transfers is written and read back, not the overlap, which needs GPU streams)."""

import gzip
import json
from pathlib import Path

import jax
import pytest

from helpers import example_module

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "ring_trace.py"


@pytest.fixture(scope="module")
def ring_trace():
    with example_module(SCRIPT, "ring_trace") as module:
        yield module


def _meta(pid, tid, kind, name):
    event = {"ph": "M", "pid": pid, "name": kind, "args": {"name": name}}
    if tid is not None:
        event["tid"] = tid
    return event


def _span(pid, tid, name, ts, dur):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


def _gpu_trace():
    # GPU 0: kernels on stream 7 at [0, 100) and [150, 250), NCCL on stream 9 at [50, 170) and
    # [300, 320): 50 + 20 of its 140 us lie under a kernel. The "XLA Ops" track's spans cover
    # everything and must not count. GPU 1: a transfer and no kernel.
    return [
        _meta(1, None, "process_name", "/device:GPU:0"),
        _meta(1, 7, "thread_name", "Stream #7(Compute)"),
        _meta(1, 9, "thread_name", "Stream #9(Collectives)"),
        _meta(1, 3, "thread_name", "XLA Ops"),
        _meta(2, None, "process_name", "/device:GPU:1"),
        _meta(2, 4, "thread_name", "Stream #4"),
        _span(1, 7, "pallas_flash_mosaic_fwd", 0, 100),
        _span(1, 7, "pallas_flash_mosaic_bwd_fused", 150, 100),
        _span(1, 9, "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 50, 120),
        _span(1, 9, "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 300, 20),
        _span(1, 3, "collective-permute-start.1", 0, 400),
        _span(1, 3, "pallas_flash_mosaic_fwd", 0, 400),
        _span(1, 7, "loop_fusion", 100, 300),
        _span(2, 4, "ncclDevKernel_SendRecv", 10, 30),
    ]


def test_overlap_counts_stream_spans_only(ring_trace):
    gpu0, gpu1 = ring_trace.overlap_report(_gpu_trace())
    assert gpu0["device"] == "/device:GPU:0"
    assert (gpu0["transfers"], gpu0["kernels"]) == (2, 2)
    assert gpu0["transfer_ms"] == pytest.approx(0.140)
    assert gpu0["kernel_ms"] == pytest.approx(0.200)
    assert gpu0["overlapped_ms"] == pytest.approx(0.070)
    assert gpu0["overlap"] == pytest.approx(70 / 140)
    assert gpu1["device"] == "/device:GPU:1" and gpu1["kernels"] == 0
    assert gpu1["overlap"] == 0.0


def test_interval_helpers(ring_trace):
    merged = ring_trace.union([(5, 8), (0, 2), (1, 3), (8, 9)])
    assert merged == [(0, 3), (5, 9)]
    assert ring_trace.length(merged) == 7
    assert ring_trace.intersect(merged, [(2, 6), (8.5, 20)]) == pytest.approx(1 + 1 + 0.5)
    assert ring_trace.intersect(merged, []) == 0


def test_host_tracks_count_when_there_are_no_streams(ring_trace):
    events = [_meta(5, None, "process_name", "/host:CPU"),
              _meta(5, 1, "thread_name", "tf_XLAEigen/1"),
              _span(5, 1, "ppermute.3", 0, 10), _span(5, 1, "end: ppermute.3", 10, 1),
              _span(5, 1, "pallas_flash_fwd", 5, 10)]
    (row,) = ring_trace.overlap_report(events)
    assert (row["transfers"], row["kernels"]) == (1, 1)
    assert row["overlap"] == pytest.approx(0.5)


def test_load_events_reads_gzip_and_plain(ring_trace, tmp_path):
    events = _gpu_trace()
    plain, packed = tmp_path / "t.json", tmp_path / "t.json.gz"
    plain.write_text(json.dumps(events))
    with gzip.open(packed, "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert ring_trace.load_events(str(plain)) == events
    assert ring_trace.load_events(str(packed)) == events


@pytest.mark.skipif(len(jax.devices()) < 2, reason="the ring needs at least 2 devices")
def test_smoke_capture_finds_the_ring_transfers(ring_trace, tmp_path):
    report = ring_trace.main(["--smoke", "--devices", "2", "--warmup", "1",
                              "--out", str(tmp_path)])
    assert report["meta"]["devices"] == 2
    assert Path(report["meta"]["trace"]).is_file()
    saved = json.loads(next(tmp_path.glob("ring_trace_*.json")).read_text())
    assert saved["devices"] == report["devices"]
    # Both devices send and receive K/V shards; interpret-mode kernels are XLA ops, not spans
    # named after the kernels.
    assert report["devices"] and all(r["transfers"] > 0 for r in report["devices"])
