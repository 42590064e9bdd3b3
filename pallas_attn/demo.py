"""`pallas-attn demo`: compile several variants, check them against the
dense reference and print a table with timings.

On CPU it runs in Pallas interpret mode on small shapes; on a GPU it runs the
compiled Triton kernels on a larger shape.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import pallas_attn as pa
from pallas_attn.schedule.timing import median_time_ms


def demo_variants(heads: int, seq: int) -> dict:
  """name -> (attention kwargs, reference masked_fill)."""
  slopes = 2.0 ** (-8.0 * jnp.arange(1, heads + 1) / heads)
  causal = lambda b, h, qi, ki: qi >= ki
  window = lambda b, h, qi, ki: (qi >= ki) & (qi - ki < max(seq // 4, 1))
  retnet = lambda row: row / jnp.maximum(jnp.sum(jnp.abs(row), -1, keepdims=True), 1.0)
  return {
      "softmax": (dict(), -jnp.inf),
      "causal": (dict(mask_mod=causal), -jnp.inf),
      "softcap 20": (dict(score_mod=lambda s, b, h, qi, ki: 20.0 * jnp.tanh(s / 20.0)), -jnp.inf),
      "alibi": (dict(score_mod=lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi), mask_mod=causal),
                -jnp.inf),
      "sliding window": (dict(mask_mod=window), -jnp.inf),
      "sigmoid": (dict(rownorm="sigmoid",
                       score_mod=lambda s, b, h, qi, ki: s - jnp.log(float(seq))), -jnp.inf),
      "relu": (dict(rownorm="relu"), -jnp.inf),
      "retnet norm": (dict(rownorm=retnet, mask_mod=causal), 0.0),
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="pallas-attn demo", description=__doc__)
  on_gpu = jax.default_backend() == "gpu"
  parser.add_argument("--seq", type=int, default=2048 if on_gpu else 100)
  parser.add_argument("--batch", type=int, default=4 if on_gpu else 1)
  parser.add_argument("--heads", type=int, default=16 if on_gpu else 4)
  parser.add_argument("--kv-heads", type=int, default=None)
  parser.add_argument("--head-dim", type=int, default=128 if on_gpu else 32)
  parser.add_argument("--dtype", choices=["float32", "bfloat16"],
                      default="bfloat16" if on_gpu else "float32")
  args = parser.parse_args(argv)
  kv_heads = args.kv_heads or max(1, args.heads // 2)
  dtype = jnp.dtype(args.dtype)
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  shape = lambda h: (args.batch, args.seq, h, args.head_dim)
  q = jax.random.normal(keys[0], shape(args.heads), dtype)
  k = jax.random.normal(keys[1], shape(kv_heads), dtype)
  v = jax.random.normal(keys[2], shape(kv_heads), dtype)
  mode = "compiled Triton" if on_gpu else "Pallas interpret mode"
  print(f"pallas_attn demo on {jax.devices()[0].device_kind} ({mode}); "
        f"q {q.shape}, k/v {k.shape} {args.dtype}, GQA {args.heads}/{kv_heads}")
  print(f"{'variant':<16} {'rownorm class':<14} {'rel. error':>10} {'ours ms':>9} {'dense ms':>9}  ok")
  tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
  failures = 0
  for name, (kw, fill) in demo_variants(args.heads, args.seq).items():
    kind = pa.analyze_variant(kw.get("score_mod"), kw.get("mask_mod"),
                              kw.get("rownorm", "softmax")).rownorm.kind
    ours = jax.jit(lambda q, k, v, kw=kw: pa.attention(q, k, v, **kw))
    dense = jax.jit(lambda q, k, v, kw=kw: pa.attention_reference(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
        masked_fill=fill, **kw))
    start = time.perf_counter()
    out = jax.block_until_ready(ours(q, k, v))
    compile_s = time.perf_counter() - start
    ref = dense(q, k, v)
    err = float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    ok = err <= tolerance and not bool(jnp.isnan(out).any())
    failures += not ok
    reps = 10 if on_gpu else 1
    ours_ms = median_time_ms(lambda: ours(q, k, v), warmup=1, reps=reps)
    dense_ms = median_time_ms(lambda: dense(q, k, v), warmup=1, reps=reps)
    print(f"{name:<16} {kind:<14} {err:>10.2e} {ours_ms:>9.2f} {dense_ms:>9.2f}  "
          f"{'yes' if ok else 'NO'}   (first call {compile_s:.1f}s)")
  print("all variants match the reference" if not failures else f"{failures} variant(s) FAILED")
  return 1 if failures else 0


if __name__ == "__main__":
  raise SystemExit(main())
