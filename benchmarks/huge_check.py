"""Do the kernels' offsets survive tensors of more than 2**31 elements?

    PYTHONPATH=. python benchmarks/huge_check.py --out $OUT          # on one H200, ~2-3 min
    PYTHONPATH=. python benchmarks/huge_check.py --smoke --out /tmp  # tiny, CPU (interpret mode)

Default shape: batch 1, seq 1,048,576, 32 heads (q and kv), head_dim 128, bf16, causal. Then q
alone holds 1 * 2**20 * 32 * 128 = 2**32 elements (8 GiB), and the element offset of (row s,
head h) in q, k, v, O, dO, dQ, dK and dV, s * heads * head_dim + h * head_dim, passes 2**31 at
row 2**31 / 4096 = 524,288: every row in the second half of the sequence is out of int32 reach.
A kernel that forms its pointers in int32 reads or writes the wrong rows there.

What runs, once each:
  1. q, k, v, dO (bf16) and a cotangent dlse for the lse output (float32), random normal.
  2. forward: flash_attention(q, k, v, causal=True, return_lse=True) under jax.vjp, eagerly. The
     library's own jit runs the forward kernel; the eager vjp keeps q, k, v and O as single
     buffers (a jit that returns the vjp function copies them: 32 GiB more here). Its time
     therefore includes compiling the forward.
  3. backward: the vjp function applied to (dO, dlse), jitted and compiled ahead of time, so its
     compile and run times are separate.
  4. jnp.isfinite(x).all() on O, lse, dQ, dK, dV: the whole tensors, on the device.
  5. sampled rows against a float32 reference (HIGHEST precision, plain jnp, O(seq * head_dim)
     memory per row, nothing seq x seq):
     - query rows (row, head), chosen for high offsets (the last row of the last head, the rows
       either side of the 2**31 boundary, rows near the end in several heads) plus row 0 of head
       0: O and dQ by relative error max|a - b| / max|b|, lse by absolute error (the relative
       error of the softmax normaliser exp(lse); lse itself can be ~0 at row 0).
       The reference for row i sees keys 0..i only, and needs nothing but row i.
     - key rows (row, head), including the last key of the last head (the highest offset) and
       key 0 of the last head (seen by every query, so its gradient reads all 1M query rows):
       dK and dV. These need P_ij = exp(s_ij - lse_i) and D_i = dO_i . O_i - dlse_i for every
       query i >= j, i.e. lse and O of every row of the head. Recomputing those is O(seq^2)
       per head; instead the reference takes the KERNEL's lse and O for those rows. So the
       dK/dV check tests the backward given the forward's lse and O, and the forward is tested
       on its own: against the independent reference on the sampled query rows, and for
       finiteness everywhere (step 4). A forward error confined to unsampled rows would pass
       both, which is why the query samples sit at the offsets most likely to break.

Output: one line per check as it completes (PASS/FAIL), the step times, the peak device memory
(`memory_stats()['peak_bytes_in_use']`, GPU only), and JSON in --out (default $OUT, else '.').
Exit status 1 if any check fails.

On a CPU only --smoke (seq 300, heads 2, head_dim 16) is sensible: the kernels run in Pallas
interpret mode there, and it checks the checker, not int32 offsets.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import sys
import time
import traceback
from typing import Any, Callable

if __name__ == "__main__":
    # Before JAX starts: the default allocator cap is 75% of the GPU (~104 GiB of an H200), and
    # this run needs ~64 GiB of tensors plus the backward's temporaries. An explicit setting
    # wins. Only as a script: imported (by the tests) it must not change the environment.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import pallas_flash as pf  # noqa: E402
from pallas_flash.bench.cases import attention_flops, parse_seq, seq_label  # noqa: E402
from pallas_flash.bench.impls import short_error  # noqa: E402
from pallas_flash.bench.report import git_commit  # noqa: E402

INT32_LIMIT = 2**31
DEFAULT_SHAPE = (1 << 20, 32, 128)   # seq, heads, head_dim
SMOKE_SHAPE = (300, 2, 16)
DTYPE = jnp.bfloat16
# Relative error max|a - b| / max|b| allowed for O, dQ, dK, dV: the bf16 tolerance of
# tests/helpers.py. bf16 inputs and the bf16 rounding of P and dS inside the kernels give
# ~3e-3; reading a wrong row gives an error of order 1.
TOL = 2e-2
# Absolute error allowed for lse. The kernel computes lse in float32 from the same bf16 inputs,
# so only float32 summation order separates it from the reference (~1e-5 at 1M keys).
LSE_TOL = 1e-3
HI = lax.Precision.HIGHEST
# More elements than this in q without a GPU: interpret mode would take days.
CPU_MAX_ELEMENTS = 1 << 24


# --------------------------------------------------------------------------
# Which rows to check
# --------------------------------------------------------------------------

def element_offset(row: int, head: int, heads: int, head_dim: int) -> int:
    """Element index of (row, head, 0) in a [1, seq, heads, head_dim] tensor."""
    return (row * heads + head) * head_dim


def first_row_past_int32(seq: int, heads: int, head_dim: int) -> int | None:
    """The first row whose head-0 offset is >= 2**31, or None if the tensor is smaller."""
    row = -(-INT32_LIMIT // (heads * head_dim))
    return row if row < seq else None


def _pick(candidates, count: int, seq: int, heads: int, seed: int) -> list[tuple[int, int]]:
    """The first `count` distinct in-range candidates, topped up with random (row, head)s."""
    picked: list[tuple[int, int]] = []
    for row, head in candidates:
        pair = (min(max(row, 0), seq - 1), min(max(head, 0), heads - 1))
        if pair not in picked and len(picked) < count:
            picked.append(pair)
    count = min(count, seq * heads)
    rng = np.random.default_rng(seed)
    while len(picked) < count:
        pair = (int(rng.integers(seq)), int(rng.integers(heads)))
        if pair not in picked:
            picked.append(pair)
    return picked


def query_samples(seq: int, heads: int, head_dim: int, count: int, seed: int = 0):
    """(row, head) of the query rows to check, the most overflow-prone first."""
    last = heads - 1
    candidates = [(seq - 1, last), (0, 0)]      # highest offset, lowest offset
    boundary = first_row_past_int32(seq, heads, head_dim)
    if boundary is not None:
        # (boundary, 0) is the first row past 2**31; (boundary - 1, last) ends just below it.
        candidates += [(boundary, 0), (boundary - 1, last)]
    candidates += [(seq - 1, 0), (seq - 2, heads // 2), (seq - 129, heads // 4),
                   (seq // 3, 3 * heads // 4)]
    return _pick(candidates, count, seq, heads, seed)


def key_samples(seq: int, heads: int, head_dim: int, count: int, seed: int = 0):
    """(row, head) of the key rows whose dK, dV to check."""
    last = heads - 1
    boundary = first_row_past_int32(seq, heads, head_dim)
    candidates = [(seq - 1, last),              # highest offset; causal: one query sees it
                  (0, last),                    # seen by every query of the last head
                  (seq // 2 if boundary is None else boundary, 0),
                  (seq - 200, heads // 2)]
    return _pick(candidates, count, seq, heads, seed + 1)


# --------------------------------------------------------------------------
# The step under test
# --------------------------------------------------------------------------

def make_inputs(seq: int, heads: int, head_dim: int, seed: int):
    """q, k, v, dO [1, seq, heads, head_dim] bf16 and dlse [1, heads, seq] float32, normal."""
    keys = jax.random.split(jax.random.key(seed), 5)
    shape = (1, seq, heads, head_dim)
    # One tensor at a time, each generated directly in bf16: no float32 copy of 16 GiB.
    q, k, v, do = (jax.random.normal(key, shape, DTYPE) for key in keys[:4])
    dlse = jax.random.normal(keys[4], (1, heads, seq), jnp.float32)
    return jax.block_until_ready((q, k, v, do, dlse))


@jax.jit
def _apply_vjp(vjp_fn, do, dlse):
    return vjp_fn((do, dlse))


def run_step(q, k, v, do, dlse, *, causal: bool, log) -> tuple[dict, dict]:
    """Forward once and backward once. Returns ({o, lse, dq, dk, dv}, times in seconds)."""
    attention = functools.partial(pf.flash_attention, causal=causal, return_lse=True)
    times = {}
    t0 = time.perf_counter()
    (o, lse), vjp_fn = jax.vjp(attention, q, k, v)
    jax.block_until_ready((o, lse))
    times["fwd_s"] = time.perf_counter() - t0
    log(f"forward (includes its compilation): {times['fwd_s']:.2f} s")

    t0 = time.perf_counter()
    backward = _apply_vjp.lower(vjp_fn, do, dlse).compile()
    times["bwd_compile_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    dq, dk, dv = jax.block_until_ready(backward(vjp_fn, do, dlse))
    times["bwd_s"] = time.perf_counter() - t0
    log(f"backward: compile {times['bwd_compile_s']:.2f} s, run {times['bwd_s']:.2f} s")
    return {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}, times


# --------------------------------------------------------------------------
# References for single rows (float32, HIGHEST, O(seq * head_dim) memory)
# --------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("scale", "causal"))
def query_row(q, k, v, do, dlse, o, lse, dq, i, h, *, scale: float, causal: bool):
    """Reference and kernel O, lse, dQ of query row i in head h.

    P_j = softmax_j(scale * q_i . k_j) over the keys row i sees; O_i = sum_j P_j v_j;
    dQ_i = scale * sum_j P_j (dO_i . v_j - D_i) k_j with D_i = dO_i . O_i - dlse_i, where O_i
    is the reference's own row: nothing outside row i is needed.
    """
    f32 = jnp.float32
    k_h, v_h = k[0, :, h].astype(f32), v[0, :, h].astype(f32)          # [seq, head_dim]
    q_i, do_i = q[0, i, h].astype(f32), do[0, i, h].astype(f32)        # [head_dim]
    s = scale * jnp.dot(k_h, q_i, precision=HI)                        # [seq]
    if causal:
        s = jnp.where(jnp.arange(s.shape[0]) <= i, s, -jnp.inf)
    m = jnp.max(s)
    e = jnp.exp(s - m)
    denom = jnp.sum(e)
    p = e / denom
    ref_o = jnp.dot(p, v_h, precision=HI)
    ref_lse = m + jnp.log(denom)
    delta = jnp.dot(do_i, ref_o, precision=HI) - dlse[0, h, i]
    ds = p * (jnp.dot(v_h, do_i, precision=HI) - delta)
    ref_dq = scale * jnp.dot(ds, k_h, precision=HI)
    return (ref_o, ref_lse, ref_dq), (o[0, i, h], lse[0, h, i], dq[0, i, h])


@functools.partial(jax.jit, static_argnames=("scale", "causal"))
def key_row(q, k, v, do, dlse, o, lse, dk, dv, j, h, *, scale: float, causal: bool):
    """Reference and kernel dK, dV of key row j in head h.

    dV_j = sum_i P_ij dO_i and dK_j = scale * sum_i P_ij (dO_i . v_j - D_i) q_i over the queries
    i that see key j, with P_ij = exp(scale * q_i . k_j - lse_i) and D_i = dO_i . O_i - dlse_i.
    lse_i and O_i are the KERNEL's (see the module docstring): the reference would need all
    rows of the head, O(seq^2) work.
    """
    f32 = jnp.float32
    q_h, do_h = q[0, :, h].astype(f32), do[0, :, h].astype(f32)        # [seq, head_dim]
    o_h, lse_h = o[0, :, h].astype(f32), lse[0, h]                     # [seq, head_dim], [seq]
    k_j, v_j = k[0, j, h].astype(f32), v[0, j, h].astype(f32)          # [head_dim]
    s = scale * jnp.dot(q_h, k_j, precision=HI)                        # [seq]
    seen = jnp.arange(s.shape[0]) >= j if causal else jnp.ones(s.shape, bool)
    p = jnp.where(seen, jnp.exp(s - lse_h), 0.0)
    delta = jnp.sum(do_h * o_h, axis=-1) - dlse[0, h]
    ds = p * (jnp.dot(do_h, v_j, precision=HI) - delta)
    ref_dk = scale * jnp.dot(ds, q_h, precision=HI)
    ref_dv = jnp.dot(p, do_h, precision=HI)
    return (ref_dk, ref_dv), (dk[0, j, h], dv[0, j, h])


@jax.jit
def _all_finite(x):
    return jnp.isfinite(x).all()


# --------------------------------------------------------------------------
# Checks and report
# --------------------------------------------------------------------------

def rel_err(actual, expected) -> float:
    """max|a - b| / max|b| in float64; NaN or inf in `actual` gives NaN/inf (a failure)."""
    a = np.asarray(actual, np.float64)
    b = np.asarray(expected, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def abs_err(actual, expected) -> float:
    return float(np.max(np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64))))


def _json_float(x):
    return x if x is None or math.isfinite(x) else str(x)


class Report:
    """Collects checks, prints each as it completes, rewrites the JSON after each one."""

    def __init__(self, path: str | None, meta: dict):
        self.path = path
        self.data: dict[str, Any] = {"meta": meta, "complete": False, "times_s": {},
                                     "checks": []}

    def log(self, text: str) -> None:
        print(text, flush=True)

    def add(self, check: str, passed: bool, line: str, **fields) -> None:
        status = "PASS" if passed else "FAIL"
        self.data["checks"].append({"check": check, "passed": bool(passed), **fields})
        self.log(f"{status}  {check:<7} {line}")
        self.save()

    def add_error(self, check: str, row: int, head: int, heads: int, head_dim: int,
                  err: float, tol: float, metric: str) -> None:
        offset = element_offset(row, head, heads, head_dim)
        side = ">=" if offset >= INT32_LIMIT else "<"
        self.add(check, err <= tol,  # NaN compares False: a failure
                 f"row {row:>8} head {head:>3}  offset {offset:>13,} ({side} 2^31)  "
                 f"err {err:.2e} (tol {tol:.0e}, {metric})",
                 row=row, head=head, offset=offset, err=_json_float(err), tol=tol,
                 metric=metric)

    @property
    def all_passed(self) -> bool:
        return all(c["passed"] for c in self.data["checks"])

    def save(self) -> None:
        self.data["all_passed"] = self.all_passed
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self.data, f, indent=1)


def check_finite(report: Report, results: dict) -> None:
    for name, x in results.items():
        finite = bool(_all_finite(x))
        report.add("finite", finite, f"{name} {list(x.shape)}: "
                   f"{'all finite' if finite else 'has NaN or inf'}", tensor=name)


def check_queries(report, samples, inputs, results, *, scale, causal, heads, head_dim) -> None:
    q, k, v, do, dlse = inputs
    r = results
    for row, head in samples:
        (ref_o, ref_lse, ref_dq), (o, lse, dq) = query_row(
            q, k, v, do, dlse, r["o"], r["lse"], r["dq"], row, head, scale=scale, causal=causal)
        rel = "max|a-b|/max|b|"
        report.add_error("O", row, head, heads, head_dim, rel_err(o, ref_o), TOL, rel)
        report.add_error("lse", row, head, heads, head_dim, abs_err(lse, ref_lse), LSE_TOL,
                         "|a-b|")
        report.add_error("dQ", row, head, heads, head_dim, rel_err(dq, ref_dq), TOL, rel)


def check_keys(report, samples, inputs, results, *, scale, causal, heads, head_dim) -> None:
    q, k, v, do, dlse = inputs
    r = results
    for row, head in samples:
        (ref_dk, ref_dv), (dk, dv) = key_row(
            q, k, v, do, dlse, r["o"], r["lse"], r["dk"], r["dv"], row, head,
            scale=scale, causal=causal)
        rel = "max|a-b|/max|b|"
        report.add_error("dK", row, head, heads, head_dim, rel_err(dk, ref_dk), TOL, rel)
        report.add_error("dV", row, head, heads, head_dim, rel_err(dv, ref_dv), TOL, rel)


def peak_bytes() -> int | None:
    """Process-wide peak device memory; None where the backend keeps no statistics (CPU)."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - e.g. after a device error; the report matters more
        return None
    return stats.get("peak_bytes_in_use")


