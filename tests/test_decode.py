"""Split-KV decoding: `decode_attention`, `paged_attention` and `attention`'s
dispatch for a few queries, against the dense float32 reference at the same
absolute positions (query i of sequence b at kv_lengths[b] - Sq + i).

Caches hold NaN past each sequence's length (and unused pages are NaN), so
a kernel that reads a key it must not turns the output NaN.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_attn as pa
from conftest import MODES, assert_close, random
from pallas_attn import split_kv
from pallas_attn import variants as V
from pallas_attn.spec import mask_bounds

S_MAX = 50  # not a multiple of the 16-key blocks
SPLITS = pa.DecodeConfig(block_k=16, num_splits=3)


def inputs(batch=3, seq_q=1, heads=4, kv_heads=2, d_qk=16, d_v=24, seq=S_MAX,
           dtype=jnp.float32, seed=0):
  return (random((batch, seq_q, heads, d_qk), dtype, seed),
          random((batch, seq, kv_heads, d_qk), dtype, seed + 1),
          random((batch, seq, kv_heads, d_v), dtype, seed + 2))


def lengths_for(seq_q, batch=3):
  """Shorter than one block, on a block (and split) boundary, the whole cache."""
  return jnp.asarray([max(seq_q, 5), 48, S_MAX][:batch], jnp.int32)


def poisoned(x, lengths):
  """The cache with NaN at every position past each sequence's length."""
  positions = jnp.arange(x.shape[1])[None, :, None, None]
  return jnp.where(positions < lengths[:, None, None, None], x, jnp.nan)


def reference(q, k, v, lengths, *, score_mod=None, mask_mod=None, rownorm="softmax",
              sinks=None, masked_fill=-jnp.inf, return_lse=False):
  """Dense float32 attention with query i of sequence b at lengths[b] - Sq + i, keys
  past lengths[b] masked (with `return_lse`: (output, log-sum-exp))."""
  offset = lengths - q.shape[1]

  def mask(b, h, qi, ki):
    keep = ki < lengths[b]
    return keep if mask_mod is None else keep & mask_mod(b, h, qi + offset[b], ki)
  score = None if score_mod is None else (
      lambda s, b, h, qi, ki: score_mod(s, b, h, qi + offset[b], ki))
  run = jax.jit(lambda *x: pa.attention_reference(
      *(a.astype(jnp.float32) for a in x), score_mod=score, mask_mod=mask, rownorm=rownorm,
      sinks=sinks, masked_fill=masked_fill, return_lse=return_lse))
  return run(q, k, v)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("seq_q,heads,kv_heads,d_qk,config,dtype", [
    (1, 4, 2, 16, pa.DecodeConfig(block_k=16, num_splits=1), jnp.float32),
    (1, 4, 2, 16, SPLITS, jnp.bfloat16),
    (3, 4, 1, 20, SPLITS, jnp.float32),  # MQA, head dims not powers of two
    (16, 2, 2, 16, pa.DecodeConfig(block_k=32, num_splits=2), jnp.float32),
    (16, 4, 1, 16, pa.DecodeConfig(block_k=16, num_splits=2, block_rows=16), jnp.float32),
], ids=["sq1-one-split", "sq1-bf16", "sq3-mqa-odd-dims", "sq16", "sq16-row-blocks"])
def test_decode_matches_reference(seq_q, heads, kv_heads, d_qk, config, dtype, interpret):
  q, k, v = inputs(seq_q=seq_q, heads=heads, kv_heads=kv_heads, d_qk=d_qk, dtype=dtype)
  lengths = lengths_for(seq_q)
  out = pa.decode_attention(q, poisoned(k, lengths), poisoned(v, lengths), lengths,
                            config=config, interpret=interpret)
  assert out.shape == q.shape[:3] + (v.shape[3],) and out.dtype == dtype
  assert_close(out, reference(q, k, v, lengths), dtype)


