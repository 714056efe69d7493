"""Speed, accuracy and memory benchmark for ``pallas_flash``.

Run ``python -m pallas_flash.bench --help`` for the options. Everything is
measured in one process on one device (``jax.devices()[0]``), except the
memory sweep, which gives every (implementation, sequence length) point a fresh
child process so that one point's peak memory cannot leak into the next.

Method
------
Implementations live in :data:`IMPLS`, a dict ``name -> fn(q, k, v, causal,
**variant)`` where ``q`` is ``[batch, seq_q, q_heads, head_dim]`` and ``k, v``
are ``[batch, seq_kv, kv_heads, head_dim]``. ``variant`` holds the options of
``pallas_flash.flash_attention`` that a variant case uses (segment ids,
``window``, ``softcap``); an implementation that cannot express one raises
:class:`NotApplicable` and its row reads ``n.a.``.

For every case and implementation three jitted functions are timed:

* forward: ``out = fn(q, k, v)``;
* forward+backward: ``jax.vjp`` of ``fn`` applied to a random cotangent, inside
  one jitted function that returns ``(dq, dk, dv)``;
* backward: the vjp closure of one forward call (its residuals computed once,
  before the timing) applied to the cotangent, so the backward's time is its
  own, the way cuDNN's and FlashAttention's benchmarks time it.

Until session 5 the backward time was the difference of the first two medians;
that moved the forward's run-to-run noise, with the opposite sign, into the
backward (an unchanged forward read 0.75-1.04x cuDNN across three runs, and the
backward beside it 0.98-0.81x). Each function is called ``--warmup`` times
first (the first call compiles), then ``--iters`` (forward) or ``--iters-bwd``
(backward, forward+backward) times, each call ended by
``jax.block_until_ready``; we report the median. With ``--timer pipelined``
the calls run back to back instead, one synchronisation per batch of calls,
three batches, the median batch's mean reported: the host's launch work then
overlaps the device's, as in a training loop that dispatches ahead. Per call,
every launch's host latency lands in the time, and more so for programs of
several launches (ours: check, D, kernel, cast; NOTES.md run 29: 0.41 ms a
call, cuDNN's 0.66). Inputs are random normal
(never zeros: zeros make every softmax row uniform and hide bugs).

Throughput uses the conventional FLOP count of :func:`attention_flops`
(forward ``4*B*Hq*Sq*Skv*D``, halved when causal; backward 2.5x forward).
Variant cases count only the (query, key) pairs that the mask keeps, so their
TFLOP/s is useful work; compare their milliseconds with the same kernel
without the variant (row ``pallas_flash[plain]``).

Accuracy is measured in the same run on the forward output: the relative error
``||out - x|| / ||x||`` against cuDNN's output and against a float32 reference
evaluated on a random subset of query rows (``--ref-rows``) with the full keys
and values, so the reference stays cheap at long sequence lengths (see
:func:`reference_rows`).

A failure of one implementation (out of memory, unsupported shape, any
exception) becomes that row's result and the run goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

# --------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------

# (batch, seq, q_heads, kv_heads, head_dim); each is run causal and non-causal.
DEFAULT_CASES = (
    (8, 2048, 16, 16, 128),
    (2, 8192, 16, 16, 128),
    (1, 16384, 16, 16, 128),
    (2, 8192, 32, 32, 64),
    (2, 8192, 32, 8, 128),
    (2, 8192, 8, 8, 256),
)
SMOKE_CASE = (1, 128, 2, 1, 32)
DEFAULT_IMPLS = ("pallas_flash", "cudnn", "xla")
# The row of our own kernel run without the variant's option, for variants.
PLAIN = "pallas_flash[plain]"
MEMORY_SEQS = "32k,128k,512k,1M,2M,4M"
# Memory sweep shape: batch 1, 16 heads (no GQA), head_dim 128, causal.
MEMORY_SHAPE = (1, 16, 16, 128)
CHILD_MARKER = "PALLAS_FLASH_MEMORY_JSON "
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    seq: int
    q_heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    variant: str | None = None  # None, "packed", "window" or "softcap"

    @property
    def shape_name(self) -> str:
        return (f"{self.batch}x{self.seq}x{self.q_heads}x{self.kv_heads}"
                f"x{self.head_dim}")

    @property
    def name(self) -> str:
        return f"{self.variant}:{self.shape_name}" if self.variant else self.shape_name


def parse_case(text: str) -> tuple[int, ...]:
    """'2x8192x16x16x128' -> (2, 8192, 16, 16, 128)."""
    parts = text.strip().lower().split("x")
    if len(parts) != 5:
        raise argparse.ArgumentTypeError(
            f"case {text!r} is not batch x seq x q_heads x kv_heads x head_dim")
    return tuple(int(p) for p in parts)


def parse_seq(text: str) -> int:
    """'32k' -> 32768, '1M' -> 1048576, '4096' -> 4096 (powers of two)."""
    text = text.strip()
    mult = {"k": 1 << 10, "K": 1 << 10, "m": 1 << 20, "M": 1 << 20}.get(text[-1:], 1)
    return int(text[:-1] if mult > 1 else text) * mult


def seq_label(seq: int) -> str:
    if seq % (1 << 20) == 0:
        return f"{seq >> 20}M"
    if seq % (1 << 10) == 0:
        return f"{seq >> 10}k"
    return str(seq)


def variant_cases() -> list[Case]:
    """The variant cases; all bf16 (or --dtype), head_dim 128, causal."""
    return [
        Case(1, 16384, 16, 16, 128, True, "packed"),   # 12 documents in 16k tokens
        Case(1, 32768, 16, 16, 128, True, "window"),   # sliding window 4096
        Case(2, 8192, 16, 16, 128, True, "softcap"),   # logit softcap 50
    ]


PACKED_DOCS = 12
WINDOW = (4096, 0)
SOFTCAP = 50.0


def packed_segment_ids(key, seq: int, docs: int) -> jax.Array:
    """[1, seq] int32 ids of `docs` back-to-back documents of random lengths."""
    # Distinct random cut points give random lengths that sum to `seq`.
    cuts = jax.random.choice(key, jnp.arange(1, seq), (docs - 1,), replace=False)
    cuts = jnp.sort(cuts)
    ids = jnp.searchsorted(cuts, jnp.arange(seq), side="right")
    return ids.astype(jnp.int32)[None, :]


def variant_kwargs(case: Case, key) -> dict[str, Any]:
    """The flash_attention keyword arguments that make `case` a variant."""
    if case.variant is None:
        return {}
    if case.variant == "packed":
        ids = jnp.broadcast_to(packed_segment_ids(key, case.seq, PACKED_DOCS),
                               (case.batch, case.seq))
        return {"q_segment_ids": ids, "kv_segment_ids": ids}
    if case.variant == "window":
        return {"window": WINDOW}
    if case.variant == "softcap":
        return {"softcap": SOFTCAP}
    raise ValueError(f"unknown variant {case.variant!r}")


# --------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------

def attention_flops(batch: int, seq_q: int, seq_kv: int, q_heads: int,
                    head_dim: int, causal: bool, pass_: str = "fwd") -> float:
    """Conventional FLOP count of attention (FlashAttention papers' convention).

    forward  = 4 * B * Hq * Sq * Skv * D    (two matmuls, QK^T and PV, 2 FLOPs
               per multiply-add), halved when causal;
    backward = 2.5 * forward               (five matmuls instead of two);
    fwd+bwd  = 3.5 * forward.

    Softmax exponentials are not counted; kv_heads does not matter (GQA shares
    K/V but each query head still does the full work).
    """
    fwd = 4.0 * batch * q_heads * seq_q * seq_kv * head_dim
    if causal:
        fwd /= 2
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwdbwd": 3.5 * fwd}[pass_]


def attended_pairs(case: Case, kwargs: dict[str, Any]) -> float:
    """(query, key) pairs per batch row and head that the variant keeps."""
    s = case.seq
    if "window" in kwargs:  # causal window (left, 0): row i sees min(i, left)+1 keys
        left = kwargs["window"][0]
        w = min(left, s - 1)
        return w * (w + 1) / 2 + (w + 1) * (s - w)
    if "q_segment_ids" in kwargs:  # causal within each document
        ids = kwargs["q_segment_ids"][0]
        lengths = jnp.bincount(ids, length=int(ids.max()) + 1).tolist()
        return float(sum(n * (n + 1) // 2 for n in lengths))
    return s * s / 2 if case.causal else s * s


def case_flops(case: Case, kwargs: dict[str, Any], pass_: str) -> float:
    """FLOPs of `case` run with `kwargs` (dense formula unless masked variant)."""
    if not {"window", "q_segment_ids"} & kwargs.keys():
        return attention_flops(case.batch, case.seq, case.seq, case.q_heads,
                               case.head_dim, case.causal, pass_)
    # Same formula, with Sq*Skv/2 replaced by the pairs the mask keeps.
    fwd = 4.0 * case.batch * case.q_heads * case.head_dim * attended_pairs(case, kwargs)
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwdbwd": 3.5 * fwd}[pass_]


# --------------------------------------------------------------------------
# Implementations
# --------------------------------------------------------------------------

class NotApplicable(Exception):
    """The implementation cannot express this case; reported as 'n.a.'."""


def _pallas_flash(backend: str = "auto"):
    def fn(q, k, v, causal, **kw):
        # Imported here: this module is part of the package, and a lazy import keeps
        # `pallas_flash/__init__.py` free to import bench without a cycle.
        import pallas_flash
        try:
            return pallas_flash.flash_attention(q, k, v, causal=causal, backend=backend, **kw)
        except ValueError as e:
            # A forced backend that cannot serve the case says so before any launch.
            if backend != "auto" and "backend" in str(e):
                raise NotApplicable(str(e).splitlines()[0]) from e
            raise
    return fn


def _jax_nn(implementation: str):
    def fn(q, k, v, causal, **kw):
        kw = dict(kw)
        mask, window = None, None
        if kw.pop("softcap", None) is not None:
            raise NotApplicable("no softcap in jax.nn.dot_product_attention")
        if "window" in kw:
            window = tuple(kw.pop("window"))
        q_ids, kv_ids = kw.pop("q_segment_ids", None), kw.pop("kv_segment_ids", None)
        if q_ids is not None:
            # No segment ids in the public API: a dense [B, 1, Sq, Skv] mask.
            # 16k x 16k is 256 MiB of bool, acceptable for a benchmark.
            mask = q_ids[:, None, :, None] == kv_ids[:, None, None, :]
        if kw:
            raise NotApplicable(f"unsupported options {sorted(kw)}")
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=causal, local_window_size=window,
            implementation=implementation)
    return fn


def _jax_pallas_triton(q, k, v, causal, **kw):
    # Deprecated upstream module; imported lazily so its warning and any
    # future removal only matter when this implementation is asked for.
    from jax.experimental.pallas.ops.gpu import attention as jax_attention
    if q.shape[2] != k.shape[2]:
        raise NotApplicable("no GQA in jax.experimental.pallas.ops.gpu.attention.mha")
    # mha takes one segment-id array for queries and keys alike; our variant
    # cases are self-attention with identical q and kv ids.
    segment_ids = kw.pop("q_segment_ids", None)
    kw.pop("kv_segment_ids", None)
    if kw:
        raise NotApplicable(f"unsupported options {sorted(kw)}")
    blocks = jax_attention.BlockSizes(block_q=128, block_k=64, block_q_dkv=64,
                                      block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
    return jax_attention.mha(q, k, v, segment_ids, sm_scale=1 / math.sqrt(q.shape[-1]),
                             causal=causal, block_sizes=blocks,
                             interpret=jax.default_backend() == "cpu")


# name -> fn(q, k, v, causal, **variant_kwargs). Add entries to compare more.
IMPLS: dict[str, Callable[..., jax.Array]] = {
    "pallas_flash": _pallas_flash(),
    # Each backend forced, to compare them in one run (only when named in --impls).
    "pallas_flash_triton": _pallas_flash("triton"),
    "pallas_flash_mosaic": _pallas_flash("mosaic"),
    "cudnn": _jax_nn("cudnn"),
    "xla": _jax_nn("xla"),
    # Only when named in --impls: it has no GQA.
    "jax_pallas_triton": _jax_pallas_triton,
}


# --------------------------------------------------------------------------
# Reference on sampled rows
# --------------------------------------------------------------------------

def sample_rows(seq: int, count: int, key) -> jax.Array:
    """Sorted distinct query rows to check; all rows when count >= seq."""
    if count >= seq:
        return jnp.arange(seq)
    return jnp.sort(jax.random.choice(key, seq, (count,), replace=False))


def reference_rows(q, k, v, rows, *, causal: bool, scale: float | None = None,
                   window=None, softcap=None, q_segment_ids=None,
                   kv_segment_ids=None) -> jax.Array:
    """Attention output for query rows `rows` only, in float32, plain jnp.

    Uses q[:, rows] against all keys, so memory is O(len(rows) * Skv), not
    O(Sq * Skv). The mask is built from the absolute row indices: with the
    top-left causal convention query i sees keys j <= i (the cases here have
    Sq == Skv, where top-left and bottom-right agree); window (left, right)
    keeps i - left <= j <= i + right (None = unbounded). Returns
    [batch, len(rows), q_heads, head_dim].
    """
    batch, _, q_heads, head_dim = q.shape
    seq_kv, kv_heads = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    hi = jax.lax.Precision.HIGHEST  # GPUs would otherwise use TF32 for f32

    # GQA: query head h uses kv head h // group (same grouping as jax.nn).
    qr = q[:, rows].astype(jnp.float32).reshape(batch, len(rows), kv_heads, group, head_dim)
    s = jnp.einsum("brkgd,bskd->bkgrs", qr, k.astype(jnp.float32), precision=hi) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)

    i = rows[:, None]
    j = jnp.arange(seq_kv)[None, :]
    keep = jnp.ones((len(rows), seq_kv), bool)
    if causal:
        keep &= j <= i
    if window is not None:
        left, right = window
        if left is not None:
            keep &= j >= i - left
        if right is not None:
            keep &= j <= i + right
    keep = jnp.broadcast_to(keep, (batch, len(rows), seq_kv))
    if q_segment_ids is not None:
        keep &= q_segment_ids[:, rows][:, :, None] == kv_segment_ids[:, None, :]
    keep = keep[:, None, None]  # broadcast over kv heads and groups

    s = jnp.where(keep, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # fully masked rows give 0, not NaN
    p = jnp.where(keep, jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("bkgrs,bskd->brkgd", p, v.astype(jnp.float32), precision=hi)
    return out.reshape(batch, len(rows), q_heads, head_dim)


def rel_err(x, ref) -> float:
    """||x - ref|| / ||ref|| in float32."""
    x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm((x - ref).ravel()) / jnp.linalg.norm(ref.ravel()))


# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------

def short_error(exc: BaseException) -> str:
    """One line that says what went wrong, e.g. 'OOM: RESOURCE_EXHAUSTED: ...'."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    msg = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        msg = "OOM: " + msg
    return msg[:200]


def time_calls(f, args, iters: int, warmup: int,
               pipelined: bool = False) -> tuple[list[float], Any]:
    """Per-call wall times in seconds (after warmup) and the last result; pipelined: the
    mean per call of each of three batches of `iters` back-to-back calls."""
    out = None
    # At least two: the first call compiles, and JAX's Pallas modules load on
    # the first trace in a process and register config options, which changes
    # the jit cache key, so the second call of the first Pallas function
    # compiles again.
    for _ in range(max(warmup, 2)):
        out = jax.block_until_ready(f(*args))
    times = []
    if pipelined:
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(iters):
                out = f(*args)
            out = jax.block_until_ready(out)
            times.append((time.perf_counter() - t0) / iters)
        return times, out
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
               pipelined: bool = False) -> tuple[dict, Any]:
    """Time one implementation. Returns (row fields, forward output or None)."""
    row: dict[str, Any] = {"status": "ok", "error": None}
    arrays, static = split_kwargs(kw)
    fwd, fwdbwd = make_fns(fn, causal, static)
    out = None
    try:
        times, out = time_calls(fwd, (q, k, v, arrays), iters, warmup, pipelined)
        row["fwd_times_ms"] = [t * 1e3 for t in times]
        row["fwd_ms"] = statistics.median(times) * 1e3
    except NotApplicable as e:
        return {"status": "n.a.", "error": str(e)}, None
    except Exception as e:  # noqa: BLE001 - any failure is a result
        return {"status": "error", "error": short_error(e)}, None
    try:
        times, grads = time_calls(fwdbwd, (q, k, v, do, arrays), iters_bwd, warmup,
                                  pipelined)
        del grads
        row["fwdbwd_times_ms"] = [t * 1e3 for t in times]
        row["fwdbwd_ms"] = statistics.median(times) * 1e3
        bwd, bwd_args = make_backward(fn, causal, static, q, k, v, do, arrays)
        times, grads = time_calls(bwd, bwd_args, iters_bwd, warmup, pipelined)
        del grads, bwd_args
        row["bwd_times_ms"] = [t * 1e3 for t in times]
        row["bwd_ms"] = statistics.median(times) * 1e3
    except Exception as e:  # noqa: BLE001
        # Keep the forward numbers: a backward failure is a partial result.
        row["status"] = "bwd error"
        row["error"] = short_error(e)
    return row, out


