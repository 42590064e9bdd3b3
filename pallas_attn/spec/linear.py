"""Validation of linear-attention calls: shapes, dtypes, decays, feature maps.

Everything here runs on shapes (and, where the caller passes concrete
arrays, on values) before any kernel is traced, so that mistakes surface as
`ValueError`/`TypeError` naming the argument instead of as a lowering error.
"""
from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_attn.schedule.config import TILE, LinearAttentionConfig, check_value

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                    jnp.dtype(jnp.float16))

# How `log_decay` is laid out, by its rank.
DECAY_NONE = "none"          # no decay: plain linear attention
DECAY_PER_HEAD = "per_head"  # [H]: one constant per head (RetNet)
DECAY_SCALAR = "scalar"      # [B, S, H]: a scalar per step and head (Mamba2)
DECAY_VECTOR = "vector"      # [B, S, H, Dk']: a gate per key feature (GLA)

# How the state takes in a token, by whether `beta` is given.
UPDATE_ADDITIVE = "additive"  # S_t = A_t S_{t-1} + k_t^T v_t
# The delta rule: S_t = A_t S_{t-1} + beta_t k_t^T (v_t - k_t A_t S_{t-1}).
UPDATE_DELTA = "delta"


@dataclasses.dataclass(frozen=True)
class LinearAttentionSpec:
  """Static description of a validated linear-attention call.

  `d_feature` is Dk' (the width after the feature maps), which is also the
  row count of the state; with `normalize` the state carries the normalizer
  as one extra value column. `state_update` is UPDATE_ADDITIVE or
  UPDATE_DELTA (the delta rule, when `beta` is given).
  """
  batch: int
  seq_len: int
  heads: int
  d_qk: int
  d_feature: int
  d_v: int
  decay_kind: str
  normalize: bool
  dtype: Any
  scale: float
  state_update: str = UPDATE_ADDITIVE

  def fingerprint(self) -> str:
    """The variant's part of a tuning-cache key (the shapes are the key's own)."""
    return (f"linear;decay={self.decay_kind};update={self.state_update};"
            f"normalize={self.normalize}")

  @property
  def state_shape(self) -> tuple[int, int, int, int]:
    return (self.batch, self.heads, self.d_feature,
            self.d_v + int(self.normalize))


def _check_dtype(name: str, x) -> None:
  if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
    raise TypeError(
        f"{name} has dtype {x.dtype}; linear_attention supports float32, "
        "bfloat16 and float16. Cast it with .astype(jnp.bfloat16) or "
        ".astype(jnp.float32).")


def _check_array(name: str, x, ndim: int, layout: str) -> None:
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(
        f"{name} must be an array {layout}, got {type(x).__name__}.")
  if x.ndim != ndim:
    raise ValueError(f"{name} must have shape {layout}, got {tuple(x.shape)}.")


def feature_dim(name: str, feature_map: Callable | None, x) -> int:
  """Dk' of `feature_map` applied to `x` ([..., Dk]), found by tracing shapes.

  A feature map must act on the last axis only: it may change Dk but not the
  rank or the leading axes, and must return one floating-point array.
  """
  if feature_map is None:
    return x.shape[-1]
  if not callable(feature_map):
    raise TypeError(f"{name} must be a callable [..., Dk] -> [..., Dk'], got "
                    f"{type(feature_map).__name__}.")
  out = jax.eval_shape(feature_map, jax.ShapeDtypeStruct(x.shape, x.dtype))
  if not isinstance(out, jax.ShapeDtypeStruct):
    raise TypeError(f"{name} must return a single array, got {out}.")
  if len(out.shape) != len(x.shape) or out.shape[:-1] != x.shape[:-1]:
    raise ValueError(
        f"{name} must map rows [..., Dk] -> [..., Dk'] keeping the rank and "
        f"the leading axes; it maps {tuple(x.shape)} -> {tuple(out.shape)}. "
        "Apply it per row (e.g. with jnp ops on the last axis), not to the "
        "whole tensor.")
  if not jnp.issubdtype(out.dtype, jnp.floating):
    raise TypeError(f"{name} must return floating-point features, got "
                    f"{out.dtype}.")
  if out.shape[-1] == 0:
    raise ValueError(f"{name} returns an empty feature axis.")
  return out.shape[-1]


def is_traced(x) -> bool:
  """Whether `x` is abstract (under jit, grad, vmap): its values are unknown."""
  return isinstance(x, jax.core.Tracer)


# Device arrays whose largest entry was read, by id (weakly held): one
# device-to-host copy per array, not one per call that reuses it.
_READ_DECAYS: dict[int, tuple[weakref.ref, float]] = {}


