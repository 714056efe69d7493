"""Tests of benchmarks/decode_tune.py that run on the CPU.

One small run in interpret mode goes through the sweep: the copy bandwidth, a served (splits,
tiles) pair timed whole and as the partial kernel alone, a pair the kernel refuses as a row with
its reason, and the JSON. The whole call it times, with tiles that are not the defaults, is
checked against the float32 reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import pallas_flash as pf
from helpers import TOLERANCE, assert_close, example_module
from pallas_flash.mosaic.decode import DecodeTiles

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_tune.py"
ON_GPU = jax.default_backend() == "gpu"


@pytest.mark.skipif(ON_GPU, reason="the interpret-mode smoke run is for machines without a GPU")
def test_sweep_rows_and_json(tmp_path):
    with example_module(_SCRIPT, "decode_tune_script") as dt:
        record = dt.main(["--cases", "1x256x4x2x64", "--splits", "2", "--tiles",
                          "default,256/2/1/k", "--iters", "1", "--copy-mib", "8",
                          "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "decode_tune.json").read_text())
    assert saved == json.loads(json.dumps(record))
    served, refused = saved["rows"]
    assert (served["case"], served["q_len"], served["num_splits"]) == ("1x256x4x2x64", 1, 2)
    assert served["tiles"] == "default" and served["ran"] == "128/2/1/k"
    kv_bytes = 256 * 2 * 64 * 2 * 2
    for name in ("call", "partial"):
        assert served[f"{name}_us"] > 0
        if jax.default_backend() != "gpu":  # no trace to time from: the wall clock's time
            assert served[f"{name}_us"] == served[f"{name}_wall_us"]
        pct = 100 * kv_bytes / (served[f"{name}_us"] * 1e-6) / 1e9 / saved["copy"]["gbps"]
        assert served[f"{name}_pct_of_copy"] == pytest.approx(pct, abs=0.06)
    assert refused["tiles"] == "256/2/1/k" and "not a multiple of block_kv" in refused["error"]


def test_timed_call_with_other_tiles_matches_the_reference():
    with example_module(_SCRIPT, "decode_tune_script") as dt:
        kq, kk, kv = jax.random.split(jax.random.key(3), 3)
        b, ctx, hq, hkv, d = 2, 384, 8, 2, 64
        q = jax.random.normal(kq, (b, 1, hq, d), jnp.float32).astype(jnp.bfloat16)
        k, v = (jax.random.normal(x, (b, ctx, hkv, d), jnp.float32).astype(jnp.bfloat16)
                for x in (kk, kv))
        lengths = jnp.array([384, 200], jnp.int32)
        plan, ran, (full, _) = dt.call_fns(q, k, v, lengths, 3, DecodeTiles(64, 3, 1))
        assert plan.num_splits == 3 and ran == DecodeTiles(64, 3, 1)
        out = full(q, k, v, lengths)
    ref = pf.reference_attention(q, k, v, causal=True, causal_alignment="bottom_right",
                                 kv_lengths=lengths)
    assert_close("out", out.astype(jnp.float32), ref, TOLERANCE[jnp.dtype(jnp.bfloat16)])
