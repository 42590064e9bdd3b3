"""Tile-level pieces shared by the forward and backward templates.

* Captured arrays: each `CaptureUse` becomes one kernel operand whose
  BlockSpec follows its addressing (a slope per head is one element, a
  `[B, Skv]` key bias is one row, a `[B, H, Sq, Skv]` bias is a q block by
  the whole kv length that the kernel slices per kv block). A gather's
  operand has its gathered axes flattened into one last axis, passed whole,
  and read at the tile's computed (clamped) positions. A hoisted diagonal
  term (spec/diagonal.py) is a vector per head over `q - kv`: read by the
  Triton templates as a gather at `q - kv`, by the Mosaic GPU ones as tiles
  of a diagonal bank (`diagonal_banks`).
* `TileContext`: evaluates score_mod and mask_mod on a `[block_q, block_k]`
  tile with the in-kernel interpreter; the backward evaluates score_mod on
  capture values it passes in, so that it can differentiate with respect to
  them.
* `visit_blocks`: the loops over kv (or q) blocks shared by all templates.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_attn.kernels import backend
from pallas_attn.schedule.config import next_power_of_2
from pallas_attn.spec import blockeval, diagonal
from pallas_attn.spec.analysis import VariantAnalysis
from pallas_attn.spec.captures import GATHERED
from pallas_attn.spec.diagonal import DIAGONAL


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
  axes: tuple      # per operand axis: 'b' | 'h' | 'q' | 'kv' | int | GATHERED (last)
  is_bool: bool
  gather_dims: tuple = ()  # sizes of the array axes flattened into the GATHERED axis
  diagonals: tuple = ()    # a term's (seq_q_pad, seq_kv_pad): its vector has one per q - kv

  @property
  def is_gather(self) -> bool:
    return bool(self.gather_dims)

  @property
  def is_term(self) -> bool:
    return bool(self.diagonals)

  def diagonal_index(self, q_idx, kv_idx):
    """A term vector's position for `q_idx - kv_idx` (tiles broadcast)."""
    seq_q, seq_kv = self.diagonals
    return jnp.clip(q_idx - kv_idx + seq_kv - 1, 0, seq_q + seq_kv - 2).astype(jnp.int32)

  def bank_row(self, fixed_axis: str, fixed_start, other_start):
    """The first row of a `diagonal_bank`'s tile for rows of `fixed_axis`
    from `fixed_start` and columns of the other axis from `other_start`."""
    other = self.diagonals[1] if fixed_axis == "q" else self.diagonals[0]
    return fixed_start - other_start + other

  def flat_index(self, indices):
    """Position in the flattened gathered axis of per-axis index tiles,
    each clamped into its axis (as `dynamic_slice` clamps)."""
    flat, stride = 0, 1
    for index, dim in reversed(list(zip(indices, self.gather_dims))):
      flat = flat + jnp.clip(index.astype(jnp.int32), 0, dim - 1) * stride
      stride *= dim
    return jnp.asarray(flat, jnp.int32)


def _flatten_gathered(x, axes):
  """(array with the GATHERED axes moved last, flattened and zero-padded to
  a power of two; operand axes; sizes of the gathered axes)."""
  kept = [n for n, a in enumerate(axes) if a != GATHERED]
  gathered = [n for n, a in enumerate(axes) if a == GATHERED]
  dims = tuple(x.shape[n] for n in gathered)
  x = jnp.transpose(x, kept + gathered).reshape([x.shape[n] for n in kept] + [-1])
  size = x.shape[-1]
  x = jnp.pad(x, [(0, 0)] * len(kept) + [(0, next_power_of_2(size) - size)])
  return x, tuple(axes[n] for n in kept) + (GATHERED,), dims


