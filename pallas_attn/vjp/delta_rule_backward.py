"""Backward pass of the delta rule, and its `jax.custom_vjp`.

The forward is the Pallas kernels of `kernels.linear.delta_rule`, whose
residuals are the states entering each chunk S0, W, the values U = U~ - W S0
and T; the backward is Pallas kernels too, in three steps:

1. The cotangent of the state leaving every chunk, from the last chunk
   down: the template's reverse state pass in its delta form. Per chunk (U
   its values, P the decayed causal Q K^T, K' = K 2^(g_last - g)), with dS
   the cotangent of the state leaving it:

       dU  = scale P^T dO + K' dS
       dS0 = 2^g_last dS + scale (Q 2^g)^T dO - W^T dU

   The pass stores dS and dU per chunk (for per-feature decays scale P^T
   dO comes first, from a parallel pass over chunks).
2. Per chunk, all in parallel, what meets the states (`_state_gradient_kernel`):
   dQ (from dO S0^T and the scores' dP = scale dO U^T), K's gradient through
   the scores and K', and dW = -dU S0^T.
3. Per chunk, all in parallel, through the UT transform
   (`_transform_gradient_kernel`): U~ = T (beta V) and W = T (beta K 2^g)
   to dV, dbeta and the rest of dK, via dT and dL = -T^T dT T^T on the
   strictly lower part of L = beta (K K^T decayed).

A chunk sees the decays of earlier ones only through its entering state, so
these local gradients are the whole gradients. Two kernels, not one: a
single program per chunk holding the state, its cotangent and every [C, D]
tile recomputed U and dU and ran at a fraction of the tensor cores' rate
(DeltaNet, B4 S4096 H16 d128 on an H200: 1.25 of the 2.2 ms forward+backward).
Per-feature decays pair rows by `per_feature_pairs`.
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
    scale_rows, state_pass)
from pallas_attn.kernels.linear.delta_rule import (
    chunk_spec, delta_rule_forward, delta_rule_forward_mosaic, per_feature_pairs,
    strictly_lower)

# Warps of steps 2 and 3 per decay kind, at the templates' chunks (32, 64,
# 16). On an H200 (B4 S4096 H16 d128 bf16, kernel ms, state / transform
# kernel): DeltaNet 8 / 4 warps 0.36 / 0.27 (4 / 4: 0.39 / 0.29; 2 warps
# for the transform 0.50); Gated DeltaNet 8 / 8 0.43 / 0.45 (4 / 4: 0.94 /
# 0.77); KDA 4 / 4 0.81 / 0.60 (8 / 4: 1.12 states; 2 / 2: 2.10 / 0.87).
STATE_GRADIENT_WARPS = {"none": 8, "scalar": 8, "vector": 4}
TRANSFORM_GRADIENT_WARPS = {"none": 4, "scalar": 8, "vector": 4}
# Value columns per step of the state-gradient kernel's walk over the state
# (None: all at once).
GRADIENT_VALUE_BLOCK = {"none": None, "scalar": None, "vector": 64}


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def chunked_delta_rule(q, k, v, beta, log_decay, initial_state,
                       schedule: ChunkedSchedule):
  """The delta rule on padded inputs (S a multiple of the chunk), each
  array differentiable. beta: [B, S, H] (zero on padded steps); log_decay:
  None, [B, S, H] or [B, S, H, Dk] step log decays. Returns (o, final
  state float32)."""
  if schedule.lowering == "mosaic_gpu":
    return delta_rule_forward_mosaic(q, k, v, beta, log_decay, initial_state, schedule)
  o, final_state, *_ = delta_rule_forward(
      q, k, v, beta, log_decay, initial_state, schedule)
  return o, final_state


def _forward_with_residuals(q, k, v, beta, log_decay, initial_state,
                            schedule):
  o, final_state, chunk_states, pseudo_keys, values, transforms = delta_rule_forward(
      q, k, v, beta, log_decay, initial_state, schedule, keep_transforms=True)
  residuals = (q, k, v, beta, log_decay, chunk_states, pseudo_keys, values,
               transforms)
  return (o, final_state), residuals


def _decayed_pairs(x, k_ref, g_ref, decay, *, vector: bool, mm,
                   d_pairs=None):
  """P_ij = sum_d x_id k_jd 2^(g_id - g_jd) for i >= j, else 0 ([C, C]),
  and given d_pairs (its cotangent) the gradients of x and k ([C, D]); P
  is then None unless the decays are per feature (whose pairing forms it
  on the way).

  decay: `dense_decay`'s masked decay matrix ("none"/"scalar"); per-feature
  decays split around anchor rows instead (`per_feature_pairs`).
  """
  if vector:
    return per_feature_pairs(x, k_ref, g_ref, x.shape[0], mm, d_pairs)
  k = k_ref[...].astype(jnp.float32)
  if d_pairs is None:
    return mm(x, k, trans_b=True) * decay, None, None
  d_pairs = d_pairs * decay
  return None, mm(d_pairs, k), mm(d_pairs.T, x)


def _chunk_decays(g_ref, vector: bool, chunk: int):
  """(`dense_decay`'s masked decay matrix, or None for per-feature decays;
  the row log factors g; the log factors to the chunk end g_last - g)."""
  if not vector:
    return dense_decay(g_ref, chunk)
  g = g_ref[...]
  return None, g, g_ref[chunk - 1, :][None, :] - g


def _operand_dot(dtype, fp32_exact: bool):
  """Products with operands in the inputs' dtype (as the forward's),
  accumulated in float32."""
  return lambda a, b, **kw: backend.dot(
      a.astype(dtype), b.astype(dtype), fp32_exact=fp32_exact, **kw)


def _local_value_cotangent_kernel(q_ref, k_ref, g_ref, do_ref, out_ref, *,
                                  chunk: int, fp32_exact: bool):
  """P^T dO of one chunk with per-feature decays: what dU owes to the
  chunk's own outputs, over the output scale (the reverse pass's units)."""
  mm = functools.partial(backend.dot, fp32_exact=fp32_exact)
  scores, _, _ = per_feature_pairs(q_ref[...].astype(jnp.float32), k_ref, g_ref,
                                   chunk, mm)
  out_ref[...] = mm(scores.T, do_ref[...].astype(jnp.float32))


def _chunk_inputs(arrays, chunk: int):
  """BlockSpecs (grid: chunk, batch, head) of whole chunks of [B, S, H]
  and [B, S, H, D] arrays (None entries dropped) and the arrays."""
  arrays = [x for x in arrays if x is not None]
  return [chunk_spec(chunk, x.shape[3] if x.ndim == 4 else None)
          for x in arrays], arrays


def _leaving_state_cotangents(q, k, log_decay_cum, pseudo_keys, d_out,
                              d_final, schedule: ChunkedSchedule):
  """(dS leaving each chunk [B, H, N, Dk, Dv] in q's dtype, d(initial
  state), dU [B, S, H, Dv] in q's dtype): step 1 of the module docstring,
  as the template's reverse state pass in its delta form. It forms scale
  P^T dO itself but for per-feature decays, whose pairing is a parallel
  pass before it."""
  batch, seq_len, heads, _ = q.shape
  chunk = schedule.chunk_size
  local_d_values = None
  if schedule.decay_kind == "vector":
    in_specs, inputs = _chunk_inputs((q, k, log_decay_cum, d_out), chunk)
    kernel = functools.partial(
        _local_value_cotangent_kernel, chunk=chunk,
        fp32_exact=q.dtype == jnp.float32)
    local_d_values = backend.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(d_out.shape, jnp.float32),
        grid=(seq_len // chunk, batch, heads), in_specs=in_specs,
        out_specs=in_specs[-1], num_warps=schedule.num_warps, num_stages=1,
        interpret=schedule.interpret,
        name=f"delta_rule_bwd_local_{schedule.decay_kind}")(*inputs)
  return state_pass(q, d_out.astype(q.dtype), log_decay_cum, d_final,
                    schedule, reverse=True, pseudo_keys=pseudo_keys,
                    keys=k, local_d_values=local_d_values)


def _last_row(d_g, d_g_last, chunk: int):
  """d_g [C, D] plus the chunk end's terms d_g_last [1, D] on its last row."""
  last = lax.broadcasted_iota(jnp.int32, d_g.shape, 0) == chunk - 1
  return d_g + jnp.where(last, d_g_last, 0.0)


