"""GPU time read from a profiler trace: how long a program kept the GPU busy, apart from the host.

A program of microsecond kernels can finish on the GPU before the host has dispatched the next
one, and then a wall clock times the host (XLA's dispatch of a program of 64 decode calls
costs about as much host time as the GPU spends running it, docs/performance.md,
"Decoding"). `device_times` runs each program under `jax.profiler.trace` and measures the span
of its kernels on the GPU's stream tracks instead: first kernel start to last kernel end.

The trace-reading helpers here are shared with the trace scripts in benchmarks/.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import statistics
import tempfile
import time
import warnings
from typing import Any

import jax

# Thread names of a GPU's stream tracks in a JAX Perfetto trace ("Stream #7(...)"); the
# "XLA Ops" track repeats every op as a span from its launch and is not a GPU time.
STREAM_PREFIX = "Stream"
# Idle seconds before each traced program: a gap in the GPU's work that no program of chained
# calls has inside it, so that the kernels split into programs at the gaps (SPLIT_S).
PAUSE_S = 0.002
SPLIT_S = PAUSE_S / 2


def load_events(path: str) -> list[dict]:
    """The trace events of a Chrome / Perfetto JSON trace file (gzipped or not)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def find_trace(log_dir: str) -> str:
    """The Perfetto trace `jax.profiler.trace(log_dir, create_perfetto_trace=True)` wrote."""
    found = sorted(glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"),
                             recursive=True))
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir}")
    return found[-1]


def track_names(events: list[dict], kind: str) -> dict:
    """The names a trace's metadata events give: kind "process_name" maps pid -> name,
    "thread_name" maps (pid, tid) -> name."""
    return {(e["pid"] if kind == "process_name" else (e["pid"], e.get("tid"))): e["args"]["name"]
            for e in events if e.get("ph") == "M" and e.get("name") == kind}


def stream_kernels(events: list[dict]) -> list[dict]:
    """The complete ("X") events on GPU stream tracks, in start order."""
    threads = track_names(events, "thread_name")
    kernels = [e for e in events if e.get("ph") == "X" and "dur" in e
               and threads.get((e["pid"], e.get("tid")), "").startswith(STREAM_PREFIX)]
    return sorted(kernels, key=lambda e: float(e["ts"]))


def bursts(kernels: list[dict], gap_us: float) -> list[list[dict]]:
    """Kernels (in start order) split wherever the GPU stood idle for more than gap_us: the
    stream kernels of one program each, when programs ran apart."""
    out: list[list[dict]] = []
    end = None
    for e in kernels:
        ts = float(e["ts"])
        if end is None or ts - end > gap_us:
            out.append([])
        out[-1].append(e)
        end = max(end or ts, ts + float(e["dur"]))
    return out


def span_us(kernels: list[dict]) -> float:
    """First kernel start to last kernel end, in microseconds."""
    return (max(float(e["ts"]) + float(e["dur"]) for e in kernels)
            - float(kernels[0]["ts"]))


def device_times(jobs: list[tuple[Any, tuple]], rounds: int = 3) -> list[list[float] | None]:
    """Per (f, args) of jobs: the GPU seconds of one call f(*args) in each of `rounds` rounds
    (every job once a round, the order reversed from one round to the next), from one profiler
    trace; None for every job off a GPU, and for a job whose calls did not each show as one
    burst of the same number of kernels (then the trace cannot tell its time).

    Each call runs alone, after PAUSE_S of idle GPU, and is waited for, so that its kernels
    form one burst in the trace. The jobs must already be compiled and warm."""
    if jax.default_backend() != "gpu" or not jobs:
        return [None] * len(jobs)
    order = [i for r in range(rounds)
             for i in (range(len(jobs)) if r % 2 == 0 else reversed(range(len(jobs))))]
    try:
        with tempfile.TemporaryDirectory() as log_dir:
            with jax.profiler.trace(log_dir, create_perfetto_trace=True):
                for i in order:
                    f, args = jobs[i]
                    time.sleep(PAUSE_S)
                    jax.block_until_ready(f(*args))
            found = bursts(stream_kernels(load_events(find_trace(log_dir))), SPLIT_S * 1e6)
    except Exception as e:  # noqa: BLE001 - a profiler that cannot trace leaves the wall clock
        # The jobs ran before (the caller timed them), so what failed here is the profiler or
        # its trace; the rows keep their wall-clock times.
        warnings.warn(f"no GPU times from a trace ({type(e).__name__}: {e}); the wall clock's "
                      "stand", stacklevel=2)
        return [None] * len(jobs)
    if len(found) != len(order):
        return [None] * len(jobs)
    times: list[list[float] | None] = []
    for i in range(len(jobs)):
        mine = [b for b, j in zip(found, order) if j == i]
        same = len({len(b) for b in mine}) == 1
        times.append([span_us(b) * 1e-6 for b in mine] if same else None)
    return times


def device_times_of(jobs: list[tuple[Any, tuple]],
                    results: list[tuple[Any, Any]]) -> list[list[float] | None]:
    """`device_times` of the jobs that `timing.time_interleaved` timed, given its results
    ((times or the exception, last output) per job); None for a job that raised."""
    ran = [i for i, (times, _) in enumerate(results) if not isinstance(times, Exception)]
    found = dict(zip(ran, device_times([jobs[i] for i in ran])))
    return [found.get(i) for i in range(len(jobs))]


def smaller_time(wall: float, gpu_times: list[float] | None) -> tuple[float, str]:
    """(time, "wall" or "gpu"): the smaller of a wall-clock time and the median of GPU times
    (the same unit). Each bounds the kernels' own time from above: the wall clock includes the
    host's dispatch where that sets the pace, the trace the profiler's overhead."""
    gpu = statistics.median(gpu_times) if gpu_times else None
    return (gpu, "gpu") if gpu is not None and gpu < wall else (wall, "wall")
