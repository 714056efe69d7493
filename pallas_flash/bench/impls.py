"""The attention implementations the benchmark compares.

:data:`IMPLS` maps a name to ``fn(q, k, v, causal, **variant)``, where ``q`` is
``[batch, seq_q, q_heads, head_dim]`` and ``k, v`` are ``[batch, seq_kv, kv_heads, head_dim]``.
``variant`` holds the options of ``pallas_flash.flash_attention`` that a variant case uses
(segment ids, ``window``, ``softcap``); an implementation that cannot express one raises
:class:`NotApplicable` and its row reads ``n.a.``. "cudnn" and "xla" are
``jax.nn.dot_product_attention`` with that ``implementation=``, in the same process.
"""

from __future__ import annotations

import math
import re
from typing import Callable

import jax

import pallas_flash

DEFAULT_IMPLS = ("pallas_flash", "cudnn", "xla")


class NotApplicable(Exception):
    """The implementation cannot express this case; reported as 'n.a.'."""


def short_error(exc: BaseException) -> str:
    """One line that says what went wrong: 'OOM: could not allocate 60.30GiB' for XLA's
    out-of-memory errors, else the exception's type and first line."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        size = re.search(r"allocate ([0-9.]+ ?[KMGT]i?B)", text)
        return "OOM: could not allocate " + size.group(1) if size else f"OOM: {first[:180]}"
    msg = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return msg[:200]


def _pallas_flash(backend: str = "auto"):
    def fn(q, k, v, causal, **kw):
        try:
            return pallas_flash.flash_attention(q, k, v, causal=causal, backend=backend, **kw)
        except ValueError as e:
            # A forced backend that cannot serve the case says so before any launch.
            if backend != "auto" and "backend" in str(e):
                raise NotApplicable(str(e).splitlines()[0]) from e
            raise
    return fn


def pop_segment_mask(kw: dict):
    """The segment ids popped from kw as a dense [B, 1, Sq, Skv] boolean mask (None without),
    for APIs that take no segment ids: kw's DENSE_MASK when the caller built it (outside the
    timed function, as a model would hold it), else built here. 16k x 16k is 256 MiB of bool."""
    q_ids, kv_ids = kw.pop("q_segment_ids", None), kw.pop("kv_segment_ids", None)
    mask = kw.pop(DENSE_MASK, None)
    if mask is not None or q_ids is None:
        return mask
    return dense_segment_mask(q_ids, kv_ids)


# kw key of a dense mask built from the segment ids before the timed call (`pop_segment_mask`).
DENSE_MASK = "dense_segment_mask"


def dense_segment_mask(q_ids, kv_ids):
    return q_ids[:, None, :, None] == kv_ids[:, None, None, :]


def import_tokamax():
    """The tokamax module, or NotApplicable saying it is not importable."""
    try:
        import tokamax
    except ImportError as e:
        raise NotApplicable(f"tokamax is not importable ({short_error(e)})") from e
    return tokamax


def _jax_nn(implementation: str):
    def fn(q, k, v, causal, **kw):
        kw = dict(kw)
        window = None
        if kw.pop("softcap", None) is not None:
            raise NotApplicable("no softcap in jax.nn.dot_product_attention")
        if "window" in kw:
            window = tuple(kw.pop("window"))
        mask = pop_segment_mask(kw)
        if kw:
            raise NotApplicable(f"unsupported options {sorted(kw)}")
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=causal, local_window_size=window,
            implementation=implementation)
    return fn


def _jax_pallas_triton(q, k, v, causal, **kw):
    # Deprecated upstream module; imported lazily so its warning and any
    # future removal only matter when this implementation is asked for.
    from jax.experimental.pallas.ops.gpu import attention as jax_attention
    if q.shape[2] != k.shape[2]:
        raise NotApplicable("no GQA in jax.experimental.pallas.ops.gpu.attention.mha")
    # mha takes one segment-id array for queries and keys alike; our variant
    # cases are self-attention with identical q and kv ids.
    segment_ids = kw.pop("q_segment_ids", None)
    kw.pop("kv_segment_ids", None)
    kw.pop(DENSE_MASK, None)
    if kw:
        raise NotApplicable(f"unsupported options {sorted(kw)}")
    blocks = jax_attention.BlockSizes(block_q=128, block_k=64, block_q_dkv=64,
                                      block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
    return jax_attention.mha(q, k, v, segment_ids, sm_scale=1 / math.sqrt(q.shape[-1]),
                             causal=causal, block_sizes=blocks,
                             interpret=jax.default_backend() == "cpu")


def _tokamax(q, k, v, causal, **kw):
    """tokamax.dot_product_attention on its Pallas kernels (Mosaic, else Triton): its default
    list ends in XLA, which would time something else. Absent tokamax reads n.a."""
    tokamax = import_tokamax()
    kw = dict(kw)
    options = {"logits_soft_cap": kw.pop("softcap", None), "mask": pop_segment_mask(kw)}
    if "window" in kw:
        options["local_window_size"] = tuple(kw.pop("window"))
    if kw:
        raise NotApplicable(f"unsupported options {sorted(kw)}")
    return tokamax.dot_product_attention(q, k, v, is_causal=causal,
                                         implementation=("mosaic", "triton"), **options)


# name -> fn(q, k, v, causal, **variant_kwargs). Add entries to compare more.
IMPLS: dict[str, Callable[..., jax.Array]] = {
    "pallas_flash": _pallas_flash(),
    # Each backend forced, to compare them in one run (only when named in --impls).
    "pallas_flash_triton": _pallas_flash("triton"),
    "pallas_flash_mosaic": _pallas_flash("mosaic"),
    "cudnn": _jax_nn("cudnn"),
    "xla": _jax_nn("xla"),
    # Only when named in --impls: it has no GQA.
    "jax_pallas_triton": _jax_pallas_triton,
    # Only when named in --impls (and installed).
    "tokamax": _tokamax,
}
