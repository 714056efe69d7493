"""Results: the JSON files a run writes, its text tables, and the Markdown report.

``python -m pallas_flash.bench --report RESULTS.json ...`` turns committed results into
Markdown and rewrites only the marked blocks of the docs, so that no table is edited by hand::

    <!-- bench-report:speed source=benchmarks/results/bench_h200_abc1234.json -->
    ...generated...
    <!-- /bench-report:speed -->

Blocks: ``headline`` (a few shapes, pallas_flash against cuDNN, for README.md), ``speed``
(every row of the benchmark JSONs), ``memory`` (the memory sweep), ``cold-start`` (process
start to the third training step), ``decode`` (decode attention's bandwidth) and
``train-step`` (the Llama-style training step, attention swapped). The opening
marker keeps the files it was generated from, so ``--report`` without files regenerates every
block from the files it names.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

from pallas_flash.bench.cases import PLAIN, seq_label
from pallas_flash.bench.decode import LAYOUTS

_BLOCK_RE = re.compile(r"<!-- bench-report:(?P<name>[a-z-]+)(?P<attrs>[^>]*?)\s*-->\n?"
                       r"(?P<body>.*?)<!-- /bench-report:(?P=name) -->", re.S)
# (case, causal) rows of the headline table, when the results hold them.
HEADLINE_CASES = (
    ("2x8192x16x16x128", False),
    ("2x8192x16x16x128", True),
    ("1x16384x16x16x128", True),
    ("2x8192x32x8x128", False),
    ("2x8192x32x32x64", True),
    ("2x8192x8x8x256", True),
)
_IMPL_ORDER = {"pallas_flash": 0, "pallas_flash_mosaic": 1, "pallas_flash_triton": 2,
               PLAIN: 3, "cudnn": 4, "xla": 5}

# --------------------------------------------------------------------------
# JSON files
# --------------------------------------------------------------------------


def git_commit() -> str | None:
    """HEAD of the checkout this module lives in, '+dirty' if modified."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def summary_line(meta: dict) -> str:
    return (f"{meta['gpu']} ({meta['backend']}), jax {meta['jax_version']}, "
            f"commit {meta['git_commit']}, {meta['date_utc']}, {meta['dtype']}")


# --------------------------------------------------------------------------
# Text tables (printed at the end of a run)
# --------------------------------------------------------------------------

def _fmt(x, spec=".1f", none="-") -> str:
    return none if x is None else format(x, spec)


def fmt_seconds(x: float | None) -> str:
    """'11.86 s' from a second up, '2.614 ms' below."""
    if x is None:
        return "–"
    return f"{x:.2f} s" if x >= 1 else f"{x * 1e3:.3f} ms"


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


_CACHE_ORDER = {"none": 0, "fill": 1, "warm": 2}


def _cold_rows(section: dict) -> list[dict]:
    """Runs by case, then implementation (ours first), then cache setting."""
    cases = list(dict.fromkeys((r["case"], r["causal"]) for r in section["runs"]))
    return sorted(section["runs"], key=lambda r: (
        cases.index((r["case"], r["causal"])), _IMPL_ORDER.get(r["impl"], 9), r["impl"],
        _CACHE_ORDER.get(r["cache"], 9)))


def _cold_cells(r: dict, baseline: str | None) -> list[str]:
    """start -> 3rd, minus the baseline, steps 1, 2, 3 and N, steps 2 and 3 over step N."""
    diff = r.get("minus_baseline_s")
    return ([fmt_seconds(r.get("start_to_third_s")),
             "–" if diff is None or r["impl"] == baseline else f"{diff:+.2f} s"]
            + [fmt_seconds(r.get(f"step{i}_s")) for i in ("1", "2", "3", "N")]
            + [_fmt(r.get(f"step{i}_over_stepN"), ".2f", "–") for i in ("2", "3")])


