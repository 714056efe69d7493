"""Compile the Mosaic forward for a few configs, or the backward with its default config,
with ptxas' report on (registers, spills and wgmma serialization warnings), and time each
once: the tool for "why is this config slow?".

    MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_TO=$OUT/dump \
        PYTHONPATH=. python3 benchmarks/mosaic_ptxas.py --head-dim 128 [--kernel bwd --causal 1,0]

(Mosaic GPU reads the MOSAIC_GPU_DUMP_* variables from the environment when it compiles.)
"""

from __future__ import annotations

import argparse
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import pallas_flash as pf  # noqa: E402
from benchmarks.check_log import timed  # noqa: E402
from benchmarks.mosaic_tune import named_configs  # noqa: E402
from pallas_flash.masking import make_mask_spec  # noqa: E402
from pallas_flash.mosaic import backward as mb  # noqa: E402
from pallas_flash.mosaic import forward as mf  # noqa: E402
from pallas_flash.spec import AttentionSpec  # noqa: E402
from pallas_flash.triton import forward as tf  # noqa: E402


def backward_report(d: int, s: int, h: int, causal: bool):
    """The default Mosaic backward (the fused kernel at head_dim 64 / 128), compiled and timed."""
    q, k, v, do = (jax.random.normal(key, (2, s, h, d), jnp.float32).astype(jnp.bfloat16)
                   for key in jax.random.split(jax.random.key(0), 4))
    spec = AttentionSpec(mask=make_mask_spec(s, s, causal=causal), scale=1 / math.sqrt(d),
                         softcap=None, has_segments=False, precision=lax.Precision.DEFAULT,
                         config=pf.default_config(d, jnp.bfloat16), interpret=False)
    out, st = jax.jit(lambda q, k, v: tf.forward(spec, q, k, v))(q, k, v)
    cfg = mb.default_backward_config(d)
    print(f"=== backward causal={causal} {cfg}", flush=True)
    fn = jax.jit(lambda *a: mb.backward(spec, *a, config=cfg))
    _, t = timed(fn, (q, k, v, out, st, do, st.m), 10)
    flops = 2.5 * 4 * 2 * h * s * s * d * (0.5 if causal else 1.0)
    print(f"=== {t * 1e3:.3f} ms, {flops / t / 1e12:.1f} TFLOP/s", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--block-kv", type=int, default=128)
    p.add_argument("--overlap", default="0,1", help="forward: 0 / 1 (ping-pong otherwise), "
                   "or 'default' for the default config; comma list")
    p.add_argument("--configs", default=None,
                   help="forward: ';'-separated overrides of the call's default config "
                        "(mosaic_tune.py --fwd-configs), instead of --block-kv / --overlap")
    p.add_argument("--kernel", choices=("fwd", "bwd"), default="fwd")
    p.add_argument("--causal", default="1,0", help="backward only")
    args = p.parse_args()
    d, s, h = args.head_dim, args.seq, {64: 32, 128: 16, 256: 8}[args.head_dim]
    if args.kernel == "bwd":
        for causal in (bool(int(x)) for x in args.causal.split(",")):
            backward_report(d, s, h, causal)
        return
    q, k, v = (jax.random.normal(key, (2, s, h, d), jnp.float32).astype(jnp.bfloat16)
               for key in jax.random.split(jax.random.key(0), 3))
    spec = AttentionSpec(mask=make_mask_spec(s, s, causal=False), scale=1 / math.sqrt(d),
                         softcap=None, has_segments=False, precision=lax.Precision.DEFAULT,
                         config=pf.default_config(d, jnp.bfloat16), interpret=False)
    if args.configs is not None:
        configs = named_configs(mf.default_forward_config(d, spec), args.configs)
    else:
        # "default": the head_dim's default config, as users run it.
        configs = [mf.default_forward_config(d) if ov == "default"
                   else mf.MosaicForwardConfig(block_kv=args.block_kv, overlap=bool(int(ov)))
                   for ov in args.overlap.split(",")]
    for cfg in configs:
        print(f"=== {cfg}", flush=True)
        fn = jax.jit(lambda q, k, v, cfg=cfg: mf.forward(spec, q, k, v, config=cfg))
        _, t = timed(fn, (q, k, v), 10)
        print(f"=== {t * 1e3:.3f} ms, {4 * 2 * h * s * s * d / t / 1e12:.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