def make_inputs(case: Case, dtype, key):
    """Random normal q, k, v and output cotangent (never zeros)."""
    kq, kk, kv, kd = jax.random.split(key, 4)
    b, s, hq, hkv, d = case.batch, case.seq, case.q_heads, case.kv_heads, case.head_dim
    q = jax.random.normal(kq, (b, s, hq, d), dtype)
    k = jax.random.normal(kk, (b, s, hkv, d), dtype)
    v = jax.random.normal(kv, (b, s, hkv, d), dtype)
    do = jax.random.normal(kd, (b, s, hq, d), dtype)
    return q, k, v, do


def run_case(case: Case, impl_names, args, key) -> list[dict]:
    """All implementations on one case: timing, ratios and accuracy rows."""
    k_in, k_var, k_rows = jax.random.split(key, 3)
    q, k, v, do = make_inputs(case, DTYPES[args.dtype], k_in)
    kw = variant_kwargs(case, k_var)
    # cuDNN first, so its output exists when the others are compared with it.
    names = sorted(impl_names, key=lambda n: n != "cudnn")
    runs = [(n, IMPLS[n], kw) for n in names]
    if case.variant and "pallas_flash" in impl_names:
        runs.append((PLAIN, IMPLS["pallas_flash"], {}))

    rows, outputs = [], {}
    for name, fn, run_kw in runs:
        print(f"  {case.name} causal={case.causal} {name} ...", flush=True)
        fields, out = bench_impl(fn, q, k, v, do, case.causal, dict(run_kw),
                                 args.iters, args.iters_bwd, args.warmup,
                                 args.timer == "pipelined")
        row = {"case": case.name, "variant": case.variant, "batch": case.batch,
               "seq": case.seq, "q_heads": case.q_heads, "kv_heads": case.kv_heads,
               "head_dim": case.head_dim, "causal": case.causal, "dtype": args.dtype,
               "impl": name, **fields}
        add_throughput(row, case, run_kw)
        # The row's speeds as soon as they exist: a run cut by a time limit keeps them in its
        # log (the table prints only at the end).
        print("    " + progress_line(row), flush=True)
        rows.append(row)
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
        # A backward time at or below zero is noise on a tiny case, not a speed.
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


