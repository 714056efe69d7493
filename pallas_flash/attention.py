"""flash_attention: validation, defaults, backend choice and the custom_vjp wiring.

Data flow: validate once (ValueError naming the argument) -> fold the options into one hashable
`AttentionSpec` -> pick the backend -> call a custom_vjp function whose forward returns
(O, lse) and saves (q, k, v, O) and the row statistics M and L (stats.py: two float32 numbers
per query row, from which lse is derived) plus the integer segment ids and the sink logits,
nothing else. This
module never knows how a kernel tiles its work.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Literal, overload

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

# Pallas interpret mode imports this module on its first trace, and the module registers a config
# option that is part of jit's cache key: every function traced before that first trace (a whole
# train step) would then be traced and compiled twice. Importing it here, up front, avoids that.
import jax.experimental.pallas.fuser  # noqa: E402,F401  pylint: disable=unused-import

from pallas_flash import guarded, stats, validation
from pallas_flash.config import (FlashConfig, check_shared_memory, default_config,
                                 shared_memory_limit)
from pallas_flash.masking import CausalAlignment, fold_lengths, make_mask_spec
from pallas_flash.sinks import check_sinks
from pallas_flash.spec import AttentionSpec
from pallas_flash.mosaic import backward as mosaic_backward
from pallas_flash.mosaic import forward as mosaic_forward
from pallas_flash.triton import backward as triton_backward
from pallas_flash.triton import forward as triton_forward

__all__ = ["flash_attention", "OUT_NAME", "LSE_NAME"]

# Names for jax.checkpoint policies, e.g. save_only_these_names(OUT_NAME, LSE_NAME): with both
# saved, rematerialisation never re-runs the forward kernel. LSE_NAME tags the row statistics
# the backward reads (the public lse is a cheap elementwise function of them).
OUT_NAME = "pallas_flash_out"
LSE_NAME = "pallas_flash_lse"

_BACKENDS = ("auto", "triton", "mosaic")
# Kernel modules by backend; looked up when a call is traced (tests swap them out). "guarded" is
# the Mosaic kernels behind a finiteness check that falls back to Triton (guarded.py says why):
# what "auto" runs on an sm_90 GPU.
_FORWARDS = {"triton": triton_forward, "mosaic": mosaic_forward, "guarded": guarded}
_BACKWARDS = {"triton": triton_backward, "mosaic": mosaic_backward, "guarded": guarded}
_PRECISIONS = {
    None: lax.Precision.DEFAULT,
    "default": lax.Precision.DEFAULT,
    "high": lax.Precision.HIGH,
    "highest": lax.Precision.HIGHEST,
    lax.Precision.DEFAULT: lax.Precision.DEFAULT,
    lax.Precision.HIGH: lax.Precision.HIGH,
    lax.Precision.HIGHEST: lax.Precision.HIGHEST,
}


@overload
def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    return_lse: Literal[False] = ...,
    causal_alignment: CausalAlignment = ...,
    window: tuple[int | None, int | None] | None = ...,
    softcap: float | None = ...,
    sinks: jax.Array | None = ...,
    q_segment_ids: jax.Array | None = ...,
    kv_segment_ids: jax.Array | None = ...,
    q_lengths: jax.Array | None = ...,
    kv_lengths: jax.Array | None = ...,
    precision: Any = ...,
    config: FlashConfig | None = ...,
    backend: str = ...,
    interpret: bool | None = ...,
) -> jax.Array: ...


@overload
def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    return_lse: Literal[True],
    causal_alignment: CausalAlignment = ...,
    window: tuple[int | None, int | None] | None = ...,
    softcap: float | None = ...,
    sinks: jax.Array | None = ...,
    q_segment_ids: jax.Array | None = ...,
    kv_segment_ids: jax.Array | None = ...,
    q_lengths: jax.Array | None = ...,
    kv_lengths: jax.Array | None = ...,
    precision: Any = ...,
    config: FlashConfig | None = ...,
    backend: str = ...,
    interpret: bool | None = ...,
) -> tuple[jax.Array, jax.Array]: ...


@overload
def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    return_lse: bool = ...,
    causal_alignment: CausalAlignment = ...,
    window: tuple[int | None, int | None] | None = ...,
    softcap: float | None = ...,
    sinks: jax.Array | None = ...,
    q_segment_ids: jax.Array | None = ...,
    kv_segment_ids: jax.Array | None = ...,
    q_lengths: jax.Array | None = ...,
    kv_lengths: jax.Array | None = ...,
    precision: Any = ...,
    config: FlashConfig | None = ...,
    backend: str = ...,
    interpret: bool | None = ...,
) -> jax.Array | tuple[jax.Array, jax.Array]: ...


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    causal_alignment: CausalAlignment = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_lengths: jax.Array | None = None,
    kv_lengths: jax.Array | None = None,
    precision: Any = None,
    config: FlashConfig | None = None,
    backend: str = "auto",
    interpret: bool | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Memory-efficient exact attention, softmax(scale * q k^T) v, with O(seq) memory.

    Args:
      q: [batch, seq_q, q_heads, head_dim] queries (bfloat16, float16, float32; float64 in
        interpret mode only).
      k: [batch, seq_kv, kv_heads, head_dim], same dtype; q_heads must be a multiple of
        kv_heads (GQA; kv_heads = 1 is MQA). K/V are shared in place, never repeated.
      v: [batch, seq_kv, kv_heads, head_dim_v], same dtype: head_dim_v may differ from q and
        k's head_dim (DeepSeek's MLA: 192 and 128); the Mosaic kernels take one at most Q/K's,
        the Triton kernels any.
      causal: query i sees only keys j <= i (top-left alignment, as in
        `jax.nn.dot_product_attention`), or j <= i + seq_kv - seq_q with
        ``causal_alignment="bottom_right"`` (the last query sees every key: decoding, chunked
        prefill).
      scale: a positive logit multiplier (a normal float32); default 1/sqrt(head_dim) (Q/K's).
      return_lse: also return lse [batch, q_heads, seq_q], float32, the natural-log logsumexp of
        each row's scaled (and soft-capped) logits. Both outputs are differentiable.
      causal_alignment: "top_left" (default) or "bottom_right"; also anchors `window`.
      window: (left, right): query i sees keys in [i - left, i + right] (shifted by the
        alignment); None on a side means unbounded. Combined with causal, right is clamped to 0.
      softcap: logits become softcap * tanh(logits / softcap) (Gemma 2).
      sinks: float [q_heads] learnable sink logits (gpt-oss): each joins its head's softmax
        denominator with no value row, and gets a gradient. lse then includes the sink.
      q_segment_ids, kv_segment_ids: int [batch, seq_q] / [batch, seq_kv]; a query sees only
        keys with its id (packed documents). Ids 2**31 - 2 and 2**31 - 1 are reserved.
      q_lengths, kv_lengths: int [batch] valid lengths; padded rows give 0 output and 0
        gradient, padded keys are never seen.
      precision: matmul precision for float32 inputs: None/"default" lets the GPU use tf32 (as
        XLA does), "highest" asks for full float32.
      config: a `FlashConfig` of Triton tiles; default chosen by head_dim and dtype. Given
        explicitly, "auto" runs the Triton kernels with it.
      backend: "auto", "triton" or "mosaic". "mosaic" runs the Pallas Mosaic GPU kernels for
        Hopper (sm_90): bfloat16 / float16, head_dim a multiple of 16 from 32 to 256 (V's the
        same or a smaller such one), every mask and option. It raises a ValueError for a call
        it cannot serve (or on another GPU). "triton" runs the
        Triton-lowered kernels: any GPU, dtype and head_dim. "auto" (default) runs the Mosaic
        kernels on an sm_90 GPU when they serve the call and `config` is not given, behind a
        finiteness check that sends a call a NaN or inf operand reaches to the Triton kernels
        (they confine it to the rows that depend on it; see pallas_flash/guarded.py), and the
        Triton kernels otherwise. Every backend saves the same row statistics, so results
        agree to rounding.
      interpret: run in Pallas interpret mode; default: True exactly when JAX has no GPU.

    Returns:
      out [batch, seq_q, q_heads, head_dim_v] in q's dtype, or (out, lse) with return_lse. A row
      that sees no key gives out = 0 and lse = -inf, and zero gradients.
    """
    opts = validation.validate(
        q, k, v, causal=causal, scale=scale, causal_alignment=causal_alignment, window=window,
        softcap=softcap, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        q_lengths=q_lengths, kv_lengths=kv_lengths, v_head_dim_may_differ=True,
    )
    if not isinstance(return_lse, (bool,)):
        raise ValueError(f"return_lse must be a bool, got {return_lse!r}")
    if sinks is not None:
        sinks = check_sinks(sinks, q.shape[2])
    explicit_config = config is not None  # before kernel_options fills in the default
    precision, config, interpret = kernel_options(q, precision=precision, config=config,
                                                  interpret=interpret, head_dim_v=v.shape[-1])
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    batch, seq_q = q.shape[:2]
    seq_kv = k.shape[1]
    has_segments = q_segment_ids is not None or q_lengths is not None or kv_lengths is not None
    spec = AttentionSpec(
        mask=make_mask_spec(seq_q, seq_kv, causal=bool(causal), causal_alignment=causal_alignment,
                            window=opts.window),
        scale=opts.scale,
        softcap=opts.softcap,
        has_segments=has_segments,
        precision=precision,
        config=config,
        interpret=interpret,
    )
    q_ids = kv_ids = None
    if has_segments:
        q_ids, kv_ids = fold_lengths(q_segment_ids, kv_segment_ids, q_lengths, kv_lengths,
                                     batch=batch, seq_q=seq_q, seq_kv=seq_kv)
    backends = _choose_backends(backend, spec, q, k, v, explicit_config=explicit_config)
    out, lse = _custom_vjp_attention(spec, *backends)(q, k, v, q_ids, kv_ids, sinks)
    return (out, lse) if return_lse else out


