"""Equinox layer on pallas_attn kernels.

The swap, for a model built with `equinox.nn`::

    from pallas_attn.layers import equinox as pa_eqx
    attention = pa_eqx.MultiheadAttention(num_heads, query_size, key=key,
                                          variant=variants.causal())

`MultiheadAttention` is `equinox.nn.MultiheadAttention` (a subclass: same
constructor, call and fields `query_proj`, `key_proj`, `value_proj`,
`output_proj`, `dropout`, ..., so `eqx.tree_at`, `tree_serialise_leaves`
files and weights carry over) plus the variant arguments. Inputs are
unbatched as in Equinox; `jax.vmap` over the layer batches the Pallas
kernels (one launch per pass for the whole batch, not one per example:
pallas_call's batching rule and Mosaic GPU's `plgpu.kernel` vmap rule each
add a grid axis).

Differences from Equinox's dense attention: a query row whose keys are all
masked returns zeros (Equinox averages every value); dropout on the
attention weights (`dropout_p > 0` outside inference) raises an error.
"""
from __future__ import annotations

import warnings
from typing import Callable

import jax

try:
  import equinox as eqx
except ImportError as error:  # pragma: no cover - exercised by a test with equinox hidden
  raise ImportError("pallas_attn.layers.equinox needs equinox: "
                    "pip install -e '.[equinox]'") from error

from pallas_attn.layers import _common
from pallas_attn.variants import Variant


class MultiheadAttention(eqx.nn.MultiheadAttention):
  """`equinox.nn.MultiheadAttention` on pallas_attn kernels, with a variant.

  Arguments: those of `equinox.nn.MultiheadAttention` (passed through),
  then `variant` (a `pallas_attn.variants.Variant`, e.g.
  `variants.causal() + variants.alibi(num_heads=8)`) and `score_mod`,
  `mask_mod`, `rownorm` composed after it. The variant's callables are
  static fields; its attention sinks, if any, are a field `sinks` (a leaf,
  trained like the weights). Call: Equinox's `(query, key_, value, mask=None,
  *, key=None, inference=None, deterministic=None, process_heads=None)`,
  with `mask` `[q_seq, kv_seq]` or `[num_heads, q_seq, kv_seq]`, True keeps.
  """

  score_mod: Callable | None = eqx.field(static=True)
  mask_mod: Callable | None = eqx.field(static=True)
  rownorm: str | Callable = eqx.field(static=True)
  sinks: jax.Array | None

  def __init__(self, *args, variant: Variant | None = None, score_mod=None, mask_mod=None,
               rownorm="softmax", **kwargs):
    super().__init__(*args, **kwargs)
    resolved = _common.resolve_variant(variant, score_mod, mask_mod, rownorm)
    self.score_mod, self.mask_mod = resolved.score_mod, resolved.mask_mod
    self.rownorm, self.sinks = resolved.rownorm, resolved.sinks

  def __call__(self, query, key_, value, mask=None, *, key=None, inference=None,
               deterministic=None, process_heads=None):
    del key  # only dropout would use it, and dropout on the weights is refused below
    if deterministic is not None:
      inference = deterministic
      warnings.warn("MultiheadAttention()(deterministic=...) is deprecated in favour of "
                    "MultiheadAttention()(inference=...)")
    inference = self.dropout.inference if inference is None else inference
    if self.dropout.p > 0 and not inference:
      raise NotImplementedError(
          f"dropout on attention weights (dropout_p={self.dropout.p}) is not supported: "
          "pallas_attn never materializes the weights. Call with inference=True or build "
          "the layer with dropout_p=0.0.")
    if query.ndim != 2 or key_.ndim != 2 or value.ndim != 2:
      raise ValueError(f"query, key_ and value are unbatched [seq, features] (jax.vmap over "
                       f"the batch); got {query.shape}, {key_.shape}, {value.shape}")
    if key_.shape[0] != value.shape[0]:
      raise ValueError("key and value must both be sequences of equal length.")
    heads = (self._project(self.query_proj, query), self._project(self.key_proj, key_),
             self._project(self.value_proj, value))
    if process_heads is not None:
      shapes = tuple(x.shape for x in heads)
      heads = process_heads(*heads)
      if tuple(x.shape for x in heads) != shapes:
        raise ValueError("process_heads must not change the shape of the heads.")
    q_seq, kv_seq = query.shape[0], key_.shape[0]
    if mask is not None:
      if mask.shape not in ((q_seq, kv_seq), (self.num_heads, q_seq, kv_seq)):
        raise ValueError(f"mask must have shape (query_seq_length, kv_seq_length) = "
                         f"({q_seq}, {kv_seq}) or (num_heads, ...) = ({self.num_heads}, "
                         f"{q_seq}, {kv_seq}); got {mask.shape}")
      mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    variant = Variant("layer", self.score_mod, self.mask_mod, self.rownorm, self.sinks)
    out = _common.attend(*(x[None] for x in heads), variant, mask=mask)[0]
    return jax.vmap(self.output_proj)(out.reshape(q_seq, -1))
