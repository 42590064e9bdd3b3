"""Benchmark harness, PyTorch side and the scripts' common parts.

* Kernel time: the device time per call from the GPU's own records of what
  ran (CUPTI, read through `torch.profiler`), for JAX and PyTorch calls
  alike. Both frameworks run in this process's CUDA context and CUPTI records
  every kernel, memset and copy there, so the sum of their durations compares
  an implementation with a peer without any timer's host latency, stream or
  L2 policy tilting it. Host gaps are not counted for either side: compare
  throughput (`median_time_ms`, the one timer, for both frameworks) for those.
* The PyTorch peers of a case (FlexAttention, SDPA) on the case's inputs.
* `measure`: every implementation of some cases by throughput, then by kernel
  time in alternating rounds, with per-round ratios to ours and each side's
  agreement with ours.
* The scripts' command line and results files (`benchmarks/results/<date>_<device>/`).

Needs PyTorch with CUDA only for kernel time and the PyTorch peers; without
them those rows say why.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for PyTorch

import argparse  # noqa: E402
import collections  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_attn import bench, variants as V  # noqa: E402
from pallas_attn.bench import Case, Inputs, Row  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
TORCH_IMPLS = ("flex", "sdpa")


# ----------------------------------------------------------------------------- kernel time

def cuda_torch():
  """PyTorch, where it has a CUDA device; else None."""
  try:
    import torch
  except ImportError:
    return None
  return torch if torch.cuda.is_available() else None


def require_torch():
  torch = cuda_torch()
  if torch is None:
    raise NotImplementedError("needs PyTorch with a CUDA device")
  return torch


def wait_torch(_):
  """Waits for PyTorch's device work (`median_time_ms`'s `wait` for a PyTorch call)."""
  cuda_torch().cuda.synchronize()


def _device_events(fn: Callable, calls: int, warmup: int, with_device: bool = False):
  """(start us, end us, name) of everything the device ran in `calls`
  back-to-back calls of `fn()` after `warmup` waited ones, in start order;
  with `with_device`, (start, end, name, device index) of every GPU's."""
  torch = require_torch()
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
  return sorted((e.time_range.start, e.time_range.end, e.name)
                + ((e.device_index,) if with_device else ())
                for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def kernel_time_ms(fn: Callable, *, calls: int = 20,
                   warmup: int = 2) -> tuple[float, dict[str, float]]:
  """(total, {kernel name: ms}) of device time per call of `fn()`, a
  zero-argument call (a jitted JAX function on fixed inputs, or a PyTorch
  op) compiled or autotuned before, or in, the `warmup` calls."""
  per_kernel = collections.defaultdict(float)
  for start, end, name in _device_events(fn, calls, warmup):
    per_kernel[name] += (end - start) / 1e3 / calls
  return sum(per_kernel.values()), dict(per_kernel)


def _busy_us(intervals) -> float:
  """Length of the union of (start, end) intervals sorted by start."""
  busy, covered_to = 0.0, -math.inf
  for start, end in intervals:
    busy += max(0.0, end - max(start, covered_to))
    covered_to = max(covered_to, end)
  return busy


def device_breakdown_ms(fn: Callable, *, calls: int = 3, warmup: int = 2,
                        top: int = 8) -> dict[int, dict]:
  """Per GPU index, per call of a multi-GPU `fn()`: span (first start to
  last end), busy (any kernel running), collective (NCCL kernels' union),
  compute (other kernels' union), idle, and the `top` kernels by time."""
  events = _device_events(fn, calls, warmup, with_device=True)
  result = {}
  for device in sorted({e[3] for e in events}):
    mine = [e for e in events if e[3] == device]
    collective = [e[:2] for e in mine if "nccl" in e[2].lower()]
    compute = [e[:2] for e in mine if "nccl" not in e[2].lower()]
    per_kernel = collections.defaultdict(float)
    for start, end, name, _ in mine:
      per_kernel[name[:80]] += (end - start) / 1e3 / calls
    span = (max(e[1] for e in mine) - mine[0][0]) / 1e3 / calls
    busy = _busy_us([e[:2] for e in mine]) / 1e3 / calls
    result[device] = {
        "span_ms": span, "busy_ms": busy, "idle_ms": span - busy,
        "collective_ms": _busy_us(collective) / 1e3 / calls,
        "compute_ms": _busy_us(compute) / 1e3 / calls,
        "top_kernels_ms": dict(sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top])}
  return result


