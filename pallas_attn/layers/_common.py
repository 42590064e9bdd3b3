"""What the Flax and Equinox layers share: a variant from the layer's
arguments, a caller's dense bias / mask as captured arrays, and attention
over a KV cache.

A dense `[batch, heads, Sq, Skv]` bias or mask from the caller is not
materialized into the scores: it becomes an array that score_mod / mask_mod
read elementwise (axes of size 1 read at index 0), so the kernel loads the
tiles it needs and the block mask still skips tiles the mask removes.
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from pallas_attn.api import attention
from pallas_attn.decode import decode_attention
from pallas_attn.schedule.config import MAX_DECODE_QUERIES
from pallas_attn.variants import Variant, compose

VANILLA = Variant("vanilla")


def resolve_variant(variant=None, score_mod=None, mask_mod=None, rownorm="softmax") -> Variant:
  """One `Variant` from a layer's `variant` and its `score_mod` /
  `mask_mod` / `rownorm` (composed after `variant`)."""
  if variant is not None and not isinstance(variant, Variant):
    raise TypeError(f"variant must be a pallas_attn.variants.Variant; got {type(variant)}")
  own = None
  if score_mod is not None or mask_mod is not None or rownorm != "softmax":
    own = Variant("custom", score_mod=score_mod, mask_mod=mask_mod, rownorm=rownorm)
  if variant is None:
    return own or VANILLA
  return variant if own is None else variant + own


def merge_batch_dims(x, batch_shape: tuple[int, ...], name: str):
  """`x` `[batch..., S, H, D]` as `[prod(batch), S, H, D]` (`[1, ...]` without batch dims)."""
  if x.shape[:-3] != tuple(batch_shape):
    raise ValueError(f"{name} has batch dims {x.shape[:-3]}; expected {tuple(batch_shape)} "
                     f"(query, key and value must share them)")
  return x.reshape((math.prod(batch_shape),) + x.shape[-3:])


def as_4d(array, batch_shape: tuple[int, ...], full_shape: tuple[int, int, int], name: str):
  """A caller's `array`, broadcastable to `[batch..., H, Sq, Skv]`, as 4-d
  `[1 or prod(batch), 1 or H, 1 or Sq, 1 or Skv]`: broadcast only across
  the batch dims when some of them, not all, have size 1."""
  array = jnp.asarray(array)
  target = tuple(batch_shape) + tuple(full_shape)
  if array.ndim > len(target):
    raise ValueError(f"{name} has shape {array.shape}, more dims than [batch..., heads, "
                     f"q_length, kv_length] = {target}")
  array = array.reshape((1,) * (len(target) - array.ndim) + array.shape)
  for size, want in zip(array.shape, target):
    if size not in (1, want):
      raise ValueError(f"{name} of shape {array.shape} does not broadcast to [batch..., "
                       f"heads, q_length, kv_length] = {target}")
  tail = array.shape[len(batch_shape):]
  if all(size == 1 for size in array.shape[:len(batch_shape)]):
    return array.reshape((1,) + tail)
  return jnp.broadcast_to(array, tuple(batch_shape) + tail).reshape(
      (math.prod(batch_shape),) + tail)


def _reader(array):
  """`(b, h, q_idx, kv_idx) -> array[...]` for a 4-d array, size-1 axes read at 0."""
  def read(b, h, q_idx, kv_idx):
    return array[tuple(i if size > 1 else 0
                       for i, size in zip((b, h, q_idx, kv_idx), array.shape))]
  return read


def caller_variant(bias=None, mask=None, q_origin=None) -> Variant:
  """A caller's 4-d `bias` (added to the score after the variant's
  score_mod) and boolean `mask` (True keeps) as captured arrays.

  `q_origin(b)`: the absolute position of the first query, when the kernel
  passes absolute query positions (cache attention) but the arrays are
  indexed by the query's row.
  """
  row = (lambda b, q_idx: q_idx) if q_origin is None else (
      lambda b, q_idx: q_idx - q_origin(b))
  score_mod = mask_mod = None
  if bias is not None:
    read_bias = _reader(bias)

    def score_mod(score, b, h, q_idx, kv_idx):
      return score + read_bias(b, h, row(b, q_idx), kv_idx).astype(score.dtype)
  if mask is not None:
    read_mask = _reader(mask.astype(jnp.bool_))

    def mask_mod(b, h, q_idx, kv_idx):
      return read_mask(b, h, row(b, q_idx), kv_idx)
  return Variant("caller", score_mod=score_mod, mask_mod=mask_mod)


def top_left_causal() -> Variant:
  """Causal as `is_causal` means it in Flax and `jax.nn`: query i keeps keys
  j <= i, whatever the lengths (not bottom-right aligned)."""
  return Variant("is_causal", mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)


def attend(query, key, value, variant: Variant, *, bias=None, mask=None, causal=False):
  """`pallas_attn.attention` of 4-d inputs with `variant`, then a caller's
  4-d bias and mask, and top-left causal masking if `causal`."""
  parts = [variant]
  if bias is not None or mask is not None:
    parts.append(caller_variant(bias, mask))
  if causal:
    parts.append(top_left_causal())
  return attention(query, key, value, **compose(*parts).kwargs())


def cache_attention(query, k_cache, v_cache, kv_lengths, *, score_mod=None, mask_mod=None,
                    rownorm="softmax", sinks=None):
  """Attention of `query` `[B, Sq, Hq, D]` over the first `kv_lengths[b]`
  positions of `k_cache` / `v_cache` `[B, S_max, Hkv, D]`.

  Query i of sequence b sits at absolute position `kv_lengths[b] - Sq + i`;
  score_mod and mask_mod see that position as `q_idx`: the contract of
  `pallas_attn.decode_attention`, which runs a few tokens (the split-KV
  template). A longer chunk (a prompt) runs the parallel template over the
  whole cache with the positions past each length masked.
  """
  seq_q = query.shape[1]
  if seq_q <= MAX_DECODE_QUERIES:
    return decode_attention(query, k_cache, v_cache, kv_lengths, score_mod=score_mod,
                            mask_mod=mask_mod, rownorm=rownorm, sinks=sinks)

  def position(b, q_idx):
    return kv_lengths[b] - seq_q + q_idx

  def valid_mask_mod(b, h, q_idx, kv_idx):
    keep = kv_idx < kv_lengths[b]
    if mask_mod is not None:
      keep = keep & mask_mod(b, h, position(b, q_idx), kv_idx)
    return keep

  positioned_score_mod = None
  if score_mod is not None:
    def positioned_score_mod(score, b, h, q_idx, kv_idx):
      return score_mod(score, b, h, position(b, q_idx), kv_idx)
  return attention(query, k_cache, v_cache, score_mod=positioned_score_mod,
                   mask_mod=valid_mask_mod, rownorm=rownorm, sinks=sinks)
