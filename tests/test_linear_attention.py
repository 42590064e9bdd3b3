"""linear_attention and linear_attention_step against a lax.scan reference.

Kernels run in Pallas interpret mode on the CPU; the `interpret=False`
cases (marked `gpu`) run the compiled Triton kernels and skip without a GPU.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random
from pallas_attn.kernels.linear import reference
from pallas_attn.kernels.linear.chunked_forward import (
    chunk_cumulative_log_decay, state_tile)
from pallas_attn.kernels.linear.reference import (
    chunked_linear_attention_jnp, linear_attention_reference)
from pallas_attn.linear import linear_attention, linear_attention_step
from pallas_attn.schedule.config import LinearAttentionConfig

B, S, H, DK, DV = 2, 40, 2, 16, 24  # S is not a multiple of the chunk
CHUNK = 16
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
# d(log_decay) sums q.dq - k.dk over the sequence: float32 rounding of those
# (larger, cancelling) terms leaves ~1e-5 relative error in the sum.
DECAY_GRAD_TOL = {jnp.float32: 1e-4, jnp.bfloat16: 3e-2}

INTERPRET = [True, pytest.param(False, marks=pytest.mark.gpu)]
KINDS = ["none", "per_head", "scalar", "vector"]


def _normal(seed, shape, dtype=jnp.float32):
  return random(shape, dtype, seed)


def _log_decay(kind, seed, d_feature=DK, seq_len=S, strength=1.0):
  """Random log decays in [-strength, -0.01 * strength] (never zero)."""
  shape = {"none": None, "per_head": (H,), "scalar": (B, seq_len, H),
           "vector": (B, seq_len, H, d_feature)}[kind]
  if shape is None:
    return None
  u = random(shape, seed=seed, distribution="uniform")
  return -strength * (0.01 + 0.99 * u)


def _inputs(dtype=jnp.float32, seq_len=S, d_v=DV, seed=0):
  q = _normal(seed, (B, seq_len, H, DK), dtype)
  k = _normal(seed + 1, (B, seq_len, H, DK), dtype)
  v = _normal(seed + 2, (B, seq_len, H, d_v), dtype)
  return q, k, v


def assert_close(actual, expected, tol, name=""):
  actual = np.asarray(jnp.asarray(actual, jnp.float32))
  expected = np.asarray(jnp.asarray(expected, jnp.float32))
  assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
  assert np.all(np.isfinite(actual)), f"{name}: non-finite values"
  err = np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-6)
  assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g}"


def elu_plus_one(x):
  return jax.nn.elu(x) + 1.0


def random_features(x):
  """A width-changing map (Dk -> 2 Dk): cos/sin of a fixed projection."""
  w = jax.random.normal(jax.random.PRNGKey(42), (x.shape[-1], x.shape[-1]))
  proj = x @ w.astype(x.dtype) / math.sqrt(x.shape[-1])
  return jnp.concatenate([jnp.cos(proj), jnp.sin(proj)], -1)


def _check_forward(kind, dtype, interpret):
  """Output and final state (values, dtypes, shapes) against the reference."""
  q, k, v = _inputs(dtype)
  log_decay = _log_decay(kind, 3)
  state = _normal(4, (B, H, DK, DV))
  o, final = linear_attention(q, k, v, log_decay=log_decay,
                              initial_state=state, return_final_state=True,
                              chunk_size=CHUNK, interpret=interpret)
  o_ref, final_ref = linear_attention_reference(
      q, k, v, log_decay=log_decay, initial_state=state)
  assert o.dtype == dtype and o.shape == (B, S, H, DV)
  assert final.dtype == jnp.float32 and final.shape == (B, H, DK, DV)
  assert_close(o, o_ref, TOL[dtype], "o")
  assert_close(final, final_ref, TOL[dtype], "final state")


def _has_gradient_test(kind, dtype, interpret):
  """test_gradients_match_reference runs this case (and checks its forward too)."""
  return not (dtype == jnp.bfloat16 and kind in ("none", "per_head") and interpret)


# Compiled, every case; in interpret mode the cases without a gradient test only: the
# gradient test checks the others' forward with the same call (its kernels compiled anyway).
FORWARD_CASES = [
    pytest.param(kind, dtype, interpret, id=f"{kind}-{jnp.dtype(dtype).name}-{interpret}",
                 marks=() if interpret else pytest.mark.gpu)
    for kind in KINDS for dtype in (jnp.float32, jnp.bfloat16) for interpret in (True, False)
    if not (interpret and _has_gradient_test(kind, dtype, interpret))]


@pytest.mark.parametrize("kind,dtype,interpret", FORWARD_CASES)
def test_forward_matches_reference(kind, dtype, interpret):
  """Output and final state against the reference."""
  _check_forward(kind, dtype, interpret)


def _loss_weights(o_shape, state_shape):
  return _normal(20, o_shape), _normal(21, state_shape)


def _grads(fn, args, argnums, o_shape, state_shape):
  w_o, w_state = _loss_weights(o_shape, state_shape)

  def loss(*a):
    o, final = fn(*a)
    return (jnp.sum(o.astype(jnp.float32) * w_o)
            + jnp.sum(final.astype(jnp.float32) * w_state))

  return jax.grad(loss, argnums=argnums)(*args)


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_gradients_match_reference(kind, dtype, interpret):
  """Output, final state and gradients (q, k, v, initial state, log decay)
  against the reference."""
  if not _has_gradient_test(kind, dtype, interpret):
    pytest.skip("bf16 gradients run for the scalar and vector kernels only")
  _check_forward(kind, dtype, interpret)
  q, k, v = _inputs(dtype)
  log_decay = _log_decay(kind, 3)
  state = _normal(4, (B, H, DK, DV))
  kernel = functools.partial(linear_attention, return_final_state=True,
                             chunk_size=CHUNK, interpret=interpret)
  call = lambda q, k, v, g, s: kernel(q, k, v, log_decay=g, initial_state=s)
  ref = lambda q, k, v, g, s: linear_attention_reference(
      q, k, v, log_decay=g, initial_state=s)
  argnums = (0, 1, 2, 4) if log_decay is None else (0, 1, 2, 4, 3)
  args = (q, k, v, log_decay, state)
  grads = _grads(call, args, argnums, v.shape, state.shape)
  grads_ref = _grads(ref, args, argnums, v.shape, state.shape)
  names = ["dq", "dk", "dv", "d_initial_state", "d_log_decay"]
  for name, g, g_ref in zip(names, grads, grads_ref):
    tol = (DECAY_GRAD_TOL if name == "d_log_decay" else TOL)[dtype]
    assert g.dtype == g_ref.dtype or name in ("dq", "dk", "dv")
    assert_close(g, g_ref, tol * (2 if dtype == jnp.bfloat16 else 1), name)


@pytest.mark.parametrize("interpret", INTERPRET)
def test_normalize_and_feature_maps_with_gradients(interpret):
  """Linear transformer (elu+1, normalised) with a scalar decay."""
  q, k, v = _inputs()
  log_decay = _log_decay("scalar", 5)
  state = jnp.abs(_normal(6, (B, H, DK, DV + 1)))  # z column > 0
  kwargs = dict(q_mod=elu_plus_one, k_mod=elu_plus_one, normalize=True)
  call = lambda q, k, v, g, s: linear_attention(
      q, k, v, log_decay=g, initial_state=s, return_final_state=True,
      chunk_size=CHUNK, interpret=interpret, **kwargs)
  ref = lambda q, k, v, g, s: linear_attention_reference(
      q, k, v, log_decay=g, initial_state=s, **kwargs)
  args = (q, k, v, log_decay, state)
  o, final = call(*args)
  o_ref, final_ref = ref(*args)
  assert_close(o, o_ref, 1e-5, "o")
  assert_close(final, final_ref, 1e-5, "final state")
  argnums = (0, 1, 2, 3, 4)
  names = ["dq", "dk", "dv", "d_log_decay", "d_initial_state"]
  grads = _grads(call, args, argnums, v.shape, state.shape)
  grads_ref = _grads(ref, args, argnums, v.shape, state.shape)
  for name, g, g_ref in zip(names, grads, grads_ref):
    assert_close(g, g_ref, DECAY_GRAD_TOL[jnp.float32], name)


@pytest.mark.parametrize("interpret", INTERPRET)
def test_width_changing_feature_map_with_vector_gate(interpret):
  """Random features (Dk -> 2 Dk) with a gate over the feature width."""
  q, k, v = _inputs()
  log_decay = _log_decay("vector", 7, d_feature=2 * DK)
  kwargs = dict(q_mod=random_features, k_mod=random_features, scale=0.5)
  call = lambda q, k, v, g: (linear_attention(
      q, k, v, log_decay=g, chunk_size=CHUNK, interpret=interpret, **kwargs),
      jnp.zeros(()))
  ref = lambda q, k, v, g: (linear_attention_reference(
      q, k, v, log_decay=g, **kwargs)[0], jnp.zeros(()))
  args = (q, k, v, log_decay)
  assert_close(call(*args)[0], ref(*args)[0], 1e-5, "o")
  grads = _grads(call, args, (0, 1, 2, 3), v.shape, ())
  grads_ref = _grads(ref, args, (0, 1, 2, 3), v.shape, ())
  for name, g, g_ref in zip(["dq", "dk", "dv", "d_log_decay"], grads,
                            grads_ref):
    assert_close(g, g_ref, DECAY_GRAD_TOL[jnp.float32], name)


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("normalize", [False, True])
def test_state_passing_across_calls_equals_one_call(normalize, interpret):
  q, k, v = _inputs()
  log_decay = _log_decay("vector", 8)
  feature_map = elu_plus_one if normalize else None
  run = functools.partial(
      linear_attention, q_mod=feature_map, k_mod=feature_map,
      normalize=normalize, return_final_state=True, chunk_size=CHUNK,
      interpret=interpret)
  o_full, state_full = run(q, k, v, log_decay=log_decay)
  cut = 19  # neither piece is a multiple of the chunk
  o_1, state = run(q[:, :cut], k[:, :cut], v[:, :cut],
                   log_decay=log_decay[:, :cut])
  o_2, state = run(q[:, cut:], k[:, cut:], v[:, cut:],
                   log_decay=log_decay[:, cut:], initial_state=state)
  assert_close(jnp.concatenate([o_1, o_2], axis=1), o_full, 1e-5, "o")
  assert_close(state, state_full, 1e-5, "final state")


@pytest.mark.parametrize("kind", KINDS)
def test_decode_step_equals_last_row(kind):
  q, k, v = _inputs()
  normalize = kind == "none"  # also covers the normaliser column
  feature_map = elu_plus_one if normalize else None
  log_decay = _log_decay(kind, 9)
  kwargs = dict(q_mod=feature_map, k_mod=feature_map, normalize=normalize)
  o_full, state_full = linear_attention(
      q, k, v, log_decay=log_decay, return_final_state=True,
      chunk_size=CHUNK, **kwargs)
  prompt = log_decay
  step_decay = log_decay
  if kind in ("scalar", "vector"):
    prompt, step_decay = log_decay[:, :-1], log_decay[:, -1]
  _, state = linear_attention(
      q[:, :-1], k[:, :-1], v[:, :-1], log_decay=prompt,
      return_final_state=True, chunk_size=CHUNK, **kwargs)
  o_t, state = linear_attention_step(
      q[:, -1], k[:, -1], v[:, -1], state, log_decay_t=step_decay, **kwargs)
  assert o_t.shape == (B, H, DV)
  assert_close(o_t, o_full[:, -1], 1e-5, "o_t")
  assert_close(state, state_full, 1e-5, "state")


def test_decode_step_gradients_match_reference():
  q, k, v = _inputs(seq_len=1)
  state = _normal(10, (B, H, DK, DV))
  log_decay = _log_decay("vector", 11, seq_len=1)
  step = lambda q, k, v, g, s: linear_attention_step(
      q[:, 0], k[:, 0], v[:, 0], s, log_decay_t=g[:, 0])
  ref = lambda q, k, v, g, s: (lambda o, st: (o[:, 0], st))(
      *linear_attention_reference(q, k, v, log_decay=g, initial_state=s))
  args = (q, k, v, log_decay, state)
  grads = _grads(step, args, (0, 1, 2, 3, 4), (B, H, DV), state.shape)
  grads_ref = _grads(ref, args, (0, 1, 2, 3, 4), (B, H, DV), state.shape)
  for g, g_ref in zip(grads, grads_ref):
    assert_close(g, g_ref, 1e-5)


@pytest.mark.parametrize("interpret", INTERPRET)
def test_several_value_blocks_and_default_chunk(interpret):
  """block_v=16 splits Dv into blocks: dq/dk are summed across programs."""
  q, k, v = _inputs(d_v=40)
  log_decay = _log_decay("scalar", 12)
  config = LinearAttentionConfig(chunk_size=32, block_v=16)
  ref = lambda q, k, v, g: linear_attention_reference(q, k, v, log_decay=g)
  args = (q, k, v, log_decay)
  grads_ref = _grads(ref, args, (0, 1, 2, 3), v.shape, (B, H, DK, 40))
  for kwargs in (dict(config=config), dict()):
    call = lambda q, k, v, g: linear_attention(
        q, k, v, log_decay=g, return_final_state=True, interpret=interpret,
        **kwargs)
    assert_close(call(*args)[0], ref(*args)[0], 1e-5, "o")
    grads = _grads(call, args, (0, 1, 2, 3), v.shape, (B, H, DK, 40))
    for g, g_ref in zip(grads, grads_ref):
      assert_close(g, g_ref, DECAY_GRAD_TOL[jnp.float32])


def test_eager_calls_compile_once_per_shape():
  """Eager calls (no outer jit) with new decay values reuse one compiled core,
  and each call sees its own values."""
  from pallas_attn import linear
  q, k, v = _inputs()
  linear._linear_core.clear_cache()
  for n in range(3):
    log_decay = _log_decay("scalar", 20 + n)
    out = linear_attention(q, k, v, log_decay=log_decay, interpret=True)
    assert_close(out, linear_attention_reference(q, k, v, log_decay=log_decay)[0], 1e-5)
  assert linear._linear_core._cache_size() == 1


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("kind", ["scalar", "vector"])
def test_state_pass_splits_feature_and_value_blocks(kind, interpret):
  """Dk = 128 and Dv = 200 (padded to 256): the state passes run 2 x 2 tiles
  of 64 x 128 per head, forwards and in reverse (`state_tile`)."""
  d_k, d_v = 128, 200
  assert state_tile(d_k, 256) == (64, 128)
  shape = (1, S, 1)
  q, k = _normal(40, shape + (d_k,)), _normal(41, shape + (d_k,))
  v = _normal(42, shape + (d_v,))
  state = _normal(43, (1, 1, d_k, d_v))
  u = random(shape + ((d_k,) if kind == "vector" else ()), seed=44, distribution="uniform")
  log_decay = -(0.01 + 0.99 * u)
  call = lambda q, k, v, g, s: linear_attention(
      q, k, v, log_decay=g, initial_state=s, return_final_state=True,
      chunk_size=CHUNK, interpret=interpret)
  ref = lambda q, k, v, g, s: linear_attention_reference(
      q, k, v, log_decay=g, initial_state=s)
  args = (q, k, v, log_decay, state)
  for name, x, x_ref in zip(["o", "final state"], call(*args), ref(*args)):
    assert_close(x, x_ref, 1e-5, name)
  names = ["dq", "dk", "dv", "d_log_decay", "d_initial_state"]
  grads = _grads(call, args, (0, 1, 2, 3, 4), v.shape, state.shape)
  grads_ref = _grads(ref, args, (0, 1, 2, 3, 4), v.shape, state.shape)
  for name, g, g_ref in zip(names, grads, grads_ref):
    assert_close(g, g_ref, DECAY_GRAD_TOL[jnp.float32], name)


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("kind", ["scalar", "vector"])
def test_chunk_cumulative_log_decay_matches_jnp(kind, interpret):
  """The decay-prefix kernel against the jnp cumsum, four chunks."""
  log_decay = _log_decay(kind, 50, seq_len=4 * CHUNK, strength=5.0)
  assert_close(chunk_cumulative_log_decay(log_decay, CHUNK, interpret=interpret),
               reference.chunk_cumulative_log_decay(log_decay, CHUNK), 1e-6)


@pytest.mark.parametrize("kind", ["scalar", "vector"])
def test_strong_decay_over_long_chunks_is_stable(kind):
  """Cumulative log decays down to about -2000 within a 64-token chunk."""
  q, k, v = _inputs(seq_len=64)
  log_decay = _log_decay(kind, 13, seq_len=64, strength=60.0)
  call = lambda q, k, v, g: linear_attention(
      q, k, v, log_decay=g, return_final_state=True, chunk_size=64)
  ref = lambda q, k, v, g: linear_attention_reference(q, k, v, log_decay=g)
  args = (q, k, v, log_decay)
  o, final = call(*args)
  o_ref, final_ref = ref(*args)
  assert_close(o, o_ref, 1e-5, "o")
  assert_close(final, final_ref, 1e-5, "final state")
  grads = _grads(call, args, (0, 1, 2, 3), v.shape, final.shape)
  grads_ref = _grads(ref, args, (0, 1, 2, 3), v.shape, final.shape)
  for g, g_ref in zip(grads, grads_ref):
    assert_close(g, g_ref, DECAY_GRAD_TOL[jnp.float32])


@pytest.mark.parametrize("interpret", INTERPRET)
def test_vector_decay_of_mixed_strength(interpret):
  """Row blocks of mild decay pair their own keys on the tensor cores, those
  of strong decay elementwise; one call with both matches the reference."""
  q, k, v = _inputs(seq_len=64)
  strength = jnp.where(jnp.arange(64) % 32 < 16, 0.2, 40.0)[None, :, None, None]
  log_decay = _log_decay("vector", 16, seq_len=64) * strength
  call = lambda q, k, v, g: linear_attention(
      q, k, v, log_decay=g, return_final_state=True, chunk_size=32,
      interpret=interpret)
  ref = lambda q, k, v, g: linear_attention_reference(q, k, v, log_decay=g)
  args = (q, k, v, log_decay)
  for x, x_ref, name in zip(call(*args), ref(*args), ["o", "final state"]):
    assert_close(x, x_ref, 1e-5, name)
  grads = _grads(call, args, (0, 1, 2, 3), v.shape, (B, H, DK, DV))
  grads_ref = _grads(ref, args, (0, 1, 2, 3), v.shape, (B, H, DK, DV))
  for name, g, g_ref in zip(["dq", "dk", "dv", "d_log_decay"], grads,
                            grads_ref):
    assert_close(g, g_ref, DECAY_GRAD_TOL[jnp.float32], name)


def test_under_jit():
  q, k, v = _inputs()
  log_decay = _log_decay("scalar", 14)
  fn = jax.jit(functools.partial(linear_attention, chunk_size=CHUNK))
  o = fn(q, k, v, log_decay=log_decay)
  o_ref, _ = linear_attention_reference(q, k, v, log_decay=log_decay)
  assert_close(o, o_ref, 1e-5)


def test_under_vmap():
  """A batch of calls mapped over a leading axis gives each call's output."""
  q, k, v = _inputs()
  log_decay = _log_decay("scalar", 15)
  attend = lambda q, k, v, g: linear_attention(q[None], k[None], v[None], log_decay=g[None],
                                               chunk_size=CHUNK)[0]
  o = jax.vmap(attend)(q, k, v, log_decay)
  o_ref, _ = linear_attention_reference(q, k, v, log_decay=log_decay)
  assert_close(o, o_ref, 1e-5)