def timeline_ms(fn: Callable, *, calls: int = 3, warmup: int = 2) -> tuple[float, float]:
  """(span, idle) per call of `calls` back-to-back calls of `fn()`: from the
  first kernel's start to the last one's end, and the gaps in it where the
  device ran nothing (what a wall-clock timer adds beyond is host latency)."""
  events = _device_events(fn, calls, warmup)
  span = events[-1][1] - events[0][0]
  busy = _busy_us([e[:2] for e in events])  # streams may overlap
  return span / 1e3 / calls, (span - busy) / 1e3 / calls


# ----------------------------------------------------------------------------- PyTorch peers

def t5_bucket_torch(torch, relative_position):
  """`bench.t5_bucket` in PyTorch, for Flex's score_mod."""
  n = torch.clamp(-relative_position, min=0)
  exact = bench.T5_BUCKETS // 2
  large = exact + (torch.log(torch.clamp(n, min=1).float() / exact)
                   / math.log(bench.T5_MAX_DISTANCE / exact)
                   * (bench.T5_BUCKETS - exact)).to(n.dtype)
  return torch.where(n < exact, n, torch.clamp(large, max=bench.T5_BUCKETS - 1))


def _flex(torch, c: Case, param):
  """(q, k, v) -> out by FlexAttention (torch.compile'd, block mask built once
  with B=H=None, as ours is a constant of the call), or NotImplementedError."""
  from torch.nn.attention import flex_attention as fa
  s, name = c.shape, c.variant
  offset = s.seq_kv - s.seq_q  # queries bottom-right, as our variants place them
  causal = lambda b, h, qi, ki: qi + offset >= ki
  masks = dict.fromkeys(("causal", "alibi_causal", "rel_table", "t5_buckets", "sink",
                         "softcap_causal", "off_by_one_causal"), causal)
  windows = dict(bench.WINDOWS, window256_bidir=256, gemma2_local=4096)
  if name in windows:
    size = windows[name]
    masks[name] = ((lambda b, h, qi, ki: (qi + offset - ki).abs() < size)
                   if name.endswith("_bidir") else
                   (lambda b, h, qi, ki: (qi + offset >= ki) & (qi + offset - ki < size)))
  if name.startswith("documents8") or name == "softcap_documents8":
    ids = torch.from_numpy(np.asarray(bench.document_ids(1, s.seq_kv)[0])).cuda()
    masks[name] = ((lambda b, h, qi, ki: ids[qi] == ids[ki]) if name.endswith("_bidir") else
                   (lambda b, h, qi, ki: (ids[qi] == ids[ki]) & (qi >= ki)))
  if name == "prefix_lm":
    masks[name] = lambda b, h, qi, ki: (ki < s.seq_kv // 2) | (qi + offset >= ki)
  slopes = torch.from_numpy(np.asarray(V.alibi_slopes(s.heads_q))).cuda()
  alibi = lambda x, b, h, qi, ki: x + slopes[h] * (ki - qi)
  cap = lambda c: (lambda x, b, h, qi, ki: c * torch.tanh(x / c))
  score_mods = {"softcap": cap(30.0), "softcap_causal": cap(30.0),
                "softcap_documents8": cap(30.0), "gemma2_local": cap(50.0),
                "alibi": alibi, "alibi_causal": alibi,
                "rel_table": lambda x, b, h, qi, ki: x + param[h, qi - ki + s.seq_kv - 1],
                "t5_buckets": lambda x, b, h, qi, ki: x + param[h, t5_bucket_torch(torch,
                                                                                   ki - qi)]}
  sinks = {"sink": param, "sink_bidir": param}
  if name.startswith("off_by_one"):  # a sink of logit 0 in every head
    sinks[name] = torch.zeros(s.heads_q, device="cuda")
  if (name != "vanilla" and name not in masks and name not in score_mods
      and name not in sinks):
    raise NotImplementedError(f"cannot express variant {name!r}")
  for limit in ("recompile_limit", "cache_size_limit"):  # a compile per case and mode
    if hasattr(torch._dynamo.config, limit):
      setattr(torch._dynamo.config, limit, 64)
  flex = torch.compile(fa.flex_attention, dynamic=False)
  block_mask = (fa.create_block_mask(masks[name], None, None, s.seq_q, s.seq_kv, device="cuda")
                if name in masks else None)
  options = dict(block_mask=block_mask, enable_gqa=s.heads_q != s.heads_kv)
  if name in sinks:  # out * sigmoid(lse - sink) rescales softmax to exp(sink) + sum(exp(s))
    lse_option = (dict(return_aux=fa.AuxRequest(lse=True)) if hasattr(fa, "AuxRequest")
                  else dict(return_lse=True))  # return_lse is deprecated

    def with_sink(q, k, v):
      out, aux = flex(q, k, v, **options, **lse_option)
      lse = getattr(aux, "lse", aux)
      return out * torch.sigmoid(lse - sinks[name][None, :, None]).unsqueeze(-1).to(out.dtype)
    return with_sink
  return lambda q, k, v: flex(q, k, v, score_mod=score_mods.get(name), **options)


def _sdpa(torch, c: Case, param):
  """(q, k, v) -> out by `torch.nn.functional.scaled_dot_product_attention`."""
  if c.variant not in ("vanilla", "causal") or (c.variant == "causal"
                                               and c.shape.seq_q != c.shape.seq_kv):
    raise NotImplementedError(f"cannot express variant {c.variant!r}")
  return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
      q, k, v, is_causal=c.variant == "causal", enable_gqa=c.shape.heads_q != c.shape.heads_kv)


