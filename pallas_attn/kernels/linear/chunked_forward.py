"""Chunk-parallel forward of linear attention: a state pass, an output pass.

The sequence is cut into chunks of C tokens. With `g` the cumulative log
decay *within* a chunk (g_i = sum of the step decays 0..i, precomputed in
the wrapper) and `S` the float32 state [Dk, Dv] entering the chunk:

  S       <- exp(g_last) * S + (k * exp(g_last - g))^T v      (state pass)
  o_chunk  = scale * ((q * exp(g)) S + (scores * decay) v)     (output pass)

Every exponent is a difference `g_i - g_j` with i >= j or `g_i` itself,
hence <= 0: nothing overflows however long the chunk or strong the decay.
`g` is kept in base 2 (scaled by log2(e)), so each factor is one `exp2`
(Triton lowers `exp` to libdevice's `expf`: a range reduction around ex2).

Only the state pass is sequential: one program per (batch, head, Dk block,
Dv block) walks the chunks with a tile of the state in registers (the
update is separable over Dk rows and Dv columns) and stores the state
entering every chunk, one small dot per chunk. The output pass runs one
program per (Dv block, row block, batch, head), all in parallel, from the
stored states; a row block is a whole chunk, or `SUB_BLOCK` rows of one for
the vector kind. The backward (`pallas_attn.vjp`) runs the state pass in
reverse for the state cotangents, then a parallel gradient pass.

The output pass is specialised by the decay kind (a static argument):

* "none" / "scalar" (`g` is [C] per head): the intra-chunk part is one dense
  masked product `(Q K^T * D) V` with `D_ij = exp(g_i - g_j)` for i >= j.
* "vector" (GLA: `g` is [C, Dk]): `exp(g_id - g_jd)` does not factor out of
  the Dk contraction, so queries are processed in row blocks of
  `SUB_BLOCK` tokens, one program each. Keys of earlier blocks are rescaled
  against the last row before the block (both factors <= 1) and go through
  the tensor cores. The block's own keys join them where its decay is mild
  enough for the split factors to stay in range (`split_own_keys`), and
  are summed elementwise, one key row at a time, where it is not.

Normalisation and feature maps are not template parameters: the wrapper
applies the feature maps and appends a ones column to v (the normaliser is
that column of the output), see `pallas_attn.linear`.

`TEMPLATE` is the forward as the scheduler sees it (schedule/template.py):
q/k/v chunks pipelined `num_stages` deep, the state in registers. Its
problem shape has one sequence (seq_q = seq_kv) and d_qk the feature width.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_attn.kernels import backend
from pallas_attn.kernels.online import LOG2E
from pallas_attn.schedule.config import (LinearAttentionConfig, clamp_block, next_power_of_2,
                                         padded_head_dim)
from pallas_attn.schedule.template import (ResourceUse, TileCheck, TritonTemplate,
                                           accumulator_registers, register)

SUB_BLOCK = 16  # rows of a vector-decay row block (the smallest dot operand)
SPLIT_SPAN = 32.0  # base-2 decay span under which a row block's decay splits
# State-pass tiles: at most STATE_TILE elements of the state per program on
# 4 warps (64 float32 registers per thread), as `state_tile` splits them.
STATE_TILE = 64 * 128
STATE_WARPS = 4
# Dk columns per step of the dense output pass's contractions (see
# `_dense_output`): 64 measured 1.1-1.25x faster than whole rows on an H200.
FEATURE_SLICE = 64


@dataclasses.dataclass(frozen=True)
class ChunkedSchedule:
  """Static parameters of the chunked kernels (hashable for custom_vjp).

  decay_kind: "none", "scalar" or "vector" (the kernel's view of log_decay).
  block_v: Dv columns per program of the parallel (output, gradient) passes.
  out_dtype: dtype name of the output o.
  sm_count: the device's multiprocessors (None: unknown), which the state
  pass sizes its pipeline by (`state_pass_stages`).
  lowering, backward_lowering: the forward's and the backward's ("triton":
  these passes and vjp/linear_backward.py's; "mosaic_gpu": the one kernel of
  kernels/linear/mosaic_forward.py, vjp/linear_mosaic_backward.py).
  """
  decay_kind: str
  scale: float
  chunk_size: int
  block_v: int
  num_warps: int
  num_stages: int
  interpret: bool
  out_dtype: str
  sm_count: int | None = None
  lowering: str = "triton"
  backward_lowering: str = "triton"

  @property
  def rows_per_program(self) -> int:
    """Tokens per program of the parallel passes: a whole chunk, or for the
    vector kind one row block (`SUB_BLOCK`), so that the elementwise
    diagonal blocks of a chunk run in parallel programs, not in sequence."""
    return SUB_BLOCK if self.decay_kind == "vector" else self.chunk_size

  @property
  def programs_per_chunk(self) -> int:
    return self.chunk_size // self.rows_per_program


def heuristic_linear_config(seq_len: int, d_feature: int,
                            d_v: int) -> LinearAttentionConfig:
  """Default tiles for Hopper-class GPUs (padded Dk' and Dv given).

  64-token chunks for every kind (as flash-linear-attention): a program
  holds one chunk (or row block) and no carried state, and longer chunks
  mean fewer stored states and a shorter sequential state pass. Dk > 128
  falls back to 32-token chunks (the vector kind's [C, Dk] float32 rescaled
  tiles). Dv blocks of up to 128 columns: each Dv block recomputes the
  intra-chunk scores, so wider is cheaper. 4 warps: an H200 sweep (GLA,
  scalar decay, Mamba2 shapes at S=4k) ran 1.2-1.5x faster than on 8.
  Short sequences shrink the chunk to their padded length.
  """
  chunk = 64 if d_feature <= 128 else 32
  return LinearAttentionConfig(
      chunk_size=clamp_block(chunk, seq_len), block_v=min(128, d_v),
      num_warps=4, num_stages=2)


# Step log decays are clamped to this floor by the prefix pass: exp(-100) is
# below float32's smallest normal number, and a finite floor keeps a hard
# reset (-inf) from turning differences of cumulative decays into inf - inf.
LOG_DECAY_FLOOR = -100.0


def _cumulative_decay_kernel(log_decay_ref, g_ref):
  # Scaled per step, before the sum: rounding stays relative to each step,
  # not to the (large, cancelling) cumulative values.
  steps = jnp.maximum(log_decay_ref[...].astype(jnp.float32), LOG_DECAY_FLOOR)
  g_ref[...] = lax.cumsum(steps * LOG2E, axis=0)


def chunk_cumulative_log_decay(log_decay, chunk_size: int, *,
                               interpret: bool):
  """Inclusive cumulative sums of `log_decay` ([B, S, H] or [B, S, H, Dk],
  any float dtype, clamped to `LOG_DECAY_FLOOR`) within chunks, in base 2
  (the kernels' `g`: a decay factor is exp2 of a difference), as float32.
  The clamp and the cast happen here, not in an XLA pass before: a GLA gate
  is as large as q, and one more pass over it cost about as much as this one.

  Each program reads a [C, Dk] chunk of one head (vector gates) or a [C,
  heads] chunk of up to 128 heads (scalar decays: contiguous rows, not one
  strided column per head) once and writes it once. XLA lowers a cumsum on
  the GPU to a reduce-window, several passes over the data; the jnp
  version is `reference.chunk_cumulative_log_decay`.
  """
  batch, seq_len, heads = log_decay.shape[:3]
  num_chunks = seq_len // chunk_size
  if log_decay.ndim == 4:
    block = pl.BlockSpec((None, chunk_size, None, log_decay.shape[3]),
                         lambda b, c, h: (b, c, h, 0))
    grid, num_warps = (batch, num_chunks, heads), 4
  else:
    head_block = min(heads & -heads, 128)  # the largest power of two dividing H
    block = pl.BlockSpec((None, chunk_size, head_block),
                         lambda b, c, h: (b, c, h))
    grid, num_warps = (batch, num_chunks, heads // head_block), 1
  return backend.pallas_call(
      _cumulative_decay_kernel,
      out_shape=jax.ShapeDtypeStruct(log_decay.shape, jnp.float32),
      grid=grid, in_specs=[block], out_specs=block, num_warps=num_warps,
      num_stages=1, interpret=interpret,
      name="linear_attention_decay_cumsum")(log_decay)


def scale_rows(x, log_factor):
  """x * 2^log_factor in float32 (x unchanged when there is no decay)."""
  if log_factor is None:
    return x
  return x * jnp.exp2(log_factor)


def masked_rescale(x, log_factor, mask):
  """x * 2^log_factor where `mask`, else 0; exp2 is never taken off-mask."""
  return jnp.where(mask, x * jnp.exp2(jnp.where(mask, log_factor, 0.0)), 0.0)


def causal_decay(g, chunk: int):
  """[C, C]: the causal mask times 2^(g_i - g_j) for row log factors g [C, 1]
  (None: no decay)."""
  causal = (lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
            >= lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1))
  if g is None:
    return causal.astype(jnp.float32)
  return masked_rescale(1.0, g - g.T, causal)


def dense_decay(g_ref, chunk: int):
  """Decay terms of one chunk for the "none"/"scalar" kinds.

  Returns (D [C, C], log row factor g [C, 1], log factor to the chunk end
  g_last - g [C, 1]); the last two are None without decay. D is the causal
  mask times exp(g_i - g_j).
  """
  if g_ref is None:
    return causal_decay(None, chunk), None, None
  g = g_ref[...][:, None]
  return causal_decay(g, chunk), g, g_ref[chunk - 1] - g


def split_own_keys(g_ref, offset, g_anchor):
  """SUB_BLOCK (traced) if the row block at `offset` may pair with its own
  keys on the tensor cores, else 0 (they go through `diagonal_block`).

  A dot needs exp(g_i - g_j) split into a query and a key factor around
  one anchor row, and for keys after the anchor the key factor is > 1. The
  split is taken when the block's cumulative decay, from the anchor to its
  last row, spans at most 2^-SPLIT_SPAN in every feature, so both factors
  stay within 2^(+-SPLIT_SPAN): far from overflow and underflow in bfloat16
  or float32. Stronger decays take the exact elementwise path.
  """
  span = jnp.max(g_anchor - g_ref[offset + SUB_BLOCK - 1, :][None, :])
  # (Not jnp.where: Pallas' Triton lowering mistypes a select of scalars.)
  return SUB_BLOCK * (span <= SPLIT_SPAN).astype(jnp.int32)


def keys_to_anchor(k_ref, g_ref, offset, chunk: int):
  """The chunk's keys rescaled to the row before the row block at `offset`
  (its anchor), for that block's queries on the tensor cores.

  Returns (anchor log decay [1, Dk], `split_own_keys`' count, keys [C, Dk]
  in k's dtype): keys of earlier rows, and the block's own where the split
  is taken, times exp(g_anchor - g_j) <= 1; the other rows are zero.
  """
  g_anchor = g_ref[jnp.maximum(offset - 1, 0), :][None, :]
  by_dot = split_own_keys(g_ref, offset, g_anchor)
  key_rows = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
  keys = masked_rescale(k_ref[...], g_anchor - g_ref[...],
                        key_rows < offset + by_dot)
  return g_anchor, by_dot, keys.astype(k_ref.dtype)


def diagonal_block(q, g, k_ref, g_ref, start, num_keys, d_scores=None):
  """Vector-decay scores of a row block against its own keys, elementwise.

  q, g: the block's queries and cumulative log decays [T, Dk] (rows
  start..start+T-1, read from k_ref/g_ref one key row at a time).
  num_keys: how many of the block's keys to pair (0 or T, may be traced:
  0 when `split_own_keys` sent them through the tensor cores).
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
    decay = masked_rescale(1.0, g - g_ref[start + j, :][None, :], rows >= j)
    q_decayed = q * decay  # zero above row j
    column = jnp.sum(q_decayed * k_j, axis=1, keepdims=True)
    scores = scores + jnp.where(cols == j, column, 0.0)
    if with_grads:
      d_column = jnp.sum(jnp.where(cols == j, d_scores, 0.0), axis=1,
                         keepdims=True)
      dq = dq + d_column * k_j * decay
      dk_j = jnp.sum(d_column * q_decayed, axis=0, keepdims=True)
      dk = dk + jnp.where(rows == j, dk_j, 0.0)
    return scores, dq, dk

  zeros = jnp.zeros((size, width), jnp.float32)
  init = (jnp.zeros((size, size), jnp.float32),
          zeros if with_grads else None, zeros if with_grads else None)
  return lax.fori_loop(0, num_keys, key_row, init)


def state_tile(d_feature: int, d_v: int, *,
               whole_rows: bool = False) -> tuple[int, int]:
  """(block_k, block_v) of the state pass: Dv columns first (up to 128),
  then as many Dk rows as fit STATE_TILE; with `whole_rows` (the delta
  rule contracts the state over Dk) all Dk rows and the Dv columns that
  fit beside them (at least 16).

  Whole 128-wide Dv rows read each token's k row (and, for GLA, its decay
  row) once per Dk block instead of once per (Dk, Dv) tile; the pass is
  memory bound, so that pays even at fewer programs (H200, B4 S4k: GLA
  0.24 -> 0.17 ms with 64 x 128 tiles; Mamba2, Dv 64, 0.33 -> 0.29 ms with
  128 x 64 ones, against 64 x 64).
  """
  if whole_rows:
    return d_feature, min(d_v, max(16, STATE_TILE // d_feature))
  block_v = min(d_v, 128)
  return min(d_feature, STATE_TILE // block_v), block_v


def state_pass_stages(num_programs: int, sm_count: int | None) -> int:
  """Pipeline stages of the state pass for a grid of `num_programs`.

  Each program walks its chunks in sequence, so the loads of the next chunk
  must hide under the current one's dot. With at most two programs per SM
  nothing else hides that latency and a third stage pays (H200, B4 H16
  Dk=Dv=128, 64 x 128 tiles, GLA: 0.23 -> 0.17 ms); with more, the extra
  buffer costs resident programs instead (Mamba2 B4 H80: 0.29 -> 0.32 ms).
  """
  return 3 if sm_count and num_programs <= 2 * sm_count else 2


def _state_kernel(*refs, decay_kind: str, chunk: int, num_chunks: int,
                  reverse: bool, factor: float, delta: bool,
                  fp32_exact: bool, out_scale: float | None):
  """Carries one [block_k, block_v] state tile through the chunks.

  With `delta` (the delta rule; all Dk rows in the tile) forwards, y holds
  the pseudo-values U~ and the chunk's values are U~ - W S, S the entering
  state, stored to `values_ref`; given `out_scale` (and the queries after
  W) the chunk's output out_scale (Q 2^g S + P U) too, P its decayed causal
  Q K^T, from the state in registers (an output pass would read every
  stored state again). In reverse the state is dS and the value
  cotangents dU = dU_local + (K 2^(g_last - g)) dS, stored to `values_ref`,
  feed back into it as -W^T dU; dU_local = factor P^T dO (P the chunk's
  decayed causal Q K^T; `local_ref` holds P^T dO for per-feature decays,
  formed here for the others: its two small products sit off the carried
  dS's chain).
  """
  x_ref, y_ref, *refs = refs
  w_ref = refs.pop(0) if delta else None
  queries_ref = refs.pop(0) if out_scale is not None else None
  keys_ref = refs.pop(0) if delta and reverse else None
  local_ref = refs.pop(0) if keys_ref is not None and decay_kind == "vector" else None
  g_ref = refs.pop(0) if decay_kind != "none" else None
  initial_ref, states_ref, final_ref, *values_ref = refs
  mm = functools.partial(backend.dot, fp32_exact=fp32_exact)
  # The carry is S / factor (dS / scale in reverse), so that every product
  # adds straight to it and Triton accumulates in place: a scaled or
  # subtracted product is one more live [block_k, block_v] float32 tile
  # (the reverse delta pass spilled). What leaves the pass is scaled back.
  leaving = lambda x: x if factor == 1.0 else factor * x

  def body(i, state):
    c = num_chunks - 1 - i if reverse else i
    states_ref[c, :, :] = leaving(state).astype(states_ref.dtype)
    start = pl.multiple_of(c * chunk, chunk)
    rows, last = pl.ds(start, chunk), start + chunk - 1
    x, y = x_ref[rows, :], y_ref[rows, :]
    g = g_last = None
    if decay_kind == "vector":  # g [C, block_k]; the state decays per row
      g, g_last = g_ref[rows, :], g_ref[last, :][None, :]
    elif decay_kind == "scalar":
      g, g_last = g_ref[rows][:, None], g_ref[last]
    correction = None
    # The chunk's decayed causal scores of rows a against keys b (no per-feature decay).
    scores = lambda a, b: mm(a, b, trans_b=True) * causal_decay(g, chunk)
    if delta and not reverse:
      y = (y.astype(jnp.float32) - mm(w_ref[rows, :], state.astype(
          w_ref.dtype))).astype(y_ref.dtype)
      values_ref[0][rows, :] = y
      if queries_ref is not None:
        queries = queries_ref[rows, :]
        out = scale_rows(mm(queries, state.astype(queries.dtype)), g) + mm(
            scores(queries, x).astype(y.dtype), y)
        values_ref[1][rows, :] = (out_scale * out).astype(values_ref[1].dtype)
    elif delta:
      raw_keys = keys_ref[rows, :]
      if local_ref is not None:
        local = local_ref[rows, :].astype(jnp.float32)
      else:
        local = mm(scores(x, raw_keys).T.astype(y.dtype), y)
      keys = scale_rows(raw_keys.astype(jnp.float32), None if g is None else g_last - g)
      d_values = mm(keys.astype(x_ref.dtype), state.astype(x_ref.dtype)) + local
      values_ref[0][rows, :] = leaving(d_values).astype(values_ref[0].dtype)
      correction = mm(w_ref[rows, :].T, (-d_values).astype(w_ref.dtype))
    if g is not None:
      state = (jnp.exp2(g_last).T if decay_kind == "vector"
               else jnp.exp2(g_last)) * state
      x = scale_rows(x, g if reverse else g_last - g).astype(x_ref.dtype)
    if correction is not None:
      state = state + correction
    return state + mm(x.T, y)

  final_ref[...] = leaving(lax.fori_loop(
      0, num_chunks, body, initial_ref[...].astype(jnp.float32) / factor))


def state_pass(x, y, log_decay_cum, initial, schedule: ChunkedSchedule, *,
               reverse: bool, pseudo_keys=None, keys=None,
               local_d_values=None, queries=None):
  """The sequential pass over chunks, forwards for S or in reverse for dS.

  Forwards (x = k, y = v): S <- exp(g_last) S + (x * exp(g_last - g))^T y,
  storing the state *entering* each chunk. In reverse (x = q, y = dO, the
  transpose of o = scale * (q * exp(g)) S): dS <- exp(g_last) dS +
  scale * (x * exp(g))^T y from the last chunk down, storing the cotangent
  of the state *leaving* each chunk.

  x: [B, S, H, Dk]; y: [B, S, H, Dv]; log_decay_cum: None, [B, S, H] or
  [B, S, H, Dk] (`chunk_cumulative_log_decay`); initial: [B, H, Dk, Dv]
  float32 (the first state, or dS after the last chunk). Returns (per-chunk
  states [B, H, S / C, Dk, Dv] in x's dtype, the last carry [B, H, Dk, Dv]
  float32).

  pseudo_keys: the delta rule's W [B, S, H, Dk] (forwards only), y its
  pseudo-values U~ (`delta_rule.ut_transform`): each chunk's values are
  then U~ - W S from the state S entering it, and are returned as a third
  output [B, S, H, Dv] in y's dtype. A program then holds all Dk rows of
  its state tile (W S contracts over them). Given `queries` (q; decays
  "none" or "scalar") the chunk outputs follow as a fourth output [B, S, H,
  Dv] in the schedule's out_dtype (the output pass's, formed here). In
  reverse (x = q, y = dO) the delta rule also needs `keys` (k) and, for
  per-feature decays, `local_d_values` (P^T dO, unscaled, P the chunk's
  decayed causal Q K^T; the pass forms it for the others): the stored
  cotangents then include what flows back through U = U~ - W S, and the
  value cotangents dU are returned as a third output [B, S, H, Dv] in y's
  dtype.
  """
  batch, seq_len, heads, d_feature = x.shape
  d_v = y.shape[-1]
  chunk = schedule.chunk_size
  num_chunks = seq_len // chunk
  delta = pseudo_keys is not None
  block_k, block_v = state_tile(d_feature, d_v, whole_rows=delta)
  tile_spec = pl.BlockSpec((None, None, block_k, block_v),
                           lambda b, h, i, j: (b, h, i, j))
  in_specs = [
      pl.BlockSpec((None, seq_len, None, block_k),
                   lambda b, h, i, j: (b, 0, h, i)),
      pl.BlockSpec((None, seq_len, None, block_v),
                   lambda b, h, i, j: (b, 0, h, j))]
  inputs = [x, y]
  if delta:
    whole_rows = pl.BlockSpec((None, seq_len, None, d_feature),
                              lambda b, h, i, j: (b, 0, h, 0))
    in_specs.append(whole_rows)
    inputs.append(pseudo_keys)
  if queries is not None:
    in_specs.append(whole_rows)
    inputs.append(queries)
  if delta and reverse:
    in_specs.append(whole_rows)
    inputs.append(keys)
    if schedule.decay_kind == "vector":
      in_specs.append(in_specs[1])
      inputs.append(local_d_values)
  if log_decay_cum is not None:
    if log_decay_cum.ndim == 3:
      in_specs.append(pl.BlockSpec((None, seq_len, None),
                                   lambda b, h, i, j: (b, 0, h)))
    else:
      in_specs.append(pl.BlockSpec((None, seq_len, None, block_k),
                                   lambda b, h, i, j: (b, 0, h, i)))
    inputs.append(log_decay_cum)
  in_specs.append(tile_spec)
  inputs.append(initial)
  out_shape = [
      jax.ShapeDtypeStruct((batch, heads, num_chunks, d_feature, d_v),
                           x.dtype),
      jax.ShapeDtypeStruct((batch, heads, d_feature, d_v), jnp.float32)]
  out_specs = [pl.BlockSpec((None, None, num_chunks, block_k, block_v),
                            lambda b, h, i, j: (b, h, 0, i, j)),
               tile_spec]
  if delta:
    out_shape.append(jax.ShapeDtypeStruct(y.shape, y.dtype))
    out_specs.append(in_specs[1])
  if queries is not None:
    out_shape.append(jax.ShapeDtypeStruct(y.shape, jnp.dtype(schedule.out_dtype)))
    out_specs.append(in_specs[1])
  kernel = functools.partial(
      _state_kernel, decay_kind=schedule.decay_kind, chunk=chunk,
      num_chunks=num_chunks, reverse=reverse,
      factor=schedule.scale if reverse else 1.0, delta=delta,
      fp32_exact=x.dtype == jnp.float32,
      out_scale=None if queries is None else schedule.scale)
  direction = ("bwd" if reverse else "fwd") + ("_delta" if delta else "")
  grid = (batch, heads, d_feature // block_k, d_v // block_v)
  return backend.pallas_call(
      kernel, out_shape=out_shape, grid=grid,
      in_specs=in_specs, out_specs=out_specs, num_warps=STATE_WARPS,
      num_stages=state_pass_stages(math.prod(grid), schedule.sm_count),
      interpret=schedule.interpret,
      name=f"linear_attention_states_{direction}_{schedule.decay_kind}",
  )(*inputs)


def sequence_spec(rows: int, width: int, *, column_blocked: bool,
                  programs_per_block: int = 1):
  """Block of `rows` tokens of a [B, S, H, D] array in the parallel passes
  (grid: Dv block j, row block i, batch b, head h).

  programs_per_block: how many programs share the block (1 for the
  program's own rows; `programs_per_chunk` for its whole chunk).
  column_blocked: the program's Dv column block (v, o, dO), else all
  columns (q, k). Interpret mode clamps an out-of-range block index, Triton
  does not: q and k must not follow the Dv block index.
  """
  return pl.BlockSpec(
      (None, rows, None, width),
      lambda j, i, b, h: (b, i // programs_per_block, h,
                          j if column_blocked else 0))


def decay_chunk_spec(log_decay_cum, schedule: ChunkedSchedule):
  """Block of one chunk of the cumulative log decays: [C] or [C, Dk]."""
  chunk, shared = schedule.chunk_size, schedule.programs_per_chunk
  if log_decay_cum.ndim == 3:
    return pl.BlockSpec((None, chunk, None),
                        lambda j, i, b, h: (b, i // shared, h))
  return pl.BlockSpec((None, chunk, None, log_decay_cum.shape[3]),
                      lambda j, i, b, h: (b, i // shared, h, 0))


def chunk_inputs(q, k, v, log_decay_cum, schedule: ChunkedSchedule):
  """BlockSpecs and arrays of q, k, v (and the decays), whole chunks, for a
  parallel pass's grid (Dv block, row block, batch, head)."""
  chunk, shared = schedule.chunk_size, schedule.programs_per_chunk
  in_specs = [sequence_spec(chunk, q.shape[-1], column_blocked=False,
                            programs_per_block=shared)] * 2 + [
      sequence_spec(chunk, schedule.block_v, column_blocked=True,
                    programs_per_block=shared)]
  inputs = [q, k, v]
  if log_decay_cum is not None:
    in_specs.append(decay_chunk_spec(log_decay_cum, schedule))
    inputs.append(log_decay_cum)
  return in_specs, inputs


def row_spec(schedule: ChunkedSchedule, width: int, *, column_blocked: bool):
  """Block of a program's own rows (outputs, dO)."""
  return sequence_spec(schedule.rows_per_program, width,
                       column_blocked=column_blocked)


def chunk_state_spec(schedule: ChunkedSchedule, d_feature: int):
  """Block of one chunk's state [Dk, block_v] of [B, H, N, Dk, Dv]."""
  shared = schedule.programs_per_chunk
  return pl.BlockSpec((None, None, None, d_feature, schedule.block_v),
                      lambda j, i, b, h: (b, h, i // shared, 0, j))


def row_block_offset(chunk: int):
  """First row, within its chunk, of this program's row block (vector kind)."""
  block = pl.program_id(1) % (chunk // SUB_BLOCK)
  return pl.multiple_of(block * SUB_BLOCK, SUB_BLOCK)


def _dense_output(q_ref, k_ref, v_ref, g_ref, state_ref, o_ref, *, chunk,
                  scale, mm):
  """Output rows of one chunk ("none"/"scalar" decay).

  Both products that contract over Dk (scores and the state term) walk Dk
  in `FEATURE_SLICE`-wide slices, so that Triton pipelines the slices'
  loads under the dots; the row decay exp(g_i) scales the state term
  after its product (it is per row, so it commutes with the contraction).
  """
  width = q_ref.shape[-1]
  step = min(FEATURE_SLICE, width)

  def feature_slice(i, carry):
    scores, inter = carry
    cols = pl.ds(pl.multiple_of(i * step, step), step)
    q = q_ref[:, cols]
    return (scores + mm(q, k_ref[:, cols], trans_b=True),
            inter + mm(q, state_ref[cols, :]))

  scores, inter = lax.fori_loop(
      0, width // step, feature_slice,
      (jnp.zeros((chunk, chunk), jnp.float32),
       jnp.zeros((chunk, v_ref.shape[-1]), jnp.float32)))
  decay, g, _ = dense_decay(g_ref, chunk)
  out = scale_rows(inter, g) + mm((scores * decay).astype(v_ref.dtype),
                                  v_ref[...])
  o_ref[...] = (scale * out).astype(o_ref.dtype)


def causal_from(offset: int, size: int, chunk: int):
  """[size, chunk] mask: key column <= query row, the queries being chunk
  rows offset..offset+size-1."""
  rows = offset + lax.broadcasted_iota(jnp.int32, (size, chunk), 0)
  return lax.broadcasted_iota(jnp.int32, (size, chunk), 1) <= rows


def _vector_output(q_ref, k_ref, v_ref, g_ref, state_ref, o_ref, *, chunk,
                   scale, mm):
  """Output rows of one row block of a chunk ("vector" decay).

  The block's queries meet the keys of earlier blocks on the tensor cores,
  both sides rescaled to the row before the block (the anchor) so that both
  factors are <= 1; the block's own keys join that dot when
  `split_own_keys` allows, else they are summed elementwise.
  """
  dtype = k_ref.dtype
  offset = row_block_offset(chunk)
  rows = pl.ds(offset, SUB_BLOCK)
  q_b, g_b = q_ref[rows, :], g_ref[rows, :]
  out = mm(scale_rows(q_b, g_b).astype(dtype), state_ref[...])
  g_anchor, by_dot, keys = keys_to_anchor(k_ref, g_ref, offset, chunk)
  scores = mm(scale_rows(q_b, g_b - g_anchor).astype(dtype), keys,
              trans_b=True)
  scores = jnp.where(causal_from(offset, SUB_BLOCK, chunk), scores, 0.0)
  out += mm(scores.astype(dtype), v_ref[...])
  scores, _, _ = diagonal_block(q_b, g_b, k_ref, g_ref, offset,
                                SUB_BLOCK - by_dot)
  out += mm(scores.astype(dtype), v_ref[rows, :])
  o_ref[...] = (scale * out).astype(o_ref.dtype)


def _output_kernel(*refs, schedule: ChunkedSchedule, fp32_exact: bool):
  q_ref, k_ref, v_ref, *refs = refs
  g_ref = refs.pop(0) if schedule.decay_kind != "none" else None
  state_ref, o_ref = refs
  output = (_vector_output if schedule.decay_kind == "vector"
            else _dense_output)
  output(q_ref, k_ref, v_ref, g_ref, state_ref, o_ref,
         chunk=schedule.chunk_size, scale=schedule.scale,
         mm=functools.partial(backend.dot, fp32_exact=fp32_exact))


def cumulative_log_decay(log_decay, schedule: ChunkedSchedule):
  """The kernels' `g` of step log decays (None without decay)."""
  if log_decay is None:
    return None
  return chunk_cumulative_log_decay(log_decay, schedule.chunk_size,
                                    interpret=schedule.interpret)


def output_pass(q, k, v, log_decay_cum, chunk_states,
                schedule: ChunkedSchedule):
  """o [B, S, H, Dv] from q, k, v and the states entering each chunk
  [B, H, S / C, Dk, Dv], all chunks in parallel (shapes as in
  `chunked_forward`)."""
  batch, seq_len, heads, d_feature = q.shape
  d_v = v.shape[-1]
  block_v = schedule.block_v
  in_specs, inputs = chunk_inputs(q, k, v, log_decay_cum, schedule)
  in_specs.append(chunk_state_spec(schedule, d_feature))
  inputs.append(chunk_states)
  kernel = functools.partial(_output_kernel, schedule=schedule,
                             fp32_exact=q.dtype == jnp.float32)
  return backend.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((batch, seq_len, heads, d_v),
                                             jnp.dtype(schedule.out_dtype)),
      grid=(d_v // block_v, seq_len // schedule.rows_per_program, batch,
            heads),
      in_specs=in_specs,
      out_specs=row_spec(schedule, block_v, column_blocked=True),
      num_warps=schedule.num_warps, num_stages=schedule.num_stages,
      interpret=schedule.interpret,
      name=f"linear_attention_fwd_{schedule.decay_kind}")(*inputs)


def chunked_forward(q, k, v, log_decay_cum, initial_state,
                    schedule: ChunkedSchedule):
  """Runs the state pass and the output pass on padded inputs.

  q, k: [B, S, H, Dk]; v: [B, S, H, Dv]; S a multiple of the chunk, Dk and
  Dv powers of two >= 16 and Dv a multiple of block_v. log_decay_cum: None,
  [B, S, H] or [B, S, H, Dk] float32 chunk-cumulative log decays in base 2
  (`chunk_cumulative_log_decay`).
  initial_state: [B, H, Dk, Dv] float32.
  Returns (o [B, S, H, Dv], final state [B, H, Dk, Dv] float32, the state
  entering each chunk [B, H, S / C, Dk, Dv] in q's dtype: the output pass
  reads it, and the backward keeps it as a residual).
  """
  chunk_states, final_state = state_pass(k, v, log_decay_cum, initial_state,
                                         schedule, reverse=False)
  o = output_pass(q, k, v, log_decay_cum, chunk_states, schedule)
  return o, final_state, chunk_states


class LinearTemplate(TritonTemplate):
  """The chunked passes (the forward here, the backward in
  vjp/linear_backward.py): chunks of chunk_size tokens by block_v value
  columns."""
  config_class = LinearAttentionConfig
  chunk_choices = (16, 32, 64, 128)
  block_v_choices = (16, 32, 64, 128)

  def default_config(self, shape, device=None, *, block_sparse=False,
                     scores_per_position=False):
    return heuristic_linear_config(shape.seq_kv, padded_head_dim(shape.d_qk),
                                   padded_head_dim(shape.d_v))

  def tile_checks(self, config, shape, device):
    mma_m, mma_n, mma_k = device.mma_tile
    return [TileCheck("chunk_size", config.chunk_size, max(mma_m, mma_n, mma_k),
                      next_power_of_2(max(shape.seq_q, shape.seq_kv)), "padded seq"),
            TileCheck("block_v", config.block_v, mma_n, padded_head_dim(shape.d_v),
                      "padded d_v")]

  def score_tile(self, config):
    return config.chunk_size, config.chunk_size

  def tile_axes(self, shape, device, default):
    return {"chunk_size": self.chunk_choices, "block_v": self.block_v_choices}


class LinearForwardTemplate(LinearTemplate):
  name = "linear_forward"

  def resource_use(self, config, shape, device):
    d_qk = padded_head_dim(shape.d_qk)
    c, bv = config.chunk_size, config.block_v
    smem = config.num_stages * c * (2 * d_qk + bv) * shape.itemsize
    # The state, the intra-chunk scores and the output chunk.
    return ResourceUse(smem, accumulator_registers(d_qk * bv + c * c + c * bv, config, device))


TEMPLATE = register(LinearForwardTemplate())
