"""decode_attention: attention of a few new queries against a K/V cache, for sampling.

Data flow: validate once (ValueError naming the argument) -> fold the static options into a
`DecodePlan` -> pack the q_heads // kv_heads query heads of each kv head, times the q_len new
tokens, into the rows of one tile (K/V is read once per group) -> a backend's split-KV kernel
writes one partial (O, lse) per (batch, kv head, split) -> the combine kernel merges the splits
through their lse -> sinks -> unpack to [batch, q_len, q_heads, head_dim].

Backend contract (pallas_flash/triton/decode.py, pallas_flash/mosaic/decode.py): each module
exposes `partial(plan, q_packed, k_cache, v_cache, kv_lengths, block_table)` (see
`partial_contract` below for its shapes), `unsupported_reason(plan) -> str | None` and
`d_major(plan, tiles) -> bool`: True where its partial O comes transposed, O^T [..., head_dim,
n] with lse [..., n] for n >= rows columns (the Mosaic keys-as-M kernel), which the combine
reads in place, and `reads_queries_unpacked(plan, tiles) -> bool`: True where `partial` takes
the queries as given, so that the caller's packing transpose is spared.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Literal, overload

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flash import attention, validation
from pallas_flash.attention import kernel_options
from pallas_flash.mosaic.schedule import device_sms
from pallas_flash.sinks import apply_sinks, check_sinks
from pallas_flash.triton import decode as triton_decode

__all__ = ["decode_attention", "DecodePlan", "choose_num_splits"]


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """The static description of one decode call: hashable, closed over by the kernels.

    Attributes:
      batch, q_len, q_heads, kv_heads, head_dim: the call's sizes (q_len in 1..16).
      group: q_heads // kv_heads.
      rows: group * q_len, the packed query rows of one kv head (row r = t * group + g).
      max_len: key positions a sequence can hold: the contiguous cache's length, or
        pages_per_seq * page_size.
      pages_per_seq: block_table's second dimension; None for a contiguous cache.
      page_size: keys per page (a power of two >= 16); None for a contiguous cache.
      num_splits: chunks the key positions [0, max_len) are cut into; split s owns positions
        [s * chunk, min((s + 1) * chunk, max_len)). A split past a sequence's kv_length is
        empty for it.
      chunk: keys per split, a multiple of CHUNK_ALIGN and of page_size (a split never cuts a
        page); num_splits * chunk >= max_len > (num_splits - 1) * chunk.
      scale: logit multiplier.
      softcap: logits become softcap * tanh(scale * q.k / softcap); None for none.
      window_left: query t (at position p = kv_length - q_len + t) sees keys
        max(0, p - window_left) <= j <= p; None = unbounded, else at most max_len (a longer
        side sees the same keys). The right side of a window is clamped to 0 by causality, so
        only the left side is kept.
      dtype: the dtype of q and of the caches.
      interpret: Pallas interpret mode.
    """

    batch: int
    q_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    group: int
    rows: int
    max_len: int
    pages_per_seq: int | None
    page_size: int | None
    num_splits: int
    chunk: int
    scale: float
    softcap: float | None
    window_left: int | None
    dtype: jnp.dtype
    interpret: bool

    @property
    def paged(self) -> bool:
        return self.page_size is not None


# A chunk is a whole number of these keys, so that the backends' smallest kv blocks (powers of
# two up to this size) tile a chunk exactly; a larger block serves a chunk it divides
# (mosaic.decode.unsupported_reason).
CHUNK_ALIGN = 64


def partial_contract(plan: DecodePlan, q_packed: jax.Array, k_cache: jax.Array,
                     v_cache: jax.Array, kv_lengths: jax.Array,
                     block_table: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """The signature and meaning of every backend's `partial` (this function is documentation).

    Args:
      plan: the call's DecodePlan.
      q_packed: [batch, kv_heads, rows, head_dim] in plan.dtype; row r = t * group + g holds
        query token t of query head kv_head * group + g. A backend whose
        `reads_queries_unpacked` is True takes [batch, q_len, q_heads, head_dim] as the caller
        gave it instead (the partials are the same).
      k_cache, v_cache: contiguous [batch, max_len, kv_heads, head_dim], or paged
        [num_pages, page_size, kv_heads, head_dim]; plan.dtype.
      kv_lengths: int32 [batch], already clamped to [0, max_len]. Query token t sits at
        position kv_length - q_len + t and sees keys j <= that position (and j >= position -
        window_left); a token whose position is < 0 sees no key.
      block_table: int32 [batch, pages_per_seq] (logical page p of sequence b is physical page
        block_table[b, p]), or None for a contiguous cache. Only the entries of pages that hold
        a position < kv_length, and not wholly before the window's first key (kv_length - q_len
        - window_left), are read; the rest may hold anything. A read entry outside
        [0, num_pages) (a traced table is not checked before the call) is read as page 0, so
        no memory outside the cache is touched, and every split that reads it writes NaN for
        O and lse in every row of that sequence: the caller's merge keeps NaN as NaN.

    Returns:
      o_part: float32 [batch, kv_heads, num_splits, rows, head_dim], each split's softmax-
        normalised output over its own keys (0 for a row that sees no key of the split).
      lse_part: float32 [batch, kv_heads, num_splits, rows], the natural-log logsumexp of the
        row's scaled (soft-capped) logits over the split's visible keys; -inf when none.
    """
    raise NotImplementedError("documentation only")


# Split rule constants (choose_num_splits).
CTAS_PER_SM = 2        # where the grid is near one program per SM (choose_num_splits)
MIN_CHUNK_BLOCKS = 4   # each split keeps a few blocks, so its fixed cost stays amortised
MAX_SPLITS = 256       # bounds the combine's loop and the partials' memory
MAX_Q_LEN = 16
_BACKENDS = ("auto", "triton", "mosaic")


def choose_num_splits(batch: int, kv_heads: int, max_len: int, num_sms: int,
                      align: int = CHUNK_ALIGN) -> int:
    """Splits per (batch, kv head): enough programs for every SM.

    Decoding is bandwidth-bound and a grid of batch * kv_heads programs leaves most SMs idle at
    small batch, so the key positions are cut into chunks. Where at least two splits give each
    SM a program, the grid stops at one program per SM: more would double the partials the
    combine reads and each program's fixed cost. Else (batch * kv_heads near the SM count or
    above) it aims at CTAS_PER_SM programs per SM, which keeps more loads in flight than a
    single long program per SM. Chunks never hold fewer than MIN_CHUNK_BLOCKS * align keys,
    and there are at most MAX_SPLITS.
    """
    programs = batch * kv_heads
    wanted = num_sms // programs
    if wanted < 2:
        wanted = -(-CTAS_PER_SM * num_sms // programs)
    by_length = max(1, max_len // (MIN_CHUNK_BLOCKS * align))
    return max(1, min(wanted, by_length, MAX_SPLITS))


def split_geometry(max_len: int, num_splits: int, align: int) -> tuple[int, int]:
    """(num_splits, chunk): chunk a multiple of align covering max_len in at most num_splits
    pieces; the count shrinks when rounding leaves trailing splits with no position at all."""
    chunk = -(-max_len // num_splits)
    chunk = -(-chunk // align) * align
    return -(-max_len // chunk), chunk


def fills_one_wave(plan: DecodePlan, num_sms: int) -> bool:
    """Whether the plan's grid of batch * kv_heads * num_splits programs fits one per SM.

    "auto" takes the Mosaic kernel only there: one CTA per SM streaming a long chunk is where
    its deeper copy pipeline wins (docs/tuning.md, "Mosaic or Triton"). Past one wave its CTAs,
    one per SM, run in several waves, and the Triton kernel was measured faster.
    """
    return plan.batch * plan.kv_heads * plan.num_splits <= num_sms


def _array(name, x, rank):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if len(x.shape) != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(x.shape)}")
    return tuple(x.shape)


def _check_pages(block_table, kv_lengths, *, num_pages, page_size, max_len, q_len,
                 window_left):
    """When block_table and kv_lengths are concrete (an eager call, or constants under jit):
    every page a sequence reads is a page of the cache, else a ValueError naming the entry. The
    pages read are those that overlap the keys the new tokens see: [kv_length - q_len -
    window_left, kv_length), or from 0 without a window; other entries may hold anything (a
    sentinel for a page not allocated). A traced table is left to the kernels, which read page
    0 in place of such an id and make that sequence's output NaN."""
    if any(isinstance(x, jax.core.Tracer) for x in (block_table, kv_lengths)):
        return
    table = np.asarray(block_table)
    lengths = np.clip(np.asarray(kv_lengths).astype(np.int64), 0, max_len)
    lo = (np.zeros_like(lengths) if window_left is None
          else np.maximum(lengths - q_len - window_left, 0))
    starts = np.arange(table.shape[1]) * page_size
    read = (starts[None, :] < lengths[:, None]) & (starts[None, :] + page_size > lo[:, None])
    bad = read & ((table < 0) | (table >= num_pages))
    if bad.any():
        b, p = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"block_table[{b}, {p}] = {table[b, p]} is not a page of the cache (its "
            f"{num_pages} pages are numbered 0 to {num_pages - 1}), and sequence {b} reads that "
            f"page (kv_lengths[{b}] = {lengths[b]}, page_size {page_size})")


