"""Block sparsity from mask_mod: which (q block, kv block) tiles to visit.

A small Pallas kernel evaluates mask_mod tile by tile (with the same
interpreter and captured-array blocking as the attention kernels) and
classifies each tile as empty, partial or full, so no dense `[B, H, Sq, Skv]`
mask ever exists in memory. The classes become index lists, as in
FlexAttention: for each q block, the kv blocks that need the mask and the
ones that don't (forward and dq), and the transpose (dk/dv). Empty tiles
are never visited. When mask_mod ignores b or h, that axis has size 1 and
is broadcast.

Masks are built eagerly (`block_mask`, and `attention` where mask_mod's
captured arrays are concrete) by a compiled builder, cached per mask and
shape, that takes the captured arrays as arguments; inside a trace where
they are traced, in that trace. A mask records what it was built from
(mask_mod's program fingerprint, a digest of the captured values) for
`attention` to check against the mask_mod it is passed with.
"""
from __future__ import annotations

import builtins
import dataclasses
import functools
import hashlib
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_attn.kernels import backend, tiles
from pallas_attn.schedule.config import clamp_block
from pallas_attn.spec import blockeval, primitives
from pallas_attn.spec.analysis import VariantAnalysis, analyze_variant
from pallas_attn.spec.trace import eval_inlined, is_concrete, is_literal

EMPTY, PARTIAL, FULL = 0, 1, 2
_NO_QUERIES = -1  # a q block past the sequence end, while re-tiling: neither keeps nor masks


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["kv_partial_num", "kv_partial_idx", "kv_full_num", "kv_full_idx",
                 "q_partial_num", "q_partial_idx", "q_full_num", "q_full_idx", "classes",
                 "digest"],
    meta_fields=["block_q", "block_k", "seq_q", "seq_kv", "program"])
