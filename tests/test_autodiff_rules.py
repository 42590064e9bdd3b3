"""Every primitive of the rule table, forward and gradients, against the reference.

For each primitive a variant may contain (spec/primitives.py), a small
score_mod built from it (averaged with eight others: one kernel per nine)
runs forward and backward; outputs and the gradients with respect to q, k,
v and a captured float array match `jax.grad` of the dense float32
reference. Then the programs whose
derivative is not their body's: `stop_gradient`, custom_jvp and custom_vjp
rules (the user's rule, never the body's derivative), JAX's own custom
rules (`jax.nn.relu` at 0), nested `jax.jit`, and rownorms with them.
Interpret mode on CPU; compiled on both lowerings on a GPU (`gpu`).
"""
import jax
import jax.numpy as jnp
import pytest
from jax import lax

import pallas_attn as pa
from conftest import assert_close, qkv, random
from pallas_attn.kernels.linear.reference import linear_attention_reference
from pallas_attn.spec import primitives
from test_attention_backward import check_gradients
from test_mosaic_backward import _check as check_mosaic_gradients
from test_mosaic_backward import _lowering as mosaic_lowering

SMALL = pa.AttentionConfig(block_q=16, block_k=16, num_warps=4, num_stages=1)
HEADS, KV_HEADS = 2, 1
WEIGHTS = 1.0 + 0.1 * random((HEADS,), seed=7)  # a captured float array, differentiated

# score_mod = op(score * weights[h], q_idx, kv_idx), one op per primitive.
where = jnp.where
EXAMPLES = {
    "add": lambda x, q, kv: x + 1.0,
    "sub": lambda x, q, kv: x - 0.5,
    "mul": lambda x, q, kv: x * x,
    "div": lambda x, q, kv: x / (1.5 + x * x),
    "neg": lambda x, q, kv: -x,
    "max": lambda x, q, kv: jnp.maximum(x, 0.2),
    "min": lambda x, q, kv: jnp.minimum(x, 0.3),
    "abs": lambda x, q, kv: jnp.abs(x),
    "sign": lambda x, q, kv: x * jnp.sign(x - 0.1),
    "floor": lambda x, q, kv: x + jnp.floor(x),
    "ceil": lambda x, q, kv: x + jnp.ceil(x),
    "round": lambda x, q, kv: x + jnp.round(x),
    "rem": lambda x, q, kv: lax.rem(x, 0.7),
    "pow": lambda x, q, kv: lax.pow(1.0 + x * x, 0.7),
    "integer_pow": lambda x, q, kv: 0.1 * x ** 3,
    "exp": lambda x, q, kv: jnp.exp(0.5 * x),
    "exp2": lambda x, q, kv: jnp.exp2(0.5 * x),
    "log": lambda x, q, kv: jnp.log(1.0 + x * x),
    "log1p": lambda x, q, kv: jnp.log1p(x * x),
    "expm1": lambda x, q, kv: jnp.expm1(0.5 * x),
    "tanh": lambda x, q, kv: 2.0 * jnp.tanh(x),
    "logistic": lambda x, q, kv: 3.0 * jax.nn.sigmoid(x),
    "sin": lambda x, q, kv: jnp.sin(x),
    "cos": lambda x, q, kv: jnp.cos(x),
    "tan": lambda x, q, kv: jnp.tan(0.3 * x),
    "sqrt": lambda x, q, kv: jnp.sqrt(1.0 + x * x),
    "rsqrt": lambda x, q, kv: lax.rsqrt(1.0 + x * x),
    "cbrt": lambda x, q, kv: jnp.cbrt(1.0 + x * x),
    "square": lambda x, q, kv: lax.square(x),
    "erf": lambda x, q, kv: 2.0 * lax.erf(x),
    "atan2": lambda x, q, kv: jnp.arctan2(x, 1.5),
    "is_finite": lambda x, q, kv: where(jnp.isfinite(x), x, 0.0),
    "select_n": lambda x, q, kv: lax.select(x > 0, x, 0.1 * x),
    "clamp": lambda x, q, kv: lax.clamp(-1.0, x, 1.0),
    "eq": lambda x, q, kv: where(q == kv, x + 1.0, x),
    "ne": lambda x, q, kv: where(q != kv, x, 0.5 * x),
    "lt": lambda x, q, kv: where(q < kv, x, 0.5 * x),
    "le": lambda x, q, kv: where(q <= kv, x, 0.5 * x),
    "gt": lambda x, q, kv: where(q > kv, x, 0.5 * x),
    "ge": lambda x, q, kv: where(q >= kv, x, 0.5 * x),
    "and": lambda x, q, kv: where((q > 2) & (kv > 3), x, -x),
    "or": lambda x, q, kv: where((q > 2) | (kv > 3), x, -x),
    "not": lambda x, q, kv: where(~(q > kv), x, 2.0 * x),
    "xor": lambda x, q, kv: where(((q & 1) ^ (kv & 1)) == 1, x, -x),
    "convert_element_type": lambda x, q, kv: x + 0.01 * q.astype(jnp.float32),
    "shift_left": lambda x, q, kv: x + 0.01 * (q << 1).astype(jnp.float32),
    "shift_right_arithmetic": lambda x, q, kv: x + 0.1 * (kv >> 1).astype(jnp.float32),
    "shift_right_logical": lambda x, q, kv: x + 0.1 * lax.shift_right_logical(kv, 1).astype(
        jnp.float32),
    "broadcast_in_dim": lambda x, q, kv: lax.squeeze(lax.broadcast_in_dim(x, (1,), ()), (0,)),
    "reshape": lambda x, q, kv: jnp.squeeze(jnp.reshape(x, (1, 1))),
    "squeeze": lambda x, q, kv: jnp.squeeze(x[None]),
    "copy": lambda x, q, kv: jnp.copy(x),
    "stop_gradient": lambda x, q, kv: x + 0.35 * lax.stop_gradient(x),
    "dynamic_slice": lambda x, q, kv: x,  # every example reads weights[h]
}


