"""The chunked template's Mosaic GPU forward (kernels/linear/mosaic_forward.py)
against the lax.scan reference and the Triton passes, compiled on Hopper;
its choice and fallbacks everywhere.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random
from pallas_attn import LinearAttentionConfig
from pallas_attn.kernels import mosaic_backend as mb
from pallas_attn.kernels.linear import mosaic_forward
from pallas_attn.kernels.linear.reference import (delta_rule_reference,
                                                  linear_attention_reference)
from pallas_attn.linear import linear_attention, linear_attention_lowering

TOL = {jnp.bfloat16: 2e-2, jnp.float16: 5e-3}


def _case(batch, seq, heads, d_k, d_v, kind, dtype, seed=0):
  q, k = (random((batch, seq, heads, d_k), dtype, seed + i) for i in range(2))
  v = random((batch, seq, heads, d_v), dtype, seed + 2)
  log_decay = None
  if kind == "per_head":
    log_decay = -jnp.linspace(0.01, 0.5, heads)
  elif kind in ("scalar", "vector", "strong_vector"):
    gate = (batch, seq, heads) + (() if kind == "scalar" else (d_k,))
    u = random(gate, seed=seed + 3, distribution="uniform")
    # strong_vector: up to 6 per step, spans past SPAN_LIMIT (the Triton passes run)
    log_decay = -(0.01 + 0.99 * u) * (6.0 if kind == "strong_vector" else 1.0)
  state = random((batch, heads, d_k, d_v), jnp.float32, seed + 4)
  return q, k, v, log_decay, state


def _rel_err(actual, expected):
  actual, expected = (np.asarray(jnp.asarray(x, jnp.float32)) for x in (actual, expected))
  assert actual.shape == expected.shape
  assert np.all(np.isfinite(actual)), "non-finite values"
  return np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-6)


# (batch, seq, heads, d_k, d_v, kind, dtype): ragged S, Dv below a block, Mamba2's
# head dim 64 with state 128, fp16, GLA's per-feature gates (strong ones past
# SPAN_LIMIT take the Triton passes at run time); asked for explicitly (the default
# takes Triton for grids this small).
CASES = {
    "scalar-bf16": (2, 200, 4, 128, 128, "scalar", jnp.bfloat16),
    "none-bf16": (2, 130, 4, 128, 64, "none", jnp.bfloat16),
    "per_head-fp16": (1, 256, 3, 64, 64, "per_head", jnp.float16),
    "mamba2-like": (1, 192, 6, 128, 64, "scalar", jnp.bfloat16),
    "narrow-dv": (2, 100, 2, 64, 40, "scalar", jnp.bfloat16),
    "gla-bf16": (2, 200, 4, 128, 128, "vector", jnp.bfloat16),
    "gla-d64": (1, 130, 3, 64, 64, "vector", jnp.bfloat16),
    "gla-strong": (1, 128, 2, 128, 64, "strong_vector", jnp.bfloat16),
}


@pytest.mark.hopper
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_forward_and_state_match_reference(case):
  *shape, kind, dtype = case
  q, k, v, log_decay, state = _case(*shape, kind, dtype)
  run = jax.jit(lambda *a: linear_attention(*a[:3], log_decay=a[3], initial_state=a[4],
                                            return_final_state=True,
                                            implementation="mosaic_gpu"))
  o, final = run(q, k, v, log_decay, state)
  o_ref, final_ref = linear_attention_reference(q, k, v, log_decay=log_decay,
                                                initial_state=state)
  assert o.dtype == dtype
  assert _rel_err(o, o_ref) <= TOL[dtype]
  assert _rel_err(final, final_ref) <= TOL[dtype]
  o_triton = linear_attention(q, k, v, log_decay=log_decay, initial_state=state,
                              implementation="triton")
  assert _rel_err(o, o_triton) <= TOL[dtype]


@pytest.mark.hopper
@pytest.mark.parametrize("kind", ["scalar", "none", "vector"])
def test_gradients_through_mosaic_states(kind):
  """The Triton backward reads the states the Mosaic forward stored."""
  q, k, v, log_decay, state = _case(2, 160, 4, 128, 64, kind, jnp.bfloat16, seed=7)
  args = (q, k, v, state) + (() if log_decay is None else (log_decay,))

  def loss(attention, q, k, v, state, *log_decay):
    o, final = attention(q, k, v, log_decay=log_decay[0] if log_decay else None,
                         initial_state=state)
    weights = random(o.shape, jnp.float32, 11)
    return jnp.sum(o.astype(jnp.float32) * weights) + jnp.sum(final * final) * 1e-2

  ours = lambda *a, **kw: linear_attention(*a, implementation="mosaic_gpu",
                                           return_final_state=True, **kw)
  argnums = tuple(range(len(args)))
  grads = jax.jit(jax.grad(lambda *a: loss(ours, *a), argnums))(*args)
  expected = jax.grad(lambda *a: loss(linear_attention_reference, *a), argnums)(
      *(x.astype(jnp.float32) for x in args))
  for name, g, e in zip(["dq", "dk", "dv", "d_state", "d_log_decay"], grads, expected):
    assert _rel_err(g, e) <= 3e-2, name


@pytest.mark.hopper
@pytest.mark.parametrize("stages", [3, 4])
def test_deeper_rings_than_fit_take_fewer_slots(stages):
  """A config's num_stages deeper than a kernel's rings fit (GLA's at d 128:
  two slots forward and backward) runs with the slots that fit."""
  q, k, v, log_decay, _ = _case(1, 192, 2, 128, 128, "vector", jnp.bfloat16, seed=3)
  config = LinearAttentionConfig(chunk_size=64, block_v=64, num_stages=stages)
  weights = random(v.shape, jnp.float32, 12)

  def loss(attention, *args):
    return jnp.sum(attention(*args[:3], log_decay=args[3]).astype(jnp.float32) * weights)

  ours = lambda *a, **kw: linear_attention(*a, config=config, implementation="mosaic_gpu", **kw)
  grads = jax.jit(jax.grad(lambda *a: loss(ours, *a), (0, 1, 2, 3)))(q, k, v, log_decay)
  reference = lambda *a, **kw: linear_attention_reference(*a, **kw)[0]
  expected = jax.grad(lambda *a: loss(reference, *a), (0, 1, 2, 3))(
      *(x.astype(jnp.float32) for x in (q, k, v, log_decay)))
  for name, g, e in zip(["dq", "dk", "dv", "d_log_decay"], grads, expected):
    assert _rel_err(g, e) <= 3e-2, name


@pytest.mark.skipif(mb.plgpu is None, reason="this JAX has no Mosaic GPU")
def test_ring_depth_fits_shared_memory():
  slots = lambda kib: lambda n: [mb.plgpu.SMEM((n, kib, 512), jnp.bfloat16)]  # kib KiB a slot
  assert mb.deepest_ring(slots(64), 2) == 2 and mb.deepest_ring(slots(64), 4) == 3
  assert mb.deepest_ring(slots(256), 3) == 1


def test_choice_and_fallbacks():
  """Off Hopper, or outside the kernel's scope, Triton runs and says why;
  asking for Mosaic there raises with the reason."""
  q, k, v, log_decay, _ = _case(1, 64, 2, 32, 32, "scalar", jnp.float32)
  lowering = linear_attention_lowering(q, k, v, log_decay=log_decay)
  assert lowering.forward == "triton" and lowering.reason
  assert "triton" in lowering.describe()
  with pytest.raises(ValueError, match="implementation='mosaic_gpu' cannot run"):
    linear_attention(q, k, v, log_decay=log_decay, implementation="mosaic_gpu")
  with pytest.raises(ValueError, match="implementation must be"):
    linear_attention(q, k, v, implementation="cuda")
  common = dict(dtype=jnp.bfloat16, out_dtype=jnp.bfloat16, d_feature=128,
                d_values=128, chunk_size=64)
  if mosaic_forward.obstacle(decay_kind="scalar", **common) is None:  # a Hopper GPU
    assert mosaic_forward.obstacle(decay_kind="vector", **common) is None
    assert "bfloat16's exponent range" in mosaic_forward.obstacle(
        decay_kind="vector", **{**common, "dtype": jnp.float16})
    assert "float32" in mosaic_forward.obstacle(
        decay_kind="scalar", **{**common, "dtype": jnp.float32})
  assert "programs" in mosaic_forward.too_few_programs(32, 132)
  assert mosaic_forward.too_few_programs(64, 132) is None


def test_gates_in_range_bounds_the_anchored_factors():
  """The vector kind's spans, from a chunk's first row to its anchor and from
  the anchor to its last, in base 2, against SPAN_LIMIT."""
  chunk, anchor, limit = mosaic_forward.CHUNK, mosaic_forward.ANCHOR, mosaic_forward.SPAN_LIMIT
  step = jnp.full((1, 2 * chunk, 1, 4), -0.5, jnp.float32)  # base 2 per step
  cumulative = jnp.cumsum(step.reshape(1, 2, chunk, 1, 4), axis=2).reshape(step.shape)
  assert bool(mosaic_forward.gates_in_range(cumulative))  # spans 0.5 * 32
  strong = cumulative.at[0, chunk + anchor + 1:, 0, 3].add(-limit)  # past the anchor
  assert not bool(mosaic_forward.gates_in_range(strong))


def test_anchored_operands_carry_the_per_feature_decays():
  """The operands the kernel streams for per-feature gates: the scores' pair
  multiplies out to sum_d q_id k_jd 2^(g_id - g_jd) within each chunk (at
  i >= j, the scores the kernel keeps), the
  state's to Q 2^g and K 2^(g_last - g), g_last per chunk [B, H, S / C, Dk]."""
  chunk, batch, heads, width = mosaic_forward.CHUNK, 2, 3, 8
  shape = (batch, 2 * chunk, heads, width)
  q, k = (random(shape, jnp.float32, seed) for seed in (0, 1))
  steps = -jax.random.uniform(jax.random.key(2), shape, jnp.float32, 0.0, 0.3)
  g = jnp.cumsum(steps.reshape(batch, 2, chunk, heads, width), axis=2).reshape(shape)
  q_state, k_update, q_scores, k_scores, g_last = mosaic_forward.anchored_operands(q, k, g)
  chunked = lambda x: x.reshape(batch, 2, chunk, heads, width)
  gc = chunked(g)
  want = jnp.einsum("bcihd,bcjhd->bchij", chunked(q) * jnp.exp2(gc), chunked(k) * jnp.exp2(-gc))
  got = jnp.einsum("bcihd,bcjhd->bchij", chunked(q_scores), chunked(k_scores))
  causal = jnp.tril(jnp.ones((chunk, chunk), bool))
  np.testing.assert_allclose(jnp.where(causal, got, 0), jnp.where(causal, want, 0), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(chunked(q_state), chunked(q) * jnp.exp2(gc), rtol=1e-6)
  np.testing.assert_allclose(chunked(k_update),
                             chunked(k) * jnp.exp2(gc[:, :, -1:] - gc), rtol=1e-6)
  np.testing.assert_array_equal(g_last, jnp.transpose(gc[:, :, -1], (0, 2, 1, 3)))


@pytest.mark.hopper
def test_feature_maps_on_mosaic_and_normalize_on_triton():
  """Feature maps run before the kernel, so Mosaic takes them; normalize's
  float32 output keeps the default on Triton, and says so."""
  q, k, v, log_decay, _ = _case(4, 256, 16, 64, 64, "scalar", jnp.bfloat16)
  phi = lambda x: jax.nn.elu(x) + 1.0
  o = linear_attention(q, k, v, log_decay=log_decay, q_mod=phi, k_mod=phi,
                       implementation="mosaic_gpu")
  o_ref, _ = linear_attention_reference(q, k, v, log_decay=log_decay, q_mod=phi, k_mod=phi)
  assert _rel_err(o, o_ref) <= TOL[jnp.bfloat16]
  lowering = linear_attention_lowering(q, k, v, log_decay=log_decay, q_mod=phi, k_mod=phi,
                                       normalize=True)
  assert lowering.forward == "triton" and "normalize" in lowering.reason


@pytest.mark.hopper
def test_vmap_and_closures_on_mosaic():
  """Under jax.vmap, with the decays closed over by a jitted function."""
  q, k, v, log_decay, _ = _case(2, 128, 16, 64, 64, "scalar", jnp.bfloat16)
  attend = jax.jit(lambda q, k, v: linear_attention(q[None], k[None], v[None],
                                                    log_decay=log_decay[:1],
                                                    implementation="mosaic_gpu")[0])
  o = jax.vmap(attend)(q, k, v)
  o_ref, _ = linear_attention_reference(q, k, v, log_decay=jnp.broadcast_to(
      log_decay[:1], log_decay.shape))
  assert _rel_err(o, o_ref) <= TOL[jnp.bfloat16]


@pytest.mark.hopper
def test_backward_runs_on_the_forwards_lowering():
  q, k, v, log_decay, _ = _case(4, 256, 16, 128, 128, "scalar", jnp.bfloat16)
  for decay in (log_decay, jnp.broadcast_to(log_decay[..., None], q.shape)):
    lowering = linear_attention_lowering(q, k, v, log_decay=decay)
    assert (lowering.forward, lowering.backward) == ("mosaic_gpu", "mosaic_gpu")


@pytest.mark.hopper
@pytest.mark.parametrize("kind", ["none", "scalar", "vector"])
def test_delta_rule_forward_on_mosaic(kind):
  """DeltaNet, Gated DeltaNet and KDA: the UT transform, then the Mosaic kernel
  computing U = U~ - W S per chunk; L2-normed keys, ragged S, a state in and
  out. A differentiated call keeps Triton's chunks (checked by the delta-rule
  suite)."""
  q, k, v, log_decay, state = _case(2, 200, 16, 128, 128, kind, jnp.bfloat16, seed=3)
  l2 = lambda x: x / jnp.linalg.norm(x.astype(jnp.float32), axis=-1, keepdims=True)
  beta = jax.nn.sigmoid(random(q.shape[:3], jnp.float32, 9))
  args = dict(beta=beta, log_decay=log_decay, q_mod=l2, k_mod=l2, initial_state=state)
  o, final = linear_attention(q, k, v, return_final_state=True, implementation="mosaic_gpu",
                              **args)
  o_ref, final_ref = delta_rule_reference(q, k, v, **args)
  assert _rel_err(o, o_ref) <= TOL[jnp.bfloat16]
  assert _rel_err(final, final_ref) <= TOL[jnp.bfloat16]
  lowering = linear_attention_lowering(q, k, v, beta=beta, log_decay=log_decay)
  assert (lowering.forward, lowering.backward) == ("mosaic_gpu", "triton")
