"""Tile-level pieces shared by the forward and backward templates.

* Captured arrays: each `CaptureUse` becomes one kernel operand whose
  BlockSpec follows its addressing (a slope per head is one element, a
  `[B, Skv]` key bias is one row, a `[B, H, Sq, Skv]` bias is a q block by
  the whole kv length that the kernel slices per kv block).
* `TileContext`: evaluates score_mod and mask_mod on a `[block_q, block_k]`
  tile with the in-kernel interpreter.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_attn.spec import blockeval
from pallas_attn.spec.analysis import VariantAnalysis


def _pad_axis(x, axis, length):
  pad = length - x.shape[axis]
  if pad <= 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, mode="edge")


@dataclasses.dataclass(frozen=True)
class CaptureOperand:
  """One captured-array read as a kernel operand."""
  axes: tuple      # per array axis: 'b' | 'h' | 'q' | 'kv' | int
  is_bool: bool


def capture_operands(analysis: VariantAnalysis, seq_q_pad: int, seq_kv_pad: int):
  """The arrays to pass to a kernel, one per capture use (score_mod's first).

  Boolean arrays travel as int32; q- and kv-addressed axes are padded to the
  padded sequence lengths so that reads of padding stay in bounds.
  """
  arrays, operands = [], []
  for prog in (analysis.score_mod, analysis.mask_mod):
    if prog is None:
      continue
    for use in prog.uses:
      x = jnp.asarray(prog.traced.consts[use.capture])
      is_bool = x.dtype == jnp.bool_
      if is_bool:
        x = x.astype(jnp.int32)
      for axis, a in enumerate(use.axes):
        if a == "q":
          x = _pad_axis(x, axis, seq_q_pad)
        elif a == "kv":
          x = _pad_axis(x, axis, seq_kv_pad)
      arrays.append(x)
      operands.append(CaptureOperand(use.axes, is_bool))
  return arrays, tuple(operands)


def capture_block_spec(operand: CaptureOperand, shape, *, blocked: str, block: int):
  """BlockSpec for a grid `(i, b, h)` where `i` blocks the `blocked` axis
  ('q' or 'kv') by `block`; the other sequence axis is passed whole."""
  block_shape, picks = [], []
  for a, dim in zip(operand.axes, shape):
    if a == blocked:
      block_shape.append(block)
      picks.append("i")
    elif a in ("q", "kv"):
      block_shape.append(dim)
      picks.append(0)
    else:
      block_shape.append(None)
      picks.append(a)

  def index_map(i, b, h):
    env = {"i": i, "b": b, "h": h}
    return tuple(env[p] if isinstance(p, str) else p for p in picks)

  return pl.BlockSpec(tuple(block_shape), index_map)


def load_capture(ref, operand: CaptureOperand, *, blocked: str, start, size):
  """Loads a capture as a tile broadcastable to `[block_q, block_k]`.

  The `blocked` axis is already one block; the other sequence axis is read
  at `pl.ds(start, size)`.
  """
  seq_axes = [a for a in operand.axes if a in ("q", "kv")]
  if not seq_axes:
    x = ref[...]
  else:
    idx = tuple(slice(None) if a == blocked else pl.ds(start, size) for a in seq_axes)
    x = ref[idx]
    if seq_axes == ["kv", "q"]:
      x = x.T
    elif seq_axes == ["q"]:
      x = x[:, None]
    elif seq_axes == ["kv"]:
      x = x[None, :]
  return x != 0 if operand.is_bool else x


@dataclasses.dataclass(frozen=True)
class TileContext:
  """Evaluates the variant's elementwise programs on one tile."""
  analysis: VariantAnalysis
  operands: tuple  # CaptureOperand per capture ref
  blocked: str     # which sequence axis the grid blocks ('q' or 'kv')

  def _loads(self, prog, refs, offset, start, size):
    env = {}
    for var, use_index in prog.loads:
      ref = refs[offset + use_index]
      env[var] = load_capture(ref, self.operands[offset + use_index],
                              blocked=self.blocked, start=start, size=size)
    return env

  def _offsets(self):
    n_score = 0 if self.analysis.score_mod is None else len(self.analysis.score_mod.uses)
    return 0, n_score

  def score(self, s, b, h, q_idx, kv_idx, refs, start, size):
    """score_mod(s, b, h, q_idx, kv_idx) on the tile (s already scaled)."""
    prog = self.analysis.score_mod
    if prog is None:
      return s
    env = self._loads(prog, refs, self._offsets()[0], start, size)
    jaxpr = prog.traced.jaxpr
    env.update(zip(jaxpr.invars, (s, b, h, q_idx, kv_idx)))
    out, = blockeval.evaluate(jaxpr, env, jaxpr.outvars, prog.skip)
    return jnp.broadcast_to(out.astype(jnp.float32), s.shape)

  def mask(self, b, h, q_idx, kv_idx, refs, start, size):
    """mask_mod on the tile (True = keep), or None without a mask_mod."""
    prog = self.analysis.mask_mod
    if prog is None:
      return None
    env = self._loads(prog, refs, self._offsets()[1], start, size)
    jaxpr = prog.traced.jaxpr
    env.update(zip(jaxpr.invars, (b, h, q_idx, kv_idx)))
    out, = blockeval.evaluate(jaxpr, env, jaxpr.outvars, prog.skip)
    return out


def tile_indices(start, size, axis):
  """Absolute positions of a tile's rows (axis 0) or columns (axis 1)."""
  shape = (size, 1) if axis == 0 else (1, size)
  return start + jax.lax.broadcasted_iota(jnp.int32, shape, axis)

