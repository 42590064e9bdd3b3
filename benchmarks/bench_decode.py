"""Issue 17: split-KV decoding against cuDNN, our parallel template and FlexAttention.

Run on the GPU machine: `python benchmarks/bench_decode.py --out DIR`. Writes
DIR/decode.json after every measurement and prints a table last. `--small`
runs tiny shapes (on CPU: interpret mode, no cuDNN or Flex). `--sweep` also
times the split-KV template over block_k x num_stages, and over split
counts, at the two target shapes, for the schedule's defaults.

Shapes (bf16, Hq 32, Hkv 8, d 128, every sequence holding the whole cache):
Sq 1 at B8 8k, B8 32k, B1 128k, B64 4k; Sq 4 at B8 32k and B1 128k; a
4096-key sliding window (causal) over B8 32k and B1 128k caches.

Rows per shape:
* decode: `pa.decode_attention` (kv_lengths = S);
* paged: `pa.paged_attention` on the same keys in 16-key pages (vLLM's
  default), shuffled;
* attention: `pa.attention` (Sq <= 16 dispatches to the split-KV template);
* parallel: `pa.attention` with the parallel template's heuristic config
  (no dispatch: the path before issue 17);
* cudnn: `jax.nn.dot_product_attention(implementation="cudnn")` with
  `query_seq_lengths` / `key_value_seq_lengths` (without, if cuDNN refuses
  them: `cudnn_lengths` in the JSON says so); for the window,
  on the window's keys sliced beforehand (the same work, no mask);
* flex: PyTorch's `flex_attention` (torch.compile'd, `enable_gqa`, the
  window as a block mask built once), in this process on the same GPU.

Timing: JAX sides by device throughput (`median_time_ms`: back-to-back
calls, one wait per window); Flex by CUDA events around back-to-back calls;
all sides also by kernel time (`kernel_time.py`, CUPTI), keys `*kernel_ms`.
TB/s count the K/V bytes the attended keys occupy (the window's for the
window rows), against the device's HBM peak for the targets (>= 80% at B8
32k and B1 128k; >= 1.0x cuDNN; >= 3x Flex). Before timing, each row's
output is compared with cuDNN's (or decode's) on the timed inputs.
"""
from __future__ import annotations

import time

START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for torch
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_attn as pa  # noqa: E402
from bench_forward import environment  # noqa: E402
from kernel_time import kernel_time_ms  # noqa: E402
from pallas_attn.schedule.config import heuristic_config  # noqa: E402
from pallas_attn.schedule.timing import median_time_ms  # noqa: E402

FULL = dict(heads=32, kv_heads=8, d=128, page_size=16, cases=[
    dict(name="b8_8k", batch=8, seq=8192, seq_q=1),
    dict(name="b8_32k", batch=8, seq=32768, seq_q=1),
    dict(name="b1_128k", batch=1, seq=131072, seq_q=1),
    dict(name="b64_4k", batch=64, seq=4096, seq_q=1),
    dict(name="b8_32k_sq4", batch=8, seq=32768, seq_q=4),
    dict(name="b1_128k_sq4", batch=1, seq=131072, seq_q=4),
    dict(name="b8_32k_window4k", batch=8, seq=32768, seq_q=1, window=4096),
    dict(name="b1_128k_window4k", batch=1, seq=131072, seq_q=1, window=4096),
])
SMALL = dict(heads=4, kv_heads=2, d=32, page_size=16, cases=[
    dict(name="b2_512", batch=2, seq=512, seq_q=1),
    dict(name="b1_1k_sq4", batch=1, seq=1024, seq_q=4),
    dict(name="b1_1k_window128", batch=1, seq=1024, seq_q=1, window=128),
])
IMPLS = ("decode", "paged", "attention", "parallel", "cudnn", "flex")
SWEEP_CASES = ("b8_32k", "b1_128k")
HBM_TB_S = {"h100": 3.35, "h200": 4.8, "b200": 8.0}  # peak, SXM parts


def elapsed():
  return time.perf_counter() - START