@dataclasses.dataclass(frozen=True)
class BlockMask:
  """Tile lists of a mask. `kv_*` are q-major (`[Bm, Hm, nq]` counts and
  `[Bm, Hm, nq, nk]` kv block indices); `q_*` are kv-major, for the dk/dv
  pass. Bm, Hm are 1 where the mask does not depend on b, h. `classes`
  (`[Bm, Hm, nq, nk]` int8, EMPTY / PARTIAL / FULL) is what the lists were
  made from; `with_blocks` re-tiles it.

  What it was built from, for `attention` to check against its mask_mod:
  `program`, the mask_mod program's fingerprint (`program_fingerprint`;
  static, so known under a trace), and `digest`, a uint32 scalar hash of
  the captured arrays' values (`values_digest`: a tracer where they were
  traced; None where mask_mod captures none, and in the lists `attention`
  hands its kernels)."""
  kv_partial_num: jax.Array
  kv_partial_idx: jax.Array
  kv_full_num: jax.Array
  kv_full_idx: jax.Array
  q_partial_num: jax.Array
  q_partial_idx: jax.Array
  q_full_num: jax.Array
  q_full_idx: jax.Array
  classes: jax.Array
  digest: jax.Array | None
  block_q: int
  block_k: int
  seq_q: int
  seq_kv: int
  program: str

  def q_major(self, num_blocks: int | None = None) -> tuple:
    """(partial num, partial idx, full num, full idx) per q block; with
    `num_blocks`, for a grid of that many q blocks (see `_grid_rows`)."""
    return _grid_rows((self.kv_partial_num, self.kv_partial_idx, self.kv_full_num,
                       self.kv_full_idx), num_blocks)

  def kv_major(self, num_blocks: int | None = None) -> tuple:
    """(partial num, partial idx, full num, full idx) per kv block, as `q_major`."""
    return _grid_rows((self.q_partial_num, self.q_partial_idx, self.q_full_num,
                       self.q_full_idx), num_blocks)

  def with_blocks(self, block_q: int, block_k: int) -> "BlockMask":
    """The same mask on other tiles (powers of two), e.g. the backward's.

    Larger tiles are exact (full if every sub-tile is full, empty if every
    one is empty, else partial); smaller tiles inherit their parent's class,
    so a partial parent's empty sub-tiles are visited with the mask applied
    (correct, slightly more work than a rebuild).
    """
    if (block_q, block_k) == (self.block_q, self.block_k):
      return self
    if not self.can_retile(block_q, block_k):
      raise ValueError(f"cannot re-tile a block mask from {self.block_q}x{self.block_k} to "
                       f"{block_q}x{block_k}: block sizes must divide each other")
    classes = _retile(self.classes, 2, self.block_q, block_q, -(-self.seq_q // block_q),
                      _NO_QUERIES)
    classes = _retile(classes, 3, self.block_k, block_k, -(-self.seq_kv // block_k), EMPTY)
    return from_classes(classes, block_q=block_q, block_k=block_k, seq_q=self.seq_q,
                        seq_kv=self.seq_kv, program=self.program, digest=self.digest)

  def can_retile(self, block_q: int, block_k: int) -> bool:
    """Whether `with_blocks` takes these sizes: each divides the current one or is a multiple."""
    return all(max(a, b) % min(a, b) == 0
               for a, b in ((self.block_q, block_q), (self.block_k, block_k)))

  def density(self) -> float:
    """Fraction of tiles visited (partial or full)."""
    nq, nk = self.kv_partial_idx.shape[-2:]
    visited = self.kv_partial_num.sum() + self.kv_full_num.sum()
    return visited / (nq * nk * self.kv_partial_num.shape[0] * self.kv_partial_num.shape[1])


KV_BLOCKS_PER_PROGRAM = 16  # the width of a program's output block: a power of two
TILE_BOUNDS = True  # decide tiles by bounds first (`bound_classes`); False: evaluate all
_UNDECIDED = 3  # `classify_tiles(..., exact=False)`: a tile the bounds leave open


# Tile bounds. Most tiles of a structured mask are decided by bounds on the
# values mask_mod computes over the tile, with no position evaluated: for
# `(ids[qi] == ids[ki]) & (qi >= ki)` the q block's ids in [2, 2] and the kv
# block's in [3, 4] make every position false, and `qi >= ki` holds at
# every position when the q block's first row is past the kv block's last
# key. `_tile_bounds` runs mask_mod's jaxpr on such bounds: each integer
# value as a range [lo, hi] that holds at every real position of the tile
# (`_Range`, with `ok` = 0 where an operation may have overflowed or is not
# modelled, then nothing is known), each boolean as (`must`: true at every
# position, `may`: true at some) (`_Bool`), anything else (floats, bitwise
# integer ops, gathers) as unknown. The rules are sound, so a decision is
# exact. Bounds show a tile may be kept, never that it is partial: a tile
# whose corners mask_mod keeps and drops is (`_corners_disagree`). A tile
# left open after both is evaluated position by position as before.
# The bounds of all tiles are computed at once, as arrays (`bound_classes`:
# a few fused XLA kernels), not tile by tile in the classify kernel: there
# each tile's chain of a load, block reductions and scalar rules ran one
# after another, slower on an H100 (0.235 ms at 16k) than evaluating every
# position (0.164 ms).

_I32 = np.iinfo(np.int32)
_MUL_SAFE = 46340  # |x|, |y| <= this: x * y fits int32


@dataclasses.dataclass(frozen=True)
class _Range:
  lo: jax.Array  # int32 scalars
  hi: jax.Array
  ok: jax.Array  # int32 1: the range holds; 0: nothing is known
  dtype: np.dtype  # the traced value's (a signed integer of at most 32 bits)


@dataclasses.dataclass(frozen=True)
class _Bool:
  must: jax.Array  # int32 1: true at every position
  may: jax.Array   # int32 0: false at every position


_UNKNOWN = None
# Masks are not differentiated: stop_gradient is an identity there too.
_IDENTITIES = primitives.names(primitives.IDENTITY, primitives.NO_GRADIENT)


def _flag(condition):
  return jnp.asarray(condition).astype(jnp.int32)


def _i32(x):
  return jnp.asarray(x, jnp.int32)


def _integer(dtype) -> bool:
  dtype = np.dtype(dtype)
  return dtype.kind == "i" and dtype.itemsize <= 4


def _fit(lo, hi, ok, dtype) -> _Range:
  """A range of `dtype` values computed in int32: unknown where it leaves a narrower dtype."""
  if np.dtype(dtype).itemsize < 4:
    info = np.iinfo(dtype)
    ok = ok * _flag(lo >= info.min) * _flag(hi <= info.max)
  return _Range(lo, hi, ok, np.dtype(dtype))


def _as_range(x):
  """A `_Bool` as the range of its 0/1 values; a `_Range` as itself; else None."""
  if isinstance(x, _Bool):
    return _Range(x.must, x.may, _i32(1), np.dtype(bool))
  return x


def _as_bool(x) -> _Bool:
  if isinstance(x, _Bool):
    return x
  return _Bool(_i32(0), _i32(1))  # unknown


def _hull(values, dtype):
  """What holds for any one of `values` at each position (a select by an unknown predicate)."""
  if np.dtype(dtype) == np.bool_:
    bools = [_as_bool(v) for v in values]
    must, may = bools[0].must, bools[0].may
    for v in bools[1:]:
      must, may = must * v.must, jnp.maximum(may, v.may)
    return _Bool(must, may)
  if any(not isinstance(v, _Range) for v in values):
    return _UNKNOWN
  lo, hi, ok = values[0].lo, values[0].hi, values[0].ok
  for v in values[1:]:
    lo, hi, ok = jnp.minimum(lo, v.lo), jnp.maximum(hi, v.hi), ok * v.ok
  return _Range(lo, hi, ok, np.dtype(dtype))


def _div(x, y):  # lax's truncating division, broadcasting
  return jax.lax.div(*jnp.broadcast_arrays(x, y))


def _rem(x, y):
  return jax.lax.rem(*jnp.broadcast_arrays(x, y))


def _add_ok(x, y, total):
  """int32 `x + y == total` did not overflow (x, y of one sign and total of the other)."""
  return _flag(jnp.bitwise_and(jnp.bitwise_xor(x, total), jnp.bitwise_xor(y, total)) >= 0)


def _sub_ok(x, y, diff):
  return _flag(jnp.bitwise_and(jnp.bitwise_xor(x, y), jnp.bitwise_xor(x, diff)) >= 0)


def _arith(prim, args, params, dtype):
  """Rules for integer arithmetic on `_Range`s; None where there is none."""
  a = args[0]
  b = args[1] if len(args) > 1 else None
  wide = np.dtype(dtype).itemsize == 4
  if prim == "add":
    lo, hi = a.lo + b.lo, a.hi + b.hi
    ok = a.ok * b.ok * (_add_ok(a.lo, b.lo, lo) * _add_ok(a.hi, b.hi, hi) if wide else 1)
    return _fit(lo, hi, ok, dtype)
  if prim == "sub":
    lo, hi = a.lo - b.hi, a.hi - b.lo
    ok = a.ok * b.ok * (_sub_ok(a.lo, b.hi, lo) * _sub_ok(a.hi, b.lo, hi) if wide else 1)
    return _fit(lo, hi, ok, dtype)
  if prim == "neg":
    return _fit(-a.hi, -a.lo, a.ok * _flag(a.lo != _I32.min), dtype)
  if prim == "mul":
    small = [_flag((x >= -_MUL_SAFE) & (x <= _MUL_SAFE)) for x in (a.lo, a.hi, b.lo, b.hi)]
    corners = [x * y for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    lo = functools.reduce(jnp.minimum, corners)
    hi = functools.reduce(jnp.maximum, corners)
    return _fit(lo, hi, a.ok * b.ok * math.prod(small), dtype)
  if prim in ("max", "min"):
    pick = jnp.maximum if prim == "max" else jnp.minimum
    return _Range(pick(a.lo, b.lo), pick(a.hi, b.hi), a.ok * b.ok, np.dtype(dtype))
  if prim == "abs":
    lo = jnp.where(a.lo >= 0, a.lo, jnp.where(a.hi <= 0, -a.hi, _i32(0)))
    return _fit(lo, jnp.maximum(-a.lo, a.hi), a.ok * _flag(a.lo != _I32.min), dtype)
  if prim == "sign":
    sign = lambda x: _flag(x > 0) - _flag(x < 0)
    return _Range(sign(a.lo), sign(a.hi), a.ok, np.dtype(dtype))
  if prim == "clamp":  # clamp(min, x, max): nondecreasing in each
    low, x, high = args
    clamp = lambda m, v, n: jnp.minimum(jnp.maximum(v, m), n)
    return _Range(clamp(low.lo, x.lo, high.lo), clamp(low.hi, x.hi, high.hi),
                  low.ok * x.ok * high.ok, np.dtype(dtype))
  if prim in ("div", "rem"):
    # Positive divisors only (then no division by zero, no MIN / -1).
    ok = a.ok * b.ok * _flag(b.lo > 0)
    d_lo, d_hi = jnp.maximum(b.lo, 1), jnp.maximum(b.hi, 1)
    if prim == "div":  # truncating: monotone in each operand for d > 0
      corners = [_div(x, y) for x in (a.lo, a.hi) for y in (d_lo, d_hi)]
      return _Range(functools.reduce(jnp.minimum, corners), functools.reduce(jnp.maximum, corners),
                    ok, np.dtype(dtype))
    # rem takes the dividend's sign and is below the divisor in magnitude;
    # one divisor and one quotient over the range: monotone, exact ends.
    exact = _flag(d_lo == d_hi) * _flag(_div(a.lo, d_lo) == _div(a.hi, d_lo))
    lo = jnp.where(exact == 1, _rem(a.lo, d_lo), jnp.where(a.lo >= 0, _i32(0), 1 - d_hi))
    hi = jnp.where(exact == 1, _rem(a.hi, d_lo), jnp.where(a.hi <= 0, _i32(0), d_hi - 1))
    return _Range(lo, hi, ok, np.dtype(dtype))
  if prim == "integer_pow" and params["y"] in (1, 2):
    return a if params["y"] == 1 else _arith("mul", [a, a], {}, dtype)
  return None


def _compare(prim, a, b) -> _Bool:
  ok = a.ok * b.ok
  if prim in ("gt", "ge"):
    a, b, prim = b, a, {"gt": "lt", "ge": "le"}[prim]
  if prim == "lt":
    must, may = _flag(a.hi < b.lo), _flag(a.lo < b.hi)
  elif prim == "le":
    must, may = _flag(a.hi <= b.lo), _flag(a.lo <= b.hi)
  else:  # eq, ne
    same = _flag(a.lo == a.hi) * _flag(b.lo == b.hi) * _flag(a.lo == b.lo)
    overlap = _flag(a.lo <= b.hi) * _flag(b.lo <= a.hi)
    must, may = (same, overlap) if prim == "eq" else (1 - overlap, 1 - same)
  return _Bool(ok * must, jnp.maximum(1 - ok, may))


def _logic(prim, args) -> _Bool:
  a = args[0]
  if prim == "not":
    return _Bool(1 - a.may, 1 - a.must)
  b = args[1]
  if prim in ("and", "min"):
    return _Bool(a.must * b.must, a.may * b.may)
  if prim in ("or", "max"):
    return _Bool(jnp.maximum(a.must, b.must), jnp.maximum(a.may, b.may))
  # xor, ne: true where exactly one is; eq: where both agree.
  a_false, b_false = 1 - a.may, 1 - b.may
  one = jnp.maximum(a.must * b_false, a_false * b.must)
  both_same = jnp.maximum(a.must * b.must, a_false * b_false)
  return _Bool(one, 1 - both_same) if prim in ("xor", "ne") else _Bool(both_same, 1 - one)


def _bound_eqn(eqn, args):
  """The bound of `eqn`'s output from its operands' bounds (`_UNKNOWN` where there is no rule)."""
  prim = eqn.primitive.name
  dtype = np.dtype(eqn.outvars[0].aval.dtype)
  if prim in _IDENTITIES:
    return args[0]
  if prim == "select_n":
    pred, cases = args[0], args[1:]
    if len(cases) != 2 or not isinstance(pred, _Bool):
      return _hull(cases, dtype)
    if dtype == np.bool_:
      (c0, c1), p = [_as_bool(c) for c in cases], pred
      p_false = 1 - p.may
      must = jnp.maximum(c0.must * c1.must, jnp.maximum(p_false * c0.must, p.must * c1.must))
      may = jnp.maximum(c0.may * (1 - p.must), c1.may * p.may)
      return _Bool(must, may)
    hull = _hull(cases, dtype)
    if hull is _UNKNOWN:
      return _UNKNOWN
    c0, c1 = cases
    pick = lambda x0, x1, both: jnp.where(pred.must == 1, x1,
                                          jnp.where(pred.may == 0, x0, both))
    return _Range(pick(c0.lo, c1.lo, hull.lo), pick(c0.hi, c1.hi, hull.hi),
                  pick(c0.ok, c1.ok, hull.ok), dtype)
  if prim == "convert_element_type":
    x = args[0]
    if dtype == np.bool_:
      if isinstance(x, _Bool):
        return x
      if isinstance(x, _Range):  # x != 0
        return _compare("ne", x, _Range(_i32(0), _i32(0), _i32(1), x.dtype))
      return _UNKNOWN
    if _integer(dtype):
      x = _as_range(x)
      return _UNKNOWN if x is _UNKNOWN else _fit(x.lo, x.hi, x.ok, dtype)
    return _UNKNOWN
  if any(a is _UNKNOWN for a in args):
    return _UNKNOWN
  if prim in ("and", "or", "not", "xor") or (prim in ("max", "min", "eq", "ne")
                                             and all(isinstance(a, _Bool) for a in args)):
    if all(isinstance(a, _Bool) for a in args):
      return _logic(prim, args)
    return _UNKNOWN  # bitwise integer ops
  if prim in ("lt", "le", "gt", "ge", "eq", "ne"):
    return _compare(prim, *[_as_range(a) for a in args])
  if _integer(dtype) and all(isinstance(a, _Range) for a in args):
    return _arith(prim, args, eqn.params, dtype) or _UNKNOWN
  return _UNKNOWN


def _literal_bound(v):
  dtype = np.dtype(v.aval.dtype)
  if dtype == np.bool_:
    flag = _i32(int(bool(v.val)))
    return _Bool(flag, flag)
  if _integer(dtype):
    c = _i32(int(v.val))
    return _Range(c, c, _i32(1), dtype)
  return _UNKNOWN


def _capture_bound(x, use, extents, blocks):
  """The bound of capture `x` read by `use` over each tile, broadcastable to
  `[Bm, Hm, nq, nk]` (`extents`), or `_UNKNOWN` for gathers and floats.
  Each q / kv axis is cut into `blocks` (block_q, block_k) and reduced; an
  index past an axis reads its last element, as `dynamic_slice` clamps
  (padding rows and keys are counted too: a wider bound, still sound)."""
  if use.is_gather:
    return _UNKNOWN
  x = jnp.asarray(x)
  is_bool = x.dtype == jnp.bool_
  if not is_bool and not _integer(x.dtype):
    return _UNKNOWN
  dtype = np.dtype(x.dtype)
  lo = hi = x.astype(jnp.int32)
  places = []  # the [Bm, Hm, nq, nk] axis of each remaining axis
  for address, size in zip(use.axes, x.shape):
    axis = len(places)
    if not isinstance(address, str):  # a fixed index
      lo, hi = (jnp.take(v, min(int(address), size - 1), axis=axis) for v in (lo, hi))
      continue
    place = "b h q kv".split().index(address)
    count = extents[place]
    block = blocks[place - 2] if place >= 2 else 1
    if address in ("b", "h"):
      index = jnp.clip(jnp.arange(count), 0, size - 1)
      lo, hi = (jnp.take(v, index, axis=axis) for v in (lo, hi))
    else:  # the first count * block along the axis, its last element repeated past it
      length = count * block
      widths = [(0, 0)] * lo.ndim
      widths[axis] = (0, max(0, length - size))
      lo, hi = (jax.lax.slice_in_dim(jnp.pad(v, widths, mode="edge"), 0, length, axis=axis)
                for v in (lo, hi))
    if block > 1:
      split = lambda v: v.reshape(v.shape[:axis] + (count, block) + v.shape[axis + 1:])
      lo, hi = split(lo).min(axis=axis + 1), split(hi).max(axis=axis + 1)
    places.append(place)
  order = sorted(range(len(places)), key=places.__getitem__)
  shape = [extents[n] if n in places else 1 for n in range(4)]
  lo, hi = (jnp.transpose(v, order).reshape(shape) for v in (lo, hi))
  if is_bool:
    return _Bool(lo, hi)
  return _Range(lo, hi, _i32(1), dtype)


def _tile_bounds(prog, inputs, loads):
  """(must, may) int32 flags of mask_mod over tiles (arrays of any
  broadcastable shape): `inputs` the bounds of (b, h, q, kv) over their real
  positions, `loads` of each capture use; None where no rule reaches the
  result (then no tile can be decided)."""
  jaxpr = prog.traced.jaxpr
  env = dict(zip(jaxpr.invars, inputs))
  env.update({var: loads[use] for var, use in prog.loads})
  for n in blockeval.needed_equations(jaxpr, jaxpr.outvars, env):
    if n in prog.skip:
      continue
    eqn = jaxpr.eqns[n]
    args = [_literal_bound(v) if is_literal(v) else env[v] for v in eqn.invars]
    env[eqn.outvars[0]] = _bound_eqn(eqn, args)
  out, = jaxpr.outvars
  result = _literal_bound(out) if is_literal(out) else env[out]
  return None if result is _UNKNOWN else (result.must, result.may)


def bound_classes(analysis: VariantAnalysis, batch, heads, seq_q, seq_kv, block_q, block_k):
  """`[Bm, Hm, nq, nk]` int32 classes of the tiles that bounds decide,
  `_UNDECIDED` elsewhere; None where no bound reaches the result. Plain
  array operations on all tiles at once (a few fused XLA kernels), with
  captured arrays reduced per block."""
  prog = analysis.mask_mod
  deps = analysis.mask_deps
  extents = (batch if "b" in deps else 1, heads if "h" in deps else 1,
             -(-seq_q // block_q), -(-seq_kv // block_k))
  shape = lambda n: tuple(extents[n] if m == n else 1 for m in range(4))
  point = lambda n: jnp.arange(extents[n], dtype=jnp.int32).reshape(shape(n))
  int32 = np.dtype(np.int32)

  def span(n, block, length):
    start = point(n) * block
    return _Range(start, jnp.minimum(start + block, length) - 1, _i32(1), int32)
  inputs = (_Range(point(0), point(0), _i32(1), int32), _Range(point(1), point(1), _i32(1), int32),
            span(2, block_q, seq_q), span(3, block_k, seq_kv))
  loads = [_capture_bound(prog.traced.consts[use.capture], use, extents, (block_q, block_k))
           for use in prog.uses]
  bound = _tile_bounds(prog, inputs, loads)
  if bound is None:
    return None
  must, may = bound
  # must: every real position kept (full; partial where the tile has
  # padding keys); else not may: none kept; else a tile whose corners
  # disagree is partial; else left open.
  padded = _flag(inputs[3].hi - inputs[3].lo + 1 < block_k)
  open_ = jnp.where(_corners_disagree(prog, inputs, extents), PARTIAL, _UNDECIDED)
  classes = jnp.where(must == 1, 2 - padded, jnp.where(may == 0, EMPTY, open_))
  return jnp.broadcast_to(classes.astype(jnp.int32), extents)


def _corners_disagree(prog, inputs, extents):
  """`[Bm, Hm, nq, nk]` bool: mask_mod keeps one corner of the tile (its
  first and last real query and key) and drops another, so the tile is
  partial. Bounds cannot show that (only that a tile may be kept); the
  corners decide the tiles that a causal diagonal, a window's edge or a
  document boundary crosses, which would otherwise be evaluated position by
  position in the classify kernel."""
  b, h = (jnp.broadcast_to(r.lo, extents) for r in inputs[:2])
  q, kv = (jnp.broadcast_to(jnp.stack([r.lo, r.hi]), (2,) + extents) for r in inputs[2:])
  keep = jax.vmap(lambda *point: eval_inlined(prog.traced.jaxpr, prog.traced.consts,
                                              *point)[0])
  corners = [keep(b.ravel(), h.ravel(), q[i].ravel(), kv[j].ravel()).reshape(extents)
             for i in (0, 1) for j in (0, 1)]
  kept = functools.reduce(jnp.logical_or, corners)
  dropped = functools.reduce(jnp.logical_or, [~c for c in corners])
  return kept & dropped


def live_kv_blocks(analysis: VariantAnalysis, consts, lengths, first_query, seq_q: int,
                   heads_kv: int, group: int, block_k: int, num_blocks: int):
  """`[B, Hm, 2]` int32: per sequence (and kv head, where mask_mod reads h)
  the first kv block, and one past the last, that mask_mod may keep for
  one of its queries, by the tile bounds; None where no bound reaches
  mask_mod's result. For the split-KV template, which splits only these
  blocks (a window over a long cache reads the window).

  Sequence b's queries sit at `first_query[b] + [0, seq_q)`, its keys at
  `[0, lengths[b])`; a kv head's queries are heads `[j * group, (j + 1) *
  group)`. `consts`: mask_mod's captured arrays. Those read by b, kv and
  constants are bounded per block; other reads are unknown (sound, and
  then decide nothing).
  """
  prog = analysis.mask_mod
  batch = lengths.shape[0]
  heads = heads_kv if "h" in analysis.mask_deps else 1
  int32 = np.dtype(np.int32)
  column = lambda x: jnp.asarray(x, jnp.int32).reshape(batch, 1, 1, 1)
  lengths, first_query = column(lengths), column(first_query)
  batches = jnp.arange(batch, dtype=jnp.int32).reshape(batch, 1, 1, 1)
  kv_head = jnp.arange(heads, dtype=jnp.int32).reshape(1, heads, 1, 1)
  starts = jnp.arange(num_blocks, dtype=jnp.int32).reshape(1, 1, 1, num_blocks) * block_k
  ends = jnp.maximum(jnp.minimum(starts + block_k, lengths) - 1, starts)
  inputs = (_Range(batches, batches, _i32(1), int32),
            _Range(kv_head * group, kv_head * group + group - 1, _i32(1), int32),
            _Range(first_query, first_query + seq_q - 1, _i32(1), int32),
            _Range(starts, ends, _i32(1), int32))
  loads = [_UNKNOWN if {"h", "q"} & set(use.axes) else
           _capture_bound(consts[use.capture], use, (batch, 1, 1, num_blocks),
                          (1, block_k)) for use in prog.uses]
  bound = _tile_bounds(prog, inputs, loads)
  if bound is None:
    return None
  live = (bound[1] == 1) & (starts < lengths)
  live = jnp.broadcast_to(live, (batch, heads, 1, num_blocks))[:, :, 0]
  first = jnp.argmax(live, axis=-1)
  end = num_blocks - jnp.argmax(live[..., ::-1], axis=-1)
  alive = jnp.any(live, axis=-1)
  return jnp.stack([jnp.where(alive, first, 0), jnp.where(alive, end, 0)], -1).astype(jnp.int32)


def _classify_kernel(*refs, analysis, operands, block_q, block_k, seq_q, seq_kv, num_kv_blocks,
                     known):
  """Classes of one q block's tiles against `KV_BLOCKS_PER_PROGRAM` kv blocks,
  by evaluating mask_mod at each position; with `known` (classes from
  `bound_classes`, the last input), only of the tiles those leave open."""
  cap_refs, out_ref = refs[:-1], refs[-1]
  if known:
    cap_refs, known_ref = cap_refs[:-1], cap_refs[-1]
  qi, chunk, b, h = (pl.program_id(n) for n in range(4))
  tile = tiles.TileContext(analysis, operands, blocked="q")
  q_start = qi * block_q
  q_idx = tiles.tile_indices(q_start, block_q, axis=0)
  width = out_ref.shape[-1]
  first = chunk * width
  slots = jax.lax.broadcasted_iota(jnp.int32, (1, width), 1)
  # A tile is full when all its query rows keep all block_k keys: padding
  # keys count as masked (their tile runs the mask), padding queries not at all.
  positions = jnp.minimum(block_q, seq_q - q_start) * block_k

  def evaluated(j):
    kv_start = (first + j) * block_k
    kv_idx = tiles.tile_indices(kv_start, block_k, axis=1)
    keep = jnp.broadcast_to(tile.mask(b, h, q_idx, kv_idx, cap_refs, kv_start, block_k),
                            (block_q, block_k))
    if seq_kv % block_k:
      keep = jnp.logical_and(keep, kv_idx < seq_kv)
    if seq_q % block_q:
      keep = jnp.logical_and(keep, q_idx < seq_q)
    kept = jnp.sum(keep.astype(jnp.int32))
    # Integer arithmetic, not selects on booleans (Triton rejects mixed-type selects):
    # class = any kept + all kept = EMPTY (0), PARTIAL (1) or FULL (2).
    return (kept > 0).astype(jnp.int32) + (kept == positions).astype(jnp.int32)

  count = jnp.minimum(width, num_kv_blocks - first)
  zeros = jnp.zeros((1, width), jnp.int32)
  if not known:
    out_ref[...] = jax.lax.fori_loop(
        0, count, lambda j, c: c + (slots == j).astype(jnp.int32) * evaluated(j), zeros)
    return
  given = known_ref[...]
  open_ = (given == _UNDECIDED).astype(jnp.int32)

  def visit(j, classes):  # a 0/1-trip loop: Triton's lowering takes it where a cond is refused
    at = (slots == j).astype(jnp.int32)
    return jax.lax.fori_loop(0, jnp.sum(open_ * at), lambda _, c: c + at * evaluated(j),
                             classes)
  # Programs with no open tile (most) skip the loop.
  found = jax.lax.fori_loop(0, jnp.minimum(jnp.sum(open_), 1),
                            lambda _, c: jax.lax.fori_loop(0, count, visit, c), zeros)
  out_ref[...] = jnp.where(open_ == 1, found, given)


def classify_tiles(analysis: VariantAnalysis, batch, heads, seq_q, seq_kv, block_q, block_k,
                   interpret, *, bounds: bool | None = None, exact: bool = True):
  """`[Bm, Hm, nq, nk]` int32 tile classes (EMPTY / PARTIAL / FULL).

  Tiles that bounds decide (`bound_classes`, with `bounds`, default
  `TILE_BOUNDS`) get their class from those; the kernel evaluates mask_mod
  at every position of the others (without `exact`, they are returned as
  `_UNDECIDED`, to measure the bounds). One program per (q block, run of
  `KV_BLOCKS_PER_PROGRAM` kv blocks, b, h): at long sequences many short
  programs fill the GPU where one program per q block, looping over every
  kv block, would run a few long ones.
  """
  bounds = TILE_BOUNDS if bounds is None else bounds
  nq, nk = -(-seq_q // block_q), -(-seq_kv // block_k)
  known = (bound_classes(analysis, batch, heads, seq_q, seq_kv, block_q, block_k)
           if bounds else None)
  if not exact:
    if known is None:
      deps = analysis.mask_deps
      known = jnp.full((batch if "b" in deps else 1, heads if "h" in deps else 1, nq, nk),
                       _UNDECIDED, jnp.int32)
    return known
  num_chunks = -(-nk // KV_BLOCKS_PER_PROGRAM)
  deps = analysis.mask_deps
  mb = batch if "b" in deps else 1
  mh = heads if "h" in deps else 1
  arrays, operands = tiles.capture_operands(analysis, nq * block_q, nk * block_k)
  in_specs = [tiles.capture_block_spec(op, x.shape, blocked="q", block=block_q)
              for op, x in zip(operands, arrays)]
  in_specs = [pl.BlockSpec(s.block_shape, lambda i, c, b, h, f=s.index_map: f(i, b, h))
              for s in in_specs]
  chunk_spec = pl.BlockSpec((None, None, 1, KV_BLOCKS_PER_PROGRAM),
                            lambda i, c, b, h: (b, h, i, c))
  if known is not None:
    arrays.append(jnp.pad(known, [(0, 0)] * 3 + [(0, num_chunks * KV_BLOCKS_PER_PROGRAM - nk)]))
    in_specs.append(chunk_spec)
  kernel = functools.partial(
      _classify_kernel, analysis=analysis, operands=operands, block_q=block_q,
      block_k=block_k, seq_q=seq_q, seq_kv=seq_kv, num_kv_blocks=nk, known=known is not None)
  call = backend.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((mb, mh, nq, num_chunks * KV_BLOCKS_PER_PROGRAM),
                                     jnp.int32),
      grid=(nq, num_chunks, mb, mh),
      in_specs=in_specs,
      out_specs=chunk_spec,
      num_warps=4, num_stages=1, interpret=interpret, name="pallas_attn_block_mask")
  return call(*arrays)[..., :nk]


def _grid_rows(lists, num_blocks: int | None):
  """Lists with one row per block of a grid that may be longer than the
  mask (sequences padded to the tiles of both passes): the extra blocks hold
  only padding and visit nothing. Triton does not clamp block indices, so
  every grid block needs a row."""
  rows = lists[0].shape[2]
  if num_blocks is None or num_blocks == rows:
    return lists
  return tuple(jnp.pad(x, [(0, 0), (0, 0), (0, num_blocks - rows)] + [(0, 0)] * (x.ndim - 3))
               for x in lists)


def _retile(classes, axis: int, block: int, new_block: int, count: int, beyond: int):
  """Tile classes along `axis` for tiles of `new_block` (`count` of them);
  the two sizes divide each other (`BlockMask.can_retile`). Blocks past the
  sequence end count as `beyond`: padding queries are ignored (as tiles
  classify them), padding keys are masked."""
  if new_block <= block:
    return jnp.repeat(classes, block // new_block, axis=axis)[
        (slice(None),) * axis + (slice(0, count),)]
  ratio = new_block // block
  widths = [(0, 0)] * classes.ndim
  widths[axis] = (0, count * ratio - classes.shape[axis])
  grouped = jnp.pad(classes, widths, constant_values=beyond)
  shape = classes.shape[:axis] + (count, ratio) + classes.shape[axis + 1:]
  grouped = grouped.reshape(shape)
  ignored = grouped == _NO_QUERIES
  full = jnp.all((grouped == FULL) | ignored, axis=axis + 1)
  empty = jnp.all((grouped == EMPTY) | ignored, axis=axis + 1)
  return jnp.where(full, FULL, jnp.where(empty, EMPTY, PARTIAL)).astype(classes.dtype)


def _tile_lists(classes):
  """Per row of `classes`: (partial count, partial indices first, full count, full indices).

  Each index row lists its class's blocks in order, then the other blocks in
  order: the stable partition that a sort would give, placed directly (a
  prefix count gives each block its slot; one scatter writes both lists).
  """
  n = classes.shape[-1]
  flags = jnp.stack([classes == PARTIAL, classes == FULL]).astype(jnp.int32)
  order = jnp.arange(n, dtype=jnp.int32)
  through = jnp.cumsum(flags, axis=-1, dtype=jnp.int32)  # listed blocks up to each one
  count = through[..., -1:]
  slot = jnp.where(flags == 1, through - 1, count + order - through)
  row_start = jnp.arange(slot.size // n, dtype=jnp.int32).reshape(slot.shape[:-1] + (1,)) * n
  idx = jnp.zeros(slot.size, jnp.int32).at[(row_start + slot).ravel()].set(
      jnp.broadcast_to(order, slot.shape).ravel(), unique_indices=True).reshape(slot.shape)
  return count[0, ..., 0], idx[0], count[1, ..., 0], idx[1]


def from_classes(classes, *, block_q, block_k, seq_q, seq_kv, program, digest) -> BlockMask:
  return BlockMask(*_tile_lists(classes), *_tile_lists(jnp.swapaxes(classes, -1, -2)),
                   classes.astype(jnp.int8), digest, block_q=block_q, block_k=block_k,
                   seq_q=seq_q, seq_kv=seq_kv, program=program)


def program_fingerprint(prog) -> str:
  """What `VariantAnalysis.fingerprint` hashes of one program, here
  mask_mod's (that one also hashes score_mod and the rownorm, which a block
  mask does not depend on): its jaxpr as text and its captured arrays'
  shapes and dtypes, not their values, so the same whether those are
  concrete or traced."""
  h = hashlib.sha256(str(prog.traced.jaxpr).encode())
  for c in prog.traced.consts:
    h.update(f"{np.shape(c)}{jnp.result_type(c)};".encode())
  return h.hexdigest()[:16]


def _mix(x):
  """MurmurHash3's 32-bit finalizer: every input bit flips about half the output bits."""
  x = (x ^ (x >> 16)) * jnp.uint32(0x85EBCA6B)
  x = (x ^ (x >> 13)) * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def _words(x):
  """`x`'s bits as flat uint32 words (one per element of up to 4 bytes, two of 8)."""
  x = jnp.asarray(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32).ravel()
  if x.dtype.itemsize < 4:
    x = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    return x.astype(jnp.uint32).ravel()
  return jax.lax.bitcast_convert_type(x, jnp.uint32).ravel()


def values_digest(consts):
  """A uint32 hash of the captured arrays' bits: the sum over words of
  mix(word ^ mix(position)), positions running on across the arrays, so
  that a word moved elsewhere (permuted ids, a moved document boundary)
  changes the sum. Elementwise integer ops and one reduction per array."""
  total, start = jnp.uint32(0), 0
  for x in consts:
    words = _words(x)
    position = jnp.arange(start, start + words.size, dtype=jnp.uint32)
    total = total + jnp.sum(_mix(words ^ _mix(position)), dtype=jnp.uint32)
    start += words.size
  return total


@jax.jit
def _digest_is(digest, consts):
  return values_digest(consts) == digest


def built_over(block_mask: BlockMask, consts) -> bool:
  """Whether `block_mask`'s digest is that of `consts` (both concrete): one
  small compiled computation and one scalar read, run at once also inside a
  trace (at trace time: the values are constants there)."""
  with jax.ensure_compile_time_eval():
    return bool(_digest_is(block_mask.digest, tuple(consts)))


def build_block_masks(analysis: VariantAnalysis, batch, heads, seq_q, seq_kv, tilings,
                      interpret) -> tuple:
  """Block masks at each (block_q, block_k) of `tilings`, classified once at
  the finest tiles and coarsened (exactly) to each; a tiling that the finest
  does not divide is classified on its own. Where tile bounds decide most
  tiles, a tile costs little whatever its size, so each tiling is classified
  on its own: fewer tiles than the finest for the coarser ones, and a
  jitted forward keeps only its own. Each records mask_mod's program and
  the digest of its captured arrays (see `BlockMask`)."""
  consts = analysis.mask_mod.traced.consts
  built_from = dict(program=program_fingerprint(analysis.mask_mod),
                    digest=values_digest(consts) if consts else None)

  def build(block_q, block_k):
    classes = classify_tiles(analysis, batch, heads, seq_q, seq_kv, block_q, block_k, interpret)
    return from_classes(classes, block_q=block_q, block_k=block_k, seq_q=seq_q, seq_kv=seq_kv,
                        **built_from)

  if TILE_BOUNDS and has_tile_bounds(analysis):
    built = {}
    for tiling in tilings:
      if tiling not in built:
        built[tiling] = build(*tiling)
    return tuple(built[tiling] for tiling in tilings)
  finest = build(min(bq for bq, _ in tilings), min(bk for _, bk in tilings))
  return tuple(finest.with_blocks(bq, bk) if finest.can_retile(bq, bk) else build(bq, bk)
               for bq, bk in tilings)


_BUILDERS: dict = {}  # fingerprint, argument types, shapes -> compiled builder
_TRACED: dict = {}    # block_mask's jaxpr text, shapes -> (compiled builder, capture positions)
_CACHE_MAX = 64


def _remember(cache: dict, key, value):
  """Stores `value` under `key`, dropping the oldest entry past `_CACHE_MAX`."""
  if len(cache) >= _CACHE_MAX:
    cache.pop(next(iter(cache)))
  cache[key] = value
  return value


def _arg_types(consts) -> tuple:
  """What a compiled builder is specialized to in its arguments."""
  return tuple((jax.typeof(c), getattr(c, "sharding", None)) for c in consts)


def _with_consts(analysis: VariantAnalysis, consts) -> VariantAnalysis:
  mask = analysis.mask_mod
  return dataclasses.replace(analysis, mask_mod=dataclasses.replace(
      mask, traced=dataclasses.replace(mask.traced, consts=tuple(consts))))


def compiled_builder(analysis: VariantAnalysis, batch, heads, seq_q, seq_kv, tilings, interpret):
  """`build_block_masks` of `analysis` as a compiled function of mask_mod's
  captured arrays (concrete), cached per fingerprint, argument types, shapes,
  tilings and interpret mode: new values of the same shapes reuse it, and no
  value is baked in. A compiled executable runs at once, also when called
  inside another trace, whose constants its masks then are.
  """
  consts = analysis.mask_mod.traced.consts
  key = (analysis.fingerprint(), _arg_types(consts), batch, heads, seq_q, seq_kv, tilings,
         interpret)
  if key not in _BUILDERS:
    program = _with_consts(analysis, ())  # keeps no captured values alive
    build = lambda consts: build_block_masks(_with_consts(program, consts), batch, heads, seq_q,
                                             seq_kv, tilings, interpret)
    _remember(_BUILDERS, key, jax.jit(build).lower(consts).compile())
  return _BUILDERS[key]


_MASK_ARGS = [jax.ShapeDtypeStruct((), jnp.int32)] * 4


def _traced_key(mask_mod):
  """(mask_mod's jaxpr as text and its captures' types, its captured
  arrays): what the analysis fingerprint hashes, from one trace and no
  analysis. None where mask_mod does not trace (the analysis then says why)
  or captures traced values."""
  try:
    closed = jax.make_jaxpr(mask_mod)(*_MASK_ARGS)
  except Exception:  # analyze_variant reports it
    return None, ()
  if not all(map(is_concrete, closed.consts)):
    return None, ()
  return (str(closed.jaxpr), _arg_types(closed.consts)), tuple(closed.consts)


def _positions(consts, captured):
  """Where each of the analysis' `consts` is among `captured` (the arrays of
  `_traced_key`'s trace), or None if one is not (an array held inside a
  nested jit: then every call runs the analysis)."""
  positions = [next((n for n, c in enumerate(captured) if c is x), None) for x in consts]
  return None if None in positions else tuple(positions)


# Eager builds without a trace. What mask_mod's trace can depend on is its
# code and what that code reads: closure cells, defaults and the globals it
# names, and so on through the functions among them. `_Walk` describes that
# as a hashable key, with every concrete jax Array by its type alone and
# collected as a leaf, so a new closure of the same code over new arrays of
# the same shapes (per-batch document ids) finds the builder of the first
# and passes it the new arrays. A key is cached only after a trace with the
# leaves abstract shows that the jaxpr cannot depend on their values (as it
# would through `int(x)`); values the walk cannot describe (objects, other
# modules, tracers) fall back to tracing mask_mod on every call.

class _Unkeyable(Exception):
  """A value `_Walk` cannot describe."""


_LIBRARIES = frozenset(["jax", "jaxlib", "numpy", "ml_dtypes", "math", "operator", "functools",
                        "builtins", "typing"])
_LIBRARY_MODULES = _LIBRARIES | {"pallas_attn"}  # module objects that hold no user values
_SCALARS = frozenset([bool, int, str, bytes, type(None), type(Ellipsis)])
_MAX_NODES = 2000  # values one walk may visit before giving up (huge global containers)


def _library(module, names=_LIBRARIES) -> bool:
  return isinstance(module, str) and module.partition(".")[0] in names


@functools.lru_cache(maxsize=512)
def _code_names(code) -> tuple:
  """Names that `code` and the code nested in it (lambdas, comprehensions)
  look up: globals, builtins and attribute names alike."""
  names = list(code.co_names)
  for c in code.co_consts:
    if isinstance(c, types.CodeType):
      names.extend(_code_names(c))
  return tuple(dict.fromkeys(names))


class _Walk:
  """`value(v)` -> (key, v'): a hashable description of `v` and, with
  `substitute` (one value per leaf), `v` rebuilt with those in place of its
  leaves (functions re-created over new cells and globals)."""

  def __init__(self, substitute=None):
    self.leaves, self._leaf_of, self._active = [], {}, set()
    self._substitute, self._nodes = substitute, 0

  def value(self, v):
    self._nodes += 1
    if self._nodes > _MAX_NODES:
      raise _Unkeyable("too large")
    t = type(v)
    if t in _SCALARS:
      return (t, v), v
    if t is float:
      return (t, v.hex()), v  # -0.0 is not 0.0, as a traced literal
    if t is complex:
      return (t, v.real.hex(), v.imag.hex()), v
    if isinstance(v, jax.Array):
      return self._array(v)
    if t is tuple or t is list:
      parts = [self.value(x) for x in v]
      return (t, *(k for k, _ in parts)), t(x for _, x in parts) if self._substitute else v
    if t is dict:
      parts = [(self.value(k)[0], k, self.value(x)) for k, x in v.items()]
      key = (t, *((kk, xk) for kk, _, (xk, _) in parts))
      return key, {k: x for _, k, (_, x) in parts} if self._substitute else v
    if t is types.FunctionType:
      return self._function(v)
    if isinstance(v, functools.partial) and _library(t.__module__):  # jax's Partial too
      (fk, f), (ak, a), (kk, kw) = (self.value(x) for x in (v.func, v.args, v.keywords))
      return (t, fk, ak, kk), t(f, *a, **kw) if self._substitute else v
    if t is types.ModuleType:
      if _library(v.__name__, _LIBRARY_MODULES):
        return (t, v.__name__), v
      raise _Unkeyable(f"module {v.__name__}")
    if isinstance(v, np.ndarray):  # mutable: by value, where small
      if v.dtype.hasobject or v.nbytes > 4096:
        raise _Unkeyable("numpy array")
      return (t, v.shape, v.dtype.str, v.tobytes()), v
    if isinstance(v, np.generic):
      return (t, v.tobytes()), v
    if isinstance(v, np.dtype):
      return (t, v.str), v
    # Library objects (jnp.int32, jax.nn.relu, np.add, min): themselves.
    if _library(t.__module__) and _library(getattr(v, "__module__", t.__module__)):
      try:
        hash(v)
      except TypeError:
        raise _Unkeyable(t.__name__) from None
      return ("object", v), v
    raise _Unkeyable(t.__name__)

  def _array(self, x):
    if not is_concrete(x):
      raise _Unkeyable("traced array")
    n = self._leaf_of.get(id(x))
    if n is not None:  # one array met twice is one argument; two arrays are two
      key = ("same", n)
    else:
      n = self._leaf_of[id(x)] = len(self.leaves)
      self.leaves.append(x)
      key = ("array", jax.typeof(x), x.sharding)
    return key, x if self._substitute is None else self._substitute[n]

  def _function(self, fn):
    if _library(fn.__module__) and not fn.__closure__:
      return ("object", fn), fn
    if id(fn) in self._active:
      raise _Unkeyable("recursive function")
    self._active.add(id(fn))
    code, scope = fn.__code__, fn.__globals__
    names, new_globals = [], {}
    for name in _code_names(code):
      if name in scope:
        key, value = self.value(scope[name])
        names.append((name, key))
        new_globals[name] = value
      else:  # a builtin, an attribute, or a NameError at trace time
        names.append((name, name in builtins.__dict__))
    try:
      cells = [self.value(c.cell_contents) for c in fn.__closure__ or ()]
    except ValueError:  # an empty cell
      raise _Unkeyable("empty closure cell") from None
    defaults = self.value(fn.__defaults__)
    kwdefaults = self.value(fn.__kwdefaults__)
    self._active.discard(id(fn))
    key = (types.FunctionType, code, tuple(names), tuple(k for k, _ in cells), defaults[0],
           kwdefaults[0])
    if not self._substitute:
      return key, fn
    new = types.FunctionType(code, {**scope, **new_globals}, fn.__name__, defaults[1],
                             tuple(types.CellType(c) for _, c in cells))
    new.__kwdefaults__ = kwdefaults[1]
    return key, new


def _closure_key(mask_mod):
  """(`_Walk`'s key of mask_mod, its leaves), or (None, ()) where it has none."""
  walk = _Walk()
  try:
    return walk.value(mask_mod)[0], walk.leaves
  except _Unkeyable:
    return None, ()


def _value_independent(mask_mod, leaves) -> bool:
  """Whether mask_mod traces with its leaves abstract (then its jaxpr is a
  function of the walk's key alone), none of them left a constant."""
  def rebuilt(leaves, *indices):
    return _Walk(substitute=leaves).value(mask_mod)[1](*indices)
  avals = [jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=jax.typeof(x).weak_type)
           for x in leaves]
  try:
    closed = jax.make_jaxpr(rebuilt)(avals, *_MASK_ARGS)
  except Exception:
    return False
  return not any(c is x for c in closed.consts for x in leaves)


_CLOSURES: dict = {}  # (_closure_key, shape) -> (compiled builder, capture positions) | None


def _eager_builder(mask_mod, shape):
  """(build, argument): `build(argument)[0]` is mask_mod's block mask at `shape`."""
  key, leaves = _closure_key(mask_mod)
  try:
    entry = _CLOSURES.get((key, *shape), _CLOSURES)
  except TypeError:  # an unhashable value in the key
    key = None
  if key is not None:
    key = (key, *shape)
    if entry is not _CLOSURES and entry is not None:
      build, positions = entry
      return build, tuple(leaves[p] for p in positions)
    if entry is _CLOSURES:  # first seen: analyzed once, below, and remembered
      # Through a new function: JAX reuses a function object's last trace,
      # also when the values it reads (in the key) have changed since.
      fresh = lambda b, h, q_idx, kv_idx: mask_mod(b, h, q_idx, kv_idx)
      analysis = analyze_variant(mask_mod=fresh)
      consts = analysis.mask_mod.traced.consts
      positions = _positions(consts, leaves)
      entry = None
      if (all(map(is_concrete, consts)) and positions is not None
          and _value_independent(mask_mod, leaves)):
        entry = (compiled_builder(analysis, *shape), positions)
      _remember(_CLOSURES, key, entry)
      if entry is not None:
        return entry[0], consts
  traced_key, captured = _traced_key(mask_mod)
  traced_key = None if traced_key is None else (traced_key, *shape)
  if traced_key not in _TRACED:
    analysis = analyze_variant(mask_mod=mask_mod)
    consts = analysis.mask_mod.traced.consts
    if not all(map(is_concrete, consts)):
      return (lambda _: build_block_masks(analysis, *shape)), None
    build = compiled_builder(analysis, *shape)
    positions = _positions(consts, captured)
    if traced_key is None or positions is None:
      return build, consts
    _remember(_TRACED, traced_key, (build, positions))
  build, positions = _TRACED[traced_key]
  return build, tuple(captured[p] for p in positions)


@functools.lru_cache(maxsize=256)
def _shape(batch, heads, seq_q, seq_kv, block_q, block_kv, interpret) -> tuple:
  """`compiled_builder`'s shape arguments for `block_mask`'s."""
  from pallas_attn.schedule.config import heuristic_config
  default = heuristic_config(seq_q, seq_kv, 128, 128)
  block_q = clamp_block(block_q or default.block_q, seq_q)
  block_k = clamp_block(block_kv or default.block_k, seq_kv)
  return (batch, heads, seq_q, seq_kv, ((block_q, block_k),),
          backend.resolve_interpret(interpret))


def block_mask(mask_mod, batch, heads, seq_q, seq_kv, *, block_q=None, block_kv=None,
               interpret=None) -> BlockMask:
  """Builds the tile lists of `mask_mod` once, for reuse across calls and layers.

  Pass the result as `attention(..., mask_mod=mask_mod, block_mask=bm)`. The
  block sizes become the kernel's block_q / block_k (defaults: the dense
  heuristic's, 128x64 for d=128, not the 128x128 tiles a mask_mod alone
  gets: a block mask can be coarsened for the other pass, not refined, so
  the backward runs on these tiles too).

  The first call per mask, shapes and blocks compiles a builder that takes
  mask_mod's captured arrays as arguments. Later calls with the same
  mask_mod, or a new closure of the same code over new arrays of the same
  shapes (new document ids), run it without tracing mask_mod, where what
  mask_mod reads is plain (closures, globals and defaults of functions,
  arrays, numbers, containers; see `_Walk`); otherwise they trace it once.
  Inside a jitted function whose arguments mask_mod captures, the mask is
  built in that trace instead.

  The mask records mask_mod's program and a digest of its captured values,
  which `attention` checks (see its `block_mask` argument); the digest is
  computed by the builder, on device, with no transfer.
  """
  build, argument = _eager_builder(
      mask_mod, _shape(batch, heads, seq_q, seq_kv, block_q, block_kv, interpret))
  return build(argument)[0]


def has_tile_bounds(analysis: VariantAnalysis) -> bool:
  """Whether the tile bounds can decide any tile of mask_mod (see `_tile_bounds`)."""
  prog = analysis.mask_mod

  def bound():  # on placeholder bounds: whether a rule reaches the result is static
    rng = lambda dtype=np.dtype(np.int32): _Range(_i32(0), _i32(0), _i32(1), dtype)
    loads = []
    for use in prog.uses:
      dtype = np.dtype(jnp.result_type(prog.traced.consts[use.capture]))
      loads.append(_UNKNOWN if use.is_gather else _Bool(_i32(0), _i32(1)) if dtype == np.bool_
                   else rng(dtype) if _integer(dtype) else _UNKNOWN)
    return _tile_bounds(prog, (rng(), rng(), rng(), rng()), loads)
  return bool(jax.make_jaxpr(bound)().out_avals)


def keeps_nothing_between(analysis: VariantAnalysis, q_span: tuple, kv_span: tuple) -> bool:
  """Whether tile bounds show that mask_mod keeps no position with q_idx and
  kv_idx in the inclusive spans, for every b, h and every value of its
  captured arrays (True for causal masks with the queries before the keys)."""
  def bound():
    rng = lambda lo, hi: _Range(_i32(lo), _i32(hi), _i32(1), np.dtype(np.int32))
    inputs = (rng(0, _I32.max), rng(0, _I32.max), rng(*q_span), rng(*kv_span))
    return _tile_bounds(analysis.mask_mod, inputs, [_UNKNOWN] * len(analysis.mask_mod.uses))
  with jax.ensure_compile_time_eval():
    result = bound()
  return result is not None and int(result[1]) == 0


def describe_build(analysis: VariantAnalysis, batch, heads, seq_q, seq_kv) -> str:
  """One line on what `attention` pays to build the block mask of `analysis`
  when no block_mask is passed (`pallas-attn explain`)."""
  if not analysis.mask_mod.traced.consts:
    return ("block mask: a constant of the jitted call, built at trace time by a builder "
            "compiled once per shape")
  deps = analysis.mask_deps
  sizes = (batch if "b" in deps else 1, heads if "h" in deps else 1, seq_q, seq_kv)
  where = ("the tiles that bounds on its values leave open (partial ones, for masks of "
           "comparisons and captured ids)" if has_tile_bounds(analysis) else
           "every tile (its values have no bounds: floats, bitwise ops or gathers)")
  return ("block mask: a constant built at trace time where mask_mod's arrays are closed "
          "over; where they are traced (jit arguments), rebuilt in each call: mask_mod "
          f"evaluated on {where}, of {' x '.join(map(str, sizes))} (b, h, q, kv) positions "
          f"(~{math.prod(sizes) / 1e6:.3g} M); build it once per batch with "
          "pallas_attn.block_mask(...) and pass block_mask= to avoid that (attention checks "
          "it against mask_mod's program, and against its arrays' values where those are "
          "concrete; not under jit with them as arguments: build it in the step, from them)")
