"""The rule table: what a variant's programs may contain and what each primitive means.

score_mod, mask_mod and rownorm are traced to flat jaxprs (spec/trace.py),
run on tiles inside the kernels (spec/blockeval.py) and differentiated there
with `jax.vjp` by the backward kernels. `RULES` is the one place that says,
for every primitive a program may hold, how it is evaluated and
differentiated and which lowerings take it: the allow-check while tracing,
the tile evaluation (Triton and Mosaic GPU) and the derivative all read it.
A primitive without a rule is rejected when the program is traced.

Roles:
* ELEMENTWISE: bound on operands broadcast to one shape; JAX's derivative.
* IDENTITY: shape-only primitives and copies, identities on the logically
  scalar values the programs are traced on.
* NO_GRADIENT: `stop_gradient`, an identity whose derivative is zero.
* INDEX: a read of a captured array, resolved by spec/captures.py into the
  loads the kernels do; never evaluated as a primitive.
* ROW_REDUCTION: rownorm programs only: reduces the row (the tile's last axis).
* CUSTOM_RULE: a `jax.custom_jvp` or `jax.custom_vjp` function. Tracing
  turns each into one `custom_rule` equation holding two flat jaxprs: its
  body (what the forward runs) and the vector-Jacobian product of the
  user's rule, traced by JAX at the call's scalar shapes (what the backward
  runs: `as_custom_vjp`). Elementwise calls on scalars stay elementwise on
  tiles, so both run on tiles as traced.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

ELEMENTWISE, IDENTITY, NO_GRADIENT, INDEX, ROW_REDUCTION, CUSTOM_RULE = (
    "elementwise", "identity", "no_gradient", "index", "row_reduction", "custom_rule")


@dataclasses.dataclass(frozen=True)
class Rule:
  role: str
  # The Mosaic GPU lowering takes it on register arrays (JAX 0.10-0.11); a
  # custom rule where its body and derivative do.
  mosaic_gpu: bool = True


def _rules(names: str, role: str, mosaic_gpu: bool = True) -> dict:
  return {name: Rule(role, mosaic_gpu) for name in names.split()}


RULES: dict[str, Rule] = {
    **_rules("""add sub mul div neg max min abs sign round rem integer_pow exp exp2 log
                tanh logistic sin cos rsqrt square erf atan2 select_n clamp eq ne lt le
                gt ge and or not xor convert_element_type shift_left
                shift_right_arithmetic shift_right_logical""", ELEMENTWISE),
    **_rules("floor ceil pow log1p expm1 tan sqrt cbrt is_finite", ELEMENTWISE,
             mosaic_gpu=False),
    # Sums of cotangents: only in the derivatives JAX traces for custom rules
    # (mosaic_backend.lowerable rewrites it for Mosaic GPU).
    **_rules("add_any", ELEMENTWISE, mosaic_gpu=False),
    **_rules("broadcast_in_dim reshape squeeze copy", IDENTITY),
    **_rules("stop_gradient", NO_GRADIENT),
    **_rules("dynamic_slice", INDEX),
    **_rules("reduce_sum reduce_max reduce_min", ROW_REDUCTION),
    **_rules("custom_rule", CUSTOM_RULE),
}


def names(*roles: str) -> frozenset:
  """The primitives of the given roles."""
  return frozenset(name for name, rule in RULES.items() if rule.role in roles)


def role(name: str) -> str | None:
  rule = RULES.get(name)
  return None if rule is None else rule.role


MOSAIC_GPU = frozenset(name for name, rule in RULES.items() if rule.mosaic_gpu)


# A custom_jvp / custom_vjp call with its rule (see the module docstring).
# params: name (the user's function), kind ('custom_jvp' | 'custom_vjp'),
# body and vjp (ClosedJaxprs: inputs -> outputs; inputs, output cotangents
# -> the cotangents of the inputs listed in `differentiable`).
custom_rule_p = jex_core.Primitive("custom_rule")
custom_rule_p.multiple_results = True
custom_rule_p.def_abstract_eval(
    lambda *avals, body, **params: [v.aval for v in body.jaxpr.outvars])


def used_primitives(jaxpr, indices=None) -> set:
  """Names of the primitives that evaluating equations `indices` of `jaxpr`
  (default: all) binds: a custom rule's body in place of the rule."""
  eqns = jaxpr.eqns if indices is None else [jaxpr.eqns[n] for n in indices]
  used = set()
  for eqn in eqns:
    if eqn.primitive.name == "custom_rule":
      used |= used_primitives(eqn.params["body"].jaxpr)
    else:
      used.add(eqn.primitive.name)
  return used


@jax.custom_jvp
def no_gradient(x):
  """`stop_gradient` as autodiff sees it inside a kernel: an identity that
  binds nothing where it is not differentiated (no lowering needs a rule)."""
  return x


no_gradient.defjvps(lambda tangent, ans, x: jnp.zeros_like(tangent))


def as_custom_vjp(params, run):
  """A custom_rule equation's call as a `jax.custom_vjp` function of its
  inputs: `run(closed_jaxpr, args)` evaluates the body forward and the
  traced vector-Jacobian product backward (in a kernel on tiles, whose
  inputs the caller broadcasts to one shape first; elsewhere as plain JAX).
  Inputs outside `differentiable` (integers) get no cotangent."""
  body, vjp, differentiable = params["body"], params["vjp"], params["differentiable"]

  def primal(*xs):
    return tuple(run(body, xs))

  def fwd(*xs):
    return primal(*xs), xs

  def bwd(xs, cotangents):
    grads = dict(zip(differentiable, run(vjp, (*xs, *cotangents))))
    return tuple(None if n not in grads else
                 jnp.broadcast_to(jnp.asarray(grads[n], jnp.result_type(x)), jnp.shape(x))
                 for n, x in enumerate(xs))

  call = jax.custom_vjp(primal)
  call.defvjp(fwd, bwd)
  return call
