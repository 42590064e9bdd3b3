"""The one module that knows which Pallas GPU backend runs our kernels.

Every kernel template calls `pallas_call` from here instead of
`jax.experimental.pallas.pallas_call`, so that selecting the backend
(Triton today; JAX 0.9+ defaults GPU Pallas to Mosaic GPU), its compiler
parameters and interpret mode live in one place. A Mosaic GPU template can
later stand beside the Triton one by adding a branch here.
"""
from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_attn.schedule.device import device_config


def default_interpret() -> bool:
  """Interpret mode when JAX's default backend is the CPU (tests, CI)."""
  return jax.default_backend() == "cpu"


def resolve_interpret(interpret: bool | None) -> bool:
  return default_interpret() if interpret is None else bool(interpret)


def compiler_params(num_warps: int, num_stages: int):
  """Triton compiler parameters; passing them is what selects Triton."""
  return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# JAX 0.11 warns, each time it lowers a Triton pallas_call, that the backend
# is deprecated. We select it on purpose and keep that choice here.
TRITON_DEPRECATION = "The Pallas Triton backend is deprecated"


@contextlib.contextmanager
def triton_deprecation_ignored():
  """Ignores JAX's deprecation warning of the Triton backend inside the
  block, and restores `warnings.filters` after it.

  JAX lowers a pallas_call where the jitted function around it is first
  run. Our entry points enter this block around the calls that compile
  our kernels: their jitted cores when called eagerly, the block-mask
  builders, the tuner. Under the caller's own jit the kernels lower when
  that jit compiles, with none of our code running, and the warning is
  JAX's to show (Python's default filters hide a library's
  DeprecationWarnings).
  """
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)
    yield


def pallas_call(kernel, *, out_shape, grid, in_specs, out_specs, num_warps: int,
                num_stages: int, interpret: bool, name: str):
  """`pl.pallas_call` on the Triton backend (or in interpret mode)."""
  return pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      compiler_params=compiler_params(num_warps, num_stages),
      interpret=interpret,
      name=name,
  )


def dot(a, b, *, trans_b: bool = False, fp32_exact: bool = False):
  """Matrix product with float32 accumulation.

  `fp32_exact` asks for float32 accuracy (not TF32's 10-bit mantissas) when
  both operands are float32, so that float32 inputs meet float32
  tolerances: three TF32 tensor-core products (TF32x3, dropping a term of
  ~2^-22 of each product) on NVIDIA GPUs, IEEE products elsewhere. Triton's
  IEEE product runs on the CUDA cores with both operand tiles in registers:
  on an H200 (2026-11-26, B4 H16 S4096, causal ALiBi) an fp32 Dqk 192 / Dv
  128 forward ran 140 ms on its best tiles against 29 ms with TF32x3 (relative
  error 1.3e-7 / 4.6e-7 against the float32 reference), and the IEEE tiles
  that fit took 8 to over 20 s to compile.
  """
  dims = (((1,), (1,)), ((), ())) if trans_b else (((1,), (0,)), ((), ()))
  precision = None
  if fp32_exact and a.dtype == b.dtype == jnp.float32:
    precision = (lax.DotAlgorithmPreset.TF32_TF32_F32_X3 if _nvidia_gpu()
                 else lax.Precision.HIGHEST)
  return lax.dot_general(a, b, dims, precision=precision,
                         preferred_element_type=jnp.float32)


def _nvidia_gpu() -> bool:
  """JAX's default device is an NVIDIA GPU (its XLA and Triton run TF32x3)."""
  return not default_interpret() and device_config().vendor == "nvidia"


def _e4m3_pair_asm(selector: str) -> str:
  """PTX taking two uint16 elements (one 32-bit register: bytes 0-1 the
  first's columns, 2-3 the second's), picking one byte of each (`selector`,
  `prmt`'s) and converting the pair to float16 in one instruction."""
  return ("{ .reg .b32 t; .reg .b16 lo, hi;\n"
          f"prmt.b32 t, $1, 0, {selector};\n"
          "mov.b32 {lo, hi}, t;\n"
          "cvt.rn.f16x2.e4m3x2 $0, lo; }")


def e4m3_pairs_supported() -> bool:
  """Compiled on an NVIDIA GPU that converts e4m3 pairs (sm_89 and later)."""
  if not _nvidia_gpu():
    return False
  capability = str(getattr(jax.devices()[0], "compute_capability", "0"))
  return tuple(int(x) for x in capability.split(".")[:2]) >= (8, 9)


def e4m3_pairs_to_float16(pairs, *, asm: bool):
  """(even, odd) float16 tiles of a uint16 tile whose low bytes are e4m3
  values of even columns and high bytes of odd ones (an e4m3 array viewed
  as uint16 along its last axis).

  An fp8 V tile whose keys the PV product wants adjacent is read by Triton
  one byte per shared-memory load; as uint16 its 16-bit operand layout is
  loaded by ldmatrix, and each pure unary conversion below follows that
  layout. `asm` (`e4m3_pairs_supported`): one prmt and one cvt per two
  values; else the same values by bit casts (interpret mode, other GPUs).
  """
  if asm:
    return tuple(
        pl_triton.elementwise_inline_asm(
            _e4m3_pair_asm(selector), args=[pairs], constraints="=r,r", pack=2,
            result_shape_dtypes=[jax.ShapeDtypeStruct(pairs.shape, jnp.float16)])[0]
        for selector in ("0x0020", "0x0031"))
  as_float16 = lambda byte: lax.bitcast_convert_type(
      byte.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float16)
  return as_float16(pairs & 0xFF), as_float16(pairs >> 8)


@jax.custom_jvp
def fast_tanh(x):
  """Hardware `tanh.approx.f32` (one instruction; relative error ~2^-11)."""
  return pl_triton.approx_tanh(x)


@fast_tanh.defjvp
def _fast_tanh_jvp(primals, tangents):
  y = fast_tanh(primals[0])
  return y, (1.0 - y * y) * tangents[0]


def fast_math_overrides(enabled: bool) -> dict:
  """Approximate transcendentals for score_mod / rownorm programs.

  Triton lowers `tanh` and `logistic` to precise libdevice calls that cost
  several times an attention tile's exp2. Enabled only for half-precision
  inputs on the GPU: float32 inputs keep exact math, and interpret mode has
  no inline assembly. Differentiable, so the backward can use them too.
  """
  if not enabled:
    return {}
  return {
      "tanh": fast_tanh,
      "logistic": lambda x: 0.5 * fast_tanh(0.5 * x) + 0.5,
      "exp": lambda x: jnp.exp2(x * 1.4426950408889634),
  }
