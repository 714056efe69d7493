"""A kernel's SASS, summarised from Nsight Compute's source page: where its instructions and its
warps' stall samples go.

    ncu --section SourceCounters -o REPORT COMMAND...
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass | gzip > source.csv.gz
    python3 benchmarks/sass_summary.py source.csv.gz [--kernel N] [--loop-lines 400]

(`SOURCE=1 bash benchmarks/gpu.sh profile ...` runs all three.) For each profiled kernel it
prints the warp instructions executed and the stall samples, both split by opcode, then the
instruction groups that share an execution count (a loop body runs each of its instructions
equally often) in order of their samples, and the hottest group's instructions in address
order. That group is usually the kernel's main loop, and its instruction count per trip is the
figure to compare between two versions of a kernel.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io

EXECUTED = "Instructions Executed"
SAMPLES = "Warp Stall Sampling (All Samples)"


def read_kernels(path: str) -> list[tuple[str, list[dict]]]:
    """[(kernel name, [one dict per SASS instruction, keyed by the CSV's header])]."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(io.StringIO(f.read())))
    kernels, header = [], None
    for row in rows:
        if not row:
            continue
        if row[0] == "Kernel Name":
            kernels.append((row[1], []))
            header = None
        elif row[0] == "Address":
            header = row
        elif header is not None and kernels:
            kernels[-1][1].append(dict(zip(header, row)))
    return kernels


def opcode(source: str) -> str:
    """'@!P0 BRA 0x...' -> 'BRA'; 'HGMMA.64x32x16.F32.BF16 ...' -> 'HGMMA'."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0].rstrip(";") if words else "?"


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return 0


def summarise(name: str, instructions: list[dict], loop_lines: int, top: int = 24) -> str:
    executed = [_int(i.get(EXECUTED, "0")) for i in instructions]
    samples = [_int(i.get(SAMPLES, "0")) for i in instructions]
    total, sampled = sum(executed), sum(samples) or 1
    lines = [f"{name}: {len(instructions)} SASS instructions, {total:,} warp instructions "
             f"executed, {sum(samples):,} stall samples"]
    by_op, samples_by_op = collections.Counter(), collections.Counter()
    for ins, n, s in zip(instructions, executed, samples):
        op = opcode(ins.get("Source", ""))
        by_op[op] += n
        samples_by_op[op] += s
    lines.append(f"  {'opcode':<12}{'executed':>12}{'share':>8}{'samples':>9}{'share':>8}")
    for op, n in by_op.most_common(top):
        lines.append(f"  {op:<12}{n:>12,}{n / (total or 1):>8.1%}{samples_by_op[op]:>9,}"
                     f"{samples_by_op[op] / sampled:>8.1%}")
    groups = collections.defaultdict(list)
    for index, n in enumerate(executed):
        if n:
            groups[n].append(index)
    ranked = sorted(groups, key=lambda n: -sum(samples[i] for i in groups[n]))
    lines.append("  groups by execution count (instructions, samples, barriers):")
    for n in ranked[:6]:
        members = groups[n]
        bars = sum("BAR.SYNC" in instructions[i].get("Source", "") for i in members)
        lines.append(f"    executed {n:>9,} times: {len(members):>5} instructions, "
                     f"{sum(samples[i] for i in members):>6,} samples, {bars} BAR.SYNC")
    if ranked and loop_lines:
        hottest = groups[ranked[0]]
        lines.append(f"  the hottest group, in address order ({len(hottest)} instructions; "
                     "samples, source):")
        for i in hottest[:loop_lines]:
            lines.append(f"    {samples[i]:>5}  {instructions[i].get('Source', '').strip()}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output (.gz ok)")
    parser.add_argument("--kernel", type=int, action="append",
                        help="the index of a profiled kernel to print (default: every one)")
    parser.add_argument("--loop-lines", type=int, default=0,
                        help="instructions of the hottest group to print (default: none)")
    args = parser.parse_args(argv)
    kernels = read_kernels(args.csv)
    for index, (name, instructions) in enumerate(kernels):
        if args.kernel is None or index in args.kernel:
            print(f"[{index}] " + summarise(name, instructions, args.loop_lines))


if __name__ == "__main__":
    main()
