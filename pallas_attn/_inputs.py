"""Checks of user inputs that every entry point makes, with errors that say what to fix.

`attention` (api.py), the decoding entry points (decode.py) and ring
attention (distributed/ring.py) share them.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_attn.spec.analysis import VariantAnalysis

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
FP8_CACHE_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)  # decoding dequantizes them on load


def is_fp8(x) -> bool:
  return jnp.dtype(x.dtype) in tuple(map(jnp.dtype, FP8_CACHE_DTYPES))


def check_qkv(q, k, v, *, k_name: str = "k", v_name: str = "v",
              kv_layout: str = "[batch, seq, heads, head_dim]", fp8_cache: bool = False):
  """The checks every entry point makes of q and a K/V pair: 4-D arrays of
  one supported dtype (with `fp8_cache`, also a K/V pair of one fp8 dtype
  against a bfloat16 / float16 q), equal q/k head dims, query heads a
  multiple of kv heads (GQA/MQA)."""
  for i, (name, x) in enumerate((("q", q), (k_name, k), (v_name, v))):
    if getattr(x, "ndim", None) != 4:
      layout = "[batch, seq, heads, head_dim]" if i == 0 else kv_layout
      raise ValueError(f"{name} must be {layout}; got shape {getattr(x, 'shape', None)}")
    if x.dtype not in SUPPORTED_DTYPES and not (fp8_cache and i and is_fp8(x)):
      fp8 = " (and float8_e4m3fn / float8_e5m2 for a decoding cache)" if fp8_cache else ""
      if is_fp8(x) and not fp8_cache:
        fp8 = (". fp8 runs as q, k and v all of one fp8 dtype (attention with q_descale / "
               "k_descale / v_descale) or as a decoding cache (decode_attention / "
               "paged_attention with k_descale / v_descale)")
      raise TypeError(f"{name} has dtype {x.dtype}; supported: float32, bfloat16, "
                      f"float16{fp8}")
  if is_fp8(k) or is_fp8(v):
    if k.dtype != v.dtype:
      raise TypeError(f"{k_name} and {v_name} must share an fp8 dtype; got {k.dtype}, "
                      f"{v.dtype}")
    if q.dtype not in (jnp.bfloat16, jnp.float16):
      raise TypeError(f"an fp8 cache is read against a bfloat16 or float16 query (dequantized "
                      f"on load); q has dtype {q.dtype}")
  elif not q.dtype == k.dtype == v.dtype:
    raise TypeError(f"q, {k_name}, {v_name} must share a dtype; got {q.dtype}, {k.dtype}, "
                    f"{v.dtype}")
  if q.shape[3] != k.shape[3]:
    raise ValueError(f"q and {k_name} head dims differ: q {q.shape}, {k_name} {k.shape}")
  if q.shape[2] % k.shape[2]:
    raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of kv heads "
                     f"({k.shape[2]}) for GQA/MQA")


def check_attention_inputs(q, k, v):
  """attention's q, k, v: `check_qkv`, then one batch, one key length and
  one head count for k and v, non-empty sequences."""
  check_qkv(q, k, v)
  if not (q.shape[0] == k.shape[0] == v.shape[0]):
    raise ValueError(f"batch sizes differ: q {q.shape}, k {k.shape}, v {v.shape}")
  if k.shape[1] != v.shape[1]:
    raise ValueError(f"k and v sequence lengths differ: k {k.shape}, v {v.shape}")
  if k.shape[2] != v.shape[2]:
    raise ValueError(f"k and v head counts differ: k {k.shape}, v {v.shape}")
  if min(q.shape[1], k.shape[1]) == 0:
    raise ValueError("sequence lengths must be positive")


def resolve_sinks(sinks, analysis: VariantAnalysis, heads: int):
  """The `[Hq]` float32 sink logits the kernel starts rows at, or None:
  the caller's array, else the constant a recognized rownorm wrote."""
  rownorm = analysis.rownorm
  if sinks is None:
    return None if rownorm.sink is None else jnp.full((heads,), rownorm.sink, jnp.float32)
  if rownorm.kind != "softmax":
    raise ValueError(f"sinks add a term to a softmax denominator; rownorm "
                     f"'{rownorm.name}' is {rownorm.kind}")
  if rownorm.sink is not None:
    raise ValueError(f"rownorm '{rownorm.name}' already has a sink term (logit "
                     f"{rownorm.sink:g}); pass sinks or write one in the rownorm, not both")
  if getattr(sinks, "shape", None) != (heads,):
    raise ValueError(f"sinks must be [Hq] = [{heads}], one logit per query head; got shape "
                     f"{getattr(sinks, 'shape', type(sinks).__name__)}")
  if not jnp.issubdtype(sinks.dtype, jnp.floating):
    raise TypeError(f"sinks must be floating point; got {sinks.dtype}")
  return sinks


