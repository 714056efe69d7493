"""Where an attention call's time goes: its kernels and their times, from a profiler trace.

The benchmark gives one time per call; this script says which kernels make it up. For each case
it runs `--calls` calls chained in one jitted program (each call's input waits on the previous
call's output, through an optimization barrier, so the calls run one after another, as the
layers of a model do), once more under `jax.profiler.trace`, and reads the GPU stream tracks
back: the time per call (first kernel start to last kernel end, over the calls) and each
kernel's count and mean duration, as `benchmarks/decode_trace.py` does for decoding. Comparing
`pallas_flash` (backend "auto") with `pallas_flash_mosaic` (forced, unchecked) shows what the
finiteness guard launches and what each launch costs; comparing either with `cudnn` shows
which launches cuDNN does without. Usage, from the repository root:

    PYTHONPATH=. python benchmarks/step_trace.py --out $OUT \\
        --cases pallas_flash:16x1024x16x16x128:causal:bwd,pallas_flash_mosaic:16x1024x16x16x128:causal:bwd

A case is IMPL:SHAPE:MASK:PASS. IMPL is a name of the benchmark's `--impls`
(`pallas_flash.bench.impls.IMPLS`); SHAPE is BATCHxSEQxQ_HEADSxKV_HEADSxHEAD_DIM, as the
benchmark's `--cases` (SEQ may read 1k); MASK is causal or full; PASS is fwd (the forward), bwd
(the vjp closure of one forward, its residuals computed before the traced program, as the
benchmark times the backward) or step (forward and backward in one program). It writes
step_trace_<time>.json to --out. On a CPU there are no stream tracks: the cases still run (in
interpret mode) and report no kernels.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_trace import add_run_arguments, breakdown, run_cases  # noqa: E402
from pallas_flash.bench.trace import find_trace, load_events  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_flash.bench.cases import Case, make_inputs, parse_seq  # noqa: E402
from pallas_flash.bench.impls import IMPLS  # noqa: E402

PASSES = ("fwd", "bwd", "step")
MASKS = {"causal": True, "full": False}


def parse_case(text: str) -> tuple[str, Case, str]:
    """'cudnn:2x8kx16x16x128:causal:bwd' -> ('cudnn', Case(2, 8192, ...), 'bwd')."""
    parts = text.strip().split(":")
    if len(parts) != 4 or parts[0] not in IMPLS or parts[2] not in MASKS or parts[3] not in PASSES:
        raise ValueError(f"a case is IMPL:SHAPE:MASK:PASS with IMPL in {sorted(IMPLS)}, MASK in "
                         f"{sorted(MASKS)} and PASS in {PASSES}, got {text!r}")
    impl, shape, mask, pass_ = parts
    dims = shape.lower().split("x")
    if len(dims) != 5:
        raise ValueError(f"SHAPE is BATCHxSEQxQ_HEADSxKV_HEADSxHEAD_DIM, got {shape!r}")
    b, s, hq, hkv, d = dims
    return impl, Case(int(b), parse_seq(s), int(hq), int(hkv), int(d), MASKS[mask]), pass_


def chained(call, calls: int):
    """run(first, *rest) -> outputs: `calls` calls of call(x, *rest), every x `first` held back
    by an optimization barrier until the previous call's output exists, so that the calls can
    neither overlap nor be merged into one."""
    def run(first, *rest):
        outs, prev = [], None
        for _ in range(calls):
            x = first
            if prev is not None:
                x, _ = jax.lax.optimization_barrier((x, prev))
            prev = call(x, *rest)
            outs.append(prev)
        return tuple(outs)
    return run


def program(impl: str, case: Case, pass_: str, calls: int, key):
    """(jitted program, its arguments) for one case."""
    fn = IMPLS[impl]
    q, k, v, do = make_inputs(case, jnp.bfloat16, key)

    def attend(q, k, v):
        return fn(q, k, v, case.causal)

    if pass_ == "fwd":
        return jax.jit(chained(lambda q, k, v: attend(q, k, v), calls)), (q, k, v)
    if pass_ == "step":
        def step(do, q, k, v):
            _, vjp = jax.vjp(attend, q, k, v)
            return vjp(do)
        return jax.jit(chained(step, calls)), (do, q, k, v)
    _, vjp = jax.vjp(attend, q, k, v)
    return jax.jit(chained(lambda do, vjp: vjp(do), calls)), (do, vjp)


def capture(text: str, args) -> dict:
    impl, case, pass_ = parse_case(text)
    run, run_args = program(impl, case, pass_, args.calls, jax.random.key(args.seed))
    for _ in range(3):
        jax.block_until_ready(run(*run_args))
    log_dir = os.path.join(args.out, "step_trace_" + text.replace(":", "_"))
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        jax.block_until_ready(run(*run_args))
    result = breakdown(load_events(find_trace(log_dir)), args.calls)
    shutil.rmtree(log_dir, ignore_errors=True)
    return {"case": text, "impl": impl, "shape": case.shape_name, "causal": case.causal,
            "pass": pass_, **result}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shape = "16x1024x16x16x128"
    p.add_argument("--cases", default=",".join(
        f"{impl}:{shape}:causal:{pass_}" for pass_ in ("fwd", "bwd")
        for impl in ("pallas_flash", "pallas_flash_mosaic", "cudnn")),
        help="comma list of IMPL:SHAPE:MASK:PASS")
    p.add_argument("--calls", type=int, default=8, help="chained calls per traced program")
    return add_run_arguments(p)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    cases = [c for c in args.cases.split(",") if c.strip()]
    for text in cases:
        parse_case(text)   # every case checked before the first one runs
    return run_cases("step_trace", cases, capture, args, argv)

if __name__ == "__main__":
    main()