@pytest.mark.parametrize("kind", ["per_head", "scalar", "vector"])
@pytest.mark.parametrize("host", [False, True], ids=["device", "numpy"])
def test_closed_over_log_decay_under_jit(kind, host):
  """A concrete log_decay closed over by a jitted function is ordinary JAX:
  its value is checked on the host, not through a staged jnp op."""
  q, k, v = _inputs()
  log_decay = _log_decay(kind, 16)
  if host:
    log_decay = np.asarray(log_decay)
  fn = jax.jit(lambda q, k, v: linear_attention(q, k, v, log_decay=log_decay,
                                                chunk_size=CHUNK))
  o_ref, _ = linear_attention_reference(q, k, v, log_decay=jnp.asarray(log_decay))
  assert_close(fn(q, k, v), o_ref, 1e-5)
  positive = -log_decay
  with pytest.raises(ValueError, match="<= 0"):
    jax.jit(lambda q, k, v: linear_attention(q, k, v, log_decay=positive))(q, k, v)


def test_device_log_decay_is_read_once_per_array(monkeypatch):
  """Eager calls reusing one device array do not copy it to the host again."""
  from pallas_attn.spec import linear as spec_lib
  q, k, v = _inputs()
  log_decay = _log_decay("scalar", 17)
  reads = []

  class CountingNumpy:
    def __getattr__(self, name):
      return getattr(np, name)

    def asarray(self, x, *args, **kwargs):
      reads.append(1)
      return np.asarray(x, *args, **kwargs)

  monkeypatch.setattr(spec_lib, "np", CountingNumpy())
  for _ in range(3):
    linear_attention(q, k, v, log_decay=log_decay, chunk_size=CHUNK)
  assert len(reads) == 1


