"""The delta rule (DeltaNet, Gated DeltaNet, KDA) against a float32
`lax.scan` of its recurrence.

Kernels run in Pallas interpret mode on the CPU; the `interpret=False`
cases (marked `gpu`) run the compiled kernels and skip without a GPU.
"""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MODES, assert_close, random

from pallas_attn.kernels.linear.reference import (
    chunked_delta_rule_jnp, delta_rule_reference)
from pallas_attn.kernels.linear.triangular import invert_unit_lower
from pallas_attn.linear import linear_attention, linear_attention_step
from pallas_attn.vjp import delta_rule_backward

# The module (the package re-exports a function of the same name).
chunked_forward = importlib.import_module(
    "pallas_attn.kernels.linear.chunked_forward")
delta_rule = importlib.import_module("pallas_attn.kernels.linear.delta_rule")
mosaic_forward = importlib.import_module("pallas_attn.kernels.linear.mosaic_forward")

B, S, H, DK, DV = 1, 40, 2, 16, 24  # S is not a multiple of the chunk
CHUNK = 16
KINDS = ["none", "scalar", "vector"]  # DeltaNet, Gated DeltaNet, KDA


def _l2_normalize(x):
  """The models' q/k normalisation, which keeps the delta rule contractive."""
  return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def _inputs(kind, dtype=jnp.float32, seq_len=S, seed=0):
  """q, k (unit rows), v, beta in (0, 2) and log decays of `kind`."""
  q = _l2_normalize(random((B, seq_len, H, DK), seed=seed)).astype(dtype)
  k = _l2_normalize(random((B, seq_len, H, DK), seed=seed + 1)).astype(dtype)
  v = random((B, seq_len, H, DV), dtype, seed=seed + 2)
  beta = 2 * jax.nn.sigmoid(random((B, seq_len, H), seed=seed + 3))
  shape = {"none": None, "scalar": (B, seq_len, H),
           "vector": (B, seq_len, H, DK)}[kind]
  log_decay = None if shape is None else -jax.random.uniform(
      jax.random.PRNGKey(seed + 4), shape, minval=0.01, maxval=1.0)
  return q, k, v, beta, log_decay


@pytest.mark.parametrize("size, block", [(8, 16), (64, 16), (32, 4)])
def test_invert_unit_lower_is_the_inverse(size, block):
  """Elimination alone (a block wider than the matrix), and with two or
  three levels of merges."""
  a = jnp.tril(random((3, size, size), seed=0), -1) / 4
  inverse = invert_unit_lower(a, block=block)
  product = jnp.einsum("bij,bjk->bik", jnp.eye(size) + a, inverse,
                       precision="highest")
  assert_close(product, jnp.broadcast_to(jnp.eye(size), (3, size, size)))


def test_reference_is_the_delta_rule():
  """Two tokens by hand: S1 = b1 k1^T v1, S2 = S1 + b2 k2^T (v2 - k2 S1)."""
  q, k, v, beta, _ = _inputs("none", seq_len=2)
  o, state = delta_rule_reference(q, k, v, beta, scale=1.0)
  f32 = lambda x: np.asarray(x, np.float64)[0, :, 0]
  q, k, v, beta = f32(q), f32(k), f32(v), f32(beta)
  s1 = beta[0] * np.outer(k[0], v[0])
  s2 = s1 + beta[1] * np.outer(k[1], v[1] - k[1] @ s1)
  assert_close(state[0, 0], s2)
  assert_close(o[0, :, 0], np.stack([q[0] @ s1, q[1] @ s2]))


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_jnp_matches_scan(kind):
  q, k, v, beta, log_decay = _inputs(kind)
  initial = random((B, H, DK, DV), seed=9)
  o, state = chunked_delta_rule_jnp(q, k, v, beta, log_decay=log_decay,
                                    initial_state=initial, chunk_size=CHUNK)
  o_ref, state_ref = delta_rule_reference(q, k, v, beta, log_decay=log_decay,
                                          initial_state=initial)
  assert_close(o, o_ref)
  assert_close(state, state_ref)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("kind, chunk", [(kind, CHUNK) for kind in KINDS]
                         + [("vector", 2 * CHUNK),  # row blocks of a chunk
                            ("none", 4 * CHUNK)])  # four blocks of the UT transform
