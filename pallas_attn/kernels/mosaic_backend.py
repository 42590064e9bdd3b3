"""The one module that knows how our Mosaic GPU (Hopper) kernels are built.

Pallas' Mosaic GPU backend (`jax.experimental.pallas.mosaic_gpu`) lowers
kernels written per warpgroup: TMA copies into shared memory, `wgmma` with
register accumulators in the WGMMA layout, mbarriers. This module holds what
is specific to it outside the templates: whether it can run here, its
compiler parameters, the layouts our tiles and row values take, and reads of
captured arrays from device memory in those layouts. The Triton lowering's
counterpart is kernels/backend.py.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_attn.kernels.online import RowLayout
from pallas_attn.spec.trace import eval_inlined

try:  # absent or broken on some JAX builds; `unavailable` says so
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.pallas import mosaic_gpu as plgpu
  _IMPORT_ERROR = None
except Exception as e:  # pragma: no cover - depends on the installed JAX
  mgpu, plgpu, _IMPORT_ERROR = None, None, e

_LOAD_TAKES_INDEX = plgpu is not None and (
    inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty)

MIN_COMPUTE_CAPABILITY = (9, 0)
WG_ROWS = 64       # query rows per consumer warpgroup: the M of one wgmma
SWIZZLE_BYTES = 128


def num_warps(consumer_rows: int) -> int:
  """The warps of a program whose consumers own `consumer_rows` rows: a
  warpgroup (4 warps) per 64 rows and the producer's."""
  return 4 * (consumer_rows // WG_ROWS + 1)


def registers(consumers: int) -> tuple[int, int]:
  """(consumer, producer) registers per thread after `setmaxnreg`, within a
  block's 64K: two consumers take 232 beside a producer's 40, three 160
  beside 24 (the fp8 forward's 192-row programs, a score tile and the
  accumulator: no spills unmasked, masked tiles spill 196 bytes, two
  consumers' 184; the backward's wide dq programs)."""
  return (160, 24) if consumers == 3 else (232, 40)


def _compute_capability(device) -> tuple[int, int] | None:
  text = str(getattr(device, "compute_capability", "") or "")
  try:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)
  except ValueError:
    return None


@functools.cache
def unavailable() -> str | None:
  """Why Mosaic GPU kernels cannot run on JAX's default device, or None."""
  if plgpu is None:
    return f"jax.experimental.pallas.mosaic_gpu does not import ({_IMPORT_ERROR})"
  device = jax.devices()[0]
  if device.platform != "gpu":
    return (f"needs an NVIDIA GPU of compute capability 9.0+ (here: {device.platform}); "
            "JAX 0.10's Mosaic GPU interpreter lacks layout casts and transposed wgmma "
            "operands, so this template has no CPU interpret mode")
  cc = _compute_capability(device)
  if cc is None or cc < MIN_COMPUTE_CAPABILITY:
    return (f"needs an NVIDIA GPU of compute capability 9.0+ (Hopper); {device.device_kind} "
            f"reports {getattr(device, 'compute_capability', None)}")
  return None


def kernel(body, *, name: str, **kwargs):
  """`plgpu.kernel` of `body`, named `name` in profiles (Pallas names a
  kernel after its body's `__name__`, which a functools.partial lacks)."""
  named = functools.partial(body)
  named.__name__ = name
  return plgpu.kernel(named, **kwargs)


def load_ref(ref, *, layout, optimized: bool = True):
  """`plgpu.load` of a whole ref (index it with `.at[...]` first): JAX 0.10
  requires a separate index argument, JAX 0.11 deprecates passing one."""
  if _LOAD_TAKES_INDEX:
    return plgpu.load(ref, (), layout=layout, optimized=optimized)
  return plgpu.load(ref, layout=layout, optimized=optimized)


def compiler_params(fast_math: bool):
  """`approx_math` turns exp2 / tanh / logistic / division into the hardware
  approximations: half-precision inputs only (as the Triton template's
  fast_math)."""
  return plgpu.CompilerParams(approx_math=fast_math)