def _state_gradient_kernel(*refs, decay_kind: str, chunk: int, scale: float,
                           fp32_exact: bool, value_block: int):
  """Step 2 of the module docstring for one chunk of one head: dQ, K's
  gradient through the scores and K' (dK partial), dW, and their terms of
  dG, the gradient of the chunk-cumulative log decay: x * dx over every
  factor 2^(+-g) met (row sides +, column sides -), plus the chunk end's
  decay (of K' and of the entering state) on the last row; summed over
  features for a scalar decay.

  Every product contracts the state's value columns; with `value_block`
  under Dv they are walked in blocks, each sum used after the walk.
  """
  q_ref, k_ref, *refs = refs
  g_ref = refs.pop(0) if decay_kind != "none" else None
  (values_ref, do_ref, d_values_ref, state_ref, d_state_ref,
   dq_ref, dk_ref, dw_ref, *dg_ref) = refs
  mm = _operand_dot(q_ref.dtype, fp32_exact)
  d_v = do_ref.shape[1]
  add = lambda total, x: x if total is None else total + x
  d_scores = dq_state = dk_state = d_w = state_products = None
  for start in range(0, d_v, value_block):
    cols = ... if value_block == d_v else (slice(None), pl.ds(start, value_block))
    values, do, d_values, state, d_state = (r[cols] for r in (
        values_ref, do_ref, d_values_ref, state_ref, d_state_ref))
    d_scores = add(d_scores, scale * mm(do, values, trans_b=True))
    dq_state = add(dq_state, mm(do, state, trans_b=True))
    d_w = add(d_w, -mm(d_values, state, trans_b=True))
    dk_state = add(dk_state, mm(values, d_state, trans_b=True))
    if g_ref is not None:  # rowsum(S0 * dS), for the chunk end's decay
      state_products = add(state_products, jnp.sum(
          state.astype(jnp.float32) * d_state.astype(jnp.float32), axis=1))
  vector = decay_kind == "vector"
  decay, g, g_to_end = _chunk_decays(g_ref, vector, chunk)
  q = q_ref[...].astype(jnp.float32)
  _, dq, dk_scores = _decayed_pairs(q, k_ref, g_ref, decay, vector=vector,
                                    mm=mm, d_pairs=d_scores)
  dq += scale * scale_rows(dq_state, g)
  dk_state = scale_rows(dk_state, g_to_end)
  dq_ref[...] = dq.astype(dq_ref.dtype)
  dk_ref[...] = dk_scores + dk_state
  dw_ref[...] = d_w.astype(dw_ref.dtype)
  if g_ref is None:
    return
  k = k_ref[...].astype(jnp.float32)
  d_g = q * dq - k * (dk_scores + dk_state)
  d_g_last = (jnp.sum(k * dk_state, axis=0, keepdims=True)
              + scale_rows(state_products[None, :],
                           g_ref[chunk - 1, :][None, :] if vector else
                           g_ref[chunk - 1]))
  if not vector:
    d_g, d_g_last = jnp.sum(d_g, axis=1), jnp.sum(d_g_last)
  dg_ref[0][...] = _last_row(d_g, d_g_last, chunk)


