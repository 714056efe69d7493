"""What "auto"'s finiteness check costs inside a many-layer training step (issue 4 follow-up).

    PYTHONPATH=. python3 benchmarks/guard_cost.py --out $OUT

The benchmark times attention calls alone, so it cannot show what the guard of
pallas_flash/guarded.py costs between the layers of a real step (session 10's `lax.cond` read
its flag on the host once per layer; session 11's predicated Triton launch reads it on the
device). This script times a jitted forward+backward of `--layers` stacked attention
layers under `lax.scan` (each layer: x + attention(x, x, x), so the layers depend on each other)
for each backend, and reports the time per layer and the gap between "auto" and the unchecked
"mosaic" (on a GPU that is not sm_90, or on the CPU, both run Triton / the interpreter and the
gap is noise). Results go to <out>/guard_cost.json.

`--guarded-cluster 1,2` times "auto" once per value, its head_dim 128 forward run in clusters
of that many CTAs (guarded.forward takes the Mosaic forward's own default otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import pallas_flash as pf  # noqa: E402
from pallas_flash import attention, guarded  # noqa: E402


def step_fn(backend: str, causal: bool, layers: int):
    """A jitted loss-and-gradient of `layers` residual attention layers under lax.scan."""
    def layer(x, _):
        return x + pf.flash_attention(x, x, x, causal=causal, backend=backend), None

    def loss(x):
        y, _ = lax.scan(layer, x, None, length=layers)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss))


def step_ms(fn, x, iters: int) -> float:
    """Median milliseconds of fn(x), each call waited for, after two warm-up calls."""
    jax.block_until_ready(fn(x))
    jax.block_until_ready(fn(x))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


@contextlib.contextmanager
def guarded_cluster(n: int):
    """"auto"'s Mosaic forward with clusters of n CTAs at head_dim 128 (else its default)."""
    real = guarded.mosaic_forward

    def config(head_dim, spec=None):
        cfg = real.default_forward_config(head_dim, spec)
        return dataclasses.replace(cfg, cluster=n) if head_dim == 128 else cfg

    def forward(spec, q, *args, config=None):
        return real.forward(spec, q, *args, config=config or _config(q.shape[-1], spec))

    _config = config
    guarded.mosaic_forward = types.SimpleNamespace(forward=forward, default_forward_config=config)
    attention._custom_vjp_attention.cache_clear()  # no trace of the other choice is reused
    try:
        yield
    finally:
        guarded.mosaic_forward = real
        attention._custom_vjp_attention.cache_clear()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="2x8192x16x128", help="batch x seq x heads x head_dim")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--backends", default="auto,mosaic,triton")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--guarded-cluster", default="2",
                   help='"auto" forward cluster sizes to time at head_dim 128, e.g. 1,2')
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    b, s, h, d = (int(n) for n in args.shape.split("x"))
    x = jax.random.normal(jax.random.key(0), (b, s, h, d), jnp.float32).astype(jnp.bfloat16)
    x = x * 0.1  # keeps the residual stream bounded over the layers
    rows = []
    for causal in (bool(int(c)) for c in args.causal.split(",")):
        runs = [(b, int(n)) for b in args.backends.split(",")
                for n in (args.guarded_cluster.split(",") if b == "auto" else ["1"])]
        for backend, cluster in runs:
            row = dict(shape=args.shape, layers=args.layers, causal=causal, backend=backend,
                       guarded_cluster=cluster)
            try:
                with guarded_cluster(cluster):
                    fn = step_fn(backend, causal, args.layers)
                    row["step_ms"] = step_ms(fn, x, args.iters)
                row["per_layer_ms"] = row["step_ms"] / args.layers
            except ValueError as e:  # a forced backend that cannot serve this machine
                row["error"] = str(e).splitlines()[0]
            rows.append(row)
            print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items()), flush=True)
    first_cluster = int(args.guarded_cluster.split(",")[0])
    for causal in {r["causal"] for r in rows}:
        by = {r["backend"]: r.get("step_ms") for r in rows
              if r["causal"] == causal and r["guarded_cluster"] == first_cluster}
        if by.get("auto") and by.get("mosaic"):
            gap = (by["auto"] - by["mosaic"]) / args.layers
            print(f"causal={causal}: auto - mosaic = {gap:.3f} ms per layer "
                  f"({by['auto'] / by['mosaic'] - 1:+.1%} of the step)")
    record = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                  date=time.strftime("%Y-%m-%dT%H:%M:%S"), rows=rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "guard_cost.json"), "w") as f:
        json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