@jax.custom_jvp
def straight_through_cap(x):
  """A soft-cap whose gradient passes through unchanged."""
  return 5.0 * jnp.tanh(x / 5.0)


straight_through_cap.defjvp(lambda primals, tangents: (straight_through_cap(primals[0]),
                                                       tangents[0]))


@jax.custom_jvp
def twice_used_tangent(x):
  return x * x


@twice_used_tangent.defjvp
def _twice_used_tangent_jvp(primals, tangents):
  x, t = primals[0], tangents[0]
  return x * x, t * x + t * (x + 1.0)  # transposed, the two uses sum (add_any)


@jax.custom_vjp
def clipped_gradient(x):
  return x


clipped_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.01, 0.01),))

CUSTOM_EXAMPLES = {
    "custom_jvp_straight_through": lambda x, q, kv: straight_through_cap(x),
    "custom_vjp_clipped": lambda x, q, kv: 2.0 * clipped_gradient(x),
    "custom_jvp_add_any": lambda x, q, kv: 0.3 * twice_used_tangent(x),
    "relu_tie_at_zero": lambda x, q, kv: jax.nn.relu(where(q == kv, 0.0, x)),
    "softplus": lambda x, q, kv: jax.nn.softplus(x),
    "silu": lambda x, q, kv: jax.nn.silu(x),
    "stopped_score_bias": lambda x, q, kv: (lax.stop_gradient(x)
                                            + 0.1 * (kv - q).astype(jnp.float32)),
    "nested_jit": lambda x, q, kv: jax.jit(lambda y: jnp.tanh(y) * 2.0)(x),
    "jit_of_custom_vjp": lambda x, q, kv: jax.jit(clipped_gradient)(x) + 0.1 * x,
}
# Rownorms whose derivative goes through a row reduction, a stop_gradient or a custom rule.
ROWNORMS = {
    "reduce_sum": lambda row: row / jnp.maximum(jnp.sum(jnp.abs(row), -1, keepdims=True), 1.0),
    "reduce_max": lambda row: jnp.exp(row - jnp.max(row, -1, keepdims=True)) / jnp.sum(
        jnp.exp(row - jnp.max(row, -1, keepdims=True)), -1, keepdims=True),
    "reduce_min": lambda row: jnp.exp(row - jnp.min(row, -1, keepdims=True)) / jnp.sum(
        jnp.exp(row - jnp.min(row, -1, keepdims=True)), -1, keepdims=True),
    "stop_gradient_divisor": lambda row: row / lax.stop_gradient(
        jnp.maximum(jnp.sum(jnp.abs(row), -1, keepdims=True), 1.0)),
    "relu": jax.nn.relu,
    "custom_vjp_weights": lambda row: jax.nn.sigmoid(clipped_gradient(row)),
}


