"""The Mosaic GPU backward (dq, dk/dv) against jax.grad of the float32
reference (compiled on Hopper GPUs), and the choice of the backward's
lowering (everywhere)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_attn as pa
from pallas_attn import variants
from pallas_attn.kernels import lowering, mosaic_backend
from pallas_attn.spec.analysis import analyze_variant
from conftest import assert_close, qkv, random
from test_mosaic_forward import B, HKV, HQ, HOPPER, VARIANTS, _variant

TRITON_BACKWARD = ("tile_bias",)  # [q, kv] tiles of a captured array


def _gradients(fn, q, k, v, kw):
  do = random((*q.shape[:3], v.shape[3]), seed=4)

  def loss(q, k, v):
    return jnp.sum(fn(q, k, v, **kw).astype(jnp.float32) * do)

  return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def _check(q, k, v, kw, factor=2.0, **attention_kwargs):
  """Our gradients (Mosaic backward where chosen) against the float32 reference's."""
  ours = _gradients(lambda *a, **w: pa.attention(*a, **attention_kwargs, **w), q, k, v, kw)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  refs = _gradients(pa.attention_reference, *f32, kw)
  for name, g, r in zip("qkv", ours, refs):
    assert not np.isnan(np.asarray(g, np.float32)).any(), name
    assert_close(g, r, q.dtype.type, factor=factor)
  return ours


def _lowering(kw, d_qk=128, d_v=128):
  analysis = analyze_variant(kw.get("score_mod"), kw.get("mask_mod"),
                             kw.get("rownorm", "softmax"))
  return lowering.choose(None, analysis, jnp.bfloat16, d_qk, d_v, False)


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n in VARIANTS if n not in TRITON_BACKWARD])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_variants_ragged_gqa(name, dtype):
  seq = 333
  q, k, v = qkv(batch=B, seq_q=seq, seq_kv=seq, heads=HQ, kv_heads=HKV, d_qk=128, d_v=128,
                dtype=dtype)
  kw = _variant(name, seq, seq)
  chosen = _lowering(kw)
  assert chosen.backward == "mosaic_gpu", chosen.describe()
  _check(q, k, v, kw)


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("seq_q,seq_kv", [(200, 520), (520, 200)])
@pytest.mark.parametrize("name", ["rel_table", "t5"])
def test_diagonal_terms_uneven_lengths(name, seq_q, seq_kv):
  """Diagonal term windows for Sq != Skv: the forward's and dq's `[q, kv]`
  tiles, the dk/dv kernel's `[kv, q]` tiles of the term's vector."""
  q, k, v = qkv(batch=1, seq_q=seq_q, seq_kv=seq_kv, heads=HQ, kv_heads=HKV, d_qk=128,
                d_v=128, dtype=jnp.bfloat16, seed=seq_q)
  kw = _variant(name, seq_q, seq_kv)
  if name == "t5":  # causal aligned at the end, as FlexAttention's
    kw["mask_mod"] = lambda b, h, qi, ki: qi + (seq_kv - seq_q) >= ki
  chosen = _lowering(kw)
  assert (chosen.forward, chosen.backward) == ("mosaic_gpu", "mosaic_gpu"), chosen.describe()
  out = pa.attention(q, k, v, **kw)
  ref = pa.attention_reference(*[x.astype(jnp.float32) for x in (q, k, v)], **kw)
  assert_close(out, ref, jnp.bfloat16)
  _check(q, k, v, kw)


