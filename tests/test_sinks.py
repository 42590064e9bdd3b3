"""Attention sinks: per-head sink logits (`sinks=` / `variants.sink`) and
rownorms with a constant sink term, against the dense reference, forward
and gradients (the sink logits' included)."""
import jax
import jax.numpy as jnp
import pytest

import pallas_attn as pa
from conftest import MODES, assert_close, modes, qkv, random
from pallas_attn import variants as V
from test_attention_backward import SMALL, check_gradients

CAUSAL = lambda b, h, qi, ki: qi >= ki
WINDOW = lambda b, h, qi, ki: (qi >= ki) & (qi - ki < 5)  # rows 0..: some keys masked


def shifted_sink_softmax(row):
  """A softmax with a constant sink of logit 0.5, max-shifted, in base 2."""
  m = jnp.max(row, axis=-1, keepdims=True)
  e = jnp.exp2(row - m)
  return e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp2(0.5 - m))


def unshifted_sink_softmax(row):
  e = jnp.exp(row)
  return e / (2.0 + jnp.sum(e, axis=-1, keepdims=True))


SINK_CASES = {f"{dtype_id}-{mask_id}": (mask_mod, dtype)
              for mask_id, mask_mod in (("dense", None), ("causal", CAUSAL), ("window", WINDOW))
              for dtype_id, dtype in (("fp32", jnp.float32), ("bf16", jnp.bfloat16))}


# Interpret mode: every mask in float32, bfloat16 with the window (masked keys and
# rows): the dtype's handling does not depend on the mask.
@pytest.mark.parametrize("mask_mod,dtype,interpret", modes(
    SINK_CASES, ["fp32-dense", "fp32-causal", "fp32-window", "bf16-window"]))
def test_per_head_sinks_forward_and_gradients(mask_mod, dtype, interpret):
  """Output, lse and gradients (the sink logits' included) with per-head sinks."""
  q, k, v = qkv(dtype=dtype)
  sinks = 2.0 * random((q.shape[2],), seed=7)
  out, lse = pa.attention(q, k, v, sinks=sinks, mask_mod=mask_mod, config=SMALL,
                          interpret=interpret, return_lse=True)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  ref, ref_lse = pa.attention_reference(*f32, sinks=sinks, mask_mod=mask_mod, return_lse=True)
  assert_close(out, ref, dtype)
  assert_close(lse, ref_lse, dtype)
  check_gradients(q, k, v, {"sinks": sinks}, dtype=dtype, interpret=interpret,
                  make_kwargs=lambda c: dict(sinks=c["sinks"], mask_mod=mask_mod))


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("rownorm", [V.off_by_one_softmax, shifted_sink_softmax,
                                     unshifted_sink_softmax], ids=["off_by_one", "exp2", "plain"])
def test_rownorm_with_a_constant_sink(rownorm, interpret):
  analysis = pa.analyze_variant(rownorm=rownorm)
  assert analysis.rownorm.kind == "softmax" and analysis.rownorm.sink is not None
  q, k, v = qkv()
  out = pa.attention(q, k, v, rownorm=rownorm, mask_mod=CAUSAL, config=SMALL,
                     interpret=interpret)
  assert_close(out, pa.attention_reference(q, k, v, rownorm=rownorm, mask_mod=CAUSAL))
  check_gradients(q, k, v, make_kwargs=lambda c: dict(rownorm=rownorm), interpret=interpret)


def test_off_by_one_equals_a_zero_sink():
  q, k, v = qkv()
  zero = jnp.zeros((q.shape[2],))
  assert_close(pa.attention(q, k, v, rownorm=V.off_by_one_softmax, config=SMALL),
               pa.attention(q, k, v, sinks=zero, config=SMALL))


def test_fully_masked_rows_return_zeros_and_the_sink_lse():
  """A row with no key left puts all its weight on the sink: output 0, lse = sink."""
  q, k, v = qkv(seq_q=20, seq_kv=20)
  sinks = random((q.shape[2],), seed=3)
  nothing_for_early_rows = lambda b, h, qi, ki: (qi >= 8) & (ki <= qi)
  out, lse = pa.attention(q, k, v, sinks=sinks, mask_mod=nothing_for_early_rows,
                          config=SMALL, return_lse=True)
  assert float(jnp.max(jnp.abs(out[:, :8]))) == 0.0
  assert_close(lse[:, :, :8], jnp.broadcast_to(sinks[None, :, None], lse[:, :, :8].shape))


def test_sink_variant_composes_and_runs_under_jit_with_closed_over_logits():
  q, k, v = qkv()
  sinks = random((q.shape[2],), seed=5)
  variant = V.sink(sinks) + V.causal() + V.softcap(20.0)
  assert set(variant.kwargs()) == {"score_mod", "mask_mod", "rownorm", "sinks"}
  out = jax.jit(lambda q, k, v: pa.attention(q, k, v, **variant.kwargs(), config=SMALL))(q, k, v)
  assert_close(out, pa.attention_reference(q, k, v, **variant.kwargs()))
  with pytest.raises(ValueError, match="two variants with sinks"):
    V.sink(sinks) + V.sink(sinks)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(sinks=jnp.zeros((3,))), ValueError, r"\[Hq\] = \[4\]"),
    (dict(sinks=jnp.zeros((4,), jnp.int32)), TypeError, "floating point"),
    (dict(sinks=jnp.zeros((4,)), rownorm="sigmoid"), ValueError, "softmax denominator"),
    (dict(sinks=jnp.zeros((4,)), rownorm=V.off_by_one_softmax), ValueError, "not both"),
])
def test_sink_errors(kwargs, error, match):
  q, k, v = qkv()
  with pytest.raises(error, match=match):
    pa.attention(q, k, v, **kwargs)


def test_a_sink_term_that_is_not_shifted_with_the_scores_is_rejected():
  """`1 + sum(exp(s - m))` is not a sink: its weight would change with the row max."""
  def bad(row):
    e = jnp.exp(row - jnp.max(row, axis=-1, keepdims=True))
    return e / (1.0 + jnp.sum(e, axis=-1, keepdims=True))
  with pytest.raises(pa.VariantError, match="sink term"):
    pa.analyze_variant(rownorm=bad)
