"""Fingerprints of the Mosaic GPU kernels' jaxprs, for refactors made without a GPU.

    PYTHONPATH=. python3 benchmarks/jaxpr_fingerprint.py > before.txt
    (refactor)
    PYTHONPATH=. python3 benchmarks/jaxpr_fingerprint.py | diff before.txt -

Mosaic GPU lowers a kernel from its jaxpr alone, so a change under which every jaxpr below stays
the same (source lines do not enter a jaxpr) leaves the compiled kernels the same, and needs no
new compiled run. Any other kernel change does. Each line has two hashes: of the kernel
launches alone (their equations, bodies included), and of the whole program around them (the
XLA glue: padding, the D = rowsum(dO O) pass, casts); a change to the glue alone moves only
the second. The configs cover both backward designs (two kernels; fused, column split and
turns), the forward, masks, softcap, segment ids, partial tiles and both compile modes (sm_90
and interpret).
"""

from __future__ import annotations

import hashlib
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
from pallas_flash.masking import make_mask_spec  # noqa: E402
from pallas_flash.mosaic import backward as mb  # noqa: E402
from pallas_flash.mosaic import forward as mf  # noqa: E402
from pallas_flash.mosaic.config import MosaicBackwardConfig  # noqa: E402
from pallas_flash.spec import AttentionSpec  # noqa: E402
from pallas_flash.stats import RowStats  # noqa: E402

SEQ = 1001   # neither a multiple of the tiles nor of 8
FUSED_64 = MosaicBackwardConfig(dkdv_block_q=64, fused=True)
CASES = [
    # (head_dim, dtype, options, backward config or None for the default)
    (64, jnp.bfloat16, dict(causal=True), None),
    (64, jnp.bfloat16, dict(causal=True), FUSED_64),
    (256, jnp.float16, dict(), None),
    (128, jnp.bfloat16, dict(causal=True), None),
    (128, jnp.bfloat16, dict(window=(100, 50), softcap=30.0), None),
    (128, jnp.bfloat16, dict(causal=True), MosaicBackwardConfig(dkdv_block_q=64,
                                                                   dq_block_kv=64)),
    (128, jnp.bfloat16, dict(causal=True, window=(200, None), softcap=30.0,
                             has_segments=True), None),
    # No position mask: the fused kernel's head-major stream (with GQA; the cases above with a
    # mask take the block-major one).
    (128, jnp.bfloat16, dict(), None),
    (64, jnp.bfloat16, dict(), None),
]


def _spec(d, dtype, interpret, causal=False, window=None, softcap=None, has_segments=False):
    return AttentionSpec(mask=make_mask_spec(SEQ, SEQ, causal=causal, window=window),
                         scale=1.0 / math.sqrt(d), softcap=softcap, has_segments=has_segments,
                         precision=lax.Precision.DEFAULT, config=pf.default_config(d, dtype),
                         interpret=interpret)


def fingerprints():
    rows = []
    for interpret in (False, True):
        for d, dtype, opts, cfg in CASES:
            b, hq, hkv = 2, 4, 2
            q = jnp.zeros((b, SEQ, hq, d), dtype)
            k = v = jnp.zeros((b, SEQ, hkv, d), dtype)
            stats = RowStats(jnp.zeros((b, hq, SEQ), jnp.float32),
                             jnp.zeros((b, hq, SEQ), jnp.float32))
            spec = _spec(d, dtype, interpret, **opts)
            ids = (jnp.zeros((b, SEQ), jnp.int32),) * 2 if spec.has_segments else ()
            bwd = jax.make_jaxpr(lambda *a: mb.backward(spec, *a, config=cfg))(
                q, k, v, q, stats, q, stats.m, *ids)
            fwd = jax.make_jaxpr(lambda *a: mf.forward(spec, *a))(q, k, v, *ids)
            for name, jaxpr in (("bwd", bwd), ("fwd", fwd)):
                whole = hashlib.sha256(str(jaxpr).encode()).hexdigest()[:16]
                kernels = hashlib.sha256("\n".join(kernel_equations(jaxpr.jaxpr)).encode())
                rows.append(f"{kernels.hexdigest()[:16]} {whole} {name} interpret={interpret} "
                            f"d{d} {jnp.dtype(dtype).name} {opts} config={cfg}")
    return rows


def kernel_equations(jaxpr) -> list[str]:
    """The kernel launches (Pallas calls) in `jaxpr` and the jaxprs inside it, printed."""
    import jax.extend

    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("pallas_call", "mpmd_map"):
            out.append(str(eqn))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out.extend(kernel_equations(sub))
    return out


if __name__ == "__main__":
    print("\n".join(fingerprints()))
