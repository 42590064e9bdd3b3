"""Built-in variants (pallas_attn.variants) against the dense reference and
hand-written numpy masks (interpret mode; compiled on GPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_attn as pa
from conftest import MODES, assert_close, modes, random
from pallas_attn import variants as V
from pallas_attn.reference import dense_mask, dense_scores

SMALL = pa.AttentionConfig(block_q=16, block_k=16, num_warps=4, num_stages=1)
BATCH, HEADS, KV_HEADS = 2, 4, 2
SQ, SKV, S = 37, 45, 45  # ragged: no length is a multiple of the 16-row blocks
DTYPES = [("fp32", jnp.float32), ("bf16", jnp.bfloat16)]
# Per-batch data: 4 documents of different lengths in each row, different prefixes.
SEGMENT_IDS = jnp.asarray(np.sort(np.random.RandomState(0).randint(0, 4, (BATCH, S))), jnp.int32)
PREFIX = jnp.array([5, 30], jnp.int32)


def inputs(seq_q=SQ, seq_kv=SKV, dtype=jnp.float32, heads=HEADS, kv_heads=KV_HEADS, seed=0):
  """q, k, v with GQA and d_qk != d_v."""
  return (random((BATCH, seq_q, heads, 24), dtype, seed),
          random((BATCH, seq_kv, kv_heads, 24), dtype, seed + 1),
          random((BATCH, seq_kv, kv_heads, 32), dtype, seed + 2))


def run(variant, q, k, v, interpret=True, **kwargs):
  return pa.attention(q, k, v, **variant.kwargs(), config=SMALL, interpret=interpret, **kwargs)


def reference(variant, q, k, v):
  """float32 dense reference; RetNet's sum-normalized rownorm needs masked_fill=0."""
  fill = 0.0 if variant.rownorm is V.retention_norm else -jnp.inf
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  return pa.attention_reference(*f32, **variant.kwargs(), masked_fill=fill)


# Hand-written numpy masks, `[B or 1, Sq, Skv]`: queries bottom-right aligned.
def positions(seq_q, seq_kv):
  return np.arange(seq_q)[:, None] + (seq_kv - seq_q), np.arange(seq_kv)[None, :]


def np_causal(seq_q, seq_kv):
  q, kv = positions(seq_q, seq_kv)
  return (kv <= q)[None]


def np_window(seq_q, seq_kv, size, causal):
  q, kv = positions(seq_q, seq_kv)
  return (((kv <= q) & (kv > q - size)) if causal else (np.abs(q - kv) < size))[None]


def np_prefix_lm(prefix, seq):
  return (np.arange(seq)[None, None, :] < np.asarray(prefix)[:, None, None]) | np_causal(seq, seq)


def np_document(q_ids, kv_ids, causal):
  q_ids, kv_ids = np.asarray(q_ids), np.asarray(kv_ids)
  same = q_ids[:, :, None] == kv_ids[:, None, :]
  return same & np_causal(q_ids.shape[1], kv_ids.shape[1]) if causal else same


def np_attention(q, k, v, keep, bias=0.0):
  """Softmax attention in float64; rows with nothing kept are zero."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  group = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]) + bias
  keep = np.broadcast_to(np.asarray(keep)[:, None], s.shape)
  s = np.where(keep, s, -np.inf)
  row_max = np.where(keep.any(-1, keepdims=True), s.max(-1, keepdims=True), 0.0)
  w = np.where(keep, np.exp(s - row_max), 0.0)
  w = w / np.maximum(w.sum(-1, keepdims=True), 1e-300)
  return np.einsum("bhqk,bkhd->bqhd", w, v)


def mask_of(variant, seq_q, seq_kv, batch=BATCH):
  """The variant's mask_mod as a dense `[B, Sq, Skv]` (it ignores heads)."""
  return np.asarray(dense_mask(variant.mask_mod, batch, 1, seq_q, seq_kv))[:, 0]


MASK_CASES = {
    "causal": lambda sq, skv: (V.causal(seq_q=sq, seq_kv=skv), np_causal(sq, skv)),
    "sliding_window": lambda sq, skv: (V.sliding_window(6, seq_q=sq, seq_kv=skv),
                                       np_window(sq, skv, 6, causal=True)),
    "sliding_window_bidirectional": lambda sq, skv: (
        V.sliding_window(6, causal=False, seq_q=sq, seq_kv=skv),
        np_window(sq, skv, 6, causal=False)),
    "document_causal_cross": lambda sq, skv: (
        V.document(q_segment_ids=SEGMENT_IDS[:, S - sq:], kv_segment_ids=SEGMENT_IDS[:, S - skv:],
                   causal=True),
        np_document(SEGMENT_IDS[:, S - sq:], SEGMENT_IDS[:, S - skv:], causal=True)),
}