def test_every_rule_has_an_example():
  covered = set(EXAMPLES) | set(ROWNORMS) | {"custom_rule", "add_any"}
  assert set(primitives.RULES) <= covered, set(primitives.RULES) - covered


def _score_mod(op):
  return lambda weights: dict(
      score_mod=lambda s, b, h, q_idx, kv_idx: op(s * weights[h], q_idx, kv_idx))


def _check(make_kwargs, interpret, implementation=None, factor=1.0):
  q, k, v = qkv(batch=1, seq_q=37, seq_kv=29, heads=HEADS, kv_heads=KV_HEADS, d_qk=16,
                d_v=16, seed=3)
  captures = {"w": WEIGHTS}
  out = pa.attention(q, k, v, interpret=interpret, config=SMALL, implementation=implementation,
                     **make_kwargs(captures))
  assert_close(out, pa.attention_reference(q, k, v, **make_kwargs(captures)))
  check_gradients(q, k, v, captures, interpret=interpret, implementation=implementation,
                  make_kwargs=make_kwargs, factor=factor)


ALL_SCORE_MODS = {**EXAMPLES, **CUSTOM_EXAMPLES}
# A clipped gradient is discontinuous: a rounding difference in a score's
# gradient near the clip moves the captured array's summed gradient by more.
FACTORS = {"custom_vjp_clipped": 5.0, "jit_of_custom_vjp": 5.0}


# The plain primitives' examples, nine to a score_mod (their mean): a group costs one
# forward and one backward compilation instead of nine. A derivative rule off by 1% in
# any one example moves its group's gradients by 2.5e-4 to 5.5e-3 relative (25 to 550
# times the tolerance), so each rule is still checked; the failing group names its nine.
PRIMITIVE_GROUPS = [sorted(EXAMPLES)[i::6] for i in range(6)]


def _mean(ops):
  return lambda x, q, kv: sum(op(x, q, kv) for op in ops) / len(ops)


@pytest.mark.parametrize("names", PRIMITIVE_GROUPS, ids=["+".join(g) for g in PRIMITIVE_GROUPS])
def test_score_mod_primitives(names):
  """Each primitive of the rule table in a score_mod with eight others: forward
  and gradients (q, k, v, the captured weights) against the reference."""
  make = _score_mod(_mean([EXAMPLES[name] for name in names]))
  _check(lambda c: make(c["w"]), interpret=True)


@pytest.mark.parametrize("name", sorted(CUSTOM_EXAMPLES))
def test_score_mod_custom_rule(name):
  """A program whose derivative is not its body's, alone in a score_mod."""
  make = _score_mod(CUSTOM_EXAMPLES[name])
  _check(lambda c: make(c["w"]), interpret=True, factor=FACTORS.get(name, 1.0))


@pytest.mark.parametrize("name", sorted(ROWNORMS))
def test_rownorm_primitive(name):
  _check(lambda c: dict(score_mod=lambda s, b, h, qi, ki: s * c["w"][h],
                        rownorm=ROWNORMS[name]), interpret=True)


