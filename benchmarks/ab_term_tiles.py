"""A/B of how the Mosaic kernels build a diagonal term's tile (issue 14).

`python benchmarks/ab_term_tiles.py --out DIR`: for each way of building
the tile (`mosaic_backend.diagonal_tile`, no term at all as a bound, or an
alternative added to TILES), ptxas' registers and spill stores and the PTX's global
loads per kernel (a compile in a subprocess), then forward+backward kernel
time (CUPTI) of the relative-position table next to ALiBi, causal B4 H16
S4096 d128 bf16, interleaved in rounds. Writes DIR/ab_term_tiles.json;
prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_attn as pa  # noqa: E402
from bench_forward import environment  # noqa: E402
from kernel_time import kernel_time_ms  # noqa: E402
from pallas_attn.kernels import mosaic_backend as mb  # noqa: E402

DIAGONAL_TILE = mb.diagonal_tile


def zero_tile(vector, shape, rows_are_queries: bool):
  """No term at all (a bound: what reading it costs)."""
  del vector, rows_are_queries
  return mb.as_tile(jnp.zeros(shape, jnp.float32))


TILES = {"diagonal_tile": DIAGONAL_TILE, "zero": zero_tile}
SEQ, HEADS = 4096, 16


def causal(b, h, q, kv):
  return q >= kv


def step(name, batch=4, seq=SEQ, heads=HEADS):
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  q, k, v, d_out = (jax.random.normal(kk, (batch, seq, heads, 128), jnp.bfloat16)
                    for kk in keys[:4])
  if name == "alibi":
    slopes = pa.variants.alibi_slopes(heads)
    score_mod = lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)
  else:
    table = jax.random.normal(keys[4], (heads, 2 * seq - 1), jnp.float32)
    score_mod = lambda s, b, h, qi, ki: s + table[h, qi - ki + seq - 1]
  mask = pa.block_mask(causal, batch, heads, seq, seq)

  def fwd_bwd(q, k, v, d_out):
    out, vjp = jax.vjp(lambda q, k, v: pa.attention(q, k, v, score_mod=score_mod,
                                                    mask_mod=causal, block_mask=mask), q, k, v)
    return vjp(d_out)
  fn = jax.jit(fwd_bwd)
  return lambda: fn(q, k, v, d_out)


def use(tile_name):
  mb.diagonal_tile = TILES[tile_name]
  pa.api._attention.clear_cache()
  jax.clear_caches()


def probe(tile_name):
  """ptxas registers / spill stores and PTX global loads per kernel, compiled in a subprocess."""
  code = (f"import sys; sys.argv=['x']; sys.path[:0]={sys.path[:3]!r}\n"
          f"import ab_term_tiles as ab; ab.use({tile_name!r})\n"
          "import jax; f = ab.step('table', batch=1, seq=1024, heads=2); jax.block_until_ready(f())\n")
  env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_PTX="1")
  run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300, cwd=os.path.dirname(os.path.abspath(__file__)))
  text = run.stdout + run.stderr
  kernels = []
  for entry in re.split(r"\.entry ", text)[1:]:
    name = entry.split("(", 1)[0].strip()
    kernels.append(dict(kernel=name, ld_global=len(re.findall(r"ld\.global", entry)),
                        ld_shared=len(re.findall(r"ld\.shared", entry))))
  return dict(tile=tile_name, ok=run.returncode == 0, tail=text[-1500:] if run.returncode else "",
              registers=re.findall(r"Used (\d+) registers", text),
              spill_stores=re.findall(r"(\d+) bytes spill stores", text),
              serialized=sorted(set(re.findall(r"C751[23]", text))), kernels=kernels)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default="/tmp/out")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--tiles", default=",".join(TILES))
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  names = args.tiles.split(",")
  results = {"environment": environment(), "probes": [], "runs": []}
  for name in names:
    results["probes"].append(probe(name))
    print(json.dumps({k: v for k, v in results["probes"][-1].items()}), flush=True)
  rows = [("alibi", "diagonal_tile")] + [("table", n) for n in names]
  for r in range(args.rounds):
    for variant, tile_name in rows:
      use(tile_name)
      try:
        total, kernels = kernel_time_ms(step(variant))
        run = dict(round=r, variant=variant, tile=tile_name, ms=total, kernels=kernels)
      except Exception as e:  # noqa: BLE001 - recorded, the others still run
        run = dict(round=r, variant=variant, tile=tile_name, error=f"{type(e).__name__}: {e}"[:400])
      results["runs"].append(run)
      print(json.dumps({k: v for k, v in run.items() if k != "kernels"}), flush=True)
      with open(os.path.join(args.out, "ab_term_tiles.json"), "w") as f:
        json.dump(results, f, indent=1)
  if not results["runs"]:
    return
  print(f"{'variant':8s} {'tile':8s} {'f+b ms':>8s} {'/alibi':>7s}  fwd / dq / dkv ms")
  base = statistics.median(r["ms"] for r in results["runs"] if r["variant"] == "alibi" and "ms" in r)
  for variant, tile_name in rows:
    runs = [r for r in results["runs"] if (r["variant"], r["tile"]) == (variant, tile_name)
            and "ms" in r]
    if not runs:
      continue
    ms = statistics.median(r["ms"] for r in runs)
    parts = [statistics.median(v for r in runs for k, v in r["kernels"].items() if tag in k)
             for tag in ("mosaic_forward", "mosaic_dq", "mosaic_dkv")]
    print(f"{variant:8s} {tile_name:8s} {ms:8.3f} {ms / base:7.3f}  "
          + " / ".join(f"{p:.3f}" for p in parts))


if __name__ == "__main__":
  main()
