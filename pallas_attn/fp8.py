"""fp8 KV caches: `quantize_fp8` turns a cache into fp8 values and the
descales `decode_attention` / `paged_attention` take (real values are
`x.astype(float32) * descale`, FlashAttention-3's convention)."""
from __future__ import annotations

import jax.numpy as jnp

from pallas_attn import _inputs

GRANULARITIES = ("tensor", "head")


def quantize_fp8(x, *, per: str = "head", dtype=jnp.float8_e4m3fn):
  """(x in `dtype`, its float32 descale) for a `[B, S, H, D]` cache (or a
  `[num_pages, page_size, H, D]` pool with `per="tensor"`).

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