def add_accuracy(rows, outputs, case, q, k, v, kw, ref_rows, key) -> None:
    """Relative error of each forward output vs cuDNN and vs the f32 reference."""
    rows_idx = sample_rows(case.seq, ref_rows, key)
    refs: dict[bool, jax.Array] = {}
    for r in rows:
        r["ref_rows"] = int(len(rows_idx))
        r["err_vs_cudnn"] = r["err_vs_ref"] = None
        out = outputs.get(r["impl"])
        if out is None:
            continue
        plain = r["impl"] == PLAIN
        # Our plain row computes different attention than the variant.
        if "cudnn" in outputs and r["impl"] != "cudnn" and not plain:
            r["err_vs_cudnn"] = rel_err(out, outputs["cudnn"])
        try:
            if plain not in refs:
                refs[plain] = reference_rows(q, k, v, rows_idx, causal=case.causal,
                                             **({} if plain else kw))
            r["err_vs_ref"] = rel_err(out[:, rows_idx], refs[plain])
        except Exception as e:  # noqa: BLE001 - e.g. reference OOM
            r["err_vs_ref_error"] = short_error(e)


# --------------------------------------------------------------------------
# Memory sweep
# --------------------------------------------------------------------------

def memory_floor(seq: int, dtype_bytes: int) -> int:
    """Bytes of q, k, v, o, dq, dk, dv and dO: what any implementation must hold."""
    batch, q_heads, kv_heads, head_dim = MEMORY_SHAPE
    q_like = batch * seq * q_heads * head_dim     # q, o, dq, dO
    kv_like = batch * seq * kv_heads * head_dim   # k, v, dk, dv
    return (4 * q_like + 4 * kv_like) * dtype_bytes