def _gib(n: int | None) -> str:
    return "n/a (no memory statistics on this backend)" if n is None else f"{n / 2**30:.2f} GiB"


def metadata(args, argv) -> dict:
    seq, heads, head_dim = args.seq, args.heads, args.head_dim
    elements = seq * heads * head_dim
    return {
        "device": jax.devices()[0].device_kind,
        "backend": jax.default_backend(),
        "interpret": jax.default_backend() != "gpu",
        "jax_version": jax.__version__,
        "git_commit": git_commit(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(argv),
        "shape": {"batch": 1, "seq": seq, "q_heads": heads, "kv_heads": heads,
                  "head_dim": head_dim, "dtype": "bfloat16", "causal": args.causal},
        "elements_per_tensor": elements,
        "exceeds_int32": elements > INT32_LIMIT - 1,
        "tolerance": {"O, dQ, dK, dV": f"max|a-b|/max|b| <= {TOL}", "lse": f"|a-b| <= {LSE_TOL}"},
        "dkdv_reference": "uses the kernel's lse and O of all query rows of the head, which are "
                          "checked against the reference on the sampled query rows",
    }


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="benchmarks/huge_check.py",
        description="One flash_attention forward+backward on tensors of more than 2**31 "
                    "elements, checked on sampled rows against a float32 reference.")
    p.add_argument("--seq", type=parse_seq, default=None,
                   help="sequence length, e.g. 1M or 65536 (default 1M; --smoke: 300)")
    p.add_argument("--heads", type=int, default=None, help="q and kv heads (default 32)")
    p.add_argument("--head-dim", type=int, default=None, help="default 128")
    p.add_argument("--no-causal", dest="causal", action="store_false",
                   help="full attention instead of causal")
    p.add_argument("--rows", type=int, default=8,
                   help="query (row, head) pairs checked for O, lse, dQ (default 8)")
    p.add_argument("--key-rows", type=int, default=4,
                   help="key (row, head) pairs checked for dK, dV (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true",
                   help="tiny shape for the CPU: seq 300, heads 2, head_dim 16")
    p.add_argument("--out", default=os.environ.get("OUT") or ".",
                   help="directory for the JSON (default $OUT, else '.')")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, value in zip(("seq", "heads", "head_dim"),
                           SMOKE_SHAPE if args.smoke else DEFAULT_SHAPE):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if min(args.seq, args.heads, args.head_dim) < 1 or args.rows < 1 or args.key_rows < 1:
        parser.error("--seq, --heads, --head-dim, --rows and --key-rows must be positive")
    if (jax.default_backend() != "gpu"
            and args.seq * args.heads * args.head_dim > CPU_MAX_ELEMENTS):
        parser.error("no GPU: the kernels would run in Pallas interpret mode, far too slowly "
                     "for this shape; use --smoke (or a small --seq) on the CPU")
    return args


