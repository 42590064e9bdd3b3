"""The delta rule on padded inputs, and its `jax.custom_vjp`.

The forward is the Pallas kernels of `kernels.linear.delta_rule`. The
backward has two steps, the first one not yet a kernel:

1. The cotangent of the state leaving every chunk, by a `lax.scan` from the
   last chunk down (plain JAX). Per chunk (S0 the state entering it, U its
   values U~ - W S0, P the decayed causal Q K^T, K' = K exp(g_last - g)),
   with dS the cotangent of the state leaving it:

       dU  = scale P^T dO + K' dS
       dS0 = exp(g_last) dS + scale (Q exp(g))^T dO - W^T dU

   (W is the forward's, kept as a residual: the step is two small products).
2. Every chunk's gradients, all chunks in parallel, from its entering state
   (the forward's residual) and the cotangents of its outputs and leaving
   state: a chunk sees the decays of earlier ones only through its entering
   state, so these local gradients are the whole gradients. For the "none"
   and "scalar" kinds (DeltaNet, Gated DeltaNet) a Pallas kernel
   (`_dense_gradient_kernel`); for per-feature decays (KDA) JAX autodiff of
   the chunk's WY form (`reference.delta_rule_chunk`), which holds
   [C, C, Dk] decay tensors for every chunk at once: far more memory than
   a kernel would use at long sequences.

Correct in every input (q, k, v, beta, log_decay, initial state).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_attn.kernels import backend
from pallas_attn.kernels.linear.chunked_forward import (
    LOG_DECAY_FLOOR, ChunkedSchedule, cumulative_log_decay, dense_decay,
    scale_rows)
from pallas_attn.kernels.linear.delta_rule import (
    chunk_spec, delta_rule_forward, strictly_lower, wy_transform)
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


def _dense_gradient_kernel(*refs, chunk: int, scale: float, has_decay: bool,
                           fp32_exact: bool):
  """Gradients of one chunk of one head ("none"/"scalar" decay), float32.

  Recomputes the chunk's T, W and values U = U~ - W S0 from its entering
  state, then runs the forward's products backwards: dU = scale P^T dO +
  K' dS; through U = T (beta V) - T (beta K 2^g) S0 to dV, dbeta, dK and dT;
  dL = -T^T dT T^T on the strictly lower part; through L = beta (K K^T *
  decay) to dbeta and dK. dG, the gradient of the chunk-cumulative log
  decay, sums x . dx over every factor 2^(+-g) met (row sides +, column
  sides -), plus the chunk-end decay's terms on the last row.
  """
  q_ref, k_ref, v_ref, beta_ref, *refs = refs
  g_ref = refs.pop(0) if has_decay else None
  (state_ref, d_state_ref, do_ref, dq_ref, dk_ref, dv_ref, dbeta_ref,
   *dg_ref) = refs
  mm = functools.partial(backend.dot, fp32_exact=fp32_exact)
  q, k, v, do, state, d_state = (
      r[...].astype(jnp.float32)
      for r in (q_ref, k_ref, v_ref, do_ref, state_ref, d_state_ref))
  beta = beta_ref[...].astype(jnp.float32)[:, None]
  decay, g, g_to_end = dense_decay(g_ref, chunk)
  key_products = mm(k, k, trans_b=True) * decay
  transform = wy_transform(key_products, beta)
  keys_decayed = scale_rows(k, g)
  keys_to_end = scale_rows(k, g_to_end)
  w = mm(transform, beta * keys_decayed)
  values = mm(transform, beta * v) - mm(w, state)
  scores = mm(q, k, trans_b=True) * decay
  d_values = scale * mm(scores.T, do) + mm(keys_to_end, d_state)
  d_scores = scale * mm(do, values, trans_b=True) * decay
  dq = mm(d_scores, k) + scale * scale_rows(
      mm(do, state, trans_b=True), g)
  dk_scores = mm(d_scores.T, q)
  dk_state = scale_rows(mm(values, d_state, trans_b=True), g_to_end)
  d_w = -mm(d_values, state, trans_b=True)
  from_values = mm(transform.T, d_values)
  from_w = mm(transform.T, d_w)
  d_transform = (mm(d_values, beta * v, trans_b=True)
                 + mm(d_w, beta * keys_decayed, trans_b=True))
  d_lower = jnp.where(strictly_lower(chunk), -mm(
      mm(transform.T, d_transform), transform, trans_b=True), 0.0)
  d_products = beta * d_lower * decay
  dk_w = beta * scale_rows(from_w, g)
  dk_rows, dk_cols = mm(d_products, k), mm(d_products.T, k)
  dq_ref[...] = dq
  dk_ref[...] = dk_scores + dk_state + dk_w + dk_rows + dk_cols
  dv_ref[...] = (beta * from_values).astype(dv_ref.dtype)
  dbeta_ref[...] = (jnp.sum(v * from_values, axis=1)
                    + jnp.sum(keys_decayed * from_w, axis=1)
                    + jnp.sum(d_lower * key_products, axis=1))
  if has_decay:
    d_g = (jnp.sum(q * dq, axis=1)
           + jnp.sum(k * (dk_rows - dk_cols + dk_w - dk_scores - dk_state),
                     axis=1))
    d_g_last = (jnp.sum(k * dk_state)
                + jnp.exp2(g_ref[chunk - 1]) * jnp.sum(state * d_state))
    last = lax.broadcasted_iota(jnp.int32, (chunk,), 0) == chunk - 1
    dg_ref[0][...] = d_g + jnp.where(last, d_g_last, 0.0)


def _fused_chunk_grads(q, k, v, beta, log_decay, chunk_states, d_leaving,
                       d_out, schedule: ChunkedSchedule):
  """(dq, dk, dv, dbeta, d log_decay) of the "none"/"scalar" kinds from one
  `_dense_gradient_kernel` program per chunk and head."""
  batch, seq_len, heads, d_feature = q.shape
  d_v, chunk = v.shape[-1], schedule.chunk_size
  has_decay = log_decay is not None
  rows = functools.partial(chunk_spec, chunk)
  state = pl.BlockSpec((None, None, None, d_feature, d_v),
                       lambda c, b, h: (b, h, c, 0, 0))
  in_specs = [rows(d_feature), rows(d_feature), rows(d_v), rows()]
  inputs = [q, k, v, beta]
  if has_decay:
    in_specs.append(rows())
    inputs.append(cumulative_log_decay(log_decay, schedule))
  in_specs += [state, state, rows(d_v)]
  inputs += [chunk_states, jnp.moveaxis(d_leaving, 0, 2), d_out]
  per_token = jax.ShapeDtypeStruct(beta.shape, jnp.float32)
  out_shape = [jax.ShapeDtypeStruct(q.shape, jnp.float32),
               jax.ShapeDtypeStruct(k.shape, jnp.float32),
               jax.ShapeDtypeStruct(v.shape, v.dtype), per_token]
  out_specs = [rows(d_feature), rows(d_feature), rows(d_v), rows()]
  if has_decay:
    out_shape.append(per_token)
    out_specs.append(rows())
  kernel = functools.partial(
      _dense_gradient_kernel, chunk=chunk, scale=schedule.scale,
      has_decay=has_decay, fp32_exact=q.dtype == jnp.float32)
  dq, dk, dv, d_beta, *d_g = backend.pallas_call(
      kernel, out_shape=out_shape, grid=(seq_len // chunk, batch, heads),
      in_specs=in_specs, out_specs=out_specs,
      num_warps=schedule.num_warps, num_stages=1,
      interpret=schedule.interpret,
      name=f"delta_rule_bwd_{schedule.decay_kind}")(*inputs)
  d_log_decay = None
  if has_decay:  # G_t sums the chunk's steps up to t; no gradient past the clamp
    d_g = d_g[0].reshape(batch, seq_len // chunk, chunk, heads)
    d_steps = lax.cumsum(d_g, axis=2, reverse=True).reshape(log_decay.shape)
    d_log_decay = jnp.where(log_decay >= LOG_DECAY_FLOOR, d_steps, 0.0)
  return dq, dk, dv, d_beta, d_log_decay


def _autodiff_chunk_grads(inputs, chunk_states, d_leaving, d_out_chunks,
                          seq_len, scale):
  """(dq, dk, dv, dbeta, d log_decay [B, S, H, 1 or Dk]) of every chunk at
  once, by JAX autodiff of `reference.delta_rule_chunk` (the "vector"
  kind, which has no fused gradient kernel yet)."""
  entering = jnp.moveaxis(chunk_states, 2, 0).astype(jnp.float32)
  _, pullback = jax.vjp(
      lambda *inputs: delta_rule_chunk(entering, inputs, scale=scale),
      *inputs)
  d_q, d_k, d_v, d_beta, d_log_decay = (
      from_chunks(d, seq_len) for d in pullback((d_leaving, d_out_chunks)))
  return d_q, d_k, d_v, d_beta[..., 0], d_log_decay


def _backward(schedule, residuals, cotangents):
  q, k, v, beta, log_decay, chunk_states, pseudo_keys = residuals
  d_out, d_final = cotangents
  batch, seq_len, heads = q.shape[:3]
  chunk = schedule.chunk_size
  inputs = tuple(to_chunks(x, chunk) for x in (q, k, v, beta[..., None]))
  inputs += (chunk_step_log_decay(log_decay, batch, seq_len, heads, chunk),)
  d_out_chunks = to_chunks(d_out, chunk)
  d_leaving, d_initial = _leaving_state_cotangents(
      inputs[0], inputs[1], jnp.maximum(inputs[4], LOG_DECAY_FLOOR),
      to_chunks(pseudo_keys, chunk), d_out_chunks, d_final, schedule.scale)
  if schedule.decay_kind == "vector":
    grads = _autodiff_chunk_grads(inputs, chunk_states, d_leaving,
                                  d_out_chunks, seq_len, schedule.scale)
  else:
    grads = _fused_chunk_grads(q, k, v, beta, log_decay, chunk_states,
                               d_leaving, d_out, schedule)
  primals = (q, k, v, beta, log_decay)
  return tuple(None if x is None else d.reshape(x.shape).astype(x.dtype)
               for d, x in zip(grads, primals)) + (d_initial,)


chunked_delta_rule.defvjp(_forward_with_residuals, _backward)
