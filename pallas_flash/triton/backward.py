"""Backward kernels, lowered through Pallas Triton, FlashAttention-2 style, without atomics.

Both kernels recompute P = 2^((U - m) c - r) tile by tile from Q, K and the saved row
statistics (stats.py); nothing of size seq_q x seq_kv ever exists. With dS = P * (dP - D),
dP = dO V^T and D = rowsum(dO * O) - dlse (the lse cotangent enters here: d lse_i / d S_ij =
P_ij):

* dK/dV kernel. Grid (key blocks, batch, kv_heads). Each program owns block_kv keys of one kv
  head, and loops over the `group` q heads that share it (GQA/MQA) and, inside, over the query
  blocks that may see these keys:  dV += P^T dO,  dK += dS^T Q * scale.
  Summing the group inside one program is what makes dK/dV deterministic with no atomics.
* dQ kernel. Grid (query blocks, batch, q_heads), looping over key blocks:  dQ += dS K * scale.

V, dO and dV have V's head_dim, which may differ from Q/K's (MLA); dP = dO V^T contracts it.
Softcap: S = c * tanh(S_raw / c), so dS_raw = dS * (1 - tanh^2).
Rows that saw no key (r = -inf) are read as r = +inf, which turns their P into exactly 0; rows
past the end of the sequence are read the same way, so neither needs a mask.
On masked tiles P and dS are set to 0 outside the mask, and the operand of each block matmul
whose rows a masked pair may skip (Q for dK, K for dQ) has its NaN and inf entries zeroed: a
non-finite input reaches exactly the gradients that depend on it (common.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flash.masking import segment_block_ranges
from pallas_flash.spec import AttentionSpec
from pallas_flash.stats import RowStats, output_dot
from pallas_flash.triton import common

__all__ = ["backward"]


def _load_stats(m_ref, r_ref, start, block, n_rows, head=None):
    """m and r of a query block; r = -inf (saw nothing) and rows past the end become r = +inf."""
    m = common.load_vector(m_ref, start, block, n_rows, head=head, other=0.0)
    r = common.load_vector(r_ref, start, block, n_rows, head=head, other=jnp.inf)
    return m, jnp.where(r == -jnp.inf, jnp.inf, r)


def _probabilities_and_ds(spec, q, k, v, do, stats, delta, vis):
    """P and dS (w.r.t. the raw scaled logits) of one tile."""
    m, r = stats
    u, t = common.logits(spec, q, k)
    p = jnp.exp2((u - m[:, None]) * common.exp2_factor(spec) - r[:, None])
    if vis is not None:
        p = jnp.where(vis, p, 0.0)  # 0 even on rows whose r is NaN
    dp = common.dot(spec, do, v, trans_b=True)
    ds = p * (dp - delta[:, None])
    if t is not None:
        ds = ds * (1.0 - t * t)
    if vis is not None:
        ds = jnp.where(vis, ds, 0.0)  # masked pairs: 0, even where dP is NaN from unseen rows
    return p, ds


def _ds_product(spec, ds, x, *, trans_a=False):
    """ds @ x (or ds^T @ x) in x's dtype, safe from float16 overflow (common.scaled_for_cast)."""
    ds, f = common.scaled_for_cast(ds, x.dtype)
    return common.unscale(common.dot(spec, ds, x, trans_a=trans_a), f)


