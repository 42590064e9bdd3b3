"""Flax layers on pallas_attn kernels.

The three-line swap, for a model built with `flax.nnx` (or linen)::

    from pallas_attn.layers import flax as pa_flax
    layer = nnx.MultiHeadAttention(..., attention_fn=pa_flax.attention_fn)     # same layer
    layer = pa_flax.MultiHeadAttention(..., variant=variants.softcap(30.0))   # or ours

- `attention_fn`: `flax.nnx.dot_product_attention`'s signature and semantics
  (linen's keywords accepted too), for the `attention_fn=` of
  `nnx.MultiHeadAttention` and `linen.MultiHeadDotProductAttention`.
- `make_attention_fn(score_mod, mask_mod, rownorm, variant)`: the same with
  a variant.
- `VariantAttention`: an `nnx.Module` attention_fn whose variant reads
  learnable `nnx.Param`s (ALiBi slopes, relative-position tables).
- `MultiHeadAttention`: `nnx.MultiHeadAttention` (same constructor, call,
  parameters and KV cache) plus `variant` / `score_mod` / `mask_mod` /
  `rownorm`, with decoding that keeps the variant's positions.

Differences from Flax's dense attention: a query row whose keys are all
masked returns zeros (Flax averages every value); attention weights are
never materialized, so dropout on them and `sow_weights` raise an error.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

try:
  from flax import nnx
  from flax.nnx.nn import dtypes as nnx_dtypes
except ImportError as error:  # pragma: no cover - exercised by a test with flax hidden
  raise ImportError("pallas_attn.layers.flax needs flax (flax.nnx): "
                    "pip install -e '.[flax]'") from error

from pallas_attn import variants
from pallas_attn.layers import _common
from pallas_attn.variants import Variant


def _check_supported(dropout_rate, deterministic, module, einsums):
  """Errors for what a fused kernel cannot honor (nothing is silently ignored)."""
  if dropout_rate > 0.0 and not deterministic:
    raise NotImplementedError(
        f"dropout on attention weights (dropout_rate={dropout_rate}, deterministic=False) "
        "is not supported: pallas_attn never materializes the weights. Use "
        "deterministic=True or dropout_rate=0.0 (dropout on the layer's output still works).")
  if module is not None:
    raise NotImplementedError("attention weights cannot be sown (module= / sow_weights=True): "
                              "pallas_attn never materializes them")
  named = [name for name, fn in einsums.items() if fn is not None]
  if named:
    raise NotImplementedError(f"custom einsums ({', '.join(named)}) cannot run inside the "
                              "fused kernel; leave them None")


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionFn:
  """`flax.nnx.dot_product_attention` on pallas_attn kernels, with `variant`.

  Call: query `[batch..., Sq, Hq, D]`, key `[batch..., Skv, Hkv, D]`, value
  `[batch..., Skv, Hkv, Dv]` (GQA when Hkv divides Hq; no batch dims or
  several, merged into one for the kernel) -> `[batch..., Sq, Hq, Dv]`.
  `bias` and `mask` broadcast to `[batch..., Hq, Sq, Skv]` and become
  arrays the variant's score_mod / mask_mod read (bias added after the
  variant's score_mod, and differentiable; mask False drops a key).
  `is_causal`: query i keeps keys j <= i (top-left, as
  Flax). `dtype` / `promote_dtype` promote q, k, v as Flax does;
  `precision` and `force_fp32_for_softmax` are accepted and moot (the
  kernels accumulate and normalize in float32); dropout with
  `deterministic=False`, `module` and custom einsums raise.
  """
  variant: Variant = _common.VANILLA

  def __call__(self, query, key, value, bias=None, mask=None, broadcast_dropout=True,
               dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
               precision=None, module=None, promote_dtype=nnx_dtypes.promote_dtype,
               is_causal=False, force_fp32_for_softmax=False, einsum_dot_general=None,
               qk_attn_weights_einsum=None, attn_weights_value_einsum=None):
    del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax  # moot here
    _check_supported(dropout_rate, deterministic, module, dict(
        einsum_dot_general=einsum_dot_general, qk_attn_weights_einsum=qk_attn_weights_einsum,
        attn_weights_value_einsum=attn_weights_value_einsum))
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    if query.ndim < 3:
      raise ValueError(f"query must be [batch..., q_length, heads, head_dim]; got shape "
                       f"{query.shape}")
    batch_shape = query.shape[:-3]
    q, k, v = (_common.merge_batch_dims(x, batch_shape, name)
               for x, name in ((query, "query"), (key, "key"), (value, "value")))
    full_shape = (q.shape[2], q.shape[1], k.shape[1])
    bias, mask = (None if x is None else _common.as_4d(x, batch_shape, full_shape, name)
                  for x, name in ((bias, "bias"), (mask, "mask")))
    out = _common.attend(q, k, v, self.variant, bias=bias, mask=mask, causal=is_causal)
    return out.reshape(batch_shape + out.shape[1:])

  def current_variant(self) -> Variant:
    """The variant this function runs (as `VariantAttention.current_variant`)."""
    return self.variant


attention_fn = AttentionFn()  # vanilla: the drop-in for flax.nnx.dot_product_attention


def make_attention_fn(score_mod=None, mask_mod=None, rownorm="softmax",
                      variant: Variant | None = None) -> AttentionFn:
  """An `attention_fn` (the signature of `flax.nnx.dot_product_attention`)
  running `variant` and then `score_mod` / `mask_mod` / `rownorm`, e.g.
  `make_attention_fn(variant=variants.softcap(30.0) + variants.sliding_window(4096))`.

  Captured arrays are constants of the function; for learnable ones use
  `VariantAttention`. In Flax's own layers' decode mode the single query is
  row 0 (Flax passes no positions): variants that depend on positions
  decode correctly only in this module's `MultiHeadAttention`.
  """
  return AttentionFn(_common.resolve_variant(variant, score_mod, mask_mod, rownorm))


class VariantAttention(nnx.Module):
  """An `attention_fn` whose variant is rebuilt at each call from learnable
  `nnx.Param`s, so that their gradients flow (through the kernels' captured
  array gradients).

  `build(**params) -> Variant` receives the current values, e.g.
  `VariantAttention(lambda slopes: variants.alibi(slopes) + variants.causal(),
  slopes=variants.alibi_slopes(8))`. As an nnx module it can be the
  `attention_fn` of `nnx.MultiHeadAttention` or the `variant` of ours; the
  params live in the layer's state (`layer.attention_fn.slopes`).
  """

  def __init__(self, build: Callable[..., Variant], **params):
    self.build = build
    self.param_names = tuple(params)
    for name, value in params.items():
      setattr(self, name, nnx.Param(jnp.asarray(value)))

  def current_variant(self) -> Variant:
    """The variant built from the params' current values."""
    return self.build(**{name: getattr(self, name)[...] for name in self.param_names})

  def __call__(self, query, key, value, bias=None, mask=None, **kwargs):
    return AttentionFn(self.current_variant())(query, key, value, bias, mask, **kwargs)


