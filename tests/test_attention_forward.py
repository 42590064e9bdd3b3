"""Forward kernel against the dense float32 reference (interpret mode; compiled on GPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import pallas_attn as pa
from conftest import MODES, RANDOM_SHAPES, assert_close, modes, qkv, random

SMALL = pa.AttentionConfig(block_q=16, block_k=16, num_warps=4, num_stages=1)
HEADS = 4


def retnet_norm(row):
  return row / jnp.maximum(jnp.sum(jnp.abs(row), axis=-1, keepdims=True), 1.0)


def temperature_softmax(row):
  z = row / 0.7
  e = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))
  return e / jnp.sum(e, axis=-1, keepdims=True)


def base2_softmax(row):
  e = jnp.exp2(row - jnp.max(row, axis=-1, keepdims=True))
  return e / jnp.sum(e, axis=-1, keepdims=True)


def max_normalized(row):
  return jnp.exp(row) * (1.0 / (1.0 + jnp.exp(jnp.max(row, axis=-1, keepdims=True))))


ROWNORMS = {
    "softmax": ("softmax", -jnp.inf),
    "sigmoid": ("sigmoid", -jnp.inf),
    "relu": ("relu", -jnp.inf),
    "none": ("none", -jnp.inf),
    "jax.nn.softmax": (jax.nn.softmax, -jnp.inf),
    "temperature_softmax": (temperature_softmax, -jnp.inf),
    "base2_softmax": (base2_softmax, -jnp.inf),
    "retnet_abs_sum": (retnet_norm, 0.0),
    "max_normalized": (max_normalized, -jnp.inf),
}


# Compiled, every rownorm dense and causal; in interpret mode every rownorm causal and,
# dense, one per class (named softmax, elementwise, normalized, and the max statistic),
# as in the backward tests: the other callables of a class take the same path.
ROWNORM_CASES = {f"{'causal' if masked else 'dense'}-{name}": (name, masked)
                 for masked in (False, True) for name in ROWNORMS}


@pytest.mark.parametrize("name,masked,interpret", modes(ROWNORM_CASES, [
    *(f"causal-{name}" for name in ROWNORMS),
    "dense-softmax", "dense-sigmoid", "dense-retnet_abs_sum", "dense-max_normalized"]))
def test_rownorm_classes(name, masked, interpret):
  """The rownorm (a named class or a callable) against the reference."""
  rownorm, fill = ROWNORMS[name]
  q, k, v = qkv()
  mask_mod = (lambda b, h, qi, ki: qi >= ki) if masked else None
  out = pa.attention(q, k, v, rownorm=rownorm, mask_mod=mask_mod, config=SMALL,
                     interpret=interpret)
  ref = pa.attention_reference(q, k, v, rownorm=rownorm, mask_mod=mask_mod, masked_fill=fill)
  assert_close(out, ref)


def _captures(batch, heads, seq_q, seq_kv):
  return dict(
      slopes=jnp.linspace(0.1, 1.0, heads),
      bias4=random((batch, heads, seq_q, seq_kv), seed=7),
      bias3=random((heads, seq_q, seq_kv), seed=8),
      key_bias=random((batch, seq_kv), seed=9),
      query_bias=random((seq_q,), seed=10),
      transposed=random((seq_kv, seq_q), seed=11),
      temperature=jnp.float32(1.3),
      broadcast_batch=random((1, seq_kv), seed=12),
      rows=random((3, seq_kv), seed=13),
      one_element=jnp.array([0.7]),
  )


SCORE_MODS = {
    "softcap": lambda c: lambda s, b, h, qi, ki: 5.0 * jnp.tanh(s / 5.0),
    "alibi": lambda c: lambda s, b, h, qi, ki: s + c["slopes"][h] * (ki - qi).astype(jnp.float32),
    "bias_bhqk": lambda c: lambda s, b, h, qi, ki: s + c["bias4"][b, h, qi, ki],
    "bias_hqk_chained": lambda c: lambda s, b, h, qi, ki: s + c["bias3"][h][qi][ki],
    "key_padding_bias": lambda c: lambda s, b, h, qi, ki: s + c["key_bias"][b, ki],
    "query_bias": lambda c: lambda s, b, h, qi, ki: s * c["query_bias"][qi],
    "kv_q_layout": lambda c: lambda s, b, h, qi, ki: s + c["transposed"][ki, qi],
    "size1_batch_axis": lambda c: lambda s, b, h, qi, ki: s + c["broadcast_batch"][b, ki],
    "constant_index": lambda c: lambda s, b, h, qi, ki: s + c["rows"][1, ki] - c["rows"][-1, ki],
    "scalar_capture": lambda c: lambda s, b, h, qi, ki: s / c["temperature"],
    "one_element_indexed": lambda c: lambda s, b, h, qi, ki: s * c["one_element"][b],
    "index_only": lambda c: lambda s, b, h, qi, ki: s + jnp.where(qi % 3 == 0, 0.5, -0.25),
}


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("name", list(SCORE_MODS))
def test_score_mods(name, interpret):
  q, k, v = qkv()
  score_mod = SCORE_MODS[name](_captures(2, HEADS, 37, 45))
  out = pa.attention(q, k, v, score_mod=score_mod, config=SMALL, interpret=interpret)
  ref = pa.attention_reference(q, k, v, score_mod=score_mod)
  assert_close(out, ref)


@pytest.mark.parametrize("interpret", MODES)
def test_document_mask_with_captured_ids(interpret):
  q, k, v = qkv(seq_q=45, seq_kv=45)
  doc = jnp.array(np.sort(np.random.RandomState(0).randint(0, 4, size=(2, 45))), jnp.int32)
  mask_mod = lambda b, h, qi, ki: (doc[b, qi] == doc[b, ki]) & (qi >= ki)
  out = pa.attention(q, k, v, mask_mod=mask_mod, config=SMALL, interpret=interpret)
  assert_close(out, pa.attention_reference(q, k, v, mask_mod=mask_mod))


@pytest.mark.parametrize("interpret", MODES)
def test_boolean_capture_mask(interpret):
  q, k, v = qkv()
  keep = jax.random.bernoulli(jax.random.PRNGKey(3), 0.7, (2, 45))
  mask_mod = lambda b, h, qi, ki: keep[b, ki]
  out = pa.attention(q, k, v, mask_mod=mask_mod, config=SMALL, interpret=interpret)
  assert_close(out, pa.attention_reference(q, k, v, mask_mod=mask_mod))


LAYOUT_CASES = {f"{layout}-{dtype_id}": (dtype, 4, kv_heads)
                for layout, kv_heads in (("mha", 4), ("gqa", 2), ("mqa", 1))
                for dtype_id, dtype in (("fp32", jnp.float32), ("bf16", jnp.bfloat16))}


# Interpret mode: the head layouts in float32, bfloat16 in GQA (float32 GQA is the
# layout of the other tests; the dtype's handling does not depend on the layout).
@pytest.mark.parametrize("dtype,heads,kv_heads,interpret",
                         modes(LAYOUT_CASES, ["mha-fp32", "mqa-fp32", "gqa-bf16"]))
def test_dtypes_and_head_layouts(dtype, heads, kv_heads, interpret):
  """Output dtype and values for the head layout and dtype."""
  q, k, v = qkv(heads=heads, kv_heads=kv_heads, dtype=dtype)
  out = pa.attention(q, k, v, config=SMALL, interpret=interpret)
  assert out.dtype == dtype
  ref = pa.attention_reference(q.astype(jnp.float32), k.astype(jnp.float32),
                               v.astype(jnp.float32))
  assert_close(out, ref, dtype)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("d_qk,d_v", [(48, 32), (32, 64), (16, 16)])
def test_head_dims(d_qk, d_v, interpret):
  q, k, v = qkv(d_qk=d_qk, d_v=d_v, seq_q=33, seq_kv=20)
  out = pa.attention(q, k, v, config=SMALL, interpret=interpret)
  assert out.shape == (2, 33, HEADS, d_v)
  assert_close(out, pa.attention_reference(q, k, v))


@pytest.mark.parametrize("interpret", MODES)
def test_lse_and_row_statistics(interpret):
  q, k, v = qkv()
  causal = lambda b, h, qi, ki: qi >= ki + 10  # first rows fully masked
  out, lse = pa.attention(q, k, v, mask_mod=causal, return_lse=True, config=SMALL,
                          interpret=interpret)
  ref, ref_lse = pa.attention_reference(q, k, v, mask_mod=causal, return_lse=True)
  assert_close(out, ref)
  assert lse.shape == (2, HEADS, 37)
  assert np.all(np.isneginf(np.asarray(lse[:, :, :10])))
  np.testing.assert_allclose(lse[:, :, 10:], ref_lse[:, :, 10:], rtol=1e-5, atol=1e-5)
  _, stat = pa.attention(q, k, v, rownorm="sigmoid", return_lse=True, config=SMALL,
                         interpret=interpret)
  assert stat is None
  _, divisor = pa.attention(q, k, v, rownorm=retnet_norm, return_lse=True, config=SMALL,
                            interpret=interpret)
  scores = pa.reference.dense_scores(q, k)
  expected = jnp.maximum(jnp.sum(jnp.abs(scores), -1), 1.0)
  np.testing.assert_allclose(divisor, expected, rtol=1e-5)


@pytest.mark.parametrize("rownorm,interpret", modes(
    {"softmax": ("softmax",), "sigmoid": ("sigmoid",), "relu": ("relu",), "none": ("none",),
     "retnet_norm": (retnet_norm,)}, ["softmax", "sigmoid", "none", "retnet_norm"]))
def test_fully_masked_rows_are_zero(rownorm, interpret):
  """Rows that the mask empties are 0, not NaN. Interpret mode: one rownorm per class,
  and "none", whose weight at a masked score (-inf) is not 0 by itself (relu's is)."""
  q, k, v = qkv()
  mask_mod = lambda b, h, qi, ki: (qi % 2 == 0) & (ki < 40)
  out = pa.attention(q, k, v, mask_mod=mask_mod, rownorm=rownorm, config=SMALL,
                     interpret=interpret)
  assert not np.isnan(np.asarray(out)).any()
  np.testing.assert_array_equal(np.asarray(out[:, 1::2]), 0.0)


@pytest.mark.parametrize("interpret", MODES)
def test_jit_vmap_and_callables_built_inside_jit(interpret):
  q, k, v = qkv()
  slopes = jnp.linspace(0.1, 1.0, HEADS)

  @jax.jit
  def f(q, k, v, slopes):
    score_mod = lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)
    return pa.attention(q, k, v, score_mod=score_mod, config=SMALL, interpret=interpret)

  alibi = lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)
  assert_close(f(q, k, v, slopes), pa.attention_reference(q, k, v, score_mod=alibi))
  stacked = [jnp.stack([x, x * 0.5]) for x in (q, k, v)]
  out = jax.vmap(lambda q, k, v: pa.attention(q, k, v, config=SMALL,
                                              interpret=interpret))(*stacked)
  for i in range(2):
    ref = pa.attention_reference(*(x[i] for x in stacked))
    assert_close(out[i], ref)