def memory_child(impl: str, seq: int, dtype_name: str) -> dict:
    """One forward+backward step in this (fresh) process; peak device memory."""
    batch, q_heads, kv_heads, head_dim = MEMORY_SHAPE
    case = Case(batch, seq, q_heads, kv_heads, head_dim, causal=True)
    result: dict[str, Any] = {"impl": impl, "seq": seq, "dtype": dtype_name}
    try:
        # Inputs are generated one tensor at a time; their transient peak (<= 6
        # tensor sizes) stays below the step's own floor of 8 tensor sizes, so
        # the process-wide peak is the step's.
        q, k, v, do = make_inputs(case, DTYPES[dtype_name], jax.random.key(0))
        stats = jax.devices()[0].memory_stats() or {}
        result["bytes_after_inputs"] = stats.get("bytes_in_use")
        _, fwdbwd = make_fns(IMPLS[impl], True, {})
        # Compile ahead of time so the step time excludes compilation.
        compiled = fwdbwd.lower(q, k, v, do, {}).compile()
        try:
            result["compiled_temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
        except Exception:  # noqa: BLE001 - not every backend reports it
            result["compiled_temp_bytes"] = None
        # Autotuning during compilation allocates too; if this is close to the
        # final peak, the peak is the compiler's, not the step's.
        stats = jax.devices()[0].memory_stats() or {}
        result["peak_bytes_after_compile"] = stats.get("peak_bytes_in_use")
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v, do, {}))
        result["step_s"] = time.perf_counter() - t0
        stats = jax.devices()[0].memory_stats() or {}
        result["peak_bytes"] = stats.get("peak_bytes_in_use")
        if result["step_s"] < 30:
            # The first run may include one-time kernel loading; when a second
            # run is cheap, report its time instead.
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(q, k, v, do, {}))
            result["step_s"] = time.perf_counter() - t0
        result["status"] = "ok"
    except NotApplicable as e:
        result.update(status="n.a.", error=str(e))
    except Exception as e:  # noqa: BLE001
        result.update(status="error", error=short_error(e))
    return result


