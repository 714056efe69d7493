"""Whether the ring's K/V transfers run under its attention kernels, read from a profiler trace.

`ring_attention` issues the ppermute that brings the next K/V shard before a step's kernels
and consumes it after them, so on a GPU the transfer (NCCL kernels on their own stream) should
run while pallas_flash's kernels run. This script shows it: it runs the jitted forward+backward
step of benchmarks/scaling.py a few times, then once more under `jax.profiler.trace` with a
Perfetto trace, and reads that trace back. Per GPU it reports the time its transfer kernels
run, the time pallas_flash's kernels run, and how much of the first lies under the second:

    overlap = |union(transfers) ∩ union(kernels)| / |union(transfers)|

On a GPU only the stream tracks count (the "XLA Ops" track repeats every op as a span from its
launch, which would overlap everything). Usage, from the repository root, with two or more GPUs:

    PYTHONPATH=. python benchmarks/ring_trace.py --seq 128k --out $OUT

It writes ring_trace_<time>.json (the per-device figures and the shape) to --out and keeps the
trace folder beside it for ui.perfetto.dev. `--smoke` runs a tiny step on 4 CPU host devices,
where the kernels run in interpret mode as many small XLA ops, so it checks the plumbing (a
trace with transfers is written and read), not the overlap.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
from pathlib import Path

if __name__ == "__main__" and "--smoke" in sys.argv[1:]:
    # As benchmarks/scaling.py does for its own --smoke: CPU host devices for the ring, asked
    # for before JAX starts its CPU backend (scaling.py asks only when it is the script).
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=4".strip()

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scaling  # noqa: E402

import jax  # noqa: E402

from pallas_flash.bench.trace import (  # noqa: E402
    STREAM_PREFIX, find_trace, load_events, track_names)

KERNEL_PATTERN = r"^pallas_flash"
# NCCL's kernels on a GPU; XLA:CPU's ppermute thunks on a host.
TRANSFER_PATTERN = r"^nccl|^ppermute|^collective-permute"


# ================================================================================================
# Reading a trace
# ================================================================================================


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same points as `intervals`."""
    merged: list[list[float]] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(hi - lo for lo, hi in intervals)


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Measure of the intersection of two disjoint sorted interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_report(events: list[dict], kernel_pattern: str = KERNEL_PATTERN,
                   transfer_pattern: str = TRANSFER_PATTERN) -> list[dict]:
    """Per device (trace process) that ran a transfer: its transfer and kernel time in ms and
    the fraction of the transfer time that some kernel covers.

    A process with stream tracks (a GPU) counts only events on them; a process without (a CPU
    host) counts every track. Names starting with "end: " (XLA:CPU's closing markers) are
    not spans of their own.
    """
    processes, threads = track_names(events, "process_name"), track_names(events, "thread_name")
    has_streams = {pid for (pid, _), name in threads.items() if name.startswith(STREAM_PREFIX)}
    kernel_re, transfer_re = re.compile(kernel_pattern), re.compile(transfer_pattern, re.I)
    spans: dict = {}
    for e in events:
        if e.get("ph") != "X" or "dur" not in e or e.get("name", "").startswith("end: "):
            continue
        pid = e["pid"]
        if (pid in has_streams
                and not threads.get((pid, e.get("tid")), "").startswith(STREAM_PREFIX)):
            continue
        kind = ("kernel" if kernel_re.search(e["name"])
                else "transfer" if transfer_re.search(e["name"]) else None)
        if kind:
            span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            spans.setdefault(pid, {"kernel": [], "transfer": []})[kind].append(span)
    rows = []
    for pid, found in sorted(spans.items()):
        if not found["transfer"]:
            continue
        transfers, kernels = union(found["transfer"]), union(found["kernel"])
        moved, covered = length(transfers), intersect(transfers, kernels)
        rows.append({
            "device": processes.get(pid, str(pid)),
            "transfers": len(found["transfer"]), "kernels": len(found["kernel"]),
            "transfer_ms": moved / 1e3, "kernel_ms": length(kernels) / 1e3,
            "overlapped_ms": covered / 1e3,
            "overlap": covered / moved if moved else None,
        })
    return rows


