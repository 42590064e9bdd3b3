"""Random compositions of variants at random odd shapes against the float32
reference: outputs and gradients, and fp8 forwards against the dequantized
reference.

The other suites test each variant, shape class and kernel path on chosen
cases; here each seed draws them together, as users combine them: lengths
on either side of the compiled kernels' block edges (64, 128, 192 rows),
Sq != Skv, GQA, Dqk != Dv, head dims of both backward lowerings, 16-bit
dtypes, and up to four of the built-in variants and arrays closed over
(a relative-position table, per-(batch, head) biases, a key padding mask),
with sinks or an elementwise rownorm (random_variants.py; the multi-device
checks draw rings' variants there too). Compiled (`gpu`) at lengths up to
600; in interpret mode four seeds at short lengths keep the drawing itself
tested on CPU.
"""
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_attn as pa
from conftest import assert_close, random
from random_variants import random_variant
from test_attention_backward import assert_gradient_close
from test_fp8_prefill import dequantized

COMPILED_SEEDS = range(32)
INTERPRETED_SEEDS = range(4)
EDGES = (64, 128, 192, 256, 384, 512)  # the compiled kernels' row and key block multiples
# The references run on the host: a gradient's program compiles there in
# 0.2-0.3 s, on an H200 in 0.6-1.5 s (11 s with XLA's dot autotuning).
HOST = jax.devices("cpu")[0]


def on_host(fn, *args):
  """`fn(*args)` compiled and run on the host."""
  with jax.default_device(HOST):
    return jax.jit(fn)(*(jax.device_put(x, HOST) for x in args))


@contextlib.contextmanager
def described(what: str):
  """Assertion errors prefixed with the drawn case."""
  try:
    yield
  except AssertionError as error:
    raise AssertionError(f"{what}: {error}") from None


def _length(rng, short: bool) -> int:
  if short:
    return int(rng.integers(1, 70))
  if rng.random() < 0.5:  # next to a block edge
    return int(max(1, rng.choice(EDGES) + rng.integers(-2, 3)))
  return int(rng.integers(1, 601))


def _random_qkv(seed: int, dtype, *shapes):
  return tuple(random(shape, dtype, 3 * seed + i) for i, shape in enumerate(shapes))


@functools.lru_cache(maxsize=None)
def draw(seed: int, short: bool, fp8: bool = False):
  """(description, q, k, v, attention keyword arguments) of seed `seed`."""
  rng = np.random.default_rng(1000 + seed)
  batch, kv_heads = int(rng.integers(1, 3)), int(rng.integers(1, 3))
  heads = kv_heads * int(rng.choice([1, 2, 4]))
  seq_q = _length(rng, short)
  seq_kv = seq_q if rng.random() < 0.4 else _length(rng, short)
  if short:
    d_qk, d_v = int(rng.choice([8, 16])), int(rng.choice([8, 24]))
  elif fp8:
    d_qk = d_v = 128  # the fp8 tensor-core path
  else:
    d_qk = int(rng.choice([64, 128, 128, 96, 256]))
    d_v = d_qk if rng.random() < 0.6 else int(rng.choice([64, 128]))
  dtype = jnp.bfloat16 if fp8 or rng.random() < 0.7 else jnp.float16
  name, kwargs = random_variant(rng, batch, heads, seq_q, seq_kv, most=4)
  shape = dict(batch=batch, seq_q=seq_q, seq_kv=seq_kv, heads=heads, kv_heads=kv_heads,
               d_qk=d_qk, d_v=d_v, dtype=jnp.dtype(dtype).name)
  q, k, v = _random_qkv(seed, dtype, (batch, seq_q, heads, d_qk),
                        (batch, seq_kv, kv_heads, d_qk), (batch, seq_kv, kv_heads, d_v))
  return f"{name} {shape}", q, k, v, kwargs


def _cases():
  return ([pytest.param(s, True, id=f"short{s}-interpret") for s in INTERPRETED_SEEDS]
          + [pytest.param(s, False, id=f"seed{s}-compiled", marks=pytest.mark.gpu)
             for s in COMPILED_SEEDS])


@pytest.mark.parametrize("seed,interpret", _cases())
def test_random_composition(seed, interpret):
  """Output and gradients of q, k, v against `jax.grad` of the reference."""
  what, q, k, v, kwargs = draw(seed, short=interpret)
  dtype = q.dtype.type
  cotangent = random((*q.shape[:3], v.shape[3]), seed=99)

  def ours(q, k, v):
    out = pa.attention(q, k, v, interpret=interpret, **kwargs)
    return jnp.sum(out.astype(jnp.float32) * cotangent), out

  def reference(q, k, v, cotangent):
    out = pa.attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), **kwargs)
    return jnp.sum(out * cotangent), out

  (_, out), grads = jax.value_and_grad(ours, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  (_, want), want_grads = on_host(
      jax.value_and_grad(reference, argnums=(0, 1, 2), has_aux=True), q, k, v, cotangent)
  with described(what):
    assert out.dtype == dtype
    assert_close(out, want, dtype)
    for got, wanted in zip(grads, want_grads):
      assert got.dtype == dtype
      assert_gradient_close(got, wanted, cotangent, dtype, factor=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(8))
def test_random_composition_fp8(seed):
  """e4m3 q, k, v (per-head descales) against the reference on their
  dequantized values, within the tensor-core path's bound of the fp8 suite."""
  what, q, k, v, kwargs = draw(seed, short=False, fp8=True)
  quantized = [pa.quantize_fp8(x) for x in (q, k, v)]
  (q8, qd), (k8, kd), (v8, vd) = quantized
  out = pa.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, **kwargs)
  real = [dequantized(x, d) for x, d in quantized]
  want = on_host(lambda q, k, v: pa.attention_reference(q, k, v, **kwargs), *real)
  with described(what):
    assert_close(out, want, jnp.bfloat16, factor=4)


