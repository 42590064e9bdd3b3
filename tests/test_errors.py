"""Bad input gets a clear error, never a silent wrong answer."""
import jax
import jax.numpy as jnp
import pytest

import pallas_attn as pa
from conftest import qkv


def test_shape_and_dtype_errors():
  q, k, v = qkv()
  with pytest.raises(ValueError, match="batch, seq, heads, head_dim"):
    pa.attention(q[0], k, v)
  with pytest.raises(ValueError, match="head dims differ"):
    pa.attention(q[..., :8], k, v)
  with pytest.raises(ValueError, match="multiple of kv heads"):
    pa.attention(q[:, :, :3], k, v)
  with pytest.raises(ValueError, match="sequence lengths differ"):
    pa.attention(q, k, v[:, :5])
  with pytest.raises(TypeError, match="share a dtype"):
    pa.attention(q, k.astype(jnp.bfloat16), v)
  with pytest.raises(TypeError, match="dtype int32"):
    pa.attention(q.astype(jnp.int32), k, v)
  with pytest.raises(TypeError, match="config must be"):
    pa.attention(q, k, v, config=(64, 64))


def test_unsupported_primitive_is_named_with_line():
  q, k, v = qkv()
  table = jnp.arange(10.0)
  def score_mod(s, b, h, qi, ki):
    return s + jnp.cumsum(table)[3]
  with pytest.raises(pa.VariantError, match=r"cumsum.*test_errors.py:\d+"):
    pa.attention(q, k, v, score_mod=score_mod)


def test_python_control_flow_on_traced_values():
  q, k, v = qkv()
  def score_mod(s, b, h, qi, ki):
    if qi > ki:
      return s
    return s * 2.0
  with pytest.raises(pa.VariantError, match=r"control flow.*test_errors.py:\d+.*jnp.where"):
    pa.attention(q, k, v, score_mod=score_mod)


def test_rownorm_not_online_decomposable():
  q, k, v = qkv()
  centered = lambda row: jax.nn.softmax(row - jnp.mean(row, -1, keepdims=True) ** 2)
  with pytest.raises(pa.VariantError, match="not online-decomposable|depends on a row reduction"):
    pa.attention(q, k, v, rownorm=lambda r: r - jnp.mean(r, -1, keepdims=True) ** 2)
  with pytest.raises(pa.VariantError, match="Unknown rownorm"):
    pa.attention(q, k, v, rownorm="entmax")
  with pytest.raises(pa.VariantError, match="sort"):
    pa.attention(q, k, v, rownorm=lambda r: jnp.sort(r, axis=-1))
  del centered


def test_capture_read_whole_is_rejected():
  q, k, v = qkv()
  table = jnp.ones((4, 45))
  with pytest.raises(pa.VariantError, match="one scalar"):
    pa.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * table[h])


def test_mask_mod_must_return_bool_and_score_mod_a_scalar():
  q, k, v = qkv()
  with pytest.raises(pa.VariantError, match="expected a boolean"):
    pa.attention(q, k, v, mask_mod=lambda b, h, qi, ki: qi - ki)
  with pytest.raises(pa.VariantError, match="one scalar"):
    pa.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: jnp.broadcast_to(s, (2,)))
  with pytest.raises(pa.VariantError, match="'stack'"):
    pa.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: jnp.stack([s, s]))