def to_torch(torch, x, dtype=None):
  """A JAX array as a CUDA tensor; `[B, S, H, D]` becomes PyTorch's `[B, H, S, D]`."""
  t = torch.from_numpy(np.array(jnp.asarray(x, jnp.float32))).cuda()
  t = t.transpose(1, 2).contiguous() if t.ndim == 4 else t
  return t.to(getattr(torch, dtype)) if dtype else t


def torch_call(impl: str, c: Case, mode: str, inputs: Inputs) -> Callable:
  """A zero-argument PyTorch call of `impl` on the case's inputs, run once
  (compiles): the forward (no grad), or the gradients of q, k, v (and the
  param with `grad_params`) for the cotangent dout."""
  torch = require_torch()
  build = {"flex": _flex, "sdpa": _sdpa}[impl]
  dtype = c.shape.dtype
  q, k, v, dout = (to_torch(torch, x, dtype) for x in
                   (inputs.q, inputs.k, inputs.v, inputs.dout))
  param = None if inputs.built.params is None else to_torch(torch, inputs.built.params)
  if mode == "fwd":
    forward = build(torch, c, param)

    def call():
      with torch.no_grad():
        return forward(q, k, v)
  else:
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    if c.grad_params:
      param = param.detach().clone().requires_grad_()
      leaves.append(param)
    forward = build(torch, c, param)
    call = lambda: torch.autograd.grad(forward(*leaves[:3]), leaves, dout)
  call()
  torch.cuda.synchronize()
  return call


def peer_call(impl: str, c: Case, mode: str, inputs: Inputs, interpret=None) -> Callable:
  """A compiled zero-argument call of any implementation (JAX or PyTorch)."""
  if impl in TORCH_IMPLS:
    return torch_call(impl, c, mode, inputs)
  return bench.jax_call(impl, c, mode, inputs, interpret)


def host_leaves(out, heads_second: bool = False) -> list:
  """An output's arrays on the host as float32; with `heads_second`, PyTorch's
  4-D `[B, H, S, D]` tensors in our `[B, S, H, D]` layout."""
  if not is_torch(out):
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(out)]
  tensors = out if isinstance(out, (tuple, list)) else [out]
  return [(t.transpose(1, 2) if heads_second and t.ndim == 4 else t).float().cpu().numpy()
          for t in tensors]