def check_fp8_prefill(q, k, v, q_descale, k_descale, v_descale):
  """Whether q, k, v are an fp8 prefill (all of one fp8 dtype; the descales
  are then checked: float32 scalars or `[B, Hq]` for q, `[B, Hkv]` for k and
  v); raises for a mix of fp8 and other dtypes, and for descales of non-fp8
  inputs."""
  given = [x for x in (q, k, v) if hasattr(x, "dtype")]
  fp8 = [is_fp8(x) for x in given]
  if not any(fp8):
    if any(d is not None for d in (q_descale, k_descale, v_descale)):
      raise TypeError("q_descale / k_descale / v_descale scale fp8 inputs (real values are "
                      f"x.astype(float32) * descale); q has dtype {q.dtype}")
    return False
  if not all(fp8) or len(given) != 3 or not q.dtype == k.dtype == v.dtype:
    raise TypeError(f"fp8 attention takes q, k and v all of one fp8 dtype; got {q.dtype}, "
                    f"{k.dtype}, {v.dtype} (an fp8 cache against a 16-bit query is "
                    "decode_attention's / paged_attention's)")
  for name, x, heads in (("q_descale", q_descale, q.shape[2]),
                         ("k_descale", k_descale, k.shape[2]),
                         ("v_descale", v_descale, v.shape[2])):
    shape = getattr(x, "shape", ())
    if x is not None and tuple(shape) not in ((), (q.shape[0], heads)):
      raise ValueError(f"{name} must be a scalar or [B, H] = [{q.shape[0]}, {heads}] (one per "
                       f"sequence and head); got shape {tuple(shape)}")
  return True


def descales(k_descale, v_descale, k, batch: int, k_name: str = "k_cache"):
  """(k's, v's) descales of an fp8 cache, float32 scalars (None: 1) or
  `[B, Hkv]` as given (not broadcast: the split-KV kernel reads either
  without an XLA pass); None for another cache, which takes no descales."""
  heads_kv = k.shape[2]
  if not is_fp8(k):
    if k_descale is not None or v_descale is not None:
      raise TypeError(f"k_descale / v_descale scale an fp8 cache (real values are "
                      f"x.astype(float32) * descale); {k_name} has dtype {k.dtype}")
    return None
  scales = []
  for name, x in (("k_descale", k_descale), ("v_descale", v_descale)):
    if x is not None and jnp.shape(x) not in ((), (batch, heads_kv)):
      raise ValueError(f"{name} must be a scalar or [B, Hkv] = [{batch}, {heads_kv}]; got "
                       f"shape {jnp.shape(x)}")
    scales.append(jnp.ones((), jnp.float32) if x is None else jnp.asarray(x, jnp.float32))
  return tuple(scales)


def per_head_descale(descale, batch: int, heads: int):
  """A descale (None: 1, a scalar or `[B, H]`) as `[B, H]` float32."""
  x = jnp.ones((), jnp.float32) if descale is None else jnp.asarray(descale, jnp.float32)
  return jnp.broadcast_to(x, (batch, heads))
