"""How much faster is context-parallel ring attention over all local GPUs
than one GPU, and what does it hold per GPU?

    python benchmarks/multi_gpu.py [--seqs 65536 131072]

Causal softmax, bf16, d 128, Hq = Hkv = 16, batch 1: `context_parallel_attention`
with the sequence split over every local GPU (zigzag, the default for causal
masks) against `attention` on one GPU at the same total length; forward, and
forward+backward (q, k, v). By throughput; the speedup is one GPU's time over
the ring's. Memory per GPU: the compiled program's arguments, temporaries and
outputs (per device under SPMD) and the measured peak, each configuration in a
process of its own so that peaks do not carry over (this one leaves the GPUs
alone). NVLink multicast stays off (NCCL_NVLS_ENABLE=0). `--small` runs on
two simulated CPU devices. Writes `multi_gpu.json` to `--out`.
"""
from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"  # before JAX starts NCCL; inherited by the runs

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import harness  # noqa: E402

from pallas_attn import bench  # noqa: E402
from pallas_attn.bench import Row  # noqa: E402

ONE_GPU, RING = "pallas_attn", "ring"
SMALL_ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}


def measure(side: str, seq: int, heads: int, d: int) -> dict:
  """Environment, then per mode: ms, TFLOP/s and bytes per GPU of one side."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec

  import pallas_attn as pa
  from pallas_attn import bench
  from pallas_attn.schedule.timing import attention_flops, median_time_ms
  causal = pa.variants.causal().mask_mod
  devices = jax.local_devices() if side == RING else jax.local_devices()[:1]
  if side == RING:
    mesh = jax.make_mesh((len(devices),), ("seq",), devices=devices)
    sharding = NamedSharding(mesh, PartitionSpec(None, "seq"))
    attention = lambda q, k, v: pa.context_parallel_attention(q, k, v, mesh=mesh, seq_axis="seq",
                                                              mask_mod=causal)
  else:
    sharding = jax.sharding.SingleDeviceSharding(devices[0])
    attention = lambda q, k, v: pa.attention(q, k, v, mask_mod=causal)

  def inputs(key):  # created in place with their sharding
    return jax.jit(lambda key: tuple(jax.random.normal(k, (1, seq, heads, d), jnp.bfloat16)
                                     for k in jax.random.split(key, 3)),
                   out_shardings=(sharding,) * 3)(key)
  q, k, v = inputs(jax.random.key(0))
  cotangent = inputs(jax.random.key(1))[0]

  def step(q, k, v, d_out):
    return jax.vjp(attention, q, k, v)[1](d_out)
  result = {"environment": bench.environment(), "devices": len(devices)}
  for mode, fn, args in (("fwd", attention, (q, k, v)), ("fwd_bwd", step, (q, k, v, cotangent))):
    compiled = jax.jit(fn).lower(*args).compile()
    ms = median_time_ms(lambda: compiled(*args), warmup=2, reps=5)
    stats = compiled.memory_analysis()
    flops = attention_flops(1, heads, seq, seq, d, d, density=(seq + 1) / (2 * seq), mode=mode)
    result[mode] = {"ms": ms, "tflops": flops / ms / 1e9, "compiled_bytes_per_gpu": int(
        stats.argument_size_in_bytes + stats.temp_size_in_bytes + stats.output_size_in_bytes),
        "peak_bytes_per_gpu": [int((x.memory_stats() or {}).get("peak_bytes_in_use", 0))
                               for x in devices]}
  return result


def run_one(side: str, seq: int, args) -> dict:
  """`measure` in a fresh process (its own memory peaks), or the error's last lines."""
  command = [sys.executable, __file__, "--one", side, str(seq), "--heads", str(args.heads),
             "--d", str(args.d)]
  env = dict(os.environ, **(SMALL_ENV if args.small else {}))
  proc = subprocess.run(command, capture_output=True, text=True, env=env)
  lines = proc.stdout.strip().splitlines()
  if proc.returncode or not lines:
    return {"error": " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])}
  return json.loads(lines[-1])


def main(argv=None):
  parser = harness.parser(__doc__.splitlines()[0], rounds=0)
  parser.add_argument("--seqs", type=int, nargs="+", default=[65536, 131072])
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--d", type=int, default=128)
  parser.add_argument("--one", nargs=2, metavar=("SIDE", "SEQ"), help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.one:
    print(json.dumps(measure(args.one[0], int(args.one[1]), args.heads, args.d)))
    return
  if args.small:
    args.seqs, args.heads, args.d = [512], 2, 32
  rows, env = [], None
  for seq in args.seqs:
    name = f"causal_{bench.seq_name(seq)}"
    for side in (ONE_GPU, RING):
      result = run_one(side, seq, args)
      env = env or result.pop("environment", None)
      for mode in ("fwd", "fwd_bwd"):
        if "error" in result:
          rows.append(Row(name, side, mode, None, note=result["error"][-200:]))
          continue
        cell = result[mode]
        rows.append(Row(name, side, mode, cell["ms"], tflops=cell["tflops"], extra={
            "devices": result["devices"], **{k: cell[k] for k in (
                "compiled_bytes_per_gpu", "peak_bytes_per_gpu")}}))
  ring = next((r.extra["devices"] for r in rows if r.impl == RING and r.time_ms), 1)
  harness.finish(args, "multi_gpu", rows, env=env, device_count=ring,
                 notes="NCCL_NVLS_ENABLE=0; speedup = pallas_attn ms / ring ms")


if __name__ == "__main__":
  main()
