"""The `jax.custom_vjp` of fused attention: forward kernel, saved statistics, backward kernels.

`attention_core` runs on q, k, v padded by api.py and takes the arrays that
score_mod and mask_mod close over as explicit arguments (the
`jax.closure_convert` pattern), so their cotangents reach the user's
arrays, tracers of an outer jit or grad included.

Saved for the backward: q, k, v, the captured arrays, the block mask, the
output and the row statistics: the lse for softmax, the raw row sums/maxes
for normalized rownorms, nothing for elementwise ones. `row_terms` turns
them into the per-row inputs of the backward kernels (see
vjp/parallel_backward.py); the normalized class differentiates its row
factor h(stats) here, with `jax.vjp` on `[B, H, Sq]` arrays.

Sink logits (softmax with an extra denominator term per head) act as one
more key of value 0: the forward starts each row's state at it, the lse
includes it, and its gradient is `-sum_rows exp(sink - lse) * delta`, an
XLA reduction over the saved row statistics.

Captured float arrays get gradients only when they are differentiated
(`symbolic_zeros` tells which); the kernels write partials laid out by their
grids and `_capture_gradient` sums them over the axes the array is not
addressed by. Integer and boolean captures, and mask_mod's, get none.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_attn.distributed import sharded_passes
from pallas_attn.kernels import lowering, parallel_forward, tiles
from pallas_attn.kernels.online import run_row_program
from pallas_attn.schedule.config import AttentionConfig
from pallas_attn.spec.analysis import VariantAnalysis
from pallas_attn.spec.rownorm import RowNorm
from pallas_attn.vjp import parallel_backward
from pallas_attn.vjp.parallel_backward import GATHER, KEY, ROW, TILE, softmax_lse2


@dataclasses.dataclass(frozen=True)
class CoreSpec:
  """Static description of one attention call (inputs padded by the caller)."""
  analysis: VariantAnalysis
  scale: float
  seq_q: int            # true lengths
  seq_kv: int
  group: int            # query heads per kv head
  fp32_exact: bool
  config: AttentionConfig
  bwd_config: AttentionConfig
  interpret: bool
  forward_lowering: str = lowering.TRITON  # kernels/lowering.py
  backward_lowering: str = lowering.TRITON


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _plan_fields(spec: CoreSpec, config: AttentionConfig, operands, block_sparse: bool,
                 has_sink: bool) -> dict:
  return dict(analysis=spec.analysis, operands=operands, scale=spec.scale, seq_q=spec.seq_q,
              seq_kv=spec.seq_kv, block_q=config.block_q, block_k=config.block_k,
              num_kv_blocks=_cdiv(spec.seq_kv, config.block_k), group=spec.group,
              fp32_exact=spec.fp32_exact, block_sparse=block_sparse,
              fast_math=not (spec.fp32_exact or spec.interpret), has_sink=has_sink)


def _forward(spec: CoreSpec, q, k, v, consts, block_mask, sinks, descales=None):
  # Mosaic GPU reads a term from its vector (mosaic_backend.diagonal_tile); Triton from banks.
  mosaic = spec.forward_lowering == lowering.MOSAIC_GPU
  capture_arrays, operands = tiles.capture_operands(
      spec.analysis, q.shape[1], k.shape[1], consts, heads=q.shape[2],
      bank_width=None if mosaic else spec.config.block_k)
  plan = parallel_forward.ForwardPlan(
      **_plan_fields(spec, spec.config, operands, block_mask is not None, sinks is not None))
  lists = () if block_mask is None else block_mask.q_major(-(-q.shape[1] // spec.config.block_q))
  fp8 = {} if descales is None else {"descales": descales}  # the Mosaic forward's
  if mosaic:
    from pallas_attn.kernels import mosaic_forward
    template = mosaic_forward
  else:
    template = parallel_forward
  return template.forward(q, k, v, capture_arrays, sinks, lists, plan=plan,
                          config=spec.config, interpret=spec.interpret, **fp8)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["q", "k", "v", "consts", "block_mask", "sinks", "out", "stat", "row_stats",
                 "delta"],
    meta_fields=["differentiated"])
@dataclasses.dataclass(frozen=True)
class _Residuals:
  q: jax.Array
  k: jax.Array
  v: jax.Array
  consts: tuple          # (score_mod's captured arrays, mask_mod's)
  block_mask: object     # the backward's BlockMask or None
  sinks: jax.Array | None  # [Hq] sink logits
  out: jax.Array | None  # None where `delta` is given
  stat: jax.Array
  row_stats: jax.Array | None
  differentiated: tuple  # per score_mod capture: whether it needs a gradient
  delta: jax.Array | None = None  # softmax's rowsum(dO * O) - d_stat, where given


def attention_core(q, k, v, consts, block_masks, sinks, *, spec: CoreSpec):
  """Differentiable attention on padded inputs.

  q `[B, Sq_pad, Hq, Dqk_pad]`, k `[B, Skv_pad, Hkv, Dqk_pad]`, v
  `[B, Skv_pad, Hkv, Dv_pad]`, sequence lengths padded to multiples of the
  blocks of both passes; consts: (score_mod's captured arrays, mask_mod's);
  block_masks: (forward, backward) BlockMasks with the blocks of each
  pass's config, or None; sinks: `[Hq]` float32 sink logits (softmax) or
  None.
  Returns (out `[B, Sq_pad, Hq, Dv_pad]`, row statistic `[B, Hq, Sq_pad]`).
  """
  core = jax.custom_vjp(functools.partial(_primal, spec))
  core.defvjp(functools.partial(_core_fwd, spec), functools.partial(_core_bwd, spec),
              symbolic_zeros=True)
  return core(q, k, v, consts, block_masks, sinks)


def fp8_forward(q, k, v, consts, block_masks, sinks, descales, *, spec: CoreSpec):
  """The forward alone on padded fp8 inputs (fp8 attention has no backward;
  api.py refuses its gradient), `descales` from `fp8.kernel_descales`.
  Returns (out in bfloat16, row statistic)."""
  out, stat, _ = sharded_passes.forward(_forward, spec, q, k, v, consts,
                                        _pass_mask(block_masks, 0), sinks, descales)
  return out, stat


def recorded_gradients(q, k, v, consts, block_masks, sinks, stat, delta, d_out, *,
                       spec: CoreSpec):
  """(dq, dk, dv) on padded inputs: the backward kernels at (q, k, v) with
  the saved row statistic `stat` and the softmax row terms `delta` =
  rowsum(dO * O) minus the statistic's cotangent (None for elementwise
  rownorms) given, for the output cotangent `d_out`. No forward runs and no
  output is read: ring attention's backward steps, each block of keys
  against the rows merged over all blocks. Captured arrays get no gradient
  (the ring refuses differentiated ones)."""
  if spec.analysis.rownorm.kind == "normalized":
    raise ValueError("recorded statistics: normalized rownorms are not supported")
  res = _Residuals(q, k, v, consts, _pass_mask(block_masks, 1), sinks, None, stat, None,
                   (False,) * len(consts[0]), delta)
  return sharded_passes.backward(_backward, spec, res, d_out, None)[:3]


def _differentiated(score_consts) -> tuple:
  """Per score_mod capture (custom_vjp primals): whether it needs a gradient."""
  return tuple(c.perturbed and jnp.issubdtype(jnp.result_type(c.value), jnp.floating)
               for c in score_consts)


def _primal(spec, q, k, v, consts, block_masks, sinks):
  out, stat, _ = sharded_passes.forward(_forward, spec, q, k, v, consts,
                                        _pass_mask(block_masks, 0), sinks)
  return out, stat


def _pass_mask(block_masks, n: int):
  """The forward's (n = 0) or the backward's (n = 1) block mask, or None."""
  return None if block_masks is None else block_masks[n]


def _core_fwd(spec, q, k, v, consts, block_masks, sinks):
  differentiated = _differentiated(consts[0])
  q, k, v, consts, block_masks, sinks = jax.custom_derivatives.custom_vjp_primal_tree_values(
      (q, k, v, consts, block_masks, sinks))
  out, stat, row_stats = sharded_passes.forward(_forward, spec, q, k, v, consts,
                                                _pass_mask(block_masks, 0), sinks)
  return (out, stat), _Residuals(q, k, v, consts, _pass_mask(block_masks, 1), sinks, out,
                                 stat, row_stats, differentiated)


def _is_zero(ct) -> bool:
  return isinstance(ct, jax.custom_derivatives.SymbolicZero)


def _core_bwd(spec, res: _Residuals, cotangents):
  d_out, d_stat = cotangents
  d_out = jnp.zeros_like(res.out) if _is_zero(d_out) else d_out
  d_stat = None if _is_zero(d_stat) else d_stat
  if _differentiates_a_term(spec.analysis, res.differentiated):
    # The gradient of an array a term reads flows through the kernel's reads;
    # chosen before partitioning, so that a shard's reads of it are planned alike.
    spec = dataclasses.replace(spec, analysis=spec.analysis.without_terms())
  return sharded_passes.backward(_backward, spec, res, d_out, d_stat)


def _backward(spec, res: _Residuals, d_out, d_stat):
  analysis = spec.analysis
  score_uses = () if analysis.score_mod is None else analysis.score_mod.uses
  grad_kinds = tuple(parallel_backward.gradient_kind(use.axes)
                     if not use.is_term and res.differentiated[use.capture] else None
                     for use in score_uses)
  cfg, block_mask, template = spec.bwd_config, res.block_mask, parallel_backward
  if spec.backward_lowering == lowering.MOSAIC_GPU:
    if any(kind is not None for kind in grad_kinds):
      # Capture gradients are Triton's alone: its passes on its tiles (a
      # finer block mask is exact but may visit some empty tiles).
      cfg = parallel_backward.heuristic_backward_config(
          spec.seq_q, spec.seq_kv, res.q.shape[-1], res.v.shape[-1])
      if block_mask is not None:
        block_mask = block_mask.with_blocks(cfg.block_q, cfg.block_k)
    else:
      from pallas_attn.vjp import mosaic_backward
      template = mosaic_backward
  capture_arrays, operands = tiles.capture_operands(
      analysis, res.q.shape[1], res.k.shape[1], res.consts, heads=res.q.shape[2],
      bank_width=None if template is not parallel_backward else cfg.block_k)
  plan = parallel_backward.BackwardPlan(
      **_plan_fields(spec, cfg, operands, block_mask is not None, res.sinks is not None),
      num_q_blocks=_cdiv(spec.seq_q, cfg.block_q), grad_kinds=grad_kinds)
  if res.delta is not None:  # given (ring attention's steps): both templates take the rows
    rows = jnp.stack([softmax_lse2(res.stat), res.delta], axis=2)
  elif template is parallel_backward:
    rows = row_terms(analysis.rownorm, res.out, d_out, res.stat, res.row_stats, d_stat)
  else:  # the dq kernel computes delta
    rows = template.row_inputs(analysis.rownorm, res.out, res.stat, d_stat)
  dq, dk, dv, partials, used_rows = template.backward(
      res.q, res.k, res.v, d_out, rows, capture_arrays, block_mask, plan=plan, config=cfg,
      interpret=spec.interpret)
  score_consts, mask_consts = res.consts
  grads = [None] * len(score_consts)
  for n, (use, kind, partial) in enumerate(zip(score_uses, grad_kinds, partials)):
    if kind is None:
      continue
    if kind == TILE and block_mask is not None:
      partial = _zero_unvisited(partial, block_mask)
    const = score_consts[use.capture]
    if kind == GATHER:
      g = _gather_gradient(partial, operands[n], use.axes, jnp.shape(const))
    else:
      g = _capture_gradient(partial, kind, use.axes, jnp.shape(const), spec.seq_q, spec.seq_kv)
    g = g if grads[use.capture] is None else grads[use.capture] + g
    grads[use.capture] = g
  score_grads = tuple(None if g is None else g.astype(jnp.result_type(c))
                      for g, c in zip(grads, score_consts))
  return (dq, dk, dv, (score_grads, (None,) * len(mask_consts)), None,
          None if res.sinks is None else
          _sink_gradient(res.sinks, res.stat, used_rows[:, :, 1], spec.seq_q))  # softmax's delta


def _differentiates_a_term(analysis, differentiated) -> bool:
  terms = () if analysis.score_mod is None else analysis.score_mod.terms
  return any(differentiated[c] for term in terms for c in term.captures)


def _sink_gradient(sinks, lse, delta, seq_q: int):
  """d loss / d sinks `[Hq]`: a sink is a key of value 0, so its score
  gradient is `p_sink * (0 - delta)` with `p_sink = exp(sink - lse)`."""
  delta = delta[:, :, :seq_q]
  p_sink = jnp.exp(sinks[None, :, None].astype(jnp.float32) - lse[:, :, :seq_q])
  return (-jnp.sum(p_sink * delta, axis=(0, 2))).astype(sinks.dtype)


def row_delta(out, d_out, d_stat):
  """`rowsum(dO * O)` `[B, H, Sq_pad]`, minus the lse cotangent when given."""
  delta = jnp.transpose(jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1),
                        (0, 2, 1))
  return delta if d_stat is None else delta - d_stat


def row_terms(rownorm: RowNorm, out, d_out, stat, row_stats, d_stat):
  """Per-row inputs of the backward kernels, `[B, H, T, Sq_pad]` float32.

  softmax: (lse in log2 units, +inf for empty rows so their weights are 0;
  delta = rowsum(dO * O) minus the lse cotangent). elementwise: None.
  normalized: (F, the factor multiplying the row's weights; dr_k per row
  statistic; the argmax kv position of each max statistic). With O = F * acc,
  dL/dF = rowsum(dO * acc) = delta / F, and dr = vjp of F(stats) (and of
  the returned divisor h, for its cotangent).
  """
  if rownorm.kind == "elementwise":
    return None
  if rownorm.kind == "softmax":
    return jnp.stack([softmax_lse2(stat), row_delta(out, d_out, d_stat)], axis=2)
  delta = row_delta(out, d_out, None)
  num_stats = len(rownorm.stats)
  stats = tuple(row_stats[:, :, n] for n in range(num_stats))

  def factor_and_divisor(*stats):
    h = jnp.broadcast_to(
        run_row_program(rownorm.factor, *stats, differentiable=True).astype(jnp.float32),
        stats[0].shape)
    f = 1.0 / h if rownorm.combine == "div" else h
    return jnp.where(jnp.isfinite(f), f, 0.0), h

  (factor, divisor), pullback = jax.vjp(factor_and_divisor, *stats)
  nonzero = factor != 0.0
  d_factor = jnp.where(nonzero, delta / jnp.where(nonzero, factor, 1.0), 0.0)
  d_divisor = jnp.zeros_like(divisor) if d_stat is None else d_stat
  d_stats = [jnp.where(jnp.isfinite(d), d, 0.0) for d in pullback((d_factor, d_divisor))]
  argmaxes = [row_stats[:, :, n] for n in range(num_stats, row_stats.shape[2])]
  return jnp.stack([factor, *d_stats, *argmaxes], axis=2)


# The axes of each kind of capture partial (see parallel_backward.backward).
_PARTIAL_AXES = {ROW: ("b", "h", "q"), TILE: ("b", "h", "q", "kv"), KEY: ("b", "h", "kv")}


def _fit(x, axis: int, length: int):
  """Slices or zero-pads `axis` to `length`."""
  if x.shape[axis] >= length:
    return jax.lax.slice_in_dim(x, 0, length, axis=axis)
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, length - x.shape[axis])
  return jnp.pad(x, widths)


def _capture_gradient(partial, kind: str, axes: tuple, shape: tuple, seq_q: int, seq_kv: int):
  """A capture's gradient from its kernel partial.

  Drops padded positions, sums the axes the capture is not addressed by,
  orders the rest as the capture's axes and places them at its fixed
  indices.
  """
  names = _PARTIAL_AXES[kind]
  true_length = {"q": seq_q, "kv": seq_kv}
  partial = partial[tuple(slice(0, true_length.get(n)) for n in names)]
  addressed = [a for a in axes if isinstance(a, str)]
  g = jnp.sum(partial, axis=tuple(d for d, n in enumerate(names) if n not in addressed))
  kept = [n for n in names if n in addressed]
  g = jnp.transpose(g, [kept.index(a) for a in addressed])
  named_dims = [dim for a, dim in zip(axes, shape) if isinstance(a, str)]
  for axis, dim in enumerate(named_dims):
    g = _fit(g, axis, dim)
  if len(addressed) == len(axes):
    return g
  index = tuple(a if isinstance(a, int) else slice(None) for a in axes)
  return jnp.zeros(shape, g.dtype).at[index].set(g)


def _gather_gradient(partial, operand, axes: tuple, shape: tuple):
  """A gathered capture's gradient from its `[B, Hq, nq, T]` partial: sums
  q blocks and the b / h it is not addressed by, unflattens the gathered
  axes (`tiles.CaptureOperand`) and places them at the capture's axes."""
  gathered = [n for n, a in enumerate(axes) if a == tiles.GATHERED]
  named = [(n, a) for n, a in enumerate(axes) if a in ("b", "h")]
  size = 1
  for dim in operand.gather_dims:
    size *= dim
  g = jnp.sum(partial[..., :size], axis=2)
  g = jnp.sum(g, axis=tuple(d for d, a in enumerate("bh") if a not in axes))
  kept = [a for a in "bh" if a in axes]
  g = jnp.transpose(g, [kept.index(a) for _, a in named] + [len(kept)])
  g = g.reshape(g.shape[:-1] + operand.gather_dims)
  for axis, (n, _) in enumerate(named):
    g = _fit(g, axis, shape[n])
  order = [n for n, _ in named] + gathered  # the capture axis of each axis of g
  g = jnp.transpose(g, sorted(range(len(order)), key=order.__getitem__))
  if len(order) == len(axes):
    return g
  index = tuple(a if isinstance(a, int) else slice(None) for a in axes)
  return jnp.zeros(shape, g.dtype).at[index].set(g)


