"""A/B of how the Mosaic forward is compiled, beside cuDNN (issue 15).

`python benchmarks/ab_forward_params.py --out DIR`: vanilla B4 H16 S4096
d128 bf16 forward kernel time (CUPTI) as built by default and with each
alternative in SETTINGS (compiler parameters, the programs' final wait on
their TMA stores), beside cuDNN, in alternating rounds, each call's kernels
recorded by name; outputs compared with the default's. `--batch`, `--seq`,
`--causal` change the call. Writes DIR/ab_forward_params_b{B}_s{S}[_causal].json;
prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_attn as pa  # noqa: E402
from bench_forward import environment  # noqa: E402
from kernel_time import kernel_time_ms  # noqa: E402
from pallas_attn.kernels import mosaic_backend as mb  # noqa: E402

DEFAULT_PARAMS, DEFAULT_WAIT = mb.compiler_params, mb.plgpu.wait_smem_to_gmem
SETTINGS = {  # name: (extra plgpu.CompilerParams fields, programs end on a read-only TMA wait)
    "default": ({}, False),
    "no_auto_barriers": ({"unsafe_no_auto_barriers": True}, False),
    "read_only_wait": ({}, True),
}


def build(name, q, k, v, causal):
  if name == "cudnn":
    fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                              implementation="cudnn"))
    return lambda: fn(q, k, v)
  extra, read_only = SETTINGS[name]
  mb.compiler_params = lambda fast_math: mb.plgpu.CompilerParams(approx_math=fast_math, **extra)
  if read_only:
    mb.plgpu.wait_smem_to_gmem = lambda n: DEFAULT_WAIT(n, wait_read_only=True)
  try:
    pa.api._attention.clear_cache()
    jax.clear_caches()
    variant = pa.variants.causal().kwargs() if causal else {}
    fn = jax.jit(lambda q, k, v: pa.attention(q, k, v, implementation="mosaic_gpu", **variant))
    fn = fn.lower(q, k, v).compile()  # built now, under this setting
  finally:
    mb.compiler_params, mb.plgpu.wait_smem_to_gmem = DEFAULT_PARAMS, DEFAULT_WAIT
  return lambda: fn(q, k, v)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default="/tmp/out")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--settings", default=",".join(SETTINGS))
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--causal", action="store_true")
  args = parser.parse_args()
  settings = ["default"] + [n for n in args.settings.split(",") if n != "default"]
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q, k, v = (jax.random.normal(kk, (args.batch, args.seq, 16, 128), jnp.bfloat16) for kk in keys)
  names = settings + ["cudnn"]
  calls = {n: build(n, q, k, v, args.causal) for n in names}
  base = np.asarray(calls["default"](), np.float32)
  results = {"environment": environment(), "shape": [args.batch, args.seq, 16, 128],
             "causal": args.causal, "equal_to_default": {}, "max_diff_to_default": {},
             "runs": []}
  for n in settings:
    out = np.asarray(calls[n](), np.float32)
    results["equal_to_default"][n] = bool(np.array_equal(out, base))
    results["max_diff_to_default"][n] = float(np.max(np.abs(out - base)))
  for r in range(args.rounds):
    for n in names:
      ms, kernels = kernel_time_ms(calls[n])
      results["runs"].append(dict(round=r, setting=n, ms=ms, kernels=kernels))
  os.makedirs(args.out, exist_ok=True)
  name = f"ab_forward_params_b{args.batch}_s{args.seq}{'_causal' if args.causal else ''}.json"
  with open(os.path.join(args.out, name), "w") as f:
    json.dump(results, f, indent=1)
  print("equal to default:", results["equal_to_default"], "max |diff|:",
        results["max_diff_to_default"])
  for run in results["runs"][-len(names):]:
    print(run["setting"], {k[:60]: round(v, 4) for k, v in run["kernels"].items()})
  for n in settings:
    ratios = [c["ms"] / o["ms"] for c, o in zip(
        [x for x in results["runs"] if x["setting"] == "cudnn"],
        [x for x in results["runs"] if x["setting"] == n])]
    print(f"{n:18s} ms {statistics.median(x['ms'] for x in results['runs'] if x['setting'] == n):.4f}"
          f"  speed / cuDNN {statistics.median(ratios):.4f} [{min(ratios):.4f}-{max(ratios):.4f}]")


if __name__ == "__main__":
  main()
