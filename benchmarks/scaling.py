"""Context-parallel scaling of `pallas_flash.ring_attention` against one device.

Usage, from the repository root:

    PYTHONPATH=. python benchmarks/scaling.py --out $OUT            # all visible GPUs
    PYTHONPATH=. python benchmarks/scaling.py --devices 1,2 --out $OUT   # P=1 and P=2 rings
    PYTHONPATH=. python benchmarks/scaling.py --smoke --out /tmp/s  # tiny shapes, CPU devices

On a CPU the --smoke run asks XLA for 4 host devices (unless XLA_FLAGS already sets a count),
so the ring has devices to run on; the kernels then run in Pallas interpret mode. On a GPU set
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 if part 2 should compare against (nearly) the whole
memory: JAX's default `bytes_limit` is 75% of it.

Defaults: batch 1, 16 heads (q and kv; --kv-heads for GQA), head_dim 128, causal, bf16. The
context-parallel call runs over the first P devices for each P of --devices (default: all
visible; P=1 runs the ring on one device, against flash_attention on the same device), with
--strategy ring, allgather or auto (default ring).

Part 1, timing (rows "time"). For each --seqs length, one jitted forward+backward step
(`jax.vjp` of the attention, applied to a random cotangent; the step returns the output and
dq, dk, dv) is compiled, then run `--warmup` times and `--iters` times, each call ended by
`jax.block_until_ready`; the row reports the median, and the compiled step's per-device
memory analysis (argument + output + temp - alias bytes, as in part 2). It is timed:
  * on one device with `flash_attention`;
  * on P devices with `ring_attention` (zig-zag layout, sequence split over a mesh
    axis "context", inputs placed with a NamedSharding along the sequence). The inputs are the
    one-device inputs put into zig-zag order with `zigzag_permute` (a model does that once, at
    its input, so the permutation is not part of the timed step).
TFLOP/s counts the forward as 4*B*H*S*S*D, halved for causal, and forward+backward as 3.5x
that (`pallas_flash.bench.cases.attention_flops`); the ring's total is that count over its time
and its per-GPU figure the total / P. Scaling efficiency = t_1 / (P * t_P): 1.0 is perfect.
The ring row also checks correctness: its output (and gradients), put back into natural
order, against the one-device step's at the same length, as ||ring - one|| / ||one||; the
output must be within 2e-2 (bf16) for "match".

Part 2, longest sequence that fits (rows "fit"). The steps are NOT run at these lengths (far
too slow): the jitted step is lowered and compiled from `jax.ShapeDtypeStruct` inputs (with
the ring's sharding) and XLA's compile-time `memory_analysis()` gives, per device, the bytes of
arguments, outputs and temporaries. Their sum (less any aliasing) is the prediction, compared
with the device's `bytes_limit`. A compile that fails for lack of memory counts as "does not
fit"; once a length does not fit, longer ones are skipped. This is a prediction, not a run:
it says nothing of run time, and a run may still fail for other reasons.

Part 3, longest sequence that runs (rows "run", with --run-fit). Each length is RUN: one
forward+backward step in a fresh child process (inputs made on the devices, already split
along the sequence for the ring, so no device holds the whole sequence), which reports the
largest `peak_bytes_in_use` of the devices it used (`memory_stats()`, so the peak is the
step's and its inputs') and whether it ran out of memory. Lengths grow until the first that
fails. This is the measured counterpart of part 2; its lengths are --run-seqs-1 (one device)
and --run-seqs-ring (each P).

Every failure (out of memory, a compile error, the --time-budget running out) becomes a
result row, never a crash. Rows are printed as they complete and the JSON (--out) is
rewritten after every row, so a run cut by an outer timeout keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _request_host_devices(argv) -> None:
    """Fake CPU devices for --smoke. XLA reads the flag once, when JAX starts its CPU backend,
    so this must happen before `import jax`; it changes nothing on a GPU, and a count already
    in XLA_FLAGS (e.g. from tests/conftest.py) is left alone."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "--smoke" in argv and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=4".strip()


_request_host_devices(sys.argv[1:] if __name__ == "__main__" else [])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402

try:
    import pallas_flash as pf
except ImportError:
    # Run from a source checkout without PYTHONPATH: the package sits one directory up.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import pallas_flash as pf

