"""A/B of the Mosaic GPU backward's knobs, interleaved in rounds (same run).

`python benchmarks/sweep_mosaic_backward.py --out DIR`: forward+backward
kernel time (CUPTI) of vanilla and causal B4 H16 S4096 d128 bf16 for each
setting (keys per dq step, ring depth), and each kernel's share. Writes
DIR/sweep_mosaic_backward.json; prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_attn as pa  # noqa: E402
from bench_forward import environment  # noqa: E402
from kernel_time import kernel_time_ms  # noqa: E402
from pallas_attn.vjp import mosaic_backward  # noqa: E402

SETTINGS = {  # name: (DQ_STEP_KEYS, num_stages)
    "dq64_s4": (64, 4), "dq64_s2": (64, 2), "dq128_s2": (128, 2), "dq64_s3": (64, 3),
}


def step(variant, stages):
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q, k, v = (jax.random.normal(kk, (4, 4096, 16, 128), jnp.bfloat16) for kk in keys)
  kw = pa.variants.causal().kwargs() if variant == "causal" else {}
  cfg = pa.AttentionConfig(block_q=128, block_k=128, num_warps=12, num_stages=stages)
  loss = lambda q, k, v: jnp.sum(pa.attention(q, k, v, bwd_config=cfg, **kw).astype(jnp.float32))
  fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  return lambda: fn(q, k, v)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default="/tmp/out")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--settings", default=",".join(SETTINGS))
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  results = {"environment": environment(), "runs": []}
  names = args.settings.split(",")
  for r in range(args.rounds):
    for name in names:
      for variant in ("vanilla", "causal"):
        mosaic_backward.DQ_STEP_KEYS, stages = SETTINGS[name]
        jax.clear_caches()
        try:
          total, kernels = kernel_time_ms(step(variant, stages))
          results["runs"].append(dict(round=r, setting=name, variant=variant, ms=total,
                                      kernels=kernels))
        except Exception as e:
          results["runs"].append(dict(round=r, setting=name, variant=variant,
                                      error=f"{type(e).__name__}: {str(e)[:300]}"))
        print(json.dumps({k: v for k, v in results["runs"][-1].items() if k != "kernels"}),
              flush=True)
        with open(os.path.join(args.out, "sweep_mosaic_backward.json"), "w") as f:
          json.dump(results, f, indent=1)
  pairs = {"vanilla": 4096 ** 2, "causal": 4096 * 4097 // 2}
  fl = {name: 3.5 * 2 * 4 * 16 * n * 256 for name, n in pairs.items()}  # backward: 2.5 forwards
  print(f"{'setting':10s} {'variant':8s} {'TFLOP/s by round':30s} top kernels (ms)")
  for name in names:
    for variant in ("vanilla", "causal"):
      runs = [x for x in results["runs"] if x["setting"] == name and x["variant"] == variant]
      rates = " ".join(f"{fl[variant] / x['ms'] / 1e9:6.0f}" if "ms" in x else "   err"
                       for x in runs)
      top = sorted(runs[-1].get("kernels", {}).items(), key=lambda kv: -kv[1])[:3]
      print(f"{name:10s} {variant:8s} {rates:30s} "
            + "; ".join(f"{k[:28]} {v:.3f}" for k, v in top))


if __name__ == "__main__":
  main()
