"""The delta rule on padded inputs, and its `jax.custom_vjp`.

The forward is the Pallas kernels of `kernels.linear.delta_rule`. The
backward is not yet a fused kernel; it is plain JAX in two steps:

1. The cotangent of the state leaving every chunk, by a `lax.scan` from the
   last chunk down. Per chunk (S0 the state entering it, U its values
   U~ - W S0, P the decayed causal Q K^T, K' = K exp(g_last - g)), with dS
   the cotangent of the state leaving it:

       dU  = scale P^T dO + K' dS
       dS0 = exp(g_last) dS + scale (Q exp(g))^T dO - W^T dU

   (W is the forward's, kept as a residual: the step is two small products).
2. Every chunk's gradients at once: JAX autodiff of the chunk's WY form
   (`reference.delta_rule_chunk`) from its entering state (the forward's
   residual) and the cotangents of its outputs and leaving state. A chunk
   sees the decays of earlier ones only through its entering state, so
   these local gradients are the whole gradients.

Correct in every input (q, k, v, beta, log_decay, initial state). Step 2
holds [C, C, Dk] decay tensors per chunk for per-feature decays (KDA): far
more memory than a fused gradient kernel would use at long sequences.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_attn.kernels.linear.chunked_forward import (
    LOG_DECAY_FLOOR, ChunkedSchedule)
from pallas_attn.kernels.linear.delta_rule import delta_rule_forward
from pallas_attn.kernels.linear.reference import (
    chunk_step_log_decay, decayed_products, delta_rule_chunk, from_chunks,
    to_chunks)

_HIGHEST = lax.Precision.HIGHEST


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def chunked_delta_rule(q, k, v, beta, log_decay, initial_state,
                       schedule: ChunkedSchedule):
  """The delta rule on padded inputs (S a multiple of the chunk), each
  array differentiable. beta: [B, S, H] (zero on padded steps); log_decay:
  None, [B, S, H] or [B, S, H, Dk] step log decays. Returns (o, final
  state float32)."""
  o, final_state, _, _ = delta_rule_forward(
      q, k, v, beta, log_decay, initial_state, schedule)
  return o, final_state


def _forward_with_residuals(q, k, v, beta, log_decay, initial_state,
                            schedule):
  o, final_state, chunk_states, pseudo_keys = delta_rule_forward(
      q, k, v, beta, log_decay, initial_state, schedule)
  residuals = (q, k, v, beta, log_decay, chunk_states, pseudo_keys)
  return (o, final_state), residuals


def _leaving_state_cotangents(q, k, log_decay, pseudo_keys, d_out, d_final,
                              scale):
  """(dS leaving each chunk [N, B, H, Dk, Dv], d(initial state)); inputs in
  chunk layout [N, B, H, C, D] (step 1 of the module docstring)."""
  g = jnp.cumsum(log_decay, axis=-2)
  g_last = g[..., -1:, :]
  mm = functools.partial(jnp.einsum, precision=_HIGHEST)
  d_local = scale * mm("...ij,...iv->...jv",
                       decayed_products(q, k, g, strict=False), d_out)
  d_from_out = scale * mm("...ck,...cv->...kv", q * jnp.exp(g), d_out)
  keys_to_end = k * jnp.exp(g_last - g)
  state_decay = jnp.swapaxes(jnp.exp(g_last), -1, -2)

  def step(d_state, chunk):
    d_local, d_from_out, keys_to_end, state_decay, pseudo_keys = chunk
    d_values = d_local + mm("...ck,...kv->...cv", keys_to_end, d_state)
    d_entering = (state_decay * d_state + d_from_out
                  - mm("...ck,...cv->...kv", pseudo_keys, d_values))
    return d_entering, d_state

  d_initial, d_leaving = lax.scan(
      step, d_final, (d_local, d_from_out, keys_to_end, state_decay,
                      pseudo_keys), reverse=True)
  return d_leaving, d_initial


def _backward(schedule, residuals, cotangents):
  q, k, v, beta, log_decay, chunk_states, pseudo_keys = residuals
  d_out, d_final = cotangents
  batch, seq_len, heads = q.shape[:3]
  chunk = schedule.chunk_size
  inputs = tuple(to_chunks(x, chunk) for x in (q, k, v, beta[..., None]))
  inputs += (chunk_step_log_decay(log_decay, batch, seq_len, heads, chunk),)
  d_leaving, d_initial = _leaving_state_cotangents(
      inputs[0], inputs[1], jnp.maximum(inputs[4], LOG_DECAY_FLOOR),
      to_chunks(pseudo_keys, chunk),
      to_chunks(d_out, chunk), d_final, schedule.scale)
  entering = jnp.moveaxis(chunk_states, 2, 0).astype(jnp.float32)
  _, pullback = jax.vjp(
      lambda *inputs: delta_rule_chunk(entering, inputs, scale=schedule.scale),
      *inputs)
  d_q, d_k, d_v, d_beta, d_log_decay = (
      from_chunks(d, seq_len) for d in pullback(
          (d_leaving, to_chunks(d_out, chunk))))
  if log_decay is None:
    d_log_decay = None
  else:
    d_log_decay = d_log_decay.reshape(log_decay.shape)
  grads = (d_q, d_k, d_v, d_beta[..., 0], d_log_decay)
  primals = (q, k, v, beta, log_decay)
  return tuple(None if d is None else d.astype(x.dtype)
               for d, x in zip(grads, primals)) + (d_initial,)


chunked_delta_rule.defvjp(_forward_with_residuals, _backward)
