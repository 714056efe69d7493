"""Where one decoding step's time goes: the kernels of chained decode calls, from a profiler trace.

At batch 1 a `decode_attention` call lasts a few tens of microseconds, so the kernels around the
split kernel (the combine, any XLA fusion before or after) and the gaps between them matter as
much as the split kernel itself. This script runs `--calls` calls chained as the decode bench
chains them (`pallas_flash.bench.decode.repeated`: each call's query waits on the previous
call's output), once more under `jax.profiler.trace`, and reads the GPU stream tracks back:
per case, the time per call (first kernel start to last kernel end, over the calls) and each
kernel's count and mean duration. Usage, from the repository root:

    PYTHONPATH=. python benchmarks/decode_trace.py --cases mosaic:1:16k:1,triton:1:4k:1 --out $OUT

A case is BACKEND:BATCH:CONTEXT:Q_LEN, BACKEND one of auto, mosaic, triton or xla
(`jax.nn.dot_product_attention` with a length mask). The calls cycle over `--copies` copies of
the cache (default: as many as the decode bench takes for the case, together larger than the
L2 cache), so that each call reads its K/V from HBM.
It writes decode_trace_<time>.json to --out. On a CPU there are no stream tracks; the cases
still run (interpret mode) and report no kernels.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_flash as pf  # noqa: E402
from pallas_flash.bench.decode import calls_and_copies, repeated  # noqa: E402
from pallas_flash.bench.trace import (  # noqa: E402
    find_trace, load_events, span_us, stream_kernels)

BACKENDS = ("auto", "mosaic", "triton", "xla")


def parse_case(text: str) -> tuple[str, int, int, int]:
    """'mosaic:1:16k:1' -> ('mosaic', 1, 16384, 1)."""
    parts = text.split(":")
    if len(parts) != 4 or parts[0] not in BACKENDS:
        raise ValueError(f"a case is BACKEND:BATCH:CONTEXT:Q_LEN with BACKEND in {BACKENDS}, "
                         f"got {text!r}")
    backend, batch, context, q_len = parts
    context = int(context[:-1]) * 1024 if context.endswith("k") else int(context)
    return backend, int(batch), context, int(q_len)


def breakdown(events: list[dict], calls: int) -> dict:
    """{"per_call_us": span of the stream kernels / calls, "kernels": [{"name", "count",
    "mean_us", "per_call_us"}] by total time}; per_call_us is None without stream kernels."""
    kernels = stream_kernels(events)
    if not kernels:
        return {"per_call_us": None, "kernels": []}
    total, count = collections.defaultdict(float), collections.Counter()
    for e in kernels:
        total[e["name"]] += float(e["dur"])
        count[e["name"]] += 1
    rows = [{"name": name, "count": count[name], "mean_us": total[name] / count[name],
             "per_call_us": total[name] / calls}
            for name in sorted(total, key=total.get, reverse=True)]
    return {"per_call_us": span_us(kernels) / calls, "kernels": rows}


def _attend(backend: str):
    def call(q, k_cache, v_cache, lengths):
        if backend == "xla":
            visible = jnp.arange(k_cache.shape[1])[None, :] < lengths[:, None]
            return jax.nn.dot_product_attention(q, k_cache, v_cache,
                                                mask=visible[:, None, None, :],
                                                implementation="xla")
        return pf.decode_attention(q, k_cache, v_cache, kv_lengths=lengths, backend=backend)
    return call


def capture(case: str, args) -> dict:
    backend, batch, context, q_len = parse_case(case)
    keys = jax.random.split(jax.random.key(args.seed), 3)
    qs = [jax.random.normal(jax.random.fold_in(keys[0], i),
                            (batch, q_len, args.q_heads, args.head_dim), jnp.bfloat16)
          for i in range(args.calls)]
    shape = (batch, context, args.kv_heads, args.head_dim)
    # K and V in bf16; never more copies than calls.
    copies = args.copies or min(args.calls, calls_and_copies(2 * math.prod(shape) * 2)[1])
    caches = [(jax.random.normal(jax.random.fold_in(keys[1], c), shape, jnp.bfloat16),
               jax.random.normal(jax.random.fold_in(keys[2], c), shape, jnp.bfloat16))
              for c in range(copies)]
    lengths = jnp.full((batch,), context, jnp.int32)
    run = jax.jit(repeated(_attend(backend), args.calls))
    for _ in range(3):
        jax.block_until_ready(run(qs, caches, lengths))
    log_dir = os.path.join(args.out, f"decode_trace_{case.replace(':', '_')}")
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        jax.block_until_ready(run(qs, caches, lengths))
    result = breakdown(load_events(find_trace(log_dir)), args.calls)
    shutil.rmtree(log_dir, ignore_errors=True)
    return {"case": case, "backend": backend, "batch": batch, "context": context,
            "q_len": q_len, "cache_copies": copies, **result}


def format_case(row: dict) -> str:
    if row["per_call_us"] is None:
        return f"{row['case']}: no GPU stream kernels in the trace"
    lines = [f"{row['case']}: {row['per_call_us']:.2f} us a call"]
    lines += [f"  {k['per_call_us']:8.2f} us a call  {k['count']:4d} x {k['mean_us']:7.2f} us  "
              f"{k['name'][:70]}" for k in row["kernels"]]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="mosaic:1:4k:1,mosaic:1:16k:1,triton:1:4k:1,"
                   "triton:1:16k:1,xla:1:4k:1", help="comma list of BACKEND:BATCH:CONTEXT:Q_LEN")
    p.add_argument("--calls", type=int, default=16, help="chained calls per traced program")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--copies", type=int, default=None,
                   help="cache copies the calls cycle over (default: the decode bench's)")
    return add_run_arguments(p)


def add_run_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--seed and --out, which every trace script takes."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=".", help="folder for the JSON (and, briefly, the traces)")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    return run_cases("decode_trace", args.cases.split(","), capture, args, argv)


def run_cases(tool: str, cases: list[str], capture, args, argv) -> dict:
    """capture(case, args) for every case, each printed as it ends, then `write_report`."""
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for case in cases:
        rows.append(capture(case, args))
        print(format_case(rows[-1]), flush=True)
    return write_report(tool, args.out, rows, argv)


def write_report(tool: str, out: str, rows: list[dict], argv) -> dict:
    """{"meta", "cases": rows}, written to <out>/<tool>_<time>.json (and returned)."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    report = {"meta": {"device_kind": jax.devices()[0].device_kind,
                       "backend": jax.default_backend(), "jax_version": jax.__version__,
                       "date_utc": stamp, "argv": sys.argv[1:] if argv is None else argv},
              "cases": rows}
    path = os.path.join(out, f"{tool}_{stamp}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"json: {path}")
    return report


if __name__ == "__main__":
    main()