def capture_operands(analysis: VariantAnalysis, seq_q_pad: int, seq_kv_pad: int,
                     consts=None, heads: int = 1):
  """The arrays to pass to a kernel, one per capture use (score_mod's first).

  Boolean arrays travel as int32; q- and kv-addressed axes are padded to the
  padded sequence lengths so that reads of padding stay in bounds. `consts`
  (score_mod's, mask_mod's captured arrays) replaces the traced ones, e.g.
  with the differentiable arguments of a custom_vjp. A term's vector is
  evaluated here, for `heads` query heads.
  """
  if consts is None:
    consts = tuple(() if prog is None else prog.traced.consts
                   for prog in (analysis.score_mod, analysis.mask_mod))
  arrays, operands = [], []
  for prog, prog_consts in zip((analysis.score_mod, analysis.mask_mod), consts):
    if prog is None:
      continue
    for use in prog.uses:
      if use.is_term:
        x = diagonal.term_vector(prog.traced.jaxpr, prog_consts, prog.inputs,
                                 prog.terms[use.term], heads, seq_q_pad, seq_kv_pad)
        size = x.shape[-1]
        arrays.append(jnp.pad(x, [(0, 0), (0, next_power_of_2(size) - size)], mode="edge"))
        operands.append(CaptureOperand(use.axes, False, diagonals=(seq_q_pad, seq_kv_pad)))
        continue
      x = jnp.asarray(prog_consts[use.capture])
      is_bool = x.dtype == jnp.bool_
      if is_bool:
        x = x.astype(jnp.int32)
      if use.is_gather:
        x, axes, dims = _flatten_gathered(x, use.axes)
        arrays.append(x)
        operands.append(CaptureOperand(axes, is_bool, dims))
        continue
      for axis, a in enumerate(use.axes):
        if a == "q":
          x = _pad_axis(x, axis, seq_q_pad)
        elif a == "kv":
          x = _pad_axis(x, axis, seq_kv_pad)
      arrays.append(x)
      operands.append(CaptureOperand(use.axes, is_bool))
  return arrays, tuple(operands)


def gathered_per_row(analysis: VariantAnalysis) -> VariantAnalysis:
  """The analysis with every captured read that a head or query index
  addresses turned into a gather (its 'h', 'q' and 'kv' axes read at the
  tile's indices, as `CaptureUse` gathers are).

  For templates whose tile rows are not one head's consecutive queries:
  the split-KV template packs the query heads of a GQA group and their
  query tokens into one tile's rows, so `h` and `q_idx` are per-row
  columns there, not a program's block. Reads by b, kv and constants only
  keep their blocked loads.
  """
  def convert(prog):
    if prog is None:
      return None
    prog = prog.without_terms()
    index_var = dict(zip(prog.inputs, prog.traced.jaxpr.invars))
    uses = []
    for use in prog.uses:
      if not use.is_gather and not {"h", "q"} & set(use.axes):
        uses.append(use)
        continue
      gathered, axes, index_vars = iter(use.index_vars), [], []
      for axis in use.axes:
        if axis == GATHERED or axis in ("h", "q", "kv"):
          axes.append(GATHERED)
          index_vars.append(next(gathered) if axis == GATHERED else index_var[axis])
        else:
          axes.append(axis)
      uses.append(dataclasses.replace(use, axes=tuple(axes), index_vars=tuple(index_vars)))
    return dataclasses.replace(prog, uses=tuple(uses))

  return dataclasses.replace(analysis, score_mod=convert(analysis.score_mod),
                             mask_mod=convert(analysis.mask_mod))


def capture_block_spec(operand: CaptureOperand, shape, *, blocked: str, block: int,
                       head_block: int = 1):
  """BlockSpec for a grid `(i, b, h)` where `i` blocks the `blocked` axis
  ('q' or 'kv') by `block`; the other sequence axis is passed whole.

  With `head_block > 1` the grid's `h` is a kv head and head-addressed axes
  hold its `head_block` query heads (GQA in the dk/dv pass).
  """
  block_shape, picks = [], []
  for a, dim in zip(operand.axes, shape):
    if a in (GATHERED, DIAGONAL):
      block_shape.append(dim)
      picks.append(0)
    elif a == blocked:
      block_shape.append(block)
      picks.append("i")
    elif a in ("q", "kv"):
      block_shape.append(dim)
      picks.append(0)
    elif a == "h" and head_block > 1:
      block_shape.append(head_block)
      picks.append("h")
    else:
      block_shape.append(None)
      picks.append(a)

  def index_map(i, b, h):
    env = {"i": i, "b": b, "h": h}
    return tuple(env[p] if isinstance(p, str) else p for p in picks)

  return pl.BlockSpec(tuple(block_shape), index_map)


