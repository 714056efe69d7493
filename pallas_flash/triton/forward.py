"""Forward kernel, lowered through Pallas Triton: O and the row statistics (m, r).

Grid: (query blocks, batch, q_heads). Each program owns block_q query rows of one (batch, head)
and walks the key/value blocks of its kv head (head // group: GQA never copies K/V) with
FlashAttention-2's online softmax, in logit units u (stats.py) and base 2:
    m_j   = max(m_{j-1}, rowmax(U_j))                  U_j = Q K_j^T (or its tanh, softcapped)
    l_j   = l_{j-1} * 2^((m_{j-1} - m_j) c) + rowsum(2^((U_j - m_j) c))
    acc_j = acc_{j-1} * 2^((m_{j-1} - m_j) c) + 2^((U_j - m_j) c) V_j
    O = acc / l,    r = log2 l,    c = logit_scale * log2(e)
Q and K share one head_dim; V, acc and O have V's own (equal, or not: MLA).

With a sink (sinks.py) the last step adds its term to l (stats.sink_epilogue), so O, m and r
are those of the whole softmax, sink included.

Only the key blocks masking.py's range gives are visited, unmasked where every query sees
them whole. A row that sees no key leaves with O = 0, m = 0 and r = -inf: the running max is
read as 0 while it is -inf, so no inf - inf is formed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flash.masking import segment_block_ranges
from pallas_flash.spec import AttentionSpec
from pallas_flash.stats import RowStats, sink_epilogue
from pallas_flash.triton import common

__all__ = ["forward"]


def _forward_kernel(*refs, spec: AttentionSpec, block_q: int, block_kv: int, head_dim: int,
                    head_dim_v: int, has_sinks: bool, tile=None):
    (q_ref, k_ref, v_ref), segment_refs, rest = common.split_refs(refs, 3, spec.has_segments)
    sink_ref, (o_ref, m_ref, r_ref) = (rest[0], rest[1:]) if has_sinks else (None, rest)
    q_ids_ref, kv_ids_ref, lo_ref, hi_ref = segment_refs
    mask = spec.mask
    acc_dtype = common.accumulator_dtype(q_ref.dtype)
    cols = common.column_mask(head_dim, q_ref.shape[-1])
    v_cols = common.value_column_mask(cols, head_dim, head_dim_v, v_ref.shape[-1])

    q_start = (pl.program_id(0) if tile is None else tile) * block_q
    q_pos = common.row_positions(q_start, block_q)
    q = common.load_tile(q_ref, q_start, block_q, mask.seq_q, cols)
    q_ids = None
    if q_ids_ref is not None:
        q_ids = common.load_vector(q_ids_ref, q_start, block_q, mask.seq_q, other=-1)

    c = common.exp2_factor(spec)

    def step(j, carry, masked):
        acc, m, l = carry
        k_start = j * block_kv
        k = common.load_tile(k_ref, k_start, block_kv, mask.seq_kv, cols)
        v = common.load_tile(v_ref, k_start, block_kv, mask.seq_kv, v_cols)
        u, _ = common.logits(spec, q, k)
        poison = None
        if masked:
            kv_ids = None
            if kv_ids_ref is not None:
                kv_ids = common.load_vector(kv_ids_ref, k_start, block_kv, mask.seq_kv, other=-2)
            k_pos = common.row_positions(k_start, block_kv)
            vis = common.tile_visible(spec, q_pos, k_pos, q_ids, kv_ids)
            u = jnp.where(vis, u, -jnp.inf)
            poison = vis & common.nonfinite_rows(v)[None, :]
            v = common.finite_or_zero(v)
        m_new = jnp.maximum(m, jnp.max(u, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2((m - m_safe) * c)
        p = jnp.exp2((u - m_safe[:, None]) * c)
        l = l * alpha + jnp.sum(p, axis=1)
        if poison is not None:
            # Visible pairs whose V row is non-finite carry NaN into P V (not into l).
            p = jnp.where(poison, jnp.nan, p)
        acc = acc * alpha[:, None] + common.dot(spec, p.astype(v.dtype), v)
        return acc, m_new, l

    init = (
        jnp.zeros((block_q, v_ref.shape[-1]), acc_dtype),
        jnp.full((block_q,), -jnp.inf, acc_dtype),
        jnp.zeros((block_q,), acc_dtype),
    )
    bounds = mask.kv_blocks(q_start, block_q, block_kv, mask.seq_kv)
    bounds = common.block_range(bounds, lo_ref, hi_ref)
    acc, m, l = common.three_phase_loop(bounds, step, init)

    # `l != 0` rather than `l > 0`: a NaN row must stay NaN (r too), not pass for empty.
    seen = l != 0
    if sink_ref is None:
        out, r = acc / jnp.where(seen, l, 1.0)[:, None], jnp.log2(l)
    else:
        weight, r = sink_epilogue(m, l, sink_ref[0].astype(acc_dtype), c)
        out = jnp.where(seen[:, None], acc * weight[:, None], 0.0)
    out = common.clamp_to_dtype(out, o_ref.dtype)
    common.store_tile(o_ref, q_start, block_q, mask.seq_q, v_cols, out)
    ok = q_pos < mask.seq_q
    index = pl.ds(q_start, block_q)
    plgpu.store(m_ref.at[index], jnp.where(m == -jnp.inf, 0.0, m).astype(m_ref.dtype), mask=ok)
    plgpu.store(r_ref.at[index], r.astype(r_ref.dtype), mask=ok)


def forward(spec: AttentionSpec, q, k, v, q_ids=None, kv_ids=None, sinks=None, *, skip=None,
            into=None):
    """O [batch, seq_q, q_heads, head_dim_v] (V's head_dim, which may differ from Q/K's) and
    the row statistics (stats.RowStats, each [batch, q_heads, seq_q]).

    q_ids/kv_ids: int32 [batch, seq] segment ids (masking.py), exactly when spec.has_segments.
    sinks: None, or float [q_heads] sink logits folded into the softmax (sinks.py).
    skip, into: a predicated launch (common.predicated), both or neither.
    """
    batch, seq_q, q_heads, head_dim = q.shape
    seq_kv, kv_heads, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    group = q_heads // kv_heads
    cfg = spec.config.fwd
    block_q = common.fit_block(cfg.block_q, seq_q)
    block_kv = common.fit_block(cfg.block_kv, seq_kv)
    d_pad = common.padded_head_dim(head_dim)
    dv_pad = common.padded_head_dim(head_dim_v)
    n_q_blocks = pl.cdiv(seq_q, block_q)

    whole_q = pl.BlockSpec((None, seq_q, None, d_pad), lambda i, b, h: (b, 0, h, 0))
    whole_kv = pl.BlockSpec((None, seq_kv, None, d_pad), lambda i, b, h: (b, 0, h // group, 0))
    whole_v = pl.BlockSpec((None, seq_kv, None, dv_pad), lambda i, b, h: (b, 0, h // group, 0))
    in_specs = [whole_q, whole_kv, whole_v]
    args = [q, k, v]
    if spec.has_segments:
        lo, hi = segment_block_ranges(q_ids, kv_ids, block_q, block_kv)
        seg_specs, seg_args = common.segment_operands(q_ids, kv_ids, lo, hi)
        in_specs += seg_specs
        args += seg_args
    if sinks is not None:
        in_specs.append(pl.BlockSpec((1,), lambda i, b, h: (h,)))
        args.append(sinks.astype(common.accumulator_dtype(q.dtype)))

    stats_dtype = common.accumulator_dtype(q.dtype)
    per_row = pl.BlockSpec((None, None, seq_q), lambda i, b, h: (b, h, 0))
    kernel = functools.partial(
        _forward_kernel, spec=spec, block_q=block_q, block_kv=block_kv, head_dim=head_dim,
        head_dim_v=head_dim_v, has_sinks=sinks is not None,
    )
    out_specs = [pl.BlockSpec((None, seq_q, None, dv_pad), lambda i, b, h: (b, 0, h, 0)),
                 per_row, per_row]
    out_shape = [jax.ShapeDtypeStruct((batch, seq_q, q_heads, head_dim_v), q.dtype),
                 jax.ShapeDtypeStruct((batch, q_heads, seq_q), stats_dtype),
                 jax.ShapeDtypeStruct((batch, q_heads, seq_q), stats_dtype)]
    into = None if into is None else (into[0], into[1].m, into[1].r)
    kernel, in_specs, args, aliases = common.predicated(kernel, in_specs, args, out_specs,
                                                        out_shape, skip, into)
    out, m, r = pl.pallas_call(
        kernel,
        grid=(n_q_blocks, batch, q_heads),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=spec.interpret,
        name="pallas_flash_fwd",
    )(*args)
    return out, RowStats(m, r)