@pytest.mark.parametrize("seq_q,seq_kv", [(SQ, SKV), (SKV, SQ), (S, S)])
@pytest.mark.parametrize("name", list(MASK_CASES))
def test_masks_match_hand_written(name, seq_q, seq_kv):
  variant, expected = MASK_CASES[name](seq_q, seq_kv)
  got = mask_of(variant, seq_q, seq_kv)
  np.testing.assert_array_equal(got, np.broadcast_to(expected, got.shape))


def test_self_attention_masks_match_hand_written():
  assert np.array_equal(mask_of(V.causal(), S, S)[0], np.tril(np.ones((S, S), bool)))
  np.testing.assert_array_equal(mask_of(V.prefix_lm(PREFIX), S, S), np_prefix_lm(PREFIX, S))
  np.testing.assert_array_equal(mask_of(V.prefix_lm(7), S, S)[1], np_prefix_lm([7], S)[0])
  for causal in (False, True):
    np.testing.assert_array_equal(mask_of(V.document(SEGMENT_IDS, causal), S, S),
                                  np_document(SEGMENT_IDS, SEGMENT_IDS, causal))
  shared = V.document(SEGMENT_IDS[0])  # [S] ids: the same documents in every row
  np.testing.assert_array_equal(mask_of(shared, S, S)[1],
                                np_document(SEGMENT_IDS[:1], SEGMENT_IDS[:1], False)[0])


def test_alibi_slopes_paper_formula():
  np.testing.assert_allclose(V.alibi_slopes(8), [2.0 ** -i for i in range(1, 9)])
  # Not a power of two: the 4-head slopes, then every other 8-head slope.
  np.testing.assert_allclose(V.alibi_slopes(6), [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1,
                                                 2 ** -3])
  np.testing.assert_allclose(V.alibi_slopes(12), [2.0 ** -i for i in range(1, 9)]
                             + [2 ** -0.5, 2 ** -1.5, 2 ** -2.5, 2 ** -3.5])


def test_alibi_bias_is_slope_times_distance():
  q, k, _ = inputs()
  bias = dense_scores(jnp.zeros_like(q), k,
                      score_mod=V.alibi(num_heads=HEADS, seq_q=SQ, seq_kv=SKV).score_mod)
  q_pos, kv_pos = positions(SQ, SKV)
  slopes = np.array([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8])
  expected = slopes[:, None, None] * (kv_pos - q_pos)[None]
  np.testing.assert_allclose(bias, np.broadcast_to(expected, bias.shape), rtol=1e-6)


def test_retention_decay_and_no_overflow_when_masked():
  score_mod = V.retention_parallel(jnp.array([0.5, 0.9])).score_mod
  np.testing.assert_allclose(score_mod(2.0, 0, 1, 5, 2), 2.0 * 0.9 ** 3, rtol=1e-6)
  assert np.isfinite(score_mod(2.0, 0, 0, 0, 100_000))  # kv > q: masked, clamped
  np.testing.assert_allclose(V.retention_gammas(3), [1 - 2 ** -5, 1 - 2 ** -6, 1 - 2 ** -7])


BUILTINS = {
    "causal_bottom_right": lambda: (V.causal(seq_q=SQ, seq_kv=SKV), SQ, SKV),
    "sliding_window": lambda: (V.sliding_window(10, seq_q=SQ, seq_kv=SKV), SQ, SKV),
    "sliding_window_bidirectional": lambda: (V.sliding_window(7, causal=False), SQ, SKV),
    "prefix_lm": lambda: (V.prefix_lm(PREFIX), S, S),
    "document": lambda: (V.document(SEGMENT_IDS), S, S),
    "document_causal_cross": lambda: (
        V.document(q_segment_ids=SEGMENT_IDS[:, S - SQ:], kv_segment_ids=SEGMENT_IDS,
                   causal=True), SQ, S),
    "alibi_causal": lambda: (V.alibi(num_heads=HEADS, seq_q=SQ, seq_kv=SKV)
                             + V.causal(seq_q=SQ, seq_kv=SKV), SQ, SKV),
    "softcap": lambda: (V.softcap(2.0), SQ, SKV),
    "sigmoid": lambda: (V.sigmoid(seq_kv=SKV), SQ, SKV),
    "relu": lambda: (V.relu(seq_kv=SKV), SQ, SKV),
    "retention": lambda: (V.retention_parallel(num_heads=HEADS, seq_q=SQ, seq_kv=SKV), SQ, SKV),
    "softcap+window+document": lambda: (
        V.softcap(5.0) + V.sliding_window(8) + V.document(SEGMENT_IDS), S, S),
    "sigmoid+document_causal": lambda: (V.sigmoid(seq_kv=S) + V.document(SEGMENT_IDS, True), S, S),
    "retention+document": lambda: (
        V.retention_parallel(num_heads=HEADS) + V.document(SEGMENT_IDS), S, S),
    "relu+prefix_lm": lambda: (V.relu(seq_kv=S) + V.prefix_lm(PREFIX), S, S),
}


