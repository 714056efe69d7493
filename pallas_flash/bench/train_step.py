"""End-to-end benchmark: one training step of a Llama-style decoder, attention swapped.

``python -m pallas_flash.bench.train_step`` builds the decoder of :mod:`pallas_flash.bench.llama`
(by default Llama-3-8B's layer shape, 4 layers, 32k vocabulary, bf16) and times its jitted
training step (forward, backward, Adam; parameters and optimiser state donated) with the
attention served by each implementation in turn:

* ``pallas_flash``: ``pallas_flash.flash_attention(causal=True)``;
* ``cudnn`` and ``xla``: ``jax.nn.dot_product_attention(implementation=..., is_causal=True)``;
  ``xla`` materialises every layer's scores and is skipped, with the reason, at a length whose
  scores alone would not fit the device;
* ``tokamax``: ``tokamax.dot_product_attention(is_causal=True)`` on its Pallas kernels (Mosaic,
  else Triton), skipped with the reason where tokamax is not importable.

For every implementation and sequence length it records the compile time, the step time (the
median of ``--steps`` steps each ended by ``jax.block_until_ready``, after ``--warmup`` untimed
steps; and the mean of as many steps dispatched back to back, one synchronisation at the end),
tokens/s, model TFLOP/s, the step-0 loss and the peak device memory, and each implementation's
ratios to the baseline (cuDNN; XLA where cuDNN is not run).

Peak memory. On a GPU every implementation runs in its own child process, its lengths in
increasing order, and the peak is ``memory_stats()['peak_bytes_in_use']`` after the steps: a
longer sequence needs more memory, so each length's peak is its own. Where the device keeps no
statistics (the CPU), or with ``--isolate no``, it is XLA's memory analysis of the compiled step
(arguments + outputs - donated aliases + temporaries), which leaves out the allocator's
fragmentation.

``--preset tiny`` is a CPU-sized run (Pallas interpret mode) for tests. The results go to
``OUT/train_step_<stamp>.json``, rewritten after every implementation, and a table is printed;
:func:`markdown_train_step` renders the JSON as Markdown for the docs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

from pallas_flash.bench import llama, report
from pallas_flash.bench.cases import parse_seq, seq_label
from pallas_flash.bench.impls import IMPLS, NotApplicable, short_error

__all__ = ["main", "measure_point", "markdown_train_step", "format_table"]

IMPL_NAMES = ("pallas_flash", "cudnn", "tokamax", "xla")
CHILD_MARKER = "PALLAS_FLASH_TRAIN_STEP_JSON "
PEAK_STATS = "memory_stats()['peak_bytes_in_use'] of a child process per implementation"
PEAK_ANALYSIS = ("XLA memory analysis of the compiled step (arguments + outputs - donated "
                 "aliases + temporaries)")
FLOPS = ("6 x tokens x matmul parameters (output head included, embedding gather not) + "
         "layers x causal attention fwd+bwd (3.5 x 2 x B x Hq x S^2 x D)")
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# preset -> model and run settings; flags override them one by one.
PRESETS: dict[str, dict[str, Any]] = {
    "llama8b-4l": {"model": llama.PRESETS["llama8b-4l"], "seqs": "8k,32k", "batch": 1,
                   "impls": IMPL_NAMES, "steps": 10, "warmup": 2},
    "tiny": {"model": llama.PRESETS["tiny"], "seqs": "256", "batch": 1,
             "impls": ("pallas_flash", "xla"), "steps": 2, "warmup": 1},
}


# --------------------------------------------------------------------------------------------
# One (implementation, sequence length) point, in this process
# --------------------------------------------------------------------------------------------


def attention_fn(impl: str) -> llama.Attention:
    """attn(q, k, v), causal, for one implementation name."""
    if impl == "tokamax" and importlib.util.find_spec("tokamax") is None:
        raise NotApplicable("tokamax not importable (not installed)")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {sorted(IMPLS)}, got {impl!r}")
    fn = IMPLS[impl]
    return lambda q, k, v: fn(q, k, v, True)


def xla_score_bytes(cfg: llama.ModelConfig, batch: int, seq: int) -> int:
    """What XLA attention's scores need in one step: every layer keeps its float32 and
    compute-dtype probabilities for the backward, and the layer being computed holds its
    float32 logits besides."""
    scores = batch * cfg.q_heads * seq * seq
    return scores * (cfg.n_layers * (4 + cfg.compute_dtype.itemsize) + 4)


def _device_stats() -> dict:
    try:
        return jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without statistics
        return {}


def _analysis(compiled) -> dict | None:
    try:
        ma = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None
    if ma is None:
        return None
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
              "temp_size_in_bytes")
    out = {f: int(getattr(ma, f)) for f in fields}
    out["peak_bytes"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"]
                         - out["alias_size_in_bytes"] + out["temp_size_in_bytes"])
    return out


def measure_point(cfg: llama.ModelConfig, impl: str, batch: int, seq: int, *, steps: int,
                  warmup: int, seed: int = 0, lr: float = 1e-4,
                  device_peak: bool = True) -> dict:
    """Compiles and times one training step; a failure becomes the row's status and error.

    The parameters and the batch depend only on (cfg, seed, batch, seq), so every
    implementation's step-0 loss is computed from the same numbers. device_peak: this process
    ran nothing larger before, so the device's peak statistic is this point's.
    """
    row: dict[str, Any] = {"impl": impl, "seq": seq, "batch": batch, "status": "error",
                           "error": None}
    try:
        attn = attention_fn(impl)
        limit = _device_stats().get("bytes_limit")
        if impl == "xla" and limit and xla_score_bytes(cfg, batch, seq) > limit:
            raise NotApplicable(
                f"XLA's attention scores need {xla_score_bytes(cfg, batch, seq) / 2**30:.0f} "
                f"GiB, the device has {limit / 2**30:.0f} GiB")
        k_params, k_tokens = jax.random.split(jax.random.key(seed))
        params = jax.jit(llama.init_params, static_argnums=0)(cfg, k_params)
        opt_state = jax.jit(llama.init_adam)(params)
        tokens = jax.random.randint(k_tokens, (batch, seq + 1), 0, cfg.vocab, jnp.int32)
        row["state_bytes"] = llama.tree_bytes((params, opt_state))

        t0 = time.perf_counter()
        compiled = llama.make_train_step(cfg, attn, lr).lower(params, opt_state, tokens).compile()
        row["compile_s"] = time.perf_counter() - t0
        row["memory_analysis"] = _analysis(compiled)
        # Autotuning while compiling allocates too: a peak close to this one is the compiler's.
        row["peak_bytes_after_compile"] = _device_stats().get("peak_bytes_in_use")

        def run(state):
            return jax.block_until_ready(compiled(*state, tokens))

        t0 = time.perf_counter()
        *state, loss = run((params, opt_state))
        row["first_step_s"] = time.perf_counter() - t0
        row["loss_first"] = float(loss)
        for _ in range(warmup - 1):
            *state, loss = run(state)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            *state, loss = run(state)
            times.append(time.perf_counter() - t0)
        # Back to back: the host's dispatch of step i+1 overlaps the device's step i, as in a
        # training loop that does not read the loss every step.
        t0 = time.perf_counter()
        for _ in range(steps):
            *state, loss = compiled(*state, tokens)
        jax.block_until_ready((state, loss))
        pipelined = (time.perf_counter() - t0) / steps
        row["loss_last"] = float(loss)
        del state

        step_s = statistics.median(times)
        row.update(status="ok", step_times_ms=[t * 1e3 for t in times], step_ms=step_s * 1e3,
                   pipelined_step_ms=pipelined * 1e3, tokens_per_s=batch * seq / step_s,
                   step_flops=llama.step_flops(cfg, batch, seq),
                   loss_finite=all(map(math.isfinite, (row["loss_first"], row["loss_last"]))))
        row["model_tflops"] = row["step_flops"] / step_s / 1e12
        peak = _device_stats().get("peak_bytes_in_use") if device_peak else None
        if peak is not None:
            row.update(peak_bytes=int(peak), peak_source="memory_stats")
        elif row["memory_analysis"] is not None:
            row.update(peak_bytes=row["memory_analysis"]["peak_bytes"],
                       peak_source="memory_analysis")
        else:
            row.update(peak_bytes=None, peak_source=None)
    except NotApplicable as e:
        row.update(status="skipped", error=str(e))
    except Exception as e:  # noqa: BLE001 - any failure is this row's result
        row["error"] = short_error(e)
    return row


def run_impl(spec: dict, emit=None) -> list[dict]:
    """Every sequence length of spec["impl"], shortest first; after a failure the longer ones
    are skipped (memory only grows with the length). emit(row) after each point."""
    cfg = llama.ModelConfig(**spec["model"])
    rows, failed_at = [], None
    for seq in sorted(spec["seqs"]):
        if failed_at is not None:
            row = {"impl": spec["impl"], "seq": seq, "batch": spec["batch"],
                   "status": "skipped", "error": f"failed at {seq_label(failed_at)}"}
        else:
            row = measure_point(cfg, spec["impl"], spec["batch"], seq, steps=spec["steps"],
                                warmup=spec["warmup"], seed=spec["seed"], lr=spec["lr"],
                                device_peak=spec["device_peak"])
            if row["status"] == "error":
                failed_at = seq
        rows.append(row)
        if emit:
            emit(row)
    return rows


# --------------------------------------------------------------------------------------------
# Child processes
# --------------------------------------------------------------------------------------------


def run_child(spec: dict, timeout: float) -> list[dict]:
    """run_impl(spec) in a fresh process; its rows, with an error row for each length it did
    not report (the child died, or ran out of time)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "pallas_flash.bench.train_step", "--_child", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        stdout, why = proc.stdout, None
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            why = f"exit {proc.returncode}: {tail}"[:200]
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        why = f"timeout after {timeout:.0f}s"
    rows = [json.loads(line[len(CHILD_MARKER):]) for line in stdout.splitlines()
            if line.startswith(CHILD_MARKER)]
    done = {r["seq"] for r in rows}
    rows += [{"impl": spec["impl"], "seq": s, "batch": spec["batch"], "status": "error",
              "error": why or "no result"} for s in sorted(spec["seqs"]) if s not in done]
    return rows