def run(args: argparse.Namespace, argv: list[str] = (), *,
        perturb: Callable[[dict], dict] | None = None) -> dict:
    """The whole check; returns the report dict (also written as JSON).

    perturb, for tests: maps the kernel results {o, lse, dq, dk, dv} to altered ones before
    any check, to show that a wrong value is caught.
    """
    t_start = time.perf_counter()
    seq, heads, head_dim, causal = args.seq, args.heads, args.head_dim, args.causal
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = os.path.join(args.out, f"huge_check_{seq_label(seq)}_{stamp}.json")
    meta = metadata(args, argv)
    report = Report(path, meta)
    log, times = report.log, report.data["times_s"]
    log(f"huge_check: q, k, v, O, dO, dQ, dK, dV each [1, {seq}, {heads}, {head_dim}] bf16 = "
        f"{meta['elements_per_tensor']:,} elements; beyond int32 (2^31 = {INT32_LIMIT:,}): "
        f"{'yes' if meta['exceeds_int32'] else 'NO'}; causal={causal}")
    log(f"device: {meta['device']} ({meta['backend']}, "
        f"{'interpret mode' if meta['interpret'] else 'compiled kernels'}), "
        f"jax {meta['jax_version']}, commit {meta['git_commit']}")
    q_rows = query_samples(seq, heads, head_dim, args.rows, args.seed)
    k_rows = key_samples(seq, heads, head_dim, args.key_rows, args.seed)
    report.data.update(query_samples=q_rows, key_samples=k_rows)

    t0 = time.perf_counter()
    inputs = make_inputs(seq, heads, head_dim, args.seed)
    times["inputs_s"] = time.perf_counter() - t0
    log(f"inputs: {times['inputs_s']:.2f} s")

    try:
        results, step_times = run_step(*inputs, causal=causal, log=log)
    except Exception as e:  # noqa: BLE001
        # A pointer offset that wrapped around int32 tends to end as an illegal memory access,
        # not as wrong numbers: that is a failure of the check, reported like any other.
        traceback.print_exc()
        report.add("step", False, f"forward/backward raised {short_error(e)}",
                   error=short_error(e))
        return finish(report, path, t_start)
    times.update(step_times)
    report.data["peak_bytes_after_step"] = peak_bytes()
    flops = {p: attention_flops(1, seq, seq, heads, head_dim, causal, p)
             for p in ("fwd", "bwd")}
    report.data["tflops"] = {p: flops[p] / times[f"{p}_s"] / 1e12 for p in flops}
    log(f"TFLOP/s: forward {report.data['tflops']['fwd']:.3g} (compile included), backward "
        f"{report.data['tflops']['bwd']:.3g}; peak memory {_gib(peak_bytes())}")
    report.save()
    if perturb is not None:
        results = perturb(dict(results))

    t0 = time.perf_counter()
    check_finite(report, results)
    scale = 1 / math.sqrt(head_dim)
    shape_kw = dict(scale=scale, causal=causal, heads=heads, head_dim=head_dim)
    check_queries(report, q_rows, inputs, results, **shape_kw)
    log("dK/dV reference: P and D use the kernel's lse and O for all query rows of the head "
        "(both checked above on the sampled rows)")
    check_keys(report, k_rows, inputs, results, **shape_kw)
    times["checks_s"] = time.perf_counter() - t0
    return finish(report, path, t_start)


def finish(report: Report, path: str, t_start: float) -> dict:
    """Final times, peak memory and the summary line; writes the JSON a last time."""
    times = report.data["times_s"]
    times["total_s"] = time.perf_counter() - t_start
    report.data["peak_bytes"] = peak_bytes()
    report.data["complete"] = True
    report.save()
    checks = report.data["checks"]
    failed = [c for c in checks if not c["passed"]]
    report.log("times: " + ", ".join(f"{n} {t:.2f}" for n, t in times.items()))
    report.log(f"peak memory: {_gib(report.data['peak_bytes'])}")
    report.log(f"{len(checks) - len(failed)}/{len(checks)} checks passed: "
               f"{'ALL PASS' if not failed else 'FAIL'}")
    report.log(f"json: {path}")
    return report.data


def main(argv: list[str] | None = None, *,
         perturb: Callable[[dict], dict] | None = None) -> int:
    """CLI entry point; returns the exit status (0 = every check passed)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    data = run(parse_args(argv), argv, perturb=perturb)
    return 0 if data["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