@pytest.mark.parametrize("kind", ["scalar", "vector"])
def test_chunked_jnp_baseline_matches_reference(kind):
  q, k, v = _inputs(seq_len=32)
  log_decay = _log_decay(kind, 15, seq_len=32)
  o, final = chunked_linear_attention_jnp(q, k, v, log_decay=log_decay,
                                          chunk_size=16)
  o_ref, final_ref = linear_attention_reference(q, k, v, log_decay=log_decay)
  assert_close(o, o_ref, 1e-5, "o")
  assert_close(final, final_ref, 1e-5, "final state")


# Recipes from the module docstring, checked against their own definitions.


def test_recipe_mamba2_ssd():
  """y_t = sum_{s<=t} C_t . B_s * exp(sum_{s<r<=t} dt_r A) * dt_s x_s."""
  n, p = 16, 16
  x = _normal(30, (B, S, H, p))
  b_in, c_in = _normal(31, (B, S, H, n)), _normal(32, (B, S, H, n))
  dt = jax.nn.softplus(_normal(33, (B, S, H)))
  a = -jnp.exp(_normal(34, (H,)))
  y = linear_attention(c_in, b_in, x * dt[..., None], log_decay=dt * a,
                       scale=1.0, chunk_size=CHUNK)
  cum = jnp.cumsum(dt * a, axis=1)  # [B, S, H]
  seg = cum[:, :, None, :] - cum[:, None, :, :]  # [B, t, s, H]
  causal = jnp.tril(jnp.ones((S, S), bool))[None, :, :, None]
  weights = jnp.where(causal, jnp.exp(jnp.where(causal, seg, 0.0)), 0.0)
  scores = jnp.einsum("bthn,bshn->btsh", c_in, b_in, precision="highest")
  expected = jnp.einsum("btsh,bshp->bthp", scores * weights,
                        x * dt[..., None], precision="highest")
  assert_close(y, expected, 1e-5)


