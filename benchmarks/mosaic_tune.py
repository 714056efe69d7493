"""Tile sweep for the Mosaic GPU kernels (sm_90), each kernel timed alone, cuDNN in the same run.

    PYTHONPATH=. python3 benchmarks/mosaic_tune.py --head-dims 128 --passes fwd,bwd --out DIR

For each head_dim, at the benchmark's shape for it (batch 2 or --batch, seq 8192; 16 heads at head_dim 128,
32 at 64, 8 at 256), bf16, causal and not, it times
  - the Mosaic forward (`pallas_flash.mosaic.forward.forward`) for every candidate
    MosaicForwardConfig that fits shared memory, and cuDNN's forward;
  - the Mosaic backward alone (O and row statistics precomputed by the Triton forward) for every
    candidate MosaicBackwardConfig, and cuDNN's backward (its vjp, residuals precomputed).
Timing: one call to compile, then the best of 3 averages of --iters back-to-back calls, device
synchronised. TFLOP/s use the benchmark's count (forward 2*B*H*S^2*(D+Dv), halved for causal;
backward 2.5x). Every row is printed as it completes and the JSON (<out>/mosaic_tune_<dims>.json)
is rewritten after each, so a run cut by its time limit keeps what it measured. A config that
fails to compile or run is a row with its error, not the end of the run. docs/tuning.md says
how a winner becomes a default in pallas_flash/mosaic/config.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import pallas_flash as pf  # noqa: E402
from pallas_flash.masking import make_mask_spec  # noqa: E402
from pallas_flash.mosaic import backward as mb  # noqa: E402
from pallas_flash.mosaic import config as mc  # noqa: E402
from pallas_flash.mosaic import forward as mf  # noqa: E402
from pallas_flash.mosaic.config import SMEM_LIMIT  # noqa: E402
from pallas_flash.spec import AttentionSpec  # noqa: E402
from pallas_flash.triton import forward as tf  # noqa: E402

HEADS = {64: 32, 128: 16, 256: 8}  # other head dims: 16 up to 160, else 8 (the benchmark's)
# Register budgets of a forward with three compute warpgroups (3 * 160 + 32 = 512 =
# register_budget(4); FlashAttention-3's split). --fwd-registers is for two.
THREE_WG_REGISTERS = (160, 32)



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

def forward_candidates(head_dim: int, *, stages=None, pingpong=(True, False),
                       overlap=(False, True), registers=((232, 40),), cluster=(1,), block_kvs=None,
                       compute_wgs=(2,)) -> list[mc.MosaicForwardConfig]:
    kvs = block_kvs or {64: (128, 256), 128: (64, 128, 192), 256: (64, 128)}[head_dim]
    stage_counts = stages or ((2, 3) if head_dim == 64 else (2, 3, 4))
    out = []
    for block_kv, n_stages, pp, ov, regs, n_cluster, wgs in itertools.product(
            kvs, stage_counts, pingpong, overlap, registers, cluster, compute_wgs):
        if wgs == 3:
            if pp:      # ping-pong pairs exactly two warpgroups (MosaicForwardConfig)
                continue
            regs = THREE_WG_REGISTERS
        compute, copy = regs
        cfg = mc.MosaicForwardConfig(block_q=64, block_kv=block_kv, stages=n_stages,
                                     pingpong=pp, overlap=ov, compute_registers=compute,
                                     copy_registers=copy, cluster=n_cluster, compute_wgs=wgs)
        # Three warpgroups ignore the --fwd-registers list: one candidate, not one per entry.
        if cfg.smem_bytes(head_dim) <= SMEM_LIMIT and cfg not in out:
            out.append(cfg)
    return out


def backward_candidates(head_dim: int) -> list[mc.MosaicBackwardConfig]:
    out = []
    wgs = (1,) if head_dim > 128 else (1, 2)
    stage_counts = (2,) if head_dim == 64 else (2, 3)
    for bq, bkv, stages, dq_wgs in itertools.product((64, 128), (64, 128), stage_counts, wgs):
        cfg = mc.MosaicBackwardConfig(dkdv_block_q=bq, dq_block_kv=bkv, dkdv_stages=stages,
                                      dq_stages=stages, dq_compute_wgs=dq_wgs)
        if max(cfg.dkdv_smem_bytes(head_dim), cfg.dq_smem_bytes(head_dim)) <= SMEM_LIMIT:
            out.append(cfg)
    return out


def field_value(base, name: str, text: str):
    """`text` as the type of config field `name`: 0/1 for bools, "none" for an optional field
    (whose default is None, e.g. fused_head_chunk) left to its rule, else the default's type."""
    default = getattr(base, name)
    if text.lower() == "none":
        return None
    if isinstance(default, bool):
        return bool(int(text))
    if default is None:
        return int(text)
    return type(default)(text)


