"""fp8 prefill (issue 40): `attention` on q, k, v of one fp8 dtype with
FlashAttention-3's descales (real values are `x.astype(float32) *
descale`), against the dense float32 reference on the dequantized inputs;
forward only; the errors. The inputs are dequantized to bfloat16 before the
kernels for now (`pallas_attn.fp8.PREFILL_NOTE`)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_attn as pa
from conftest import MODES, assert_close
from pallas_attn import variants as V

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def inputs(seq_q=37, seq_kv=50, heads=4, kv_heads=2, d=32, seed=0):
  """float32 q, k, v (Sq != Skv, GQA) whose heads differ in scale, k with an outlier channel."""
  rng = np.random.default_rng(seed)
  head_scales = lambda *s: np.array(s)[None, None, :, None]
  q = rng.standard_normal((2, seq_q, heads, d)) * head_scales(0.5, 2.0, 1.0, 3.0)[:, :, :heads]
  k, v = (rng.standard_normal((2, seq_kv, kv_heads, d)) * head_scales(0.3, 4.0)[:, :, :kv_heads]
          for _ in range(2))
  k[..., 3] *= 20.0
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
  loss = lambda q8: pa.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                 interpret=True).astype(jnp.float32).sum()
  with pytest.raises(ValueError, match="fp8 attention is forward only"):
    jax.grad(loss)(q8)
