"""Two questions about a training step's work around the kernels (session 10, run 49), on the GPU.

1. `--part delta`: the backward's preprocess D = rowsum(dO * O) ([b, h, s] float32, stacked
   with m and r), which Nsight Compute timed at ~0.27 ms per 2x8192x16x128 call (run 49: an
   `input_concatenate_fusion`, ~5% of the backward) where reading O and dO takes ~0.04 ms.
   Times each formulation alone.
2. `--part hlo`: the optimized HLO of an L-layer training step (guard_cost.py's) for one
   backend, with every custom call and the computation holding it: run 49 counted the Mosaic
   forward twice per layer under backend="mosaic" (once under "auto").

    PYTHONPATH=. python3 benchmarks/step_probe.py --part delta
    PYTHONPATH=. python3 benchmarks/step_probe.py --part hlo --backend mosaic --out $OUT
    PYTHONPATH=. python3 benchmarks/step_probe.py --part barrier --layers 8
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402


def _rows(m, r, delta):
    return jnp.stack([m, jnp.where(r == -jnp.inf, jnp.inf, r), delta], axis=2)


def delta_forms():
    """name -> f(out, do, m, r) giving the stacked [b, h, 3, s] rows."""
    f32 = jnp.float32

    def einsum_bhs(out, do, m, r):  # the current form
        return _rows(m, r, jnp.einsum("bshd,bshd->bhs", out.astype(f32), do.astype(f32)))

    def sum_then_transpose(out, do, m, r):
        d = jnp.sum(out.astype(f32) * do.astype(f32), axis=-1)  # [b, s, h]: minor-axis reduce
        return _rows(m, r, jnp.transpose(d, (0, 2, 1)))

    def sum_barrier_transpose(out, do, m, r):
        d = lax.optimization_barrier(jnp.sum(out.astype(f32) * do.astype(f32), axis=-1))
        return _rows(m, r, jnp.transpose(d, (0, 2, 1)))

    def einsum_bsh_barrier(out, do, m, r):
        d = lax.optimization_barrier(
            jnp.einsum("bshd,bshd->bsh", out.astype(f32), do.astype(f32)))
        return _rows(m, r, jnp.transpose(d, (0, 2, 1)))

    def delta_alone(out, do, m, r):  # no stack: what the reduce alone costs
        del m, r
        return jnp.einsum("bshd,bshd->bhs", out.astype(f32), do.astype(f32))

    return dict(einsum_bhs=einsum_bhs, sum_then_transpose=sum_then_transpose,
                sum_barrier_transpose=sum_barrier_transpose,
                einsum_bsh_barrier=einsum_bsh_barrier, delta_alone=delta_alone)


def time_ms(f, args, iters=50):
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        y = f(*args)
    jax.block_until_ready(y)
    return (time.perf_counter() - t0) / iters * 1e3


def part_delta(shape):
    b, s, h, d = shape
    keys = jax.random.split(jax.random.key(0), 4)
    out = jax.random.normal(keys[0], (b, s, h, d), jnp.bfloat16)
    do = jax.random.normal(keys[1], (b, s, h, d), jnp.bfloat16)
    m = jax.random.normal(keys[2], (b, h, s), jnp.float32)
    r = jax.random.normal(keys[3], (b, h, s), jnp.float32)
    want = None
    for name, f in delta_forms().items():
        f = jax.jit(f)
        got = f(out, do, m, r)
        if name != "delta_alone":
            want = got if want is None else want
            err = float(jnp.max(jnp.abs(got - want)))
        else:
            err = float("nan")
        print(f"delta {name:24s} {time_ms(f, (out, do, m, r)):.4f} ms  max|diff| {err:.2e}",
              flush=True)


def part_hlo(shape, backend, layers, out_dir):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from guard_cost import step_fn
    from hlo_kernels import kernel_sites, print_sites
    b, s, h, d = shape
    x = jax.random.normal(jax.random.key(0), (b, s, h, d), jnp.bfloat16) * 0.1
    hlo = step_fn(backend, False, layers).lower(x).compile().as_text()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"step_hlo_{backend}.txt"), "w") as f:
        f.write(hlo)
    print_sites(kernel_sites(hlo), prefix=f"hlo {backend} ")
    for line in hlo.splitlines():
        if "mosaic_gpu" in line and "custom-call(" in line:
            print("hlo-line", line.strip()[:400])


def part_barrier(shape, layers, iters=10):
    """The step of backend="mosaic" as it is and with the Mosaic forward's outputs passed
    through lax.optimization_barrier (run 50's A/B; attention.py has the barrier since, so both
    rows now carry it and should read the same)."""
    import types

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from guard_cost import step_fn, step_ms
    from pallas_flash import attention
    from pallas_flash.mosaic import forward as mosaic_forward
    b, s, h, d = shape
    x = jax.random.normal(jax.random.key(0), (b, s, h, d), jnp.bfloat16) * 0.1
    fenced = types.SimpleNamespace(forward=lambda *a, **kw: lax.optimization_barrier(
        mosaic_forward.forward(*a, **kw)))
    for name, module in (("plain", mosaic_forward), ("barrier", fenced)):
        attention._FORWARDS["mosaic"] = module
        attention._custom_vjp_attention.cache_clear()
        fn = step_fn("mosaic", False, layers)
        hlo = fn.lower(x).compile().as_text()
        calls = sum("mosaic_gpu" in ln and "custom-call(" in ln for ln in hlo.splitlines())
        print(f"barrier {name:8s} step {step_ms(fn, x, iters):.3f} ms "
              f"({layers} layers), Mosaic custom calls in the HLO: {calls}", flush=True)
    attention._FORWARDS["mosaic"] = mosaic_forward
    attention._custom_vjp_attention.cache_clear()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("delta", "hlo", "barrier"), required=True)
    p.add_argument("--shape", default="2x8192x16x128")
    p.add_argument("--backend", default="mosaic")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    shape = tuple(int(n) for n in args.shape.split("x"))
    if args.part == "delta":
        part_delta(shape)
    elif args.part == "barrier":
        part_barrier(shape, args.layers)
    else:
        part_hlo(shape, args.backend, args.layers, args.out)


if __name__ == "__main__":
    main()
