"""pallas_attn: attention variants written as plain JAX, compiled to fused Pallas kernels."""
from pallas_attn._version import __version__
from pallas_attn.api import attention
from pallas_attn.decode import decode_attention, paged_attention
from pallas_attn.distributed import (context_parallel_attention, ring_attention,
                                     sharded_decode_attention, sharded_paged_attention)
from pallas_attn.fp8 import quantize_fp8
from pallas_attn.kernels.block_mask import BlockMask
from pallas_attn.kernels.block_mask_cache import block_mask
from pallas_attn.linear import linear_attention, linear_attention_lowering, linear_attention_step
from pallas_attn.reference import attention_reference
from pallas_attn.schedule.config import AttentionConfig, DecodeConfig, LinearAttentionConfig
from pallas_attn.spec.analysis import analyze_variant
from pallas_attn.spec.trace import VariantError
from pallas_attn import variants

__all__ = [
    "attention", "attention_reference", "BlockMask", "block_mask", "linear_attention",
    "linear_attention_lowering", "linear_attention_step", "AttentionConfig",
    "LinearAttentionConfig", "analyze_variant",
    "VariantError", "variants", "decode_attention", "paged_attention", "DecodeConfig",
    "context_parallel_attention", "ring_attention", "sharded_decode_attention",
    "sharded_paged_attention", "quantize_fp8",
]
