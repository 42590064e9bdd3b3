"""A/B of the Mosaic GPU forward's tiles at one head dim, interleaved in rounds.

`python benchmarks/sweep_mosaic_forward.py --d 64 --out DIR`: forward
kernel time (CUPTI) of vanilla and causal B4 H16 S4096 bf16 for each
(block_k, ring depth) that fits shared memory, in alternating rounds; the
median per setting. Writes DIR/sweep_mosaic_forward_d{D}.json; prints a
table last. The heuristic (kernels/lowering.heuristic_mosaic_config) is the
first setting.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_attn as pa  # noqa: E402
from bench_forward import environment  # noqa: E402
from kernel_time import kernel_time_ms  # noqa: E402
from pallas_attn.kernels import lowering, mosaic_forward  # noqa: E402
from pallas_attn.schedule.timing import attention_flops  # noqa: E402

SMEM_LIMIT = 227 * 1024


def settings(d, seq):
  """[(name, config)]: the heuristic first, then block_k x stages that fit."""
  first = lowering.heuristic_mosaic_config(seq, seq, d, d)
  found = [("heuristic", first)]
  for block_k in (64, 128, 256):
    for stages in (2, 3, 4):
      cfg = pa.AttentionConfig(block_q=128, block_k=block_k, num_warps=12, num_stages=stages)
      if (cfg != first and mosaic_forward.shared_memory_bytes(cfg, d, d, 2) <= SMEM_LIMIT):
        found.append((f"k{block_k}_s{stages}", cfg))
  return found


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--d", type=int, default=64)
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--out", default="/tmp/out")
  args = parser.parse_args()
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q, k, v = (jax.random.normal(kk, (4, args.seq, 16, args.d), jnp.bfloat16) for kk in keys)
  calls = {}
  for variant in ("vanilla", "causal"):
    kw = pa.variants.causal().kwargs() if variant == "causal" else {}
    for name, cfg in settings(args.d, args.seq):
      fn = jax.jit(lambda q, k, v, cfg=cfg, kw=kw: pa.attention(
          q, k, v, config=cfg, implementation="mosaic_gpu", **kw))
      try:
        jax.block_until_ready(fn(q, k, v))
        calls[(variant, name)] = lambda fn=fn: fn(q, k, v)
      except Exception as e:  # a config that does not compile is reported, not fatal
        print(f"{variant} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
  times = {key: [] for key in calls}
  for _ in range(args.rounds):
    for key, call in calls.items():
      times[key].append(kernel_time_ms(call, calls=10, warmup=1)[0])
  rows = []
  for (variant, name), ms in times.items():
    density = 0.5 if variant == "causal" else 1.0
    tf = attention_flops(4, 16, args.seq, args.seq, args.d, args.d, density=density) / (
        statistics.median(ms) * 1e9)
    rows.append(dict(variant=variant, setting=name, ms=ms, tflops=tf))
    print(json.dumps(rows[-1]), flush=True)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, f"sweep_mosaic_forward_d{args.d}.json"), "w") as f:
    json.dump(dict(environment=environment(), d=args.d, seq=args.seq, rows=rows), f, indent=1)
  print(f"\nd={args.d} S={args.seq} forward TFLOP/s (kernel time, median of {args.rounds})")
  for row in rows:
    print(f"  {row['variant']:<8} {row['setting']:<10} {row['tflops']:6.0f}")


if __name__ == "__main__":
  main()
