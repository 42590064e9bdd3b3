"""Built-in attention variants: ready score_mod / mask_mod / rownorm bundles.

Each constructor returns a `Variant`; pass it as
`pallas_attn.attention(q, k, v, **variant.kwargs())`. Variants compose with
`+` (or `compose`): score_mods chain in order, mask_mods are ANDed, and at
most one rownorm may differ from softmax, e.g.
`softcap(30.0) + sliding_window(256) + document(segment_ids)`. A variant
with attention sinks (`sink`) also passes `sinks`.

Positions when Sq != Skv: constructors that take `seq_q` / `seq_kv` align
queries bottom-right, as FlashAttention 2.1+ does: query i sits at absolute
position `i + Skv - Sq`, the position of the last query matching the last key
(decoding with a KV cache). With both lengths None or equal, query i sits at
position i. A query with no key left (Sq > Skv) returns zeros.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_attn.api import attention

DEFAULT_ROWNORM = "softmax"


@dataclasses.dataclass(frozen=True)
class Variant:
  """A named attention variant: the three callables of `attention`, and
  per-head sink logits where it has them."""
  name: str
  score_mod: Callable | None = None
  mask_mod: Callable | None = None
  rownorm: str | Callable = DEFAULT_ROWNORM
  sinks: jax.Array | None = None

  def kwargs(self) -> dict:
    """`attention` keyword arguments: `attention(q, k, v, **variant.kwargs())`."""
    kwargs = dict(score_mod=self.score_mod, mask_mod=self.mask_mod, rownorm=self.rownorm)
    if self.sinks is not None:
      kwargs["sinks"] = self.sinks
    return kwargs

  def __add__(self, other):
    if not isinstance(other, Variant):
      return NotImplemented
    return compose(self, other)


def _chain_score_mods(mods):
  """score_mods applied in order."""
  if len(mods) == 1:
    return mods[0]

  def score_mod(score, b, h, q_idx, kv_idx):
    for mod in mods:
      score = mod(score, b, h, q_idx, kv_idx)
    return score
  return score_mod


def _and_mask_mods(mods):
  """mask_mods ANDed."""
  if len(mods) == 1:
    return mods[0]

  def mask_mod(b, h, q_idx, kv_idx):
    keep = mods[0](b, h, q_idx, kv_idx)
    for mod in mods[1:]:
      keep = keep & mod(b, h, q_idx, kv_idx)
    return keep
  return mask_mod


def compose(*variants: Variant) -> Variant:
  """One variant applying all of `variants`: score_mods in order, mask_mods
  ANDed, the one rownorm that is not softmax (ValueError if two differ) and
  the one variant's sinks (ValueError if two have them)."""
  score_mods = [v.score_mod for v in variants if v.score_mod is not None]
  mask_mods = [v.mask_mod for v in variants if v.mask_mod is not None]
  rownorms = []
  for v in variants:
    if v.rownorm != DEFAULT_ROWNORM and v.rownorm not in rownorms:
      rownorms.append(v.rownorm)
  if len(rownorms) > 1:
    raise ValueError(f"cannot compose variants with different rownorms: {rownorms}")
  sinks = [v.sinks for v in variants if v.sinks is not None]
  if len(sinks) > 1:
    raise ValueError("cannot compose two variants with sinks; give one the sum of the "
                     "logsumexp of both")
  return Variant(name="+".join(v.name for v in variants) or "vanilla",
                 score_mod=_chain_score_mods(score_mods) if score_mods else None,
                 mask_mod=_and_mask_mods(mask_mods) if mask_mods else None,
                 rownorm=rownorms[0] if rownorms else DEFAULT_ROWNORM,
                 sinks=sinks[0] if sinks else None)