from pallas_flash.bench.accuracy import rel_err  # noqa: E402
from pallas_flash.bench.cases import attention_flops, parse_seq, seq_label  # noqa: E402
from pallas_flash.bench.impls import short_error  # noqa: E402
from pallas_flash.bench.report import git_commit  # noqa: E402
from pallas_flash.bench.timing import time_calls  # noqa: E402

AXIS = "context"
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}
# ||ring - one|| / ||one|| allowed for the output: a few bf16 roundings (2^-8 each) apart.
MATCH_TOL = {"bf16": 2e-2, "fp16": 5e-3, "fp32": 1e-4}
SINGLE, RING = "flash_attention", "ring_attention"
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Shape:
    """Everything but the sequence length."""

    batch: int
    heads: int
    head_dim: int
    causal: bool
    dtype: str
    kv_heads: int | None = None  # None: as many as heads

    def fwdbwd_flops(self, seq: int) -> float:
        return attention_flops(self.batch, seq, seq, self.heads, self.head_dim, self.causal,
                               "fwdbwd")

    def tokens(self, seq: int, kv: bool = False) -> tuple[int, int, int, int]:
        heads = self.kv_heads or self.heads if kv else self.heads
        return (self.batch, seq, heads, self.head_dim)

    def structs(self, seq: int, sharding=None):
        """q, k, v, dO as ShapeDtypeStructs."""
        dtype = DTYPES[self.dtype]
        return [jax.ShapeDtypeStruct(self.tokens(seq, kv=i in (1, 2)), dtype, sharding=sharding)
                for i in range(4)]


# ================================================================================================
# The step: one forward+backward, on one device or on the ring
# ================================================================================================


def make_mesh(devices):
    return jax.make_mesh((len(devices),), (AXIS,), axis_types=(AxisType.Auto,), devices=devices)


def along_seq(mesh) -> NamedSharding:
    """[batch, seq, heads, dim] split over the ring axis along seq."""
    return NamedSharding(mesh, PartitionSpec(None, AXIS, None, None))


def attention_fn(impl: str, causal: bool, mesh=None, strategy: str = "ring"):
    if impl == SINGLE:
        return lambda q, k, v: pf.flash_attention(q, k, v, causal=causal)
    return lambda q, k, v: pf.ring_attention(q, k, v, mesh=mesh, axis_name=AXIS, causal=causal,
                                             layout="zigzag", strategy=strategy)


def make_step(attention):
    """Jitted (q, k, v, do) -> (out, (dq, dk, dv)). The output is returned too, so the ring's
    correctness check uses the very results that were timed (it is computed anyway)."""

    def step(q, k, v, do):
        out, vjp = jax.vjp(attention, q, k, v)
        return out, vjp(do)

    return jax.jit(step)


def make_inputs(shape: Shape, seq: int, key):
    """Random normal q, k, v and cotangent on the default device (never zeros: zeros make every
    softmax row uniform and would hide a wrong merge)."""
    dtype = DTYPES[shape.dtype]
    return tuple(jax.random.normal(k, shape.tokens(seq, kv=i in (1, 2)), dtype)
                 for i, k in enumerate(jax.random.split(key, 4)))


# ================================================================================================
# Rows: printed and saved as they complete
# ================================================================================================


class Recorder:
    """Collects rows; prints each one at once and rewrites the JSON after each, so a run cut
    by a timeout still shows (and keeps) what it finished. Also keeps the time budget."""

    def __init__(self, meta: dict, out_dir: str, budget_s: float):
        self.meta, self.rows = meta, []
        self.start, self.budget_s = time.perf_counter(), budget_s
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, f"scaling_{stamp}.json")

    def out_of_time(self) -> bool:
        return time.perf_counter() - self.start > self.budget_s

    def skipped(self, row: dict) -> dict:
        return self.add({**row, "status": "skipped",
                         "error": f"time budget of {self.budget_s:.0f} s spent"})

    def add(self, row: dict) -> dict:
        row["elapsed_s"] = round(time.perf_counter() - self.start, 1)
        self.rows.append(row)
        print(format_row(row), flush=True)
        self.save(complete=False)
        return row

    def save(self, complete: bool) -> None:
        with open(self.path, "w") as f:
            json.dump({"meta": self.meta, "complete": complete, "rows": self.rows}, f, indent=1)


# ================================================================================================
# Part 1: timing and correctness
# ================================================================================================