def _child_main(spec_json: str) -> None:
    def emit(row):
        print(CHILD_MARKER + json.dumps(row), flush=True)
    run_impl(json.loads(spec_json), emit)


# --------------------------------------------------------------------------------------------
# Ratios and tables
# --------------------------------------------------------------------------------------------


def peak_description(rows: list[dict]) -> str:
    """How the peaks of these rows were taken (a child falls back to the analysis where its
    device keeps no statistics)."""
    sources = {r.get("peak_source") for r in rows if r.get("peak_bytes") is not None}
    if sources == {"memory_stats"}:
        return PEAK_STATS
    if sources == {"memory_analysis"}:
        return PEAK_ANALYSIS
    return f"per row ({PEAK_STATS}; or {PEAK_ANALYSIS})" if sources else "not measured"


def baseline_of(impls) -> str | None:
    return next((n for n in ("cudnn", "xla") if n in impls), None)


def add_ratios(rows: list[dict], baseline: str | None) -> None:
    """speedup_vs_baseline = baseline's step time / this one's (> 1: faster);
    peak_vs_baseline = this peak / the baseline's (< 1: less memory); loss_vs_baseline = the
    step-0 losses' relative difference (same parameters and batch), same length."""
    base = {r["seq"]: r for r in rows if r["impl"] == baseline and r["status"] == "ok"}
    for r in rows:
        b = base.get(r["seq"])
        ok = r["status"] == "ok" and b is not None
        r["speedup_vs_baseline"] = b["step_ms"] / r["step_ms"] if ok else None
        r["peak_vs_baseline"] = (r["peak_bytes"] / b["peak_bytes"]
                                 if ok and r.get("peak_bytes") and b.get("peak_bytes") else None)
        r["loss_vs_baseline"] = (abs(r["loss_first"] - b["loss_first"]) / abs(b["loss_first"])
                                 if ok and b["loss_first"] else None)