def _query_offset(seq_q, seq_kv) -> int:
  """Skv - Sq for bottom-right alignment; 0 when both lengths are None."""
  if (seq_q is None) != (seq_kv is None):
    raise ValueError(f"give both seq_q and seq_kv or neither; got seq_q={seq_q}, "
                     f"seq_kv={seq_kv}")
  return 0 if seq_q is None else int(seq_kv) - int(seq_q)


def _query_position(q_idx, offset: int):
  """The absolute position of query q_idx (bottom-right aligned)."""
  return q_idx + offset if offset else q_idx


def _causal_keep(q_idx, kv_idx, offset: int):
  """Key kv_idx is at or before query q_idx's (aligned) position."""
  return _query_position(q_idx, offset) >= kv_idx


def causal(*, seq_q=None, seq_kv=None) -> Variant:
  """Causal (autoregressive) masking as a mask_mod: query i keeps keys j <= i.

  With `seq_q` != `seq_kv` the mask is bottom-right aligned (FlashAttention
  2.1+): query i keeps keys j <= i + Skv - Sq.
  """
  offset = _query_offset(seq_q, seq_kv)

  def mask_mod(b, h, q_idx, kv_idx):
    return _causal_keep(q_idx, kv_idx, offset)
  return Variant("causal", mask_mod=mask_mod)


def sliding_window(size: int, causal: bool = True, *, seq_q=None, seq_kv=None) -> Variant:
  """Local attention over a window of `size` keys (Longformer, Beltagy et al.
  2020; Mistral 7B, Jiang et al. 2023).

  Causal: keep `q - size < kv <= q` (the query and the `size - 1` keys before
  it). Non-causal: keep `|q - kv| < size`. `q` is bottom-right aligned when
  `seq_q` != `seq_kv` (see the module docstring).
  """
  if size < 1:
    raise ValueError(f"window size must be >= 1; got {size}")
  offset = _query_offset(seq_q, seq_kv)

  def mask_mod(b, h, q_idx, kv_idx):
    q_pos = _query_position(q_idx, offset)
    if causal:
      return (q_pos - size < kv_idx) & (kv_idx <= q_pos)
    return jnp.abs(q_pos - kv_idx) < size
  return Variant(f"sliding_window({size})", mask_mod=mask_mod)


def prefix_lm(prefix_lengths, *, seq_q=None, seq_kv=None) -> Variant:
  """Prefix-LM masking (T5, Raffel et al. 2020; UniLM, Dong et al. 2019;
  PaliGemma, Beyer et al. 2024): full bidirectional attention to the first
  `prefix_lengths[b]` keys, causal after them.

  `prefix_lengths`: int `[B]` (per batch row) or a scalar shared by all rows.
  """
  prefix = jnp.asarray(prefix_lengths, jnp.int32)
  if prefix.ndim > 1:
    raise ValueError(f"prefix_lengths must be [B] or a scalar; got shape {prefix.shape}")
  prefix_of = (lambda b: prefix[b]) if prefix.ndim == 1 else (lambda b: prefix)
  offset = _query_offset(seq_q, seq_kv)

  def mask_mod(b, h, q_idx, kv_idx):
    in_prefix = kv_idx < prefix_of(b)
    return in_prefix | _causal_keep(q_idx, kv_idx, offset)
  return Variant("prefix_lm", mask_mod=mask_mod)


def _segment_lookup(ids):
  """`(b, i) -> ids[b, i]` for `[B, S]` ids, `ids[i]` for `[S]` ids."""
  return (lambda b, i: ids[b, i]) if ids.ndim == 2 else (lambda b, i: ids[i])