def format_cold_start_table(section: dict) -> str:
    n, base = section["steps"], section["baseline"] or "-"
    head = (f"{'case':<22} {'causal':<6} {'impl':<20} {'cache':<5} {'start->3rd':>10} "
            f"{'-' + base:>9} {'step 1':>10} {'step 2':>10} {'step 3':>10} "
            f"{f'step {n}':>10} {f'2/{n}':>5} {f'3/{n}':>5}")
    lines = [head, "-" * len(head)]
    for r in _cold_rows(section):
        left = f"{r['case']:<22} {str(r['causal']):<6} {r['impl']:<20} {r['cache']:<5}"
        if r["status"] != "ok":
            lines.append(f"{left} {r['status']}: {r.get('error')}")
            continue
        c = _cold_cells(r, section["baseline"])
        lines.append(f"{left} {c[0]:>10} {c[1]:>9} {c[2]:>10} {c[3]:>10} {c[4]:>10} "
                     f"{c[5]:>10} {c[6]:>5} {c[7]:>5}")
    lines.append(f"start->3rd: {section['clock']}; -{base}: minus {base}'s, same cache; "
                 "cache: none (off), fill (empty folder, filled by this run), warm (filled)")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------

def _cell(text) -> str:
    return str(text).replace("|", "\\|")


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def _source_line(path: str, meta: dict, with_timer: bool, complete: bool = True) -> str:
    commit = meta.get("git_commit") or "unknown"
    text = (f"`{path}`: {meta.get('gpu')}, jax {meta.get('jax_version')}, "
            f"{meta.get('dtype')}, commit `{commit}`")
    if with_timer:
        fwd, bwd = meta.get("iters_fwd"), meta.get("iters_fwdbwd")
        if meta.get("timer") == "pipelined":
            text += (f", pipelined timer (median of 3 batches of {fwd} forward / {bwd} "
                     "backward calls)")
        else:
            text += f", per-call timer (median of {fwd} forward / {bwd} backward calls)"
        if meta.get("warm_s"):
            text += f", each pass timed after {meta['warm_s']:g} s of back-to-back calls"
    if not complete:
        text += "; cut by its time limit, the case it stopped in left out"
    return text + "."


def _shape_label(r: dict) -> str:
    heads = (f"{r['q_heads']} heads" if r["q_heads"] == r["kv_heads"]
             else f"{r['q_heads']} q / {r['kv_heads']} kv heads")
    return f"{r['batch']} × {r['seq']}, {heads}, d {r['head_dim']}"


def _mask(r: dict) -> str:
    return "causal" if r["causal"] else "full"


def _grouped(rows: list[dict]) -> list[dict]:
    """Rows grouped by (case, causal) in first-seen order, our rows before the baselines."""
    groups = list(dict.fromkeys((r["case"], r["causal"]) for r in rows))
    return sorted(rows, key=lambda r: (groups.index((r["case"], r["causal"])),
                                       _IMPL_ORDER.get(r["impl"], 9), r["impl"]))


def markdown_headline(sources: list[tuple[str, dict]]) -> str:
    rows = [r for _, data in sources for r in data["results"]]
    by_key = {(r["case"], r["causal"], r["impl"]): r for r in rows}
    keys = [k for k in HEADLINE_CASES if (*k, "pallas_flash") in by_key]
    if not keys:  # results of other shapes: every plain case
        keys = list(dict.fromkeys((r["case"], r["causal"]) for r in rows if not r["variant"]))
    table = []
    for case, causal in keys:
        ours = by_key.get((case, causal, "pallas_flash"), {})
        base = by_key.get((case, causal, "cudnn"), {})
        if not ours:
            continue
        cells = [_shape_label(ours), _mask(ours)]
        for p in ("fwd", "bwd"):
            cells += [f"{_fmt(ours.get(f'{p}_tflops'), '.0f')} / "
                      f"{_fmt(base.get(f'{p}_tflops'), '.0f')}",
                      _fmt(ours.get(f"{p}_vs_cudnn"), ".2f")]
        table.append(cells)
    lines = _table(["shape (batch × seq, heads, head_dim)", "mask",
                    "forward TFLOP/s, ours / cuDNN", "× cuDNN",
                    "backward TFLOP/s, ours / cuDNN", "× cuDNN"], table)
    files = ", ".join(f"`{path}`" for path, _ in sources)
    lines += ["", f"× cuDNN: cuDNN's time over ours (above 1: faster). From {files}."]
    return "\n".join(lines) + "\n"


