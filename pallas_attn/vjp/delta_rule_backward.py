"""Backward pass of the delta rule, and its `jax.custom_vjp`.

The forward is the Pallas kernels of `kernels.linear.delta_rule`; the
backward is Pallas kernels too, in two steps:

1. The cotangent of the state leaving every chunk, from the last chunk
   down: the template's reverse state pass in its delta form. Per chunk (S0
   the state entering it, U its values U~ - W S0, P the decayed causal
   Q K^T, K' = K exp(g_last - g)), with dS the cotangent of the state
   leaving it:

       dU  = scale P^T dO + K' dS
       dS0 = exp(g_last) dS + scale (Q exp(g))^T dO - W^T dU

   scale P^T dO comes first, from a parallel pass over chunks; W is the
   forward's, kept as a residual.
2. Every chunk's gradients, all chunks in parallel, from its entering state
   (the forward's residual) and the cotangents of its outputs and leaving
   state: a chunk sees the decays of earlier ones only through its entering
   state, so these local gradients are the whole gradients. One program per
   chunk and head (`_gradient_kernel`) for all three decay kinds
   (per-feature decays pair rows by `per_feature_pairs`).
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

# Warps of the gradient kernel per decay kind. It holds a chunk's state and
# its cotangent ([Dk, Dv] each) beside a dozen [C, D] float32 tiles; on an
# H200 (B4 S4096 H16 d128 bf16, forward+backward kernel time) 4 warps ran
# DeltaNet in 2.19 ms (8: 2.24) and KDA in 7.5 (8: 7.9), but Gated
# DeltaNet's kernel took 14.5 ms on 4 warps against 2.4 on 8.
GRADIENT_WARPS = {"none": 4, "scalar": 8, "vector": 4}
# Value columns per step of the gradient kernel's walk over the state (None:
# all at once). KDA's 16-token chunks leave registers for a 64-column walk
# (its kernel 4.34 -> 3.12 ms, H200, B4 S4096 H16 d128); DeltaNet's and
# Gated DeltaNet's 32-token chunks spill on it (1.25 -> 9.6, 1.95 -> 12.5).
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
  o, final_state, chunk_states, pseudo_keys, transforms = delta_rule_forward(
      q, k, v, beta, log_decay, initial_state, schedule, keep_transforms=True)
  residuals = (q, k, v, beta, log_decay, chunk_states, pseudo_keys, transforms)
  return (o, final_state), residuals


def _decayed_pairs(x, k_ref, g_ref, decay, *, vector: bool, mm,
                   d_pairs=None):
  """P_ij = sum_d x_id k_jd 2^(g_id - g_jd) for i >= j, else 0 ([C, C]),
  and given d_pairs (its cotangent) the gradients of x and k ([C, D]).

  decay: `dense_decay`'s masked decay matrix ("none"/"scalar"); per-feature
  decays split around anchor rows instead (`per_feature_pairs`).
  """
  if vector:
    return per_feature_pairs(x, k_ref, g_ref, x.shape[0], mm, d_pairs)
  k = k_ref[...].astype(jnp.float32)
  pairs = mm(x, k, trans_b=True) * decay
  if d_pairs is None:
    return pairs, None, None
  d_pairs = d_pairs * decay
  return pairs, mm(d_pairs, k), mm(d_pairs.T, x)


def _chunk_decays(g_ref, vector: bool, chunk: int):
  """(`dense_decay`'s masked decay matrix, or None for per-feature decays;
  the row log factors g; the log factors to the chunk end g_last - g)."""
  if not vector:
    return dense_decay(g_ref, chunk)
  g = g_ref[...]
  return None, g, g_ref[chunk - 1, :][None, :] - g


def _local_value_cotangent_kernel(*refs, decay_kind: str, chunk: int,
                                  scale: float, fp32_exact: bool):
  """scale P^T dO of one chunk: what dU owes to the chunk's own outputs."""
  q_ref, k_ref, *refs = refs
  g_ref = refs.pop(0) if decay_kind != "none" else None
  do_ref, out_ref = refs
  mm = functools.partial(backend.dot, fp32_exact=fp32_exact)
  vector = decay_kind == "vector"
  decay, _, _ = _chunk_decays(g_ref, vector, chunk)
  scores, _, _ = _decayed_pairs(q_ref[...].astype(jnp.float32), k_ref, g_ref,
                                decay, vector=vector, mm=mm)
  out_ref[...] = scale * mm(scores.T, do_ref[...].astype(jnp.float32))


