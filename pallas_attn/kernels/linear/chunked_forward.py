"""Chunk-parallel forward template of linear attention (one kernel for all).

The sequence is cut into chunks of C tokens. One program owns a (batch,
head, Dv block) and walks the chunks in order with the state
`S [Dk, block_v]` in registers (float32):

  o_chunk = scale * ((q * exp(g)) S  +  (scores * decay) v)     (tensor cores)
  S       = exp(g_last) * S + (k * exp(g_last - g))^T v

where `g` is the cumulative log decay *within* the chunk (g_i = sum of the
step decays 0..i, precomputed in the wrapper). Every exponent above is a
difference `g_i - g_j` with i >= j or `g_i` itself, hence <= 0: nothing
overflows however long the chunk or strong the decay.

The template is specialised by the decay kind (a static argument):

* "none" / "scalar" (`g` is [S] per head): the intra-chunk part is one dense
  masked product `(Q K^T * D) V` with `D_ij = exp(g_i - g_j)` for i >= j.
* "vector" (GLA: `g` is [S, Dk]): `exp(g_id - g_jd)` does not factor out of
  the Dk contraction, so queries are processed in row blocks of
  `SUB_BLOCK` tokens. Keys of earlier blocks are rescaled against the last
  row before the block (both factors <= 1) and go through the tensor cores;
  the diagonal block is summed elementwise, one key row at a time.

Normalisation and feature maps are not template parameters: the wrapper
applies the feature maps and appends a ones column to v (the normaliser is
that column of the output), see `pallas_attn.linear`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_attn.kernels import backend
from pallas_attn.schedule.config import LinearAttentionConfig, clamp_block

SUB_BLOCK = 16  # rows of a vector-decay row block (the smallest dot operand)


@dataclasses.dataclass(frozen=True)
class ChunkedSchedule:
  """Static parameters of the chunked kernels (hashable for custom_vjp).

  decay_kind: "none", "scalar" or "vector" (the kernel's view of log_decay).
  out_dtype: dtype name of the output o.
  """
  decay_kind: str
  scale: float
  chunk_size: int
  block_v: int
  num_warps: int
  num_stages: int
  interpret: bool
  out_dtype: str


def heuristic_linear_config(seq_len: int, d_feature: int, d_v: int,
                            decay_kind: str = "scalar"
                            ) -> LinearAttentionConfig:
  """Default tiles for Hopper-class GPUs (padded Dk' and Dv given).

  64-token chunks and 64-wide Dv blocks on 8 warps keep the [Dk, block_v]
  state and the chunk tiles of the dense kinds in registers for Dk <= 128
  (checked with ptxas for sm_90: no or little spilling). The vector kind
  holds more per chunk (gates per feature, row blocks) and uses 32-token
  chunks; so does Dk > 128. Short sequences shrink the chunk to their
  padded length.
  """
  chunk = 64 if d_feature <= 128 and decay_kind != "vector" else 32
  return LinearAttentionConfig(
      chunk_size=clamp_block(chunk, seq_len), block_v=min(64, d_v),
      num_warps=8, num_stages=2)


def chunk_cumulative_log_decay(log_decay, chunk_size: int):
  """Inclusive cumulative sums of `log_decay` ([B, S, H, ...]) within chunks."""
  batch, seq_len = log_decay.shape[:2]
  chunks = log_decay.astype(jnp.float32).reshape(
      batch, seq_len // chunk_size, chunk_size, *log_decay.shape[2:])
  return jnp.cumsum(chunks, axis=2).reshape(log_decay.shape)


def scale_rows(x, log_factor):
  """x * exp(log_factor) in float32 (x unchanged when there is no decay)."""
  if log_factor is None:
    return x
  return x * jnp.exp(log_factor)


def masked_rescale(x, log_factor, mask):
  """x * exp(log_factor) where `mask`, else 0; exp is never taken off-mask."""
  return jnp.where(mask, x * jnp.exp(jnp.where(mask, log_factor, 0.0)), 0.0)


def dense_decay(g_ref, start: int, chunk: int):
  """Decay terms of one chunk for the "none"/"scalar" kinds.

  Returns (D [C, C], log row factor g [C, 1], log factor to the chunk end
  g_last - g [C, 1], log state factor g_last); the last three are None
  without decay. D is the causal mask times exp(g_i - g_j).
  """
  rows = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
  cols = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
  causal = rows >= cols
  if g_ref is None:
    return causal.astype(jnp.float32), None, None, None
  g = g_ref[pl.ds(start, chunk)]
  g_last = g_ref[start + chunk - 1]
  decay = masked_rescale(1.0, g[:, None] - g[None, :], causal)
  return decay, g[:, None], (g_last - g)[:, None], g_last


def diagonal_block(q, g, k_ref, g_ref, start, d_scores=None):
  """Vector-decay scores of a row block against its own keys, elementwise.

  q, g: the block's queries and cumulative log decays [T, Dk] (rows
  start..start+T-1, read from k_ref/g_ref one key row at a time).
  Returns scores [T, T] (sum_d q_id k_jd exp(g_id - g_jd) for i >= j) and,
  given d_scores [T, T] (the cotangent of the scores, unmasked), the
  matching query and key gradients [T, Dk] (else None).
  """
  size, width = q.shape
  rows = lax.broadcasted_iota(jnp.int32, (size, 1), 0)
  cols = lax.broadcasted_iota(jnp.int32, (1, size), 1)
  q = q.astype(jnp.float32)
  with_grads = d_scores is not None

  def key_row(j, carry):
    scores, dq, dk = carry
    k_j = k_ref[start + j, :].astype(jnp.float32)[None, :]
    g_j = g_ref[start + j, :][None, :]
    q_decayed = masked_rescale(q, g - g_j, rows >= j)  # zero above row j
    column = jnp.sum(q_decayed * k_j, axis=1, keepdims=True)
    scores = scores + jnp.where(cols == j, column, 0.0)
    if with_grads:
      d_column = jnp.sum(jnp.where(cols == j, d_scores, 0.0), axis=1,
                         keepdims=True)
      dq = dq + masked_rescale(d_column * k_j, g - g_j, rows >= j)
      dk_j = jnp.sum(d_column * q_decayed, axis=0, keepdims=True)
      dk = dk + jnp.where(rows == j, dk_j, 0.0)
    return scores, dq, dk

  zeros = jnp.zeros((size, width), jnp.float32)
  init = (jnp.zeros((size, size), jnp.float32),
          zeros if with_grads else None, zeros if with_grads else None)
  return lax.fori_loop(0, size, key_row, init)


def _dense_chunk(start, state, q_ref, k_ref, v_ref, g_ref, o_ref, *, chunk,
                 scale, mm):
  """Output rows of one chunk and the state after it ("none"/"scalar")."""
  rows = pl.ds(start, chunk)
  q, k, v = q_ref[rows, :], k_ref[rows, :], v_ref[rows, :]
  dtype = q.dtype
  decay, g, g_to_end, g_last = dense_decay(g_ref, start, chunk)
  scores = mm(q, k, trans_b=True) * decay
  out = (mm(scale_rows(q, g).astype(dtype), state.astype(dtype))
         + mm(scores.astype(dtype), v))
  o_ref[rows, :] = (scale * out).astype(o_ref.dtype)
  carried = state if g_last is None else jnp.exp(g_last) * state
  return carried + mm(scale_rows(k, g_to_end).astype(dtype).T, v)


def _vector_chunk(start, state, q_ref, k_ref, v_ref, g_ref, o_ref, *, chunk,
                  scale, mm):
  """Output rows of one chunk and the state after it ("vector" decay)."""
  full = pl.ds(start, chunk)
  dtype = k_ref.dtype
  state_in = state.astype(dtype)
  key_rows = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
  for block in range(chunk // SUB_BLOCK):
    offset = block * SUB_BLOCK
    rows = pl.ds(start + offset, SUB_BLOCK)
    q_b, g_b = q_ref[rows, :], g_ref[rows, :]
    out = mm(scale_rows(q_b, g_b).astype(dtype), state_in)
    if block:  # keys of earlier blocks, rescaled to the row before (anchor)
      g_anchor = g_ref[start + offset - 1, :][None, :]
      k_earlier = masked_rescale(k_ref[full, :], g_anchor - g_ref[full, :],
                                 key_rows < offset)
      scores = mm(scale_rows(q_b, g_b - g_anchor).astype(dtype),
                  k_earlier.astype(dtype), trans_b=True)
      out += mm(scores.astype(dtype), v_ref[full, :])
    scores, _, _ = diagonal_block(q_b, g_b, k_ref, g_ref, start + offset)
    out += mm(scores.astype(dtype), v_ref[rows, :])
    o_ref[rows, :] = (scale * out).astype(o_ref.dtype)
  g_last = g_ref[start + chunk - 1, :][None, :]
  k_to_end = scale_rows(k_ref[full, :], g_last - g_ref[full, :])
  return (jnp.exp(g_last).T * state
          + mm(k_to_end.astype(dtype).T, v_ref[full, :]))


def _forward_kernel(*refs, schedule: ChunkedSchedule, num_chunks: int,
                    store_states: bool, fp32_exact: bool):
  has_decay = schedule.decay_kind != "none"
  q_ref, k_ref, v_ref, *refs = refs
  g_ref = refs.pop(0) if has_decay else None
  state_ref, o_ref, final_ref, *states_ref = refs
  chunk = schedule.chunk_size
  step = _vector_chunk if schedule.decay_kind == "vector" else _dense_chunk
  step = functools.partial(
      step, q_ref=q_ref, k_ref=k_ref, v_ref=v_ref, g_ref=g_ref, o_ref=o_ref,
      chunk=chunk, scale=schedule.scale,
      mm=functools.partial(backend.dot, fp32_exact=fp32_exact))

  def body(c, state):
    if store_states:
      states_ref[0][c, :, :] = state.astype(states_ref[0].dtype)
    return step(c * chunk, state)

  final_ref[...] = lax.fori_loop(0, num_chunks, body,
                                 state_ref[...].astype(jnp.float32))


def sequence_spec(seq_len: int, width: int, *, column_blocked: bool):
  """Block of one (batch, head) of a [B, S, H, D] array: the program's Dv
  column block (`column_blocked`, for v and o) or all columns (q, k).

  Interpret mode clamps an out-of-range block index, Triton does not: q and
  k must not follow the Dv block index.
  """
  if column_blocked:
    return pl.BlockSpec((None, seq_len, None, width), lambda b, h, j: (b, 0, h, j))
  return pl.BlockSpec((None, seq_len, None, width), lambda b, h, j: (b, 0, h, 0))


def state_spec(d_feature: int, block_v: int):
  """Block of one (batch, head) and one Dv block of a [B, H, Dk, Dv] state."""
  return pl.BlockSpec((None, None, d_feature, block_v),
                      lambda b, h, j: (b, h, 0, j))


def decay_spec(log_decay):
  """Block of the cumulative log decays: [S] (scalar) or [S, Dk] (vector)."""
  seq_len = log_decay.shape[1]
  if log_decay.ndim == 3:
    return pl.BlockSpec((None, seq_len, None), lambda b, h, j: (b, 0, h))
  return pl.BlockSpec((None, seq_len, None, log_decay.shape[3]),
                      lambda b, h, j: (b, 0, h, 0))


def chunk_states_spec(num_chunks: int, d_feature: int, block_v: int):
  """Block of the per-chunk states [B, H, N, Dk, Dv] of one program."""
  return pl.BlockSpec((None, None, num_chunks, d_feature, block_v),
                      lambda b, h, j: (b, h, 0, 0, j))


def chunked_forward(q, k, v, log_decay_cum, initial_state,
                    schedule: ChunkedSchedule, *, store_states: bool):
  """Runs the forward template on padded inputs.

  q, k: [B, S, H, Dk]; v: [B, S, H, Dv]; S a multiple of the chunk, Dk and
  Dv powers of two >= 16 and Dv a multiple of block_v. log_decay_cum: None,
  [B, S, H] or [B, S, H, Dk] float32 chunk-cumulative log decays.
  initial_state: [B, H, Dk, Dv] float32.
  Returns (o [B, S, H, Dv], final state [B, H, Dk, Dv] float32, and with
  `store_states` the state entering each chunk [B, H, S / C, Dk, Dv] in q's
  dtype, for the backward pass; else None).
  """
  batch, seq_len, heads, d_feature = q.shape
  d_v = v.shape[-1]
  block_v = schedule.block_v
  num_chunks = seq_len // schedule.chunk_size
  has_decay = log_decay_cum is not None
  in_specs = [sequence_spec(seq_len, d_feature, column_blocked=False)] * 2 + [
      sequence_spec(seq_len, block_v, column_blocked=True)]
  inputs = [q, k, v]
  if has_decay:
    in_specs.append(decay_spec(log_decay_cum))
    inputs.append(log_decay_cum)
  in_specs.append(state_spec(d_feature, block_v))
  inputs.append(initial_state)
  out_shape = [jax.ShapeDtypeStruct((batch, seq_len, heads, d_v),
                                    jnp.dtype(schedule.out_dtype)),
               jax.ShapeDtypeStruct((batch, heads, d_feature, d_v),
                                    jnp.float32)]
  out_specs = [sequence_spec(seq_len, block_v, column_blocked=True),
               state_spec(d_feature, block_v)]
  if store_states:
    out_shape.append(jax.ShapeDtypeStruct(
        (batch, heads, num_chunks, d_feature, d_v), q.dtype))
    out_specs.append(chunk_states_spec(num_chunks, d_feature, block_v))
  kernel = functools.partial(
      _forward_kernel, schedule=schedule, num_chunks=num_chunks,
      store_states=store_states, fp32_exact=q.dtype == jnp.float32)
  outs = backend.pallas_call(
      kernel, out_shape=out_shape, grid=(batch, heads, d_v // block_v),
      in_specs=in_specs, out_specs=out_specs, num_warps=schedule.num_warps,
      num_stages=schedule.num_stages, interpret=schedule.interpret,
      name=f"linear_attention_fwd_{schedule.decay_kind}")(*inputs)
  return outs[0], outs[1], (outs[2] if store_states else None)
