"""fp8 inputs: `quantize_fp8` turns a cache (or q, k, v) into fp8 values and
the descales `decode_attention` / `paged_attention` / `attention` take (real
values are `x.astype(float32) * descale`, FlashAttention-3's convention);
`dequantized` is the fp8 prefill's way in to the 16-bit kernels."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_attn import _inputs

GRANULARITIES = ("tensor", "head")


def quantize_fp8(x, *, per: str = "head", dtype=jnp.float8_e4m3fn):
  """(x in `dtype`, its float32 descale) for a `[B, S, H, D]` cache or q, k,
  v of an fp8 prefill (or a `[num_pages, page_size, H, D]` pool with
  `per="tensor"`).

  per="head": one descale per sequence and head, `[B, H]`, from the largest
  magnitude of that head's keys (or values); per="tensor": one scalar. The
  values are scaled so that the largest maps to the dtype's largest finite
  value, then rounded to nearest."""
  if per not in GRANULARITIES:
    raise ValueError(f"per must be one of {GRANULARITIES}; got {per!r}")
  if jnp.dtype(dtype) not in tuple(map(jnp.dtype, _inputs.FP8_CACHE_DTYPES)):
    raise TypeError(f"dtype must be float8_e4m3fn or float8_e5m2; got {jnp.dtype(dtype)}")
  if getattr(x, "ndim", None) != 4:
    raise ValueError(f"x must be a [B, S, H, D] cache; got shape {getattr(x, 'shape', None)}")
  x = jnp.asarray(x, jnp.float32)
  largest = jnp.max(jnp.abs(x), axis=(1, 3) if per == "head" else None)
  descale = jnp.where(largest > 0, largest / float(jnp.finfo(dtype).max), 1.0)
  scale = descale[:, None, :, None] if per == "head" else descale
  limit = float(jnp.finfo(dtype).max)
  return jnp.clip(x / scale, -limit, limit).astype(dtype), descale.astype(jnp.float32)


PREFILL_NOTE = ("fp8 q / k / v: dequantized to bfloat16 before the kernels (q's and k's "
                "descales folded into q, v's into the output); no fp8 tensor-core template "
                "yet, so the call runs at bfloat16's rate plus one conversion pass")


@jax.custom_vjp
def _forward_only(x):
  return x


def _no_gradient(x):
  return x, None


def _refuse_gradient(_, cotangent):
  raise ValueError("fp8 attention is forward only (FlashAttention-3's fp8 path is too): "
                   "differentiate a bfloat16 call, e.g. on x.astype(jnp.bfloat16) * descale")


_forward_only.defvjp(_no_gradient, _refuse_gradient)


def dequantized(q, k, v, q_descale, k_descale, v_descale):
  """(q', k', v' in bfloat16, the output's [B, Hq] float32 factor) of an fp8
  prefill: scores from q' and k' are the real ones (q' = q * q_descale *
  k_descale of its kv head, rounded once to bfloat16; k' and v' exact), and
  the output times v's descale of each query head's kv head is the real
  output (every rownorm weighs v linearly). Differentiating raises."""
  batch, _, heads, _ = q.shape
  kv_heads = k.shape[2]

  def kv_of_head(descale):  # [B, Hkv] -> [B, Hq]: each query head's kv head's
    return jnp.repeat(_inputs.per_head_descale(descale, batch, kv_heads), heads // kv_heads,
                      axis=1)
  q_factor = _inputs.per_head_descale(q_descale, batch, heads) * kv_of_head(k_descale)
  q, k, v = (_forward_only(x) for x in (q, k, v))
  q = (q.astype(jnp.float32) * q_factor[:, None, :, None]).astype(jnp.bfloat16)
  return q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), kv_of_head(v_descale)
