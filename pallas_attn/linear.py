"""Linear attention: chunk-parallel Pallas kernels for decayed recurrences.

One recurrence covers linear transformers, RetNet, gated retention, GLA and
Mamba2's SSD. Per batch and head, with a state `S_t` of shape [Dk', Dv]:

    S_t = diag(exp(log_decay_t)) S_{t-1} + phi_k(k_t)^T v_t
    o_t = scale * phi_q(q_t) S_t                  (token t included)

Given `beta` [B, S, H], the state takes tokens in by the delta rule instead
(DeltaNet; Gated DeltaNet with a scalar decay, KDA with a per-feature one),
with A_t = diag(exp(log_decay_t)):

    S_t = A_t S_{t-1} + beta_t phi_k(k_t)^T (v_t - phi_k(k_t) A_t S_{t-1})

`linear_attention` runs it over a whole sequence (chunk-parallel forward and
backward kernels); `linear_attention_step` advances it by one token for
decoding. Both are differentiable in every array argument, including
`log_decay` and the state.

Recipes
-------
Mamba2 SSD (one SSM group per head; broadcast B/C over the heads of a group
first). With x [B, S, H, P], dt [B, S, H] (after softplus), A [H] (< 0),
B, C [B, S, H, N]::

    y = linear_attention(C, B, x * dt[..., None], log_decay=dt * A, scale=1.0)
    y = y + x * D[:, None]                       # skip connection, outside

RetNet (multi-scale retention, recurrent form): gamma [H] in (0, 1)::

    o = linear_attention(q, k, v, log_decay=jnp.log(gamma))

Gated retention / GLA: a data-dependent gate per step and head ([B, S, H]) or
per key feature ([B, S, H, Dk]), e.g.::

    o = linear_attention(q, k, v, log_decay=jax.nn.log_sigmoid(gate_logits))

Linear transformer (Katharopoulos et al.) with the elu+1 feature map and
the normaliser `scale * phi(q_t) . z_t`, z_t = sum of phi(k_j)::

    phi = lambda x: jax.nn.elu(x) + 1
    o = linear_attention(q, k, v, q_mod=phi, k_mod=phi, normalize=True)

Gated DeltaNet (Qwen3-Next's linear layers) and KDA (Kimi Linear), L2-normed
q and k, beta = sigmoid(b) (values up to 2 are allowed)::

    l2 = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    o = linear_attention(q, k, v, beta=jax.nn.sigmoid(b), q_mod=l2, k_mod=l2,
                         log_decay=log_decay)  # [B, S, H], or [B, S, H, Dk]

The delta rule's forward and backward are Pallas kernels (a UT transform
per chunk, then the template's passes: `pallas_attn.kernels.linear.
delta_rule`, `pallas_attn.vjp.delta_rule_backward`).

Random-feature attention: `q_mod`/`k_mod` may change the feature width, e.g.
`lambda x: jnp.concatenate([jnp.cos(x @ W), jnp.sin(x @ W)], -1)`.

Processing a long sequence in pieces, and decoding after a prompt::

    o1, state = linear_attention(q1, k1, v1, return_final_state=True)
    o2, state = linear_attention(q2, k2, v2, initial_state=state,
                                 return_final_state=True)
    o_t, state = linear_attention_step(q_t, k_t, v_t, state)

States are float32 [B, H, Dk', Dv]; with `normalize=True` they carry the
normaliser z as one extra last column, [B, H, Dk', Dv + 1].

Checks: shapes, dtypes and feature maps are validated eagerly; that
`log_decay <= 0` is checked only for concrete arrays, also ones a jitted
function closes over (an argument of `jax.jit` or `jax.grad` is a tracer and
cannot be inspected); a device array is read once while it lives, so eager
calls that reuse it do not sync. `-inf` (a hard reset)
is allowed; step log decays below -100 count as -100 (exp(-100) underflows
float32 anyway).

Feature maps run in plain JAX just before the kernels (XLA fuses them with
the padding the kernels need), so any jnp code works, including maps that
close over arrays, and their gradients come from JAX autodiff.
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_attn import _templates
from pallas_attn.kernels import backend
from pallas_attn.kernels import lowering as lowering_lib
from pallas_attn.kernels.linear import mosaic_forward
from pallas_attn.kernels.linear.chunked_forward import ChunkedSchedule
from pallas_attn.schedule import cache as tuning_cache
from pallas_attn.schedule.config import LinearAttentionConfig, next_power_of_2
from pallas_attn.schedule.device import device_config
from pallas_attn.schedule.template import ProblemShape, Template
from pallas_attn.spec import linear as spec_lib
from pallas_attn.vjp.delta_rule_backward import chunked_delta_rule
from pallas_attn.vjp.linear_backward import chunked_linear_attention

# The padded core compiled once per schedule, so that a second eager call of
# `linear_attention` reuses it (as `attention`'s core does) instead of
# retracing its kernels.
_delta_rule_core = jax.jit(chunked_delta_rule, static_argnums=6)
_linear_core = jax.jit(chunked_linear_attention, static_argnums=5)

FeatureMap = Callable[[jax.Array], jax.Array]


def _features(feature_map: FeatureMap | None, x):
  """phi(x) in x's dtype, outside the kernel for JAX to differentiate."""
  return x if feature_map is None else feature_map(x).astype(x.dtype)


