"""dot_product_attention: a drop-in for `jax.nn.dot_product_attention` that runs our kernels.

    out = pallas_flash.dot_product_attention(q, k, v, is_causal=True)   # same call as jax.nn

Same parameters, shapes, defaults and results as `jax.nn.dot_product_attention` (jax 0.11), with
`implementation=None` meaning "our Pallas kernels where they can serve the call, XLA where they
cannot". Everything the kernels do not implement (a dense `bias`, a dense boolean `mask`, ...)
is handed, unchanged, to ``jax.nn.dot_product_attention(..., implementation="xla")``; the list
is in the docstring below. The only numerical difference from jax.nn is for query rows that see
no key at all (see "Rows that see no key" below).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_flash.attention import flash_attention
from pallas_flash.config import FlashConfig
from pallas_flash.validation import MAX_HEAD_DIM

__all__ = ["dot_product_attention", "IMPLEMENTATIONS"]

# None: the kernels, falling back to XLA for what they cannot serve. "pallas": the kernels or a
# ValueError. "xla" / "cudnn": jax.nn.dot_product_attention with that implementation, verbatim.
IMPLEMENTATIONS = (None, "pallas", "xla", "cudnn")

_KERNEL_DTYPES = tuple(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))


def dot_product_attention(
    query: jax.typing.ArrayLike,
    key: jax.typing.ArrayLike,
    value: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    mask: jax.typing.ArrayLike | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.typing.ArrayLike | None = None,
    key_value_seq_lengths: jax.typing.ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
    precision: Any = None,
    config: FlashConfig | None = None,
):
    r"""Scaled dot-product attention with the signature of `jax.nn.dot_product_attention`.

    Computes ``softmax(scale * Q K^T + bias, masked) V`` for each head. Letters as in jax.nn:
    B batch, T query length, S key/value length, N query heads, K key/value heads (N a multiple
    of K: MHA, GQA, MQA), H head dim.

    Args:
      query: [B, T, N, H] or [T, N, H] (no batch).
      key, value: [B, S, K, H] or [S, K, H]; same dtype as query.
      bias: optional additive logits bias broadcastable to [B, N, T, S]. **Served by XLA.**
      mask: optional boolean mask broadcastable to [B, N, T, S], True = attend. **Served by
        XLA.** Prefer `is_causal`, the lengths and `local_window_size`, which the kernels
        serve without materialising a [T, S] mask.
      scale: logit multiplier; default 1/sqrt(H).
      is_causal: query i sees keys j <= i (top-left aligned, also when T != S).
      query_seq_lengths: int [B] valid query lengths. Rows t >= length give output 0 and
        gradient 0, exactly as in jax.nn.
      key_value_seq_lengths: int [B] valid key/value lengths; keys s >= length are never seen.
      local_window_size: (left, right) or an int w meaning (w, w): query i sees keys
        i - left <= j <= i + right. With `is_causal` the right side is clamped to 0.
      implementation: None (default): the Pallas kernels, or XLA for what they cannot serve
        (list below). "pallas": the kernels only; a call they cannot serve raises ValueError.
        "xla" or "cudnn": `jax.nn.dot_product_attention` with that implementation, unchanged.
      return_residual: also return the logsumexp of each row's scaled logits, shape [B, T, N]
        (or [T, N]), in key's dtype, with its gradient stopped (as in jax.nn).
      precision: (extension, kernel path only) matmul precision for float32 inputs, as in
        `flash_attention`: None/"default" (tf32 on GPUs, like XLA's default) or "highest".
      config: (extension, kernel path only) a `FlashConfig` of kernel tiles.

    Returns:
      The output, shaped like `query` and in its dtype; with `return_residual`, the pair
      (output, residual).

    What falls back to XLA (``implementation=None``), where
    ``jax.nn.dot_product_attention(..., implementation="xla")`` gets the arguments unchanged:

    * a `bias` or a `mask` (dense arrays: the kernels take only structured masking);
    * a dtype other than bfloat16, float16 or float32 (float64 too runs on the kernels when
      they run in interpret mode, i.e. without a GPU);
    * a head dim H above 256;
    * a `scale` that is traced, zero or not finite (the kernels need a static non-zero float);
    * a `local_window_size` with a negative side (e.g. (w, -1): strictly earlier keys).

    Rows that see no key: a row whose keys are all masked out (``key_value_seq_lengths`` 0, or
    a window that excludes every key) gets output 0, zero gradients and residual -inf from the
    kernels. jax.nn masks with a large finite negative number instead, so there the same row
    gets the *mean of all S values, padded ones included*, and a residual near -2.4e38 (-inf
    in float16); we consider 0 the meaningful answer and do not reproduce that. Padded query
    rows (t >= query_seq_lengths) are not affected by this: they are 0 in both, with zero
    gradient, but their residual is -inf here and about -2.4e38 in jax.nn. Calls that fall
    back to XLA give jax.nn's results in every case.

    Differences in what is accepted: the lengths may be any integer dtype (jax.nn wants int32);
    inputs of rank 1 or 2, which jax.nn silently pads with leading axes, are rejected.

    Raises:
      ValueError: on shapes, dtypes or options that jax.nn would also reject, on an unknown
        `implementation`, and with implementation="pallas" on a call the kernels cannot serve.
    """
    if not (implementation is None or isinstance(implementation, str)) or (
            implementation not in IMPLEMENTATIONS):
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}"
        )
    if implementation in ("xla", "cudnn"):
        return jax.nn.dot_product_attention(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size, implementation=implementation,
            return_residual=return_residual,
        )

    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    output_shape = query.shape
    q4, k4, v4 = (_ensure_4d(name, x) for name, x in
                  (("query", query), ("key", key), ("value", value)))
    batch, _, q_heads, head_dim = q4.shape
    _, _, kv_heads, _ = k4.shape
    if v4.shape != k4.shape:
        raise ValueError(f"value must have the shape of key, got key {key.shape} and value "
                         f"{value.shape}")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"query, key and value must share one dtype, got query {query.dtype}, "
                         f"key {key.dtype}, value {value.dtype}")
    if k4.shape[0] != batch or k4.shape[3] != head_dim:
        raise ValueError(
            f"query and key must agree on batch size and head dim (B and H of [B, T, N, H] and "
            f"[B, S, K, H]), got query {query.shape} and key {key.shape}"
        )
    if q_heads % kv_heads != 0:
        raise ValueError(
            f"the number of query heads ({q_heads}) must be a multiple of the number of "
            f"key/value heads ({kv_heads}), got query {query.shape} and key {key.shape}"
        )
    q_lengths = _lengths("query_seq_lengths", query_seq_lengths, batch)
    kv_lengths = _lengths("key_value_seq_lengths", key_value_seq_lengths, batch)
    window = _window(local_window_size)
    is_causal = bool(is_causal)
    return_residual = bool(return_residual)

    reasons = _unsupported(query.dtype, head_dim, bias, mask, scale, window)
    if reasons:
        if implementation == "pallas":
            raise ValueError(
                "implementation='pallas' cannot serve this call (" + "; ".join(reasons)
                + "); use implementation=None to let XLA serve it"
            )
        return jax.nn.dot_product_attention(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal,
            query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
            local_window_size=window, implementation="xla", return_residual=return_residual,
        )

    result = flash_attention(
        q4, k4, v4, causal=is_causal, scale=None if scale is None else float(scale),
        window=window, q_lengths=q_lengths, kv_lengths=kv_lengths,
        return_lse=return_residual, precision=precision, config=config,
    )
    if not return_residual:
        return result.reshape(output_shape)
    out, lse = result
    # lse is [B, N, T] float32; jax.nn's residual is [B, T, N] in key's dtype, gradient stopped.
    residual = lax.stop_gradient(jnp.swapaxes(lse, 1, 2).astype(key.dtype))
    return out.reshape(output_shape), residual.reshape(output_shape[:-1])


def _ensure_4d(name, x):
    if x.ndim == 4:
        return x
    if x.ndim == 3:
        return x[None]
    raise ValueError(
        f"{name} must have rank 4 [batch, seq, heads, head_dim] or rank 3 [seq, heads, "
        f"head_dim], got shape {x.shape}"
    )


def _lengths(name, lengths, batch):
    if lengths is None:
        return None
    lengths = jnp.asarray(lengths)
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(
            f"{name} must be an integer array of shape [B] = ({batch},), got shape "
            f"{lengths.shape} and dtype {lengths.dtype}"
        )
    return lengths.astype(jnp.int32)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _window(local_window_size):
    if local_window_size is None:
        return None
    if _is_int(local_window_size):
        return (int(local_window_size), int(local_window_size))
    if (isinstance(local_window_size, Sequence) and not isinstance(local_window_size, str)
            and len(local_window_size) == 2 and all(map(_is_int, local_window_size))):
        return tuple(int(w) for w in local_window_size)
    raise ValueError(
        f"local_window_size must be None, an int or a (left, right) pair of ints, got "
        f"{local_window_size!r}"
    )


def _static_scale_ok(scale) -> bool:
    if scale is None:
        return True
    if isinstance(scale, jax.core.Tracer) or isinstance(scale, (bool, np.bool_)):
        return False
    try:
        value = float(scale)
    except (TypeError, ValueError):
        return False
    return math.isfinite(value) and value != 0.0


def _unsupported(dtype, head_dim, bias, mask, scale, window) -> list[str]:
    """Why the kernels cannot serve a call; empty when they can."""
    reasons = []
    if bias is not None:
        reasons.append("a dense bias")
    if mask is not None:
        reasons.append("a dense mask")
    dtype = jnp.dtype(dtype)
    interpreting = jax.default_backend() != "gpu"
    if dtype not in _KERNEL_DTYPES and not (dtype == jnp.float64 and interpreting):
        reasons.append(f"dtype {dtype}")
    if head_dim > MAX_HEAD_DIM:
        reasons.append(f"head dim {head_dim} > {MAX_HEAD_DIM}")
    if not _static_scale_ok(scale):
        reasons.append(f"scale {scale!r} (the kernels need a static, finite, non-zero float)")
    if window is not None and min(window) < 0:
        reasons.append(f"local_window_size {window} with a negative side")
    return reasons
