"""The parallel (flash-style) backward templates: dq, and dk/dv.

Both passes recompute each visited tile's scores from q and k, the
variant's score_mod and mask_mod (as the forward does) and per-row terms
derived from the forward's row statistics (see `row_terms` in
vjp/attention_vjp.py), so no `[Sq, Skv]` weights are ever stored. With
`dP = dO V^T` on a tile, the rownorm classes differ only in the cotangents
of the tile programs:

* softmax: `P = exp2(u(s) - lse2)` with `u` the log2-domain logit program;
  `du = P * (dP - delta) * ln 2`, `delta = rowsum(dO * O)` (minus the lse
  cotangent). Plain softmax skips the programs: `ds = P * (dP - delta)`.
* elementwise: `W = g(s)`; `dg = dP`.
* normalized: `W = F * g(s)` with the row factor `F`; `dg = F * dP`, and
  each row statistic operand `f_k` gets the row's `dr_k` (for a max
  statistic only at the row's argmax, saved by the forward).

The chain rule through the rownorm programs and score_mod is `jax.vjp` of
the traced programs on the tile, which also gives the cotangents of
captured float arrays. `ds` is the gradient with respect to the scaled score
`q.k * scale`, so `dq = scale * ds K`, `dk = scale * ds^T Q`, `dv = W^T dO`.

* dq: one program per (q block, batch, query head) walks its kv blocks
  (the q-major tile lists). It also accumulates the gradients of captures
  addressed by q alone or by no sequence axis (a partial per row), writes
  the tiles of captures addressed by both q and kv, and scatter-adds the
  tile cotangents of gathered captures into a partial of the gathered axis
  per program (`scatter_add_tile`: a reduction per distinct index in the
  tile, in a fixed order).
* dk/dv: one program per (kv block, batch, kv head) loops over the query
  heads of its GQA group and their q blocks (the kv-major tile lists), so
  dk and dv come out summed over the group. It accumulates the gradients of
  captures addressed by kv alone (a partial per key and query head).

Capture gradients are partials laid out by the grid: the wrapper sums the
axes a capture is not addressed by. Nothing is accumulated atomically, so
the backward is deterministic.

`TEMPLATE` is the backward as the scheduler sees it (schedule/template.py):
one config tiles both kernels, so it must fit the larger of the dk/dv kernel
(resident K/V, pipelined Q/dO) and the dq kernel (the mirror image).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_attn.kernels import backend, tiles
from pallas_attn.kernels.online import LN2, LOG2E, run_tile_program
from pallas_attn.kernels.parallel_forward import (ForwardPlan, TritonParallelTemplate,
                                                   block_mask_specs)
from pallas_attn.schedule.config import AttentionConfig, clamp_block, padded_head_dim
from pallas_attn.schedule.template import ResourceUse, accumulator_registers, register
from pallas_attn.spec.captures import GATHERED

# Where each captured float array's gradient is accumulated, by addressing.
ROW, TILE, KEY, GATHER = "row", "tile", "key", "gather"
# Slots of the gathered axis a tile's scatter-add accumulates in registers at once.
SCATTER_WINDOW = 64


def softmax_lse2(stat):
  """The lse in log2 units, +inf for empty rows (so that their weights are 0)."""
  return jnp.where(jnp.isneginf(stat), jnp.inf, stat * LOG2E)


def gradient_kind(axes) -> str:
  """'gather' (a computed index, dq pass), 'tile' (addressed by q and kv,
  dq pass), 'key' (kv only, dk/dv pass) or 'row' (q only or neither, dq pass)."""
  if GATHERED in axes:
    return GATHER
  if "kv" in axes:
    return TILE if "q" in axes else KEY
  return ROW


def scatter_add_tile(ref, flat, d):
  """`ref[flat[i, j]] += d[i, j]` over a tile, deterministically.

  `ref` is this program's own partial of a flattened gathered axis (a power
  of two long). The tile's positions span `[min(flat), max(flat)]`; each
  window of SCATTER_WINDOW slots is summed slot by slot (one masked tile
  sum per distinct position) into registers and added to `ref` once. The
  cost grows with the span: a relative-position table spans block_q +
  block_k - 1 slots per tile, T5 buckets a few.
  """
  flat = jnp.broadcast_to(flat, d.shape)
  size = ref.shape[-1]
  width = min(SCATTER_WINDOW, size)
  slots = jax.lax.broadcasted_iota(jnp.int32, (width,), 0)
  lo, hi = jnp.min(flat), jnp.max(flat)

  def window(w, carry):
    first = lo + w * width
    base = jnp.minimum(first, size - width)  # the last window shifts back in bounds

    def slot(t, acc):
      return acc + jnp.where(slots == t - base, jnp.sum(jnp.where(flat == t, d, 0.0)), 0.0)

    acc = jax.lax.fori_loop(first, jnp.minimum(first + width, hi + 1), slot,
                            jnp.zeros((width,), jnp.float32))
    ref[pl.ds(base, width)] = ref[pl.ds(base, width)] + acc
    return carry

  jax.lax.fori_loop(0, (hi - lo) // width + 1, window, 0)


def zero_fill(ref, chunk: int = 1024):
  """Zeros a 1-D ref (a power of two long) in chunks that fit in registers."""
  width = min(chunk, ref.shape[-1])

  def fill(c, carry):
    ref[pl.ds(pl.multiple_of(c * width, width), width)] = jnp.zeros((width,), ref.dtype)
    return carry

  jax.lax.fori_loop(0, ref.shape[-1] // width, fill, 0)


def heuristic_backward_config(seq_q: int, seq_kv: int, d_qk: int, d_v: int,
                              itemsize: int = 2) -> AttentionConfig:
  """Default backward tiles for Hopper-class GPUs (Triton).

  Both passes use one tile shape: the dq pass runs block_q query rows per
  program over kv steps of block_k; the dk/dv pass block_k keys per program
  over q steps of block_q. For d=128, 64x64 tiles on 4 warps, 2 stages ran
  fwd+bwd at 318 / 380 TFLOP/s (S 4k / 16k, H200, bf16) against 184 / 201
  with 64x128 on 8 warps (benchmarks/results/2026-11-21_h200/sweep_order_backward.json).
  Wider heads (where the Mosaic backward does not run yet): 64x32 on 4 warps
  ran d=256 at 289 TFLOP/s and Dqk 192 / Dv 128 at 250, against 87 / 158
  with 32x64 (H100, benchmarks/results/2026-11-23_h100/sweep_backward_wide.json).
  float32 inputs take 32x32 tiles, as the forward's (`heuristic_config`):
  64x64 asked for 256 KiB of shared memory at d 128 with TF32x3 products.
  Wider float32 heads take 16x32: Dqk 192 / Dv 128 causal ALiBi, B4 H16
  S4096, forward+backward on an H200 ran 122 ms and compiled in 4.3 s,
  against 809 ms and 9.2 s on 32x32 (32x16: 886 ms, 8.0 s; one stage
  changed neither).
  """
  if itemsize > 2:
    wide = max(padded_head_dim(d_qk), padded_head_dim(d_v)) > 128
    cfg = AttentionConfig(block_q=16 if wide else 32, block_k=32, num_warps=4, num_stages=2)
  elif max(d_qk, d_v) <= 128:
    cfg = AttentionConfig(block_q=64, block_k=64, num_warps=4, num_stages=2)
  else:
    cfg = AttentionConfig(block_q=64, block_k=32, num_warps=4, num_stages=2)
  return dataclasses.replace(cfg, block_q=clamp_block(cfg.block_q, seq_q),
                             block_k=clamp_block(cfg.block_k, seq_kv))


@dataclasses.dataclass(frozen=True)
class BackwardPlan(ForwardPlan):
  """Static parameters of the backward kernels (blocks are the backward's)."""
  num_q_blocks: int     # q blocks holding queries: ceil(seq_q / block_q)
  grad_kinds: tuple     # per score_mod capture use: ROW | TILE | KEY | None

  @property
  def num_row_terms(self) -> int:
    rownorm = self.analysis.rownorm
    if rownorm.kind == "softmax":
      return 2  # lse2, delta
    if rownorm.kind == "elementwise":
      return 0
    num_max = sum(st.reducer == "max" for st in rownorm.stats)
    return 1 + len(rownorm.stats) + num_max  # factor, dr_k..., argmaxes...

  @property
  def folds_separable_bias(self) -> bool:
    """Plain softmax of `score + R + C` (a separable bias): each row term's
    vector takes the bias's part along its own axis and the tile adds only
    the other part, in the exp2's multiply-add (the Mosaic GPU kernels)."""
    return (self.analysis.separable_bias and self.scale > 0
            and self.online.logits_are_scores())

  @property
  def score_scale(self) -> float:
    """What `q.k` is multiplied by: the softmax scale, times log2(e) when
    the scores go to the log2 domain."""
    return self.scale * LOG2E if self.folds_log2 else self.scale

  def uses_of(self, kind: str) -> tuple:
    return tuple(n for n, k in enumerate(self.grad_kinds) if k == kind)

  @property
  def kv_tile(self) -> tiles.TileContext:
    """Tiles seen from the dk/dv grid: kv blocked, the group's heads per program."""
    return tiles.TileContext(self.analysis, self.operands, blocked="kv", head_block=self.group,
                             fast_math=self.fast_math)


def _where(keep, x):
  return x if keep is None else jnp.where(keep, x, 0.0)


def softmax_weights(logits2, lse2, keep):
  """P of a plain-softmax tile from its log2-domain logits and lse2 (0
  where `keep` is False)."""
  return _where(keep, jnp.exp2(logits2 - lse2))


def softmax_tile_gradients(logits2, dp, rows, keep):
  """(P, dS) of a plain-softmax tile from its log2-domain logits and the row
  terms (lse2, delta): dS = P (dP - delta), the gradient with respect to
  the scaled score."""
  lse2, delta = rows
  p = softmax_weights(logits2, lse2, keep)
  return p, p * (dp - delta)


def tile_gradients(plan: BackwardPlan, tile: tiles.TileContext, s, dp, rows, keep, position,
                   cap_refs, window, grad_uses, lower=lambda f: f()):
  """Gradients on one tile, `[block_q, block_k]` (or its transpose: the
  algebra is elementwise).

  s: the scaled score (log2 domain when `plan.folds_log2`); dp: `dO V^T`;
  rows: the row terms, broadcastable to the tile; position: (b, h, q_idx,
  kv_idx); window: where captures are read along the unblocked axis;
  lower: how the differentiated tile programs are evaluated (`lower(f)`
  calls the thunk `f`; a lowering may rewrite what autodiff binds).
  Returns (W, the weights that multiply V; ds, the gradient with respect
  to the scaled score; the cotangent tiles of the `grad_uses` captures;
  their flat positions, for gathers). All are zero where `keep` is False.
  """
  if plan.folds_log2:
    return (*softmax_tile_gradients(s, dp, rows, keep), (), ())
  b, h, q_idx, kv_idx = position
  rownorm = plan.analysis.rownorm
  online = plan.online
  captures, flats = tile.score_captures(s, b, h, q_idx, kv_idx, cap_refs, *window)

  def programs(s, *diff_captures):
    values = list(captures)
    for use, x in zip(grad_uses, diff_captures):
      values[use] = x
    score = tile.score_with(s, b, h, q_idx, kv_idx, tuple(values), differentiable=True)
    return (online.weights(score, differentiable=True),
            *(run_tile_program(st.operand, score, plan.fast_math, differentiable=True)
              for st in rownorm.stats))

  def differentiate():
    # Captures enter at full tile shape so that each position's cotangent
    # can be masked before it is summed.
    diff = tuple(jnp.broadcast_to(captures[u], s.shape) for u in grad_uses)
    outs, pullback = jax.vjp(programs, s, *diff)
    if rownorm.kind == "softmax":
      lse2, delta = rows
      weights = _where(keep, jnp.exp2(outs[0] - lse2))
      cotangents = (weights * (dp - delta) * LN2,)
    elif rownorm.kind == "elementwise":
      weights = _where(keep, outs[0])
      cotangents = (_where(keep, dp),)
    else:
      factor, *rest = rows
      num_stats = len(rownorm.stats)
      d_stats, argmaxes = rest[:num_stats], iter(rest[num_stats:])
      weights = factor * _where(keep, outs[0])
      cotangents = [_where(keep, factor * dp)]
      for st, d in zip(rownorm.stats, d_stats):
        at = keep
        if st.reducer == "max":
          at_max = kv_idx.astype(jnp.float32) == next(argmaxes)
          at = at_max if keep is None else jnp.logical_and(keep, at_max)
        cotangents.append(_where(at, jnp.broadcast_to(d, s.shape)))
    ds, *d_captures = pullback(tuple(c.astype(o.dtype) for c, o in zip(cotangents, outs)))
    return (weights, _where(keep, ds.astype(jnp.float32)),
            tuple(_where(keep, d.astype(jnp.float32)) for d in d_captures))

  weights, ds, d_captures = lower(differentiate)
  return weights, ds, d_captures, tuple(flats[u] for u in grad_uses)


def split_inputs(plan: BackwardPlan, refs, num_row_refs: int = 1):
  """(row-term refs, capture refs, block mask refs, remaining refs) of a
  backward kernel's inputs after q, k, v, dO; row-term and block mask refs
  are empty where the plan has none."""
  num_rows = num_row_refs if plan.num_row_terms else 0
  row_refs, refs = refs[:num_rows], refs[num_rows:]
  n_caps = len(plan.operands)
  cap_refs, refs = refs[:n_caps], refs[n_caps:]
  n_lists = 4 if plan.block_sparse else 0
  return row_refs, cap_refs, refs[:n_lists], refs[n_lists:]


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, *refs, plan: BackwardPlan):
  row_refs, cap_refs, list_refs, out_refs = split_inputs(plan, refs)
  rows_ref = row_refs[0] if row_refs else None
  row_uses, tile_uses, gather_uses = plan.uses_of(ROW), plan.uses_of(TILE), plan.uses_of(GATHER)
  dq_ref, *grad_refs = out_refs
  row_grad_refs = grad_refs[:len(row_uses)]
  tile_grad_refs = grad_refs[len(row_uses):len(row_uses) + len(tile_uses)]
  gather_grad_refs = grad_refs[len(row_uses) + len(tile_uses):]
  for ref in gather_grad_refs:
    zero_fill(ref)
  qi = tiles.program_block()
  b, h = pl.program_id(1), pl.program_id(2)
  bq, bk = plan.block_q, plan.block_k
  tile = dataclasses.replace(plan.tile, block=(qi * bq, bq))
  q, do = q_ref[...], do_ref[...]
  rows = tuple(rows_ref[t, :][:, None] for t in range(plan.num_row_terms))
  q_idx = tiles.tile_indices(qi * bq, bq, axis=0)
  score_scale = plan.score_scale

  def visit(kv_block, carry, masked: bool):
    dq, row_grads = carry
    kv_start = pl.multiple_of(kv_block * bk, bk)
    k = k_ref[pl.ds(kv_start, bk), :]
    v = v_ref[pl.ds(kv_start, bk), :]
    s = backend.dot(q, k, trans_b=True, fp32_exact=plan.fp32_exact) * score_scale
    dp = backend.dot(do, v, trans_b=True, fp32_exact=plan.fp32_exact)
    kv_idx = tiles.tile_indices(kv_start, bk, axis=1)
    keep = plan.tile_keep(tile, masked, b, h, q_idx, kv_idx, cap_refs, kv_start, bk)
    _, ds, d_captures, flats = tile_gradients(
        plan, tile, s, dp, rows, keep, (b, h, q_idx, kv_idx), cap_refs, (kv_start, bk),
        row_uses + tile_uses + gather_uses)
    dq = dq + backend.dot(ds.astype(k.dtype), k, fp32_exact=plan.fp32_exact)
    row_grads = tuple(acc + jnp.sum(d, axis=1) for acc, d in zip(row_grads, d_captures))
    num_dense = len(row_uses) + len(tile_uses)
    for ref, d in zip(tile_grad_refs, d_captures[len(row_uses):num_dense]):
      ref[:, pl.ds(kv_start, bk)] = d
    for ref, d, flat in zip(gather_grad_refs, d_captures[num_dense:], flats[num_dense:]):
      scatter_add_tile(ref, flat, d)
    return dq, row_grads

  lists = None
  if plan.block_sparse:
    partial_num, partial_idx, full_num, full_idx = list_refs
    lists = (partial_num[0], lambda j: partial_idx[j], full_num[0], lambda j: full_idx[j])
  init = (jnp.zeros(q.shape, jnp.float32),
          tuple(jnp.zeros((bq,), jnp.float32) for _ in row_uses))
  num_plain = 0 if plan.analysis.mask_mod is not None else plan.seq_kv // bk
  dq, row_grads = tiles.visit_blocks(visit, init, lists=lists, num_plain=num_plain,
                                     num_blocks=plan.num_kv_blocks)
  dq_ref[...] = (dq * plan.scale).astype(dq_ref.dtype)
  for ref, grad in zip(row_grad_refs, row_grads):
    ref[...] = grad


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, *refs, plan: BackwardPlan):
  row_refs, cap_refs, list_refs, out_refs = split_inputs(plan, refs)
  rows_ref = row_refs[0] if row_refs else None
  key_uses = plan.uses_of(KEY)
  dk_ref, dv_ref, *key_grad_refs = out_refs
  ki, b, kv_head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  bq, bk = plan.block_q, plan.block_k
  k, v = k_ref[...], v_ref[...]
  kv_start = ki * bk
  tile = dataclasses.replace(plan.kv_tile, block=(kv_start, bk))
  kv_idx = tiles.tile_indices(kv_start, bk, axis=1)
  score_scale = plan.score_scale
  # Padded query rows have dO = 0; outside plain softmax their scores could
  # still make non-finite derivatives, so they are masked.
  mask_rows = not plan.folds_log2 and plan.seq_q % bq != 0
  per_head_lists = plan.block_sparse and list_refs[0].shape[0] > 1

  def head(g, carry):
    h = kv_head * plan.group + g

    def visit(q_block, carry, masked: bool):
      dk, dv, key_grads = carry
      q_start = pl.multiple_of(q_block * bq, bq)
      q = q_ref[pl.ds(q_start, bq), g, :]
      do = do_ref[pl.ds(q_start, bq), g, :]
      rows = tuple(rows_ref[g, t, pl.ds(q_start, bq)][:, None]
                   for t in range(plan.num_row_terms))
      s = backend.dot(q, k, trans_b=True, fp32_exact=plan.fp32_exact) * score_scale
      dp = backend.dot(do, v, trans_b=True, fp32_exact=plan.fp32_exact)
      q_idx = tiles.tile_indices(q_start, bq, axis=0)
      keep = plan.tile_keep(tile, masked, b, h, q_idx, kv_idx, cap_refs, q_start, bq)
      if mask_rows:
        valid = q_idx < plan.seq_q
        keep = valid if keep is None else jnp.logical_and(keep, valid)
      weights, ds, d_captures, _ = tile_gradients(
          plan, tile, s, dp, rows, keep, (b, h, q_idx, kv_idx), cap_refs, (q_start, bq),
          key_uses)
      dv = dv + backend.dot(weights.astype(do.dtype).T, do, fp32_exact=plan.fp32_exact)
      dk = dk + backend.dot(ds.astype(q.dtype).T, q, fp32_exact=plan.fp32_exact)
      key_grads = tuple(acc + jnp.sum(d, axis=0) for acc, d in zip(key_grads, d_captures))
      return dk, dv, key_grads

    lists = None
    if plan.block_sparse:
      partial_num, partial_idx, full_num, full_idx = list_refs
      m = g if per_head_lists else 0
      lists = (partial_num[m, 0], lambda j: partial_idx[m, j],
               full_num[m, 0], lambda j: full_idx[m, j])
    init = (*carry, tuple(jnp.zeros((bk,), jnp.float32) for _ in key_uses))
    num_plain = 0 if plan.analysis.mask_mod is not None else plan.num_q_blocks
    dk, dv, key_grads = tiles.visit_blocks(visit, init, lists=lists, num_plain=num_plain,
                                           num_blocks=plan.num_q_blocks)
    for ref, grad in zip(key_grad_refs, key_grads):
      ref[g, :] = grad
    return dk, dv

  init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  if plan.group == 1:
    dk, dv = head(0, init)
  else:
    dk, dv = jax.lax.fori_loop(0, plan.group, head, init)
  dk_ref[...] = (dk * plan.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def backward(q, k, v, d_out, rows, capture_arrays, block_mask, *, plan: BackwardPlan,
             config: AttentionConfig, interpret: bool):
  """Runs the dq and dk/dv kernels on padded inputs.

  q, k, v as for the forward; d_out `[B, Sq_pad, Hq, Dv_pad]`; rows: the
  row terms `[B, Hq, T, Sq_pad]` float32 (None when T = 0); block_mask: a
  BlockMask with the plan's blocks, or None. Returns (dq, dk, dv, capture
  partials, rows): rows as given; the partials, in `plan.grad_kinds` order
  of their uses, are `[B, Hq, Sq_pad]` (ROW), `[B, Hq, Sq_pad, Skv_pad]`
  (TILE, only visited tiles written), `[B, Hq, Skv_pad]` (KEY) and `[B, Hq,
  nq, T]` (GATHER, per q block, T the operand's flattened gathered axis)
  float32.
  """
  batch, seq_q_pad, heads, d_qk = q.shape
  seq_kv_pad, kv_heads, d_v = k.shape[1], k.shape[2], v.shape[-1]
  bq, bk, group = plan.block_q, plan.block_k, plan.group
  grad_shape = {
      ROW: (batch, heads, seq_q_pad),
      TILE: (batch, heads, seq_q_pad, seq_kv_pad),
      KEY: (batch, heads, seq_kv_pad),
  }
  row_inputs = () if rows is None else (rows,)
  launch = functools.partial(backend.pallas_call, num_warps=config.num_warps,
                             num_stages=config.num_stages, interpret=interpret)

  num_q_blocks = seq_q_pad // bq
  dq_in_specs = [
      pl.BlockSpec((None, bq, None, d_qk), lambda i, b, h: (b, i, h, 0)),
      pl.BlockSpec((None, seq_kv_pad, None, d_qk), lambda i, b, h: (b, 0, h // group, 0)),
      pl.BlockSpec((None, seq_kv_pad, None, d_v), lambda i, b, h: (b, 0, h // group, 0)),
      pl.BlockSpec((None, bq, None, d_v), lambda i, b, h: (b, i, h, 0)),
  ]
  if rows is not None:
    dq_in_specs.append(pl.BlockSpec((None, None, rows.shape[2], bq), lambda i, b, h: (b, h, 0, i)))
  dq_in_specs += [tiles.capture_block_spec(op, x.shape, blocked="q", block=bq)
                  for op, x in zip(plan.operands, capture_arrays)]
  q_lists = () if block_mask is None else block_mask.q_major(num_q_blocks)
  dq_in_specs += block_mask_specs(q_lists)
  dq_uses = plan.uses_of(ROW) + plan.uses_of(TILE) + plan.uses_of(GATHER)
  dq_out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  dq_out_specs = [pl.BlockSpec((None, bq, None, d_qk), lambda i, b, h: (b, i, h, 0))]
  for use in dq_uses:
    kind = plan.grad_kinds[use]
    if kind == GATHER:
      size = capture_arrays[use].shape[-1]
      dq_out_shape.append(jax.ShapeDtypeStruct((batch, heads, num_q_blocks, size), jnp.float32))
      dq_out_specs.append(pl.BlockSpec((None, None, None, size), lambda i, b, h: (b, h, i, 0)))
      continue
    dq_out_shape.append(jax.ShapeDtypeStruct(grad_shape[kind], jnp.float32))
    dq_out_specs.append(
        pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)) if kind == ROW else
        pl.BlockSpec((None, None, bq, seq_kv_pad), lambda i, b, h: (b, h, i, 0)))
  dq, *dq_grads = launch(
      functools.partial(_dq_kernel, plan=plan), out_shape=dq_out_shape,
      grid=(num_q_blocks, batch, heads),
      in_specs=tiles.heaviest_first(dq_in_specs, num_q_blocks),
      out_specs=tiles.heaviest_first(dq_out_specs, num_q_blocks),
      name="pallas_attn_backward_dq",
  )(q, k, v, d_out, *row_inputs, *capture_arrays, *q_lists)

  dkv_in_specs = [
      pl.BlockSpec((None, seq_q_pad, group, d_qk), lambda i, b, h: (b, 0, h, 0)),
      pl.BlockSpec((None, bk, None, d_qk), lambda i, b, h: (b, i, h, 0)),
      pl.BlockSpec((None, bk, None, d_v), lambda i, b, h: (b, i, h, 0)),
      pl.BlockSpec((None, seq_q_pad, group, d_v), lambda i, b, h: (b, 0, h, 0)),
  ]
  if rows is not None:
    dkv_in_specs.append(pl.BlockSpec((None, group, rows.shape[2], seq_q_pad),
                                     lambda i, b, h: (b, h, 0, 0)))
  dkv_in_specs += [tiles.capture_block_spec(op, x.shape, blocked="kv", block=bk, head_block=group)
                   for op, x in zip(plan.operands, capture_arrays)]
  kv_lists = () if block_mask is None else block_mask.kv_major(seq_kv_pad // bk)
  dkv_in_specs += block_mask_specs(kv_lists, group)
  key_uses = plan.uses_of(KEY)
  dkv_out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
  dkv_out_shape += [jax.ShapeDtypeStruct(grad_shape[KEY], jnp.float32) for _ in key_uses]
  dkv_out_specs = [
      pl.BlockSpec((None, bk, None, d_qk), lambda i, b, h: (b, i, h, 0)),
      pl.BlockSpec((None, bk, None, d_v), lambda i, b, h: (b, i, h, 0)),
  ]
  dkv_out_specs += [pl.BlockSpec((None, group, bk), lambda i, b, h: (b, h, i)) for _ in key_uses]
  dk, dv, *key_grads = launch(
      functools.partial(_dkv_kernel, plan=plan), out_shape=dkv_out_shape,
      grid=(seq_kv_pad // bk, batch, kv_heads), in_specs=dkv_in_specs, out_specs=dkv_out_specs,
      name="pallas_attn_backward_dkv",
  )(q, k, v, d_out, *row_inputs, *capture_arrays, *kv_lists)

  by_use = dict(zip(dq_uses, dq_grads)) | dict(zip(key_uses, key_grads))
  return dq, dk, dv, tuple(by_use.get(n) for n in range(len(plan.grad_kinds))), rows


class BackwardTemplate(TritonParallelTemplate):
  name = "backward"

  def default_config(self, shape, device=None, *, block_sparse=False,
                     scores_per_position=False):
    return heuristic_backward_config(shape.seq_q, shape.seq_kv, shape.d_qk, shape.d_v,
                                     shape.itemsize)

  def resource_use(self, config, shape, device):
    d_qk, d_v = padded_head_dim(shape.d_qk), padded_head_dim(shape.d_v)
    bq, bk, stages = config.block_q, config.block_k, config.num_stages
    dkv_kernel = (bk * (d_qk + d_v) + stages * bq * (d_qk + d_v)) * shape.itemsize
    dq_kernel = (bq * (d_qk + d_v) + stages * bk * (d_qk + d_v)) * shape.itemsize
    # dK/dV accumulators (or dQ) plus the score and dP tiles.
    fp32 = max(bk * (d_qk + d_v), bq * d_qk) + 2 * bq * bk
    return ResourceUse(max(dkv_kernel, dq_kernel), accumulator_registers(fp32, config, device))


TEMPLATE = register(BackwardTemplate())