def _dkdv_kernel(*refs, spec: AttentionSpec, group: int, block_q: int, block_kv: int,
                 head_dim: int, head_dim_v: int, tile=None):
    (q_ref, k_ref, v_ref, do_ref, m_ref, r_ref, delta_ref), segment_refs, (dk_ref, dv_ref) = (
        common.split_refs(refs, 7, spec.has_segments))
    q_ids_ref, kv_ids_ref, lo_ref, hi_ref = segment_refs
    mask = spec.mask
    acc_dtype = common.accumulator_dtype(q_ref.dtype)
    d_pad = q_ref.shape[-1]
    cols = common.column_mask(head_dim, d_pad)
    dv_pad = v_ref.shape[-1]
    v_cols = common.value_column_mask(cols, head_dim, head_dim_v, dv_pad)

    kv_start = (pl.program_id(0) if tile is None else tile) * block_kv
    k_pos = common.row_positions(kv_start, block_kv)
    k = common.load_tile(k_ref, kv_start, block_kv, mask.seq_kv, cols)
    v = common.load_tile(v_ref, kv_start, block_kv, mask.seq_kv, v_cols)
    kv_ids = None
    if kv_ids_ref is not None:
        kv_ids = common.load_vector(kv_ids_ref, kv_start, block_kv, mask.seq_kv, other=-2)
    bounds = mask.q_blocks(kv_start, block_kv, block_q, mask.seq_kv, mask.seq_q)
    bounds = common.block_range(bounds, lo_ref, hi_ref)

    def head_step(g, carry):
        def step(i, carry, masked):
            dk, dv = carry
            q_start = i * block_q
            q = common.load_tile(q_ref, q_start, block_q, mask.seq_q, cols, head=g)
            do = common.load_tile(do_ref, q_start, block_q, mask.seq_q, v_cols, head=g)
            stats = _load_stats(m_ref, r_ref, q_start, block_q, mask.seq_q, head=g)
            delta = common.load_vector(delta_ref, q_start, block_q, mask.seq_q, head=g, other=0.0)
            vis = None
            q_for_dk = q
            if masked:
                q_ids = None
                if q_ids_ref is not None:
                    q_ids = common.load_vector(q_ids_ref, q_start, block_q, mask.seq_q, other=-1)
                q_pos = common.row_positions(q_start, block_q)
                vis = common.tile_visible(spec, q_pos, k_pos, q_ids, kv_ids)
                do = common.zero_unseen_rows(do, common.any_along(vis, 1))
                # A NaN in q[i] reaches dK[j] through dS[i, j], NaN for every key j that row i
                # sees; for the keys it does not see, dS[i, j] = 0 must not meet the NaN itself.
                q_for_dk = common.finite_or_zero(q)
            p, ds = _probabilities_and_ds(spec, q, k, v, do, stats, delta, vis)
            dv = dv + common.dot(spec, p.astype(do.dtype), do, trans_a=True)
            dk = dk + _ds_product(spec, ds, q_for_dk, trans_a=True)
            return dk, dv

        return common.three_phase_loop(bounds, step, carry)

    zeros = jnp.zeros((block_kv, d_pad), acc_dtype)
    zeros_v = zeros if dv_pad == d_pad else jnp.zeros((block_kv, dv_pad), acc_dtype)
    dk, dv = jax.lax.fori_loop(jnp.int32(0), jnp.int32(group), head_step, (zeros, zeros_v))
    common.store_tile(dk_ref, kv_start, block_kv, mask.seq_kv, cols, dk * spec.scale)
    common.store_tile(dv_ref, kv_start, block_kv, mask.seq_kv, v_cols, dv)


def _dq_kernel(*refs, spec: AttentionSpec, block_q: int, block_kv: int, head_dim: int,
               head_dim_v: int, tile=None):
    (q_ref, k_ref, v_ref, do_ref, m_ref, r_ref, delta_ref), segment_refs, (dq_ref,) = (
        common.split_refs(refs, 7, spec.has_segments))
    q_ids_ref, kv_ids_ref, lo_ref, hi_ref = segment_refs
    mask = spec.mask
    acc_dtype = common.accumulator_dtype(q_ref.dtype)
    d_pad = q_ref.shape[-1]
    cols = common.column_mask(head_dim, d_pad)
    v_cols = common.value_column_mask(cols, head_dim, head_dim_v, v_ref.shape[-1])

    q_start = (pl.program_id(0) if tile is None else tile) * block_q
    q_pos = common.row_positions(q_start, block_q)
    q = common.load_tile(q_ref, q_start, block_q, mask.seq_q, cols)
    do = common.load_tile(do_ref, q_start, block_q, mask.seq_q, v_cols)
    stats = _load_stats(m_ref, r_ref, q_start, block_q, mask.seq_q)
    delta = common.load_vector(delta_ref, q_start, block_q, mask.seq_q, other=0.0)
    q_ids = None
    if q_ids_ref is not None:
        q_ids = common.load_vector(q_ids_ref, q_start, block_q, mask.seq_q, other=-1)

    def step(j, dq, masked):
        k_start = j * block_kv
        k = common.load_tile(k_ref, k_start, block_kv, mask.seq_kv, cols)
        v = common.load_tile(v_ref, k_start, block_kv, mask.seq_kv, v_cols)
        vis = None
        k_for_dq = k
        if masked:
            kv_ids = None
            if kv_ids_ref is not None:
                kv_ids = common.load_vector(kv_ids_ref, k_start, block_kv, mask.seq_kv, other=-2)
            k_pos = common.row_positions(k_start, block_kv)
            vis = common.tile_visible(spec, q_pos, k_pos, q_ids, kv_ids)
            k_for_dq = common.finite_or_zero(k)   # as q in the dK/dV kernel
        _, ds = _probabilities_and_ds(spec, q, k, v, do, stats, delta, vis)
        return dq + _ds_product(spec, ds, k_for_dq)

    bounds = mask.kv_blocks(q_start, block_q, block_kv, mask.seq_kv)
    bounds = common.block_range(bounds, lo_ref, hi_ref)
    dq = common.three_phase_loop(bounds, step, jnp.zeros((block_q, d_pad), acc_dtype))
    common.store_tile(dq_ref, q_start, block_q, mask.seq_q, cols, dq * spec.scale)