def smem_transforms(itemsize: int = 2):
  """Shared-memory tiling for `[rows, 128 bytes * k]` operands of wgmma and
  TMA (16-bit ones `[rows, 64k]`, fp8 ones `[rows, 128k]`)."""
  return (plgpu.TilingTransform((8, SWIZZLE_BYTES // itemsize)),
          plgpu.SwizzleTransform(SWIZZLE_BYTES))


def as_tile(x):
  return plgpu.layout_cast(x, plgpu.Layout.WGMMA)


def as_rows(x):
  return plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1))


# Row values are `[rows]` vectors in the accumulator's row-reduced layout.
ROWS = RowLayout(keepdims=False, place_rows=as_rows, place_tile=as_tile)


def tile_indices(start, shape, axis: int):
  """Absolute positions along `axis` of a `[rows, cols]` tile, as a full tile."""
  return start + plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)


def axis_positions(start, size: int, axis: int):
  """Positions `start + [0, size)` along a tile axis, as a vector in the
  accumulator's row (axis 0) or column (axis 1) layout."""
  layout = plgpu.Layout.WGMMA.reduce(1 - axis)
  return start + plgpu.broadcasted_iota(jnp.int32, (size,), 0, layout=layout)


def _separable_at(tile, b, h, refs, fixed_axis: str, fixed, other):
  q, kv = (fixed, other) if fixed_axis == "q" else (other, fixed)
  return tile.separable_part(b, h, q, kv, refs)


def separable_rows(tile, b, h, refs, fixed_axis: str, start, rows: int):
  """A separable score_mod's bias along a program's own `rows` positions of
  `fixed_axis` from `start`: `E(row, 0) - E(start, 0)` (spec/separable.py),
  a `[rows]` vector computed once per program (and head)."""
  zero = jnp.int32(0)
  at = functools.partial(_separable_at, tile, b, h, refs, fixed_axis)
  return at(axis_positions(start, rows, 0), zero) - at(start, zero)


def separable_columns(tile, b, h, refs, fixed_axis: str, start, other_start, cols: int):
  """A separable score_mod's bias `E(start, column)` along `cols` positions
  of the other axis from `other_start`: a `[cols]` vector in the column layout."""
  return _separable_at(tile, b, h, refs, fixed_axis, start, axis_positions(other_start, cols, 1))


def affine_separable_columns(tile, b, h, refs, start, cols: int):
  """For a separable bias affine in kv (spec/separable.py) on the rows from
  `start`: (a `[cols]` vector in the column layout, E(start, start), a
  function of a tile's first key k0). Their sum, vector + function(k0), is
  `E(start, k0 + column) - E(start, start)`: the vector, E(start, start + j)
  - E(start, start), once per program; the function, E(start, k0) -
  E(start, start), one number per tile. Relative to the program's first
  row, so that tiles near the diagonal add small numbers."""
  at = functools.partial(_separable_at, tile, b, h, refs, "q", start)
  origin = at(start)
  vector = separable_columns(tile, b, h, refs, "q", start, start, cols) - origin
  return vector, origin, lambda k0: at(k0) - origin


def with_separable_bias(tile, b, h, refs, fixed_axis: str, start, row_part, other_start,
                        cols: int):
  """`tile` with its `bias` set on the `[rows, cols]` tile whose columns are
  `cols` positions of the other axis from `other_start`: `row_part` plus
  `E(start, column)`, two vectors broadcast, so each score costs two adds."""
  columns = separable_columns(tile, b, h, refs, fixed_axis, start, other_start, cols)
  shape = (row_part.shape[0], cols)
  bias = lax.broadcast_in_dim(row_part, shape, (0,)) + lax.broadcast_in_dim(columns, shape, (1,))
  return dataclasses.replace(tile, bias=bias)


