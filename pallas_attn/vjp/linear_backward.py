"""Backward pass of chunked linear attention, and its `jax.custom_vjp`.

Two passes, as in the forward. The state pass of the forward runs in
reverse (`state_pass(..., reverse=True)`): dS <- exp(g_last) dS +
scale * (Q * exp(g))^T dO from the last chunk down, storing the cotangent
of the state leaving each chunk; what is left is d(initial state). Then a
gradient pass runs one program per (Dv block, row block, batch, head), all in
parallel, from the stored states S (entering the chunk, the forward's
residual) and cotangents dS. Per chunk, with `g` the chunk-cumulative log
decays, `D` the causal decay matrix and `dA = (dO V^T) * D`:

  dq = scale * (dA K + (dO S^T) * exp(g))
  dk = scale * dA^T Q + (V dS^T) * exp(g_last - g)
  dv = scale * (Q K^T * D)^T dO + (K * exp(g_last - g)) dS

(the "vector" kind runs the same terms in row blocks, as the forward does).
A program sees one Dv block, so dq and dk come out as per-block partial sums
that the wrapper adds up.

The log-decay gradient needs no kernel of its own: since the loss depends on
the cumulative decay G_t only through exp(G_t - G_j) (query t, key j),
dL/dG_t = q_t * dq_t - k_t * dk_t (+ S_T * dS_T at the last step), and
d log_decay is the reverse cumulative sum of that over the sequence.
Feature-map gradients come from JAX autodiff of the user's callables, which
the wrapper applies outside this function.

`TEMPLATE` is the backward as the scheduler sees it (schedule/template.py):
q/k/v/dO chunks pipelined, the state and its cotangent in registers.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_attn.kernels import backend
from pallas_attn.kernels.linear import mosaic_forward
from pallas_attn.kernels.linear.chunked_forward import (
    LOG_DECAY_FLOOR, SUB_BLOCK, ChunkedSchedule, LinearTemplate, causal_from,
    chunk_inputs, chunk_state_spec, chunked_forward, cumulative_log_decay,
    dense_decay, diagonal_block, keys_to_anchor, masked_rescale,
    row_block_offset, row_spec, scale_rows, sequence_spec, state_pass)
from pallas_attn.schedule.config import padded_head_dim
from pallas_attn.schedule.template import ResourceUse, accumulator_registers, register
from pallas_attn.vjp import linear_mosaic_backward


def _dense_chunk_grads(refs, *, chunk, scale, mm):
  """Gradients of one chunk ("none"/"scalar" decay)."""
  (q_ref, k_ref, v_ref, g_ref, state_ref, d_state_ref, do_ref, dq_ref, dk_ref,
   dv_ref) = refs
  q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
  dtype = q.dtype
  state, d_state = state_ref[...], d_state_ref[...]
  decay, g, g_to_end = dense_decay(g_ref, chunk)
  scores = (mm(q, k, trans_b=True) * decay).astype(dtype)
  d_scores = (mm(do, v, trans_b=True) * decay).astype(dtype)
  dq_ref[...] = scale * (
      mm(d_scores, k) + scale_rows(mm(do, state, trans_b=True), g))
  dk_ref[...] = (scale * mm(d_scores.T, q)
                 + scale_rows(mm(v, d_state, trans_b=True), g_to_end))
  dv_ref[...] = (scale * mm(scores.T, do) + mm(
      scale_rows(k, g_to_end).astype(dtype), d_state)).astype(dv_ref.dtype)


def _vector_chunk_grads(refs, *, chunk, scale, mm):
  """Gradients of one row block of a chunk ("vector" decay).

  The block's queries meet the keys of earlier blocks (rescaled to the row
  before the block, as in the forward) and its keys meet the queries of
  later blocks (rescaled to the block's last row), so every exponent stays
  <= 0; the block's own pairs join those dots when `split_own_keys`
  allows, else they are summed elementwise.
  """
  (q_ref, k_ref, v_ref, g_ref, state_ref, d_state_ref, do_ref, dq_ref, dk_ref,
   dv_ref) = refs
  dtype = q_ref.dtype
  offset = row_block_offset(chunk)
  rows = pl.ds(offset, SUB_BLOCK)
  chunk_rows = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
  q_b, k_b, v_b = q_ref[rows, :], k_ref[rows, :], v_ref[rows, :]
  do_b, g_b = do_ref[rows, :], g_ref[rows, :]
  g_before, by_dot, keys = keys_to_anchor(k_ref, g_ref, offset, chunk)
  scores, dq_b, dk_b = diagonal_block(
      q_b, g_b, k_ref, g_ref, offset, SUB_BLOCK - by_dot,
      mm(do_b, v_b, trans_b=True))
  dq_b += scale_rows(mm(do_b, state_ref[...], trans_b=True), g_b)
  dk_b *= scale
  dv_b = scale * mm(scores.astype(dtype).T, do_b)
  # This block's queries, keys of earlier blocks (and its own, by_dot).
  causal = causal_from(offset, SUB_BLOCK, chunk)
  d_scores = jnp.where(causal, mm(do_b, v_ref[...], trans_b=True), 0.0)
  dq_b += scale_rows(mm(d_scores.astype(dtype), keys),
                     g_b - g_before)
  # This block's keys, queries of later blocks (and its own, by_dot).
  g_after = g_ref[offset + SUB_BLOCK - 1, :][None, :]
  queries = masked_rescale(q_ref[...], g_ref[...] - g_after,
                           chunk_rows >= offset + SUB_BLOCK - by_dot
                           ).astype(dtype)
  causal = (lax.broadcasted_iota(jnp.int32, (chunk, SUB_BLOCK), 0)
            >= offset + lax.broadcasted_iota(jnp.int32, (chunk, SUB_BLOCK), 1))
  scores = jnp.where(causal, mm(queries, scale_rows(k_b, g_after - g_b).astype(
      dtype), trans_b=True), 0.0)
  d_scores = jnp.where(causal, mm(do_ref[...], v_b, trans_b=True), 0.0)
  dk_b += scale * scale_rows(mm(d_scores.astype(dtype).T, queries),
                             g_after - g_b)
  dv_b += scale * mm(scores.astype(dtype).T, do_ref[...])
  g_last = g_ref[chunk - 1, :][None, :]
  k_to_end = scale_rows(k_b, g_last - g_b).astype(dtype)
  dq_ref[...] = scale * dq_b
  d_state = d_state_ref[...]
  dk_ref[...] = dk_b + scale_rows(mm(v_b, d_state, trans_b=True),
                                  g_last - g_b)
  dv_ref[...] = (dv_b + mm(k_to_end, d_state)).astype(dv_ref.dtype)


def _gradient_kernel(*refs, schedule: ChunkedSchedule, fp32_exact: bool):
  q_ref, k_ref, v_ref, *refs = refs
  g_ref = refs.pop(0) if schedule.decay_kind != "none" else None
  grads = (_vector_chunk_grads if schedule.decay_kind == "vector"
           else _dense_chunk_grads)
  grads((q_ref, k_ref, v_ref, g_ref, *refs), chunk=schedule.chunk_size,
        scale=schedule.scale,
        mm=functools.partial(backend.dot, fp32_exact=fp32_exact))


def chunked_backward(q, k, v, log_decay_cum, chunk_states, d_out, d_final,
                     schedule: ChunkedSchedule):
  """dq, dk (float32), dv and d(initial state) of the chunked forward.

  Shapes as in `chunked_forward`; d_out [B, S, H, Dv], d_final
  [B, H, Dk, Dv] float32. dq and dk are summed over the Dv blocks here.
  """
  batch, seq_len, heads, d_feature = q.shape
  d_v = v.shape[-1]
  block_v, rows = schedule.block_v, schedule.rows_per_program
  num_blocks_v = d_v // block_v
  d_out = d_out.astype(q.dtype)
  d_states, d_initial = state_pass(q, d_out, log_decay_cum, d_final, schedule,
                                   reverse=True)
  in_specs, inputs = chunk_inputs(q, k, v, log_decay_cum, schedule)
  in_specs += [chunk_state_spec(schedule, d_feature)] * 2 + [
      sequence_spec(schedule.chunk_size, block_v, column_blocked=True,
                    programs_per_block=schedule.programs_per_chunk)]
  inputs += [chunk_states, d_states, d_out]
  partial_spec = pl.BlockSpec((None, None, rows, None, d_feature),
                              lambda j, c, b, h: (j, b, c, h, 0))
  partial_shape = jax.ShapeDtypeStruct(
      (num_blocks_v, batch, seq_len, heads, d_feature), jnp.float32)
  out_shape = [partial_shape, partial_shape,
               jax.ShapeDtypeStruct(v.shape, v.dtype)]
  out_specs = [partial_spec, partial_spec,
               row_spec(schedule, block_v, column_blocked=True)]
  kernel = functools.partial(_gradient_kernel, schedule=schedule,
                             fp32_exact=q.dtype == jnp.float32)
  dq, dk, dv = backend.pallas_call(
      kernel, out_shape=out_shape,
      grid=(num_blocks_v, seq_len // rows, batch, heads),
      in_specs=in_specs, out_specs=out_specs, num_warps=schedule.num_warps,
      num_stages=schedule.num_stages, interpret=schedule.interpret,
      name=f"linear_attention_bwd_{schedule.decay_kind}")(*inputs)
  return dq.sum(0), dk.sum(0), dv, d_initial


def log_decay_grad(q, k, dq, dk, final_state, d_final, decay_kind: str):
  """d(step log decay) from the q/k gradients (see the module docstring).

  Returns [B, S, H] for the "scalar" kind, [B, S, H, Dk] for "vector".
  """
  d_cumulative = q.astype(jnp.float32) * dq - k.astype(jnp.float32) * dk
  d_last = jnp.sum(final_state * d_final, axis=-1)  # [B, H, Dk]
  if decay_kind == "scalar":
    d_cumulative = jnp.sum(d_cumulative, axis=-1)
    d_last = jnp.sum(d_last, axis=-1)
  return lax.cumsum(d_cumulative, axis=1, reverse=True) + d_last[:, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def chunked_linear_attention(q, k, v, log_decay, initial_state,
                             schedule: ChunkedSchedule):
  """Linear attention on padded inputs, differentiable in all array inputs.

  log_decay: None, [B, S, H] or [B, S, H, Dk] step log decays (the kind
  named by `schedule.decay_kind`), clamped to `LOG_DECAY_FLOOR` here.
  Returns (o, final state).
  """
  o, final_state, _ = _forward(
      q, k, v, cumulative_log_decay(log_decay, schedule), initial_state,
      schedule, keep_states=False)
  return o, final_state


def _forward(q, k, v, log_decay_cum, initial_state, schedule: ChunkedSchedule, *,
             keep_states: bool):
  """(o, final state, the states entering the chunks or None) from the
  schedule's lowering; Mosaic's one kernel stores the states only when the
  backward keeps them, and per-feature gates whose spans exceed its factors'
  range (`mosaic_forward.gates_in_range`) take the Triton passes at run time."""
  def triton():
    o, final_state, chunk_states = chunked_forward(q, k, v, log_decay_cum, initial_state,
                                                   schedule)
    return o, final_state, chunk_states if keep_states else None

  if schedule.lowering != "mosaic_gpu":
    return triton()

  def mosaic():
    return mosaic_forward.forward(q, k, v, log_decay_cum, initial_state,
                                  decay_kind=schedule.decay_kind, scale=schedule.scale,
                                  store_states=keep_states, stages=schedule.num_stages)

  return mosaic_forward.unless_gates_out_of_range(schedule.decay_kind, log_decay_cum, mosaic,
                                                  triton)


def _forward_with_residuals(q, k, v, log_decay, initial_state, schedule):
  log_decay_cum = cumulative_log_decay(log_decay, schedule)
  o, final_state, chunk_states = _forward(
      q, k, v, log_decay_cum, initial_state, schedule, keep_states=True)
  residuals = (q, k, v, log_decay, log_decay_cum, chunk_states, final_state)
  return (o, final_state), residuals


def _backward(schedule, residuals, cotangents):
  q, k, v, log_decay, log_decay_cum, chunk_states, final_state = residuals
  d_out, d_final = cotangents
  triton = lambda: chunked_backward(q, k, v, log_decay_cum, chunk_states, d_out, d_final,
                                    schedule)
  mosaic = lambda: linear_mosaic_backward.backward(
      q, k, v, log_decay_cum, chunk_states, d_out, d_final, decay_kind=schedule.decay_kind,
      scale=schedule.scale, stages=schedule.num_stages)
  if schedule.backward_lowering != "mosaic_gpu":
    dq, dk, dv, d_initial = triton()
  else:  # as the forward: the anchored factors' range
    dq, dk, dv, d_initial = mosaic_forward.unless_gates_out_of_range(
        schedule.decay_kind, log_decay_cum, mosaic, triton)
  d_log_decay = None
  if log_decay is not None:  # no gradient through the prefix pass' clamp
    d_log_decay = jnp.where(
        log_decay >= LOG_DECAY_FLOOR,
        log_decay_grad(q, k, dq, dk, final_state, d_final,
                       schedule.decay_kind), 0.0).astype(log_decay.dtype)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv, d_log_decay, d_initial


chunked_linear_attention.defvjp(_forward_with_residuals, _backward)


class LinearBackwardTemplate(LinearTemplate):
  name = "linear_backward"

  def resource_use(self, config, shape, device):
    d_qk = padded_head_dim(shape.d_qk)
    c, bv = config.chunk_size, config.block_v
    smem = config.num_stages * c * (2 * d_qk + 2 * bv) * shape.itemsize
    # The state and its cotangent, the scores and the gradients.
    fp32 = 2 * d_qk * bv + 2 * c * c + c * (d_qk + bv)
    return ResourceUse(smem, accumulator_registers(fp32, config, device))


TEMPLATE = register(LinearBackwardTemplate())
