"""Tests of benchmarks/sass_summary.py on a hand-written source page: two kernels, a loop whose
instructions share an execution count, predicated and dotted opcodes."""

from __future__ import annotations

import gzip
from pathlib import Path

from helpers import example_module

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sass_summary.py"
_HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)",'
           '"Warp Stall Sampling (Not-issued Samples)","# Samples","Instructions Executed"')


def _page(kernels):
    lines = []
    for name, rows in kernels:
        lines += [f'"Kernel Name","{name}",', _HEADER]
        lines += [f'"0x{i:x}","{src}","{samples}","0","0","{executed}"'
                  for i, (src, samples, executed) in enumerate(rows)]
    return "\n".join(lines) + "\n"


def test_summary_splits_by_opcode_and_finds_the_loop(tmp_path, capsys):
    loop = [("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2", 1, 64),
            ("@!P0  BRA 0x10", 30, 64),
            ("HGMMA.64x32x16.F32.BF16 R24, gdesc[UR4], R24", 2, 64),
            ("BAR.SYNC.DEFER_BLOCKING R21, 0x80", 5, 64),
            ("FMNMX.NAN R1, R2, R3, !PT", 3, 64)]
    prologue = [("LDC R1, c[0x0][0x28]", 1, 4), ("EXIT", 0, 4)]
    path = tmp_path / "source.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write(_page([("first_kernel", prologue + loop), ("second_kernel", prologue)]))
    with example_module(_SCRIPT, "sass_summary_script") as ss:
        kernels = ss.read_kernels(str(path))
        assert [name for name, _ in kernels] == ["first_kernel", "second_kernel"]
        assert [len(rows) for _, rows in kernels] == [7, 2]
        assert ss.opcode("@!P0  BRA 0x10") == "BRA"
        assert ss.opcode("HGMMA.64x32x16.F32.BF16 R24") == "HGMMA"
        ss.main([str(path), "--kernel", "0", "--loop-lines", "10"])
    out = capsys.readouterr().out
    assert "first_kernel: 7 SASS instructions, 328 warp instructions executed, 42 stall samples" \
        in out
    assert "second_kernel" not in out
    # The loop (64 executions each) is the hottest group, with its one barrier.
    assert "executed        64 times:     5 instructions,     41 samples, 1 BAR.SYNC" in out
    bra = next(line for line in out.splitlines() if line.strip().startswith("BRA "))
    assert bra.split()[1:3] == ["64", "19.5%"] and bra.split()[3] == "30"
    assert out.rstrip().endswith("FMNMX.NAN R1, R2, R3, !PT")
