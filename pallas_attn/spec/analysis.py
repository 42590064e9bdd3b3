"""The analysis of a variant: what the kernel templates are parameterized by.

`analyze_variant` traces score_mod, mask_mod and rownorm and returns one
`VariantAnalysis`: the elementwise programs with their captured-array reads,
which indices each depends on, whether score_mod uses the score or is a pure
bias, and the rownorm class. Its fingerprint (a hash of the analyzed jaxprs
and the captured arrays' shapes) keys the tuning cache.
"""
from __future__ import annotations

import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from pallas_attn.spec import captures as captures_lib
from pallas_attn.spec import primitives, separable
from pallas_attn.spec.captures import GATHERED, position_free
from pallas_attn.spec.rownorm import RowNorm, analyze_rownorm
from pallas_attn.spec.trace import eval_inlined
from pallas_attn.spec.trace import VariantError, trace

_ELEMENTWISE_ALLOWED = primitives.names(
    primitives.ELEMENTWISE, primitives.IDENTITY, primitives.NO_GRADIENT, primitives.INDEX)
_INDEX = jax.ShapeDtypeStruct((), jnp.int32)
_SCORE = jax.ShapeDtypeStruct((), jnp.float32)
_TERM_NOTE = ("a part that depends on the positions only through q_idx - kv_idx, computed "
              "once per call over the Sq + Skv - 1 diagonals (a vector per head) instead of "
              "per position; kept per position where an array it reads is differentiated")


@dataclasses.dataclass(frozen=True)
class VariantAnalysis:
  score_mod: captures_lib.ElementwiseProgram | None
  mask_mod: captures_lib.ElementwiseProgram | None
  rownorm: RowNorm

  @property
  def score_uses_score(self) -> bool:
    return self.score_mod is not None and "score" in self.score_mod.deps

  def without_terms(self) -> VariantAnalysis:
    """The analysis with score_mod's diagonal terms computed in the kernel."""
    if self.score_mod is None or not self.score_mod.terms:
      return self
    return dataclasses.replace(self, score_mod=self.score_mod.without_terms())

  @property
  def separable_bias(self) -> bool:
    """score_mod is `score + R(b, h, q_idx) + C(b, h, kv_idx)` (spec/separable.py)."""
    return self.score_mod is not None and self.score_mod.separable

  @property
  def affine_columns(self) -> bool:
    """A separable bias whose part along kv_idx is affine in it (spec/separable.py)."""
    return self.separable_bias and self.score_mod.affine_kv

  @property
  def scores_per_position(self) -> bool:
    """score_mod is evaluated at every position: present, and no bias that
    the kernels build from vectors (a template's heuristic may size tiles by it)."""
    return self.score_mod is not None and not self.separable_bias

  @property
  def mask_deps(self) -> frozenset:
    """Indices the mask depends on ('b', 'h', 'q', 'kv')."""
    return frozenset() if self.mask_mod is None else self.mask_mod.deps

  def fingerprint(self) -> str:
    """Stable hash of the analyzed programs (not of captured values)."""
    h = hashlib.sha256()
    for part in (self.score_mod, self.mask_mod):
      if part is None:
        h.update(b"none;")
        continue
      h.update(str(part.traced.jaxpr).encode())
      for c in part.traced.consts:
        h.update(f"{np.shape(c)}{jnp.result_type(c)};".encode())
    h.update(self.rownorm.kind.encode())
    h.update(str(self.rownorm.traced.jaxpr).encode())
    return h.hexdigest()[:16]

  def describe(self) -> str:
    lines = [f"rownorm: {self.rownorm.name} -> {self.rownorm.describe()}"]
    lines += _custom_rules(self.rownorm.traced.jaxpr)
    for label, prog in (("score_mod", self.score_mod), ("mask_mod", self.mask_mod)):
      if prog is None:
        lines.append(f"{label}: none")
        continue
      deps = ", ".join(sorted(prog.deps)) or "nothing"
      kind = ""
      if label == "score_mod":
        kind = " (uses the score)" if self.score_uses_score else " (index-only bias)"
      lines.append(f"{label}: {len(prog.traced.jaxpr.eqns)} primitives, "
                   f"depends on {deps}{kind}")
      if label == "score_mod" and self.separable_bias:
        columns = ("a column vector, made once per program in the forward (C is affine in "
                   "kv_idx) and per tile in the backward" if self.affine_columns
                   else "a column vector per tile")
        lines.append("  separable bias score + R(q_idx) + C(kv_idx): the Mosaic GPU kernels "
                     f"build it from a row vector and {columns}")
      lines += _custom_rules(prog.traced.jaxpr)
      for use in prog.uses:
        if use.is_term:
          lines.append(f"  hoists {use.describe(())}: {_TERM_NOTE}")
          continue
        shape = np.shape(prog.traced.consts[use.capture])
        if use.is_gather:
          grad = (" (its gradient: one tile sum per distinct index in each tile)"
                  if label == "score_mod" else "")
          lines.append(f"  reads {use.describe(shape)}: gathers at the computed, clamped "
                       f"index per position{grad}")
          continue
        blocking = ", ".join(
            {"q": "block_q rows", "kv": "block_k keys"}.get(a, "one element")
            if isinstance(a, str) else f"fixed {a}" for a in use.axes) or "scalar"
        where = ("per program (Mosaic GPU) or per tile (Triton)"
                 if position_free(use.axes) else "per tile")
        lines.append(f"  reads {use.describe(shape)}: loads {blocking} {where}")
    if self.mask_mod is not None:
      broadcast = [n for n in ("b", "h") if n not in self.mask_deps]
      lines.append("block sparsity: tiles classified from mask_mod (what the build costs: the 'block mask' line of pallas-attn explain)"
                   + (f", broadcast over {'/'.join(broadcast)}" if broadcast else ""))
    lines.append(f"fingerprint: {self.fingerprint()}")
    return "\n".join(lines)