def _latest(rows: list[dict]) -> list[dict]:
    """One row per (case, mask, implementation, variant, dtype): a case measured again in a
    later file replaces the earlier measurement, in the earlier one's place."""
    keyed = {}
    for r in rows:
        keyed[(*_case_key(r), r["impl"])] = r
    return list(keyed.values())


def _case_key(r: dict) -> tuple:
    """A measured case: shape, mask, variant and dtype (every implementation's row of it)."""
    return r["case"], r["causal"], r.get("variant"), r.get("dtype")


def _case_label(r: dict) -> str:
    """The case as the table shows it, with its dtype where it is not bf16."""
    label = r["case"].replace("x", " × ")
    dtype = r.get("dtype")
    return label if dtype in (None, "bf16") else f"{label} ({dtype})"


# What the speed table is read against: the least ratio of cuDNN's time to ours that meets each
# pass's target; tokamax's times are a target too, where it ran beside our row.
SPEED_TARGETS = {"fwd": 1.05, "bwd": 1.00}


def _row_key(r: dict) -> tuple:
    return r["case"], r["causal"], r.get("dtype")


def _ours(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["impl"] == "pallas_flash" and not r.get("variant")]


def _tokamax_beside(sources: list[tuple[str, dict]], latest: dict) -> dict:
    """tokamax's row for each of our `latest` rows (by _row_key) that it ran in the same run."""
    beside = {}
    for _, data in sources:
        ours_here = {_row_key(r): r for r in _ours(data["results"])}
        for r in data["results"]:
            key = _row_key(r)
            if (r["impl"] == "tokamax" and r["status"] == "ok" and key in latest
                    and ours_here.get(key) is latest[key]):
                beside[key] = r
    return beside


def _speed_targets(rows: list[dict], sources: list[tuple[str, dict]]) -> list[str]:
    """One line per target: how many of our plain rows meet it, and which fall short."""
    ours = [r for r in _ours(rows) if r["status"] == "ok"]
    if not ours:
        return []

    def label(r):
        return f"{_case_label(r)} {_mask(r)}"

    lines = []
    for p, least in SPEED_TARGETS.items():
        ratios = [(r, r[f"{p}_vs_cudnn"]) for r in ours if r.get(f"{p}_vs_cudnn") is not None]
        short = [f"{label(r)} ({x:.3f}×)" for r, x in ratios if x < least]
        lines.append(f"- pallas_flash's {'forward' if p == 'fwd' else 'backward'} at least "
                     f"{least:.2f}× cuDNN: {len(ratios) - len(short)} of {len(ratios)} rows"
                     + (f"; short: {', '.join(short)}" if short else ""))
    tokamax = _tokamax_beside(sources, {_row_key(r): r for r in ours})
    if not tokamax:
        return lines
    short = []
    for r in ours:    # the table's order
        t = tokamax.get(_row_key(r))
        if t is None:
            continue
        slower = [f"{p} {t[f'{p}_ms'] / r[f'{p}_ms']:.3f}×" for p in ("fwd", "bwd")
                  if r.get(f"{p}_ms") and t.get(f"{p}_ms") and r[f"{p}_ms"] > t[f"{p}_ms"]]
        if slower:
            short.append(f"{label(r)} ({', '.join(slower)})")
    lines.append(f"- pallas_flash at least as fast as tokamax in both passes, measured in the "
                 f"same run: {len(tokamax) - len(short)} of {len(tokamax)} rows"
                 + (f"; short (tokamax's time over ours): {', '.join(short)}" if short else ""))
    return lines