def test_recipe_retnet_parallel_form():
  """Retention: (Q K^T * D) V with D_ij = gamma^(i - j), i >= j."""
  q, k, v = _inputs()
  gamma = 1.0 - 2.0 ** (-5.0 - jnp.arange(H, dtype=jnp.float32))
  o = linear_attention(q, k, v, log_decay=jnp.log(gamma), chunk_size=CHUNK)
  i = jnp.arange(S)
  d = jnp.where(i[:, None] >= i[None, :],
                gamma[:, None, None] ** (i[:, None] - i[None, :]), 0.0)
  scores = jnp.einsum("bihd,bjhd->bhij", q, k, precision="highest") / 4.0
  expected = jnp.einsum("bhij,bjhv->bihv", scores * d, v, precision="highest")
  assert_close(o, expected, 1e-5)


def test_recipe_gla_gate():
  """GLA: o_t = q_t sum_{s<=t} (prod_{s<r<=t} a_r) * k_s v_s^T, a = sigmoid."""
  q, k, v = _inputs()
  gate_logits = _normal(35, (B, S, H, DK)) + 2.0
  o = linear_attention(q, k, v, log_decay=jax.nn.log_sigmoid(gate_logits),
                       chunk_size=CHUNK)
  cum = jnp.cumsum(jax.nn.log_sigmoid(gate_logits), axis=1)
  seg = cum[:, :, None] - cum[:, None, :]  # [B, t, s, H, Dk]
  causal = jnp.tril(jnp.ones((S, S), bool))[None, :, :, None, None]
  weights = jnp.where(causal, jnp.exp(jnp.where(causal, seg, 0.0)), 0.0)
  scores = jnp.einsum("bthd,bshd,btshd->bths", q, k, weights,
                      precision="highest") / 4.0
  expected = jnp.einsum("bths,bshv->bthv", scores, v, precision="highest")
  assert_close(o, expected, 1e-5)


