"""Dense plain-JAX reference of `pallas_attn.attention` (float32 math).

Materializes the `[B, H, Sq, Skv]` scores: for tests and as the XLA peer in
benchmarks, never for production use.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_attn.spec.rownorm import NAMED_ROWNORMS


def _grid_indices(batch, heads, seq_q, seq_kv):
  b = jnp.arange(batch, dtype=jnp.int32)[:, None, None, None]
  h = jnp.arange(heads, dtype=jnp.int32)[None, :, None, None]
  qi = jnp.arange(seq_q, dtype=jnp.int32)[None, None, :, None]
  ki = jnp.arange(seq_kv, dtype=jnp.int32)[None, None, None, :]
  return jnp.broadcast_arrays(b, h, qi, ki)


def dense_scores(q, k, *, score_mod=None, scale=None):
  """score_mod(q k^T * scale) as `[B, Hq, Sq, Skv]` float32."""
  batch, seq_q, heads, d_qk = q.shape
  group = heads // k.shape[2]
  scale = 1.0 / math.sqrt(d_qk) if scale is None else scale
  k = jnp.repeat(k, group, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST) * scale
  if score_mod is not None:
    idx = _grid_indices(batch, heads, seq_q, k.shape[1])
    s = jax.vmap(score_mod)(s.ravel(), *(i.ravel() for i in idx)).reshape(s.shape)
  return s


def dense_mask(mask_mod, batch, heads, seq_q, seq_kv):
  """mask_mod over every (b, h, q_idx, kv_idx) as a boolean `[B, H, Sq, Skv]`."""
  idx = _grid_indices(batch, heads, seq_q, seq_kv)
  return jax.vmap(mask_mod)(*(i.ravel() for i in idx)).reshape(idx[0].shape)


def attention_reference(q, k, v, *, score_mod=None, mask_mod=None, rownorm="softmax",
                        scale=None, sinks=None, masked_fill=-jnp.inf, return_lse=False):
  """Dense attention with the semantics of `pallas_attn.attention`.

  Masked positions enter the rownorm as `masked_fill` (-inf suits softmax
  and the elementwise rownorms; pass 0.0 for sum-normalized rownorms such as
  RetNet's) and get weight 0. Fully masked rows give zeros. `sinks` `[Hq]`
  enter as one more key column of those scores, dropped after the rownorm.
  """
  batch, seq_q, heads, _ = q.shape
  s = dense_scores(q, k, score_mod=score_mod, scale=scale)
  fn = NAMED_ROWNORMS[rownorm] if isinstance(rownorm, str) else rownorm
  keep = None
  if mask_mod is not None:
    keep = dense_mask(mask_mod, batch, heads, seq_q, k.shape[1])
    s = jnp.where(keep, s, masked_fill)
  if sinks is not None:
    sink_column = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, None],
                                   s.shape[:3] + (1,))
    s = jnp.concatenate([s, sink_column], axis=-1)
  w = fn(s)
  lse = jax.nn.logsumexp(s, axis=-1) if rownorm == "softmax" or fn is jax.nn.softmax else None
  if sinks is not None:
    w = w[..., :-1]
  if keep is not None:
    w = jnp.where(keep, w, 0.0)
    w = jnp.where(jnp.any(keep, axis=-1, keepdims=True), w, 0.0)
  v = jnp.repeat(v, heads // v.shape[2], axis=2)
  out = jnp.einsum("bhqk,bkhd->bqhd", w, v.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST).astype(q.dtype)
  return (out, lse) if return_lse else out
