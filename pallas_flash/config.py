"""Tiling configuration for the attention kernels, and the defaults we measured.

A `KernelConfig` tiles one kernel: a block of queries by a block of keys, with the Triton launch
parameters. A `FlashConfig` holds one `KernelConfig` per kernel (forward, dK/dV, dQ). Both are
frozen and validate themselves, so they are hashable static arguments and a bad config fails in
Python, on any machine, instead of at GPU lowering time.

Why powers of two: the Triton lowering only accepts tensors whose every dimension is a power of
two (seen on our H200: a 72-wide block failed with "requires that all operations have array
arguments and results whose size is a power of 2", while interpret mode ran it). We check it
here so CPU CI catches it too. The minimum of 16 is the smallest tile `tl.dot` accepts.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

__all__ = ["KernelConfig", "FlashConfig", "default_config"]

_MIN_BLOCK = 16
_MAX_BLOCK = 256


def _is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile of one kernel: `block_q` query rows by `block_kv` key rows per loop step.

    Attributes:
      block_q: query rows per program (forward, dQ) or per inner step (dK/dV).
      block_kv: key rows per inner step (forward, dQ) or per program (dK/dV).
      num_warps: warps per program, one of 1, 2, 4, 8, 16.
      num_stages: software-pipelining depth of the inner loop, >= 1.
    """

    block_q: int
    block_kv: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_kv"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"KernelConfig.{name} must be an int, got {value!r}")
            if not (_is_power_of_two(value) and _MIN_BLOCK <= value <= _MAX_BLOCK):
                raise ValueError(
                    f"KernelConfig.{name} must be a power of two in [{_MIN_BLOCK}, {_MAX_BLOCK}] "
                    f"(the Triton lowering rejects other tile sizes), got {value}"
                )
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(
                f"KernelConfig.num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps!r}"
            )
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"KernelConfig.num_stages must be an int >= 1, got {self.num_stages!r}")


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """One tile per kernel: the forward pass, the dK/dV pass and the dQ pass."""

    fwd: KernelConfig
    bwd_dkdv: KernelConfig
    bwd_dq: KernelConfig

    def __post_init__(self):
        for name in ("fwd", "bwd_dkdv", "bwd_dq"):
            if not isinstance(getattr(self, name), KernelConfig):
                raise ValueError(
                    f"FlashConfig.{name} must be a KernelConfig, got {type(getattr(self, name)).__name__}"
                )


def default_config(head_dim: int, dtype) -> FlashConfig:
    """The tiles we use when the caller gives none, chosen by head_dim and dtype.

    Measured with benchmarks/tune.py on our H200 (jax 0.11.2, bf16, batch 2, seq 8192, 16 heads
    at head_dim 128; each kernel's tile swept with the others fixed; benchmarks/NOTES.md has the
    table):
      * forward, head_dim 128: 128x128, 8 warps, 3 stages ran 399 TFLOP/s non-causal and 337
        causal (2.76 + 1.63 ms), the best sum; 64x64 ran 346 / 351 (3.18 + 1.57 ms).
      * dK/dV, head_dim 128: 64 queries x 64 keys, 4 warps, 2 stages made the whole backward
        8.0 ms (342 TFLOP/s) against 14.3 ms for 64x128 with 8 warps, the runner-up family
        (32x64 / 32x128) at 11 ms.
      * dQ, head_dim 128: 64x64, 4 warps, 2 stages was the fastest of seven, within 3% of 128x64.
      * head_dim 64: the forward sweep put 64x64 (341) and 64x128 (343) on top; the backward
        tiles follow head_dim 128's, since its sweep did not finish in the lease.
      * head_dim 256: not swept yet. The tiles are sized so that the float32 accumulators fit
        in registers (a 64x256 float32 tile is 64 KiB, i.e. 128 registers per thread at 4 warps)
        and double-buffered K/V tiles fit in shared memory.
    float32 (and float64) operands take twice (four times) the registers and shared memory of
    bf16, so they take the next smaller tile with 2 stages.
    """
    wide = jnp.dtype(dtype).itemsize >= 4
    if head_dim <= 64:
        fwd = KernelConfig(block_q=64, block_kv=64, num_warps=4, num_stages=3)
        dkdv = KernelConfig(block_q=64, block_kv=64, num_warps=4, num_stages=2)
        dq = KernelConfig(block_q=64, block_kv=64, num_warps=4, num_stages=2)
    elif head_dim <= 128:
        fwd = KernelConfig(block_q=128, block_kv=128, num_warps=8, num_stages=3)
        dkdv = KernelConfig(block_q=64, block_kv=64, num_warps=4, num_stages=2)
        dq = KernelConfig(block_q=64, block_kv=64, num_warps=4, num_stages=2)
    else:
        fwd = KernelConfig(block_q=64, block_kv=64, num_warps=8, num_stages=2)
        dkdv = KernelConfig(block_q=32, block_kv=64, num_warps=8, num_stages=2)
        dq = KernelConfig(block_q=64, block_kv=32, num_warps=8, num_stages=2)
    if wide:
        fwd, dkdv, dq = (_halve(c) for c in (fwd, dkdv, dq))
    return FlashConfig(fwd=fwd, bwd_dkdv=dkdv, bwd_dq=dq)


def _halve(cfg: KernelConfig) -> KernelConfig:
    return dataclasses.replace(
        cfg,
        block_q=max(_MIN_BLOCK, cfg.block_q // 2),
        block_kv=max(_MIN_BLOCK, cfg.block_kv // 2),
        num_stages=min(cfg.num_stages, 2),
    )
