"""The kernels compiled for an H200 on a machine without a GPU: what ptxas says of each Mosaic
kernel (registers, stack, spills), the seconds of tracing, lowering and compiling, and each
Mosaic kernel's layout inference (seconds, and the assignments its solver had to guess).

Interpret mode proves the math and the GPU the speed; between them, this answers without a GPU
whether a kernel still lowers and compiles for sm_90, whether a change made ptxas spill, and
where a fresh process's first step spends its compile time (docs/performance.md, "Cold start").
It needs jax with its CUDA plugin, in an environment of its own on a CPU machine:

    python3.12 -m venv /tmp/cuda-venv && /tmp/cuda-venv/bin/pip install -e ".[cuda]"
    /tmp/cuda-venv/bin/python benchmarks/sm90_compile.py \\
        --cases 2x8192x16x16x128:causal:step,2x8192x16x16x112:full:step,decode:1x4kx32x8x128:1

A case is SHAPE:MASK:PASS, as `benchmarks/step_trace.py`'s without the implementation: SHAPE
is BATCHxSEQxQ_HEADSxKV_HEADSxHEAD_DIM (SEQ may read 8k), MASK causal or full, PASS fwd (the
forward) or step (forward and backward under jax.vjp, as a training step stages them). A
decode case is decode:BATCHxCONTEXTxQ_HEADSxKV_HEADSxHEAD_DIM:Q_LEN, a contiguous cache, every
sequence full. --backend picks the backend of flash_attention (auto: the Mosaic kernels behind
the guard's Triton fallback, as on an H200) and of decode_attention. Each case runs in a
process of its own, so its times are a fresh process's, with every cache off (JAX's persistent
one and the lowering cache).

How: JAX's compile-only topology for the cuda platform, described by `TARGET_CONFIG` (an
H200's figures), compiles the program as XLA does on the GPU, Mosaic GPU's ptxas included;
MOSAIC_GPU_DUMP_PTXAS makes ptxas print its resource report. The Triton kernels compile inside
XLA, which prints no such report.

The report depends on ptxas's version as much as on the kernel: two versions can spill quite
differently for the same PTX. Mosaic GPU assembles its kernels with the first ptxas on PATH,
while XLA's own kernels take the one in jax's CUDA folder (the nvidia-cuda-nvcc wheel), so a
step can name two. Each row records the assemblers XLA's log names, in order; --ptxas-dir puts
another ptxas first on the child's PATH (the wheel's bin folder, say), which changes the Mosaic
kernels' report. The library asks the local device whether it is an sm_90
GPU; here there is none, so the child answers for it (`_as_sm90`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# An H200 SXM as XLA's GpuTargetConfigProto describes a GPU (figures from NVIDIA's H200
# datasheet and the H100's CUDA device properties, which the H200 shares but for its memory).
TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
device_description_str: "NVIDIA H200"
"""

MASKS = {"causal": True, "full": False}
PASSES = ("fwd", "step")
# ptxas's report: the kernel's name, then its stack and spills, then its registers.
_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")
_KERNEL_SUFFIX = "_mosaic_gpu_kernel"


def parse_case(text: str) -> dict:
    """'2x8kx16x16x128:causal:step' or 'decode:1x4kx32x8x128:1' -> the child's case dict."""
    from pallas_flash.bench.cases import parse_seq

    parts = text.strip().split(":")
    decode = parts[0] == "decode"
    if decode:
        parts = parts[1:]
    if len(parts) != (2 if decode else 3):
        raise ValueError("a case is SHAPE:MASK:PASS or decode:SHAPE:Q_LEN, got " + repr(text))
    dims = parts[0].lower().split("x")
    if len(dims) != 5:
        raise ValueError(f"SHAPE is BATCHxSEQxQ_HEADSxKV_HEADSxHEAD_DIM, got {parts[0]!r}")
    b, s, hq, hkv, d = int(dims[0]), parse_seq(dims[1]), int(dims[2]), int(dims[3]), int(dims[4])
    case = {"text": text.strip(), "shape": [b, s, hq, hkv, d]}
    if decode:
        return {**case, "pass": "decode", "q_len": int(parts[1])}
    if parts[1] not in MASKS or parts[2] not in PASSES:
        raise ValueError(f"MASK is one of {sorted(MASKS)} and PASS one of {PASSES}, got "
                         f"{text!r}")
    return {**case, "pass": parts[2], "causal": MASKS[parts[1]]}


# XLA's line naming the assembler it chose (TF_CPP_VMODULE=assemble_compilation_provider=3).
_ASSEMBLER = re.compile(r"Using ptxas\(path=([^,]+), version=([\w.]+)\)")
_LIBRARY = re.compile(r"Using (libnvptxcompiler|libnvjitlink)")


