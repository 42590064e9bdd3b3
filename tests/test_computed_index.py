"""Captured arrays read at computed indices (gathers): relative-position
tables, T5 buckets, Swin's 2D relative bias, lookups through another
array's value, out-of-range indices; forward, gradients (the gathered
table's included, deterministic) and block masks, against the dense
reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_attn as pa
from conftest import MODES, assert_close, modes, qkv, random
from pallas_attn.reference import dense_mask
from test_attention_backward import SMALL, check_gradients

B, SQ, SKV, HEADS = 2, 37, 45, 4  # qkv()'s defaults: ragged lengths, GQA, Dqk != Dv
CAUSAL = lambda b, h, qi, ki: qi >= ki


def t5_bucket(relative, num_buckets=8, max_distance=20):
  """T5's unidirectional log bucket of `q - kv` (>= 0 attends to the past)."""
  n = jnp.maximum(relative, 0)
  exact = num_buckets // 2
  log_bucket = exact + (jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / exact)
                        / np.log(max_distance / exact) * (num_buckets - exact)).astype(jnp.int32)
  return jnp.where(n < exact, n, jnp.minimum(log_bucket, num_buckets - 1))


SWIN = 5  # tokens form SWIN x SWIN windows row by row: position p is (p // SWIN, p % SWIN)


def swin_index(qi, ki):
  dy = qi // SWIN - ki // SWIN + (SKV // SWIN - 1)
  dx = qi % SWIN - ki % SWIN + (SWIN - 1)
  return dy * (2 * SWIN - 1) + dx


