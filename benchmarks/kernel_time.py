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


def kernel_time_ms(fn: Callable, *, calls: int = 20,
                   warmup: int = 2) -> tuple[float, dict[str, float]]:
  """(total, {kernel name: ms}) of device time per call of `fn()`.

  `fn` is a zero-argument callable (a jitted JAX function on fixed inputs,
  or a PyTorch op); compile or autotune it before, or in, the `warmup` calls.
  """
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
  per_kernel = collections.defaultdict(float)
  for event in prof.events():
    if event.device_type == torch.autograd.DeviceType.CUDA:
      per_kernel[event.name] += event.time_range.elapsed_us() / 1e3 / calls
  return sum(per_kernel.values()), dict(per_kernel)
