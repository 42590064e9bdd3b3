"""Which lowering runs a call's parallel passes: Mosaic GPU or Triton.

`implementation=None` takes Mosaic GPU (kernels/mosaic_forward.py,
vjp/mosaic_backward.py) for each pass it can run on this device, else
Triton, and says why in `pallas-attn explain`; an explicit choice whose
forward cannot run raises with the reason. The passes are independent (the
backward reads only the saved row statistics), so a variant the Mosaic
backward does not lower yet keeps a Mosaic forward.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_attn.kernels import mosaic_backend
from pallas_attn.kernels.online import OnlineRowNorm
from pallas_attn.schedule.config import AttentionConfig, padded_head_dim as triton_head_dim
from pallas_attn.spec import primitives
from pallas_attn.spec.analysis import VariantAnalysis
from pallas_attn.spec.captures import ElementwiseProgram

MOSAIC_GPU, TRITON = "mosaic_gpu", "triton"
IMPLEMENTATIONS = (MOSAIC_GPU, TRITON)
MAX_MOSAIC_HEAD_DIM = 256
MAX_MOSAIC_BACKWARD_HEAD_DIM = 128


@dataclasses.dataclass(frozen=True)
class Lowering:
  """Each pass's lowering and, where Triton was picked over Mosaic GPU, why."""
  forward: str
  reason: str = ""
  backward: str = TRITON
  backward_reason: str = ""
  backward_note: str = ""  # said after the passes, where the backward runs on Mosaic GPU

  def describe(self) -> str:
    def one(name, lowering, reason):
      why = f" (mosaic_gpu not used: {reason})" if reason else ""
      return f"{name} on {lowering}{why}"
    if (self.forward, self.reason) == (self.backward, self.backward_reason):
      text = one("forward and backward", self.forward, self.reason)
    else:
      text = (one("forward", self.forward, self.reason) + "; "
              + one("backward", self.backward, self.backward_reason))
    if self.backward == MOSAIC_GPU and self.backward_note:
      text += "; " + self.backward_note
    return "implementation: " + text


def _program_obstacle(label: str, prog) -> str | None:
  """Primitives of what the kernel runs of `prog` (hoisted terms are plain
  JAX) that Mosaic GPU does not lower."""
  if prog is None:
    return None
  eqns = prog.traced.jaxpr.eqns
  run = (prog.kernel_equations() if isinstance(prog, ElementwiseProgram)
         else range(len(eqns)))
  used = sorted(primitives.used_primitives(prog.traced.jaxpr, run) - primitives.MOSAIC_GPU)
  if used:
    return f"{label} uses {', '.join(used)}, which the Mosaic GPU lowering lacks"
  return None


def mosaic_obstacle(analysis: VariantAnalysis, dtype, d_qk: int, d_v: int,
                    interpret: bool) -> str | None:
  """Why the Mosaic GPU forward cannot run this call, or None."""
  why = mosaic_backend.unavailable()
  if why:
    return why
  if interpret:
    return "interpret mode: the Mosaic GPU template runs compiled only"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return (f"{jnp.dtype(dtype).name} inputs: the template takes 16-bit operands (wgmma's "
            "float32 path is TF32, short of float32 tolerances)")
  if max(d_qk, d_v) > MAX_MOSAIC_HEAD_DIM:
    return f"head dims ({d_qk}, {d_v}) over {MAX_MOSAIC_HEAD_DIM} do not fit shared memory"
  if analysis.rownorm.kind == "normalized":
    return f"the normalized rownorm class ('{analysis.rownorm.name}') is not lowered yet"
  for label, prog in (("score_mod", analysis.score_mod), ("mask_mod", analysis.mask_mod),
                      ("rownorm", analysis.rownorm)):
    why = _program_obstacle(label, prog)
    if why:
      return why
  for label, prog in (("score_mod", analysis.score_mod), ("mask_mod", analysis.mask_mod)):
    for use in () if prog is None else prog.uses:
      if use.is_gather:
        return f"{label} reads a captured array at computed indices (gathers: not lowered yet)"
      if not mosaic_backend.supported_capture_axes(use.axes):
        return f"{label} reads a captured array with its kv axis before its q axis"
  return None