def is_torch(out) -> bool:
  first = out[0] if isinstance(out, (tuple, list)) else out
  return type(first).__module__.startswith("torch")


def rel_err(leaves, reference) -> float:
  """Largest relative error (Frobenius) over matching leaves."""
  return max(float(np.linalg.norm(x - r) / max(np.linalg.norm(r), 1e-30))
             for x, r in zip(leaves, reference))


# ----------------------------------------------------------------------------- measuring

class Budget:
  """Wall-clock seconds a script may start new measurements in (a device call is limited)."""

  def __init__(self, seconds: float):
    self.deadline = time.perf_counter() + seconds

  def spent(self) -> bool:
    return time.perf_counter() > self.deadline


def measure(items: list[tuple[Case, str]], impls: list[str], *, rounds: int = 3,
            budget: Budget | None = None, pairs: list = (),
            interpret=None) -> tuple[list[Row], list[dict]]:
  """`measure_calls` of every implementation of each (case, mode) in `items`,
  on the case's inputs (`bench.make_inputs`)."""
  builders, flops = {}, {}
  for c, mode in items:
    inputs = bench.make_inputs(c)
    flops[c.name, mode] = bench.case_flops(c, mode, inputs.built)
    for impl in impls:
      builders[c.name, impl, mode] = functools.partial(peer_call, impl, c, mode, inputs,
                                                       interpret)
  return measure_calls(builders, rounds=rounds, budget=budget, pairs=pairs, flops=flops)


def measure_calls(builders: dict, *, rounds: int = 3, budget: Budget | None = None,
                  pairs: list = (), flops: dict = None, gbytes: dict = None,
                  heads_second=TORCH_IMPLS,
                  kernel_impls=None) -> tuple[list[Row], list[dict]]:
  """(rows, ratios) of `builders` {(case, impl, mode): () -> compiled call}.

  Each call is built, checked against its case and mode's first
  implementation's output (`extra.rel_err`; outputs of `heads_second`
  implementations are PyTorch's `[B, H, S, D]`), timed by throughput, then
  by `kernel_rounds` (those of `kernel_impls`, default all; the budget stops
  new builds, not the rounds of built calls). `flops` / `gbytes`
  {(case, mode): work} give rates. An implementation that cannot run gives a
  row with the reason.
  """
  rows, calls, reference = [], {}, {}
  work = lambda table, name, mode: (table or {}).get((name, mode))
  for (name, impl, mode), build in builders.items():
    if budget and budget.spent():
      rows.append(Row(name, impl, mode, None, note="skipped: time budget"))
      continue
    try:
      started = time.perf_counter()
      call = build()
      first_s = time.perf_counter() - started
      out = call()
      leaves = host_leaves(out, impl in heads_second)
    except Exception as e:  # A peer that cannot run shows n/a, never aborts the run.
      rows.append(Row(name, impl, mode, None, note=bench.failure_note(e)))
      continue
    row = bench.timed_row(name, impl, mode, call, work(flops, name, mode),
                          gbytes=work(gbytes, name, mode),
                          wait=wait_torch if is_torch(out) else jax.block_until_ready)
    row.extra.update(first_call_s=first_s, **{f"{k}_s": v for k, v in
                                              getattr(call, "stages", {}).items()})
    first_impl, first = reference.setdefault((name, mode), (impl, leaves))
    if first_impl != impl and [x.shape for x in leaves] == [x.shape for x in first]:
      row.extra.update(rel_err=rel_err(leaves, first), rel_err_vs=first_impl)
    rows.append(row)
    if kernel_impls is None or impl in kernel_impls:
      calls[name, impl, mode] = call
  kernel_rows, ratios = kernel_rounds(calls, rounds, flops=flops, gbytes=gbytes, pairs=pairs)
  return rows + kernel_rows, ratios