def _visited_tiles(block_mask, nq: int, nk: int):
  """`[Bm, Hm, nq, nk]` for a grid of nq x nk tiles: True where the q-major lists visit."""
  partial_num, partial_idx, full_num, full_idx = block_mask.q_major(nq)
  bm, hm = partial_idx.shape[:2]
  slots = jnp.arange(partial_idx.shape[-1])
  ib, ih, iq = (x[..., None] for x in jnp.meshgrid(
      jnp.arange(bm), jnp.arange(hm), jnp.arange(nq), indexing="ij"))
  visited = jnp.zeros((bm, hm, nq, nk + 1), bool)  # column nk takes unused list slots
  for num, idx in ((partial_num, partial_idx), (full_num, full_idx)):
    visited = visited.at[ib, ih, iq, jnp.where(slots < num[..., None], idx, nk)].set(True)
  return visited[..., :nk]


def _zero_unvisited(partial, block_mask):
  """Zeros the tiles of a TILE partial that the dq kernel skipped (never written)."""
  batch, heads, seq_q_pad, seq_kv_pad = partial.shape
  bq, bk = block_mask.block_q, block_mask.block_k
  tiled = partial.reshape(batch, heads, seq_q_pad // bq, bq, seq_kv_pad // bk, bk)
  visited = _visited_tiles(block_mask, seq_q_pad // bq, seq_kv_pad // bk)[:, :, :, None, :, None]
  return jnp.where(visited, tiled, 0.0).reshape(partial.shape)