def _document_ids():
  return jnp.asarray(np.arange(3 * S_MAX).reshape(3, S_MAX) // 13 % 4, jnp.int32)


VARIANTS = {
    "causal": lambda: V.causal(),
    "sliding_window": lambda: V.sliding_window(8),
    "alibi": lambda: V.alibi(num_heads=4) + V.causal(),
    "softcap": lambda: V.softcap(2.0) + V.sliding_window(20),
    "sigmoid": lambda: V.sigmoid(seq_kv=S_MAX),
    "relu": lambda: V.relu(seq_kv=S_MAX) + V.causal(),
    "document": lambda: V.document(_document_ids(), causal=True),
    "prefix_lm": lambda: V.prefix_lm(jnp.asarray([3, 20, 40], jnp.int32)),
    "retention": lambda: V.retention_parallel(num_heads=4),
    "sink": lambda: V.sink(2.0 * random((4,), seed=7)) + V.sliding_window(12),
    "off_by_one": lambda: V.Variant("off_by_one", mask_mod=V.causal().mask_mod,
                                    rownorm=V.off_by_one_softmax),
    "bias_table": lambda: V.Variant(  # gathers: per-head, per-key and relative-position reads
        "bias_table", score_mod=lambda s, b, h, qi, ki: (
            s + BIAS[b, h, ki] + TABLE[h, jnp.clip(qi - ki, 0, 7)])),
    "head_windows": lambda: V.Variant(  # live key blocks per kv head
        "head_windows", mask_mod=lambda b, h, qi, ki: (ki <= qi) & (qi - ki < 6 * (h + 1))),
}
ONE_SPLIT = pa.DecodeConfig(block_k=16, num_splits=1)  # the kernel finalizes (no combine)
CASES = [(name, SPLITS) for name in VARIANTS] + [
    (name, ONE_SPLIT) for name in ("sink", "retention", "sigmoid")]
BIAS = random((3, 4, S_MAX), seed=11)
TABLE = random((4, 8), seed=12)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("name,config", CASES,
                         ids=[f"{n}-{c.num_splits}-splits" for n, c in CASES])
def test_variants(name, config, interpret):
  variant = VARIANTS[name]()
  q, k, v = inputs(seq_q=2)
  lengths = lengths_for(2)
  out = pa.decode_attention(q, poisoned(k, lengths), poisoned(v, lengths), lengths,
                            config=config, interpret=interpret, **variant.kwargs())
  fill = 0.0 if name == "retention" else -jnp.inf
  assert_close(out, reference(q, k, v, lengths, masked_fill=fill, **variant.kwargs()))


def to_pages(x, lengths, page_size, seed):
  """A paged copy of a `[B, S, Hkv, D]` cache: pages in shuffled order
  among NaN pages nobody owns, and the page table."""
  batch, seq = x.shape[:2]
  per_sequence = -(-seq // page_size)
  x = jnp.pad(poisoned(x, lengths), ((0, 0), (0, per_sequence * page_size - seq), (0, 0),
                                     (0, 0)), constant_values=jnp.nan)
  pages = x.reshape(batch * per_sequence, page_size, *x.shape[2:])
  num_pages = batch * per_sequence + 3
  order = np.random.default_rng(seed).permutation(num_pages)
  stored = jnp.full((num_pages,) + pages.shape[1:], jnp.nan, x.dtype).at[order[:len(pages)]].set(
      pages)
  return stored, jnp.asarray(order[:len(pages)].reshape(batch, per_sequence), jnp.int32)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("page_size,dtype,window", [
    (4, jnp.float32, None),        # a 16-key block spans four pages; 13 pages a sequence
    (32, jnp.bfloat16, 12),        # two blocks per page, a window over the cache
], ids=["small-pages-fp32", "large-pages-bf16-window"])
def test_paged_matches_contiguous(page_size, dtype, window, interpret):
  q, k, v = inputs(seq_q=2, dtype=dtype)
  lengths = lengths_for(2)
  k_pages, table = to_pages(k, lengths, page_size, seed=1)
  v_pages, _ = to_pages(v, lengths, page_size, seed=1)
  kwargs = {} if window is None else V.sliding_window(window).kwargs()
  out = pa.paged_attention(q, k_pages, v_pages, table, lengths, config=SPLITS,
                           interpret=interpret, **kwargs)
  assert_close(out, reference(q, k, v, lengths, **kwargs), dtype)


@pytest.mark.parametrize("interpret", MODES)
def test_attention_dispatches_small_queries_to_split_kv(interpret):
  """attention() with Sq <= 16: the split-KV template, attention's positions
  (query i at i, every key valid); gradients from the parallel template."""
  q, k, v = inputs(batch=2, seq_q=3, seq=300)
  variant = V.alibi(num_heads=4) + V.sliding_window(100, causal=False)
  kwargs = dict(**variant.kwargs(), interpret=interpret)
  assert split_kv.split_kv_call(pa.analyze_variant(**variant.kwargs()), q, k, v, None,
                              interpret) is not None
  jaxpr = str(jax.make_jaxpr(lambda q, k, v: pa.attention(q, k, v, **kwargs))(q, k, v))
  assert "pallas_attn_decode" in jaxpr and "pallas_attn_forward" not in jaxpr
  out, lse = pa.attention(q, k, v, return_lse=True, **kwargs)
  ref, ref_lse = jax.jit(lambda *x: pa.attention_reference(
      *x, return_lse=True, **variant.kwargs()))(q, k, v)
  assert_close(out, ref)
  assert_close(lse, ref_lse)
  grad = lambda f: jax.jit(jax.grad(lambda *x: jnp.sum(f(*x) ** 2), argnums=(0, 1, 2)))
  grads = grad(lambda *x: pa.attention(*x, **kwargs))(q, k, v)
  ref_grads = grad(lambda *x: pa.attention_reference(*x, **variant.kwargs()))(q, k, v)
  for g, r in zip(grads, ref_grads):
    assert_close(g, r, factor=10)


def test_window_splits_only_the_window():
  """A sliding window over a long cache: only its blocks are split (by the
  mask's tile bounds), per sequence; an unbounded mask gets no ranges."""
  analysis = pa.analyze_variant(**V.sliding_window(32).kwargs())
  lengths = jnp.asarray([1000, 40, 1], jnp.int32)
  ranges = mask_bounds.live_kv_blocks(analysis, (), lengths, lengths - 1, 1, 2, 2, 16, 63)
  # Query at p keeps keys (p - 32, p]: blocks of keys 968..999, 8..39, 0.
  np.testing.assert_array_equal(ranges[:, 0], [[60, 63], [0, 3], [0, 1]])
  floats = random((1000,))
  unbounded = pa.analyze_variant(mask_mod=lambda b, h, qi, ki: floats[ki] > 0)
  assert mask_bounds.live_kv_blocks(unbounded, unbounded.mask_mod.traced.consts, lengths,
                                    lengths - 1, 1, 2, 2, 16, 63) is None


def test_schedule_fills_the_gpu():
  """The fewest splits that make >= 1 wave of programs over the SMs (a
  paged cache >= 2) and fill >= 90% of the last one; one split where batch
  x kv heads do."""
  from pallas_attn.schedule.config import decode_splits, heuristic_decode_config
  one = heuristic_decode_config(1, 8, 4, 131072, 128, 128, sm_count=132,
                                smem_per_block=227 * 1024)
  # 15 splits of ceil(1024 / 15) = 69 blocks: 15 working, 120 programs, 91% of 132.
  assert (one.block_k, one.num_splits, one.block_rows, one.num_stages) == (128, 15, 16, 3)
  paged = heuristic_decode_config(1, 8, 4, 131072, 128, 128, sm_count=132,
                                  smem_per_block=227 * 1024, paged=True)
  # 30 splits of ceil(1024 / 30) = 35 blocks: 30 working, 240 programs in 2 waves of 132.
  assert paged.num_splits == 30
  fp8_paged = heuristic_decode_config(1, 8, 4, 131072, 128, 128, itemsize=1, sm_count=132,
                                      smem_per_block=227 * 1024, paged=True)
  assert fp8_paged.num_splits == 45  # 360 programs in 3 waves of 132, 91% of the last
  assert decode_splits(8, 1024, 132, 2) == 30
  assert decode_splits(512, 32, 132, 1) == 1
  assert decode_splits(64, 256, 264, 2) == 8
  assert decode_splits(64, 64, 132, 1) == 2
  assert heuristic_decode_config(1, 8, 4, 1024, 128, 128, sm_count=None).num_splits == 1
  wide = heuristic_decode_config(1, 8, 4, 4096, 256, 256, itemsize=4, sm_count=132)
  assert wide.block_k == 32  # 3 stages of K/V tiles within 192 KiB
  fp8 = heuristic_decode_config(1, 8, 4, 131072, 128, 128, itemsize=1, sm_count=132,
                                smem_per_block=227 * 1024)
  assert (fp8.block_k, fp8.num_stages) == (128, 4)  # an fp8 cache: half the bytes a stage


def test_bad_input_errors():
  q, k, v = inputs(seq_q=2)
  lengths = lengths_for(2)
  with pytest.raises(ValueError, match="1 to 16 query tokens"):
    pa.decode_attention(jnp.zeros((3, 17, 4, 16)), k, v, lengths)
  with pytest.raises(ValueError, match=r"kv_lengths\[1\] = 51 is outside \[Sq, S_max\]"):
    pa.decode_attention(q, k, v, jnp.asarray([5, 51, 9], jnp.int32))
  with pytest.raises(ValueError, match=r"kv_lengths\[0\] = 1 is outside"):
    pa.decode_attention(q, k, v, jnp.asarray([1, 5, 9], jnp.int32))
  with pytest.raises(ValueError, match="kv_lengths must be an integer"):
    pa.decode_attention(q, k, v, jnp.asarray([5.0, 6.0, 7.0]))
  with pytest.raises(TypeError, match="must share a dtype"):
    pa.decode_attention(q, k.astype(jnp.bfloat16), v, lengths)
  with pytest.raises(ValueError, match="batch sizes differ"):
    pa.decode_attention(q, k[:2], v[:2], lengths)
  with pytest.raises(ValueError, match="multiple of kv heads"):
    pa.decode_attention(q[:, :, :3], k, v, lengths)
  with pytest.raises(ValueError, match="power of two"):
    pa.decode_attention(q, k, v, lengths, config=pa.DecodeConfig(block_k=48))
  with pytest.raises(TypeError, match="DecodeConfig"):
    pa.decode_attention(q, k, v, lengths, config=pa.AttentionConfig())
  k_pages, table = to_pages(k, lengths, 8, seed=0)
  bad = table.at[1, 2].set(k_pages.shape[0])
  with pytest.raises(ValueError, match=r"page_table\[1, 2\] = 24 is not a page index"):
    pa.paged_attention(q, k_pages, k_pages, bad, lengths)
  # Past a sequence's length, entries are not read: any value goes.
  pa.paged_attention(q, k_pages, k_pages, table.at[0, 6].set(-1), lengths,
                     config=SPLITS)
  with pytest.raises(TypeError, match="forward-only"):
    jax.grad(lambda q: pa.decode_attention(q, k, v, lengths).sum())(q)


def test_traced_lengths_and_table():
  """Under jit (lengths and table traced: no checks) the same results."""
  q, k, v = inputs(seq_q=1)
  lengths = lengths_for(1)
  k_pages, table = to_pages(k, lengths, 16, seed=2)
  v_pages, _ = to_pages(v, lengths, 16, seed=2)
  run = jax.jit(lambda *a: pa.paged_attention(*a, config=SPLITS, **V.causal().kwargs()))
  assert_close(run(q, k_pages, v_pages, table, lengths), reference(q, k, v, lengths))


def test_tuner_covers_the_split_kv_template(tmp_path, monkeypatch):
  """`tune_attention(template="decode")` times split-KV configs and stores
  the winner, which decode_attention then uses."""
  from pallas_attn import tuning
  from pallas_attn.schedule import cache
  monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "tuning.json"))
  shapes = (2, 1, 4, 16), (2, 64, 2, 16), (2, 64, 2, 16)
  result = tuning.tune_attention(*shapes, dtype="float32", template="decode",
                                max_candidates=2, budget_s=60)
  assert isinstance(result.best, pa.DecodeConfig) and result.best.num_splits >= 1
  q, k, v = inputs(batch=2, seq=64, d_v=16)  # the tuned shapes (d_v keys the cache)
  assert cache.lookup_config("decode", pa.analyze_variant().fingerprint(), q_shape=q.shape,
                             k_shape=k.shape, v_shape=v.shape, dtype=q.dtype) == result.best
  assert split_kv.resolve_config(None, pa.analyze_variant(), q, k.shape, v.shape) == result.best
  with pytest.raises(ValueError, match="1 to 16 query tokens"):
    tuning.tune_attention((2, 32, 4, 16), *shapes[1:], template="decode")