def _custom_rules(jaxpr) -> list:
  """explain's lines on the custom_jvp / custom_vjp functions a program calls."""
  return [f"  calls the {eqn.params['kind']} function '{eqn.params['name']}': its body "
          "forward, its rule in the backward" for eqn in jaxpr.eqns
          if eqn.primitive.name == "custom_rule"]


def _check_scalar_output(traced, dtype_kind: str, name: str):
  outs = traced.jaxpr.outvars
  if len(outs) != 1 or outs[0].aval.shape != ():
    raise VariantError(
        f"{name} must return one scalar per (b, h, q_idx, kv_idx); got "
        f"{[v.aval.str_short() for v in outs]}. It is traced on scalars: "
        "write it elementwise.")
  if jnp.dtype(outs[0].aval.dtype).kind not in dtype_kind:
    raise VariantError(f"{name} returns {outs[0].aval.dtype}; expected "
                       + ("a boolean" if dtype_kind == "b" else "a float"))


def consts_of(analysis: VariantAnalysis) -> tuple:
  """(score_mod's, mask_mod's) captured arrays, () where a program is absent:
  what `as_mods` takes back."""
  return tuple(() if prog is None else tuple(prog.traced.consts)
               for prog in (analysis.score_mod, analysis.mask_mod))


def as_mods(analysis: VariantAnalysis, consts) -> tuple:
  """(score_mod, mask_mod) callables evaluating the analyzed programs on
  `consts` (score_mod's, mask_mod's captured arrays; None where a program is
  absent): for callers that rewrap them, inside a shard_map or a partitioned
  shard, on captured arrays given as operands rather than closed over."""
  score_mod = mask_mod = None
  if analysis.score_mod is not None:
    def score_mod(score, b, h, q_idx, kv_idx):
      return eval_inlined(analysis.score_mod.traced.jaxpr, consts[0], score, b, h, q_idx,
                          kv_idx)[0]
  if analysis.mask_mod is not None:
    def mask_mod(b, h, q_idx, kv_idx):
      return eval_inlined(analysis.mask_mod.traced.jaxpr, consts[1], b, h, q_idx, kv_idx)[0]
  return score_mod, mask_mod


def analyze_variant(score_mod=None, mask_mod=None, rownorm="softmax") -> VariantAnalysis:
  """Traces and analyzes the three callables of a variant."""
  score_prog = mask_prog = None
  if score_mod is not None:
    traced = trace(score_mod, [_SCORE, _INDEX, _INDEX, _INDEX, _INDEX],
                   name="score_mod", allowed=_ELEMENTWISE_ALLOWED)
    _check_scalar_output(traced, "f", "score_mod")
    score_prog = captures_lib.analyze_elementwise(
        traced, ("score", "b", "h", "q", "kv"), hoist=True)
    scalar_reads = all(not {"q", "kv", GATHERED} & set(use.axes) for use in score_prog.uses)
    # A bias of one position only is left to the per-score path: Mosaic GPU found no
    # layouts for a kv-only bias built from vectors (JAX 0.11.2, non-causal forward).
    if (scalar_reads and not score_prog.terms and {"q", "kv"} <= score_prog.deps
        and separable.is_separable(traced.jaxpr, score_prog.inputs)):
      score_prog = dataclasses.replace(
          score_prog, separable=True,
          affine_kv=separable.kv_part_is_affine(traced.jaxpr, score_prog.inputs))
  if mask_mod is not None:
    traced = trace(mask_mod, [_INDEX, _INDEX, _INDEX, _INDEX],
                   name="mask_mod", allowed=_ELEMENTWISE_ALLOWED)
    _check_scalar_output(traced, "b", "mask_mod")
    mask_prog = captures_lib.analyze_elementwise(traced, ("b", "h", "q", "kv"))
  return VariantAnalysis(score_prog, mask_prog, analyze_rownorm(rownorm))