def capture_loader(b, h, fixed_axis: str, start, rows: int):
  """Reads captured arrays (whole `GMEM` refs) for tiles of `rows` positions
  of `fixed_axis` ('q' or 'kv') from `start`: `(ref, operand, other_start,
  size) -> value`, a scalar or a `[rows, size]` tile in the accumulator
  layout whose columns run along the other axis (tiles.TileContext.loader).
  The forward and dq tiles are `[q, kv]`; the dk/dv tiles `[kv, q]`. A
  diagonal term's ref is its vector over q - kv as neighbour pairs
  (diagonal_tile)."""

  def load(ref, operand, other_start, size):
    if operand.is_term:  # its vector's pairs, at q - kv + seq_kv - 1 (tiles.capture_operands)
      assert operand.vector, "Mosaic GPU kernels take a term's vector, not its bank"
      head = h if operand.axes[0] == "h" else 0
      queries = fixed_axis == "q"
      first = operand.vector_window(start, rows, other_start, size, queries)
      return diagonal_tile(ref.at[head, pl.ds(first, rows + size - 1)], (rows, size), queries)
    index, seq_axes = [], []
    for a in operand.axes:
      if a == "b":
        index.append(b)
      elif a == "h":
        index.append(h)
      elif a in ("q", "kv"):
        index.append(pl.ds(start, rows) if a == fixed_axis else pl.ds(other_start, size))
        seq_axes.append(a)
      else:
        index.append(a)
    shape = (rows, size)
    if not seq_axes:
      x = ref[tuple(index)]
    elif len(seq_axes) == 1:
      tile_axis = 0 if seq_axes[0] == fixed_axis else 1
      x = load_ref(ref.at[tuple(index)], layout=plgpu.Layout.WGMMA.reduce(1 - tile_axis),
                   optimized=False)
      x = lax.broadcast_in_dim(x, shape, (tile_axis,))
    elif seq_axes[0] == fixed_axis:
      x = load_ref(ref.at[tuple(index)], layout=plgpu.Layout.WGMMA, optimized=False)
    else:
      raise NotImplementedError("a [kv, q]-ordered tile load (see supported_capture_axes)")
    return x != 0 if operand.is_bool else x

  return load


def _pair_parts(shape, rows_are_queries: bool) -> list[tuple[int, int]]:
  """For each of a thread's positions, in the order `FragmentedArray.foreach`
  visits them: the static part of the offset into a diagonal term's window
  of the neighbour pair holding it, and its place in the pair. A position's
  offset is `i - j` (`[q, kv]` tiles) or `j - i` (`[kv, q]`) plus a thread
  offset the WGMMA layout adds to every one, so thread 0's positions give
  the static parts; the layout's two-element vectors are column neighbours,
  one pair of the window. Mosaic GPU internals (the layout's tiling and
  foreach's order), checked by the compiled tests on JAX 0.11.2."""
  rows, cols = shape
  layout = mgpu.WGMMA_LAYOUT
  assert layout.vector_length == 2, layout
  strides = layout.tiling.tile_strides((cols, 1))
  parts = []
  for register in np.ndindex(layout.registers_shape(shape)):
    i, j = divmod(sum(n * s for n, s in zip(register, strides)), cols)
    first = i - j - 1 if rows_are_queries else j - i  # the pair: offsets first, first + 1
    parts += [(first, 1 - e if rows_are_queries else e) for e in range(2)]
  return parts


