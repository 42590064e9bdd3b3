"""Evaluates a traced callable on tiles inside a kernel.

The user's callables are traced on logically scalar values (a score, an
index). Inside a kernel the same program runs on tiles: the score is a
`[block_q, block_k]` tile, `q_idx` a `[block_q, 1]` column, `kv_idx` a
`[1, block_k]` row, `b` and `h` scalars. Elementwise primitives are applied
after broadcasting their operands to a common shape, shape-only primitives
are identities, and row reductions (rownorm programs only) reduce the last
axis keeping it. Only the equations a requested output needs are run.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_attn.spec.trace import REDUCTION_PRIMITIVES, SHAPE_PRIMITIVES, is_literal

_IDENTITY_PRIMITIVES = SHAPE_PRIMITIVES | {"stop_gradient", "copy", "copy_p"}
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


def _bind_broadcast(eqn, invals):
  arrays = [jnp.asarray(x) for x in invals]
  shape = jnp.broadcast_shapes(*[a.shape for a in arrays])
  arrays = [a if a.shape == shape else jnp.broadcast_to(a, shape) for a in arrays]
  return eqn.primitive.bind(*arrays, **eqn.params)


def evaluate(jaxpr, env: dict, outputs, skip=frozenset(), overrides=None):
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
    invals = [read(v) for v in eqn.invars]
    if prim in _IDENTITY_PRIMITIVES:
      out = invals[0]
    elif prim in REDUCTION_PRIMITIVES:
      out = _REDUCERS[prim](invals[0], axis=-1, keepdims=True)
    elif prim in overrides and jnp.asarray(invals[0]).dtype == jnp.float32:
      out = overrides[prim](*invals)
    else:
      out = _bind_broadcast(eqn, invals)
    env[eqn.outvars[0]] = out
  return [read(v) for v in outputs]
