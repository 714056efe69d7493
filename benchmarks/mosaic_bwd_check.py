"""One unattended GPU check of the draft Mosaic GPU backward (pallas_flash/mosaic/backward.py).

    PYTHONPATH=. python3 benchmarks/mosaic_bwd_check.py --out $OUT

1. Correctness: row statistics and O from the Triton forward, then dq, dk, dv from the Mosaic
   backward on bf16/fp16, head_dim 64/128/256, causal or not, GQA, against the vjp of
   `reference_attention` in float32 (random dO and dlse; relative Frobenius error, tolerance
   2e-2 bf16, 4e-3 fp16) and against the Triton backward fed the same statistics.
2. Speed of the backward alone (O and statistics precomputed) at 2x8192x16x16x128 bf16, causal
   and not: Mosaic, Triton, and cuDNN's backward (the vjp of
   `jax.nn.dot_product_attention(implementation="cudnn")`, residuals precomputed), in TFLOP/s
   (2.5 * 4*B*H*S*S*D, halved for causal).

Every check prints one line (PASS / FAIL / SKIP); every exception becomes a FAIL row with the
first lines of its message, the full text in <out>/mosaic_bwd_check_errors.log (the first one
also in <out>/mosaic_bwd_check_first_failure.log). Results go to <out>/mosaic_bwd_check.json,
rewritten after every row. A watchdog ends the run (writing the JSON first) when one check runs
past CHECK_HANG_S (a barrier deadlock is not an exception) or the whole run past its budget
(machinery in benchmarks/check_log.py).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from benchmarks.check_log import CheckLog, timed  # noqa: E402

TOTAL_BUDGET_S = 330.0
CHECK_HANG_S = 120.0
TOL = {"bfloat16": 2e-2, "float16": 4e-3}
PREFIX = "mosaic_bwd_check"


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.isfinite(a).all():
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    log = CheckLog(args.out, PREFIX, total_budget_s=TOTAL_BUDGET_S, hang_s=CHECK_HANG_S)
    log.start_watchdog()

    try:
        import jax
        import jax.numpy as jnp
        from jax import lax
        dev = jax.devices()[0]
        log.env.update(python=platform.python_version(), jax=jax.__version__,
                       devices=[str(d) for d in jax.devices()], device_kind=dev.device_kind,
                       compute_capability=getattr(dev, "compute_capability", None))
        print(f"env: {log.env}", flush=True)
    except Exception as exc:  # noqa: BLE001
        log.note_failure("import jax", "".join(traceback.format_exception(exc)))
        log.row("FAIL", "import jax", error=f"{type(exc).__name__}: {exc}")
        return 1

    import importlib

    import pallas_flash as pf
    from pallas_flash.masking import make_mask_spec
    from pallas_flash.spec import AttentionSpec

    mosaic = log.guarded("import mosaic backward",
                         lambda: importlib.import_module("pallas_flash.mosaic.backward"))
    tri_fwd = log.guarded("import triton forward",
                          lambda: importlib.import_module("pallas_flash.triton.forward").forward)
    tri_bwd = log.guarded("import triton backward",
                          lambda: importlib.import_module("pallas_flash.triton.backward").backward)
    if mosaic is None or tri_fwd is None:
        log.row("SKIP", "everything", reason="imports failed")
        return 1

    def make_spec(sq, skv, d, dtype, causal):
        return AttentionSpec(mask=make_mask_spec(sq, skv, causal=causal),
                             scale=1.0 / math.sqrt(d), softcap=None, has_segments=False,
                             precision=lax.Precision.DEFAULT,
                             config=pf.default_config(d, dtype), interpret=False)

    def inputs(b, s, hq, hkv, d, dtype, seed=0):
        ks = jax.random.split(jax.random.key(seed), 5)
        q = jax.random.normal(ks[0], (b, s, hq, d), jnp.float32).astype(dtype)
        k = jax.random.normal(ks[1], (b, s, hkv, d), jnp.float32).astype(dtype)
        v = jax.random.normal(ks[2], (b, s, hkv, d), jnp.float32).astype(dtype)
        do = jax.random.normal(ks[3], (b, s, hq, d), jnp.float32).astype(dtype)
        dlse = jax.random.normal(ks[4], (b, hq, s), jnp.float32)
        return q, k, v, do, dlse

    # ---- 1. correctness -------------------------------------------------------------------
    cases = [  # (b, s, hq, hkv, d, dtype, causal)
        (2, 1024, 4, 4, 128, "bfloat16", False),
        (2, 1024, 4, 4, 128, "bfloat16", True),
        (2, 1024, 4, 2, 64, "bfloat16", True),
        (2, 1024, 4, 2, 64, "float16", False),
        (2, 1024, 4, 1, 128, "float16", True),
        (2, 1024, 4, 2, 256, "bfloat16", True),
        (2, 1024, 2, 2, 256, "float16", False),
        (1, 4096, 4, 2, 128, "bfloat16", True),
    ]
    for (b, s, hq, hkv, d, dt, causal) in cases:
        name = f"correct b{b} s{s} hq{hq} hkv{hkv} d{d} {dt} {'causal' if causal else 'full'}"

        def run_case(b=b, s=s, hq=hq, hkv=hkv, d=d, dt=dt, causal=causal, name=name):
            dtype = jnp.dtype(dt)
            q, k, v, do, dlse = inputs(b, s, hq, hkv, d, dtype)
            spec = make_spec(s, s, d, dtype, causal)
            out, st = jax.jit(lambda q, k, v: tri_fwd(spec, q, k, v))(q, k, v)
            t0 = time.monotonic()
            grads = jax.jit(lambda *a: mosaic.backward(spec, *a))(q, k, v, out, st, do, dlse)
            grads = jax.block_until_ready(grads)
            fields = {"compile_run_s": time.monotonic() - t0}
            up = lambda x: x.astype(jnp.float32)  # noqa: E731
            fn = lambda q, k, v: pf.reference_attention(q, k, v, causal=causal,  # noqa: E731
                                                        return_lse=True)
            _, vjp = jax.vjp(fn, up(q), up(k), up(v))
            ref = vjp((up(do), dlse))
            for n, g, r in zip(("dq", "dk", "dv"), grads, ref):
                fields[f"err_{n}_ref"] = rel(g, r)
            if tri_bwd is not None:
                try:
                    tg = jax.jit(lambda *a: tri_bwd(spec, *a))(q, k, v, out, st, do, dlse)
                    for n, g, t in zip(("dq", "dk", "dv"), grads, tg):
                        fields[f"err_{n}_triton"] = rel(g, t)
                except Exception as exc:  # noqa: BLE001
                    fields["triton_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            tol = TOL[dt]
            bad = [key for key, val in fields.items() if key.startswith("err_") and not val <= tol]
            if bad:
                log.note_failure(name, f"numerical mismatch, tol {tol}: {fields}")
                log.row("FAIL", name, tol=tol, over_tol=bad, **fields)
                return False
            log.row("PASS", name, tol=tol, **fields)
            return True

        log.guarded(name, run_case, min_left=60.0)

    # ---- 2. speed ---------------------------------------------------------------------------
    b, s, h, d = 2, 8192, 16, 128
    for causal in (False, True):
        flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
        tag = f"{b}x{s}x{h}x{h}x{d} bf16 {'causal' if causal else 'full'}"
        q, k, v, do, dlse = inputs(b, s, h, h, d, jnp.bfloat16, seed=1)
        spec = make_spec(s, s, d, jnp.bfloat16, causal)
        prep = log.guarded(f"speed {tag} prepare", lambda spec=spec: jax.block_until_ready(
            jax.jit(lambda q, k, v: tri_fwd(spec, q, k, v))(q, k, v)))
        if prep is None:
            continue
        out, st = prep
        impls = [("mosaic", lambda spec=spec: (jax.jit(
            lambda *a: mosaic.backward(spec, *a)), (q, k, v, out, st, do, dlse)))]
        if tri_bwd is not None:
            impls.append(("triton", lambda spec=spec: (jax.jit(
                lambda *a: tri_bwd(spec, *a)), (q, k, v, out, st, do, dlse))))

        def cudnn(causal=causal):
            _, vjp = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, implementation="cudnn"), q, k, v)
            return jax.jit(lambda vjp, do: vjp(do)), (vjp, do)

        impls.append(("cudnn", cudnn))
        for impl, build in impls:
            check = f"speed bwd {tag} {impl}"

            def bench(build=build, check=check):
                first, best = timed(*build(), args.iters)
                log.row("PASS", check, ms=best * 1e3, tflops=flops / best / 1e12,
                        first_call_s=first)

            log.guarded(check, bench, min_left=10.0)

    return log.finish()


if __name__ == "__main__":
    sys.exit(main())