def _largest_entry(log_decay) -> float | None:
  """The largest entry of a concrete `log_decay`, read with NumPy; None for
  a tracer (under jit/grad/vmap, unknown) or an empty array.

  Also right when a concrete array is closed over by a jitted function: the
  value is read on the host, never through a staged jnp op. A device array
  is read once and remembered while it lives.
  """
  if is_traced(log_decay) or log_decay.size == 0:
    return None
  if isinstance(log_decay, np.ndarray):
    return float(np.max(log_decay))
  key = id(log_decay)
  known = _READ_DECAYS.get(key)
  if known is not None and known[0]() is log_decay:
    return known[1]
  largest = float(np.max(np.asarray(log_decay)))
  try:
    ref = weakref.ref(log_decay, lambda _, key=key: _READ_DECAYS.pop(key, None))
  except TypeError:  # not weakly referenceable: read every time
    return largest
  _READ_DECAYS[key] = (ref, largest)
  return largest


def classify_decay(log_decay, batch: int, seq_len: int, heads: int,
                   d_feature: int, *, step: bool = False) -> str:
  """The decay kind of `log_decay` (one of DECAY_*), after checking it.

  Positive entries (growing states) are rejected when the values are
  concrete (see `_largest_entry`); under `jax.jit`/`jax.grad` a log_decay
  passed as an argument is a tracer and cannot be checked, so the caller is
  responsible for log_decay <= 0 there.
  """
  if log_decay is None:
    return DECAY_NONE
  name = "log_decay_t" if step else "log_decay"
  if step:
    layouts = {1: ((heads,), DECAY_PER_HEAD),
               2: ((batch, heads), DECAY_SCALAR),
               3: ((batch, heads, d_feature), DECAY_VECTOR)}
    expected = f"[H]={heads}, [B, H]={(batch, heads)} or [B, H, Dk']=" \
               f"{(batch, heads, d_feature)}"
  else:
    layouts = {1: ((heads,), DECAY_PER_HEAD),
               3: ((batch, seq_len, heads), DECAY_SCALAR),
               4: ((batch, seq_len, heads, d_feature), DECAY_VECTOR)}
    expected = (f"[H]={heads}, [B, S, H]={(batch, seq_len, heads)} or "
                f"[B, S, H, Dk']={(batch, seq_len, heads, d_feature)}")
  if not hasattr(log_decay, "shape") or not hasattr(log_decay, "dtype"):
    raise TypeError(f"{name} must be an array, got {type(log_decay).__name__}.")
  shape, kind = layouts.get(log_decay.ndim, (None, None))
  if shape != tuple(log_decay.shape):
    raise ValueError(
        f"{name} has shape {tuple(log_decay.shape)}; expected {expected} "
        "(Dk' is the key width after k_mod).")
  if not jnp.issubdtype(log_decay.dtype, jnp.floating):
    raise TypeError(f"{name} must be floating point, got {log_decay.dtype}.")
  largest = _largest_entry(log_decay)
  if largest is not None and not largest <= 0:
    raise ValueError(
        f"{name} must be <= 0 (a log of a decay factor in (0, 1]); its "
        f"largest entry is {largest}. Pass e.g. jax.nn.log_sigmoid(gate) "
        "or -softplus(x).")
  return kind


def check_scale(scale, d_qk: int) -> float:
  """The output scale as a Python float (default 1/sqrt(Dk))."""
  if scale is None:
    return 1.0 / math.sqrt(d_qk)
  if is_traced(scale) or np.ndim(scale) != 0:
    raise TypeError("scale must be a Python number (it is baked into the "
                    f"kernel), got {scale!r}.")
  if not math.isfinite(scale) or scale == 0:
    # The backward's state pass carries dS / scale.
    raise ValueError(f"scale must be a finite nonzero number, got {scale!r}.")
  return float(scale)


def _check_state(name: str, state, expected: tuple[int, ...],
                 normalize: bool) -> None:
  _check_array(name, state, 4, "[B, H, Dk', Dv]")
  if tuple(state.shape) != expected:
    extra = (" With normalize=True the state carries the normalizer z as one "
             "extra last column: [B, H, Dk', Dv + 1]." if normalize else "")
    raise ValueError(
        f"{name} has shape {tuple(state.shape)}; expected {expected} "
        f"([B, H, Dk', Dv], Dk' the key width after k_mod).{extra}")
  if not jnp.issubdtype(state.dtype, jnp.floating):
    raise TypeError(f"{name} must be floating point, got {state.dtype}.")


def _check_features(q, k, q_mod, k_mod) -> int:
  dq = feature_dim("q_mod", q_mod, q)
  dk = feature_dim("k_mod", k_mod, k)
  if dq != dk:
    raise ValueError(
        f"q and k features must have the same width to be contracted: q_mod "
        f"gives {dq}, k_mod gives {dk} (an unset map is the identity).")
  return dq


