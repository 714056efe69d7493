"""pallas_flash: FlashAttention for JAX, written in Pallas for NVIDIA GPUs.

    out = pallas_flash.flash_attention(q, k, v, causal=True)   # q, k, v: [batch, seq, heads, dim]
"""

from pallas_flash.attention import LSE_NAME, OUT_NAME, flash_attention
from pallas_flash.config import FlashConfig, KernelConfig, default_config
from pallas_flash.decode import decode_attention
from pallas_flash.masking import segment_ids_from_cu_seqlens
from pallas_flash.nn import dot_product_attention
from pallas_flash.reference import reference_attention
from pallas_flash.ring import (ring_attention, ring_attention_local, zigzag_permute,
                               zigzag_unpermute)
from pallas_flash.sharding import sharded_flash_attention

__all__ = [
    "flash_attention",
    "dot_product_attention",
    "reference_attention",
    "decode_attention",
    "segment_ids_from_cu_seqlens",
    "FlashConfig",
    "KernelConfig",
    "default_config",
    "OUT_NAME",
    "LSE_NAME",
    "sharded_flash_attention",
    "ring_attention",
    "ring_attention_local",
    "zigzag_permute",
    "zigzag_unpermute",
]

__version__ = "0.1.0"
