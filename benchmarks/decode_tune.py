"""Split counts and tiles of the Mosaic decode kernel, swept on one GPU.

    PYTHONPATH=. python3 benchmarks/decode_tune.py --cases 1x16kx32x8x128 --q-lens 1,4 \
        --splits auto,8,16,32 --tiles default,64/2/1,64/4/1 --out DIR

For every case (batch x context x q heads x kv heads x head_dim, bf16, every sequence holding its
whole context, its q_len newest tokens attending bottom-right), q_len, split count and tiles
(block_kv/stages/compute_wgs of `DecodeTiles`; "default" is `default_tiles`, "auto" splits are
`choose_num_splits`'), it times
  - the whole call: `decode_attention`'s jitted function with those tiles (Q packing, the partial
    kernel, the combine, the unpacking), and
  - the partial kernel alone (`pallas_flash.mosaic.decode.partial` on packed queries),
each as `python -m pallas_flash.bench --decode` times a call: a jitted program of several calls,
cycling over copies of the cache that outgrow the L2 cache together, divided by the calls; the
median of 3 batches of --iters programs (`pallas_flash.bench.decode.repeated`: every call takes
its own query argument, so that XLA cannot merge equal calls). A case's programs are compiled
ahead by --workers threads, with a compilation cache directory, so that the Mosaic lowering
cache lowers each kernel once, and timed together: each of the three rounds times one batch of
every program of the case in turn (`pallas_flash.bench.timing.time_interleaved`), so that the
pairs compared run under the same conditions. On a GPU each program then runs once a round more
under a profiler trace (`pallas_flash.bench.trace.device_times`). A row gives microseconds per
call (the smaller of the wall clock's and the GPU's time, the span of a program's kernels in
the trace, where it tells it: each bounds the GPU's own time from above; `*_wall_us` is the
wall clock's) and the K/V bytes read over that time against
the copy bandwidth of the same run. A pair the kernel
refuses (shared memory, block_kv against the chunk) is a row with the reason. A case's rows
print once its rounds end and the JSON (<out>/decode_tune.json) is rewritten after each, so a
run cut by its time limit keeps the cases it finished. docs/tuning.md ("Mosaic decode") says
which defaults the numbers chose.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_flash import decode  # noqa: E402
from pallas_flash.bench import decode as bench_decode  # noqa: E402
from pallas_flash.bench.report import git_commit  # noqa: E402
from pallas_flash.bench.timing import default_warm_s, time_interleaved  # noqa: E402
from pallas_flash.bench.trace import device_times_of, smaller_time  # noqa: E402
from pallas_flash.mosaic import decode as mosaic_decode  # noqa: E402


def parse_tiles(text: str) -> list[mosaic_decode.DecodeTiles | None]:
    """'default' (None: the kernel's own choice) or block_kv/stages/compute_wgs, with a trailing
    '/k' for keys as the wgmma M axis (DecodeTiles.keys_as_m), comma-separated."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if item == "default":
            out.append(None)
            continue
        fields = item.split("/")
        keys_as_m = fields[-1] == "k"
        block_kv, stages, wgs = (int(x) for x in fields[:3])
        out.append(mosaic_decode.DecodeTiles(block_kv, stages, wgs, keys_as_m=keys_as_m))
    return out


def parse_splits(text: str) -> list[int | None]:
    """'auto' (None: choose_num_splits) or split counts, comma-separated."""
    return [None if t.strip() == "auto" else int(t) for t in text.split(",") if t.strip()]


def tiles_label(tiles) -> str:
    if tiles is None:
        return "default"
    return (f"{tiles.block_kv}/{tiles.stages}/{tiles.compute_wgs}"
            + ("/k" if tiles.keys_as_m else ""))


def call_fns(q, k, v, lengths, num_splits, tiles):
    """(plan, the tiles the kernel runs, (whole call, partial kernel alone)), or (plan, those
    tiles, the reason) where the kernel refuses the pair."""
    plan, _ = decode._validate(q, k, v, lengths, None, scale=None, softcap=None, window=None,
                               sinks=None, return_lse=False, num_splits=num_splits,
                               backend="mosaic", interpret=None)
    ran = tiles or mosaic_decode.default_tiles(plan)
    reason = mosaic_decode.unsupported_reason(plan, ran)
    if reason is not None:
        return plan, ran, reason
    whole = decode._decode_fn(plan, "mosaic", False, tiles)

    def full(q, k, v, lengths):
        return whole(q, k, v, lengths, None, None)[0]

    def partial(q, k, v, lengths):
        return mosaic_decode.partial(plan, decode.backend_queries(mosaic_decode, plan, q, tiles),
                                     k, v, lengths, None, tiles=tiles)[0]
    return plan, ran, (full, partial)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="1x16kx32x8x128",
                   help="comma list of BATCHxCONTEXTxHQxHKVxD (context as 16k)")
    p.add_argument("--q-lens", default="1", help="new tokens per sequence, comma list")
    p.add_argument("--splits", default="auto", help="'auto' or split counts, comma list")
    p.add_argument("--tiles", default="default",
                   help="'default' or block_kv/stages/compute_wgs[/k], comma list")
    p.add_argument("--iters", type=int, default=10, help="programs per timed batch")
    p.add_argument("--copy-mib", type=int, default=None,
                   help="MiB of the copy-bandwidth buffer (default 4096 on a GPU, 64 on a CPU)")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                   help="threads compiling a case's programs ahead of timing")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    if jax.config.jax_compilation_cache_dir is None:
        # A program repeats one kernel `calls` times: with a cache directory, the Mosaic
        # lowering cache (pallas_flash/mosaic/lowering_cache.py) lowers it once, not per call.
        jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="decode_tune"))
    on_gpu = jax.default_backend() == "gpu"
    # On a CPU (interpret mode) a smoke run: a program of two calls over two cache copies.
    sizes = ((bench_decode.PROGRAM_BYTES, bench_decode.ROTATE_BYTES) if on_gpu else
             (bench_decode.CPU_PROGRAM_BYTES, bench_decode.CPU_ROTATE_BYTES))
    copy_bytes = (args.copy_mib << 20 if args.copy_mib else
                  bench_decode.COPY_BYTES_GPU if on_gpu else bench_decode.COPY_BYTES_CPU)
    path = os.path.join(args.out, "decode_tune.json")
    record = {"meta": {"gpu": jax.devices()[0].device_kind, "jax_version": jax.__version__,
                       "git_commit": git_commit(),
                       "date_utc": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
                       "argv": sys.argv[1:] if argv is None else list(argv),
                       "dtype": "bf16", "iters": args.iters},
              "copy": bench_decode.measure_copy(copy_bytes, args.iters, 2, True), "rows": []}
    copy_gbps = record["copy"]["gbps"]
    print(f"copy bandwidth {copy_gbps:.0f} GB/s", flush=True)

    def emit(**row):
        record["rows"].append(row)
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        with open(path, "w") as f:
            json.dump(record, f, indent=1)

    key = jax.random.key(0)
    for b, ctx, hq, hkv, d in bench_decode.parse_cases(args.cases, smoke=False):
        group = bench_decode.Group(b, ctx, hkv, d, (hq,))
        k, v = bench_decode.make_cache(group, jnp.bfloat16, key)
        kv_bytes = b * ctx * hkv * d * 2 * 2
        calls, copies = bench_decode.calls_and_copies(kv_bytes, *sizes)
        caches = bench_decode._copies(k, v, copies)
        lengths = jnp.full((b,), ctx, jnp.int32)
        queries = {q_len: jax.random.normal(jax.random.fold_in(key, q_len), (b, q_len, hq, d),
                                            jnp.float32).astype(jnp.bfloat16)
                   for q_len in (int(x) for x in args.q_lens.split(","))}
        pairs, jobs = [], {}
        for (q_len, q), num_splits, tiles in itertools.product(
                queries.items(), parse_splits(args.splits), parse_tiles(args.tiles)):
            plan, ran, fns = call_fns(q, k, v, lengths, num_splits, tiles)
            base = dict(case=f"{b}x{ctx}x{hq}x{hkv}x{d}", q_len=q_len,
                        splits="auto" if num_splits is None else num_splits,
                        num_splits=plan.num_splits, tiles=tiles_label(tiles),
                        ran=tiles_label(ran), calls=calls)
            pairs.append((len(pairs), base, q, fns))
            if not isinstance(fns, str):
                for name, fn in zip(("call", "partial"), fns):
                    jobs[len(pairs) - 1, name] = (bench_decode.repeated(fn, calls),
                                                  ((q,) * calls, caches, lengths))
        compiled = bench_decode.compile_all(jobs, args.workers)
        # Every program of the case timed in the same rounds, so that the pairs compared share
        # the GPU's state (`timing.time_interleaved`); one that failed to compile is its error.
        keys = list(jobs)
        programs = [(compiled[key], jobs[key][1]) for key in keys]
        timed = dict(zip(keys, time_interleaved(programs, args.iters, 2, pipelined=True,
                                                warm_s=default_warm_s())))
        # The programs that ran, timed again on the GPU's clock (`trace.device_times_of`): at
        # batch 1 and short contexts the wall clock times the host's dispatch.
        gpu = dict(zip(keys, device_times_of(programs, [timed[key] for key in keys])))
        for index, base, q, fns in pairs:
            if isinstance(fns, str):
                emit(**base, error=fns)
                continue
            row = dict(base)
            for name in ("call", "partial"):
                times, _ = timed[index, name]
                if isinstance(times, Exception):  # a failing pair is a result row
                    row[f"{name}_error"] = (f"{type(times).__name__}: "
                                            f"{str(times).splitlines()[0][:200]}")
                    continue
                wall = statistics.median(times) / calls
                gpu_times = gpu[index, name]
                t, _ = smaller_time(wall, gpu_times and [x / calls for x in gpu_times])
                row[f"{name}_us"] = round(t * 1e6, 2)
                row[f"{name}_wall_us"] = round(wall * 1e6, 2)
                row[f"{name}_pct_of_copy"] = round(100 * kv_bytes / t / 1e9 / copy_gbps, 1)
            emit(**row)
    return record


if __name__ == "__main__":
    main()