@pytest.mark.hopper
@pytest.mark.gpu
def test_diagonal_term_closed_over_under_jit_and_vmap():
  """A relative-position table closed over as users write it: eager twice
  (the same bits), jitted, vmapped, and its q/k/v gradients jitted."""
  seq = 300
  q, k, v = qkv(batch=B, seq_q=seq, seq_kv=seq, heads=HQ, kv_heads=HKV, d_qk=128, d_v=128,
                dtype=jnp.bfloat16, seed=12)
  kw = _variant("rel_table", seq, seq)
  call = lambda q, k, v: pa.attention(q, k, v, **kw)
  ref = pa.attention_reference(*[x.astype(jnp.float32) for x in (q, k, v)], **kw)
  eager, again = call(q, k, v), call(q, k, v)
  np.testing.assert_array_equal(np.asarray(eager, np.float32), np.asarray(again, np.float32))
  vmapped = jax.jit(jax.vmap(call))(q[None], k[None], v[None])[0]
  for out in (eager, jax.jit(call)(q, k, v), vmapped):
    assert_close(out, ref, jnp.bfloat16)
  grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(call(q, k, v).astype(jnp.float32)),
                           argnums=(0, 1, 2)))(q, k, v)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  refs = jax.grad(lambda q, k, v: jnp.sum(pa.attention_reference(q, k, v, **kw)),
                  argnums=(0, 1, 2))(*f32)
  for g, r in zip(grads, refs):
    assert_close(g, r, jnp.bfloat16, factor=2.0)


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("seq_q,seq_kv,d_qk,d_v,kv_heads", [
    (200, 520, 64, 64, 1), (520, 200, 128, 128, 4), (300, 300, 128, 64, 2),
    (1, 77, 128, 128, 1), (129, 129, 96, 32, 1), (64, 64, 64, 64, 2), (1000, 1000, 128, 128, 1),
    (300, 300, 256, 256, 2), (200, 333, 192, 128, 1)])
@pytest.mark.parametrize("masked", [False, True], ids=["dense", "causal"])
def test_shapes(seq_q, seq_kv, d_qk, d_v, kv_heads, masked):
  """Wide heads run the Mosaic forward with Triton's backward passes."""
  q, k, v = qkv(batch=1, seq_q=seq_q, seq_kv=seq_kv, heads=HQ, kv_heads=kv_heads, d_qk=d_qk,
                d_v=d_v, dtype=jnp.bfloat16, seed=seq_q)
  kw = variants.causal(seq_q=seq_q, seq_kv=seq_kv).kwargs() if masked else {}
  _check(q, k, v, kw)


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("seq_q,seq_kv,kv_heads", [(2100, 1900, HKV), (2304, 2304, 1)])
@pytest.mark.parametrize("score", ["plain", "softcap"])
def test_wide_dq_programs(seq_q, seq_kv, kv_heads, score):
  """Three-consumer dq programs (unmasked softmax of the score, or of a
  function of it alone: a softcap whose cap is a captured array, from 2k
  queries): 2100 queries pad to 2176, so the last program's third consumer
  lies past q's end and only turns the ring; 2304 fill twelve programs."""
  q, k, v = qkv(batch=2, seq_q=seq_q, seq_kv=seq_kv, heads=HQ, kv_heads=kv_heads, d_qk=128,
                d_v=128, dtype=jnp.bfloat16, seed=seq_q)
  cap = jnp.float32(20.0)
  kw = {} if score == "plain" else {"score_mod": lambda s, b, h, qi, ki: cap * jnp.tanh(s / cap)}
  _check(q, k, v, kw)


@pytest.mark.hopper
@pytest.mark.gpu
def test_wide_dq_programs_under_jit_and_vmap():
  """The wide dq programs as users reach them: gradients of a vmapped call
  under jit (the mapped axis folded into the batch), against the reference."""
  q, k, v = qkv(batch=2, seq_q=2100, seq_kv=2100, heads=HQ, kv_heads=HKV, d_qk=128, d_v=128,
                dtype=jnp.bfloat16, seed=11)
  do = random((1, *q.shape[:3], v.shape[3]), seed=4)

  def loss(fn, q, k, v):
    return jnp.sum(jax.vmap(fn)(q, k, v).astype(jnp.float32) * do)

  ours = jax.jit(jax.grad(lambda *x: loss(pa.attention, *x), argnums=(0, 1, 2)))(
      q[None], k[None], v[None])
  f32 = [x[None].astype(jnp.float32) for x in (q, k, v)]
  refs = jax.grad(lambda *x: loss(pa.attention_reference, *x), argnums=(0, 1, 2))(*f32)
  for name, g, r in zip("qkv", ours, refs):
    assert not np.isnan(np.asarray(g, np.float32)).any(), name
    assert_close(g, r, jnp.bfloat16, factor=2.0)