def _chunk_inputs(arrays, chunk: int):
  """BlockSpecs (grid: chunk, batch, head) of whole chunks of [B, S, H]
  and [B, S, H, D] arrays (None entries dropped) and the arrays."""
  arrays = [x for x in arrays if x is not None]
  return [chunk_spec(chunk, x.shape[3] if x.ndim == 4 else None)
          for x in arrays], arrays


def _leaving_state_cotangents(q, k, log_decay_cum, pseudo_keys, d_out,
                              d_final, schedule: ChunkedSchedule):
  """(dS leaving each chunk [B, H, N, Dk, Dv] in q's dtype, d(initial
  state)): step 1 of the module docstring, as the template's reverse state
  pass in its delta form."""
  batch, seq_len, heads, _ = q.shape
  chunk = schedule.chunk_size
  in_specs, inputs = _chunk_inputs((q, k, log_decay_cum, d_out), chunk)
  kernel = functools.partial(
      _local_value_cotangent_kernel, decay_kind=schedule.decay_kind,
      chunk=chunk, scale=schedule.scale, fp32_exact=q.dtype == jnp.float32)
  local_d_values = backend.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(d_out.shape, jnp.float32),
      grid=(seq_len // chunk, batch, heads), in_specs=in_specs,
      out_specs=in_specs[-1], num_warps=schedule.num_warps, num_stages=1,
      interpret=schedule.interpret,
      name=f"delta_rule_bwd_local_{schedule.decay_kind}")(*inputs)
  return state_pass(q, d_out.astype(q.dtype), log_decay_cum, d_final,
                    schedule, reverse=True, pseudo_keys=pseudo_keys,
                    keys=k, local_d_values=local_d_values)