def _pad_to(x, shape):
  return jnp.pad(x, [(0, n - m) for m, n in zip(x.shape, shape)])


def _kernel_log_decay(log_decay, spec: spec_lib.LinearAttentionSpec):
  """log_decay as the kernel sees it: None, [B, S, H] or [B, S, H, Dk'] in
  its own dtype (the decay-prefix kernel casts and clamps it)."""
  if log_decay is None:
    return None
  if spec.decay_kind == spec_lib.DECAY_PER_HEAD:
    return jnp.broadcast_to(log_decay, (spec.batch, spec.seq_len, spec.heads))
  return log_decay


def _kernel_decay_kind(kind: str) -> str:
  return "scalar" if kind == spec_lib.DECAY_PER_HEAD else kind


def tuned_template(spec: spec_lib.LinearAttentionSpec) -> Template:
  """The template whose config (LinearAttentionConfig) tiles this call: the
  chunked passes, or the delta rule's for its decay kind."""
  if spec.state_update != spec_lib.UPDATE_DELTA:
    return _templates.LINEAR_FORWARD
  return _templates.DELTA_RULE[_kernel_decay_kind(spec.decay_kind)]


def tile_shapes(spec: spec_lib.LinearAttentionSpec) -> tuple[tuple, tuple, tuple]:
  """The (q, k, v) shapes the tiles see: Dk' after the feature maps, Dv with
  normalize's ones column (the tuning cache's key shapes)."""
  rows = (spec.batch, spec.seq_len, spec.heads)
  return rows + (spec.d_feature,), rows + (spec.d_feature,), rows + (spec.d_v + spec.normalize,)


def resolve_config(spec: spec_lib.LinearAttentionSpec, chunk_size: int | None,
                   config) -> tuple[LinearAttentionConfig, int, int, int]:
  """(config, chunk, padded Dk', padded Dv') of a call: the given config,
  else (None or "auto") the one `tune_linear_attention` stored for this
  variant and shape bucket, else the template's default; `chunk_size`
  overrides the chunk. Dv' counts normalize's ones column."""
  if not isinstance(config, LinearAttentionConfig):
    template, shapes = tuned_template(spec), tile_shapes(spec)
    config = (tuning_cache.lookup_config(template.name, spec.fingerprint(), q_shape=shapes[0],
                                         k_shape=shapes[1], v_shape=shapes[2], dtype=spec.dtype)
              or template.default_config(ProblemShape.from_shapes(*shapes, spec.dtype)))
  d_values = spec.d_v + int(spec.normalize)
  return (config, chunk_size or config.chunk_size, next_power_of_2(max(spec.d_feature, 16)),
          next_power_of_2(max(d_values, 16)))


