"""The delta rule's chunked forward: the UT transform, then the chunked
template's passes with the delta state update.

Per chunk, with `g` the chunk-cumulative log decays (base 2, as the
template's) and S the state entering it, the delta rule's pseudo-values
U_t = beta_t (v_t - k_t A_t S_{t-1}) solve (I + L) U = beta (V - K2^g S),
L_ij = beta_i sum_d k_id k_jd 2^(g_id - g_jd) for i > j, K2^g = K * 2^g
(`reference.chunked_delta_rule_jnp` derives it). With T = (I + L)^-1:

  W = T (beta K2^g),  U~ = T (beta V),  U = U~ - W S

and the chunk is then ordinary decayed linear attention with values U. So:

1. `ut_transform`, all chunks in parallel (one program per chunk and head):
   for the "none"/"scalar" kinds block forward substitution over
   `UT_BLOCK`-row blocks of L, T and W, U~ (`_blocked_ut_transform`), and
   so for per-feature decays in the Mosaic forward's chunks, their keys
   scaled around one anchor row by XLA; elsewhere per-feature decays take L from
   `per_feature_pairs` (any gate strength), T by
   `triangular.invert_unit_lower` on the whole [C, C], then W and U~ by two
   products.
2. The template's sequential state pass in its delta form
   (`state_pass(..., pseudo_keys=W)`): per chunk U = U~ - W S, stored, and
   S <- 2^g_last S + (K 2^(g_last - g))^T U; without per-feature decays,
   in chunks up to FUSED_OUTPUT_CHUNK, it forms each chunk's output too,
   from the state it holds.
3. Otherwise the template's output pass, with values U.

On Hopper an undifferentiated call runs 2. and 3. as one Mosaic GPU kernel
(`delta_rule_forward_mosaic`): it computes U = U~ - W S per chunk from the
state it carries in registers.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_attn.kernels import backend
from pallas_attn.kernels.linear import mosaic_forward
from pallas_attn.kernels.linear.chunked_forward import (
    SPLIT_SPAN, SUB_BLOCK, ChunkedSchedule, LinearForwardTemplate,
    cumulative_log_decay, diagonal_block, masked_rescale,
    output_pass, scale_rows, state_pass)
from pallas_attn.kernels.linear.triangular import invert_unit_lower
from pallas_attn.schedule.config import (LinearAttentionConfig, clamp_block,
                                         padded_head_dim)
from pallas_attn.schedule.template import register


def strictly_lower(chunk: int):
  """[C, C] mask of i > j: the pairs the delta rule's system couples."""
  return (lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
          > lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1))


# Whether T's merge products are float32-exact for bf16/fp16 inputs too (T is
# rounded to the inputs' dtype before use, so TF32's 10-bit mantissas suffice).
EXACT_MERGES = False


def wy_transform(key_products, beta, *, fp32_exact: bool):
  """T = (I + L)^-1 [C, C] float32, L = beta_i * key_products_ij below the
  diagonal (key_products: the decayed K K^T; beta [C, 1]), in a kernel whose
  inputs are float32 (`fp32_exact`: exact merge products) or narrower."""
  chunk = key_products.shape[0]
  return invert_unit_lower(
      jnp.where(strictly_lower(chunk), beta * key_products, 0.0),
      matmul=functools.partial(backend.dot, fp32_exact=fp32_exact or EXACT_MERGES))


