"""Forward TFLOP/s of pallas_attn next to cuDNN, JAX's Pallas reference and XLA.

Run on the GPU machine: `python benchmarks/bench_forward.py --out DIR`.
Writes DIR/forward.json (device, date, versions, every measurement) and
prints a short table last. Masked FLOPs are not counted (causal counts the
kept half).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import traceback

import jax
import jax.numpy as jnp

import pallas_attn as pa
from pallas_attn.schedule.timing import amortized_time_ms, attention_flops

CAUSAL = lambda b, h, qi, ki: qi >= ki


def environment() -> dict:
  env = {"device": jax.devices()[0].device_kind, "date": datetime.date.today().isoformat(),
         "jax": jax.__version__, "python": platform.python_version()}
  for mod in ("jaxlib", "triton", "torch"):
    try:
      env[mod] = __import__(mod).__version__
    except Exception:
      env[mod] = None
  return env


def inputs(batch, seq, heads, d_qk, d_v, dtype=jnp.bfloat16, kv_heads=None):
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  kv_heads = kv_heads or heads
  return (jax.random.normal(keys[0], (batch, seq, heads, d_qk), dtype),
          jax.random.normal(keys[1], (batch, seq, kv_heads, d_qk), dtype),
          jax.random.normal(keys[2], (batch, seq, kv_heads, d_v), dtype))


def time_fn(fn, *args):
  """Median ms of one call inside a jitted program (dispatch amortized, see
  `amortized_time_ms`), or None (with the reason) if it fails."""
  try:
    return amortized_time_ms(fn, *args), None
  except Exception as e:  # a peer that cannot run this shape is reported n/a
    return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def peers_softmax(causal: bool):
  """Standard softmax attention by each implementation, as q,k,v -> out."""
  from jax.experimental.pallas.ops.gpu import attention as pallas_ref
  mask_mod = CAUSAL if causal else None
  return {
      "pallas_attn": lambda q, k, v: pa.attention(q, k, v, mask_mod=mask_mod),
      "cudnn": lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="cudnn"),
      "pallas_ref": lambda q, k, v: pallas_ref.mha(
          q, k, v, segment_ids=None, sm_scale=q.shape[-1] ** -0.5, causal=causal),
      "xla": lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="xla"),
  }


def variant_kwargs(heads):
  slopes = 2.0 ** (-8.0 * jnp.arange(1, heads + 1) / heads)
  return {
      "vanilla": {},
      "softcap": dict(score_mod=lambda s, b, h, qi, ki: 30.0 * jnp.tanh(s / 30.0)),
      "alibi": dict(score_mod=lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)),
      "sigmoid": dict(rownorm="sigmoid", score_mod=lambda s, b, h, qi, ki: s - 8.0),
      "relu": dict(rownorm="relu"),
  }


def memory_bytes(fn, *args):
  stats = jax.jit(fn).lower(*args).compile().memory_analysis()
  return int(stats.temp_size_in_bytes + stats.output_size_in_bytes)


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
        q, k, v = inputs(tokens // seq, seq, heads, d, d)
        density = (seq + 1) / (2 * seq) if causal else 1.0
        flops = attention_flops(tokens // seq, heads, seq, seq, d, d, density=density)
        row = {"d": d, "causal": causal, "seq": seq, "batch": tokens // seq}
        for name, fn in peers_softmax(causal).items():
          ms, err = time_fn(fn, q, k, v)
          row[name] = cell(ms, flops)
          if err:
            results["errors"].append(f"{name} d={d} causal={causal} S={seq}: {err}")
        results["softmax"].append(row)
        print(json.dumps(row), flush=True)
  batch, seq = 4, 4096
  for d_qk, d_v in ((128, 128), (192, 128)):
    q, k, v = inputs(batch, seq, heads, d_qk, d_v)
    flops = attention_flops(batch, heads, seq, seq, d_qk, d_v)
    names = variant_kwargs(heads) if d_qk == 128 else {"vanilla": {}}
    for name, kw in names.items():
      row = {"variant": name if d_qk == 128 else "dqk192_dv128", "seq": seq, "batch": batch}
      for impl, fn in (("pallas_attn", lambda q, k, v, kw=kw: pa.attention(q, k, v, **kw)),
                       ("xla", lambda q, k, v, kw=kw: pa.attention_reference(q, k, v, **kw))):
        ms, err = time_fn(fn, q, k, v)
        row[impl] = cell(ms, flops)
        if err:
          results["errors"].append(f"{impl} {row['variant']}: {err}")
      results["variants"].append(row)
      print(json.dumps(row), flush=True)
  for seq in (16384, 65536):
    q, k, v = inputs(1, seq, heads, 128, 128)
    row = {"seq": seq}
    for impl, fn in (("pallas_attn", lambda q, k, v: pa.attention(q, k, v)),
                     ("xla", lambda q, k, v: jax.nn.dot_product_attention(
                         q, k, v, implementation="xla"))):
      try:
        row[impl + "_bytes"] = memory_bytes(fn, q, k, v)
      except Exception as e:
        row[impl + "_bytes"] = None
        results["errors"].append(f"memory {impl} S={seq}: {type(e).__name__}")
    results["memory"].append(row)
  with open(os.path.join(args.out, "forward.json"), "w") as f:
    json.dump(results, f, indent=1)
  print_table(results)
  return 0


def cell(ms, flops):
  """A measurement cell (ms and TFLOP/s), or None when the call failed."""
  return None if ms is None else {"ms": ms, "tflops": flops / ms / 1e9}


def fmt_tflops(measured):
  """A measurement cell as whole TFLOP/s, or n/a."""
  return "n/a" if measured is None else f"{measured['tflops']:.0f}"


def print_table(results):
  env = results["environment"]
  print(f"\n{env['device']}  {env['date']}  jax {env['jax']}  triton {env['triton']}")
  print("softmax forward TFLOP/s (bf16, H=16, 16k tokens)")
  print(f"{'d':>4} {'causal':>6} {'S':>6} {'ours':>6} {'cudnn':>6} {'p_ref':>6} {'xla':>6} {'ours/p_ref':>10}")
  for r in results["softmax"]:
    ratio = (r["pallas_attn"]["tflops"] / r["pallas_ref"]["tflops"]
             if r["pallas_attn"] and r["pallas_ref"] else float("nan"))
    print(f"{r['d']:>4} {str(r['causal']):>6} {r['seq']:>6} {fmt_tflops(r['pallas_attn']):>6} "
          f"{fmt_tflops(r['cudnn']):>6} {fmt_tflops(r['pallas_ref']):>6} {fmt_tflops(r['xla']):>6} {ratio:>10.2f}")
  print("variants forward TFLOP/s (B4 H16 S4096)")
  for r in results["variants"]:
    ours, xla = r["pallas_attn"], r["xla"]
    ratio = ours["tflops"] / xla["tflops"] if ours and xla else float("nan")
    print(f"  {r['variant']:>14} ours {fmt_tflops(ours):>5}  xla {fmt_tflops(xla):>5}  x{ratio:.1f}")
  for r in results["memory"]:
    print(f"  memory S={r['seq']}: ours {r.get('pallas_attn_bytes')} B, xla {r.get('xla_bytes')} B")
  for e in results["errors"]:
    print("  error:", e)


if __name__ == "__main__":
  try:
    sys.exit(main())
  except Exception:
    traceback.print_exc()
    sys.exit(1)