def describe(e):
  return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def hbm_peak():
  kind = jax.devices()[0].device_kind.lower()
  return next((tb for name, tb in HBM_TB_S.items() if name in kind), None)


def make_inputs(case, shape):
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  b, s, sq = case["batch"], case["seq"], case["seq_q"]
  hq, hkv, d = shape["heads"], shape["kv_heads"], shape["d"]
  q = jax.random.normal(keys[0], (b, sq, hq, d), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, s, hkv, d), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, s, hkv, d), jnp.bfloat16)
  return q, k, v, jnp.full((b,), s, jnp.int32)


def paged(x, page_size, seed=0):
  """(pages `[B*S/P, P, Hkv, D]` in shuffled order, page table `[B, S/P]`)."""
  b, s = x.shape[:2]
  pages = x.reshape(b * s // page_size, page_size, *x.shape[2:])
  order = np.random.default_rng(seed).permutation(pages.shape[0])
  stored = jnp.zeros_like(pages).at[order].set(pages)
  return stored, jnp.asarray(order.reshape(b, s // page_size), jnp.int32)


def variant(case):
  return {} if "window" not in case else pa.variants.sliding_window(case["window"]).kwargs()


def keys_read(case):
  return min(case["seq"], case.get("window", case["seq"]) + case["seq_q"] - 1)


def jax_rows(case, shape, q, k, v, lengths):
  """impl -> (function, args) of the JAX sides."""
  kw = variant(case)
  seq_q, seq = case["seq_q"], case["seq"]
  aligned = {} if "window" not in case else pa.variants.sliding_window(
      case["window"], seq_q=seq_q, seq_kv=seq).kwargs()
  k_pages, table = paged(k, shape["page_size"])
  v_pages, _ = paged(v, shape["page_size"])
  parallel_cfg = heuristic_config(seq_q, seq, shape["d"], shape["d"],
                                  block_sparse="window" in case)
  rows = {
      "decode": (lambda q, k, v, n: pa.decode_attention(q, k, v, n, **kw), (q, k, v, lengths)),
      "paged": (lambda q, kp, vp, t, n: pa.paged_attention(q, kp, vp, t, n, **kw),
                (q, k_pages, v_pages, table, lengths)),
      "attention": (lambda q, k, v: pa.attention(q, k, v, **aligned), (q, k, v)),
      "parallel": (lambda q, k, v: pa.attention(q, k, v, config=parallel_cfg, **aligned),
                   (q, k, v)),
  }
  queries = jnp.full_like(lengths, seq_q)
  cudnn = lambda q, k, v, n: jax.nn.dot_product_attention(
      q, k, v, query_seq_lengths=queries, key_value_seq_lengths=n, implementation="cudnn")
  if "window" in case:  # cuDNN on the window's keys: the same work
    first = seq - keys_read(case)
    rows["cudnn"] = (cudnn, (q, k[:, first:], v[:, first:], jnp.full_like(lengths, seq - first)))
  else:
    rows["cudnn"] = (cudnn, (q, k, v, lengths))
  return rows


def cudnn_without_lengths(args):
  q, k, v, _ = args
  return (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"),
          (q, k, v))


def kernel_ms(call):
  try:
    return kernel_time_ms(call)[0]
  except Exception:
    return None


def time_jax(fn, args):
  """(ms, kernel ms, zero-argument call, output) of jitted fn(*args)."""
  jitted = jax.jit(fn)
  call = lambda: jitted(*args)
  out = jax.block_until_ready(call())
  return median_time_ms(call), kernel_ms(call), call, out


def flex_call(case, shape, q, k, v):
  """A zero-argument FlexAttention call on our inputs, or (None, why)."""
  try:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
  except Exception as e:
    return None, describe(e)
  if not torch.cuda.is_available():
    return None, "torch has no CUDA device"
  flex = torch.compile(flex_attention, dynamic=False)
  to_torch = lambda x: torch.from_numpy(np.asarray(x.astype(jnp.float32))).to(
      "cuda", torch.bfloat16).transpose(1, 2).contiguous()
  qt, kt, vt = (to_torch(x) for x in (q, k, v))
  seq_q, seq = case["seq_q"], case["seq"]
  block_mask = None
  if "window" in case:
    window = case["window"]

    def mask_mod(b, h, qi, ki):
      pos = qi + seq - seq_q
      return (ki <= pos) & (pos - ki < window)
    block_mask = create_block_mask(mask_mod, None, None, seq_q, seq, device="cuda")

  def call():
    with torch.no_grad():
      return flex(qt, kt, vt, block_mask=block_mask, enable_gqa=True)
  return call, None


def time_torch(call, reps=5, calls=20):
  """(median ms per call over `reps` windows of back-to-back calls between
  CUDA events, kernel ms, output)."""
  import torch
  out = call()
  call()
  torch.cuda.synchronize()
  times = []
  for _ in range(reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
      call()
    end.record()
    end.synchronize()
    times.append(start.elapsed_time(end) / calls)
  return statistics.median(times), kernel_ms(call), out


def rel_err(x, ref):
  x, ref = (np.asarray(jnp.asarray(a, jnp.float32)) for a in (x, ref))
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def sweep(case, shape, q, k, v, lengths, deadline):
  """Split-KV times at one shape: block_k x num_stages at the schedule's
  split count, then x1/2, x2 and x4 the splits at the schedule's tiles:
  {config: {ms, kernel_ms}}."""
  from pallas_attn.decode import resolve_config
  default = resolve_config(None, pa.analyze_variant(), q, k.shape, v.shape)
  out = {"default": str(default)}
  configs = [pa.DecodeConfig(block_k=bk, num_stages=st, num_splits=default.num_splits)
             for bk in (64, 128, 256) for st in (2, 3, 4)]
  configs += [pa.DecodeConfig(block_k=default.block_k, num_stages=default.num_stages,
                              num_splits=n)
              for n in sorted({max(1, default.num_splits // 2), 2 * default.num_splits,
                               4 * default.num_splits} - {default.num_splits})]
  for cfg in configs:
    if elapsed() > deadline:
      out["cut_by_budget"] = True
      break
    label = f"block_k={cfg.block_k} num_stages={cfg.num_stages} num_splits={cfg.num_splits}"
    try:
      ms, kms, _, _ = time_jax(
          lambda q, k, v, n, cfg=cfg: pa.decode_attention(q, k, v, n, config=cfg),
          (q, k, v, lengths))
      out[label] = {"ms": ms, "kernel_ms": kms}
    except Exception as e:
      out[label] = {"error": describe(e)}
    print(json.dumps({"sweep": case["name"], label: out[label]}), flush=True)
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", default="benchmarks/results")
  parser.add_argument("--small", action="store_true", help="tiny shapes (CPU interpret mode)")
  parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
  parser.add_argument("--cases", nargs="+", default=None, help="case names (default: all)")
  parser.add_argument("--sweep", action="store_true",
                      help="also sweep the split-KV config at " + ", ".join(SWEEP_CASES))
  parser.add_argument("--budget-s", type=float, default=480.0,
                      help="start no measurement after this many seconds")
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "decode.json")
  shape = SMALL if args.small else FULL
  cases = [c for c in shape["cases"] if args.cases is None or c["name"] in args.cases]
  peak = hbm_peak()
  results = {"environment": environment(), "shape": {k: v for k, v in shape.items()
                                                     if k != "cases"},
             "args": vars(args), "hbm_peak_tb_s": peak,
             "timing": "JAX: median_time_ms (device throughput); flex: CUDA events around "
                       "back-to-back calls; *kernel_ms: CUPTI kernel time per call",
             "cases": {}, "sweeps": {}, "errors": [], "skipped": []}

  def save():
    results["elapsed_s"] = elapsed()
    with open(path, "w") as f:
      json.dump(results, f, indent=1)

  # Shape by shape; Flex (a torch.compile per shape) after all JAX sides, so a
  # budget cut drops Flex first.
  order = [(c, i) for c in cases for i in args.impls if i != "flex"]
  order += [(c, "flex") for c in cases if "flex" in args.impls]
  current, outputs = {}, {}  # the inputs of one shape; every shape's outputs (small)
  for case, impl in order:
    name = case["name"]
    cell = results["cases"].setdefault(name, dict(case))
    if elapsed() > args.budget_s:
      results["skipped"].append(f"{name} {impl}: time budget")
      continue
    if name not in current:
      current.clear()
      q, k, v, lengths = make_inputs(case, shape)
      current[name] = (q, k, v, lengths, jax_rows(case, shape, q, k, v, lengths))
      cell["kv_bytes"] = (case["batch"] * shape["kv_heads"] * keys_read(case) * 2
                          * shape["d"] * 2)
    q, k, v, lengths, rows = current[name]
    outputs = outputs if name in outputs else {**outputs, name: {}}
    started = elapsed()
    try:
      if impl == "flex":
        call, why = flex_call(case, shape, q, k, v)
        if call is None:
          raise RuntimeError(why)
        ms, kms, out = time_torch(call)
        out = out.float().transpose(1, 2).cpu().numpy()
      else:
        fn, fn_args = rows[impl]
        try:
          ms, kms, _, out = time_jax(fn, fn_args)
        except Exception as e:
          if impl != "cudnn":
            raise
          cell["cudnn_lengths"] = f"refused ({describe(e)}); timed on the whole cache"
          ms, kms, _, out = time_jax(*cudnn_without_lengths(fn_args))
      out = np.asarray(jnp.asarray(out, jnp.float32)) if impl != "flex" else out
      outputs[name][impl] = out
      reference = outputs[name].get("cudnn", outputs[name].get("decode"))
      entry = {"ms": ms, "kernel_ms": kms,
               "tb_s": cell["kv_bytes"] / ms / 1e9 if ms else None,
               "kernel_tb_s": cell["kv_bytes"] / kms / 1e9 if kms else None,
               "rel_err_vs_reference": None if reference is None or reference is out
               else rel_err(out, reference)}
      if peak and entry["tb_s"]:
        entry["fraction_of_hbm_peak"] = entry["tb_s"] / peak
    except Exception as e:
      entry = {"error": describe(e)}
      results["errors"].append(f"{name} {impl}: {describe(e)}")
    entry["took_s"] = elapsed() - started
    cell[impl] = entry
    print(json.dumps({"case": name, "impl": impl, **entry}), flush=True)
    save()
  current.clear()
  if args.sweep:
    for case in cases:
      if case["name"] in SWEEP_CASES and elapsed() < args.budget_s:
        q, k, v, lengths = make_inputs(case, shape)
        results["sweeps"][case["name"]] = sweep(case, shape, q, k, v, lengths,
                                                args.budget_s + 60)
        save()
  results["ratios"] = ratios(results["cases"])
  save()
  print_table(results)


def ratios(cases):
  """Per shape: decode's time against each peer (> 1: decode is faster)."""
  out = {}
  for name, cell in cases.items():
    ours = cell.get("decode", {}).get("ms")
    for peer in ("cudnn", "flex", "parallel"):
      theirs = cell.get(peer, {}).get("ms")
      if ours and theirs:
        out[f"{name} {peer}/decode"] = theirs / ours
  return out


def print_table(results):
  env = results["environment"]
  print(f"\n{env['device']}  {env['date']}  jax {env['jax']}  torch {env['torch']}  "
        f"HBM peak {results['hbm_peak_tb_s']} TB/s")
  impls = [i for i in IMPLS if any(i in c for c in results["cases"].values())]
  print(f"{'case':<20}" + "".join(f"{i:>20}" for i in impls) + "   (ms | TB/s of K/V read)")
  for name, cell in results["cases"].items():
    cells = []
    for impl in impls:
      e = cell.get(impl)
      if not e or e.get("ms") is None:
        cells.append(f"{'n/a' if not e else 'error':>20}")
      else:
        cells.append(f"{e['ms']:.4f} | {e['tb_s']:.2f}".rjust(20))
    print(f"{name:<20}" + "".join(cells))
  for label, r in results["ratios"].items():
    print(f"  {label}: {r:.2f}x")
  for line in results["errors"] + results["skipped"]:
    print(f"  {line}")


if __name__ == "__main__":
  main()
