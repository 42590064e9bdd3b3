"""Backward kernels against jax.grad of the dense float32 reference.

Interpret mode on CPU; each test also has a compiled (`gpu`) variant. Every
check differentiates `sum(out * cotangent)` with a random cotangent with
respect to q, k, v and the float arrays score_mod closes over.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import pallas_attn as pa
import test_attention_forward as forward_tests
from conftest import MODES, RANDOM_SHAPES, TOLERANCE, assert_close, modes, qkv, random

SMALL = pa.AttentionConfig(block_q=16, block_k=16, num_warps=4, num_stages=1)
HEADS = 4
CAUSAL = lambda b, h, qi, ki: qi >= ki


def loss_fns(cotangent, *, make_kwargs, fill=-jnp.inf, interpret=True, config=SMALL,
             bwd_config=SMALL, implementation=None):
  """(ours, reference) as functions of (q, k, v, captures) -> scalar loss."""

  def ours(q, k, v, captures):
    out = pa.attention(q, k, v, config=config, bwd_config=bwd_config, interpret=interpret,
                       implementation=implementation, **make_kwargs(captures))
    return jnp.sum(out.astype(jnp.float32) * cotangent)

  def reference(q, k, v, captures):
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    out = pa.attention_reference(q, k, v, masked_fill=fill, **make_kwargs(captures))
    return jnp.sum(out * cotangent)

  return ours, reference


def check_gradients(q, k, v, captures=None, *, make_kwargs, dtype=jnp.float32, factor=1.0,
                    jit_reference=False, **loss_kwargs):
  """Asserts that d loss / d(q, k, v, captures) match the reference's; returns ours.
  `jit_reference`: the reference's gradient as one compiled program, cheaper than its
  eager ops (a compilation each) where the shapes are new to the process."""
  captures = {} if captures is None else captures
  cotangent = random((*q.shape[:3], v.shape[3]), seed=99)
  ours, reference = loss_fns(cotangent, make_kwargs=make_kwargs, **loss_kwargs)
  got = jax.grad(ours, argnums=(0, 1, 2, 3))(q, k, v, captures)
  reference_grad = jax.grad(reference, argnums=(0, 1, 2, 3))
  want = (jax.jit(reference_grad) if jit_reference else reference_grad)(q, k, v, captures)
  for name, g, w in zip("qkv", got[:3], want[:3]):
    assert g.dtype == dtype, name
    assert_gradient_close(g, w, cotangent, dtype, factor)
  for name in captures:
    assert_gradient_close(got[3][name], want[3][name], cotangent, dtype, factor)
  return got


def assert_gradient_close(got, want, cotangent, dtype, factor):
  """Relative error; against a vanishing reference (dq and dk with a single
  key), the error relative to the cotangent's size."""
  scale = np.linalg.norm(np.asarray(cotangent))
  if np.linalg.norm(np.asarray(want, np.float32)) > 1e-6 * scale:
    assert_close(got, want, dtype, factor)
  else:
    assert np.linalg.norm(np.asarray(got, np.float32)) <= TOLERANCE[dtype] * factor * scale


# Every rownorm with a causal mask; one per class (and the max statistic) without.
ROWNORM_CASES = ([(name, True) for name in forward_tests.ROWNORMS]
                 + [(name, False) for name in ("softmax", "sigmoid", "retnet_abs_sum",
                                               "max_normalized")])


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("name,masked", ROWNORM_CASES,
                         ids=[f"{n}-{'causal' if m else 'dense'}" for n, m in ROWNORM_CASES])
def test_rownorm_classes(name, masked, interpret):
  rownorm, fill = forward_tests.ROWNORMS[name]
  q, k, v = qkv()
  check_gradients(q, k, v, fill=fill, interpret=interpret, make_kwargs=lambda c: dict(
      rownorm=rownorm, mask_mod=CAUSAL if masked else None))