def load_capture(ref, operand: CaptureOperand, *, blocked: str, start, size, head=None):
  """Loads a capture as a tile broadcastable to `[block_q, block_k]`.

  The `blocked` axis is already one block; the other sequence axis is read
  at `pl.ds(start, size)`; head axes, where the ref holds several heads, at
  `head`.
  """
  kept = [a for a in operand.axes if a in ("q", "kv") or (a == "h" and head is not None)]
  seq_axes = [a for a in kept if a != "h"]
  if not kept:
    x = ref[...]
  else:
    idx = tuple(head if a == "h" else slice(None) if a == blocked else pl.ds(start, size)
                for a in kept)
    x = ref[idx]
    if seq_axes == ["kv", "q"]:
      x = x.T
    elif seq_axes == ["q"]:
      x = x[:, None]
    elif seq_axes == ["kv"]:
      x = x[None, :]
  return x != 0 if operand.is_bool else x


def diagonal_banks(arrays, operands, fixed_axis: str, width: int):
  """`arrays` with each term's vector `[Hv, Sq_pad + Skv_pad - 1 (padded)]`
  replaced by its diagonal bank for tiles whose rows run along `fixed_axis`
  and whose columns are at most `width` positions of the other axis:
  `[Hv, Sq_pad + Skv_pad, width]` float32, the tile at rows (x0, ...),
  columns (y0, ...) being the bank's rows from `bank_row(fixed_axis, x0,
  y0)`, columns from 0. Linear memory, dense tile loads (no gather)."""
  banked = []
  for x, operand in zip(arrays, operands):
    if operand.is_term:
      seq_q, seq_kv = operand.diagonals
      sign, other = (1, seq_kv) if fixed_axis == "q" else (-1, seq_q)
      rows = jnp.arange(seq_q + seq_kv, dtype=jnp.int32)[:, None]
      cols = jnp.arange(width, dtype=jnp.int32)[None, :]
      difference = sign * (rows - other - cols)  # q - kv at each bank position
      x = jnp.take(x, operand.diagonal_index(difference, 0), axis=-1)
    banked.append(x)
  return banked


def gather_capture(ref, operand: CaptureOperand, flat, head=None):
  """Reads a gather operand at flat positions `flat` (any tile shape);
  `head` picks the head where the ref holds several."""
  x = ref[flat] if head is None or "h" not in operand.axes else ref[head, flat]
  return x != 0 if operand.is_bool else x


@dataclasses.dataclass(frozen=True)
class TileContext:
  """Evaluates the variant's elementwise programs on one tile."""
  analysis: VariantAnalysis
  operands: tuple  # CaptureOperand per capture ref
  blocked: str     # which sequence axis the grid blocks ('q' or 'kv')
  head_block: int = 1  # query heads per program (see capture_block_spec)
  fast_math: bool = False  # approximate transcendentals (backend.fast_math_overrides)
  # Reads a non-gather capture as a tile: `(ref, operand, start, size) ->
  # value`, the other sequence axis read at `pl.ds(start, size)`. None: the
  # Triton templates' blocked refs (`load_capture`).
  loader: Callable | None = None

  def _load_uses(self, prog, refs, offset, inputs, start, size):
    """(one loaded tile per use of `prog`, refs from `offset` on; the flat
    positions of each gather, None for other uses).

    Uses come in the order the program reads them, so a gather's index
    tiles are evaluated from the inputs and the values loaded before it.
    """
    jaxpr = prog.traced.jaxpr
    h = inputs[prog.inputs.index("h")]
    head = h % self.head_block if self.head_block > 1 else None
    env = dict(zip(jaxpr.invars, inputs))
    values, flats = [], []
    for n, use in enumerate(prog.uses):
      ref, operand = refs[offset + n], self.operands[offset + n]
      if operand.is_term and self.loader is None:
        position = dict(zip(prog.inputs, inputs))
        flat = operand.diagonal_index(position["q"], position["kv"])
        value = gather_capture(ref, operand, flat, head)
      elif operand.is_gather:
        indices = blockeval.evaluate(jaxpr, env, use.index_vars, prog.skip)
        flat = operand.flat_index(indices)
        value = gather_capture(ref, operand, flat, head)
      elif self.loader is not None:
        flat, value = None, self.loader(ref, operand, start, size)
      else:
        flat = None
        value = load_capture(ref, operand, blocked=self.blocked, start=start, size=size,
                             head=head)
      env.update({var: value for var, use_index in prog.loads if use_index == n})
      values.append(value)
      flats.append(flat)
    return tuple(values), tuple(flats)

  def _evaluate(self, prog, inputs, captures):
    return prog.evaluate(inputs, captures, backend.fast_math_overrides(self.fast_math))

  def score_captures(self, s, b, h, q_idx, kv_idx, refs, start, size) -> tuple:
    """(score_mod's captured values on the tile, one per use; each gather's
    flat positions, None for other uses)."""
    prog = self.analysis.score_mod
    if prog is None:
      return (), ()
    return self._load_uses(prog, refs, 0, (s, b, h, q_idx, kv_idx), start, size)

  def score_with(self, s, b, h, q_idx, kv_idx, captures):
    """score_mod on the tile with the given captured values (a function of
    `s` and `captures` that the backward differentiates)."""
    prog = self.analysis.score_mod
    if prog is None:
      return s
    out = self._evaluate(prog, (s, b, h, q_idx, kv_idx), captures)
    return jnp.broadcast_to(out.astype(jnp.float32), s.shape)

  def score(self, s, b, h, q_idx, kv_idx, refs, start, size):
    """score_mod(s, b, h, q_idx, kv_idx) on the tile (s already scaled)."""
    captures, _ = self.score_captures(s, b, h, q_idx, kv_idx, refs, start, size)
    return self.score_with(s, b, h, q_idx, kv_idx, captures)

  def mask(self, b, h, q_idx, kv_idx, refs, start, size):
    """mask_mod on the tile (True = keep), or None without a mask_mod."""
    prog = self.analysis.mask_mod
    if prog is None:
      return None
    offset = 0 if self.analysis.score_mod is None else len(self.analysis.score_mod.uses)
    inputs = (b, h, q_idx, kv_idx)
    captures, _ = self._load_uses(prog, refs, offset, inputs, start, size)
    return self._evaluate(prog, inputs, captures)


