"""Tiles and hardware budgets of the Mosaic GPU kernels (Hopper, sm_90).

One frozen, self-validating dataclass per kernel family, hashable so it can be a static
argument: `MosaicForwardConfig` (forward.py) and `MosaicBackwardConfig` (backward.py and
fused_backward.py). Each default says why in a line; the measurements behind them, and how to
re-tune, are in docs/tuning.md. The budgets below are what a config is checked against before
any launch, so a tile that cannot run fails in Python, also on a CPU.
"""

from __future__ import annotations

import dataclasses

from pallas_flash.config import HOPPER_SHARED_MEMORY
from pallas_flash.spec import AttentionSpec

__all__ = ["MosaicBackwardConfig", "MosaicForwardConfig", "default_backward_config",
           "default_forward_config", "register_budget"]

# ---- budgets --------------------------------------------------------------------------------

SMEM_LIMIT = HOPPER_SHARED_MEMORY   # bytes of shared memory per CTA on an H100 / H200
# What Mosaic GPU allocates beyond the operand tiles (barriers, alignment): about 3.2 KB.
SMEM_RESERVED = 4096
MAX_REGISTERS = 512                 # per thread, summed over a CTA's warpgroups (65536 / 128)
WG_ROWS = 64                        # wgmma M tile: rows owned by one compute warpgroup

# The fused backward's fixed tile: 128 keys per CTA (one 64-row tile per compute warpgroup),
# 64 query rows per step (the rows of one dQ tile).
FUSED_CTA_KEYS = 2 * WG_ROWS
FUSED_BLOCK_Q = WG_ROWS
FUSED_DS_BUFFERS = 2                # dS^T by step parity: one warpgroup may run a step ahead
FUSED_REGISTER_POOL = 4 * 128       # 4 warpgroups x 128 registers per thread at launch
# When the fused backward splits its kv heads over launches (schedule.fused_launches), so that
# its float32 dQ sum is never whole: only from this size of sum up (below it a step's peak is
# already dominated by the operands), into at most this many launches, each of at least this
# many waves of CTAs over an H100 / H200's SMs (fewer waves leave the launch's tail idle).
FUSED_SPLIT_BYTES = 256 << 20
FUSED_MAX_LAUNCHES = 8
FUSED_MIN_WAVES = 4
HOPPER_SMS = 132                    # an H100 / H200; decode's count where a device reports none
# How the persistent fused backward hands out items (schedule.persistent_plan): longest
# first, each to the least loaded CTA; or the same with the CTA indices mirrored (tests).
HANDOUTS = ("longest_first", "reversed")


def register_budget(warpgroups: int) -> int:
    """The most that a CTA's setmaxnreg budgets may sum to, per thread.

    A launch hands every thread the same multiple of 8 (168 with three warpgroups, 128 with
    four) and setmaxnreg only moves registers between warpgroups; past this sum the last
    increase waits forever for registers no warpgroup frees (the GPU hangs).
    """
    return warpgroups * (MAX_REGISTERS // warpgroups // 8 * 8)


# setmaxnreg's range (PTX ISA): a multiple of 8 from 24 to 256 registers per thread.
MIN_SETMAXNREG, MAX_SETMAXNREG = 24, 256


def _check_registers(owner: str, value) -> None:
    if (isinstance(value, bool) or not isinstance(value, int) or value % 8
            or not MIN_SETMAXNREG <= value <= MAX_SETMAXNREG):
        raise ValueError(f"{owner} must be a multiple of 8 from {MIN_SETMAXNREG} to "
                         f"{MAX_SETMAXNREG} (setmaxnreg's range), got {value!r}")


def _check_chunk(owner: str, chunk) -> None:
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)
                              or chunk < 1):
        raise ValueError(f"{owner} must be None or a positive int, got {chunk!r}")


