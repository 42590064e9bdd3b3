"""Masked variants: block skipping, block-mask build cost, and FlexAttention as the peer.

Run on the GPU machine: `python benchmarks/bench_masks.py --out DIR`. Writes
DIR/masks.json and prints a short table last. TFLOP/s count only unmasked
(q, kv) pairs. FlexAttention (torch.compile'd) runs in the same process on
the same GPU. Each implementation is timed twice: wall clock (ours and the
JAX peers by `amortized_time_ms`, Flex by `do_bench`) and, where PyTorch
is there, device time from the GPU's kernel records (`kernel_time.py`,
keys `*_kernel_ms`), the same measure for every side.
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for torch

import jax
import jax.numpy as jnp
import numpy as np

import pallas_attn as pa
from bench_forward import environment, inputs, time_fn
from kernel_time import kernel_time_ms
from pallas_attn.schedule.timing import attention_flops

HEADS, D = 16, 128


def causal(b, h, qi, ki):
  return qi >= ki


def window(size):
  return lambda b, h, qi, ki: (qi >= ki) & (qi - ki < size)


def documents(batch, seq, count):
  ids = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32) * count // seq, (batch, seq))
  return ids, lambda b, h, qi, ki: (ids[b, qi] == ids[b, ki]) & (qi >= ki)


def density(mask_mod, seq):
  """Exact fraction of kept pairs (b = h = 0), from a strided dense sample."""
  if mask_mod is None:
    return 1.0
  stride = max(1, seq // 2048)
  idx = jnp.arange(0, seq, stride, dtype=jnp.int32)
  m = jax.vmap(lambda qi: jax.vmap(lambda ki: mask_mod(0, 0, qi, ki))(idx))(idx)
  return float(m.mean())


def build_ms(mask_mod, batch, seq):
  fn = jax.jit(lambda: pa.block_mask(mask_mod, batch, HEADS, seq, seq).kv_partial_num)
  jax.block_until_ready(fn())
  start = time.perf_counter()
  for _ in range(10):
    jax.block_until_ready(fn())
  return (time.perf_counter() - start) / 10 * 1e3


def _flex_masks(torch, seq):
  """FlexAttention mask_mods matching this file's masks (8 documents, `documents`' ids)."""
  ids = torch.from_numpy(np.asarray(documents(1, seq, 8)[0][0])).cuda()
  return {"causal": lambda b, h, qi, ki: qi >= ki,
          "sliding_window_256": lambda b, h, qi, ki: (qi >= ki) & (qi - ki < 256),
          "sliding_window_1024": lambda b, h, qi, ki: (qi >= ki) & (qi - ki < 1024),
          "documents_8": lambda b, h, qi, ki: (ids[qi] == ids[ki]) & (qi >= ki)}


def device_ms(fn, *args):
  """Kernel time per call of jitted `fn(*args)` (`kernel_time_ms`), or None
  without PyTorch or where `fn` fails (its wall-clock time says why)."""
  try:
    jitted = jax.jit(fn)
    return kernel_time_ms(lambda: jitted(*args))[0]
  except Exception:
    return None


def flex_peer(batch, seq, variant):
  """FlexAttention forward (wall-clock ms, kernel ms) for a named variant,
  or None if torch is unavailable."""
  try:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from triton.testing import do_bench
  except Exception:
    return None
  dev = "cuda"
  q, k, v = (torch.randn(batch, HEADS, seq, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
  slopes = torch.from_numpy(np.asarray(pa.variants.alibi_slopes(HEADS))).to(dev)
  masks = _flex_masks(torch, seq)
  score_mods = {"softcap": lambda s, b, h, qi, ki: 30.0 * torch.tanh(s / 30.0),
                "alibi": lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)}
  block_mask = (create_block_mask(masks[variant], None, None, seq, seq, device=dev)
                if variant in masks else None)
  fn = torch.compile(flex_attention)
  run = lambda: fn(q, k, v, score_mod=score_mods.get(variant), block_mask=block_mask)
  run()
  torch.cuda.synchronize()
  return (float(do_bench(run, warmup=25, rep=100, return_mode="median")),
          kernel_time_ms(run)[0])


def flex_build_ms(seq, variant, reps=10):
  """Milliseconds of FlexAttention's `create_block_mask` (B=H=None, as ours
  builds a capture-free mask once; the document mask reads a captured id
  tensor), eager and with `_compile=True`; None without torch."""
  try:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask
  except Exception:
    return None
  mask = _flex_masks(torch, seq)[variant]
  times = {}
  for name, compile_ in (("eager", False), ("compiled", True)):
    build = lambda: create_block_mask(mask, None, None, seq, seq, device="cuda",
                                      _compile=compile_)
    build()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
      build()
    torch.cuda.synchronize()
    times[name] = (time.perf_counter() - start) / reps * 1e3
  return times


def cudnn_peer(variant, batch, seq):
  """`jax.nn.dot_product_attention(implementation="cudnn")` keywords for the
  variants cuDNN expresses, as (static keywords, array keywords), else None.

  Windows are bottom-right `local_window_size`s. ALiBi and the document mask
  have no cuDNN mask type: they go in as a dense [1, H, S, S] bias and a
  dense [B, 1, S, S] mask (read in full, no block skipping), which is how a
  cuDNN user would express them.
  """
  windows = {"sliding_window_256": 256, "sliding_window_1024": 1024}
  if variant == "vanilla":
    return {}, {}
  if variant == "causal":
    return dict(is_causal=True), {}
  if variant in windows:
    return dict(is_causal=True, local_window_size=(windows[variant] - 1, 0)), {}
  positions = jnp.arange(seq, dtype=jnp.int32)
  if variant == "alibi":
    distance = (positions[None, :] - positions[:, None]).astype(jnp.float32)
    bias = pa.variants.alibi_slopes(HEADS)[:, None, None] * distance
    return {}, dict(bias=bias[None].astype(jnp.bfloat16))
  if variant == "documents_8":
    ids, _ = documents(batch, seq, 8)
    same = ids[:, None, :, None] == ids[:, None, None, :]
    return dict(is_causal=True), dict(mask=same)
  return None


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", default="benchmarks/results")
  parser.add_argument("--parts", nargs="+", default=["causal", "window", "build", "peers"],
                      help="which sections to run (a device call may not fit all)")
  parser.add_argument("--variants", nargs="+", default=None,
                      help="peer variants to run (default: all)")
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  results = {"environment": environment(), "causal": [], "window": [], "peers": [],
             "build_ms": {}, "errors": []}
  from jax.experimental.pallas.ops.gpu import attention as pallas_ref

  for seq in (4096, 8192, 16384) if "causal" in args.parts else ():
    batch = 16384 // seq
    q, k, v = inputs(batch, seq, HEADS, D, D)
    dense = lambda q, k, v: pa.attention(q, k, v)
    causal_fn = lambda q, k, v: pa.attention(q, k, v, mask_mod=causal)
    ref = lambda q, k, v: pallas_ref.mha(q, k, v, None, sm_scale=D ** -0.5, causal=True)
    cudnn_ms, _ = time_fn(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn"), q, k, v)
    row = dict(seq=seq, batch=batch, dense_ms=time_fn(dense, q, k, v)[0],
               causal_ms=time_fn(causal_fn, q, k, v)[0],
               pallas_ref_causal_ms=time_fn(ref, q, k, v)[0], cudnn_causal_ms=cudnn_ms,
               dense_kernel_ms=device_ms(dense, q, k, v),
               causal_kernel_ms=device_ms(causal_fn, q, k, v),
               pallas_ref_causal_kernel_ms=device_ms(ref, q, k, v))
    results["causal"].append(row)
    print(json.dumps(row), flush=True)

  seq = 16384
  q, k, v = inputs(1, seq, HEADS, D, D)
  for size in (256, 1024) if "window" in args.parts else ():
    ms, err = time_fn(lambda q, k, v: pa.attention(q, k, v, mask_mod=window(size)), q, k, v)
    results["window"].append(dict(seq=seq, window=size, ms=ms))
    if err:
      results["errors"].append(f"window {size}: {err}")
  if "build" in args.parts:
    _, doc_mask = documents(1, seq, 8)
    results["build_ms"] = {"causal_16k": build_ms(causal, 1, seq),
                           "documents8_16k": build_ms(doc_mask, 1, seq)}
    for name in ("causal", "documents_8"):
      try:
        results["build_ms"][f"flex_{name}_16k"] = flex_build_ms(seq, name)
      except Exception as e:
        results["errors"].append(f"flex build {name}: {type(e).__name__}: {str(e)[:200]}")
    print(json.dumps(results["build_ms"]), flush=True)

  batch, seq = 4, 4096
  q, k, v = inputs(batch, seq, HEADS, D, D)
  slopes = pa.variants.alibi_slopes(HEADS)
  _, doc4 = documents(batch, seq, 8)
  variants = {
      "vanilla": {},
      "causal": dict(mask_mod=causal),
      "softcap": dict(score_mod=lambda s, b, h, qi, ki: 30.0 * jnp.tanh(s / 30.0)),
      "alibi": dict(score_mod=lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)),
      "sliding_window_256": dict(mask_mod=window(256)),
      "sliding_window_1024": dict(mask_mod=window(1024)),
      "documents_8": dict(mask_mod=doc4),
  }
  for name, kw in variants.items():
    if "peers" not in args.parts or (args.variants and name not in args.variants):
      continue
    flops = attention_flops(batch, HEADS, seq, seq, D, D, density=density(kw.get("mask_mod"), seq))
    if "mask_mod" in kw:  # built once and reused, as FlexAttention's block masks are
      kw = dict(kw, block_mask=pa.block_mask(kw["mask_mod"], batch, HEADS, seq, seq))
    ours_fn = lambda q, k, v, kw=kw: pa.attention(q, k, v, **kw)
    ours, err = time_fn(ours_fn, q, k, v)
    ours_kernel = device_ms(ours_fn, q, k, v)
    dense_kw = {key: val for key, val in kw.items() if key != "block_mask"}
    xla, _ = time_fn(lambda q, k, v: pa.attention_reference(q, k, v, **dense_kw), q, k, v)
    peer, cudnn, cudnn_kernel = cudnn_peer(name, batch, seq), None, None
    if peer is not None:
      static_kw, array_kw = peer  # arrays as arguments, not jit constants
      cudnn_fn = lambda q, k, v, arrays: jax.nn.dot_product_attention(
          q, k, v, implementation="cudnn", **static_kw, **arrays)
      cudnn, cudnn_err = time_fn(cudnn_fn, q, k, v, array_kw)
      cudnn_kernel = device_ms(cudnn_fn, q, k, v, array_kw)
      if cudnn_err:
        results["errors"].append(f"cudnn {name}: {cudnn_err}")
    try:
      flex, flex_kernel = flex_peer(batch, seq, name) or (None, None)
    except Exception as e:
      flex, flex_kernel = None, None
      results["errors"].append(f"flex {name}: {type(e).__name__}: {str(e)[:200]}")
    row = dict(variant=name, flops=flops, ours_ms=ours, xla_ms=xla, flex_ms=flex,
               cudnn_ms=cudnn, ours_kernel_ms=ours_kernel, flex_kernel_ms=flex_kernel,
               cudnn_kernel_ms=cudnn_kernel)
    if err:
      results["errors"].append(f"ours {name}: {err}")
    results["peers"].append(row)
    print(json.dumps(row), flush=True)
  with open(os.path.join(args.out, "masks.json"), "w") as f:
    json.dump(results, f, indent=1)
  print_table(results)


def _tf(flops, ms):
  return "n/a" if not ms else f"{flops / ms / 1e9:.0f}"


def _ms(x):
  return "n/a" if x is None else f"{x:.2f}"


def _ratio(a, b):
  return "n/a" if not a or not b else f"{a / b:.2f}"


def print_table(results):
  env = results["environment"]
  print(f"\n{env['device']}  {env['date']}  jax {env['jax']}  torch {env['torch']}")
  print("causal vs dense forward ms (bf16 H16 d128, 16k tokens)")
  print(f"  {'S':>6} {'dense':>7} {'causal':>7} {'c/dense':>7} {'p_ref c':>7} {'cudnn c':>7} "
        f"{'ours vs p_ref':>13}")
  for r in results["causal"]:
    print(f"  {r['seq']:>6} {_ms(r['dense_ms']):>7} {_ms(r['causal_ms']):>7} "
          f"{_ratio(r['causal_ms'], r['dense_ms']):>7} {_ms(r['pallas_ref_causal_ms']):>7} "
          f"{_ms(r['cudnn_causal_ms']):>7} {_ratio(r['pallas_ref_causal_ms'], r['causal_ms']):>13}")
  if any(r.get("causal_kernel_ms") for r in results["causal"]):
    print("  device (kernel) time: " + ", ".join(
        f"S={r['seq']} causal/dense {_ratio(r['causal_kernel_ms'], r['dense_kernel_ms'])}"
        f" p_ref/ours {_ratio(r['pallas_ref_causal_kernel_ms'], r['causal_kernel_ms'])}"
        for r in results["causal"]))
  for r in results["window"]:
    print(f"  sliding window {r['window']:>4} at S={r['seq']}: {_ms(r['ms'])} ms")
  print(f"  block mask build ms: {results['build_ms']}")
  print("B4 H16 S4096 d128 forward TFLOP/s (masked FLOPs not counted)")
  print(f"  {'variant':<20} {'ours':>6} {'flex':>6} {'cudnn':>6} {'xla':>6} {'ours/flex':>9}")
  for r in results["peers"]:
    print(f"  {r['variant']:<20} {_tf(r['flops'], r['ours_ms']):>6} "
          f"{_tf(r['flops'], r['flex_ms']):>6} {_tf(r['flops'], r.get('cudnn_ms')):>6} "
          f"{_tf(r['flops'], r['xla_ms']):>6} {_ratio(r['flex_ms'], r['ours_ms']):>9}")
  if any(r.get("ours_kernel_ms") for r in results["peers"]):
    print("  same, by device (kernel) time:")
    for r in results["peers"]:
      print(f"  {r['variant']:<20} {_tf(r['flops'], r['ours_kernel_ms']):>6} "
            f"{_tf(r['flops'], r['flex_kernel_ms']):>6} "
            f"{_tf(r['flops'], r['cudnn_kernel_ms']):>6} {'':>6} "
            f"{_ratio(r['flex_kernel_ms'], r['ours_kernel_ms']):>9}")
  for e in results["errors"]:
    print("  error:", e)


if __name__ == "__main__":
  main()
