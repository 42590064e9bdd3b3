"""Parts of score_mod that depend on the positions only through q_idx - kv_idx.

A relative-position bias (a learned table read at `q_idx - kv_idx`, T5's
log-spaced buckets of it) takes one value per diagonal of the score matrix.
Evaluated on every tile it costs a gather, and T5's log and divisions, at
every position; evaluated once per call over the `Sq + Skv - 1` diagonals
in plain JAX it is one vector per head (linear memory), from which the
kernels read their tiles (`kernels/tiles.py`).

`find_terms` picks the subexpressions worth it: float values whose inputs
are `h`, captured arrays and one difference `a * (q_idx - kv_idx) + c`,
maximal (used by something that depends on more), and holding a read at a
computed index or a transcendental. Cheap ones (ALiBi's `slope[h] * (kv -
q)`) stay in the kernel: recomputing them costs less than loading them.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_attn.spec.blockeval import needed_equations
from pallas_attn.spec.trace import eval_inlined, is_literal

DIAGONAL = "diagonal"  # the axis of a term's vector: q_idx - kv_idx
_DIFFERENCE = "q-kv"   # source name of a value that is a * (q_idx - kv_idx) + c
_COSTLY = frozenset("""
exp exp2 log log1p expm1 div pow sqrt rsqrt cbrt tanh logistic sin cos tan erf atan2 rem
""".split())


@dataclasses.dataclass(frozen=True)
class DiagonalTerm:
  """A hoisted subexpression: `var` of the program's jaxpr, one value per
  (head if `per_head`, q_idx - kv_idx); `captures`: the indices of the
  captured arrays it reads (their gradients need the unhoisted program)."""
  var: object
  per_head: bool
  captures: frozenset


def _affine(eqn, forms):
  """The (q, kv) coefficients of an integer equation's output if it is an
  affine function `cq * q_idx + ckv * kv_idx + c`, else None; `forms` gives
  the operands' (None: not affine)."""
  prim = eqn.primitive.name
  if prim == "convert_element_type" and np.dtype(eqn.params["new_dtype"]).kind in "iu":
    return forms[0]
  if prim in ("add", "sub") and None not in forms:
    sign = 1 if prim == "add" else -1
    return (forms[0][0] + sign * forms[1][0], forms[0][1] + sign * forms[1][1])
  if prim == "neg" and forms[0] is not None:
    return (-forms[0][0], -forms[0][1])
  if prim == "mul" and None not in forms:
    (aq, akv), (bq, bkv) = forms
    if aq == akv == 0 or bq == bkv == 0:  # a constant factor
      const = eqn.invars[0] if aq == akv == 0 else eqn.invars[1]
      if is_literal(const):
        factor = int(const.val)
        other = forms[1] if aq == akv == 0 else forms[0]
        return (factor * other[0], factor * other[1])
  return None


def find_terms(jaxpr, inputs) -> tuple:
  """The subexpressions of a score_mod jaxpr (inputs named by `inputs`) to
  hoist out of the kernel, as DiagonalTerms."""
  sources = {}  # var -> frozenset of input names, _DIFFERENCE standing for q_idx - kv_idx
  forms = {}    # var -> (cq, ckv) for affine integer values of q_idx and kv_idx
  costly = {}   # var -> whether computing it reads at a computed index or is transcendental
  for var, name in zip(jaxpr.invars, inputs):
    sources[var] = frozenset([name])
    if name in ("q", "kv"):
      forms[var] = (1, 0) if name == "q" else (0, 1)
  for var in jaxpr.constvars:
    sources[var] = frozenset()

  def src(v):
    return frozenset() if is_literal(v) else sources.get(v, frozenset())

  def form(v):
    if is_literal(v) or not src(v):
      integer = np.dtype(v.aval.dtype).kind in "iu" and v.aval.shape == ()
      return (0, 0) if integer else None
    return forms.get(v)

  users = {}
  for eqn in jaxpr.eqns:
    out = eqn.outvars[0]
    merged = frozenset().union(*[src(v) for v in eqn.invars])
    affine = _affine(eqn, [form(v) for v in eqn.invars])
    if affine is not None and affine != (0, 0):
      forms[out] = affine
      merged = frozenset([_DIFFERENCE]) if affine[0] == -affine[1] else merged
    prim = eqn.primitive.name
    gathers = prim == "dynamic_slice" and any(_DIFFERENCE in src(v) for v in eqn.invars[1:])
    costly[out] = (prim in _COSTLY or gathers
                   or any(costly.get(v, False) for v in eqn.invars if not is_literal(v)))
    for v in eqn.outvars:
      sources[v] = merged
    for v in eqn.invars:
      if not is_literal(v):
        users.setdefault(v, []).append(out)

  def diagonal(v):
    s = src(v)
    return _DIFFERENCE in s and s <= {_DIFFERENCE, "h"}

  terms = []
  for eqn in jaxpr.eqns:
    out = eqn.outvars[0]
    if not (diagonal(out) and costly[out] and out.aval.shape == ()
            and jnp.issubdtype(out.aval.dtype, jnp.floating)):
      continue
    used_beyond = any(not diagonal(u) for u in users.get(out, ())) or out in jaxpr.outvars
    if used_beyond:
      terms.append(DiagonalTerm(out, "h" in src(out), _captures_read(jaxpr, out)))
  return tuple(terms)


def _captures_read(jaxpr, var) -> frozenset:
  """Indices of the jaxpr's constvars that `var` is computed from."""
  constvars = {v: n for n, v in enumerate(jaxpr.constvars)}
  read = set()
  for n in needed_equations(jaxpr, [var], set()):
    read.update(constvars[v] for v in jaxpr.eqns[n].invars
                if not is_literal(v) and v in constvars)
  return frozenset(read)


def term_vector(jaxpr, consts, inputs, term: DiagonalTerm, heads: int, seq_q: int,
                seq_kv: int):
  """`[heads or 1, seq_q + seq_kv - 1]` float32: the term at each head and
  `q_idx - kv_idx` from `-(seq_kv - 1)` to `seq_q - 1` (index `q - kv +
  seq_kv - 1`). Each diagonal is evaluated at one (q_idx, kv_idx) on it:
  the term depends on them only through their difference."""
  program = jaxpr.replace(outvars=[term.var])

  def at(h, d):
    values = {"score": jnp.float32(0), "b": jnp.int32(0), "h": h,
              "q": jnp.maximum(d, 0), "kv": jnp.maximum(-d, 0)}
    return eval_inlined(program, consts, *[values[name] for name in inputs])[0]

  diagonals = jnp.arange(-(seq_kv - 1), seq_q, dtype=jnp.int32)
  head_ids = jnp.arange(heads if term.per_head else 1, dtype=jnp.int32)
  per_head = jax.vmap(lambda h: jax.vmap(lambda d: at(h, d))(diagonals))
  return per_head(head_ids).astype(jnp.float32)
