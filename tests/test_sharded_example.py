"""End-to-end test of examples/sharded_train_step.py: data- and context-parallel training.

In-process, the run uses conftest's four host devices as a 2 x 2 ("data", "context") mesh
(1 x 2 when only two or three devices exist), trains a few steps with ring attention in the
zig-zag layout, and replays the first steps on one device with flash_attention. A second,
one-step run goes through the command line in a fresh process with XLA_FLAGS unset, which
covers the script's own request for host devices.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from helpers import example_module

_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sharded_train_step.py"
NUM_DEVICES = len(jax.devices())
pytestmark = pytest.mark.skipif(NUM_DEVICES < 2, reason="the sharded example needs at least "
                                                         f"2 devices (found {NUM_DEVICES})")


@pytest.fixture(scope="module")
def example():
    with example_module(_EXAMPLE, "sharded_train_step_example") as module:
        yield module


def test_sharded_training_learns_and_matches_one_device(example):
    data = 2 if NUM_DEVICES >= 4 else 1
    result = example.main(["--data", str(data), "--context", "2", "--steps", "8",
                           "--check-steps", "2", "--batch", "4", "--seq", "64"])
    losses = result["losses"]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses), losses
    # Starts near ln(vocab) and the bigram structure is learnt within a few steps.
    assert losses[0] == pytest.approx(math.log(example.Model().vocab), abs=0.3)
    assert losses[-1] < losses[0] - 0.5, losses
    # Same initialisation and batches on one device in natural order: the same losses, up to
    # float32 summation order.
    assert len(result["single_device_losses"]) == 2
    assert result["max_rel_diff"] < 1e-4, result


def test_zigzag_batches_are_a_permutation(example):
    import numpy as np

    inputs, targets, positions = example.make_batch(np.random.default_rng(0), 32, 2, 32)
    assert inputs.shape == targets.shape == positions.shape == (2, 32)
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])  # next-token targets
    permuted = np.asarray(example.pallas_flash.zigzag_permute(positions, 2, axis=1))
    np.testing.assert_array_equal(np.sort(permuted, axis=1), positions)
    assert not np.array_equal(permuted, positions)


def test_runs_as_a_script_with_its_own_host_devices():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, str(_EXAMPLE), "--steps", "1", "--batch", "2", "--seq", "32"],
        capture_output=True, text=True, timeout=300, cwd=_EXAMPLE.parent, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mesh data=2 x context=2" in proc.stdout
    assert "sharded step   0" in proc.stdout
