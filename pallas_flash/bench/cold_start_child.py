"""One cold start of one implementation, in the fresh process that runs this file.

``python -P pallas_flash/bench/cold_start_child.py SPEC_JSON`` imports jax, and pallas_flash only
for our own implementations, so that a baseline's start is not charged for importing our library.
It builds random-normal inputs and a random cotangent (never zeros), runs ``steps`` jitted
forward+backward steps, each ended by ``jax.block_until_ready``, and prints one JSON line after
:data:`MARKER`.
All times are ``time.time()`` differences from ``spawned_at``, the parent's clock just before it
started this process; ``start_to_third_s`` ends with the third step.
"""

import time

CHILD_STARTED = time.time()  # before any import but the interpreter's own

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

MARKER = "PALLAS_FLASH_COLD_START_JSON "
# Served by jax.nn.dot_product_attention(implementation=...), without importing pallas_flash.
JAX_NN_IMPLS = ("cudnn", "xla")


def _short_error(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return (f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__)[:200]


def _attention(impl: str):
    """fn(q, k, v, causal), the same call as the benchmark's IMPLS[impl]."""
    import jax

    if impl in JAX_NN_IMPLS:
        return lambda q, k, v, causal: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation=impl)
    from pallas_flash.bench.impls import IMPLS
    return IMPLS[impl]


def _configure_cache(cache_dir: str | None) -> None:
    import jax

    if cache_dir is None:
        return
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    # Every program is written, however quick to compile or small.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def prime(spec: dict) -> dict:
    """Imports and device start-up only: loads the libraries from disk into the page cache, so
    that the first measured child is not the only one to read them."""
    import jax

    jax.devices()
    for impl in spec["impls"]:
        _attention(impl)
    return {"status": "ok"}


def cold_start(spec: dict) -> dict:
    spawned = spec["spawned_at"]
    since = lambda: time.time() - spawned  # noqa: E731
    # Seconds since the spawn at which each stage ended.
    at = {"interpreter": CHILD_STARTED - spawned}
    result = {"impl": spec["impl"], "cache": spec["cache"], "status": "error", "at_s": at}
    if spec.get("cache_dir"):
        # Shows whether this run found a filled cache.
        result["cache_files_at_start"] = len(os.listdir(spec["cache_dir"]))
    try:
        import jax
        import jax.numpy as jnp
        import numpy as np

        _configure_cache(spec.get("cache_dir"))
        result["jax_compilation_cache_dir"] = jax.config.jax_compilation_cache_dir
        at["jax_imported"] = since()
        result["device"] = jax.devices()[0].device_kind
        result["backend"] = jax.default_backend()
        at["devices"] = since()
        fn = _attention(spec["impl"])
        at["impl_imported"] = since()

        b, s, hq, hkv, d = spec["shape"]
        # Drawn on the host: no compilation of its own in the figure, for either side.
        rng = np.random.default_rng(spec["seed"])
        q, k, v, do = (jax.device_put(rng.standard_normal(shape, np.float32)
                                      .astype(jnp.dtype(spec["dtype"])))
                       for shape in ((b, s, hq, d), (b, s, hkv, d), (b, s, hkv, d), (b, s, hq, d)))
        jax.block_until_ready((q, k, v, do))
        at["inputs"] = since()

        causal = spec["causal"]

        @jax.jit
        def step(q, k, v, do):
            _, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, causal), q, k, v)
            return vjp(do)

        times = result["step_s"] = []
        for i in range(spec["steps"]):
            t0 = time.perf_counter()
            jax.block_until_ready(step(q, k, v, do))
            times.append(time.perf_counter() - t0)
            if i == 2:
                result["start_to_third_s"] = at["third_step"] = since()
        at["last_step"] = since()
        result["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - a failure is this run's result
        result["error"] = _short_error(e)
    return result


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    out = prime(spec) if spec.get("prime") else cold_start(spec)
    print(MARKER + json.dumps(out), flush=True)
