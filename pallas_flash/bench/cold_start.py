"""Cold start (``--cold-start``): seconds from process start to the end of the third training step.

Each (implementation, cache) run is a fresh child process (:mod:`cold_start_child`, run by path)
that times ``steps`` jitted forward+backward steps of one case. The clock starts in the parent,
with ``time.time()`` just before it spawns the child, the same way for every implementation, so
the figure holds the interpreter's start, the imports, the device's start-up, the inputs, the
compilation and three steps. Every implementation runs three times:

* ``none``: JAX's persistent compilation cache off, what a first run pays;
* ``fill``: the cache on, in a fresh empty folder, which this child fills;
* ``warm``: the cache on, in that folder: what a second process pays.

One untimed child first imports everything, so that the first measured child is not the only one
to read the libraries from disk. The children run with JAX's default device allocator, which
reserves most of the GPU's memory at start, as a user's process does: with that reservation off
(`XLA_PYTHON_CLIENT_PREALLOCATE=false`, which the other benchmarks set so that a process takes
only what it uses), the first steps also pay the allocator's growth.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax.numpy as jnp

from pallas_flash.bench.cases import DTYPES, Case
from pallas_flash.bench.cold_start_child import MARKER
from pallas_flash.bench.report import fmt_seconds

DEFAULT_CASE = (1, 8192, 16, 16, 128)
CACHES = ("none", "fill", "warm")
CLOCK = ("time.time() in the parent just before it spawns the child, to time.time() in the "
         "child at the end of the third step")
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cold_start_child.py")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Settings that would put a cache under the "none" run, and the allocator settings that make a
# child's allocator differ from a user's (module docstring).
_CACHE_ENV = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
              "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")
_ALLOCATOR_ENV = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                  "XLA_PYTHON_CLIENT_ALLOCATOR")


def default_impls(backend: str) -> list[str]:
    return ["pallas_flash", "cudnn"] if backend == "gpu" else ["pallas_flash", "xla"]


def baseline_of(impls: list[str]) -> str | None:
    """The implementation every other one is compared with: cuDNN where it runs, else XLA."""
    return next((n for n in ("cudnn", "xla") if n in impls), None)


def child_env(env: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in env.items() if k not in _CACHE_ENV + _ALLOCATOR_ENV}
    # -P keeps the child's folder off sys.path; pallas_flash comes from the checkout.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    return env


def run_child(spec: dict, env: dict[str, str], timeout: float) -> dict:
    """Spawns one child; its JSON result, or an error result that says why there is none."""
    spec = {**spec, "spawned_at": time.time()}
    cmd = [sys.executable, "-P", _CHILD, json.dumps(spec)]
    base = {"impl": spec.get("impl"), "cache": spec.get("cache"), "status": "error"}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**base, "error": f"timeout after {timeout:g}s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {**base, "error": f"exit {proc.returncode}: {tail}"[:200]}


def summarize(run: dict) -> None:
    """Adds steps 1, 2, 3 and N and the ratios of steps 2 and 3 to step N."""
    steps = run.get("step_s") or []
    if run["status"] != "ok" or len(steps) < 3:
        return
    run.update(step1_s=steps[0], step2_s=steps[1], step3_s=steps[2], stepN_s=steps[-1],
               step2_over_stepN=steps[1] / steps[-1], step3_over_stepN=steps[2] / steps[-1])


def add_baseline_differences(runs: list[dict], baseline: str | None) -> None:
    """start_to_third_s minus the baseline's, for the same case and cache."""
    base = {(r["case"], r["cache"]): r.get("start_to_third_s")
            for r in runs if r["impl"] == baseline and r["status"] == "ok"}
    for r in runs:
        b = base.get((r["case"], r["cache"]))
        mine = r.get("start_to_third_s")
        r["minus_baseline_s"] = mine - b if mine is not None and b is not None else None


def run_cold_start(args, impls: list[str], cases: list[Case], env: dict[str, str],
                   on_run=None) -> dict[str, Any]:
    """Every case, cache setting and implementation, one fresh child each."""
    runs: list[dict] = []
    baseline = baseline_of(impls)
    section = {"steps": args.cold_start_steps, "dtype": args.dtype, "baseline": baseline,
               "clock": CLOCK, "impls": list(impls), "caches": list(CACHES),
               "runs": runs}
    env = child_env(env)
    section["env"] = {k: env.get(k) for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_FLAGS")}
    print("  cold start: priming the page cache (untimed) ...", flush=True)
    primed = run_child({"prime": True, "impls": list(impls)}, env, args.child_timeout)
    if primed["status"] != "ok":
        print(f"    prime: {primed.get('error')}", flush=True)
    dirs = {}
    try:
        for case in cases:
            for cache in CACHES:
                for impl in impls:
                    if cache == "fill":
                        dirs[case, impl] = tempfile.mkdtemp(prefix="pallas_flash_cache_")
                    spec = {"impl": impl, "cache": cache,
                            "cache_dir": None if cache == "none" else dirs[case, impl],
                            "shape": [case.batch, case.seq, case.q_heads, case.kv_heads,
                                      case.head_dim],
                            "dtype": jnp.dtype(DTYPES[args.dtype]).name, "causal": case.causal,
                            "seed": args.seed, "steps": args.cold_start_steps}
                    print(f"  cold start {case.name} causal={case.causal} {impl} "
                          f"cache={cache} ...", flush=True)
                    run = run_child(spec, env, args.child_timeout)
                    run.update(case=case.name, causal=case.causal, impl=impl, cache=cache)
                    summarize(run)
                    runs.append(run)
                    add_baseline_differences(runs, baseline)
                    print("    " + progress_line(run), flush=True)
                    if on_run:
                        on_run(section)
    finally:
        for path in dirs.values():
            shutil.rmtree(path, ignore_errors=True)
    return section


def progress_line(run: dict) -> str:
    if run["status"] != "ok":
        return f"{run['status']}: {run.get('error')}"
    return (f"start -> 3rd step {run['start_to_third_s']:.2f} s; steps 1/2/3/N "
            + " / ".join(fmt_seconds(run[f"step{i}_s"]) for i in ("1", "2", "3", "N")))