def _validate(q, k_cache, v_cache, kv_lengths, block_table, *, scale, softcap, window, sinks,
              return_lse, num_splits, backend, interpret) -> tuple[DecodePlan, jax.Array | None]:
    """Every check of decode_attention, before anything is traced: (plan, sinks)."""
    batch, q_len, q_heads, head_dim = _array("q", q, 4)
    # q's sizes come before validation.validate: it is given q as k and v too, so its message
    # for an empty dimension would report q's shape under their names.
    if not 1 <= q_len <= MAX_Q_LEN:
        raise ValueError(f"q must hold 1 to {MAX_Q_LEN} new tokens per sequence (q_len, its "
                         f"second dimension), got q_len = {q_len}")
    if min(q.shape) < 1:
        raise ValueError(f"q dimensions must be >= 1, got {tuple(q.shape)}")
    # q against itself: validation.validate's checks of q and its normalisation of scale,
    # window and softcap, with flash_attention's messages.
    opts = validation.validate(q, q, q, causal=True, scale=scale, causal_alignment="bottom_right",
                               window=window, softcap=softcap, q_segment_ids=None,
                               kv_segment_ids=None, q_lengths=None, kv_lengths=None)
    k_shape = _array("k_cache", k_cache, 4)
    if _array("v_cache", v_cache, 4) != k_shape:
        raise ValueError(f"v_cache must have k_cache's shape {k_shape}, got {v_cache.shape}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    rows_or_pages, slot_len, kv_heads, cache_dim = k_shape
    if cache_dim != head_dim:
        raise ValueError(f"k_cache head_dim {cache_dim} does not match q head_dim {head_dim}")
    if min(k_shape) < 1:
        raise ValueError(f"k_cache dimensions must be >= 1, got {k_shape}")
    if q_heads % kv_heads:
        raise ValueError(f"the number of q heads ({q_heads}) must be a multiple of the cache's "
                         f"kv heads ({kv_heads})")
    if _array("kv_lengths", kv_lengths, 1) != (batch,):
        raise ValueError(f"kv_lengths must have shape [batch] = ({batch},), got "
                         f"{tuple(kv_lengths.shape)}")
    if not jnp.issubdtype(kv_lengths.dtype, jnp.integer):
        raise ValueError(f"kv_lengths must have an integer dtype, got {kv_lengths.dtype}")
    if block_table is None:
        if rows_or_pages != batch:
            raise ValueError(f"k_cache of a contiguous cache must have q's batch {batch} first, "
                             f"got shape {k_shape} (a paged cache needs block_table)")
        max_len, pages_per_seq, page_size = slot_len, None, None
    else:
        table = _array("block_table", block_table, 2)
        if table[0] != batch:
            raise ValueError(f"block_table must have shape [batch, pages_per_seq] with batch "
                             f"{batch}, got {table}")
        if block_table.dtype != jnp.int32:
            raise ValueError(f"block_table must have dtype int32, got {block_table.dtype}")
        page_size = slot_len
        if page_size < 16 or page_size & (page_size - 1):
            raise ValueError(f"page_size (k_cache's second dimension) must be a power of two "
                             f">= 16, got {page_size}")
        pages_per_seq = table[1]
        if pages_per_seq < 1:
            raise ValueError(f"block_table must hold at least one page per sequence (its second "
                             f"dimension, pages_per_seq), got shape {table}")
        max_len = pages_per_seq * page_size
    # No query sits past max_len - 1, so a left side longer than max_len sees what max_len
    # sees; the clamp keeps a huge side (2**31 and up) out of the kernels' int32 arithmetic.
    window_left = None if opts.window is None else opts.window[0]
    if window_left is not None:
        window_left = min(window_left, max_len)
    if sinks is not None:
        sinks = check_sinks(sinks, q_heads)
    if block_table is not None:
        _check_pages(block_table, kv_lengths, num_pages=rows_or_pages, page_size=page_size,
                     max_len=max_len, q_len=q_len, window_left=window_left)
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse must be a bool, got {return_lse!r}")
    if num_splits is not None and not (validation.is_int(num_splits) and num_splits >= 1):
        raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    _, _, interpret = kernel_options(q, precision=None, config=None, interpret=interpret)

    align = max(CHUNK_ALIGN, page_size or 1)
    if num_splits is None:
        num_splits = choose_num_splits(batch, kv_heads, max_len, device_sms(), align)
    num_splits, chunk = split_geometry(max_len, int(num_splits), align)
    group = q_heads // kv_heads
    plan = DecodePlan(
        batch=batch, q_len=q_len, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
        group=group, rows=group * q_len, max_len=max_len, pages_per_seq=pages_per_seq,
        page_size=page_size, num_splits=num_splits, chunk=chunk, scale=opts.scale,
        softcap=opts.softcap, window_left=window_left,
        dtype=jnp.dtype(q.dtype), interpret=interpret)
    return plan, sinks


def _mosaic_module():
    """pallas_flash.mosaic.decode, or None where it does not exist (imported lazily)."""
    try:
        return importlib.import_module("pallas_flash.mosaic.decode")
    except ImportError:
        return None


def _choose_backend(backend: str, plan: DecodePlan) -> str:
    """The one place a decode backend is chosen. "auto" never raises: Triton serves all."""
    if backend == "triton":
        return "triton"
    if backend == "auto":
        # Interpret mode stays on Triton, as flash_attention's "auto" does: the Mosaic
        # interpreter is far slower, and a CPU has no Mosaic speed to gain.
        if plan.interpret or not attention._is_sm90():
            return "triton"
        mosaic = _mosaic_module()
        served = mosaic is not None and mosaic.unsupported_reason(plan) is None
        return "mosaic" if served and fills_one_wave(plan, device_sms()) else "triton"
    mosaic = _mosaic_module()
    if mosaic is None:
        raise ValueError("backend='mosaic' has no decode kernel in this installation; "
                         "backend='auto' or 'triton' can serve the call")
    if not plan.interpret and not attention._is_sm90():
        raise ValueError(f"backend='mosaic' needs an sm_90 GPU (H100, H200) or interpret=True; "
                         f"this device has compute capability {attention._capability()}")
    reason = mosaic.unsupported_reason(plan)
    if reason is not None:
        raise ValueError(f"backend='mosaic' cannot serve this call ({reason}); "
                         f"backend='auto' or 'triton' can")
    return "mosaic"


def _backend_module(name: str):
    return triton_decode if name == "triton" else _mosaic_module()


def pack_queries(q, kv_heads: int):
    """[batch, q_len, q_heads, d] -> [batch, kv_heads, q_len * group, d], row t * group + g."""
    batch, q_len, q_heads, d = q.shape
    group = q_heads // kv_heads
    q = q.reshape(batch, q_len, kv_heads, group, d).transpose(0, 2, 1, 3, 4)
    return q.reshape(batch, kv_heads, q_len * group, d)


def backend_queries(module, plan: DecodePlan, q, tiles=None):
    """q as the backend `module`'s `partial` takes it: as given where it reads the queries
    unpacked, else packed (`pack_queries`)."""
    return q if module.reads_queries_unpacked(plan, tiles) else pack_queries(q, plan.kv_heads)


def unpack_out(plan: DecodePlan, out):
    """Packed O [batch, kv_heads, rows, d] -> [batch, q_len, q_heads, d]."""
    b, h, t, g = plan.batch, plan.kv_heads, plan.q_len, plan.group
    out = out.reshape(b, h, t, g, plan.head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, plan.q_heads, plan.head_dim)


def unpack_lse(plan: DecodePlan, lse):
    """Packed lse [batch, kv_heads, rows] -> [batch, q_heads, q_len]."""
    b, h, t, g = plan.batch, plan.kv_heads, plan.q_len, plan.group
    return lse.reshape(b, h, t, g).transpose(0, 1, 3, 2).reshape(b, plan.q_heads, t)


def _no_derivative(primals, tangents):
    raise TypeError(
        "decode_attention is forward only: it serves sampling, where no gradient is taken. "
        "Use pallas_flash.flash_attention for training.")


@functools.lru_cache(maxsize=None)
def _decode_fn(plan: DecodePlan, backend: str, has_sinks: bool, tiles=None):
    """One jitted function per static plan and backend; forward only (custom_jvp whose rule
    raises, so jax.grad and jax.jvp stop with an explanation instead of a silent zero).
    tiles: the Mosaic kernel's DecodeTiles instead of its defaults (benchmarks/decode_tune.py).
    """
    extra = {} if tiles is None else {"tiles": tiles}

    @jax.custom_jvp
    def decode(q, k_cache, v_cache, kv_lengths, block_table, sinks):
        module = _backend_module(backend)
        # Clipped before the cast, so that a wider integer cannot wrap into range.
        lengths = jnp.clip(kv_lengths, 0, plan.max_len).astype(jnp.int32)
        o_part, lse_part = module.partial(plan, backend_queries(module, plan, q, tiles), k_cache,
                                          v_cache, lengths, block_table, **extra)
        # A d-major partial (the Mosaic keys-as-M kernel): O^T [..., head_dim, n], lse [..., n]
        # with n >= rows columns, read in place by the combine.
        d_major = module.d_major(plan, tiles)
        # With sinks the merged O is rescaled once more, so it stays float32 until then.
        out_dtype = jnp.float32 if has_sinks else plan.dtype
        if plan.num_splits == 1:
            out, lse = o_part[:, :, 0], lse_part[:, :, 0]
            if d_major:
                out = jnp.swapaxes(out, -1, -2)[..., :plan.rows, :]
                lse = lse[..., :plan.rows]
            out = unpack_out(plan, out.astype(out_dtype))
        else:
            # The combine reads only num_splits * rows * head_dim floats per head: one Triton
            # kernel serves every backend. It writes O unpacked.
            out, lse = triton_decode.combine(plan, o_part, lse_part, out_dtype, d_major=d_major)
        lse = unpack_lse(plan, lse)
        if has_sinks:
            out, lse = apply_sinks(out, lse, sinks)
        return out.astype(plan.dtype), lse

    decode.defjvp(_no_derivative)
    return jax.jit(decode)


@overload
def decode_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, *, kv_lengths: jax.Array,
    block_table: jax.Array | None = ..., scale: float | None = ..., softcap: float | None = ...,
    window: tuple[int | None, int | None] | None = ..., sinks: jax.Array | None = ...,
    return_lse: Literal[False] = ..., num_splits: int | None = ..., backend: str = ...,
    interpret: bool | None = ...,
) -> jax.Array: ...


