"""Tiling configuration of the Triton kernels, and their defaults (docs/tuning.md says why).

A `KernelConfig` tiles one kernel: a block of queries by a block of keys, with the Triton launch
parameters. A `FlashConfig` holds one `KernelConfig` per kernel (forward, dK/dV, dQ). Both are
frozen and validate themselves, so they are hashable static arguments and a bad config fails in
Python, on any machine, instead of at GPU lowering time.

Why powers of two: the Triton lowering builds no tensor with another size ("requires that all
operations have array arguments and results whose size is a power of 2"), while interpret mode
runs them; checking here lets CPU CI catch it. 16 is the smallest tile `tl.dot` accepts.

Why a shared-memory estimate: a tile too big for the GPU's shared memory fails only when Triton
compiles it, inside the first call. `check_shared_memory` predicts it from the tile, so the
caller gets a ValueError naming the kernel before any launch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["KernelConfig", "FlashConfig", "default_config", "shared_memory_bytes",
           "shared_memory_limit", "check_shared_memory"]

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
        if isinstance(self.num_warps, bool) or not isinstance(self.num_warps, int) or (
                self.num_warps not in (1, 2, 4, 8, 16)):
            raise ValueError(
                f"KernelConfig.num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps!r}"
            )
        if (isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int)
                or self.num_stages < 1):
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


def default_config(head_dim: int, dtype, *, head_dim_v: int | None = None) -> FlashConfig:
    """The tiles used when the caller gives none, by head_dim and dtype: the fastest of
    benchmarks/tune.py's sweeps, each kernel swept with the others fixed (docs/tuning.md).

    head_dim_v: V's head_dim where it differs from Q/K's (MLA). The wider of the two picks the
    row: every kernel holds tiles of both, and the wider bounds registers and shared memory.
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, (int, np.integer)) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    wide = jnp.dtype(dtype).itemsize >= 4
    if head_dim_v is not None:
        head_dim = max(head_dim, head_dim_v)
    if head_dim <= 64:
        # The forward sweep's top tile (64x128 tied); the backward follows head_dim 128.
        fwd = KernelConfig(block_q=64, block_kv=64, num_warps=4, num_stages=3)
        dkdv = KernelConfig(block_q=64, block_kv=64, num_warps=4, num_stages=2)
        dq = KernelConfig(block_q=64, block_kv=64, num_warps=4, num_stages=2)
    elif head_dim <= 128:
        # Forward: the best causal + non-causal sum. dK/dV: the fastest, by far.
        # dQ: the fastest of seven.
        fwd = KernelConfig(block_q=128, block_kv=128, num_warps=8, num_stages=3)
        dkdv = KernelConfig(block_q=64, block_kv=64, num_warps=4, num_stages=2)
        dq = KernelConfig(block_q=64, block_kv=64, num_warps=4, num_stages=2)
    else:
        # Each kernel's fastest: wide rows want fewer keys (forward, dQ) or queries (dK/dV).
        fwd = KernelConfig(block_q=128, block_kv=64, num_warps=8, num_stages=2)
        dkdv = KernelConfig(block_q=32, block_kv=64, num_warps=8, num_stages=2)
        dq = KernelConfig(block_q=64, block_kv=16, num_warps=4, num_stages=2)
    # float32 (float64) operands take twice (four times) the registers and shared memory of
    # bf16: the next smaller tile, with 2 stages.
    if wide:
        fwd, dkdv, dq = (_halve(c) for c in (fwd, dkdv, dq))
    return FlashConfig(fwd=fwd, bwd_dkdv=dkdv, bwd_dq=dq)


# Shared memory per thread block by compute capability (the CUDA programming guide's opt-in
# maximum). Interpret mode checks against Hopper's, so a config that could not compile on an
# H100 / H200 fails on the CPU too.
HOPPER_SHARED_MEMORY = 232448
_SHARED_MEMORY = {(9, 0): HOPPER_SHARED_MEMORY, (8, 0): 166912, (8, 6): 101376, (8, 7): 166912,
                  (8, 9): 101376}
_HOPPER = (9, 0)


def shared_memory_limit(interpret: bool) -> int:
    """Bytes of shared memory one program may use on the target GPU."""
    if interpret:
        return _SHARED_MEMORY[_HOPPER]
    try:
        cc = tuple(int(x) for x in str(jax.devices()[0].compute_capability).split(".")[:2])
    except (AttributeError, ValueError):
        return _SHARED_MEMORY[_HOPPER]
    return _SHARED_MEMORY.get(cc, min(_SHARED_MEMORY.values()) if cc < _HOPPER else
                              _SHARED_MEMORY[_HOPPER])


def shared_memory_bytes(config: FlashConfig, head_dim: int, dtype, *,
                        head_dim_v: int | None = None) -> dict[str, int]:
    """Estimated shared memory of each kernel's program, in bytes.

    The model: each pipelined tile the inner loop loads is buffered `num_stages` times; the
    tiles a program keeps for its whole loop that feed a matmul's B side live in shared memory
    once; so does each block matrix Triton must transpose or re-layout through shared memory
    between two matmuls. With d the padded head_dim of Q and K, e that of V and dO (d unless
    head_dim_v differs) and b the itemsize:
      forward: stages * (K + V tiles) + the Q tile                          (bkv, bkv, bq rows)
      dK/dV:   stages * (Q + dO tiles) + K + V + the P^T and dS^T blocks    (bq x bkv each)
      dQ:      stages * (K + V tiles) + Q + dO + the dS block
    It is calibrated against the compiler's own figures (docs/tuning.md).
    """
    d = _padded(head_dim)
    de = d + (d if head_dim_v is None else _padded(head_dim_v))    # a row of each pair
    b = jnp.dtype(dtype).itemsize
    f, kv, dq = config.fwd, config.bwd_dkdv, config.bwd_dq
    return {
        "fwd": b * (f.num_stages * f.block_kv * de + f.block_q * d),
        "bwd_dkdv": b * (kv.num_stages * kv.block_q * de + kv.block_kv * de
                         + 2 * kv.block_q * kv.block_kv),
        "bwd_dq": b * (dq.num_stages * dq.block_kv * de + dq.block_q * de
                       + dq.block_q * dq.block_kv),
    }


def _padded(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def check_shared_memory(config: FlashConfig, head_dim: int, dtype, limit: int, *,
                        head_dim_v: int | None = None) -> None:
    """ValueError naming the first kernel whose tile would not fit in `limit` bytes.

    float64 runs in interpret mode only, where there is no shared memory: not checked.
    """
    if jnp.dtype(dtype) == jnp.float64:
        return
    needs = shared_memory_bytes(config, head_dim, dtype, head_dim_v=head_dim_v)
    dims = (f"head_dim {head_dim}" if head_dim_v in (None, head_dim)
            else f"head_dim {head_dim} (V's {head_dim_v})")
    for kernel, need in needs.items():
        if need > limit:
            cfg = getattr(config, kernel)
            raise ValueError(
                f"config.{kernel} ({cfg.block_q}x{cfg.block_kv}, {cfg.num_stages} stages) needs "
                f"about {need} bytes of shared memory at {dims} and "
                f"{jnp.dtype(dtype).name}, over the GPU's {limit}: use smaller blocks or fewer "
                f"stages"
            )


def _halve(cfg: KernelConfig) -> KernelConfig:
    return dataclasses.replace(
        cfg,
        block_q=max(_MIN_BLOCK, cfg.block_q // 2),
        block_kv=max(_MIN_BLOCK, cfg.block_kv // 2),
        num_stages=min(cfg.num_stages, 2),
    )