def test_recipe_linear_transformer():
  """Causal phi(q) phi(k)^T V normalised by its row sums (elu + 1)."""
  q, k, v = _inputs()
  o = linear_attention(q, k, v, q_mod=elu_plus_one, k_mod=elu_plus_one,
                       normalize=True, chunk_size=CHUNK)
  scores = jnp.einsum("bihd,bjhd->bhij", elu_plus_one(q), elu_plus_one(k),
                      precision="highest")
  scores = jnp.where(jnp.tril(jnp.ones((S, S), bool)), scores, 0.0)
  expected = jnp.einsum("bhij,bjhv->bihv", scores, v, precision="highest")
  expected = expected / jnp.sum(scores, -1).transpose(0, 2, 1)[..., None]
  assert_close(o, expected, 1e-5)


# Errors.


def _call(**overrides):
  q, k, v = _inputs()
  args = dict(q=q, k=k, v=v)
  args.update(overrides)
  return linear_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


@pytest.mark.parametrize("overrides, error, match", [
    (dict(q=jnp.zeros((B, S, DK))), ValueError, r"\[B, S, H, Dk\]"),
    (dict(k=jnp.zeros((B, S, H, DK + 1))), ValueError, "same shape"),
    (dict(v=jnp.zeros((B, S + 1, H, DV))), ValueError, "share"),
    (dict(q=jnp.zeros((B, S, H, DK), jnp.int32)), TypeError, "dtype"),
    (dict(q=np.zeros((B, S, H, DK), np.float64)), TypeError, "float32"),
    (dict(q=jnp.zeros((B, S, H, DK), jnp.bfloat16)), TypeError,
     "share a dtype"),
    (dict(log_decay=jnp.full((B, S, H), 0.1)), ValueError, "<= 0"),
    (dict(log_decay=jnp.zeros((B, S))), ValueError, "log_decay has shape"),
    (dict(log_decay=jnp.zeros((B, S, H, DK + 1))), ValueError, "Dk'"),
    (dict(q_mod=lambda x: x.reshape(x.shape[0], -1)), ValueError, "rank"),
    (dict(q_mod=lambda x: jnp.concatenate([x, x], -1)), ValueError,
     "same width"),
    (dict(q_mod=lambda x: (x, x)), TypeError, "single array"),
    (dict(initial_state=jnp.zeros((B, H, DK, DV + 1))), ValueError,
     "initial_state"),
    (dict(normalize=True, initial_state=jnp.zeros((B, H, DK, DV))),
     ValueError, "extra last column"),
    (dict(chunk_size=48), ValueError, "power of two"),
    (dict(config=dict(chunk_size=16)), TypeError, "LinearAttentionConfig"),
    (dict(scale=0.0), ValueError, "finite nonzero"),
    (dict(scale=float("nan")), ValueError, "finite nonzero"),
])
def test_clear_errors(overrides, error, match):
  with pytest.raises(error, match=match):
    _call(**overrides)


