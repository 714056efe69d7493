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

    The numbers come from the H200 sweep recorded in benchmarks/NOTES.md (jax 0.11.2, bf16,
    seq 8k-16k). Register pressure grows with head_dim, so the tiles shrink as it grows; float32
    and float64 operands take twice and four times the registers and shared memory of bf16, so
    they take the next smaller tile.
    """
    wide = jnp.dtype(dtype).itemsize >= 4
    if head_dim <= 64:
        fwd = KernelConfig(block_q=128, block_kv=64, num_warps=4, num_stages=3)
        dkdv = KernelConfig(block_q=64, block_kv=128, num_warps=8, num_stages=2)
        dq = KernelConfig(block_q=128, block_kv=64, num_warps=8, num_stages=2)
    elif head_dim <= 128:
        fwd = KernelConfig(block_q=128, block_kv=64, num_warps=8, num_stages=3)
        dkdv = KernelConfig(block_q=64, block_kv=128, num_warps=8, num_stages=2)
        dq = KernelConfig(block_q=128, block_kv=64, num_warps=8, num_stages=2)
    else:
        fwd = KernelConfig(block_q=64, block_kv=32, num_warps=4, num_stages=2)
        dkdv = KernelConfig(block_q=32, block_kv=64, num_warps=8, num_stages=1)
        dq = KernelConfig(block_q=64, block_kv=32, num_warps=8, num_stages=1)
    if wide:
        fwd, dkdv, dq = (_halve(c) for c in (fwd, dkdv, dq))
    return FlashConfig(fwd=fwd, bwd_dkdv=dkdv, bwd_dq=dq)


def _halve(cfg: KernelConfig) -> KernelConfig:
    return dataclasses.replace(
        cfg,
        block_q=max(_MIN_BLOCK, cfg.block_q // 2),
        block_kv=max(_MIN_BLOCK, cfg.block_kv // 2),
    )
