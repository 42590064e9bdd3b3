"""How much faster are context-parallel ring attention and sharded decoding
over several GPUs of one host than one GPU, and what do they hold per GPU?

    python benchmarks/multi_gpu.py [--seqs 131072 262144] [--devices 1 2 4]
        [--decode-seqs 1048576 2097152] [--head-groups G] [--profile]

Ring: causal softmax, bf16, d 128, Hq = Hkv = 16, batch 1:
`context_parallel_attention` with the sequence split over the first n local
GPUs (zigzag, the default for causal masks: its relayout in and out
included; `ring_preordered`: inputs already in the zigzag order,
`sequence_order="zigzag"`, no relayout) against `attention` on one GPU at the
same total length; forward, and forward+backward (q, k, v). Decoding: one
query token, B1 Hq 32 / Hkv 8 d 128 bf16 over a cache of S keys:
`sharded_decode_attention` with the cache's sequence split over n GPUs against
`decode_attention` on one; GB/s per GPU count the K/V bytes each reads.
By throughput; speedups are one GPU's time over n GPUs'. Memory per GPU: the
compiled program's arguments, temporaries and outputs (per device under SPMD)
and the peak measured after one call (inputs included), each configuration
in a process of its own so that peaks do not carry over (this one leaves the
GPUs alone). `--profile` adds
each GPU's kernel, collective and idle time per call (PyTorch's CUPTI
profiler; ring and decoding, whose multi-GPU throughput can be bound by the
host's dispatch of one program per GPU). NVLink multicast stays off
(NCCL_NVLS_ENABLE=0). `--small` runs on two simulated CPU devices. Writes
`multi_gpu.json` to `--out`.
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

SMALL_ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
PREORDERED = "ring_preordered"  # the ring on inputs already in the zigzag order
DECODE_HEADS, DECODE_KV_HEADS = 32, 8


def impl_name(kind: str, devices: int) -> str:
  if devices == 1:
    return "decode" if kind == "decode" else "pallas_attn"
  return f"{kind}_{devices}gpu"


def _setup(devices: int):
  """(devices, sharding of a [B, S, ...] array split over S on them, mesh or None)."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec
  chosen = jax.local_devices()[:devices]
  if len(chosen) < devices:
    raise ValueError(f"{devices} devices asked, {len(chosen)} local")
  if devices == 1:
    return chosen, jax.sharding.SingleDeviceSharding(chosen[0]), None
  mesh = jax.make_mesh((devices,), ("seq",), devices=chosen)
  return chosen, NamedSharding(mesh, PartitionSpec(None, "seq")), mesh


def _random(shapes, sharding, seed: int):
  """Normal bf16 arrays created in place with their sharding, one at a time
  (so that making them peaks below the measured calls)."""
  import jax
  import jax.numpy as jnp
  make = {s: jax.jit(lambda key, s=s: jax.random.normal(key, s, jnp.bfloat16),
                     out_shardings=sharding) for s in set(shapes)}
  return tuple(make[s](k) for k, s in zip(jax.random.split(jax.random.key(seed), len(shapes)),
                                          shapes))


def _memory(compiled, call, devices) -> dict:
  """Compiled bytes (arguments, temporaries, outputs) and the peak bytes in
  use after one call (before the timed ones: back-to-back calls also hold a
  previous call's outputs), per GPU."""
  import jax
  jax.block_until_ready(call())
  stats = compiled.memory_analysis()
  return {"compiled_bytes_per_gpu": int(stats.argument_size_in_bytes + stats.temp_size_in_bytes
                                        + stats.output_size_in_bytes),
          "peak_bytes_per_gpu": [int((x.memory_stats() or {}).get("peak_bytes_in_use", 0))
                                 for x in devices]}


def _profile(call, devices, calls: int = 3) -> list:
  """Per GPU, per call: span, busy, collective, compute and idle ms, top kernels."""
  per_device = harness.device_breakdown_ms(call, calls=calls)
  return [per_device.get(i, {}) for i in range(len(devices))]


# Timed windows of about a second (at least three calls), one GPU and the
# ring alike, as the training example times its steps: dozens of calls a
# window for the shorter rows, so that a window's first dispatch and last
# wait weigh nothing. (They were not the two-GPU forward's missing time:
# 64k 15.52 ms a call in three-call windows, 15.75 in one-second ones on
# another host, against a CUPTI span of 14.1 ms a call over three calls.)
RING_WINDOW_MS, RING_MIN_CALLS = 1000.0, 3