def _check_beta(name: str, beta, expected: tuple[int, ...], layout: str,
                normalize: bool) -> str:
  """The state update a `beta` (None or an array of `expected` shape) asks
  for, after checking it."""
  if beta is None:
    return UPDATE_ADDITIVE
  if normalize:
    raise ValueError(
        f"normalize=True cannot be combined with {name} (the delta rule): the "
        "normaliser z_t is the decayed sum of phi(k_j), which the delta rule's "
        "state does not carry (its update subtracts the state's own "
        "prediction), so phi(q_t) . z_t normalises nothing it computes. Drop "
        "normalize (the delta-rule models normalise q and k instead, e.g. "
        "q_mod=k_mod=lambda x: x / jnp.linalg.norm(x, axis=-1, "
        "keepdims=True)).")
  if not hasattr(beta, "shape") or not hasattr(beta, "dtype"):
    raise TypeError(f"{name} must be an array {layout}, got "
                    f"{type(beta).__name__}.")
  if tuple(beta.shape) != expected:
    raise ValueError(f"{name} has shape {tuple(beta.shape)}; expected "
                     f"{layout}={expected} (one writing strength per token "
                     "and head).")
  if not jnp.issubdtype(beta.dtype, jnp.floating):
    raise TypeError(f"{name} must be floating point (e.g. "
                    f"jax.nn.sigmoid(logits)), got {beta.dtype}.")
  return UPDATE_DELTA


def check_linear_attention(q, k, v, *, log_decay, q_mod, k_mod, normalize,
                           scale, initial_state,
                           beta=None) -> LinearAttentionSpec:
  """Validates a `linear_attention` call and describes it."""
  for name, x in (("q", q), ("k", k)):
    _check_array(name, x, 4, "[B, S, H, Dk]")
  _check_array("v", v, 4, "[B, S, H, Dv]")
  for name, x in (("q", q), ("k", k), ("v", v)):
    _check_dtype(name, x)
  if not q.dtype == k.dtype == v.dtype:
    raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, "
                    f"{v.dtype}.")
  if q.shape != k.shape:
    raise ValueError(f"q and k must have the same shape [B, S, H, Dk], got "
                     f"{tuple(q.shape)} and {tuple(k.shape)}.")
  if v.shape[:3] != q.shape[:3]:
    raise ValueError(f"v must share [B, S, H] with q: got v {tuple(v.shape)} "
                     f"and q {tuple(q.shape)}.")
  batch, seq_len, heads, d_qk = q.shape
  if min(batch, seq_len, heads, d_qk, v.shape[-1]) == 0:
    raise ValueError(f"empty inputs: q {tuple(q.shape)}, v {tuple(v.shape)}.")
  d_feature = _check_features(q, k, q_mod, k_mod)
  kind = classify_decay(log_decay, batch, seq_len, heads, d_feature)
  spec = LinearAttentionSpec(
      batch=batch, seq_len=seq_len, heads=heads, d_qk=d_qk,
      d_feature=d_feature, d_v=v.shape[-1], decay_kind=kind,
      normalize=bool(normalize), dtype=jnp.dtype(q.dtype),
      scale=check_scale(scale, d_qk),
      state_update=_check_beta("beta", beta, (batch, seq_len, heads),
                               "[B, S, H]", normalize))
  if initial_state is not None:
    _check_state("initial_state", initial_state, spec.state_shape, normalize)
  return spec


def check_linear_attention_step(q_t, k_t, v_t, state, *, log_decay_t, q_mod,
                                k_mod, normalize, scale,
                                beta_t=None) -> LinearAttentionSpec:
  """Validates a `linear_attention_step` call (one token, [B, H, D] inputs)."""
  for name, x in (("q_t", q_t), ("k_t", k_t)):
    _check_array(name, x, 3, "[B, H, Dk]")
  _check_array("v_t", v_t, 3, "[B, H, Dv]")
  for name, x in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
    _check_dtype(name, x)
  if q_t.shape != k_t.shape or v_t.shape[:2] != q_t.shape[:2]:
    raise ValueError(f"q_t, k_t must be [B, H, Dk] and v_t [B, H, Dv] with "
                     f"shared B, H; got {tuple(q_t.shape)}, {tuple(k_t.shape)}"
                     f", {tuple(v_t.shape)}.")
  batch, heads, d_qk = q_t.shape
  d_feature = _check_features(q_t, k_t, q_mod, k_mod)
  kind = classify_decay(log_decay_t, batch, 1, heads, d_feature, step=True)
  spec = LinearAttentionSpec(
      batch=batch, seq_len=1, heads=heads, d_qk=d_qk, d_feature=d_feature,
      d_v=v_t.shape[-1], decay_kind=kind, normalize=bool(normalize),
      dtype=jnp.dtype(q_t.dtype), scale=check_scale(scale, d_qk),
      state_update=_check_beta("beta_t", beta_t, (batch, heads), "[B, H]",
                               normalize))
  _check_state("state", state, spec.state_shape, normalize)
  return spec


def check_linear_config(chunk_size: int | None, config) -> None:
  """The config's type (it checked its fields on construction; None and
  "auto" take a tuned one, else the heuristic's) and a `chunk_size`
  override, held to the config's chunk_size rule."""
  if config not in (None, "auto") and not isinstance(config, LinearAttentionConfig):
    raise TypeError("config must be a pallas_attn.LinearAttentionConfig, 'auto' or None; "
                    f"got {config!r}.")
  if chunk_size is not None:
    check_value("chunk_size", chunk_size, TILE)
