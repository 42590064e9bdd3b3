"""Same-run sweep of the Triton backward's tiles for wide heads (Dqk 192 / 256),
which the Mosaic backward does not take yet: `python
benchmarks/sweep_backward_wide.py --out DIR`. Forward+backward kernel time
(CUPTI) of B4 H16 S4096 bf16, vanilla; writes DIR/sweep_backward_wide.json.
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

CONFIGS = [(32, 64, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2), (32, 32, 4, 2), (64, 32, 4, 2),
           (32, 64, 8, 1), (64, 64, 8, 1), (128, 32, 8, 2)]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default="/tmp/out")
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  results = {"environment": environment(), "runs": []}
  for d_qk, d_v in ((256, 256), (192, 128)):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k = (jax.random.normal(kk, (4, 4096, 16, d_qk), jnp.bfloat16) for kk in keys[:2])
    v = jax.random.normal(keys[2], (4, 4096, 16, d_v), jnp.bfloat16)
    flops = 3.5 * 2 * 4 * 16 * 4096 ** 2 * (d_qk + d_v)
    for bq, bk, warps, stages in CONFIGS:
      cfg = pa.AttentionConfig(block_q=bq, block_k=bk, num_warps=warps, num_stages=stages)
      loss = lambda q, k, v: jnp.sum(pa.attention(q, k, v, bwd_config=cfg).astype(jnp.float32))
      fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
      run = dict(d_qk=d_qk, d_v=d_v, config=[bq, bk, warps, stages])
      try:
        run["tflops"] = flops / kernel_time_ms(lambda: fn(q, k, v))[0] / 1e9
      except Exception as e:
        run["error"] = f"{type(e).__name__}: {str(e)[:200]}"
      results["runs"].append(run)
      print(json.dumps(run), flush=True)
      with open(os.path.join(args.out, "sweep_backward_wide.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
