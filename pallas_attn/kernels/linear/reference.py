"""Plain-JAX linear attention: token-by-token `lax.scan` references and
chunked jnp versions, for the additive update (the pure-XLA baseline of
`benchmarks/linear.py`) and for the delta rule.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_attn.kernels.linear.chunked_forward import LOG_DECAY_FLOOR
from pallas_attn.kernels.linear.triangular import invert_unit_lower
from pallas_attn.kernels.online import LOG2E

_HIGHEST = lax.Precision.HIGHEST


def _expand_log_decay(log_decay, batch: int, seq_len: int, heads: int):
  """log_decay as float32 [B, S, H, 1 or Dk'] (zeros when None)."""
  if log_decay is None:
    return jnp.zeros((batch, seq_len, heads, 1), jnp.float32)
  log_decay = log_decay.astype(jnp.float32)
  if log_decay.ndim == 1:
    log_decay = jnp.broadcast_to(log_decay, (batch, seq_len, heads))
  if log_decay.ndim == 3:
    log_decay = log_decay[..., None]
  return log_decay


def _float32_features(q, k, v, q_mod, k_mod):
  """q, k (through their feature maps) and v in float32."""
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  q = q if q_mod is None else q_mod(q).astype(jnp.float32)
  k = k if k_mod is None else k_mod(k).astype(jnp.float32)
  return q, k, v


def linear_attention_reference(q, k, v, *, log_decay=None, q_mod=None,
                               k_mod=None, normalize=False, scale=None,
                               initial_state=None):
  """The recurrence of `pallas_attn.linear_attention`, one token at a time.

  Everything runs in float32 with HIGHEST-precision contractions. Same
  arguments as `linear_attention`; returns (o [B, S, H, Dv] float32, final
  state [B, H, Dk', Dv], plus the normaliser column with `normalize`).
  """
  batch, seq_len, heads, d_qk = q.shape
  scale = 1.0 / math.sqrt(d_qk) if scale is None else scale
  q, k, v = _float32_features(q, k, v, q_mod, k_mod)
  log_decay = _expand_log_decay(log_decay, batch, seq_len, heads)
  d_feature, d_v = k.shape[-1], v.shape[-1]
  if initial_state is None:
    state = jnp.zeros((batch, heads, d_feature, d_v), jnp.float32)
    norm = jnp.zeros((batch, heads, d_feature), jnp.float32)
  else:
    initial_state = initial_state.astype(jnp.float32)
    state = initial_state[..., :d_v]
    norm = (initial_state[..., d_v] if normalize else
            jnp.zeros((batch, heads, d_feature), jnp.float32))

  def step(carry, inputs):
    state, norm = carry
    q_t, k_t, v_t, g_t = inputs  # [B, H, D]
    decay = jnp.exp(g_t)
    state = decay[..., None] * state + k_t[..., :, None] * v_t[..., None, :]
    norm = decay * norm + k_t
    o_t = scale * jnp.einsum("bhk,bhkv->bhv", q_t, state, precision=_HIGHEST)
    if normalize:
      o_t = o_t / (scale * jnp.sum(q_t * norm, axis=-1, keepdims=True))
    return (state, norm), o_t

  time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, log_decay)]
  (state, norm), o = lax.scan(step, (state, norm), time_major)
  if normalize:
    state = jnp.concatenate([state, norm[..., None]], axis=-1)
  return jnp.moveaxis(o, 0, 1), state


