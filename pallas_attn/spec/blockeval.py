"""Evaluates a traced callable on tiles inside a kernel.

The user's callables are traced on logically scalar values (a score, an
index). Inside a kernel the same program runs on tiles: the score is a
`[block_q, block_k]` tile, `q_idx` a `[block_q, 1]` column, `kv_idx` a
`[1, block_k]` row, `b` and `h` scalars. Each primitive runs as its role in
the rule table (spec/primitives.py) says: elementwise primitives after
broadcasting their operands to a common shape, identities pass their
operand, row reductions (rownorm programs only) reduce the last axis
keeping it. Only the equations a requested output needs are run.

`differentiable=True` is for evaluations that the caller differentiates
(the backward's tile gradients, a rownorm's row factor): `stop_gradient`
then blocks gradients and custom rules replace their body's derivative.
Elsewhere both run as their forward alone, so that no kernel binds them.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_attn.spec import primitives
from pallas_attn.spec.trace import is_literal

_REDUCERS = {"reduce_sum": jnp.sum, "reduce_max": jnp.max, "reduce_min": jnp.min}


def needed_equations(jaxpr, outputs, known) -> list:
  """Indices of the equations that `outputs` need, given the `known` vars."""
  producer = {v: n for n, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
  needed, stack = set(), [v for v in outputs if not is_literal(v)]
  seen = set()
  while stack:
    v = stack.pop()
    if v in seen or v in known:
      continue
    seen.add(v)
    n = producer.get(v)
    if n is None:
      continue
    needed.add(n)
    stack.extend(u for u in jaxpr.eqns[n].invars if not is_literal(u))
  return sorted(needed)


def _broadcast(invals):
  arrays = [jnp.asarray(x) for x in invals]
  shape = jnp.broadcast_shapes(*[a.shape for a in arrays])
  return [a if a.shape == shape else jnp.broadcast_to(a, shape) for a in arrays]


def _custom_rule(eqn, invals, overrides, differentiable: bool):
  """A custom_rule call on tiles: its body, or with `differentiable` the
  `jax.custom_vjp` function whose backward is the user's rule."""
  def run(closed, args):
    jaxpr = closed.jaxpr
    env = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, args))
    return evaluate(jaxpr, env, jaxpr.outvars, overrides=overrides)

  if not differentiable:
    return run(eqn.params["body"], invals)
  return primitives.as_custom_vjp(eqn.params, run)(*_broadcast(invals))


def evaluate(jaxpr, env: dict, outputs, skip=frozenset(), overrides=None,
             differentiable: bool = False):
  """Runs the equations of `jaxpr` that `outputs` need on tile values.

  `env` maps jaxpr vars to tile values (inputs and loaded captures).
  `overrides` maps primitive names to replacement implementations taking the
  (broadcast) operands, e.g. the backend's fast approximate transcendentals.
  """
  overrides = overrides or {}
  env = dict(env)

  def read(v):
    if is_literal(v):
      return jnp.asarray(v.val, dtype=v.aval.dtype)
    return env[v]

  for n in needed_equations(jaxpr, outputs, env):
    if n in skip:
      continue
    eqn = jaxpr.eqns[n]
    prim = eqn.primitive.name
    role = primitives.role(prim)
    invals = [read(v) for v in eqn.invars]
    if role == primitives.CUSTOM_RULE:
      outs = _custom_rule(eqn, invals, overrides, differentiable)
    elif role == primitives.IDENTITY:
      outs = invals[:1]
    elif role == primitives.NO_GRADIENT:
      outs = [primitives.no_gradient(invals[0]) if differentiable else invals[0]]
    elif role == primitives.ROW_REDUCTION:
      outs = [_REDUCERS[prim](invals[0], axis=-1, keepdims=True)]
    elif role != primitives.ELEMENTWISE:
      raise ValueError(f"'{prim}' has no tile evaluation (role {role})")
    elif prim in overrides and jnp.asarray(invals[0]).dtype == jnp.float32:
      outs = [overrides[prim](*invals)]
    else:
      outs = [eqn.primitive.bind(*_broadcast(invals), **eqn.params)]
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in outputs]