def named_configs(base, text: str) -> list:
    """Configs from ';'-separated 'field=value,...' overrides of `base` (an empty item is
    `base` itself, so a list can time the default more than once)."""
    out = []
    for item in text.split(";"):
        fields = {}
        for pair in filter(None, item.split(",")):
            name, value = pair.split("=")
            fields[name] = field_value(base, name, value)
        out.append(dataclasses.replace(base, **fields))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dims", default="64,128,256")
    p.add_argument("--passes", default="fwd,bwd")
    p.add_argument("--causal", default="0,1", help="comma list of 0/1")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seq", default="8192",
                   help="sequence length, or a comma list (e.g. 4096,8192,16384: per-step and "
                        "per-CTA costs separate across lengths)")
    p.add_argument("--heads", type=int, default=None, help="q heads (default: the head_dim's)")
    p.add_argument("--head-dim-v", type=int, default=None,
                   help="V's head_dim where it differs from Q/K's (MLA, e.g. 128 at 192)")
    p.add_argument("--group", type=int, default=1, help="q heads per kv head (GQA)")
    p.add_argument("--batch", type=int, default=2,
                   help="batch size (1 for the batch-1 launch order, fused_head_chunk)")
    p.add_argument("--fwd-stages", default=None, help="forward stage counts, e.g. 2,3")
    p.add_argument("--fwd-pingpong", default="1,0", help="forward ping-pong, comma list of 0/1")
    p.add_argument("--fwd-overlap", default="0,1", help="forward overlap, comma list of 0/1")
    p.add_argument("--fwd-registers", default="232/40",
                   help="forward compute/copy register budgets, e.g. 232/40,240/24")
    p.add_argument("--fwd-cluster", default="1",
                   help="forward CTAs per cluster (1, 2 or 4), e.g. 1,2,4")
    p.add_argument("--fwd-block-kv", default=None, help="forward key blocks, e.g. 128")
    p.add_argument("--fwd-compute-wgs", default="2",
                   help="forward compute warpgroups, e.g. 2,3 (3: registers 160/32, no "
                        "ping-pong)")
    p.add_argument("--fwd-configs", default=None,
                   help="forward configs instead of the sweep: ';'-separated overrides of the "
                        "call's default (default_forward_config with its spec), e.g. "
                        "';block_kv=176,compute_registers=240,copy_registers=24'")
    p.add_argument("--bwd-configs", default=None,
                   help="backward configs instead of the sweep: ';'-separated overrides of the "
                        "head_dim's default, e.g. ';fused=1,dkdv_stages=2' (empty = the default)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    dims = [int(x) for x in args.head_dims.split(",")]
    passes = args.passes.split(",")

    def flags(text):
        return tuple(bool(int(x)) for x in text.split(","))

    def ints(text):
        return tuple(int(x) for x in text.split(","))

    fwd_space = dict(
        stages=tuple(int(x) for x in args.fwd_stages.split(",")) if args.fwd_stages else None,
        pingpong=flags(args.fwd_pingpong), overlap=flags(args.fwd_overlap),
        registers=tuple(tuple(int(x) for x in r.split("/")) for r in args.fwd_registers.split(",")),
        cluster=ints(args.fwd_cluster),
        block_kvs=ints(args.fwd_block_kv) if args.fwd_block_kv else None,
        compute_wgs=ints(args.fwd_compute_wgs))
    path = os.path.join(args.out, f"mosaic_tune_{'_'.join(map(str, dims))}.json")
    dev = jax.devices()[0]
    record = {"device": dev.device_kind, "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": []}

    def emit(**row):
        record["rows"].append(row)
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        with open(path, "w") as f:
            json.dump(record, f, indent=1)

    for d, s in itertools.product(dims, (int(x) for x in args.seq.split(","))):
        b, h = args.batch, args.heads or HEADS.get(d, 16 if d <= 160 else 8)
        hkv = h // args.group
        dv = args.head_dim_v or d
        ks = jax.random.split(jax.random.key(d), 4)
        q, k, v, do = (jax.random.normal(kk, (b, s, hh, dd), jnp.float32).astype(jnp.bfloat16)
                       for kk, hh, dd in zip(ks, (h, hkv, hkv, h), (d, d, dv, dv)))
        dlse = jnp.zeros((b, h, s), jnp.float32)
        for causal in (bool(int(c)) for c in args.causal.split(",")):
            # 2 (d + dv) FLOPs per attended pair: the benchmark's count.
            fwd_flops = 2 * b * h * s * s * (d + dv) / (2 if causal else 1)
            spec = AttentionSpec(mask=make_mask_spec(s, s, causal=causal),
                                 scale=1.0 / math.sqrt(d), softcap=None, has_segments=False,
                                 precision=lax.Precision.DEFAULT,
                                 config=pf.default_config(d, jnp.bfloat16, head_dim_v=dv),
                                 interpret=False)
            shape = f"{b}x{s}x{h}x{hkv}x{d}" + (f"x{dv}" if dv != d else "")
            base = dict(head_dim=d, causal=causal, shape=shape)

            def run(pass_, impl, build, flops, **extra):
                try:
                    fn, fargs = build()
                    first, t = timed(fn, fargs, args.iters)
                    emit(**base, pass_=pass_, impl=impl, **extra, ms=round(t * 1e3, 4),
                         tflops=round(flops / t / 1e12, 1), first_s=round(first, 1))
                except Exception as e:  # noqa: BLE001 - a failing config is a result row
                    msg = " | ".join(str(e).strip().splitlines()[:2])[:300]
                    emit(**base, pass_=pass_, impl=impl, **extra,
                         error=f"{type(e).__name__}: {msg}")

            if "fwd" in passes:
                run("fwd", "cudnn", lambda: (jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, is_causal=causal, implementation="cudnn")), (q, k, v)), fwd_flops)
                for cfg in (forward_candidates(d, **fwd_space) if args.fwd_configs is None
                            else named_configs(mc.default_forward_config(d, spec),
                                               args.fwd_configs)):
                    run("fwd", "mosaic", lambda cfg=cfg: (jax.jit(
                        lambda q, k, v: mf.forward(spec, q, k, v, config=cfg)), (q, k, v)),
                        fwd_flops, config=repr(cfg))
            if "bwd" in passes:
                out, st = jax.block_until_ready(
                    jax.jit(lambda q, k, v: tf.forward(spec, q, k, v))(q, k, v))

                def cudnn_bwd():
                    _, vjp = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(
                        q, k, v, is_causal=causal, implementation="cudnn"), q, k, v)
                    return jax.jit(lambda vjp, do: vjp(do)), (vjp, do)

                run("bwd", "cudnn", cudnn_bwd, 2.5 * fwd_flops)
                for cfg in (backward_candidates(d) if args.bwd_configs is None
                            else named_configs(mc.default_backward_config(d),
                                               args.bwd_configs)):
                    run("bwd", "mosaic", lambda cfg=cfg: (jax.jit(
                        lambda *a: mb.backward(spec, *a, config=cfg)),
                        (q, k, v, out, st, do, dlse)), 2.5 * fwd_flops, config=repr(cfg))
    # The best Mosaic config per (shape, causal, pass), as a summary.
    best = {}
    for r in record["rows"]:
        if r["impl"] == "mosaic" and "tflops" in r:
            key = (r["shape"], r["causal"], r["pass_"])
            if key not in best or r["tflops"] > best[key]["tflops"]:
                best[key] = r
    cud = {(r["shape"], r["causal"], r["pass_"]): r.get("tflops")
           for r in record["rows"] if r["impl"] == "cudnn"}
    print("\nbest per case:")
    for key, r in sorted(best.items()):
        c = cud.get(key)
        ratio = f"{r['tflops'] / c:.2f}" if c else "-"
        print(f"  {key[0]} {'causal' if key[1] else 'full  '} {key[2]}: {r['tflops']} TFLOP/s "
              f"(cuDNN {c}, x{ratio}) {r['config']}")


if __name__ == "__main__":
    main()
