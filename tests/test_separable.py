"""Separable biases (spec/separable.py): which score_mods the analysis marks,
and the identity the Mosaic kernels build them by,
`E(q, kv) = E(q, 0) - E(q0, 0) + E(q0, kv)`, on vectors of positions."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_attn as pa
from pallas_attn import variants
from pallas_attn.kernels import tiles
from pallas_attn.spec import separable

H = 4
SLOPES = variants.alibi_slopes(H)
OFFSETS = jnp.arange(2 * H, dtype=jnp.int32).reshape(2, H)
KEY_BIAS = jnp.linspace(-1.0, 1.0, 64)

SEPARABLE = {
    "alibi": variants.alibi(num_heads=H).score_mod,
    "alibi_bottom_right": variants.alibi(num_heads=H, seq_q=24, seq_kv=40).score_mod,
    "sigmoid_alibi": (variants.sigmoid(seq_kv=40) + variants.alibi(num_heads=H)).score_mod,
    "parts": lambda s, b, h, q, kv: (s + 0.1 * q.astype(jnp.float32)
                                     - jnp.sin(kv.astype(jnp.float32)) * SLOPES[h]),
    "per_batch_offset": lambda s, b, h, q, kv: s - SLOPES[h] * (
        q + OFFSETS[b, h] - 2 * kv).astype(jnp.float32),
    "score_last": lambda s, b, h, q, kv: SLOPES[h] * (kv - q).astype(jnp.float32) + s,
}
NOT_SEPARABLE = {
    "softcap": variants.softcap(30.0).score_mod,
    "product": lambda s, b, h, q, kv: s + (q * kv).astype(jnp.float32),
    "scaled_score": lambda s, b, h, q, kv: 2 * s + (kv - q).astype(jnp.float32),
    "negated_score": lambda s, b, h, q, kv: (kv - q).astype(jnp.float32) - s,
    "distance": lambda s, b, h, q, kv: s - SLOPES[h] * jnp.abs(kv - q).astype(jnp.float32),
    "bf16_rounded": lambda s, b, h, q, kv: s + (kv - q).astype(jnp.bfloat16).astype(jnp.float32),
    "index_free": lambda s, b, h, q, kv: s + SLOPES[h],
    # The backward would take d/ds of `s + bias` (1) where the program's is 0.
    "stopped_score": lambda s, b, h, q, kv: (jax.lax.stop_gradient(s)
                                            + SLOPES[h] * (kv - q).astype(jnp.float32)),
    # Separable, but read by kv: the kernels evaluate vectors reading scalars only.
    "key_array": lambda s, b, h, q, kv: s + KEY_BIAS[kv] + q.astype(jnp.float32),
    "relative_table": lambda s, b, h, q, kv: s + jnp.ones((H, 79))[h, jnp.log1p(
        jnp.abs(q - kv).astype(jnp.float32)).astype(jnp.int32)],
}


@pytest.mark.parametrize("name", list(SEPARABLE))
def test_separable_bias_from_vectors(name):
  """The analysis marks it, and the bias from a row vector and a column
  vector (TileContext.separable_part on vectors, as the kernels call it)
  equals the program on every position of a tile."""
  score_mod = SEPARABLE[name]
  analysis = pa.analyze_variant(score_mod=score_mod)
  assert analysis.separable_bias
  arrays, operands = tiles.capture_operands(analysis, 64, 64)

  def loader(ref, operand, start, size):
    assert start is None and size is None  # vector evaluation reads scalars only
    return ref[tuple({"b": b, "h": h}.get(a, a) for a in operand.axes)]

  tile = tiles.TileContext(analysis, operands, blocked="q", loader=loader)
  for b, h, q0, kv0 in ((0, 0, 0, 0), (1, 3, 40, 8), (1, 2, 16, 48)):
    q = q0 + jnp.arange(24, dtype=jnp.int32)
    kv = kv0 + jnp.arange(16, dtype=jnp.int32)
    zero = jnp.int32(0)
    rows = (tile.separable_part(b, h, q, zero, arrays)
            - tile.separable_part(b, h, jnp.int32(q0), zero, arrays))
    cols = tile.separable_part(b, h, jnp.int32(q0), kv, arrays)
    bias = rows[:, None] + cols[None, :]
    dense = jax.vmap(lambda qi: jax.vmap(
        lambda ki: score_mod(jnp.float32(0), b, h, qi, ki))(kv))(q)
    np.testing.assert_allclose(bias, dense, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", list(NOT_SEPARABLE))
def test_other_score_mods_are_not_separable(name):
  assert not pa.analyze_variant(score_mod=NOT_SEPARABLE[name]).separable_bias


@pytest.mark.parametrize("score_mod,expected", [
    (lambda s, b, h, q, kv: s + (kv - q).astype(jnp.float32) / 3.0, True),
    (lambda s, b, h, q, kv: s + jax.lax.div(kv - q, 3).astype(jnp.float32), False),
    (lambda s, b, h, q, kv: s + ((kv - q) * 3).astype(jnp.float32), True),
], ids=["float_division", "integer_division", "integer_product"])
def test_structural_rules(score_mod, expected):
  """The rules themselves (the analysis hoists divisions as diagonal terms before them):
  integer division truncates, so it does not distribute over a sum."""
  index = jnp.int32(0)
  jaxpr = jax.make_jaxpr(score_mod)(jnp.float32(0), index, index, index, index).jaxpr
  assert separable.is_separable(jaxpr, ("score", "b", "h", "q", "kv")) == expected


AFFINE = {"alibi", "alibi_bottom_right", "sigmoid_alibi", "per_batch_offset", "score_last"}


@pytest.mark.parametrize("name", list(SEPARABLE))
def test_affine_columns_from_one_vector_and_a_number_per_tile(name):
  """Which separable biases are affine in kv (`kv_part_is_affine`), and for
  those the Mosaic forward's columns (mosaic_backend.affine_separable_columns):
  E(q0, q0 + j) - E(q0, q0) once, plus E(q0, k0) - E(q0, q0) per tile, equal
  E(q0, k0 + j) - E(q0, q0) on every tile."""
  score_mod = SEPARABLE[name]
  analysis = pa.analyze_variant(score_mod=score_mod)
  assert analysis.affine_columns == (name in AFFINE)
  if not analysis.affine_columns:
    return
  arrays, operands = tiles.capture_operands(analysis, 64, 64)

  def loader(ref, operand, start, size):
    return ref[tuple({"b": b, "h": h}.get(a, a) for a in operand.axes)]

  tile = tiles.TileContext(analysis, operands, blocked="q", loader=loader)
  at = lambda q, kv: tile.separable_part(b, h, jnp.int32(q), kv, arrays)
  for b, h, q0 in ((0, 0, 0), (1, 3, 40), (1, 2, 1000)):
    vector = at(q0, q0 + jnp.arange(16, dtype=jnp.int32)) - at(q0, jnp.int32(q0))
    for k0 in (0, 16, 48, 2048):
      shift = at(q0, jnp.int32(k0)) - at(q0, jnp.int32(q0))
      direct = at(q0, k0 + jnp.arange(16, dtype=jnp.int32)) - at(q0, jnp.int32(q0))
      np.testing.assert_allclose(vector + shift, direct, rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("score_mod,expected", [
    (lambda s, b, h, q, kv: s + 0.5 * kv.astype(jnp.float32) + 3.0, True),
    (lambda s, b, h, q, kv: s - (2 * kv - q).astype(jnp.float32) * (1 / 7.0), True),
    (lambda s, b, h, q, kv: s - (2 * kv - q).astype(jnp.float32) / 7.0, False),
    (lambda s, b, h, q, kv: s + jnp.log1p(kv.astype(jnp.float32)), False),
    (lambda s, b, h, q, kv: s + ((kv * 3) // 2).astype(jnp.float32), False),
    (lambda s, b, h, q, kv: s + jnp.sqrt(q.astype(jnp.float32)) + kv.astype(jnp.float32), True),
], ids=["scaled_plus_constant", "product", "float_division", "log", "integer_division",
        "row_function"])
def test_kv_affinity_rules(score_mod, expected):
  index = jnp.int32(0)
  jaxpr = jax.make_jaxpr(score_mod)(jnp.float32(0), index, index, index, index).jaxpr
  names = ("score", "b", "h", "q", "kv")
  assert separable.is_separable(jaxpr, names)
  assert separable.kv_part_is_affine(jaxpr, names) == expected
