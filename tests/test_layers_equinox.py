"""pallas_attn.layers.equinox against equinox.nn.MultiheadAttention with the
same weights (interpret mode; compiled on GPU through `default_mode`)."""
import io

import jax
import jax.numpy as jnp
import pytest
from jax.extend import core as jax_core

eqx = pytest.importorskip("equinox", reason="needs the test extra: pip install '.[test]'")
optax = pytest.importorskip("optax", reason="needs the test extra: pip install '.[test]'")

import pallas_attn as pa
from conftest import TOLERANCE, assert_close, assert_missing_extra_fails, random
from pallas_attn import variants as V
from pallas_attn.layers import equinox as pa_eqx

pytestmark = pytest.mark.usefixtures("exact_matmuls")
BATCH, SEQ_Q, SEQ_KV, HEADS, SIZE = 2, 11, 13, 4, 16
# qk_size != vo_size and biases on every projection.
LAYER_ARGS = dict(num_heads=HEADS, query_size=SIZE, qk_size=8, vo_size=6, use_query_bias=True,
                  use_key_bias=True, use_value_bias=True, use_output_bias=True)


def inputs(dtype=jnp.float32):
  return (random((BATCH, SEQ_Q, SIZE), dtype, 0), random((BATCH, SEQ_KV, SIZE), dtype, 1),
          random((BATCH, SEQ_KV, SIZE), dtype, 2))


def layers(dtype=jnp.float32, **variant):
  """Equinox's layer and ours from the same key: the same weights."""
  key = jax.random.PRNGKey(0)
  return (eqx.nn.MultiheadAttention(**LAYER_ARGS, dtype=dtype, key=key),
          pa_eqx.MultiheadAttention(**LAYER_ARGS, dtype=dtype, key=key, **variant))


KERNEL_PRIMITIVES = ("pallas_call", "core_map", "mpmd_map")  # Triton; Mosaic GPU


def kernels(jaxpr, loops=()):
  """[(kernel primitive, enclosing loop primitives)] in `jaxpr` and the
  jaxprs nested in it (not the kernels' own bodies)."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in KERNEL_PRIMITIVES:
      found.append((eqn.primitive.name, loops))
      continue
    inner = loops + ((eqn.primitive.name,) if eqn.primitive.name in ("while", "scan") else ())
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        if isinstance(sub, jax_core.ClosedJaxpr):
          found += kernels(sub.jaxpr, inner)
        elif isinstance(sub, jax_core.Jaxpr):
          found += kernels(sub, inner)
  return found


@pytest.mark.parametrize("dtype,per_head_mask", [
    pytest.param(jnp.float32, True, id="fp32-mask3d"),
    pytest.param(jnp.bfloat16, False, id="bf16-mask2d")])
def test_matches_equinox_outputs_and_gradients(dtype, per_head_mask, default_mode):
  """vmapped over the batch, with a caller mask: outputs and weight
  gradients equal Equinox's layer (float32 weights as the reference)."""
  theirs, ours = layers(dtype)
  reference = jax.tree.map(lambda x: x.astype(jnp.float32) if eqx.is_array(x) else x, theirs)
  mask_shape = (HEADS, SEQ_Q, SEQ_KV) if per_head_mask else (SEQ_Q, SEQ_KV)
  mask = jax.random.bernoulli(jax.random.PRNGKey(3), 0.6, mask_shape) | jnp.eye(
      SEQ_Q, SEQ_KV, dtype=bool)
  q, k, v = inputs(dtype)
  cotangent = random((BATCH, SEQ_Q, SIZE), seed=4)

  def apply(layer, q, k, v):
    return jax.vmap(lambda *x: layer(*x, mask=mask))(q, k, v)

  @eqx.filter_grad
  def grads(layer, q, k, v):
    return jnp.sum(apply(layer, q, k, v).astype(jnp.float32) * cotangent)

  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  assert_close(apply(ours, q, k, v), apply(reference, *f32), dtype, factor=2)
  got_leaves = jax.tree.leaves(eqx.filter(grads(ours, q, k, v), eqx.is_array))
  want_leaves = jax.tree.leaves(eqx.filter(grads(reference, *f32), eqx.is_array))
  assert len(got_leaves) == len(want_leaves) == 8
  total = jnp.sqrt(sum(jnp.sum(w ** 2) for w in want_leaves))
  for g, w in zip(got_leaves, want_leaves):
    if jnp.linalg.norm(w) > 1e-4 * total:
      assert_close(g, w, dtype, factor=3)
    else:  # the key bias: zero in exact math (softmax ignores a per-row constant)
      assert jnp.linalg.norm(g.astype(jnp.float32)) <= TOLERANCE[dtype] * 3 * total


