"""Timing of device work and FLOP counts of attention."""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp


def _synchronized(fn: Callable) -> Callable:
  return lambda: jax.block_until_ready(fn())


def _do_bench_ms(fn: Callable, warmup: int, reps: int) -> float | None:
  """Triton's `do_bench` median on a GPU, or None where it cannot run.

  `do_bench` takes warm-up and repetition budgets in milliseconds, so the
  counts are converted with a one-call estimate. Each call blocks until
  JAX's work is done, so its events bracket the work whatever stream runs it.
  """
  if jax.default_backend() != "gpu":
    return None
  try:
    from triton.testing import do_bench
  except ImportError:
    return None
  start = time.perf_counter()
  fn()
  estimate_ms = max((time.perf_counter() - start) * 1e3, 1e-3)
  try:
    return float(do_bench(fn, warmup=warmup * estimate_ms, rep=reps * estimate_ms,
                          return_mode="median"))
  except Exception:  # do_bench needs torch's CUDA runtime; not always there.
    return None


def median_time_ms(fn: Callable, *, warmup: int = 3, reps: int = 10) -> float:
  """Median milliseconds of `fn()` (a zero-arg callable returning arrays).

  Uses `triton.testing.do_bench` (return_mode="median") on a GPU where it is
  importable and usable, else a wall-clock median of `reps` synchronized
  calls after `warmup` calls. The first call (compilation) should happen
  before, or be covered by `warmup`.
  """
  if reps < 1:
    raise ValueError(f"reps must be >= 1, got {reps}")
  sync_fn = _synchronized(fn)
  bench_ms = _do_bench_ms(sync_fn, warmup, reps)
  if bench_ms is not None:
    return bench_ms
  for _ in range(warmup):
    sync_fn()
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    sync_fn()
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times)


def amortized_time_ms(fn: Callable, *args, warmup: int = 3, reps: int = 10,
                      target_ms: float = 4.0, max_copies: int = 8) -> float:
  """Milliseconds of one `fn(*args)` inside a jitted program, host dispatch amortized.

  Timing single synchronized calls adds JAX's dispatch and synchronization
  latency (tens of microseconds) to each call, a large share of a
  sub-millisecond kernel, and it is paid once per step in a jitted training
  loop, not per attention call. So short calls run as `copies` independent
  calls on copies of the inputs in one jitted program (distinct buffers: XLA
  cannot merge them), sized so that the program takes about `target_ms`, and
  the median program time is divided by `copies`.
  """
  return amortized_timer(fn, *args, target_ms=target_ms,
                         max_copies=max_copies)(warmup=warmup, reps=reps)


def amortized_timer(fn: Callable, *args, target_ms: float = 4.0,
                    max_copies: int = 8) -> Callable[..., float]:
  """Compiles `amortized_time_ms`'s program once and returns a function that
  times it (keyword arguments warmup, reps), for interleaved repeats."""
  single = jax.jit(fn)
  jax.block_until_ready(single(*args))
  estimate = median_time_ms(lambda: single(*args), warmup=1, reps=3)
  copies = max(1, min(max_copies, math.ceil(target_ms / max(estimate, 1e-3))))
  run = lambda: single(*args)
  if copies > 1:
    arg_sets = [args] + [jax.tree.map(lambda a: a.copy(), args) for _ in range(copies - 1)]
    batched = jax.jit(lambda sets: [fn(*a) for a in sets])
    jax.block_until_ready(batched(arg_sets))
    run = lambda: batched(arg_sets)
  return lambda warmup=3, reps=10: median_time_ms(run, warmup=warmup, reps=reps) / copies


def mask_density(mask_mod: Callable | None, seq_q: int, seq_kv: int, *,
                 max_points: int = 1024) -> float:
  """Fraction of (q, kv) pairs `mask_mod(b, h, q_idx, kv_idx)` keeps, for b = h = 0.

  Exact up to `max_points` positions per axis, else measured on an evenly
  strided grid of that many rows and columns.
  """
  if mask_mod is None:
    return 1.0
  rows = jnp.unique(jnp.linspace(0, seq_q - 1, min(seq_q, max_points)).astype(jnp.int32))
  cols = jnp.unique(jnp.linspace(0, seq_kv - 1, min(seq_kv, max_points)).astype(jnp.int32))
  q_idx, kv_idx = (x.ravel() for x in jnp.meshgrid(rows, cols, indexing="ij"))
  zeros = jnp.zeros_like(q_idx)
  return float(jnp.mean(jax.vmap(mask_mod)(zeros, zeros, q_idx, kv_idx).astype(jnp.float32)))


def attention_flops(batch: int, heads_q: int, seq_q: int, seq_kv: int, d_qk: int,
                    d_v: int, *, density: float = 1.0, mode: str = "fwd") -> float:
  """Matmul FLOPs of attention: 2*S_q*S_kv*(D_qk + D_v) per head, times `density`.

  density: fraction of unmasked (q, kv) pairs, so masked work is not counted.
  mode: "fwd", or "fwd_bwd" where the backward counts 2.5x the forward.
  """
  if mode not in ("fwd", "fwd_bwd"):
    raise ValueError(f"mode must be 'fwd' or 'fwd_bwd', got {mode!r}")
  if not 0.0 <= density <= 1.0:
    raise ValueError(f"density must be in [0, 1], got {density}")
  forward = 2.0 * batch * heads_q * seq_q * seq_kv * (d_qk + d_v) * density
  return forward * (3.5 if mode == "fwd_bwd" else 1.0)