def test_forward_matches_scan(kind, chunk, interpret):
  q, k, v, beta, log_decay = _inputs(kind)
  initial = random((B, H, DK, DV), seed=9)
  o, state = linear_attention(
      q, k, v, beta=beta, log_decay=log_decay, initial_state=initial,
      return_final_state=True, chunk_size=chunk, interpret=interpret)
  o_ref, state_ref = delta_rule_reference(q, k, v, beta, log_decay=log_decay,
                                          initial_state=initial)
  assert_close(o, o_ref)
  assert_close(state, state_ref)


def test_state_pass_in_several_value_blocks(monkeypatch):
  """The delta state pass holds all Dk rows of a tile (W S contracts over
  them) and splits Dv: two 16-column blocks here, one at full size."""
  assert chunked_forward.state_tile(128, 128, whole_rows=True) == (128, 64)
  monkeypatch.setattr(chunked_forward, "STATE_TILE", DK * 16)
  q, k, v, beta, log_decay = _inputs("scalar")
  o, state = linear_attention(q, k, v, beta=beta, log_decay=log_decay,
                              return_final_state=True, chunk_size=CHUNK)
  o_ref, state_ref = delta_rule_reference(q, k, v, beta, log_decay=log_decay)
  assert_close(o, o_ref)
  assert_close(state, state_ref)


@pytest.mark.parametrize("dtype, strength", [(jnp.float32, 1.0), (jnp.float32, 2.0),
                                             (jnp.bfloat16, 1.0)])
def test_anchored_ut_transform_matches_per_feature_pairs(dtype, strength):
  """KDA's UT transform in the Mosaic forward's chunks, by block substitution
  on keys scaled around one anchor row, gives the W and U~ of the per-feature pairing (gates
  twice the tests' make spans near SPAN_LIMIT over half a chunk)."""
  chunk = mosaic_forward.CHUNK
  _, k, v, beta, log_decay = _inputs("vector", dtype, seq_len=2 * chunk)
  schedule = chunked_forward.ChunkedSchedule(
      decay_kind="vector", scale=1.0, chunk_size=chunk, block_v=DV, num_warps=4,
      num_stages=1, interpret=True, out_dtype=jnp.dtype(dtype).name)
  g = chunked_forward.cumulative_log_decay(strength * log_decay, schedule)
  assert bool(mosaic_forward.gates_in_range(g))
  *operands, left, w_keys = mosaic_forward.anchored_operands(k, k, g, ut_keys=True)
  anchored = delta_rule.ut_transform(left, v, beta, None, schedule,
                                     anchored_keys=(operands[3], w_keys))
  paired = delta_rule.ut_transform(k, v, beta, g, schedule)
  for x, expected in zip(anchored, paired):
    assert_close(x, expected, dtype)


@pytest.mark.parametrize("kind", ["scalar", "vector"])
def test_hard_reset(kind):
  """A log decay of -inf forgets the state (Gated DeltaNet's reset) without
  NaNs, forwards and backwards."""
  q, k, v, beta, log_decay = _inputs(kind, seq_len=24)
  log_decay = log_decay.at[:, 19].set(-jnp.inf)
  attend = lambda q, beta: linear_attention(
      q, k, v, beta=beta, log_decay=log_decay, chunk_size=CHUNK)
  o_ref, _ = delta_rule_reference(q, k, v, beta, log_decay=log_decay)
  assert_close(attend(q, beta), o_ref)
  grads = jax.grad(lambda *a: jnp.sum(attend(*a)), argnums=(0, 1))(q, beta)
  assert all(np.isfinite(np.asarray(g)).all() for g in grads)


