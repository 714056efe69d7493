"""The static description of one attention call, shared by every backend.

`attention.py` folds the user's validated options into one `AttentionSpec`. It is frozen and
hashable, so it keys the jit cache and is closed over by the custom_vjp; kernels read it and
never see the raw options.
"""

from __future__ import annotations

import dataclasses

from jax import lax

from pallas_flash.config import FlashConfig
from pallas_flash.masking import MaskSpec

__all__ = ["AttentionSpec"]


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Attributes:
    mask: the static position mask and sequence lengths.
    scale: multiplies q.k before the softcap and the softmax.
    softcap: logits become softcap * tanh(logits / softcap); None = off.
    has_segments: integer segment ids (and/or padding lengths, folded into them) are passed.
    precision: matmul precision for float32 inputs (DEFAULT = tf32 on the GPU, HIGHEST = ieee).
    config: the tiles of the three kernels.
    interpret: run the kernels in Pallas interpret mode (CPU).
    """

    mask: MaskSpec
    scale: float
    softcap: float | None
    has_segments: bool
    precision: lax.Precision
    config: FlashConfig
    interpret: bool