def document(segment_ids=None, causal: bool = False, *, q_segment_ids=None,
             kv_segment_ids=None) -> Variant:
  """Document masking for packed sequences: a query keeps only keys of its
  own document (segment), optionally causally (as in sequence packing,
  Krell et al. 2021; FlexAttention's document masks).

  `segment_ids`: int `[B, S]` (or `[S]` shared by all batch rows) for
  self-attention, Sq == Skv == S. For Sq != Skv pass `q_segment_ids`
  `[B, Sq]` and `kv_segment_ids` `[B, Skv]` instead; causal is then
  bottom-right aligned.
  """
  if segment_ids is not None:
    if q_segment_ids is not None or kv_segment_ids is not None:
      raise ValueError("give segment_ids or q_segment_ids/kv_segment_ids, not both")
    q_segment_ids = kv_segment_ids = segment_ids
  elif q_segment_ids is None or kv_segment_ids is None:
    raise ValueError("give segment_ids, or both q_segment_ids and kv_segment_ids")
  q_ids = jnp.asarray(q_segment_ids, jnp.int32)
  kv_ids = jnp.asarray(kv_segment_ids, jnp.int32)
  if q_ids.ndim != kv_ids.ndim or q_ids.ndim not in (1, 2):
    raise ValueError(f"segment ids must both be [B, S] or both [S]; got {q_ids.shape}, "
                     f"{kv_ids.shape}")
  q_doc, kv_doc = _segment_lookup(q_ids), _segment_lookup(kv_ids)
  offset = kv_ids.shape[-1] - q_ids.shape[-1]

  def mask_mod(b, h, q_idx, kv_idx):
    same = q_doc(b, q_idx) == kv_doc(b, kv_idx)
    return (same & _causal_keep(q_idx, kv_idx, offset)) if causal else same
  return Variant("document_causal" if causal else "document", mask_mod=mask_mod)


def alibi_slopes(num_heads: int) -> jax.Array:
  """ALiBi head slopes `2^(-8 i / n)`, i = 1..n (Press et al. 2022). When n is
  not a power of two: the slopes of the largest power of two p < n, then
  every other slope of 2p for the remaining n - p heads (the paper's rule)."""
  def power_of_2_slopes(n):
    return [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]

  def slopes(n):
    p = 2 ** math.floor(math.log2(n))
    if p == n:
      return power_of_2_slopes(n)
    return power_of_2_slopes(p) + slopes(2 * p)[0::2][:n - p]
  return jnp.asarray(slopes(num_heads), jnp.float32)


def alibi(slopes=None, *, num_heads=None, seq_q=None, seq_kv=None) -> Variant:
  """ALiBi, "Train Short, Test Long" (Press et al. 2022): a linear distance
  bias `score + slopes[h] * (kv_idx - q_idx)` per query head h.

  Default slopes: `alibi_slopes(num_heads)`. Meant with `causal()` (where the
  bias is <= 0), as in the paper. `q_idx` is bottom-right aligned when
  `seq_q` != `seq_kv`.
  """
  if slopes is None:
    if num_heads is None:
      raise ValueError("alibi needs slopes or num_heads")
    slopes = alibi_slopes(num_heads)
  slopes = jnp.asarray(slopes, jnp.float32)
  if slopes.ndim != 1 or num_heads not in (None, slopes.shape[0]):
    raise ValueError(f"alibi slopes must be [num_heads]; got shape {slopes.shape} for "
                     f"num_heads={num_heads}")
  offset = _query_offset(seq_q, seq_kv)

  def score_mod(score, b, h, q_idx, kv_idx):
    distance = (kv_idx - _query_position(q_idx, offset)).astype(jnp.float32)
    return score + slopes[h] * distance
  return Variant("alibi", score_mod=score_mod)


def softcap(cap: float) -> Variant:
  """Logit soft-capping `cap * tanh(score / cap)` (Gemma 2, Gemma Team 2024,
  cap 50; Grok-1, cap 30): bounds the logits smoothly to (-cap, cap)."""
  if cap <= 0:
    raise ValueError(f"softcap needs cap > 0; got {cap}")
  cap = float(cap)

  def score_mod(score, b, h, q_idx, kv_idx):
    return cap * jnp.tanh(score / cap)
  return Variant(f"softcap({cap:g})", score_mod=score_mod)


