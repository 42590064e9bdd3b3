"""Per-pass GPU times of the chunked linear-attention kernels, next to
flash-linear-attention's.

    python benchmarks/profile_linear.py --out DIR [--seq 4096] [--fla-only | --no-fla]

For each benchmark shape of `bench_linear` it times (one call amortized in a
jitted program, `schedule.timing.amortized_time_ms`) the whole forward and
forward+backward, then each step alone: the within-chunk cumulative sum of
the log decays (our Pallas pass before the kernels, and XLA's cumsum that it
replaced), the forward state pass, the
forward's kernels together, the reverse state pass, the backward's kernels
together. flash-linear-attention
(`chunk_gla` / `chunk_simple_gla`) is timed with `triton.testing.do_bench`
(asynchronous launches, as a training step runs them). Appends JSON lines
to DIR/profile_linear.jsonl as each number arrives (fla autotunes for
minutes on first use, so a run may be cut short) and prints a table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.bench_linear import (  # noqa: E402
    SHAPES, _fla_runner, _inputs, _jax_fns, _ours, _scan, time_fla)
from pallas_attn.kernels import backend  # noqa: E402
from pallas_attn.kernels.linear import reference  # noqa: E402
from pallas_attn.schedule.config import LinearAttentionConfig  # noqa: E402
from pallas_attn.schedule.timing import amortized_time_ms  # noqa: E402

# The package re-exports a function named like the module: read the modules.
forward_lib = sys.modules["pallas_attn.kernels.linear.chunked_forward"]
backward_lib = sys.modules["pallas_attn.vjp.linear_backward"]


def _record(out: pathlib.Path, row: dict) -> None:
  print(json.dumps(row), flush=True)
  with open(out / "profile_linear.jsonl", "a") as f:
    f.write(json.dumps(row) + "\n")


def _schedule(kind: str, scale: float, seq_len: int, d_k: int, d_v: int):
  config = forward_lib.heuristic_linear_config(seq_len, d_k, d_v)
  return forward_lib.ChunkedSchedule(
      decay_kind=kind, scale=scale, chunk_size=config.chunk_size,
      block_v=config.block_v, num_warps=config.num_warps,
      num_stages=config.num_stages,
      interpret=backend.resolve_interpret(None), out_dtype="bfloat16")


def _time_into(row: dict, key: str, fn, args) -> None:
  """row[key] = amortized ms of fn(*args), or the error (the profile goes on)."""
  try:
    row[key] = amortized_time_ms(fn, *args)
  except Exception as e:
    row[key] = f"{type(e).__name__}: {str(e)[:200]}"
  print(f"  {row['shape']} {key}: {row[key]}", flush=True)


def profile_ours(name: str, seq_len: int, out: pathlib.Path,
                 configs=(), scan: bool = False) -> None:
  heads, d_k, d_v, kind, scale = SHAPES[name]
  q, k, v, log_decay, d_out = _inputs(seq_len, heads, d_k, d_v, kind)
  schedule = _schedule(kind, scale or d_k ** -0.5, seq_len, d_k, d_v)
  g = forward_lib.chunk_cumulative_log_decay(
      log_decay, schedule.chunk_size, interpret=schedule.interpret)
  initial = jnp.zeros((q.shape[0], heads, d_k, d_v), jnp.float32)
  _, _, states = jax.jit(forward_lib.chunked_forward, static_argnums=5)(
      q, k, v, g, initial, schedule)
  forward, forward_backward = _jax_fns(_ours(scale))
  passes = {
      "fwd": (forward, (q, k, v, log_decay)),
      "fwd_bwd": (forward_backward, (q, k, v, log_decay, d_out)),
      "decay_cumsum": (lambda ld: forward_lib.chunk_cumulative_log_decay(
          ld, schedule.chunk_size, interpret=schedule.interpret), (log_decay,)),
      "decay_cumsum_xla": (lambda ld: reference.chunk_cumulative_log_decay(
          ld, schedule.chunk_size), (log_decay,)),
      "state_fwd": (lambda k, v, g, s: forward_lib.state_pass(
          k, v, g, s, schedule, reverse=False), (k, v, g, initial)),
      "chunked_forward": (lambda q, k, v, g, s: forward_lib.chunked_forward(
          q, k, v, g, s, schedule), (q, k, v, g, initial)),
      "state_bwd": (lambda q, do, g, s: forward_lib.state_pass(
          q, do, g, s, schedule, reverse=True), (q, d_out, g, initial)),
      "chunked_backward": (lambda q, k, v, g, st, do, s:
                           backward_lib.chunked_backward(
                               q, k, v, g, st, do, s, schedule),
                           (q, k, v, g, states, d_out, initial)),
  }
  if scan:  # the token-by-token lax.scan reference, forward only
    passes["scan_fwd"] = (_scan(scale), (q, k, v, log_decay))
  for config in configs:
    key = "x".join(str(x) for x in dataclasses.astuple(config))
    forward, forward_backward = _jax_fns(_ours(scale, config))
    passes[f"fwd@{key}"] = (forward, (q, k, v, log_decay))
    passes[f"fwd_bwd@{key}"] = (forward_backward, (q, k, v, log_decay, d_out))
  row = {"impl": "ours", "shape": name, "seq_len": seq_len,
         "schedule": str(schedule), "state_tile": forward_lib.STATE_TILE,
         "sub_block": forward_lib.SUB_BLOCK}
  for key, (fn, args) in passes.items():
    _time_into(row, key, fn, args)
  _record(out, row)


def profile_fla(name: str, seq_len: int, out: pathlib.Path) -> None:
  fla, missing = _fla_runner()
  heads, d_k, d_v, kind, scale = SHAPES[name]
  row = {"impl": "fla", "shape": name, "seq_len": seq_len}
  if fla is None:
    row["error"] = missing
  else:
    times = time_fla(fla, _inputs(seq_len, heads, d_k, d_v, kind), kind, scale)
    row.update(fwd=times["fwd_ms"],
               fwd_bwd=times.get("fwd_bwd_ms", times.get("fwd_bwd_error")))
  _record(out, row)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, type=pathlib.Path)
  parser.add_argument("--seq", type=int, nargs="+", default=[4096])
  parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
  parser.add_argument("--fla-only", action="store_true")
  parser.add_argument("--no-fla", action="store_true")
  parser.add_argument("--state-tile", type=int, default=None,
                      help="state elements per state-pass program "
                           "(STATE_TILE) to try instead of the default")
  parser.add_argument("--sub-block", type=int, default=None,
                      help="vector-gate row block (SUB_BLOCK) to try instead "
                           "of the default")
  parser.add_argument("--scan", action="store_true",
                      help="also time the lax.scan reference's forward")
  parser.add_argument("--configs", nargs="*", default=[],
                      help="also time these configs, as chunk x block_v x "
                           "warps x stages, e.g. 64x128x4x2")
  args = parser.parse_args(argv)
  args.out.mkdir(parents=True, exist_ok=True)
  if args.state_tile:
    forward_lib.STATE_TILE = args.state_tile
  if args.sub_block:
    forward_lib.SUB_BLOCK = backward_lib.SUB_BLOCK = args.sub_block
  for name in args.shapes:
    for seq_len in args.seq:
      if not args.fla_only:
        profile_ours(name, seq_len, args.out, [
            LinearAttentionConfig(*map(int, c.split("x"))) for c in args.configs],
            scan=args.scan)
      if not args.no_fla:
        profile_fla(name, seq_len, args.out)
  rows = [json.loads(line) for line in
          open(args.out / "profile_linear.jsonl")]
  print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}; ms per call")
  keys = ["fwd", "fwd_bwd", "decay_cumsum", "state_fwd", "chunked_forward",
          "state_bwd", "chunked_backward", "scan_fwd"]
  print(f"{'impl':5} {'shape':26} {'S':>6} " + " ".join(f"{k:>16}" for k in keys))
  for row in rows:
    cells = [row.get(k) for k in keys]
    print(f"{row['impl']:5} {row['shape']:26} {row['seq_len']:>6} " + " ".join(
        f"{c:16.3f}" if isinstance(c, float) else f"{str(c)[:16]:>16}"
        for c in cells))
  for row in rows:
    for key, value in row.items():
      if "@" in key:
        print(f"{row['impl']:5} {row['shape']:26} {row['seq_len']:>6} "
              f"{key:>24} {value if isinstance(value, str) else f'{value:.3f}'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