def markdown_speed(sources: list[tuple[str, dict]]) -> str:
    rows = _grouped(_latest([r for _, data in sources for r in data["results"]]))
    variants = any(r.get("fwd_vs_plain") for r in rows if r["impl"] != PLAIN)
    header = ["case", "mask", "implementation", "forward ms", "forward TFLOP/s",
              "backward ms", "backward TFLOP/s", "forward × cuDNN", "backward × cuDNN"]
    header += ["× plain, fwd / bwd"] if variants else []
    header += ["error vs f32"]
    table = []
    for r in rows:
        cells = [_case_label(r), _mask(r), r["impl"]]
        if r["status"] in ("error", "n.a."):
            cells += [f"{r['status']}: {r['error']}"] + ["–"] * (len(header) - 4)
            table.append(cells)
            continue
        cells += [_fmt(r.get("fwd_ms"), ".3f", "–"), _fmt(r.get("fwd_tflops"), ".1f", "–"),
                  _fmt(r.get("bwd_ms"), ".3f", "–"), _fmt(r.get("bwd_tflops"), ".1f", "–"),
                  _fmt(r.get("fwd_vs_cudnn"), ".2f", "–"), _fmt(r.get("bwd_vs_cudnn"), ".2f", "–")]
        if variants:
            plain = r.get("fwd_vs_plain") if r["impl"] != PLAIN else None
            cells.append("–" if plain is None else
                         f"{plain:.2f} / {_fmt(r.get('bwd_vs_plain'), '.2f', '–')}")
        cells.append(_fmt(r.get("err_vs_ref"), ".1e", "–"))
        if r["status"] == "bwd error":
            cells[5] = f"bwd error: {r['error']}"
        table.append(cells)
    lines = ["Source: " + _source_line(path, data["meta"], True, data.get("complete", True))
             for path, data in sources]
    lines += ["", "Case: batch × seq × q heads × kv heads × head_dim (× V's head_dim where it "
              "differs). × cuDNN: cuDNN's time "
              "over this row's (above 1: faster). Error: ‖out − ref‖ / ‖ref‖ of the forward "
              "output against a float32 reference on sampled query rows.", ""]
    targets = [] if variants else _speed_targets(rows, sources)
    return "\n".join(lines + _table(header, table) + ([""] + targets if targets else [])) + "\n"


def _memory_cell(p: dict | None) -> str:
    if p is None or p["status"] == "skipped":
        return "–"
    if p["status"] == "ok" and p.get("peak_bytes"):
        return f"{p['peak_bytes'] / 2**30:.2f} ({p['peak_over_floor']:.2f}×)"
    error = p.get("error") or p["status"]
    return "out of memory" if error.startswith("OOM") else error.split(":")[0]


def markdown_memory(sources: list[tuple[str, dict]]) -> str:
    lines = []
    for path, data in sources:
        memory = data["memory"]
        points = memory["points"]
        seqs = sorted({p["seq"] for p in points})
        impls = list(dict.fromkeys(p["impl"] for p in points))
        at = {(p["impl"], p["seq"]): p for p in points}
        floor = {p["seq"]: p["floor_bytes"] for p in points}
        shape = memory["shape"]
        lines += [f"Source: {_source_line(path, data['meta'], False)}",
                  "", f"Peak GiB of one forward+backward step (× the floor), batch "
                  f"{shape['batch']}, {shape['q_heads']} heads, head_dim {shape['head_dim']}, "
                  f"{'causal' if shape['causal'] else 'full'}, {shape['dtype']}; a fresh "
                  "process per point. The floor is q, k, v, O, dO, dQ, dK and dV.", ""]
        table = [["floor"] + [f"{floor[s] / 2**30:.2f}" for s in seqs] + ["–"]]
        for impl in impls:
            longest = memory["longest_seq_ok"].get(impl)
            table.append([impl] + [_memory_cell(at.get((impl, s))) for s in seqs]
                         + [seq_label(longest) if longest else "none"])
        lines += _table(["implementation"] + [seq_label(s) for s in seqs]
                        + ["longest that ran"], table)
        steps = [f"{impl} {at[(impl, s)]['step_s']:.1f} s at {seq_label(s)}"
                 for impl in impls for s in [memory["longest_seq_ok"].get(impl)]
                 if s and at[(impl, s)].get("step_s")]
        if steps:
            lines += ["", "One step at the longest length that ran: " + ", ".join(steps) + "."]
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


_CACHE_LABEL = {"none": "off", "fill": "empty", "warm": "warm"}


def _not_measured(sources: list[tuple[str, dict]], key: str, what: str) -> str | None:
    """The body of a block whose files hold no `key` section; None when one does."""
    if any(key in data for _, data in sources):
        return None
    files = ", ".join(f"`{path}`" for path, _ in sources)
    return f"Not measured yet: {files} holds no {what} run.\n"


