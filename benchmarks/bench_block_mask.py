"""Block-mask build cost: eager `pa.block_mask` next to FlexAttention's
`create_block_mask`, and a document-masked forward with a prebuilt mask
against one built inside the jitted call.

Run on the GPU machine: `python benchmarks/bench_block_mask.py --out DIR`.
Writes DIR/block_mask.json and prints a short table last. `--small` runs
tiny shapes (on CPU, interpret mode) to check the script.

* Eager builds (B=1, H=16; Flex with B=H=None, the same work since none of
  the masks depends on h): the first call (compilation) and the median of
  `--calls` later calls, each waited for (`block_until_ready`). Causal and
  sliding-window masks pass the same function each call; the document mask
  (8 documents, causal) a new closure over new ids of the same shape each
  call, as a per-batch build does, on both sides (`documents_8_same`: one
  closure every call; `documents_8_jit`: ours inside a jitted function of
  the ids). Where ours is eager, its call splits into `host_ms` (finding
  the compiled builder and its arguments: no device work, no wait),
  `dispatch_ms` (calling the builder, not waited for) and `builder_ms`
  (calling it and waiting); `fast_path` says the builder was found from
  mask_mod's closure without a trace. The target: `ms` under 1 at S=16k.
* Forward (bf16, B=1, H=16, d=128, 8 documents): `prebuilt` passes
  block_mask= built at the forward's tiles; `built_in_jit` passes the ids
  as a jit argument, so the mask is built inside every call (target: at
  most 10% over `prebuilt`); `built_in_jit_no_bounds` the same with the
  classify kernel evaluating every position (`TILE_BOUNDS = False`, as
  before the tile bounds); `closed_over` closes over concrete ids, so the
  mask is built once at trace time. Timed
  by device throughput (`median_time_ms`) and, with PyTorch, by kernel time
  (`kernel_time.py`, per kernel in the JSON).
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for torch

import jax
import jax.numpy as jnp
import numpy as np

import pallas_attn as pa
from bench_forward import environment, inputs
from bench_masks import _flex_masks, causal, documents, window
from kernel_time import kernel_time_ms
from pallas_attn.api import resolve_config
from pallas_attn.kernels import block_mask as bm_lib
from pallas_attn.schedule.timing import median_time_ms

DOCUMENTS = 8
ID_SETS = 4  # document ids the per-batch builds cycle through
HAVE_TORCH = importlib.util.find_spec("torch") is not None


def document_mask(ids):
  """Causal attention within the documents of `ids` [B, S] (`bench_masks.documents`' mask)."""
  return lambda b, h, qi, ki: (ids[b, qi] == ids[b, ki]) & (qi >= ki)


def id_sets(seq):
  """`ID_SETS` [1, S] ids of 8 documents: `documents`' ids, then with the boundaries moved."""
  positions = jnp.arange(seq, dtype=jnp.int32)
  return [jnp.minimum((positions + n * seq // (2 * DOCUMENTS * ID_SETS)) * DOCUMENTS // seq,
                      DOCUMENTS - 1)[None] for n in range(ID_SETS)]


def call_times_ms(call, wait, calls):
  """(first call, median of the `calls` after it) in ms, each call waited for."""
  times = []
  for _ in range(calls + 1):
    start = time.perf_counter()
    wait(call())
    times.append((time.perf_counter() - start) * 1e3)
  return times[0], statistics.median(times[1:])


def eager_masks(seq):
  """name -> zero-argument call giving the mask_mod of the next build (B=1),
  or None for `documents_8_jit`, which builds inside a jitted function of
  the ids."""
  ids = id_sets(seq)
  cycle = itertools.cycle(ids)
  sliding, same_ids = window(1024), document_mask(ids[0])
  return {"causal": lambda: causal, "sliding_window_1024": lambda: sliding,
          f"documents_{DOCUMENTS}": lambda: document_mask(next(cycle)),
          f"documents_{DOCUMENTS}_same": lambda: same_ids,
          f"documents_{DOCUMENTS}_jit": None}


def eager_calls(seq, heads):
  """name -> zero-argument call building the next block mask (B=1)."""
  build = lambda mask_mod: pa.block_mask(mask_mod, 1, heads, seq, seq)
  cycle = itertools.cycle(id_sets(seq))
  in_jit = jax.jit(lambda ids: build(document_mask(ids)))
  return {name: (lambda make=make: build(make())) if make else (lambda: in_jit(next(cycle)))
          for name, make in eager_masks(seq).items()}


def median_ms(fn, calls):
  times = []
  for _ in range(calls):
    start = time.perf_counter()
    fn()
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times)


def eager_breakdown(make, seq, heads, calls) -> dict:
  """Where an eager call's time goes (see the module docstring); after `eager_calls`' warm-up."""
  shape = bm_lib._shape(1, heads, seq, seq, None, None, None)
  host = median_ms(lambda: bm_lib._eager_builder(make(), shape), calls)
  key = bm_lib._closure_key(make())[0]
  fast = key is not None and bm_lib._CLOSURES.get((key, *shape)) is not None
  build, argument = bm_lib._eager_builder(make(), shape)

  def dispatch():
    start = time.perf_counter()
    out = build(argument)
    elapsed = (time.perf_counter() - start) * 1e3
    jax.block_until_ready(out)
    return elapsed
  dispatch_ms = statistics.median(dispatch() for _ in range(calls))
  builder = median_ms(lambda: jax.block_until_ready(build(argument)), calls)
  return dict(host_ms=host, dispatch_ms=dispatch_ms, builder_ms=builder, fast_path=fast)


def flex_calls(seq):
  """`eager_calls` with Flex's eager `create_block_mask` (`bench_masks`' Flex
  masks, B=H=None), where it has the same call; {} without torch."""
  if not HAVE_TORCH:
    return {}
  import torch
  from torch.nn.attention.flex_attention import create_block_mask
  fixed = _flex_masks(torch, seq)  # its documents' ids are id_sets' first
  cycle = itertools.cycle([torch.from_numpy(np.asarray(ids[0])).cuda() for ids in id_sets(seq)])
  document = lambda ids: lambda b, h, qi, ki: (ids[qi] == ids[ki]) & (qi >= ki)
  build = lambda mask_mod: create_block_mask(mask_mod, None, None, seq, seq, device="cuda")
  return {"causal": lambda: build(fixed["causal"]),
          "sliding_window_1024": lambda: build(fixed["sliding_window_1024"]),
          f"documents_{DOCUMENTS}": lambda: build(document(next(cycle))),
          f"documents_{DOCUMENTS}_same": lambda: build(fixed[f"documents_{DOCUMENTS}"])}


def _cuda_wait(_):
  import torch
  torch.cuda.synchronize()


def eager_rows(seqs, heads, calls, errors):
  rows = []
  for seq in seqs:
    flex = {}
    try:
      flex = {name: call_times_ms(call, _cuda_wait, calls)
              for name, call in flex_calls(seq).items()}
    except Exception as e:
      errors.append(f"flex build S={seq}: {type(e).__name__}: {str(e)[:200]}")
    makes = eager_masks(seq)
    for name, call in eager_calls(seq, heads).items():
      first, later = call_times_ms(call, jax.block_until_ready, calls)
      flex_first, flex_later = flex.get(name, (None, None))
      row = dict(seq=seq, mask=name, first_ms=first, ms=later, flex_first_ms=flex_first,
                 flex_ms=flex_later, host_ms=None, dispatch_ms=None, builder_ms=None,
                 fast_path=None)
      if makes[name] is not None:
        row.update(eager_breakdown(makes[name], seq, heads, calls))
      rows.append(row)
      print(json.dumps(row), flush=True)
  return rows


def forward_rows(seq, heads, d, reps, errors):
  """The document-masked forward three ways (see the module docstring)."""
  q, k, v = inputs(1, seq, heads, d, d)
  ids = documents(1, seq, DOCUMENTS)[0]
  mask = document_mask(ids)
  cfg = resolve_config(None, "forward", pa.analyze_variant(mask_mod=mask), q, k, v)
  bm = pa.block_mask(mask, 1, heads, seq, seq, block_q=cfg.block_q, block_kv=cfg.block_k)
  in_jit = lambda q, k, v, ids: pa.attention(q, k, v, mask_mod=document_mask(ids))
  cases = {
      "prebuilt": (lambda q, k, v, bm: pa.attention(q, k, v, mask_mod=mask, block_mask=bm),
                   (q, k, v, bm), True),
      "built_in_jit": (in_jit, (q, k, v, ids), True),
      "built_in_jit_no_bounds": (lambda *a: in_jit(*a), (q, k, v, ids), False),
      "closed_over": (lambda q, k, v: pa.attention(q, k, v, mask_mod=mask), (q, k, v), True),
  }
  rows = []
  for name, (fn, args, bounds) in cases.items():
    jitted = jax.jit(fn)
    run = lambda: jitted(*args)
    bm_lib.TILE_BOUNDS = bounds  # read when the call is traced, below
    try:
      jax.block_until_ready(run())
    finally:
      bm_lib.TILE_BOUNDS = True
    row = dict(case=name, seq=seq, block_q=cfg.block_q, block_k=cfg.block_k,
               ms=median_time_ms(run, reps=reps), kernel_ms=None, kernels=None)
    try:
      if HAVE_TORCH:
        row["kernel_ms"], row["kernels"] = kernel_time_ms(run)
    except Exception as e:
      errors.append(f"kernel time {name}: {type(e).__name__}: {str(e)[:200]}")
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="benchmarks/results")
  parser.add_argument("--small", action="store_true",
                      help="tiny shapes, to check the script on CPU (interpret mode)")
  parser.add_argument("--calls", type=int, default=None,
                      help="eager calls timed per case after the first (default 100; 5 small)")
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  seqs, heads, d, calls = ((256, 512), 2, 32, 5) if args.small else ((4096, 8192, 16384), 16,
                                                                      128, 100)
  calls = args.calls or calls
  reps = 3 if args.small else 10
  results = {"environment": environment(), "heads": heads, "d": d, "errors": []}
  results["eager"] = eager_rows(seqs, heads, calls, results["errors"])
  results["forward"] = forward_rows(seqs[-1], heads, d, reps, results["errors"])
  with open(os.path.join(args.out, "block_mask.json"), "w") as f:
    json.dump(results, f, indent=1)
  print_table(results)


