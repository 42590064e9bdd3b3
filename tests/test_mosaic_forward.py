"""The Mosaic GPU forward template against the float32 reference (compiled on
Hopper GPUs), and the choice of lowering (everywhere)."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

import pallas_attn as pa
from pallas_attn import variants
from pallas_attn.kernels import lowering, mosaic_backend, mosaic_forward
from pallas_attn.schedule import device
from pallas_attn.spec.analysis import analyze_variant
from conftest import ON_GPU, assert_close, qkv, random
from test_computed_index import t5_bucket

HOPPER = ON_GPU and mosaic_backend.unavailable() is None

B, HQ, HKV = 2, 4, 2


def _variant(name, seq_q, seq_kv):
  """(attention kwargs, reference kwargs) of a named test variant."""
  if name == "vanilla":
    kw = {}
  elif name == "causal":
    kw = variants.causal().kwargs()
  elif name == "softcap":
    kw = variants.softcap(30.0).kwargs()
  elif name == "alibi":
    kw = variants.alibi(num_heads=HQ).kwargs()
  elif name == "alibi_sigmoid":  # a separable bias under an elementwise rownorm
    kw = (variants.sigmoid(seq_kv=seq_kv) + variants.alibi(num_heads=HQ)).kwargs()
  elif name == "window":
    kw = variants.sliding_window(96).kwargs()
  elif name == "documents":
    ids = jnp.sort(jax.random.randint(jax.random.PRNGKey(3), (B, seq_kv), 0, 5), axis=1)
    kw = variants.document(ids, causal=True).kwargs() if seq_q == seq_kv else {}
  elif name == "sigmoid":
    kw = variants.sigmoid(seq_kv=seq_kv).kwargs()
  elif name == "sinks":
    kw = variants.sink(random((HQ,), seed=9)).kwargs()
  elif name == "batch_head_softcap":  # a [B, H] capture: read once per program
    cap = 20.0 + 10.0 * jnp.abs(random((B, HQ), seed=11))
    kw = dict(score_mod=lambda s, b, h, qi, ki: cap[b, h] * jnp.tanh(s / cap[b, h]))
  elif name == "key_bias":  # a [B, Skv] captured array
    bias = random((B, seq_kv), seed=5)
    kw = dict(score_mod=lambda s, b, h, qi, ki: s + bias[b, ki])
  elif name == "row_bias":  # a [B, H, Sq] captured array
    bias = random((B, HQ, seq_q), seed=6)
    kw = dict(score_mod=lambda s, b, h, qi, ki: s + bias[b, h, qi])
  elif name == "rel_table":  # a hoisted diagonal term (the kernels read its vector)
    table = random((HQ, seq_q + seq_kv - 1), seed=8)
    kw = dict(score_mod=lambda s, b, h, qi, ki: s + table[h, qi - ki + seq_kv - 1])
  elif name == "t5":  # T5's log buckets of q - kv, causal: a hoisted term too
    table = random((HQ, 8), seed=10)
    kw = dict(score_mod=lambda s, b, h, qi, ki: s + table[h, t5_bucket(qi - ki)],
              mask_mod=lambda b, h, qi, ki: qi >= ki)
  elif name == "tile_bias":  # a full [B, H, Sq, Skv] captured array
    bias = random((B, HQ, seq_q, seq_kv), seed=7)
    kw = dict(score_mod=lambda s, b, h, qi, ki: s + bias[b, h, qi, ki])
  else:
    raise KeyError(name)
  return kw


VARIANTS = ["vanilla", "causal", "softcap", "alibi", "alibi_sigmoid", "window", "documents", "sigmoid", "sinks",
            "batch_head_softcap", "key_bias", "row_bias", "rel_table", "t5", "tile_bias"]


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_variants_ragged_gqa(name, dtype):
  seq = 333
  q, k, v = qkv(batch=B, seq_q=seq, seq_kv=seq, heads=HQ, kv_heads=HKV, d_qk=128, d_v=128,
                dtype=dtype)
  kw = _variant(name, seq, seq)
  out = pa.attention(q, k, v, implementation="mosaic_gpu", **kw)
  ref = pa.attention_reference(q.astype(jnp.float32), k.astype(jnp.float32),
                               v.astype(jnp.float32), **kw)
  assert_close(out, ref, dtype)


def test_heuristic_tiles():
  """256 keys per step for unmasked heads of at most 64 (the H200 sweep's pick), 128 for
  masked ones and wider heads, 64 beyond 128."""
  choose = lowering.heuristic_mosaic_config
  assert choose(4096, 4096, 64, 64).block_k == 256
  assert choose(4096, 4096, 64, 64, block_sparse=True).block_k == 128
  assert choose(4096, 200, 64, 64).block_k == 128
  assert choose(4096, 4096, 128, 128).block_k == 128
  assert choose(4096, 4096, 256, 256).block_k == 64


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("seq_q,seq_kv,d_qk,d_v", [
    (200, 520, 64, 64), (520, 200, 128, 128), (64, 1000, 256, 256), (300, 300, 192, 128),
    (1, 77, 128, 128), (129, 129, 96, 32), (77, 700, 32, 64)])
@pytest.mark.parametrize("masked", [False, True], ids=["dense", "causal"])
def test_shapes(seq_q, seq_kv, d_qk, d_v, masked):
  q, k, v = qkv(batch=1, seq_q=seq_q, seq_kv=seq_kv, heads=HQ, kv_heads=1, d_qk=d_qk, d_v=d_v,
                dtype=jnp.bfloat16, seed=seq_q)
  kw = variants.causal(seq_q=seq_q, seq_kv=seq_kv).kwargs() if masked else {}
  out, lse = pa.attention(q, k, v, implementation="mosaic_gpu", return_lse=True, **kw)
  ref, ref_lse = pa.attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)),
                                        return_lse=True, **kw)
  assert_close(out, ref, jnp.bfloat16)
  finite = jnp.isfinite(ref_lse)
  assert bool(jnp.all(jnp.isfinite(lse) == finite))
  assert_close(jnp.where(finite, lse, 0.0), jnp.where(finite, ref_lse, 0.0), jnp.bfloat16)


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["vanilla", "causal", "window", "documents", "alibi", "sinks",
                                  "key_bias", "fp8_window"])
def test_persistent_grid(name, monkeypatch):
  """One program per SM looping over the (b, h, q block) items, forced on 5 SMs so that
  programs take 6 or 7 of the 32 items (a count they do not divide; the K/V ring's steps
  carry from item to item): the same bits as a program per item, output and lse."""
  seq = 500  # 4 ragged q blocks of 128, B 2, 4 heads over 2 kv heads
  q, k, v = qkv(batch=B, seq_q=seq, seq_kv=seq, heads=HQ, kv_heads=HKV, d_qk=128, d_v=128,
                dtype=jnp.bfloat16, seed=4)
  kw = _variant(name.removeprefix("fp8_"), seq, seq)
  extra = {}
  if name.startswith("fp8_"):
    (q, qd), (k, kd), (v, vd) = (pa.quantize_fp8(x) for x in (q, k, v))
    extra = dict(q_descale=qd, k_descale=kd, v_descale=vd)
  run = lambda: pa.attention(q, k, v, implementation="mosaic_gpu", return_lse=True, **kw,
                             **extra)
  per_item = run()
  sm_count = dataclasses.replace(device.device_config(), sm_count=5)
  monkeypatch.setattr(mosaic_forward.device_lib, "device_config", lambda: sm_count)
  traced = []
  monkeypatch.setattr(mosaic_forward, "persistent_grid", lambda *args: traced.append(args) or True)
  jax.clear_caches()
  persistent = run()
  assert traced, "the forward was not traced again"
  for got, want in zip(persistent, per_item):
    assert bool(jnp.array_equal(got, want, equal_nan=True)), name
  if not extra:
    ref = pa.attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), **kw)
    assert_close(persistent[0], ref, jnp.bfloat16)


def test_persistent_grid_only_for_short_items():
  """The per-SM loop where every q block keeps a few kv tiles (windows, short sequences),
  not for long or unequal ones (vanilla and causal at 4k, causal at 1k)."""
  def chosen(variant, seq):
    analysis = analyze_variant(**variant.kwargs())
    return mosaic_forward.persistent_grid(analysis, 128, 128, seq, seq, 4 * 16 * seq // 128, 132)
  assert chosen(variants.sliding_window(256), 4096)
  assert chosen(variants.sliding_window(256, causal=False), 16384)
  assert chosen(variants.Variant("vanilla"), 1024)
  assert not chosen(variants.Variant("vanilla"), 4096)
  assert not chosen(variants.causal(), 4096)
  assert not chosen(variants.causal(), 1024)
  assert not chosen(variants.sliding_window(2048), 4096)
  config = lowering.heuristic_mosaic_config(4096, 4096, 128, 128, block_sparse=True)
  window = analyze_variant(**variants.sliding_window(256).kwargs())
  assert mosaic_forward.describe_grid(window, config, 4, 16, 4096, 4096, 132).startswith(
      "grid: one program per SM (132) looping over 2048")
  assert mosaic_forward.describe_grid(window, config, 4, 16, 4096, 4096, None) == (
      "grid: one program per (b, h, q block) item (2048)")


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("score_mod,affine", [
    (variants.alibi(num_heads=HQ, seq_q=700, seq_kv=1500).score_mod, True),
    (lambda s, b, h, q, kv: s + 0.02 * (kv - 2 * q).astype(jnp.float32) + 100.0, True),
    (lambda s, b, h, q, kv: s - (kv + 3).astype(jnp.float32) * (1 / 64.0), False),
    (lambda s, b, h, q, kv: s - (kv + 3).astype(jnp.float32) / 64.0, False),
], ids=["alibi_bottom_right", "large_constant", "key_only", "key_only_divided"])
@pytest.mark.parametrize("masked", [False, True], ids=["dense", "causal"])
def test_affine_bias_columns(score_mod, affine, masked):
  """Separable biases affine in kv (the forward builds their columns from one
  vector per program and a number per tile) on a ragged Sq != Skv: output
  and lse against the reference, whose logits reach a few hundred. A bias of
  the keys alone goes the per-score way (built from vectors, Mosaic GPU found
  no layouts for it without a mask)."""
  q, k, v = qkv(batch=B, seq_q=700, seq_kv=1500, heads=HQ, kv_heads=HKV, d_qk=128, d_v=128,
                dtype=jnp.bfloat16, seed=3)
  assert analyze_variant(score_mod=score_mod).affine_columns == affine
  kw = dict(score_mod=score_mod)
  if masked:
    kw.update(variants.causal(seq_q=700, seq_kv=1500).kwargs())
  out, lse = pa.attention(q, k, v, implementation="mosaic_gpu", return_lse=True, **kw)
  ref, ref_lse = pa.attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)),
                                        return_lse=True, **kw)
  assert_close(out, ref, jnp.bfloat16)
  assert_close(lse, ref_lse, jnp.bfloat16)


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["vanilla", "causal", "alibi", "sinks", "key_bias"])
def test_gradients_through_mosaic_forward(name):
  seq = 200
  q, k, v = qkv(batch=B, seq_q=seq, seq_kv=seq, heads=HQ, kv_heads=HKV, d_qk=64, d_v=64,
                dtype=jnp.bfloat16, seed=1)
  kw = _variant(name, seq, seq)
  do = random((B, seq, HQ, 64), jnp.bfloat16, seed=4)

  def loss(fn, q, k, v):
    return jnp.sum(fn(q, k, v, **kw).astype(jnp.float32) * do.astype(jnp.float32))

  ours = jax.grad(lambda *x: loss(lambda *a, **w: pa.attention(
      *a, implementation="mosaic_gpu", **w), *x), argnums=(0, 1, 2))(q, k, v)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  refs = jax.grad(lambda *x: loss(pa.attention_reference, *x), argnums=(0, 1, 2))(*f32)
  for g, r in zip(ours, refs):
    assert_close(g, r, jnp.bfloat16, factor=2.0)


@pytest.mark.hopper
@pytest.mark.gpu
def test_default_is_mosaic_on_hopper_and_agrees_with_triton():
  q, k, v = qkv(batch=1, seq_q=512, seq_kv=512, heads=HQ, kv_heads=HKV, d_qk=128, d_v=128,
                dtype=jnp.bfloat16)
  kw = variants.causal().kwargs()
  analysis = analyze_variant(**kw)
  assert lowering.choose(None, analysis, q.dtype, 128, 128, False).forward == "mosaic_gpu"
  mosaic = pa.attention(q, k, v, **kw)
  triton = pa.attention(q, k, v, implementation="triton", **kw)
  assert_close(mosaic, triton.astype(jnp.float32), jnp.bfloat16)


def test_choice_without_a_hopper_gpu_falls_back_and_says_why():
  analysis = analyze_variant(**variants.causal().kwargs())
  chosen = lowering.choose(None, analysis, jnp.bfloat16, 128, 128, interpret=not ON_GPU)
  if not HOPPER:
    assert chosen.forward == "triton"
    assert "mosaic_gpu not used" in chosen.describe()
    with pytest.raises(ValueError, match="implementation='mosaic_gpu' cannot run"):
      lowering.choose("mosaic_gpu", analysis, jnp.bfloat16, 128, 128, interpret=not ON_GPU)


@pytest.mark.parametrize("kwargs,reason", [
    (dict(dtype=jnp.float32), "float32 inputs"),
    (dict(d_qk=512), "over 256"),
    (dict(rownorm=lambda r: r / jnp.sum(jnp.abs(r), axis=-1, keepdims=True)), "normalized"),
    (dict(score_mod=lambda s, b, h, qi, ki: s + jnp.floor(qi / 7.0)), "floor"),
])
def test_mosaic_obstacles_are_named(kwargs, reason, monkeypatch):
  monkeypatch.setattr(mosaic_backend, "unavailable", lambda: None)
  dtype = kwargs.pop("dtype", jnp.bfloat16)
  d_qk = kwargs.pop("d_qk", 128)
  analysis = analyze_variant(**kwargs)
  why = lowering.mosaic_obstacle(analysis, dtype, d_qk, 128, interpret=False)
  assert why is not None and reason in why


def test_gather_and_triton_config_keep_triton(monkeypatch):
  monkeypatch.setattr(mosaic_backend, "unavailable", lambda: None)
  table = jnp.zeros((HQ, 63))
  analysis = analyze_variant(score_mod=lambda s, b, h, qi, ki: s + table[h, (qi * ki) % 63])
  assert "gathers" in lowering.mosaic_obstacle(analysis, jnp.bfloat16, 64, 64, False)
  # A read at q - kv is a hoisted term, not a gather: Mosaic GPU runs it.
  analysis = analyze_variant(score_mod=lambda s, b, h, qi, ki: s + table[h, qi - ki + 31])
  assert lowering.mosaic_obstacle(analysis, jnp.bfloat16, 64, 64, False) is None
  plain = analyze_variant()
  small = pa.AttentionConfig(block_q=16, block_k=16)
  chosen = lowering.choose(None, plain, jnp.bfloat16, 64, 64, False, small)
  assert chosen.forward == "triton" and "block_q 64, 128 or 192" in chosen.reason
  assert lowering.choose(None, plain, jnp.bfloat16, 64, 64, False).forward == "mosaic_gpu"


def test_unknown_implementation_is_an_error():
  q, k, v = qkv()
  with pytest.raises(ValueError, match="implementation must be"):
    pa.attention(q, k, v, implementation="cuda")


def test_lazy_running_max_gives_the_exact_softmax():
  """online.OnlineRowNorm.max_growth (the fp8 forward's lazy max): a row's
  max moves only when a tile raises it by more than the bound (8), its
  factor is then exactly 1 and its weights stay below 2**8; the finalized
  output and lse equal the exact max's. Rows in tile 2: scores up by 40, by
  12, by 5 (the max stays); a row empty until tile 3; one masked throughout."""
  from pallas_attn.kernels.online import OnlineRowNorm
  rownorm = analyze_variant().rownorm
  rng = jax.random.split(jax.random.key(3), 8)
  tiles = [jax.random.normal(rng[j], (5, 16)) for j in range(4)]
  tiles[2] = tiles[2] + jnp.array([40.0, 12.0, 5.0, 0.0, 0.0])[:, None]
  values = [jax.random.normal(rng[4 + j], (16, 8)) for j in range(4)]
  keeps = [jnp.ones((5, 16), bool).at[3].set(j == 3).at[4].set(False) for j in range(4)]
  results = {}
  for growth in (None, 8.0):
    online = OnlineRowNorm(rownorm, True, False, max_growth=growth)
    state = online.init(5, 8)
    for j, (s, v, keep) in enumerate(zip(tiles, values, keeps)):
      w, factor, (_, m, l) = online.weigh(state, s, keep, log2_logits=s)
      if growth is not None:
        assert float(jnp.max(w)) <= 2.0 ** growth
        held = (m == state[1])[:, 0]
        assert bool(jnp.all(jnp.where(held, factor[:, 0] == 1.0, True)))
        if j == 2:
          assert held.tolist() == [False, False, True, True, True]
      state = (online.rescale(state[0], factor) + w @ v, m, l)
    results[growth] = online.finalize(state)
  (out, lse), (lazy_out, lazy_lse) = results[None], results[8.0]
  assert bool(jnp.all(jnp.isfinite(lazy_out)))
  assert_close(lazy_out, out)
  assert bool(jnp.all(jnp.isinf(lazy_lse) == jnp.isinf(lse)))
  finite = lambda x: jnp.where(jnp.isinf(lse), 0.0, x)
  assert_close(finite(lazy_lse), finite(lse))