def _gradient_kernel(*refs, decay_kind: str, chunk: int, scale: float,
                     fp32_exact: bool, value_block: int):
  """Gradients of one chunk of one head: products with operands in the
  inputs' dtype (as the forward's), accumulated and combined in float32.

  Takes the chunk's T from the forward (its UT transform's, in the inputs'
  dtype: recomputing it cost KDA's kernel 1.8 of 5.9 ms on an H200),
  recomputes W and the values U = U~ - W S0 from the entering state, then
  runs the forward's products backwards: dU = scale P^T dO + K' dS;
  through U = T (beta V) - T (beta K 2^g) S0 to dV, dbeta, dK and dT;
  dL = -T^T dT T^T on the strictly lower part; through L = beta (K K^T *
  decay) to dbeta and dK. dG, the gradient of the chunk-cumulative log
  decay, sums x * dx over every factor 2^(+-g) met (row sides +, column
  sides -), plus the chunk-end decay's terms on the last row; summed over
  features for a scalar decay.
  """
  q_ref, k_ref, v_ref, beta_ref, *refs = refs
  g_ref = refs.pop(0) if decay_kind != "none" else None
  (transform_ref, state_ref, d_state_ref, do_ref, dq_ref, dk_ref, dv_ref, dbeta_ref,
   *dg_ref) = refs
  dtype = q_ref.dtype
  mm = lambda a, b, **kw: backend.dot(  # operands in the inputs' dtype
      a.astype(dtype), b.astype(dtype), fp32_exact=fp32_exact, **kw)
  q, k = (r[...].astype(jnp.float32) for r in (q_ref, k_ref))
  d_v = dv_ref.shape[1]
  blocks = [pl.ds(start, value_block) for start in range(0, d_v, value_block)]
  one_block = len(blocks) == 1
  columns = lambda cols: ... if one_block else (slice(None), cols)

  def load(cols):  # v, dO, S0 and dS in these columns (S0, dS: operands only)
    return (*(r[columns(cols)].astype(jnp.float32) for r in (v_ref, do_ref)),
            state_ref[columns(cols)], d_state_ref[columns(cols)])

  first = load(blocks[0]) if one_block else None  # the plain order loads first
  beta = beta_ref[...].astype(jnp.float32)[:, None]
  vector = decay_kind == "vector"
  decay, g, g_to_end = _chunk_decays(g_ref, vector, chunk)
  pairs = functools.partial(_decayed_pairs, k_ref=k_ref, g_ref=g_ref,
                            decay=decay, vector=vector, mm=mm)
  key_products, _, _ = pairs(k)
  transform = transform_ref[...]
  keys_decayed = scale_rows(k, g)
  keys_to_end = scale_rows(k, g_to_end)
  # Every term of the walk below is linear in the state's value columns and
  # sums over their blocks. Triton's code follows the order of the products
  # (H200, B4 S4096 H16 d128, kernel ms): with one block each sum is used as
  # soon as it is complete and the last columns' sums come at the end (Gated
  # DeltaNet 1.95; other orders 2.0-2.09); walking several blocks, W and P
  # come first and every use after the walk (KDA 3.1; uses inside the last
  # step spilled: 4.9).
  add = lambda total, x: x if total is None else total + x
  w_keys = scores = d_scores = dq_state = dk_state = d_w = None
  d_transform = dbeta = state_products = None
  if not one_block:
    w_keys = mm(transform, beta * keys_decayed)  # W
    scores, _, _ = pairs(q)

  def column_sums(cols, v, from_values):
    """dv's columns and their terms of dbeta."""
    nonlocal dbeta
    dv_ref[columns(cols)] = (beta * from_values).astype(dv_ref.dtype)
    dbeta = add(dbeta, jnp.sum(v * from_values, axis=1))

  # rowsum(S0 * dS), for the chunk end's decay
  state_terms = lambda state, d_state: jnp.sum(
      state.astype(jnp.float32) * d_state.astype(jnp.float32), axis=1)

  for cols in blocks:
    v, do, state, d_state = first if one_block else load(cols)
    u_tilde = mm(transform, beta * v)
    if one_block:
      w_keys = mm(transform, beta * keys_decayed)
    values = u_tilde - mm(w_keys, state)
    if one_block:
      scores, _, _ = pairs(q)
    d_values = scale * mm(scores.T, do) + mm(keys_to_end, d_state)
    d_scores = add(d_scores, scale * mm(do, values, trans_b=True))
    if one_block:
      _, dq, dk_scores = pairs(q, d_pairs=d_scores)
    dq_state = add(dq_state, mm(do, state, trans_b=True))
    if one_block:
      dq += scale * scale_rows(dq_state, g)
    dk_state = add(dk_state, mm(values, d_state, trans_b=True))
    if one_block:
      dk_state = scale_rows(dk_state, g_to_end)
    d_w = add(d_w, -mm(d_values, state, trans_b=True))
    from_values = mm(transform.T, d_values)
    if one_block:
      from_w = mm(transform.T, d_w)
    else:
      column_sums(cols, v, from_values)
    d_transform = add(d_transform, mm(d_values, beta * v, trans_b=True))
    if g_ref is not None and not one_block:
      state_products = add(state_products, state_terms(state, d_state))
  if not one_block:
    _, dq, dk_scores = pairs(q, d_pairs=d_scores)
    dq += scale * scale_rows(dq_state, g)
    dk_state = scale_rows(dk_state, g_to_end)
    from_w = mm(transform.T, d_w)
  d_transform += mm(d_w, beta * keys_decayed, trans_b=True)
  d_lower = jnp.where(strictly_lower(chunk), -mm(
      mm(transform.T, d_transform), transform, trans_b=True), 0.0)
  _, dk_rows, dk_cols = pairs(k, d_pairs=beta * d_lower)
  dk_w = beta * scale_rows(from_w, g)
  dq_ref[...] = dq
  dk_ref[...] = dk_scores + dk_state + dk_w + dk_rows + dk_cols
  if one_block:
    column_sums(blocks[0], v, from_values)
  dbeta_ref[...] = (dbeta + jnp.sum(keys_decayed * from_w, axis=1)
                    + jnp.sum(d_lower * key_products, axis=1))
  if g_ref is None:
    return
  d_g = q * dq + k * (dk_rows - dk_cols + dk_w - dk_scores - dk_state)
  # The chunk end's decay: of every key (K') and of the entering state.
  d_g_last = (jnp.sum(k * dk_state, axis=0, keepdims=True)
              + scale_rows((state_products if not one_block else
                            state_terms(state, d_state))[None, :],
                           g_ref[chunk - 1, :][None, :] if vector else
                           g_ref[chunk - 1]))
  if not vector:
    d_g, d_g_last = jnp.sum(d_g, axis=1), jnp.sum(d_g_last)
  last = lax.broadcasted_iota(jnp.int32, d_g.shape, 0) == chunk - 1
  dg_ref[0][...] = d_g + jnp.where(last, d_g_last, 0.0)


