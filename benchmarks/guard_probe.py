"""Where "auto"'s forward loses time to the unchecked Mosaic forward, case by case (GPU).

    PYTHONPATH=. python3 benchmarks/guard_probe.py --cases 1x16384x16x16x128 --causal 1,0

Run 54 (NOTES.md) found the gap between the benchmark's `pallas_flash` and `pallas_flash_mosaic`
forward rows uneven: ~0.2 ms a call at 1x16384 causal, 0.02-0.05 ms at 8k causal and 16k
non-causal, with the cond guard and with the predicated one alike. This script times, per case
and mask, jitted forwards of:

  check         the finiteness flag alone (guarded.all_finite(v));
  mosaic        backend="mosaic" (unchecked);
  mosaic+check  the unchecked kernel and the flag in one program, no branch;
  auto          backend="auto" (the guard);

each both ways the benchmark can (`pallas_flash.bench.time_calls`): `pipelined` (batches of
back-to-back calls, one sync a batch) and `call` (a sync after each call), best of three
batches / median call. `--sites` prints where XLA put each kernel of auto's forward
(hlo_kernels.py). Under `ncu --print-summary per-kernel` (`--iters 1`), it lists each kernel
the four programs launch and its duration.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_flash as pf  # noqa: E402
from pallas_flash import guarded  # noqa: E402
from pallas_flash.bench import Case, make_inputs, parse_case, time_calls  # noqa: E402

from benchmarks.hlo_kernels import kernel_sites, print_sites  # noqa: E402


def programs(causal: bool) -> dict:
    def attn(backend):
        return lambda q, k, v: pf.flash_attention(q, k, v, causal=causal, backend=backend)

    return {
        "check": jax.jit(lambda q, k, v: guarded.all_finite(v)),
        "mosaic": jax.jit(attn("mosaic")),
        "mosaic+check": jax.jit(lambda q, k, v: (attn("mosaic")(q, k, v), guarded.all_finite(v))),
        "auto": jax.jit(attn("auto")),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="1x16384x16x16x128,2x8192x16x16x128")
    p.add_argument("--causal", default="1,0")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--sites", action="store_true")
    args = p.parse_args(argv)
    for text in args.cases.split(","):
        q, k, v, _ = make_inputs(Case(*parse_case(text), causal=False), jnp.bfloat16,
                                 jax.random.key(0))
        for causal in (bool(int(c)) for c in args.causal.split(",")):
            for name, fn in programs(causal).items():
                piped, _ = time_calls(fn, (q, k, v), args.iters, 2, pipelined=True)
                calls, _ = time_calls(fn, (q, k, v), args.iters, 0)
                print(f"probe {text} causal={int(causal)} {name:13s} pipelined "
                      f"{min(piped) * 1e3:.3f} ms  call {statistics.median(calls) * 1e3:.3f} ms",
                      flush=True)
            if args.sites:
                hlo = programs(causal)["auto"].lower(q, k, v).compile().as_text()
                print_sites(kernel_sites(hlo), prefix=f"sites {text} causal={int(causal)} ")


if __name__ == "__main__":
    main()
