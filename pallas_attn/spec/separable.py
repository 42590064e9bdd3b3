"""score_mods that add a bias separable in the positions.

ALiBi's `score + slope[h] * (kv_idx - q_idx)` has the form `score + E(q_idx,
kv_idx)` with `E(q, kv) = R(q) + C(kv)` (b and h held fixed). Evaluated per
position, E costs index tiles, a subtraction, a conversion and a multiply at
every score: on an H100 the Mosaic forward ran ALiBi at 422 TFLOP/s against
592 for causal attention (probe_score_cost in benchmarks/results/NOTES.md). For such a
program a lowering may instead evaluate E on vectors: for any origin q0,

    E(q, kv) = [E(q, 0) - E(q0, 0)] + E(q0, kv),

a vector over the program's own rows, computed once, plus a vector over the
tile's columns, computed per tile; two additions per score remain. With q0
the program's first row both vectors stay near the magnitudes the reference
adds, so nothing large cancels.

`is_separable` decides it from the jaxpr's structure: the output is the
score plus a sum of parts each depending on one position; products and
quotients only by values that depend on neither; integer parts converted to
float32 (exact for positions below 2^24).

Where E is also affine in kv (ALiBi's is), the column vector need not be
evaluated per tile: E(q0, k0 + j) - E(q0, q0) = [E(q0, q0 + j) - E(q0, q0)]
+ [E(q0, k0) - E(q0, q0)], a vector computed once per program plus one
number per tile (`kv_part_is_affine`). On an H200 the per-tile vector was
most of ALiBi's forward cost over vanilla attention (16k: 4.04-4.11 ms
against 3.51-3.65; 3.69-3.84 with no column vector at all).
"""
from __future__ import annotations

import numpy as np

from pallas_attn.spec import primitives
from pallas_attn.spec.trace import is_literal

CONST, Q, KV, SEPARABLE, SCORE_PLUS = "const", "q", "kv", "separable", "score+"
# Not stop_gradient: `stop_gradient(score) + bias` is no `score + bias` to the backward.
_IDENTITIES = primitives.names(primitives.IDENTITY)


def _combine(forms) -> str:
  """The form of a sum of non-score forms."""
  kinds = set(forms) - {CONST}
  if not kinds:
    return CONST
  if len(kinds) == 1:
    return kinds.pop()
  return SEPARABLE


def _form(eqn, forms):
  """The output form of `eqn` given its operands' forms, or None (not of the
  forms above)."""
  prim = eqn.primitive.name
  if None in forms:
    return None
  if set(forms) <= {CONST, Q} or set(forms) <= {CONST, KV}:
    return _combine(forms)  # any function of one position (or of neither)
  if prim in _IDENTITIES:
    return forms[0]
  if prim == "convert_element_type":
    if forms[0] == SCORE_PLUS:
      return SCORE_PLUS if eqn.params["new_dtype"] == eqn.invars[0].aval.dtype else None
    # Into float32 only: a sum rounded to fewer bits is not the sum of its rounded parts.
    return SEPARABLE if np.dtype(eqn.params["new_dtype"]) == np.float32 else None
  if prim == "add":
    if forms.count(SCORE_PLUS) == 1:
      return SCORE_PLUS
    return None if SCORE_PLUS in forms else _combine(forms)
  if prim == "sub":
    if forms[1] == SCORE_PLUS:
      return None
    return SCORE_PLUS if forms[0] == SCORE_PLUS else _combine(forms)
  if prim == "neg":
    return None if forms[0] == SCORE_PLUS else forms[0]
  if prim == "mul" and SCORE_PLUS not in forms and CONST in forms:
    return _combine(forms)
  floating = np.issubdtype(eqn.outvars[0].aval.dtype, np.floating)
  if prim == "div" and floating and SCORE_PLUS not in forms and forms[1] == CONST:
    return forms[0]  # integer division truncates: (a + b) / c is not a / c + b / c
  return None


def is_separable(jaxpr, inputs) -> bool:
  """Whether a score_mod jaxpr (inputs named by `inputs`: score, b, h, q,
  kv) computes `score + R(b, h, q_idx) + C(b, h, kv_idx)`."""
  start = {"score": SCORE_PLUS, "q": Q, "kv": KV}
  forms = {var: start.get(name, CONST) for var, name in zip(jaxpr.invars, inputs)}
  forms.update({var: CONST for var in jaxpr.constvars})
  read = lambda v: CONST if is_literal(v) else forms.get(v)
  for eqn in jaxpr.eqns:
    form = _form(eqn, [read(v) for v in eqn.invars])
    for v in eqn.outvars:
      forms[v] = form
  out, = jaxpr.outvars
  return read(out) == SCORE_PLUS


def kv_part_is_affine(jaxpr, inputs) -> bool:
  """Whether a separable score_mod's jaxpr is affine in kv_idx: every value
  that depends on kv is kv added to, subtracted from, negated or multiplied
  by values that do not, or converted to float32 (exact for positions below
  2^24). Division is left out: these are the forms compiled and checked on
  Hopper."""
  on_kv = {var: name == "kv" for var, name in zip(jaxpr.invars, inputs)}  # affine so far
  read = lambda v: False if is_literal(v) else on_kv.get(v, False)
  for eqn in jaxpr.eqns:
    tags = [read(v) for v in eqn.invars]
    prim = eqn.primitive.name
    if any(tags) and not (
        prim in ("add", "sub", "neg") or prim in _IDENTITIES
        or (prim == "convert_element_type"
            and np.dtype(eqn.params["new_dtype"]) == np.float32)
        or (prim == "mul" and not all(tags))):
      return False
    for v in eqn.outvars:
      on_kv[v] = any(tags)
  return True