SCORE_MODS = {
    "softcap": ((), lambda c: lambda s, b, h, qi, ki: 5.0 * jnp.tanh(s / 5.0)),
    "alibi": (("slopes",), lambda c: lambda s, b, h, qi, ki:
              s + c["slopes"][h] * (ki - qi).astype(jnp.float32)),
    "bias_bhqk": (("bias4",), lambda c: lambda s, b, h, qi, ki: s + c["bias4"][b, h, qi, ki]),
    "bias_hqk": (("bias3",), lambda c: lambda s, b, h, qi, ki: s + c["bias3"][h, qi, ki]),
    "key_bias": (("key_bias",), lambda c: lambda s, b, h, qi, ki: s + c["key_bias"][b, ki]),
    # Query-scaled, transposed [Skv, Sq], scalar and size-1 (fixed index) captures at once.
    "mixed_layouts": (("query_bias", "transposed", "temperature", "broadcast_batch"),
                      lambda c: lambda s, b, h, qi, ki:
                      s * c["query_bias"][qi] / c["temperature"] + c["transposed"][ki, qi]
                      + jnp.tanh(c["broadcast_batch"][b, ki])),
}


# Every score_mod dense; with a mask, one capture per kind of gradient partial
# (per row, per tile, per key).
SCORE_MOD_CASES = ([(name, False) for name in SCORE_MODS]
                   + [(name, True) for name in ("alibi", "bias_bhqk", "key_bias")])


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("name,masked", SCORE_MOD_CASES,
                         ids=[f"{n}-{'causal' if m else 'dense'}" for n, m in SCORE_MOD_CASES])
def test_score_mod_and_capture_gradients(name, masked, interpret):
  q, k, v = qkv()
  used, make_score_mod = SCORE_MODS[name]
  captures = {n: x for n, x in forward_tests._captures(2, HEADS, 37, 45).items() if n in used}
  check_gradients(q, k, v, captures, interpret=interpret, make_kwargs=lambda c: dict(
      score_mod=make_score_mod(c), mask_mod=CAUSAL if masked else None))


@pytest.mark.parametrize("interpret", MODES)
def test_sigmoid_with_key_bias_and_head_dependent_mask(interpret):
  """Per-head tile lists in the dk/dv pass (GQA group of 2 with different masks)."""
  q, k, v = qkv()
  captures = {"key_bias": random((2, 45), seed=9)}
  window = lambda b, h, qi, ki: (qi >= ki) & (qi - ki < 8 + 8 * h)
  check_gradients(q, k, v, captures, interpret=interpret, make_kwargs=lambda c: dict(
      rownorm="sigmoid", mask_mod=window,
      score_mod=lambda s, b, h, qi, ki: s + c["key_bias"][b, ki]))


@pytest.mark.parametrize("interpret", MODES)
def test_integer_capture_gets_no_gradient(interpret):
  q, k, v = qkv(seq_q=45, seq_kv=45)
  doc = jnp.array(np.sort(np.random.RandomState(0).randint(0, 4, size=(2, 45))), jnp.int32)
  cotangent = random((2, 45, HEADS, 40), seed=99)

  def loss(q, k, v, doc, attention):
    mask_mod = lambda b, h, qi, ki: (doc[b, qi] == doc[b, ki]) & (qi >= ki)
    return jnp.sum(attention(q, k, v, mask_mod=mask_mod) * cotangent)

  ours = functools.partial(pa.attention, config=SMALL, bwd_config=SMALL, interpret=interpret)
  got = jax.grad(loss, argnums=(0, 1, 2, 3), allow_int=True)(q, k, v, doc, ours)
  want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, doc, pa.attention_reference)
  assert got[3].dtype == jax.dtypes.float0
  for g, w in zip(got[:3], want):
    assert_close(g, w)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("rownorm", ["softmax", "sigmoid", forward_tests.retnet_norm],
                         ids=["softmax", "sigmoid", "retnet"])
