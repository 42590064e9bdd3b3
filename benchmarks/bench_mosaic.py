"""Issue 15: the Mosaic GPU forward next to our Triton template, cuDNN,
PyTorch FlexAttention and JAX's own Mosaic GPU flash attention.

Run on the GPU machine: `python benchmarks/bench_mosaic.py --out DIR
[--rows vanilla_4k,causal_4k,...] [--modes fwd,fwdbwd]`. Writes
DIR/mosaic.json after every row and prints a short table last. bf16
(fp16 for JAX's reference, which takes nothing else). Every side is timed by
kernel time (CUPTI through `torch.profiler`, `kernel_time.py`), ours also by
device throughput (`median_time_ms`). TFLOP/s count unmasked pairs;
forward+backward counts the backward as 2.5 forwards. Before timing, each of
our rows is checked against the other lowering on the timed inputs.
`--rounds N` times every side of a row N times in alternation: the table
gives each side's median, the JSON each round's time and the per-round
ratios of ours to cuDNN and Flex (median and range). `--memory-seqs`
instead compiles the forward and the gradient at those lengths (B1 H16
d128) and records XLA's memory analysis (temporaries + outputs) of each
side, to DIR/mosaic_memory.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for torch
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_attn as pa  # noqa: E402
from bench_forward import environment, memory_bytes  # noqa: E402
from kernel_time import kernel_time_ms  # noqa: E402
from pallas_attn.kernels import lowering  # noqa: E402
from pallas_attn.schedule.timing import median_time_ms  # noqa: E402
from pallas_attn.spec.analysis import analyze_variant  # noqa: E402

HEADS = 16

# name: (variant, batch, seq, d_qk, d_v)
ROWS = {
    "vanilla_4k": ("vanilla", 4, 4096, 128, 128),
    "causal_4k": ("causal", 4, 4096, 128, 128),
    "vanilla_16k": ("vanilla", 1, 16384, 128, 128),
    "causal_16k": ("causal", 1, 16384, 128, 128),
    "softcap_4k": ("softcap", 4, 4096, 128, 128),
    "alibi_4k": ("alibi", 4, 4096, 128, 128),
    "window256_4k": ("window256", 4, 4096, 128, 128),
    "window1024_4k": ("window1024", 4, 4096, 128, 128),
    "documents8_4k": ("documents8", 4, 4096, 128, 128),
    "sigmoid_4k": ("sigmoid", 4, 4096, 128, 128),
    "dqk192_4k": ("vanilla", 4, 4096, 192, 128),
    "d64_4k": ("vanilla", 4, 4096, 64, 64),
    "d256_4k": ("vanilla", 4, 4096, 256, 256),
}


def document_ids(batch, seq, count):
  bounds = np.linspace(0, seq, count + 1).astype(np.int32)[1:-1]
  ids = np.searchsorted(bounds, np.arange(seq), side="right").astype(np.int32)
  return np.broadcast_to(ids, (batch, seq))


def ours_kwargs(variant, batch, seq):
  v = pa.variants
  if variant == "vanilla":
    return {}
  if variant == "causal":
    return v.causal().kwargs()
  if variant == "softcap":
    return v.softcap(30.0).kwargs()
  if variant == "alibi":
    return (v.alibi(num_heads=HEADS) + v.causal()).kwargs()
  if variant.startswith("window"):
    return v.sliding_window(int(variant[6:])).kwargs()
  if variant == "documents8":
    return v.document(jnp.asarray(document_ids(batch, seq, 8)), causal=True).kwargs()
  if variant == "sigmoid":
    return v.sigmoid(seq_kv=seq).kwargs()
  raise KeyError(variant)


def density(variant, seq):
  pos = np.arange(seq)
  if variant in ("vanilla", "softcap", "sigmoid"):
    return 1.0
  keep = pos[:, None] >= pos[None, :]
  if variant.startswith("window"):
    keep &= pos[:, None] - pos[None, :] < int(variant[6:])
  if variant == "documents8":
    ids = document_ids(1, seq, 8)[0]
    keep &= ids[:, None] == ids[None, :]
  return float(keep.mean())


def flops(batch, seq, d_qk, d_v, dens, mode):
  fwd = 2.0 * batch * HEADS * seq * seq * (d_qk + d_v) * dens
  return fwd * (3.5 if mode == "fwdbwd" else 1.0)


def loss_fn(attn):
  def loss(q, k, v):
    return jnp.sum(attn(q, k, v).astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def jax_callables(variant, batch, seq, d_qk, d_v, mode):
  """{name: zero-arg callable} of the JAX sides of a row."""
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (batch, seq, HEADS, d_qk), jnp.bfloat16)
  k = jax.random.normal(keys[1], (batch, seq, HEADS, d_qk), jnp.bfloat16)
  v = jax.random.normal(keys[2], (batch, seq, HEADS, d_v), jnp.bfloat16)
  kw = ours_kwargs(variant, batch, seq)
  sides = {}
  for impl in ("mosaic_gpu", "triton"):
    attn = lambda q, k, v, impl=impl: pa.attention(q, k, v, implementation=impl, **kw)
    fn = jax.jit(attn) if mode == "fwd" else loss_fn(attn)
    sides[impl] = lambda fn=fn: fn(q, k, v)
  cudnn = {"vanilla": {}, "causal": dict(is_causal=True)}
  if variant.startswith("window"):
    cudnn[variant] = dict(is_causal=True, local_window_size=(int(variant[6:]) - 1, 0))
  if variant in cudnn and d_qk == d_v:
    attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn",
                                                        **cudnn[variant])
    fn = jax.jit(attn) if mode == "fwd" else loss_fn(attn)
    sides["cudnn"] = lambda fn=fn: fn(q, k, v)
  if variant in ("vanilla", "causal") and mode == "fwd" and d_qk == d_v:
    try:
      from jax.experimental.pallas.ops.gpu import attention_mgpu as ref
      cfg = ref.TuningConfig(block_q=64, block_kv=128 if d_qk <= 128 else 64,
                             max_concurrent_steps=2, causal=variant == "causal")
      q16, k16, v16 = (x.astype(jnp.float16) for x in (q, k, v))
      fn = jax.jit(lambda q, k, v: ref.attention(q, k, v, cfg))
      sides["jax_mgpu_fp16"] = lambda fn=fn: fn(q16, k16, v16)
    except Exception:
      pass
  return sides, (q, k, v, kw)


def flex_callable(variant, batch, seq, d_qk, d_v, mode):
  import torch
  from torch.nn.attention.flex_attention import create_block_mask, flex_attention
  # Every row compiles new score/mask closures: past dynamo's recompile limit
  # (8) flex_attention would silently run unfused.
  torch._dynamo.reset()
  dev = "cuda"
  q = torch.randn(batch, HEADS, seq, d_qk, device=dev, dtype=torch.bfloat16,
                  requires_grad=mode != "fwd")
  k = torch.randn(batch, HEADS, seq, d_qk, device=dev, dtype=torch.bfloat16,
                  requires_grad=mode != "fwd")
  v = torch.randn(batch, HEADS, seq, d_v, device=dev, dtype=torch.bfloat16,
                  requires_grad=mode != "fwd")
  slopes = torch.from_numpy(np.asarray(pa.variants.alibi_slopes(HEADS))).to(dev)
  ids = torch.from_numpy(np.ascontiguousarray(document_ids(1, seq, 8)[0])).to(dev)
  causal = lambda b, h, qi, ki: qi >= ki
  masks = {"causal": causal, "alibi": causal,
           "documents8": lambda b, h, qi, ki: (ids[qi] == ids[ki]) & (qi >= ki)}
  if variant.startswith("window"):
    size = int(variant[6:])
    masks[variant] = lambda b, h, qi, ki: (qi >= ki) & (qi - ki < size)
  score_mods = {"softcap": lambda s, b, h, qi, ki: 30.0 * torch.tanh(s / 30.0),
                "alibi": lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)}
  if variant == "sigmoid":
    return None  # Flex has no elementwise rownorm
  block_mask = (create_block_mask(masks[variant], None, None, seq, seq, device=dev)
                if variant in masks else None)
  fn = torch.compile(flex_attention)
  if mode == "fwd":
    return lambda: fn(q, k, v, score_mod=score_mods.get(variant), block_mask=block_mask)

  def step():
    out = fn(q, k, v, score_mod=score_mods.get(variant), block_mask=block_mask)
    return torch.autograd.grad(out.float().sum(), (q, k, v))
  return step


def agreement(sides):
  a, b = sides.get("mosaic_gpu"), sides.get("triton")
  if a is None or b is None:
    return None
  xs, ys = jax.tree.leaves(a()), jax.tree.leaves(b())
  errs = [float(jnp.linalg.norm((x.astype(jnp.float32) - y.astype(jnp.float32)).ravel())
                / jnp.linalg.norm(y.astype(jnp.float32).ravel())) for x, y in zip(xs, ys)]
  return max(errs)


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default="/tmp/out")
  parser.add_argument("--rows", default=",".join(ROWS))
  parser.add_argument("--modes", default="fwd,fwdbwd")
  parser.add_argument("--budget-s", type=float, default=420.0)
  parser.add_argument("--no-flex", action="store_true")
  parser.add_argument("--rounds", type=int, default=1)
  parser.add_argument("--memory-seqs", default="", help="e.g. 16384,65536")
  args = parser.parse_args(argv)
  start = time.perf_counter()
  os.makedirs(args.out, exist_ok=True)
  if args.memory_seqs:
    return memory(args.out, [int(s) for s in args.memory_seqs.split(",")])
  results = {"environment": environment(), "rows": []}
  for name in args.rows.split(","):
    for mode in args.modes.split(","):
      if time.perf_counter() - start > args.budget_s:
        results["rows"].append({"row": name, "mode": mode, "skipped": "time budget"})
        continue
      variant, batch, seq, d_qk, d_v = ROWS[name]
      dens = density(variant, seq)
      fl = flops(batch, seq, d_qk, d_v, dens, mode)
      row = {"row": name, "mode": mode, "density": dens, "tflops": {}, "errors": {}}
      try:
        sides, (q, _, _, kw) = jax_callables(variant, batch, seq, d_qk, d_v, mode)
        row["lowering"] = lowering.choose(None, analyze_variant(**kw), q.dtype, d_qk, d_v,
                                          False).describe()
        if not args.no_flex:
          try:
            flex = flex_callable(variant, batch, seq, d_qk, d_v, mode)
            if flex is not None:
              sides["flex"] = flex
          except Exception as e:
            row["errors"]["flex"] = f"{type(e).__name__}: {str(e)[:200]}"
        try:
          row["mosaic_vs_triton_rel_err"] = agreement(sides)
        except Exception as e:
          row["errors"]["agreement"] = f"{type(e).__name__}: {str(e)[:300]}"
        samples = {side: [] for side in sides}
        for _ in range(args.rounds):
          for side, call in sides.items():
            if side in row["errors"]:
              continue
            try:
              samples[side].append(kernel_time_ms(call)[0])
            except Exception as e:
              row["errors"][side] = f"{type(e).__name__}: {str(e)[:300]}"
              traceback.print_exc(limit=3)
        for side, ms in samples.items():
          if ms:
            row["tflops"][side] = fl / statistics.median(ms) / 1e9
        if args.rounds > 1:
          row["kernel_ms_rounds"] = samples
          row["ratio_rounds"] = round_ratios(samples)
        for side in ("mosaic_gpu", "triton"):
          if samples.get(side):
            try:
              row["tflops"][side + "_throughput"] = fl / median_time_ms(sides[side]) / 1e9
            except Exception as e:
              row["errors"][side + "_throughput"] = f"{type(e).__name__}: {str(e)[:300]}"
      except Exception as e:
        row["errors"]["row"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc(limit=3)
      results["rows"].append(row)
      with open(os.path.join(args.out, "mosaic.json"), "w") as f:
        json.dump(results, f, indent=1)
      print(json.dumps(row), flush=True)
  print_table(results)


def memory(out, seqs):
  """Compiled bytes (temporaries + outputs) of the forward and the gradient
  of ours (each lowering) and cuDNN, vanilla and causal: linear in S."""
  results = {"environment": environment(), "memory": []}
  for seq in seqs:
    q = jax.ShapeDtypeStruct((1, seq, HEADS, 128), jnp.bfloat16)
    for variant in ("vanilla", "causal"):
      kw = ours_kwargs(variant, 1, seq)
      attns = {impl: lambda q, k, v, impl=impl: pa.attention(q, k, v, implementation=impl, **kw)
               for impl in ("mosaic_gpu", "triton")}
      attns["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, implementation="cudnn", is_causal=variant == "causal")
      row = {"seq": seq, "variant": variant, "bytes": {}, "errors": {}}
      for side, attn in attns.items():
        for mode, fn in (("fwd", attn), ("fwdbwd", loss_fn(attn))):
          try:
            row["bytes"][f"{side}_{mode}"] = memory_bytes(fn, q, q, q)
          except Exception as e:
            row["errors"][f"{side}_{mode}"] = f"{type(e).__name__}: {str(e)[:200]}"
      results["memory"].append(row)
      print(json.dumps(row), flush=True)
  with open(os.path.join(out, "mosaic_memory.json"), "w") as f:
    json.dump(results, f, indent=1)
  print(results["environment"])
  for row in results["memory"]:
    print(f"S={row['seq']:6d} {row['variant']:8s} "
          + " ".join(f"{k}={v / 2**20:.0f}MiB" for k, v in row["bytes"].items()))


def round_ratios(samples):
  """Ours (Mosaic) over cuDNN and over Flex in throughput, per round: median and range."""
  out = {}
  for peer in ("cudnn", "flex"):
    pairs = list(zip(samples.get("mosaic_gpu", []), samples.get(peer, [])))
    if pairs:
      vals = sorted(theirs / ours for ours, theirs in pairs)
      out[f"mosaic_gpu/{peer}"] = {"median": statistics.median(vals),
                                   "range": [vals[0], vals[-1]]}
  return out


def print_table(results):
  cols = ["mosaic_gpu", "triton", "cudnn", "flex", "jax_mgpu_fp16"]
  print(results["environment"])
  print(f"{'row':16s} {'mode':7s} " + " ".join(f"{c[:10]:>10s}" for c in cols)
        + "  mos/cudnn mos/flex mos/tri  err")
  for row in results["rows"]:
    if "tflops" not in row:
      print(f"{row['row']:16s} {row['mode']:7s} skipped")
      continue
    t = row["tflops"]
    cells = " ".join(f"{t[c]:10.0f}" if c in t else f"{'-':>10s}" for c in cols)
    ratio = lambda a, b: f"{t[a] / t[b]:.2f}" if a in t and b in t else "-"
    err = row.get("mosaic_vs_triton_rel_err")
    print(f"{row['row']:16s} {row['mode']:7s} {cells}  {ratio('mosaic_gpu', 'cudnn'):>9s} "
          f"{ratio('mosaic_gpu', 'flex'):>8s} {ratio('mosaic_gpu', 'triton'):>7s}  "
          f"{'-' if err is None else f'{err:.1e}'}")
    if "mosaic_gpu not used" in row.get("lowering", ""):
      print(f"    {row['lowering'][:200]}")
    for label, r in row.get("ratio_rounds", {}).items():
      print(f"    {label} by round: median {r['median']:.3f} "
            f"[{r['range'][0]:.3f}-{r['range'][1]:.3f}]")
    for side, e in row["errors"].items():
      print(f"    {side}: {e[:160]}")


if __name__ == "__main__":
  main()
