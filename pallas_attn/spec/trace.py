"""Tracing user callables into flat jaxprs, with errors a user can act on.

A callable is traced once on abstract values. Nested calls (`jit`,
`checkpoint`) are inlined so that the analysis and the in-kernel interpreter
see one flat list of primitives. A `jax.custom_jvp` or `jax.custom_vjp`
function becomes one `custom_rule` equation that keeps its rule
(spec/primitives.py). Every primitive, those of the custom rules included,
is checked against the rule table, so an error can name the primitive and
the user's source line.
"""
from __future__ import annotations

import contextlib
import dataclasses
import traceback

import jax
import jax.numpy as jnp
from jax import core as jax_core
from jax.extend import core as jex_core

from pallas_attn.spec import primitives


class VariantError(ValueError):
  """A score_mod / mask_mod / rownorm that pallas_attn cannot compile."""


# Calls that are inlined: their derivative is their body's.
_CALL_PARAMS = {
    "pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr", "remat": "jaxpr", "checkpoint": "jaxpr",
}
# Calls that carry a derivative rule of their own.
_CUSTOM_CALLS = frozenset(["custom_jvp_call", "custom_vjp_call"])
# JAX's own custom_jvp functions whose rule is the derivative of their body,
# written for numerical safety only: inlined, so that the rownorm analysis
# sees the softmax inside `jax.nn.softmax` (under `jax_softmax_custom_jvp`).
_EXACT_LIBRARY_RULES = frozenset(["_softmax"])


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


def _call_body(eqn):
  """(jaxpr, consts, how many leading inputs it does not take) of an
  inlined or custom call, or None for other equations."""
  name = eqn.primitive.name
  if name in _CUSTOM_CALLS:
    sub = eqn.params["call_jaxpr"]
  elif name in _CALL_PARAMS:
    sub = eqn.params[_CALL_PARAMS[name]]
  else:
    return None
  jaxpr, consts = (sub.jaxpr, sub.consts) if hasattr(sub, "jaxpr") else (sub, ())
  return jaxpr, consts, len(eqn.invars) - len(jaxpr.invars)


def _function_source(eqn) -> str:
  """A custom_jvp / custom_vjp function's name and where it is defined
  ('clip at model.py:12')."""
  info = getattr(eqn.params["call_jaxpr"].jaxpr, "debug_info", None)
  return getattr(info, "func_src_info", None) or "<function>"


def _exact_library_rule(eqn) -> bool:
  where = _function_source(eqn)
  return "/jax/_src/" in where and where.split(" at ")[0] in _EXACT_LIBRARY_RULES


def check_primitives(jaxpr, allowed: frozenset, fn_name: str, outer_line: str = "") -> None:
  """Raises VariantError naming the first primitive the kernel cannot lower.

  Inside an inlined call (a jnp function), the user's line is the call's.
  """
  for eqn in jaxpr.eqns:
    line = source_line(eqn) or outer_line
    body = _call_body(eqn)
    if body is not None:
      check_primitives(body[0], allowed, fn_name, outer_line or line)
    elif eqn.primitive.name not in allowed:
      hint = ""
      if eqn.primitive.name == "gather":
        hint = (" Index captured arrays with plain scalar indexing, e.g. "
                "bias[b, h, q_idx, kv_idx] or slopes[h].")
      elif primitives.role(eqn.primitive.name) == primitives.ROW_REDUCTION:
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


