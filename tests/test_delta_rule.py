"""The delta rule (DeltaNet, Gated DeltaNet, KDA) against a float32
`lax.scan` of its recurrence.

Kernels run in Pallas interpret mode on the CPU; the `interpret=False`
cases (marked `gpu`) run the compiled kernels and skip without a GPU.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_attn.kernels.linear.reference import (
    chunked_delta_rule_jnp, delta_rule_reference)
from pallas_attn.kernels.linear.triangular import invert_unit_lower

B, S, H, DK, DV = 1, 40, 2, 16, 24  # S is not a multiple of the chunk
CHUNK = 16
KINDS = ["none", "scalar", "vector"]  # DeltaNet, Gated DeltaNet, KDA


def _normal(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(
      dtype)


def _l2_normalize(x):
  """The models' q/k normalisation, which keeps the delta rule contractive."""
  return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def _inputs(kind, dtype=jnp.float32, seq_len=S, seed=0):
  """q, k (unit rows), v, beta in (0, 2) and log decays of `kind`."""
  q = _l2_normalize(_normal(seed, (B, seq_len, H, DK))).astype(dtype)
  k = _l2_normalize(_normal(seed + 1, (B, seq_len, H, DK))).astype(dtype)
  v = _normal(seed + 2, (B, seq_len, H, DV), dtype)
  beta = 2 * jax.nn.sigmoid(_normal(seed + 3, (B, seq_len, H)))
  shape = {"none": None, "scalar": (B, seq_len, H),
           "vector": (B, seq_len, H, DK)}[kind]
  log_decay = None if shape is None else -jax.random.uniform(
      jax.random.PRNGKey(seed + 4), shape, minval=0.01, maxval=1.0)
  return q, k, v, beta, log_decay


def assert_close(actual, expected, tol, name=""):
  actual = np.asarray(jnp.asarray(actual, jnp.float32))
  expected = np.asarray(jnp.asarray(expected, jnp.float32))
  assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
  assert np.all(np.isfinite(actual)), f"{name}: non-finite values"
  err = np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-6)
  assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g}"


def test_invert_unit_lower_is_the_inverse():
  a = jnp.tril(_normal(0, (3, 8, 8)), -1)
  inverse = invert_unit_lower(a)
  product = jnp.einsum("bij,bjk->bik", jnp.eye(8) + a, inverse,
                       precision="highest")
  assert_close(product, jnp.broadcast_to(jnp.eye(8), (3, 8, 8)), 1e-5)


def test_reference_is_the_delta_rule():
  """Two tokens by hand: S1 = b1 k1^T v1, S2 = S1 + b2 k2^T (v2 - k2 S1)."""
  q, k, v, beta, _ = _inputs("none", seq_len=2)
  o, state = delta_rule_reference(q, k, v, beta, scale=1.0)
  f32 = lambda x: np.asarray(x, np.float64)[0, :, 0]
  q, k, v, beta = f32(q), f32(k), f32(v), f32(beta)
  s1 = beta[0] * np.outer(k[0], v[0])
  s2 = s1 + beta[1] * np.outer(k[1], v[1] - k[1] @ s1)
  assert_close(state[0, 0], s2, 1e-6)
  assert_close(o[0, :, 0], np.stack([q[0] @ s1, q[1] @ s2]), 1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_jnp_matches_scan(kind):
  q, k, v, beta, log_decay = _inputs(kind)
  initial = _normal(9, (B, H, DK, DV))
  o, state = chunked_delta_rule_jnp(q, k, v, beta, log_decay=log_decay,
                                    initial_state=initial, chunk_size=CHUNK)
  o_ref, state_ref = delta_rule_reference(q, k, v, beta, log_decay=log_decay,
                                          initial_state=initial)
  assert_close(o, o_ref, 1e-5, "o")
  assert_close(state, state_ref, 1e-5, "state")
