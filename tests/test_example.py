"""End-to-end tests of examples/train_lm.py: a byte-level LM trained on flash attention.

On CPU the kernels run in Pallas interpret mode, so the runs stay short (compiling the train
step dominates). The in-process run trains the tiny preset on the committed Shakespeare text and
covers the forward and both backward kernels, GQA, jit, the optax optimiser, validation in bits
per byte and the comparison against reference_attention. A subprocess run covers the command
line, the synthetic data and the scanned layers. The rest are unit tests that compile nothing.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from helpers import example_module

_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_lm.py"


@pytest.fixture(scope="module")
def train_lm():
    with example_module(_EXAMPLE, "train_lm_example") as module:
        yield module


def _config(train_lm, *argv):
    return train_lm.build_config(train_lm.parse_args(["--preset", "tiny", *argv]))


def _unigram_cross_entropy_bits(train: np.ndarray, val: np.ndarray) -> float:
    """Bits per byte of the validation bytes under the training bytes' frequencies."""
    p = np.bincount(train, minlength=256) / len(train)
    q = np.bincount(val, minlength=256) / len(val)
    seen = q > 0
    return float(-(q[seen] * np.log2(np.maximum(p[seen], 1e-12))).sum())


def test_tiny_text_run_learns_and_matches_reference(train_lm, tmp_path):
    result = train_lm.main([
        "--preset", "tiny", "--steps", "40", "--eval-every", "20", "--check-steps", "2",
        "--seed", "0", "--no-progress", "--log-every", "0", "--save", str(tmp_path / "lm"),
    ])
    assert result["data"] == "text"
    losses = result["losses"]
    assert len(losses) == 40
    assert all(math.isfinite(x) for x in losses), losses
    # The untrained model is close to a uniform guess over 256 bytes.
    assert losses[0] == pytest.approx(math.log(256), abs=0.2)
    assert np.mean(losses[-5:]) < losses[0] - 1.5, losses

    assert [step for step, _ in result["val_bpb"]] == [20, 40]
    first_val, final_val = result["val_bpb"][0][1], result["final_val_bpb"]
    assert final_val == result["val_bpb"][-1][1]
    assert math.isfinite(final_val) and final_val < first_val, result["val_bpb"]
    # Better than the byte frequencies alone: the model has learnt some context.
    text = np.frombuffer(train_lm.DEFAULT_TEXT.read_bytes(), np.uint8)
    split = int(len(text) * 0.9)
    unigram = _unigram_cross_entropy_bits(text[:split], text[split:])
    assert final_val < unigram - 0.3, (final_val, unigram)

    assert result["tokens_per_s"] > 0
    assert result["check"] is not None and len(result["check"]["ref_losses"]) == 2
    assert result["check_passed"] is True, result["check"]
    assert result["ok"] is True

    # --save writes the trained weights (to the exact path given) for examples/generate.py.
    assert result["checkpoint"] == str(tmp_path / "lm")
    cfg, params = train_lm.load_checkpoint(tmp_path / "lm")
    assert cfg == _config(train_lm, "--steps", "40", "--eval-every", "20", "--check-steps", "2")
    assert params["layers"]["wq"].shape == (cfg.n_layers, cfg.d_model, cfg.d_model)
    assert params["embed"].dtype == np.float32


def test_reference_check_catches_attention_the_loss_hides(train_lm, monkeypatch):
    """At initialisation the loss barely depends on attention; the gradients of wq and wk
    depend on nothing else: a non-causal attention (every token seeing the future) fails the
    check there, while its first losses agree with the reference to about 1e-4."""
    args = train_lm.parse_args(["--preset", "tiny"])
    cfg = train_lm.build_config(args)
    data = train_lm.build_data(args, cfg)
    assert max(train_lm.attention_grad_errors(cfg, data).values()) < 1e-3
    monkeypatch.setattr(train_lm, "flash_attention", lambda q, k, v: train_lm.pallas_flash.
                        flash_attention(q, k, v, causal=False, interpret=True))
    assert min(train_lm.attention_grad_errors(cfg, data).values()) > 1e-2


