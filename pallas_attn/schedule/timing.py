"""Timing of device work and FLOP counts of attention."""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp


WINDOW_MS = 20.0  # device time per timed window of back-to-back calls
MAX_CALLS_PER_WINDOW = 200


def median_time_ms(fn: Callable, *, warmup: int = 3, reps: int = 10,
                   window_ms: float = WINDOW_MS, min_calls: int = 1,
                   wait: Callable = jax.block_until_ready) -> float:
  """Median milliseconds per call of `fn()` (a zero-arg callable returning
  arrays), as device throughput.

  Each of `reps` windows issues calls back to back and waits once, at its
  end: JAX's asynchronous dispatch runs ahead of the device, so a call
  costs its device time (launch gaps included, host latency not), as in a
  training loop. The last of `warmup` calls (at least one; compilation
  should happen before, or in, the others) sizes a window to about
  `window_ms`, and to at least `min_calls` calls. Waiting after every call
  instead adds the host's dispatch and wait to each: 50-70 us on an H200,
  up to 40% of a 0.2 ms kernel; a program over several GPUs pays more
  (about 1 ms for the two-GPU ring), which a window of one long call
  leaves in.
  (Triton's `do_bench` does that for JAX: its events are recorded on
  PyTorch's stream, which JAX does not run on.) `wait(out)` blocks until
  `out` is computed: pass `lambda _: torch.cuda.synchronize()` to time a
  PyTorch call the same way.
  """
  if reps < 1 or warmup < 1:
    raise ValueError(f"warmup and reps must be >= 1, got {warmup}, {reps}")
  for _ in range(warmup - 1):
    wait(fn())
  start = time.perf_counter()
  wait(fn())
  estimate_ms = (time.perf_counter() - start) * 1e3
  calls = max(1, min_calls, min(MAX_CALLS_PER_WINDOW,
                                math.floor(window_ms / max(estimate_ms, 1e-3))))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn()
    wait(out)
    times.append((time.perf_counter() - start) * 1e3 / calls)
  return statistics.median(times)


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