_DERIVATIVE_OBSTACLES: dict = {}  # analysis fingerprint -> _derivative_obstacle
_CACHE_MAX = 64


def _derivative_obstacle(analysis: VariantAnalysis) -> str | None:
  """Whether the tile gradients (score_mod, then the rownorm's weights,
  differentiated in the score), as the backward kernels bind them
  (`mosaic_backend.lowerable`), use primitives Mosaic GPU does not lower.
  Cached by the analysis' fingerprint: tracing the gradient costs a few ms,
  more than the rest of a call's host work."""
  key = analysis.fingerprint()
  if key not in _DERIVATIVE_OBSTACLES:
    if len(_DERIVATIVE_OBSTACLES) >= _CACHE_MAX:
      _DERIVATIVE_OBSTACLES.pop(next(iter(_DERIVATIVE_OBSTACLES)))
    _DERIVATIVE_OBSTACLES[key] = _traced_derivative_obstacle(analysis)
  return _DERIVATIVE_OBSTACLES[key]


def _traced_derivative_obstacle(analysis: VariantAnalysis) -> str | None:
  online = OnlineRowNorm(analysis.rownorm, True, False)
  prog = analysis.score_mod

  def weights(s):
    if prog is not None:  # as the kernel evaluates it: captured values (and terms) loaded
      loaded = {use: jnp.zeros(var.aval.shape, var.aval.dtype) for var, use in prog.loads}
      s = prog.evaluate((s, 0, 0, 0, 0), loaded, differentiable=True)
    return online.weights(s, differentiable=True)

  def gradient(s):
    return mosaic_backend.lowerable(lambda: jax.vjp(weights, s)[1](jnp.ones_like(weights(s))))

  jaxpr = jax.make_jaxpr(gradient)(jnp.float32(0.5))
  used = sorted({eqn.primitive.name for eqn in jaxpr.jaxpr.eqns} - primitives.MOSAIC_GPU)
  if used:
    return f"the tile gradients use {', '.join(used)}, which the Mosaic GPU lowering lacks"
  return None


def mosaic_backward_obstacle(analysis: VariantAnalysis, dtype, d_qk: int, d_v: int,
                             interpret: bool) -> str | None:
  """Why the Mosaic GPU backward cannot run this call, or None (calls that
  differentiate a captured array still take the Triton passes)."""
  return (mosaic_obstacle(analysis, dtype, d_qk, d_v, interpret)
          or _backward_obstacle(analysis, d_qk, d_v))


def _backward_obstacle(analysis: VariantAnalysis, d_qk: int, d_v: int) -> str | None:
  """What keeps a call the Mosaic forward runs from the Mosaic backward."""
  if max(padded_head_dim(d, MOSAIC_GPU) for d in (d_qk, d_v)) > MAX_MOSAIC_BACKWARD_HEAD_DIM:
    return (f"head dims ({d_qk}, {d_v}) over {MAX_MOSAIC_BACKWARD_HEAD_DIM}: the dk/dv "
            "accumulators outgrow a warpgroup's registers")
  for label, prog in (("score_mod", analysis.score_mod), ("mask_mod", analysis.mask_mod)):
    for use in () if prog is None else prog.uses:
      if not mosaic_backend.supported_capture_axes(use.axes, "kv"):
        return (f"{label} reads a [q, kv] tile of a captured array, which the transposed "
                "dk/dv tiles cannot load yet")
  return _derivative_obstacle(analysis)