def base_row(kind: str, impl: str, devices: int, shape: Shape, seq: int) -> dict:
    return {"kind": kind, "impl": impl, "devices": devices, "seq": seq, "batch": shape.batch,
            "heads": shape.heads, "kv_heads": shape.kv_heads or shape.heads,
            "head_dim": shape.head_dim, "causal": shape.causal, "dtype": shape.dtype,
            "status": "ok", "error": None}


def timed_row(row: dict, step, inputs, shape: Shape, args):
    """Fills row with the compiled step's memory analysis and the timing of step(*inputs);
    returns the step's result (None on error)."""
    try:
        compiled = compile_step(step, inputs)
        row.update(memory_fields(compiled.memory_analysis()))
        times, result = time_calls(compiled, inputs, args.iters, args.warmup)
    except Exception as e:  # noqa: BLE001 - any failure (OOM, lowering) is a result row
        row.update(status="error", error=short_error(e))
        return None
    ms = statistics.median(times) * 1e3
    total = shape.fwdbwd_flops(row["seq"]) / (ms * 1e-3) / 1e12
    row.update(times_ms=[t * 1e3 for t in times], ms=ms, tflops_total=total,
               tflops_per_gpu=total / row["devices"])
    return result


def compare_ring(ring_result, single_result, devices: int, dtype: str) -> dict:
    """Ring vs one-device results, both brought to device 0 in natural token order."""
    home = jax.devices()[0]

    def natural(x):
        return pf.zigzag_unpermute(jax.device_put(x, home), devices, axis=1)

    ring_out, ring_grads = ring_result
    one_out, one_grads = single_result
    out_err = rel_err(natural(ring_out), one_out)
    grad_err = max(rel_err(natural(g), g1) for g, g1 in zip(ring_grads, one_grads))
    return {"out_rel_err": out_err, "grad_rel_err": grad_err, "tolerance": MATCH_TOL[dtype],
            "match": bool(out_err <= MATCH_TOL[dtype])}


def time_ring(args, shape: Shape, mesh, inputs, single: dict, single_result, ring: dict):
    """Times the ring on the zig-zag-permuted inputs and checks it against the one-device
    result; fills the ring row."""
    devices = mesh.size
    ring_result = None
    try:
        ring_inputs = [jax.device_put(pf.zigzag_permute(x, devices, axis=1), along_seq(mesh))
                       for x in inputs]
        step = make_step(attention_fn(RING, shape.causal, mesh, args.strategy))
        ring_result = timed_row(ring, step, ring_inputs, shape, args)
    except Exception as e:  # noqa: BLE001 - e.g. a length the zig-zag cannot split
        ring.update(status="error", error=short_error(e))
    if ring.get("ms") and single.get("ms"):
        ring["speedup"] = single["ms"] / ring["ms"]
        ring["efficiency"] = single["ms"] / (devices * ring["ms"])
    if ring_result is not None and single_result is not None:
        try:
            ring.update(compare_ring(ring_result, single_result, devices, shape.dtype))
        except Exception as e:  # noqa: BLE001
            ring["check_error"] = short_error(e)


def ring_row(kind: str, shape: Shape, mesh, seq: int, args) -> dict:
    return {**base_row(kind, RING, mesh.size, shape, seq), "strategy": args.strategy}


def run_timing(args, shape: Shape, meshes, rec: Recorder) -> None:
    for i, seq in enumerate(args.seqs):
        single = base_row("time", SINGLE, 1, shape, seq)
        rings = [ring_row("time", shape, mesh, seq, args) for mesh in meshes]
        if rec.out_of_time():
            for row in (single, *rings):
                rec.skipped(row)
            continue
        try:
            inputs = make_inputs(shape, seq, jax.random.fold_in(jax.random.key(args.seed), i))
        except Exception as e:  # noqa: BLE001 - e.g. out of memory for the inputs themselves
            for row in (single, *rings):
                rec.add({**row, "status": "error", "error": "inputs: " + short_error(e)})
            continue
        print(f"  timing {SINGLE} seq={seq_label(seq)} on 1 device ...", flush=True)
        single_result = timed_row(single, make_step(attention_fn(SINGLE, shape.causal)), inputs,
                                  shape, args)
        rec.add(single)
        for mesh, ring in zip(meshes, rings):
            if rec.out_of_time():
                rec.skipped(ring)
                continue
            print(f"  timing {RING} ({args.strategy}) seq={seq_label(seq)} on {mesh.size} "
                  "device(s) ...", flush=True)
            time_ring(args, shape, mesh, inputs, single, single_result, ring)
            rec.add(ring)
        # Free this length's buffers before the next, longer one.
        del inputs, single_result