def _ordered(rows: list[dict]) -> list[dict]:
    order = {n: i for i, n in enumerate(IMPL_NAMES)}
    return sorted(rows, key=lambda r: (r["seq"], order.get(r["impl"], 9), r["impl"]))


def _gib(x) -> str:
    if x is None:
        return "–"
    return f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.1f} MiB"


def _ratio(x) -> str:
    return "–" if x is None else f"{x:.2f}"


def _cells(r: dict) -> list[str]:
    """step, back to back, tokens/s, TFLOP/s, speed ratio, peak, peak ratio, compile, loss."""
    return [f"{r['step_ms']:.1f} ms", f"{r['pipelined_step_ms']:.1f} ms",
            f"{r['tokens_per_s']:,.0f}", f"{r['model_tflops']:.3g}",
            _ratio(r.get("speedup_vs_baseline")), _gib(r.get("peak_bytes")),
            _ratio(r.get("peak_vs_baseline")), f"{r['compile_s']:.1f} s",
            f"{r['loss_first']:.4f}"]


def _headers(base: str | None) -> list[str]:
    base = base or "baseline"
    return ["step", "back to back", "tokens/s", "TFLOP/s", f"× {base} speed", "peak memory",
            f"peak / {base}", "compile", "step-0 loss"]


def model_line(section: dict) -> str:
    m = section["model"]
    heads = f"{m['q_heads']} q / {m['kv_heads']} kv heads of {m['head_dim']}"
    layers = f"{m['n_layers']} layer" + ("s" if m["n_layers"] > 1 else "")
    return (f"{layers}, d_model {m['d_model']}, {heads}, SwiGLU {m['mlp_dim']}, "
            f"vocab {m['vocab']} ({'tied' if m['tied'] else 'untied'}), batch "
            f"{section['batch']}, {m['dtype']}, float32 loss, Adam")