def choose(implementation: str | None, analysis: VariantAnalysis, dtype, d_qk: int, d_v: int,
           interpret: bool, config=None, bwd_config=None) -> Lowering:
  """The lowering of one call's passes; raises if an explicit one cannot run
  the forward. An explicit `config` (`bwd_config`) with tiles the Mosaic
  templates cannot take keeps an unspecified implementation on Triton."""
  if implementation not in (None, *IMPLEMENTATIONS):
    raise ValueError(f"implementation must be None, 'mosaic_gpu' or 'triton'; got "
                     f"{implementation!r}")
  if implementation == TRITON:
    asked = "implementation='triton' was asked for"
    return Lowering(TRITON, asked, TRITON, asked)
  why = mosaic_obstacle(analysis, dtype, d_qk, d_v, interpret)
  if why is None and isinstance(config, AttentionConfig) and implementation is None:
    why = mosaic_config_error(config)
  if why is not None and implementation == MOSAIC_GPU:
    raise ValueError(f"implementation='mosaic_gpu' cannot run this call: {why}. Pass "
                     "implementation=None to fall back to Triton.")
  backward_why = why or _backward_obstacle(analysis, d_qk, d_v)
  if backward_why is None and isinstance(bwd_config, AttentionConfig):
    backward_why = mosaic_backward_config_error(bwd_config)
  return Lowering(TRITON if why else MOSAIC_GPU, why or "",
                  TRITON if backward_why else MOSAIC_GPU, backward_why or "",
                  "the backward takes triton's passes when a captured array is differentiated")


def padded_head_dim(d: int, *lowerings: str) -> int:
  """Head dims as the kernels of the given passes' lowerings take them:
  powers of two of at least 16 for Triton's tiles; at least 64 (one
  128-byte swizzle row) where a pass runs on Mosaic GPU."""
  triton = triton_head_dim(d)
  return max(64, triton) if MOSAIC_GPU in lowerings else triton


def padded_head_dims(d_qk: int, d_v: int, *lowerings: str) -> tuple[int, int]:
  """Both head dims as `padded_head_dim` gives them."""
  return padded_head_dim(d_qk, *lowerings), padded_head_dim(d_v, *lowerings)


def heuristic_mosaic_config(seq_q: int, seq_kv: int, d_qk: int, d_v: int, *,
                            block_sparse: bool = False) -> AttentionConfig:
  """Mosaic GPU forward tiles: two consumer warpgroups of 64 rows (block_q
  128; 64 for a single short q block), 128 keys per step up to heads of
  128 and 64 beyond (shared memory), a two-slot K/V ring. Heads of at most
  64 without a mask take 256 keys per step: fewer, longer steps for the same
  small K/V tiles (H200 sweep, benchmarks/results/2026-11-23_h200/sweep_mosaic_forward_d64.json:
  vanilla 420 -> 471 TFLOP/s; causal 395 -> 375, so masked variants keep
  128). num_warps counts the producer's warpgroup too."""
  block_q = 64 if seq_q <= 64 else 128
  block_k = 128 if max(d_qk, d_v) <= 128 and seq_kv > 64 else 64
  if max(d_qk, d_v) <= 64 and seq_kv >= 256 and not block_sparse:
    block_k = 256
  return AttentionConfig(block_q=block_q, block_k=block_k,
                         num_warps=mosaic_backend.num_warps(block_q), num_stages=2)


def heuristic_mosaic_backward_config(seq_q: int, seq_kv: int, d_qk: int,
                                     d_v: int) -> AttentionConfig:
  """Mosaic GPU backward tiles: dq programs of block_q queries and dk/dv
  programs of block_k keys, two consumer warpgroups each (one for a single
  short block), streaming 64-row tiles through a four-slot ring."""
  del d_qk, d_v
  block_q = 64 if seq_q <= 64 else 128
  block_k = 64 if seq_kv <= 64 else 128
  return AttentionConfig(block_q=block_q, block_k=block_k,
                         num_warps=mosaic_backend.num_warps(max(block_q, block_k)),
                         num_stages=4)


def mosaic_backward_config_error(config: AttentionConfig) -> str | None:
  if config.block_q not in (64, 128) or config.block_k not in (64, 128):
    return (f"a mosaic_gpu backward config needs block_q and block_k of 64 or 128 (one or "
            f"two consumer warpgroups); got {config}")
  return None


def mosaic_config_error(config: AttentionConfig) -> str | None:
  if config.block_q not in (64, 128, 192) or config.block_k % 64 or config.block_k > 256:
    return (f"a mosaic_gpu config needs block_q 64, 128 or 192 (one to three consumer "
            f"warpgroups; 192 for fp8 inputs) and block_k a multiple of 64 up to 256; got "
            f"{config}")
  return None