# ================================================================================================
# Part 2: longest sequence that fits (compile-time memory analysis, nothing is run)
# ================================================================================================


def device_limit(devices, override_gib: float | None) -> int | None:
    """The smallest `bytes_limit` of the devices (None when the backend does not report one,
    as on the CPU), or the --mem-limit-gib override."""
    if override_gib is not None:
        return int(override_gib * GIB)
    limits = []
    for d in devices:
        try:
            limits.append((d.memory_stats() or {}).get("bytes_limit"))
        except Exception:  # noqa: BLE001 - a backend without memory stats
            limits.append(None)
    return None if None in limits or not limits else min(limits)


def is_oom(exc: BaseException) -> bool:
    text = str(exc)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def compile_step(step, structs):
    # Autotuning would allocate real buffers of the candidate's size on the device (and could
    # fail a huge length for a reason that is not the step's own footprint); the buffer
    # assignment we read does not depend on it.
    lowered = step.lower(*structs)
    try:
        return lowered.compile(compiler_options={"xla_gpu_autotune_level": 0})
    except Exception as e:  # noqa: BLE001
        if "xla_gpu_autotune_level" not in str(e):
            raise
        return lowered.compile()


def memory_fields(stats) -> dict:
    """The per-device fields of XLA's memory analysis, and their sum."""
    fields = {name: int(getattr(stats, f"{name}_size_in_bytes"))
              for name in ("argument", "output", "temp", "alias")}
    # Arguments and outputs live through the whole call and temporaries are one allocation,
    # so this is what running the executable takes on each device.
    predicted = fields["argument"] + fields["output"] + fields["temp"] - fields["alias"]
    peak = getattr(stats, "peak_memory_in_bytes", None)
    return {**{f"{n}_bytes": b for n, b in fields.items()}, "predicted_bytes": predicted,
            "xla_peak_bytes": int(peak) if peak else None}


def predict(step, structs) -> dict:
    """XLA's per-device memory analysis of the compiled step."""
    t0 = time.perf_counter()
    stats = compile_step(step, structs).memory_analysis()
    return {**memory_fields(stats), "compile_s": time.perf_counter() - t0}


def growing(kind: str, method: str, args, shape: Shape, impl: str, seqs, mesh, rec: Recorder,
            limit_gib=None):
    """(row, seq) for each length in increasing order, until the caller sets row["fits"] to
    False: longer lengths, and those past the time budget, get their skipped rows here."""
    devices = mesh.size if impl == RING else 1
    used = mesh.devices.flat if impl == RING else jax.devices()[:1]
    limit = device_limit(list(used), limit_gib)
    too_big = None
    for seq in sorted(seqs):
        row = {**(ring_row(kind, shape, mesh, seq, args) if impl == RING
                  else base_row(kind, impl, devices, shape, seq)),
               "limit_bytes": limit, "method": method}
        if too_big is not None:
            # Memory only grows with the length: a longer one cannot fit either.
            rec.add({**row, "status": "skipped", "fits": False,
                     "error": f"{seq_label(too_big)} did not fit"})
        elif rec.out_of_time():
            rec.skipped(row)
        else:
            yield row, seq
            if row.get("fits") is False:
                too_big = seq
            rec.add(row)


def run_fit(args, shape: Shape, impl: str, seqs, mesh, rec: Recorder) -> None:
    """Compile-only memory prediction for growing seqs; stops at the first that does not fit."""
    devices = mesh.size if impl == RING else 1
    for row, seq in growing("fit", "XLA compile-time memory_analysis, per device (not run)",
                            args, shape, impl, seqs, mesh, rec, args.mem_limit_gib):
        structs = shape.structs(seq, along_seq(mesh) if impl == RING else None)
        print(f"  compiling {impl} seq={seq_label(seq)} on {devices} device(s) for its "
              "memory analysis ...", flush=True)
        try:
            step = make_step(attention_fn(impl, shape.causal, mesh, args.strategy))
            row.update(predict(step, structs))
            limit = row["limit_bytes"]
            row["fits"] = None if limit is None else row["predicted_bytes"] <= limit
        except Exception as e:  # noqa: BLE001
            oom = is_oom(e)
            row.update(status="oom" if oom else "error", error=short_error(e),
                       fits=False if oom else None)