def test_synthetic_data_runs_as_a_script():
    # Covers the __main__ path, the import fallback for an uninstalled checkout, --data
    # synthetic and --scan; a short run without the check keeps the extra compile small.
    proc = subprocess.run(
        [sys.executable, str(_EXAMPLE), "--preset", "tiny", "--data", "synthetic", "--scan",
         "--steps", "3", "--seq", "32", "--batch", "2", "--eval-every", "0", "--no-check",
         "--no-progress"],
        capture_output=True, text=True, timeout=300, cwd=_EXAMPLE.parent,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "synthetic Markov-chain tokens" in proc.stdout
    assert "flash step     3 | validation" in proc.stdout
    assert "bits/token" in proc.stdout and "tokens/s" in proc.stdout
    assert "nan" not in proc.stdout.lower()


def test_text_data_splits_and_windows(train_lm):
    cfg = _config(train_lm, "--seq", "32", "--batch", "4", "--eval-batches", "3")
    text = train_lm.DEFAULT_TEXT.read_bytes()
    data = train_lm.TextData(cfg, text)
    assert len(data.train) + len(data.val) == len(text)
    assert len(data.val) == len(text) - int(len(text) * 0.9)

    first, again, other = data.batch(0), data.batch(0), data.batch(1)
    assert first.shape == (4, 33) and first.dtype == np.int32
    np.testing.assert_array_equal(first, again)  # the reference replay relies on this
    assert not np.array_equal(first, other)
    train_bytes, val_bytes = data.train.tobytes(), data.val.tobytes()
    for row in first:
        assert train_bytes.find(row.astype(np.uint8).tobytes()) >= 0

    evals = data.eval_batches()
    assert evals.shape == (3, 4, 33) and evals.dtype == np.int32
    np.testing.assert_array_equal(evals, data.eval_batches())
    for row in evals.reshape(-1, 33):
        assert val_bytes.find(row.astype(np.uint8).tobytes()) >= 0
    # Spread over the whole split: the first window starts it and the last one ends it.
    np.testing.assert_array_equal(evals[0, 0], data.val[:33])
    np.testing.assert_array_equal(evals[-1, -1], data.val[-33:])


def test_text_data_rejects_a_text_shorter_than_a_window(train_lm):
    cfg = _config(train_lm, "--seq", "64")
    with pytest.raises(ValueError, match="validation split has 30 bytes.*--seq"):
        train_lm.TextData(cfg, b"x" * 300)


def test_synthetic_data_is_deterministic_and_structured(train_lm):
    cfg = _config(train_lm, "--seq", "32")
    data = train_lm.SyntheticData(cfg)
    first, again, other = data.batch(0), data.batch(0), data.batch(1)
    assert first.shape == (cfg.batch, cfg.seq + 1) and first.dtype == np.int32
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    assert first.min() >= 0 and first.max() < 256
    # Apart from the injected noise, each sequence repeats with period pattern_len.
    period = data.pattern_len
    assert period == cfg.seq // 4
    same = np.mean(first[:, period:] == first[:, :-period])
    assert same > 0.8, same
    evals = data.eval_batches()
    assert evals.shape == (cfg.eval_batches, cfg.batch, cfg.seq + 1)
    assert not any(np.array_equal(e, data.batch(i)) for i, e in enumerate(evals))


def test_schedule_warms_up_then_decays_to_a_tenth(train_lm):
    cfg = _config(train_lm, "--steps", "100", "--warmup", "9", "--lr", "1e-3")
    schedule = train_lm.make_schedule(cfg)
    lrs = np.array([float(schedule(i)) for i in range(101)])
    # The first update already moves the weights, and the ramp is linear to the peak.
    np.testing.assert_allclose(lrs[:10], 1e-3 * np.arange(1, 11) / 10, rtol=1e-5)
    assert lrs.max() == pytest.approx(1e-3)
    assert np.all(np.diff(lrs[9:]) <= 1e-9)
    assert lrs[100] == pytest.approx(1e-4)


def test_weight_decay_spares_the_norm_scales(train_lm):
    cfg = _config(train_lm)
    params = jax.eval_shape(lambda: train_lm.init_params(cfg, jax.random.key(0)))
    mask = train_lm._decay_mask(params)
    assert mask["embed"] and mask["lm_head"] and not mask["final_norm"]
    assert mask["layers"]["wq"] and mask["layers"]["w_out"]
    assert not mask["layers"]["attn_norm"] and not mask["layers"]["mlp_norm"]


@pytest.mark.parametrize("argv, message", [
    (["--d-model", "130"], "d_model 130 is not divisible by n_heads 4"),
    (["--kv-heads", "3"], "n_heads 4 is not a multiple of n_kv_heads 3"),
    (["--d-model", "12"], "RoPE needs an even head_dim, got 3"),
    (["--steps", "0"], "must be positive"),
    (["--seq", "1"], "seq >= 2"),
    (["--warmup", "-1"], "must not be negative"),
])
def test_config_errors(train_lm, argv, message):
    with pytest.raises(ValueError, match=message):
        _config(train_lm, *argv)


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


def test_tokens_per_second_skips_the_warmup_steps(train_lm):
    cfg = _config(train_lm, "--seq", "10", "--batch", "2")
    # 20 tokens a step; the first two steps (compilation, one-time costs) do not count.
    assert train_lm.tokens_per_second(cfg, [30.0, 5.0, 0.5, 0.5]) == pytest.approx(40.0)
    assert train_lm.tokens_per_second(cfg, [30.0, 0.5]) == pytest.approx(40.0)
    assert math.isnan(train_lm.tokens_per_second(cfg, [30.0]))


def test_cli_exit_status_follows_result(train_lm, monkeypatch):
    monkeypatch.setattr(train_lm, "main", lambda argv=None: {"ok": False})
    assert train_lm.cli([]) == 1
    monkeypatch.setattr(train_lm, "main", lambda argv=None: {"ok": True})
    assert train_lm.cli([]) == 0
