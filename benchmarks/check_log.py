"""The timing loop of the kernel sweeps (`benchmarks/mosaic_tune.py`)."""

from __future__ import annotations

import time

import jax


def timed(fn, args, iters: int) -> tuple[float, float]:
    """(seconds of the first call, which compiles; best of 3 means of `iters` back-to-back calls,
    device synchronised once per mean)."""
    t0 = time.monotonic()
    jax.block_until_ready(fn(*args))
    first = time.monotonic() - t0
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            res = fn(*args)
        jax.block_until_ready(res)
        best = min(best, (time.perf_counter() - t0) / iters)
    return first, best
