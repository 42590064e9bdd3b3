"""Row normalization analysis: which rownorms can run online, and how.

A rownorm maps a row of scores to weights. A flash-style kernel sees a row
one kv block at a time, so the analysis decomposes the traced row program
into pieces the kernel can run per block:

* elementwise: `w = g(s)` (sigmoid, relu, none). No row state.
* softmax: `w = exp(a(s) - c) / sum(exp(a(s) - c))` for any elementwise `a`
  and any row constant `c`. Softmax is shift-invariant, so the kernel uses
  its own running max (the exp homomorphism `exp(x - m1) = exp(x - m2) *
  exp(m2 - m1)` rescales the partial sums) whatever `c` the user wrote.
  With a sink, the denominator has one more term that no score enters:
  `exp(K - c) + sum(exp(a(s) - c))` (or `L + sum(exp(a(s)))` unshifted),
  an attention sink of logit K (gpt-oss, StreamingLLM; K = 0 is the
  "off-by-one" softmax). The kernel starts each row's state at it.
* normalized: `w = g(s) / h(r_1, ..., r_n)` (or `g(s) * h(...)`) where each
  `r_i` is a row sum or max of an elementwise `f_i(s)`. The kernel
  accumulates `sum g(s) v` and the `r_i`, and divides in the epilogue
  (RetNet's `s / max(sum |s|, 1)`).

Everything else is rejected with the reason it cannot run online. String
rownorms are analyzed the same way, as the callables they name.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_attn.spec import primitives
from pallas_attn.spec.trace import TracedFn, VariantError, is_literal, trace

_REDUCTIONS = primitives.names(primitives.ROW_REDUCTION)
_IDENTITIES = primitives.names(primitives.IDENTITY)

# Distinct sizes so that shapes of traced values tell rows from keys.
TRACE_ROWS, TRACE_KEYS = 3, 7

NAMED_ROWNORMS: dict[str, Callable] = {
    "softmax": jax.nn.softmax,
    "sigmoid": jax.nn.sigmoid,
    "relu": jax.nn.relu,
    "none": lambda s: s,
}


@dataclasses.dataclass(frozen=True)
class RowProgram:
  """A piece of the row program: `output` computed from `inputs`."""
  traced: TracedFn
  inputs: tuple
  output: object


@dataclasses.dataclass(frozen=True)
class RowStat:
  reducer: str  # "sum" or "max"
  operand: RowProgram  # f(s), elementwise


@dataclasses.dataclass(frozen=True)
class RowNorm:
  """The analyzed rownorm. `weights` maps the score to the (unnormalized)
  weight for 'elementwise' and 'normalized', and to the logit for 'softmax'
  (times `logit_scale`)."""
  kind: str  # "elementwise" | "softmax" | "normalized"
  name: str
  weights: RowProgram
  stats: tuple = ()  # tuple[RowStat], 'normalized' only
  factor: RowProgram | None = None  # h(stats), 'normalized' only
  combine: str = "div"  # weights = g / h ("div") or g * h ("mul")
  logit_scale: float = 1.0  # 'softmax': ln 2 when the user wrote exp2
  sink: float | None = None  # 'softmax': logit of a sink term, natural units
  traced: TracedFn | None = None

  def describe(self) -> str:
    if self.kind == "softmax":
      sink = "" if self.sink is None else f", sink exp({self.sink:g}) in the denominator"
      return f"softmax (online: running max, rescaled sum; exp homomorphism{sink})"
    if self.kind == "elementwise":
      return "elementwise (weights = g(score), no row state)"
    stats = ", ".join(f"{s.reducer}(f_{i}(score))" for i, s in enumerate(self.stats))
    op = "/" if self.combine == "div" else "*"
    return f"normalized (weights = g(score) {op} h({stats}); stats accumulated online)"


def _levels(jaxpr):
  """Per var: (depends on the scores elementwise, depends on a row reduction)."""
  lv = {jaxpr.invars[0]: (True, False)}

  def get(v):
    return (False, False) if is_literal(v) else lv.get(v, (False, False))

  for eqn in jaxpr.eqns:
    ins = [get(v) for v in eqn.invars]
    if eqn.primitive.name in _REDUCTIONS:
      out = (False, True)
    else:
      out = (any(e for e, _ in ins), any(r for _, r in ins))
    for v in eqn.outvars:
      lv[v] = out
  return get


def _producers(jaxpr):
  prod = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}

  def source(v):
    """The eqn producing `v`, looking through shape-only primitives."""
    eqn = None if is_literal(v) else prod.get(v)
    while eqn is not None and eqn.primitive.name in _IDENTITIES:
      v = eqn.invars[0]
      eqn = None if is_literal(v) else prod.get(v)
    return eqn, v

  return source


def _structure(jaxpr):
  """A key per var that is equal for structurally identical expressions."""
  prod = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
  memo = {}

  def key(v):
    if is_literal(v):
      return ("lit", repr(v.val), str(v.aval.dtype))
    if v not in memo:
      eqn = prod.get(v)
      if eqn is None:
        memo[v] = ("in", jaxpr.invars.index(v) if v in jaxpr.invars else id(v))
      else:
        params = tuple(sorted((k, repr(p)) for k, p in eqn.params.items()))
        memo[v] = (eqn.primitive.name, params, eqn.outvars.index(v),
                   tuple(key(u) for u in eqn.invars))
    return memo[v]

  return key


def _split_sink(den, source):
  """(the reduce_sum eqn, the extra term or None) of a softmax denominator
  `sum(...)` or `extra + sum(...)`; None if it is neither."""
  den_eqn, _ = source(den)
  if den_eqn is None:
    return None
  if den_eqn.primitive.name == "reduce_sum":
    return den_eqn, None
  if den_eqn.primitive.name != "add":
    return None
  for summed, extra in (den_eqn.invars, den_eqn.invars[::-1]):
    summed_eqn, _ = source(summed)
    if summed_eqn is not None and summed_eqn.primitive.name == "reduce_sum":
      return summed_eqn, extra
  return None


def _sink_logit(extra, exp_name, shift, source, structure):
  """The logit K of a sink term, in the units of `exp_name`'s argument:
  `exp(K - shift)` (`exp(-shift)` for K = 0), or without a shift a positive
  constant L = exp(K); None when `extra` is no such term."""
  _, root = source(extra)
  if is_literal(root):
    value = float(root.val)
    if shift is not None or not value > 0:
      return None
    return math.log(value) if exp_name == "exp" else math.log2(value)
  eqn, _ = source(root)
  if eqn is None or eqn.primitive.name != exp_name:
    return None
  arg_eqn, arg = source(eqn.invars[0])
  if shift is None:
    return float(arg.val) if is_literal(arg) else None
  if arg_eqn is None:
    return None
  if arg_eqn.primitive.name == "neg" and structure(arg_eqn.invars[0]) == structure(shift):
    return 0.0
  if (arg_eqn.primitive.name == "sub" and is_literal(arg_eqn.invars[0])
      and structure(arg_eqn.invars[1]) == structure(shift)):
    return float(arg_eqn.invars[0].val)
  return None


def _match_softmax(jaxpr, level, source, structure):
  """Matches out = exp(a(s) - c) / (sink + sum(exp(a(s) - c))); returns
  (the logit var, whether the base is 2, the sink logit in natural units or None)."""
  out_eqn, _ = source(jaxpr.outvars[0])
  if out_eqn is None or out_eqn.primitive.name != "div":
    return None
  num, den = out_eqn.invars
  split = _split_sink(den, source)
  if split is None:
    return None
  den_eqn, extra = split
  _, num_root = source(num)
  _, summed_root = source(den_eqn.invars[0])
  if structure(num_root) != structure(summed_root):
    return None
  exp_eqn, _ = source(num_root)
  if exp_eqn is None or exp_eqn.primitive.name not in ("exp", "exp2"):
    return None
  arg = exp_eqn.invars[0]
  sub_eqn, _ = source(arg)
  shift = None
  if sub_eqn is not None and sub_eqn.primitive.name == "sub":
    logit, shift = sub_eqn.invars
    if level(logit) != (True, False) or level(shift)[0]:
      return None
  elif level(arg) == (True, False):
    logit = arg
  else:
    return None
  base2 = exp_eqn.primitive.name == "exp2"
  sink = None
  if extra is not None:
    sink = _sink_logit(extra, exp_eqn.primitive.name, shift, source, structure)
    if sink is None:
      return None
    sink *= math.log(2.0) if base2 else 1.0
  return logit, base2, sink


def _match_normalized(jaxpr, level, source, traced):
  out_eqn, _ = source(jaxpr.outvars[0])
  if out_eqn is None or out_eqn.primitive.name not in ("div", "mul"):
    return None
  a, b = out_eqn.invars
  if level(a) != (True, False) or level(b)[0]:
    if out_eqn.primitive.name == "mul" and level(b) == (True, False) and not level(a)[0]:
      a, b = b, a
    else:
      return None
  stats, stat_vars = [], []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in _REDUCTIONS:
      if level(eqn.invars[0]) != (True, False):
        raise VariantError(
            f"rownorm '{traced.name}' reduces a value that already depends on "
            "a row reduction, so it cannot run online in one pass.")
      if eqn.primitive.name == "reduce_min":
        raise VariantError(f"rownorm '{traced.name}': row minimum is not supported online.")
      reducer = "sum" if eqn.primitive.name == "reduce_sum" else "max"
      stats.append(RowStat(reducer, RowProgram(traced, (jaxpr.invars[0],), eqn.invars[0])))
      stat_vars.append(eqn.outvars[0])
  return a, b, out_eqn.primitive.name, tuple(stats), tuple(stat_vars)


def analyze_rownorm(rownorm) -> RowNorm:
  if isinstance(rownorm, str):
    if rownorm not in NAMED_ROWNORMS:
      raise VariantError(
          f"Unknown rownorm {rownorm!r}; use one of {sorted(NAMED_ROWNORMS)} "
          "or a callable on a row of scores.")
    name, fn = rownorm, NAMED_ROWNORMS[rownorm]
  elif callable(rownorm):
    name, fn = getattr(rownorm, "__name__", "rownorm"), rownorm
  else:
    raise VariantError(f"rownorm must be a string or a callable, got {rownorm!r}")
  allowed = primitives.names(primitives.ELEMENTWISE, primitives.IDENTITY,
                             primitives.NO_GRADIENT, primitives.ROW_REDUCTION)
  traced = trace(fn, [jax.ShapeDtypeStruct((TRACE_ROWS, TRACE_KEYS), jnp.float32)],
                 name=f"rownorm '{name}'", allowed=allowed)
  jaxpr = traced.jaxpr
  for eqn in jaxpr.eqns:
    if (eqn.primitive.name == "custom_rule"
        and primitives.used_primitives(eqn.params["body"].jaxpr) & _REDUCTIONS):
      raise VariantError(
          f"rownorm '{name}' calls the {eqn.params['kind']} function '{eqn.params['name']}' "
          "on whole rows: a rule over a row cannot be split into the per-block pieces a "
          "kernel runs online. Keep row reductions outside custom_jvp / custom_vjp "
          "functions (jax.nn.softmax is recognized as it is).")
  if traced.consts:
    raise VariantError(
        f"rownorm '{name}' closes over arrays; write constants as Python "
        "numbers (a rownorm is the same for every row).")
  out_aval = jaxpr.outvars[0].aval
  if len(jaxpr.outvars) != 1 or out_aval.shape != (TRACE_ROWS, TRACE_KEYS):
    raise VariantError(
        f"rownorm '{name}' must map a row [..., Skv] to weights of the same "
        f"shape; got {[v.aval for v in jaxpr.outvars]}")
  level, source = _levels(jaxpr), _producers(jaxpr)
  score = jaxpr.invars[0]
  if not any(e.primitive.name in _REDUCTIONS for e in jaxpr.eqns):
    return RowNorm("elementwise", name, RowProgram(traced, (score,), jaxpr.outvars[0]),
                   traced=traced)
  softmax = _match_softmax(jaxpr, level, source, _structure(jaxpr))
  if softmax is not None:
    logit, base2, sink = softmax
    return RowNorm("softmax", name, RowProgram(traced, (score,), logit),
                   logit_scale=math.log(2.0) if base2 else 1.0, sink=sink, traced=traced)
  normalized = _match_normalized(jaxpr, level, source, traced)
  if normalized is None:
    raise VariantError(
        f"rownorm '{name}' is not online-decomposable: supported forms are "
        "an elementwise g(s); softmax-like exp(a(s) - c) / sum(exp(a(s) - c)), "
        "optionally with a sink term in the denominator, exp(K - c) + sum(...) "
        "for a constant K (per-head sinks: attention(..., sinks=logits)); "
        "or g(s) / h(row sums or maxes of elementwise f(s)). The output here "
        "mixes row statistics and scores in another way.")
  weights, factor, combine, stats, stat_vars = normalized
  return RowNorm("normalized", name, RowProgram(traced, (score,), weights),
                 stats=stats, factor=RowProgram(traced, stat_vars, factor),
                 combine=combine, traced=traced)
