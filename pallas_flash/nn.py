"""dot_product_attention: a drop-in for `jax.nn.dot_product_attention` that runs our kernels.

    out = pallas_flash.dot_product_attention(q, k, v, is_causal=True)   # same call as jax.nn

Same parameters, shapes, defaults and results as `jax.nn.dot_product_attention` (jax 0.11), with
`implementation=None` meaning "our Pallas kernels where they can serve the call, XLA where they
cannot", plus tokamax's `logits_soft_cap`. A dense boolean `mask` is served by the kernels when
it is causal, padding, packed segments or a product of these (`dense_mask.recognise` derives
the segment ids from the mask and checks them against it); everything else the kernels do not
implement is handed to XLA (`xla_attention.py`), with a warning, once per process, that XLA
materialises the T x S logits.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any, Literal, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_flash import dense_mask, validation, xla_attention
from pallas_flash.attention import flash_attention
from pallas_flash.config import FlashConfig
from pallas_flash.sinks import check_sinks
from pallas_flash.validation import MAX_HEAD_DIM

__all__ = ["dot_product_attention", "IMPLEMENTATIONS", "FallbackWarning"]

# None: the kernels, falling back to XLA for what they cannot serve. "pallas": the kernels or a
# ValueError. "xla" / "cudnn": jax.nn.dot_product_attention with that implementation, verbatim.
IMPLEMENTATIONS = (None, "pallas", "xla", "cudnn")

_KERNEL_DTYPES = tuple(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))

_UNRECOGNISED_MASK = "a mask that is not causal, padding, packed segments or their product"


class FallbackWarning(UserWarning):
    """A call to `dot_product_attention` is served by XLA instead of the flash kernels."""


# Reasons already warned about: each is reported once per process.
_WARNED: set[str] = set()


def _warn_fallback(reasons: dict[str, str], *, stacklevel: int = 3) -> None:
    new = [text for key, text in reasons.items() if key not in _WARNED]
    if not new:
        return
    _WARNED.update(reasons)
    warnings.warn(
        "pallas_flash.dot_product_attention falls back to XLA (" + "; ".join(new) + "), which "
        "materialises the attention logits, T x S per head, instead of running the flash "
        "kernels. Shown once per process for each reason.",
        FallbackWarning, stacklevel=stacklevel,
    )


def _warn_mask_fallback_at_run_time(branch) -> None:
    # Under vmap, a batched switch index reaches here for every element, taken or not.
    if np.any(np.asarray(branch) == dense_mask.FALLBACK):
        _warn_fallback({"mask": _UNRECOGNISED_MASK + ", found at run time"})


@overload
def dot_product_attention(
    query: jax.typing.ArrayLike, key: jax.typing.ArrayLike, value: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = ..., mask: jax.typing.ArrayLike | None = ..., *,
    scale: float | None = ..., is_causal: bool = ...,
    query_seq_lengths: jax.typing.ArrayLike | None = ...,
    key_value_seq_lengths: jax.typing.ArrayLike | None = ...,
    local_window_size: int | tuple[int, int] | None = ..., implementation: str | None = ...,
    return_residual: Literal[False] = ..., logits_soft_cap: float | None = ...,
    sinks: jax.typing.ArrayLike | None = ...,
    precision: Any = ..., config: FlashConfig | None = ...,
) -> jax.Array: ...


@overload
def dot_product_attention(
    query: jax.typing.ArrayLike, key: jax.typing.ArrayLike, value: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = ..., mask: jax.typing.ArrayLike | None = ..., *,
    scale: float | None = ..., is_causal: bool = ...,
    query_seq_lengths: jax.typing.ArrayLike | None = ...,
    key_value_seq_lengths: jax.typing.ArrayLike | None = ...,
    local_window_size: int | tuple[int, int] | None = ..., implementation: str | None = ...,
    return_residual: Literal[True], logits_soft_cap: float | None = ...,
    sinks: jax.typing.ArrayLike | None = ...,
    precision: Any = ..., config: FlashConfig | None = ...,
) -> tuple[jax.Array, jax.Array]: ...


@overload
def dot_product_attention(
    query: jax.typing.ArrayLike, key: jax.typing.ArrayLike, value: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = ..., mask: jax.typing.ArrayLike | None = ..., *,
    scale: float | None = ..., is_causal: bool = ...,
    query_seq_lengths: jax.typing.ArrayLike | None = ...,
    key_value_seq_lengths: jax.typing.ArrayLike | None = ...,
    local_window_size: int | tuple[int, int] | None = ..., implementation: str | None = ...,
    return_residual: bool = ..., logits_soft_cap: float | None = ...,
    sinks: jax.typing.ArrayLike | None = ...,
    precision: Any = ..., config: FlashConfig | None = ...,
) -> jax.Array | tuple[jax.Array, jax.Array]: ...


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
    logits_soft_cap: float | None = None,
    sinks: jax.typing.ArrayLike | None = None,
    precision: Any = None,
    config: FlashConfig | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    r"""Scaled dot-product attention with the signature of `jax.nn.dot_product_attention`.

    Computes ``softmax(scale * Q K^T + bias, masked) V`` for each head. Letters as in jax.nn:
    B batch, T query length, S key/value length, N query heads, K key/value heads (N a multiple
    of K: MHA, GQA, MQA), H head dim.

    Args:
      query: [B, T, N, H] or [T, N, H] (no batch).
      key, value: [B, S, K, H] or [S, K, H]; same dtype as query. (Extension, kernel path
        only) value may have a head dim of its own, [B, S, K, H_v] (DeepSeek's MLA: H = 192,
        H_v = 128); the output then has H_v, and a call only jax.nn could serve raises.
      bias: optional additive logits bias broadcastable to [B, N, T, S]. **Served by XLA.**
      mask: optional boolean mask broadcastable to [B, N, T, S] (rank 4 or less, as in jax.nn),
        True = attend. Served by the kernels when it has a structure they implement, by XLA
        otherwise: see "Masks" below. `is_causal` and the lengths are cheaper ways to say the
        same thing: they need no [T, S] array and no check.
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
      logits_soft_cap: (tokamax's name) a positive float c: the scaled logits x become
        c * tanh(x / c) before the mask and the softmax (Gemma 2). jax.nn has no soft cap, so
        with "xla" or "cudnn", or with a `bias` or another reason to fall back to jax.nn
        (list below), it raises ValueError.
      sinks: float [N] learnable attention-sink logits (gpt-oss), one per query head, as in
        `flash_attention`: on the kernels and on the dense-mask path; like the soft cap it
        raises ValueError where only jax.nn could serve the call.
      precision: (extension, kernel path only) matmul precision for float32 inputs, as in
        `flash_attention`: None/"default" (tf32 on GPUs, like XLA's default) or "highest".
      config: (extension, kernel path only) a `FlashConfig` of kernel tiles.

    Returns:
      The output, shaped like `query` (with value's head dim) and in its dtype; with
      `return_residual`, the pair (output, residual).

    Masks. A mask is served by the kernels when, together with `is_causal`, the window and the
    lengths, it lets query t see key s exactly when ``[s <= t] and q_id[t] == kv_id[s]`` (the
    causal factor optional) for some segment ids, where a row or column that sees nothing gets
    an id that matches nothing. That covers what Flax builds: ``nn.make_causal_mask``,
    ``nn.make_attention_mask(q_valid, kv_valid)`` for padding on either side (trailing or
    leading), packed documents (``make_attention_mask(seg, seg, jnp.equal)``), decode's cache
    mask, and their products (``nn.combine_masks``), per batch row, shared by all heads. The
    ids are derived from the mask with reductions over it (each row's first visible key) and
    then checked against every element of it, so a mask with any other pattern (a sliding
    window, bottom-right causal, a per-head mask, ...) is never served wrongly: it goes to
    XLA. When that is decided depends on the mask:

    * a concrete mask (numpy, or a jax array outside jit, or a constant closed over by a
      jitted function) is checked when the call is made or traced, and only the chosen path
      is compiled;
    * a traced mask (the usual case under jit) is checked on the device at run time, and a
      ``lax.switch`` runs the kernels (causal or not) or the XLA fallback. All branches are
      compiled, and XLA reserves memory for each, taken or not; so the fallback works through
      the queries in chunks, and what it reserves is a few times the size of the mask itself
      (at least 16 MiB of logits), not the size of the logits. Under vmap
      with a batched mask the switch becomes a select and every branch runs: still correct,
      but slower. With implementation="pallas" a traced mask raises ValueError, since it
      cannot be checked before it runs.

    Warnings. A call that falls back to XLA emits one `FallbackWarning` per process for each
    reason (bias, dtype, head dim, scale, window, mask): when it is traced or called, or, for a
    traced mask, from the device (a ``jax.debug.callback`` in the fallback branch) the first
    time the fallback branch actually runs. Silence them with
    ``warnings.filterwarnings("ignore", category=pallas_flash.nn.FallbackWarning)``.

    What falls back to jax.nn's XLA implementation (``implementation=None``), where
    ``jax.nn.dot_product_attention(..., implementation="xla")`` gets the arguments unchanged:

    * a `bias` (a dense array);
    * a dtype other than bfloat16, float16 or float32 (float64 too runs on the kernels when
      they run in interpret mode, i.e. without a GPU);
    * a head dim H (or value's H_v) above 256;
    * a `scale` that is traced, not positive, or outside float32's normal range (the kernels
      need a static positive float);
    * a `local_window_size` with a negative side (e.g. (w, -1): strictly earlier keys).

    A mask with no structure the kernels serve goes to an XLA computation of ours instead,
    chunked as described above, with jax.nn's arithmetic (including the soft cap).

    Rows that see no key: a row whose keys are all masked out gets output 0, zero gradients
    and residual -inf, whether the kernels or the mask fallback serve it. jax.nn masks with a
    large finite negative number instead, so there the same row gets the *mean of all S
    values, padded ones included*, and a residual near -2.4e38 (-inf in float16); we consider
    0 the meaningful answer and do not reproduce that. In particular the padded query rows of
    a Flax padding mask are 0 here; a loss that ignores padded positions, as it should, sees
    no difference. Padded query rows given by ``query_seq_lengths`` are 0 in both (with zero
    gradient), but their residual is -inf here and about -2.4e38 in jax.nn. Calls that fall
    back to jax.nn (list above) give jax.nn's results in every case.

    Differences in what is accepted: the lengths may be any integer dtype (jax.nn wants int32);
    inputs of rank 1 or 2, which jax.nn silently pads with leading axes, are rejected, and so
    is a `scale` that is not a real number (a bool, a string, more than one value).

    Raises:
      ValueError: on shapes, dtypes or options that jax.nn would also reject, on an unknown
        `implementation`, on a `logits_soft_cap` that is not a positive finite float or that
        only XLA could serve, and with implementation="pallas" on a call the kernels cannot
        serve.
    """
    if not (scale is None or _is_scalar_number(scale)):
        raise ValueError(f"scale must be None or a real number, got {scale!r}")
    if not (implementation is None or isinstance(implementation, str)) or (
            implementation not in IMPLEMENTATIONS):
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}"
        )
    softcap = _soft_cap(logits_soft_cap)
    if implementation in ("xla", "cudnn"):
        if sinks is not None:
            raise ValueError(
                f"sinks are served by the Pallas kernels only; implementation="
                f"{implementation!r} (jax.nn.dot_product_attention) has no attention sinks"
            )
        if softcap is not None:
            raise ValueError(
                f"logits_soft_cap is served by the Pallas kernels only; "
                f"implementation={implementation!r} (jax.nn.dot_product_attention) has no soft "
                f"cap"
            )
        if _value_head_dim_differs(query, value):
            raise ValueError(
                f"a value head dim other than the query's is served by the Pallas kernels "
                f"only; implementation={implementation!r} (jax.nn.dot_product_attention) needs "
                f"one head dim, got query {jnp.shape(query)} and value {jnp.shape(value)}"
            )
        return jax.nn.dot_product_attention(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size, implementation=implementation,
            return_residual=return_residual,
        )

    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    q4, k4, v4 = (_ensure_4d(name, x) for name, x in
                  (("query", query), ("key", key), ("value", value)))
    output_shape = (*query.shape[:-1], value.shape[-1])
    for name, x in (("query", query), ("key", key), ("value", value)):
        if 0 in x.shape:
            raise ValueError(f"{name} must have every dimension >= 1, got shape {x.shape}")
    batch, seq_q, q_heads, head_dim = q4.shape
    _, seq_kv, kv_heads, _ = k4.shape
    if v4.shape[:3] != k4.shape[:3]:
        raise ValueError(f"value must have the shape of key, got key {key.shape} and value "
                         f"{value.shape} (B, S and K must match; its head dim may differ)")
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
    if sinks is not None:
        sinks = check_sinks(jnp.asarray(sinks), q_heads)
    q_lengths = _lengths("query_seq_lengths", query_seq_lengths, batch)
    kv_lengths = _lengths("key_value_seq_lengths", key_value_seq_lengths, batch)
    window = _window(local_window_size)
    is_causal = bool(is_causal)
    return_residual = bool(return_residual)
    mask4 = None if mask is None else _mask(mask, (batch, q_heads, seq_q, seq_kv))
    if bias is not None:
        _check_bias(bias, (batch, q_heads, seq_q, seq_kv))

    reasons = _unsupported(query.dtype, max(head_dim, v4.shape[3]), bias, scale, window)
    if reasons:
        if implementation == "pallas":
            raise ValueError(
                "implementation='pallas' cannot serve this call (" + "; ".join(reasons.values())
                + "); use implementation=None to let XLA serve it"
            )
        if sinks is not None:
            raise ValueError(
                "sinks are served by the Pallas kernels only, and they cannot serve this call ("
                + "; ".join(reasons.values()) + "); jax.nn.dot_product_attention, which would, "
                "has no attention sinks"
            )
        if softcap is not None:
            raise ValueError(
                "logits_soft_cap is served by the Pallas kernels only, and they cannot serve "
                "this call (" + "; ".join(reasons.values()) + "); jax.nn.dot_product_attention, "
                "which would, has no soft cap"
            )
        if _value_head_dim_differs(query, value):
            raise ValueError(
                "a value head dim other than the query's is served by the Pallas kernels only, "
                "and they cannot serve this call (" + "; ".join(reasons.values()) + "); "
                "jax.nn.dot_product_attention, which would, needs one head dim"
            )
        _warn_fallback(reasons)
        return jax.nn.dot_product_attention(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal,
            query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
            local_window_size=window, implementation="xla", return_residual=return_residual,
        )

    scale = None if scale is None else float(scale)

    def finish(out, residual=None):
        if not return_residual:
            return out.reshape(output_shape)
        return out.reshape(output_shape), residual.reshape(output_shape[:-1])

    def kernels(causal, q_ids, kv_ids, q_lengths, kv_lengths):
        result = flash_attention(
            q4, k4, v4, causal=causal, scale=scale, window=window, softcap=softcap,
            q_segment_ids=q_ids, kv_segment_ids=kv_ids, q_lengths=q_lengths,
            kv_lengths=kv_lengths, return_lse=return_residual, precision=precision,
            config=config, sinks=sinks,
        )
        if not return_residual:
            return (result,)
        out, lse = result
        # lse is [B, N, T] float32; jax.nn's residual is [B, T, N] in key's dtype, gradient
        # stopped.
        return out, lax.stop_gradient(jnp.swapaxes(lse, 1, 2).astype(key.dtype))

    if mask4 is None:
        return finish(*kernels(is_causal, None, None, q_lengths, kv_lengths))

    def fallback(q_lengths, kv_lengths):
        return xla_attention.masked_attention(
            q4, k4, v4, mask4, causal=is_causal, window=window, q_lengths=q_lengths,
            kv_lengths=kv_lengths, scale=scale, softcap=softcap, sinks=sinks,
            return_residual=return_residual,
        )

    recognise = functools.partial(dense_mask.recognise, batch=batch, seq_q=seq_q, seq_kv=seq_kv,
                                  is_causal=is_causal, window=window)
    if not any(isinstance(x, jax.core.Tracer) for x in (mask4, q_lengths, kv_lengths)):
        # A concrete mask: decide now, and compile only the path that serves it.
        with jax.ensure_compile_time_eval():
            q_ids, kv_ids, branch = recognise(mask4, q_lengths, kv_lengths)
            branch = int(branch)
        if branch != dense_mask.FALLBACK:
            causal = is_causal or branch == dense_mask.CAUSAL
            return finish(*kernels(causal, q_ids, kv_ids, None, None))
        if implementation == "pallas":
            raise ValueError(f"implementation='pallas' cannot serve this call "
                             f"({_UNRECOGNISED_MASK}); use implementation=None to let XLA "
                             f"serve it")
        _warn_fallback({"mask": _UNRECOGNISED_MASK})
        return finish(*fallback(q_lengths, kv_lengths))

    if implementation == "pallas":
        raise ValueError(
            "implementation='pallas' cannot serve a traced mask: whether the kernels can serve "
            "it is known only when it runs. Use implementation=None (the kernels when the mask "
            "allows, XLA otherwise), or is_causal and the lengths instead of a mask"
        )
    q_ids, kv_ids, branch = recognise(mask4, q_lengths, kv_lengths)

    def fallback_branch(q_ids, kv_ids, q_lengths, kv_lengths, branch):
        del q_ids, kv_ids
        if "mask" not in _WARNED:
            jax.debug.callback(_warn_mask_fallback_at_run_time, branch)
        return fallback(q_lengths, kv_lengths)

    def kernel_branch(causal):
        def run(q_ids, kv_ids, q_lengths, kv_lengths, branch):
            del q_lengths, kv_lengths, branch  # already folded into the ids
            return kernels(causal, q_ids, kv_ids, None, None)
        return run

    if is_causal:  # the mask is checked within the causal region: one kernel variant serves
        branches = [kernel_branch(True), fallback_branch]
        index = (branch == dense_mask.FALLBACK).astype(jnp.int32)
    else:
        branches = [kernel_branch(False), kernel_branch(True), fallback_branch]
        index = branch
    return finish(*lax.switch(index, branches, q_ids, kv_ids, q_lengths, kv_lengths, branch))


def _value_head_dim_differs(query, value) -> bool:
    return jnp.ndim(value) >= 1 and jnp.shape(value)[-1] != jnp.shape(query)[-1]


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


def _check_broadcastable(name, x, full_shape):
    if x.ndim > 4 or any(d not in (1, f) for d, f in zip(x.shape[::-1], full_shape[::-1])):
        raise ValueError(
            f"{name} must be broadcastable to [B, N, T, S] = {full_shape} with rank at most 4, "
            f"got shape {x.shape}"
        )


def _mask(mask, full_shape):
    """The mask as a rank-4 boolean array, each dim 1 or that of [B, N, T, S]."""
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise ValueError(f"mask must be a boolean array (True = attend), got dtype {mask.dtype}")
    _check_broadcastable("mask", mask, full_shape)
    return mask.reshape((1,) * (4 - mask.ndim) + mask.shape)


def _check_bias(bias, full_shape):
    """A bias goes to jax.nn, whose own error for a misshapen one is a TypeError from inside
    its arithmetic, which names no argument."""
    _check_broadcastable("bias", jnp.asarray(bias), full_shape)


def _window(local_window_size):
    if local_window_size is None:
        return None
    if validation.is_int(local_window_size):
        return (int(local_window_size), int(local_window_size))
    if (isinstance(local_window_size, Sequence) and not isinstance(local_window_size, str)
            and len(local_window_size) == 2 and all(map(validation.is_int, local_window_size))):
        return tuple(int(w) for w in local_window_size)
    raise ValueError(
        f"local_window_size must be None, an int or a (left, right) pair of ints, got "
        f"{local_window_size!r}"
    )


def _soft_cap(logits_soft_cap):
    if logits_soft_cap is None:
        return None
    if isinstance(logits_soft_cap, jax.core.Tracer):
        raise ValueError("logits_soft_cap must be a static Python float, got a traced value")
    if isinstance(logits_soft_cap, (bool, np.bool_)) or not isinstance(
            logits_soft_cap, (int, float, np.integer, np.floating)):
        raise ValueError(f"logits_soft_cap must be None or a positive float, got "
                         f"{logits_soft_cap!r}")
    value = float(logits_soft_cap)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"logits_soft_cap must be None or a positive float, got {value}")
    return value


def _is_scalar_number(x) -> bool:
    """A traced scalar, or a real number (Python, numpy or a 0-d array) that is not a bool."""
    if isinstance(x, jax.core.Tracer):
        return x.shape == ()
    if isinstance(x, (bool, np.bool_)):
        return False
    try:
        a = np.asarray(x)
    except (TypeError, ValueError):
        return False
    return a.shape == () and (np.issubdtype(a.dtype, np.floating)
                              or np.issubdtype(a.dtype, np.integer))


def _static_scale_ok(scale) -> bool:
    if scale is None:
        return True
    if isinstance(scale, jax.core.Tracer) or isinstance(scale, (bool, np.bool_)):
        return False
    try:
        value = float(scale)
    except (TypeError, ValueError):
        return False
    return validation.scale_is_served(value)


def _unsupported(dtype, head_dim, bias, scale, window) -> dict[str, str]:
    """Why the kernels cannot serve a call, by reason; empty when they can. (A mask is judged
    separately, by `dense_mask.recognise`.)"""
    reasons = {}
    if bias is not None:
        reasons["bias"] = "a dense bias"
    dtype = jnp.dtype(dtype)
    interpreting = jax.default_backend() != "gpu"
    if dtype not in _KERNEL_DTYPES and not (dtype == jnp.float64 and interpreting):
        reasons["dtype"] = f"dtype {dtype}"
    if head_dim > MAX_HEAD_DIM:
        reasons["head_dim"] = f"head dim {head_dim} > {MAX_HEAD_DIM}"
    if not _static_scale_ok(scale):
        reasons["scale"] = (f"scale {scale!r} (the kernels need a static, positive float, "
                            f"normal in float32)")
    if window is not None and min(window) < 0:
        reasons["window"] = f"local_window_size {window} with a negative side"
    return reasons
