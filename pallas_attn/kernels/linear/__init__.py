"""Chunked-recurrent kernels: linear attention with decays (the forward's
state and output passes, its one-kernel Mosaic GPU form, plain-JAX
references) and the delta rule's UT transform, which feeds the same passes.
The backward kernels live in `pallas_attn.vjp`.
"""
from pallas_attn.kernels.linear.chunked_forward import (
    ChunkedSchedule, chunked_forward, heuristic_linear_config)
from pallas_attn.kernels.linear.reference import (
    chunked_delta_rule_jnp, chunked_linear_attention_jnp, delta_rule_reference,
    linear_attention_reference)