def run_memory_point(impl: str, seq: int, args) -> dict:
    """Runs memory_child in a fresh subprocess and parses its JSON line."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    # Make `-m pallas_flash.bench` importable from any working directory.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "pallas_flash.bench", "--_memory-child", impl,
           str(seq), "--dtype", args.dtype]
    base = {"impl": impl, "seq": seq, "dtype": args.dtype}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.child_timeout)
    except subprocess.TimeoutExpired:
        return {**base, "status": "error", "error": f"timeout after {args.child_timeout}s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(CHILD_MARKER):
            return json.loads(line[len(CHILD_MARKER):])
    # No JSON: the child died (e.g. killed by the OS); show its last words.
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {**base, "status": "error", "error": f"exit {proc.returncode}: {tail}"[:200]}


def run_memory(args, impl_names, on_point=None) -> dict:
    """Every (impl, seq) point; `on_point(partial result)` after each one."""
    seqs = [parse_seq(s) for s in args.memory_seqs.split(",") if s.strip()]
    dtype_bytes = jnp.dtype(DTYPES[args.dtype]).itemsize
    batch, q_heads, kv_heads, head_dim = MEMORY_SHAPE
    shape = {"batch": batch, "q_heads": q_heads, "kv_heads": kv_heads,
             "head_dim": head_dim, "causal": True, "dtype": args.dtype}
    points, longest = [], {}
    memory = {"shape": shape, "points": points, "longest_seq_ok": longest}
    for impl in impl_names:
        failed_at = None
        for seq in sorted(seqs):
            if failed_at is not None:
                # Memory only grows with seq: a bigger point would fail too.
                point = {"impl": impl, "seq": seq, "dtype": args.dtype,
                         "status": "skipped", "error": f"failed at {seq_label(failed_at)}"}
            else:
                print(f"  memory {impl} seq={seq_label(seq)} ...", flush=True)
                point = run_memory_point(impl, seq, args)
            point["floor_bytes"] = memory_floor(seq, dtype_bytes)
            peak = point.get("peak_bytes")
            point["peak_over_floor"] = peak / point["floor_bytes"] if peak else None
            if point["status"] == "ok":
                longest[impl] = seq
            elif failed_at is None:
                failed_at = seq
            points.append(point)
            if on_point:
                on_point(memory)
    return memory


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------

def _fmt(x, spec=".1f", none="-") -> str:
    return none if x is None else format(x, spec)


def _tf(x) -> str:
    """TFLOP/s: one decimal on a GPU, three significant digits for CPU smoke runs."""
    return _fmt(x, ".1f" if x is None or x >= 10 else ".3g")


def format_table(rows: list[dict]) -> str:
    """Compact text table; variant rows also show speed vs our plain kernel."""
    head = (f"{'case':<32} {'causal':<6} {'impl':<20} {'fwd ms':>8} {'TF/s':>6} "
            f"{'bwd ms':>8} {'TF/s':>6} {'fwd xcuDNN':>10} {'bwd xcuDNN':>10} "
            f"{'xplain f/b':>10} {'err/cuDNN':>9} {'err/ref':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        left = f"{r['case']:<32} {str(r['causal']):<6} {r['impl']:<20}"
        if r["status"] in ("error", "n.a."):
            label = "n.a." if r["status"] == "n.a." else "error"
            lines.append(f"{left} {label}: {r['error']}")
            continue
        plain = ("-" if r.get("fwd_vs_plain") is None or r["impl"] == PLAIN else
                 f"{_fmt(r['fwd_vs_plain'], '.2f')}/{_fmt(r.get('bwd_vs_plain'), '.2f')}")
        line = (f"{left} {_fmt(r.get('fwd_ms'), '.3f'):>8} {_tf(r.get('fwd_tflops')):>6} "
                f"{_fmt(r.get('bwd_ms'), '.3f'):>8} {_tf(r.get('bwd_tflops')):>6} "
                f"{_fmt(r.get('fwd_vs_cudnn'), '.2f'):>10} {_fmt(r.get('bwd_vs_cudnn'), '.2f'):>10} "
                f"{plain:>10} {_fmt(r.get('err_vs_cudnn'), '.1e'):>9} "
                f"{_fmt(r.get('err_vs_ref'), '.1e'):>9}")
        if r["status"] == "bwd error":
            line += f"  bwd error: {r['error']}"
        lines.append(line)
    lines.append("x = speed ratio (cuDNN or plain time / this time; >1 is faster); "
                 "err = ||out-x||/||x|| of the forward output")
    return "\n".join(lines)


def format_memory_table(memory: dict) -> str:
    head = (f"{'impl':<20} {'seq':>6} {'status':<8} {'peak GiB':>9} {'floor GiB':>9} "
            f"{'peak/floor':>10} {'step s':>8}")
    lines = [head, "-" * len(head)]
    gib = 1 << 30
    for p in memory["points"]:
        line = (f"{p['impl']:<20} {seq_label(p['seq']):>6} {p['status']:<8} "
                f"{_fmt(p.get('peak_bytes') and p['peak_bytes'] / gib, '.2f'):>9} "
                f"{p['floor_bytes'] / gib:>9.2f} {_fmt(p.get('peak_over_floor'), '.2f'):>10} "
                f"{_fmt(p.get('step_s'), '.3f'):>8}")
        if p.get("error"):
            line += f"  {p['error']}"
        lines.append(line)
    for impl in dict.fromkeys(p["impl"] for p in memory["points"]):
        seq = memory["longest_seq_ok"].get(impl)
        lines.append(f"longest seq that fits: {impl}: {seq_label(seq) if seq else 'none'}")
    return "\n".join(lines)


def plot_speed(rows: list[dict], path: str) -> bool:
    """TFLOP/s vs sequence length; panels fwd/bwd x non-causal/causal.

    Colour = implementation, marker = head layout (q heads/kv heads, head_dim):
    seq alone does not fix the shape, so points of one layout are joined.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        return False
    impls = sorted({r["impl"] for r in rows})
    shapes = sorted({(r["q_heads"], r["kv_heads"], r["head_dim"]) for r in rows})
    markers = "os^Dvp*hX"
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), squeeze=False)
    for col, causal in enumerate((False, True)):
        for row_i, pass_ in enumerate(("fwd", "bwd")):
            ax = axes[row_i][col]
            for ci, impl in enumerate(impls):
                for si, shape in enumerate(shapes):
                    pts = sorted((r["seq"], r[f"{pass_}_tflops"]) for r in rows
                                 if r["impl"] == impl and r["causal"] == causal
                                 and (r["q_heads"], r["kv_heads"], r["head_dim"]) == shape
                                 and r.get(f"{pass_}_tflops"))
                    if pts:
                        ax.plot(*zip(*pts), color=f"C{ci}", marker=markers[si % len(markers)],
                                linestyle="-" if len(pts) > 1 else "none")
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)  # so heights read as fractions of the ceiling
            ax.set_xlabel("sequence length")
            ax.set_ylabel("TFLOP/s")
            ax.set_title(f"{pass_} {'causal' if causal else 'non-causal'}")
            ax.grid(True, alpha=0.3)
    handles = [Line2D([], [], color=f"C{i}", label=n) for i, n in enumerate(impls)]
    handles += [Line2D([], [], color="gray", linestyle="none", marker=markers[i % len(markers)],
                       label=f"heads {hq}/{hkv}, D {d}")
                for i, (hq, hkv, d) in enumerate(shapes)]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_memory(memory: dict, path: str) -> bool:
    """Peak memory vs sequence length per implementation, with the floor."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 5))
    points = memory["points"]
    for impl in sorted({p["impl"] for p in points}):
        pts = sorted((p["seq"], p["peak_bytes"] / 2**30) for p in points
                     if p["impl"] == impl and p.get("peak_bytes"))
        if pts:
            ax.plot(*zip(*pts), marker="o", label=impl)
    floor = sorted({(p["seq"], p["floor_bytes"] / 2**30) for p in points})
    ax.plot(*zip(*floor), "k--", label="floor (q,k,v,o,dq,dk,dv,dO)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length")
    ax.set_ylabel("peak GiB, one fwd+bwd step")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def git_commit() -> str | None:
    """HEAD of the checkout this module lives in, '+dirty' if modified."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                              capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def metadata(args, argv) -> dict:
    dev = jax.devices()[0]
    return {
        "gpu": dev.device_kind,
        "backend": jax.default_backend(),
        "jax_version": jax.__version__,
        "git_commit": git_commit(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(argv),
        "dtype": args.dtype,
        "iters_fwd": args.iters,
        "iters_fwdbwd": args.iters_bwd,
        "warmup": args.warmup,
        "timer": args.timer,
        "ref_rows": args.ref_rows,
        "flops": "fwd = 4*B*Hq*Sq*Skv*D (/2 causal); bwd = 2.5*fwd; variants count "
                 "kept (query, key) pairs instead of Sq*Skv(/2)",
    }


def summary_line(meta: dict) -> str:
    return (f"{meta['gpu']} ({meta['backend']}), jax {meta['jax_version']}, "
            f"commit {meta['git_commit']}, {meta['date_utc']}, {meta['dtype']}")


def claim_stem(out_dir: str, prefix: str, stamp: str) -> str:
    """A file stem `prefix_stamp` (then `-2`, `-3`, ...) that no other run in `out_dir` holds.

    The file is created here, exclusively, so two runs started in the same second (one per GPU,
    say) cannot both write `bench_<stamp>.json`, one overwriting the other."""
    os.makedirs(out_dir, exist_ok=True)
    for n in range(1, 1000):
        stem = f"{prefix}_{stamp}" + (f"-{n}" if n > 1 else "")
        try:
            os.close(os.open(os.path.join(out_dir, stem + ".json"),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return stem
        except FileExistsError:
            continue
    raise RuntimeError(f"no free {prefix}_{stamp}* name in {out_dir}")


def write_json(obj: dict, out_dir: str, stem: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, stem + ".json")
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
    return path


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pallas_flash.bench",
        description="Time and check pallas_flash against cuDNN and XLA attention.")
    p.add_argument("--cases", default=None,
                   help="comma list of BxSxHqxHkvxD, e.g. 2x8192x16x16x128; "
                        "'none' runs no standard case (default: the six standard cases)")
    p.add_argument("--causal", choices=("both", "yes", "no"), default=None,
                   help="which masks to run for the standard cases (default both)")
    p.add_argument("--impls", default=None,
                   help=f"comma list from {sorted(IMPLS)} (default "
                        f"{','.join(DEFAULT_IMPLS)}; variants default to pallas_flash,cudnn)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--iters", type=int, default=None, help="forward runs (default 20)")
    p.add_argument("--iters-bwd", type=int, default=None,
                   help="forward+backward runs (default 10)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed calls first, at least 2 (default 3)")
    p.add_argument("--timer", choices=("call", "pipelined"), default="call",
                   help="time each call to its end (default), or batches of back-to-back "
                        "calls with one synchronisation each (host work overlapped)")
    p.add_argument("--ref-rows", type=int, default=None,
                   help="query rows sampled for the f32 reference (default 256)")
    p.add_argument("--variants", action="store_true",
                   help="also run packed documents, sliding window and softcap cases")
    p.add_argument("--memory", action="store_true",
                   help="instead: peak memory of one fwd+bwd step as seq grows "
                        "(batch 1, 16 heads, head_dim 128, causal), one subprocess per point")
    p.add_argument("--memory-seqs", default=MEMORY_SEQS,
                   help=f"sequence lengths for --memory (default {MEMORY_SEQS})")
    p.add_argument("--child-timeout", type=float, default=900.0,
                   help="seconds per --memory subprocess (default 900)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny CPU-friendly run: case 1x128x2x1x32, pallas_flash,cudnn,xla, "
                        "1 iteration, no plot")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"),
                   help="directory for the JSON and PNG (default benchmarks/results)")
    plot = p.add_mutually_exclusive_group()
    plot.add_argument("--plot", dest="plot", action="store_true", default=None,
                      help="write the PNG (default unless --smoke; needs matplotlib)")
    plot.add_argument("--no-plot", dest="plot", action="store_false")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--_memory-child", nargs=2, metavar=("IMPL", "SEQ"),
                   help=argparse.SUPPRESS)
    return p