def backward(spec: AttentionSpec, q, k, v, out, stats: RowStats, do, dlse, q_ids=None,
             kv_ids=None, *, delta=None, skip=None, into=None):
    """(dq, dk, dv) in the dtypes and shapes of q, k, v (dv and dO have V's head_dim).

    stats: the forward's row statistics (stats.RowStats); dlse: the cotangent of the public lse
    (zeros if unused).
    delta: the preprocess's D (stats.output_dot in the accumulator dtype), if already formed.
    skip, into: a predicated launch of both kernels (common.predicated), both or neither.
    """
    if (skip is None) != (into is None):
        raise ValueError("skip and into are given together or not at all")
    batch, seq_q, q_heads, head_dim = q.shape
    seq_kv, kv_heads, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    group = q_heads // kv_heads
    d_pad = common.padded_head_dim(head_dim)
    dv_pad = common.padded_head_dim(head_dim_v)
    acc_dtype = common.accumulator_dtype(q.dtype)

    # The preprocess: one XLA pass over O and dO, [batch, q_heads, seq_q].
    if delta is None:
        delta = output_dot(out, do, dlse, acc_dtype)
    compiler = lambda cfg: plgpu.CompilerParams(num_warps=cfg.num_warps,  # noqa: E731
                                                num_stages=cfg.num_stages)

    # ---- dK, dV: one program per (key block, batch, kv head) -----------------------------------
    cfg = spec.config.bwd_dkdv
    block_q = common.fit_block(cfg.block_q, seq_q)
    block_kv = common.fit_block(cfg.block_kv, seq_kv)
    group_q = pl.BlockSpec((None, seq_q, group, d_pad), lambda j, b, h: (b, 0, h, 0))
    group_do = pl.BlockSpec((None, seq_q, group, dv_pad), lambda j, b, h: (b, 0, h, 0))
    group_rows = pl.BlockSpec((None, group, seq_q), lambda j, b, h: (b, h, 0))
    own_kv = pl.BlockSpec((None, seq_kv, None, d_pad), lambda j, b, h: (b, 0, h, 0))
    own_v = pl.BlockSpec((None, seq_kv, None, dv_pad), lambda j, b, h: (b, 0, h, 0))
    in_specs = [group_q, own_kv, own_v, group_do, group_rows, group_rows, group_rows]
    args = [q, k, v, do, stats.m, stats.r, delta]
    if spec.has_segments:
        # Per key block: the query blocks whose ids may match.
        lo, hi = segment_block_ranges(kv_ids, q_ids, block_kv, block_q)
        seg_specs, seg_args = common.segment_operands(q_ids, kv_ids, lo, hi)
        in_specs += seg_specs
        args += seg_args
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    kernel, in_specs, args, aliases = common.predicated(
        functools.partial(_dkdv_kernel, spec=spec, group=group, block_q=block_q,
                          block_kv=block_kv, head_dim=head_dim, head_dim_v=head_dim_v),
        in_specs, args, [own_kv, own_v], out_shape, skip, None if into is None else into[1:])
    dk, dv = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(seq_kv, block_kv), batch, kv_heads),
        in_specs=in_specs,
        out_specs=[own_kv, own_v],
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=compiler(cfg),
        interpret=spec.interpret,
        name="pallas_flash_bwd_dkdv",
    )(*args)

    # ---- dQ: one program per (query block, batch, q head) ---------------------------------------
    cfg = spec.config.bwd_dq
    block_q = common.fit_block(cfg.block_q, seq_q)
    block_kv = common.fit_block(cfg.block_kv, seq_kv)
    own_q = pl.BlockSpec((None, seq_q, None, d_pad), lambda i, b, h: (b, 0, h, 0))
    own_do = pl.BlockSpec((None, seq_q, None, dv_pad), lambda i, b, h: (b, 0, h, 0))
    shared_kv = pl.BlockSpec((None, seq_kv, None, d_pad), lambda i, b, h: (b, 0, h // group, 0))
    shared_v = pl.BlockSpec((None, seq_kv, None, dv_pad), lambda i, b, h: (b, 0, h // group, 0))
    own_rows = pl.BlockSpec((None, None, seq_q), lambda i, b, h: (b, h, 0))
    in_specs = [own_q, shared_kv, shared_v, own_do, own_rows, own_rows, own_rows]
    args = [q, k, v, do, stats.m, stats.r, delta]
    if spec.has_segments:
        lo, hi = segment_block_ranges(q_ids, kv_ids, block_q, block_kv)
        seg_specs, seg_args = common.segment_operands(q_ids, kv_ids, lo, hi)
        in_specs += seg_specs
        args += seg_args
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    kernel, in_specs, args, aliases = common.predicated(
        functools.partial(_dq_kernel, spec=spec, block_q=block_q, block_kv=block_kv,
                          head_dim=head_dim, head_dim_v=head_dim_v),
        in_specs, args, [own_q], out_shape, skip, None if into is None else into[:1])
    (dq,) = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(seq_q, block_q), batch, q_heads),
        in_specs=in_specs,
        out_specs=[own_q],
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=compiler(cfg),
        interpret=spec.interpret,
        name="pallas_flash_bwd_dq",
    )(*args)
    return dq, dk, dv