@pytest.mark.hopper
@pytest.mark.gpu
def test_dkv_programs_without_visits():
  """Keys no query sees: their dk/dv programs walk no step, and the first
  consumer still lets the second start (the staggered starts), so the
  kernel ends with zero gradients there."""
  q, k, v = qkv(batch=B, seq_q=333, seq_kv=333, heads=HQ, kv_heads=HKV, d_qk=128, d_v=128,
                dtype=jnp.bfloat16, seed=13)
  kw = {"mask_mod": lambda b, h, qi, ki: ki < 100}
  assert _lowering(kw).backward == "mosaic_gpu"
  grads = _check(q, k, v, kw)
  for g in grads[1:]:
    assert not np.asarray(g[:, 128:], np.float32).any()


@pytest.mark.hopper
@pytest.mark.gpu
def test_agrees_with_triton_and_is_deterministic():
  q, k, v = qkv(batch=2, seq_q=1024, seq_kv=1024, heads=HQ, kv_heads=HKV, d_qk=128, d_v=128,
                dtype=jnp.bfloat16, seed=3)
  kw = variants.causal().kwargs()
  mosaic = _gradients(pa.attention, q, k, v, kw)
  again = _gradients(pa.attention, q, k, v, kw)
  triton = _gradients(lambda *a, **w: pa.attention(*a, implementation="triton", **w), q, k, v,
                      kw)
  for m, a, t in zip(mosaic, again, triton):
    np.testing.assert_array_equal(np.asarray(m, np.float32), np.asarray(a, np.float32))
    assert_close(m, t.astype(jnp.float32), jnp.bfloat16, factor=2.0)


@pytest.mark.hopper
@pytest.mark.gpu
def test_differentiated_captures_take_the_triton_passes():
  seq = 200
  q, k, v = qkv(batch=B, seq_q=seq, seq_kv=seq, heads=HQ, kv_heads=HKV, d_qk=128, d_v=128,
                dtype=jnp.bfloat16, seed=2)
  slopes = jnp.linspace(0.05, 0.5, HQ)

  def loss(fn, slopes, q, k, v):
    out = fn(q, k, v, score_mod=lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi))
    return jnp.sum(out.astype(jnp.float32))

  got = jax.grad(lambda s: loss(pa.attention, s, q, k, v))(slopes)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  want = jax.grad(lambda s: loss(pa.attention_reference, s, *f32))(slopes)
  assert_close(got, want, jnp.bfloat16, factor=2.0)


@pytest.mark.parametrize("sub_steps,skip,step,want", [
    (2, 0, 1, [(1, 5, 0, 0), (2, 5, 1, 0), (3, 7, 0, 0), (4, 7, 1, 0), (5, 9, 0, 1),
               (6, 9, 1, 1)]),
    (1, 1, 0, [(1, 7, 0, 0), (2, 9, 0, 1)]),
])
def test_fold_visits_numbers_sub_steps_as_ring_steps(sub_steps, skip, step, want):
  """Producer and consumers fold the same visits: unmasked blocks (from the
  `skip`-th), then masked ones, one step per sub-step, counted from `step`."""
  full = jnp.array([5, 7], jnp.int32)
  visits = ((jnp.int32(2), lambda j: full[j]), (jnp.int32(1), lambda j: 9 + j))

  def record(step, block, sub, masked, log):
    return log.at[step].set(jnp.stack([step, block, jnp.asarray(sub, jnp.int32),
                                       jnp.int32(masked)]))

  log, end = mosaic_backend.fold_visits(visits, record, jnp.full((8, 4), -1, jnp.int32),
                                        step=step, skip=skip, sub_steps=sub_steps)
  got = [tuple(int(x) for x in row) for row in np.asarray(log) if row[0] >= 0]
  assert got == want and int(end) == want[-1][0] + 1


@pytest.mark.parametrize("kwargs,reason", [
    (dict(d_qk=192), "over 128"),
    (dict(score_mod=lambda s, b, h, qi, ki: s * jnp.sqrt(jnp.abs(s) + 1.0)), "sqrt"),
])
def test_backward_obstacles_are_named(kwargs, reason, monkeypatch):
  monkeypatch.setattr(mosaic_backend, "unavailable", lambda: None)
  d_qk = kwargs.pop("d_qk", 128)
  analysis = analyze_variant(**kwargs)
  why = lowering.mosaic_backward_obstacle(analysis, jnp.bfloat16, d_qk, 128, interpret=False)
  assert why is not None and reason in why


