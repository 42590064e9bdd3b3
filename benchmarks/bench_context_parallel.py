"""Context-parallel ring attention over all local GPUs against one GPU.

Run on the GPU machine: `python benchmarks/bench_context_parallel.py --out DIR`.
Writes DIR/context_parallel.json (device, date, versions, every
measurement) and prints a table last.

Causal softmax, bf16, d=128, Hq=Hkv=16, batch 1, S = 64k and 128k tokens:
`pallas_attn.context_parallel_attention` with the sequence split over every
local GPU (zigzag layout, the default for causal masks) against
`pallas_attn.attention` on one GPU at the same total length. Forward, and
forward+backward (the VJP of a random cotangent with respect to q, k, v).
Time is back-to-back device throughput (`schedule.timing.median_time_ms`);
the speedup is the one-GPU time over the ring's (the same tokens).
Memory per GPU: the compiled program's arguments, temporaries and outputs
(`memory_analysis`, per device under SPMD) and the measured peak
(`device.memory_stats()['peak_bytes_in_use']`, each configuration in its own
process so that peaks do not carry over). NVLink multicast stays off
(NCCL_NVLS_ENABLE=0).
"""
from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"  # before JAX starts NCCL; inherited by the runs

import argparse
import json
import subprocess
import sys
import traceback

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

import pallas_attn as pa
from bench_forward import CAUSAL, environment
from pallas_attn.schedule.timing import attention_flops, median_time_ms

RING, SINGLE = "ring", "single"


def _inputs(seq, heads, d, sharding):
  """Random bf16 q, k, v `[1, seq, heads, d]` created in place with `sharding`."""
  def make(key):
    keys = jax.random.split(key, 3)
    return tuple(jax.random.normal(k, (1, seq, heads, d), jnp.bfloat16) for k in keys)
  return jax.jit(make, out_shardings=(sharding,) * 3)(jax.random.PRNGKey(0))


def _memory(compiled) -> int:
  stats = compiled.memory_analysis()
  return int(stats.argument_size_in_bytes + stats.temp_size_in_bytes
             + stats.output_size_in_bytes)


def _peaks(devices) -> list:
  return [int((d.memory_stats() or {}).get("peak_bytes_in_use", 0)) for d in devices]


def measure(side: str, seq: int, heads: int, d: int) -> dict:
  """Times and memory of the forward, then the forward+backward, of one side."""
  if side == RING:
    devices = jax.local_devices()
    mesh = jax.make_mesh((len(devices),), ("seq",), devices=devices)
    sharding = NamedSharding(mesh, PartitionSpec(None, "seq"))

    def attention(q, k, v):
      return pa.context_parallel_attention(q, k, v, mesh=mesh, seq_axis="seq",
                                           mask_mod=CAUSAL)
  else:
    devices = jax.local_devices()[:1]
    sharding = jax.sharding.SingleDeviceSharding(devices[0])

    def attention(q, k, v):
      return pa.attention(q, k, v, mask_mod=CAUSAL)

  q, k, v = _inputs(seq, heads, d, sharding)
  cotangent = _inputs(seq, heads, d, sharding)[0]

  def step(q, k, v, d_out):
    _, pullback = jax.vjp(attention, q, k, v)
    return pullback(d_out)

  result = {"side": side, "seq": seq, "devices": len(devices), "environment": environment()}
  for mode, fn, args in (("fwd", attention, (q, k, v)), ("fwd_bwd", step, (q, k, v, cotangent))):
    compiled = jax.jit(fn).lower(*args).compile()
    ms = median_time_ms(lambda: compiled(*args), warmup=2, reps=5)
    flops = attention_flops(1, heads, seq, seq, d, d, density=(seq + 1) / (2 * seq), mode=mode)
    result[mode] = {"ms": ms, "tflops": flops / ms / 1e9,
                    "tflops_per_gpu": flops / ms / 1e9 / len(devices),
                    "compiled_bytes_per_gpu": _memory(compiled),
                    "peak_bytes_per_gpu": _peaks(devices)}
  return result


def _run_one(side, seq, heads, d) -> dict:
  """`measure` in a fresh process (its own memory peaks)."""
  command = [sys.executable, __file__, "--one", side, str(seq), "--heads", str(heads),
             "--d", str(d)]
  proc = subprocess.run(command, capture_output=True, text=True)
  lines = proc.stdout.strip().splitlines()
  if proc.returncode or not lines:
    return {"side": side, "seq": seq,
            "error": (proc.stderr or proc.stdout).strip().splitlines()[-12:]}
  return json.loads(lines[-1])


def print_table(results):
  print(f"{'S':>7} {'pass':>8} {'1 GPU ms':>9} {'ring ms':>9} {'speedup':>8} "
        f"{'ring TF/s/GPU':>13} {'peak GiB/GPU 1 | ring':>22} {'compiled 1 | ring':>18}")
  gib = lambda x: x / 2 ** 30
  for row in results["rows"]:
    single, ring = row[SINGLE], row[RING]
    if "error" in single or "error" in ring:
      print(f"{row['seq']:>7}  error: see the JSON")
      continue
    for mode in ("fwd", "fwd_bwd"):
      peak = lambda r: gib(max(r[mode]["peak_bytes_per_gpu"]))
      compiled = lambda r: gib(r[mode]["compiled_bytes_per_gpu"])
      print(f"{row['seq']:>7} {mode:>8} {single[mode]['ms']:>9.1f} {ring[mode]['ms']:>9.1f} "
            f"{row['speedup'][mode]:>7.2f}x {ring[mode]['tflops_per_gpu']:>13.0f} "
            f"{peak(single):>10.2f} | {peak(ring):<9.2f} {compiled(single):>8.2f} | "
            f"{compiled(ring):.2f}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", default="benchmarks/results")
  parser.add_argument("--seqs", default="65536,131072")
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--d", type=int, default=128)
  parser.add_argument("--one", nargs=2, metavar=("SIDE", "SEQ"), help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.one:
    side, seq = args.one[0], int(args.one[1])
    print(json.dumps(measure(side, seq, args.heads, args.d)))
    return
  os.makedirs(args.out, exist_ok=True)
  # This process leaves the GPUs alone (no JAX backend: it would hold their
  # memory); each measurement runs in its own process and reports its setup.
  results = {"environment": {"NCCL_NVLS_ENABLE": os.environ["NCCL_NVLS_ENABLE"]},
             "config": {"heads": args.heads, "d": args.d, "batch": 1, "dtype": "bfloat16",
                        "mask": "causal"},
             "rows": []}
  for seq in map(int, args.seqs.split(",")):
    row = {"seq": seq}
    for side in (SINGLE, RING):
      try:
        row[side] = _run_one(side, seq, args.heads, args.d)
      except Exception:
        row[side] = {"error": traceback.format_exc().splitlines()[-5:]}
    for side in (SINGLE, RING):
      results["environment"].update(row[side].pop("environment", {}))
    if "error" not in row[SINGLE] and "error" not in row[RING]:
      row["speedup"] = {mode: row[SINGLE][mode]["ms"] / row[RING][mode]["ms"]
                        for mode in ("fwd", "fwd_bwd")}
    results["rows"].append(row)
    with open(os.path.join(args.out, "context_parallel.json"), "w") as f:
      json.dump(results, f, indent=1)
  print_table(results)


if __name__ == "__main__":
  main()
