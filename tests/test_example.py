"""End-to-end test of examples/train_lm.py: train a tiny LM on flash attention in-process.

On CPU the kernels run in Pallas interpret mode, so the run is kept tiny (20 steps of 4 x 64
tokens; compiling the train step dominates). It still covers the forward and both backward
kernels, GQA, jit, scan over layers, and the comparison against reference_attention. One
more short run goes through the script's command line in a subprocess.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import example_module

_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_lm.py"


@pytest.fixture(scope="module")
def train_lm():
    with example_module(_EXAMPLE, "train_lm_example") as module:
        yield module


def test_tiny_run_learns_and_matches_reference(train_lm):
    result = train_lm.main([
        "--preset", "tiny", "--steps", "20", "--seq", "64", "--batch", "4",
        "--check-steps", "3", "--seed", "0", "--no-progress", "--log-every", "0",
    ])
    losses = result["losses"]
    assert len(losses) == 20
    assert all(math.isfinite(x) for x in losses), losses
    # The first loss sits near ln(vocab); the Markov structure is learnable within a few
    # steps, so demand a clear drop rather than any decrease at all.
    assert losses[0] == pytest.approx(math.log(result["config"]["vocab"]), abs=0.2)
    assert losses[-1] < losses[0] - 0.5, losses
    assert result["check"] is not None
    assert len(result["check"]["ref_losses"]) == 3
    assert result["check_passed"] is True, result["check"]
    assert result["ok"] is True


def test_synthetic_data_is_deterministic_and_structured(train_lm):
    cfg = train_lm.build_config(train_lm.parse_args(["--preset", "tiny", "--seq", "32"]))
    data = train_lm.SyntheticData(cfg)
    first, again, other = data.batch(0), data.batch(0), data.batch(1)
    assert first.shape == (cfg.batch, cfg.seq + 1) and first.dtype == np.int32
    np.testing.assert_array_equal(first, again)  # the reference check relies on this
    assert not np.array_equal(first, other)
    assert first.min() >= 0 and first.max() < cfg.vocab
    # Apart from the injected noise, each sequence repeats with period pattern_len.
    period = cfg.pattern_len
    same = np.mean(first[:, period:] == first[:, :-period])
    assert same > 0.8, same


def test_text_bar_fallback(train_lm, capsys):
    bar = train_lm._TextBar(total=4, desc="flash")
    for i in range(4):
        bar.set_postfix_str(f"loss {4 - i:.1f}")
        bar.update(1)
    bar.write("step line")
    bar.close()
    captured = capsys.readouterr()
    assert "4/4" in captured.err and "loss 1.0" in captured.err
    assert "step line" in captured.out


def test_compare_losses(train_lm):
    rel, passed = train_lm.compare_losses([2.0, 1.5], [2.0, 1.5015], rtol=1e-3)
    assert passed and rel[0] == 0.0 and rel[1] == pytest.approx(1e-3, rel=1e-2)
    assert not train_lm.compare_losses([2.0, 1.5], [2.0, 1.6], rtol=1e-3)[1]
    assert not train_lm.compare_losses([float("nan")], [2.0], rtol=1e-3)[1]
    assert not train_lm.compare_losses([2.0], [2.0, 1.9], rtol=1e-3)[1]  # truncated
    assert not train_lm.compare_losses([], [], rtol=1e-3)[1]


def test_cli_exit_status_follows_result(train_lm, monkeypatch):
    monkeypatch.setattr(train_lm, "main", lambda argv=None: {"ok": False})
    assert train_lm.cli([]) == 1
    monkeypatch.setattr(train_lm, "main", lambda argv=None: {"ok": True})
    assert train_lm.cli([]) == 0


def test_runs_as_a_script():
    # Covers the __main__ path and the import fallback for an uninstalled checkout; a
    # two-step run without the check keeps the extra compile small.
    proc = subprocess.run(
        [sys.executable, str(_EXAMPLE), "--preset", "tiny", "--steps", "2", "--seq", "32",
         "--batch", "2", "--no-check", "--no-progress"],
        capture_output=True, text=True, timeout=300, cwd=_EXAMPLE.parent,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "flash step    1" in proc.stdout
