"""pallas_flash: FlashAttention for JAX, written in Pallas for NVIDIA GPUs.

    out = pallas_flash.flash_attention(q, k, v, causal=True)   # q, k, v: [batch, seq, heads, dim]
"""

from pallas_flash.attention import LSE_NAME, OUT_NAME, flash_attention
from pallas_flash.config import FlashConfig, KernelConfig, default_config
from pallas_flash.reference import reference_attention

__all__ = [
    "flash_attention",
    "reference_attention",
    "FlashConfig",
    "KernelConfig",
    "default_config",
    "OUT_NAME",
    "LSE_NAME",
]

__version__ = "0.1.0"