def diagonal_tile(pairs, shape, rows_are_queries: bool):
  """The `shape` tile of a diagonal term from the `rows + cols - 1` entries
  of its vector that the tile spans, as neighbour pairs (a `[n, 2]` ref of
  tiles.term_pairs): entry `cols - 1 + i - j` at (i, j) for `[q, kv]` tiles,
  `rows - 1 - i + j` for `[kv, q]`.

  A thread's two column neighbours are neighbouring entries, so each pair
  is one aligned 8-byte load; positions 8 rows apart share entries, so each
  distinct pair is loaded once: 9 loads for a thread's 32 positions of a
  64 x 64 tile, at constant offsets from one address (the static parts of
  its row and column fold into the load), served by the SM's L1. Time
  ratios to ALiBi on an H200 (causal, B4 H16 S4096 d128), forward+backward:
  a load per position 1.35 (ptxas: 656 bytes of spill stores in the dk/dv
  kernel), one per distinct position 1.13 (332; same run), one per distinct
  pair 1.07 (196; the rounds of benchmarks/results/2026-11-24_h200/
  parity_term_pairs.json). Forward: a bank of dense tiles 1.51, a gather at
  computed positions 1.33, a load per position 1.03 (same run), pairs 1.10
  (the same rounds)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, vector

  rows, cols = shape
  parts = _pair_parts(shape, rows_are_queries)

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                     return_type=plgpu.ShapeDtypeStruct(shape, pairs.dtype,
                                                        layout=plgpu.Layout.WGMMA))
  def load(ctx, window):
    del ctx
    index = ir.IndexType.get()
    dtype = ir.MemRefType(window.type).element_type
    pair_type = ir.VectorType.get((2,), dtype)
    loaded, visits = {}, iter(parts)

    def at(_, position):
      first, place = next(visits)
      if first not in loaded:
        i, j = position
        if rows_are_queries:
          offset = arith.subi(arith.addi(i, arith.constant(index, cols - 1 - place)), j)
        else:
          offset = arith.subi(arith.addi(j, arith.constant(index, rows - 1 - place)), i)
        loaded[first] = vector.load(pair_type, window, [offset, arith.constant(index, 0)],
                                    alignment=8)
      return vector.extract(loaded[first], dynamic_position=[],
                            static_position=ir.DenseI64ArrayAttr.get([place]))

    tile = mgpu.FragmentedArray.splat(arith.constant(dtype, 0.0), shape,
                                      layout=mgpu.WGMMA_LAYOUT)
    tile = tile.foreach(at, create_array=True)
    assert next(visits, None) is None, "foreach visited fewer positions than _pair_parts"
    return tile

  return load(pairs)


FP8_KEY_GROUP = 64  # keys whose order an fp8 weight tile permutes (store_fp8_weights)


def fp8_weight_key_order(v_t):
  """V given transposed (`[..., D, S]`, S a multiple of FP8_KEY_GROUP) with
  its keys in store_fp8_weights' order: in each group of 64, position
  16 t + 2 m + e holds key 8 m + 2 t + e (t < 4, m < 8, e < 2)."""
  *lead, seq = v_t.shape
  grouped = v_t.reshape(*lead, seq // FP8_KEY_GROUP, 8, 4, 2)
  n = grouped.ndim
  return jnp.swapaxes(grouped, n - 3, n - 2).reshape(v_t.shape)


def store_fp8_weights(w, ref):
  """`ref[...] = w` for a `[64, n]` e4m3 tile of weights in the WGMMA layout,
  in 16-byte stores, with its keys in fp8_weight_key_order: a thread's
  column pairs of a 64-key group (keys 8 m + 2 t + e) go side by side, one
  16-byte vector per row and group. The PV product contracts over the keys,
  so V's transposed tile in the same order gives the same output. In the
  WGMMA layout's own order the tile takes a 2-byte store per pair, 64 per
  thread for 256 keys, with 1.5-way bank conflicts."""
  from jax._src.lib.mlir.dialects import vector

  rows, cols = w.shape
  layout = mgpu.TiledLayout(
      mgpu.fragmented_array.Tiling(((rows, FP8_KEY_GROUP), (16, FP8_KEY_GROUP),
                                    (8, FP8_KEY_GROUP), (16,))),
      warp_dims=(-7,), lane_dims=(-3, -2), vector_dim=-1)

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(transforms=smem_transforms(1))))
  def store(ctx, tile, smem):
    del ctx
    pairs = tile.registers  # [1, cols / 8, 1, 1, 2 (row halves), 1, 1, 1, 1] 2-vectors
    grouped = np.empty(layout.registers_shape((rows, cols)), dtype=object)
    for g in range(cols // FP8_KEY_GROUP):
      for half in range(2):
        parts, width = [pairs[0, 8 * g + m, 0, 0, half, 0, 0, 0, 0] for m in range(8)], 2
        while len(parts) > 1:  # concatenated pairwise: 8 x 2 -> 4 x 4 -> 2 x 8 -> 16
          width *= 2
          parts = [vector.shuffle(a, b, list(range(width))) for a, b in zip(parts[::2], parts[1::2])]
        grouped[0, g, 0, 0, half, 0, 0, 0, 0] = parts[0]
    mgpu.FragmentedArray(_registers=grouped, _layout=layout, _is_signed=None).store_tiled(
        smem, swizzle=SWIZZLE_BYTES)

  store(w, ref)


def rescale_unless_unit(acc, factor):
  """`acc * factor[:, None]` for a float32 `[64, n]` WGMMA tile and its row
  factor, skipped in each warp whose every factor is 1 (one warp vote in
  place of n / 2 multiplies a thread): with softmax's lazy running max
  (online.OnlineRowNorm.max_growth) most tiles leave every row's factor 1."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm, scf, vector

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)),
                     return_type=plgpu.ShapeDtypeStruct(acc.shape, jnp.float32,
                                                        layout=plgpu.Layout.WGMMA))
  def rescale(ctx, tile, rows):
    del ctx
    f32, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(32)
    one, differs = arith.constant(f32, 1.0), None
    for reg in rows.registers.flat:
      try:
        size = ir.VectorType(reg.type).shape[0]
      except ValueError:  # a scalar register
        values = [reg]
      else:
        values = [vector.extract(reg, dynamic_position=[],
                                 static_position=ir.DenseI64ArrayAttr.get([i]))
                  for i in range(size)]
      for x in values:
        ne = arith.cmpf(arith.CmpFPredicate.UNE, x, one)
        differs = ne if differs is None else arith.ori(differs, ne)
    vote = llvm.inline_asm(
        i32, [arith.extui(i32, differs)],
        "{ .reg .pred p; setp.ne.u32 p, $1, 0; vote.sync.any.pred p, p, 0xffffffff; "
        "selp.u32 $0, 1, 0, p; }", "=r,r", has_side_effects=True)
    scale = arith.cmpi(arith.CmpIPredicate.ne, vote, arith.constant(i32, 0))
    registers = list(tile.registers.flat)
    branch = scf.IfOp(scale, [r.type for r in registers], has_else=True)
    with ir.InsertionPoint(branch.then_block):
      scaled = tile * rows.broadcast_minor(tile.shape[1])
      scf.yield_(list(scaled.registers.flat))
    with ir.InsertionPoint(branch.else_block):
      scf.yield_(registers)
    results = np.empty(tile.registers.shape, dtype=object)
    results.flat[:] = list(branch.results)
    return mgpu.FragmentedArray(_registers=results, _layout=tile.layout, _is_signed=None)

  return rescale(acc, factor)


