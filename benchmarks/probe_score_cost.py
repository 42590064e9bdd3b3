"""Probe: where an arithmetic score_mod's time goes in the Mosaic GPU kernels.

ALiBi (`s + slopes[h] * (kv - q)`) ran 30% under causal attention on the
Mosaic forward when its bias was evaluated at every position. This times, in
one run, causal attention with variants of that bias that separate its
parts: a constant slope instead of the captured per-head one, the bias's
key part or query part alone, and the slope alone. On an H100 (2026-11-23):
causal 592 / alibi 422 / constant slope 427 / keys only 493 / queries only
556 / slope only 558 TFLOP/s forward: the per-position index arithmetic, not
the slope's load, was the cost; spec/separable.py now builds such biases
from vectors (ALiBi 506). Kernel time (CUPTI), bf16 B4 H16 S4096 d128.

    python benchmarks/probe_score_cost.py --out DIR
"""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_attn as pa  # noqa: E402
from kernel_time import kernel_time_ms  # noqa: E402
from pallas_attn import variants as V  # noqa: E402
from pallas_attn.schedule.timing import attention_flops  # noqa: E402

CAUSAL = V.causal().mask_mod


def score_mods(heads):
  slopes = V.alibi_slopes(heads)
  return {
      "causal": None,
      "alibi": lambda s, b, h, q, kv: s + slopes[h] * (kv - q).astype(jnp.float32),
      "alibi_const_slope": lambda s, b, h, q, kv: s + 0.0625 * (kv - q).astype(jnp.float32),
      "slope_only": lambda s, b, h, q, kv: s + slopes[h],
      "kv_only": lambda s, b, h, q, kv: s + slopes[h] * kv.astype(jnp.float32),
      "q_only": lambda s, b, h, q, kv: s + slopes[h] * q.astype(jnp.float32),
  }


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=".")
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--only", default="", help="comma-separated variants (default: all)")
  args = parser.parse_args(argv)
  batch, heads, seq, d = 4, 16, args.seq, 128
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q, k, v = (jax.random.normal(kk, (batch, seq, heads, d), jnp.bfloat16) for kk in keys)
  rows = []
  for name, mod in score_mods(heads).items():
    if args.only and name not in args.only.split(","):
      continue
    attn = lambda q, k, v, mod=mod: pa.attention(q, k, v, score_mod=mod, mask_mod=CAUSAL)
    fwd = jax.jit(attn)
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32)),
                            argnums=(0, 1, 2)))
    row = dict(name=name)
    for mode, fn in (("fwd", fwd), ("fwd_bwd", grad)):
      try:
        ms, kernels = kernel_time_ms(lambda fn=fn: fn(q, k, v), calls=20, warmup=2)
        tf = attention_flops(batch, heads, seq, seq, d, d, density=0.5, mode=mode) / ms / 1e9
        row[mode] = dict(ms=ms, tflops=tf, kernels=kernels)
      except Exception as e:  # report and go on
        row[mode] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
    rows.append(row)
    print(json.dumps({n: (r if not isinstance(r, dict) else {kk: vv for kk, vv in r.items()
                                                              if kk != "kernels"})
                      for n, r in row.items()}), flush=True)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "probe_score_cost.json"), "w") as f:
    json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=rows), f,
              indent=1)
  print(f"\n{'variant':<20} {'fwd TF/s':>9} {'f+b TF/s':>9}")
  for row in rows:
    cells = [f"{row[m]['tflops']:9.0f}" if "tflops" in row[m] else f"{'err':>9}"
             for m in ("fwd", "fwd_bwd")]
    print(f"{row['name']:<20} {' '.join(cells)}")


if __name__ == "__main__":
  main()