def per_feature_pairs(x, k_ref, g_ref, chunk: int, mm, d_pairs=None):
  """P_ij = sum_d x_id k_jd 2^(g_id - g_jd) for i >= j, else 0 ([C, C]),
  for per-feature decays, and given d_pairs its x and k gradients ([C, D]).

  The decay does not factor out of the sum over d, but around an anchor
  row it splits into a row factor and a key factor: each `SUB_BLOCK`-row
  block meets the keys before it (and its own) on the tensor cores, both
  sides rescaled to the row before the block, as the template's output
  pass does (`split_own_keys`). Where some block's decay spans more than
  2^-SPLIT_SPAN, the own keys' factors could overflow: then the keys
  before each block still go through the dots and the whole chunk is
  paired elementwise instead (`diagonal_block`), one key row at a time.
  """
  x = x.astype(jnp.float32)
  g, k = g_ref[...], k_ref[...].astype(jnp.float32)
  rows = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
  causal = rows >= lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
  blocks = range(0, chunk, SUB_BLOCK)
  anchors = [g_ref[max(start - 1, 0), :][None, :] for start in blocks]
  span = functools.reduce(jnp.maximum, [
      jnp.max(anchor - g_ref[start + SUB_BLOCK - 1, :][None, :])
      for start, anchor in zip(blocks, anchors)])
  split = (span <= SPLIT_SPAN).astype(jnp.int32)
  pairs = jnp.zeros((chunk, chunk), jnp.float32)
  dx = dk = jnp.zeros_like(x) if d_pairs is not None else None
  for start, anchor in zip(blocks, anchors):
    in_block = (rows >= start) & (rows < start + SUB_BLOCK)
    keys_met = rows < start + split * SUB_BLOCK
    x_side = masked_rescale(x, g - anchor, in_block)
    k_side = masked_rescale(k, anchor - g, keys_met)
    pairs += jnp.where(causal, mm(x_side, k_side, trans_b=True), 0.0)
    if d_pairs is not None:
      d_block = jnp.where(causal & in_block, d_pairs, 0.0)
      dx += masked_rescale(mm(d_block, k_side), g - anchor, in_block)
      dk += masked_rescale(mm(d_block.T, x_side), anchor - g, keys_met)
  # Without the split: every pair of the chunk elementwise (the dots above
  # then met only earlier blocks' keys, which the elementwise pass recounts).
  elementwise = diagonal_block(x, g, k_ref, g_ref, 0, (1 - split) * chunk,
                               d_pairs)
  own = split.astype(jnp.float32)
  pairs = own * pairs + elementwise[0]
  if d_pairs is None:
    return pairs, None, None
  return pairs, own * dx + elementwise[1], own * dk + elementwise[2]


def chunk_spec(chunk: int, width: int | None = None):
  """One chunk of one head of a [B, S, H] or [B, S, H, width] array, for a
  grid (chunk, batch, head)."""
  if width is None:
    return pl.BlockSpec((None, chunk, None), lambda c, b, h: (b, c, h))
  return pl.BlockSpec((None, chunk, None, width),
                      lambda c, b, h: (b, c, h, 0))


# Rows per block of the UT transform for the "none"/"scalar" kinds, and its
# warps: one per UT_ROWS_PER_WARP rows of the chunk. On an H200 (B4 S4096
# H16 d128 bf16, kernel ms, none / scalar), 64-token chunks on 2 warps took
# 0.157 / 0.189 (4: 0.259 / 0.295; 1: 0.227 / 0.380; the [C, C] inverse on
# 4: 0.206 / 0.217), 32-token ones with T kept on 1 warp 0.105 / 0.117 (2:
# 0.139 / 0.151; the [C, C] inverse 0.135 / 0.146).
UT_BLOCK = 16
UT_ROWS_PER_WARP = 32


def _ut_transform_kernel(*refs, decay_kind: str, chunk: int,
                         fp32_exact: bool, anchored: bool):
  """W and U~ of one chunk of one head (and its T, given a third output).
  `anchored`: the refs after beta are K 2^(g_m - g) and K 2^g, k's is
  K 2^(g - g_m) (`ut_transform`), and the decay is in them."""
  k_ref, v_ref, beta_ref, *refs = refs
  key_refs = (refs.pop(0), refs.pop(0)) if anchored else None
  g_ref = refs.pop(0) if decay_kind != "none" and not anchored else None
  w_ref, u_ref, *t_ref = refs
  mm = functools.partial(backend.dot, fp32_exact=fp32_exact)
  if decay_kind != "vector" or anchored:
    return _blocked_ut_transform(k_ref, v_ref, beta_ref, g_ref, w_ref, u_ref, t_ref,
                                 chunk=chunk, mm=mm, fp32_exact=fp32_exact,
                                 key_refs=key_refs)
  k, dtype = k_ref[...], k_ref.dtype
  beta = beta_ref[...].astype(jnp.float32)[:, None]
  g = g_ref[...]  # exp(g_id - g_jd) stays inside the sum over d
  products, _, _ = per_feature_pairs(k, k_ref, g_ref, chunk, mm)
  transform = wy_transform(products, beta, fp32_exact=fp32_exact).astype(dtype)
  if t_ref:
    t_ref[0][...] = transform
  keys = beta * scale_rows(k.astype(jnp.float32), g)
  w_ref[...] = mm(transform, keys.astype(dtype)).astype(w_ref.dtype)
  values = beta * v_ref[...].astype(jnp.float32)
  u_ref[...] = mm(transform, values.astype(dtype)).astype(u_ref.dtype)