def learned_alibi(num_heads: int, *, plus: Variant | None = None) -> VariantAttention:
  """ALiBi with learnable slopes (initialized as in the paper), followed by
  `plus`, e.g. `variants.causal()` or `variants.sliding_window(4096)`."""
  return VariantAttention(lambda slopes: variants.compose(variants.alibi(slopes), *_opt(plus)),
                          slopes=variants.alibi_slopes(num_heads))


def relative_position_bias(num_heads: int, max_distance: int, *,
                           plus: Variant | None = None) -> VariantAttention:
  """A learnable bias per head and clipped distance (T5-style, without
  buckets): `score + table[h, clip(kv - q, -(max_distance-1), max_distance-1)
  + max_distance - 1]`, table `[num_heads, 2 * max_distance - 1]` starting
  at zero; `plus` follows (a mask, say)."""
  if max_distance < 1:
    raise ValueError(f"max_distance must be >= 1; got {max_distance}")
  reach = max_distance - 1

  def build(table):
    def score_mod(score, b, h, q_idx, kv_idx):
      return score + table[h, jnp.clip(kv_idx - q_idx, -reach, reach) + reach]
    return variants.compose(Variant("relative_position", score_mod=score_mod), *_opt(plus))
  return VariantAttention(build, table=jnp.zeros((num_heads, 2 * max_distance - 1),
                                                 jnp.float32))


def _opt(variant):
  return () if variant is None else (variant,)


def _layer_attention_fn(attention_fn, variant, score_mod, mask_mod, rownorm):
  """The layer's attention: ours, from `attention_fn` or the variant arguments."""
  own = score_mod is not None or mask_mod is not None or rownorm != "softmax"
  if attention_fn is not None:
    if not isinstance(attention_fn, (AttentionFn, VariantAttention)):
      raise TypeError("pallas_attn's MultiHeadAttention takes attention_fn from "
                      "pallas_attn.layers.flax (attention_fn, make_attention_fn, "
                      f"VariantAttention); got {attention_fn!r}. For another attention "
                      "function use flax.nnx.MultiHeadAttention.")
    if variant is not None or own:
      raise ValueError("give attention_fn or variant/score_mod/mask_mod/rownorm, not both")
    return attention_fn
  if isinstance(variant, VariantAttention):
    if own:
      raise ValueError("a VariantAttention carries its variant: put score_mod/mask_mod/"
                       "rownorm into its build function")
    return variant
  return AttentionFn(_common.resolve_variant(variant, score_mod, mask_mod, rownorm))