BUILTIN_CASES = {f"{name}-{dtype_id}": (name, dtype) for dtype_id, dtype in DTYPES
                 for name in BUILTINS}
# Interpret mode: every built-in in float32; in bfloat16 the composites, which between
# them run every rownorm (softmax, sigmoid, relu, retention's normalized one), score_mod
# (ALiBi, softcap, retention's decay) and kind of mask (causal, window, documents,
# prefix) in bfloat16: the dtype's handling does not depend on the variant.
BF16_BUILTINS = ["alibi_causal", "softcap+window+document", "sigmoid+document_causal",
                 "retention+document", "relu+prefix_lm"]


@pytest.mark.parametrize("name,dtype,interpret", modes(BUILTIN_CASES, [
    *(f"{name}-fp32" for name in BUILTINS), *(f"{name}-bf16" for name in BF16_BUILTINS)]))
def test_builtin_matches_reference(name, dtype, interpret):
  """The built-in variant (and its output dtype) against the float32 reference."""
  variant, seq_q, seq_kv = BUILTINS[name]()
  q, k, v = inputs(seq_q, seq_kv, dtype)
  out = run(variant, q, k, v, interpret)
  assert out.dtype == dtype
  assert_close(out, reference(variant, q, k, v), dtype)


HAND_WRITTEN = {
    "causal_bottom_right": lambda: (V.causal(seq_q=SQ, seq_kv=SKV), np_causal(SQ, SKV), SQ, SKV),
    "sliding_window": lambda: (V.sliding_window(10, seq_q=SQ, seq_kv=SKV),
                               np_window(SQ, SKV, 10, causal=True), SQ, SKV),
    "prefix_lm": lambda: (V.prefix_lm(PREFIX), np_prefix_lm(PREFIX, S), S, S),
    "document_causal": lambda: (V.document(SEGMENT_IDS, causal=True),
                                np_document(SEGMENT_IDS, SEGMENT_IDS, True), S, S),
}


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("name", list(HAND_WRITTEN))
def test_masks_against_numpy_attention(name, interpret):
  variant, keep, seq_q, seq_kv = HAND_WRITTEN[name]()
  q, k, v = inputs(seq_q, seq_kv)
  assert_close(run(variant, q, k, v, interpret), np_attention(q, k, v, keep))


@pytest.mark.parametrize("interpret", MODES)
def test_alibi_against_numpy_attention(interpret):
  q, k, v = inputs(S, S, heads=8, kv_heads=2)
  slopes = 2.0 ** -np.arange(1, 9)
  q_pos, kv_pos = positions(S, S)
  bias = slopes[None, :, None, None] * (kv_pos - q_pos)
  out = run(V.alibi(num_heads=8) + V.causal(), q, k, v, interpret)
  assert_close(out, np_attention(q, k, v, np_causal(S, S), bias))


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("variant", [V.causal(seq_q=S, seq_kv=20),
                                     V.sigmoid(seq_kv=20) + V.causal(seq_q=S, seq_kv=20),
                                     V.retention_parallel(num_heads=HEADS, seq_q=S, seq_kv=20)],
                         ids=["softmax", "sigmoid", "retention"])
def test_rows_with_no_key_are_zero(variant, interpret):
  """Sq > Skv bottom-right: the first Sq - Skv queries precede every key."""
  q, k, v = inputs(S, 20)
  out = np.asarray(run(variant, q, k, v, interpret))
  assert not np.isnan(out).any()
  np.testing.assert_array_equal(out[:, :S - 20], 0.0)
  assert_close(out, reference(variant, q, k, v))