def _ms(x):
  return "n/a" if x is None else f"{x:.3f}"


def _vs(ms, prebuilt_ms):
  return "n/a" if not ms or not prebuilt_ms else f"{(ms / prebuilt_ms - 1) * 100:+.0f}%"


def print_table(results):
  env = results["environment"]
  print(f"\n{env['device']}  {env['date']}  jax {env['jax']}  torch {env['torch']}")
  print(f"eager block mask ms (B=1 H={results['heads']}, ours on the default tiles, Flex on "
        "128x128; later calls: median, each waited for; ours split into host (finding the "
        "builder), dispatch and builder (called and waited for); fast: found without a trace)")
  print(f"  {'S':>6} {'mask':<21} {'first':>9} {'later':>7} {'host':>7} {'dispatch':>8} "
        f"{'builder':>7} {'fast':>5} {'flex':>7} {'flex/ours':>9}")
  for r in results["eager"]:
    ratio = "n/a" if not r["flex_ms"] else f"{r['flex_ms'] / r['ms']:.1f}"
    fast = "n/a" if r.get("fast_path") is None else "yes" if r["fast_path"] else "no"
    print(f"  {r['seq']:>6} {r['mask']:<21} {_ms(r['first_ms']):>9} {_ms(r['ms']):>7} "
          f"{_ms(r.get('host_ms')):>7} {_ms(r.get('dispatch_ms')):>8} "
          f"{_ms(r.get('builder_ms')):>7} {fast:>5} {_ms(r['flex_ms']):>7} {ratio:>9}")
  rows = results["forward"]
  print(f"document-masked forward ms (bf16 B1 H{results['heads']} d{results['d']}, "
        f"S={rows[0]['seq']}, {rows[0]['block_q']}x{rows[0]['block_k']} tiles)")
  for r in rows:
    print(f"  {r['case']:<22} throughput {_ms(r['ms'])} ({_vs(r['ms'], rows[0]['ms'])})  "
          f"kernels {_ms(r['kernel_ms'])} ({_vs(r['kernel_ms'], rows[0]['kernel_ms'])})")
  for e in results["errors"]:
    print("  error:", e)


if __name__ == "__main__":
  main()