def _allocator_note(section: dict) -> str:
    """How the children's device allocator was set (cold_start.py says why it matters)."""
    if (section.get("env") or {}).get("XLA_PYTHON_CLIENT_PREALLOCATE") == "false":
        return ("Allocator: grown on demand (XLA_PYTHON_CLIENT_PREALLOCATE=false), so the "
                "first steps also pay its growth.")
    return "Allocator: JAX's default, most of the memory reserved at start."


def markdown_cold_start(sources: list[tuple[str, dict]]) -> str:
    if (empty := _not_measured(sources, "cold_start", "cold-start")) is not None:
        return empty
    measured = [(path, data) for path, data in sources if "cold_start" in data]
    lines = []
    for path, data in measured:
        section = data["cold_start"]
        rows = _cold_rows(section)
        n, base = section["steps"], section["baseline"]
        cases = list(dict.fromkeys((r["case"], r["causal"]) for r in rows))
        one_case = len(cases) == 1
        what = (f"case {cases[0][0].replace('x', ' × ')}, "
                f"{'causal' if cases[0][1] else 'full'}, " if one_case else "")
        lines += [f"Source: {_source_line(path, data['meta'], False)}", "",
                  f"One jitted forward+backward step, {what}{section['dtype']}, called {n} "
                  "times in a fresh process per row. Start → 3rd step: from the benchmark's "
                  "clock just before it starts the process to the end of the third step. "
                  "Cache: JAX's persistent compilation cache off; on, in an empty folder that "
                  "the run fills; warm, filled by the run above"
                  + (f"; − {base}: start → 3rd step minus {base}'s, same cache." if base
                     else ".") + " " + _allocator_note(section), ""]
        header = ([] if one_case else ["case", "mask"]) + [
            "implementation", "cache", "start → 3rd step"] + (
            [f"− {base}"] if base else []) + [
            "step 1", "step 2", "step 3", f"step {n}", f"step 2 / step {n}",
            f"step 3 / step {n}"]
        table = []
        for r in rows:
            cells = ([] if one_case else [r["case"].replace("x", " × "),
                                          "causal" if r["causal"] else "full"])
            cells += [r["impl"], _CACHE_LABEL.get(r["cache"], r["cache"])]
            if r["status"] != "ok":
                table.append(cells + [f"{r['status']}: {r.get('error')}"]
                             + ["–"] * (len(header) - len(cells) - 1))
                continue
            c = _cold_cells(r, base)
            table.append(cells + c[:1] + (c[1:2] if base else []) + c[2:])
        lines += _table(header, table) + [""]
    return "\n".join(lines).rstrip("\n") + "\n"


# --------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------

_DECODE_LABEL = {"xla": "XLA", "cudnn": "cuDNN", "tokamax": "tokamax"}
# A decode row's wall-clock time over its GPU time above which the report says the host set
# the pace.
HOST_BOUND = 1.1
# Targets of the decode kernels, as (label, predicate on our contiguous/paged row, threshold).
_DECODE_TARGETS = (
    ("at least 80% of the copy bandwidth at contexts of 16k and more",
     lambda r: r["context"] >= 16384, 0.80),
    ("at least 60% of the copy bandwidth at batch 1 with a 4k context",
     lambda r: r["batch"] == 1 and r["context"] == 4096, 0.60),
)