def visited_tiles(keep, block=16):
  """Fraction of block x block tiles with any kept position (all batch rows)."""
  b, sq, skv = keep.shape
  nq, nk = -(-sq // block), -(-skv // block)
  padded = np.zeros((b, nq * block, nk * block), bool)
  padded[:, :sq, :skv] = keep
  return padded.reshape(b, nq, block, nk, block).any(axis=(2, 4)).mean()


@pytest.mark.parametrize("interpret", MODES)
def test_block_sparsity_skips_masked_tiles(interpret):
  window = V.sliding_window(5)
  bm = pa.block_mask(window.mask_mod, BATCH, HEADS, 48, 48, block_q=16, block_kv=16,
                     interpret=interpret)
  assert visited_tiles(np_window(48, 48, 5, True)) == 5 / 9  # diagonal and sub-diagonal tiles
  assert float(bm.density()) == pytest.approx(5 / 9)
  q, k, v = inputs(48, 48)
  assert_close(run(window, q, k, v, interpret, block_mask=bm), reference(window, q, k, v))


@pytest.mark.parametrize("interpret", MODES)
def test_nothing_masked_equals_vanilla(interpret):
  everything = V.prefix_lm(S) + V.document(jnp.zeros((BATCH, S), jnp.int32))
  bm = pa.block_mask(everything.mask_mod, BATCH, HEADS, S, S, block_q=16, block_kv=16,
                     interpret=interpret)
  assert float(bm.density()) == 1.0
  q, k, v = inputs(S, S)
  out = run(everything, q, k, v, interpret, block_mask=bm)
  assert_close(out, pa.attention_reference(q, k, v))


@pytest.mark.parametrize("interpret", MODES)
def test_block_mask_reuse_across_calls_jit_and_vmap(interpret):
  variant = V.document(SEGMENT_IDS, causal=True)
  bm = pa.block_mask(variant.mask_mod, BATCH, HEADS, S, S, block_q=16, block_kv=16,
                     interpret=interpret)
  assert float(bm.density()) == pytest.approx(visited_tiles(np_document(SEGMENT_IDS, SEGMENT_IDS,
                                                                        True)))
  first, second = inputs(S, S, seed=0), inputs(S, S, seed=10)
  jitted = jax.jit(lambda q, k, v, bm: run(variant, q, k, v, interpret, block_mask=bm))
  for q, k, v in (first, second):
    assert_close(run(variant, q, k, v, interpret, block_mask=bm), reference(variant, q, k, v))
    assert_close(jitted(q, k, v, bm), reference(variant, q, k, v))
  stacked = [jnp.stack(pair) for pair in zip(first, second)]
  out = jax.vmap(lambda q, k, v: run(variant, q, k, v, interpret, block_mask=bm))(*stacked)
  for i, qkv_i in enumerate((first, second)):
    assert_close(out[i], reference(variant, *qkv_i))


@pytest.mark.parametrize("interpret", MODES)
def test_variant_built_inside_jit_from_traced_data(interpret):
  """Prefix lengths and segment ids as jit arguments (captured tracers)."""
  @jax.jit
  def f(q, k, v, prefix, segment_ids):
    variant = V.prefix_lm(prefix) + V.document(segment_ids) + V.alibi(num_heads=HEADS)
    return run(variant, q, k, v, interpret)

  q, k, v = inputs(S, S)
  expected = reference(V.prefix_lm(PREFIX) + V.document(SEGMENT_IDS) + V.alibi(num_heads=HEADS),
                       q, k, v)
  assert_close(f(q, k, v, PREFIX, SEGMENT_IDS), expected)
  assert_close(f(q, k, v, PREFIX[::-1], SEGMENT_IDS),
               reference(V.prefix_lm(PREFIX[::-1]) + V.document(SEGMENT_IDS)
                         + V.alibi(num_heads=HEADS), q, k, v))


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("dtype,lam", [(jnp.float32, 0.3),
                                       (jnp.bfloat16, jnp.array([0.1, 0.2, 0.5, 0.8]))],
                         ids=["fp32_scalar", "bf16_per_head"])
def test_differential(dtype, lam, interpret):
  q1, k1, v = inputs(SQ, SKV, dtype, seed=0)
  q2, k2, _ = inputs(SQ, SKV, dtype, seed=5)
  variant = V.causal(seq_q=SQ, seq_kv=SKV)
  out = V.differential(q1, k1, q2, k2, v, lam, **variant.kwargs(), config=SMALL,
                       interpret=interpret)
  assert out.dtype == dtype
  lam_b = jnp.asarray(lam, jnp.float32).reshape(-1, 1) if jnp.ndim(lam) else lam
  expected = reference(variant, q1, k1, v) - lam_b * reference(variant, q2, k2, v)
  assert_close(out, expected, dtype)


@pytest.mark.parametrize("name", V.NAMES)
def test_by_name(name):
  variant = V.by_name(name, num_heads=HEADS, seq_q=SQ, seq_kv=SKV)
  assert isinstance(variant, V.Variant) and variant.name
  assert set(variant.kwargs()) == {"score_mod", "mask_mod", "rownorm"}
  pa.analyze_variant(**variant.kwargs())  # the kernel templates accept it


def test_by_name_document_is_eight_causal_documents_bottom_right():
  variant = V.by_name("document", num_heads=HEADS, seq_q=SQ, seq_kv=SKV)
  q_pos, kv_pos = positions(SQ, SKV)
  expected = (q_pos * 8 // SKV == kv_pos * 8 // SKV) & (kv_pos <= q_pos)
  np.testing.assert_array_equal(mask_of(variant, SQ, SKV, batch=1)[0], expected)
  q, k, v = inputs()
  assert_close(run(variant, q, k, v), np_attention(q, k, v, expected[None]))
  with pytest.raises(ValueError, match="unknown variant"):
    V.by_name("nope", num_heads=HEADS, seq_q=SQ, seq_kv=SKV)


def shift(amount):
  return V.Variant(f"shift({amount})", score_mod=lambda s, b, h, qi, ki: s + amount)


def test_compose_chains_score_mods_in_order_and_ands_masks():
  capped_then_shifted = V.softcap(1.0) + shift(10.0)
  shifted_then_capped = V.compose(shift(10.0), V.softcap(1.0))
  # float32 against float64, rtol a few float32 ulps: XLA's CPU tanh is not correctly
  # rounded (2.6e-7 relative at worst at any optimization level; at level 0, which
  # conftest sets, a scalar tanh(10.5) is 1 - 1.8e-7, not 1). The other order's
  # values, 1.0 and 10.46, are far outside it.
  np.testing.assert_allclose(capped_then_shifted.score_mod(0.5, 0, 0, 0, 0), np.tanh(0.5) + 10,
                             rtol=1e-6)
  np.testing.assert_allclose(shifted_then_capped.score_mod(0.5, 0, 0, 0, 0), np.tanh(10.5),
                             rtol=1e-6)
  both = V.causal() + V.sliding_window(3, causal=False) + V.document(SEGMENT_IDS)
  expected = (np_causal(S, S) & np_window(S, S, 3, causal=False)
              & np_document(SEGMENT_IDS, SEGMENT_IDS, False))
  np.testing.assert_array_equal(mask_of(both, S, S), expected)
  assert both.name == "causal+sliding_window(3)+document" and both.rownorm == "softmax"
  assert V.compose().kwargs() == V.Variant("vanilla").kwargs()


def test_compose_rownorms():
  assert (V.sigmoid(seq_kv=8) + V.causal()).rownorm == "sigmoid"
  assert (V.causal() + V.retention_parallel(num_heads=2)).rownorm is V.retention_norm
  assert (V.sigmoid(seq_kv=8) + V.sigmoid(seq_kv=8)).rownorm == "sigmoid"
  with pytest.raises(ValueError, match="different rownorms"):
    V.sigmoid(seq_kv=8) + V.relu(seq_kv=8)
  with pytest.raises(TypeError):
    V.causal() + (lambda b, h, qi, ki: qi >= ki)


def test_invalid_arguments():
  q, k, v = inputs()
  for make in (lambda: V.causal(seq_q=4), lambda: V.sliding_window(0),
               lambda: V.softcap(0.0), lambda: V.sigmoid(), lambda: V.relu(),
               lambda: V.relu(-1.0), lambda: V.alibi(), lambda: V.alibi(jnp.ones(3), num_heads=4),
               lambda: V.prefix_lm(jnp.ones((2, 2))), lambda: V.retention_parallel(),
               lambda: V.document(), lambda: V.document(q_segment_ids=SEGMENT_IDS),
               lambda: V.document(SEGMENT_IDS, kv_segment_ids=SEGMENT_IDS),
               lambda: V.differential(q, k, q, k, v, 0.5, return_lse=True)):
    with pytest.raises(ValueError):
      make()
