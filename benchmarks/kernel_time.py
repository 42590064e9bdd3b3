"""Device time per call from the GPU's own records of what ran (CUPTI,
read through `torch.profiler`), for JAX and PyTorch callables alike.

Both frameworks run in this process's CUDA context and CUPTI records every
kernel, memset and copy there, so the sum of their durations compares an
implementation with a peer without any timer's host latency, stream or L2
policy tilting it. Host-side gaps are not counted for either side: compare
wall-clock throughput (`schedule.timing.median_time_ms`) for those. Needs
PyTorch with CUDA (the GPU machine has it).
"""
from __future__ import annotations

import collections
from typing import Callable

import jax


def _device_events(fn: Callable, calls: int, warmup: int):
  """(start us, end us, name) of everything the device ran in `calls`
  back-to-back calls of `fn()` after `warmup` waited ones, in start order."""
  import torch
  from torch.profiler import ProfilerActivity, profile

  def wait(out):
    jax.block_until_ready(out)  # leaves that are not JAX arrays pass through
    torch.cuda.synchronize()

  for _ in range(warmup):
    wait(fn())
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(calls):
      out = fn()
    wait(out)
  return sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA)


def kernel_time_ms(fn: Callable, *, calls: int = 20,
                   warmup: int = 2) -> tuple[float, dict[str, float]]:
  """(total, {kernel name: ms}) of device time per call of `fn()`.

  `fn` is a zero-argument callable (a jitted JAX function on fixed inputs,
  or a PyTorch op); compile or autotune it before, or in, the `warmup` calls.
  """
  per_kernel = collections.defaultdict(float)
  for start, end, name in _device_events(fn, calls, warmup):
    per_kernel[name] += (end - start) / 1e3 / calls
  return sum(per_kernel.values()), dict(per_kernel)


def timeline_ms(fn: Callable, *, calls: int = 3, warmup: int = 2) -> tuple[float, float]:
  """(span, idle) per call of `calls` back-to-back calls of `fn()`: from the
  first kernel's start to the last one's end, and the gaps in it where the
  device ran nothing (what a wall-clock timer adds beyond is host latency)."""
  events = _device_events(fn, calls, warmup)
  span = events[-1][1] - events[0][0]
  busy, covered_to = 0.0, events[0][0]
  for start, end, _ in events:  # union of the intervals: streams may overlap
    busy += max(0.0, end - max(start, covered_to))
    covered_to = max(covered_to, end)
  return span / 1e3 / calls, (span - busy) / 1e3 / calls
