"""pallas_attn.layers.flax against Flax's own attention with the same weights
(interpret mode; compiled on GPU through the `default_mode` fixture)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

optax = pytest.importorskip("optax", reason="needs the test extra: pip install '.[test]'")
pytest.importorskip("flax", reason="needs the test extra: pip install '.[test]'")
from flax import linen, nnx  # noqa: E402

import pallas_attn as pa
from conftest import TOLERANCE, assert_close, assert_missing_extra_fails, random
from pallas_attn import variants as V
from pallas_attn.layers import flax as pa_flax

pytestmark = pytest.mark.usefixtures("exact_matmuls")
DTYPES = [pytest.param(jnp.float32, id="fp32"), pytest.param(jnp.bfloat16, id="bf16")]
BATCH, SEQ, FEATURES, HEADS, KV_HEADS = 2, 13, 16, 4, 2  # ragged length, GQA


def flat_grads(grads):
  """{path: array} of an nnx.grad State, comparable across our layer and Flax's."""
  return {jax.tree_util.keystr(path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(grads)}


def assert_grads_close(got, want, dtype=jnp.float32, factor=1.0):
  """Per-parameter relative error; a gradient that is zero in exact math
  (the key projection's bias: softmax ignores a per-row constant) is held to
  the tolerance times the norm of all gradients instead."""
  assert got.keys() == want.keys()
  total = np.sqrt(sum(np.sum(np.square(np.asarray(w, np.float32))) for w in want.values()))
  for path, grad in got.items():
    if np.linalg.norm(np.asarray(want[path], np.float32)) > 1e-4 * total:
      assert_close(grad, want[path], dtype, factor), path
    else:
      assert np.linalg.norm(np.asarray(grad, np.float32)) <= TOLERANCE[dtype] * factor * total


def flax_pair(dtype=jnp.float32, **ours_kwargs):
  """Flax's MultiHeadAttention and ours (GQA) holding the same parameters."""
  kwargs = dict(num_kv_heads=KV_HEADS, decode=False, param_dtype=dtype, dtype=dtype)
  theirs = nnx.MultiHeadAttention(HEADS, FEATURES, rngs=nnx.Rngs(0), **kwargs)
  ours = pa_flax.MultiHeadAttention(HEADS, FEATURES, rngs=nnx.Rngs(1), **kwargs, **ours_kwargs)
  nnx.update(ours, nnx.state(theirs, nnx.Param))
  return theirs, ours


def caller_mask(batch=BATCH, seq_q=SEQ, seq_kv=SEQ, seed=3):
  """A random boolean [B, 1, Sq, Skv] mask; every row keeps its diagonal."""
  keep = jax.random.bernoulli(jax.random.PRNGKey(seed), 0.6, (batch, 1, seq_q, seq_kv))
  return keep | jnp.eye(seq_q, seq_kv, dtype=bool)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_fn_matches_flax_with_bias_mask_gqa_and_batch_dims(dtype, default_mode):
  """Two batch dims, Sq != Skv, GQA, a per-head bias and a per-example mask:
  outputs and gradients (q, k, v, bias) equal Flax's dot_product_attention."""
  shape = (2, 1)
  q = random(shape + (11, HEADS, 8), dtype, 0)
  k = random(shape + (SEQ, KV_HEADS, 8), dtype, 1)
  v = random(shape + (SEQ, KV_HEADS, 8), dtype, 2)
  bias = random((HEADS, 11, SEQ), jnp.float32, 3)
  mask = caller_mask(2, 11, SEQ).reshape(2, 1, 1, 11, SEQ)
  cotangent = random(shape + (11, HEADS, 8), jnp.float32, 4)

  def loss(attention_fn, q, k, v, bias):
    out = attention_fn(q, k, v, bias=bias.astype(q.dtype), mask=mask)
    return jnp.sum(out.astype(jnp.float32) * cotangent), out

  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  (_, want), want_grads = jax.value_and_grad(loss, argnums=(1, 2, 3, 4), has_aux=True)(
      nnx.dot_product_attention, *f32, bias)
  (_, got), got_grads = jax.value_and_grad(loss, argnums=(1, 2, 3, 4), has_aux=True)(
      pa_flax.attention_fn, q, k, v, bias)
  assert got.shape == want.shape and got.dtype == dtype
  assert_close(got, want, dtype, factor=2)
  for g, w in zip(got_grads, want_grads):
    assert_close(g, w, dtype, factor=3)


def test_attention_fn_is_causal_without_batch_dims(default_mode):
  q, k, v = (random((SEQ, HEADS, 8), seed=s) for s in range(3))
  want = nnx.dot_product_attention(q, k, v, is_causal=True)
  assert_close(jax.jit(pa_flax.attention_fn, static_argnames="is_causal")(
      q, k, v, is_causal=True), want)


def test_unsupported_arguments_raise_clearly():
  q = random((1, 5, 2, 8))
  with pytest.raises(NotImplementedError, match="dropout on attention weights"):
    pa_flax.attention_fn(q, q, q, dropout_rate=0.1, dropout_rng=jax.random.PRNGKey(0))
  with pytest.raises(NotImplementedError, match="sown"):
    pa_flax.attention_fn(q, q, q, module=object())
  with pytest.raises(NotImplementedError, match="qk_attn_weights_einsum"):
    pa_flax.attention_fn(q, q, q, qk_attn_weights_einsum=jnp.einsum)
  with pytest.raises(ValueError, match="does not broadcast"):
    pa_flax.attention_fn(q, q, q, mask=jnp.ones((3, 5, 5), bool))
  with pytest.raises(ValueError, match="not both"):
    pa_flax.MultiHeadAttention(2, 16, rngs=nnx.Rngs(0), attention_fn=pa_flax.attention_fn,
                               variant=V.causal())
  with pytest.raises(TypeError, match="flax.nnx.MultiHeadAttention"):
    pa_flax.MultiHeadAttention(2, 16, rngs=nnx.Rngs(0), attention_fn=nnx.dot_product_attention)
  layer = pa_flax.MultiHeadAttention(2, 16, dropout_rate=0.5, rngs=nnx.Rngs(0), decode=False)
  with pytest.raises(NotImplementedError, match="deterministic=True"):
    layer(random((1, 5, 16)), deterministic=False)


def test_drop_in_attention_fn_for_nnx_and_linen_layers(default_mode):
  """`attention_fn=pa_flax.attention_fn` in Flax's own layers, unchanged otherwise."""
  x = random((BATCH, SEQ, FEATURES))
  mask = caller_mask()
  theirs = nnx.MultiHeadAttention(HEADS, FEATURES, decode=False, rngs=nnx.Rngs(0))
  swapped = nnx.MultiHeadAttention(HEADS, FEATURES, decode=False, rngs=nnx.Rngs(0),
                                   attention_fn=pa_flax.attention_fn)
  assert_close(swapped(x, mask=mask), theirs(x, mask=mask))

  linen_theirs = linen.MultiHeadDotProductAttention(num_heads=HEADS)
  linen_ours = linen.MultiHeadDotProductAttention(num_heads=HEADS,
                                                  attention_fn=pa_flax.attention_fn)
  params = linen_theirs.init(jax.random.PRNGKey(0), x)
  assert_close(linen_ours.apply(params, x, mask=mask), linen_theirs.apply(params, x, mask=mask))


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_loads_flax_state_and_matches_outputs_and_gradients(dtype, default_mode):
  theirs, ours = flax_pair(dtype)
  assert isinstance(ours, nnx.MultiHeadAttention)
  x = random((BATCH, SEQ, FEATURES), dtype)
  mask = caller_mask()
  cotangent = random((BATCH, SEQ, FEATURES), seed=7)

  def loss(layer):
    return jnp.sum(layer(x, mask=mask).astype(jnp.float32) * cotangent)

  reference, _ = flax_pair(jnp.float32)  # float32 weights and math for the bf16 case
  nnx.update(reference, jax.tree.map(lambda p: p.astype(jnp.float32),
                                     nnx.state(theirs, nnx.Param)))
  want = reference(x.astype(jnp.float32), mask=mask)
  assert_close(ours(x, mask=mask), want, dtype, factor=2)
  assert_grads_close(flat_grads(nnx.grad(loss)(ours)), flat_grads(nnx.grad(loss)(reference)),
                     dtype, factor=3)


def test_layer_variant_matches_a_dense_layer(default_mode):
  """softcap + sliding window + causal, outputs and parameter gradients,
  against Flax's layer running the dense reference of the same variant."""
  variant = V.softcap(2.0) + V.sliding_window(5)
  reference_fn = lambda q, k, v, **_: pa.attention_reference(q, k, v, **variant.kwargs())
  theirs = nnx.MultiHeadAttention(HEADS, FEATURES, num_kv_heads=KV_HEADS, decode=False,
                                  rngs=nnx.Rngs(0), attention_fn=reference_fn)
  ours = pa_flax.MultiHeadAttention(HEADS, FEATURES, num_kv_heads=KV_HEADS, decode=False,
                                    rngs=nnx.Rngs(0), variant=variant)
  x = random((BATCH, SEQ, FEATURES))
  loss = lambda layer: jnp.sum(jnp.sin(layer(x)))
  assert_close(ours(x), theirs(x))
  assert_grads_close(flat_grads(nnx.grad(loss)(ours)), flat_grads(nnx.grad(loss)(theirs)))


def test_decoding_matches_flax_decoding(default_mode):
  """Vanilla decoding one token at a time (batch 1, under nnx.jit): the same
  outputs and caches as Flax's (to float32 rounding: ours is jitted and
  Flax's eager, so their key projections may round apart on a GPU)."""
  theirs, ours = flax_pair()
  x = random((1, 6, FEATURES))
  for layer in (theirs, ours):
    layer.init_cache(x.shape)
  step = nnx.jit(lambda layer, token: layer(token, decode=True))
  for i in range(x.shape[1]):
    assert_close(step(ours, x[:, i:i + 1]), theirs(x[:, i:i + 1], decode=True))
  assert_close(ours.cached_key[...], theirs.cached_key[...])
  assert int(ours.cache_index[...]) == int(theirs.cache_index[...]) == x.shape[1]


def test_decoding_with_a_variant_matches_the_full_forward(default_mode):
  """A prompt chunk then single tokens, ALiBi + sliding window (absolute
  positions), a caller padding mask: equal to the causal full forward;
  writing past the cache's end gives NaN, not a silently wrong output."""
  variant = V.alibi(num_heads=HEADS) + V.sliding_window(4)
  _, full = flax_pair(variant=variant)
  _, decoder = flax_pair(variant=variant)
  x = random((BATCH, 9, FEATURES))
  keys_kept = jnp.arange(9) != 1  # drop key 1 for every query
  want = full(x, mask=keys_kept[None, None, None, :])
  decoder.init_cache(x.shape)
  chunks = [(0, 4)] + [(i, i + 1) for i in range(4, 9)]
  got = [decoder(x[:, a:b], decode=True, mask=jnp.broadcast_to(
      keys_kept, (BATCH, 1, b - a, 9))) for a, b in chunks]
  assert_close(jnp.concatenate(got, axis=1), want)
  assert np.isnan(np.asarray(decoder(x[:, :1], decode=True))).all()


def test_learned_alibi_and_relative_position_gradients(default_mode):
  """VariantAttention params get the gradients of the dense reference; as
  the attention_fn of Flax's own layer they are part of its state."""
  q, k, v = (random((BATCH, SEQ, HEADS, 8), seed=s) for s in range(3))
  cotangent = random((BATCH, SEQ, HEADS, 8), seed=5)
  modules = [pa_flax.learned_alibi(HEADS, plus=V.causal()),
             pa_flax.relative_position_bias(HEADS, 4, plus=V.causal())]
  modules[1].table[...] = random((HEADS, 7), seed=6)
  for module in modules:
    got = flat_grads(nnx.grad(lambda m: jnp.sum(m(q, k, v) * cotangent))(module))
    want = flat_grads(nnx.grad(lambda m: jnp.sum(pa.attention_reference(
        q, k, v, **m.current_variant().kwargs()) * cotangent))(module))
    for path, grad in got.items():
      assert np.abs(np.asarray(grad)).max() > 0, path
      assert_close(grad, want[path]), path

  layer = nnx.MultiHeadAttention(HEADS, FEATURES, decode=False, rngs=nnx.Rngs(0),
                                 attention_fn=modules[0])
  assert nnx.state(layer, nnx.Param)["attention_fn"]["slopes"][...].shape == (HEADS,)


def test_training_step_under_nnx_jit_lowers_the_loss(default_mode):
  """optax + nnx.jit with a learned-ALiBi causal layer: a few steps fit a target."""
  layer = pa_flax.MultiHeadAttention(HEADS, FEATURES, decode=False, rngs=nnx.Rngs(0),
                                     variant=pa_flax.learned_alibi(HEADS, plus=V.causal()))
  optimizer = nnx.Optimizer(layer, optax.adam(3e-2), wrt=nnx.Param)
  x, target = random((BATCH, SEQ, FEATURES), seed=1), random((BATCH, SEQ, FEATURES), seed=2)

  @nnx.jit
  def step(layer, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(layer)
    optimizer.update(layer, grads)
    return loss

  losses = [float(step(layer, optimizer)) for _ in range(5)]
  assert losses[-1] < 0.9 * losses[0], losses


def test_vmap_and_jit_of_attention_fn(default_mode):
  q, k, v = (random((3, BATCH, SEQ, HEADS, 8), seed=s) for s in range(3))
  causal_fn = pa_flax.make_attention_fn(variant=V.causal())
  assert_close(jax.jit(jax.vmap(causal_fn))(q, k, v), causal_fn(q, k, v))


def test_missing_flax_fails_clearly(monkeypatch):
  assert_missing_extra_fails(monkeypatch, "flax")