def test_weights_and_saved_files_carry_over(default_mode):
  """Fields as Equinox's: a file saved from Equinox's layer loads into ours."""
  theirs, _ = layers()
  theirs = eqx.tree_at(lambda m: m.output_proj.weight, theirs,
                       random(theirs.output_proj.weight.shape, seed=8))
  buffer = io.BytesIO()
  eqx.tree_serialise_leaves(buffer, theirs)
  buffer.seek(0)
  ours = eqx.tree_deserialise_leaves(buffer, pa_eqx.MultiheadAttention(
      **LAYER_ARGS, key=jax.random.PRNGKey(1)))
  q, k, v = (x[0] for x in inputs())
  assert_close(ours(q, k, v), theirs(q, k, v))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_vmap_is_one_batched_kernel_per_pass(dtype, default_mode):
  """vmap over examples (each with its own traced mask) batches the kernels:
  the same kernels as one example's call (block masks and forward; under
  grad also dq and dk/dv), none inside a loop. Pallas adds a grid axis:
  pallas_call's batching rule for Triton, plgpu.kernel's vmap rule for
  Mosaic GPU (bf16 on Hopper)."""
  _, ours = layers(dtype, variant=V.causal(seq_q=SEQ_Q, seq_kv=SEQ_KV))
  q, k, v = inputs(dtype)
  masks = jax.random.bernoulli(jax.random.PRNGKey(3), 0.7, (BATCH, SEQ_Q, SEQ_KV))

  def one(layer, q, k, v, mask):
    return jnp.sum(layer(q, k, v, mask=mask))

  def batched(layer, q, k, v, masks):
    return jnp.sum(jax.vmap(lambda *x: layer(*x[:3], mask=x[3]))(q, k, v, masks))

  def count(loss, *args):
    return (kernels(eqx.filter_make_jaxpr(loss)(ours, *args)[0].jaxpr),
            kernels(eqx.filter_make_jaxpr(eqx.filter_grad(loss))(ours, *args)[0].jaxpr))

  forward, grads = count(batched, q, k, v, masks)
  single_forward, single_grads = count(one, q[0], k[0], v[0], masks[0])
  assert 2 <= len(forward) == len(single_forward), (forward, single_forward)
  assert 4 <= len(grads) == len(single_grads), (grads, single_grads)
  assert all(not loops for _, loops in forward + grads), (forward, grads)


def test_training_step_with_variant_and_sinks_under_filter_jit(default_mode):
  """ALiBi + causal with learnable sinks: eqx.filter_jit + optax steps lower
  the loss, and the sinks (a leaf of the layer) are trained."""
  sinks = jnp.zeros((HEADS,), jnp.float32)
  _, ours = layers(variant=V.alibi(num_heads=HEADS) + V.causal() + V.sink(sinks))
  q, _, _ = inputs()
  target = random((BATCH, SEQ_Q, SIZE), seed=5)
  optimizer = optax.adam(3e-2)
  state = optimizer.init(eqx.filter(ours, eqx.is_array))

  @eqx.filter_jit
  def step(layer, state):
    loss, grads = eqx.filter_value_and_grad(
        lambda m: jnp.mean((jax.vmap(lambda x: m(x, x, x))(q) - target) ** 2))(layer)
    updates, state = optimizer.update(grads, state)
    return eqx.apply_updates(layer, updates), state, loss

  losses = []
  for _ in range(5):
    ours, state, loss = step(ours, state)
    losses.append(float(loss))
  assert losses[-1] < 0.9 * losses[0], losses
  assert float(jnp.abs(ours.sinks - sinks).max()) > 0


def test_vmap_agrees_with_per_example_calls(default_mode):
  """Nested vmap, keys and values shared across the mapped axis, and
  vmap(grad) per-example gradients, against one unbatched call per example."""
  _, ours = layers(variant=V.causal(seq_q=SEQ_Q, seq_kv=SEQ_KV))
  q, k, v = inputs()
  nested = jax.vmap(jax.vmap(ours))(*(jnp.stack([x, x[::-1]]) for x in (q, k, v)))
  per_example = [ours(x, y, z) for x, y, z in zip(q, k, v)]
  assert_close(nested[0], jnp.stack(per_example))
  assert_close(nested[1], jnp.stack(per_example[::-1]))
  shared = jax.vmap(ours, in_axes=(0, None, None))(q, k[0], v[0])
  assert_close(shared[1], ours(q[1], k[0], v[0]))

  def grad_q(x, y, z):
    return jax.grad(lambda x: jnp.sum(jnp.sin(ours(x, y, z))))(x)
  per_example_grads = jax.vmap(grad_q)(q, k, v)
  for i in range(BATCH):
    assert_close(per_example_grads[i], grad_q(q[i], k[i], v[i]))


def test_reference_semantics_of_a_variant(default_mode):
  """A softcap variant: equal to the dense reference on the projected heads."""
  _, ours = layers(variant=V.softcap(2.0), rownorm="sigmoid")
  q, k, v = (x[0] for x in inputs())
  heads = [ours._project(p, x) for p, x in ((ours.query_proj, q), (ours.key_proj, k),
                                             (ours.value_proj, v))]
  want = pa.attention_reference(*(h[None] for h in heads), **(
      V.softcap(2.0) + V.sigmoid(0.0)).kwargs())[0]
  want = jax.vmap(ours.output_proj)(want.reshape(SEQ_Q, -1))
  assert_close(eqx.filter_jit(ours)(q, k, v), want)


def test_bad_input_raises_clearly():
  _, ours = layers()
  q, k, v = (x[0] for x in inputs())
  with pytest.raises(ValueError, match="mask must have shape"):
    ours(q, k, v, mask=jnp.ones((SEQ_Q, SEQ_Q), bool))
  with pytest.raises(ValueError, match="unbatched"):
    ours(q[None], k[None], v[None])
  dropping = pa_eqx.MultiheadAttention(HEADS, SIZE, dropout_p=0.1, key=jax.random.PRNGKey(0))
  with pytest.raises(NotImplementedError, match="inference=True"):
    dropping(q, k, v, key=jax.random.PRNGKey(1))


def test_missing_equinox_fails_clearly(monkeypatch):
  assert_missing_extra_fails(monkeypatch, "equinox")
