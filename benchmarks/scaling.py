"""Context-parallel scaling of `pallas_flash.ring_attention` against one device.

Usage, from the repository root:

    PYTHONPATH=. python benchmarks/scaling.py --out $OUT            # all visible GPUs
    PYTHONPATH=. python benchmarks/scaling.py --smoke --out /tmp/s  # tiny shapes, CPU devices

On a CPU the --smoke run asks XLA for 4 host devices (unless XLA_FLAGS already sets a count),
so the ring has devices to run on; the kernels then run in Pallas interpret mode. On a GPU set
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 if part 2 should compare against (nearly) the whole
memory: JAX's default `bytes_limit` is 75% of it.

Defaults: batch 1, 16 heads (q and kv), head_dim 128, causal, bf16.

Part 1, timing (rows "time"). For each --seqs length, one jitted forward+backward step
(`jax.vjp` of the attention, applied to a random cotangent; the step returns the output and
dq, dk, dv) is run `--warmup` times, then `--iters` times, each call ended by
`jax.block_until_ready`; the row reports the median. It is timed twice:
  * on one device with `flash_attention`;
  * on all P visible devices with `ring_attention` (zig-zag layout, sequence split over a mesh
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

Every failure (out of memory, a compile error, the --time-budget running out) becomes a
result row, never a crash. Rows are printed as they complete and the JSON (--out) is
rewritten after every row, so a run cut by an outer timeout keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
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

    def fwdbwd_flops(self, seq: int) -> float:
        return attention_flops(self.batch, seq, seq, self.heads, self.head_dim, self.causal,
                               "fwdbwd")

    def tokens(self, seq: int) -> tuple[int, int, int, int]:
        return (self.batch, seq, self.heads, self.head_dim)


# ================================================================================================
# The step: one forward+backward, on one device or on the ring
# ================================================================================================


def make_mesh(devices):
    return jax.make_mesh((len(devices),), (AXIS,), axis_types=(AxisType.Auto,), devices=devices)


def along_seq(mesh) -> NamedSharding:
    """[batch, seq, heads, dim] split over the ring axis along seq."""
    return NamedSharding(mesh, PartitionSpec(None, AXIS, None, None))


def attention_fn(impl: str, causal: bool, mesh=None):
    if impl == SINGLE:
        return lambda q, k, v: pf.flash_attention(q, k, v, causal=causal)
    return lambda q, k, v: pf.ring_attention(q, k, v, mesh=mesh, axis_name=AXIS, causal=causal,
                                             layout="zigzag")


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
    return tuple(jax.random.normal(k, shape.tokens(seq), dtype) for k in jax.random.split(key, 4))


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
            "heads": shape.heads, "head_dim": shape.head_dim, "causal": shape.causal,
            "dtype": shape.dtype, "status": "ok", "error": None}


def timed_row(row: dict, step, inputs, shape: Shape, args):
    """Fills row with the timing of step(*inputs); returns the step's result (None on error)."""
    try:
        times, result = time_calls(step, inputs, args.iters, args.warmup)
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
        ring_result = timed_row(ring, make_step(attention_fn(RING, shape.causal, mesh)),
                                ring_inputs, shape, args)
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


def run_timing(args, shape: Shape, mesh, rec: Recorder) -> None:
    for i, seq in enumerate(args.seqs):
        single = base_row("time", SINGLE, 1, shape, seq)
        ring = base_row("time", RING, mesh.size, shape, seq)
        if rec.out_of_time():
            rec.skipped(single)
            rec.skipped(ring)
            continue
        try:
            inputs = make_inputs(shape, seq, jax.random.fold_in(jax.random.key(args.seed), i))
        except Exception as e:  # noqa: BLE001 - e.g. out of memory for the inputs themselves
            for row in (single, ring):
                rec.add({**row, "status": "error", "error": "inputs: " + short_error(e)})
            continue
        print(f"  timing {SINGLE} seq={seq_label(seq)} on 1 device ...", flush=True)
        single_result = timed_row(single, make_step(attention_fn(SINGLE, shape.causal)), inputs,
                                  shape, args)
        rec.add(single)
        if mesh.size < 2:
            rec.add({**ring, "status": "skipped", "error": "needs at least 2 devices"})
        elif rec.out_of_time():
            rec.skipped(ring)
        else:
            print(f"  timing {RING} seq={seq_label(seq)} on {mesh.size} devices ...", flush=True)
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


def predict(step, structs) -> dict:
    """XLA's per-device memory analysis of the compiled step."""
    t0 = time.perf_counter()
    stats = compile_step(step, structs).memory_analysis()
    fields = {name: int(getattr(stats, f"{name}_size_in_bytes"))
              for name in ("argument", "output", "temp", "alias")}
    # Arguments and outputs live through the whole call and temporaries are one allocation,
    # so this is what running the executable takes on each device.
    predicted = fields["argument"] + fields["output"] + fields["temp"] - fields["alias"]
    peak = getattr(stats, "peak_memory_in_bytes", None)
    return {**{f"{n}_bytes": b for n, b in fields.items()}, "predicted_bytes": predicted,
            "xla_peak_bytes": int(peak) if peak else None,
            "compile_s": time.perf_counter() - t0}