def measure_ring(devices: int, seq: int, heads: int, d: int, profile: bool,
                 preordered: bool = False, head_groups: int | None = None) -> dict:
  """Per mode: ms, TFLOP/s and bytes per GPU of the ring over `devices` GPUs
  (one GPU: `attention`); `preordered`: inputs and output in the zigzag
  order (`sequence_order="zigzag"`, no relayout); `head_groups`: the ring's
  (None: its default)."""
  import jax

  import pallas_attn as pa
  from pallas_attn.schedule.timing import attention_flops, median_time_ms
  causal = pa.variants.causal().mask_mod
  chosen, sharding, mesh = _setup(devices)
  if mesh is None:
    attention = lambda q, k, v: pa.attention(q, k, v, mask_mod=causal)
  else:
    order = "zigzag" if preordered else "natural"
    attention = lambda q, k, v: pa.context_parallel_attention(
        q, k, v, mesh=mesh, seq_axis="seq", mask_mod=causal, sequence_order=order,
        head_groups=head_groups)
  q, k, v, cotangent = _random([(1, seq, heads, d)] * 4, sharding, 0)

  def step(q, k, v, d_out):
    return jax.vjp(attention, q, k, v)[1](d_out)
  result = {"environment": bench.environment(), "devices": devices}
  for mode, fn, args in (("fwd", attention, (q, k, v)), ("fwd_bwd", step, (q, k, v, cotangent))):
    # As the README tells users: the ring's transfers on the copy engines.
    compiled = jax.jit(fn, compiler_options=pa.distributed.PEER_COPY_OPTIONS).lower(*args).compile()
    memory = _memory(compiled, lambda: compiled(*args), chosen)
    # On CPU (`--small`) one call a window: XLA's CPU collectives time out in
    # their rendezvous with several executions of the ring in flight.
    on_cpu = jax.default_backend() == "cpu"
    ms = median_time_ms(lambda: compiled(*args), warmup=2, reps=5,
                        window_ms=0.0 if on_cpu else RING_WINDOW_MS,
                        min_calls=1 if on_cpu else RING_MIN_CALLS)
    flops = attention_flops(1, heads, seq, seq, d, d, density=(seq + 1) / (2 * seq), mode=mode)
    result[mode] = {"ms": ms, "tflops": flops / ms / 1e9, **memory}
    if profile and mesh is not None:
      result[mode]["profile"] = _profile(lambda: compiled(*args), chosen)
  return result


def measure_decode(devices: int, seq: int, d: int, profile: bool) -> dict:
  """ms, GB/s per GPU and bytes per GPU of decoding one token over a cache
  of `seq` keys split over `devices` GPUs (one GPU: `decode_attention`)."""
  import jax
  import jax.numpy as jnp

  import pallas_attn as pa
  from pallas_attn.schedule.timing import median_time_ms
  chosen, sharding, mesh = _setup(devices)
  cache = (1, seq, DECODE_KV_HEADS, d)
  k, v = _random([cache, cache], sharding, 0)
  replicated = chosen[0] if mesh is None else jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec())
  q = jax.device_put(jax.random.normal(jax.random.key(1), (1, 1, DECODE_HEADS, d), jnp.bfloat16),
                     replicated)
  lengths = jax.device_put(jnp.full((1,), seq, jnp.int32), replicated)
  if mesh is None:
    fn = pa.decode_attention
  else:
    fn = lambda q, k, v, lengths: pa.sharded_decode_attention(q, k, v, lengths, mesh=mesh,
                                                              axis_name="seq")
  compiled = jax.jit(fn).lower(q, k, v, lengths).compile()
  call = lambda: compiled(q, k, v, lengths)
  memory = _memory(compiled, call, chosen)
  ms = median_time_ms(call, warmup=3, reps=10)
  gbytes_per_gpu = 2 * seq * DECODE_KV_HEADS * d * 2 / devices / 1e9
  cell = {"ms": ms, "gb_s": gbytes_per_gpu / ms * 1e3, **memory}
  if profile:
    cell["profile"] = _profile(call, chosen, calls=20)
  return {"environment": bench.environment(), "devices": devices, "decode": cell}