def chunk_cumulative_log_decay(log_decay, chunk_size: int):
  """jnp version of `chunked_forward.chunk_cumulative_log_decay`: base-2
  inclusive cumulative sums of the step log decays, clamped to
  `LOG_DECAY_FLOOR`, within chunks."""
  batch, seq_len = log_decay.shape[:2]
  steps = jnp.maximum(log_decay.astype(jnp.float32), LOG_DECAY_FLOOR)
  chunks = steps.reshape(
      batch, seq_len // chunk_size, chunk_size, *log_decay.shape[2:])
  return jnp.cumsum(chunks * LOG2E, axis=2).reshape(log_decay.shape)


def chunked_linear_attention_jnp(q, k, v, *, log_decay=None, scale=None,
                                 initial_state=None, chunk_size: int = 64):
  """Chunk-parallel linear attention in jnp (no feature maps, no normaliser).

  The baseline a JAX user would write: per chunk, `(Q K^T * D) V` plus the
  carried state, with a `lax.scan` over chunks. A vector gate is factored as
  q * exp(g) and k * exp(-g) around the chunk start (g the chunk-cumulative
  log decay), which overflows once a chunk's decay passes exp(-88); the
  Pallas kernels avoid that, this baseline does not. S must be a multiple of
  `chunk_size`. Returns (o float32, final state).
  """
  batch, seq_len, heads, d_qk = q.shape
  d_v = v.shape[-1]
  scale = 1.0 / math.sqrt(d_qk) if scale is None else scale
  num_chunks = seq_len // chunk_size
  if num_chunks * chunk_size != seq_len:
    raise ValueError(f"S={seq_len} must be a multiple of chunk_size="
                     f"{chunk_size}.")

  def chunks(x):  # [B, S, H, D] -> [N, B, H, C, D]
    x = x.astype(jnp.float32).reshape(batch, num_chunks, chunk_size, heads, -1)
    return jnp.transpose(x, (1, 0, 3, 2, 4))

  g = jnp.cumsum(chunks(_expand_log_decay(log_decay, batch, seq_len, heads)),
                 axis=3)
  g_last = g[:, :, :, -1:]
  q_c, k_c, v_c = chunks(q), chunks(k), chunks(v)
  causal = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
  if g.shape[-1] == 1:  # scalar decay: an exact decay matrix
    diff = g[..., :, None, 0] - g[..., None, :, 0]
    scores = jnp.einsum("nbhik,nbhjk->nbhij", q_c, k_c, precision=_HIGHEST)
    scores = jnp.where(causal, scores * jnp.exp(jnp.where(causal, diff, 0.0)),
                       0.0)
  else:
    scores = jnp.einsum("nbhik,nbhjk->nbhij", q_c * jnp.exp(g),
                        k_c * jnp.exp(-g), precision=_HIGHEST)
    scores = jnp.where(causal, scores, 0.0)
  intra = jnp.einsum("nbhij,nbhjv->nbhiv", scores, v_c, precision=_HIGHEST)
  q_in = q_c * jnp.exp(g)
  k_out = k_c * jnp.exp(g_last - g)
  state_decay = jnp.exp(jnp.swapaxes(g_last, -1, -2))  # [N, B, H, Dk or 1, 1]

  def carry_state(state, inputs):
    q_in, k_out, v, decay = inputs
    out = jnp.einsum("bhik,bhkv->bhiv", q_in, state, precision=_HIGHEST)
    state = decay * state + jnp.einsum("bhjk,bhjv->bhkv", k_out, v,
                                       precision=_HIGHEST)
    return state, out

  if initial_state is None:
    initial_state = jnp.zeros((batch, heads, d_qk, d_v), jnp.float32)
  final_state, inter = lax.scan(carry_state, initial_state.astype(jnp.float32),
                                (q_in, k_out, v_c, state_decay))
  o = scale * (intra + inter)  # [N, B, H, C, Dv]
  o = jnp.transpose(o, (1, 0, 3, 2, 4)).reshape(batch, seq_len, heads, d_v)
  return o, final_state


def delta_rule_reference(q, k, v, beta, *, log_decay=None, q_mod=None,
                         k_mod=None, scale=None, initial_state=None):
  """The delta rule of `pallas_attn.linear_attention(..., beta=...)`, one
  token at a time, written from its formula:

      A_t = diag(exp(log_decay_t))
      S_t = A_t S_{t-1} + beta_t phi(k_t)^T (v_t - phi(k_t) A_t S_{t-1})
      o_t = scale * phi(q_t) S_t

  float32 throughout, HIGHEST-precision contractions. beta: [B, S, H];
  log_decay as in `linear_attention`. Returns (o [B, S, H, Dv] float32,
  final state [B, H, Dk', Dv]).
  """
  batch, seq_len, heads, d_qk = q.shape
  scale = 1.0 / math.sqrt(d_qk) if scale is None else scale
  q, k, v = _float32_features(q, k, v, q_mod, k_mod)
  log_decay = _expand_log_decay(log_decay, batch, seq_len, heads)
  if initial_state is None:
    initial_state = jnp.zeros((batch, heads, k.shape[-1], v.shape[-1]))

  def step(state, inputs):
    q_t, k_t, v_t, beta_t, g_t = inputs  # [B, H, D], beta_t [B, H]
    decayed = jnp.exp(g_t)[..., None] * state
    predicted = jnp.einsum("bhk,bhkv->bhv", k_t, decayed, precision=_HIGHEST)
    correction = beta_t[..., None] * (v_t - predicted)
    state = decayed + k_t[..., :, None] * correction[..., None, :]
    o_t = scale * jnp.einsum("bhk,bhkv->bhv", q_t, state, precision=_HIGHEST)
    return state, o_t

  time_major = [jnp.moveaxis(x, 1, 0)
                for x in (q, k, v, beta.astype(jnp.float32), log_decay)]
  state, o = lax.scan(step, initial_state.astype(jnp.float32), time_major)
  return jnp.moveaxis(o, 0, 1), state


def _decayed_products(x, k, g, *, strict: bool):
  """[..., C, C]: sum_d x_id k_jd exp(g_id - g_jd) for i > j (strict) or
  i >= j, else 0. g [..., C, 1 or Dk]; exp is only taken on the mask, where
  the exponent is <= 0."""
  size = x.shape[-2]
  mask = jnp.tril(jnp.ones((size, size), bool), -1 if strict else 0)
  diff = g[..., :, None, :] - g[..., None, :, :]  # [..., C, C, 1 or Dk]
  decay = jnp.exp(jnp.where(mask[..., None], diff, -jnp.inf))
  if g.shape[-1] == 1:
    products = jnp.einsum("...id,...jd->...ij", x, k, precision=_HIGHEST)
    return products * decay[..., 0]
  return jnp.sum(x[..., :, None, :] * k[..., None, :, :] * decay, axis=-1)


def _to_chunks(x, chunk_size: int):
  """[B, S, H, D] -> float32 [N, B, H, C, D], zero padded to whole chunks."""
  batch, seq_len, heads = x.shape[:3]
  num_chunks = -(-seq_len // chunk_size)
  x = jnp.pad(x.astype(jnp.float32),
              [(0, 0), (0, num_chunks * chunk_size - seq_len), (0, 0), (0, 0)])
  x = x.reshape(batch, num_chunks, chunk_size, heads, -1)
  return jnp.transpose(x, (1, 0, 3, 2, 4))


def _from_chunks(x, seq_len: int):
  """[N, B, H, C, D] -> [B, S, H, D], the padding dropped."""
  num_chunks, batch, heads, chunk_size = x.shape[:4]
  x = jnp.transpose(x, (1, 0, 3, 2, 4))
  return x.reshape(batch, num_chunks * chunk_size, heads, -1)[:, :seq_len]


def _delta_rule_chunk(state, inputs, *, scale):
  """One chunk of the delta rule in the WY form (see
  `chunked_delta_rule_jnp`): (state leaving, o). state [B, H, Dk, Dv];
  inputs q, k, v, beta, step log decays [B, H, C, D] (beta [B, H, C, 1],
  log decays [B, H, C, 1 or Dk], clamped to `LOG_DECAY_FLOOR` here)."""
  q, k, v, beta, log_decay = inputs
  g = jnp.cumsum(jnp.maximum(log_decay, LOG_DECAY_FLOOR), axis=-2)
  mm = functools.partial(jnp.einsum, precision=_HIGHEST)
  transform = invert_unit_lower(
      beta * _decayed_products(k, k, g, strict=True))
  w = mm("...ij,...jd->...id", transform, beta * k * jnp.exp(g))
  u = mm("...ij,...jv->...iv", transform, beta * v)
  new_values = u - mm("...ck,...kv->...cv", w, state)
  o = scale * (mm("...ck,...kv->...cv", q * jnp.exp(g), state)
               + mm("...ij,...jv->...iv",
                    _decayed_products(q, k, g, strict=False), new_values))
  g_last = g[..., -1:, :]
  state = (jnp.swapaxes(jnp.exp(g_last), -1, -2) * state
           + mm("...ck,...cv->...kv", k * jnp.exp(g_last - g), new_values))
  return state, o


def chunked_delta_rule_jnp(q, k, v, beta, *, log_decay=None, scale=None,
                           initial_state=None, chunk_size: int = 64):
  """The delta rule chunk by chunk in jnp, by the WY representation.

  Within a chunk with cumulative log decays g and entering state S0, the
  pseudo-values U_t = beta_t (v_t - k_t A_t S_{t-1}) solve the
  unit-lower-triangular system (I + L) U = beta (V - (K exp(g)) S0), with
  L_ij = beta_i sum_d k_id k_jd exp(g_id - g_jd) for i > j (the UT
  transform). With T = (I + L)^-1, W = T (beta K exp(g)) and
  U~ = T (beta V), U = U~ - W S0; the chunk is then ordinary decayed linear
  attention with values U:

      o = scale * ((Q exp(g)) S0 + (Q K^T * decay) U)
      S = exp(g_last) S0 + (K exp(g_last - g))^T U

  No feature maps (apply them first); S need not be a multiple of
  `chunk_size` (zero padding: beta = 0 steps leave the state unchanged).
  Step log decays are clamped to `LOG_DECAY_FLOOR` as the kernels do. The
  chunk step is rematerialised under autodiff, so that its gradient keeps
  one state per chunk. Returns (o float32, final state).
  """
  batch, seq_len, heads, d_qk = q.shape
  scale = 1.0 / math.sqrt(d_qk) if scale is None else scale
  log_decay = _expand_log_decay(log_decay, batch, seq_len, heads)
  inputs = tuple(_to_chunks(x, chunk_size)
                 for x in (q, k, v, beta[..., None], log_decay))
  if initial_state is None:
    initial_state = jnp.zeros((batch, heads, d_qk, v.shape[-1]))
  step = jax.checkpoint(functools.partial(_delta_rule_chunk, scale=scale))
  final_state, o = lax.scan(step, initial_state.astype(jnp.float32), inputs)
  return _from_chunks(o, seq_len), final_state