def _chunk_grads(q, k, v, beta, log_decay, log_decay_cum, transforms, chunk_states,
                 d_leaving, d_out, schedule: ChunkedSchedule):
  """(dq, dk, dv, dbeta, d log_decay) from one `_gradient_kernel` program
  per chunk and head; transforms [B, S, H, C] (the forward's T), d_leaving
  [B, H, N, Dk, Dv]."""
  batch, seq_len, heads, d_feature = q.shape
  d_v, chunk = v.shape[-1], schedule.chunk_size
  in_specs, inputs = _chunk_inputs((q, k, v, beta, log_decay_cum), chunk)
  out_specs = list(in_specs)
  state = pl.BlockSpec((None, None, None, d_feature, d_v),
                       lambda c, b, h: (b, h, c, 0, 0))
  in_specs += [chunk_spec(chunk, chunk), state, state, chunk_spec(chunk, d_v)]
  inputs += [transforms, chunk_states, d_leaving, d_out]
  # Gradients of q, k, v, beta (and of the cumulative log decay G).
  out_shape = [jax.ShapeDtypeStruct(x.shape, jnp.float32)
               for x in inputs[:len(out_specs)]]
  out_shape[2] = jax.ShapeDtypeStruct(v.shape, v.dtype)
  value_block = GRADIENT_VALUE_BLOCK[schedule.decay_kind]
  kernel = functools.partial(
      _gradient_kernel, decay_kind=schedule.decay_kind, chunk=chunk,
      scale=schedule.scale, fp32_exact=q.dtype == jnp.float32,
      value_block=value_block if value_block and d_v % value_block == 0 else d_v)
  dq, dk, dv, d_beta, *d_g = backend.pallas_call(
      kernel, out_shape=out_shape, grid=(seq_len // chunk, batch, heads),
      in_specs=in_specs, out_specs=out_specs,
      num_warps=GRADIENT_WARPS[schedule.decay_kind], num_stages=1,
      interpret=schedule.interpret,
      name=f"delta_rule_bwd_{schedule.decay_kind}")(*inputs)
  d_log_decay = None
  if log_decay is not None:  # G_t sums the chunk's steps up to t
    d_g = d_g[0].reshape(batch, seq_len // chunk, chunk, *log_decay.shape[2:])
    d_steps = lax.cumsum(d_g, axis=2, reverse=True).reshape(log_decay.shape)
    # No gradient past the clamp of the cumulative-decay kernel.
    d_log_decay = jnp.where(log_decay >= LOG_DECAY_FLOOR, d_steps, 0.0)
  return dq, dk, dv, d_beta, d_log_decay


def _backward(schedule, residuals, cotangents):
  q, k, v, beta, log_decay, chunk_states, pseudo_keys, transforms = residuals
  d_out, d_final = cotangents
  log_decay_cum = cumulative_log_decay(log_decay, schedule)
  d_leaving, d_initial = _leaving_state_cotangents(
      q, k, log_decay_cum, pseudo_keys, d_out, d_final, schedule)
  grads = _chunk_grads(q, k, v, beta, log_decay, log_decay_cum, transforms, chunk_states,
                       d_leaving, d_out, schedule)
  primals = (q, k, v, beta, log_decay)
  return tuple(None if x is None else d.reshape(x.shape).astype(x.dtype)
               for d, x in zip(grads, primals)) + (d_initial,)


chunked_delta_rule.defvjp(_forward_with_residuals, _backward)
