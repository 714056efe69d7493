"""Input checks shared by `flash_attention` and `reference_attention`.

Everything here runs in Python on shapes and dtypes (and on the values of segment ids and
lengths wider than int32, where they are known), before any kernel is traced, and raises a
ValueError that names the argument and says what was expected. Kernels never validate.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flash.masking import PAD_KEY_ID, PAD_QUERY_ID

MAX_HEAD_DIM = 256
_FLOAT_DTYPES = tuple(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64))
_ALIGNMENTS = ("top_left", "bottom_right")


class Options(NamedTuple):
    """Validated, normalised options."""

    scale: float
    window: tuple[int | None, int | None] | None
    softcap: float | None


def _shape_of(name, x):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    return tuple(x.shape)


def _check_ids(name, x, batch, seq, *, lengths=False):
    shape = _shape_of(name, x)
    want = (batch,) if lengths else (batch, seq)
    what = "[batch]" if lengths else "[batch, seq]"
    if shape != want:
        raise ValueError(f"{name} must have shape {what} = {want}, got {shape}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must have an integer dtype, got {x.dtype}")
    # The kernels take int32 (ids 2**31 - 2 and up mark padding). A wider dtype's values are
    # checked where they are known, so that none wraps into another document or length;
    # int32 needs no check, and under jit the values are not known.
    if jnp.iinfo(x.dtype).max > _INT32_MAX and not isinstance(x, jax.core.Tracer):
        values = np.asarray(x)
        top = _INT32_MAX if lengths else _RESERVED_ID - 1
        if values.size and (values.min() < -_INT32_MAX - 1 or values.max() > top):
            raise ValueError(f"{name} must hold values from {-_INT32_MAX - 1} to {top} (the "
                             f"kernels take int32), got {values.min()} to {values.max()}")


def is_int(x) -> bool:
    """A Python or numpy integer, not a bool (shared by every module that checks int options)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


_F32_TINY, _F32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
_INT32_MAX = 2**31 - 1
# The smallest segment id that masking.py reserves for padding.
_RESERVED_ID = min(PAD_KEY_ID, PAD_QUERY_ID)
MAX_WINDOW = 1 << 30


def scale_is_served(scale: float) -> bool:
    """Whether the kernels take this logit scale: positive, and a normal float32."""
    return _F32_TINY <= scale <= _F32_MAX


def validate(q, k, v, *, causal, scale, causal_alignment, window, softcap, q_segment_ids,
             kv_segment_ids, q_lengths, kv_lengths, v_head_dim_may_differ=False) -> Options:
    """v_head_dim_may_differ: the caller serves a V head_dim other than Q/K's (MLA); an entry
    point that does not leaves it False and gets a ValueError for such a v."""
    shapes = {name: _shape_of(name, x) for name, x in (("q", q), ("k", k), ("v", v))}
    for name, shape in shapes.items():
        if len(shape) != 4:
            raise ValueError(
                f"{name} must have rank 4 [batch, seq, heads, head_dim], got shape {shape}"
            )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(x.dtype) not in _FLOAT_DTYPES:
            raise ValueError(
                f"{name} must be bfloat16, float16, float32 or float64, got dtype {x.dtype}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}"
        )
    (batch, seq_q, q_heads, head_dim) = shapes["q"]
    (_, seq_kv, kv_heads, _) = shapes["k"]
    head_dim_v = shapes["v"][3]
    for name in ("k", "v"):
        if shapes[name][0] != batch:
            raise ValueError(
                f"{name} batch size {shapes[name][0]} does not match q batch size {batch} "
                f"(q {shapes['q']}, {name} {shapes[name]})"
            )
    if shapes["k"][3] != head_dim:
        raise ValueError(
            f"k head_dim {shapes['k'][3]} does not match q head_dim {head_dim} "
            f"(q {shapes['q']}, k {shapes['k']})"
        )
    if head_dim_v != head_dim and not v_head_dim_may_differ:
        raise ValueError(
            f"v head_dim {head_dim_v} does not match q head_dim {head_dim} (q {shapes['q']}, "
            f"v {shapes['v']}): this entry point takes one head_dim (flash_attention takes a "
            f"V head_dim of its own)"
        )
    if shapes["v"][1:3] != shapes["k"][1:3]:
        raise ValueError(
            f"v must have the seq_kv and kv_heads of k, got k {shapes['k']} and v {shapes['v']}"
        )
    if min(seq_q, seq_kv, q_heads, kv_heads, head_dim, head_dim_v, batch) < 1:
        raise ValueError(
            f"every dimension must be >= 1, got q {shapes['q']}, k {shapes['k']}, "
            f"v {shapes['v']}"
        )
    for name, dim in (("q", head_dim), ("v", head_dim_v)):
        if dim > MAX_HEAD_DIM:
            raise ValueError(f"{name} head_dim must be <= {MAX_HEAD_DIM}, got {dim} "
                             f"({name} {shapes[name]})")
    if q_heads % kv_heads != 0:
        raise ValueError(
            f"the number of q heads ({q_heads}) must be a multiple of the number of kv heads "
            f"({kv_heads}) for GQA/MQA (q {shapes['q']}, k {shapes['k']})"
        )

    if not isinstance(causal, (bool, np.bool_)):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if causal_alignment not in _ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {_ALIGNMENTS}, got {causal_alignment!r}")

    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise ValueError(f"scale must be a Python float (a static value), got {scale!r}")
    scale = float(scale)
    if not scale_is_served(scale):
        # The kernels keep each row's running maximum of the unscaled logits q.k, which is the
        # maximum of the scaled ones only for a positive scale; they compute in float32.
        raise ValueError(f"scale must be positive and a normal float32 ({_F32_TINY:.3g} to "
                         f"{_F32_MAX:.3g}), got {scale}")

    if window is not None:
        if not (isinstance(window, (tuple, list)) and len(window) == 2):
            raise ValueError(f"window must be a (left, right) pair, got {window!r}")
        for side, w in zip(("left", "right"), window):
            if w is not None and not (is_int(w) and w >= 0):
                raise ValueError(f"window {side} must be None or an int >= 0, got {w!r}")
        # A side of MAX_WINDOW or more bounds nothing a sequence the kernels take can reach;
        # clamped there, position +- window stays in the masks' int32 arithmetic.
        window = tuple(None if w is None else min(int(w), MAX_WINDOW) for w in window)
        if window == (None, None):
            window = None

    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap,
                                                       (int, float, np.floating, np.integer)):
            raise ValueError(f"softcap must be None or a positive float, got {softcap!r}")
        softcap = float(softcap)
        if not (math.isfinite(softcap) and softcap > 0):
            raise ValueError(f"softcap must be None or a positive float, got {softcap}")

    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    if q_segment_ids is not None:
        _check_ids("q_segment_ids", q_segment_ids, batch, seq_q)
        _check_ids("kv_segment_ids", kv_segment_ids, batch, seq_kv)
    if q_lengths is not None:
        _check_ids("q_lengths", q_lengths, batch, seq_q, lengths=True)
    if kv_lengths is not None:
        _check_ids("kv_lengths", kv_lengths, batch, seq_kv, lengths=True)
    return Options(scale=scale, window=window, softcap=softcap)
