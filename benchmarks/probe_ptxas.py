"""What ptxas says about the Mosaic GPU forward: registers, spills, and its
C7512 / C7513 notes (wgmma serialized: the whole kernel's matrix products
wait on each other; C7513 cost the overlapped forward a third of its speed
on block-sparse variants until the walk's cond moved outside it, C7512, for
lack of registers, is in the dk/dv kernel of every masked variant).

`python benchmarks/probe_ptxas.py [--variants vanilla,causal,...] [--backward]`:
each variant compiles in a subprocess with MOSAIC_GPU_DUMP_PTXAS=1 (B1 H2
S1024 d128 bf16; with --backward its gradient too, so the forward, dq and
dk/dv kernels, in ptxas' order); one line per variant, a nonzero exit if
any warns.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

VARIANTS = ("vanilla", "causal", "softcap", "alibi", "documents", "window", "d64")

_COMPILE = """
import jax, jax.numpy as jnp, pallas_attn as pa
name = {name!r}
v = pa.variants
d = 64 if name == "d64" else 128
ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), 256)[None]
kw = {{"vanilla": {{}}, "d64": {{}}, "causal": v.causal().kwargs(),
       "softcap": v.softcap(30.0).kwargs(),
       "alibi": (v.alibi(num_heads=2) + v.causal()).kwargs(),
       "documents": v.document(ids, causal=True).kwargs(),
       "window": v.sliding_window(256).kwargs()}}[name]
q = jnp.ones((1, 1024, 2, d), jnp.bfloat16)
attend = lambda q, k, v: pa.attention(q, k, v, implementation="mosaic_gpu", **kw)
fn = attend
if {backward!r}:
  fn = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
jax.block_until_ready(jax.jit(fn)(q, q, q))
"""


def probe(name: str, backward: bool = False) -> dict:
  env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1")
  code = _COMPILE.format(name=name, backward=backward)
  run = subprocess.run([sys.executable, "-c", code], env=env,
                       capture_output=True, text=True, timeout=300)
  text = run.stdout + run.stderr
  registers = re.findall(r"Used (\d+) registers", text)
  spills = re.findall(r"(\d+) bytes spill stores", text)
  return dict(variant=name, ok=run.returncode == 0, registers=registers, spill_stores=spills,
              serialized_wgmma=sorted(set(re.findall(r"C751[23]", text))))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--backward", action="store_true")
  args = parser.parse_args()
  bad = False
  for name in args.variants.split(","):
    r = probe(name, args.backward)
    bad |= bool(r["serialized_wgmma"]) or not r["ok"]
    print(f"{name:10s} ok={r['ok']} registers={','.join(r['registers'])} "
          f"spill_stores={','.join(r['spill_stores'])} "
          f"serialized_wgmma={','.join(r['serialized_wgmma']) or 'no'}", flush=True)
  sys.exit(1 if bad else 0)


if __name__ == "__main__":
  main()