def test_step_errors():
  q, k, v = _inputs()
  state = jnp.zeros((B, H, DK, DV))
  with pytest.raises(ValueError, match="state"):
    linear_attention_step(q[:, 0], k[:, 0], v[:, 0], state[..., :-1])
  with pytest.raises(ValueError, match="log_decay_t"):
    linear_attention_step(q[:, 0], k[:, 0], v[:, 0], state,
                          log_decay_t=jnp.zeros((B, S, H)))
  with pytest.raises(ValueError, match="<= 0"):
    linear_attention_step(q[:, 0], k[:, 0], v[:, 0], state,
                          log_decay_t=jnp.ones((H,)))


def test_positive_log_decay_is_not_checked_under_jit():
  """Documented: traced values cannot be inspected, so jit does not raise."""
  q, k, v = _inputs()
  fn = jax.jit(functools.partial(linear_attention, chunk_size=CHUNK))
  o = fn(q, k, v, log_decay=jnp.full((B, S, H), 0.01))
  assert o.shape == v.shape


@pytest.mark.parametrize("kind", ["scalar", "vector"])
def test_log_decay_gradient_below_the_floor(kind):
  """Steps below LOG_DECAY_FLOOR (a -inf reset, a -1000 step) get a zero
  gradient, as a clamp's; the others match the reference's. The gate is
  bfloat16, so its gradient comes back in bfloat16."""
  q, k, v = _inputs()
  log_decay = (_log_decay(kind, 17).at[:, 21].set(-jnp.inf)
               .at[:, 40].set(-1000.0).astype(jnp.bfloat16))
  loss = lambda fn: lambda g: jnp.sum(fn(g) * v)
  d_log_decay = jax.grad(loss(lambda g: linear_attention(
      q, k, v, log_decay=g, chunk_size=CHUNK)))(log_decay)
  d_ref = jax.grad(loss(lambda g: linear_attention_reference(
      q, k, v, log_decay=jnp.maximum(g.astype(jnp.float32), -100.0))[0]))(
          log_decay)
  assert d_log_decay.dtype == jnp.bfloat16
  clamped = log_decay < -100.0
  assert not jnp.any(jnp.where(clamped, d_log_decay, 0.0))
  assert_close(jnp.where(clamped, 0.0, d_log_decay), d_ref, 2e-2)


@pytest.mark.parametrize("kind", ["scalar", "vector"])
def test_hard_reset_with_minus_infinity(kind):
  q, k, v = _inputs()
  log_decay = _log_decay(kind, 16).at[:, 21].set(-jnp.inf)
  call = lambda q, k, v: linear_attention(
      q, k, v, log_decay=log_decay, return_final_state=True, chunk_size=CHUNK)
  ref = lambda q, k, v: linear_attention_reference(q, k, v,
                                                   log_decay=log_decay)
  o, final = call(q, k, v)
  o_ref, final_ref = ref(q, k, v)
  assert_close(o, o_ref, 1e-5, "o")
  assert_close(final, final_ref, 1e-5, "final state")
  grads = _grads(call, (q, k, v), (0, 1, 2), v.shape, final.shape)
  grads_ref = _grads(ref, (q, k, v), (0, 1, 2), v.shape, final.shape)
  for g, g_ref in zip(grads, grads_ref):
    assert_close(g, g_ref, 1e-5)
