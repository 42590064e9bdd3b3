"""Same-run sweeps behind the defaults: forward and backward tiles, and q-block order.

Run on the GPU machine:
`python benchmarks/sweep_configs.py [forward] [order] [backward] [causal]`.
Prints one line per measurement and writes $OUT/sweep.json (default /tmp/out).
`order` compares the heaviest-first query-block order with the natural one by
swapping `tiles.program_block` / `tiles.heaviest_first` for identity versions.
`causal` times dense, causal and the Pallas reference's causal forward in
interleaved rounds (one kernel's drift between runs reached ~15%, more than
the margins of the causal targets), and reports per-round ratios.
"""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for torch

import jax
from jax.experimental import pallas as pl

import pallas_attn as pa
from bench_forward import inputs
from bench_masks import flex_peer
from pallas_attn.kernels import tiles
from pallas_attn.schedule.timing import (amortized_time_ms, amortized_timer,
                                         attention_flops)

HEADS, D = 16, 128
CAUSAL = lambda b, h, qi, ki: qi >= ki
RESULTS = []


def record(name, ms, flops):
  tflops = flops / ms / 1e9 if ms else None
  RESULTS.append(dict(name=name, ms=ms, tflops=tflops))
  print(f"{name:<56} {ms and round(ms, 4)} ms  {tflops and round(tflops)} TFLOP/s", flush=True)


def timed(fn, *args):
  try:
    return amortized_time_ms(fn, *args)
  except Exception as e:  # a config that does not fit is reported, not fatal
    print("error:", type(e).__name__, str(e)[:300])
    return None


def forward_and_backward(**kw):
  def run(q, k, v, d_out):
    _, vjp = jax.vjp(lambda q, k, v: pa.attention(q, k, v, **kw), q, k, v)
    return vjp(d_out)
  return run


def compare_causal(rounds: int = 5):
  from jax.experimental.pallas.ops.gpu import attention as pallas_ref
  for seq in (4096, 16384):
    batch = 16384 // seq
    q, k, v = inputs(batch, seq, HEADS, D, D)
    kernels = {
        "dense": lambda q, k, v: pa.attention(q, k, v),
        "causal": lambda q, k, v: pa.attention(q, k, v, mask_mod=CAUSAL),
        "pallas_ref_causal": lambda q, k, v: pallas_ref.mha(
            q, k, v, None, sm_scale=D ** -0.5, causal=True),
    }
    flops = attention_flops(batch, HEADS, seq, seq, D, D)
    timers = {name: amortized_timer(fn, q, k, v) for name, fn in kernels.items()}
    times = {name: [] for name in kernels}
    for _ in range(rounds):
      for name, timer in timers.items():
        ms = timer()
        times[name].append(ms)
        record(f"causal S={seq} {name}", ms, flops * (0.5 if "causal" in name else 1))
    ratios = {
        "causal_over_dense": [c / d for c, d in zip(times["causal"], times["dense"])],
        "pallas_ref_over_causal": [r / c for r, c in
                                   zip(times["pallas_ref_causal"], times["causal"])]}
    for name, values in ratios.items():
      values = sorted(values)
      RESULTS.append(dict(name=f"causal S={seq} {name}", per_round=values))
      print(f"S={seq} {name}: median {values[len(values) // 2]:.3f} "
            f"range {values[0]:.3f}-{values[-1]:.3f}", flush=True)


def sweep_forward():
  from jax.experimental.pallas.ops.gpu import attention as pallas_ref
  batch, seq = 4, 4096
  q, k, v = inputs(batch, seq, HEADS, D, D)
  flops = attention_flops(batch, HEADS, seq, seq, D, D)
  record("pallas_ref vanilla", timed(lambda q, k, v: pallas_ref.mha(
      q, k, v, None, sm_scale=D ** -0.5), q, k, v), flops)
  record("flex vanilla", flex_peer(batch, seq, "vanilla"), flops)
  for cfg in [(128, 64, 8, 3), (128, 64, 8, 4), (256, 64, 8, 3), (128, 128, 8, 3),
              (128, 64, 4, 3), (64, 64, 4, 4)]:
    config = pa.AttentionConfig(*cfg)
    record(f"vanilla fwd {cfg}", timed(lambda q, k, v: pa.attention(q, k, v, config=config),
                                       q, k, v), flops)
    record(f"causal fwd {cfg}", timed(lambda q, k, v: pa.attention(
        q, k, v, mask_mod=CAUSAL, config=config), q, k, v), flops / 2)


def compare_order():
  heaviest = (tiles.program_block, tiles.heaviest_first)
  natural = (lambda: pl.program_id(0), lambda specs, n: specs)
  for seq in (4096, 16384):
    batch = 16384 // seq
    q, k, v = inputs(batch, seq, HEADS, D, D)
    flops = attention_flops(batch, HEADS, seq, seq, D, D)
    record(f"S{seq} dense", timed(lambda q, k, v: pa.attention(q, k, v), q, k, v), flops)
    for name, (block, specs) in (("heaviest", heaviest), ("natural", natural),
                                 ("heaviest", heaviest)):
      tiles.program_block, tiles.heaviest_first = block, specs
      record(f"S{seq} causal {name}", timed(lambda q, k, v: pa.attention(
          q, k, v, mask_mod=CAUSAL), q, k, v), flops / 2)


def sweep_backward():
  cases = {
      (128, 4096): [(64, 128, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2),
                    (64, 32, 4, 2), (128, 128, 8, 2)],
      (64, 4096): [(64, 64, 4, 2), (128, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2)],
  }
  for (d, seq), configs in cases.items():
    batch = 16384 // seq
    q, k, v = inputs(batch, seq, HEADS, d, d)
    d_out = jax.random.normal(jax.random.PRNGKey(5), q.shape, q.dtype)
    flops = attention_flops(batch, HEADS, seq, seq, d, d, mode="fwd_bwd")
    for cfg in configs:
      record(f"d{d} S{seq} fwd+bwd bwd{cfg}", timed(forward_and_backward(
          bwd_config=pa.AttentionConfig(*cfg)), q, k, v, d_out), flops)


if __name__ == "__main__":
  chosen = sys.argv[1:] or ["forward", "order", "backward"]
  for name, fn in (("forward", sweep_forward), ("order", compare_order),
                   ("backward", sweep_backward), ("causal", compare_causal)):
    if name in chosen:
      fn()
  out = os.environ.get("OUT", "/tmp/out")
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "sweep.json"), "w") as f:
    json.dump(RESULTS, f, indent=1)
