"""fp8 KV caches for decoding (issue 40): `decode_attention` and
`paged_attention` on float8_e4m3fn / float8_e5m2 caches with their descales
(real values are `x.astype(float32) * descale`), against the dense float32
reference on the dequantized cache; `quantize_fp8`; the errors.

Caches hold NaN (in fp8) past each sequence's length, as in test_decode.py.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import pallas_attn as pa
from conftest import MODES, assert_close
from pallas_attn.kernels import backend
from pallas_attn import variants as V
from test_decode import SPLITS, poisoned, reference, to_pages

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
LENGTHS = jnp.asarray([5, 48, 50], jnp.int32)


def cache_inputs(seq_q, seed=0, seq=50, heads=4, kv_heads=2, d=32):
  """bf16 q; float32 k, v whose kv heads differ in scale, with an outlier channel."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((3, seq_q, heads, d)), jnp.bfloat16)
  scales = np.array([0.3, 5.0])[None, None, :kv_heads, None]
  k, v = (rng.standard_normal((3, seq, kv_heads, d)) * scales for _ in range(2))
  k[..., 3] *= 20.0  # an outlier channel
  return q, jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32)


def dequantized(x8, descale):
  scale = descale[:, None, :, None] if jnp.ndim(descale) == 2 else descale
  return x8.astype(jnp.float32) * scale


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("dtype,per,config,seq_q", [
    (E4M3, "head", pa.DecodeConfig(block_k=16, num_splits=1), 1),
    (E4M3, "tensor", SPLITS, 4),        # splits merged: v's descale on the partial outputs
    (E5M2, "head", SPLITS, 1),
], ids=["e4m3-head", "e4m3-tensor-splits", "e5m2-head-splits"])
def test_fp8_cache_matches_the_dequantized_reference(dtype, per, config, seq_q, interpret):
  q, k, v = cache_inputs(seq_q)
  (k8, k_descale), (v8, v_descale) = (pa.quantize_fp8(x, per=per, dtype=dtype) for x in (k, v))
  kwargs = dict(**V.causal().kwargs(), sinks=jnp.linspace(-1.0, 1.0, 4))
  out = pa.decode_attention(q, poisoned(k8, LENGTHS), poisoned(v8, LENGTHS), LENGTHS,
                            k_descale=k_descale, v_descale=v_descale, config=config,
                            interpret=interpret, **kwargs)
  assert out.dtype == jnp.bfloat16
  want = reference(q, dequantized(k8, k_descale), dequantized(v8, v_descale), LENGTHS, **kwargs)
  assert_close(out, want, jnp.bfloat16)


@pytest.mark.parametrize("interpret", MODES)
def test_fp8_cache_takes_queries_past_float16s_range(interpret):
  """The products run in float16; a query past its range is scaled by a
  power of two first (one kv head's queries here reach 2^20, the other's
  stay small), so nothing overflows and the small ones keep their digits."""
  q, k, v = cache_inputs(1, seed=2)
  q = q.at[:, :, :2].multiply(2.0 ** 20 / 8)
  (k8, k_descale), (v8, v_descale) = (pa.quantize_fp8(x) for x in (k, v))
  k_descale = k_descale * 2.0 ** -17  # keeps the scores' scale moderate
  out = pa.decode_attention(q, poisoned(k8, LENGTHS), poisoned(v8, LENGTHS), LENGTHS,
                            k_descale=k_descale, v_descale=v_descale, config=SPLITS,
                            interpret=interpret)
  want = reference(q, dequantized(k8, k_descale), dequantized(v8, v_descale), LENGTHS)
  assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
  assert_close(out, want, jnp.bfloat16)


@pytest.mark.parametrize("interpret", MODES)
def test_fp8_cache_with_odd_head_dims(interpret):
  """Dqk 48 != Dv 40: K padded to 64 columns, V read as 20 column pairs
  padded to 32 (padding clamped to the last column, read twice)."""
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.standard_normal((3, 2, 4, 48)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.standard_normal((3, 50, 2, d)), jnp.float32) for d in (48, 40))
  (k8, k_descale), (v8, v_descale) = (pa.quantize_fp8(x) for x in (k, v))
  out = pa.decode_attention(q, poisoned(k8, LENGTHS), poisoned(v8, LENGTHS), LENGTHS,
                            k_descale=k_descale, v_descale=v_descale, config=SPLITS,
                            interpret=interpret)
  assert out.shape == (3, 2, 4, 40)
  want = reference(q, dequantized(k8, k_descale), dequantized(v8, v_descale), LENGTHS)
  assert_close(out, want, jnp.bfloat16)


