"""Peak device memory of one forward+backward step as the sequence grows (``--memory``).

Every (implementation, sequence length) point runs in a fresh child process, so that one
point's peak cannot leak into the next; the child prints its result as one JSON line after
:data:`CHILD_MARKER`. The shape is batch 1, 16 heads (no GQA; ``--memory-heads`` takes fewer
where a step at the longest lengths would outlast the time a run has), head_dim 128, causal. The
floor is what any implementation must hold: q, k, v, O, dO and the three gradients.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

from pallas_flash.bench.cases import DTYPES, Case, make_inputs, parse_seq, seq_label
from pallas_flash.bench.impls import IMPLS, NotApplicable, short_error
from pallas_flash.bench.timing import make_fns

MEMORY_SEQS = "32k,128k,512k,1M,2M,4M"
# The share of device memory a child's allocator may take. Without preallocation JAX's
# allocator still stops at 75% of the memory by default, below the longest points' needs
# (the floor at 4M tokens and 16 heads is 128 GiB of an H200's 139).
MEMORY_FRACTION = "0.95"
MEMORY_SHAPE = (1, 16, 16, 128)  # batch, q_heads, kv_heads, head_dim
CHILD_MARKER = "PALLAS_FLASH_MEMORY_JSON "
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def memory_shape(heads: int | None = None) -> tuple[int, int, int, int]:
    """(batch, q_heads, kv_heads, head_dim) of the sweep, with `heads` q and kv heads if given."""
    batch, q_heads, kv_heads, head_dim = MEMORY_SHAPE
    return (batch, heads, heads, head_dim) if heads else (batch, q_heads, kv_heads, head_dim)


def memory_floor(seq: int, dtype_bytes: int, heads: int | None = None) -> int:
    """Bytes of q, k, v, o, dq, dk, dv and dO: what any implementation must hold."""
    batch, q_heads, kv_heads, head_dim = memory_shape(heads)
    q_like = batch * seq * q_heads * head_dim     # q, o, dq, dO
    kv_like = batch * seq * kv_heads * head_dim   # k, v, dk, dv
    return (4 * q_like + 4 * kv_like) * dtype_bytes


def memory_child(impl: str, seq: int, dtype_name: str, heads: int | None = None) -> dict:
    """One forward+backward step in this (fresh) process; peak device memory."""
    batch, q_heads, kv_heads, head_dim = memory_shape(heads)
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


def child_env() -> dict:
    """The environment of a memory child: no preallocation (the peak is what the step holds),
    and the allocator allowed MEMORY_FRACTION of the device unless the caller set a share."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    if not (env.get("XLA_CLIENT_MEM_FRACTION") or env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")):
        env["XLA_CLIENT_MEM_FRACTION"] = MEMORY_FRACTION
    return env


def run_memory_point(impl: str, seq: int, args) -> dict:
    """Runs memory_child in a fresh subprocess and parses its JSON line."""
    env = child_env()
    # Make `-m pallas_flash.bench` importable from any working directory.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "pallas_flash.bench", "--_memory-child", impl,
           str(seq), "--dtype", args.dtype, "--memory-heads", str(args.memory_heads)]
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
    batch, q_heads, kv_heads, head_dim = memory_shape(args.memory_heads)
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
            point["floor_bytes"] = memory_floor(seq, dtype_bytes, args.memory_heads)
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