# ---- forward ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MosaicForwardConfig:
    """Tiles of the Mosaic forward kernel; the comment at each field says why its default.

    A CTA holds compute_wgs * block_q query rows and one more warpgroup that only issues TMA
    copies of K / V blocks of block_kv keys into `stages` shared-memory slots.
    """

    # One 64-row wgmma M tile per compute warpgroup; 128 would need two accumulators each.
    block_q: int = 64
    # Keys per step, a multiple of 16 in [64, 256]: the widest multiple of 64 whose two
    # K / V slots fit shared memory at head_dim 128.
    block_kv: int = 128
    # K / V slots in flight: two hide a block's copy behind the previous block's compute; a
    # third does not fit at head_dim 128, block_kv 128.
    stages: int = 2
    # Offset the two compute warpgroups by half a step so one's softmax overlaps the other's
    # wgmmas: the faster schedule without `overlap`.
    pingpong: bool = True
    # Lag P V by one block so the softmax of block j runs while P_{j-1} V_{j-1} is on the
    # tensor cores (FlashAttention-3's intra-warpgroup pipelining); costs a second P tile of
    # registers. On by default above head_dim 64, and with three compute warpgroups at 64.
    overlap: bool = False
    # setmaxnreg budgets: the copy warpgroup keeps what TMA issue needs, the compute
    # warpgroups take the rest of register_budget(compute_wgs + 1) (2 x 232 + 40 = 504).
    compute_registers: int = 232
    copy_registers: int = 40
    # A folder for Mosaic GPU traces of each call (common.profile_params); "" for none.
    profile_dir: str = ""
    # CTAs per cluster along the query tiles (1, 2, 4): n CTAs share each K / V block by TMA
    # multicast, cutting L2 reads n-fold; it pays only when adjacent tiles stream the same
    # keys (no position mask), so 1 unless default_forward_config picks 2.
    cluster: int = 1
    # Compute warpgroups per CTA (2 or 3). Three serve 192 rows from each K / V block instead
    # of 128, with 160 registers a thread instead of 232: it pays at head_dim 64 only.
    compute_wgs: int = 2
    # Form each exponent as one multiply-add, u c - (m c), instead of (u - m) c: one
    # instruction less per score, at a relative error of |m c| 2^-24 per weight, far below the
    # 16-bit operands' rounding (stats.py's m and r are unchanged).
    fused_exponent: bool = True
    # Heads interleaved tile by tile in the launch order (a divisor of the q heads; schedule.py);
    # None: one head at a time, or FlashAttention-3's L2 sections under a causal bound.
    head_chunk: int | None = None
    # A persistent grid: one CTA per SM runs (tile, head, batch) items, longest first to the
    # least loaded CTA (schedule.persistent_forward_plan); the next item's K / V stream in under
    # this one's last steps and epilogue. For grids of many short CTAs (short sequences).
    persistent: bool = False
    # CTAs of the persistent grid; None: the device's SMs.
    ctas: int | None = None
    # Persistent only: a second Q buffer per compute warpgroup, so that the next item's Q loads
    # while this item runs instead of after its store (one more Q tile of shared memory).
    q_prefetch: bool = False

    def __post_init__(self):
        if self.block_q != 64:
            raise ValueError(f"MosaicForwardConfig.block_q must be 64, got {self.block_q}")
        # 16: the P V product's K in a 32-byte swizzle at the narrowest (forward._v_transforms);
        # 256: a wgmma's largest N (Q K^T).
        if self.block_kv % 16 or not 64 <= self.block_kv <= 256:
            raise ValueError("MosaicForwardConfig.block_kv must be a multiple of 16 in "
                             f"[64, 256], got {self.block_kv}")
        if self.stages < 2:
            raise ValueError(f"MosaicForwardConfig.stages must be >= 2, got {self.stages}")
        # Mosaic GPU splits a multicast block only into whole 8-row tiles of its layout.
        if self.cluster not in (1, 2, 4):
            raise ValueError(
                f"MosaicForwardConfig.cluster must be 1, 2 or 4, got {self.cluster}")
        if (self.block_kv // self.cluster) % 8:
            raise ValueError(
                f"MosaicForwardConfig.cluster must be 1 or 2 at block_kv={self.block_kv} (each "
                f"CTA's multicast slice, block_kv / cluster rows, must be whole 8-row tiles), "
                f"got {self.cluster}")
        _check_chunk("MosaicForwardConfig.head_chunk", self.head_chunk)
        _check_chunk("MosaicForwardConfig.ctas", self.ctas)
        if self.persistent and self.cluster > 1:
            raise ValueError("MosaicForwardConfig.persistent runs without clusters (a cluster's "
                             f"CTAs share blocks of adjacent tiles), got cluster={self.cluster}")
        if self.q_prefetch and not self.persistent:
            raise ValueError("MosaicForwardConfig.q_prefetch needs persistent=True (a grid "
                             "CTA runs one item, so there is no next Q to load)")
        if self.cluster > 1 and self.head_chunk not in (None, 1):
            raise ValueError("MosaicForwardConfig.head_chunk must be None or 1 with clusters "
                             f"(a cluster's CTAs are adjacent tiles), got {self.head_chunk}")
        if self.compute_wgs not in (2, 3):
            raise ValueError(
                f"MosaicForwardConfig.compute_wgs must be 2 or 3, got {self.compute_wgs}")
        if self.compute_wgs != 2 and self.pingpong:
            # The ping-pong rendezvous offsets one warpgroup against exactly one other.
            raise ValueError("MosaicForwardConfig.compute_wgs must be 2 with pingpong=True, "
                             f"got {self.compute_wgs}")
        for name in ("compute_registers", "copy_registers"):
            _check_registers(f"MosaicForwardConfig.{name}", getattr(self, name))
        budget = register_budget(self.compute_wgs + 1)
        if self.compute_wgs * self.compute_registers + self.copy_registers > budget:
            most = (budget - self.copy_registers) // self.compute_wgs // 8 * 8
            raise ValueError(
                f"MosaicForwardConfig.compute_registers must be at most {most} with "
                f"compute_wgs={self.compute_wgs} and copy_registers={self.copy_registers} "
                f"(compute_wgs * compute_registers + copy_registers <= {budget}), "
                f"got {self.compute_registers}")

    @property
    def cta_rows(self) -> int:
        """Query rows per CTA: block_q for each compute warpgroup."""
        return self.compute_wgs * self.block_q

    def smem_bytes(self, head_dim: int, itemsize: int = 2, head_dim_v: int | None = None) -> int:
        """Shared memory of one CTA; head_dim_v: V's head_dim if not Q/K's (MLA), whose O
        then stages in a buffer of its own (Q's otherwise)."""
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        q = self.cta_rows * head_dim * itemsize * (2 if self.q_prefetch else 1)
        o = self.cta_rows * head_dim_v * itemsize if head_dim_v != head_dim else 0
        kv = self.stages * self.block_kv * (head_dim + head_dim_v) * itemsize
        stats = 2 * self.cta_rows * 4
        return q + o + kv + stats + SMEM_RESERVED


def default_forward_config(head_dim: int, spec: AttentionSpec | None = None
                           ) -> MosaicForwardConfig:
    """The forward's tiles for `head_dim` (and, given `spec`, for the call: compiled-only
    choices need it). docs/tuning.md has the sweeps behind each branch."""
    if head_dim <= 64:
        if spec is not None and not spec.interpret:
            # Three compute warpgroups, 192 rows a CTA: FlashAttention-3's head_dim 64 tile.
            # Not interpreted: the interpreter needs a CPU-pool thread per waiting warpgroup.
            return MosaicForwardConfig(block_q=64, block_kv=128, stages=2, pingpong=False,
                                       overlap=True, compute_wgs=3, compute_registers=160,
                                       copy_registers=32)
        # Small tiles compute little per step: ping-pong hides the softmax better than overlap.
        return MosaicForwardConfig(block_q=64, block_kv=256, stages=2)
    if head_dim <= 128:
        if head_dim == 128 and _persistent_pays(spec):
            # Items of a few key blocks each: one CTA per SM hides each item's Q load and
            # store under the next item's K / V stream, which a launch per tile cannot.
            return MosaicForwardConfig(block_q=64, block_kv=128, stages=2, pingpong=False,
                                       overlap=True, persistent=True)
        clusters = _clusters_pay(spec)
        if head_dim == 96 and clusters:
            # Every tile streams every key: 192-key blocks halve the steps per key (at 80 they
            # measured no faster). Under a causal bound the diagonal block's masked half costs
            # more than that saves.
            return MosaicForwardConfig(block_q=64, block_kv=192, stages=2, pingpong=False,
                                       overlap=True, cluster=2)
        # The largest block whose two slots fit at head_dim 128, with the softmax overlapping
        # P V; at 112 a third slot fits too and keeps the copies further ahead.
        return MosaicForwardConfig(block_q=64, block_kv=128, stages=3 if head_dim == 112 else 2,
                                   pingpong=False, overlap=True, cluster=2 if clusters else 1)
    if head_dim <= 176:
        # Two slots of 128 keys still fit: half the steps of 64-key blocks.
        return MosaicForwardConfig(block_q=64, block_kv=128, stages=2, pingpong=False,
                                   overlap=True)
    # Up to head_dim 256: 64 keys keep two K / V slots in shared memory. At 208 a third slot
    # fits and keeps the copies further ahead; at 192 it measured slower.
    return MosaicForwardConfig(block_q=64, block_kv=64, stages=3 if head_dim == 208 else 2,
                               pingpong=False, overlap=True)


# Longest key sequence at which the head_dim 128 forward runs persistent (docs/tuning.md).
PERSISTENT_FORWARD_MAX_KV = 1024


def _persistent_pays(spec: AttentionSpec | None) -> bool:
    """Whether a head_dim 128 call runs the persistent grid: where clusters would pay (every
    tile streams the same key blocks), with at most PERSISTENT_FORWARD_MAX_KV keys. With a
    causal bound, or longer keys, the grid measured faster."""
    return _clusters_pay(spec) and spec.mask.seq_kv <= PERSISTENT_FORWARD_MAX_KV


def _clusters_pay(spec: AttentionSpec | None) -> bool:
    """Whether a head_dim 128 call runs in clusters of two: compiled (the interpreter has no
    multicast) and every tile streams the same key blocks (no position mask, no segment ids)."""
    return (spec is not None and not spec.interpret and not spec.mask.has_position_mask
            and not spec.has_segments)


# ---- backward -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MosaicBackwardConfig:
    """Tiles of the Mosaic backward: the two-kernel path (dK/dV, then dQ) and the fused
    kernel (fused_backward.py, fixed 128-key x 64-query tile); the comment at each field says
    why its default."""

    # Queries per dK/dV step (the N of S^T = K Q^T): 64 is the faster at head_dim 128 and 256.
    dkdv_block_q: int = 64
    # Keys per dQ step (64, 128, 192, 256); default_backward_config picks the faster 64.
    dq_block_kv: int = 128
    # Slots of the streamed operands: two overlap one copy with one step.
    dkdv_stages: int = 2
    dq_stages: int = 2
    # Compute warpgroups per dQ CTA (64 q rows each), 1 or 2: two share each K / V block.
    dq_compute_wgs: int = 2
    # setmaxnreg budgets, as in the forward: 2 x 232 + 40 = 504 = register_budget(3).
    compute_registers: int = 232
    copy_registers: int = 40
    # One kernel, dQ summed across key tiles in a fixed order: 5 matmul units a step instead of
    # the two kernels' 7. Where it serves (bf16 and fp16, head_dim 32 to 128, no segment ids).
    fused: bool = False
    # Slots of the fused kernel's Q / dO / statistics stream.
    fused_stages: int = 2
    # float32 dQ tiles in flight to the fused kernel's writer warpgroup (1 or 2).
    fused_dq_slots: int = 1
    # A folder for Mosaic GPU traces of the fused kernel (common.profile_params); "" for none.
    fused_profile_dir: str = ""
    # Above head_dim 128 the dK/dV kernel's two warpgroups own the same 64 keys (split columns):
    # divide the recomputation (one forms P^T, the other dP^T and dS^T, exchanged through
    # shared memory), 4 matmul units a step instead of 6.
    dkdv_paired: bool = False
    # kv heads whose key tiles the fused kernel interleaves in its launch order (schedule.py);
    # None: up to four at batch 1 (consecutive CTAs then alternate between chains of dQ adds).
    fused_head_chunk: int | None = None
    # Launches over which the fused kernel splits the kv heads, each summing dQ for its own q
    # heads (a smaller float32 sum alive at once); None: schedule.fused_launches.
    fused_launches: int | None = None
    # kv heads interleaved tile by tile in the two kernels' launch order (schedule.py); None:
    # one head at a time, or FlashAttention-3's L2 sections under a causal bound.
    head_chunk: int | None = None
    # The fused kernel as a persistent grid: one CTA per SM runs (kv head, key tile) items
    # handed out ahead of time (schedule.persistent_plan), the next item's Q / dO streaming in
    # while this one stores dK / dV.
    fused_persistent: bool = False
    # CTAs of the persistent grid; None: the device's SMs. More than can be resident at once
    # could deadlock (schedule.persistent_plan); fewer serve tests.
    fused_ctas: int | None = None
    # How the persistent grid hands out its items (HANDOUTS); "reversed" exists for tests.
    fused_handout: str = "longest_first"

    def __post_init__(self):
        for name in ("dkdv_block_q", "dq_block_kv"):
            value = getattr(self, name)
            if value % 64 or not 64 <= value <= 256:
                raise ValueError(f"MosaicBackwardConfig.{name} must be 64, 128, 192 or 256, "
                                 f"got {value}")
        for name in ("dkdv_stages", "dq_stages", "fused_stages"):
            if getattr(self, name) < 2:
                raise ValueError(f"MosaicBackwardConfig.{name} must be >= 2, "
                                 f"got {getattr(self, name)}")
        if self.fused_dq_slots not in (1, 2):
            raise ValueError("MosaicBackwardConfig.fused_dq_slots must be 1 or 2, "
                             f"got {self.fused_dq_slots}")
        if self.dq_compute_wgs not in (1, 2):
            raise ValueError("MosaicBackwardConfig.dq_compute_wgs must be 1 or 2, "
                             f"got {self.dq_compute_wgs}")
        for name in ("fused_head_chunk", "head_chunk", "fused_launches", "fused_ctas"):
            _check_chunk(f"MosaicBackwardConfig.{name}", getattr(self, name))
        if self.fused_handout not in HANDOUTS:
            raise ValueError(f"MosaicBackwardConfig.fused_handout must be one of {HANDOUTS}, "
                             f"got {self.fused_handout!r}")
        for name in ("compute_registers", "copy_registers"):
            _check_registers(f"MosaicBackwardConfig.{name}", getattr(self, name))
        # The dK/dV kernel's two compute warpgroups and its copy warpgroup (the dQ kernel's two
        # fit whenever these do; its one takes MAX_SETMAXNREG, which beside any copy_registers
        # fits register_budget(2)); past the budget the GPU hangs (register_budget).
        budget = register_budget(3)
        if 2 * self.compute_registers + self.copy_registers > budget:
            most = (budget - self.copy_registers) // 2 // 8 * 8
            raise ValueError(
                f"MosaicBackwardConfig.compute_registers must be at most {most} with "
                f"copy_registers={self.copy_registers} (2 * compute_registers + copy_registers "
                f"<= {budget}), got {self.compute_registers}")
        # The fused kernel's copy and writer warpgroups share what its compute warpgroups
        # leave of four warpgroups' registers, each at least setmaxnreg's minimum.
        if self.fused and self.fused_side_registers() < MIN_SETMAXNREG:
            most = (register_budget(4) - 2 * MIN_SETMAXNREG) // 2 // 8 * 8
            raise ValueError(
                f"MosaicBackwardConfig.compute_registers must be at most {most} with "
                f"fused=True (its copy and writer warpgroups need {MIN_SETMAXNREG} each), "
                f"got {self.compute_registers}")

    # ---- geometry ---------------------------------------------------------------------------

    @staticmethod
    def dkdv_col_splits(head_dim: int) -> int:
        """Column slices of dK/dV per 64 key rows: 2 above head_dim 128 (two 64 x 256 float32
        accumulators exceed a warpgroup's registers), else 1."""
        return 2 if head_dim > 128 else 1

    @staticmethod
    def dkdv_col_slices(width: int, splits: int) -> tuple[tuple[int, int], ...]:
        """(first column, columns) of each of `splits` slices of `width` columns (dK's or
        dV's): whole 16s, a wgmma step, so at 144 the halves are 80 and 64."""
        if splits == 1:
            return ((0, width),)
        first = -(-width // 32) * 16
        return ((0, first), (first, width - first))

    @staticmethod
    def dkdv_compute_wgs() -> int:
        return 2

    def dkdv_block_kv(self, head_dim: int) -> int:
        """Key rows per dK/dV CTA."""
        return WG_ROWS * (self.dkdv_compute_wgs() // self.dkdv_col_splits(head_dim))

    def dq_block_q(self) -> int:
        """Query rows per dQ CTA."""
        return WG_ROWS * self.dq_compute_wgs

    def dkdv_pairs(self, head_dim: int) -> bool:
        """Whether the dK/dV kernel runs paired (`dkdv_paired`) for this call."""
        return self.dkdv_paired and self.dkdv_col_splits(head_dim) > 1

    # ---- budgets (compiled path; interpret mode adds staging buffers) ------------------------

    def dkdv_smem_bytes(self, head_dim: int, itemsize: int = 2,
                        head_dim_v: int | None = None) -> int:
        """head_dim_v: V's head_dim where it is not Q/K's (MLA), as in the methods below."""
        both = head_dim + (head_dim if head_dim_v is None else head_dim_v)   # K and V, Q and dO
        kv = self.dkdv_block_kv(head_dim) * both * itemsize
        stream = self.dkdv_stages * (self.dkdv_block_q * both * itemsize
                                     + 3 * self.dkdv_block_q * 4)
        # The paired exchange: P^T in float32, dS^T (with a softcap, P^T first) in the input
        # dtype, the float16 row scales.
        paired = (WG_ROWS * self.dkdv_block_q * (4 + itemsize) + WG_ROWS * 4
                  if self.dkdv_pairs(head_dim) else 0)
        marks = self.dkdv_compute_wgs() * WG_ROWS * 4
        return kv + stream + paired + marks + SMEM_RESERVED

    def dq_smem_bytes(self, head_dim: int, itemsize: int = 2,
                      head_dim_v: int | None = None) -> int:
        both = head_dim + (head_dim if head_dim_v is None else head_dim_v)   # Q and dO, K and V
        rows = self.dq_block_q()
        own = rows * both * itemsize + 3 * rows * 4
        stream = self.dq_stages * self.dq_block_kv * both * itemsize
        return own + stream + SMEM_RESERVED

    def fused_smem_bytes(self, head_dim: int, itemsize: int = 2, stat_rows: int = 3) -> int:
        """stat_rows: statistics streamed per query (fused_backward.stat_rows)."""
        kv = 2 * FUSED_CTA_KEYS * head_dim * itemsize
        stream = self.fused_stages * (2 * FUSED_BLOCK_Q * head_dim * itemsize
                                      + stat_rows * FUSED_BLOCK_Q * 4)
        ds = FUSED_DS_BUFFERS * FUSED_CTA_KEYS * FUSED_BLOCK_Q * itemsize
        dq = self.fused_dq_slots * FUSED_BLOCK_Q * head_dim * 4
        marks = 2 * WG_ROWS * 4
        return kv + stream + ds + dq + marks + SMEM_RESERVED

    def fused_side_registers(self) -> int:
        """Registers per thread of the fused kernel's copy and writer warpgroups: what the two
        compute warpgroups leave of the pool, a multiple of 8."""
        return (FUSED_REGISTER_POOL - 2 * self.compute_registers) // 2 // 8 * 8


def default_backward_config(head_dim: int) -> MosaicBackwardConfig:
    """The backward's tiles for `head_dim`. docs/tuning.md has the sweeps behind each."""
    if head_dim <= 64:
        # Fused at 64: four stream slots and two dQ slots keep the writer from waiting on
        # compute. Below 64 the two kernels: the fused one is no faster over both masks, and
        # its dQ needs a float32 sum. Two-kernel tiles (also segment ids, MLA): 128 queries a
        # dK/dV step.
        return MosaicBackwardConfig(dkdv_block_q=128, dq_block_kv=64, fused=head_dim == 64,
                                    fused_stages=4, fused_dq_slots=2)
    if head_dim < 128:
        # Fused: two dQ slots, as at 64, and the most stream stages that fit beside them (4 at
        # 80, 3 at 96, 2 at 112, float16's fourth statistic counted). Two-kernel: 128's.
        stages = max(s for s in (2, 3, 4) if MosaicBackwardConfig(
            fused=True, fused_stages=s, fused_dq_slots=2).fused_smem_bytes(
                head_dim, stat_rows=4) <= SMEM_LIMIT)
        return MosaicBackwardConfig(dkdv_block_q=64, dq_block_kv=64, dkdv_stages=3, dq_stages=3,
                                    fused=True, fused_stages=stages, fused_dq_slots=2)
    if head_dim == 128:
        # Fused: two stages and one dQ slot are all that fit. Two-kernel: 64 x 64, 3 stages.
        return MosaicBackwardConfig(dkdv_block_q=64, dq_block_kv=64, dkdv_stages=3, dq_stages=3,
                                    fused=True)
    # Above 128 the fused kernel does not fit: two kernels, the dK/dV one paired. Two dQ
    # warpgroups up to head_dim 208; from 224 they would need more shared memory than there is.
    return MosaicBackwardConfig(dkdv_block_q=64, dq_block_kv=64,
                                dq_compute_wgs=2 if head_dim <= 208 else 1, dkdv_paired=True)
