"""``python -m pallas_flash.bench --decode``: decode attention against the GPU's copy bandwidth.

Decoding reads the whole K/V cache for a few new queries, so it is bandwidth-bound and its
figure of merit is the bandwidth it achieves:

    kv_bytes = sum over sequences of kv_len * kv_heads * head_dim * 2 (K and V) * itemsize
    GB/s     = kv_bytes / time,   % of copy = GB/s / the copy bandwidth of the same run

The copy bandwidth is that of a jitted elementwise ``x + 1`` over a large buffer (4 GiB on a
GPU), counting its read and its write. Every sequence of a case is full (kv_len = context), and
its queries are the q_len newest tokens, aligned bottom-right. A call's time is that of a jitted
program of several calls divided by their number, since a small case's call is shorter than a
program's launch from the host; the calls cycle over copies of the cache too large together for
the L2 cache, so each reads its K/V from HBM, as in a model whose layers each read their own.

Each case runs ``pallas_flash.decode_attention`` on a contiguous cache and on a paged one (the
same keys in pages of ``--decode-page-size`` keys, handed out in a shuffled order by a random
block table), and on the contiguous cache the comparators: ``jax.nn.dot_product_attention``
with ``implementation="xla"`` and ``"cudnn"`` (``key_value_seq_lengths``, and for q_len > 1 a
bottom-right boolean mask, since its ``is_causal`` is top-left), and tokamax's
``dot_product_attention`` when it is importable. One that cannot serve a case reads ``n.a.``
with the reason. Accuracy: each output's first sequence against a float32 reference.

Cases are grouped by cache shape: one group's caches are made once and serve every head count
and q_len. Each case is a new shape to compile, and compiling takes far longer than the calls,
so a group's programs are compiled ahead of time, in parallel (``--decode-compile-workers``),
before any of them is timed. ``--decode-budget`` seconds bound the run: groups that would not
end by then are listed as skipped, and the JSON, rewritten after every group, says the run is
incomplete.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash
from pallas_flash.bench.accuracy import rel_err
from pallas_flash.bench.cases import parse_seq, seq_label
from pallas_flash.bench.impls import NotApplicable, import_tokamax, short_error
from pallas_flash.bench.timing import default_warm_s, time_calls, time_interleaved
from pallas_flash.bench.trace import device_times_of, smaller_time

# The matrix of the issue: every combination of these, q_len 1 and 4, both cache layouts.
BATCHES = (1, 4, 16, 64)
CONTEXTS = (4096, 16384, 32768, 131072)
HEADS = ((32, 8), (64, 8))
HEAD_DIM = 128
Q_LENS = (1, 4)
PAGE_SIZE = 64
# Interpret mode on a CPU: one small group, both q_lens and layouts.
SMOKE_CASES = ((2, 256, 4, 2, 32),)
SMOKE_PAGE_SIZE = 16

COMPARATORS = ("xla", "cudnn", "tokamax")
# Our rows: the implementation name -> decode_attention's backend.
OURS = {"pallas_flash": "auto", "pallas_flash_triton": "triton",
        "pallas_flash_mosaic": "mosaic"}
LAYOUTS = ("contiguous", "paged")
COPY_BYTES_GPU = 4 << 30
COPY_BYTES_CPU = 64 << 20
# The next group is expected to take up to this many times the last one (groups grow).
_GROWTH = 1.5
# Keys generated at random per group; longer caches repeat them (the bandwidth does not care,
# and generating 17 GB of normal samples would cost more time than the case itself).
_RANDOM_KEYS = 4096
# A timed program reads about this many K/V bytes: one call of a small case lasts a few
# microseconds, less than launching a program from the host, so a program makes several calls
# (each on its own query argument, so that XLA cannot merge them) and the time is divided.
PROGRAM_BYTES = 1 << 30
MAX_CALLS = 64
# Consecutive calls cycle over copies of the cache that together hold this many bytes (at most
# MAX_COPIES copies: about 134 MB for the smallest default case), more than the H200's 50 MB
# L2, so that a call finds none of its K/V in L2, as in a model where every layer reads its own
# cache.
ROTATE_BYTES = 256 << 20
MAX_COPIES = 8
# Seconds of back-to-back calls before a group's first row on a GPU, which sat idle while the
# group compiled; later rows take timing.WARM_S_GPU.
GROUP_WARM_S = 2.0
# Interpret mode on a CPU: two calls over two copies for the smoke case, to exercise both.
CPU_PROGRAM_BYTES = CPU_ROTATE_BYTES = 256 << 10


@dataclasses.dataclass(frozen=True)
class Group:
    """One cache shape; its cases are every (q_heads, q_len) over it."""

    batch: int
    context: int
    kv_heads: int
    head_dim: int
    q_heads: tuple[int, ...]


def full_matrix() -> list[tuple[int, ...]]:
    """(batch, context, q_heads, kv_heads, head_dim) of the full matrix, smallest caches first,
    so that a run cut short by the budget has covered the most cases."""
    shapes = [(b, c, hq, hkv, HEAD_DIM) for b in BATCHES for c in CONTEXTS for hq, hkv in HEADS]
    return sorted(shapes, key=lambda s: (s[0] * s[1], s[1]))


def parse_cases(text: str | None, smoke: bool) -> list[tuple[int, ...]]:
    """'full' (default), 'smoke', or a comma list of BATCHxCONTEXTxHQxHKVxD (context as 32k)."""
    if text is None:
        text = "smoke" if smoke else "full"
    if text == "full":
        return full_matrix()
    if text == "smoke":
        return list(SMOKE_CASES)
    shapes = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        parts = item.lower().split("x")
        if len(parts) != 5:
            raise ValueError(
                f"decode case {item!r} is not batch x context x q_heads x kv_heads x head_dim")
        b, c, hq, hkv, d = parts
        shapes.append((int(b), parse_seq(c), int(hq), int(hkv), int(d)))
    return shapes


def make_groups(shapes: list[tuple[int, ...]]) -> list[Group]:
    groups: dict[tuple[int, ...], list[int]] = {}
    for b, c, hq, hkv, d in shapes:
        heads = groups.setdefault((b, c, hkv, d), [])
        if hq not in heads:
            heads.append(hq)
    return [Group(b, c, hkv, d, tuple(hq)) for (b, c, hkv, d), hq in groups.items()]


# --------------------------------------------------------------------------
# Implementations: fn(q, k, v, kv_lengths, block_table) -> out
# --------------------------------------------------------------------------


def _ours(backend: str) -> Callable:
    def fn(q, k, v, kv_lengths, block_table):
        try:
            return pallas_flash.decode_attention(q, k, v, kv_lengths=kv_lengths,
                                                 block_table=block_table, backend=backend)
        except ValueError as e:
            # A forced backend that cannot serve the case says so before any launch.
            if backend != "auto" and "backend" in str(e):
                raise NotApplicable(str(e).splitlines()[0]) from e
            raise
    return fn


def bottom_right_mask(kv_lengths: jax.Array, q_len: int, max_len: int) -> jax.Array:
    """[batch, 1, q_len, max_len] bool: token t of sequence b (at position kv_len - q_len + t)
    sees the keys at positions up to its own."""
    last = kv_lengths[:, None] - q_len + jnp.arange(q_len)[None, :]
    return (jnp.arange(max_len)[None, None, :] <= last[:, :, None])[:, None]


def _jax_nn(implementation: str) -> Callable:
    def fn(q, k, v, kv_lengths, block_table):
        del block_table  # contiguous cases only
        if implementation == "cudnn" and jax.default_backend() != "gpu":
            raise NotApplicable("cuDNN needs a GPU")
        # is_causal is top-left in jax.nn; bottom-right alignment needs an explicit mask.
        mask = bottom_right_mask(kv_lengths, q.shape[1], k.shape[1]) if q.shape[1] > 1 else None
        return jax.nn.dot_product_attention(q, k, v, mask=mask, key_value_seq_lengths=kv_lengths,
                                            implementation=implementation)
    return fn


def _tokamax(q, k, v, kv_lengths, block_table):
    del block_table
    tokamax = import_tokamax()
    mask = bottom_right_mask(kv_lengths, q.shape[1], k.shape[1]) if q.shape[1] > 1 else None
    try:
        return tokamax.dot_product_attention(q, k, v, mask=mask,
                                             key_value_seq_lengths=kv_lengths,
                                             implementation=("mosaic", "triton"))
    except (NotImplementedError, ExceptionGroup) as e:
        raise NotApplicable(short_error(e)) from e


IMPLS: dict[str, Callable] = {**{name: _ours(b) for name, b in OURS.items()},
                              "xla": _jax_nn("xla"), "cudnn": _jax_nn("cudnn"),
                              "tokamax": _tokamax}


def decode_impls(explicit: list[str] | None) -> list[str]:
    """pallas_flash and every comparator, plus the forced backends --impls names."""
    extra = [n for n in explicit or [] if n in OURS and n != "pallas_flash"]
    return ["pallas_flash", *extra, *COMPARATORS]


# --------------------------------------------------------------------------
# Copy bandwidth
# --------------------------------------------------------------------------


def measure_copy(nbytes: int, iters: int, warmup: int, pipelined: bool) -> dict:
    """Read+write bandwidth of a jitted elementwise x + 1 over an nbytes uint32 buffer."""
    n = nbytes // 4
    cols = 1 << 16 if n >= 1 << 16 else n
    x = jnp.zeros((n // cols, cols), jnp.uint32)
    times, out = time_calls(jax.jit(lambda a: a + 1), (x,), iters, warmup, pipelined,
                            default_warm_s())
    del out, x
    moved = 2 * (n // cols) * cols * 4
    t = statistics.median(times)
    return {"bytes": moved, "what": "x + 1 over a uint32 buffer, read + write",
            "ms": t * 1e3, "times_ms": [s * 1e3 for s in times], "gbps": moved / t / 1e9}


# --------------------------------------------------------------------------
# One group
# --------------------------------------------------------------------------


def make_cache(group: Group, dtype, key) -> tuple[jax.Array, jax.Array]:
    """Contiguous K and V [batch, context, kv_heads, head_dim], random normal."""
    b, c, h, d = group.batch, group.context, group.kv_heads, group.head_dim
    base = min(c, _RANDOM_KEYS)
    reps = -(-c // base)

    @jax.jit
    def one(key):
        x = jax.random.normal(key, (b, base, h, d), jnp.float32).astype(dtype)
        return jnp.tile(x, (1, reps, 1, 1))[:, :c]

    kk, kv = jax.random.split(key)
    return one(kk), one(kv)


def page(cache: jax.Array, page_size: int, perm: np.ndarray) -> jax.Array:
    """The pool [num_pages, page_size, ...] holding `cache`: page j of sequence b at row
    perm[b * pages_per_seq + j] (the block table is perm reshaped)."""
    return _gather_pages(cache, jnp.asarray(np.argsort(perm).astype(np.int32)), page_size)


@functools.partial(jax.jit, static_argnums=2)
def _gather_pages(cache, order, page_size):
    # One program, so that the padded and reshaped cache is never a buffer of its own.
    b, c = cache.shape[:2]
    pages = -(-c // page_size)
    cache = jnp.pad(cache, ((0, 0), (0, pages * page_size - c), (0, 0), (0, 0)))
    return cache.reshape(b * pages, page_size, *cache.shape[2:])[order]


def _copies(k: jax.Array, v: jax.Array, copies: int) -> tuple:
    """((k, v), then copies - 1 (k, v) pairs in buffers of their own)."""
    return ((k, v),) + tuple((jnp.copy(k), jnp.copy(v)) for _ in range(copies - 1))


@jax.jit
def _reference_first(q, k, v, kv_lengths):
    # Float32 reference of sequence 0 only: cheap at any batch.
    return pallas_flash.reference_attention(
        q[:1], k[:1], v[:1], causal=True, causal_alignment="bottom_right",
        kv_lengths=kv_lengths[:1])


def calls_and_copies(kv_bytes: int, program_bytes: int = PROGRAM_BYTES,
                     rotate_bytes: int = ROTATE_BYTES) -> tuple[int, int]:
    """(calls per timed program, copies of the cache they cycle over) for one call's bytes."""
    calls = min(MAX_CALLS, max(1, -(-program_bytes // kv_bytes)))
    return calls, min(calls, MAX_COPIES, max(1, -(-rotate_bytes // kv_bytes)))


def repeated(fn: Callable, calls: int) -> Callable:
    """run(qs, caches, kv_lengths, *rest) -> outs: `calls` calls of fn, call i on query qs[i]
    and cache copy caches[i % len(caches)] (a (k, v) pair).

    Each call's query is its own argument, so that XLA cannot merge equal calls, and the query
    and the cache pass through an optimization barrier together with the previous call's
    output, so that every call depends on the one before and sees its cache as a value of its
    own: calls that share a cache copy then cannot be merged (XLA's dot merger would otherwise
    turn the products of several queries with one cached K into one product that reads K
    once), nor share work done on the cache alone (a transpose of K that a comparator computes
    once per copy instead of once per call), which no real decoding step can do. The barrier
    launches nothing."""
    def run(qs, caches, kv_lengths, *rest):
        outs, prev = [], None
        for i in range(calls):
            q, (k, v) = qs[i], caches[i % len(caches)]
            if prev is not None:
                q, k, v, _ = jax.lax.optimization_barrier((q, k, v, prev))
            prev = fn(q, k, v, kv_lengths, *rest)
            outs.append(prev)
        return tuple(outs)
    return run


def program(name: str, calls: int) -> Callable:
    """fn(qs, caches, kv_lengths, block_table) -> outs: `calls` calls of an implementation
    (`repeated`)."""
    return repeated(IMPLS[name], calls)


def compile_all(jobs: dict, workers: int) -> dict:
    """{key: compiled program, or the exception its tracing or compilation raised} for jobs
    {key: (program function, its arguments or their shapes)}, compiled ahead of time by
    `workers` threads.

    Every case is a new shape, so compilation, not the millisecond calls, is most of the run's
    time; XLA and the Triton and Mosaic GPU compilers release the GIL for most of it."""
    def one(job):
        fn, args = job
        try:
            return jax.jit(fn).lower(*args).compile()
        except Exception as e:  # noqa: BLE001 - reported as the row's result
            return e

    if workers <= 1:
        return {key: one(job) for key, job in jobs.items()}
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return dict(zip(jobs, pool.map(one, jobs.values())))


def _fields(result: tuple[Any, Any], calls: int,
            gpu_times: list[float] | None = None) -> tuple[dict, Any]:
    """Row fields (the time of one call) and the output of the last call, from one job's
    (wall times of a program, or the exception it raised; its last output) and its programs'
    GPU times from a trace (`trace.device_times`), if measured.

    "ms" is the smaller of the two medians (`trace.smaller_time`; "timer" says which): at
    batch 1 and short contexts the host's dispatch of a program takes as long as the GPU's run
    of it, and the wall clock then times the host."""
    times, outs = result
    try:
        if isinstance(times, Exception):
            raise times
        times, out = [t / calls for t in times], outs[-1]
    except NotApplicable as e:
        return {"status": "n.a.", "error": str(e)}, None
    except NotImplementedError as e:  # jax.nn's cuDNN path declining a shape
        return {"status": "n.a.", "error": short_error(e)}, None
    except Exception as e:  # noqa: BLE001 - any failure is a result
        return {"status": "error", "error": short_error(e)}, None
    wall = statistics.median(times) * 1e3
    gpu = [t / calls * 1e3 for t in gpu_times] if gpu_times else None
    ms, timer = smaller_time(wall, gpu)
    return {"status": "ok", "error": None, "times_ms": [t * 1e3 for t in times],
            "wall_ms": wall, "gpu_times_ms": gpu, "timer": timer, "ms": ms}, out


def run_group(group: Group, impls: list[str], opts, copy_gbps: float, key) -> dict:
    """Every case of one cache shape: all q_heads and q_lens, each implementation on the
    contiguous cache and (ours) the paged one, a case's rows timed together in interleaved
    rounds (`timing.time_interleaved`), their order reversed from one case to the next, so
    that neither a layout nor an implementation is always timed first. The group's first case
    is timed after GROUP_WARM_S of calls (later ones after timing.WARM_S_GPU): the GPU sat idle
    while the group compiled. On a GPU, each program then runs once a round more under a
    profiler trace, whose kernels' span is the row's time where it is below the wall clock's
    (`_fields`, `trace.device_times`).

    Returns {"rows": [...], "compile_s", "seconds"}."""
    start = time.perf_counter()
    dtype, itemsize = opts.dtype, jnp.dtype(opts.dtype).itemsize
    b, c, hkv, d = group.batch, group.context, group.kv_heads, group.head_dim
    pages = -(-c // opts.page_size)
    cases = [(hq, q_len) for hq in group.q_heads for q_len in opts.q_lens]
    kv_bytes = b * c * hkv * d * 2 * itemsize  # every sequence full
    calls, copies = calls_and_copies(kv_bytes, *opts.program_and_rotate_bytes)
    shape = jax.ShapeDtypeStruct
    lengths_s, table_s = shape((b,), jnp.int32), shape((b, pages), jnp.int32)
    caches_s = {"contiguous": ((shape((b, c, hkv, d), dtype),) * 2,) * copies,
                "paged": ((shape((b * pages, opts.page_size, hkv, d), dtype),) * 2,) * copies}
    jobs = {}
    for hq, q_len in cases:
        qs_s = (shape((b, q_len, hq, d), dtype),) * calls
        for layout in LAYOUTS:
            for name in (n for n in impls if layout == "contiguous" or n in OURS):
                jobs[hq, q_len, layout, name] = (program(name, calls), (
                    qs_s, caches_s[layout], lengths_s, table_s if layout == "paged" else None))
    compiled = compile_all(jobs, opts.compile_workers)
    compile_s = time.perf_counter() - start

    k_cache, v_cache = make_cache(group, dtype, jax.random.fold_in(key, 0))
    lengths = jnp.full((b,), c, jnp.int32)
    queries = {case: jax.random.normal(jax.random.fold_in(key, 1 + i), (b, case[1], case[0], d),
                                       jnp.float32).astype(dtype)
               for i, case in enumerate(cases)}
    rows, outputs = [], {}

    def record(hq, q_len, layout, name, result, ref, gpu_times):
        fields, out = _fields(result, calls, gpu_times)
        row = {"batch": b, "context": c, "q_len": q_len, "q_heads": hq, "kv_heads": hkv,
               "head_dim": d, "layout": layout,
               "page_size": opts.page_size if layout == "paged" else None,
               "dtype": opts.dtype_name, "impl": name, "kv_bytes": kv_bytes,
               "calls_per_program": calls, "cache_copies": copies, **fields}
        ms = row.get("ms")
        row["gbps"] = kv_bytes / (ms * 1e-3) / 1e9 if ms and ms > 0 else None
        row["frac_of_copy"] = row["gbps"] / copy_gbps if row["gbps"] and copy_gbps else None
        row["err_vs_ref"] = rel_err(out[:1], ref) if out is not None else None
        outputs[hq, q_len, layout, name] = out
        print(f"  {b}x{seq_label(c)} q_len {q_len} {hq}:{hkv} {layout} {name}: "
              + progress(row), flush=True)
        rows.append(row)

    refs = {case: _reference_first(queries[case], k_cache, v_cache, lengths) for case in cases}
    # Both layouts stay alive, so that they can be timed side by side: two sets of copies.
    perm = np.random.default_rng(opts.seed).permutation(b * pages)
    table = jnp.asarray(perm.reshape(b, pages).astype(np.int32))
    layouts = {"contiguous": (_copies(k_cache, v_cache, copies), None)}
    k_pool, v_pool = page(k_cache, opts.page_size, perm), page(v_cache, opts.page_size, perm)
    del k_cache, v_cache
    layouts["paged"] = (_copies(k_pool, v_pool, copies), table)
    del k_pool, v_pool
    warm_s = GROUP_WARM_S if jax.default_backend() == "gpu" else 0.0
    for i, (hq, q_len) in enumerate(cases):
        order = [(name, layout) for name in impls for layout in LAYOUTS
                 if layout == "contiguous" or name in OURS]
        order = order if i % 2 == 0 else order[::-1]
        jobs = []
        for name, layout in order:
            caches, table = layouts[layout]
            # A program that failed to compile is its exception: the row's result.
            jobs.append((compiled[hq, q_len, layout, name],
                         ((queries[hq, q_len],) * calls, caches, lengths, table)))
        results = time_interleaved(jobs, opts.iters, opts.warmup, opts.pipelined, warm_s)
        # The programs that ran, timed again on the GPU's own clock (`_fields`).
        gpu = device_times_of(jobs, results)
        for (name, layout), result, gpu_times in zip(order, results, gpu):
            record(hq, q_len, layout, name, result, refs[hq, q_len], gpu_times)
        warm_s = default_warm_s()
    add_comparisons(rows, outputs)
    return {"rows": rows, "compile_s": compile_s, "seconds": time.perf_counter() - start}


def add_comparisons(rows: list[dict], outputs: dict) -> None:
    """x pallas_flash (its contiguous time over this row's: above 1, this row is faster), and
    for paged rows the time and output against the same implementation's contiguous row."""
    ms = {(r["q_heads"], r["q_len"], r["layout"], r["impl"]): r.get("ms") for r in rows}
    for r in rows:
        key = (r["q_heads"], r["q_len"])
        ours, mine = ms.get((*key, "contiguous", "pallas_flash")), r.get("ms")
        r["vs_pallas_flash"] = ours / mine if ours and mine else None
        r["paged_over_contiguous"] = r["paged_out_vs_contiguous"] = None
        if r["layout"] == "paged":
            contig = ms.get((*key, "contiguous", r["impl"]))
            r["paged_over_contiguous"] = mine / contig if mine and contig else None
            a = outputs.get((*key, "paged", r["impl"]))
            b = outputs.get((*key, "contiguous", r["impl"]))
            if a is not None and b is not None:
                r["paged_out_vs_contiguous"] = rel_err(a, b)


def progress(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {row['error']}"
    frac = row["frac_of_copy"]
    return (f"{row['ms'] * 1e3:.1f} us, {row['gbps']:.4g} GB/s"
            + (f" ({100 * frac:.0f}% of copy)" if frac else "")
            + (f", wall {row['wall_ms'] * 1e3:.1f} us" if row.get("timer") == "gpu" else ""))


# --------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Options:
    dtype: Any
    dtype_name: str
    iters: int
    warmup: int
    pipelined: bool
    page_size: int
    q_lens: tuple[int, ...]
    seed: int
    compile_workers: int
    program_and_rotate_bytes: tuple[int, int]


def run_decode(args, groups: list[Group], impls: list[str], on_group=None) -> dict:
    """The copy bandwidth, then every group until `args.decode_budget` seconds have passed.

    `on_group(section)` is called after the copy and after every group (to save the JSON)."""
    from pallas_flash.bench.cases import DTYPES

    start = time.perf_counter()
    opts = Options(DTYPES[args.dtype], args.dtype, args.iters, args.warmup,
                   args.timer == "pipelined", args.decode_page_size, tuple(args.decode_q_lens),
                   args.seed, args.decode_compile_workers,
                   (PROGRAM_BYTES, ROTATE_BYTES) if jax.default_backend() == "gpu"
                   else (CPU_PROGRAM_BYTES, CPU_ROTATE_BYTES))
    on_gpu = jax.default_backend() == "gpu"
    copy_bytes = args.decode_copy_mib << 20 if args.decode_copy_mib else (
        COPY_BYTES_GPU if on_gpu else COPY_BYTES_CPU)
    copy = measure_copy(copy_bytes, max(opts.iters, 5), opts.warmup, opts.pipelined)
    print(f"copy bandwidth: {copy['gbps']:.0f} GB/s ({copy['bytes'] / 2**30:.2f} GiB moved "
          f"in {copy['ms']:.3f} ms)", flush=True)
    section = {"copy": copy, "page_size": opts.page_size, "q_lens": list(opts.q_lens),
               "impls": impls, "budget_s": args.decode_budget,
               "bytes": "sum over sequences of kv_len * kv_heads * head_dim * 2 * itemsize",
               "compile_workers": opts.compile_workers, "rows": [], "groups": [],
               "skipped": []}
    if on_group:
        on_group(section)
    key = jax.random.key(args.seed)
    last = 0.0
    for i, group in enumerate(groups):
        # Groups grow in size: stop before one that would likely overrun the budget, so the
        # run ends with its table printed instead of being killed mid-group.
        if time.perf_counter() - start + _GROWTH * last > args.decode_budget:
            section["skipped"] = [dataclasses.asdict(g) for g in groups[i:]]
            print(f"budget of {args.decode_budget:.0f} s: {len(groups) - i} cache shapes "
                  "skipped", flush=True)
            break
        done = run_group(group, impls, opts, copy["gbps"], jax.random.fold_in(key, i))
        section["rows"] += done.pop("rows")
        section["groups"].append({**dataclasses.asdict(group), **done})
        print(f"  ({done['seconds']:.1f} s, compiling {done['compile_s']:.1f} s)", flush=True)
        last = done["seconds"]
        if on_group:
            on_group(section)
    section["seconds"] = time.perf_counter() - start
    return section