@overload
def decode_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, *, kv_lengths: jax.Array,
    block_table: jax.Array | None = ..., scale: float | None = ..., softcap: float | None = ...,
    window: tuple[int | None, int | None] | None = ..., sinks: jax.Array | None = ...,
    return_lse: Literal[True], num_splits: int | None = ..., backend: str = ...,
    interpret: bool | None = ...,
) -> tuple[jax.Array, jax.Array]: ...


@overload
def decode_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, *, kv_lengths: jax.Array,
    block_table: jax.Array | None = ..., scale: float | None = ..., softcap: float | None = ...,
    window: tuple[int | None, int | None] | None = ..., sinks: jax.Array | None = ...,
    return_lse: bool = ..., num_splits: int | None = ..., backend: str = ...,
    interpret: bool | None = ...,
) -> jax.Array | tuple[jax.Array, jax.Array]: ...


def decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    kv_lengths: jax.Array,
    block_table: jax.Array | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    sinks: jax.Array | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
    backend: str = "auto",
    interpret: bool | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of a few new tokens per sequence against a K/V cache, for sampling.

    Forward only: it has no gradient, and differentiating it raises a TypeError (train with
    `flash_attention`). The keys are split across programs (split-KV), so a small batch still
    fills the GPU.

    Args:
      q: [batch, q_len, q_heads, head_dim], 1 <= q_len <= 16: the newest tokens of each
        sequence, aligned bottom-right: token t sits at position kv_lengths[b] - q_len + t and
        sees the keys at positions <= that (its own included: write the new K/V into the cache
        first).
      k_cache, v_cache: contiguous [batch, max_len, kv_heads, head_dim], or paged
        [num_pages, page_size, kv_heads, head_dim] (page_size a power of two >= 16) with
        `block_table`; q's dtype. q_heads is a multiple of kv_heads (GQA, MQA).
      kv_lengths: int [batch], the valid keys of each sequence, counting the q_len new ones.
        Values are clipped to [0, max_len]. A token whose position is negative (kv_length <
        q_len) sees no key: out = 0, lse = -inf.
      block_table: int32 [batch, pages_per_seq]: logical page p of sequence b is physical page
        block_table[b, p] (vLLM, flash_attn_with_kvcache). Entries past a sequence's length
        (or wholly before its window) are never read and may hold anything; the pages that are
        read must be ids in [0, num_pages). When the table and kv_lengths are concrete, a
        ValueError names the first entry that is not. Under jit their values are not known
        when the call is staged: the kernels read page 0 in place of such an id (never memory
        outside the cache) and every output row of that sequence, and its lse, is NaN, so a
        bad table shows instead of a wrong answer; the other sequences are unaffected.
      scale: logit multiplier; default 1/sqrt(head_dim).
      softcap: logits become softcap * tanh(logits / softcap).
      window: (left, right) as in flash_attention: a token at position p sees keys >= p - left
        (None: unbounded); right is clamped to 0 by causality.
      sinks: float [q_heads] sink logits (gpt-oss), as in flash_attention.
      return_lse: also return lse [batch, q_heads, q_len], float32, natural log.
      num_splits: at most this many key chunks per sequence; default by `choose_num_splits`.
      backend: "auto" (the Mosaic kernel on an sm_90 GPU where it serves the call and the
        grid is at most one program per SM, else Triton), "triton" or "mosaic" (ValueError
        when it cannot serve the call).
      interpret: Pallas interpret mode; default: True exactly when JAX has no GPU.

    Returns:
      out [batch, q_len, q_heads, head_dim] in q's dtype, or (out, lse) with return_lse.
    """
    plan, sinks = _validate(q, k_cache, v_cache, kv_lengths, block_table, scale=scale,
                            softcap=softcap, window=window, sinks=sinks, return_lse=return_lse,
                            num_splits=num_splits, backend=backend, interpret=interpret)
    name = _choose_backend(backend, plan)
    out, lse = _decode_fn(plan, name, sinks is not None)(q, k_cache, v_cache, kv_lengths,
                                                        block_table, sinks)
    return (out, lse) if return_lse else out