@functools.lru_cache(maxsize=None)
def draw_decode(seed: int, short: bool, cache: str):
  """(description, q, k cache, v cache, kv_lengths, attention keyword
  arguments) of seed `seed`; `cache` "bf16", "fp8" or "paged". The variants
  see absolute positions, as decoding gives them."""
  rng = np.random.default_rng(2000 + seed)
  batch, kv_heads = int(rng.integers(1, 4)), int(rng.integers(1, 5))
  heads = kv_heads * int(rng.choice([1, 2, 4, 8]))
  seq_q = int(rng.choice([1, 1, 2, 4, 16]))
  max_length = int(rng.integers(seq_q, 70 if short else 3000))
  lengths = jnp.asarray(rng.integers(seq_q, max_length + 1, (batch,)), jnp.int32)
  d = 16 if short else int(rng.choice([64, 128, 128, 256]))
  d_v = d if cache == "fp8" or rng.random() < 0.7 else int(rng.choice([64, 128]))
  name, kwargs = random_variant(rng, batch, heads, max_length, max_length, most=3)
  shape = dict(batch=batch, seq_q=seq_q, max_length=max_length, lengths=lengths.tolist(),
               heads=heads, kv_heads=kv_heads, d=d, d_v=d_v, cache=cache)
  q, k, v = _random_qkv(seed, jnp.bfloat16, (batch, seq_q, heads, d),
                        (batch, max_length, kv_heads, d), (batch, max_length, kv_heads, d_v))
  return f"{name} {shape}", q, k, v, lengths, kwargs


def decode_reference(q, k, v, lengths, *, score_mod=None, mask_mod=None, **kwargs):
  """The float32 reference with query i of sequence b at position
  `lengths[b] - Sq + i` and the keys from `lengths[b]` on masked."""
  seq_q = q.shape[1]
  position = lambda b, q_idx: lengths[b] - seq_q + q_idx

  def mask(b, h, q_idx, kv_idx):
    keep = kv_idx < lengths[b]
    return keep if mask_mod is None else keep & mask_mod(b, h, position(b, q_idx), kv_idx)

  score = None if score_mod is None else (
      lambda s, b, h, q_idx, kv_idx: score_mod(s, b, h, position(b, q_idx), kv_idx))
  return pa.attention_reference(q, k, v, score_mod=score, mask_mod=mask, **kwargs)


def _paged(x, rng, page_size: int):
  """`x` `[B, S, H, D]` as shuffled pages and their table."""
  batch, length = x.shape[:2]
  per_row = -(-length // page_size)
  x = jnp.pad(x, ((0, 0), (0, per_row * page_size - length), (0, 0), (0, 0)))
  order = rng.permutation(batch * per_row)  # row-major page i goes to page order[i]
  pages = x.reshape(batch * per_row, page_size, *x.shape[2:])[np.argsort(order)]
  return pages, jnp.asarray(order.reshape(batch, per_row), jnp.int32)


def _decode_cases():
  return [pytest.param(s, cache, True, id=f"short{s}-{cache}-interpret")
          for s in range(2) for cache in ("bf16", "fp8", "paged")] + [
              pytest.param(s, cache, False, id=f"seed{s}-{cache}-compiled",
                           marks=pytest.mark.gpu)
              for s in range(12) for cache in ("bf16", "fp8", "paged")]


@pytest.mark.parametrize("seed,cache,interpret", _decode_cases())
def test_random_decode(seed, cache, interpret):
  """`decode_attention` (or `paged_attention`) on a random composition,
  ragged lengths and a bf16, fp8 or paged cache, against the reference on
  the cache's real values."""
  what, q, k, v, lengths, kwargs = draw_decode(seed, interpret, cache)
  descales = {}
  if cache == "fp8":
    (k, k_descale), (v, v_descale) = pa.quantize_fp8(k), pa.quantize_fp8(v)
    descales = dict(k_descale=k_descale, v_descale=v_descale)
    real = [dequantized(k, k_descale), dequantized(v, v_descale)]
  else:
    real = [k, v]
  if cache == "paged":
    (k_pages, table), (v_pages, _) = (_paged(x, np.random.default_rng(seed), 16) for x in (k, v))
    out = pa.paged_attention(q, k_pages, v_pages, table, lengths, interpret=interpret, **kwargs)
  else:
    out = pa.decode_attention(q, k, v, lengths, interpret=interpret, **descales, **kwargs)
  want = on_host(lambda q, k, v, lengths: decode_reference(
      *(x.astype(jnp.float32) for x in (q, k, v)), lengths, **kwargs), q, *real, lengths)
  with described(what):
    assert_close(out, want, jnp.bfloat16)
