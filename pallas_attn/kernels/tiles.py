"""Tile-level pieces shared by the forward and backward templates.

* Captured arrays: each `CaptureUse` becomes one kernel operand whose
  BlockSpec follows its addressing (a slope per head is one element, a
  `[B, Skv]` key bias is one row, a `[B, H, Sq, Skv]` bias is a q block by
  the whole kv length that the kernel slices per kv block). A gather's
  operand has its gathered axes flattened into one last axis, passed whole,
  and read at the tile's computed (clamped) positions. A hoisted diagonal
  term (spec/diagonal.py) is evaluated once per call as a vector per head
  over `q - kv`: the Triton templates load its `[q, kv]` tiles densely from
  a diagonal bank (`diagonal_bank`), the Mosaic GPU ones read the vector's
  neighbour pairs (`term_pairs`, `CaptureOperand.vector_window`,
  mosaic_backend.diagonal_tile).
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
from pallas_attn.spec.analysis import VariantAnalysis, consts_of
from pallas_attn.spec.captures import GATHERED, position_free
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
  # per operand axis: 'b' | 'h' | 'q' | 'kv' | int | GATHERED (last); a
  # term's bank: ('h' | 0, DIAGONAL, DIAGONAL), its rows and columns
  axes: tuple
  is_bool: bool
  gather_dims: tuple = ()  # sizes of the array axes flattened into the GATHERED axis
  diagonals: tuple = ()  # a term's (seq_q_pad, seq_kv_pad)
  # a term passed as its vector's pairs `[Hv, seq_q + seq_kv - 1, 2]` (entry
  # q - kv + seq_kv - 1 and the next; `term_pairs`) instead of its bank
  # (`vector_window`)
  vector: bool = False

  @property
  def is_gather(self) -> bool:
    return bool(self.gather_dims)

  @property
  def is_term(self) -> bool:
    return bool(self.diagonals)

  def bank_row(self, row_start, col_start):
    """The first row of the bank's tile whose rows start at query
    `row_start` and columns at key `col_start`; its columns start at 0."""
    return row_start - col_start + self.diagonals[1]

  def vector_window(self, row_start, rows: int, col_start, cols: int, rows_are_queries: bool):
    """The first of the `rows + cols - 1` vector entries that a term's
    `[rows, cols]` tile spans, its rows at positions from `row_start` and
    columns from `col_start` (queries and keys, or keys and queries): the
    tile at (i, j) holds entry `first + cols - 1 + i - j` (`[q, kv]`) or
    `first + rows - 1 - i + j` (`[kv, q]`)."""
    if rows_are_queries:
      return row_start - col_start - cols + self.diagonals[1]
    return col_start - row_start - rows + self.diagonals[1]

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
                     consts=None, heads: int = 1, bank_width: int | None = None):
  """The arrays to pass to a kernel, one per capture use (score_mod's first).

  Boolean arrays travel as int32; q- and kv-addressed axes are padded to the
  padded sequence lengths so that reads of padding stay in bounds. `consts`
  (score_mod's, mask_mod's captured arrays) replaces the traced ones, e.g.
  with the differentiable arguments of a custom_vjp. A term is evaluated
  here, for `heads` query heads, as its bank for tiles of at most
  `bank_width` keys (the kernel's block_k), or without one as its vector's
  pairs (`term_pairs`; the Mosaic GPU kernels read tiles from them,
  mosaic_backend.diagonal_tile).
  """
  if consts is None:
    consts = consts_of(analysis)
  arrays, operands = [], []
  for prog, prog_consts in zip((analysis.score_mod, analysis.mask_mod), consts):
    if prog is None:
      continue
    for use in prog.uses:
      if use.is_term:
        vector = diagonal.term_vector(prog.traced.jaxpr, prog_consts, prog.inputs,
                                      prog.terms[use.term], heads, seq_q_pad, seq_kv_pad)
        if bank_width is None:
          arrays.append(term_pairs(vector))
          operands.append(CaptureOperand(use.axes, False, diagonals=(seq_q_pad, seq_kv_pad),
                                         vector=True))
        else:
          arrays.append(diagonal_bank(vector, seq_q_pad, seq_kv_pad, bank_width))
          operands.append(CaptureOperand(use.axes + (DIAGONAL,), False,
                                         diagonals=(seq_q_pad, seq_kv_pad)))
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


def term_bytes(analysis: VariantAnalysis, heads: int, seq_q_pad: int, seq_kv_pad: int,
               bank_width: int | None = None) -> int:
  """Bytes of the terms' arrays `capture_operands` passes for one pass:
  their banks `bank_width` wide, or without one their vectors' pairs."""
  terms = () if analysis.score_mod is None else analysis.score_mod.terms
  per_head = (2 * (seq_q_pad + seq_kv_pad - 1) if bank_width is None
              else (seq_q_pad + seq_kv_pad) * bank_width)
  return sum((heads if t.per_head else 1) * per_head * 4 for t in terms)


def term_pairs(vector):
  """A term's vector `[Hv, n]` as `[Hv, n, 2]`: each entry beside the next
  (the last beside itself), so that any two neighbours are one aligned
  8-byte load (mosaic_backend.diagonal_tile)."""
  following = jnp.concatenate([vector[:, 1:], vector[:, -1:]], axis=1)
  return jnp.stack([vector, following], axis=-1)


def diagonal_bank(vector, seq_q: int, seq_kv: int, width: int):
  """A term's vector `[Hv, seq_q + seq_kv - 1]` (index `q - kv + seq_kv -
  1`) laid out as `[Hv, seq_q + seq_kv, width]` so that the term on the
  `[q, kv]` tile at queries from q0 and at most `width` keys from kv0 is
  the bank's rows from `q0 - kv0 + seq_kv` (`CaptureOperand.bank_row`),
  columns from 0: row r, column c holds q - kv = r - c - seq_kv. Linear
  memory; dense tile loads instead of a gather per position."""
  rows = jnp.arange(seq_q + seq_kv, dtype=jnp.int32)[:, None]
  cols = jnp.arange(width, dtype=jnp.int32)[None, :]
  index = jnp.clip(rows - cols - 1, 0, seq_q + seq_kv - 2)  # (q - kv) + seq_kv - 1
  return jnp.take(vector, index, axis=-1)


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
  # Triton: (start, size) of the program's block of the `blocked` axis, for
  # terms' bank tiles (set per program with `dataclasses.replace`).
  block: tuple = ()
  # Reads a non-gather capture as a tile: `(ref, operand, start, size) ->
  # value`, the other sequence axis read at `pl.ds(start, size)`. None: the
  # Triton templates' blocked refs (`load_capture`).
  loader: Callable | None = None
  # Captures read by b, h and constants only, loaded once per program
  # (`with_program_loads`): `(ref index, value)` pairs.
  program_loads: tuple = ()
  # A separable score_mod's bias on this tile (`score - s`, spec/separable.py),
  # set per tile by a lowering that builds it from vectors of
  # `separable_part`: `score_with` then adds it instead of evaluating the
  # program at every position.
  bias: object = None

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
    loaded = dict(self.program_loads)
    values, flats = [], []
    for n, use in enumerate(prog.uses):
      ref, operand = refs[offset + n], self.operands[offset + n]
      if offset + n in loaded:
        flat, value = None, loaded[offset + n]
      elif operand.is_term and self.loader is None:
        flat, value = None, self._bank_tile(ref, operand, head, start, size)
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

  def with_program_loads(self, refs):
    """This context with the captures that no position indexes (a per-head
    ALiBi slope, a per-head cap) read once, before a program's loop, by its
    `loader`, instead of at every tile: the slope's read per tile cost the
    Mosaic forward of non-causal ALiBi 10% (H200, B4 H16 S4096)."""
    if self.loader is None:
      return self
    loads = tuple((n, self.loader(ref, operand, None, None))
                  for n, (ref, operand) in enumerate(zip(refs, self.operands))
                  if position_free(operand.axes))
    return dataclasses.replace(self, program_loads=loads)

  def _bank_tile(self, ref, operand, head, start, size):
    """A term's `[block_q, block_k]` tile from its bank (the Triton
    templates' tiles are `[q, kv]` on either grid)."""
    block_start, block_size = self.block
    if self.blocked == "q":
      q_start, rows, kv_start, cols = block_start, block_size, start, size
    else:
      q_start, rows, kv_start, cols = start, size, block_start, block_size
    index = (pl.ds(operand.bank_row(q_start, kv_start), rows),
             slice(None) if cols == ref.shape[-1] else pl.ds(0, cols))
    return ref[index if head is None or operand.axes[0] != "h" else (head, *index)]

  def _evaluate(self, prog, inputs, captures, differentiable=False):
    return prog.evaluate(inputs, captures, backend.fast_math_overrides(self.fast_math),
                         differentiable)

  def score_captures(self, s, b, h, q_idx, kv_idx, refs, start, size) -> tuple:
    """(score_mod's captured values on the tile, one per use; each gather's
    flat positions, None for other uses)."""
    prog = self.analysis.score_mod
    if prog is None:
      return (), ()
    return self._load_uses(prog, refs, 0, (s, b, h, q_idx, kv_idx), start, size)

  def separable_part(self, b, h, q, kv, refs):
    """A separable score_mod's bias `E(q, kv)` (its output at score 0) on
    position values of any broadcastable shapes (vectors, scalars): its
    captured arrays are read by b, h and constants only."""
    prog = self.analysis.score_mod
    inputs = (jnp.float32(0), b, h, q, kv)
    captures, _ = self._load_uses(prog, refs, 0, inputs, None, None)
    return self._evaluate(prog, inputs, captures)

  def score_with(self, s, b, h, q_idx, kv_idx, captures, differentiable=False):
    """score_mod on the tile with the given captured values (a function of
    `s` and `captures` that the backward differentiates, passing
    `differentiable`; with `bias` set, of `s` only)."""
    prog = self.analysis.score_mod
    if prog is None:
      return s
    if self.bias is not None:
      return s + self.bias
    out = self._evaluate(prog, (s, b, h, q_idx, kv_idx), captures, differentiable)
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