def resolve_defaults(args) -> None:
    """Fill unset options; --smoke changes the defaults, explicit flags win."""
    smoke = args.smoke
    defaults = {
        "causal": "both",
        "iters": 1 if smoke else 20,
        "iters_bwd": 1 if smoke else 10,
        "warmup": 2 if smoke else 3,
        # Fewer rows than the sequence so the smoke run exercises row sampling.
        "ref_rows": 64 if smoke else 256,
        "plot": not smoke,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.warmup = max(args.warmup, 2)  # see time_calls


def parse_impls(text: str | None, parser) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in IMPLS]
    if unknown:
        parser.error(f"unknown impls {unknown}; known: {sorted(IMPLS)}")
    return names


def select_cases(args, parser) -> list[Case]:
    if args.cases is None:
        shapes = [SMOKE_CASE] if args.smoke else list(DEFAULT_CASES)
    elif args.cases.strip().lower() == "none":
        shapes = []
    else:
        try:
            shapes = [parse_case(c) for c in args.cases.split(",") if c.strip()]
        except (argparse.ArgumentTypeError, ValueError) as e:
            parser.error(str(e))
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    return [Case(*shape, causal=c) for shape in shapes for c in causals]


def main(argv: list[str] | None = None) -> dict:
    """CLI entry point; returns the dict also written as JSON."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)

    if args._memory_child:
        impl, seq = args._memory_child
        result = memory_child(impl, int(seq), args.dtype)
        print(CHILD_MARKER + json.dumps(result), flush=True)
        return result

    resolve_defaults(args)
    explicit_impls = parse_impls(args.impls, parser)
    impls = explicit_impls or list(DEFAULT_IMPLS)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    meta = metadata(args, argv)
    print(f"device: {meta['gpu']} ({meta['backend']}), jax {meta['jax_version']}", flush=True)

    if args.memory:
        stem = claim_stem(args.out, "memory", stamp)

        def save(memory, complete):
            return write_json({"meta": meta, "complete": complete, "memory": memory},
                              args.out, stem)

        memory = run_memory(args, impls, on_point=lambda m: save(m, False))
        path = save(memory, True)
        result = {"meta": meta, "complete": True, "memory": memory}
        if args.plot and plot_memory(memory, os.path.join(args.out, f"{stem}.png")):
            print(f"plot: {os.path.join(args.out, f'{stem}.png')}")
        print(f"json: {path}\n")
        print(summary_line(meta))
        print(format_memory_table(memory))
        return result

    key = jax.random.key(args.seed)
    plan = [(c, impls, jax.random.fold_in(key, i))
            for i, c in enumerate(select_cases(args, parser))]
    if args.variants:
        # XLA materialises S x S logits, hopeless at 32k: only if asked for.
        v_impls = explicit_impls or ["pallas_flash", "cudnn"]
        plan += [(c, v_impls, jax.random.fold_in(key, 1000 + i))
                 for i, c in enumerate(variant_cases())]

    rows: list[dict] = []
    result = {"meta": meta, "complete": False, "results": rows}
    stem = claim_stem(args.out, "bench", stamp)
    for case, case_impls, case_key in plan:
        rows += run_case(case, case_impls, args, case_key)
        # Rewritten after every case, so a run cut short keeps what it measured.
        path = write_json(result, args.out, stem)
    result["complete"] = True
    path = write_json(result, args.out, stem)
    png = os.path.join(args.out, f"{stem}.png")
    if args.plot:
        speed_rows = [r for r in rows if r["variant"] is None]
        print(f"plot: {png}" if plot_speed(speed_rows, png)
              else "plot: skipped (matplotlib not importable)")
    print(f"json: {path}\n")
    print(summary_line(meta))
    print(format_table(rows))
    return result


if __name__ == "__main__":
    main()