def test_eager_calls_compile_once_per_variant_and_shape():
  """Eager calls (no outer jit) reuse one compiled program across new
  closures of the same variant; each call still sees its own captured values."""
  from pallas_attn import api
  q, k, v = qkv()
  api._attention.clear_cache()
  for n in range(3):
    slopes = jnp.linspace(0.1, 1.0, HEADS) * (n + 1)
    alibi = lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)
    out = pa.attention(q, k, v, score_mod=alibi, config=SMALL, interpret=True)
    assert_close(out, pa.attention_reference(q, k, v, score_mod=alibi))
    grad = jax.grad(lambda sl: jnp.sum(pa.attention(
        q, k, v, score_mod=lambda s, b, h, qi, ki: s + sl[h] * (ki - qi), config=SMALL,
        interpret=True)))(slopes)
    ref = jax.grad(lambda sl: jnp.sum(pa.attention_reference(
        q, k, v, score_mod=lambda s, b, h, qi, ki: s + sl[h] * (ki - qi))))(slopes)
    assert_close(grad, ref)
  assert api._attention._cache_size() == 1  # grad runs under its own trace


@pytest.mark.parametrize("interpret", MODES)
def test_default_config_and_longer_sequence(interpret):
  q, k, v = qkv(batch=1, seq_q=200, seq_kv=130, heads=2, kv_heads=1, d_qk=64, d_v=64)
  out = pa.attention(q, k, v, mask_mod=lambda b, h, qi, ki: qi + 70 >= ki,
                     interpret=interpret)
  ref = pa.attention_reference(q, k, v, mask_mod=lambda b, h, qi, ki: qi + 70 >= ki)
  assert_close(out, ref)


@settings(max_examples=8, deadline=None)
@given(**RANDOM_SHAPES)
def test_random_shapes_property(batch, seq_q, seq_kv, kv_heads, group, d_qk, d_v, causal, seed):
  q, k, v = qkv(batch, seq_q, seq_kv, kv_heads * group, kv_heads, d_qk, d_v, seed=seed)
  mask_mod = (lambda b, h, qi, ki: qi >= ki) if causal else None
  out = pa.attention(q, k, v, mask_mod=mask_mod, config=SMALL, interpret=True)
  # The reference as one program: eagerly, each of its ops compiles anew for new shapes.
  reference = jax.jit(lambda q, k, v: pa.attention_reference(q, k, v, mask_mod=mask_mod))
  assert_close(out, reference(q, k, v))