def _choose_backends(backend: str, spec: AttentionSpec, q, k, v, *,
                     explicit_config: bool = False) -> tuple[str, str]:
    """(forward backend, backward backend), decided here and nowhere else; ValueError if a
    forced backend cannot serve the call. "auto" never raises: Triton serves everything."""
    if backend == "triton":
        return "triton", "triton"
    if backend == "auto":
        # Interpret mode stays on Triton: the Mosaic interpreter is far slower, and a CPU has no
        # Mosaic speed to gain. A FlashConfig names Triton tiles, so it asks for Triton.
        if (spec.interpret or explicit_config or not _is_sm90()
                or mosaic_forward.unsupported_reason(spec, q, k, v) is not None):
            return "triton", "triton"
        served = mosaic_backward.unsupported_reason(spec, q, k, v) is None
        return "guarded", "guarded" if served else "triton"
    if not spec.interpret and not _is_sm90():
        raise ValueError(f"backend='mosaic' needs an sm_90 GPU (H100, H200) or "
                         f"interpret=True; this device has compute capability {_capability()}")
    reason = mosaic_forward.unsupported_reason(spec, q, k, v)
    if reason is not None:
        raise ValueError(f"backend='mosaic' cannot serve this call ({reason}); "
                         f"backend='auto' or 'triton' can")
    backward = "mosaic" if mosaic_backward.unsupported_reason(spec, q, k, v) is None else "triton"
    return "mosaic", backward