def test_diagonal_terms_take_the_mosaic_backward(monkeypatch):
  """A hoisted q_idx - kv_idx term is no obstacle: both kernels read its vector."""
  monkeypatch.setattr(mosaic_backend, "unavailable", lambda: None)
  analysis = analyze_variant(
      score_mod=lambda s, b, h, qi, ki: s - jnp.log1p(jnp.abs(qi - ki).astype(jnp.float32)))
  assert analysis.score_mod.terms
  assert lowering.mosaic_backward_obstacle(analysis, jnp.bfloat16, 128, 128, False) is None


def test_tile_captures_keep_the_backward_on_triton(monkeypatch):
  monkeypatch.setattr(mosaic_backend, "unavailable", lambda: None)
  bias = jnp.zeros((B, HQ, 64, 64))
  analysis = analyze_variant(score_mod=lambda s, b, h, qi, ki: s + bias[b, h, qi, ki])
  chosen = lowering.choose(None, analysis, jnp.bfloat16, 128, 128, False)
  assert (chosen.forward, chosen.backward) == ("mosaic_gpu", "triton")
  assert "[q, kv] tile" in chosen.describe()
  plain = lowering.choose(None, analyze_variant(), jnp.bfloat16, 128, 128, False)
  assert (plain.forward, plain.backward) == ("mosaic_gpu", "mosaic_gpu")
  assert "differentiated" in plain.describe()


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("seq", [300, 2100])  # 2100: the wide dq programs
def test_lse_cotangent(seq):
  """A loss on the returned lse reaches the delta the dq kernel computes."""
  q, k, v = qkv(batch=B, seq_q=seq, seq_kv=seq, heads=HQ, kv_heads=HKV, d_qk=128, d_v=128,
                dtype=jnp.bfloat16, seed=5)
  weights = random((B, HQ, seq), seed=6)

  def loss(fn, q, k, v):
    out, lse = fn(q, k, v, return_lse=True)
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse * weights)

  ours = jax.grad(lambda *x: loss(pa.attention, *x), argnums=(0, 1, 2))(q, k, v)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  refs = jax.grad(lambda *x: loss(pa.attention_reference, *x), argnums=(0, 1, 2))(*f32)
  for g, r in zip(ours, refs):
    assert_close(g, r, jnp.bfloat16, factor=2.0)


@pytest.mark.parametrize("name,seq_q,seq_kv,d", [
    ("causal", 200, 264, 64), ("alibi", 200, 264, 64),
    pytest.param("vanilla", 2100, 1900, 128, marks=pytest.mark.hopper)])  # wide dq programs
def test_gradients_from_given_row_terms(name, seq_q, seq_kv, d):
  """The backward kernels on a given lse and delta = rowsum(dO * O) - d_lse
  (ring attention's steps, `api._recorded_gradients`: no output read) give
  attention's gradients, the lse's cotangent included. Compiled on Hopper
  (the Mosaic dq kernel loading the terms), else Triton's interpret mode."""
  from pallas_attn import api
  from pallas_attn.vjp.attention_vjp import row_delta
  dtype = jnp.bfloat16 if HOPPER else jnp.float32
  q, k, v = qkv(batch=B, seq_q=seq_q, seq_kv=seq_kv, heads=HQ, kv_heads=HKV, d_qk=d, d_v=d,
                dtype=dtype, seed=7)
  kw = _variant(name, seq_q, seq_kv)
  d_out = random((B, seq_q, HQ, d), seed=8).astype(dtype)
  d_lse = random((B, HQ, seq_q), seed=9)
  (out, lse), pullback = jax.vjp(lambda *x: pa.attention(*x, return_lse=True, **kw), q, k, v)
  want = pullback((d_out, d_lse))
  call, consts, block_masks, _, _ = api._prepare(q, k, v, **kw)
  delta = row_delta(out, d_out, d_lse)
  got = api._recorded_gradients(q, k, v, consts, block_masks, None, lse, delta, d_out, call=call)
  for g, w in zip(got, want):
    assert not np.isnan(np.asarray(g, np.float32)).any()
    assert_close(g, w, dtype, factor=2.0)
