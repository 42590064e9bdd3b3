"""Which lowering runs a call's parallel forward: Mosaic GPU or Triton.

`implementation=None` takes Mosaic GPU (kernels/mosaic_forward.py) where it
can run the analysis on this device, else Triton, and says why in
`pallas-attn explain`; an explicit choice that cannot run raises with the
reason. The backward passes run on Triton for now whichever forward ran
(they read only the saved row statistics).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_attn.kernels import mosaic_backend
from pallas_attn.schedule import search_space
from pallas_attn.schedule.config import AttentionConfig
from pallas_attn.spec.analysis import VariantAnalysis

MOSAIC_GPU, TRITON = "mosaic_gpu", "triton"
IMPLEMENTATIONS = (MOSAIC_GPU, TRITON)
MAX_MOSAIC_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class Lowering:
  """The forward's lowering and, when Triton was picked over Mosaic GPU, why."""
  forward: str
  reason: str = ""

  def describe(self) -> str:
    if self.forward == MOSAIC_GPU:
      return "implementation: mosaic_gpu forward (Hopper template); backward on triton"
    why = f" (mosaic_gpu not used: {self.reason})" if self.reason else ""
    return f"implementation: triton forward and backward{why}"


def _program_obstacle(label: str, prog) -> str | None:
  if prog is None:
    return None
  used = sorted({eqn.primitive.name for eqn in prog.traced.jaxpr.eqns}
                - mosaic_backend.PRIMITIVES)
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


def choose(implementation: str | None, analysis: VariantAnalysis, dtype, d_qk: int, d_v: int,
           interpret: bool, config=None) -> Lowering:
  """The lowering of one call; raises if an explicit one cannot run it.
  An explicit `config` with tiles the Mosaic template cannot take keeps an
  unspecified implementation on Triton."""
  if implementation not in (None, *IMPLEMENTATIONS):
    raise ValueError(f"implementation must be None, 'mosaic_gpu' or 'triton'; got "
                     f"{implementation!r}")
  if implementation == TRITON:
    return Lowering(TRITON, "implementation='triton' was asked for")
  why = mosaic_obstacle(analysis, dtype, d_qk, d_v, interpret)
  if why is None and isinstance(config, AttentionConfig) and implementation is None:
    why = mosaic_config_error(config)
  if why is None:
    return Lowering(MOSAIC_GPU)
  if implementation == MOSAIC_GPU:
    raise ValueError(f"implementation='mosaic_gpu' cannot run this call: {why}. Pass "
                     "implementation=None to fall back to Triton.")
  return Lowering(TRITON, why)


def padded_head_dim(d: int, forward: str) -> int:
  """Head dims as the kernels take them: powers of two of at least 16 for
  Triton's tiles; at least 64 (one 128-byte swizzle row) for Mosaic GPU."""
  triton = search_space.padded_head_dim(d)
  return max(64, triton) if forward == MOSAIC_GPU else triton


def heuristic_mosaic_config(seq_q: int, seq_kv: int, d_qk: int, d_v: int) -> AttentionConfig:
  """Mosaic GPU forward tiles: two consumer warpgroups of 64 rows (block_q
  128; 64 for a single short q block), 128 keys per step up to heads of
  128 and 64 beyond (shared memory), a two-slot K/V ring. num_warps counts
  the producer's warpgroup too."""
  block_q = 64 if seq_q <= 64 else 128
  block_k = 128 if max(d_qk, d_v) <= 128 and seq_kv > 64 else 64
  return AttentionConfig(block_q=block_q, block_k=block_k,
                         num_warps=4 * (block_q // mosaic_backend.WG_ROWS + 1), num_stages=2)


def mosaic_config_error(config: AttentionConfig) -> str | None:
  if config.block_q not in (64, 128) or config.block_k % 64 or config.block_k > 256:
    return (f"a mosaic_gpu config needs block_q 64 or 128 (one or two consumer warpgroups) "
            f"and block_k a multiple of 64 up to 256; got {config}")
  return None


def check_mosaic_config(config: AttentionConfig):
  why = mosaic_config_error(config)
  if why:
    raise ValueError(why)
