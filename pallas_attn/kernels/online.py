"""Online row normalization: the state a flash-style kernel carries per row.

One `OnlineRowNorm` per rownorm class of the analysis (spec/rownorm.py):
`init` the per-row state, `update` it with one `[block_q, block_k]` tile of
modified scores and its value tile, `finalize` into the output and the row
statistic the backward needs. Masked positions get weight 0 and add nothing
to the row statistics; a row with nothing kept finalizes to zeros.

For the normalized class the state also tracks, per max statistic, the
first kv position reaching the row max, so that the backward sends the
max's gradient there without comparing recomputed floats.

The algebra is written once for every lowering; `RowLayout` says how a
lowering holds per-row values next to its tiles (Triton: `[rows, 1]`
columns that broadcast; Mosaic GPU: `[rows]` vectors in the reduced
accumulator layout, broadcast explicitly), and `weigh` stops before the
weights-times-values product, which each lowering issues its own way.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from pallas_attn.kernels import backend
from pallas_attn.spec import blockeval
from pallas_attn.spec.rownorm import RowNorm

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)


def run_row_program(prog, *values, fast_math=False, differentiable=False):
  """A piece of the rownorm on row or tile values (`differentiable` as in
  `blockeval.evaluate`)."""
  jaxpr = prog.traced.jaxpr
  out, = blockeval.evaluate(jaxpr, dict(zip(prog.inputs, values)), [prog.output],
                            overrides=backend.fast_math_overrides(fast_math),
                            differentiable=differentiable)
  return out


def run_tile_program(prog, s, fast_math=False, differentiable=False):
  """An elementwise piece of the rownorm on a score tile, at the tile's shape
  (also when it does not depend on the score)."""
  return jnp.broadcast_to(
      run_row_program(prog, s, fast_math=fast_math, differentiable=differentiable), s.shape)


def _keep(x, keep, fill):
  return x if keep is None else jnp.where(keep, x, fill)


def _identity(x):
  return x


@dataclasses.dataclass(frozen=True)
class RowLayout:
  """How per-row values sit next to `[rows, cols]` tiles.

  keepdims: rows are `[rows, 1]` columns that broadcast implicitly (Triton);
  else `[rows]` vectors broadcast with `broadcast_in_dim` (Mosaic GPU).
  `place_rows` / `place_tile` give a fresh constant the lowering's layout.
  """
  keepdims: bool = True
  place_rows: Callable = _identity
  place_tile: Callable = _identity

  def full(self, rows: int, value):
    shape = (rows, 1) if self.keepdims else (rows,)
    return self.place_rows(jnp.full(shape, value, jnp.float32))

  def zeros_tile(self, rows: int, cols: int):
    return self.place_tile(jnp.zeros((rows, cols), jnp.float32))

  def reduce(self, op, x):
    return op(x, axis=1, keepdims=True) if self.keepdims else op(x, axis=1)

  def expand(self, row, shape):
    """A row value broadcast over a tile of `shape`."""
    return row if self.keepdims else lax.broadcast_in_dim(row, shape, (0,))


KEEPDIMS = RowLayout()


@dataclasses.dataclass(frozen=True)
class OnlineRowNorm:
  rownorm: RowNorm
  fp32_exact: bool
  fast_math: bool = False  # approximate transcendentals (backend.fast_math_overrides)
  rows: RowLayout = KEEPDIMS
  # softmax's lazy running max (log2 units; None: exact): a row's max moves
  # only when a tile raises it by more than this, so that most tiles leave
  # the accumulator's factor exactly 1 and their weights at most 2**max_growth.
  max_growth: float | None = None

  @property
  def kind(self) -> str:
    return self.rownorm.kind

  def logits_are_scores(self) -> bool:
    """True when softmax runs on the scores themselves (no pre-map)."""
    w = self.rownorm.weights
    return self.kind == "softmax" and w.output is w.inputs[0] and self.rownorm.logit_scale == 1.0

  def weights(self, s, differentiable=False):
    """Per-position weight before row normalization (log2-domain logit for
    softmax); `differentiable` as in `blockeval.evaluate`."""
    x = run_tile_program(self.rownorm.weights, s, self.fast_math, differentiable)
    if self.kind == "softmax":
      return x * (self.rownorm.logit_scale * LOG2E)
    return x

  def init(self, rows: int, dv, sink2=None):
    """The empty row state. Softmax with a sink (a log2-domain logit) starts
    as if one key of that logit and value 0 had been folded in. `dv` a tuple
    of widths: the accumulator is that tuple of column groups (`update`'s v
    a tuple of as many tiles)."""
    full = self.rows.full
    acc = (tuple(self.rows.zeros_tile(rows, d) for d in dv) if isinstance(dv, tuple)
           else self.rows.zeros_tile(rows, dv))
    if self.kind == "softmax":
      if sink2 is None:
        return (acc, full(rows, -jnp.inf), full(rows, 0.0))
      m = full(rows, 0.0) + jnp.asarray(sink2, jnp.float32)
      return (acc, m, jnp.where(m == -jnp.inf, 0.0, 1.0))
    stats = tuple(full(rows, 0.0 if st.reducer == "sum" else -jnp.inf)
                  for st in self.rownorm.stats)
    argmaxes = tuple(full(rows, -1.0) for _ in self._max_stats())
    return (acc, stats, argmaxes)

  def _max_stats(self):
    return [st for st in self.rownorm.stats if st.reducer == "max"]

  @property
  def num_row_statistics(self) -> int:
    """Rows of `row_statistics`: each stat, then each max stat's argmax."""
    return len(self.rownorm.stats) + len(self._max_stats())

  def _pv(self, p, v, v_transposed=False):
    if isinstance(v, tuple):
      return tuple(self._pv(p, part, v_transposed) for part in v)
    return backend.dot(p.astype(v.dtype), v, trans_b=v_transposed, fp32_exact=self.fp32_exact)

  def update(self, state, s, keep, v, *, kv_idx=None, log2_logits=None, v_transposed=False):
    """Folds one tile in. `log2_logits`, if given, replaces `weights(s)`;
    `kv_idx` (the tile's key positions) is needed by max statistics;
    `v_transposed`: v is given as `[Dv, keys]`."""
    w, acc_factor, state = self.weigh(state, s, keep, kv_idx=kv_idx, log2_logits=log2_logits)
    acc = jax.tree.map(jnp.add, self.rescale(state[0], acc_factor), self._pv(w, v, v_transposed))
    return (acc,) + state[1:]

  def rescale(self, acc, acc_factor):
    """The accumulator (or its column groups) times `weigh`'s per-row factor
    (None: unchanged)."""
    if acc_factor is None:
      return acc
    return jax.tree.map(lambda a: a * self.rows.expand(acc_factor, a.shape), acc)

  def weigh(self, state, s, keep, *, kv_idx=None, log2_logits=None, logit_scale=1.0,
            logit_shift=None):
    """One tile's row-statistics update, short of the accumulator: returns
    (weights tile w, per-row factor for the accumulator or None, the state
    with new statistics). The new accumulator is
    `rescale(acc, factor) + w @ v`. The log2-domain logits are
    `log2_logits * logit_scale (+ logit_shift)`: a positive scale, applied
    to the row max and inside the exp2's argument (one multiply-add per
    score), and a number for the whole tile, applied to the row max and to
    the row's subtrahend (no work per score)."""
    if self.kind == "softmax":
      acc, m, l = state
      t = self.weights(s) if log2_logits is None else log2_logits
      t = _keep(t, keep, -jnp.inf)
      unit = isinstance(logit_scale, (int, float)) and logit_scale == 1.0  # else maybe traced
      scaled = (lambda x: x) if unit else (lambda x: x * logit_scale)
      tile_max = scaled(self.rows.reduce(jnp.max, t))
      m_new = jnp.maximum(m, tile_max if logit_shift is None else tile_max + logit_shift)
      if self.max_growth is not None:
        m_new = jnp.where(m_new > m + self.max_growth, m_new, m)
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      alpha = jnp.exp2(m - m_safe)
      if self.max_growth is not None:  # exactly 1 where the max stays
        alpha = jnp.where(m_new == m, 1.0, alpha)
      subtrahend = m_safe if logit_shift is None else m_safe - logit_shift
      p = jnp.exp2(scaled(t) - self.rows.expand(subtrahend, t.shape))
      l = l * alpha + self.rows.reduce(jnp.sum, p)
      return p, alpha, (acc, m_new, l)
    acc, stats, argmaxes = state
    w = _keep(self.weights(s), keep, 0.0)
    new_stats, new_argmaxes, argmaxes = [], [], iter(argmaxes)
    for st, val in zip(self.rownorm.stats, stats):
      f = run_tile_program(st.operand, s, self.fast_math)
      if st.reducer == "sum":
        new_stats.append(val + self.rows.reduce(jnp.sum, _keep(f, keep, 0.0)))
        continue
      f = _keep(f, keep, -jnp.inf)
      tile_max = self.rows.reduce(jnp.max, f)
      at_max = f == self.rows.expand(tile_max, f.shape)
      first = self.rows.reduce(jnp.min, jnp.where(at_max, kv_idx, jnp.iinfo(jnp.int32).max))
      new_argmaxes.append(jnp.where(tile_max > val, first.astype(jnp.float32), next(argmaxes)))
      new_stats.append(jnp.maximum(val, tile_max))
    return w, None, (acc, tuple(new_stats), tuple(new_argmaxes))

  def finalize(self, state):
    """(output tile, row statistic): lse for softmax, h(stats) for normalized."""
    if self.kind == "softmax":
      acc, m, l = state
      empty = l == 0.0
      out = self.rescale(acc, 1.0 / jnp.where(empty, 1.0, l))
      lse = jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) * LN2)
      return out, lse
    acc, stats, _ = state
    if self.kind == "elementwise":
      return acc, self.rows.full(acc.shape[0], 0.0)
    h = self.row_factor(stats)
    factor = 1.0 / h if self.rownorm.combine == "div" else h
    factor = jnp.where(jnp.isfinite(factor), factor, 0.0)
    return self.rescale(acc, factor), h

  def row_statistics(self, state):
    """The backward's residuals of the normalized class: the raw row
    sums/maxes, then the argmax of each max (a kv position, as float32)."""
    return (*state[1], *state[2]) if self.kind == "normalized" else ()

  def row_factor(self, stats):
    """h(stats) for the normalized class, as a row value (see RowLayout)."""
    h = run_row_program(self.rownorm.factor, *stats)
    return jnp.broadcast_to(h.astype(jnp.float32), stats[0].shape)

  @property
  def num_partial_statistics(self) -> int:
    """Rows of `partial_statistics`."""
    return {"softmax": 2, "elementwise": 0}.get(self.kind, len(self.rownorm.stats))

  def partial_statistics(self, state) -> tuple:
    """The row values a split of the keys hands to `merge` besides its
    accumulator: softmax's running max (log2 units) and sum, the normalized
    class's raw row statistics, nothing for elementwise rownorms."""
    if self.kind == "softmax":
      return state[1:]
    return tuple(state[1])

  def merge(self, acc, statistics, sink2=None):
    """One state from the partial states of disjoint runs of a row's keys,
    stacked on axis 0 (flash-decoding's combine step): accumulators add,
    softmax rescales each part to the common max first (log-sum-exp), and
    a sink (a log2 logit) joins once, as one more term; the normalized
    class's sums add and maxes take the largest. `finalize` the result.
    An empty part (max -inf, sum 0) adds nothing."""
    if self.kind == "softmax":
      m, l = statistics
      m_new = jnp.max(m, axis=0)
      if sink2 is not None:
        m_new = jnp.maximum(m_new, sink2)
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      weight = jnp.exp2(m - m_safe)
      l_new = jnp.sum(l * weight, axis=0)
      if sink2 is not None:
        l_new = l_new + jnp.exp2(sink2 - m_safe)
      return jnp.sum(self.rescale(acc, weight), axis=0), m_new, l_new
    reduce = {"sum": jnp.sum, "max": jnp.max}
    stats = tuple(reduce[st.reducer](value, axis=0)
                  for st, value in zip(self.rownorm.stats, statistics))
    return jnp.sum(acc, axis=0), stats, ()
