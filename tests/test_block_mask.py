"""Block sparsity: tile classes against a dense mask, reuse, broadcasting, errors."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_attn as pa
from pallas_attn import variants
from pallas_attn.kernels import block_mask as bm_lib
from pallas_attn.kernels import block_mask_cache
from pallas_attn.spec import mask_bounds
from pallas_attn.reference import dense_mask
from conftest import MODES, assert_close, qkv

SMALL = pa.AttentionConfig(block_q=16, block_k=16, num_warps=4, num_stages=1)
DOCS = jnp.array(np.sort(np.random.RandomState(1).randint(0, 3, size=(2, 45))), jnp.int32)
PREFIX = jnp.array([5, 30], jnp.int32)
MASKS = {
    "causal": lambda b, h, qi, ki: qi >= ki,
    "window": lambda b, h, qi, ki: (qi >= ki) & (qi - ki < 10),
    "document": lambda b, h, qi, ki: DOCS[b, qi] == DOCS[b, ki],
    "prefix_lm": lambda b, h, qi, ki: (ki < PREFIX[b]) | (qi >= ki),
    "per_head": lambda b, h, qi, ki: (qi + 4 * h >= ki),
    "all_masked_rows": lambda b, h, qi, ki: (qi < 20) & (ki < 40),
}


FIELDS = ["kv_partial_num", "kv_partial_idx", "kv_full_num", "kv_full_idx", "q_partial_num",
          "q_partial_idx", "q_full_num", "q_full_idx", "classes"]


def documents(ids):
  """A causal document mask over `ids` [B, S], a new closure per call as per batch."""
  return lambda b, h, qi, ki: (ids[b, qi] == ids[b, ki]) & (qi >= ki)


def dense_classes(mask, seq_q, seq_kv, bq, bk):
  """Expected tile classes from a dense mask (padding: q rows ignored, kv columns masked)."""
  nq, nk = -(-seq_q // bq), -(-seq_kv // bk)
  full = np.zeros(mask.shape[:2] + (nq * bq, nk * bk), bool)
  full[:, :, :seq_q, :seq_kv] = mask
  valid = np.zeros((nq * bq, 1), bool)
  valid[:seq_q] = True
  tiles = full.reshape(*mask.shape[:2], nq, bq, nk, bk)
  rows = np.broadcast_to(valid.reshape(nq, bq, 1, 1), tiles.shape[2:])
  any_kept = (tiles & rows).any(axis=(3, 5))
  all_kept = (tiles | ~rows).all(axis=(3, 5))
  return np.where(all_kept, bm_lib.FULL, np.where(any_kept, bm_lib.PARTIAL, bm_lib.EMPTY))


@pytest.mark.parametrize("name", list(MASKS))
def test_tile_classes_match_dense_mask(name):
  mask_mod = MASKS[name]
  analysis = pa.analyze_variant(mask_mod=mask_mod)
  classes = bm_lib.classify_tiles(analysis, 2, 4, 45, 45, 16, 16, interpret=True)
  mask = np.asarray(dense_mask(mask_mod, 2, 4, 45, 45))
  expected = dense_classes(mask, 45, 45, 16, 16)
  deps = analysis.mask_deps
  assert classes.shape[0] == (2 if "b" in deps else 1)
  assert classes.shape[1] == (4 if "h" in deps else 1)
  np.testing.assert_array_equal(classes, expected[:classes.shape[0], :classes.shape[1]])


@pytest.mark.parametrize("bounds", [True, False])
@pytest.mark.parametrize("name", ["causal", "window", "per_head"])
def test_masks_on_192_row_tiles(name, bounds, monkeypatch):
  """The fp8 forward's 192-row tiles (three consumer warpgroups): classified
  as 64-row tiles (the classify kernel's Triton tiles are powers of two) and
  coarsened, with and without tile bounds."""
  monkeypatch.setattr(bm_lib, "TILE_BOUNDS", bounds)
  classify, rows = bm_lib.classify_tiles, []
  monkeypatch.setattr(bm_lib, "classify_tiles",
                      lambda *args, **kw: rows.append(args[6]) or classify(*args, **kw))
  mask_mod = MASKS[name]
  analysis = pa.analyze_variant(mask_mod=mask_mod)
  built, _ = bm_lib.build_block_masks(analysis, 2, 4, 400, 400, ((192, 64), (64, 64)),
                                      interpret=True)
  assert (built.block_q, built.block_k) == (192, 64) and set(rows) == {64}
  expected = dense_classes(np.asarray(dense_mask(mask_mod, 2, 4, 400, 400)),
                           400, 400, 192, 64)
  np.testing.assert_array_equal(built.classes,
                                expected[:built.classes.shape[0], :built.classes.shape[1]])


def test_tile_lists():
  causal = pa.block_mask(MASKS["causal"], 1, 1, 64, 64, block_q=16, block_kv=16)
  np.testing.assert_array_equal(causal.kv_full_num[0, 0], [0, 1, 2, 3])
  np.testing.assert_array_equal(causal.kv_partial_num[0, 0], [1, 1, 1, 1])
  np.testing.assert_array_equal(causal.kv_partial_idx[0, 0, :, 0], [0, 1, 2, 3])
  np.testing.assert_array_equal(causal.q_full_num[0, 0], [3, 2, 1, 0])
  np.testing.assert_array_equal(causal.q_full_idx[0, 0, 0, :3], [1, 2, 3])
  assert float(causal.density()) == pytest.approx(10 / 16)


@pytest.mark.parametrize("name", ["causal", "document", "prefix_lm", "all_masked_rows"])
def test_retiled_block_mask(name):
  """Coarser tiles are exact; finer tiles inherit the parent's class (a superset)."""
  mask_mod = MASKS[name]
  mask = np.asarray(dense_mask(mask_mod, 2, 4, 45, 45))
  fine = pa.block_mask(mask_mod, 2, 4, 45, 45, block_q=16, block_kv=16, interpret=True)
  coarse = fine.with_blocks(32, 64)
  expected = dense_classes(mask, 45, 45, 32, 64)
  np.testing.assert_array_equal(coarse.classes, expected[:coarse.classes.shape[0],
                                                         :coarse.classes.shape[1]])
  refined = pa.block_mask(mask_mod, 2, 4, 45, 45, block_q=32, block_kv=32,
                          interpret=True).with_blocks(16, 16)
  exact = dense_classes(mask, 45, 45, 16, 16)[:refined.classes.shape[0], :refined.classes.shape[1]]
  got = np.asarray(refined.classes)
  assert got.shape == exact.shape
  assert np.all((got == bm_lib.FULL) <= (exact == bm_lib.FULL))
  assert np.all((got == bm_lib.EMPTY) <= (exact == bm_lib.EMPTY))
  assert coarse.program == refined.program == fine.program and coarse.digest is fine.digest
  with pytest.raises(ValueError, match="re-tile"):
    fine.with_blocks(24, 16)


def test_coarsened_tiles_ignore_padding_queries():
  """The last q block's padding rows (45 of 48 are queries) neither keep nor mask."""
  first_keys = lambda b, h, qi, ki: ki < 32
  coarse = pa.block_mask(first_keys, 1, 1, 45, 64, block_q=16, block_kv=16).with_blocks(32, 32)
  direct = pa.block_mask(first_keys, 1, 1, 45, 64, block_q=32, block_kv=32)
  np.testing.assert_array_equal(coarse.classes[0, 0, :, 0], [bm_lib.FULL, bm_lib.FULL])
  for field in FIELDS:
    np.testing.assert_array_equal(getattr(coarse, field), getattr(direct, field))


@pytest.mark.parametrize("interpret", MODES)
def test_block_mask_reuse_jit_and_vmap(interpret):
  q, k, v = qkv(seq_q=45, seq_kv=45)
  mask_mod = MASKS["document"]
  bm = pa.block_mask(mask_mod, 2, 4, 45, 45, block_q=16, block_kv=16, interpret=interpret)
  ref = pa.attention_reference(q, k, v, mask_mod=mask_mod)
  run = lambda q, k, v, bm: pa.attention(q, k, v, mask_mod=mask_mod, block_mask=bm,
                                         interpret=interpret)
  assert_close(run(q, k, v, bm), ref)
  assert_close(jax.jit(run)(q * 0.5, k, v, bm),
               pa.attention_reference(q * 0.5, k, v, mask_mod=mask_mod))
  causal = pa.block_mask(MASKS["causal"], 1, 1, 45, 45, block_q=16, block_kv=16,
                         interpret=interpret)
  stacked = [jnp.stack([x, -x]) for x in (q, k, v)]
  out = jax.vmap(lambda q, k, v: pa.attention(q, k, v, mask_mod=MASKS["causal"],
                                              block_mask=causal, interpret=interpret))(*stacked)
  for i in range(2):
    assert_close(out[i], pa.attention_reference(*(x[i] for x in stacked),
                                                mask_mod=MASKS["causal"]))


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("name", ["window", "prefix_lm", "per_head", "all_masked_rows"])
def test_sparse_masks_forward(name, interpret):
  q, k, v = qkv(seq_q=45, seq_kv=45)
  out = pa.attention(q, k, v, mask_mod=MASKS[name], config=SMALL, interpret=interpret)
  assert_close(out, pa.attention_reference(q, k, v, mask_mod=MASKS[name]))


def test_block_mask_errors():
  q, k, v = qkv(seq_q=45, seq_kv=45)
  bm = pa.block_mask(MASKS["causal"], 1, 1, 45, 45, block_q=16, block_kv=16)
  with pytest.raises(ValueError, match="without the mask_mod"):
    pa.attention(q, k, v, block_mask=bm)
  with pytest.raises(ValueError, match="built for"):
    pa.attention(q[:, :30], k, v, mask_mod=MASKS["causal"], block_mask=bm)
  with pytest.raises(TypeError, match="pallas_attn.block_mask"):
    pa.attention(q, k, v, mask_mod=MASKS["causal"], block_mask=np.ones((4, 4)))


REBUILD = r"rebuild it with pallas_attn\.block_mask\(mask_mod, B, H, Sq, Skv\)"


def test_block_mask_of_another_mask_mod_is_rejected():
  """Issue 36: a causal call given an anti-causal block mask of the right shape."""
  q, k, v = qkv(seq_q=45, seq_kv=45)
  anti_causal = pa.block_mask(lambda b, h, qi, ki: qi <= ki, 1, 1, 45, 45, block_q=16,
                              block_kv=16)
  run = lambda q, bm: pa.attention(q, k, v, mask_mod=MASKS["causal"], block_mask=bm)
  for call in (run, jax.jit(run)):  # the program is static: known under a trace too
    with pytest.raises(ValueError, match="different mask_mod.*" + REBUILD):
      call(q, anti_causal)
  wider = pa.block_mask(documents(jnp.zeros((2, 64), jnp.int32)), 2, 1, 45, 45)
  with pytest.raises(ValueError, match="different mask_mod"):  # captures of other shapes
    pa.attention(q, k, v, mask_mod=documents(DOCS), block_mask=wider)


def test_block_mask_over_other_captured_values_is_rejected():
  """Same code over another batch's ids: rejected where both sets of values are concrete."""
  q, k, v = qkv(seq_q=45, seq_kv=45)
  other = jnp.array(np.sort(np.random.RandomState(2).randint(0, 3, size=(2, 45))), jnp.int32)
  bm = pa.block_mask(documents(DOCS), 2, 1, 45, 45, block_q=16, block_kv=16)
  run = lambda q, ids, bm: pa.attention(q, k, v, mask_mod=documents(ids), block_mask=bm)
  with pytest.raises(ValueError, match="same mask_mod code over other captured values.*"
                     + REBUILD):
    run(q, other, bm)
  with pytest.raises(ValueError, match="other captured values"):  # ids closed over under jit
    jax.jit(lambda q: run(q, other, bm))(q)
  reference = pa.attention_reference(q, k, v, mask_mod=documents(DOCS))
  for _ in range(2):  # the same mask for new closures over the same ids, as layers pass it
    assert_close(run(q, DOCS, bm), reference)
  # ids as jit arguments: the values are unknown while tracing, and are not compared.
  assert_close(jax.jit(run)(q, DOCS, bm), reference)


def test_values_digest_sees_positions_and_dtypes():
  ids = jnp.arange(64, dtype=jnp.int32) // 16
  moved = jnp.minimum((jnp.arange(64, dtype=jnp.int32) + 1) // 16, 3)
  digests = [int(bm_lib.values_digest(c)) for c in
             [(ids,), (ids[::-1],), (moved,), (ids, ids), (ids > 1,),
              (ids.astype(jnp.bfloat16),), (ids.astype(jnp.float32),)]]
  assert len(set(digests)) == len(digests)
  assert int(bm_lib.values_digest((jnp.array(ids),))) == digests[0]


def test_eager_block_mask_reuses_its_compiled_builder(monkeypatch):
  """New document ids of the same shape: no new builder, no compilation, the new ids' lists."""
  shape = (2, 1, 300, 300)
  ids = [jnp.array(np.sort(np.random.RandomState(seed).randint(0, 4, size=(2, 300))), jnp.int32)
         for seed in (3, 4)]
  pa.block_mask(documents(ids[0]), *shape, block_q=16, block_kv=16)
  compiled = []
  monkeypatch.setattr(block_mask_cache, "compiled_builder", lambda *a: compiled.append(a))
  listener = lambda event, *_, **__: (compiled.append(event)
                                      if event == "/jax/core/compile/backend_compile_duration"
                                      else None)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    second = pa.block_mask(documents(ids[1]), *shape, block_q=16, block_kv=16)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert not compiled
  analysis = pa.analyze_variant(mask_mod=documents(ids[1]))
  fresh, = bm_lib.build_block_masks(analysis, *shape, ((16, 16),), interpret=True)
  for field in FIELDS:
    np.testing.assert_array_equal(getattr(second, field), getattr(fresh, field))
  expected = dense_classes(np.asarray(dense_mask(documents(ids[1]), 2, 1, 300, 300)),
                           300, 300, 16, 16)
  np.testing.assert_array_equal(second.classes, expected)


def test_block_mask_inside_jit_with_traced_captures():
  ids = jnp.array(np.sort(np.random.RandomState(5).randint(0, 3, size=(2, 45))), jnp.int32)
  build = lambda ids: pa.block_mask(documents(ids), 2, 1, 45, 45, block_q=16, block_kv=16)
  traced, eager = jax.jit(build)(ids), build(ids)
  for field in FIELDS + ["digest"]:
    np.testing.assert_array_equal(getattr(traced, field), getattr(eager, field))
  assert traced.program == eager.program
  q, k, v = qkv(seq_q=45, seq_kv=45)
  used = jax.jit(lambda q, ids: pa.attention(q, k, v, mask_mod=documents(ids),
                                             block_mask=build(ids)))
  assert_close(used(q, ids), pa.attention_reference(q, k, v, mask_mod=documents(ids)))


def test_tracing_compiles_and_runs_no_block_mask_kernel(monkeypatch):
  """Pure construction: while a function is traced, `block_mask` and `attention` run no
  compiled builder and stage no classify kernel where mask_mod's arrays are concrete (none,
  or closed over): the tile bounds classify the tiles on the host, the same classes as an
  eager build. A mask the bounds cannot reach is built in the traced program instead."""
  build = lambda: pa.block_mask(documents(DOCS), 2, 1, 45, 45, block_q=16, block_kv=16)
  eager = build()  # outside any trace: by the compiled builder

  def fail(*_, **__):
    raise AssertionError("a compiled block-mask builder ran while tracing")
  monkeypatch.setattr(block_mask_cache, "compiled_builder", fail)
  for cache in ("_CLOSURES", "_TRACED"):  # nor one compiled earlier
    monkeypatch.setattr(block_mask_cache, cache, {})
  assert "pallas_attn_block_mask" not in str(jax.make_jaxpr(build)())
  traced = jax.jit(build)()
  for field in FIELDS + ["digest"]:
    np.testing.assert_array_equal(getattr(traced, field), getattr(eager, field))
  q, k, v = qkv(seq_q=45, seq_kv=45)
  float_mask = lambda b, h, qi, ki: qi.astype(jnp.float32) * 0.5 >= ki.astype(jnp.float32) * 0.5
  for mask_mod, staged in ((MASKS["causal"], False), (documents(DOCS), False),
                           (float_mask, True)):
    attend = lambda q: pa.attention(q, k, v, mask_mod=mask_mod, config=SMALL)
    assert ("pallas_attn_block_mask" in str(jax.make_jaxpr(attend)(q))) == staged
    assert_close(jax.jit(attend)(q), pa.attention_reference(q, k, v, mask_mod=mask_mod))


def _expected(mask_mod, shape, block=16):
  batch, heads, seq_q, seq_kv = shape
  return dense_classes(np.asarray(dense_mask(mask_mod, batch, heads, seq_q, seq_kv)),
                       seq_q, seq_kv, block, block)


def _check_eager(mask_mod, shape=(2, 1, 45, 45)):
  """`pa.block_mask` of mask_mod against its dense mask's classes."""
  got = pa.block_mask(mask_mod, *shape, block_q=16, block_kv=16)
  expected = _expected(mask_mod, shape)
  np.testing.assert_array_equal(got.classes, expected[:got.classes.shape[0],
                                                     :got.classes.shape[1]])


def _no_trace(monkeypatch):
  """Makes any trace of a mask_mod by `block_mask` fail the test."""
  def fail(*_, **__):
    raise AssertionError("mask_mod was traced")
  monkeypatch.setattr(block_mask_cache, "analyze_variant", fail)
  monkeypatch.setattr(block_mask_cache, "_traced_key", fail)


def test_eager_closure_over_new_arrays_runs_without_a_trace(monkeypatch):
  """A new closure of the same code over new ids of the same shape: the new ids' mask, no trace."""
  ids = [jnp.array(np.sort(np.random.RandomState(seed).randint(0, 4, size=(2, 45))), jnp.int32)
         for seed in (6, 7, 8)]
  library = lambda x: variants.document(x, causal=True).mask_mod  # closures over closures
  partial = lambda x: functools.partial(lambda ids, b, h, qi, ki: ids[b, qi] <= ids[b, ki], x)
  for make in (documents, library, partial):
    _check_eager(make(ids[0]))
  _no_trace(monkeypatch)
  for make in (documents, library, partial):
    for x in ids[1:]:
      _check_eager(make(x))


def test_eager_closure_key_follows_python_values(monkeypatch):
  """Closed-over numbers, defaults, mutable containers and globals are part of the key."""
  window = lambda size: lambda b, h, qi, ki: (qi >= ki) & (qi - ki < size)
  for size in (3, 17, 3, 40):
    _check_eager(window(size))
  scaled = lambda scale: lambda b, h, qi, ki: (qi - ki) * scale < 3.0
  for scale in (0.5, 0.25, -0.0, 0.0):
    _check_eager(scaled(scale))
  for start in (4, 20):
    _check_eager(lambda b, h, qi, ki, start=start: ki >= start)
  params = {"width": 3}
  mask_mod = lambda b, h, qi, ki: jnp.abs(qi - ki) < params["width"]
  _check_eager(mask_mod)
  params["width"] = 20  # the same function object, now another mask
  _check_eager(mask_mod)
  state = [7]

  def nested(b, h, qi, ki):
    return _helper(qi, ki, state[0])
  _check_eager(nested)
  state[0] = 30
  _check_eager(nested)


HELPER_OFFSET = 0


def _helper(qi, ki, width):
  return (qi + HELPER_OFFSET >= ki) & (qi - ki < width)


def test_eager_closure_key_follows_globals(monkeypatch):
  """A global a helper reads, rebound: the new value's mask (numbers and arrays alike)."""
  mask_mod = lambda b, h, qi, ki: _helper(qi, ki, 9)
  for offset in (0, 13):
    monkeypatch.setattr(__import__(__name__), "HELPER_OFFSET", offset)
    _check_eager(mask_mod)
  global_docs = lambda b, h, qi, ki: DOCS[b, qi] == DOCS[b, ki]
  _check_eager(global_docs)
  other = jnp.array(np.sort(np.random.RandomState(9).randint(0, 5, size=(2, 45))), jnp.int32)
  monkeypatch.setattr(__import__(__name__), "DOCS", other)
  _check_eager(global_docs)


def test_eager_closure_key_aliasing_and_fallbacks():
  """One array captured twice is not two arrays; value-dependent traces and objects still work."""
  a, b_ = (jnp.array(np.sort(np.random.RandomState(s).randint(0, 3, size=(2, 45))), jnp.int32)
           for s in (10, 11))
  pair = lambda q_ids, kv_ids: lambda b, h, qi, ki: q_ids[b, qi] == kv_ids[b, ki]
  for q_ids, kv_ids in ((a, a), (a, b_), (b_, b_), (b_, a)):
    _check_eager(pair(q_ids, kv_ids))
  # int(width) bakes the value into the trace: each width must still give its own mask.
  by_value = lambda width: lambda b, h, qi, ki: jnp.abs(qi - ki) < int(width)
  for width in (3, 21):
    _check_eager(by_value(jnp.int32(width)))

  class Config:
    width = 4
  config = Config()
  from_object = lambda b, h, qi, ki: jnp.abs(qi - ki) < config.width
  _check_eager(from_object)
  config.width = 15
  _check_eager(from_object)


# Tile bounds (spec/mask_bounds.py): tiles decided without evaluating a position
# must get their exact class, and the bounds must decide the tiles of
# structured masks that are not partial.

IDS = jnp.array(np.sort(np.random.RandomState(12).randint(0, 5, size=(2, 90))), jnp.int32)
IDS16 = IDS.astype(jnp.int16)
FLAGS = jnp.array(np.random.RandomState(13).rand(2, 90) > 0.3)
GRID = jnp.array(np.random.RandomState(14).randint(0, 4, size=(90, 80)), jnp.int32)
PER_HEAD = jnp.array(np.sort(np.random.RandomState(15).randint(0, 99, size=(2, 2, 90))),
                     jnp.int32)
SHORT = jnp.arange(50, dtype=jnp.int32) // 10  # shorter than the keys: reads clamp
BOUNDED = {
    "chunked": lambda b, h, qi, ki: qi // 16 == ki // 16,
    "modulo": lambda b, h, qi, ki: (qi % 7) != (ki % 5),
    "int16_ids": lambda b, h, qi, ki: IDS16[b, qi] == IDS16[b, ki],
    "bool_capture": lambda b, h, qi, ki: FLAGS[b, ki] & (qi >= ki),
    "select": lambda b, h, qi, ki: jnp.where(qi > 40, ki < 30, ki >= 30),
    "xor_not": lambda b, h, qi, ki: ~((qi >= ki) ^ (ki < 20)),
    "overflow_mul": lambda b, h, qi, ki: qi * 100000000 + ki > 0,
    "overflow_add": lambda b, h, qi, ki: (qi + 2147483600) > (ki + 2147483600),
    "narrowing": lambda b, h, qi, ki: (qi * 3 - ki).astype(jnp.int8) > 0,
    "float": lambda b, h, qi, ki: qi.astype(jnp.float32) * 0.5 > ki,
    "bitwise": lambda b, h, qi, ki: (qi & 16) == (ki & 16),
    "gather": lambda b, h, qi, ki: IDS[b, jnp.maximum(qi - 3, 0)] == IDS[b, ki],
    "abs_clip_sign": lambda b, h, qi, ki: (jnp.abs(qi - ki) < 9 + 3 * h)
                                          | (jnp.sign(jnp.clip(ki - qi, -2, 2)) > 0),
    "square": lambda b, h, qi, ki: (qi - ki) ** 2 < 100,
    "kv_by_q": lambda b, h, qi, ki: GRID[ki, qi] + GRID[qi, 3] > 2,
    "per_head_keys": lambda b, h, qi, ki: PER_HEAD[b, h, ki] <= qi,
    "clamped": lambda b, h, qi, ki: (SHORT[ki] >= 3) | (SHORT[qi] == SHORT[ki]),
    "fixed_index": lambda b, h, qi, ki: IDS[1, ki] == IDS[b, 5],
}


def _check_bounds(mask_mod, seq_q=77, seq_kv=90, bq=16, bk=32, heads=2):
  """Exact classes with the bounds on; decided tiles exact with evaluation off. Returns
  (undecided, partial, all) tile counts."""
  analysis = pa.analyze_variant(mask_mod=mask_mod)
  expected = dense_classes(np.asarray(dense_mask(mask_mod, 2, heads, seq_q, seq_kv)), seq_q,
                           seq_kv, bq, bk)
  bounded = np.asarray(bm_lib.classify_tiles(analysis, 2, heads, seq_q, seq_kv, bq, bk, True,
                                             exact=False))
  expected = expected[:bounded.shape[0], :bounded.shape[1]]
  decided = bounded != mask_bounds.UNDECIDED
  np.testing.assert_array_equal(bounded[decided], expected[decided])
  classes = bm_lib.classify_tiles(analysis, 2, heads, seq_q, seq_kv, bq, bk, True)
  np.testing.assert_array_equal(classes, expected)
  return int((~decided).sum()), int((expected == bm_lib.PARTIAL).sum()), decided.size


def test_tile_bounds_at_edges():
  """Comparisons whose sides meet at a tile edge, selects by a mixed predicate, int32's
  minimum negated: one mask per head (a select by h, which the bounds resolve exactly)."""
  low = jnp.int32(-2 ** 31)
  masks = [lambda b, h, qi, ki, f=f, x=x, off=off, c=c: f((qi, ki)[x] + off, c)
           for f in (jnp.less, jnp.less_equal, jnp.greater, jnp.greater_equal, jnp.equal,
                     jnp.not_equal)
           for x, c in ((0, 32), (1, 64)) for off in (-1, 0, 1)]
  masks += [lambda b, h, qi, ki: jnp.where(qi >= ki, ki >= 0, ki < 0),
            lambda b, h, qi, ki: jnp.where(qi >= ki, qi, -1) >= 0,
            lambda b, h, qi, ki: -(qi + low) > 0,
            lambda b, h, qi, ki: jnp.abs(qi + low) > 0,
            lambda b, h, qi, ki: (qi + low) - 1 < 0]

  def per_head(b, h, qi, ki):
    keep = masks[0](b, h, qi, ki)
    for n, mask_mod in enumerate(masks[1:], 1):
      keep = jnp.where(h == n, mask_mod(b, h, qi, ki), keep)
    return keep
  _check_bounds(per_head, heads=len(masks))


@pytest.mark.parametrize("name", list(BOUNDED))
def test_tile_bounds_are_exact(name):
  undecided, _, count = _check_bounds(BOUNDED[name])
  bounded = mask_bounds.has_tile_bounds(pa.analyze_variant(mask_mod=BOUNDED[name]))
  assert bounded == (name not in ("float", "bitwise", "gather"))
  if not bounded:
    assert undecided == count


@pytest.mark.parametrize("name", ["causal", "window", "prefix_lm", "per_head", "documents"])
def test_tile_bounds_and_corners_decide_every_tile(name):
  """Bounds decide the empty and full tiles; corners that disagree, the partial ones
  that a diagonal, a window edge or a document boundary crosses: no tile is evaluated."""
  mask_mod = documents(IDS) if name == "documents" else MASKS[name]
  undecided, partial, _ = _check_bounds(mask_mod, seq_q=90, seq_kv=90, bq=16, bk=16)
  assert partial > 0 and undecided == 0


def _random_mask(rs, depth=3):
  """A random mask_mod over indices, captured ids, wide constants and the integer and
  boolean primitives that the bounds model (and some they do not)."""
  consts = [0, 1, 3, 7, 16, 45, -5, 2 ** 30, -2 ** 31 + 1, 2 ** 31 - 100]

  def integer(d):
    if d == 0 or rs.rand() < 0.25:
      leaf = rs.randint(6)
      c = consts[rs.randint(len(consts))]
      return [lambda b, h, qi, ki: qi, lambda b, h, qi, ki: ki, lambda b, h, qi, ki: h,
              lambda b, h, qi, ki: jnp.int32(c), lambda b, h, qi, ki: IDS[b, qi],
              lambda b, h, qi, ki: IDS[b, ki]][leaf]
    x, y = integer(d - 1), integer(d - 1)
    c = int(rs.choice([1, 2, 5, 16, 33]))
    return [lambda *i: x(*i) + y(*i), lambda *i: x(*i) - y(*i), lambda *i: x(*i) * y(*i),
            lambda *i: x(*i) // c, lambda *i: x(*i) % c, lambda *i: jnp.abs(x(*i)),
            lambda *i: jnp.maximum(x(*i), y(*i)), lambda *i: jnp.minimum(x(*i), y(*i)),
            lambda *i: -x(*i), lambda *i: jnp.clip(x(*i), -c, c * 7),
            lambda *i: x(*i) // jnp.maximum(y(*i), 1), lambda *i: x(*i) & y(*i),
            lambda *i: jnp.where(boolean(d - 1)(*i), x(*i), y(*i)),
            lambda *i: x(*i).astype(jnp.int8).astype(jnp.int32)][rs.randint(14)]

  def boolean(d):
    if d == 0 or rs.rand() < 0.2:
      return lambda b, h, qi, ki: FLAGS[b, ki]
    kind = rs.randint(9)
    if kind < 6:
      x, y = integer(d - 1), integer(d - 1)
      compare = [jnp.less, jnp.less_equal, jnp.greater, jnp.greater_equal, jnp.equal,
                 jnp.not_equal][kind]
      return lambda *i: compare(x(*i), y(*i))
    x, y = boolean(d - 1), boolean(d - 1)
    return [lambda *i: x(*i) & y(*i), lambda *i: x(*i) | y(*i), lambda *i: x(*i) ^ ~y(*i)][
        kind - 6]

  return boolean(depth)


@pytest.mark.parametrize("seed", range(16))
def test_tile_bounds_of_random_masks_are_exact(seed):
  _check_bounds(_random_mask(np.random.RandomState(seed)))