def tile_indices(start, size, axis):
  """Absolute positions of a tile's rows (axis 0) or columns (axis 1)."""
  shape = (size, 1) if axis == 0 else (1, size)
  return start + jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def program_block():
  """The block of grid axis 0 that this program owns: last to first.

  Under causal-like masks the last query blocks see the most keys; launching
  them first (longest job first) leaves short programs for the final wave.
  `heaviest_first` gives the BlockSpecs the same order.
  """
  return pl.num_programs(0) - 1 - pl.program_id(0)


def heaviest_first(specs, num_blocks: int):
  """BlockSpecs for a grid whose axis 0 runs blocks last to first (see `program_block`)."""
  return [pl.BlockSpec(s.block_shape, lambda i, *rest, f=s.index_map: f(num_blocks - 1 - i, *rest))
          for s in specs]


def visit_blocks(visit, state, *, lists=None, num_plain=0, num_blocks=0):
  """Folds `visit(block, state, masked)` over the blocks a program sees.

  With a block mask, `lists` is (partial count, partial index, full count,
  full index), as loaded values and `j -> block` readers: full blocks run
  without the mask, partial ones with it. Without one, blocks
  `[0, num_plain)` run unmasked and `[num_plain, num_blocks)` masked.
  """
  if lists is not None:
    partial_num, partial_idx, full_num, full_idx = lists
    state = _visit_listed(lambda b, st: visit(b, st, False), state, full_num, full_idx)
    return _visit_listed(lambda b, st: visit(b, st, True), state, partial_num, partial_idx)
  state = jax.lax.fori_loop(0, num_plain, lambda j, st: visit(j, st, False), state)
  return jax.lax.fori_loop(num_plain, num_blocks, lambda j, st: visit(j, st, True), state)


def _visit_listed(visit, state, count, block_at):
  """Visits the `count` listed blocks, in order.

  Lists are sorted, so when the last minus the first equals count - 1 the
  blocks are contiguous (causal, sliding windows, documents): they are then
  visited by a plain range loop whose block addresses do not depend on a
  value loaded inside the loop, so Triton can software-pipeline the K/V
  loads. Otherwise the list loop runs. One of the two loops has no trips
  (two loops, not a `cond`, which Triton's lowering rejects here).
  """
  first = block_at(0)
  last = block_at(jnp.maximum(count - 1, 0))
  num_ranged = jnp.where(last - first == count - 1, count, 0)
  state = jax.lax.fori_loop(0, num_ranged, lambda j, st: visit(first + j, st), state)
  return jax.lax.fori_loop(num_ranged, count, lambda j, st: visit(block_at(j), st), state)
