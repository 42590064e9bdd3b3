"""fp8 prefill (issue 40): `attention` on q, k, v of one fp8 dtype with
FlashAttention-3's descales (real values are `x.astype(float32) *
descale`), against the dense float32 reference on the dequantized inputs;
forward only; the errors. On Hopper (`hopper`), e4m3 calls with head dims of
128 and softmax rownorms run both products on fp8 wgmma; the others (and
interpret mode) are dequantized to bfloat16 before the kernels."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_attn as pa
from conftest import MODES, assert_close
from pallas_attn import api, fp8
from pallas_attn import variants as V

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def inputs(seq_q=37, seq_kv=50, heads=4, kv_heads=2, d=32, seed=0, rising_keys=False):
  """float32 q, k, v (Sq != Skv, GQA) whose heads differ in scale, k with an
  outlier channel; with `rising_keys`, keys that grow along the sequence (by
  1% a position), so that a row's scores, and its running max, jump from one
  key tile to the next."""
  rng = np.random.default_rng(seed)
  head_scales = lambda *s: np.array(s)[None, None, :, None]
  q = rng.standard_normal((2, seq_q, heads, d)) * head_scales(0.5, 2.0, 1.0, 3.0)[:, :, :heads]
  k, v = (rng.standard_normal((2, seq_kv, kv_heads, d)) * head_scales(0.3, 4.0)[:, :, :kv_heads]
          for _ in range(2))
  k[..., 3] *= 20.0
  if rising_keys:
    k *= (1.0 + np.arange(seq_kv) / 100.0)[None, :, None, None]
  return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))


def dequantized(x8, descale):
  scale = descale[:, None, :, None] if jnp.ndim(descale) == 2 else descale
  return x8.astype(jnp.float32) * scale


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("dtype,per,variant", [
    (E4M3, "head", V.causal()),
    (E4M3, "tensor", V.softcap(20.0) + V.causal()),
    (E4M3, "head", V.alibi(num_heads=4) + V.sliding_window(9)),
    (E5M2, "head", V.sigmoid(seq_kv=50)),
])
def test_fp8_prefill_matches_the_dequantized_reference(dtype, per, variant, interpret):
  quantized = [pa.quantize_fp8(x, per=per, dtype=dtype) for x in inputs()]
  (q8, qd), (k8, kd), (v8, vd) = quantized
  out = pa.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                     interpret=interpret, **variant.kwargs())
  assert out.dtype == jnp.bfloat16
  want = pa.attention_reference(*(dequantized(x, d) for x, d in quantized), **variant.kwargs())
  assert not np.isnan(np.asarray(out, np.float32)).any()
  assert_close(out, want, jnp.bfloat16)


def test_fp8_prefill_under_jit_with_sinks_and_lse():
  """Descales passed as jit arguments, sinks, the log-sum-exp of the real scores."""
  (q8, qd), (k8, kd), (v8, vd) = (pa.quantize_fp8(x) for x in inputs())
  sinks = jnp.linspace(-1.0, 1.0, 4)

  @jax.jit
  def call(q8, k8, v8, qd, kd, vd):
    return pa.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, sinks=sinks,
                        return_lse=True, interpret=True, **V.causal().kwargs())
  out, lse = call(q8, k8, v8, qd, kd, vd)
  real = [dequantized(x, d) for x, d in ((q8, qd), (k8, kd), (v8, vd))]
  want, want_lse = pa.attention(*real, sinks=sinks, return_lse=True, interpret=True,
                                **V.causal().kwargs())
  assert_close(out, want, jnp.bfloat16)
  assert_close(lse, want_lse, jnp.bfloat16)


def test_fp8_prefill_errors():
  q, k, v = inputs()
  (q8, qd), (k8, kd), (v8, vd) = (pa.quantize_fp8(x) for x in (q, k, v))
  qb = q.astype(jnp.bfloat16)
  cases = [
      ((qb, k8, v8), {}, TypeError, "all of one fp8 dtype"),
      ((q8, k8, v8.astype(jnp.float32).astype(E5M2)), {}, TypeError, "all of one fp8 dtype"),
      ((qb, qb, qb), dict(q_descale=2.0), TypeError, "scale fp8 inputs"),
      ((q8, k8, v8), dict(k_descale=jnp.ones((2, 4))), ValueError, r"k_descale must be .*\[2, 2\]"),
      ((q8, k8, v8), dict(q_descale=jnp.ones((4,))), ValueError, r"q_descale must be .*\[2, 4\]"),
  ]
  for args, kwargs, error, match in cases:
    with pytest.raises(error, match=match):
      pa.attention(*args, interpret=True, **kwargs)
  loss = lambda q8, qd, kd, vd: pa.attention(q8, k8, v8, q_descale=qd, k_descale=kd,
                                             v_descale=vd, interpret=True).astype(jnp.float32).sum()
  for argnum in range(4):  # the fp8 input, and each descale (as on fp8 tensor cores)
    with pytest.raises(ValueError, match="fp8 attention is forward only"):
      jax.grad(loss, argnum)(q8, qd, kd, vd)


def test_negative_descales_give_nan_factors():
  """The kernel's softmax takes the score factor inside its exp2: a negative
  descale would be silently wrong there, so its factor is NaN."""
  factors = fp8.kernel_descales(jnp.array([[1.0, -2.0]]), 0.5, 3.0, 1, 2, 1)
  np.testing.assert_array_equal(np.isnan(np.asarray(factors[..., 0])), [[False, True]])
  np.testing.assert_allclose(np.asarray(factors[0, 0]), [0.5, 3.0])


_TABLE = jnp.asarray(np.random.default_rng(1).standard_normal((4, 511)), jnp.float32)
RELATIVE_TABLE = V.Variant("relative table",
                           score_mod=lambda s, b, h, qi, ki: s + _TABLE[h, qi - ki + 255])

TENSOR_CORE_CASES = {
    "vanilla": (V.Variant("vanilla"), dict()),
    "causal-ragged": (V.causal(), dict(seq_q=300, seq_kv=300)),
    "softcap-sq-ne-skv": (V.softcap(20.0) + V.causal(), dict(seq_q=200, seq_kv=333)),
    "alibi-window": (V.alibi(num_heads=4) + V.sliding_window(100), dict(seq_q=384, seq_kv=384)),
    "relative-table-d96": (RELATIVE_TABLE + V.causal(), dict(d=96)),
    "causal-gqa-1000": (V.causal(), dict(seq_q=1000, seq_kv=1000, kv_heads=1)),
    # Unmasked tiles keep a lazy running max (mosaic_forward.MAX_GROWTH): keys
    # whose scores grow along the sequence (log2 logits by more than 8 between
    # some 128-key tiles) make rows move their max and rescale mid-row, others
    # not; with a mask_mod, masked tiles then take the max exactly.
    "vanilla-rising-keys": (V.Variant("vanilla"),
                            dict(seq_q=1024, seq_kv=1000, rising_keys=True)),
    "softcap-rising-keys": (V.softcap(30.0), dict(seq_q=1024, seq_kv=1000, rising_keys=True)),
    "causal-rising-keys": (V.causal(), dict(seq_q=1000, seq_kv=1000, rising_keys=True)),
}


@pytest.mark.hopper
@pytest.mark.parametrize("per", ["head", "tensor"])
@pytest.mark.parametrize("name", list(TENSOR_CORE_CASES))
def test_fp8_tensor_cores_match_the_dequantized_reference(name, per):
  variant, shape = TENSOR_CORE_CASES[name]
  shape = dict(dict(seq_q=256, seq_kv=256, heads=4, kv_heads=2, d=128), **shape)
  quantized = [pa.quantize_fp8(x, per=per) for x in inputs(**shape)]
  (q8, qd), (k8, kd), (v8, vd) = quantized
  prepared = api._prepare(*(jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) for x in (q8, k8, v8)),
                          fp8_dtype=q8.dtype, **variant.kwargs())
  call, core = prepared[0], prepared[-1]
  assert api.fp8_tensor_core_obstacle(call, q8, v8, core) is None
  assert call.config.block_q == 192  # three consumer warpgroups (fp8_config)
  out, lse = pa.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                          return_lse=True, **variant.kwargs())
  assert out.dtype == jnp.bfloat16
  real = [dequantized(x, d) for x, d in quantized]
  want, want_lse = pa.attention_reference(*real, return_lse=True, **variant.kwargs())
  assert not np.isnan(np.asarray(out, np.float32)).any()
  # Each weight rounds to e4m3 (3 mantissa bits) before the PV product.
  assert_close(out, want, jnp.bfloat16, factor=4)
  assert_close(lse, want_lse, jnp.bfloat16)


@pytest.mark.hopper
def test_fp8_tensor_cores_under_jit_with_sinks():
  (q8, qd), (k8, kd), (v8, vd) = (pa.quantize_fp8(x) for x in inputs(200, 270, d=128))
  sinks = jnp.linspace(-1.0, 1.0, 4)

  @jax.jit
  def call(q8, k8, v8, qd, kd, vd):
    return pa.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, sinks=sinks,
                        return_lse=True, **V.causal().kwargs())
  out, lse = call(q8, k8, v8, qd, kd, vd)
  real = [dequantized(x, d) for x, d in ((q8, qd), (k8, kd), (v8, vd))]
  want, want_lse = pa.attention_reference(*real, sinks=sinks, return_lse=True,
                                          **V.causal().kwargs())
  assert_close(out, want, jnp.bfloat16, factor=4)
  assert_close(lse, want_lse, jnp.bfloat16)
  with pytest.raises(ValueError, match="fp8 attention is forward only"):
    jax.grad(lambda q8: call(q8, k8, v8, qd, kd, vd)[0].astype(jnp.float32).sum())(q8)


@pytest.mark.hopper
def test_fp8_tensor_cores_with_a_block_mask():
  """A block mask built at the fp8 forward's tiles, passed to a jitted call."""
  quantized = [pa.quantize_fp8(x) for x in inputs(500, 500, d=128)]
  (q8, qd), (k8, kd), (v8, vd) = quantized
  mask = pa.block_mask(V.causal().mask_mod, 2, 4, 500, 500, block_q=192, block_kv=128)
  call = jax.jit(lambda *args: pa.attention(*args[:3], q_descale=args[3], k_descale=args[4],
                                            v_descale=args[5], block_mask=mask,
                                            **V.causal().kwargs()))
  out = call(q8, k8, v8, qd, kd, vd)
  want = pa.attention_reference(*(dequantized(x, d) for x, d in quantized),
                                **V.causal().kwargs())
  assert_close(out, want, jnp.bfloat16, factor=4)