def _transform_gradient_kernel(*refs, decay_kind: str, chunk: int,
                               fp32_exact: bool):
  """Step 3 of the module docstring for one chunk of one head: from dU and
  dW through U~ = T (beta V), W = T (beta K 2^g) and L = beta (K K^T
  decayed) to dV, dbeta, the rest of dK (added to step 2's) and of dG.

  Takes the chunk's T from the forward (in the inputs' dtype: recomputing
  it cost KDA's old one-kernel backward 1.8 of 5.9 ms on an H200).
  """
  k_ref, v_ref, beta_ref, *refs = refs
  g_ref = refs.pop(0) if decay_kind != "none" else None
  (transform_ref, d_values_ref, d_w_ref, dk_part_ref, *refs) = refs
  dg_part_ref = refs.pop(0) if g_ref is not None else None
  dk_ref, dv_ref, dbeta_ref, *dg_ref = refs
  mm = _operand_dot(k_ref.dtype, fp32_exact)
  beta = beta_ref[...].astype(jnp.float32)[:, None]
  transform = transform_ref[...]
  # In the order the tiles die (through U~, then W, then L), as Triton
  # keeps the program's order: H200, B4 S4096 H16 d128, Gated DeltaNet's
  # kernel 0.425 -> 0.389 ms, KDA's 0.603 -> 0.659, DeltaNet's equal.
  v, d_values = v_ref[...].astype(jnp.float32), d_values_ref[...]
  from_values = mm(transform.T, d_values)
  dv_ref[...] = (beta * from_values).astype(dv_ref.dtype)
  d_beta = jnp.sum(v * from_values, axis=1)
  d_transform = mm(d_values, beta * v, trans_b=True)
  vector = decay_kind == "vector"
  decay, g, _ = _chunk_decays(g_ref, vector, chunk)
  k, d_w = k_ref[...].astype(jnp.float32), d_w_ref[...]
  keys_decayed = scale_rows(k, g)
  from_w = mm(transform.T, d_w)
  d_beta += jnp.sum(keys_decayed * from_w, axis=1)
  d_transform = mm(d_w, beta * keys_decayed, trans_b=True) + d_transform
  dk_w = beta * scale_rows(from_w, g)
  d_lower = jnp.where(strictly_lower(chunk), -mm(
      mm(transform.T, d_transform), transform, trans_b=True), 0.0)
  pairs = functools.partial(_decayed_pairs, k, k_ref, g_ref, decay,
                            vector=vector, mm=mm)
  key_products, dk_rows, dk_cols = pairs(d_pairs=beta * d_lower)
  if key_products is None:  # the plain decays' gradients leave it out
    key_products, _, _ = pairs()
  d_beta += jnp.sum(d_lower * key_products, axis=1)
  dbeta_ref[...] = d_beta.astype(dbeta_ref.dtype)
  dk_ref[...] = (dk_part_ref[...] + dk_w + dk_rows + dk_cols).astype(dk_ref.dtype)
  if g_ref is None:
    return
  d_g = k * (dk_rows - dk_cols + dk_w)
  if not vector:
    d_g = jnp.sum(d_g, axis=1)
  dg_ref[0][...] = dg_part_ref[...] + d_g


