"""Chunked-recurrent kernels: linear attention with decays (the forward's
state and output passes, plain-JAX references). The backward kernels live
in `pallas_attn.vjp`.
"""
from pallas_attn.kernels.linear.chunked_forward import (
    ChunkedSchedule, chunked_forward, heuristic_linear_config)
from pallas_attn.kernels.linear.reference import (
    chunked_linear_attention_jnp, linear_attention_reference)
