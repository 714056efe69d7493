"""``python -m pallas_flash.bench``: the command line of the benchmark and of its report."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import jax

from pallas_flash.bench import cases, cold_start, decode, memory, report
from pallas_flash.bench.impls import DEFAULT_IMPLS, IMPLS
from pallas_flash.bench.plots import plot_memory, plot_speed
from pallas_flash.bench.timing import default_warm_s, run_case


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pallas_flash.bench",
        description="Time and check pallas_flash against cuDNN and XLA attention.")
    p.add_argument("--cases", default=None,
                   help="comma list of BxSxHqxHkvxD, e.g. 2x8192x16x16x128; "
                        "'none' runs no standard case (default: the six standard cases; "
                        "with --cold-start 1x8192x16x16x128)")
    p.add_argument("--causal", choices=("both", "yes", "no"), default=None,
                   help="which masks to run for the cases (default both; with --cold-start "
                        "yes)")
    p.add_argument("--impls", default=None,
                   help=f"comma list from {sorted(IMPLS)} (default "
                        f"{','.join(DEFAULT_IMPLS)}; variants default to pallas_flash,cudnn; "
                        "--cold-start to pallas_flash,cudnn on a GPU, else pallas_flash,xla)")
    p.add_argument("--dtype", choices=sorted(cases.DTYPES), default="bf16")
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
    p.add_argument("--variants", nargs="?", const="all", default=None, metavar="NAMES",
                   help="also run the variant cases: packed documents, sliding window, softcap "
                        "and sinks (all), or those named, comma-separated (e.g. sinks,softcap)")
    p.add_argument("--memory", action="store_true",
                   help="instead: peak memory of one fwd+bwd step as seq grows "
                        "(batch 1, 16 heads, head_dim 128, causal), one subprocess per point")
    p.add_argument("--memory-seqs", default=memory.MEMORY_SEQS,
                   help=f"sequence lengths for --memory (default {memory.MEMORY_SEQS})")
    p.add_argument("--memory-heads", type=int, default=memory.MEMORY_SHAPE[1],
                   help="q and kv heads of --memory's case (default "
                        f"{memory.MEMORY_SHAPE[1]}); fewer shorten a step at the longest "
                        "lengths, where a run's time ends before the memory does")
    p.add_argument("--cold-start", action="store_true",
                   help="instead: seconds from process start to the end of the third "
                        "forward+backward step, and every step's time, one fresh subprocess "
                        "per implementation, with JAX's persistent compilation cache off, "
                        "empty and warm")
    p.add_argument("--cold-start-steps", type=int, default=10,
                   help="steps each --cold-start subprocess runs, at least 3 (default 10)")
    dec = p.add_argument_group("decode (--decode)")
    dec.add_argument("--decode", action="store_true",
                     help="instead: decode_attention over K/V caches (contiguous and paged) "
                          "against XLA, cuDNN and tokamax, as bandwidth and as a fraction of "
                          "the copy bandwidth measured in the same run")
    dec.add_argument("--decode-cases", default=None,
                     help="'full' (default: batch 1,4,16,64 x context 4k,16k,32k,128k x GQA "
                          "32:8 and 64:8, head_dim 128), 'smoke', or a comma list of "
                          "BATCHxCONTEXTxHQxHKVxD, e.g. 4x32kx32x8x128")
    dec.add_argument("--decode-q-lens", default=None,
                     help="new tokens per sequence, comma list (default 1,4)")
    dec.add_argument("--decode-page-size", type=int, default=None,
                     help=f"keys per page of the paged cache (default {decode.PAGE_SIZE}; "
                          f"--smoke {decode.SMOKE_PAGE_SIZE})")
    dec.add_argument("--decode-budget", type=float, default=540.0,
                     help="seconds the cases may take: no cache shape is started that would "
                          "likely end later (default 540)")
    dec.add_argument("--decode-compile-workers", type=int, default=None,
                     help="threads compiling a cache shape's functions before they are timed "
                          "(default 8 on a GPU, 1 else)")
    dec.add_argument("--decode-copy-mib", type=int, default=None,
                     help="MiB of the copy-bandwidth buffer (default 4096 on a GPU, 64 else)")
    p.add_argument("--child-timeout", type=float, default=900.0,
                   help="seconds per --memory or --cold-start subprocess (default 900)")
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
    rep = p.add_argument_group("report (runs nothing: turns results JSON into docs)")
    rep.add_argument("--report", nargs="*", metavar="RESULTS.json", default=None,
                     help="rewrite the bench-report blocks of DOCS/performance.md and README "
                          "from these benchmark, --memory or --cold-start JSON files (none: "
                          "from the files each block names), and the plots in DOCS")
    rep.add_argument("--docs", default="docs", help="docs folder for --report (default docs)")
    rep.add_argument("--readme", default="README.md",
                     help="README for --report's headline block (default README.md)")
    rep.add_argument("--check", action="store_true",
                     help="with --report: write nothing, fail if a block is out of date")
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
    args.warmup = max(args.warmup, 2)  # see timing.time_calls


def parse_impls(text: str | None, parser) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in IMPLS]
    if unknown:
        parser.error(f"unknown impls {unknown}; known: {sorted(IMPLS)}")
    return names


def select_variants(args, parser) -> list[cases.Case]:
    """The variant cases --variants names (all of them for a bare --variants)."""
    every = cases.variant_cases()
    if args.variants == "all":
        return every
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    known = list(dict.fromkeys(c.variant for c in every))
    unknown = sorted(set(names) - set(known))
    if unknown or not names:
        parser.error(f"--variants takes names from {', '.join(known)}; got {args.variants!r}")
    return [c for c in every if c.variant in names]


def select_cases(args, parser, default=None) -> list[cases.Case]:
    if args.cases is None:
        shapes = default or ([cases.SMOKE_CASE] if args.smoke else list(cases.DEFAULT_CASES))
    elif args.cases.strip().lower() == "none":
        shapes = []
    else:
        try:
            shapes = [cases.parse_case(c) for c in args.cases.split(",") if c.strip()]
        except (argparse.ArgumentTypeError, ValueError) as e:
            parser.error(str(e))
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    return [cases.Case(*shape[:5], causal=c, head_dim_v=shape[5] if len(shape) > 5 else None)
            for shape in shapes for c in causals]


def metadata(args, argv) -> dict:
    dev = jax.devices()[0]
    return {
        "gpu": dev.device_kind,
        "backend": jax.default_backend(),
        "jax_version": jax.__version__,
        "git_commit": report.git_commit(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(argv),
        "dtype": args.dtype,
        "iters_fwd": args.iters,
        "iters_fwdbwd": args.iters_bwd,
        "warmup": args.warmup,
        "warm_s": default_warm_s(),
        "timer": args.timer,
        "ref_rows": args.ref_rows,
        "flops": "fwd = 2*B*Hq*Sq*Skv*(D+Dv), Dv = D unless given (/2 causal); "
                 "bwd = 2.5*fwd; variants count kept (query, key) pairs instead of Sq*Skv(/2)",
    }


def main_report(args) -> dict:
    result = report.run_report(args.report, docs=args.docs, readme=args.readme,
                               check=args.check, plot=args.plot is not False)
    for note in result["notes"]:
        print(note)
    for path in result["plots"]:
        print(f"plot: {path}")
    if args.check and result["changed"]:
        raise SystemExit("out of date (run the report without --check): "
                         + ", ".join(result["changed"]))
    print(("out of date: " if args.check else "rewritten: ")
          + (", ".join(result["changed"]) or "nothing"))
    return result


def run_memory_sweep(args, impls, meta, stamp) -> dict:
    stem = report.claim_stem(args.out, "memory", stamp)

    def save(sweep, complete):
        return report.write_json({"meta": meta, "complete": complete, "memory": sweep},
                                 args.out, stem)

    sweep = memory.run_memory(args, impls, on_point=lambda m: save(m, False))
    path = save(sweep, True)
    png = os.path.join(args.out, f"{stem}.png")
    if args.plot and plot_memory(sweep, png):
        print(f"plot: {png}")
    print(f"json: {path}\n")
    print(report.summary_line(meta))
    print(report.format_memory_table(sweep))
    return {"meta": meta, "complete": True, "memory": sweep}


def run_cold_start(args, parser, impls, meta, stamp, env) -> dict:
    for name in ("iters_fwd", "iters_fwdbwd", "warmup", "timer", "ref_rows", "flops"):
        meta.pop(name)  # the speed benchmark's settings, unused here
    stem = report.claim_stem(args.out, "cold_start", stamp)
    result = {"meta": meta, "complete": False}

    def save(section):
        result["cold_start"] = section
        return report.write_json(result, args.out, stem)

    case_list = select_cases(args, parser, default=[cold_start.DEFAULT_CASE])
    section = cold_start.run_cold_start(args, impls, case_list, env, on_run=save)
    result["complete"] = True
    print(f"json: {save(section)}\n")
    print(report.summary_line(meta))
    print(report.format_cold_start_table(section))
    return result


def run_decode(args, parser, explicit_impls, meta, stamp) -> dict:
    for name in ("iters_fwd", "iters_fwdbwd", "ref_rows", "flops"):
        meta.pop(name)  # the speed benchmark's settings, unused here
    meta["iters"] = args.iters
    try:
        groups = decode.make_groups(decode.parse_cases(args.decode_cases, args.smoke))
        q_lens = ([int(x) for x in args.decode_q_lens.split(",") if x.strip()]
                  if args.decode_q_lens else list(decode.Q_LENS))
    except (argparse.ArgumentTypeError, ValueError) as e:
        parser.error(str(e))
    if not groups or not q_lens or args.decode_page_size < 1:
        parser.error("--decode needs at least one case and q_len, and a positive page size")
    args.decode_q_lens = q_lens
    stem = report.claim_stem(args.out, "decode", stamp)
    result = {"meta": meta, "complete": False}

    def save(section):
        result["decode"] = section
        return report.write_json(result, args.out, stem)

    section = decode.run_decode(args, groups, decode.decode_impls(explicit_impls), save)
    result["complete"] = not section["skipped"]
    print(f"json: {save(section)}\n")
    print(report.summary_line(meta))
    print(report.format_decode_table(section))
    return result


def run_bench(args, parser, impls, explicit_impls, meta, stamp) -> dict:
    key = jax.random.key(args.seed)
    plan = [(c, impls, jax.random.fold_in(key, i))
            for i, c in enumerate(select_cases(args, parser))]
    if args.variants:
        # XLA materialises S x S logits, hopeless at 32k: only if asked for.
        v_impls = explicit_impls or ["pallas_flash", "cudnn"]
        plan += [(c, v_impls, jax.random.fold_in(key, 1000 + i))
                 for i, c in enumerate(select_variants(args, parser))]

    rows: list[dict] = []
    result = {"meta": meta, "complete": False, "results": rows}
    stem = report.claim_stem(args.out, "bench", stamp)
    for case, case_impls, case_key in plan:
        done = list(rows)

        def save(case_rows, done=done):
            # Rewritten after every timed row, so a run cut short keeps what it measured.
            rows[:] = done + case_rows
            return report.write_json(result, args.out, stem)

        save(run_case(case, case_impls, args, case_key, on_row=save))
    result["complete"] = True
    path = report.write_json(result, args.out, stem)
    png = os.path.join(args.out, f"{stem}.png")
    if args.plot:
        speed_rows = [r for r in rows if r["variant"] is None]
        print(f"plot: {png}" if plot_speed(speed_rows, png)
              else "plot: skipped (matplotlib not importable)")
    print(f"json: {path}\n")
    print(report.summary_line(meta))
    print(report.format_table(rows))
    return result


def main(argv: list[str] | None = None) -> dict:
    """CLI entry point; returns the dict also written as JSON (or the report's summary)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)

    if args._memory_child:
        impl, seq = args._memory_child
        result = memory.memory_child(impl, int(seq), args.dtype, args.memory_heads)
        print(memory.CHILD_MARKER + json.dumps(result), flush=True)
        return result
    if args.report is not None:
        return main_report(args)
    if args.check:
        parser.error("--check goes with --report")
    if sum((args.cold_start, args.memory, args.decode)) > 1:
        parser.error("--cold-start, --memory and --decode are separate runs")
    if args.cold_start_steps < 3:
        parser.error("--cold-start-steps must be at least 3")

    # The children of --cold-start get the environment as it was given.
    env = dict(os.environ)
    if args.cold_start:
        # This process only waits for them: it must not hold the GPU's memory.
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        if args.causal is None:
            args.causal = "yes"
    if args.decode:
        # Each call is a few milliseconds at most: few iterations, many shapes to compile.
        if args.iters is None:
            args.iters = 1 if args.smoke else 10
        if args.decode_page_size is None:
            args.decode_page_size = decode.SMOKE_PAGE_SIZE if args.smoke else decode.PAGE_SIZE
        if args.decode_compile_workers is None:
            args.decode_compile_workers = 8 if jax.default_backend() == "gpu" else 1
    resolve_defaults(args)
    explicit_impls = parse_impls(args.impls, parser)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    meta = metadata(args, argv)
    print(f"device: {meta['gpu']} ({meta['backend']}), jax {meta['jax_version']}", flush=True)
    if args.cold_start:
        impls = explicit_impls or cold_start.default_impls(meta["backend"])
        return run_cold_start(args, parser, impls, meta, stamp, env)
    if args.decode:
        return run_decode(args, parser, explicit_impls, meta, stamp)
    impls = explicit_impls or list(DEFAULT_IMPLS)
    if args.memory:
        return run_memory_sweep(args, impls, meta, stamp)
    return run_bench(args, parser, impls, explicit_impls, meta, stamp)


if __name__ == "__main__":
    main()