def supported_capture_axes(axes, fixed_axis: str = "q") -> bool:
  """Loads `capture_loader` can do: scalars, rows, keys, and full tiles
  whose sequence axes come in the tile's order (fixed axis first)."""
  seq = [a for a in axes if a in ("q", "kv")]
  return len(seq) < 2 or seq[0] == fixed_axis


def block_visits(list_refs, b, h, block, num_plain: int, num_blocks: int):
  """((count, j -> block) of the unmasked visits, the same of the masked
  ones) of one program's `block`: from its rows of a block mask's lists
  (`[Bm, Hm, n, ...]` GMEM refs, Bm and Hm 1 where the mask does not depend
  on b or h; empty without a block mask), else blocks `[0, num_plain)`
  unmasked and the rest masked."""
  if list_refs:
    partial_num, partial_idx, full_num, full_idx = list_refs
    bb = b if partial_num.shape[0] > 1 else 0
    hh = h if partial_num.shape[1] > 1 else 0
    return ((full_num[bb, hh, block], lambda j: full_idx[bb, hh, block, j]),
            (partial_num[bb, hh, block], lambda j: partial_idx[bb, hh, block, j]))
  return (num_plain, lambda j: j), (num_blocks - num_plain, lambda j: num_plain + j)


HOPPER_SMEM = 227 * 1024  # shared memory one program may take on sm_90 (Mosaic's limit)
SMEM_SLACK = 1024  # barriers and alignment Mosaic adds to the buffers' own bytes


def deepest_ring(scratch_for, stages: int) -> int:
  """The most ring slots, from `stages` down to 1, whose scratch buffers
  (`scratch_for(slots)`, a kernel's scratch_types) fit one program's shared
  memory: a config's pipeline depth, capped where a kernel's rings are wide."""
  def size(scratch):
    return sum(math.prod(t.shape) * jnp.dtype(t.dtype).itemsize for t in scratch
               if not isinstance(t, plgpu.Barrier))
  while stages > 1 and size(scratch_for(stages)) + SMEM_SLACK > HOPPER_SMEM:
    stages -= 1
  return stages