def parse_assemblers(text: str) -> list[str]:
    """The PTX assemblers XLA's log says it set up, in order and once each: "ptxas VERSION
    (PATH)" or a library's name."""
    found = []
    for line in text.splitlines():
        if m := _ASSEMBLER.search(line):
            name = f"ptxas {m.group(2)} ({m.group(1)})"
        elif m := _LIBRARY.search(line):
            name = m.group(1)
        else:
            continue
        if name not in found:
            found.append(name)
    return found


def parse_ptxas(text: str) -> list[dict]:
    """Each kernel ptxas compiled, in order: name, registers, stack and spill bytes."""
    kernels, current = [], None
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            name = m.group(1)
            current = {"kernel": name.removesuffix(_KERNEL_SUFFIX)}
            kernels.append(current)
        elif current is not None and (m := _SPILLS.search(line)):
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                           spill_loads=int(m.group(3)))
        elif current is not None and (m := _REGISTERS.search(line)):
            current["registers"] = int(m.group(1))
    return kernels


def _as_sm90() -> None:
    """The dispatch's question, "is the local device an sm_90 GPU?", answered yes: the program
    is compiled for one, and there is no local GPU to ask."""
    from pallas_flash import attention

    attention._is_sm90 = lambda: True
    attention._capability = lambda: "9.0"


@contextlib.contextmanager
def layout_inference_watch():
    """Yields a list that gains {"kernel", "seconds", "guesses"} for each Mosaic GPU module
    lowered inside the block: the seconds of its layout inference, and the assignments the
    solver tried where reducing the kernel's constraints left layouts open (each one reduces
    the whole system again). Most of a fresh process's lowering time is this inference
    (docs/performance.md, "Cold start"). It wraps two private functions of Mosaic GPU's
    layout inference; where they are gone, the list stays empty."""
    try:
        from jax.experimental.mosaic.gpu import layout_inference as li
        infer, conjure = li.infer_layout, li.conjure_assignment
    except (ImportError, AttributeError):
        yield []
        return
    records, tried = [], [0]

    def conjure_counted(*args, **kwargs):
        for assignment in conjure(*args, **kwargs):
            tried[0] += 1
            yield assignment

    def infer_timed(module, *args, **kwargs):
        tried[0] = 0
        start = time.perf_counter()
        result = infer(module, *args, **kwargs)
        seconds = time.perf_counter() - start
        name = module.operation.attributes["sym_name"] if "sym_name" in \
            module.operation.attributes else "?"
        records.append({"kernel": str(name).strip('"'), "seconds": seconds,
                        "guesses": tried[0]})
        return result

    li.infer_layout, li.conjure_assignment = infer_timed, conjure_counted
    try:
        yield records
    finally:
        li.infer_layout, li.conjure_assignment = infer, conjure