@pytest.mark.hopper
def test_fp8_tensor_cores_under_vmap():
  """fp8 calls mapped over a leading axis (Pallas' batching rule gives the
  kernel a grid axis in front) match the calls one by one."""
  quantized = [[pa.quantize_fp8(x) for x in inputs(256, 256, d=128, seed=n)] for n in range(2)]
  # q8, k8, v8, then their descales, each stacked over the two calls
  args = [jnp.stack([quantized[n][i][part] for n in range(2)])
          for part in (0, 1) for i in range(3)]

  def call(q8, k8, v8, qd, kd, vd):
    return pa.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                        **V.causal().kwargs())
  mapped = jax.vmap(call)(*args)
  for n in range(2):
    one = call(*(x[n] for x in args))
    np.testing.assert_array_equal(np.asarray(mapped[n], np.float32), np.asarray(one, np.float32))


def test_fp8_tiles_and_their_obstacles():
  """Three consumer warpgroups of 64 rows over 128-key tiles (the weights
  leave registers), the 16-bit tiles for short queries and 64-key tiles;
  head dims, key tiles and shared memory the fp8 forward cannot take send
  the call to the dequantized path with a reason."""
  from pallas_attn.kernels import mosaic_forward
  from pallas_attn.schedule.config import AttentionConfig
  base = AttentionConfig(block_q=128, block_k=128, num_warps=12, num_stages=4)
  three = AttentionConfig(block_q=192, block_k=128, num_warps=16, num_stages=2)
  assert mosaic_forward.fp8_config(base, seq_q=4096) == three
  assert mosaic_forward.fp8_config(base, seq_q=100) == base
  short_keys = AttentionConfig(block_q=128, block_k=64, num_warps=12, num_stages=2)
  assert mosaic_forward.fp8_config(short_keys, seq_q=4096) == short_keys
  assert mosaic_forward.fp8_obstacle(base, 128, 128) is None
  assert mosaic_forward.fp8_obstacle(three, 128, 128) is None
  assert mosaic_forward.q_rows_multiple(192) == 64 and mosaic_forward.q_rows_multiple(128) == 128
  for config, dims, says in (
      (base, (64, 64), "head dims padded to 128"),
      (AttentionConfig(block_q=128, block_k=64, num_warps=12, num_stages=2), (128, 128),
       "128-key tiles"),
      (AttentionConfig(block_q=128, block_k=256, num_warps=12, num_stages=3), (128, 128),
       "KiB of shared memory")):
    assert says in mosaic_forward.fp8_obstacle(config, *dims)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("seq", [320, 512])
def test_fp8_values_layout(seq, interpret):
  """The fp8 forward's V: transposed, each 64-key group's keys in the order its
  weight tiles are stored (256-key programs, or 64 where 256 does not divide S)."""
  from pallas_attn.kernels import fp8_values
  v = jax.random.normal(jax.random.key(1), (2, seq, 3, 128), jnp.float32).astype(E4M3)
  out = fp8_values.transposed_values(v, interpret=interpret)
  want = fp8_values.reference(v)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
  order = np.asarray(fp8_values.reference(jnp.arange(64, dtype=jnp.float32)[None, :, None, None]))
  assert order.ravel()[[0, 1, 2, 16, 17, 63]].tolist() == [0, 1, 8, 2, 3, 63]