def eval_inlined(jaxpr, consts, *args, overrides=None, custom_call=None):
  """Evaluates `jaxpr` by binding its primitives in the current trace, call
  primitives (jit, checkpoint) inlined; `overrides` maps primitive names to
  functions bound instead.

  A custom_rule equation runs as the `jax.custom_vjp` function it stands
  for (its rule kept, in plain JAX). JAX's custom_jvp / custom_vjp calls
  are passed to `custom_call(eqn, invals)`; by default their body is
  inlined, which evaluates them but drops their rule: for programs that are
  not differentiated afterwards.
  """
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
    name = eqn.primitive.name
    body = _call_body(eqn)
    if name in _CUSTOM_CALLS and custom_call is not None:
      with _user_source(eqn):
        outs = custom_call(eqn, invals)
    elif body is not None:
      sub_jaxpr, sub_consts, skipped = body
      outs = eval_inlined(sub_jaxpr, sub_consts, *invals[skipped:], overrides=overrides,
                          custom_call=custom_call)
    elif name == "custom_rule":
      run = lambda closed, xs: eval_inlined(closed.jaxpr, closed.consts, *xs)
      outs = primitives.as_custom_vjp(eqn.params, run)(*invals)
    elif name in overrides:
      outs = [overrides[name](*invals)]
    else:
      with _user_source(eqn):
        outs = eqn.primitive.bind(*invals, **eqn.params)
      if not eqn.primitive.multiple_results:
        outs = [outs]
    for var, val in zip(eqn.outvars, outs):
      env[var] = val
  return [read(v) for v in jaxpr.outvars]


def _flat(fn, avals):
  """The flat closed jaxpr of `fn` on `avals`, calls inlined (rules dropped)."""
  closed = jax.make_jaxpr(fn)(*avals)
  return jax.make_jaxpr(lambda *a: eval_inlined(closed.jaxpr, closed.consts, *a))(*avals)


def _custom_rule(eqn, invals, allowed: frozenset, fn_name: str):
  """Binds a custom_jvp / custom_vjp call as a custom_rule equation: its
  body and the vector-Jacobian product of its rule, each traced by JAX at
  the call's shapes and checked against `allowed`."""
  sub_jaxpr, sub_consts, skipped = _call_body(eqn)
  if _exact_library_rule(eqn):
    return eval_inlined(sub_jaxpr, sub_consts, *invals[skipped:])
  in_avals = [v.aval for v in eqn.invars]
  out_avals = [v.aval for v in eqn.outvars]
  differentiable = tuple(n for n, a in enumerate(in_avals)
                         if jnp.issubdtype(a.dtype, jnp.inexact))

  def call(*xs):
    return eqn.primitive.bind(*xs, **eqn.primitive.get_bind_params(eqn.params))

  def vjp(*args):
    xs, cotangents = list(args[:len(in_avals)]), list(args[len(in_avals):])

    def of_differentiable(*d):
      for n, x in zip(differentiable, d):
        xs[n] = x
      return call(*xs)
    _, pullback = jax.vjp(of_differentiable, *[xs[n] for n in differentiable])
    return pullback(cotangents)

  body = _flat(lambda *xs: eval_inlined(sub_jaxpr, sub_consts, *xs[skipped:]), in_avals)
  rule = _flat(vjp, in_avals + out_avals)
  kind = eqn.primitive.name.replace("_call", "")
  source = _function_source(eqn)
  where = f"{fn_name} calls the {kind} function {source}"
  check_primitives(body.jaxpr, allowed, f"{where}, whose body")
  check_primitives(rule.jaxpr, allowed, f"{where}, whose derivative rule")
  return primitives.custom_rule_p.bind(
      *invals, name=source.split(" at ")[0], kind=kind, body=body, vjp=rule,
      differentiable=differentiable)


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
  custom_call = lambda eqn, invals: _custom_rule(eqn, invals, allowed, name)
  flat = jax.make_jaxpr(lambda *a: eval_inlined(closed.jaxpr, closed.consts, *a,
                                                custom_call=custom_call))(*avals)
  return TracedFn(name=name, jaxpr=flat.jaxpr, consts=tuple(flat.consts))


def is_literal(v) -> bool:
  return isinstance(v, jex_core.Literal)


def is_concrete(x) -> bool:
  return not isinstance(x, jax_core.Tracer)


def staging() -> bool:
  """Whether operations called now are staged into a program being traced
  (`jax.jit`, `jax.make_jaxpr`, a scan's body), not run: a new constant is
  a tracer there. Eager `jax.grad` and `jax.vmap` run them at once."""
  return not is_concrete(jnp.zeros((), jnp.int32))