def _us(r: dict | None) -> str:
    if r is None:
        return "–"
    return f"{r['ms'] * 1e3:.1f}" if r["status"] == "ok" else r["status"]


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def decode_table(section: dict) -> tuple[list[str], list[list[str]], list[str]]:
    """(header, one row per case, notes) of a decode run: pallas_flash on the contiguous and the
    paged cache, then every other implementation's time on the contiguous cache; the notes give
    the failures and how many cases meet each target."""
    rows = section["rows"]
    at = {(r["q_heads"], r["kv_heads"], r["q_len"], r["batch"], r["context"], r["layout"],
           r["impl"]): r for r in rows}
    cases = sorted(dict.fromkeys((r["q_heads"], r["kv_heads"], r["q_len"], r["batch"],
                                  r["context"]) for r in rows))
    others = sorted({r["impl"] for r in rows} - {"pallas_flash"},
                    key=lambda n: (_IMPL_ORDER.get(n, 9), n))
    comparators = [n for n in others if not n.startswith("pallas_flash")]
    header = (["GQA", "q_len", "batch", "context", "µs", "% of copy", "paged µs",
               "paged % of copy", "paged / contiguous"]
              + [f"{_DECODE_LABEL.get(n, n)} µs" for n in others] + ["× fastest other"])
    table, faster = [], []
    for case in cases:
        ours, paged = (at.get((*case, layout, "pallas_flash")) for layout in LAYOUTS)
        mine = ours["ms"] if ours and ours["status"] == "ok" else None
        ran = [r["ms"] for n in comparators
               if (r := at.get((*case, "contiguous", n))) and r["status"] == "ok"]
        if mine and ran:
            faster.append(min(ran) > mine)
        table.append([f"{case[0]}:{case[1]}", str(case[2]), str(case[3]), seq_label(case[4]),
                      _us(ours), _pct(ours and ours.get("frac_of_copy")), _us(paged),
                      _pct(paged and paged.get("frac_of_copy")),
                      _fmt(paged and paged.get("paged_over_contiguous"), ".2f", "–")]
                     + [_us(at.get((*case, "contiguous", n))) for n in others]
                     + [f"{min(ran) / mine:.2f}" if mine and ran else "–"])
    notes = []
    for name in ("pallas_flash", *others):
        bad = [r for r in rows if r["impl"] == name and r["status"] != "ok"]
        for status in dict.fromkeys(r["status"] for r in bad):
            errors = list(dict.fromkeys(r["error"] for r in bad if r["status"] == status))
            notes.append(f"{_DECODE_LABEL.get(name, name)}: {status} in "
                         f"{sum(r['status'] == status for r in bad)} cases: "
                         + "; ".join(errors[:2]) + (" (and others)" if len(errors) > 2 else ""))
    ours_by_layout = {layout: [r for r in rows if r["impl"] == "pallas_flash"
                               and r["layout"] == layout] for layout in LAYOUTS}
    for label, where, floor in _DECODE_TARGETS:
        counts = []
        for layout, mine in ours_by_layout.items():
            hit = [r for r in mine if where(r)]
            if hit:
                met = sum((r.get("frac_of_copy") or 0) >= floor for r in hit)
                counts.append(f"{layout} {met} of {len(hit)}")
        if counts:
            notes.append(f"pallas_flash {label}: " + ", ".join(counts) + " cases")
    if faster:
        notes.append(f"pallas_flash faster than every comparator that ran: "
                     f"{sum(faster)} of {len(faster)} contiguous cases")
    if ours_by_layout["paged"]:
        paged = ours_by_layout["paged"]
        within = sum((r.get("paged_over_contiguous") or 9) <= 1.05 for r in paged)
        notes.append(f"pallas_flash paged within 5% of contiguous: {within} of {len(paged)} "
                     "cases")
    host = [r for r in ours_by_layout["contiguous"] if r.get("timer") == "gpu"
            and r["status"] == "ok" and r["wall_ms"] > HOST_BOUND * r["ms"]]
    if host:
        notes.append(f"pallas_flash's wall-clock time above {HOST_BOUND}× its GPU time (time "
                     "outside its kernels: the host's dispatch, the programs' launches) in "
                     + ", ".join(f"{r['q_heads']}:{r['kv_heads']} {r['batch']} × "
                                 f"{seq_label(r['context'])} q_len {r['q_len']} "
                                 f"({r['wall_ms'] * 1e3:.1f} against {r['ms'] * 1e3:.1f} µs)"
                                 for r in host))
    if section.get("skipped"):
        notes.append(f"not run (time budget): {len(section['skipped'])} cache shapes, from "
                     + ", ".join(f"{g['batch']} × {seq_label(g['context'])}"
                                 for g in section["skipped"][:3])
                     + (" …" if len(section["skipped"]) > 3 else ""))
    return header, table, notes