def refill(step, stages: int, copies):
  """Producer side of a ring of `stages` slots at `step`: for each
  `(source, ring, ready, free)`, from the second lap on, waits until the
  consumers freed the slot (`free` None: an earlier copy's wait covers it),
  then starts the TMA copy of `source` into the slot. Copies may share a
  `ready` barrier (one arrival each): the consumers then wait once."""
  slot = lax.rem(step, stages)
  for source, ring, ready, free in copies:
    if free is not None:
      pl.when(step >= stages)(functools.partial(plgpu.barrier_wait, free.at[slot]))
    plgpu.copy_gmem_to_smem(source, ring.at[slot], ready.at[slot])


def products(pairs, shape):
  """`a @ b^T` for each `(a, b)` pair of shared-memory tiles, issued
  together on `shape` float32 accumulators and waited for once."""
  def issue(*acc_refs):
    for acc_ref, (a, b) in zip(acc_refs, pairs):
      plgpu.wgmma(acc_ref, a, b.T)
    return tuple(acc_ref[...] for acc_ref in acc_refs)
  acc = plgpu.ACC(shape, jnp.float32)
  return pl.run_scoped(issue, *(acc,) * len(pairs))


def fold_visits(visits, body, carry, step=0, skip=0, sub_steps: int = 1):
  """Folds `body(step, block, sub, masked, carry)` over sub-steps `sub` in
  `[0, sub_steps)` of the unmasked visits from the `skip`-th, then of the
  masked ones, `step` counting sub-steps from `step`. Returns (carry, the
  step after the last). Producer and consumers fold the same visits, so
  their steps (ring slots) agree.

  A loop iteration is one sub-step, not a visit: a body unrolled over a
  visit's sub-steps doubled the dk/dv kernel's loop code, and the causal
  dk/dv kernel ran 17% slower for it (H200, same-run A/B)."""
  (full_num, full_at), (partial_num, partial_at) = visits

  def fold(first, count, block_at, masked, start, carry):
    def one(t, c):
      visit, sub = (t, 0) if sub_steps == 1 else (lax.div(t, sub_steps), lax.rem(t, sub_steps))
      return body(start + t, block_at(visit), sub, masked, c)
    return lax.fori_loop(first * sub_steps, count * sub_steps, one, carry)

  carry = fold(skip, full_num, full_at, False, step, carry)
  step = step + full_num * sub_steps
  carry = fold(0, partial_num, partial_at, True, step, carry)
  return carry, step + partial_num * sub_steps


# Primitives that autodiff binds and Mosaic GPU's lowering (JAX 0.10-0.11)
# lacks, with what `lowerable` binds instead.
AUTODIFF_REWRITES = {
    "add_any": lax.add,                      # sums of cotangents
    "one_minus_square": lambda x: 1 - x * x,  # tanh's derivative (JAX 0.11)
}


def turn_ring(visits, stages: int, slots, step=0, sub_steps: int = 1) -> None:
  """The walk of a consumer whose rows lie past q's end: at each of the
  visits' steps it waits for each `(ready, frees)` barrier pair's slot to be
  filled and frees it, as the ring's other consumers do, so that the
  producer can go on."""
  def free(step, block, sub, masked, carry):
    del block, sub, masked
    slot = lax.rem(step, stages)
    for ready, frees in slots:
      plgpu.barrier_wait(ready.at[slot])
      for free_ in frees:
        plgpu.barrier_arrive(free_.at[slot])
    return carry
  fold_visits(visits, free, None, step=step, sub_steps=sub_steps)


def lowerable(fn):
  """`fn()` with the primitives of AUTODIFF_REWRITES bound as Mosaic GPU
  lowers them: `fn` is traced to a jaxpr and evaluated equation by equation
  (call primitives inlined). For autodiff inside a kernel (the backward's
  tile gradients) and for checking what such a kernel will bind."""
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)()
  outs = eval_inlined(closed.jaxpr, closed.consts, overrides=AUTODIFF_REWRITES)
  return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
