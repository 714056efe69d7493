"""Where the public API's backward loses time against the same kernel timed alone (GPU).

    PYTHONPATH=. python3 benchmarks/backward_gap.py --out DIR [--case 2x8192x16x16x128]

In session 6's benchmark (NOTES.md runs 26-27) the backward through `flash_attention` (the vjp
closure of one forward call, timed call by call) read 10-20% below the fused kernel timed alone
(back-to-back calls, one synchronisation per average): 2x8192x16x128 causal 3.87 ms against
3.09 ms, while cuDNN's two timings differed by 0.3 ms. This script times, on one case, each
layer between the two, both ways:

  pipelined  best of 3 means of --iters back-to-back calls, one sync per mean (mosaic_tune.py's
             timer: host work overlaps the device's);
  per call   median of --iters calls, each synchronised (bench.py's timer: host work and launch
             latency add to every call).

Layers: the Mosaic backward alone (residuals precomputed); the guarded backward (the finiteness
check of q, k, v, dO and, before session 11, the lax.cond around it; since then the check of
q, k, v, D and the predicated Triton launch); the public vjp closure under "auto" and under
backend="mosaic" (no check); cuDNN's vjp closure; and, alone, the XLA pieces around the kernel
(the check, D = rowsum(dO O), the float32 dQ cast). A gap that appears per call only is host
time (launch, descriptors); one that appears pipelined too is device time, and the pieces say
whose. Rows are printed as they complete and written to <out>/backward_gap.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import pallas_flash as pf  # noqa: E402
from benchmarks.check_log import timed  # noqa: E402
from pallas_flash import bench, guarded  # noqa: E402
from pallas_flash.masking import make_mask_spec  # noqa: E402
from pallas_flash.mosaic import backward as mb  # noqa: E402
from pallas_flash.spec import AttentionSpec  # noqa: E402
from pallas_flash.triton import forward as tf  # noqa: E402


def per_call(fn, args, iters: int) -> float:
    times, _ = bench.time_calls(fn, args, iters, warmup=2)
    return statistics.median(times)


def layers(case: bench.Case, interpret: bool):
    """[(name, jitted fn, args)] for one case, heaviest layer last."""
    q, k, v, do = bench.make_inputs(case, jnp.bfloat16, jax.random.key(0))
    d, s = case.head_dim, case.seq
    spec = AttentionSpec(mask=make_mask_spec(s, s, causal=case.causal),
                         scale=1.0 / math.sqrt(d), softcap=None, has_segments=False,
                         precision=lax.Precision.DEFAULT,
                         config=pf.default_config(d, jnp.bfloat16), interpret=interpret)
    out, st = jax.block_until_ready(jax.jit(lambda q, k, v: tf.forward(spec, q, k, v))(q, k, v))
    dlse = jax.random.normal(jax.random.key(1), st.m.shape, jnp.float32)
    res = (q, k, v, out, st, do, dlse)
    rows = [
        ("check q, k, v, dO", jax.jit(guarded.all_finite), (q, k, v, do)),
        ("D = rowsum(dO O)", jax.jit(lambda o, g: jnp.einsum(
            "bshd,bshd->bhs", o.astype(jnp.float32), g.astype(jnp.float32))), (out, do)),
        ("dQ cast f32 -> bf16", jax.jit(lambda x: x.astype(jnp.bfloat16)),
         (q.astype(jnp.float32),)),
        ("mosaic backward alone", jax.jit(lambda *a: mb.backward(spec, *a)), res),
    ]
    if not interpret:   # the guard's fallback is the Triton kernel: it needs a GPU to lower
        rows.append(("guarded backward", jax.jit(lambda *a: guarded.backward(spec, *a)), res))
    for name, impl in (("public vjp, auto", "pallas_flash"),
                       ("public vjp, backend=mosaic", "pallas_flash_mosaic"),
                       ("cuDNN vjp", "cudnn")):
        if interpret and impl != "pallas_flash":
            continue
        fn, args = bench.make_backward(bench.IMPLS[impl], case.causal, {}, q, k, v, do, {})
        rows.append((name, fn, args))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", default="2x8192x16x16x128", help="BxSxHqxHkvxD")
    p.add_argument("--causal", default="1,0", help="comma list of 0/1")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    interpret = jax.default_backend() == "cpu"
    shape = tuple(int(x) for x in args.case.split("x"))
    path = os.path.join(args.out, "backward_gap.json")
    record = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "case": args.case, "rows": []}
    print(f"{'case':<28} {'layer':<28} {'pipelined ms':>13} {'per call ms':>12}")
    for causal in (bool(int(c)) for c in args.causal.split(",")):
        case = bench.Case(*shape, causal=causal)
        for name, fn, fargs in layers(case, interpret):
            _, pipelined = timed(fn, fargs, args.iters)
            one = per_call(fn, fargs, args.iters)
            row = dict(case=args.case, causal=causal, layer=name,
                       pipelined_ms=round(pipelined * 1e3, 4), per_call_ms=round(one * 1e3, 4))
            record["rows"].append(row)
            print(f"{args.case + (' causal' if causal else ''):<28} {name:<28} "
                  f"{row['pipelined_ms']:>13.3f} {row['per_call_ms']:>12.3f}", flush=True)
            with open(path, "w") as f:
                json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