@pytest.mark.parametrize("interpret", MODES)
def test_bfloat16_with_feature_maps(interpret):
  """bf16 inputs, the models' L2 norm as q_mod/k_mod, a per-head decay."""
  q, k, v, beta, _ = _inputs("none", jnp.bfloat16)
  q, k = 3 * q, 2 * k  # the maps normalise them again
  log_decay = jnp.array([-0.1, -0.5])
  o = linear_attention(q, k, v, beta=beta, log_decay=log_decay,
                       q_mod=_l2_normalize, k_mod=_l2_normalize,
                       chunk_size=CHUNK, interpret=interpret)
  o_ref, _ = delta_rule_reference(q, k, v, beta, log_decay=log_decay,
                                  q_mod=_l2_normalize, k_mod=_l2_normalize)
  assert o.dtype == jnp.bfloat16
  assert_close(o, o_ref, jnp.bfloat16)


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_then_decode_steps_equal_one_call(kind):
  q, k, v, beta, log_decay = _inputs(kind, seq_len=20)
  prompt = 17
  o_all = linear_attention(q, k, v, beta=beta, log_decay=log_decay,
                           chunk_size=CHUNK)
  cut = lambda x, s: None if x is None else x[:, s]
  o_prompt, state = linear_attention(
      q[:, :prompt], k[:, :prompt], v[:, :prompt], beta=beta[:, :prompt],
      log_decay=cut(log_decay, slice(0, prompt)), return_final_state=True,
      chunk_size=CHUNK)
  steps = [o_prompt]
  for t in range(prompt, q.shape[1]):
    o_t, state = linear_attention_step(
        q[:, t], k[:, t], v[:, t], state, beta_t=beta[:, t],
        log_decay_t=cut(log_decay, t))
    steps.append(o_t[:, None])
  assert_close(jnp.concatenate(steps, 1), o_all)


def test_two_calls_chained_through_the_state():
  q, k, v, beta, log_decay = _inputs("vector", seq_len=24)
  o_all, state_all = linear_attention(
      q, k, v, beta=beta, log_decay=log_decay, return_final_state=True,
      chunk_size=CHUNK)
  halves = [slice(0, 13), slice(13, 24)]
  outputs, state = [], None
  for part in halves:
    o, state = linear_attention(
        q[:, part], k[:, part], v[:, part], beta=beta[:, part],
        log_decay=log_decay[:, part], initial_state=state,
        return_final_state=True, chunk_size=CHUNK)
    outputs.append(o)
  assert_close(jnp.concatenate(outputs, 1), o_all)
  assert_close(state, state_all)


def test_jit_closure_and_vmap():
  q, k, v, beta, log_decay = _inputs("scalar")
  expected = linear_attention(q, k, v, beta=beta, log_decay=log_decay,
                              chunk_size=CHUNK)
  closed = jax.jit(lambda q: linear_attention(
      q, k, v, beta=beta, log_decay=log_decay, chunk_size=CHUNK))
  assert_close(closed(q), expected)
  loss = lambda beta: jnp.sum(linear_attention(
      q, k, v, beta=beta, log_decay=log_decay, chunk_size=CHUNK))
  scan_loss = lambda beta: jnp.sum(
      delta_rule_reference(q, k, v, beta, log_decay=log_decay)[0])
  assert_close(jax.jit(jax.grad(loss))(beta), jax.grad(scan_loss)(beta),
               factor=10)
  batched = jax.vmap(lambda q, k, v, beta, g: linear_attention(
      q[None], k[None], v[None], beta=beta[None], log_decay=g[None],
      chunk_size=CHUNK)[0])
  assert_close(batched(q, k, v, beta, log_decay), expected)


@pytest.mark.parametrize("bad, error, words", [
    (dict(beta=jnp.ones((B, S, H, 1))), ValueError, "beta has shape"),
    (dict(beta=jnp.ones((B, S, H), jnp.int32)), TypeError, "floating point"),
    (dict(beta=[1.0]), TypeError, "must be an array"),
    (dict(beta=jnp.ones((B, S, H)), normalize=True), ValueError,
     "normaliser"),
])
def test_bad_inputs(bad, error, words):
  q, k, v, _, _ = _inputs("none")
  with pytest.raises(error, match=words):
    linear_attention(q, k, v, **bad)


