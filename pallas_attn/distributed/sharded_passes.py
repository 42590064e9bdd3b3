"""The attention core's passes, partitioned over batch and heads.

vjp/attention_vjp.py runs its forward and its backward kernels through
`forward` and `backward` here: each describes the pass's operands for
distributed/partitioning.py (q, k, v, the output and row statistics by
batch and heads; captured arrays and block masks by how they are
addressed; sinks by head) and, on a shard, gives the pass programs that see
global b and h (distributed/offsets.py) and sums the gradients of arrays
that several shards contribute to.
"""
from __future__ import annotations

import dataclasses

import jax

from pallas_attn.distributed import offsets as offsets_lib
from pallas_attn.distributed.partitioning import (BATCH, HEADS, KV_HEADS, Dims,
                                                  capture_dims, partitioned)

Q_DIMS = Dims((BATCH, None, HEADS, None), "q")
KV_DIMS = Dims((BATCH, None, KV_HEADS, None), "k/v")
OUT_DIMS = Dims((BATCH, None, HEADS, None), "the output")
ROW_DIMS = Dims((BATCH, HEADS, None), "the row statistics")
ROW_STATS_DIMS = Dims((BATCH, HEADS, None, None), "the row statistics")
SINK_DIMS = Dims((HEADS,), "sinks")
DESCALE_DIMS = Dims((BATCH, HEADS, None), "the fp8 descales")


def _consts_dims(spec, consts, q) -> tuple:
  batch, heads = q.shape[0], q.shape[2]
  return tuple(capture_dims(prog, prog_consts, batch, heads)
               for prog, prog_consts in zip((spec.analysis.score_mod, spec.analysis.mask_mod),
                                            consts))


def _block_mask_dims(block_mask):
  """A block mask's lists and classes are `[Bm, Hm, ...]`: batch and query
  heads where the mask depends on them, else broadcast (replicated)."""
  if block_mask is None:
    return None

  def dims(x):
    roles = (BATCH if x.shape[0] > 1 else None, HEADS if x.shape[1] > 1 else None)
    return Dims(roles + (None,) * (x.ndim - 2), "a block mask")
  return jax.tree.map(dims, block_mask)


def _localized(spec, consts, shard):
  """(spec, consts) whose programs see the shard's global b and h."""
  if not shard.offsets:
    return spec, consts
  analysis, consts = offsets_lib.with_offsets(spec.analysis, consts, shard.offsets)
  return dataclasses.replace(spec, analysis=analysis), consts


def forward(run, spec, q, k, v, consts, block_mask, sinks, descales=None):
  """`run(spec, q, k, v, consts, block_mask, sinks[, descales])` -> (out,
  stat, row_stats or None), partitioned over batch and heads; `descales`:
  an fp8 call's `[B, Hq, 2]` factors, passed on where given."""
  def local(shard, q, k, v, consts, block_mask, sinks, descales):
    local_spec, local_consts = _localized(spec, consts, shard)
    fp8 = () if descales is None else (descales,)
    return run(local_spec, q, k, v, local_consts, block_mask, sinks, *fp8)

  arg_dims = (Q_DIMS, KV_DIMS, KV_DIMS, _consts_dims(spec, consts, q),
              _block_mask_dims(block_mask), None if sinks is None else SINK_DIMS,
              None if descales is None else DESCALE_DIMS)
  out_dims = (OUT_DIMS, ROW_DIMS,
              ROW_STATS_DIMS if spec.analysis.rownorm.kind == "normalized" else None)
  return partitioned(local, (q, k, v, consts, block_mask, sinks, descales), arg_dims,
                     out_dims, group=spec.group)


def backward(run, spec, res, d_out, d_stat):
  """`run(spec, res, d_out, d_stat)` -> (dq, dk, dv, (score_mod's capture
  gradients, mask_mod's), None, sink gradient or None), partitioned over
  batch and heads. `res`: the core's residuals (fields q, k, v, consts,
  block_mask, sinks, out, stat, row_stats, delta and the static
  `differentiated`)."""
  consts_dims = _consts_dims(spec, res.consts, res.q)
  score_dims = consts_dims[0]

  def local(shard, res, d_out, d_stat):
    local_spec, local_consts = _localized(spec, res.consts, shard)
    extra = len(local_consts[0]) - len(res.consts[0])
    local_res = dataclasses.replace(res, consts=local_consts,
                                    differentiated=res.differentiated + (False,) * extra)
    dq, dk, dv, (score_grads, _), _, d_sinks = run(local_spec, local_res, d_out, d_stat)
    score_grads = score_grads[:len(score_dims)]  # the offsets' (None) dropped
    pairs = [(g, dims) for g, dims in zip(score_grads + (d_sinks,), score_dims + (SINK_DIMS,))
             if g is not None]
    summed = iter(shard.sum_over_unsharded(pairs))
    *score_grads, d_sinks = [None if g is None else next(summed)
                             for g in score_grads + (d_sinks,)]
    return dq, dk, dv, tuple(score_grads), d_sinks

  res_dims = dataclasses.replace(
      res, q=Q_DIMS, k=KV_DIMS, v=KV_DIMS, consts=consts_dims,
      block_mask=_block_mask_dims(res.block_mask),
      sinks=None if res.sinks is None else SINK_DIMS,
      out=None if res.out is None else OUT_DIMS, stat=ROW_DIMS,
      row_stats=None if res.row_stats is None else ROW_STATS_DIMS,
      delta=None if res.delta is None else ROW_DIMS)
  score_out_dims = tuple(dims if differentiated else None
                         for dims, differentiated in zip(score_dims, res.differentiated))
  out_dims = (Q_DIMS, KV_DIMS, KV_DIMS, score_out_dims,
              None if res.sinks is None else SINK_DIMS)
  dq, dk, dv, score_grads, d_sinks = partitioned(
      local, (res, d_out, d_stat),
      (res_dims, OUT_DIMS, None if d_stat is None else ROW_DIMS), out_dims, group=spec.group)
  return dq, dk, dv, (score_grads, (None,) * len(res.consts[1])), None, d_sinks