def _out_dtype(spec: spec_lib.LinearAttentionSpec) -> str:
  """The kernels' output dtype: float32 under normalize (its ones column)."""
  return jnp.dtype(jnp.float32 if spec.normalize else spec.dtype).name


def _choose_lowering(implementation: str | None, spec: spec_lib.LinearAttentionSpec, *,
                     d_feature: int, d_values: int, chunk: int,
                     interpret: bool) -> lowering_lib.Lowering:
  """The forward's lowering: Mosaic GPU where its kernel runs the call
  (kernels/linear/mosaic_forward.py) and has the programs to fill the GPU,
  else Triton; an explicit "mosaic_gpu" that cannot run raises with the
  reason."""
  if implementation not in (None, *lowering_lib.IMPLEMENTATIONS):
    raise ValueError(f"implementation must be None, 'mosaic_gpu' or 'triton'; got "
                     f"{implementation!r}")
  if implementation == lowering_lib.TRITON:
    asked = "implementation='triton' was asked for"
    return lowering_lib.Lowering(lowering_lib.TRITON, asked, lowering_lib.TRITON, asked)
  delta = spec.state_update == spec_lib.UPDATE_DELTA
  why = mosaic_forward.obstacle(  # the delta rule's Mosaic forward takes its own chunks
      decay_kind=_kernel_decay_kind(spec.decay_kind), dtype=spec.dtype,
      out_dtype=_out_dtype(spec), d_feature=d_feature, d_values=d_values,
      chunk_size=mosaic_forward.CHUNK if delta else chunk)
  if why is None and interpret:
    why = "interpret mode (the Mosaic GPU kernel runs compiled only)"
  if why is None and implementation is None:
    why = mosaic_forward.too_few_programs(
        spec.batch * spec.heads * (d_values // mosaic_forward.BLOCK_V), device_config().sm_count)
  if why is not None and implementation == lowering_lib.MOSAIC_GPU:
    raise ValueError(f"implementation='mosaic_gpu' cannot run this call: {why}. Pass "
                     "implementation=None to fall back to Triton.")
  lowering = lowering_lib.TRITON if why else lowering_lib.MOSAIC_GPU
  if delta and not why:
    return lowering_lib.Lowering(
        lowering, "", lowering_lib.TRITON,
        "the delta rule has no Mosaic GPU backward yet; a differentiated call runs Triton's "
        "forward too, in the chunks its backward shares")
  return lowering_lib.Lowering(lowering, why or "", lowering, why or "")


def linear_attention(q, k, v, *, log_decay=None, beta=None,
                     q_mod: FeatureMap | None = None,
                     k_mod: FeatureMap | None = None, normalize: bool = False,
                     scale: float | None = None, initial_state=None,
                     return_final_state: bool = False,
                     chunk_size: int | None = None,
                     config: LinearAttentionConfig | str | None = None,
                     interpret: bool | None = None,
                     implementation: str | None = None):
  """Decayed linear attention over a sequence (see the module docstring).

  Args:
    q, k: [B, S, H, Dk]; v: [B, S, H, Dv] (float32, bfloat16 or float16, one
      dtype). S need not be a multiple of the chunk.
    log_decay: None (no decay), [H] (constant per head), [B, S, H] (a scalar
      per step and head) or [B, S, H, Dk'] (a gate per key feature); <= 0.
    beta: None, or [B, S, H] writing strengths: the state then follows the
      delta rule (see the module docstring). Not with `normalize`.
    q_mod, k_mod: row-wise feature maps [..., Dk] -> [..., Dk'] written in
      plain JAX (identity when None); their gradients come from JAX autodiff.
    normalize: divide by `scale * phi(q_t) . z_t`, z_t the decayed sum of
      phi(k_j) (linear transformer / random-feature attention).
    scale: output scale, default 1/sqrt(Dk).
    initial_state: [B, H, Dk', Dv] (Dv + 1 with normalize) state before the
      first token; zeros when None.
    return_final_state: also return the float32 state after the last token.
    chunk_size: tokens per chunk (power of two >= 16); overrides `config`.
    config: a LinearAttentionConfig (chunk_size, block_v, num_warps,
      num_stages); None or "auto": the one `tune_linear_attention` stored
      for this variant and shape bucket, else a heuristic's. Only 64-token
      chunks run on Mosaic GPU.
    interpret: run the kernels in Pallas interpret mode (default: on CPU).
    implementation: the forward's lowering. None: Mosaic GPU (one kernel
      per (batch, head, Dv block) carrying the state, Hopper) where it runs
      the call, else Triton (`linear_attention_lowering` says which and
      why); "mosaic_gpu" raises where it cannot; "triton". The backward
      runs on the forward's lowering.

  Returns:
    o [B, S, H, Dv] in q's dtype, or (o, final_state) with
    `return_final_state`.
  """
  spec = spec_lib.check_linear_attention(
      q, k, v, log_decay=log_decay, q_mod=q_mod, k_mod=k_mod,
      normalize=normalize, scale=scale, initial_state=initial_state,
      beta=beta)
  spec_lib.check_linear_config(chunk_size, config)
  q_features, k_features = _features(q_mod, q), _features(k_mod, k)
  values = v
  if spec.normalize:  # the normaliser z is the state of a ones column
    values = jnp.concatenate([v, jnp.ones(v.shape[:3] + (1,), v.dtype)], -1)
  if initial_state is None:
    initial_state = jnp.zeros(spec.state_shape, jnp.float32)
  config, chunk, d_feature, d_values = resolve_config(spec, chunk_size, config)
  decay_kind = _kernel_decay_kind(spec.decay_kind)
  block_v = min(config.block_v, d_values)
  seq_len = math.ceil(spec.seq_len / chunk) * chunk
  padded = (spec.batch, seq_len, spec.heads)
  kernel_log_decay = _kernel_log_decay(log_decay, spec)
  if kernel_log_decay is not None:  # padded steps do not decay
    gate_width = (d_feature,) if kernel_log_decay.ndim == 4 else ()
    kernel_log_decay = _pad_to(kernel_log_decay, padded + gate_width)
  interpret = backend.resolve_interpret(interpret)
  out_dtype = _out_dtype(spec)
  lowering = _choose_lowering(implementation, spec, d_feature=d_feature, d_values=d_values,
                              chunk=chunk, interpret=interpret)
  schedule = ChunkedSchedule(
      decay_kind=decay_kind, scale=spec.scale,
      chunk_size=chunk, block_v=block_v, num_warps=config.num_warps,
      num_stages=config.num_stages, interpret=interpret, out_dtype=out_dtype,
      sm_count=device_config().sm_count, lowering=lowering.forward,
      backward_lowering=lowering.backward)
  padded_inputs = (
      _pad_to(q_features, padded + (d_feature,)),
      _pad_to(k_features, padded + (d_feature,)),
      _pad_to(values, padded + (d_values,)))
  padded_state = _pad_to(initial_state.astype(jnp.float32),
                         (spec.batch, spec.heads, d_feature, d_values))
  with backend.triton_deprecation_ignored():
    if spec.state_update == spec_lib.UPDATE_DELTA:  # padded steps write 0
      o, final_state = _delta_rule_core(
          *padded_inputs, _pad_to(beta, padded), kernel_log_decay,
          padded_state, schedule)
    else:
      o, final_state = _linear_core(
          *padded_inputs, kernel_log_decay, padded_state, schedule)
  o = o[:, :spec.seq_len, :, :values.shape[-1]]
  final_state = final_state[:, :, :spec.d_feature, :values.shape[-1]]
  if spec.normalize:
    o = o[..., :-1] / o[..., -1:]
  o = o.astype(q.dtype)
  return (o, final_state) if return_final_state else o


def linear_attention_lowering(q, k, v, *, log_decay=None, beta=None,
                              q_mod: FeatureMap | None = None, k_mod: FeatureMap | None = None,
                              normalize: bool = False, chunk_size: int | None = None,
                              config: LinearAttentionConfig | str | None = None,
                              interpret: bool | None = None,
                              implementation: str | None = None) -> lowering_lib.Lowering:
  """Which lowering `linear_attention` with these arguments runs, and why
  not Mosaic GPU where it does not (`.describe()` says it in words)."""
  spec = spec_lib.check_linear_attention(
      q, k, v, log_decay=log_decay, q_mod=q_mod, k_mod=k_mod, normalize=normalize,
      scale=None, initial_state=None, beta=beta)
  spec_lib.check_linear_config(chunk_size, config)
  _, chunk, d_feature, d_values = resolve_config(spec, chunk_size, config)
  return _choose_lowering(implementation, spec, d_feature=d_feature, d_values=d_values,
                          chunk=chunk, interpret=backend.resolve_interpret(interpret))


def _step_decay(log_decay_t, kind: str):
  """exp(log_decay_t) shaped to scale a [B, H, Dk', Dv] state."""
  decay = jnp.exp(log_decay_t.astype(jnp.float32))
  if kind == spec_lib.DECAY_PER_HEAD:
    decay = decay[None, :]
  if kind != spec_lib.DECAY_VECTOR:
    decay = decay[..., None]
  return decay[..., None]


def linear_attention_step(q_t, k_t, v_t, state, *, log_decay_t=None,
                          beta_t=None, q_mod: FeatureMap | None = None,
                          k_mod: FeatureMap | None = None,
                          normalize: bool = False, scale: float | None = None):
  """One decoding step of `linear_attention` (pure JAX, float32 state).

  Args:
    q_t, k_t: [B, H, Dk]; v_t: [B, H, Dv].
    state: [B, H, Dk', Dv] (Dv + 1 with normalize), e.g. the final state of
      `linear_attention(..., return_final_state=True)` over the prompt.
    log_decay_t: None, [H], [B, H] or [B, H, Dk'] for this step; <= 0.
    beta_t: None, or [B, H]: this step's delta-rule writing strength (as
      `beta` of `linear_attention`).
    q_mod, k_mod, normalize, scale: as in `linear_attention`.

  Returns:
    (o_t [B, H, Dv] in q_t's dtype, the state after this token).
  """
  spec = spec_lib.check_linear_attention_step(
      q_t, k_t, v_t, state, log_decay_t=log_decay_t, q_mod=q_mod,
      k_mod=k_mod, normalize=normalize, scale=scale, beta_t=beta_t)
  q_features = _features(q_mod, q_t).astype(jnp.float32)
  k_features = _features(k_mod, k_t).astype(jnp.float32)
  values = v_t.astype(jnp.float32)
  if spec.normalize:
    values = jnp.concatenate([values, jnp.ones(values.shape[:2] + (1,))], -1)
  state = state.astype(jnp.float32)
  if log_decay_t is not None:
    state = _step_decay(log_decay_t, spec.decay_kind) * state
  if beta_t is not None:  # the delta rule writes the prediction's error
    predicted = jnp.einsum("bhk,bhkv->bhv", k_features, state,
                           precision=jax.lax.Precision.HIGHEST)
    values = beta_t.astype(jnp.float32)[..., None] * (values - predicted)
  state = state + k_features[..., :, None] * values[..., None, :]
  o_t = spec.scale * jnp.einsum("bhk,bhkv->bhv", q_features, state,
                                precision=jax.lax.Precision.HIGHEST)
  if spec.normalize:
    o_t = o_t[..., :-1] / o_t[..., -1:]
  return o_t.astype(q_t.dtype), state