@pytest.mark.parametrize("interpret", MODES)
def test_e4m3_pairs_convert_every_value(interpret):
  """The split-KV kernel's V conversion (`backend.e4m3_pairs_to_float16`:
  PTX compiled on sm_89+, bit casts interpreted) against XLA's e4m3 ->
  float16 on every uint16, so every pair of e4m3 values: zeros,
  subnormals, the largest, NaN."""
  pairs = jnp.arange(1 << 16, dtype=jnp.uint32).astype(jnp.uint16).reshape(256, 256)
  asm = not interpret and backend.e4m3_pairs_supported()

  def kernel(pairs_ref, even_ref, odd_ref):
    even_ref[...], odd_ref[...] = backend.e4m3_pairs_to_float16(pairs_ref[...], asm=asm)

  shape = jax.ShapeDtypeStruct(pairs.shape, jnp.float16)
  with backend.triton_deprecation_ignored():
    got = backend.pallas_call(kernel, out_shape=[shape, shape], grid=(1,),
                              in_specs=[pl.BlockSpec(pairs.shape, lambda i: (0, 0))],
                              out_specs=[pl.BlockSpec(pairs.shape, lambda i: (0, 0))] * 2,
                              num_warps=4, num_stages=1, interpret=interpret,
                              name="e4m3_pairs")(pairs)
  values = jax.lax.bitcast_convert_type(pairs, E4M3)  # [..., 2]: low byte first
  for column, out in enumerate(got):
    want = np.asarray(values[..., column].astype(jnp.float16), np.float32)
    out = np.asarray(out, np.float32)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    np.testing.assert_array_equal(np.where(np.isnan(want), 0, out),
                                  np.where(np.isnan(want), 0, want))


@pytest.mark.parametrize("interpret", MODES)
def test_fp8_pages_match_the_contiguous_cache(interpret):
  q, k, v = cache_inputs(2, seed=1)
  (k8, k_descale), (v8, v_descale) = (pa.quantize_fp8(x) for x in (k, v))
  k_pages, table = to_pages(k8, LENGTHS, 4, seed=1)
  v_pages, _ = to_pages(v8, LENGTHS, 4, seed=1)
  kwargs = dict(**V.sliding_window(12).kwargs(), config=SPLITS, interpret=interpret,
                k_descale=k_descale, v_descale=v_descale)
  paged = pa.paged_attention(q, k_pages, v_pages, table, LENGTHS, **kwargs)
  contiguous = pa.decode_attention(q, poisoned(k8, LENGTHS), poisoned(v8, LENGTHS), LENGTHS,
                                   **kwargs)
  np.testing.assert_allclose(np.asarray(paged, np.float32), np.asarray(contiguous, np.float32),
                             rtol=2e-2, atol=2e-2)


def test_quantize_fp8():
  _, k, _ = cache_inputs(1)
  for per, shape in (("head", (3, 2)), ("tensor", ())):
    k8, descale = pa.quantize_fp8(k, per=per)
    assert k8.dtype == E4M3 and descale.shape == shape and descale.dtype == jnp.float32
    # e4m3 keeps 3 mantissa bits: within 2^-4 of each value, or of the descale near zero
    err = jnp.abs(dequantized(k8, descale) - k)
    scale = descale[:, None, :, None] if per == "head" else descale
    assert bool(jnp.all(err <= jnp.maximum(jnp.abs(k) * 2.0 ** -4, scale * 2.0 ** -6)))
  zeros8, descale = pa.quantize_fp8(jnp.zeros((1, 4, 2, 8)))
  assert bool(jnp.all(descale == 1.0)) and bool(jnp.all(zeros8.astype(jnp.float32) == 0))
  with pytest.raises(ValueError, match="per must be one of"):
    pa.quantize_fp8(k, per="channel")
  with pytest.raises(TypeError, match="float8_e4m3fn or float8_e5m2"):
    pa.quantize_fp8(k, dtype=jnp.bfloat16)


def test_fp8_errors():
  q, k, v = cache_inputs(1)
  k8, v8 = k.astype(E4M3), v.astype(E4M3)
  kb, vb = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
  cases = [
      ((q, kb, vb), dict(k_descale=2.0), TypeError, "scale an fp8 cache"),
      ((q.astype(jnp.float32), k8, v8), {}, TypeError, "bfloat16 or float16 query"),
      ((q.astype(E4M3), k8, v8), {}, TypeError, "q has dtype float8_e4m3fn"),
      ((q, k8, v.astype(E5M2)), {}, TypeError, "share an fp8 dtype"),
      ((q, k8, vb), {}, TypeError, "share an fp8 dtype"),
      ((q, k8, v8), dict(v_descale=jnp.ones((3,))), ValueError, r"scalar or \[B, Hkv\]"),
  ]
  for args, kwargs, error, match in cases:
    with pytest.raises(error, match=match):
      pa.decode_attention(*args, LENGTHS, interpret=True, **kwargs)
  with pytest.raises(TypeError, match="all of one fp8 dtype"):
    pa.attention(q, k8, v8, interpret=True)  # prefill: q, k and v all fp8
