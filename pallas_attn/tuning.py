"""`tune_attention`: tunes `pallas_attn.attention`'s passes and the split-KV
template for a variant and shapes, through the generic tuner
(schedule/tuner.py), and stores the winners where `attention` looks them up;
`tune_linear_attention` does the same for `linear_attention`'s tiles.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_attn import _templates
from pallas_attn.api import attention
from pallas_attn.decode import decode_attention
from pallas_attn.kernels import backend
from pallas_attn.kernels.lowering import TRITON
from pallas_attn.linear import linear_attention, tile_shapes, tuned_template
from pallas_attn.schedule import cache
from pallas_attn.schedule import template as template_lib
from pallas_attn.schedule.config import MAX_DECODE_QUERIES
from pallas_attn.schedule.template import ProblemShape
from pallas_attn.schedule.tuner import TuningResult, tune_template
from pallas_attn.spec import linear as linear_spec
from pallas_attn.spec.analysis import analyze_variant

ATTENTION_TEMPLATES = tuple(t.name for t in _templates.ATTENTION)


def _random_inputs(shape: ProblemShape, seed: int):
  keys = jax.random.split(jax.random.key(seed), 4)
  shapes = (shape.q_shape, shape.k_shape, shape.v_shape, shape.q_shape[:3] + (shape.d_v,))
  return tuple(jax.random.normal(k, s, shape.dtype) for k, s in zip(keys, shapes))


def _check_lowering(template, analysis, shape: ProblemShape, interpret) -> None:
  """A clear error before compiling anything where the pass's lowering cannot run it."""
  why = template.obstacle(analysis, shape.dtype, shape.d_qk, shape.d_v,
                          backend.resolve_interpret(interpret))
  if why:
    passes = _templates.FORWARD if template in _templates.FORWARD.values() else _templates.BACKWARD
    raise ValueError(f"template {template.name!r} cannot run this call: {why}; tune "
                     f"{passes[TRITON].name!r} (Triton) instead")


def tune_attention(q_shape, k_shape, v_shape, *, dtype="bfloat16", score_mod=None,
                   mask_mod=None, rownorm="softmax", sinks=None, template: str = "forward",
                   forward_config=None, interpret: bool | None = None, seed: int = 0,
                   **tuning) -> TuningResult:
  """Tunes `pallas_attn.attention` for this variant and these shapes; stores the winner.

  template: "forward" (`config=`) or "backward" (`bwd_config=`), tuned
    separately, on the Triton lowering; "forward_mosaic" / "backward_mosaic"
    the same passes on Mosaic GPU (an error where it cannot run them). The
    backward is timed alone, with the forward's config fixed to
    `forward_config`, else the cached one, else the heuristic. With a
    mask_mod each pass gets the block mask on its own tiles. "decode": the
    split-KV template (`decode_attention`, every sequence holding k_shape's
    S_max keys; also what `attention` runs for a few queries).
  tuning: keyword arguments of `tune_template` (budget_s, max_candidates,
    axes, warmup, reps, store, progress).
  Afterwards `attention(config="auto")` finds the stored config.
  """
  if template not in ATTENTION_TEMPLATES:
    raise ValueError(f"attention templates are {ATTENTION_TEMPLATES}, got {template!r}")
  tuned = template_lib.get(template)
  shape = ProblemShape.from_shapes(q_shape, k_shape, v_shape, dtype)
  block_sparse = mask_mod is not None  # the masked heuristic is the baseline
  analysis = analyze_variant(score_mod=score_mod, mask_mod=mask_mod, rownorm=rownorm)
  fingerprint = analysis.fingerprint()
  if tuned is _templates.DECODE:
    if shape.seq_q > MAX_DECODE_QUERIES:
      raise ValueError(f"the split-KV template takes 1 to {MAX_DECODE_QUERIES} query tokens; "
                       f"q_shape has {shape.seq_q}")
  else:
    _check_lowering(tuned, analysis, shape, interpret)
  q, k, v, dout = _random_inputs(shape, seed)
  variant = dict(score_mod=score_mod, mask_mod=mask_mod, rownorm=rownorm, sinks=sinks,
                 interpret=interpret)

  if tuned is _templates.DECODE:
    lengths = jnp.full((shape.batch,), shape.seq_kv, jnp.int32)

    def build(config):
      forward = jax.jit(functools.partial(decode_attention, **variant, config=config))
      return lambda: forward(q, k, v, lengths)
  elif tuned is _templates.FORWARD[tuned.lowering]:
    def build(config):
      forward = jax.jit(functools.partial(attention, **variant, config=config,
                                          implementation=tuned.lowering))
      return lambda: forward(q, k, v)
  else:
    forward_template = _templates.FORWARD[tuned.lowering]
    if forward_config is None:
      forward_config = (
          cache.lookup_config(forward_template.name, fingerprint, q_shape=q_shape,
                              k_shape=k_shape, v_shape=v_shape, dtype=dtype)
          or forward_template.default_config(
              shape, block_sparse=block_sparse,
              scores_per_position=analysis.scores_per_position))
    call = functools.partial(attention, **variant, config=forward_config,
                             implementation=tuned.lowering)
    apply_pullback = jax.jit(lambda pullback, cotangent: pullback(cotangent))

    def build(config):
      # The forward runs here, outside the timed call; only the backward is timed.
      _, pullback = jax.vjp(functools.partial(call, bwd_config=config), q, k, v)
      return lambda: apply_pullback(pullback, dout)

  with backend.triton_deprecation_ignored():  # the compiling threads see it too
    return tune_template(template, fingerprint, build, shape, block_sparse=block_sparse,
                         scores_per_position=analysis.scores_per_position,
                         **tuning)