def _capability() -> str:
    return str(getattr(jax.devices()[0], "compute_capability", "none"))


def _is_sm90() -> bool:
    """The Mosaic kernels use wgmma and TMA: Hopper (compute capability 9.0) only."""
    return jax.default_backend() == "gpu" and _capability() == "9.0"


class InterpretModeWarning(UserWarning):
    """The kernels run in Pallas interpret mode because JAX has no GPU."""


_interpret_warned = False


def _warn_interpret_once() -> None:
    """One warning per process: interpret mode is exact but far slower than compiled kernels,
    and a GPU machine that got the CPU-only jaxlib would otherwise run it without a word."""
    global _interpret_warned
    if _interpret_warned:
        return
    _interpret_warned = True
    warnings.warn(
        f"pallas_flash: JAX's default backend is {jax.default_backend()!r}, not a GPU, so the "
        "kernels run in Pallas interpret mode (exact, but far slower than compiled kernels). "
        "On an NVIDIA GPU machine install jax with its CUDA plugin: pip install "
        "'pallas_flash[cuda]'. Pass interpret=True to choose interpret mode without this "
        "warning.", InterpretModeWarning, stacklevel=4)


def kernel_options(q, *, precision, config, interpret, head_dim_v=None):
    """Validates and defaults the options that steer the kernels (how, not what).

    Shared by every entry point that launches the kernels (flash_attention, ring.py, decode.py;
    sharding.py calls flash_attention itself).
    head_dim_v: V's head_dim when it differs from q's (None: the same).
    Returns (precision as a lax.Precision, a FlashConfig, interpret as a bool).
    """
    head_dim = q.shape[-1]
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    try:
        precision = _PRECISIONS[precision.lower() if isinstance(precision, str) else precision]
    except (KeyError, TypeError):
        raise ValueError(
            f"precision must be None, 'default', 'high', 'highest' or a jax.lax.Precision, "
            f"got {precision!r}"
        ) from None
    if config is None:
        config = default_config(head_dim, q.dtype, head_dim_v=head_dim_v)
    elif not isinstance(config, FlashConfig):
        raise ValueError(f"config must be a pallas_flash.FlashConfig, got {type(config).__name__}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
        if interpret:
            _warn_interpret_once()
    elif not isinstance(interpret, bool):
        raise ValueError(f"interpret must be None or a bool, got {interpret!r}")
    if q.dtype == jnp.float64 and not interpret:
        raise ValueError(
            "q, k, v of dtype float64 run in interpret mode only (interpret=True); the GPU "
            "kernels take bfloat16, float16 and float32"
        )
    check_shared_memory(config, head_dim, q.dtype, shared_memory_limit(interpret),
                        head_dim_v=head_dim_v)
    return precision, config, interpret


@functools.lru_cache(maxsize=None)
def _custom_vjp_attention(spec: AttentionSpec, forward_backend: str = "triton",
                          backward_backend: str = "triton"):
    """One jitted custom_vjp function per static spec and pair of backends: all are closed
    over, never arguments, and the jit makes repeated calls with the same shapes trace only
    once. Every forward saves the same row statistics (stats.py), so any backward can follow
    any forward.

    Sinks (sinks.py) enter the forward kernels' last step, so O and the statistics already
    hold them and the backward kernels run unchanged; the sinks' gradient is a sum over rows
    of the D those kernels take (stats.sink_weights), formed once here for both."""

    @jax.jit
    def forward(*args):
        # The barrier keeps XLA from launching the forward kernel twice: in a training step
        # under lax.scan, XLA can place the Mosaic forward's custom call both in the loop body
        # and in a dynamic-slice fusion beside it, and run both.
        # The jit: under differentiation JAX traces both the primal function and the forward
        # rule, and with one jitted forward the second finds the first's trace (tracing the
        # kernels takes a good part of a process's first step).
        return lax.optimization_barrier(_FORWARDS[forward_backend].forward(spec, *args))

    @jax.custom_vjp
    def attention(q, k, v, q_ids, kv_ids, sinks):
        out, row_stats = forward(q, k, v, q_ids, kv_ids, sinks)
        return out, stats.to_lse(spec, row_stats)

    def attention_fwd(q, k, v, q_ids, kv_ids, sinks):
        out, row_stats = forward(q, k, v, q_ids, kv_ids, sinks)
        out = checkpoint_name(out, OUT_NAME)
        row_stats = checkpoint_name(row_stats, LSE_NAME)
        residuals = (q, k, v, out, row_stats, q_ids, kv_ids, sinks)
        return (out, stats.to_lse(spec, row_stats)), residuals

    def attention_bwd(residuals, cotangents):
        q, k, v, out, row_stats, q_ids, kv_ids, sinks = residuals
        d_out, d_lse = cotangents
        delta = d_sinks = None
        if sinks is not None:
            # D in the statistics' dtype: the accumulator dtype of every backward.
            delta = stats.output_dot(out, d_out, d_lse, row_stats.m.dtype)
            d_sinks = -jnp.sum(stats.sink_weights(spec, row_stats, sinks) * delta, axis=(0, 2))
            d_sinks = d_sinks.astype(sinks.dtype)
        dq, dk, dv = _BACKWARDS[backward_backend].backward(spec, q, k, v, out, row_stats, d_out,
                                                           d_lse, q_ids, kv_ids, delta=delta)
        return dq, dk, dv, None, None, d_sinks

    attention.defvjp(attention_fwd, attention_bwd)
    return jax.jit(attention)