def test_bad_step_beta():
  q, k, v, _, _ = _inputs("none", seq_len=1)
  state = jnp.zeros((B, H, DK, DV))
  with pytest.raises(ValueError, match=r"beta_t has shape .*\[B, H\]"):
    linear_attention_step(q[:, 0], k[:, 0], v[:, 0], state,
                          beta_t=jnp.ones((B, 1, H)))


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("kind, chunk", [(kind, CHUNK) for kind in KINDS + ["per_head"]]
                         + [("scalar", 64), ("vector", 64),  # merges in T
                            ("strong_vector", 32), ("value_blocks", CHUNK),
                            ("scalar_value_blocks", CHUNK)])
def test_gradients_match_scan(kind, chunk, interpret, monkeypatch):
  """d/d(q, k, v, beta, log_decay, initial state) of a random functional of
  o and the final state, against jax.grad of the scan reference. Per-feature
  decays pair a chunk's rows on the tensor cores around anchor rows; strong
  ones (spans past SPLIT_SPAN within a row block) elementwise. `value_blocks`:
  the gradient kernel walks the state in 16-column blocks (two here)."""
  if kind.endswith("value_blocks"):
    kind = "scalar" if kind.startswith("scalar") else "vector"
    monkeypatch.setitem(delta_rule_backward.GRADIENT_VALUE_BLOCK, kind, 16)
    jax.clear_caches()  # no kernel traced with the default blocks
  seq_len = 24 if chunk == CHUNK else 80
  q, k, v, beta, log_decay = _inputs(
      {"per_head": "none", "strong_vector": "vector"}.get(kind, kind), seq_len=seq_len)
  if kind == "per_head":
    log_decay = jnp.array([-0.2, -0.7])
  if kind == "strong_vector":
    log_decay = 4 * log_decay
  initial = random((B, H, DK, DV), seed=9)
  o_weights = random((B, seq_len, H, DV), seed=10)
  state_weights = random((B, H, DK, DV), seed=11)

  def loss(attend, *args):
    o, state = attend(*args)
    return jnp.sum(o * o_weights) + jnp.sum(state * state_weights)

  def kernels(q, k, v, beta, log_decay, initial):
    return linear_attention(
        q, k, v, beta=beta, log_decay=log_decay, initial_state=initial,
        return_final_state=True, chunk_size=chunk, interpret=interpret)

  def scan(q, k, v, beta, log_decay, initial):
    return delta_rule_reference(q, k, v, beta, log_decay=log_decay,
                                initial_state=initial)

  args = (q, k, v, beta, log_decay, initial)
  argnums = tuple(i for i, x in enumerate(args) if x is not None)
  grads = jax.grad(loss, argnums=[i + 1 for i in argnums])(kernels, *args)
  expected = jax.grad(loss, argnums=[i + 1 for i in argnums])(scan, *args)
  for grad, want in zip(grads, expected):
    assert grad.shape == want.shape
    assert_close(grad, want, factor=10)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("kind, chunk", [("vector", CHUNK), ("scalar", 64)])
def test_bfloat16_gradients(kind, chunk, interpret):
  """bf16 inputs: the gradient kernel's products take bf16 operands (as the
  forward's), the gradients come back in the inputs' dtypes."""
  q, k, v, beta, log_decay = _inputs(kind, jnp.bfloat16,
                                     seq_len=24 if chunk == CHUNK else 80)
  beta = beta.astype(jnp.bfloat16)

  def loss(attend, q, k, v, beta):
    return jnp.sum(attend(q, k, v, beta).astype(jnp.float32) ** 2)

  kernels = lambda *a: linear_attention(*a[:3], beta=a[3], log_decay=log_decay,
                                        chunk_size=chunk, interpret=interpret)
  scan = lambda *a: delta_rule_reference(*a, log_decay=log_decay)[0]
  grads = jax.grad(loss, argnums=(1, 2, 3, 4))(kernels, q, k, v, beta)
  expected = jax.grad(loss, argnums=(1, 2, 3, 4))(scan, q, k, v, beta)
  for grad, want in zip(grads, expected):
    assert grad.dtype == jnp.bfloat16
    assert_close(grad, want, jnp.bfloat16, factor=3)