def _copy_line(section: dict) -> str:
    copy = section["copy"]
    return (f"copy bandwidth {copy['gbps']:.0f} GB/s ({copy['what']}, "
            f"{copy['bytes'] / 2**30:.2f} GiB moved in {copy['ms']:.3f} ms)")


def format_decode_table(section: dict) -> str:
    header, table, notes = decode_table(section)
    widths = [max(len(c) for c in col) for col in zip(header, *table)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in [header, *table]]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join([_copy_line(section), *lines, *notes])


def markdown_decode(sources: list[tuple[str, dict]]) -> str:
    if (empty := _not_measured(sources, "decode", "decode")) is not None:
        return empty
    lines = []
    for path, data in [(p, d) for p, d in sources if "decode" in d]:
        section, meta = data["decode"], data["meta"]
        header, table, notes = decode_table(section)
        timer = ("pipelined timer (median of 3 batches of {} programs)" if meta.get("timer")
                 == "pipelined" else "per-program timer (median of {} programs)").format(
                     meta.get("iters"))
        lines += [f"Source: {_source_line(path, meta, False)[:-1]}, {timer}.", "",
                  f"Measured in the same run: {_copy_line(section)}. Every sequence holds its "
                  "whole context (kv_lengths = context); its q_len newest tokens attend "
                  "bottom-right. µs: one call, timed in programs of up to 64 chained calls "
                  "over copies of the cache that outgrow the L2 cache"
                  + ("; the smaller of the wall clock's time and the GPU's, read from a "
                     "profiler trace (the span of a program's kernels over its calls, median "
                     "of 3 programs): each bounds the GPU's own time from above, the wall clock "
                     "where the host's dispatch sets the pace (at batch 1 and short contexts), "
                     "the trace by the profiler's overhead"
                     if any(r.get("timer") == "gpu" for r in section["rows"])
                     else "; wall-clock time, which at batch 1 and short contexts can be the "
                     "host's dispatch of the program rather than the GPU's run of it")
                  + ". % of copy: the K/V bytes "
                  "read (batch · context · kv heads · head_dim · 2 tensors · bytes per element) "
                  "over the time, against the copy bandwidth. Paged: pages of "
                  f"{section['page_size']} keys in a shuffled "
                  "order. × fastest other: the fastest other implementation's time on the "
                  "contiguous cache over ours (above 1: ours is faster).", ""]
        lines += _table(header, table) + [""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines).rstrip("\n") + "\n"


def markdown_train_step(sources: list[tuple[str, dict]]) -> str:
    # Imported here: train_step.py imports this module for its table helpers.
    from pallas_flash.bench import train_step
    return train_step.markdown_train_step(sources)


# block -> (the kind of results it renders, renderer)
_RENDER = {"headline": ("bench", markdown_headline), "speed": ("bench", markdown_speed),
           "memory": ("memory", markdown_memory), "cold-start": ("cold_start", markdown_cold_start),
           "decode": ("decode", markdown_decode), "train-step": ("train_step", markdown_train_step)}
# Blocks that may cite files of another kind, and say "not measured yet" for them.
_ANY_SOURCE = {"cold-start", "decode", "train-step"}


# --------------------------------------------------------------------------
# Blocks in Markdown files
# --------------------------------------------------------------------------

# kind of results -> its key in a results JSON
_KINDS = {"bench": "results", "memory": "memory", "cold_start": "cold_start",
          "decode": "decode", "train_step": "train_step"}


def load_result(path: str) -> tuple[list[str], dict]:
    """(kinds, data) of a results JSON; the kinds it holds of 'bench' (benchmark rows), 'memory'
    (a sweep), 'cold_start' and 'decode'."""
    with open(path) as f:
        data = json.load(f)
    if "results" in data and data.get("complete") is False:
        data["results"] = _finished_cases(data["results"])
    kinds = [kind for kind, key in _KINDS.items() if key in data]
    if not kinds:
        raise ValueError(f"{path}: no benchmark rows, memory sweep, cold start, decode or "
                         f"training-step run")
    return kinds, data