def format_table(section: dict) -> str:
    """The printed table of one run's section."""
    head = ["seq", "impl"] + _headers(section["baseline"])
    widths = [6, 13, 10, 12, 10, 8, 13, 12, 11, 8, 11]
    lines = [" ".join(f"{h:>{w}}" for h, w in zip(head, widths))]
    lines.append("-" * len(lines[0]))
    for r in _ordered(section["runs"]):
        left = f"{seq_label(r['seq']):>6} {r['impl']:>13}"
        if r["status"] != "ok":
            lines.append(f"{left} {r['status']}: {r.get('error')}")
            continue
        lines.append(left + " " + " ".join(f"{c:>{w}}" for c, w in zip(_cells(r), widths[2:])))
    lines.append(f"model: {model_line(section)}; step: median of {section['steps']} steps, each "
                 f"synchronised; back to back: mean of {section['steps']} unsynchronised; "
                 f"peak: {section['peak_memory']}")
    return "\n".join(lines)


def markdown_train_step(sources: list[tuple[str, dict]]) -> str:
    """Markdown of (path, results JSON) pairs that hold a ``train_step`` section, in the form
    of the report's other renderers (``report._RENDER``)."""
    measured = [(path, data) for path, data in sources if "train_step" in data]
    if not measured:
        files = ", ".join(f"`{path}`" for path, _ in sources)
        return f"Not measured yet: {files} holds no training-step run.\n"
    lines = []
    for path, data in measured:
        section = data["train_step"]
        base = section["baseline"]
        lines += [f"Source: {report._source_line(path, data['meta'], False)}", "",
                  f"One jitted training step (forward, backward, Adam update) of a Llama-style "
                  f"decoder: {model_line(section)}. Step: the median of {section['steps']} "
                  f"steps, each ended by `block_until_ready`, after {section['warmup']} untimed; "
                  f"back to back: the mean of {section['steps']} steps with one "
                  f"synchronisation. TFLOP/s: {FLOPS}. Peak memory: {section['peak_memory']}."
                  + (f" × {base}: {base}'s step time over this one's (> 1 is faster)." if base
                     else ""), ""]
        table = []
        for r in _ordered(section["runs"]):
            cells = [seq_label(r["seq"]), r["impl"]]
            if r["status"] != "ok":
                table.append(cells + [f"{r['status']}: {r.get('error')}"] + ["–"] * 8)
            else:
                table.append(cells + _cells(r))
        lines += report._table(["sequence", "implementation"] + _headers(base), table) + [""]
    return "\n".join(lines).rstrip("\n") + "\n"


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pallas_flash.bench.train_step",
        description="Time a Llama-style decoder's training step with each attention.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama8b-4l",
                   help="model and run size (default llama8b-4l; tiny: a CPU test)")
    p.add_argument("--impls", help=f"comma list from {list(IMPL_NAMES)} (default: all; tiny: "
                                   "pallas_flash,xla)")
    p.add_argument("--seqs", help="comma list of sequence lengths (default 8k,32k; tiny 256)")
    p.add_argument("--batch", type=int)
    p.add_argument("--layers", type=int, dest="n_layers")
    p.add_argument("--d-model", type=int, dest="d_model")
    p.add_argument("--heads", type=int, dest="q_heads")
    p.add_argument("--kv-heads", type=int, dest="kv_heads")
    p.add_argument("--head-dim", type=int, dest="head_dim")
    p.add_argument("--mlp", type=int, dest="mlp_dim", help="SwiGLU hidden width")
    p.add_argument("--vocab", type=int)
    p.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None,
                   help="output head tied to the embedding (default untied)")
    p.add_argument("--dtype", choices=sorted(_DTYPES),
                   help="parameters and activations (default bf16; tiny fp32)")
    p.add_argument("--steps", type=int, help="timed steps (default 10; tiny 2)")
    p.add_argument("--warmup", type=int, help="untimed steps first, at least 1 (default 2)")
    p.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--isolate", choices=("auto", "yes", "no"), default="auto",
                   help="a child process per implementation (auto: on a GPU, so that the "
                        "device's peak memory is each implementation's own)")
    p.add_argument("--child-timeout", type=float, default=600.0,
                   help="seconds per child process (default 600)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds for the whole run; children get what is left, and "
                        "implementations not reached are recorded as skipped")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"),
                   help="directory for the JSON (default benchmarks/results)")
    p.add_argument("--_child", help=argparse.SUPPRESS)
    return p


