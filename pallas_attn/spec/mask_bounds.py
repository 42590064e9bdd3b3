"""Bounds on mask_mod's values over tiles: the tiles they decide, no position evaluated.

Most tiles of a structured mask are decided by bounds on the values
mask_mod computes over the tile: for `(ids[qi] == ids[ki]) & (qi >= ki)`
the q block's ids in [2, 2] and the kv block's in [3, 4] make every
position false, and `qi >= ki` holds at every position when the q block's
first row is past the kv block's last key. `_tile_bounds` runs mask_mod's
jaxpr on such bounds: each integer value as a range [lo, hi] that holds at
every real position of the tile (`_Range`, with `ok` = 0 where an operation
may have overflowed or is not modelled, then nothing is known), each
boolean as (`must`: true at every position, `may`: true at some) (`_Bool`),
anything else (floats, bitwise integer ops, gathers) as unknown. The rules
are sound, so a decision is exact. Bounds show a tile may be kept, never
that it is partial: a tile whose corners mask_mod keeps and drops is
(`_corners_disagree`). A tile left open after both is evaluated position by
position by the classify kernel (kernels/block_mask.py).

The bounds of all tiles are computed at once, as arrays (`bound_classes`: a
few fused XLA kernels), not tile by tile in the classify kernel: there each
tile's chain of a load, block reductions and scalar rules ran one after
another, slower on an H100 (0.235 ms at 16k) than evaluating every position
(0.164 ms). The same rules bound a split-KV call's live kv blocks
(`live_kv_blocks`), show a mask keeps nothing between two spans
(`keeps_nothing_between`, context parallelism's layout) and bound the kv
tiles one q block may keep (`kept_kv_tiles`, the forward's grid).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_attn.spec import blockeval, primitives
from pallas_attn.spec.analysis import VariantAnalysis
from pallas_attn.spec.trace import eval_inlined, is_literal

EMPTY, PARTIAL, FULL = 0, 1, 2  # a tile's class: mask_mod keeps none, some or all of its positions
UNDECIDED = 3  # a tile the bounds leave open (`bound_classes`; evaluated by the classify kernel)

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
  `UNDECIDED` elsewhere; None where no bound reaches the result. Plain
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
  open_ = jnp.where(_corners_disagree(prog, inputs, extents), PARTIAL, UNDECIDED)
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


def kept_kv_tiles(analysis: VariantAnalysis, q_span: tuple, block_k: int, num_blocks: int) -> int:
  """How many kv tiles of `block_k` keys, from the first to the last that
  mask_mod may keep for the queries in the inclusive `q_span`, by tile
  bounds that hold for every b, h and captured value: `num_blocks` where
  they decide nothing (a mask read from captured arrays), 3 for a window of
  256 keys over 128 queries on 128-key tiles."""
  end = num_blocks * block_k - 1
  keys_dropped = lambda first, last: keeps_nothing_between(analysis, q_span, (first, last))

  def search(lo, hi, holds):  # the last n in [lo, hi] with holds(n), holds falling in n
    while lo < hi:
      mid = (lo + hi + 1) // 2
      lo, hi = (mid, hi) if holds(mid) else (lo, mid - 1)
    return lo

  first = search(0, num_blocks, lambda n: n == 0 or keys_dropped(0, n * block_k - 1))
  last = num_blocks - search(0, num_blocks - first, lambda n: n == 0 or keys_dropped(
      (num_blocks - n) * block_k, end))
  return last - first