def _finished_cases(rows: list[dict]) -> list[dict]:
    """The rows of a run cut short by its time limit, less those of a case it stopped in before
    our row: alone, its cuDNN row would replace an earlier file's and stand beside our row of
    another run (`_latest`)."""
    ours = {_case_key(r) for r in rows if r["impl"] == "pallas_flash"}
    return [r for r in rows if _case_key(r) in ours]


def _sources_of(attrs: str) -> list[str]:
    m = re.search(r"source=(\S+)", attrs)
    return m.group(1).split(",") if m else []


def rewrite_blocks(text: str, sources: dict[str, list[str]], root: str,
                   cache: dict | None = None) -> tuple[str, list[str]]:
    """`text` with every bench-report block regenerated, and one message per block.

    `sources` maps a kind ('bench', 'memory', 'cold_start') to the results files to use; a
    kind it lacks falls back on the files the block's own marker names."""
    cache = {} if cache is None else cache
    notes = []

    def load(path):
        if path not in cache:
            cache[path] = load_result(os.path.join(root, path))
        return cache[path]

    def replace(m):
        name = m.group("name")
        if name not in _RENDER:
            notes.append(f"unknown block {name!r}: left as it is")
            return m.group(0)
        kind, render = _RENDER[name]
        paths = sources.get(kind) or _sources_of(m.group("attrs"))
        if not paths:
            notes.append(f"{name}: no {kind} results given or named: left as it is")
            return m.group(0)
        loaded = [(p, load(p)) for p in paths]
        wrong = [p for p, (kinds, _) in loaded if kind not in kinds]
        if wrong and name not in _ANY_SOURCE:
            raise ValueError(f"block {name} needs {kind} results, not {wrong}")
        body = render([(p, data) for p, (_, data) in loaded])
        notes.append(f"{name}: from {', '.join(paths)}")
        return (f"<!-- bench-report:{name} source={','.join(paths)} -->\n{body}"
                f"<!-- /bench-report:{name} -->")

    return _BLOCK_RE.sub(replace, text), notes


def run_report(files: list[str], docs: str = "docs", readme: str = "README.md",
               check: bool = False, plot: bool = True, root: str = ".") -> dict:
    """Regenerates the blocks of docs/performance.md and README.md (and, unless `check`, the
    plots in `docs`). Returns {"changed": [...], "notes": [...], "plots": [...]}; with `check`
    nothing is written and "changed" lists the files whose blocks are out of date."""
    sources: dict[str, list[str]] = {}
    cache: dict[str, tuple[list[str], dict]] = {}
    for path in files:
        rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
        rel = path if rel.startswith("..") else rel
        kinds, data = load_result(os.path.join(root, rel))
        cache[rel] = (kinds, data)
        for kind in kinds:
            sources.setdefault(kind, []).append(rel)
    changed, notes = [], []
    for target in (os.path.join(docs, "performance.md"), readme):
        full = os.path.join(root, target)
        if not os.path.exists(full):
            notes.append(f"{target}: not found, skipped")
            continue
        with open(full) as f:
            text = f.read()
        if not _BLOCK_RE.search(text):
            notes.append(f"{target}: no bench-report block, skipped")
            continue
        new, block_notes = rewrite_blocks(text, sources, root, cache)
        notes += [f"{target}: {n}" for n in block_notes]
        if new != text:
            changed.append(target)
            if not check:
                with open(full, "w") as f:
                    f.write(new)
    plots = []
    if plot and not check:
        plots = _write_plots(cache, os.path.join(root, docs))
    return {"changed": changed, "notes": notes, "plots": plots}


def _write_plots(cache: dict, docs_dir: str) -> list[str]:
    from pallas_flash.bench.plots import plot_cases, plot_memory
    written = []
    bench_rows = [r for kinds, data in cache.values() if "bench" in kinds
                  for r in data["results"] if not r["variant"]]
    path = os.path.join(docs_dir, "performance_speed.png")
    if bench_rows and plot_cases(bench_rows, path):
        written.append(path)
    sweeps = [data["memory"] for kinds, data in cache.values() if "memory" in kinds]
    path = os.path.join(docs_dir, "performance_memory.png")
    if sweeps and plot_memory({"points": [p for m in sweeps for p in m["points"]]}, path):
        written.append(path)
    return written
