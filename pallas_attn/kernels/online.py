"""Online row normalization: the state a flash-style kernel carries per row.

One `OnlineRowNorm` per rownorm class of the analysis (spec/rownorm.py):
`init` the per-row state, `update` it with one `[block_q, block_k]` tile of
modified scores and its value tile, `finalize` into the output and the row
statistic the backward needs. Masked positions get weight 0 and add nothing
to the row statistics; a row with nothing kept finalizes to zeros.
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


def run_row_program(prog, *values):
  jaxpr = prog.traced.jaxpr
  out, = blockeval.evaluate(jaxpr, dict(zip(prog.inputs, values)), [prog.output])
  return out


def _keep(x, keep, fill):
  return x if keep is None else jnp.where(keep, x, fill)


@dataclasses.dataclass(frozen=True)
class OnlineRowNorm:
  rownorm: RowNorm
  fp32_exact: bool

  @property
  def kind(self) -> str:
    return self.rownorm.kind

  def logits_are_scores(self) -> bool:
    """True when softmax runs on the scores themselves (no pre-map)."""
    w = self.rownorm.weights
    return self.kind == "softmax" and w.output is w.inputs[0] and self.rownorm.logit_scale == 1.0

  def weights(self, s):
    """Per-position weight before row normalization (log2-domain logit for softmax)."""
    x = run_row_program(self.rownorm.weights, s)
    if self.kind == "softmax":
      return x * (self.rownorm.logit_scale * LOG2E)
    return x

  def init(self, rows: int, dv: int):
    acc = jnp.zeros((rows, dv), jnp.float32)
    if self.kind == "softmax":
      return (acc, jnp.full((rows, 1), -jnp.inf, jnp.float32), jnp.zeros((rows, 1), jnp.float32))
    stats = tuple(jnp.full((rows, 1), 0.0 if st.reducer == "sum" else -jnp.inf, jnp.float32)
                  for st in self.rownorm.stats)
    return (acc, *stats)

  def _pv(self, p, v):
    return backend.dot(p.astype(v.dtype), v, fp32_exact=self.fp32_exact)

  def update(self, state, s, keep, v, *, log2_logits=None):
    """Folds one tile in. `log2_logits`, if given, replaces `weights(s)`."""
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
    acc, *stats = state
    w = _keep(self.weights(s), keep, 0.0)
    new_stats = []
    for st, val in zip(self.rownorm.stats, stats):
      f = run_row_program(st.operand, s)
      if st.reducer == "sum":
        new_stats.append(val + jnp.sum(_keep(f, keep, 0.0), axis=1, keepdims=True))
      else:
        new_stats.append(jnp.maximum(val, jnp.max(_keep(f, keep, -jnp.inf), axis=1, keepdims=True)))
    return (acc + self._pv(w, v), *new_stats)

  def finalize(self, state):
    """(output tile, row statistic): lse for softmax, h(stats) for normalized."""
    if self.kind == "softmax":
      acc, m, l = state
      empty = l == 0.0
      out = acc / jnp.where(empty, 1.0, l)
      lse = jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) * LN2)
      return out, lse
    acc, *stats = state
    if self.kind == "elementwise":
      return acc, jnp.zeros((acc.shape[0], 1), jnp.float32)
    h = self.row_factor(stats)
    factor = 1.0 / h if self.rownorm.combine == "div" else h
    factor = jnp.where(jnp.isfinite(factor), factor, 0.0)
    return acc * factor, h

  def row_factor(self, stats):
    """h(stats) for the normalized class, as a `[rows, 1]` column."""
    h = run_row_program(self.rownorm.factor, *stats)
    return jnp.broadcast_to(h.astype(jnp.float32), stats[0].shape)