def child(case: dict, backend: str, dtype_name: str) -> dict:
    """Traces, lowers and compiles one case for the H200 in this process; returns the times
    and, per Mosaic kernel, its layout inference (`layout_inference_watch`)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import AxisType

    import pallas_flash as pf

    _as_sm90()
    topology = topologies.get_topology_desc("h200", "cuda", target_config=TARGET_CONFIG,
                                            topology="1x1x1")
    sharding = jax.sharding.SingleDeviceSharding(topology.devices[0])
    dtype = jnp.dtype(dtype_name)

    def arg(shape, dt=dtype):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

    b, s, hq, hkv, d = case["shape"]
    if case["pass"] == "decode":
        def fn(q, k, v, lengths):
            return pf.decode_attention(q, k, v, kv_lengths=lengths, backend=backend,
                                       interpret=False)
        args = (arg((b, case["q_len"], hq, d)), arg((b, s, hkv, d)), arg((b, s, hkv, d)),
                arg((b,), jnp.int32))
    else:
        def attend(q, k, v):
            return pf.flash_attention(q, k, v, causal=case["causal"], backend=backend,
                                      interpret=False)

        if case["pass"] == "fwd":
            fn = attend
        else:
            def fn(q, k, v, do):
                return jax.vjp(attend, q, k, v)[1](do)
        args = (arg((b, s, hq, d)), arg((b, s, hkv, d)), arg((b, s, hkv, d)))
        args += (arg((b, s, hq, d)),) if case["pass"] == "step" else ()

    # The Triton lowering asks for a GPU's description; an abstract mesh gives an H200's.
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                         platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,),
                                     abstract_device=device)
    times = {}
    with jax.sharding.use_abstract_mesh(mesh), layout_inference_watch() as inference:
        t0 = time.perf_counter()
        traced = jax.jit(fn).trace(*args)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
    lowered.compile()
    t3 = time.perf_counter()
    times.update(trace_s=t1 - t0, lower_s=t2 - t1, compile_s=t3 - t2,
                 layout_inference=inference)
    return times


def run_case(case: dict, backend: str, dtype: str, ptxas_dir: str | None = None) -> dict:
    """One case in a fresh process: its times, the assembler XLA chose and ptxas's report of
    its Mosaic kernels."""
    path = os.environ.get("PATH", "")
    if ptxas_dir:
        path = os.pathsep.join([str(Path(ptxas_dir).resolve()), path])
    env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1", JAX_PLATFORMS="cpu", PATH=path,
               # XLA names the assembler it picked only in this module's verbose log.
               TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="assemble_compilation_provider=3",
               # No CUDA driver here to check the plugin's libraries against.
               JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", PALLAS_FLASH_LOWERING_CACHE="0",
               JAX_ENABLE_COMPILATION_CACHE="false",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(case), "--backend", backend,
         "--dtype", dtype], capture_output=True, text=True, env=env)
    row = {"case": case["text"], "backend": backend, "dtype": dtype,
           "assemblers": parse_assemblers(proc.stderr),
           # Mosaic GPU prints ptxas's report on stdout; XLA's log on stderr repeats it for a
           # kernel that spills, so stderr is read only where stdout holds none.
           "kernels": parse_ptxas(proc.stdout) or parse_ptxas(proc.stderr)}
    result = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not result:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        return {**row, "error": tail[0] if tail else f"exit status {proc.returncode}"}
    return {**row, **json.loads(result[-1])}


def format_row(row: dict) -> str:
    head = f"{row['case']} ({row['backend']}, {row['dtype']})"
    if "error" in row:
        return f"{head}: error: {row['error']}"
    lines = [f"{head}: trace {row['trace_s']:.2f} s, lower {row['lower_s']:.2f} s, "
             f"compile {row['compile_s']:.2f} s"
             + "".join(f", {name}" for name in row.get("assemblers", []))]
    for k in row["kernels"]:
        lines.append(f"  {k['kernel']:<34} {k.get('registers', '?'):>4} registers, "
                     f"stack {k.get('stack', '?')} B, spills {k.get('spill_stores', '?')} B "
                     f"stored / {k.get('spill_loads', '?')} B loaded")
    for k in row.get("layout_inference", []):
        lines.append(f"  layout inference of {k['kernel']}: {k['seconds']:.2f} s, "
                     f"{k['guesses']} guesses")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    """A Markdown table of results rows: a row per case, a column per kernel (the prefix
    pallas_flash_mosaic_ dropped), each cell "registers, spilled bytes stored / loaded"."""
    kernels = []
    for row in rows:
        for k in row["kernels"]:
            if k["kernel"] not in kernels:
                kernels.append(k["kernel"])
    names = [k.removeprefix("pallas_flash_mosaic_") for k in kernels]
    lines = ["| case | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for row in rows:
        found = {k["kernel"]: k for k in row["kernels"]}
        cells = [f"{found[k].get('registers', '?')} r, {found[k].get('spill_stores', '?')} / "
                 f"{found[k].get('spill_loads', '?')}" if k in found else "–" for k in kernels]
        if "error" in row:
            cells = [f"error: {row['error']}"] + [""] * (len(kernels) - 1)
        lines.append(f"| {row['case']} | " + " | ".join(cells) + " |")
    assemblers = []
    for row in rows:
        assemblers += [name for name in row.get("assemblers", []) if name not in assemblers]
    if assemblers:
        lines += ["", "Assemblers XLA's log names: " + "; ".join(assemblers) + "."]
    return "\n".join(lines)


def metadata(argv) -> dict:
    import datetime

    import jax

    from pallas_flash.bench import report

    return {"target": "NVIDIA H200 (compile only, TARGET_CONFIG)", "jax_version": jax.__version__,
            "git_commit": report.git_commit(),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
            "argv": list(sys.argv[1:] if argv is None else argv)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="2x8kx16x16x128:causal:step",
                        help="comma-separated SHAPE:MASK:PASS or decode:SHAPE:Q_LEN")
    parser.add_argument("--backend", default="mosaic", choices=("auto", "mosaic", "triton"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--ptxas-dir", metavar="DIR",
                        help="a folder holding the ptxas to compile with, put first on PATH")
    parser.add_argument("--out", help="a folder for sm90_compile.json")
    parser.add_argument("--table", metavar="FILE",
                        help="print a results file's Markdown table (docs/tuning.md) and exit")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.table).read_text())["rows"]))
        return 0
    if args.child:
        print(json.dumps(child(json.loads(args.child), args.backend, args.dtype)), flush=True)
        return 0
    if args.ptxas_dir and not (Path(args.ptxas_dir) / "ptxas").is_file():
        parser.error(f"--ptxas-dir {args.ptxas_dir} holds no ptxas")
    cases = [parse_case(text) for text in args.cases.split(",") if text.strip()]
    rows = []
    for case in cases:
        rows.append(run_case(case, args.backend, args.dtype, args.ptxas_dir))
        print(format_row(rows[-1]), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "sm90_compile.json").write_text(
            json.dumps({"meta": metadata(argv), "rows": rows}, indent=1) + "\n")
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