def run_one(kind: str, devices: int, seq: int, args) -> dict:
  """One measurement in a fresh process (its own memory peaks), or the error's last lines."""
  command = [sys.executable, __file__, "--one", kind, str(devices), str(seq), "--heads",
             str(args.heads), "--d", str(args.d)] + (["--profile"] if args.profile else []) + (
                 ["--head-groups", str(args.head_groups)] if args.head_groups else [])
  env = dict(os.environ, **(SMALL_ENV if args.small else {}))
  proc = subprocess.run(command, capture_output=True, text=True, env=env)
  lines = proc.stdout.strip().splitlines()
  if proc.returncode or not lines:
    said = [line for line in (proc.stderr + proc.stdout).strip().splitlines()
            if line.strip() and "warn" not in line.lower()]
    return {"error": f"exit status {proc.returncode}: " + " | ".join(said[-6:])}
  return json.loads(lines[-1])


def _rows(kind: str, seq: int, devices: int, result: dict) -> list[Row]:
  name = f"{'decode' if kind == 'decode' else 'causal'}_{bench.seq_name(seq)}"
  impl = impl_name(kind, devices)
  rows = []
  for mode in (("decode",) if kind == "decode" else ("fwd", "fwd_bwd")):
    if "error" in result:
      rows.append(Row(name, impl, mode, None, note=result["error"][-800:]))
      continue
    cell = dict(result[mode])
    ms = cell.pop("ms")
    rows.append(Row(name, impl, mode, ms, tflops=cell.pop("tflops", None),
                    gb_s=cell.pop("gb_s", None), extra={"devices": devices, **cell}))
  return rows


def main(argv=None):
  parser = harness.parser(__doc__.splitlines()[0], rounds=0)
  parser.add_argument("--seqs", type=int, nargs="*", default=[131072, 262144])
  parser.add_argument("--decode-seqs", type=int, nargs="*", default=[1048576, 2097152])
  parser.add_argument("--devices", type=int, nargs="+", default=None,
                      help="GPU counts to run on (default: 1, 2 and all local GPUs)")
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--d", type=int, default=128)
  parser.add_argument("--no-preordered", action="store_true",
                      help="skip the ring on inputs already in the zigzag order")
  parser.add_argument("--head-groups", type=int, default=None,
                      help="the ring's head groups (default: its own choice)")
  parser.add_argument("--profile", action="store_true",
                      help="per-GPU kernel / collective / idle time of each call")
  parser.add_argument("--one", nargs=3, metavar=("KIND", "DEVICES", "SEQ"),
                      help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.one:
    kind, devices, seq = args.one[0], int(args.one[1]), int(args.one[2])
    if kind.startswith("ring"):
      print(json.dumps(measure_ring(devices, seq, args.heads, args.d, args.profile,
                                    preordered=kind == PREORDERED,
                                    head_groups=args.head_groups)))
    else:
      print(json.dumps(measure_decode(devices, seq, args.d, args.profile)))
    return
  if args.small:
    args.seqs, args.decode_seqs, args.heads, args.d, args.devices = [512], [1024], 2, 32, [1, 2]
  if args.devices is None:
    import jax
    args.devices = sorted({1, 2, len(jax.local_devices())})
  rows, env = [], None
  notes = "NCCL_NVLS_ENABLE=0; speedup = one GPU's ms / n GPUs' ms"
  for kind, seqs in (("ring", args.seqs), (PREORDERED, args.seqs), ("decode", args.decode_seqs)):
    for seq in seqs:
      for devices in args.devices:
        if kind == PREORDERED and (devices == 1 or args.no_preordered):
          continue  # one GPU: the same as the ring's
        result = run_one(kind, devices, seq, args)
        env = env or result.pop("environment", None)
        rows += _rows(kind, seq, devices, result)
        print(" | ".join(f"{r.case} {r.impl} {r.mode} {r.time_ms or r.note[:80]}"
                         for r in rows[-2:] if r.impl == impl_name(kind, devices)), flush=True)
        if env:  # what is measured so far survives a time limit
          bench.write_results(harness.results_path(args, "multi_gpu", max(args.devices)),
                              "multi_gpu", rows, env=env, notes=notes, small=args.small)
  harness.finish(args, "multi_gpu", rows, env=env, device_count=max(args.devices), notes=notes)


if __name__ == "__main__":
  main()