# ================================================================================================
# Capturing one
# ================================================================================================


def capture(args) -> dict:
    """Run the step, trace one more call, and report (the trace is kept under args.out)."""
    devices = jax.devices()[: args.devices] if args.devices else jax.devices()
    if len(devices) < 2:
        raise SystemExit(f"ring_trace needs two or more devices, found {len(devices)}")
    shape = scaling.Shape(batch=1, heads=args.heads, head_dim=args.head_dim, causal=args.causal,
                          dtype=args.dtype, kv_heads=args.kv_heads)
    mesh = scaling.make_mesh(devices)
    step = scaling.make_step(scaling.attention_fn(scaling.RING, args.causal, mesh,
                                                  args.strategy))
    sharding = scaling.along_seq(mesh)
    inputs = [jax.device_put(x, sharding)
              for x in scaling.make_inputs(shape, args.seq, jax.random.PRNGKey(0))]
    for _ in range(max(args.warmup, 2)):
        jax.block_until_ready(step(*inputs))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    log_dir = os.path.join(args.out, f"ring_trace_{stamp}")
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        jax.block_until_ready(step(*inputs))
    trace = find_trace(log_dir)
    return {
        "meta": {"devices": len(devices), "device_kind": devices[0].device_kind,
                 "backend": jax.default_backend(), "jax_version": jax.__version__,
                 "git_commit": scaling.git_commit(), "date_utc": stamp,
                 "argv": sys.argv[1:], "trace": trace},
        "shape": {"seq": args.seq, "heads": args.heads, "kv_heads": args.kv_heads,
                  "head_dim": args.head_dim, "causal": args.causal, "dtype": args.dtype,
                  "strategy": args.strategy},
        "devices": overlap_report(load_events(trace)),
    }


def format_report(report: dict) -> str:
    lines = [f"{'device':<28} {'transfers':>9} {'transfer ms':>11} {'kernel ms':>9} "
             f"{'under a kernel':>14}"]
    for r in report["devices"]:
        share = "-" if r["overlap"] is None else f"{r['overlap']:.0%}"
        lines.append(f"{r['device']:<28} {r['transfers']:>9} {r['transfer_ms']:>11.3f} "
                     f"{r['kernel_ms']:>9.3f} {share:>14}")
    if not report["devices"]:
        lines.append("(no transfer found in the trace)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", default=None, help="total sequence length (default 128k; smoke 256)")
    p.add_argument("--devices", type=int, default=None, help="ring size (default: all)")
    p.add_argument("--heads", type=int, default=None, help="q heads (default 16; smoke 2)")
    p.add_argument("--kv-heads", type=int, default=None, help="kv heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=None, help="default 128 (smoke 32)")
    p.add_argument("--strategy", choices=("ring", "allgather", "auto"), default="ring")
    p.add_argument("--dtype", choices=sorted(scaling.DTYPES), default=None,
                   help="default bf16 (smoke fp32)")
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before the traced one")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU host devices")
    p.add_argument("--out", default=".", help="folder for the JSON and the trace")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    small = args.smoke
    args.seq = scaling.parse_seq(args.seq or ("256" if small else "128k"))
    args.heads = args.heads or (2 if small else 16)
    args.head_dim = args.head_dim or (32 if small else 128)
    args.dtype = args.dtype or ("fp32" if small else "bf16")
    os.makedirs(args.out, exist_ok=True)
    report = capture(args)
    path = os.path.join(args.out, f"ring_trace_{report['meta']['date_utc']}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(format_report(report))
    print(f"json: {path}\ntrace: {report['meta']['trace']}")
    return report


if __name__ == "__main__":
    main()
