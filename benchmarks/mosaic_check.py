"""One unattended GPU check of the draft Mosaic GPU forward kernel (pallas_flash/mosaic/forward.py).

    PYTHONPATH=. python3 benchmarks/mosaic_check.py --out $OUT

1. Correctness: the Mosaic forward on bf16/fp16, head_dim 64/128/256, causal or not, GQA, seq
   1024 and 4096, batch 2, against `reference_attention(..., return_lse=True)` in float32
   (relative Frobenius error of O and of lse = stats.to_lse; tolerance 2e-2 bf16, 4e-3 fp16) and
   against the Triton forward on the same inputs.
2. Speed at 2x8192x16x16x128 bf16, causal and not: Mosaic (a few configs), Triton forward,
   cuDNN (`jax.nn.dot_product_attention(implementation="cudnn")`), in TFLOP/s
   (4*B*H*S*S*D, halved for causal).

Every check prints one line as it completes (PASS / FAIL / SKIP). Every exception becomes a FAIL
row with the first lines of its message; the full text of the first failure goes to
<out>/mosaic_check_first_failure.log and every failure to <out>/mosaic_check_errors.log. Results
go to <out>/mosaic_check.json (rewritten after every row). A watchdog ends the run (writing the
JSON first) if one check hangs (a barrier deadlock cannot be caught as an exception) or the whole
run passes its time budget. That machinery lives in benchmarks/check_log.py.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from benchmarks.check_log import CheckLog, error_lines, timed  # noqa: E402

TOTAL_BUDGET_S = 240.0      # the run must end within ~250 s
# One check (compile + run + the reference's XLA compile) longer than this counts as a hang. 40 s
# was too short on our H200 with 26 pytest workers compiling beside it: it fired inside the
# reference's einsum compile, after the kernel itself had compiled and run (NOTES.md, run 8).
CHECK_HANG_S = 120.0
TOL = {"bfloat16": 2e-2, "float16": 4e-3}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    rec = CheckLog(args.out, "mosaic_check", total_budget_s=TOTAL_BUDGET_S, hang_s=CHECK_HANG_S)
    rec.start_watchdog()
    guarded = rec.guarded

    # ---- environment ----------------------------------------------------------------------
    try:
        import jax
        import jax.numpy as jnp
        from jax import lax
        rec.env.update(python=platform.python_version(), jax=jax.__version__,
                       devices=[str(d) for d in jax.devices()],
                       device_kind=jax.devices()[0].device_kind,
                       compute_capability=getattr(jax.devices()[0], "compute_capability", None))
        try:
            from jax._src.lib import cuda_versions
            rt = cuda_versions.cuda_runtime_get_version() if cuda_versions else None
            rec.env["cuda_runtime"] = rt
            if rt is not None and 12080 <= rt < 12091:
                rec.env["warning"] = ("CUDA runtime 12.8.0-12.9.0: JAX's own Mosaic attention "
                                      "refuses causal here (ptxas miscompilation)")
        except Exception as exc:  # noqa: BLE001
            rec.env["cuda_runtime"] = f"unknown ({exc})"
        print(f"env: {rec.env}", flush=True)
    except Exception as exc:  # noqa: BLE001
        rec.fail("import jax", exc)
        return 1

    import pallas_flash as pf
    from pallas_flash import stats as stats_mod
    from pallas_flash.masking import make_mask_spec
    from pallas_flash.spec import AttentionSpec

    mosaic = guarded("import pallas_flash.mosaic.forward", lambda: _import_mosaic())
    triton_forward = guarded("import pallas_flash.triton.forward", lambda: _import_triton())

    def make_spec(q, k, causal):
        return AttentionSpec(
            mask=make_mask_spec(q.shape[1], k.shape[1], causal=causal),
            scale=1.0 / math.sqrt(q.shape[-1]), softcap=None, has_segments=False,
            precision=lax.Precision.DEFAULT, config=pf.default_config(q.shape[-1], q.dtype),
            interpret=False)

    def inputs(b, s, hq, hkv, d, dtype, seed=0):
        kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
        q = jax.random.normal(kq, (b, s, hq, d), dtype)
        k = jax.random.normal(kk, (b, s, hkv, d), dtype)
        v = jax.random.normal(kv, (b, s, hkv, d), dtype)
        return q, k, v

    def rel(a, b):
        a = np.asarray(a, np.float64)
        b = np.asarray(b, np.float64)
        ok = np.isfinite(b)
        if not np.array_equal(np.isfinite(a), ok):
            return float("inf")
        den = np.linalg.norm(np.where(ok, b, 0.0))
        return float(np.linalg.norm(np.where(ok, a - b, 0.0)) / max(den, 1e-30))

    def jit_mosaic(spec, config=None):
        return jax.jit(lambda q, k, v: mosaic.forward(spec, q, k, v, config=config))

    def jit_triton(spec):
        return jax.jit(lambda q, k, v: triton_forward(spec, q, k, v))

    # ---- 1. correctness -------------------------------------------------------------------
    # (b, s, hq, hkv, d, dtype, causal, config-or-None)
    cases = [
        (2, 1024, 4, 4, 128, "bfloat16", False, None),
        (2, 1024, 4, 4, 128, "bfloat16", True, None),
        (2, 1024, 4, 2, 64, "bfloat16", True, None),
        (2, 1024, 4, 2, 64, "float16", False, None),
        (2, 1024, 4, 1, 128, "float16", True, None),
        (2, 4096, 4, 2, 128, "bfloat16", True, None),
        (2, 4096, 4, 4, 64, "float16", True, None),
        (2, 1024, 4, 2, 256, "bfloat16", True, None),
        (2, 1024, 2, 2, 256, "float16", False, None),
        (2, 1024, 4, 2, 128, "bfloat16", True, "nopingpong"),
        (2, 2048, 4, 2, 128, "bfloat16", True, "kv64s4"),
    ]
    first_ok = None
    for (b, s, hq, hkv, d, dt, causal, cfg_name) in cases:
        name = f"correct b{b} s{s} hq{hq} hkv{hkv} d{d} {dt} {'causal' if causal else 'full'}"
        if cfg_name:
            name += f" cfg={cfg_name}"
        if mosaic is None:
            rec.row("SKIP", name, reason="mosaic module did not import")
            continue

        def run_case(b=b, s=s, hq=hq, hkv=hkv, d=d, dt=dt, causal=causal, cfg_name=cfg_name,
                     name=name):
            dtype = jnp.dtype(dt)
            q, k, v = inputs(b, s, hq, hkv, d, dtype)
            spec = make_spec(q, k, causal)
            cfg = _named_config(mosaic, cfg_name, d)
            t0 = time.monotonic()
            out, st = jit_mosaic(spec, cfg)(q, k, v)
            out = jax.block_until_ready(out)
            lse = np.asarray(stats_mod.to_lse(spec, st))
            compile_run_s = time.monotonic() - t0
            out = np.asarray(out.astype(jnp.float32))
            ref_o, ref_lse = pf.reference_attention(q, k, v, causal=causal, return_lse=True)
            ref_o = np.asarray(ref_o.astype(jnp.float32))
            ref_lse = np.asarray(ref_lse)
            fields = dict(err_o_ref=rel(out, ref_o), err_lse_ref=rel(lse, ref_lse),
                          compile_run_s=compile_run_s,
                          nan_o=int(np.isnan(out).sum()), nan_lse=int(np.isnan(lse).sum()))
            if triton_forward is not None:
                try:
                    t_out, t_st = jit_triton(spec)(q, k, v)
                    t_lse = np.asarray(stats_mod.to_lse(spec, t_st))
                    fields.update(err_o_triton=rel(out, np.asarray(t_out.astype(jnp.float32))),
                                  err_lse_triton=rel(lse, t_lse),
                                  err_triton_vs_ref=rel(np.asarray(t_out.astype(jnp.float32)),
                                                        ref_o))
                except Exception as exc:  # noqa: BLE001
                    fields["triton_error"] = " | ".join(error_lines(exc, 3))
            tol = TOL[dt]
            bad = [key for key in ("err_o_ref", "err_lse_ref", "err_o_triton", "err_lse_triton")
                   if key in fields and not fields[key] <= tol]
            if bad:
                where = _first_bad_rows(out, ref_o)
                rec.row("FAIL", name, tol=tol, over_tol=bad, worst_rows=where, **fields)
                rec.note_failure(
                    name, f"numerical mismatch {fields}\n"
                          f"worst (batch, seq, head) rows of |O - ref|: {where}",
                    first_text=f"numerical mismatch, tol {tol}: {fields}\nworst rows: {where}")
                return False
            rec.row("PASS", name, tol=tol, **fields)
            return True

        ok = guarded(name, run_case, min_left=45.0)
        if ok and first_ok is None:
            first_ok = name

    # ---- 2. speed ---------------------------------------------------------------------------
    b, s, h, d = 2, 8192, 16, 128
    for causal in (False, True):
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        tag = f"{b}x{s}x{h}x{h}x{d} bf16 {'causal' if causal else 'full'}"
        q, k, v = inputs(b, s, h, h, d, jnp.bfloat16, seed=1)
        spec = make_spec(q, k, causal)
        impls = []
        if mosaic is not None:
            for cfg_name in (None, "nopingpong", "kv64s4"):
                impls.append((f"mosaic[{cfg_name or 'default'}]",
                              lambda cfg_name=cfg_name: jit_mosaic(
                                  spec, _named_config(mosaic, cfg_name, d))))
        if triton_forward is not None:
            impls.append(("triton", lambda: jit_triton(spec)))
        impls.append(("cudnn", lambda causal=causal: jax.jit(
            lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, implementation="cudnn"))))
        for impl_name, build in impls:
            check = f"speed {tag} {impl_name}"

            def bench(build=build):
                first_s, best = timed(build(), (q, k, v), args.iters)
                ms = best * 1e3
                rec.row("PASS", check, ms=ms, tflops=flops / (ms * 1e-3) / 1e12,
                        first_call_s=first_s)

            guarded(check, bench, min_left=8.0)

    return rec.finish()


def _import_mosaic():
    import importlib
    return importlib.import_module("pallas_flash.mosaic.forward")


def _import_triton():
    import importlib
    return importlib.import_module("pallas_flash.triton.forward").forward


def _named_config(mosaic, name, head_dim):
    base = mosaic.default_forward_config(head_dim)
    if name is None:
        return None
    import dataclasses
    if name == "nopingpong":
        return dataclasses.replace(base, pingpong=False)
    if name == "kv64s4":
        return dataclasses.replace(base, block_kv=64, stages=4 if head_dim <= 128 else 2)
    raise ValueError(name)


def _first_bad_rows(out, ref, n=5):
    """The (batch, seq, head) rows with the largest error: tells a mask or tiling bug apart."""
    err = np.abs(out - ref).max(axis=-1)
    flat = np.argsort(err, axis=None)[::-1][:n]
    return [(tuple(int(i) for i in np.unravel_index(j, err.shape)), float(err.flat[j]))
            for j in flat]


if __name__ == "__main__":
    sys.exit(main())
