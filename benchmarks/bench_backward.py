"""Forward+backward TFLOP/s of pallas_attn next to cuDNN, JAX's Pallas reference and XLA.

Run on the GPU machine: `python benchmarks/bench_backward.py --out DIR`.
Writes DIR/backward.json (device, date, versions, every measurement) and
prints a short table last. One step is the forward and the VJP of a random
cotangent with respect to q, k, v; FLOPs count the backward as 2.5x the
forward, and masked FLOPs are not counted.

* softmax (bf16, H=16, d=64/128, causal and not, S 1k..16k at 16k tokens):
  ours, cuDNN and JAX's Pallas reference `mha` (its own custom_vjp).
* variants (B4 H16 S4096 d128): ours next to XLA autodiff of the dense
  reference; `x vanilla` is the variant's TFLOP/s over our vanilla one at
  the same sparsity (causal vanilla for the sliding window, whose density
  counts only the window).
* memory: compiled peak (temp + output) of one step at S=16k and 64k.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import jax
import jax.numpy as jnp

import pallas_attn as pa
from bench_forward import (CAUSAL, cell, environment, fmt_tflops, inputs, memory_bytes,
                           time_fn)
from pallas_attn.schedule.timing import attention_flops, mask_density

WINDOW = 256
SLIDING_WINDOW = lambda b, h, qi, ki: (qi >= ki) & (qi - ki < WINDOW)


def step(attention):
  """q, k, v, d_out -> (dq, dk, dv): one forward and its VJP."""
  def run(q, k, v, d_out):
    _, vjp = jax.vjp(attention, q, k, v)
    return vjp(d_out)
  return run


def peers_softmax(causal: bool):
  from jax.experimental.pallas.ops.gpu import attention as pallas_ref
  mask_mod = CAUSAL if causal else None
  return {
      "pallas_attn": lambda q, k, v: pa.attention(q, k, v, mask_mod=mask_mod),
      "cudnn": lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="cudnn"),
      "pallas_ref": lambda q, k, v: pallas_ref.mha(
          q, k, v, segment_ids=None, sm_scale=q.shape[-1] ** -0.5, causal=causal),
  }


def variants(heads):
  """name -> (attention kwargs, mask_mod for the density, vanilla peer name)."""
  slopes = 2.0 ** (-8.0 * jnp.arange(1, heads + 1) / heads)
  return {
      "vanilla": ({}, None, None),
      "causal": (dict(mask_mod=CAUSAL), CAUSAL, None),
      "softcap": (dict(score_mod=lambda s, b, h, qi, ki: 30.0 * jnp.tanh(s / 30.0)), None,
                  "vanilla"),
      "alibi": (dict(score_mod=lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)), None,
                "vanilla"),
      "sigmoid": (dict(rownorm="sigmoid", score_mod=lambda s, b, h, qi, ki: s - 8.0), None,
                  "vanilla"),
      "relu": (dict(rownorm="relu"), None, "vanilla"),
      "sliding_window": (dict(mask_mod=SLIDING_WINDOW), SLIDING_WINDOW, "causal"),
  }


def alibi_with_slopes_gradient(heads):
  """ALiBi whose slopes are learned: the step also returns d slopes."""
  slopes = 2.0 ** (-8.0 * jnp.arange(1, heads + 1) / heads)

  def run(q, k, v, d_out):
    def attention(q, k, v, slopes):
      return pa.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi))
    _, vjp = jax.vjp(attention, q, k, v, slopes)
    return vjp(d_out)
  return run


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", default="benchmarks/results")
  parser.add_argument("--quick", action="store_true", help="fewer shapes")
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  results = {"environment": environment(), "softmax": [], "variants": [], "memory": [],
             "errors": []}
  heads, tokens = 16, 16384
  seqs = [1024, 4096, 16384] if args.quick else [1024, 2048, 4096, 8192, 16384]
  for d in (64, 128):
    for causal in (False, True):
      for seq in seqs:
        batch = tokens // seq
        q, k, v = inputs(batch, seq, heads, d, d)
        d_out = jax.random.normal(jax.random.PRNGKey(1), q.shape, q.dtype)
        density = (seq + 1) / (2 * seq) if causal else 1.0
        flops = attention_flops(batch, heads, seq, seq, d, d, density=density, mode="fwd_bwd")
        row = {"d": d, "causal": causal, "seq": seq, "batch": batch}
        for name, fn in peers_softmax(causal).items():
          ms, err = time_fn(step(fn), q, k, v, d_out)
          row[name] = cell(ms, flops)
          if err:
            results["errors"].append(f"{name} d={d} causal={causal} S={seq}: {err}")
        results["softmax"].append(row)
        print(json.dumps(row), flush=True)

  batch, seq, d = 4, 4096, 128
  q, k, v = inputs(batch, seq, heads, d, d)
  d_out = jax.random.normal(jax.random.PRNGKey(1), q.shape, q.dtype)
  ours_tflops = {}
  for name, (kw, mask_mod, vanilla) in variants(heads).items():
    density = mask_density(mask_mod, seq, seq)
    flops = attention_flops(batch, heads, seq, seq, d, d, density=density, mode="fwd_bwd")
    row = {"variant": name, "seq": seq, "batch": batch, "density": density}
    for impl, fn in (("pallas_attn", lambda q, k, v, kw=kw: pa.attention(q, k, v, **kw)),
                     ("xla", lambda q, k, v, kw=kw: pa.attention_reference(q, k, v, **kw))):
      ms, err = time_fn(step(fn), q, k, v, d_out)
      row[impl] = cell(ms, flops)
      if err:
        results["errors"].append(f"{impl} {name}: {err}")
    if row["pallas_attn"]:
      ours_tflops[name] = row["pallas_attn"]["tflops"]
    if vanilla and row["pallas_attn"] and vanilla in ours_tflops:
      row["vs_vanilla"] = row["pallas_attn"]["tflops"] / ours_tflops[vanilla]
    results["variants"].append(row)
    print(json.dumps(row), flush=True)
  flops = attention_flops(batch, heads, seq, seq, d, d, mode="fwd_bwd")
  ms, err = time_fn(alibi_with_slopes_gradient(heads), q, k, v, d_out)
  row = {"variant": "alibi_dslopes", "seq": seq, "batch": batch, "density": 1.0,
         "pallas_attn": cell(ms, flops), "xla": None}
  if ms is not None and "vanilla" in ours_tflops:
    row["vs_vanilla"] = row["pallas_attn"]["tflops"] / ours_tflops["vanilla"]
  if err:
    results["errors"].append(f"pallas_attn alibi_dslopes: {err}")
  results["variants"].append(row)
  print(json.dumps(row), flush=True)

  for seq in (16384, 65536):
    q, k, v = inputs(1, seq, heads, 128, 128)
    row = {"seq": seq}
    for impl, fn in (("pallas_attn", lambda q, k, v: pa.attention(q, k, v)),
                     ("cudnn", lambda q, k, v: jax.nn.dot_product_attention(
                         q, k, v, implementation="cudnn")),
                     ("xla", lambda q, k, v: jax.nn.dot_product_attention(
                         q, k, v, implementation="xla"))):
      try:
        row[impl + "_bytes"] = memory_bytes(step(fn), q, k, v, q)
      except Exception as e:
        row[impl + "_bytes"] = None
        results["errors"].append(f"memory {impl} S={seq}: {type(e).__name__}")
    results["memory"].append(row)
    print(json.dumps(row), flush=True)
  with open(os.path.join(args.out, "backward.json"), "w") as f:
    json.dump(results, f, indent=1)
  print_table(results)
  return 0


def print_table(results):
  env = results["environment"]
  print(f"\n{env['device']}  {env['date']}  jax {env['jax']}  triton {env['triton']}")
  print("softmax forward+backward TFLOP/s (bf16, H=16, 16k tokens)")
  print(f"{'d':>4} {'causal':>6} {'S':>6} {'ours':>6} {'cudnn':>6} {'p_ref':>6} {'ours/p_ref':>10}")
  for r in results["softmax"]:
    ratio = (r["pallas_attn"]["tflops"] / r["pallas_ref"]["tflops"]
             if r["pallas_attn"] and r["pallas_ref"] else float("nan"))
    print(f"{r['d']:>4} {str(r['causal']):>6} {r['seq']:>6} {fmt_tflops(r['pallas_attn']):>6} "
          f"{fmt_tflops(r['cudnn']):>6} {fmt_tflops(r['pallas_ref']):>6} {ratio:>10.2f}")
  print("variants forward+backward TFLOP/s (B4 H16 S4096 d128)")
  for r in results["variants"]:
    ours, xla = r["pallas_attn"], r["xla"]
    ratio = ours["tflops"] / xla["tflops"] if ours and xla else float("nan")
    vs = f"  x vanilla {r['vs_vanilla']:.2f}" if "vs_vanilla" in r else ""
    print(f"  {r['variant']:>14} ours {fmt_tflops(ours):>5}  xla {fmt_tflops(xla):>5}  x{ratio:.1f}{vs}")
  for r in results["memory"]:
    print(f"  memory S={r['seq']}: ours {r.get('pallas_attn_bytes')} B, "
          f"cudnn {r.get('cudnn_bytes')} B, xla {r.get('xla_bytes')} B")
  for e in results["errors"]:
    print("  error:", e)


if __name__ == "__main__":
  try:
    sys.exit(main())
  except Exception:
    traceback.print_exc()
    sys.exit(1)
