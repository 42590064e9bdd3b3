"""Decoding against a KV cache: `decode_attention` and `paged_attention`.

Both run the split-KV template (split_kv.py) with the variant's analysis:
score_mod, mask_mod (captured arrays included), every online rownorm class
and sinks. `decode_attention` under `jax.jit` also takes a cache sharded
over its batch, heads or sequence (distributed/sharded_decode.py); a paged
cache split over devices goes through `sharded_paged_attention`, whose page
tables hold each device's own page indices.
"""
from __future__ import annotations

from pallas_attn import split_kv
from pallas_attn.distributed import partitioning, sharded_decode


def decode_attention(q, k_cache, v_cache, kv_lengths, *, score_mod=None, mask_mod=None,
                     rownorm="softmax", sinks=None, scale=None, config=None, interpret=None,
                     k_descale=None, v_descale=None):
  """Attention of a few new query tokens against a KV cache of ragged length.

  q `[B, Sq, Hq, D]` with 1 <= Sq <= 16 (one token, or a few for
  speculative decoding); k_cache `[B, S_max, Hkv, D]`, v_cache
  `[B, S_max, Hkv, Dv]`; kv_lengths `[B]` int32, the keys each sequence
  holds, the Sq new tokens' keys included: query i of sequence b sits at
  position `kv_lengths[b] - Sq + i`, and score_mod / mask_mod see those
  absolute positions, so `variants.causal()`, `sliding_window(w)` and
  `alibi` mean what they mean in training. Keys at or past kv_lengths[b]
  are never read (their contents do not matter). Returns `[B, Sq, Hq, Dv]`
  in q's dtype.

  The keyword arguments are `pallas_attn.attention`'s (GQA/MQA when Hkv
  divides Hq); config is a `DecodeConfig` (fields left None come from the
  schedule), "auto" or None (a tuned cache entry if any, else the
  schedule's: splits to fill the GPU's SMs).

  kv_lengths must be in [Sq, S_max]: checked when they are concrete; traced
  lengths outside [0, S_max] are clamped into it. Masks whose tile bounds
  decide key blocks (causal, sliding windows) split only the live blocks: a
  window of w keys reads about w keys, whatever the cache length.

  An fp8 cache (`float8_e4m3fn` or `float8_e5m2` k_cache and v_cache,
  against a bfloat16 / float16 q) is read at half a bf16 cache's bytes and
  dequantized on load: real values are `x.astype(float32) * descale`, with
  `k_descale` / `v_descale` float32 scalars or `[B, Hkv]` (None: 1); the
  scores score_mod sees are the real ones. `pallas_attn.quantize_fp8` makes
  a cache and its descales.

  Under `jax.jit` the cache may be sharded (a `NamedSharding`): over its
  batch and heads (q alike), each device decodes its part; over its
  sequence, each device decodes its run of positions and the parts merge
  by log-sum-exp after one all-gather of output-sized arrays, as
  `sharded_decode_attention` does (softmax and elementwise rownorms; the
  cache never moves; arrays score_mod / mask_mod close over are replicated).

  Forward only (inference): differentiating it raises; use
  `pallas_attn.attention` on the cache, sliced to the sequence, for
  gradients.
  """
  split_kv.validate(q, k_cache, v_cache, kv_lengths, "k_cache", "v_cache")
  lengths = split_kv.checked_lengths(kv_lengths, q.shape[1], k_cache.shape[1])
  options = dict(score_mod=score_mod, mask_mod=mask_mod, rownorm=rownorm, sinks=sinks,
                 scale=scale, config=config, interpret=interpret, k_descale=k_descale,
                 v_descale=v_descale)
  if not partitioning.may_shard():
    return split_kv.run_decode(q, k_cache, v_cache, lengths, None, k_cache.shape[1],
                               **options)[0]
  return split_kv.forward_only(
      lambda q, k, v: sharded_decode.partitioned_decode(q, k, v, lengths, **options),
      q, k_cache, v_cache)


def paged_attention(q, k_pages, v_pages, page_table, kv_lengths, *, score_mod=None,
                    mask_mod=None, rownorm="softmax", sinks=None, scale=None, config=None,
                    interpret=None, k_descale=None, v_descale=None):
  """`decode_attention` on a paged KV cache (vLLM's and JAX's layout).

  k_pages `[num_pages, page_size, Hkv, D]`, v_pages `[num_pages,
  page_size, Hkv, Dv]`; page_table `[B, max_pages]` int32: key position p of
  sequence b is row `p % page_size` of page `page_table[b, p // page_size]`.
  Sequences hold up to `max_pages * page_size` keys; positions and the
  other arguments are `decode_attention`'s. The kernel reads pages through
  the table, key block by key block (blocks may span pages).

  Page indices of the pages a sequence uses (those below its length) must
  be in [0, num_pages): checked when the table and lengths are concrete;
  otherwise indices are clamped into the pages (a wrong index reads another
  page, never out of bounds). Entries past a sequence's length are never
  read (padding such as -1 is fine). Pages of fp8 with their descales as
  in `decode_attention`. Forward only, as `decode_attention`.
  """
  split_kv.validate(q, k_pages, v_pages, kv_lengths, "k_pages", "v_pages", paged=True)
  split_kv.check_page_table(page_table, q.shape[0], "max_pages")
  page_size = k_pages.shape[1]
  max_length = page_table.shape[1] * page_size
  lengths = split_kv.checked_lengths(kv_lengths, q.shape[1], max_length)
  split_kv.check_pages(page_table, lengths, page_size, k_pages.shape[0])
  return split_kv.run_decode(q, k_pages, v_pages, lengths, page_table, max_length,
                             score_mod=score_mod, mask_mod=mask_mod, rownorm=rownorm,
                             sinks=sinks, scale=scale, config=config, interpret=interpret,
                             k_descale=k_descale, v_descale=v_descale)[0]
