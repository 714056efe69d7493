"""Tile sweep for the Triton kernels on one GPU: each kernel timed on its own.

    PYTHONPATH=. python benchmarks/tune.py --head-dims 64,128,256 --out DIR

For every head_dim it times the forward kernel, the dK/dV kernel and the dQ kernel for each
candidate tile (the other kernels are not run), causal and not, bf16, and prints the best.
docs/tuning.md says how a winner becomes a default in pallas_flash/config.py.
TFLOP/s use the benchmark's count: forward 4*B*H*S^2*D (halved for causal), backward 2.5x that.
A backward candidate is timed as the whole backward (dK/dV and dQ kernels, and the preprocess)
with the other kernel's tile held at the default, so the numbers are comparable across rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

from pallas_flash.attention import _PRECISIONS
from pallas_flash.config import FlashConfig, KernelConfig, default_config
from pallas_flash.masking import make_mask_spec
from pallas_flash.spec import AttentionSpec
from pallas_flash.triton import backward as tb
from pallas_flash.triton import forward as tf

FWD = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3),
       (128, 32, 4, 4), (64, 128, 4, 2), (128, 64, 4, 4), (128, 64, 8, 4)]
DKDV = [(64, 128, 8, 2), (64, 64, 4, 2), (32, 128, 4, 2), (64, 128, 4, 3), (128, 128, 8, 2),
        (32, 64, 4, 3), (64, 64, 8, 3), (32, 128, 8, 3)]
DQ = [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 128, 8, 2), (128, 64, 4, 3),
      (128, 128, 8, 2), (64, 64, 4, 3)]

# head_dim 256: the accumulators are twice as wide, so smaller tiles.
FWD_256 = [(64, 64, 8, 2), (64, 32, 4, 2), (128, 32, 8, 2), (32, 32, 4, 3), (64, 32, 8, 2),
           (128, 64, 8, 2), (64, 64, 4, 2)]
DKDV_256 = [(32, 64, 8, 2), (32, 32, 4, 2), (16, 64, 4, 2), (32, 32, 8, 2), (64, 32, 8, 2)]
DQ_256 = [(64, 32, 8, 2), (32, 32, 4, 2), (64, 16, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2)]


def timeit(fn, *args, iters=10):
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def spec_for(seq, head_dim, causal, cfg):
    return AttentionSpec(mask=make_mask_spec(seq, seq, causal=causal), scale=head_dim ** -0.5,
                         softcap=None, has_segments=False, precision=_PRECISIONS[None],
                         config=cfg, interpret=False)


def sweep(batch, seq, heads, head_dim, causal, results):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    shape = (batch, seq, heads, head_dim)
    q, k, v, do = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in keys)
    base = default_config(head_dim, jnp.bfloat16)
    flops = 4 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    out, stats = jax.jit(lambda q, k, v: tf.forward(spec_for(seq, head_dim, causal, base), q, k, v))(q, k, v)
    dlse = jnp.zeros_like(stats.m)
    tag = f"d{head_dim} s{seq} {'causal' if causal else 'full'}"
    lists = (FWD_256, DKDV_256, DQ_256) if head_dim == 256 else (FWD, DKDV, DQ)
    for kind, cands, share in zip(("fwd", "dkdv", "dq"), lists, (1.0, 2.5, 2.5)):
        for c in cands:
            kc = KernelConfig(*c)
            cfg = FlashConfig(fwd=kc if kind == "fwd" else base.fwd,
                              bwd_dkdv=kc if kind == "dkdv" else base.bwd_dkdv,
                              bwd_dq=kc if kind == "dq" else base.bwd_dq)
            spec = spec_for(seq, head_dim, causal, cfg)
            if kind == "fwd":
                fn = jax.jit(lambda q, k, v, spec=spec: tf.forward(spec, q, k, v))
            else:
                fn = jax.jit(lambda q, k, v, spec=spec: tb.backward(spec, q, k, v, out, stats, do, dlse))
            try:
                t = timeit(fn, q, k, v)
                rate = flops * share / t / 1e12
                row = dict(tag=tag, kernel=kind, config=c, ms=t * 1e3, tflops=rate)
            except Exception as e:  # noqa: BLE001 - a failing tile is a result, not a stop
                row = dict(tag=tag, kernel=kind, config=c, error=str(e).splitlines()[0][:120])
            print(json.dumps(row), flush=True)
            results["rows"].append(row)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    args = parser.parse_args()
    results = {"rows": []}
    for d in map(int, args.head_dims.split(",")):
        heads = {64: 32, 128: 16, 256: 8}.get(d, 16)
        for causal in {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]:
            sweep(2, args.seq, heads, d, causal, results)
    rows = results["rows"]
    with open(os.path.join(args.out, "tune.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\nbest per (case, kernel):")
    best = {}
    for r in rows:
        if "tflops" in r:
            key = (r["tag"], r["kernel"])
            if key not in best or r["tflops"] > best[key]["tflops"]:
                best[key] = r
    for (tag, kind), r in sorted(best.items()):
        print(f"{tag:22s} {kind:5s} {str(r['config']):20s} {r['ms']:8.3f} ms {r['tflops']:6.1f} TF/s")


if __name__ == "__main__":
    main()
