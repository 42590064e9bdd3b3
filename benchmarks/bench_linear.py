"""GPU benchmark of `pallas_attn.linear_attention` (chunked linear attention).

    python benchmarks/bench_linear.py --out DIR [--seq 4096 8192 16384]
                                      [--sweep] [--skip-scan]

Times the forward and forward+backward of our kernels (bfloat16), next to
the token-by-token `lax.scan` reference, a chunked pure-XLA (jnp) version
and, when `import fla` works, flash-linear-attention's Triton kernels through
PyTorch (`chunk_simple_gla` for the scalar decays, `chunk_gla` for the
vector gate). Shapes: B=4, H=16, Dk=Dv=128 with a GLA vector gate and with a
scalar decay, and Mamba2-2.7B's SSD (H=80, state 128, head dim 64, scalar
decay), for S in --seq. Also records the peak device memory of our forward
at the longest S from XLA's memory analysis, with --sweep times a few
tile configs per shape (the best one is reported). With fla, --rounds N
(default 3) also measures the device time of each call from the GPU's
kernel records (`kernel_time.py`), ours and fla's in alternation: the
like-for-like comparison, since the two sides' wall-clock timers differ.

Writes DIR/bench_linear.json and prints a table last.
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import pathlib
import platform
import sys
import traceback

# Leave room for PyTorch (flash-linear-attention) next to JAX.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_attn.kernels.linear.reference import (  # noqa: E402
    chunked_linear_attention_jnp, linear_attention_reference)
from pallas_attn.linear import linear_attention  # noqa: E402
from pallas_attn.schedule.config import LinearAttentionConfig  # noqa: E402
from pallas_attn.schedule.timing import amortized_time_ms  # noqa: E402

from benchmarks.kernel_time import kernel_time_ms  # noqa: E402

SHAPES = {
    # name: (heads, d_k, d_v, decay kind, scale)
    "gla_vector_h16_d128": (16, 128, 128, "vector", None),
    "scalar_decay_h16_d128": (16, 128, 128, "scalar", None),
    "mamba2_2.7b_h80_n128_p64": (80, 128, 64, "scalar", 1.0),
}
BATCH = 4
SWEEP = [LinearAttentionConfig(c, bv, w, 2)
         for c, bv, w in ((64, 128, 4), (32, 128, 4), (64, 64, 4), (64, 128, 2),
                          (64, 128, 8), (32, 64, 4))]

REPS = 20  # timed runs per measurement (after warm-up)


def _inputs(seq_len: int, heads: int, d_k: int, d_v: int, kind: str):
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  shape = (BATCH, seq_len, heads)
  q = jax.random.normal(keys[0], shape + (d_k,), jnp.bfloat16)
  k = jax.random.normal(keys[1], shape + (d_k,), jnp.bfloat16)
  v = jax.random.normal(keys[2], shape + (d_v,), jnp.bfloat16)
  gate_shape = shape + ((d_k,) if kind == "vector" else ())
  # GLA-style gates: log_sigmoid of logits, divided by 16 as in GLA.
  log_decay = jax.nn.log_sigmoid(
      jax.random.normal(keys[3], gate_shape, jnp.float32) + 3.0) / 16.0
  d_out = jax.random.normal(keys[4], shape + (d_v,), jnp.bfloat16)
  return q, k, v, log_decay, d_out


def _jax_fns(attention):
  """jitted forward and forward+backward (all of q, k, v, log_decay)."""
  forward = jax.jit(attention)

  @jax.jit
  def forward_backward(q, k, v, log_decay, d_out):
    o, vjp = jax.vjp(attention, q, k, v, log_decay)
    return vjp(d_out.astype(o.dtype))

  return forward, forward_backward


def _ours(scale, config=None):
  return lambda q, k, v, g: linear_attention(q, k, v, log_decay=g, scale=scale,
                                             config=config)


def _scan(scale):
  return lambda q, k, v, g: linear_attention_reference(
      q, k, v, log_decay=g, scale=scale)[0]


def _xla_chunked(scale):
  return lambda q, k, v, g: chunked_linear_attention_jnp(
      q, k, v, log_decay=g, scale=scale)[0]


def _time_jax(attention, args, with_backward: bool = True) -> dict:
  forward, forward_backward = _jax_fns(attention)
  q, k, v, g, d_out = args
  out = {"fwd_ms": amortized_time_ms(forward, q, k, v, g, reps=REPS)}
  if with_backward:
    try:  # the scan's backward tape can exceed memory: keep its forward
      out["fwd_bwd_ms"] = amortized_time_ms(forward_backward, q, k, v, g,
                                            d_out, reps=REPS)
    except Exception as e:
      out["fwd_bwd_error"] = f"{type(e).__name__}: {str(e)[:300]}"
  return out


def _kernel_times(attention, fla, args, kind: str, scale, rounds: int) -> dict:
  """Device time per call (`kernel_time.kernel_time_ms`) of our forward and
  forward+backward and fla's, in alternation `rounds` times.

  Medians of each, the median per-round ratio fla / ours with its range,
  and the last round's time per kernel.
  """
  forward, forward_backward = _jax_fns(attention)
  q, k, v, g, d_out = args
  ours = {"fwd": lambda: forward(q, k, v, g),
          "fwd_bwd": lambda: forward_backward(q, k, v, g, d_out)}
  theirs = _fla_calls(fla, args, kind, scale)
  times = {(side, mode): [] for side in ("ours", "fla") for mode in ours}
  kernels = {}
  for _ in range(rounds):
    for side, calls in (("ours", ours), ("fla", theirs)):
      for mode, call in calls.items():
        try:
          total, kernels[f"{side}_{mode}"] = kernel_time_ms(call)
        except Exception as e:  # fla refuses some backwards: keep the rest
          kernels[f"{side}_{mode}"] = f"{type(e).__name__}: {str(e)[:200]}"
          continue
        times[side, mode].append(total)
  median = lambda xs: sorted(xs)[len(xs) // 2]
  out = {"rounds": rounds, "per_kernel_ms_last_round": kernels}
  for mode in ours:
    mine, other = times["ours", mode], times["fla", mode]
    if mine:
      out[f"ours_{mode}_ms"] = median(mine)
    if mine and len(other) == len(mine):
      out[f"fla_{mode}_ms"] = median(other)
      ratios = sorted(t / o for t, o in zip(other, mine))
      out[f"fla_over_ours_{mode}"] = median(ratios)
      out[f"fla_over_ours_{mode}_range"] = [ratios[0], ratios[-1]]
  fla[2].cuda.empty_cache()
  return out


def _memory(attention, args) -> dict | None:
  q, k, v, g, _ = args
  analysis = jax.jit(attention).lower(q, k, v, g).compile().memory_analysis()
  if analysis is None:
    return None
  sizes = {name: int(getattr(analysis, f"{name}_size_in_bytes", 0))
           for name in ("argument", "output", "temp", "alias")}
  sizes["peak_bytes"] = (sizes["argument"] + sizes["output"] + sizes["temp"]
                         - sizes["alias"])
  return sizes


def _device_bytes() -> int | None:
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("bytes_limit")


def _fla_runner():
  """(simple_gla, gla, torch) of flash-linear-attention, or why not."""
  try:
    import torch
    from fla.ops.gla import chunk_gla
    from fla.ops.simple_gla import chunk_simple_gla
  except Exception as e:  # any import failure means "not available"
    return None, f"n/a ({type(e).__name__}: {e})"
  return (chunk_simple_gla, chunk_gla, torch), None


def _fla_calls(fla, args, kind: str, scale) -> dict:
  """fla's forward and forward+backward on our inputs, as zero-argument
  PyTorch callables ({"fwd": ..., "fwd_bwd": ...})."""
  chunk_simple_gla, chunk_gla, torch = fla
  import numpy as np
  q, k, v, g, d_out = (
      torch.from_numpy(np.array(x.astype(jnp.float32))).cuda()
      for x in args)
  q, k, v, d_out = (x.to(torch.bfloat16) for x in (q, k, v, d_out))
  leaves = [x.requires_grad_() for x in (q, k, v, g)]
  op = chunk_gla if kind == "vector" else chunk_simple_gla
  options = {"scale": scale}
  if "head_first" in inspect.signature(op).parameters:  # older releases
    options["head_first"] = False  # our [B, T, H, D] layout

  def forward():
    with torch.no_grad():
      return op(q, k, v, g, **options)[0]

  def forward_backward():
    return torch.autograd.grad(op(q, k, v, g, **options)[0], leaves, d_out)

  return {"fwd": forward, "fwd_bwd": forward_backward}


def time_fla(fla, args, kind: str, scale, with_backward: bool = True) -> dict:
  """flash-linear-attention's forward and forward+backward times (ms).

  `triton.testing.do_bench` medians of asynchronous launches, as a training
  step issues them (a synchronize per call would add launch latency to
  each of fla's several kernels). The forward is kept when the backward
  fails: fla 0.6 refuses `chunk_simple_gla`'s backward on Hopper with
  Triton 3.4-3.7.0 (its issue #640). The tensors' memory goes back to the
  device for JAX afterwards.
  """
  from triton.testing import do_bench
  calls = _fla_calls(fla, args, kind, scale)
  bench = lambda fn: float(do_bench(fn, warmup=100, rep=500,
                                    return_mode="median"))
  out = {"fwd_ms": bench(calls["fwd"])}
  if with_backward:
    try:
      out["fwd_bwd_ms"] = bench(calls["fwd_bwd"])
    except Exception as e:  # recorded, the forward stands
      out["fwd_bwd_error"] = f"{type(e).__name__}: {str(e)[:300]}"
  fla[2].cuda.empty_cache()
  return out


def _attempt(fn, *args, **kwargs) -> dict:
  try:
    return fn(*args, **kwargs)
  except Exception as e:  # record and go on: one failure must not end the run
    traceback.print_exc()
    return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def _best_config(scale, args) -> tuple[LinearAttentionConfig | None, list]:
  trials = []
  for config in SWEEP:
    result = _attempt(_time_jax, _ours(scale, config), args)
    trials.append({"config": config.to_dict(), **result})
    print(f"    sweep {config.to_dict()}: {result}", flush=True)
  ok = [t for t in trials if "fwd_bwd_ms" in t]
  if not ok:
    return None, trials
  best = min(ok, key=lambda t: t["fwd_ms"] + t["fwd_bwd_ms"])
  return LinearAttentionConfig.from_dict(best["config"]), trials


def _versions() -> dict:
  versions = {"python": platform.python_version(), "jax": jax.__version__}
  for name in ("jaxlib", "torch", "triton", "fla"):
    try:
      versions[name] = __import__(name).__version__
    except Exception:
      versions[name] = None
  return versions


def _fmt(x) -> str:
  return f"{x:.3g}" if isinstance(x, (int, float)) else "n/a"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, type=pathlib.Path)
  parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384])
  parser.add_argument("--shapes", nargs="+", default=list(SHAPES),
                      choices=list(SHAPES))
  parser.add_argument("--sweep", action="store_true",
                      help="time a few tile configs per shape at the shortest "
                           "S and use the best for that shape")
  parser.add_argument("--skip-scan", action="store_true",
                      help="leave out the (slow) lax.scan reference")
  parser.add_argument("--rounds", type=int, default=3,
                      help="rounds of device (kernel) time, ours and fla's in "
                           "alternation (0: none)")
  args = parser.parse_args(argv)
  args.out.mkdir(parents=True, exist_ok=True)
  device = jax.devices()[0]
  fla, fla_missing = _fla_runner()
  meta = {
      "device": getattr(device, "device_kind", str(device)),
      "backend": jax.default_backend(),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "versions": _versions(),
      "timer": "ours and XLA: schedule.timing.amortized_time_ms (device "
               "throughput of back-to-back calls); fla: triton do_bench "
               "median of asynchronous launches; kernel_time: summed "
               "durations of the GPU's kernel records (CUPTI) per call",
      "dtype": "bfloat16 inputs (references compute in float32)",
      "batch": BATCH,
      "fla": "available" if fla else fla_missing,
  }
  print(json.dumps(meta, indent=1), flush=True)
  results, memory, sweeps = [], {}, {}
  device_bytes = _device_bytes()
  for name in args.shapes:
    heads, d_k, d_v, kind, scale = SHAPES[name]
    config = None
    for seq_len in sorted(args.seq):
      print(f"== {name} S={seq_len}", flush=True)
      inputs = _inputs(seq_len, heads, d_k, d_v, kind)
      if args.sweep and name not in sweeps:
        config, sweeps[name] = _best_config(scale, inputs)
      row = {"shape": name, "seq_len": seq_len, "heads": heads, "d_k": d_k,
             "d_v": d_v, "decay": kind,
             "config": config.to_dict() if config else "heuristic"}
      ours_fn = _ours(scale, config)
      row["ours"] = _attempt(_time_jax, ours_fn, inputs)
      row["xla_chunked"] = _attempt(_time_jax, _xla_chunked(scale), inputs)
      if args.skip_scan:
        row["scan"] = {"error": "skipped (--skip-scan)"}
      else:
        # The scan's backward keeps one [B, H, Dk, Dv] f32 state per step.
        tape = seq_len * BATCH * heads * d_k * d_v * 4
        with_backward = device_bytes is None or tape < 0.5 * device_bytes
        row["scan"] = _attempt(_time_jax, _scan(scale), inputs, with_backward)
        if not with_backward:
          row["scan"]["fwd_bwd_ms"] = "skipped (state tape exceeds memory)"
      row["fla"] = (_attempt(time_fla, fla, inputs, kind, scale) if fla
                    else {"error": fla_missing})
      if fla and args.rounds:
        row["kernel_time"] = _attempt(
            _kernel_times, ours_fn, fla, inputs, kind, scale, args.rounds)
      for key in ("scan", "fla"):
        ours, other = row["ours"].get("fwd_ms"), row[key].get("fwd_ms")
        if isinstance(ours, float) and isinstance(other, float):
          row[f"fwd_speedup_vs_{key}"] = other / ours
        ours, other = row["ours"].get("fwd_bwd_ms"), row[key].get("fwd_bwd_ms")
        if isinstance(ours, float) and isinstance(other, float):
          row[f"fwd_bwd_speedup_vs_{key}"] = other / ours
      print(json.dumps(row), flush=True)
      results.append(row)
      if seq_len == max(args.seq):
        sizes = _attempt(_memory, ours_fn, inputs)
        memory[name] = {"seq_len": seq_len,
                        **(sizes or {"error": "no memory analysis"})}
  report = {"meta": meta, "results": results,
            "forward_memory_at_longest_seq": memory, "sweeps": sweeps}
  path = args.out / "bench_linear.json"
  path.write_text(json.dumps(report, indent=1))

  print(f"\nwrote {path}")
  print(f"device: {meta['device']}  jax {jax.__version__}  "
        f"torch {meta['versions']['torch']}  fla: {meta['fla']}")
  for name, sizes in memory.items():
    peak = sizes.get("peak_bytes")
    print(f"peak memory, our forward, {name} S={sizes['seq_len']}: "
          + (f"{peak / 2**30:.3g} GiB" if peak else sizes.get("error", "n/a")))
  header = (f"{'shape':26} {'S':>6} | {'ours fwd':>8} {'f+b':>8} | "
            f"{'scan fwd':>8} {'f+b':>8} | {'xla fwd':>8} {'f+b':>8} | "
            f"{'fla fwd':>8} {'f+b':>8} | {'x scan':>6} {'fla/ours':>8}")
  print("times in ms; x scan = scan fwd / ours fwd; fla/ours = fla fwd+bwd / "
        "ours fwd+bwd (>= 0.83 meets 'within 1.2x')")
  print(header)
  print("-" * len(header))
  for row in results:
    cells = [row[k].get(m) for k in ("ours", "scan", "xla_chunked", "fla")
             for m in ("fwd_ms", "fwd_bwd_ms")]
    print(f"{row['shape']:26} {row['seq_len']:>6} | "
          + " | ".join(f"{_fmt(a):>8} {_fmt(b):>8}"
                       for a, b in zip(cells[::2], cells[1::2]))
          + f" | {_fmt(row.get('fwd_speedup_vs_scan')):>6} "
            f"{_fmt(row.get('fwd_bwd_speedup_vs_fla')):>8}")
  print("device (kernel) time per call in ms, median of the rounds; fla/ours "
        "per round (>= 0.83 meets 'within 1.2x')")
  for row in results:
    times = row.get("kernel_time", {})
    for mode in ("fwd", "fwd_bwd"):
      ratio = times.get(f"fla_over_ours_{mode}")
      if f"ours_{mode}_ms" not in times:
        continue
      low, high = times.get(f"fla_over_ours_{mode}_range", (None, None))
      print(f"{row['shape']:26} {row['seq_len']:>6} {mode:>7}: ours "
            f"{_fmt(times[f'ours_{mode}_ms'])} fla "
            f"{_fmt(times.get(f'fla_{mode}_ms'))}, fla/ours {_fmt(ratio)} "
            f"({_fmt(low)}-{_fmt(high)})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