def test_fully_masked_rows_get_zero_gradients(rownorm, interpret):
  q, k, v = qkv()
  mask_mod = lambda b, h, qi, ki: (qi % 2 == 0) & (ki < 40)
  # A finite fill keeps the reference's own gradient finite on empty rows.
  fill = 0.0 if callable(rownorm) else -1e9
  dq, dk, dv, _ = check_gradients(q, k, v, fill=fill, interpret=interpret,
                                  make_kwargs=lambda c: dict(rownorm=rownorm, mask_mod=mask_mod))
  np.testing.assert_array_equal(np.asarray(dq[:, 1::2]), 0.0)
  np.testing.assert_array_equal(np.asarray(dk[:, 40:]), 0.0)
  np.testing.assert_array_equal(np.asarray(dv[:, 40:]), 0.0)


LAYOUT_CASES = {f"{layout}-{dtype_id}": (dtype, 4, kv_heads)
                for layout, kv_heads in (("mha", 4), ("mqa", 1))
                for dtype_id, dtype in (("fp32", jnp.float32), ("bf16", jnp.bfloat16))}


# Interpret mode: both layouts in float32, bfloat16 in MQA (four query heads' dk/dv
# summed into one kv head); the dtype's handling does not depend on the layout.
@pytest.mark.parametrize("dtype,heads,kv_heads,interpret",
                         modes(LAYOUT_CASES, ["mha-fp32", "mqa-fp32", "mqa-bf16"]))
def test_dtypes_and_head_layouts(dtype, heads, kv_heads, interpret):
  """Causal gradients (and their dtype) for the head layout and dtype."""
  q, k, v = qkv(heads=heads, kv_heads=kv_heads, dtype=dtype)
  check_gradients(q, k, v, dtype=dtype, factor=2.0, interpret=interpret,
                  make_kwargs=lambda c: dict(mask_mod=CAUSAL))


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("bwd_blocks", [(32, 16), (16, 32), None],
                         ids=["32x16", "16x32", "default"])
def test_backward_blocks_differ_from_forward(bwd_blocks, interpret):
  q, k, v = qkv(d_qk=16, d_v=16)
  bwd_config = None if bwd_blocks is None else pa.AttentionConfig(*bwd_blocks, 4, 1)
  captures = {"slopes": jnp.linspace(0.1, 1.0, HEADS)}
  check_gradients(q, k, v, captures, interpret=interpret, bwd_config=bwd_config,
                  make_kwargs=lambda c: dict(
                      score_mod=lambda s, b, h, qi, ki: s + c["slopes"][h] * (ki - qi)))


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("bwd_blocks", [(16, 16), (64, 32)], ids=["finer", "coarser"])
@pytest.mark.parametrize("captures_array", [False, True], ids=["static", "captured"])
def test_masked_backward_retiles_the_block_mask(bwd_blocks, captures_array, interpret):
  """With a mask, the backward keeps its own tiles (lists re-tiled from the same mask)."""
  q, k, v = qkv(seq_q=45, seq_kv=37, d_qk=16, d_v=16)
  offsets = jnp.array([0, 5], jnp.int32)
  mask_mod = ((lambda b, h, qi, ki: qi + offsets[b] >= ki) if captures_array
              else (lambda b, h, qi, ki: (qi >= ki) & (qi - ki < 20)))
  captures = {"bias": random((HEADS, 45, 37), seed=7)}  # a tile-addressed gradient
  check_gradients(q, k, v, captures, interpret=interpret,
                  config=pa.AttentionConfig(32, 32, 4, 1),
                  bwd_config=pa.AttentionConfig(*bwd_blocks, 4, 1),
                  make_kwargs=lambda c: dict(
                      mask_mod=mask_mod,
                      score_mod=lambda s, b, h, qi, ki: s + c["bias"][h, qi, ki]))