def longest_fit(rows, impl: str, devices: int | None = None, kind: str = "fit") -> int | None:
    fits = [r["seq"] for r in rows if r["kind"] == kind and r["impl"] == impl
            and (devices is None or r["devices"] == devices) and r.get("fits") is True]
    return max(fits, default=None)


# ================================================================================================
# Part 3: longest sequence that runs (one step per length, each in a fresh process)
# ================================================================================================

CHILD_MARKER = "SCALING_RUN_JSON "


def run_child(point: dict) -> dict:
    """One forward+backward step of `point` (impl, seq, devices, strategy, shape) in this
    process: the largest per-device `peak_bytes_in_use` of the devices used, or "oom"."""
    shape = Shape(**point["shape"])
    used = jax.devices()[:point["devices"]]
    mesh = make_mesh(used)
    ring = point["impl"] == RING
    structs = shape.structs(point["seq"], along_seq(mesh) if ring
                            else NamedSharding(make_mesh(used[:1]), PartitionSpec()))
    result = {"status": "ok", "error": None}
    try:
        # Made where they live: the ring's inputs are generated shard by shard.
        make = jax.jit(lambda key: tuple(jax.random.normal(k, x.shape, x.dtype)
                                         for k, x in zip(jax.random.split(key, 4), structs)),
                       out_shardings=tuple(x.sharding for x in structs))
        inputs = make(jax.random.key(0))
        step = make_step(attention_fn(point["impl"], shape.causal, mesh, point["strategy"]))
        compiled = compile_step(step, inputs)
        result.update(memory_fields(compiled.memory_analysis()))
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        result["step_s"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - an OOM is the answer, anything else a result too
        result.update(status="oom" if is_oom(e) else "error", error=short_error(e))
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in used]
    result["peak_bytes_per_device"] = peaks
    result["peak_bytes"] = None if None in peaks else max(peaks)
    return result


