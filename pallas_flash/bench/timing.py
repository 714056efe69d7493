"""The timer, and one case run over every implementation.

For every case and implementation three jitted functions are timed:

* forward: ``out = fn(q, k, v)``;
* forward+backward: ``jax.vjp`` of ``fn`` applied to a random cotangent, inside one jitted
  function that returns ``(dq, dk, dv)``;
* backward: the vjp closure of one forward call (its residuals computed once, before the
  timing) applied to the cotangent. The backward's time is its own, as cuDNN's and
  FlashAttention's benchmarks take it; a difference of two medians would move the forward's
  noise, with the opposite sign, into the backward.

Each function is called ``--warmup`` times first (the first call compiles), then, on a GPU,
called back to back for WARM_S_GPU seconds, so that it is not timed at the low clock a GPU
runs at after idling through the compile. With the default
timer (``call``) each of ``--iters`` (forward) or ``--iters-bwd`` calls is ended by
``jax.block_until_ready`` and the median is reported; every launch's host latency then lands in
the time, more so for programs of several launches. With ``--timer pipelined`` the calls run back
to back, one synchronisation per batch of calls, three batches, and the median batch's mean is
reported: the host's launch work overlaps the device's, as in a training loop that dispatches
ahead.

A failure of one implementation (out of memory, unsupported shape, any exception) becomes that
row's result and the run goes on.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax

from pallas_flash.bench.accuracy import add_accuracy
from pallas_flash.bench.cases import DTYPES, PLAIN, Case, case_flops, make_inputs, variant_kwargs
from pallas_flash.bench.impls import (DENSE_MASK, IMPLS, NotApplicable, dense_segment_mask,
                                      short_error)


# Seconds of back-to-back calls before a function is timed on a GPU: a program lasting well under
# a millisecond needs about this long to lift the clock that compiling left low
# (docs/performance.md, "Decoding").
WARM_S_GPU = 0.25


def default_warm_s() -> float:
    """WARM_S_GPU on a GPU; 0 elsewhere, where there is no clock to lift."""
    return WARM_S_GPU if jax.default_backend() == "gpu" else 0.0


# Timed batches of a pipelined measurement (rounds of time_interleaved).
ROUNDS = 3


def time_calls(f, args, iters: int, warmup: int, pipelined: bool = False,
               warm_s: float = 0.0) -> tuple[list[float], Any]:
    """Per-call wall times in seconds (after warmup) and the last result; pipelined: the
    mean per call of each of three batches of `iters` back-to-back calls. warm_s: seconds of
    back-to-back calls after the warmup calls, before timing."""
    out = _warm(f, args, warmup, warm_s)
    times = []
    for _ in range(ROUNDS if pipelined else 1):
        batch, out = _batch(f, args, iters, pipelined)
        times += batch
    return times, out


def time_interleaved(jobs: list[tuple[Any, tuple]], iters: int, warmup: int,
                     pipelined: bool = False, warm_s: float = 0.0) -> list[tuple[Any, Any]]:
    """time_calls for several functions at once, (times, last result) per (f, args) of jobs,
    or (the exception, None) for one that raised or whose f is an exception (a program that
    failed to compile): the same batches, but interleaved. Every
    function takes its warmup calls first, then the first one runs back to back for warm_s
    seconds, and each of three rounds times one batch of every function in turn (pipelined:
    `iters` back-to-back calls; else iters / 3 calls, each timed alone), in an order reversed
    from one round to the next.

    Why: rows compared with one another (two backends, two cache layouts, a comparator) are
    then timed under the same conditions. Timed one after another, a millisecond program's
    rows depend on the state the GPU happens to be in while each is timed, a difference the
    batches of one row share, so that it never shows as their spread.
    """
    results: list[tuple[Any, Any]] = [(None, None)] * len(jobs)
    live = []
    for i, (f, args) in enumerate(jobs):
        try:
            if isinstance(f, Exception):
                raise f
            results[i] = ([], _warm(f, args, warmup, 0.0))
            live.append(i)
        except Exception as e:  # noqa: BLE001 - the job's result
            results[i] = (e, None)
    if live:
        _keep_busy(*jobs[live[0]], warm_s)
    per_round = iters if pipelined else -(-iters // ROUNDS)
    for r in range(ROUNDS):
        for i in (live if r % 2 == 0 else live[::-1]):
            if isinstance(results[i][0], Exception):
                continue
            f, args = jobs[i]
            try:
                batch, out = _batch(f, args, per_round, pipelined)
                results[i] = (results[i][0] + batch, out)
            except Exception as e:  # noqa: BLE001 - the job's result
                results[i] = (e, None)
    return results


def _warm(f, args, warmup: int, warm_s: float):
    """The warmup calls (at least two), then warm_s seconds of back-to-back calls; the last
    result."""
    out = None
    # At least two: the first call compiles, and JAX's Pallas modules load on
    # the first trace in a process and register config options, which changes
    # the jit cache key, so the second call of the first Pallas function
    # compiles again.
    for _ in range(max(warmup, 2)):
        out = jax.block_until_ready(f(*args))
    return _keep_busy(f, args, warm_s, out)


def _keep_busy(f, args, warm_s: float, out=None):
    """Back-to-back calls for warm_s seconds; the last result (`out` if none ran).

    A GPU left idle while the host compiled runs at a low clock for a while after it resumes;
    a few short calls do not bring it back up, this keeps it busy until they do."""
    t_end = time.perf_counter() + warm_s
    while time.perf_counter() < t_end:
        for _ in range(8):
            out = f(*args)
        out = jax.block_until_ready(out)
    return out


def _batch(f, args, iters: int, pipelined: bool) -> tuple[list[float], Any]:
    """One timed batch: pipelined, [the mean of `iters` back-to-back calls]; else the time of
    each of `iters` calls, each ended by block_until_ready."""
    out = None
    if pipelined:
        t0 = time.perf_counter()
        for _ in range(iters):
            out = f(*args)
        out = jax.block_until_ready(out)
        return [(time.perf_counter() - t0) / iters], out
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return times, out


def split_kwargs(kw: dict[str, Any]) -> tuple[dict, dict]:
    """(array kwargs, static kwargs): arrays become jit arguments, not constants."""
    arrays = {n: x for n, x in kw.items() if isinstance(x, jax.Array)}
    static = {n: x for n, x in kw.items() if n not in arrays}
    return arrays, static


def make_fns(fn, causal: bool, static_kw: dict):
    """Jitted forward and forward+backward of one implementation."""
    def forward(q, k, v, arrays):
        return fn(q, k, v, causal, **static_kw, **arrays)

    def forward_backward(q, k, v, do, arrays):
        # Differentiate w.r.t. q, k, v only; segment ids are integers.
        out, vjp = jax.vjp(lambda q, k, v: forward(q, k, v, arrays), q, k, v)
        return vjp(do.astype(out.dtype))

    return jax.jit(forward), jax.jit(forward_backward)


def make_backward(fn, causal: bool, static_kw: dict, q, k, v, do, arrays):
    """(jitted backward, its arguments): the vjp closure of one forward call, whose residuals
    are computed here, once, applied to the cotangent."""
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, causal, **static_kw, **arrays), q, k, v)
    return jax.jit(lambda vjp, do: vjp(do)), (vjp, do.astype(out.dtype))


def bench_impl(fn, q, k, v, do, causal, kw, iters, iters_bwd, warmup,
               pipelined: bool = False, warm_s: float = 0.0) -> tuple[dict, Any]:
    """Time one implementation, each pass after warm_s seconds of back-to-back calls. Returns
    (row fields, forward output or None)."""
    row: dict[str, Any] = {"status": "ok", "error": None}
    arrays, static = split_kwargs(kw)
    fwd, fwdbwd = make_fns(fn, causal, static)
    out = None
    try:
        times, out = time_calls(fwd, (q, k, v, arrays), iters, warmup, pipelined, warm_s)
        row["fwd_times_ms"] = [t * 1e3 for t in times]
        row["fwd_ms"] = statistics.median(times) * 1e3
    except NotApplicable as e:
        return {"status": "n.a.", "error": str(e)}, None
    except Exception as e:  # noqa: BLE001 - any failure is a result
        return {"status": "error", "error": short_error(e)}, None
    try:
        times, grads = time_calls(fwdbwd, (q, k, v, do, arrays), iters_bwd, warmup,
                                  pipelined, warm_s)
        del grads
        row["fwdbwd_times_ms"] = [t * 1e3 for t in times]
        row["fwdbwd_ms"] = statistics.median(times) * 1e3
        bwd, bwd_args = make_backward(fn, causal, static, q, k, v, do, arrays)
        times, grads = time_calls(bwd, bwd_args, iters_bwd, warmup, pipelined, warm_s)
        del grads, bwd_args
        row["bwd_times_ms"] = [t * 1e3 for t in times]
        row["bwd_ms"] = statistics.median(times) * 1e3
    except Exception as e:  # noqa: BLE001
        # Keep the forward numbers: a backward failure is a partial result.
        row["status"] = "bwd error"
        row["error"] = short_error(e)
    return row, out


def run_case(case: Case, impl_names, args, key, on_row=None) -> list[dict]:
    """All implementations on one case: timing, ratios and accuracy rows. on_row(rows so far,
    ratios included) after each implementation's timing, before the accuracy check, which at
    long sequences takes a while: a run cut by a time limit then keeps every timed row."""
    k_in, k_var, k_rows = jax.random.split(key, 3)
    q, k, v, do = make_inputs(case, DTYPES[args.dtype], k_in)
    kw = variant_kwargs(case, k_var)
    # cuDNN first, so its output exists when the others are compared with it.
    names = sorted(impl_names, key=lambda n: n != "cudnn")
    # APIs without segment ids take a dense mask, built here once: a model holds its mask, so
    # building it is no part of the attention's time.
    dense = dict(kw)
    if "q_segment_ids" in kw:
        dense[DENSE_MASK] = dense_segment_mask(kw["q_segment_ids"], kw["kv_segment_ids"])
    runs = [(n, IMPLS[n], kw if n.startswith("pallas_flash") else dense) for n in names]
    if case.variant and "pallas_flash" in impl_names:
        runs.append((PLAIN, IMPLS["pallas_flash"], {}))

    rows, outputs = [], {}
    for name, fn, run_kw in runs:
        print(f"  {case.name} causal={case.causal} {name} ...", flush=True)
        fields, out = bench_impl(fn, q, k, v, do, case.causal, dict(run_kw),
                                 args.iters, args.iters_bwd, args.warmup,
                                 args.timer == "pipelined", default_warm_s())
        row = {"case": case.name, "variant": case.variant, "batch": case.batch,
               "seq": case.seq, "q_heads": case.q_heads, "kv_heads": case.kv_heads,
               "head_dim": case.head_dim, "head_dim_v": case.head_dim_v,
               "causal": case.causal, "dtype": args.dtype,
               "impl": name, **fields}
        add_throughput(row, case, run_kw)
        # The row's speeds as soon as they exist: a run cut by a time limit keeps them in its
        # log (the table prints only at the end).
        print("    " + progress_line(row), flush=True)
        rows.append(row)
        if on_row:
            add_ratios(rows)
            on_row(rows)
        if out is not None:
            outputs[name] = out
        del out

    add_ratios(rows)
    add_accuracy(rows, outputs, case, q, k, v, kw, args.ref_rows, k_rows)
    return rows


def progress_line(row: dict) -> str:
    """'fwd 1.733 ms 634.5 TF/s, bwd ...' for the passes a row timed, or its error."""
    if row.get("status") != "ok":
        return f"{row.get('status')}: {row.get('error')}"
    parts = [f"{p} {row[f'{p}_ms']:.3f} ms {row[f'{p}_tflops']:.1f} TF/s"
             for p in ("fwd", "bwd") if row.get(f"{p}_ms") and row.get(f"{p}_tflops")]
    return ", ".join(parts) or "no pass timed"


def add_throughput(row: dict, case: Case, kw: dict) -> None:
    """TFLOP/s of each pass that was timed."""
    for pass_, ms_key in (("fwd", "fwd_ms"), ("bwd", "bwd_ms"), ("fwdbwd", "fwdbwd_ms")):
        flops = case_flops(case, kw, pass_)
        row[f"{pass_}_flops"] = flops
        ms = row.get(ms_key)
        # A time at or below zero is noise on a tiny case, not a speed.
        row[f"{pass_}_tflops"] = flops / (ms * 1e-3) / 1e12 if ms and ms > 0 else None


def add_ratios(rows: list[dict]) -> None:
    """Speed relative to cuDNN (and to our plain kernel): >1 means faster."""
    by_name = {r["impl"]: r for r in rows}
    for base_name, prefix in (("cudnn", "vs_cudnn"), (PLAIN, "vs_plain")):
        base = by_name.get(base_name)
        for r in rows:
            for pass_ in ("fwd", "bwd", "fwdbwd"):
                a = base.get(f"{pass_}_ms") if base else None
                b = r.get(f"{pass_}_ms")
                r[f"{pass_}_{prefix}"] = a / b if a and b and a > 0 and b > 0 else None