TABLES = {"rel": (HEADS, SQ + SKV - 1), "t5": (HEADS, 8), "swin": (HEADS, (2 * (SKV // SWIN) - 1) * (2 * SWIN - 1)),
          "two_axes": (HEADS, 8, 9), "clamped": (HEADS, 30)}

SCORE_MODS = {
    # A learned relative-position table: one entry per q - kv.
    "rel": lambda t: lambda s, b, h, qi, ki: s + t[h, qi - ki + SKV - 1],
    "t5": lambda t: lambda s, b, h, qi, ki: s + t[h, t5_bucket(qi - ki)],
    "swin": lambda t: lambda s, b, h, qi, ki: s + t[h, swin_index(qi, ki)],
    # Two computed axes at once, and a score that scales the gathered value.
    "two_axes": lambda t: lambda s, b, h, qi, ki: s * (1.0 + 0.1 * t[h, qi % 8, (ki * 7) % 9]),
    # Indices past both ends: JAX wraps negatives once, then clamps into the table.
    "clamped": lambda t: lambda s, b, h, qi, ki: s + t[h, qi - 2 * ki + 3],
}


GATHER_CASES = {f"{'causal' if masked else 'dense'}-{name}": (name, masked)
                for masked in (False, True) for name in SCORE_MODS}


# Interpret mode: every table dense; causal, rel (its entries at q < kv are read by
# masked positions only: zero gradient) and T5 (bucket 0 is read by masked and kept
# positions: only the kept ones' gradient). The mask's handling does not depend on
# the index's form.
@pytest.mark.parametrize("name,masked,interpret", modes(GATHER_CASES, [
    *(f"dense-{name}" for name in SCORE_MODS), "causal-rel", "causal-t5"]))
def test_gathered_tables_forward_and_gradients(name, masked, interpret):
  """Output and gradients (the gathered table's included) of a table read at a
  computed index."""
  q, k, v = qkv()
  table = random(TABLES[name], seed=11)
  mask_mod = CAUSAL if masked else None
  out = pa.attention(q, k, v, score_mod=SCORE_MODS[name](table), mask_mod=mask_mod,
                     config=SMALL, interpret=interpret)
  assert_close(out, pa.attention_reference(q, k, v, score_mod=SCORE_MODS[name](table),
                                           mask_mod=mask_mod))
  check_gradients(q, k, v, {"table": table}, interpret=interpret, make_kwargs=lambda c: dict(
      score_mod=SCORE_MODS[name](c["table"]), mask_mod=mask_mod))


@pytest.mark.parametrize("interpret", MODES)
def test_gathered_table_bf16_and_deterministic_gradient(interpret):
  q, k, v = qkv(dtype=jnp.bfloat16)
  table = random(TABLES["rel"], seed=12)

  def loss(table):
    out = pa.attention(q, k, v, score_mod=SCORE_MODS["rel"](table), mask_mod=CAUSAL,
                       config=SMALL, bwd_config=SMALL, interpret=interpret)
    return jnp.sum(out.astype(jnp.float32) * random(out.shape, seed=5))

  grad = jax.jit(jax.grad(loss))
  first, second = grad(table), grad(table)
  assert np.array_equal(np.asarray(first), np.asarray(second))
  check_gradients(q, k, v, {"table": table}, dtype=jnp.bfloat16, interpret=interpret,
                  make_kwargs=lambda c: dict(score_mod=SCORE_MODS["rel"](c["table"]),
                                             mask_mod=CAUSAL))


def packed_documents():
  """Per-batch document ids over the keys and each document's prefix length."""
  ids = np.sort(np.random.RandomState(1).randint(0, 4, (B, SKV)), axis=1)
  prefix = np.random.RandomState(2).randint(1, 6, (B, 4))
  return jnp.asarray(ids, jnp.int32), jnp.asarray(prefix, jnp.int32)


def document_prefix_mask(ids, prefix):
  """Within its document a query sees the document's prefix bidirectionally and
  the rest causally: the start and the prefix are looked up by document id."""
  starts = jax.vmap(lambda row: jnp.searchsorted(row, jnp.arange(4), side="left"))(ids)

  def mask_mod(b, h, qi, ki):
    doc = ids[b, ki]
    in_prefix = ki < starts[b, doc] + prefix[b, doc]
    return (ids[b, qi] == doc) & ((ki <= qi) | in_prefix)
  return mask_mod


@pytest.mark.parametrize("interpret", MODES)
def test_mask_looked_up_through_another_array(interpret):
  q, k, v = qkv(seq_q=SKV)
  mask_mod = document_prefix_mask(*packed_documents())
  analysis = pa.analyze_variant(mask_mod=mask_mod)
  assert any(use.is_gather for use in analysis.mask_mod.uses)
  bm = pa.block_mask(mask_mod, B, HEADS, SKV, SKV, block_q=16, block_kv=16, interpret=interpret)
  dense = np.asarray(dense_mask(mask_mod, B, 1, SKV, SKV))[:, 0]
  classes = np.asarray(bm.classes)[:, 0]
  for qb in range(classes.shape[1]):
    for kb in range(classes.shape[2]):
      tile = dense[:, qb * 16:(qb + 1) * 16, kb * 16:(kb + 1) * 16]
      want = np.where(tile.all((1, 2)), 2, np.where(tile.any((1, 2)), 1, 0))
      assert np.array_equal(classes[:, qb, kb], want)
  for block_mask in (None, bm):
    out = pa.attention(q, k, v, mask_mod=mask_mod, block_mask=block_mask, config=SMALL,
                       interpret=interpret)
    assert_close(out, pa.attention_reference(q, k, v, mask_mod=mask_mod))
  check_gradients(q, k, v, interpret=interpret, make_kwargs=lambda c: dict(mask_mod=mask_mod))


@pytest.mark.parametrize("interpret", MODES)
def test_integer_table_at_a_computed_index_under_jit_and_vmap(interpret):
  """An int table (no gradient) closed over by a jitted, vmapped call."""
  q, k, v = qkv()
  levels = jnp.asarray(np.random.RandomState(3).randint(-3, 3, (SQ + SKV,)), jnp.int32)
  score_mod = lambda s, b, h, qi, ki: s + 0.5 * levels[qi - ki + SKV].astype(jnp.float32)
  call = lambda q, k, v: pa.attention(q, k, v, score_mod=score_mod, config=SMALL,
                                      interpret=interpret)
  out = jax.jit(jax.vmap(call))(q[None], k[None], v[None])[0]
  assert_close(out, pa.attention_reference(q, k, v, score_mod=score_mod))


def test_explain_names_the_gather():
  table = random(TABLES["swin"])
  text = pa.analyze_variant(score_mod=SCORE_MODS["swin"](table)).describe()
  assert "<computed>" in text and "gathers" in text


# Terms of q_idx - kv_idx only, hoisted out of the kernel (spec/diagonal.py).
DIAGONAL_MODS = {
    "rel": SCORE_MODS["rel"],
    "t5": SCORE_MODS["t5"],
    # No captured array: a log-distance penalty, per head through h's value.
    "log_distance": lambda t: lambda s, b, h, qi, ki: s - (0.5 + 0.1 * h) * jnp.log1p(
        jnp.abs(qi - ki).astype(jnp.float32)),
    # An offset and a factor on the difference, read past the table's ends (clamped).
    "scaled": lambda t: lambda s, b, h, qi, ki: s * 0.5 + t[h, 2 * (ki + 3 - qi) + 40],
    # The read is hoisted; its product with q_idx stays in the kernel.
    "times_q": lambda t: lambda s, b, h, qi, ki: s + 0.01 * t[h, qi - ki + SKV - 1] * qi,
}


TABLE_OF = {"scaled": "clamped", "times_q": "rel"}


@pytest.mark.parametrize("name", list(DIAGONAL_MODS))
def test_diagonal_terms_are_hoisted(name):
  table = random(TABLES.get(TABLE_OF.get(name, name), (1,)))
  prog = pa.analyze_variant(score_mod=DIAGONAL_MODS[name](table)).score_mod
  assert len(prog.terms) == 1 and prog.uses[0].is_term
  assert not any(use.is_gather for use in prog.uses)  # the table read went with the term
  assert prog.without_terms().terms == ()
  text = pa.analyze_variant(score_mod=DIAGONAL_MODS[name](table)).describe()
  assert "hoists term#0" in text and "q_idx - kv_idx" in text


@pytest.mark.parametrize("score_mod", [
    lambda s, b, h, qi, ki: s + SLOPES[h] * (ki - qi),           # cheap: stays in the kernel
    lambda s, b, h, qi, ki: s + TABLE[b, qi - ki + SKV - 1],     # depends on b
    lambda s, b, h, qi, ki: s + TABLE[h, qi - 2 * ki + 90],      # not a function of q - kv
], ids=["alibi", "batch", "not_diagonal"])
def test_other_reads_are_not_hoisted(score_mod):
  prog = pa.analyze_variant(score_mod=score_mod).score_mod
  assert prog.terms == () and not any(use.is_term for use in prog.uses)


SLOPES, TABLE = random((HEADS,)), random((HEADS, 100))


DIAGONAL_CASES = {f"{'causal' if masked else 'dense'}-{name}": (name, masked)
                  for masked in (False, True) for name in DIAGONAL_MODS}


@pytest.mark.parametrize("name,masked,interpret", modes(DIAGONAL_CASES, [
    *(f"dense-{name}" for name in DIAGONAL_MODS), "causal-rel", "causal-t5"]))
def test_diagonal_terms_forward_and_gradients(name, masked, interpret):
  """q, k and v differentiated: forward and backward read the hoisted vector
  (the table's own gradient, in test_gathered_tables_forward_and_gradients,
  takes the per-position reads). Interpret mode: every term dense, two causal
  (the hoisted vector is read the same way in partially masked tiles)."""
  q, k, v = qkv()
  table = random(TABLES.get(TABLE_OF.get(name, name), (1,)), seed=11)
  kwargs = dict(score_mod=DIAGONAL_MODS[name](table), mask_mod=CAUSAL if masked else None)
  out = pa.attention(q, k, v, **kwargs, config=SMALL, interpret=interpret)
  assert_close(out, pa.attention_reference(q, k, v, **kwargs))
  check_gradients(q, k, v, interpret=interpret, make_kwargs=lambda c: kwargs)



@pytest.mark.parametrize("seq_q,seq_kv", [(128, 320), (320, 128)])
def test_diagonal_bank_tiles(seq_q, seq_kv):
  """Each tile a kernel loads from a diagonal bank (rows from `bank_row`,
  columns from 0) is the term at q - kv of its positions."""
  from pallas_attn.kernels import tiles
  operand = tiles.CaptureOperand(("h", tiles.DIAGONAL, tiles.DIAGONAL), False,
                                 diagonals=(seq_q, seq_kv))
  vector = random((2, seq_q + seq_kv - 1))
  bank = tiles.diagonal_bank(vector, seq_q, seq_kv, 64)
  for q0 in range(0, seq_q, 64):
    for kv0 in range(0, seq_kv, 64):
      row = operand.bank_row(q0, kv0)
      tile = bank[:, row:row + 64, :]
      q_minus_kv = np.arange(q0, q0 + 64)[:, None] - np.arange(kv0, kv0 + 64)[None, :]
      np.testing.assert_array_equal(tile, vector[:, q_minus_kv + seq_kv - 1])


@pytest.mark.parametrize("seq_q,seq_kv", [(128, 320), (320, 128)])
@pytest.mark.parametrize("rows_are_queries", [True, False], ids=["q_kv", "kv_q"])
def test_vector_window_tiles(seq_q, seq_kv, rows_are_queries):
  """The Mosaic kernels' term tiles (mosaic_backend.diagonal_tile: entry
  `first + cols - 1 + i - j` of a `vector_window`, or `first + rows - 1 - i +
  j` for `[kv, q]` tiles) are the term at q - kv, inside the vector."""
  from pallas_attn.kernels import tiles
  operand = tiles.CaptureOperand(("h", tiles.DIAGONAL), False, diagonals=(seq_q, seq_kv),
                                 vector=True)
  vector = np.asarray(random((2, seq_q + seq_kv - 1)))
  rows, cols = 64, 128
  i, j = np.arange(rows)[:, None], np.arange(cols)[None, :]
  row_len, col_len = (seq_q, seq_kv) if rows_are_queries else (seq_kv, seq_q)
  for r0 in range(0, row_len, rows):
    for c0 in range(0, col_len - cols + 1, 64):
      first = operand.vector_window(r0, rows, c0, cols, rows_are_queries)
      entry = first + (cols - 1 + i - j if rows_are_queries else rows - 1 - i + j)
      assert 0 <= entry.min() and entry.max() < vector.shape[-1]
      q, kv = (r0 + i, c0 + j) if rows_are_queries else (c0 + j, r0 + i)
      np.testing.assert_array_equal(vector[:, entry], vector[:, q - kv + seq_kv - 1])


def test_term_pairs_hold_each_entry_beside_the_next():
  """The Mosaic kernels' layout of a term's vector: one aligned load per
  pair of neighbouring entries (mosaic_backend.diagonal_tile)."""
  from pallas_attn.kernels import tiles
  vector = np.asarray(random((2, 9)))
  pairs = np.asarray(tiles.term_pairs(jnp.asarray(vector)))
  assert pairs.shape == (2, 9, 2)
  np.testing.assert_array_equal(pairs[..., 0], vector)
  np.testing.assert_array_equal(pairs[:, :-1, 1], vector[:, 1:])
