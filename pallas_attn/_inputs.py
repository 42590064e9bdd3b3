"""Checks of user inputs that every entry point makes, with errors that say what to fix.

`attention` (api.py), the decoding entry points (decode.py) and ring
attention (distributed/ring.py) share them.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_attn.spec.analysis import VariantAnalysis

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_qkv(q, k, v, *, k_name: str = "k", v_name: str = "v",
              kv_layout: str = "[batch, seq, heads, head_dim]"):
  """The checks every entry point makes of q and a K/V pair: 4-D arrays of
  one supported dtype, equal q/k head dims, query heads a multiple of kv
  heads (GQA/MQA)."""
  for i, (name, x) in enumerate((("q", q), (k_name, k), (v_name, v))):
    if getattr(x, "ndim", None) != 4:
      layout = "[batch, seq, heads, head_dim]" if i == 0 else kv_layout
      raise ValueError(f"{name} must be {layout}; got shape {getattr(x, 'shape', None)}")
    if x.dtype not in SUPPORTED_DTYPES:
      raise TypeError(f"{name} has dtype {x.dtype}; supported: float32, bfloat16, float16")
  if not q.dtype == k.dtype == v.dtype:
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