class MultiHeadAttention(nnx.MultiHeadAttention):
  """`flax.nnx.MultiHeadAttention` on pallas_attn kernels, with a variant.

  Constructor and call are Flax's (its arguments pass through unchanged,
  `num_kv_heads` for GQA included); the parameters (`query`, `key`,
  `value`, `out`, `query_ln` / `key_ln`) and the cache (`cached_key`,
  `cached_value`, `cache_index`) have Flax's names and shapes, so Flax
  states load into this layer and back. Added arguments:

  - `variant`: a `pallas_attn.variants.Variant` or a `VariantAttention`
    (learnable), e.g. `variants.causal() + variants.softcap(30.0)`;
  - `score_mod`, `mask_mod`, `rownorm`: composed after `variant`.

  Decoding (`decode=True` after `init_cache`) takes one token per call as
  Flax does, or a chunk of them (a prompt): each query attends to the cached
  keys up to its own position, and the variant's score_mod / mask_mod see
  absolute positions (the cache index), so ALiBi, windows and the like
  decode as they train (`is_causal` is implied there: Flax's would keep
  key 0 only). Writing past the cache's end gives NaN outputs.
  """

  def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
               out_features: int | None = None, num_kv_heads: int | None = None,
               in_kv_features: int | None = None, *, variant=None, score_mod=None,
               mask_mod=None, rownorm="softmax", attention_fn=None, **flax_kwargs):
    super().__init__(num_heads, in_features, qkv_features, out_features, num_kv_heads,
                     in_kv_features, attention_fn=_layer_attention_fn(
                         attention_fn, variant, score_mod, mask_mod, rownorm), **flax_kwargs)

  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None,
               deterministic=None, rngs=None, sow_weights=False, decode=None, is_causal=False,
               out_sharding=None, qkv_sharding=None):
    if not (self.decode if decode is None else decode):
      return super().__call__(inputs_q, inputs_k, inputs_v, mask=mask,
                              deterministic=deterministic, rngs=rngs, sow_weights=sow_weights,
                              decode=decode, is_causal=is_causal, out_sharding=out_sharding,
                              qkv_sharding=qkv_sharding)
    del rngs, is_causal  # no dropout to draw; decoding is causal by position
    dropout_off = self.deterministic if deterministic is None else deterministic
    _check_supported(self.dropout_rate, dropout_off, self if sow_weights else None, {})
    query, key, value = self._project(inputs_q, inputs_k, inputs_v, qkv_sharding)
    return self.out(self._decode(query, key, value, mask), out_sharding=out_sharding)

  def _project(self, inputs_q, inputs_k, inputs_v, qkv_sharding):
    """Multi-headed q, k, v from the inputs, as Flax's call makes them."""
    if inputs_k is None:
      if inputs_v is not None:
        raise ValueError("inputs_k cannot be None if inputs_v is not None")
      inputs_k = inputs_q
    if inputs_v is None:
      inputs_v = inputs_k
    if inputs_q.shape[-1] != self.in_features:
      raise ValueError(f"Incompatible input dimension, got {inputs_q.shape[-1]} but module "
                       f"expects {self.in_features}.")
    query = self.query(inputs_q, out_sharding=qkv_sharding)
    key = self.key(inputs_k, out_sharding=qkv_sharding)
    value = self.value(inputs_v, out_sharding=qkv_sharding)
    if self.normalize_qk:
      query, key = self.query_ln(query), self.key_ln(key)
    return query, key, value

  def _decode(self, query, key, value, mask):
    """Writes the chunk's keys and values at `cache_index` and attends over
    the cache up to each query's position."""
    if self.cached_key is None or self.cached_value is None or self.cache_index is None:
      raise ValueError("Autoregressive cache not initialized, call init_cache first.")
    *batch_dims, max_length, kv_heads, head_dim = self.cached_key.shape
    chunk = key.shape[-3]
    if key.shape != (*batch_dims, chunk, kv_heads, head_dim):
      raise ValueError(f"Autoregressive cache shape error: the cache holds "
                       f"{tuple(self.cached_key.shape)}, so keys must be "
                       f"{(*batch_dims, 'tokens', kv_heads, head_dim)}; got {key.shape}")
    index = self.cache_index[...]
    zero = jnp.zeros((), index.dtype)
    start = (zero,) * len(batch_dims) + (index, zero, zero)
    cache_dtype = self.cached_key.dtype
    k_cache = jax.lax.dynamic_update_slice(self.cached_key[...], key.astype(cache_dtype), start)
    v_cache = jax.lax.dynamic_update_slice(self.cached_value[...], value.astype(cache_dtype),
                                           start)
    self.cached_key[...], self.cached_value[...] = k_cache, v_cache
    self.cache_index[...] = index + chunk

    batch_shape = tuple(batch_dims)
    q, k, v = (_common.merge_batch_dims(x, batch_shape, name) for x, name in (
        (query, "query"), (k_cache, "key cache"), (v_cache, "value cache")))
    q, k, v = nnx_dtypes.promote_dtype((q, k, v), dtype=self.dtype)
    # Clamped so a write past the cache's end reaches the NaN below, not a length error.
    lengths = jnp.full((q.shape[0],), jnp.minimum(index + chunk, max_length), jnp.int32)
    parts = [variants.causal(), self.attention_fn.current_variant()]
    if mask is not None:
      mask = _common.as_4d(mask, batch_shape, (self.num_heads, chunk, max_length), "mask")
      parts.append(_common.caller_variant(mask=mask, q_origin=lambda b: lengths[b] - chunk))
    out = _common.cache_attention(q, k, v, lengths, **variants.compose(*parts).kwargs())
    out = jnp.where(index + chunk <= max_length, out, jnp.nan)  # past the cache's end
    return out.reshape(batch_shape + out.shape[1:])