@pytest.mark.parametrize("interpret", MODES)
def test_row_statistic_cotangents(interpret):
  """Gradients through the returned lse (softmax) and divisor (normalized)."""
  q, k, v = qkv()
  run = functools.partial(pa.attention, config=SMALL, bwd_config=SMALL, interpret=interpret,
                          return_lse=True)

  def softmax_loss(q, k, v):
    out, lse = run(q, k, v, mask_mod=CAUSAL)
    return jnp.sum(out) + jnp.sum(jnp.sin(lse))

  def softmax_reference(q, k, v):
    out, lse = pa.attention_reference(q, k, v, mask_mod=CAUSAL, return_lse=True)
    return jnp.sum(out) + jnp.sum(jnp.sin(lse))

  def retnet_loss(q, k, v):
    out, divisor = run(q, k, v, rownorm=forward_tests.retnet_norm)
    return jnp.sum(out) + jnp.sum(jnp.log(divisor))

  def retnet_reference(q, k, v):
    scores = pa.reference.dense_scores(q, k)
    divisor = jnp.maximum(jnp.sum(jnp.abs(scores), -1), 1.0)
    out = pa.attention_reference(q, k, v, rownorm=forward_tests.retnet_norm, masked_fill=0.0)
    return jnp.sum(out) + jnp.sum(jnp.log(divisor))

  for ours, reference in ((softmax_loss, softmax_reference), (retnet_loss, retnet_reference)):
    got = jax.grad(ours, argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(reference, argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
      assert_close(g, w)


@pytest.mark.parametrize("interpret", MODES)
def test_jit_value_and_grad_and_checkpoint(interpret):
  q, k, v = qkv()
  slopes = jnp.linspace(0.1, 1.0, HEADS)
  cotangent = random((2, 37, HEADS, 40), seed=99)

  def loss(q, k, v, slopes, attention):
    alibi = lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)
    return jnp.sum(attention(q, k, v, score_mod=alibi, mask_mod=CAUSAL) * cotangent)

  ours = functools.partial(loss, attention=functools.partial(
      pa.attention, config=SMALL, bwd_config=SMALL, interpret=interpret))
  reference = functools.partial(loss, attention=pa.attention_reference)
  want_value, want = jax.value_and_grad(reference, argnums=(0, 1, 2, 3))(q, k, v, slopes)
  value, got = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2, 3)))(q, k, v, slopes)
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  remat = jax.grad(jax.checkpoint(ours), argnums=(0, 1, 2, 3))(q, k, v, slopes)
  for g, r, w in zip(got, remat, want):
    assert_close(g, w)
    assert_close(r, w)


@pytest.mark.parametrize("interpret", MODES)
def test_vmap_of_grad(interpret):
  q, k, v = qkv(batch=1)
  stacked = [jnp.stack([x, x * 0.5]) for x in (q, k, v)]
  cotangent = random((1, 37, HEADS, 40), seed=99)

  def loss(q, k, v, attention):
    return jnp.sum(attention(q, k, v, mask_mod=CAUSAL) * cotangent)

  ours = functools.partial(loss, attention=functools.partial(
      pa.attention, config=SMALL, bwd_config=SMALL, interpret=interpret))
  got = jax.vmap(jax.grad(ours, argnums=(0, 1, 2)))(*stacked)
  for i in range(2):
    want = jax.grad(functools.partial(loss, attention=pa.attention_reference),
                    argnums=(0, 1, 2))(*(x[i] for x in stacked))
    for g, w in zip(got, want):
      assert_close(g[i], w)


@settings(max_examples=5, deadline=None)
@given(**RANDOM_SHAPES)
def test_random_shapes_property(batch, seq_q, seq_kv, kv_heads, group, d_qk, d_v, causal, seed):
  q, k, v = qkv(batch, seq_q, seq_kv, kv_heads * group, kv_heads, d_qk, d_v, seed=seed)
  # A fill of -1e9 keeps the reference finite on rows that causal masking empties.
  check_gradients(q, k, v, fill=-1e9, jit_reference=True, make_kwargs=lambda c: dict(
      mask_mod=CAUSAL if causal else None))


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("mask_mod", [None, CAUSAL], ids=["dense", "causal"])
@pytest.mark.parametrize("d_qk", [128, 192])
def test_float32_default_tiles(d_qk, mask_mod, interpret):
  """The default tiles of float32 heads (16-row backward tiles past 128)
  fit shared memory (compiled) and are exact."""
  q, k, v = qkv(batch=1, seq_q=70, seq_kv=90, heads=2, kv_heads=1, d_qk=d_qk, d_v=128)
  check_gradients(q, k, v, interpret=interpret, config=None, bwd_config=None,
                  make_kwargs=lambda c: dict(mask_mod=mask_mod))
