"""Benchmark table: our kernels next to cuDNN, JAX's Pallas attention and XLA.

Used by `pallas-attn bench` and the scripts in benchmarks/. Each peer runs
only where it can express the variant (cuDNN and JAX's Pallas `mha`: the
vanilla and causal softmax variants), and a peer that fails shows "n/a" with
the reason, so one broken peer never spoils the table. TFLOP/s count only
unmasked (q, kv) pairs (`mask_density`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_attn.schedule.search_space import ProblemShape
from pallas_attn.schedule.timing import attention_flops, mask_density, median_time_ms

# pallas_attn: the default lowering; pallas_attn:<lowering>: one lowering, n/a where it cannot run.
IMPLS = ("pallas_attn", "pallas_attn:mosaic_gpu", "pallas_attn:triton", "cudnn",
         "jax_pallas_mha", "xla")
MODES = ("fwd", "fwd_bwd")
# Variants JAX's own kernels express: softmax, no score_mod, optionally causal.
_PEER_EXPRESSIBLE = {"vanilla": False, "causal": True}


@dataclasses.dataclass(frozen=True)
class BenchRow:
  """One implementation's result; time_ms is None when it could not run (note says why)."""
  variant: str
  impl: str
  time_ms: float | None
  tflops: float | None
  note: str = ""


def _cudnn(causal: bool, shape: ProblemShape):
  if jax.default_backend() != "gpu":
    raise NotImplementedError("needs a CUDA GPU")
  if shape.dtype not in ("bfloat16", "float16"):
    raise NotImplementedError("cuDNN attention needs bfloat16 or float16")
  return functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                           implementation="cudnn")


def _pallas_mha(causal: bool, shape: ProblemShape):
  from jax.experimental.pallas.ops.gpu import attention as pallas_ops
  if shape.d_qk != shape.d_v:
    raise NotImplementedError("needs d_qk == d_v")
  blocks = pallas_ops.BlockSizes.get_default()
  for seq, block in ((shape.seq_q, blocks.block_q), (shape.seq_kv, blocks.block_k)):
    if seq % min(seq, block):
      raise NotImplementedError(f"needs sequence lengths that are multiples of {block}")
  group = shape.heads_q // shape.heads_kv

  def mha(q, k, v):
    # JAX's kernel has no GQA: repeat kv heads (outside the kernel, inside the timing).
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    return pallas_ops.mha(q, k, v, None, sm_scale=1.0 / math.sqrt(shape.d_qk),
                          causal=causal, interpret=jax.default_backend() == "cpu")

  return mha


def _check_mosaic(variant: dict, shape: ProblemShape, interpret: bool | None):
  """NotImplementedError (an n/a row) with the reason the Mosaic forward cannot run."""
  from pallas_attn.kernels import backend, lowering
  from pallas_attn.spec.analysis import analyze_variant
  kwargs = {k: variant[k] for k in ("score_mod", "mask_mod", "rownorm") if k in variant}
  why = lowering.mosaic_obstacle(analyze_variant(**kwargs), shape.dtype, shape.d_qk, shape.d_v,
                                 backend.resolve_interpret(interpret))
  if why:
    raise NotImplementedError(why)


def peer_function(impl: str, name: str, variant: dict, shape: ProblemShape,
                  interpret: bool | None = None) -> Callable:
  """`(q, k, v) -> out` of one implementation.

  Raises NotImplementedError where the implementation cannot express the
  variant or run on this backend.
  """
  if impl.startswith("pallas_attn"):
    from pallas_attn import attention
    implementation = impl.partition(":")[2] or None
    if implementation == "mosaic_gpu":
      _check_mosaic(variant, shape, interpret)
    return functools.partial(attention, **variant, interpret=interpret,
                             implementation=implementation)
  if impl == "xla":
    from pallas_attn.reference import attention_reference
    return functools.partial(attention_reference, **variant)
  if name not in _PEER_EXPRESSIBLE:
    raise NotImplementedError(f"cannot express variant {name!r}")
  causal = _PEER_EXPRESSIBLE[name]
  if impl == "cudnn":
    return _cudnn(causal, shape)
  if impl == "jax_pallas_mha":
    return _pallas_mha(causal, shape)
  raise ValueError(f"unknown implementation {impl!r}; known: {', '.join(IMPLS)}")


def _with_backward(forward: Callable) -> Callable:
  """(q, k, v, dout) -> gradients of <forward(q, k, v), dout>: a forward + backward step."""
  def loss(q, k, v, dout):
    return jnp.sum(forward(q, k, v).astype(jnp.float32) * dout)
  return jax.grad(loss, argnums=(0, 1, 2))


def _short(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return (text[0] if text else type(e).__name__)[:100]


def bench_variant(name: str, variant: dict, shape: ProblemShape, *, mode: str = "fwd",
                  impls=IMPLS, warmup: int = 3, reps: int = 10,
                  interpret: bool | None = None, seed: int = 0) -> list[BenchRow]:
  """Times each implementation of one variant (`variant`: attention kwargs)."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  keys = jax.random.split(jax.random.key(seed), 4)
  q, k, v = (jax.random.normal(key, s, shape.dtype) for key, s in
             zip(keys, (shape.q_shape, shape.k_shape, shape.v_shape)))
  dout = jax.random.normal(keys[3], shape.q_shape[:3] + (shape.d_v,), jnp.float32)
  density = mask_density(variant.get("mask_mod"), shape.seq_q, shape.seq_kv)
  flops = attention_flops(shape.batch, shape.heads_q, shape.seq_q, shape.seq_kv,
                          shape.d_qk, shape.d_v, density=density, mode=mode)
  rows = []
  for impl in impls:
    try:
      forward = peer_function(impl, name, variant, shape, interpret)
      if mode == "fwd":
        step = jax.jit(forward)
        ms = median_time_ms(lambda: step(q, k, v), warmup=warmup, reps=reps)
      else:
        step = jax.jit(_with_backward(forward))
        ms = median_time_ms(lambda: step(q, k, v, dout), warmup=warmup, reps=reps)
    except Exception as e:  # A peer that cannot run shows n/a, never aborts the table.
      rows.append(BenchRow(name, impl, None, None, _short(e)))
      continue
    rows.append(BenchRow(name, impl, ms, flops / (ms * 1e-3) / 1e12))
  return rows


def describe_shape(shape: ProblemShape) -> str:
  return (f"B={shape.batch} Hq={shape.heads_q} Hkv={shape.heads_kv} Sq={shape.seq_q} "
          f"Skv={shape.seq_kv} Dqk={shape.d_qk} Dv={shape.d_v} {shape.dtype}")


def format_table(rows: list[BenchRow]) -> str:
  """Fixed-width table: variant, impl, time (ms), TFLOP/s; "n/a" where a peer could not run."""
  header = ("variant", "impl", "time ms", "TFLOP/s", "note")
  cells = [header] + [
      (r.variant, r.impl,
       "n/a" if r.time_ms is None else f"{r.time_ms:.3f}",
       "n/a" if r.tflops is None else f"{r.tflops:.2f}", r.note) for r in rows]
  widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                   for row in cells)