def _blocked_ut_transform(k_ref, v_ref, beta_ref, g_ref, w_ref, u_ref, t_ref, *,
                          chunk: int, mm, fp32_exact: bool, key_refs=None):
  """The UT transform in `UT_BLOCK`-row blocks of the chunk: block forward
  substitution, T_ii = (I + L_ii)^-1 and T_ij = -T_ii sum_m L_im T_mj
  (j <= m < i), then W_i = sum_j T_ij (beta K 2^g)_j and U~ likewise. Only
  the blocks on and below the diagonal are computed, each from rows of the
  inputs, where a [C, C] inverse spends its products on the whole square.

  key_refs: (L's right factor, W's keys) where they are not k_ref itself:
  per-feature decays split around an anchor row (`ut_transform`)."""
  block = min(UT_BLOCK, chunk)
  count, dtype = chunk // block, k_ref.dtype
  rows = [pl.ds(i * block, block) for i in range(count)]
  merge = functools.partial(backend.dot, fp32_exact=fp32_exact or EXACT_MERGES)
  keys = [k_ref[r, :] for r in rows]
  right, w_keys = ([[ref[r, :] for r in rows] for ref in key_refs] if key_refs
                   else (keys, keys))
  beta = [beta_ref[r].astype(jnp.float32)[:, None] for r in rows]
  g = [None if g_ref is None else g_ref[r] for r in rows]
  own = strictly_lower(block)

  def lower(i, j):  # L_ij = beta_i (K_i K_j^T 2^(g_i - g_j)), strictly lower
    # Anchored factors may overflow in the diagonal block's upper part: selected away.
    products = mm(keys[i], right[j], trans_b=True)
    if g_ref is not None:  # g_i <= g_j off the diagonal block: no overflow
      products = masked_rescale(products, g[i][:, None] - g[j][None, :],
                                own if i == j else True)
    return jnp.where(own, beta[i] * products, 0.0) if i == j else beta[i] * products

  scaled = lambda i, x: beta[i] * (x.astype(jnp.float32) if g_ref is None
                                   else scale_rows(x.astype(jnp.float32), g[i][:, None]))
  transform = {}
  for i in range(count):
    diagonal = invert_unit_lower(lower(i, i), matmul=merge)
    couplings = [lower(i, m) for m in range(i)]
    for j in range(i):
      total = functools.reduce(jnp.add, [merge(couplings[m], transform[m, j])
                                         for m in range(j, i)])
      transform[i, j] = -merge(diagonal, total)
    transform[i, i] = diagonal
    blocks = [transform[i, j].astype(dtype) for j in range(i + 1)]
    w_ref[rows[i], :] = functools.reduce(jnp.add, [
        mm(t, scaled(j, w_keys[j]).astype(dtype)) for j, t in enumerate(blocks)]).astype(w_ref.dtype)
    u_ref[rows[i], :] = functools.reduce(jnp.add, [
        mm(t, (beta[j] * v_ref[rows[j], :].astype(jnp.float32)).astype(dtype))
        for j, t in enumerate(blocks)]).astype(u_ref.dtype)
    if t_ref:
      for j in range(count):
        t_ref[0][rows[i], rows[j]] = (blocks[j] if j <= i else
                                      jnp.zeros((block, block), dtype))


