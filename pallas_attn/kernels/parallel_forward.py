"""The parallel (flash-style) forward template.

One program per (q block, batch, query head) walks the kv blocks and folds
each tile into the online row state of the variant's rownorm class. The
analysis parameterizes everything variant-specific: score_mod and mask_mod
are evaluated on tiles by the interpreter, captured arrays arrive as
operands blocked by their addressing, and the rownorm class picks the
online state. The `[Sq, Skv]` score matrix never exists in memory.

Inputs are padded by the caller: sequence lengths to multiples of the
blocks, head dims to powers of two. Kv blocks are visited in two loops: the
ones known to need no masking, then the ones that do (the ragged tail, or
every block when there is a mask_mod and no block mask). With a block mask,
each q block visits only its listed kv blocks (see kernels/block_mask.py).

`TEMPLATE` is the forward as the scheduler sees it (schedule/template.py):
K/V tiles pipelined `num_stages` deep next to a resident Q tile.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_attn.kernels import backend, tiles
from pallas_attn.kernels.lowering import TRITON
from pallas_attn.kernels.online import LOG2E, OnlineRowNorm
from pallas_attn.schedule.config import (TILE, AttentionConfig, heuristic_config,
                                         next_power_of_2, padded_head_dim)
from pallas_attn.schedule.template import (ResourceUse, TileCheck, TritonTemplate,
                                           accumulator_registers, register)
from pallas_attn.spec.analysis import VariantAnalysis

BLOCK_CHOICES = (16, 32, 64, 128, 256)  # block_q and block_k searched


def softmax_of_logits(analysis: VariantAnalysis) -> bool:
  """Softmax of score_mod's output itself (the scores where there is none):
  no pre-map of the logits."""
  return OnlineRowNorm(analysis.rownorm, False, False).logits_are_scores()


def is_plain_softmax(analysis: VariantAnalysis) -> bool:
  """Softmax of the scores themselves: no score_mod, no pre-map of the logits."""
  return analysis.score_mod is None and softmax_of_logits(analysis)


@dataclasses.dataclass(frozen=True)
class VariantPlan:
  """The static parameters every attention kernel plan shares (the parallel
  templates' and the split-KV one's), and what they evaluate per tile: the
  rownorm's online state and the user's programs."""
  analysis: VariantAnalysis
  operands: tuple       # tiles.CaptureOperand per captured array
  scale: float
  seq_q: int            # query tokens (before padding)
  group: int            # query heads per kv head
  fp32_exact: bool
  fast_math: bool       # approximate tanh/sigmoid/exp: half precision, compiled
  has_sink: bool        # softmax with per-head sink logits (an operand [Hq], log2 units)

  @property
  def online(self) -> OnlineRowNorm:
    return OnlineRowNorm(self.analysis.rownorm, self.fp32_exact, self.fast_math)

  @property
  def tile(self) -> tiles.TileContext:
    return tiles.TileContext(self.analysis, self.operands, blocked="q",
                             fast_math=self.fast_math)

  @property
  def folds_log2(self) -> bool:
    """Plain softmax: scores go to the log2 domain with the scale in one multiply."""
    return is_plain_softmax(self.analysis)


@dataclasses.dataclass(frozen=True)
class ForwardPlan(VariantPlan):
  """Static parameters of one forward kernel instance."""
  seq_kv: int           # true length (before padding)
  block_q: int
  block_k: int
  num_kv_blocks: int    # kv blocks holding keys: ceil(seq_kv / block_k)
  block_sparse: bool    # kv blocks come from a block mask

  def tile_keep(self, tile: tiles.TileContext, masked: bool, b, h, q_idx, kv_idx, cap_refs,
                start, size):
    """Which positions of a tile count (None: all): mask_mod and kv bounds,
    on blocks visited as masked. Captures are read at `pl.ds(start, size)`
    along the axis the grid does not block."""
    if not masked:
      return None
    keep = tile.mask(b, h, q_idx, kv_idx, cap_refs, start, size)
    if self.seq_kv % self.block_k:
      in_bounds = kv_idx < self.seq_kv
      keep = in_bounds if keep is None else jnp.logical_and(keep, in_bounds)
    return keep


def _forward_kernel(q_ref, k_ref, v_ref, *refs, plan: ForwardPlan):
  n_caps = len(plan.operands)
  cap_refs = refs[:n_caps]
  rest = refs[n_caps:]
  sink2 = None
  if plan.has_sink:
    sink2, rest = rest[0][...], rest[1:]
  lists = None
  if plan.block_sparse:
    partial_num_ref, partial_idx_ref, full_num_ref, full_idx_ref = rest[:4]
    rest = rest[4:]
    lists = (partial_num_ref[0], lambda j: partial_idx_ref[j],
             full_num_ref[0], lambda j: full_idx_ref[j])
  o_ref, stat_ref, *row_stats_refs = rest  # row stats: normalized rownorms only
  qi = tiles.program_block()
  b, h = pl.program_id(1), pl.program_id(2)
  bq, bk = plan.block_q, plan.block_k
  online = plan.online
  tile = dataclasses.replace(plan.tile, block=(qi * bq, bq))
  q = q_ref[...]
  q_idx = tiles.tile_indices(qi * bq, bq, axis=0)
  # Without score_mod or a logit pre-map, fold scale and log2(e) into one multiply.
  fold = plan.folds_log2
  qk_scale = plan.scale * LOG2E if fold else plan.scale

  def fold_block(kv_block, state, masked: bool):
    kv_start = pl.multiple_of(kv_block * bk, bk)
    k = k_ref[pl.ds(kv_start, bk), :]
    v = v_ref[pl.ds(kv_start, bk), :]
    s = backend.dot(q, k, trans_b=True, fp32_exact=plan.fp32_exact) * qk_scale
    kv_idx = tiles.tile_indices(kv_start, bk, axis=1)
    s = tile.score(s, b, h, q_idx, kv_idx, cap_refs, kv_start, bk)
    keep = plan.tile_keep(tile, masked, b, h, q_idx, kv_idx, cap_refs, kv_start, bk)
    return online.update(state, s, keep, v, kv_idx=kv_idx, log2_logits=s if fold else None)

  num_plain = 0 if plan.analysis.mask_mod is not None else plan.seq_kv // bk
  state = tiles.visit_blocks(fold_block, online.init(bq, v_ref.shape[-1], sink2), lists=lists,
                             num_plain=num_plain, num_blocks=plan.num_kv_blocks)
  out, stat = online.finalize(state)
  o_ref[...] = out.astype(o_ref.dtype)
  stat_ref[...] = stat[:, 0]
  for row_stats_ref in row_stats_refs:
    for n, value in enumerate(online.row_statistics(state)):
      row_stats_ref[n, :] = value[:, 0]


def forward(q, k, v, capture_arrays, sinks, block_mask_arrays, *, plan: ForwardPlan,
            config: AttentionConfig, interpret: bool):
  """Runs the forward kernel on padded inputs.

  q `[B, Sq_pad, Hq, Dqk_pad]`, k `[B, Skv_pad, Hkv, Dqk_pad]`, v
  `[B, Skv_pad, Hkv, Dv_pad]`; sinks `[Hq]` float32 natural-log sink
  logits when `plan.has_sink`, else None. Returns (out `[B, Sq_pad, Hq, Dv_pad]`,
  row statistic `[B, Hq, Sq_pad]` float32, and for normalized rownorms the
  `OnlineRowNorm.row_statistics` `[B, Hq, n, Sq_pad]` that the backward
  needs, else None).
  """
  batch, seq_q_pad, heads, d_qk = q.shape
  seq_kv_pad, d_v = k.shape[1], v.shape[-1]
  bq, group = plan.block_q, plan.group
  in_specs = [
      pl.BlockSpec((None, bq, None, d_qk), lambda i, b, h: (b, i, h, 0)),
      pl.BlockSpec((None, seq_kv_pad, None, d_qk), lambda i, b, h: (b, 0, h // group, 0)),
      pl.BlockSpec((None, seq_kv_pad, None, d_v), lambda i, b, h: (b, 0, h // group, 0)),
  ]
  in_specs += [tiles.capture_block_spec(op, x.shape, blocked="q", block=bq)
               for op, x in zip(plan.operands, capture_arrays)]
  sink_inputs = ()
  if plan.has_sink:
    sink_inputs = (sinks.astype(jnp.float32) * LOG2E,)
    in_specs.append(pl.BlockSpec((None,), lambda i, b, h: (h,)))
  if plan.block_sparse:
    in_specs += block_mask_specs(block_mask_arrays)
  out_shape = [
      jax.ShapeDtypeStruct((batch, seq_q_pad, heads, d_v), q.dtype),
      jax.ShapeDtypeStruct((batch, heads, seq_q_pad), jnp.float32),
  ]
  out_specs = [
      pl.BlockSpec((None, bq, None, d_v), lambda i, b, h: (b, i, h, 0)),
      pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
  ]
  num_stats = plan.online.num_row_statistics
  if num_stats:
    out_shape.append(jax.ShapeDtypeStruct((batch, heads, num_stats, seq_q_pad), jnp.float32))
    out_specs.append(pl.BlockSpec((None, None, num_stats, bq), lambda i, b, h: (b, h, 0, i)))
  num_q_blocks = seq_q_pad // bq
  call = backend.pallas_call(
      functools.partial(_forward_kernel, plan=plan),
      out_shape=out_shape,
      grid=(num_q_blocks, batch, heads),
      in_specs=tiles.heaviest_first(in_specs, num_q_blocks),
      out_specs=tiles.heaviest_first(out_specs, num_q_blocks),
      num_warps=config.num_warps,
      num_stages=config.num_stages,
      interpret=interpret,
      name="pallas_attn_forward",
  )
  out, stat, *row_stats = call(q, k, v, *capture_arrays, *sink_inputs, *block_mask_arrays)
  return out, stat, (row_stats[0] if row_stats else None)


def block_mask_specs(arrays, group: int | None = None):
  """BlockSpecs of the (num, indices) pairs of a block mask for grid (i, b, h).

  Counts are `[B|1, H|1, nq]`, indices `[B|1, H|1, nq, nk]`; a size-1 batch
  or head axis is broadcast. With `group` (the dk/dv grid, h a kv head), a
  per-head mask gives each program the lists of its `group` query heads
  (indexed by the head within the group in the kernel); a broadcast one
  gives the single list.
  """
  specs = []
  for x in arrays:
    pick_b = (lambda b: b) if x.shape[0] > 1 else (lambda b: 0)
    per_head = x.shape[1] > 1
    pick_h = (lambda h: h) if per_head else (lambda h: 0)
    heads = None if group is None else (group if per_head else 1)
    if x.ndim == 3:
      specs.append(pl.BlockSpec(
          (None, heads, 1), lambda i, b, h, pb=pick_b, ph=pick_h: (pb(b), ph(h), i)))
    else:
      specs.append(pl.BlockSpec(
          (None, heads, None, x.shape[-1]),
          lambda i, b, h, pb=pick_b, ph=pick_h: (pb(b), ph(h), i, 0)))
  return specs


def streamed_kv_use(rows: int, keys: int, config, shape, device) -> ResourceUse:
  """A program that keeps a tile of `rows` query rows resident and streams
  K/V tiles of `keys` rows `config.num_stages` deep (the forward templates):
  its shared memory, and its output accumulator and score tile."""
  d_qk, d_v = padded_head_dim(shape.d_qk), padded_head_dim(shape.d_v)
  smem = (config.num_stages * keys * (d_qk + d_v) + rows * d_qk) * shape.itemsize
  return ResourceUse(smem, accumulator_registers(rows * d_v + rows * keys, config, device))


class TritonParallelTemplate(TritonTemplate):
  """The parallel templates on Triton (the forward here, the backward in
  vjp/parallel_backward.py): tiles of block_q queries by block_k keys."""
  config_class = AttentionConfig
  lowering = TRITON

  def obstacle(self, analysis, dtype, d_qk: int, d_v: int, interpret: bool) -> str | None:
    """Why this lowering cannot run the pass for a call: Triton runs every one."""
    return None

  def config_error(self, config):
    if not TILE[0](config.block_q):
      return f"Triton's tiles are powers of two; block_q is {config.block_q}"
    return None

  def tile_checks(self, config, shape, device):
    mma_m, mma_n, mma_k = device.mma_tile
    return [TileCheck("block_q", config.block_q, mma_m, next_power_of_2(shape.seq_q),
                      "padded seq_q"),
            TileCheck("block_k", config.block_k, max(mma_n, mma_k),
                      next_power_of_2(shape.seq_kv), "padded seq_kv")]

  def score_tile(self, config):
    return config.block_q, config.block_k

  def tile_axes(self, shape, device, default):
    return {"block_q": BLOCK_CHOICES, "block_k": BLOCK_CHOICES}


class ForwardTemplate(TritonParallelTemplate):
  name = "forward"

  def default_config(self, shape, device=None, *, block_sparse=False,
                     scores_per_position=False):
    return heuristic_config(shape.seq_q, shape.seq_kv, shape.d_qk, shape.d_v,
                            block_sparse=block_sparse, scores_per_position=scores_per_position,
                            itemsize=shape.itemsize)

  def resource_use(self, config, shape, device):
    return streamed_kv_use(config.block_q, config.block_k, config, shape, device)


TEMPLATE = register(ForwardTemplate())
