"""Backward kernels for Hopper (sm_90), lowered through Pallas Mosaic GPU. DRAFT (issue 4, step 2).

Same contract as `pallas_flash.triton.backward.backward`: (dq, dk, dv) in the dtypes and layouts
of q, k, v, from the forward's row statistics (stats.RowStats: m in logit units, r = log2 of the
row's denominator). Weights are recomputed tile by tile as P = 2^((u - m) c - r), u = q.k raw,
c = scale * log2(e), with u - m formed before the scaling as stats.py asks. With
D = rowsum(dO * O) - dlse (one XLA pass before the kernels, as in the Triton backward),
dP = dO V^T and dS = P * (dP - D):

* dK/dV kernel `pallas_flash_mosaic_bwd_dkdv`. Grid (kv tile, kv head, batch). The CTA keeps
  its K and V rows in shared memory and loops, for each q head of the GQA group in turn (inside
  the CTA: no atomics, deterministic), over the q blocks that can see its keys. It works in the
  transposed orientation, so every product has the CTA's key rows as the wgmma M dimension:
      S^T = K Q^T,  P^T = 2^((S^T - m) c - r),  dP^T = V dO^T,  dS^T = P^T (dP^T - D),
      dV += P^T dO,  dK += dS^T Q   (times scale at the end).
  m, r and D index the columns here: they are read from shared memory in the column-vector
  layout (`Layout.WGMMA.reduce(0)`) and broadcast along the rows.
* dQ kernel `pallas_flash_mosaic_bwd_dq`. Grid (q tile, q head, batch), looping over key blocks:
      S = Q K^T,  P,  dP = dO V^T,  dS,  dQ += dS K   (times scale at the end).

Each CTA has `compute_wgs` compute warpgroups and one more warpgroup that only issues TMA copies
(warp specialization; it gives its registers to the compute warpgroups). Streams go through
`stages` shared-memory slots, each with one "loaded" barrier per copied array (completed by the
TMA transaction count) and a "free" barrier that needs one arrival per compute warpgroup before
the copy warpgroup refills the slot. Accumulators are float32 wgmma accumulators.

Warpgroup layout. A warpgroup's wgmma M tile is 64 rows. In the dK/dV kernel, with head_dim <=
128, the two compute warpgroups own 64 key rows each (a 128-row CTA) and share the Q / dO
stream. At head_dim 256 two float32 accumulators of 64 x 256 do not fit one warpgroup's
registers, so both warpgroups own the same 64 key rows and split the *columns* of dK and dV
(128 each); each recomputes S^T and dP^T (which need the full head_dim), i.e. 6 instead of 4
matmul units: a known cost of this draft. The dQ kernel: each compute warpgroup owns 64 q rows.

Causal (any static right bound with its offset; masking.MaskSpec): blocks that no row of a
warpgroup sees are skipped, blocks wholly visible skip the mask, the diagonal ones are masked by
an iota compare. Warpgroups of one CTA need different block ranges from the one stream; a
warpgroup waits for and releases the stream entries it does not use ("drain" steps), which keeps
every "free" barrier at exactly one arrival per warpgroup per phase (as the Mosaic forward does).

float16: dS is cast to float16 for the dS^T Q and dS K products. Like triton/common.py's
`scaled_for_cast`, this draft guards the cast against overflow, but per accumulator row instead
of per tile (a row of dK or dQ only ever meets its own row of dS): each row keeps a running
factor F >= 1 (the largest max|dS_row| / 2^14 seen so far, 1 while it stays below 2^14); dS rows
are divided by F before the cast, the accumulator row is rescaled by F_old / F_new when F grows
and multiplied by F at the end. NaN / inf rows keep F as it is.

Supported in this draft (what the Mosaic forward supports): bfloat16 and float16, head_dim
64/128/256, full or causal (top-left / bottom-right, any static right bound), GQA/MQA, no
softcap, no left window bound, no segment ids or lengths, seq_q and seq_kv multiples of the
tiles (`unsupported_reason`). Everything else raises NotImplementedError. As in the Mosaic
forward, a NaN / inf in a masked-out position of a diagonal block is not isolated.

CPU testing (jax 0.11.2): runs in Mosaic GPU interpret mode (`spec.interpret=True`). There the
interpreter takes no wgmma operand in registers and no `run_state` over an accumulator, so P^T,
dS^T and dS go through shared memory and each product is added to the accumulator afterwards;
the compiled path (operands in registers, accumulating in place) is covered on the CPU only by
the sm_90 lowering test (`jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash.spec import AttentionSpec
from pallas_flash.stats import LOG2E, RowStats

__all__ = ["DKDV_KERNEL_NAME", "DQ_KERNEL_NAME", "MosaicBackwardConfig",
           "default_backward_config", "backward", "unsupported_reason"]

DKDV_KERNEL_NAME = "pallas_flash_mosaic_bwd_dkdv"
DQ_KERNEL_NAME = "pallas_flash_mosaic_bwd_dq"
WG_ROWS = 64                     # wgmma M tile: rows owned by one compute warpgroup
SMEM_LIMIT = 227 * 1024          # H100/H200 shared memory per CTA
F16_CAST_LIMIT = 2.0 ** 14       # |dS| above this is scaled down before the float16 cast
_SUPPORTED_HEAD_DIMS = (64, 128, 256)
_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class MosaicBackwardConfig:
    """Tiles of the two backward kernels.

    dkdv_block_q: q rows per step of the dK/dV kernel (the N of S^T, the K of P^T dO).
    dq_block_kv: key rows per step of the dQ kernel.
    dkdv_stages / dq_stages: shared-memory slots of the streamed operands (>= 2).
    dq_compute_wgs: compute warpgroups (64 q rows each) per dQ CTA, 1 or 2. The dK/dV kernel
        always has 2 (two 64-row key tiles, or two column halves at head_dim 256).
    compute_registers / copy_registers: per-thread register budgets after the split.
    """

    dkdv_block_q: int = 64
    dq_block_kv: int = 128
    dkdv_stages: int = 2
    dq_stages: int = 2
    dq_compute_wgs: int = 2
    compute_registers: int = 232
    copy_registers: int = 40

    def __post_init__(self):
        for name in ("dkdv_block_q", "dq_block_kv"):
            value = getattr(self, name)
            if value % 64 or not 64 <= value <= 256:
                raise ValueError(f"MosaicBackwardConfig.{name} must be 64, 128, 192 or 256, "
                                 f"got {value}")
        for name in ("dkdv_stages", "dq_stages"):
            if getattr(self, name) < 2:
                raise ValueError(f"MosaicBackwardConfig.{name} must be >= 2, "
                                 f"got {getattr(self, name)}")
        if self.dq_compute_wgs not in (1, 2):
            raise ValueError("MosaicBackwardConfig.dq_compute_wgs must be 1 or 2, "
                             f"got {self.dq_compute_wgs}")

    # ---- geometry -------------------------------------------------------------------------

    @staticmethod
    def dkdv_col_splits(head_dim: int) -> int:
        """Column slices of dK/dV per 64 key rows: 2 at head_dim 256 (register budget), else 1."""
        return 2 if head_dim > 128 else 1

    @staticmethod
    def dkdv_compute_wgs() -> int:
        return 2

    def dkdv_block_kv(self, head_dim: int) -> int:
        """Key rows per dK/dV CTA."""
        return WG_ROWS * (self.dkdv_compute_wgs() // self.dkdv_col_splits(head_dim))

    def dq_block_q(self) -> int:
        """Query rows per dQ CTA."""
        return WG_ROWS * self.dq_compute_wgs

    # ---- shared memory (compiled path; interpret mode adds staging buffers) -----------------

    def dkdv_smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        kv = 2 * self.dkdv_block_kv(head_dim) * head_dim * itemsize
        stream = self.dkdv_stages * (2 * self.dkdv_block_q * head_dim * itemsize
                                     + 3 * self.dkdv_block_q * 4)
        return kv + stream

    def dq_smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        rows = self.dq_block_q()
        own = 2 * rows * head_dim * itemsize + 3 * rows * 4
        stream = self.dq_stages * 2 * self.dq_block_kv * head_dim * itemsize
        return own + stream


def default_backward_config(head_dim: int) -> MosaicBackwardConfig:
    """Untuned first guesses that fit 227 KiB of shared memory and 232 registers per thread."""
    if head_dim <= 128:
        return MosaicBackwardConfig(dkdv_block_q=64, dq_block_kv=128 if head_dim <= 64 else 64)
    # head_dim 256: dQ with one compute warpgroup (two would need 256 KiB of shared memory).
    return MosaicBackwardConfig(dkdv_block_q=64, dq_block_kv=64, dq_compute_wgs=1)


def unsupported_reason(spec: AttentionSpec, q, k, v,
                       config: MosaicBackwardConfig | None = None):
    """Why this draft cannot take the call, or None if it can."""
    batch, seq_q, q_heads, head_dim = q.shape
    seq_kv, kv_heads = k.shape[1], k.shape[2]
    mask = spec.mask
    if jnp.dtype(q.dtype) not in _SUPPORTED_DTYPES:
        return f"mosaic backward: dtype {jnp.dtype(q.dtype).name} (only bfloat16 and float16)"
    if not (q.dtype == k.dtype == v.dtype):
        return "mosaic backward: q, k and v must share one dtype"
    if head_dim not in _SUPPORTED_HEAD_DIMS or v.shape[-1] != head_dim:
        return f"mosaic backward: head_dim {head_dim} (only {_SUPPORTED_HEAD_DIMS})"
    if q_heads % kv_heads:
        return f"mosaic backward: q_heads {q_heads} not a multiple of kv_heads {kv_heads}"
    if spec.softcap is not None:
        return "mosaic backward: softcap is not supported yet"
    if mask.left is not None:
        return "mosaic backward: sliding window (left bound) is not supported yet"
    if spec.has_segments:
        return "mosaic backward: segment ids / padding lengths are not supported yet"
    cfg = config or default_backward_config(head_dim)
    q_mult = _lcm(cfg.dkdv_block_q, cfg.dq_block_q())
    kv_mult = _lcm(cfg.dkdv_block_kv(head_dim), cfg.dq_block_kv)
    if seq_q % q_mult:
        return f"mosaic backward: seq_q {seq_q} must be a multiple of {q_mult}"
    if seq_kv % kv_mult:
        return f"mosaic backward: seq_kv {seq_kv} must be a multiple of {kv_mult}"
    for name, need in (("dK/dV", cfg.dkdv_smem_bytes(head_dim)),
                       ("dQ", cfg.dq_smem_bytes(head_dim))):
        if need > SMEM_LIMIT:
            return (f"mosaic backward: config {cfg} needs {need} bytes of shared memory in the "
                    f"{name} kernel at head_dim {head_dim} (limit {SMEM_LIMIT})")
    return None


def _lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)


# ---- helpers used inside the kernels ------------------------------------------------------------

def _rows(x, shape):
    """A per-row vector (WGMMA.reduce(1) layout) broadcast along the columns."""
    return lax.broadcast_in_dim(x, shape, [0])


def _cols(x, shape):
    """A per-column vector (WGMMA.reduce(0) layout) broadcast along the rows."""
    return lax.broadcast_in_dim(x, shape, [1])


def _row_vector(value, n):
    return plgpu.layout_cast(jnp.full((n,), value, jnp.float32), plgpu.Layout.WGMMA.reduce(1))


def _zeros_acc(rows, cols):
    return plgpu.layout_cast(jnp.zeros((rows, cols), jnp.float32), plgpu.Layout.WGMMA)


def _product(acc, a, b_ref, *, interpret: bool, stage_ref=None):
    """acc + a @ b_ref by wgmma; a is an array in registers (WGMMA layout, input dtype).

    Compiled: a stays in registers and the product accumulates in place. Interpret mode takes
    neither, so a goes through `stage_ref` in shared memory and a fresh product is added.
    """
    if not interpret:
        def accumulate(acc_ref):
            plgpu.wgmma(acc_ref, a, b_ref)
        return pl.run_state(accumulate)(plgpu.ACC.init(acc))
    stage_ref[...] = a
    plgpu.commit_smem()

    def fresh(acc_ref):
        plgpu.wgmma(acc_ref, stage_ref, b_ref)
        return acc_ref[...]

    return acc + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))


def _matmul(a_ref, b_ref, shape):
    """a_ref @ b_ref, both in shared memory, into a fresh float32 accumulator."""
    def run(acc_ref):
        plgpu.wgmma(acc_ref, a_ref, b_ref)
        return acc_ref[...]
    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _cast_rows(x, scale, dtype):
    """x cast to dtype; for float16 with a per-row running scale guarding against overflow.

    Returns (x_cast, rescale, scale_new): the accumulator must be multiplied by `rescale`
    (per row) before the new product is added; None / unchanged outside float16.
    """
    if jnp.dtype(dtype) != jnp.float16:
        return x.astype(dtype), None, scale
    amax = jnp.max(jnp.abs(x), axis=1)
    want = jnp.where((amax > F16_CAST_LIMIT) & (amax < jnp.inf), amax * (1.0 / F16_CAST_LIMIT),
                     1.0)
    scale_new = jnp.maximum(scale, want)
    x = x * _rows(1.0 / scale_new, x.shape)
    return x.astype(dtype), scale / scale_new, scale_new


def _positions(shape, row0, col0):
    rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) + row0
    cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) + col0
    return rows, cols


def _div(x, d: int):
    return lax.div(x, jnp.int32(d))


def _relu(x):
    return jnp.maximum(x, jnp.int32(0))


# ---- dK / dV ----------------------------------------------------------------------------------

def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, st_ref, dk_ref, dv_ref,
                 k_smem, v_smem, q_smem, do_smem, st_smem,
                 k_loaded, v_loaded, q_loaded, do_loaded, st_loaded, slot_free, halves_done,
                 *stage_smem,
                 spec: AttentionSpec, cfg: MosaicBackwardConfig, group: int, head_dim: int):
    mask = spec.mask
    dtype = q_ref.dtype
    block_q, stages = cfg.dkdv_block_q, cfg.dkdv_stages
    wgs = cfg.dkdv_compute_wgs()
    splits = cfg.dkdv_col_splits(head_dim)
    row_tiles = wgs // splits
    cols = head_dim // splits
    n_q = mask.seq_q // block_q
    c = spec.scale * LOG2E
    bounded = mask.right is not None
    shift = 0 if not bounded else mask.offset + mask.right  # key j seen by query i iff j <= i + shift

    tile = lax.axis_index("tile")
    kv_head = lax.axis_index("head")
    batch = lax.axis_index("batch")
    wg = lax.axis_index("wg")
    kv_start = tile * (row_tiles * WG_ROWS)

    def first_block(key0):
        """First q block holding a query that sees key `key0` (so any key at or after it)."""
        if not bounded:
            return jnp.int32(0)
        return jnp.minimum(_div(_relu(key0 - shift), block_q), n_q)

    def first_full_block(key_last):
        """First q block whose every query sees key `key_last` (and so every key before it)."""
        if not bounded:
            return jnp.int32(0)
        return jnp.minimum(_div(_relu(key_last - shift) + (block_q - 1), block_q), n_q)

    lo_cta = first_block(kv_start)
    n_cta = n_q - lo_cta  # q blocks per head that the CTA streams
    total = group * n_cta

    def compute(col: int, row_tile):
        plgpu.set_max_registers(cfg.compute_registers, action="increase")
        key0 = kv_start + row_tile * WG_ROWS
        lo = first_block(key0)
        full = first_full_block(key0 + (WG_ROWS - 1))
        my_k, my_v = k_smem.at[row_tile], v_smem.at[row_tile]
        col_slice = (slice(None),) if splits == 1 else (slice(None), pl.ds(col, cols))
        stage = stage_smem[0].at[wg] if spec.interpret else None
        plgpu.barrier_wait(k_loaded.at[row_tile])
        plgpu.barrier_wait(v_loaded.at[row_tile])

        def slot_of(h, i):
            return lax.rem(h * n_cta + (i - lo_cta), jnp.int32(stages))

        def step(h, i, carry, masked: bool):
            dk, dv, fk = carry
            slot = slot_of(h, i)
            q_blk, do_blk, st = q_smem.at[slot], do_smem.at[slot], st_smem.at[slot]
            shape = (WG_ROWS, block_q)
            plgpu.barrier_wait(q_loaded.at[slot])
            plgpu.barrier_wait(st_loaded.at[slot])
            s_t = _matmul(my_k, q_blk.T, shape)
            m = plgpu.load(st.at[0], layout=plgpu.Layout.WGMMA.reduce(0))
            r = plgpu.load(st.at[1], layout=plgpu.Layout.WGMMA.reduce(0))
            p_t = jnp.exp2((s_t - _cols(m, shape)) * c - _cols(r, shape))
            visible = None
            if masked:
                k_pos, q_pos = _positions(shape, key0, i * block_q)
                visible = k_pos <= q_pos + shift
                p_t = jnp.where(visible, p_t, 0.0)
            plgpu.barrier_wait(do_loaded.at[slot])
            dp_t = _matmul(my_v, do_blk.T, shape)
            delta = plgpu.load(st.at[2], layout=plgpu.Layout.WGMMA.reduce(0))
            ds_t = p_t * (dp_t - _cols(delta, shape))
            if masked:
                ds_t = jnp.where(visible, ds_t, 0.0)  # 0 even where dP^T is NaN
            dv = _product(dv, p_t.astype(dtype), do_blk.at[col_slice],
                          interpret=spec.interpret, stage_ref=stage)
            ds_in, rescale, fk = _cast_rows(ds_t, fk, dtype)
            if rescale is not None:
                dk = dk * _rows(rescale, dk.shape)
            dk = _product(dk, ds_in, q_blk.at[col_slice], interpret=spec.interpret,
                          stage_ref=stage)
            plgpu.barrier_arrive(slot_free.at[slot])
            return dk, dv, fk

        def drain(h, i):
            slot = slot_of(h, i)
            plgpu.barrier_wait(q_loaded.at[slot])
            plgpu.barrier_wait(st_loaded.at[slot])
            plgpu.barrier_wait(do_loaded.at[slot])
            plgpu.barrier_arrive(slot_free.at[slot])

        def head_loop(h, carry):
            lax.fori_loop(lo_cta, lo, lambda i, _: drain(h, i), None)
            carry = lax.fori_loop(lo, full, lambda i, cr: step(h, i, cr, True), carry)
            return lax.fori_loop(full, n_q, lambda i, cr: step(h, i, cr, False), carry)

        carry = (_zeros_acc(WG_ROWS, cols), _zeros_acc(WG_ROWS, cols), _row_vector(1.0, WG_ROWS))
        dk, dv, fk = lax.fori_loop(0, group, head_loop, carry)
        dk = dk * _rows(fk * spec.scale, dk.shape)

        # K and V are no longer read once the loops end: their buffers carry dK and dV out.
        rows = (batch, pl.ds(key0, WG_ROWS), kv_head)
        if splits == 1:
            my_k[...] = dk.astype(dtype)
            my_v[...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(my_k, dk_ref.at[rows])
            plgpu.copy_smem_to_gmem(my_v, dv_ref.at[rows])
            plgpu.wait_smem_to_gmem(0)
            return

        # Column halves: both warpgroups read all of K and V, so wait for both to finish, write
        # the halves, wait again, then one warpgroup stores dK and the other dV, whole rows.
        def both_arrived():
            plgpu.barrier_arrive(halves_done)
            plgpu.barrier_wait(halves_done)

        both_arrived()
        my_k.at[:, pl.ds(col, cols)][...] = dk.astype(dtype)
        my_v.at[:, pl.ds(col, cols)][...] = dv.astype(dtype)
        plgpu.commit_smem()
        both_arrived()

        @pl.when(wg == 0)
        def _():
            plgpu.copy_smem_to_gmem(my_k, dk_ref.at[rows])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 1)
        def _():
            plgpu.copy_smem_to_gmem(my_v, dv_ref.at[rows])
            plgpu.wait_smem_to_gmem(0)

    for col_split in range(splits):
        # The column offset stays static (one code path per column slice).
        pl.when((wg < wgs) & (lax.rem(wg, jnp.int32(splits)) == col_split))(
            functools.partial(compute, col_split * cols, _div(wg, splits)))

    @pl.when(wg == wgs)
    def _copy():
        plgpu.set_max_registers(cfg.copy_registers, action="decrease")
        for rt in range(row_tiles):
            rows = (batch, pl.ds(kv_start + rt * WG_ROWS, WG_ROWS), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[rt], k_loaded.at[rt])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[rt], v_loaded.at[rt])

        def issue(t, slot):
            per_head = jnp.maximum(n_cta, 1)
            q_head = kv_head * group + lax.div(t, per_head)
            q0 = (lo_cta + lax.rem(t, per_head)) * block_q
            rows = (batch, pl.ds(q0, block_q), q_head)
            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], q_loaded.at[slot])
            plgpu.copy_gmem_to_smem(st_ref.at[batch, q_head, :, pl.ds(q0, block_q)],
                                    st_smem.at[slot], st_loaded.at[slot])
            plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], do_loaded.at[slot])

        for s in range(stages):
            pl.when(s < total)(functools.partial(issue, jnp.int32(s), s))

        def refill(t, _):
            slot = lax.rem(t, jnp.int32(stages))
            plgpu.barrier_wait(slot_free.at[slot])
            issue(t, slot)

        lax.fori_loop(jnp.int32(stages), total, refill, None)

        # Observe the last releases too (interpret mode checks every barrier phase is awaited).
        def last_release(t, _):
            plgpu.barrier_wait(slot_free.at[lax.rem(t, jnp.int32(stages))])

        lax.fori_loop(jnp.maximum(total - stages, 0), total, last_release, None)


# ---- dQ ---------------------------------------------------------------------------------------

def _dq_kernel(q_ref, k_ref, v_ref, do_ref, st_ref, dq_ref,
               q_smem, do_smem, st_smem, k_smem, v_smem,
               own_loaded, k_loaded, v_loaded, k_free, v_free, *stage_smem,
               spec: AttentionSpec, cfg: MosaicBackwardConfig, group: int, n_tiles: int,
               head_dim: int):
    mask = spec.mask
    dtype = q_ref.dtype
    block_kv, stages, wgs = cfg.dq_block_kv, cfg.dq_stages, cfg.dq_compute_wgs
    n_kv = mask.seq_kv // block_kv
    c = spec.scale * LOG2E
    bounded = mask.right is not None
    reach_shift = 0 if not bounded else mask.offset + mask.right + 1

    tile = lax.axis_index("tile")
    if bounded:
        tile = (n_tiles - 1) - tile  # the longest rows first
    head = lax.axis_index("head")
    batch = lax.axis_index("batch")
    wg = lax.axis_index("wg")
    cta_start = tile * (wgs * WG_ROWS)

    def blocks_reached(row, round_up: bool):
        """Key blocks [0, n) that query `row` sees (round_up: partly; else wholly)."""
        if not bounded:
            return jnp.int32(n_kv)
        keys = jnp.clip(row + reach_shift, 0, mask.seq_kv)
        if round_up:
            keys = keys + (block_kv - 1)
        return _div(keys, block_kv)

    n_steps = blocks_reached(cta_start + (wgs * WG_ROWS - 1), True)

    @pl.when(wg < wgs)
    def _compute():
        plgpu.set_max_registers(cfg.compute_registers, action="increase")
        q0 = cta_start + wg * WG_ROWS
        my_q, my_do, my_st = q_smem.at[wg], do_smem.at[wg], st_smem.at[wg]
        rows = (batch, pl.ds(q0, WG_ROWS), head)
        plgpu.copy_gmem_to_smem(q_ref.at[rows], my_q, own_loaded.at[wg])
        plgpu.copy_gmem_to_smem(do_ref.at[rows], my_do, own_loaded.at[wgs + wg])
        plgpu.copy_gmem_to_smem(st_ref.at[batch, head, :, pl.ds(q0, WG_ROWS)], my_st,
                                own_loaded.at[2 * wgs + wg])
        stage = stage_smem[0].at[wg] if spec.interpret else None
        hi = blocks_reached(q0 + (WG_ROWS - 1), True)
        full = blocks_reached(q0, False)
        shape = (WG_ROWS, block_kv)

        for j in range(3):
            plgpu.barrier_wait(own_loaded.at[j * wgs + wg])
        m = plgpu.load(my_st.at[0], layout=plgpu.Layout.WGMMA.reduce(1))
        r = plgpu.load(my_st.at[1], layout=plgpu.Layout.WGMMA.reduce(1))
        delta = plgpu.load(my_st.at[2], layout=plgpu.Layout.WGMMA.reduce(1))

        def step(s, carry, masked: bool):
            dq, fq = carry
            slot = lax.rem(s, jnp.int32(stages))
            plgpu.barrier_wait(k_loaded.at[slot])
            s_ = _matmul(my_q, k_smem.at[slot].T, shape)
            p = jnp.exp2((s_ - _rows(m, shape)) * c - _rows(r, shape))
            visible = None
            if masked:
                q_pos, k_pos = _positions(shape, q0, s * block_kv)
                visible = k_pos <= q_pos + (reach_shift - 1)
                p = jnp.where(visible, p, 0.0)
            plgpu.barrier_wait(v_loaded.at[slot])
            dp = _matmul(my_do, v_smem.at[slot].T, shape)
            plgpu.barrier_arrive(v_free.at[slot])
            ds = p * (dp - _rows(delta, shape))
            if masked:
                ds = jnp.where(visible, ds, 0.0)
            ds_in, rescale, fq = _cast_rows(ds, fq, dtype)
            if rescale is not None:
                dq = dq * _rows(rescale, dq.shape)
            dq = _product(dq, ds_in, k_smem.at[slot], interpret=spec.interpret, stage_ref=stage)
            plgpu.barrier_arrive(k_free.at[slot])
            return dq, fq

        def drain(s, _):
            slot = lax.rem(s, jnp.int32(stages))
            plgpu.barrier_wait(k_loaded.at[slot])
            plgpu.barrier_wait(v_loaded.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])

        carry = (_zeros_acc(WG_ROWS, head_dim), _row_vector(1.0, WG_ROWS))
        carry = lax.fori_loop(0, full, functools.partial(step, masked=False), carry)
        if bounded:
            carry = lax.fori_loop(full, hi, functools.partial(step, masked=True), carry)
            lax.fori_loop(hi, n_steps, drain, None)
        dq, fq = carry
        dq = dq * _rows(fq * spec.scale, dq.shape)
        my_q[...] = dq.astype(dtype)  # Q is no longer read: its buffer carries dQ out
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(my_q, dq_ref.at[rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == wgs)
    def _copy():
        plgpu.set_max_registers(cfg.copy_registers, action="decrease")
        kv_head = _div(head, group)

        def issue(s, slot):
            rows = (batch, pl.ds(s * block_kv, block_kv), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_loaded.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_loaded.at[slot])

        for s in range(min(stages, n_kv)):
            pl.when(s < n_steps)(functools.partial(issue, s, s))

        def refill(s, _):
            slot = lax.rem(s, jnp.int32(stages))
            rows = (batch, pl.ds(s * block_kv, block_kv), kv_head)
            plgpu.barrier_wait(v_free.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_loaded.at[slot])
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_loaded.at[slot])

        lax.fori_loop(stages, n_steps, refill, None)

        def last_release(s, _):
            slot = lax.rem(s, jnp.int32(stages))
            plgpu.barrier_wait(v_free.at[slot])
            plgpu.barrier_wait(k_free.at[slot])

        lax.fori_loop(jnp.maximum(n_steps - stages, 0), n_steps, last_release, None)


# ---- entry point ------------------------------------------------------------------------------

def backward(spec: AttentionSpec, q, k, v, out, stats: RowStats, do, dlse, q_ids=None,
             kv_ids=None, *, config: MosaicBackwardConfig | None = None):
    """(dq, dk, dv) in the dtypes of q, k, v (contract of triton.backward.backward).

    stats: the forward's row statistics; dlse: the cotangent of the public lse (zeros if unused).
    Raises NotImplementedError for anything this draft does not serve (`unsupported_reason`).
    """
    batch, seq_q, q_heads, head_dim = q.shape
    seq_kv, kv_heads = k.shape[1], k.shape[2]
    cfg = config or default_backward_config(head_dim)
    if q_ids is not None or kv_ids is not None:
        raise NotImplementedError("mosaic backward: segment ids / padding lengths are not "
                                  "supported yet")
    reason = unsupported_reason(spec, q, k, v, cfg)
    if reason is not None:
        raise NotImplementedError(reason)
    group = q_heads // kv_heads
    dtype = q.dtype
    do = do.astype(dtype)

    # The preprocess, in XLA: D = rowsum(dO * O) - dlse, and r = -inf (a row that saw no key)
    # read as +inf so that its P is exactly 0. m, r and D travel together, [b, hq, 3, seq_q].
    delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), do.astype(jnp.float32))
    delta = delta - dlse.astype(jnp.float32)
    r = stats.r.astype(jnp.float32)
    r = jnp.where(r == -jnp.inf, jnp.inf, r)
    rows = jnp.stack([stats.m.astype(jnp.float32), r, delta], axis=2)
    interpret = plgpu.InterpretGPUParams() if spec.interpret else None
    compiler = plgpu.CompilerParams(approx_math=True)

    # ---- dK, dV ------------------------------------------------------------------------------
    wgs = cfg.dkdv_compute_wgs()
    splits = cfg.dkdv_col_splits(head_dim)
    block_kv = cfg.dkdv_block_kv(head_dim)
    row_tiles = block_kv // WG_ROWS
    bq, st = cfg.dkdv_block_q, cfg.dkdv_stages
    scratch = [
        plgpu.SMEM((row_tiles, WG_ROWS, head_dim), dtype),
        plgpu.SMEM((row_tiles, WG_ROWS, head_dim), dtype),
        plgpu.SMEM((st, bq, head_dim), dtype),
        plgpu.SMEM((st, bq, head_dim), dtype),
        plgpu.SMEM((st, 3, bq), jnp.float32),
        plgpu.Barrier(num_barriers=row_tiles),
        plgpu.Barrier(num_barriers=row_tiles),
        plgpu.Barrier(num_barriers=st),
        plgpu.Barrier(num_barriers=st),
        plgpu.Barrier(num_barriers=st),
        plgpu.Barrier(num_arrivals=wgs, num_barriers=st),
        plgpu.Barrier(num_arrivals=wgs),
    ]
    if spec.interpret:
        scratch.append(plgpu.SMEM((wgs, WG_ROWS, bq), dtype))
    kv_shape = jax.ShapeDtypeStruct(k.shape, dtype)
    dk, dv = plgpu.kernel(
        functools.partial(_dkdv_kernel, spec=spec, cfg=cfg, group=group, head_dim=head_dim),
        out_type=(kv_shape, kv_shape),
        scratch_types=scratch,
        grid=(seq_kv // block_kv, kv_heads, batch),
        grid_names=("tile", "head", "batch"),
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=compiler,
        interpret=interpret,
        kernel_name=DKDV_KERNEL_NAME,
    )(q, k, v, do, rows)

    # ---- dQ ----------------------------------------------------------------------------------
    wgs = cfg.dq_compute_wgs
    bkv, st = cfg.dq_block_kv, cfg.dq_stages
    scratch = [
        plgpu.SMEM((wgs, WG_ROWS, head_dim), dtype),
        plgpu.SMEM((wgs, WG_ROWS, head_dim), dtype),
        plgpu.SMEM((wgs, 3, WG_ROWS), jnp.float32),
        plgpu.SMEM((st, bkv, head_dim), dtype),
        plgpu.SMEM((st, bkv, head_dim), dtype),
        plgpu.Barrier(num_barriers=3 * wgs),
        plgpu.Barrier(num_barriers=st),
        plgpu.Barrier(num_barriers=st),
        plgpu.Barrier(num_arrivals=wgs, num_barriers=st),
        plgpu.Barrier(num_arrivals=wgs, num_barriers=st),
    ]
    if spec.interpret:
        scratch.append(plgpu.SMEM((wgs, WG_ROWS, bkv), dtype))
    n_tiles = seq_q // cfg.dq_block_q()
    dq = plgpu.kernel(
        functools.partial(_dq_kernel, spec=spec, cfg=cfg, group=group, n_tiles=n_tiles,
                          head_dim=head_dim),
        out_type=jax.ShapeDtypeStruct(q.shape, dtype),
        scratch_types=scratch,
        grid=(n_tiles, q_heads, batch),
        grid_names=("tile", "head", "batch"),
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=compiler,
        interpret=interpret,
        kernel_name=DQ_KERNEL_NAME,
    )(q, k, v, do, rows)
    return dq, dk, dv