def sigmoid(bias=None, *, seq_kv=None) -> Variant:
  """Sigmoid attention, "Theory, Analysis, and Best Practices for Sigmoid
  Self-Attention" (Ramapuram et al. 2024): weights `sigmoid(score + bias)`
  with no row normalization; default `bias = -log(seq_kv)`, the paper's
  choice that keeps the initial row sums near one."""
  if bias is None:
    if seq_kv is None:
      raise ValueError("sigmoid attention needs bias or seq_kv (bias = -log(seq_kv))")
    bias = -math.log(seq_kv)
  bias = float(bias)

  def score_mod(score, b, h, q_idx, kv_idx):
    return score + bias
  return Variant("sigmoid", score_mod=score_mod, rownorm="sigmoid")


def relu(scale=None, *, seq_kv=None) -> Variant:
  """ReLU attention, "Replacing softmax with ReLU in Vision Transformers"
  (Wortsman et al. 2023): weights `relu(score) / seq_len`, written as
  `relu(score * scale)` with default `scale = 1 / seq_kv` (equal for
  scale > 0)."""
  if scale is None:
    if seq_kv is None:
      raise ValueError("relu attention needs scale or seq_kv (scale = 1 / seq_kv)")
    scale = 1.0 / seq_kv
  if scale <= 0:
    raise ValueError(f"relu attention needs scale > 0; got {scale}")
  scale = float(scale)

  def score_mod(score, b, h, q_idx, kv_idx):
    return score * scale
  return Variant("relu", score_mod=score_mod, rownorm="relu")


def sink(sink_logits) -> Variant:
  """Attention sinks (gpt-oss; StreamingLLM, Xiao et al. 2024): a learned
  logit per query head added to the softmax denominator,
  `out = sum_j exp(s_j) v_j / (exp(sink[h]) + sum_j exp(s_j))`, so a query
  can put weight on "no key". `sink_logits`: float `[Hq]`; their gradient
  flows. A constant sink for every head (the "off-by-one" softmax, logit 0)
  is `off_by_one_softmax` as the rownorm.
  """
  sinks = jnp.asarray(sink_logits)
  if sinks.ndim != 1 or not jnp.issubdtype(sinks.dtype, jnp.floating):
    raise ValueError(f"sink logits must be a float [num_heads] array; got {sinks.dtype} "
                     f"{sinks.shape}")
  return Variant("sink", sinks=sinks)


def off_by_one_softmax(row):
  """Softmax with a sink of logit 0: `exp(s) / (1 + sum(exp(s)))` (Miller's
  "attention is off by one"), written stably; the analyzer runs it online."""
  m = jax.lax.stop_gradient(jnp.max(row, axis=-1, keepdims=True))
  e = jnp.exp(row - m)
  return e / (jnp.exp(-m) + jnp.sum(e, axis=-1, keepdims=True))


def retention_norm(row):
  """RetNet's row normalization: `row / max(sum |row|, 1)`."""
  return row / jnp.maximum(jnp.sum(jnp.abs(row), axis=-1, keepdims=True), 1.0)


def retention_gammas(num_heads: int) -> jax.Array:
  """RetNet's per-head decays `1 - 2^(-5 - h)`, h = 0..num_heads-1."""
  return 1.0 - 2.0 ** (-5.0 - jnp.arange(num_heads, dtype=jnp.float32))