def kernel_rounds(calls: dict, rounds: int, *, flops: dict = None, gbytes: dict = None,
                  pairs: list = ()) -> tuple[list[Row], list[dict]]:
  """(rows, ratios) of kernel time in `rounds` alternating rounds over
  `calls` {(case, impl, mode): zero-argument call}; none without PyTorch on a
  GPU. Ratios: each implementation's time over its case and mode's first
  one's, per round, and each of `pairs` ((case, impl, mode), (case, impl, mode))."""
  if not (rounds and calls and cuda_torch()):
    return [], []
  samples, errors = bench.alternating_rounds(calls, rounds, lambda f: kernel_time_ms(f)[0])
  rows, ours = [], {}  # ours: (case, mode) -> its first implementation
  for (name, impl, mode), times in samples.items():
    done = [t for t in times if t is not None]
    ms = float(np.median(done)) if done else None
    rows.append(Row(name, impl, mode, ms, **bench.rates(ms, (flops or {}).get((name, mode)),
                                                        (gbytes or {}).get((name, mode))),
                    note=errors.get((name, impl, mode), ""), measure="kernel", rounds=times))
    ours.setdefault((name, mode), impl)
  pairs = [((name, impl, mode), (name, ours[name, mode], mode))
           for name, impl, mode in samples if impl != ours[name, mode]] + list(pairs)
  ratios = []
  for of, over in pairs:
    ratio = bench.round_ratio(samples.get(of, []), samples.get(over, []))
    if ratio:
      ratios.append(bench.ratio_entry(of, over, "kernel", ratio))
  return rows, ratios


# ----------------------------------------------------------------------------- scripts

def parser(description: str, rounds: int = 3) -> argparse.ArgumentParser:
  """The options every script takes."""
  p = argparse.ArgumentParser(description=description)
  p.add_argument("--out", default=None,
                 help="results folder (default: benchmarks/results/<date>_<device>/; with "
                      "--small, one under the temporary folder)")
  p.add_argument("--tag", default="", help="suffix of the results file's name")
  p.add_argument("--small", action="store_true",
                 help="tiny shapes: checks the script on a CPU (interpret mode)")
  p.add_argument("--rounds", type=int, default=rounds,
                 help="alternating rounds of kernel time (needs PyTorch with CUDA; 0: none)")
  p.add_argument("--budget-s", type=float, default=480.0,
                 help="start no measurement after this many seconds")
  return p


def default_out_dir(device_count: int = 1, small: bool = False) -> str:
  """benchmarks/results/<date>_<device>/ (a temporary folder for `--small` checks)."""
  folder = f"{datetime.date.today().isoformat()}_{bench.device_slug(device_count)}"
  return os.path.join(tempfile.gettempdir() if small else RESULTS, folder)


def results_path(args, benchmark: str, device_count: int = 1) -> str:
  out = args.out or default_out_dir(device_count, args.small)
  return os.path.join(out, benchmark + (f"_{args.tag}" if args.tag else "") + ".json")


def checkpoint(args, benchmark: str, rows: list[Row], ratios: list = (), *,
               device_count: int = 1) -> None:
  """Writes the results so far, marked partial, so that a run stopped by a
  time limit keeps its finished cases; `finish` overwrites the file."""
  bench.write_results(results_path(args, benchmark, device_count), benchmark, rows, ratios,
                      notes="partial: the run stopped before its last case", small=args.small)


def finish(args, benchmark: str, rows: list[Row], ratios: list = (), *, env: dict | None = None,
           notes: str = "", device_count: int = 1) -> str:
  """Writes the results file, then prints the ratios and a short table last."""
  path = results_path(args, benchmark, device_count)
  bench.write_results(path, benchmark, rows, ratios, env=env, notes=notes, small=args.small)
  print(f"\nwrote {path}")
  reasons = collections.Counter((r.impl, r.note) for r in rows if r.time_ms is None and r.note)
  for (impl, note), count in reasons.items():
    print(f"  {impl} n/a ({count}x): {note}")
  if ratios:
    print(bench.format_ratios(ratios))
  print(bench.pivot_table(rows))
  return path