def run_fit(args, shape: Shape, impl: str, seqs, mesh, rec: Recorder) -> None:
    """Compile-only memory prediction for growing seqs; stops at the first that does not fit."""
    devices = mesh.size if impl == RING else 1
    used = mesh.devices.flat if impl == RING else jax.devices()[:1]
    limit = device_limit(list(used), args.mem_limit_gib)
    dtype = DTYPES[shape.dtype]
    too_big = None
    for seq in sorted(seqs):
        row = {**base_row("fit", impl, devices, shape, seq), "limit_bytes": limit,
               "method": "XLA compile-time memory_analysis, per device (not run)"}
        if impl == RING and devices < 2:
            rec.add({**row, "status": "skipped", "error": "needs at least 2 devices"})
            continue
        if too_big is not None:
            # Memory only grows with the length: a longer one cannot fit either.
            rec.add({**row, "status": "skipped", "fits": False,
                     "error": f"{seq_label(too_big)} did not fit"})
            continue
        if rec.out_of_time():
            rec.skipped(row)
            continue
        sharding = along_seq(mesh) if impl == RING else None
        structs = [jax.ShapeDtypeStruct(shape.tokens(seq), dtype, sharding=sharding)] * 4
        print(f"  compiling {impl} seq={seq_label(seq)} on {devices} device(s) for its "
              "memory analysis ...", flush=True)
        try:
            row.update(predict(make_step(attention_fn(impl, shape.causal, mesh)), structs))
            row["fits"] = None if limit is None else row["predicted_bytes"] <= limit
        except Exception as e:  # noqa: BLE001
            oom = is_oom(e)
            row.update(status="oom" if oom else "error", error=short_error(e),
                       fits=False if oom else None)
        if row.get("fits") is False:
            too_big = seq
        rec.add(row)


def longest_fit(rows, impl: str) -> int | None:
    fits = [r["seq"] for r in rows if r["kind"] == "fit" and r["impl"] == impl
            and r.get("fits") is True]
    return max(fits, default=None)


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
    if r["kind"] == "time":
        line = (f"{left}  {_fmt(r.get('ms'), '.2f'):>9} ms  {_tf(r.get('tflops_total')):>6} TF/s "
                f"total  {_tf(r.get('tflops_per_gpu')):>6} TF/s/GPU")
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
                f"{'effic.':>6} {'out err':>8} {'match':>5}")
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
                         f"{'-' if match is None else ('yes' if match else 'NO'):>5}")
        lines.append(f"efficiency = t_1 / ({devices} * t_{devices}); err = ||ring - one|| / "
                     "||one|| of the output, in natural order")
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
        for impl in dict.fromkeys(r["impl"] for r in fit):
            seq = longest_fit(rows, impl)
            lines.append(f"longest predicted to fit, {impl}: "
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
        description="Ring attention over all visible devices against flash_attention on one: "
                    "time, efficiency, correctness, and the longest sequence that fits.")
    p.add_argument("--seqs", default=None, help="timed lengths, e.g. 64k,128k (default)")
    p.add_argument("--batch", type=int, default=None, help="default 1")
    p.add_argument("--heads", type=int, default=None, help="q and kv heads (default 16)")
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
        "time_budget": 600 if smoke else 120,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("seqs", "fit_seqs_1", "fit_seqs_ring"):
        setattr(args, name, parse_seqs(getattr(args, name)))


def metadata(args, argv, mesh) -> dict:
    dev = jax.devices()[0]
    return {
        "device": dev.device_kind, "backend": jax.default_backend(), "devices": mesh.size,
        "jax_version": jax.__version__, "git_commit": git_commit(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(argv), "iters": args.iters, "warmup": args.warmup,
        "mem_fraction_env": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
        "flops": "fwd = 4*B*H*S*S*D (/2 causal); fwd+bwd = 3.5*fwd; ring TF/s = flops / time, "
                 "per GPU = that / P; efficiency = t_1 / (P * t_P)",
        "fit_method": "XLA compile-time memory_analysis of the jitted fwd+bwd step, per device: "
                      "argument + output + temp - alias bytes; nothing is run",
    }


def main(argv: list[str] | None = None) -> dict:
    """CLI entry point; returns the dict also written as JSON."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    resolve_defaults(args)
    shape = Shape(args.batch, args.heads, args.head_dim, args.causal, args.dtype)
    mesh = make_mesh(jax.devices())
    meta = metadata(args, argv, mesh)
    rec = Recorder(meta, args.out, args.time_budget)
    print(f"{meta['device']} x{mesh.size} ({meta['backend']}), jax {meta['jax_version']}, "
          f"commit {meta['git_commit']}; B={shape.batch} H={shape.heads} D={shape.head_dim} "
          f"causal={shape.causal} {shape.dtype}", flush=True)

    parts = [lambda: run_timing(args, shape, mesh, rec)]
    if not args.no_fit:
        parts += [lambda: print("memory prediction: XLA compile-time memory_analysis per "
                                "device; these lengths are compiled, NOT run", flush=True),
                  lambda: run_fit(args, shape, SINGLE, args.fit_seqs_1, mesh, rec),
                  lambda: run_fit(args, shape, RING, args.fit_seqs_ring, mesh, rec)]
    for part in parts:
        try:
            part()
        except Exception as e:  # noqa: BLE001 - a bug here must not cost the other parts
            rec.add({"kind": "script", "impl": "-", "devices": mesh.size, "seq": 0,
                     "status": "error", "error": short_error(e)})

    meta["total_s"] = round(time.perf_counter() - rec.start, 1)
    meta["longest_fit"] = {impl: longest_fit(rec.rows, impl) for impl in (SINGLE, RING)}
    rec.save(complete=True)
    print(f"\njson: {rec.path}\n{format_table(rec.rows, mesh.size)}", flush=True)
    return {"meta": meta, "complete": True, "rows": rec.rows, "path": rec.path}


if __name__ == "__main__":
    main()