def ut_transform(k, v, beta, log_decay_cum, schedule: ChunkedSchedule, *,
                 keep_transforms: bool = False, anchored_keys=None):
  """(W [B, S, H, Dk] in k's dtype, U~ [B, S, H, Dv] in v's dtype) of every
  chunk, and with `keep_transforms` each chunk's T as rows [B, S, H, C] in
  k's dtype (the precision its products take). k: [B, S, H, Dk]; v: [B, S,
  H, Dv]; beta: [B, S, H]; log_decay_cum: None, [B, S, H] or [B, S, H, Dk]
  (base 2, cumulative).

  anchored_keys: per-feature decays as the Mosaic forward splits them
  (`mosaic_forward.anchored_operands(..., ut_keys=True)`, where
  `gates_in_range` holds): k is then K 2^(g - g_m) and anchored_keys
  (K 2^(g_m - g), K 2^g), so that L = beta (K 2^(g - g_m)) (K 2^(g_m -
  g))^T below the diagonal and W = T (beta K 2^g): the blocked substitution
  of the other kinds, the decay in the operands (log_decay_cum unused)."""
  batch, seq_len, heads, d_feature = k.shape
  chunk = schedule.chunk_size
  rows = functools.partial(chunk_spec, chunk)
  in_specs = [rows(d_feature), rows(v.shape[-1]), rows()]
  inputs = [k, v, beta]
  if anchored_keys is not None:
    in_specs += [rows(d_feature)] * 2
    inputs += list(anchored_keys)
  elif log_decay_cum is not None:
    in_specs.append(rows(d_feature if log_decay_cum.ndim == 4 else None))
    inputs.append(log_decay_cum)
  anchored = anchored_keys is not None
  kernel = functools.partial(
      _ut_transform_kernel, decay_kind=schedule.decay_kind, chunk=chunk,
      fp32_exact=k.dtype == jnp.float32, anchored=anchored)
  out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
  out_specs = [rows(d_feature), rows(v.shape[-1])]
  if keep_transforms:
    out_shape.append(jax.ShapeDtypeStruct((batch, seq_len, heads, chunk), k.dtype))
    out_specs.append(rows(chunk))
  return backend.pallas_call(
      kernel, out_shape=out_shape,
      grid=(seq_len // chunk, batch, heads), in_specs=in_specs,
      out_specs=out_specs,
      num_warps=(schedule.num_warps if schedule.decay_kind == "vector" and not anchored
                 else max(1, chunk // UT_ROWS_PER_WARP)),
      num_stages=1, interpret=schedule.interpret,
      name=f"delta_rule_ut_transform_{schedule.decay_kind}")(*inputs)


# The longest chunk whose outputs the state pass forms itself (else the
# output pass). The in-pass products grow with the chunk while the output
# pass reads one state per chunk: on an H200 (B4 S4096 H16 d128 bf16, f+b
# kernel ms) DeltaNet's 32-token chunks ran 1.359 -> 1.275 with them in the
# pass, Gated DeltaNet's 64-token chunks 1.838 -> 1.942.
FUSED_OUTPUT_CHUNK = 32


def delta_rule_forward(q, k, v, beta, log_decay, initial_state,
                       schedule: ChunkedSchedule, *, keep_transforms: bool = False):
  """The delta rule on padded inputs (as `chunked_forward`; beta [B, S, H],
  log_decay the *step* log decays or None). Returns (o, final state
  [B, H, Dk, Dv] float32, and for the backward the states entering each
  chunk [B, H, S / C, Dk, Dv] in k's dtype, W [B, S, H, Dk], the values
  U [B, S, H, Dv] in v's dtype and, with `keep_transforms`, T [B, S, H, C]
  (else None))."""
  log_decay_cum = cumulative_log_decay(log_decay, schedule)
  pseudo_keys, pseudo_values, *kept = ut_transform(
      k, v, beta, log_decay_cum, schedule, keep_transforms=keep_transforms)
  if schedule.decay_kind == "vector" or schedule.chunk_size > FUSED_OUTPUT_CHUNK:
    chunk_states, final_state, values = state_pass(
        k, pseudo_values, log_decay_cum, initial_state, schedule,
        reverse=False, pseudo_keys=pseudo_keys)
    o = output_pass(q, k, values, log_decay_cum, chunk_states, schedule)
  else:
    chunk_states, final_state, values, o = state_pass(
        k, pseudo_values, log_decay_cum, initial_state, schedule,
        reverse=False, pseudo_keys=pseudo_keys, queries=q)
  return (o, final_state, chunk_states, pseudo_keys, values,
          kept[0] if kept else None)


def delta_rule_forward_mosaic(q, k, v, beta, log_decay, initial_state,
                              schedule: ChunkedSchedule):
  """(o, final state) of the delta rule with the state and output passes as
  one Mosaic GPU kernel (kernels/linear/mosaic_forward.py) after the UT
  transform, in that kernel's 64-token chunks: the sequence is padded to
  them with zero beta and no decay (steps that change nothing). Per-feature
  gates (KDA) past `mosaic_forward.gates_in_range` run `delta_rule_forward`
  at run time. No residuals: a differentiated call runs
  `delta_rule_forward`, whose chunks the backward shares."""
  chunk, seq_len = mosaic_forward.CHUNK, q.shape[1]
  padding = -seq_len % chunk
  pad = lambda x: None if x is None else jnp.pad(
      x, [(0, 0), (0, padding)] + [(0, 0)] * (x.ndim - 2))
  q, k, v, beta, log_decay = map(pad, (q, k, v, beta, log_decay))
  in_chunks = dataclasses.replace(schedule, chunk_size=chunk)
  log_decay_cum = cumulative_log_decay(log_decay, in_chunks)

  def mosaic():
    keys, operands, anchored_keys = k, None, None
    if schedule.decay_kind == "vector":  # one XLA pass forms every scaled operand
      *operands, keys, w_keys = mosaic_forward.anchored_operands(
          q, k, log_decay_cum, ut_keys=True)
      anchored_keys = (operands[3], w_keys)
    pseudo_keys, pseudo_values = ut_transform(keys, v, beta, log_decay_cum, in_chunks,
                                              anchored_keys=anchored_keys)
    o, final_state, _ = mosaic_forward.forward(
        q, k, pseudo_values, log_decay_cum, initial_state, decay_kind=schedule.decay_kind,
        scale=schedule.scale, store_states=False, stages=schedule.num_stages,
        pseudo_keys=pseudo_keys, vector_operands=operands)
    return o, final_state

  triton = lambda: delta_rule_forward(q, k, v, beta, log_decay, initial_state, schedule)[:2]
  o, final_state = mosaic_forward.unless_gates_out_of_range(  # KDA: as for GLA
      schedule.decay_kind, log_decay_cum, mosaic, triton)
  return o[:, :seq_len], final_state


class DeltaRuleTemplate(LinearForwardTemplate):
  """The chunked template with the delta state update: its own heuristic,
  one instance per decay class (their kernels and best chunks differ).

  A chunk's T costs elimination steps over [C, C]; the backward's kernels
  read the whole state per chunk. On an H200 (2026-11-27, B4 S4096 H16 Dk
  = Dv = 128, bf16, forward+backward kernel time, the backward's warps of
  vjp/delta_rule_backward.py): DeltaNet 1.36 ms on 32-token chunks against
  1.41 on 64; Gated DeltaNet 1.78 on 64 (on 32 its transform-gradient
  kernel ran 8-16 ms, at every warp count tried); KDA 3.32 on 16 (32: 3.84
  at best). KDA's per-feature decays pair rows around anchor rows on the
  tensor cores (`per_feature_pairs`), and 64-token chunks ask for more
  shared memory than a Hopper SM has at d 128. An undifferentiated call on
  Hopper runs the Mosaic GPU forward in its own 64-token chunks.
  """

  def __init__(self, name: str, chunk_size: int):
    self.name, self.chunk_size = name, chunk_size

  def default_config(self, shape, device=None, *, block_sparse=False,
                     scores_per_position=False):
    return LinearAttentionConfig(
        chunk_size=clamp_block(self.chunk_size, shape.seq_kv),
        block_v=min(128, padded_head_dim(shape.d_v)), num_warps=4,
        num_stages=2)


# One template per decay kind ("none", "scalar", "vector").
TEMPLATES = {kind: register(DeltaRuleTemplate(name, chunk)) for kind, name, chunk in (
    ("none", "delta_rule_forward", 32),
    ("scalar", "delta_rule_forward_scalar_decay", 64),
    ("vector", "delta_rule_forward_per_feature_decay", 16))}