LINEAR_DECAYS = ("none", "head", "step", "feature")  # log_decay's forms, as the CLI names them
LINEAR_MODES = ("fwd", "fwd_bwd")


def linear_decay_shape(decay: str, q_shape) -> tuple | None:
  """log_decay's shape for a decay form (LINEAR_DECAYS) and q's [B, S, H, Dk]."""
  if decay not in LINEAR_DECAYS:
    raise ValueError(f"decay must be one of {LINEAR_DECAYS}; got {decay!r}")
  batch, seq, heads, d_k = q_shape
  return {"none": None, "head": (heads,), "step": (batch, seq, heads),
          "feature": (batch, seq, heads, d_k)}[decay]


def _linear_inputs(q_shape, v_shape, decay: str, delta: bool, dtype, seed: int):
  """Random (q, k, v, log_decay, beta, d_out) as models feed them: unit-norm
  q, k for the delta rule, gates of log(sigmoid) with most steps near 1."""
  gate_shape = linear_decay_shape(decay, q_shape)
  batch, seq, heads, _ = q_shape
  keys = jax.random.split(jax.random.key(seed), 6)
  q, k = (jax.random.normal(key, q_shape, jnp.float32) for key in keys[:2])
  if delta:
    q, k = (x / jnp.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
  v = jax.random.normal(keys[2], v_shape, jnp.float32)
  log_decay = None if gate_shape is None else jax.nn.log_sigmoid(
      4.0 + jax.random.normal(keys[3], gate_shape, jnp.float32))
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (batch, seq, heads))).astype(dtype) \
      if delta else None
  d_out = jax.random.normal(keys[5], v_shape, jnp.float32).astype(dtype)
  return (*(x.astype(dtype) for x in (q, k, v)), log_decay, beta, d_out)


def tune_linear_attention(q_shape, v_shape, *, decay: str = "none", delta: bool = False,
                          normalize: bool = False, dtype="bfloat16", mode: str = "fwd_bwd",
                          interpret: bool | None = None, seed: int = 0,
                          **tuning) -> TuningResult:
  """Tunes `linear_attention`'s tiles (LinearAttentionConfig) for a variant
  and shapes; stores the winner, which `linear_attention(config=None or
  "auto")` then finds.

  q_shape `[B, S, H, Dk]`, v_shape `[B, S, H, Dv]`; decay: log_decay's form
  ("none", "head", "step" or "feature"); delta: the delta rule (beta
  given). Each candidate runs as a default call would: 64-token chunks take
  the Mosaic GPU kernels where they run, other chunks Triton's passes, so
  the winner also picks the lowering. mode: "fwd_bwd" times the forward with
  its backward (training), "fwd" the forward alone (inference).
  tuning: keyword arguments of `tune_template` (budget_s, max_candidates,
  axes, warmup, reps, store, progress).
  """
  if mode not in LINEAR_MODES:
    raise ValueError(f"mode must be one of {LINEAR_MODES}; got {mode!r}")
  q, k, v, log_decay, beta, d_out = _linear_inputs(q_shape, v_shape, decay, delta, dtype, seed)
  spec = linear_spec.check_linear_attention(
      q, k, v, log_decay=log_decay, q_mod=None, k_mod=None, normalize=normalize, scale=None,
      initial_state=None, beta=beta)
  call = functools.partial(linear_attention, log_decay=log_decay, beta=beta,
                           normalize=normalize, interpret=interpret)

  def build(config):
    attend = functools.partial(call, config=config)
    if mode == "fwd":
      forward = jax.jit(attend)
      return lambda: forward(q, k, v)

    def forward_backward(q, k, v):
      out, pullback = jax.vjp(attend, q, k, v)
      return out, pullback(d_out)
    step = jax.jit(forward_backward)
    return lambda: step(q, k, v)

  shape = ProblemShape.from_shapes(*tile_shapes(spec), dtype)
  with backend.triton_deprecation_ignored():
    return tune_template(tuned_template(spec).name, spec.fingerprint(), build, shape, **tuning)
