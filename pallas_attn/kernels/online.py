"""Online row normalization: the state a flash-style kernel carries per row.

One `OnlineRowNorm` per rownorm class of the analysis (spec/rownorm.py):
`init` the per-row state, `update` it with one `[block_q, block_k]` tile of
modified scores and its value tile, `finalize` into the output and the row
statistic the backward needs. Masked positions get weight 0 and add nothing
to the row statistics; a row with nothing kept finalizes to zeros.

For the normalized class the state also tracks, per max statistic, the
first kv position reaching the row max, so that the backward sends the
max's gradient there without comparing recomputed floats.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from pallas_attn.kernels import backend
from pallas_attn.spec import blockeval
from pallas_attn.spec.rownorm import RowNorm

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)


def run_row_program(prog, *values, fast_math=False):
  jaxpr = prog.traced.jaxpr
  out, = blockeval.evaluate(jaxpr, dict(zip(prog.inputs, values)), [prog.output],
                            overrides=backend.fast_math_overrides(fast_math))
  return out


def run_tile_program(prog, s, fast_math=False):
  """An elementwise piece of the rownorm on a score tile, at the tile's shape
  (also when it does not depend on the score)."""
  return jnp.broadcast_to(run_row_program(prog, s, fast_math=fast_math), s.shape)


def _keep(x, keep, fill):
  return x if keep is None else jnp.where(keep, x, fill)


@dataclasses.dataclass(frozen=True)
class OnlineRowNorm:
  rownorm: RowNorm
  fp32_exact: bool
  fast_math: bool = False  # approximate transcendentals (backend.fast_math_overrides)

  @property
  def kind(self) -> str:
    return self.rownorm.kind

  def logits_are_scores(self) -> bool:
    """True when softmax runs on the scores themselves (no pre-map)."""
    w = self.rownorm.weights
    return self.kind == "softmax" and w.output is w.inputs[0] and self.rownorm.logit_scale == 1.0

  def weights(self, s):
    """Per-position weight before row normalization (log2-domain logit for softmax)."""
    x = run_tile_program(self.rownorm.weights, s, self.fast_math)
    if self.kind == "softmax":
      return x * (self.rownorm.logit_scale * LOG2E)
    return x

  def init(self, rows: int, dv: int, sink2=None):
    """The empty row state. Softmax with a sink (a log2-domain logit) starts
    as if one key of that logit and value 0 had been folded in."""
    acc = jnp.zeros((rows, dv), jnp.float32)
    if self.kind == "softmax":
      if sink2 is None:
        return (acc, jnp.full((rows, 1), -jnp.inf, jnp.float32),
                jnp.zeros((rows, 1), jnp.float32))
      m = jnp.broadcast_to(jnp.asarray(sink2, jnp.float32), (rows, 1))
      return (acc, m, jnp.where(m == -jnp.inf, 0.0, 1.0))
    stats = tuple(jnp.full((rows, 1), 0.0 if st.reducer == "sum" else -jnp.inf, jnp.float32)
                  for st in self.rownorm.stats)
    argmaxes = tuple(jnp.full((rows, 1), -1.0, jnp.float32) for _ in self._max_stats())
    return (acc, stats, argmaxes)

  def _max_stats(self):
    return [st for st in self.rownorm.stats if st.reducer == "max"]

  @property
  def num_row_statistics(self) -> int:
    """Rows of `row_statistics`: each stat, then each max stat's argmax."""
    return len(self.rownorm.stats) + len(self._max_stats())

  def _pv(self, p, v):
    return backend.dot(p.astype(v.dtype), v, fp32_exact=self.fp32_exact)

  def update(self, state, s, keep, v, *, kv_idx=None, log2_logits=None):
    """Folds one tile in. `log2_logits`, if given, replaces `weights(s)`;
    `kv_idx` (the tile's key positions) is needed by max statistics."""
    if self.kind == "softmax":
      acc, m, l = state
      t = self.weights(s) if log2_logits is None else log2_logits
      t = _keep(t, keep, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(t, axis=1, keepdims=True))
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      alpha = jnp.exp2(m - m_safe)
      p = jnp.exp2(t - m_safe)
      l = l * alpha + jnp.sum(p, axis=1, keepdims=True)
      return (acc * alpha + self._pv(p, v), m_new, l)
    acc, stats, argmaxes = state
    w = _keep(self.weights(s), keep, 0.0)
    new_stats, new_argmaxes, argmaxes = [], [], iter(argmaxes)
    for st, val in zip(self.rownorm.stats, stats):
      f = run_tile_program(st.operand, s, self.fast_math)
      if st.reducer == "sum":
        new_stats.append(val + jnp.sum(_keep(f, keep, 0.0), axis=1, keepdims=True))
        continue
      f = _keep(f, keep, -jnp.inf)
      tile_max = jnp.max(f, axis=1, keepdims=True)
      first = jnp.min(jnp.where(f == tile_max, kv_idx, jnp.iinfo(jnp.int32).max),
                      axis=1, keepdims=True)
      new_argmaxes.append(jnp.where(tile_max > val, first.astype(jnp.float32), next(argmaxes)))
      new_stats.append(jnp.maximum(val, tile_max))
    return (acc + self._pv(w, v), tuple(new_stats), tuple(new_argmaxes))

  def finalize(self, state):
    """(output tile, row statistic): lse for softmax, h(stats) for normalized."""
    if self.kind == "softmax":
      acc, m, l = state
      empty = l == 0.0
      out = acc / jnp.where(empty, 1.0, l)
      lse = jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) * LN2)
      return out, lse
    acc, stats, _ = state
    if self.kind == "elementwise":
      return acc, jnp.zeros((acc.shape[0], 1), jnp.float32)
    h = self.row_factor(stats)
    factor = 1.0 / h if self.rownorm.combine == "div" else h
    factor = jnp.where(jnp.isfinite(factor), factor, 0.0)
    return acc * factor, h

  def row_statistics(self, state):
    """The backward's residuals of the normalized class: the raw row
    sums/maxes, then the argmax of each max (a kv position, as float32)."""
    return (*state[1], *state[2]) if self.kind == "normalized" else ()

  def row_factor(self, stats):
    """h(stats) for the normalized class, as a `[rows, 1]` column."""
    h = run_row_program(self.rownorm.factor, *stats)
    return jnp.broadcast_to(h.astype(jnp.float32), stats[0].shape)