def retention_parallel(gamma=None, *, num_heads=None, seq_q=None, seq_kv=None) -> Variant:
  """RetNet's retention in its parallel form, "Retentive Network: A
  Successor to Transformer for Large Language Models" (Sun et al. 2023):
  causal weights `score * gamma[h]^(q - kv)`, each row divided by
  `max(sum |row|, 1)` (`retention_norm`).

  `gamma`: per-head decays in (0, 1) `[H]`; default `retention_gammas`.
  The decay is `exp((q - kv) * log(gamma[h]))` with the exponent clamped
  at 0 so that masked positions (kv > q) cannot overflow. The paper's
  extra decay-matrix row normalization and its GroupNorm are omitted.
  Its reference needs `masked_fill=0.0` (masked scores are 0 in the row sum).
  """
  if gamma is None:
    if num_heads is None:
      raise ValueError("retention_parallel needs gamma or num_heads")
    gamma = retention_gammas(num_heads)
  log_gamma = jnp.log(jnp.asarray(gamma, jnp.float32))
  offset = _query_offset(seq_q, seq_kv)

  def score_mod(score, b, h, q_idx, kv_idx):
    distance = jnp.maximum(_query_position(q_idx, offset) - kv_idx, 0).astype(jnp.float32)
    return score * jnp.exp(distance * log_gamma[h])
  mask = causal(seq_q=seq_q, seq_kv=seq_kv).mask_mod
  return Variant("retention", score_mod=score_mod, mask_mod=mask, rownorm=retention_norm)


def differential(q1, k1, q2, k2, v, lam, **attention_kwargs):
  """Differential attention, "Differential Transformer" (Ye et al. 2024), as
  two `attention` calls: `attention(q1, k1, v) - lam * attention(q2, k2, v)`.

  `lam`: a scalar or per-query-head `[Hq]`. `attention_kwargs` (a variant's
  kwargs, config, ...) go to both calls. The paper's per-head GroupNorm and
  `(1 - lambda_init)` output scale are omitted: apply them to the result.
  """
  if attention_kwargs.get("return_lse"):
    raise ValueError("differential returns the output only; return_lse is not supported")
  lam = jnp.asarray(lam, jnp.float32)
  if lam.ndim == 1:
    lam = lam[:, None]  # [Hq] -> broadcast over [B, Sq, Hq, Dv]
  first = attention(q1, k1, v, **attention_kwargs)
  second = attention(q2, k2, v, **attention_kwargs)
  return (first.astype(jnp.float32) - lam * second.astype(jnp.float32)).astype(first.dtype)


NAMES = ("vanilla", "causal", "softcap", "alibi", "sliding_window", "sigmoid", "relu",
         "document", "prefix_lm", "retention")


def by_name(name: str, *, num_heads: int, seq_q: int, seq_kv: int) -> Variant:
  """A built-in variant at default settings, for the CLI and the tuner.

  softcap: cap 50 (Gemma 2). alibi: the score_mod alone (no mask).
  sliding_window: causal, 256 keys. document: 8 equal documents over the
  keys, causal; queries take the ids of the last Sq keys (bottom-right).
  prefix_lm: the first half of the keys. Masks are bottom-right aligned
  when seq_q != seq_kv.
  """
  aligned = dict(seq_q=seq_q, seq_kv=seq_kv)
  if name == "vanilla":
    return Variant("vanilla")
  if name == "causal":
    return causal(**aligned)
  if name == "softcap":
    return softcap(50.0)
  if name == "alibi":
    return alibi(num_heads=num_heads, **aligned)
  if name == "sliding_window":
    return sliding_window(256, **aligned)
  if name == "sigmoid":
    return sigmoid(seq_kv=seq_kv)
  if name == "relu":
    return relu(seq_kv=seq_kv)
  if name == "document":
    doc_of = lambda positions: positions * 8 // seq_kv  # 8 equal documents of the keys
    q_positions = jnp.arange(seq_q, dtype=jnp.int32) + (seq_kv - seq_q)
    return document(causal=True, q_segment_ids=doc_of(q_positions),
                    kv_segment_ids=doc_of(jnp.arange(seq_kv, dtype=jnp.int32)))
  if name == "prefix_lm":
    return prefix_lm(seq_kv // 2, **aligned)
  if name == "retention":
    return retention_parallel(num_heads=num_heads, **aligned)
  raise ValueError(f"unknown variant {name!r}; known: {', '.join(NAMES)}")
