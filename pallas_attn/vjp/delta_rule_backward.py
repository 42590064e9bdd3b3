"""The delta rule on padded inputs, and its `jax.custom_vjp`.

The forward is the Pallas kernels of `kernels.linear.delta_rule`. The
backward is not yet a fused kernel: it differentiates the chunked jnp
form (`reference.chunked_delta_rule_jnp`, the same WY algebra as the
forward, rematerialised chunk by chunk) with JAX autodiff. Correct in every
input (q, k, v, beta, log_decay, initial state), but an XLA loop over
chunks, not the parallel gradient pass of `linear_backward`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_attn.kernels.linear.chunked_forward import ChunkedSchedule
from pallas_attn.kernels.linear.delta_rule import delta_rule_forward
from pallas_attn.kernels.linear.reference import chunked_delta_rule_jnp


def _chunked_jnp(q, k, v, beta, log_decay, initial_state,
                 schedule: ChunkedSchedule):
  o, final_state = chunked_delta_rule_jnp(
      q, k, v, beta, log_decay=log_decay, scale=schedule.scale,
      initial_state=initial_state, chunk_size=schedule.chunk_size)
  return o.astype(schedule.out_dtype), final_state


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def chunked_delta_rule(q, k, v, beta, log_decay, initial_state,
                       schedule: ChunkedSchedule):
  """The delta rule on padded inputs (S a multiple of the chunk), each
  array differentiable. beta: [B, S, H] (zero on padded steps); log_decay:
  None, [B, S, H] or [B, S, H, Dk] step log decays. Returns (o, final
  state float32). The forward runs the Pallas kernels of
  `kernels.linear.delta_rule`."""
  return delta_rule_forward(q, k, v, beta, log_decay, initial_state,
                            schedule)


def _forward_with_residuals(q, k, v, beta, log_decay, initial_state,
                            schedule):
  outputs = chunked_delta_rule(q, k, v, beta, log_decay, initial_state,
                               schedule)
  return outputs, (q, k, v, beta, log_decay, initial_state)


def _backward(schedule, residuals, cotangents):
  _, pullback = jax.vjp(
      functools.partial(_chunked_jnp, schedule=schedule), *residuals)
  return pullback(cotangents)


chunked_delta_rule.defvjp(_forward_with_residuals, _backward)