def resolve(args, parser) -> tuple[llama.ModelConfig, list[str], list[int]]:
    preset = PRESETS[args.preset]
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(llama.ModelConfig)
              if getattr(args, f.name, None) is not None}
    if args.dtype:
        fields["dtype"] = _DTYPES[args.dtype]
    try:
        cfg = dataclasses.replace(preset["model"], **fields)
        seqs = [parse_seq(s) for s in (args.seqs or preset["seqs"]).split(",") if s.strip()]
    except ValueError as e:
        parser.error(str(e))
    impls = ([n.strip() for n in args.impls.split(",") if n.strip()] if args.impls
             else list(preset["impls"]))
    unknown = [n for n in impls if n not in IMPL_NAMES and n not in IMPLS]
    if unknown:
        parser.error(f"unknown impls {unknown}; known: {list(IMPL_NAMES)}")
    for name in ("batch", "steps", "warmup"):
        if getattr(args, name) is None:
            setattr(args, name, preset[name])
    if args.batch < 1 or args.steps < 1 or args.warmup < 1 or not seqs or min(seqs) < 2:
        parser.error("--batch, --steps and --warmup must be at least 1, and every seq at least 2")
    return cfg, impls, seqs


def metadata(argv, cfg: llama.ModelConfig) -> dict:
    dev = jax.devices()[0]
    return {"gpu": dev.device_kind, "backend": jax.default_backend(),
            "jax_version": jax.__version__, "git_commit": report.git_commit(),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
            "argv": list(argv), "dtype": cfg.dtype, "flops": FLOPS}


def main(argv: list[str] | None = None) -> dict:
    """Runs the benchmark; returns the dict also written as JSON."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args._child:
        _child_main(args._child)
        return {}
    cfg, impls, seqs = resolve(args, parser)
    # This process must not hold the GPU's memory that the children measure; read when the
    # backend starts, so before the first jax.devices().
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    meta = metadata(argv, cfg)
    isolate = args.isolate == "yes" or (args.isolate == "auto" and meta["backend"] == "gpu")
    print(f"device: {meta['gpu']} ({meta['backend']}), jax {meta['jax_version']}", flush=True)
    baseline = baseline_of(impls)
    rows: list[dict] = []
    section = {"model": dataclasses.asdict(cfg), "batch": args.batch, "seqs": seqs,
               "steps": args.steps, "warmup": args.warmup, "lr": args.lr, "seed": args.seed,
               "impls": impls, "baseline": baseline, "isolated": isolate,
               "peak_memory": "not measured", "runs": rows}
    result = {"meta": meta, "complete": False, "train_step": section}
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    stem = report.claim_stem(args.out, "train_step", stamp)
    start = time.perf_counter()
    for impl in impls:
        spec = {"impl": impl, "seqs": seqs, "batch": args.batch, "model": section["model"],
                "steps": args.steps, "warmup": args.warmup, "seed": args.seed, "lr": args.lr,
                "device_peak": isolate}
        left = None if args.time_limit is None else args.time_limit - (time.perf_counter() - start)
        print(f"  train step {impl} seq={','.join(map(seq_label, seqs))} ...", flush=True)
        if left is not None and left < 10:
            new = [{"impl": impl, "seq": s, "batch": args.batch, "status": "skipped",
                    "error": "time limit reached"} for s in seqs]
        elif impl == "tokamax" and importlib.util.find_spec("tokamax") is None:
            # Known before any process starts: no child for it.
            new = [{"impl": impl, "seq": s, "batch": args.batch, "status": "skipped",
                    "error": "tokamax not importable (not installed)"} for s in seqs]
        elif isolate:
            new = run_child(spec, min(args.child_timeout, left or args.child_timeout))
        else:
            new = run_impl(spec)
        for r in new:
            print(f"    {seq_label(r['seq'])}: " + (
                f"{r['step_ms']:.2f} ms, {r['tokens_per_s']:,.0f} tokens/s, peak "
                f"{_gib(r.get('peak_bytes'))}, compile {r['compile_s']:.1f} s"
                if r["status"] == "ok" else f"{r['status']}: {r.get('error')}"), flush=True)
        rows += new
        add_ratios(rows, baseline)
        section["peak_memory"] = peak_description(rows)
        # Rewritten after every implementation, so a run cut short keeps what it measured.
        path = report.write_json(result, args.out, stem)
    result["complete"] = True
    path = report.write_json(result, args.out, stem)
    print(f"json: {path}\n")
    print(report.summary_line(meta))
    print(format_table(section))
    return result


if __name__ == "__main__":
    main()
