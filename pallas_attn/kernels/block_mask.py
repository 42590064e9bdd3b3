"""Block sparsity from mask_mod: which (q block, kv block) tiles to visit.

A small Pallas kernel evaluates mask_mod tile by tile (with the same
interpreter and captured-array blocking as the attention kernels) and
classifies each tile as empty, partial or full, so no dense `[B, H, Sq, Skv]`
mask ever exists in memory; tiles that bounds on mask_mod's values decide
(spec/mask_bounds.py) are not evaluated. The classes become index lists, as in
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
from pallas_attn.spec.analysis import VariantAnalysis, analyze_variant
from pallas_attn.spec.mask_bounds import (EMPTY, FULL, PARTIAL, UNDECIDED, bound_classes,
                                          has_tile_bounds)
from pallas_attn.spec.trace import is_concrete

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
  open_ = (given == UNDECIDED).astype(jnp.int32)

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
  `UNDECIDED`, to measure the bounds). One program per (q block, run of
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
                       UNDECIDED, jnp.int32)
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