def _chunk_grads(q, k, v, beta, log_decay, log_decay_cum, chunk_states, values,
                 transforms, d_leaving, d_values, d_out,
                 schedule: ChunkedSchedule):
  """(dq, dk, dv, dbeta, d log_decay): steps 2 and 3 of the module
  docstring, one program per chunk and head each; transforms [B, S, H, C]
  (the forward's T), chunk_states and d_leaving [B, H, N, Dk, Dv]."""
  batch, seq_len, heads, d_feature = q.shape
  d_v, chunk, kind = v.shape[-1], schedule.chunk_size, schedule.decay_kind
  grid = (seq_len // chunk, batch, heads)
  fp32_exact = q.dtype == jnp.float32
  f32 = lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32)
  name = lambda step: f"delta_rule_bwd_{step}_{kind}"

  in_specs, inputs = _chunk_inputs((q, k, log_decay_cum, values, d_out, d_values), chunk)
  state = pl.BlockSpec((None, None, None, d_feature, d_v),
                       lambda c, b, h: (b, h, c, 0, 0))
  value_block = GRADIENT_VALUE_BLOCK[kind]
  dg_specs = [in_specs[2]] if log_decay_cum is not None else []
  dq, dk_part, d_w, *dg_part = backend.pallas_call(
      functools.partial(
          _state_gradient_kernel, decay_kind=kind, chunk=chunk,
          scale=schedule.scale, fp32_exact=fp32_exact,
          value_block=value_block if value_block and d_v % value_block == 0 else d_v),
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), f32(k),
                 jax.ShapeDtypeStruct(k.shape, q.dtype),
                 *(f32(x) for x in (log_decay_cum,) if x is not None)],
      grid=grid, in_specs=in_specs + [state, state],
      out_specs=[in_specs[0], in_specs[1], in_specs[1]] + dg_specs,
      num_warps=STATE_GRADIENT_WARPS[kind], num_stages=1,
      interpret=schedule.interpret, name=name("states"),
  )(*inputs, chunk_states, d_leaving)

  in_specs, inputs = _chunk_inputs(
      (k, v, beta, log_decay_cum, transforms, d_values, d_w, dk_part,
       *dg_part), chunk)
  out_specs = in_specs[:3] + dg_specs
  dk, dv, d_beta, *d_g = backend.pallas_call(
      functools.partial(_transform_gradient_kernel, decay_kind=kind,
                        chunk=chunk, fp32_exact=fp32_exact),
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (k, v, beta)] + [
                 *(f32(x) for x in (log_decay_cum,) if x is not None)],
      grid=grid, in_specs=in_specs, out_specs=out_specs,
      num_warps=TRANSFORM_GRADIENT_WARPS[kind], num_stages=1,
      interpret=schedule.interpret, name=name("transform"))(*inputs)
  d_log_decay = None
  if log_decay is not None:  # G_t sums the chunk's steps up to t
    d_g = d_g[0].reshape(batch, seq_len // chunk, chunk, *log_decay.shape[2:])
    d_steps = lax.cumsum(d_g, axis=2, reverse=True).reshape(log_decay.shape)
    # No gradient past the clamp of the cumulative-decay kernel.
    d_log_decay = jnp.where(log_decay >= LOG_DECAY_FLOOR, d_steps, 0.0)
  return dq, dk, dv, d_beta, d_log_decay


def _backward(schedule, residuals, cotangents):
  (q, k, v, beta, log_decay, chunk_states, pseudo_keys, values,
   transforms) = residuals
  d_out, d_final = cotangents
  log_decay_cum = cumulative_log_decay(log_decay, schedule)
  d_leaving, d_initial, d_values = _leaving_state_cotangents(
      q, k, log_decay_cum, pseudo_keys, d_out, d_final, schedule)
  grads = _chunk_grads(q, k, v, beta, log_decay, log_decay_cum, chunk_states,
                       values, transforms, d_leaving, d_values, d_out, schedule)
  primals = (q, k, v, beta, log_decay)
  return tuple(None if x is None else d.reshape(x.shape).astype(x.dtype)
               for d, x in zip(grads, primals)) + (d_initial,)


chunked_delta_rule.defvjp(_forward_with_residuals, _backward)