def run_child_process(point: dict, timeout_s: float) -> dict:
    """run_child in a fresh process, so that no earlier length's peak is counted."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    cmd = [sys.executable, os.path.abspath(__file__), "--_run-child", json.dumps(point)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "error", "error": f"timeout after {timeout_s:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(CHILD_MARKER):
            return json.loads(line[len(CHILD_MARKER):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"status": "error", "error": f"exit {proc.returncode}: {tail}"[:300]}


def run_measured(args, shape: Shape, impl: str, seqs, mesh, rec: Recorder,
                 runner=run_child_process) -> None:
    """Runs one step per length, growing, until the first that fails."""
    devices = mesh.size if impl == RING else 1
    for row, seq in growing("run", "run: one step in a fresh process, max over devices of "
                            "peak_bytes_in_use", args, shape, impl, seqs, mesh, rec):
        print(f"  running {impl} seq={seq_label(seq)} on {devices} device(s) ...", flush=True)
        point = {"impl": impl, "seq": seq, "devices": devices, "strategy": args.strategy,
                 "shape": dataclasses.asdict(shape)}
        row.update(runner(point, args.child_timeout))
        row["fits"] = row["status"] == "ok"


# ================================================================================================
# Output
# ================================================================================================


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _tf(x) -> str:
    """TFLOP/s: one decimal on a GPU, three significant digits on a CPU."""
    return _fmt(x, ".1f" if x is None or x >= 10 else ".3g")


def _size(x) -> str:
    """Bytes in the largest unit that keeps the number >= 1 (GiB on a GPU, KiB on smoke runs)."""
    if x is None:
        return "-"
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x} B"


def format_row(r: dict) -> str:
    left = f"{r['kind']:<4} {r['impl']:<15} {r['devices']:>2} dev  seq {seq_label(r['seq']):>5}"
    if r["status"] not in ("ok", "oom"):
        return f"{left}  {r['status']}: {r['error']}"
    if r["kind"] == "run":
        return (f"{left}  ran {'yes' if r.get('fits') else 'NO'}  peak "
                f"{_size(r.get('peak_bytes'))}/device (XLA predicted "
                f"{_size(r.get('predicted_bytes'))}) limit {_size(r.get('limit_bytes'))}"
                + (f"  {r['error']}" if r.get("error") else ""))
    if r["kind"] == "time":
        line = (f"{left}  {_fmt(r.get('ms'), '.2f'):>9} ms  {_tf(r.get('tflops_total')):>6} TF/s "
                f"total  {_tf(r.get('tflops_per_gpu')):>6} TF/s/GPU  "
                f"{_size(r.get('predicted_bytes'))}/device")
        if r["impl"] == RING:
            line += (f"  efficiency {_fmt(r.get('efficiency'), '.2f')}"
                     f"  out err {_fmt(r.get('out_rel_err'), '.1e')}"
                     f"  grad err {_fmt(r.get('grad_rel_err'), '.1e')}"
                     f"  match {r.get('match', '-')}")
            if r.get("check_error"):
                line += f"  check error: {r['check_error']}"
        return line
    fits = {True: "yes", False: "NO", None: "unknown (no limit)"}[r.get("fits")]
    if r["status"] == "oom":
        return f"{left}  fits NO (compile ran out of memory: {r['error']})"
    return (f"{left}  predicted {_size(r.get('predicted_bytes'))}/device "
            f"(args {_size(r.get('argument_bytes'))}, out {_size(r.get('output_bytes'))}, "
            f"temp {_size(r.get('temp_bytes'))}; XLA peak {_size(r.get('xla_peak_bytes'))}) "
            f"limit {_size(r.get('limit_bytes'))}  fits {fits}  "
            f"[compile-time memory analysis, not a run; compile {r['compile_s']:.1f} s]")


def format_table(rows: list[dict], devices: int) -> str:
    lines = []
    timing = [r for r in rows if r["kind"] == "time"]
    if timing:
        head = (f"{'impl':<15} {'dev':>3} {'seq':>5} {'ms':>10} {'TF/s':>7} {'TF/s/GPU':>8} "
                f"{'effic.':>6} {'out err':>8} {'match':>5} {'per device':>11}")
        lines += ["forward+backward step (median of timed runs)", head, "-" * len(head)]
        for r in timing:
            left = f"{r['impl']:<15} {r['devices']:>3} {seq_label(r['seq']):>5}"
            if r["status"] != "ok":
                lines.append(f"{left} {r['status']}: {r['error']}")
                continue
            match = r.get("match")
            lines.append(f"{left} {_fmt(r.get('ms'), '.2f'):>10} {_tf(r.get('tflops_total')):>7} "
                         f"{_tf(r.get('tflops_per_gpu')):>8} {_fmt(r.get('efficiency'), '.2f'):>6} "
                         f"{_fmt(r.get('out_rel_err'), '.1e'):>8} "
                         f"{'-' if match is None else ('yes' if match else 'NO'):>5} "
                         f"{_size(r.get('predicted_bytes')):>11}")
        lines.append("efficiency = t_1 / (P * t_P); err = ||ring - one|| / ||one|| of the "
                     "output, in natural order; per device: XLA memory analysis of the step")
    fit = [r for r in rows if r["kind"] == "fit"]
    if fit:
        head = (f"{'impl':<15} {'dev':>3} {'seq':>5} {'per device':>11} {'limit':>11} "
                f"{'fits':>5}")
        lines += ["", "longest sequence that fits: XLA compile-time memory analysis, per device "
                  "(predicted, NOT run)", head, "-" * len(head)]
        for r in fit:
            left = f"{r['impl']:<15} {r['devices']:>3} {seq_label(r['seq']):>5}"
            if r["status"] not in ("ok", "oom"):
                lines.append(f"{left} {r['status']}: {r['error']}")
                continue
            fits = {True: "yes", False: "NO", None: "?"}[r.get("fits")]
            lines.append(f"{left} {_size(r.get('predicted_bytes')):>11} "
                         f"{_size(r.get('limit_bytes')):>11} {fits:>5}")
        for impl, dev in dict.fromkeys((r["impl"], r["devices"]) for r in fit):
            seq = longest_fit(rows, impl, dev)
            label = impl if impl == SINGLE else f"{impl} ({dev} dev)"
            lines.append(f"longest predicted to fit, {label}: "
                         f"{seq_label(seq) if seq else 'none of those tried'}")
    run = [r for r in rows if r["kind"] == "run"]
    if run:
        head = (f"{'impl':<15} {'dev':>3} {'seq':>5} {'peak/device':>11} {'predicted':>11} "
                f"{'limit':>11} {'ran':>4}")
        lines += ["", "longest sequence that runs: one step per length in a fresh process, "
                  "peak_bytes_in_use (measured)", head, "-" * len(head)]
        for r in run:
            left = f"{r['impl']:<15} {r['devices']:>3} {seq_label(r['seq']):>5}"
            if r["status"] == "skipped":
                lines.append(f"{left} skipped: {r['error']}")
                continue
            lines.append(f"{left} {_size(r.get('peak_bytes')):>11} "
                         f"{_size(r.get('predicted_bytes')):>11} {_size(r.get('limit_bytes')):>11} "
                         f"{'yes' if r.get('fits') else 'NO':>4}"
                         + (f"  {r['status']}: {r['error']}" if r.get("error") else ""))
        for impl, dev in dict.fromkeys((r["impl"], r["devices"]) for r in run):
            seq = longest_fit(rows, impl, dev, kind="run")
            lines.append(f"longest that ran, {impl} ({dev} dev): "
                         f"{seq_label(seq) if seq else 'none of those tried'}")
    lines += [f"script error: {r['error']}" for r in rows if r["kind"] == "script"]
    return "\n".join(lines)


# ================================================================================================
# CLI
# ================================================================================================


def parse_seqs(text: str) -> list[int]:
    return [parse_seq(s) for s in text.split(",") if s.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Context-parallel attention over P devices against flash_attention on one: "
                    "time, efficiency, correctness, per-device memory, and the longest sequence "
                    "that fits (predicted) and that runs (measured).")
    p.add_argument("--seqs", default=None, help="timed lengths, e.g. 64k,128k (default)")
    p.add_argument("--batch", type=int, default=None, help="default 1")
    p.add_argument("--heads", type=int, default=None, help="q heads (default 16)")
    p.add_argument("--kv-heads", type=int, default=None, help="kv heads (default: --heads)")
    p.add_argument("--devices", default=None,
                   help="ring sizes P, e.g. 1,2: the ring over the first P devices for each "
                        "(default: all visible)")
    p.add_argument("--strategy", choices=("ring", "allgather", "auto"), default="ring",
                   help="ring_attention's strategy (default ring)")
    p.add_argument("--head-dim", type=int, default=None, help="default 128")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--no-causal", dest="causal", action="store_false",
                   help="full attention instead of causal")
    p.add_argument("--iters", type=int, default=None, help="timed runs per step (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs first, at least 2")
    p.add_argument("--fit-seqs-1", default=None,
                   help="lengths for the one-device memory prediction (default 1M,2M,4M,8M)")
    p.add_argument("--fit-seqs-ring", default=None,
                   help="lengths for the ring's memory prediction (default 2M,4M,8M,16M)")
    p.add_argument("--no-fit", action="store_true", help="skip part 2 (memory prediction)")
    p.add_argument("--run-fit", action="store_true",
                   help="part 3: run one step per length, in a fresh process each, until one "
                        "fails (measured peak memory)")
    p.add_argument("--run-seqs-1", default=None,
                   help="lengths part 3 runs on one device (default 512k,1M,2M,3M)")
    p.add_argument("--run-seqs-ring", default=None,
                   help="lengths part 3 runs for each P (default 1M,2M,4M,6M)")
    p.add_argument("--child-timeout", type=float, default=600,
                   help="seconds allowed to one part-3 step, compile included (default 600)")
    p.add_argument("--_run-child", dest="run_child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mem-limit-gib", type=float, default=None,
                   help="compare predictions with this many GiB per device instead of the "
                        "device's bytes_limit")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds after which items not yet started are recorded as skipped "
                        "(default 120; a step already running is not interrupted)")
    p.add_argument("--out", default=os.environ.get("OUT", "."),
                   help="directory for the JSON (default $OUT or .)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true",
                   help="tiny CPU run: seq 256, 2 heads, head_dim 16, 1 iteration, tiny fit seqs")
    return p


def resolve_defaults(args) -> None:
    """Fill unset options; --smoke changes the defaults, explicit flags win."""
    smoke = args.smoke
    defaults = {
        "seqs": "256" if smoke else "64k,128k",
        "batch": 1,
        "heads": 2 if smoke else 16,
        "head_dim": 16 if smoke else 128,
        "iters": 1 if smoke else 5,
        "fit_seqs_1": "256,512" if smoke else "1M,2M,4M,8M",
        "fit_seqs_ring": "512,1k" if smoke else "2M,4M,8M,16M",
        "run_seqs_1": "256" if smoke else "512k,1M,2M,3M",
        "run_seqs_ring": "512" if smoke else "1M,2M,4M,6M",
        "devices": str(len(jax.devices())),
        "time_budget": 600 if smoke else 120,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("seqs", "fit_seqs_1", "fit_seqs_ring", "run_seqs_1", "run_seqs_ring"):
        setattr(args, name, parse_seqs(getattr(args, name)))
    args.devices = [int(p) for p in str(args.devices).split(",") if p.strip()]
    if not args.devices or not all(1 <= p <= len(jax.devices()) for p in args.devices):
        raise SystemExit(f"--devices: ring sizes between 1 and {len(jax.devices())}, got "
                         f"{args.devices}")


def metadata(args, argv) -> dict:
    dev = jax.devices()[0]
    return {
        "device": dev.device_kind, "backend": jax.default_backend(),
        "devices": max(args.devices), "ring_sizes": args.devices, "strategy": args.strategy,
        "jax_version": jax.__version__, "git_commit": git_commit(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(argv), "iters": args.iters, "warmup": args.warmup,
        "mem_fraction_env": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
        "flops": "fwd = 4*B*H*S*S*D (/2 causal); fwd+bwd = 3.5*fwd; ring TF/s = flops / time, "
                 "per GPU = that / P; efficiency = t_1 / (P * t_P)",
        "fit_method": "XLA compile-time memory_analysis of the jitted fwd+bwd step, per device: "
                      "argument + output + temp - alias bytes; nothing is run",
        "run_method": "one step per length in a fresh process; max over the devices used of "
                      "memory_stats()['peak_bytes_in_use']",
    }


def main(argv: list[str] | None = None) -> dict:
    """CLI entry point; returns the dict also written as JSON."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.run_child is not None:  # part 3's child: one step, one JSON line
        print(CHILD_MARKER + json.dumps(run_child(json.loads(args.run_child))), flush=True)
        return {}
    resolve_defaults(args)
    shape = Shape(args.batch, args.heads, args.head_dim, args.causal, args.dtype,
                  args.kv_heads)
    meshes = [make_mesh(jax.devices()[:p]) for p in args.devices]
    meta = metadata(args, argv)
    rec = Recorder(meta, args.out, args.time_budget)
    print(f"{meta['device']} x{len(jax.devices())} ({meta['backend']}), jax "
          f"{meta['jax_version']}, commit {meta['git_commit']}; B={shape.batch} H={shape.heads} "
          f"KV={shape.kv_heads or shape.heads} D={shape.head_dim} causal={shape.causal} "
          f"{shape.dtype}; ring sizes {args.devices}, strategy {args.strategy}", flush=True)

    one = make_mesh(jax.devices()[:1])
    parts = [lambda: run_timing(args, shape, meshes, rec)]
    if not args.no_fit:
        parts += [lambda: print("memory prediction: XLA compile-time memory_analysis per "
                                "device; these lengths are compiled, NOT run", flush=True),
                  lambda: run_fit(args, shape, SINGLE, args.fit_seqs_1, one, rec)]
        parts += [functools.partial(run_fit, args, shape, RING, args.fit_seqs_ring, mesh, rec)
                  for mesh in meshes]
    if args.run_fit:
        parts += [lambda: run_measured(args, shape, SINGLE, args.run_seqs_1, one, rec)]
        parts += [functools.partial(run_measured, args, shape, RING, args.run_seqs_ring, mesh,
                                    rec) for mesh in meshes]
    for part in parts:
        try:
            part()
        except Exception as e:  # noqa: BLE001 - a bug here must not cost the other parts
            rec.add({"kind": "script", "impl": "-", "devices": max(args.devices), "seq": 0,
                     "status": "error", "error": short_error(e)})

    meta["total_s"] = round(time.perf_counter() - rec.start, 1)
    meta["longest_fit"] = {SINGLE: longest_fit(rec.rows, SINGLE), **{
        f"{RING} P={p}": longest_fit(rec.rows, RING, p) for p in args.devices}}
    meta["longest_run"] = {SINGLE: longest_fit(rec.rows, SINGLE, kind="run"), **{
        f"{RING} P={p}": longest_fit(rec.rows, RING, p, kind="run") for p in args.devices}}
    rec.save(complete=True)
    print(f"\njson: {rec.path}\n{format_table(rec.rows, max(args.devices))}", flush=True)
    return {"meta": meta, "complete": True, "rows": rec.rows, "path": rec.path}


if __name__ == "__main__":
    main()
