"""Tracing user callables into flat jaxprs, with errors a user can act on.

A callable is traced once on abstract values. Nested calls (`jit`,
`custom_jvp` functions such as `jax.nn.relu` or `jax.nn.softmax`) are inlined
so that the analysis and the in-kernel interpreter see one flat list of
primitives. Before inlining, every primitive is checked against what the
kernel templates can lower, so an error can name the primitive and the user's
source line.
"""
from __future__ import annotations

import contextlib
import dataclasses
import traceback

import jax
from jax import core as jax_core
from jax.extend import core as jex_core


class VariantError(ValueError):
  """A score_mod / mask_mod / rownorm that pallas_attn cannot compile."""


# Primitives applied elementwise (on broadcastable blocks) inside kernels.
ELEMENTWISE_PRIMITIVES = frozenset("""
add sub mul div neg max min abs sign floor ceil round rem pow integer_pow
exp exp2 log log1p expm1 tanh logistic sin cos tan sqrt rsqrt cbrt square
erf atan2 is_finite select_n clamp eq ne lt le gt ge and or not xor
convert_element_type stop_gradient copy copy_p shift_left
shift_right_arithmetic shift_right_logical
""".split())
# Shape-only primitives: identities on the logically-scalar values we trace.
SHAPE_PRIMITIVES = frozenset(
    "broadcast_in_dim reshape squeeze expand_dims".split())
# Indexing of captured arrays (resolved by spec/captures.py).
INDEX_PRIMITIVES = frozenset(["dynamic_slice"])
# Row reductions: only inside a rownorm callable.
REDUCTION_PRIMITIVES = frozenset(["reduce_sum", "reduce_max", "reduce_min"])
# Calls that are inlined.
_CALL_PARAMS = {
    "pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat": "jaxpr", "checkpoint": "jaxpr",
}


@dataclasses.dataclass(frozen=True)
class TracedFn:
  """A flat closed jaxpr of a user callable and what it captured."""
  name: str
  jaxpr: jex_core.Jaxpr
  consts: tuple  # captured arrays (concrete or tracers of an outer trace)


def source_line(eqn) -> str:
  try:
    from jax._src import source_info_util
    return source_info_util.summarize(eqn.source_info)
  except Exception:  # pragma: no cover - internal API moved
    return ""


def _sub_jaxpr(eqn):
  key = _CALL_PARAMS.get(eqn.primitive.name)
  if key is None:
    return None
  sub = eqn.params[key]
  return sub.jaxpr if hasattr(sub, "jaxpr") else sub


def check_primitives(jaxpr, allowed: frozenset, fn_name: str, outer_line: str = "") -> None:
  """Raises VariantError naming the first primitive the kernel cannot lower.

  Inside an inlined call (a jnp function), the user's line is the call's.
  """
  for eqn in jaxpr.eqns:
    line = source_line(eqn) or outer_line
    sub = _sub_jaxpr(eqn)
    if sub is not None:
      check_primitives(sub, allowed, fn_name, outer_line or line)
    elif eqn.primitive.name not in allowed:
      hint = ""
      if eqn.primitive.name == "gather":
        hint = (" Index captured arrays with plain scalar indexing, e.g. "
                "bias[b, h, q_idx, kv_idx] or slopes[h].")
      elif eqn.primitive.name in REDUCTION_PRIMITIVES:
        hint = " score_mod and mask_mod are elementwise: no reductions."
      raise VariantError(
          f"{fn_name} uses the primitive '{eqn.primitive.name}' at "
          f"{outer_line or line or '<unknown location>'}, which the Pallas kernel cannot lower "
          f"inside an attention block.{hint}")


def _user_source(eqn):
  """Keeps the user's source line on re-bound equations (for error messages)."""
  try:
    from jax._src import source_info_util
    return source_info_util.user_context(eqn.source_info.traceback,
                                         name_stack=eqn.source_info.name_stack)
  except Exception:  # pragma: no cover - internal API moved
    return contextlib.nullcontext()


def eval_inlined(jaxpr, consts, *args, overrides=None):
  """Evaluates `jaxpr` by binding its primitives in the current trace, call
  primitives (jit, custom_jvp, ...) inlined; `overrides` maps primitive
  names to functions bound instead."""
  overrides = overrides or {}
  env = {}

  def read(v):
    return v.val if isinstance(v, jex_core.Literal) else env[v]

  for var, val in zip(jaxpr.constvars, consts):
    env[var] = val
  for var, val in zip(jaxpr.invars, args):
    env[var] = val
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    key = _CALL_PARAMS.get(eqn.primitive.name)
    if key is not None:
      sub = eqn.params[key]
      sub_jaxpr, sub_consts = (sub.jaxpr, sub.consts) if hasattr(sub, "jaxpr") else (sub, ())
      if eqn.primitive.name.startswith("custom_vjp"):
        invals = invals[len(invals) - len(sub_jaxpr.invars):]
      outs = eval_inlined(sub_jaxpr, sub_consts, *invals, overrides=overrides)
    elif eqn.primitive.name in overrides:
      outs = [overrides[eqn.primitive.name](*invals)]
    else:
      with _user_source(eqn):
        outs = eqn.primitive.bind(*invals, **eqn.params)
      if not eqn.primitive.multiple_results:
        outs = [outs]
    for var, val in zip(eqn.outvars, outs):
      env[var] = val
  return [read(v) for v in jaxpr.outvars]


def _user_frame(exc: BaseException) -> str:
  frames = [f for f in traceback.extract_tb(exc.__traceback__)
            if "/jax/" not in f.filename and "/pallas_attn/" not in f.filename]
  if not frames:
    return ""
  f = frames[-1]
  return f" at {f.filename}:{f.lineno} ({f.line})"


def trace(fn, avals, *, name: str, allowed: frozenset) -> TracedFn:
  """Traces `fn` on `avals` into a flat jaxpr of allowed primitives."""
  try:
    closed = jax.make_jaxpr(fn)(*avals)
  except (jax.errors.ConcretizationTypeError,
          jax.errors.TracerBoolConversionError,
          jax.errors.TracerIntegerConversionError) as e:
    raise VariantError(
        f"{name} uses Python control flow on a traced value{_user_frame(e)}. "
        "Inside score_mod, mask_mod and rownorm use jnp.where / lax.select "
        "instead of if/while on scores or indices.") from e
  except IndexError as e:
    raise VariantError(f"{name} failed to trace{_user_frame(e)}: {e}") from e
  check_primitives(closed.jaxpr, allowed, name)
  flat = jax.make_jaxpr(
      lambda *a: eval_inlined(closed.jaxpr, closed.consts, *a))(*avals)
  return TracedFn(name=name, jaxpr=flat.jaxpr, consts=tuple(flat.consts))


def is_literal(v) -> bool:
  return isinstance(v, jex_core.Literal)


def is_concrete(x) -> bool:
  return not isinstance(x, jax_core.Tracer)
