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

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_attn.kernels.online import RowLayout

try:  # absent or broken on some JAX builds; `unavailable` says so
  from jax.experimental.pallas import mosaic_gpu as plgpu
  _IMPORT_ERROR = None
except Exception as e:  # pragma: no cover - depends on the installed JAX
  plgpu, _IMPORT_ERROR = None, e

MIN_COMPUTE_CAPABILITY = (9, 0)
WG_ROWS = 64       # query rows per consumer warpgroup: the M of one wgmma
SWIZZLE_BYTES = 128

# Primitives of score_mod / mask_mod / rownorm programs that the Mosaic GPU
# lowering handles on register arrays (checked against JAX 0.11.2's rules).
PRIMITIVES = frozenset("""
add sub mul div neg max min abs sign round rem integer_pow exp exp2 log tanh
logistic sin cos rsqrt square erf atan2 select_n clamp eq ne lt le gt ge and or
not xor convert_element_type stop_gradient copy copy_p shift_left
shift_right_arithmetic shift_right_logical broadcast_in_dim reshape squeeze
expand_dims reduce_sum reduce_max reduce_min dynamic_slice
""".split())


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


def compiler_params(fast_math: bool):
  """`approx_math` turns exp2 / tanh / logistic / division into the hardware
  approximations: half-precision inputs only (as the Triton template's
  fast_math)."""
  return plgpu.CompilerParams(approx_math=fast_math)


def smem_transforms():
  """Shared-memory tiling for 16-bit `[rows, 64k]` operands of wgmma and TMA."""
  return (plgpu.TilingTransform((8, SWIZZLE_BYTES // 2)), plgpu.SwizzleTransform(SWIZZLE_BYTES))


def as_tile(x):
  return plgpu.layout_cast(x, plgpu.Layout.WGMMA)


def as_rows(x):
  return plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1))


# Row values are `[rows]` vectors in the accumulator's row-reduced layout.
ROWS = RowLayout(keepdims=False, place_rows=as_rows, place_tile=as_tile)


def tile_indices(start, shape, axis: int):
  """Absolute positions along `axis` of a `[rows, cols]` tile, as a full tile."""
  return start + plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)


def capture_loader(b, h, q_start, rows: int):
  """Reads captured arrays (whole `GMEM` refs) for a tile of `rows` queries
  from `q_start`: `(ref, operand, kv_start, size) -> value`, a scalar or a
  `[rows, size]` tile in the accumulator layout (tiles.TileContext.loader)."""

  def load(ref, operand, kv_start, size):
    index, seq_axes = [], []
    for a in operand.axes:
      if a == "b":
        index.append(b)
      elif a == "h":
        index.append(h)
      elif a == "q":
        index.append(pl.ds(q_start, rows))
        seq_axes.append(a)
      elif a == "kv":
        index.append(pl.ds(kv_start, size))
        seq_axes.append(a)
      else:
        index.append(a)
    shape = (rows, size)
    if not seq_axes:
      x = ref[tuple(index)]
    elif seq_axes == ["q"]:
      x = plgpu.load(ref, tuple(index), layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
      x = lax.broadcast_in_dim(x, shape, (0,))
    elif seq_axes == ["kv"]:
      x = plgpu.load(ref, tuple(index), layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
      x = lax.broadcast_in_dim(x, shape, (1,))
    else:
      x = plgpu.load(ref, tuple(index), layout=plgpu.Layout.WGMMA, optimized=False)
    return x != 0 if operand.is_bool else x

  return load


def supported_capture_axes(axes) -> bool:
  """Loads `capture_loader` can do: scalars, rows, keys, `[.., q, .., kv]` tiles."""
  seq = [a for a in axes if a in ("q", "kv")]
  return seq in ([], ["q"], ["kv"], ["q", "kv"])
