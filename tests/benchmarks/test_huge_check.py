"""Tests of benchmarks/huge_check.py that run on the CPU.

The script proves on a GPU that offsets past 2**31 elements are right; here its --smoke shape
runs the same pipeline in interpret mode (forward under jax.vjp, backward, finiteness, the
sampled-row references), and an injected error shows that the checks can fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp

from helpers import example_module

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "huge_check.py"


def _load():
    return example_module(_SCRIPT, "huge_check_script")


def test_samples_of_the_default_shape_cross_int32():
    with _load() as hc:
        seq, heads, head_dim = hc.DEFAULT_SHAPE
        rows = hc.query_samples(seq, heads, head_dim, 8)
        keys = hc.key_samples(seq, heads, head_dim, 4)
        assert len(set(rows)) == 8 and len(set(keys)) == 4
        # The highest offset of all, and the rows either side of 2**31 (row 524288 = 2**31 / 4096).
        assert rows[0] == (seq - 1, heads - 1) and (0, 0) in rows
        assert (524288, 0) in rows and (524287, heads - 1) in rows
        assert hc.element_offset(524288, 0, heads, head_dim) == 2**31
        assert hc.element_offset(524287, heads - 1, heads, head_dim) == 2**31 - head_dim
        # dK/dV: the last key of the last head, and key 0, which every query of its head sees.
        assert keys[:2] == [(seq - 1, heads - 1), (0, heads - 1)]
        assert all(0 <= r < seq and 0 <= h < heads for r, h in rows + keys)


def test_smoke_run_passes(tmp_path):
    with _load() as hc:
        argv = ["--smoke", "--out", str(tmp_path)]
        data = hc.run(hc.parse_args(argv), argv)
    assert data["complete"] and data["all_passed"], [c for c in data["checks"] if not c["passed"]]
    kinds = [c["check"] for c in data["checks"]]
    # 5 tensors finite, 8 query rows x (O, lse, dQ), 4 key rows x (dK, dV).
    assert kinds.count("finite") == 5
    assert kinds.count("O") == kinds.count("lse") == kinds.count("dQ") == 8
    assert kinds.count("dK") == kinds.count("dV") == 4
    for c in data["checks"]:
        if c["check"] != "finite":
            assert 0 <= c["err"] <= c["tol"] / 2, c  # a clear margin, not a near miss
    saved = json.loads(next(tmp_path.glob("huge_check_*.json")).read_text())
    assert saved["all_passed"] and len(saved["checks"]) == len(data["checks"])


def test_injected_errors_fail(tmp_path):
    """A wrong O row, a wrong dQ row and one NaN in dK fail exactly their checks."""
    with _load() as hc:
        seq, heads, head_dim = hc.SMOKE_SHAPE
        (last_row, last_head), (row0, head0) = hc.query_samples(seq, heads, head_dim, 8)[:2]
        sampled_keys = hc.key_samples(seq, heads, head_dim, 4)
        nan_at = next((r, h) for r in range(seq) for h in range(heads)
                      if (r, h) not in sampled_keys)

        def perturb(r):
            # O row 0 of head 0 feeds no sampled key's dK/dV reference (the one sampled key of
            # head 0 is row 150, which causal query 0 never sees), so only its O check may fail.
            o_row = r["o"][0, row0, head0].astype(jnp.float32)
            bump = (0.1 * jnp.abs(o_row).max()).astype(r["o"].dtype)
            r["o"] = r["o"].at[0, row0, head0, 0].add(bump)
            r["dq"] = r["dq"].at[0, last_row, last_head].multiply(1.1)
            r["dk"] = r["dk"].at[0, nan_at[0], nan_at[1], 0].set(jnp.nan)
            return r

        status = hc.main(["--smoke", "--out", str(tmp_path)], perturb=perturb)
    assert status == 1
    data = json.loads(next(tmp_path.glob("huge_check_*.json")).read_text())
    failed = {(c["check"], c.get("row"), c.get("head"), c.get("tensor"))
              for c in data["checks"] if not c["passed"]}
    assert failed == {("O", row0, head0, None), ("dQ", last_row, last_head, None),
                      ("finite", None, None, "dk")}
    assert data["complete"] and not data["all_passed"]


def test_a_step_that_raises_is_a_failure(tmp_path, monkeypatch, capsys):
    """A wrapped offset tends to end as an illegal memory access: reported, not a crash."""
    with _load() as hc:
        def broken_step(*args, **kwargs):
            raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access")

        monkeypatch.setattr(hc, "run_step", broken_step)
        status = hc.main(["--smoke", "--out", str(tmp_path)])
    assert status == 1
    data = json.loads(next(tmp_path.glob("huge_check_*.json")).read_text())
    assert [(c["check"], c["passed"]) for c in data["checks"]] == [("step", False)]
    assert "ILLEGAL_ADDRESS" in data["checks"][0]["error"]
    assert "FAIL  step" in capsys.readouterr().out