def test_custom_rules_are_not_the_body_derivative():
  """The rules above must differ from their bodies' derivatives, or the
  tests would not tell a kept rule from a dropped one."""
  x = jnp.float32(1.3)
  assert jax.grad(straight_through_cap)(x) == 1.0 != jax.grad(lambda y: 5 * jnp.tanh(y / 5))(x)
  assert jax.grad(clipped_gradient)(x) == 0.01
  assert jax.grad(jax.nn.relu)(0.0) == 0.0 != jax.grad(lambda y: jnp.maximum(y, 0.0))(0.0)


def test_rule_over_a_row_is_rejected():
  @jax.custom_jvp
  def my_softmax(row):
    e = jnp.exp(row - jnp.max(row, -1, keepdims=True))
    return e / jnp.sum(e, -1, keepdims=True)
  my_softmax.defjvp(lambda p, t: (my_softmax(p[0]), t[0]))
  q, k, v = qkv(batch=1, seq_q=8, seq_kv=8, heads=2, kv_heads=1, d_qk=16, d_v=16)
  with pytest.raises(pa.VariantError, match="custom_jvp function 'my_softmax' on whole rows"):
    pa.attention(q, k, v, rownorm=my_softmax)


def test_unlowerable_rule_names_the_function():
  @jax.custom_vjp
  def sorted_gradient(x):
    return x
  sorted_gradient.defvjp(lambda x: (x, None),
                         lambda _, g: (jnp.cumsum(jnp.reshape(g, (1,)))[0],))
  q, k, v = qkv(batch=1, seq_q=8, seq_kv=8, heads=2, kv_heads=1, d_qk=16, d_v=16)
  with pytest.raises(pa.VariantError, match=r"custom_vjp function sorted_gradient at .*"
                                            r"derivative rule uses the primitive 'cumsum'"):
    pa.attention(q, k, v, score_mod=lambda s, *_: sorted_gradient(s))


def test_linear_attention_feature_maps_keep_their_rules():
  q, k, v = (random((1, 20, 2, 16), seed=n) for n in range(3))
  phi = lambda x: jax.nn.relu(x) + 0.1 * lax.stop_gradient(x) + clipped_gradient(x)

  def loss(attention):
    return lambda q, k: jnp.sum(attention(q, k, v, q_mod=phi, k_mod=phi))

  reference = lambda *args, **kwargs: linear_attention_reference(*args, **kwargs)[0]
  got = jax.grad(loss(pa.linear_attention), (0, 1))(q, k)
  want = jax.grad(loss(reference), (0, 1))(q, k)
  for g, w in zip(got, want):
    assert_close(g, w, factor=10.0)


# Compiled: Triton in float32 with the captured array differentiated (Triton's
# backward); Mosaic GPU in bfloat16 with it closed over (Mosaic's backward).
GPU_CASES = ["stop_gradient", "stopped_score_bias", "custom_jvp_straight_through",
             "custom_vjp_clipped",
             "custom_jvp_add_any", "relu_tie_at_zero", "nested_jit", "tanh", "exp"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_CASES + ["floor", "log1p"])
def test_compiled_triton(name):
  make = _score_mod(ALL_SCORE_MODS[name])
  _check(lambda c: make(c["w"]), interpret=False, implementation="triton",
         factor=FACTORS.get(name, 1.0))


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_CASES)
def test_compiled_mosaic_gpu(name):
  kw = _score_mod(ALL_SCORE_MODS[name])(WEIGHTS)
  chosen = mosaic_lowering(kw)
  assert (chosen.forward, chosen.backward) == ("mosaic_gpu", "mosaic_gpu"), chosen.describe()
  q, k, v = qkv(batch=2, seq_q=200, seq_kv=200, heads=HEADS, kv_heads=KV_HEADS, d_qk=128,
                d_v=128, dtype=jnp.bfloat16)
  out = pa.attention(q, k, v, **kw)
  ref = pa.attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), **kw)
  assert_close(out, ref, jnp.bfloat16)
  check_mosaic_gradients(q, k, v, kw)
