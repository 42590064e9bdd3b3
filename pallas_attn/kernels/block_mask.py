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

Masks are built eagerly (`block_mask`, and eager `attention` calls, where
mask_mod's captured arrays are concrete) by a compiled builder, cached per
mask and shape (kernels/block_mask_cache.py), that takes the captured arrays
as arguments. While a function is traced (`jax.jit`) nothing is compiled or
run on a device: with concrete captures the bounds alone classify the tiles,
on the host CPU (`build_bounded_masks`); otherwise the build is part of the
traced program. A mask records what it was built from
(mask_mod's program fingerprint, a digest of the captured values) for
`attention` to check against the mask_mod it is passed with.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_attn.kernels import backend, tiles
from pallas_attn.spec.analysis import VariantAnalysis
from pallas_attn.spec.mask_bounds import (EMPTY, FULL, PARTIAL, UNDECIDED, bound_classes,
                                          has_tile_bounds)

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
    """The same mask on other tiles (sizes that divide each other), e.g. the backward's.

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
    # The classify kernel's tiles are powers of two: 192 rows (the Mosaic fp8
    # forward's) are classified as 64-row tiles and coarsened, exactly.
    rows = block_q & -block_q
    classes = classify_tiles(analysis, batch, heads, seq_q, seq_kv, rows, block_k, interpret)
    return from_classes(classes, block_q=rows, block_k=block_k, seq_q=seq_q, seq_kv=seq_kv,
                        **built_from).with_blocks(block_q, block_k)

  if TILE_BOUNDS and has_tile_bounds(analysis):
    built = {}
    for tiling in tilings:
      if tiling not in built:
        built[tiling] = build(*tiling)
    return tuple(built[tiling] for tiling in tilings)
  finest = build(min(bq for bq, _ in tilings), min(bk for _, bk in tilings))
  return tuple(finest.with_blocks(bq, bk) if finest.can_retile(bq, bk) else build(bq, bk)
               for bq, bk in tilings)


def build_bounded_masks(analysis: VariantAnalysis, batch, heads, seq_q, seq_kv,
                        tilings) -> tuple:
  """`build_block_masks` from the tile bounds alone (`bound_classes`): plain
  array operations, no kernel. Tiles the bounds and corners leave open count
  as partial: exact for masks of comparisons of indices and captured ids,
  where an open tile keeps some of its positions."""
  consts = analysis.mask_mod.traced.consts
  built_from = dict(program=program_fingerprint(analysis.mask_mod),
                    digest=values_digest(consts) if consts else None)
  masks = []
  for block_q, block_k in tilings:
    classes = bound_classes(analysis, batch, heads, seq_q, seq_kv, block_q, block_k)
    classes = jnp.where(classes == UNDECIDED, PARTIAL, classes)
    masks.append(from_classes(classes, block_q=block_q, block_k=block_k, seq_q=seq_q,
                              seq_kv=seq_kv, **built_from))
  return tuple(masks)


def describe_build(analysis: VariantAnalysis, batch, heads, seq_q, seq_kv) -> str:
  """One line on what `attention` pays to build the block mask of `analysis`
  when no block_mask is passed (`pallas-attn explain`)."""
  bounded = has_tile_bounds(analysis)
  if not analysis.mask_mod.traced.consts and bounded:
    return ("block mask: a constant of the jitted call, from bounds on mask_mod's values "
            "per tile, on the host at trace time (no kernel)")
  deps = analysis.mask_deps
  sizes = (batch if "b" in deps else 1, heads if "h" in deps else 1, seq_q, seq_kv)
  where = ("the tiles that bounds on its values leave open (partial ones, for masks of "
           "comparisons and captured ids)" if has_tile_bounds(analysis) else
           "every tile (its values have no bounds: floats, bitwise ops or gathers)")
  constant = ("a constant from bounds on its values per tile, on the host at trace time (no "
              "kernel), where mask_mod's arrays are closed over; where they are traced (jit "
              "arguments)" if bounded else "built eagerly by a compiled builder in an eager "
              "call; under jax.jit")
  return (f"block mask: {constant}, rebuilt in each call: mask_mod "
          f"evaluated on {where}, of {' x '.join(map(str, sizes))} (b, h, q, kv) positions "
          f"(~{math.prod(sizes) / 1e6:.3g} M); build it once per batch with "
          "pallas_attn.block_mask(...) and pass block_mask= to avoid that (attention checks "
          "it against mask_mod's program, and against its arrays' values where those are "
          "concrete; not under jit with them as arguments: build it in the step, from them)")
