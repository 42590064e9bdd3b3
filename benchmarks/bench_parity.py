"""Issue 14: gathered bias tables and attention sinks next to ALiBi, vanilla
causal attention and FlexAttention.

Run on the GPU machine: `python benchmarks/bench_parity.py --out DIR`.
Writes DIR/parity.json after every measurement and prints a short table
last. Under 4 minutes: no measurement starts after `--budget-s` seconds
(the skipped ones are listed; they are in priority order, Flex's sink
emulation last) and no kernel-time round after 30 s more. `--small` runs
tiny shapes (on CPU: Pallas interpret mode, and no Flex without PyTorch).

Rows (bf16, B4 H16 S4096 d128, causal), each forward and forward+backward
(gradients of q, k, v):
* rel_table: a learned relative-position table [H, 2S-1] read at
  q - kv + S - 1 (a computed index: a gather in the kernel);
* t5_buckets: T5's causal relative bucket bias (32 buckets, max distance
  128), table [H, 32] read at the bucket;
* alibi: the arithmetic bias slopes[h] * (kv - q), the reference point
  (target: a gathered table costs at most 15% more);
* vanilla_causal and sink (`sinks=` [H] logits; target: within 5% of
  vanilla; Flex emulates sinks as out * sigmoid(lse - sink));
* rel_table_dtable, t5_buckets_dtable: forward+backward that also
  differentiates the table (ours deterministic, Flex's captured-tensor
  gradient).

Timing as bench_masks.py: ours by device throughput (`median_time_ms` of
the jitted call; `--amortized`: `amortized_time_ms`, which compiles a second
program per measurement), Flex (torch.compile'd `flex_attention` on the
same inputs, causal block mask built once, as ours) by `do_bench`, and both
by kernel time (`kernel_time.py`, keys `*_kernel_ms`). With PyTorch,
`--rounds` repeats the kernel times of every compiled call in alternation,
so that the target ratios (table / ALiBi, sink / vanilla, Flex / ours) come
with a per-round median and range: one kernel drifted by 10-35% between
calls in earlier runs. TFLOP/s count unmasked pairs only.

Correctness: before timing, each variant against `attention_reference` in
float32 at a small S and d=64 (output, and gradients for the learned tables
and sinks; at d=128 the float32 backward of T5 with the table gradient
took over 80 s to compile on an H100: Triton's exact float32 dots); T5 buckets of the jnp and torch helpers compared; and Flex's
forward output against ours on the timed inputs, so that a wrong kernel or
a mismatched peer shows up in the output.
"""
from __future__ import annotations

import time

START = time.perf_counter()  # the budget counts from here

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for torch
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_attn as pa  # noqa: E402
from bench_backward import step  # noqa: E402
from bench_forward import environment, inputs, time_fn  # noqa: E402
from bench_masks import _ratio, _tf, causal, density  # noqa: E402
from kernel_time import kernel_time_ms  # noqa: E402
from pallas_attn.kernels import lowering as lowering_lib  # noqa: E402
from pallas_attn.schedule.timing import attention_flops, median_time_ms  # noqa: E402

NUM_BUCKETS, MAX_DISTANCE = 32, 128
BASES = ("alibi", "rel_table", "t5_buckets", "vanilla_causal", "sink")
ROWS = BASES + ("rel_table_dtable", "t5_buckets_dtable")
FULL = dict(batch=4, heads=16, seq=4096, d=128, check_batch=2, check_seq=256, check_d=64)
SMALL = dict(batch=1, heads=2, seq=128, d=32, check_batch=1, check_seq=64, check_d=32)
CHECK_TOL = 1e-3  # float32 vs the dense reference; a wrong kernel is off by >1e-2
DEVICE = "cuda"  # PyTorch's device for Flex


class Failed(Exception):
  """A measurement that failed, with the reason `time_fn` gave."""


def elapsed():
  return time.perf_counter() - START


def describe(e):
  """An exception as one line: its type and the start of its message."""
  return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def t5_bucket(relative_position):
  """T5's causal relative-position bucket (HF `_relative_position_bucket`,
  bidirectional=False): relative_position = kv - q as there; distances
  q - kv below 16 get a bucket each, longer ones log-spaced buckets up to
  MAX_DISTANCE, and beyond that the last bucket. (The log's argument is
  clamped to 1: the same buckets, without a log(0) on the unused branch.)"""
  n = jnp.maximum(-relative_position, 0)
  exact = NUM_BUCKETS // 2
  large = exact + (jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / exact)
                   / math.log(MAX_DISTANCE / exact) * (NUM_BUCKETS - exact)).astype(n.dtype)
  return jnp.where(n < exact, n, jnp.minimum(large, NUM_BUCKETS - 1))


def t5_bucket_torch(torch, relative_position):
  """`t5_bucket` in PyTorch, for Flex's score_mod."""
  n = torch.clamp(-relative_position, min=0)
  exact = NUM_BUCKETS // 2
  large = exact + (torch.log(torch.clamp(n, min=1).float() / exact)
                   / math.log(MAX_DISTANCE / exact) * (NUM_BUCKETS - exact)).to(n.dtype)
  return torch.where(n < exact, n, torch.clamp(large, max=NUM_BUCKETS - 1))


def score_mods(seq):
  """name -> (param -> score_mod) for the rows with a score_mod."""
  return {"rel_table": lambda t: lambda s, b, h, qi, ki: s + t[h, qi - ki + seq - 1],
          "t5_buckets": lambda t: lambda s, b, h, qi, ki: s + t[h, t5_bucket(ki - qi)],
          "alibi": lambda sl: lambda s, b, h, qi, ki: s + sl[h] * (ki - qi)}


def params(heads, seq):
  """name -> the row's parameter (float32 table, slopes or sink logits; None)."""
  keys = jax.random.split(jax.random.PRNGKey(2), 3)
  return {"rel_table": jax.random.normal(keys[0], (heads, 2 * seq - 1), jnp.float32),
          "t5_buckets": jax.random.normal(keys[1], (heads, NUM_BUCKETS), jnp.float32),
          "alibi": pa.variants.alibi_slopes(heads), "vanilla_causal": None,
          "sink": jax.random.normal(keys[2], (heads,), jnp.float32)}


def attention_fn(name, seq, attention=pa.attention, **kw):
  """(q, k, v, param) -> out of one row, by `attention` (ours or the reference)."""
  mods = score_mods(seq)

  def attn(q, k, v, p):
    if name == "sink":
      return attention(q, k, v, mask_mod=causal, sinks=p, **kw)
    return attention(q, k, v, score_mod=mods[name](p) if name in mods else None,
                     mask_mod=causal, **kw)
  return attn


def ours_fns(attn):
  """mode -> a function of (q, k, v, param[, d_out]): the forward, the
  forward+backward (gradients of q, k, v) and, as "dtable", also the
  parameter's gradient."""
  def fwd_bwd(q, k, v, p, d_out):
    return step(lambda q, k, v: attn(q, k, v, p))(q, k, v, d_out)

  def dtable(q, k, v, p, d_out):
    _, vjp = jax.vjp(attn, q, k, v, p)
    return vjp(d_out)
  return {"fwd": attn, "fwd_bwd": fwd_bwd, "dtable": dtable}


def rel_err(x, ref):
  x, ref = (np.asarray(jnp.asarray(a, jnp.float32)) for a in (x, ref))
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def check(name, shape):
  """Relative errors of ours against `attention_reference` (float32, small
  S): the output, and for the rows with a learned parameter the gradients
  of q, k, v and the parameter."""
  batch, heads, seq, d = (shape[k] for k in ("check_batch", "heads", "check_seq", "check_d"))
  q, k, v = inputs(batch, seq, heads, d, d, dtype=jnp.float32)
  p = params(heads, seq)[name]
  d_out = jax.random.normal(jax.random.PRNGKey(3), q.shape, jnp.float32)
  result = {"seq": seq}
  with_grads = name in ("rel_table", "t5_buckets", "sink")
  for side, attention in (("ours", pa.attention), ("ref", pa.attention_reference)):
    attn = attention_fn(name, seq, attention)
    if with_grads:
      out, vjp = jax.vjp(attn, q, k, v, p)
      result[side] = (out,) + tuple(vjp(d_out))
    else:
      result[side] = (attn(q, k, v, p),)
  names = ("out", "dq", "dk", "dv", "dparam")
  result["rel_err"] = {n: rel_err(a, b)
                       for n, a, b in zip(names, result.pop("ours"), result.pop("ref"))}
  result["ok"] = all(e <= CHECK_TOL for e in result["rel_err"].values())
  return result


def flex_setup(q, k, v, d_out, row_params, seq):
  """(calls, why): name -> mode -> zero-argument call of FlexAttention
  (torch.compile'd `flex_attention`, causal block mask built once) on our
  inputs (as [B, H, S, D]) and parameters; calls is None without torch or
  CUDA, with the reason."""
  try:
    import torch
    from torch.nn.attention import flex_attention as flex_module
  except Exception as e:
    return None, f"{type(e).__name__}: {e}"
  if DEVICE == "cuda" and not torch.cuda.is_available():
    return None, "torch has no CUDA device"
  for limit in ("recompile_limit", "cache_size_limit"):  # one compile per row and mode
    if hasattr(torch._dynamo.config, limit):
      setattr(torch._dynamo.config, limit, 64)
  flex = torch.compile(flex_module.flex_attention, dynamic=False)
  lse_kw = (dict(return_aux=flex_module.AuxRequest(lse=True))  # return_lse is deprecated
            if hasattr(flex_module, "AuxRequest") else dict(return_lse=True))

  def tensor(x, heads_second=False):
    t = torch.from_numpy(np.array(x.astype(jnp.float32))).to(DEVICE)
    return t.transpose(1, 2).contiguous().to(torch.bfloat16) if heads_second else t
  q, k, v, d_out = (tensor(x, heads_second=True) for x in (q, k, v, d_out))
  tensors = {n: None if p is None else tensor(p) for n, p in row_params.items()}
  block_mask = flex_module.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, seq,
                                             seq, device=DEVICE)
  mods = {"rel_table": lambda t: lambda s, b, h, qi, ki: s + t[h, qi - ki + seq - 1],
          "t5_buckets": lambda t: lambda s, b, h, qi, ki: s + t[h, t5_bucket_torch(torch, ki - qi)],
          "alibi": lambda sl: lambda s, b, h, qi, ki: s + sl[h] * (ki - qi)}

  def attention(name, param):
    """(q, k, v) -> out; the score_mod is built once per call site, since
    Dynamo guards on it. Sinks: out * sigmoid(lse - sink) rescales the
    softmax to exp(sink) + sum(exp(s))."""
    if name == "sink":
      def run(q, k, v):
        out, aux = flex(q, k, v, block_mask=block_mask, **lse_kw)
        lse = getattr(aux, "lse", aux)
        return out * torch.sigmoid(lse - param[None, :, None]).unsqueeze(-1).to(out.dtype)
      return run
    mod = mods[name](param) if name in mods else None
    return lambda q, k, v: flex(q, k, v, score_mod=mod, block_mask=block_mask)

  def calls(name):
    param = tensors[name]
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    fwd, fwd_bwd = attention(name, param), attention(name, param)

    def forward():
      with torch.no_grad():
        return fwd(q, k, v)
    out = {"fwd": forward,
           "fwd_bwd": lambda: torch.autograd.grad(fwd_bwd(*leaves), leaves, d_out)}
    if name in ("rel_table", "t5_buckets"):
      table = param.detach().clone().requires_grad_()
      dtable = attention(name, table)
      out["dtable"] = lambda: torch.autograd.grad(dtable(*leaves), leaves + [table], d_out)
    return out
  return {name: calls(name) for name in row_params}, None


def kernel_ms(call):
  """Kernel time per call of a zero-argument call (`kernel_time_ms`), or
  None without PyTorch on a GPU."""
  try:
    return kernel_time_ms(call)[0]
  except Exception:
    return None


def time_ours(fn, args, amortized=False):
  """(ms, kernel ms, zero-argument call) of jitted `fn(*args)`. ms is the
  device throughput of back-to-back calls of that one program
  (`median_time_ms`); with `amortized`, bench_masks' `time_fn`
  (`amortized_time_ms`, which compiles a second program of copies)."""
  jitted = jax.jit(fn)
  call = lambda: jitted(*args)
  jax.block_until_ready(call())  # compiles; a VariantError shows up here
  if amortized:
    ms, err = time_fn(fn, *args)
    if err:
      raise Failed(err)
  else:
    ms = median_time_ms(call)
  return ms, kernel_ms(call), call


def time_flex(call):
  """(do_bench median ms, kernel ms, call) of a zero-argument PyTorch call."""
  import torch
  from triton.testing import do_bench
  call()
  torch.cuda.synchronize()
  return float(do_bench(call, warmup=25, rep=100, return_mode="median")), kernel_ms(call), call


def bucket_check(seq):
  """Positions in [-(S-1), S-1] whose T5 bucket differs between the jnp
  and PyTorch helpers (0 expected); None without torch."""
  try:
    import torch
  except Exception:
    return None
  rel = np.arange(-(seq - 1), seq, dtype=np.int32)
  ours = np.asarray(t5_bucket(jnp.asarray(rel)))
  theirs = t5_bucket_torch(torch, torch.from_numpy(rel)).numpy()
  return {"mismatches": int((ours != theirs).sum()), "buckets_used": int(len(np.unique(ours)))}


def jobs(rows):
  """(row, side, mode) in priority order: the budget drops the last first."""
  order = [(n, "ours", "fwd") for n in BASES] + [(n, "ours", "fwd_bwd") for n in BASES]
  order += [(f"{n}_dtable", "ours", "fwd_bwd") for n in ("rel_table", "t5_buckets")]
  for n in ("rel_table", "t5_buckets", "alibi"):
    order += [(n, "flex", "fwd"), (n, "flex", "fwd_bwd")]
  order += [(f"{n}_dtable", "flex", "fwd_bwd") for n in ("rel_table", "t5_buckets")]
  order += [("vanilla_causal", "flex", m) for m in ("fwd", "fwd_bwd")]
  order += [("sink", "flex", m) for m in ("fwd", "fwd_bwd")]
  return [j for j in order if j[0] in rows]


def base_and_mode(row, mode):
  """A row's base variant and the function mode its `mode` runs."""
  if row.endswith("_dtable"):
    return row[:-len("_dtable")], "dtable"
  return row, mode


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", default="benchmarks/results")
  parser.add_argument("--small", action="store_true", help="tiny shapes (CPU interpret mode)")
  parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
  parser.add_argument("--no-checks", action="store_true",
                      help="skip the float32 checks (minutes of Triton float32 compiles on a "
                           "GPU) when a run of the same commit passed them")
  parser.add_argument("--budget-s", type=float, default=170.0,
                      help="start no measurement after this many seconds; kernel-time rounds "
                           "run until 30 s after it")
  parser.add_argument("--amortized", action="store_true",
                      help="time ours with amortized_time_ms (bench_masks' timer; compiles a "
                           "second program per measurement) instead of median_time_ms")
  parser.add_argument("--rounds", type=int, default=3,
                      help="alternating kernel-time rounds of every compiled call (needs torch)")
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "parity.json")
  shape = SMALL if args.small else FULL
  batch, heads, seq, d = shape["batch"], shape["heads"], shape["seq"], shape["d"]
  results = {"environment": environment(), "shape": shape, "args": vars(args),
             "timing": f"ours: {'amortized_time_ms' if args.amortized else 'median_time_ms'} "
                       "(device throughput); flex: do_bench median; *_kernel_ms: kernel time "
                       "(CUPTI) per call, both sides; *_s: seconds a measurement took "
                       "(compiles included)",
             "checks": {}, "rows": {}, "ratios": {}, "rounds": {}, "errors": [], "skipped": []}

  def save():
    results["elapsed_s"] = elapsed()
    with open(path, "w") as f:
      json.dump(results, f, indent=1)

  results["t5_bucket_check"] = bucket_check(seq)
  for name in BASES:
    if args.no_checks or (name not in args.rows and f"{name}_dtable" not in args.rows):
      continue
    try:
      results["checks"][name] = check(name, shape)
    except Exception as e:  # e.g. VariantError while computed indices are not supported
      results["checks"][name] = {"error": describe(e)}
    print(json.dumps({"check": name, **results["checks"][name]}), flush=True)
  save()

  q, k, v = inputs(batch, seq, heads, d, d)
  d_out = jax.random.normal(jax.random.PRNGKey(1), q.shape, q.dtype)
  row_params = params(heads, seq)
  block_mask = pa.block_mask(causal, batch, heads, seq, seq)  # built once, as Flex's
  fns = {n: ours_fns(attention_fn(n, seq, block_mask=block_mask)) for n in BASES}
  results["lowerings"] = {n: lowering_of(n, seq, row_params[n], q) for n in BASES}
  dens = density(causal, seq)
  for row in args.rows:
    results["rows"][row] = {
        "flops_fwd": attention_flops(batch, heads, seq, seq, d, d, density=dens),
        "flops_fwd_bwd": attention_flops(batch, heads, seq, seq, d, d, density=dens,
                                         mode="fwd_bwd")}
  try:
    flex, flex_why = flex_setup(q, k, v, d_out, row_params, seq)
  except Exception as e:
    flex, flex_why = None, describe(e)
  results["flex"] = "available" if flex else f"n/a ({flex_why})"
  calls = {}  # (row, side, mode) -> zero-argument call, for the rounds and the cross-check
  for row, side, mode in jobs(args.rows):
    if side == "flex" and flex is None:
      continue
    if elapsed() > args.budget_s:
      results["skipped"].append(f"{side} {row} {mode}: time budget")
      continue
    base, fn_mode = base_and_mode(row, mode)
    started, cell = elapsed(), results["rows"][row]
    try:
      if side == "ours":
        fn_args = (q, k, v, row_params[base]) + ((d_out,) if fn_mode != "fwd" else ())
        timed = time_ours(fns[base][fn_mode], fn_args, args.amortized)
      else:
        timed = time_flex(flex[base][fn_mode])
      cell[f"{side}_{mode}_ms"], cell[f"{side}_{mode}_kernel_ms"], calls[row, side, mode] = timed
    except Exception as e:  # recorded; the other rows go on
      cell[f"{side}_{mode}_ms"] = None
      results["errors"].append(f"{side} {row} {mode}: "
                               f"{str(e) if isinstance(e, Failed) else describe(e)}")
    if side == "flex" and mode == "fwd" and (row, "ours", "fwd") in calls:
      cell["flex_vs_ours_rel_err"] = agreement(calls.get((row, side, mode)),
                                               calls[row, "ours", "fwd"])
    cell[f"{side}_{mode}_s"] = elapsed() - started  # compile + timing, for planning
    print(json.dumps({"row": row, "side": side, "mode": mode,
                      "ms": cell.get(f"{side}_{mode}_ms"),
                      "kernel_ms": cell.get(f"{side}_{mode}_kernel_ms"),
                      "took_s": round(cell[f"{side}_{mode}_s"], 1)}), flush=True)
    save()

  if has_cuda_torch():
    results["rounds"] = rounds(calls, args.rounds, args.budget_s + 30.0)
  results["ratios"] = ratios(results["rows"])
  save()
  print_table(results)


def lowering_of(name, seq, param, q):
  """Which lowering runs the row's passes and why (as `pallas-attn explain`
  says), or the error."""
  mods = score_mods(seq)
  try:
    analysis = pa.analyze_variant(mods[name](param) if name in mods else None, causal)
    return lowering_lib.choose(None, analysis, q.dtype, q.shape[-1], q.shape[-1],
                               interpret=False).describe()
  except Exception as e:
    return describe(e)


def agreement(flex_call, ours_call):
  """Relative error between Flex's forward output and ours on the same
  inputs (bf16: about 1e-2 when both compute the same variant), or None."""
  if flex_call is None:
    return None
  try:
    theirs = flex_call().float().transpose(1, 2).cpu().numpy()
    return rel_err(ours_call(), theirs)
  except Exception:
    return None


def has_cuda_torch():
  """Whether kernel times can be read (PyTorch with a CUDA device)."""
  try:
    import torch
    return torch.cuda.is_available()
  except Exception:
    return False


def rounds(calls, count, deadline_s):
  """Kernel times of every compiled call, `count` times in alternation
  (rounds start only before `deadline_s`): medians, and each ratio's
  per-round median and range."""
  times = {key: [] for key in calls}
  done = 0
  for _ in range(count):
    if elapsed() > deadline_s:
      break
    for key, call in calls.items():
      try:
        times[key].append(kernel_time_ms(call)[0])
      except Exception:
        times[key].append(None)
    done += 1
  per_round = [{key: ts[i] for key, ts in times.items()} for i in range(done)]
  out = {"rounds": done, "kernel_ms": {}, "samples": {}, "ratios": {}}
  for (row, side, mode), ts in times.items():
    out["samples"][f"{row} {side} {mode}"] = ts
    ts = [t for t in ts if t]
    if ts:
      out["kernel_ms"][f"{row} {side} {mode}"] = statistics.median(ts)
  for label, (num, den) in ratio_pairs().items():
    vals = sorted(r[num] / r[den] for r in per_round if r.get(num) and r.get(den))
    if vals:
      out["ratios"][label] = {"median": statistics.median(vals), "range": [vals[0], vals[-1]]}
  return out


def ratio_pairs():
  """label -> ((row, side, mode) numerator, denominator), all time ratios."""
  pairs = {}
  for mode in ("fwd", "fwd_bwd"):
    for n in ("rel_table", "t5_buckets"):
      pairs[f"{n}/alibi {mode}"] = ((n, "ours", mode), ("alibi", "ours", mode))
    pairs[f"sink/vanilla {mode}"] = (("sink", "ours", mode), ("vanilla_causal", "ours", mode))
    for n in ROWS:  # flex time / ours time: > 1 means ours is faster
      pairs[f"flex/ours {n} {mode}"] = ((n, "flex", mode), (n, "ours", mode))
  for n in ("rel_table", "t5_buckets"):
    pairs[f"{n}_dtable/{n} fwd_bwd"] = ((f"{n}_dtable", "ours", "fwd_bwd"),
                                        (n, "ours", "fwd_bwd"))
  return pairs


def ratios(rows):
  """Every `ratio_pairs` ratio by wall clock and by kernel time (None where
  a side is missing)."""
  out = {}
  for label, ((n1, s1, m1), (n2, s2, m2)) in ratio_pairs().items():
    for suffix in ("ms", "kernel_ms"):
      a = rows.get(n1, {}).get(f"{s1}_{m1}_{suffix}")
      b = rows.get(n2, {}).get(f"{s2}_{m2}_{suffix}")
      if a is not None or b is not None:
        out[f"{label} ({'wall' if suffix == 'ms' else 'kernel'})"] = a / b if a and b else None
  return out


def print_table(results):
  env, shape = results["environment"], results["shape"]
  print(f"\n{env['device']}  {env['date']}  jax {env['jax']}  torch {env['torch']}  "
        f"triton {env['triton']}  flex {results['flex']}")
  print("checks vs attention_reference (float32, S={}): max rel err over out/grads".format(
      shape["check_seq"]))
  for name, c in results["checks"].items():
    if "error" in c:
      print(f"  {name:<16} ERROR {c['error'][:150]}")
    else:
      worst = max(c["rel_err"].values())
      print(f"  {name:<16} {worst:.1e} {'ok' if c['ok'] else 'WRONG'}  "
            + " ".join(f"{n} {e:.0e}" for n, e in c["rel_err"].items()))
  print(f"  t5 buckets jnp vs torch: {results['t5_bucket_check']}")
  for name, text in results.get("lowerings", {}).items():
    print(f"  {name:<16} {text[:150]}")
  rows = results["rows"]
  print(f"B{shape['batch']} H{shape['heads']} S{shape['seq']} d{shape['d']} bf16 causal TFLOP/s "
        "(unmasked pairs); ours/flex = flex time / ours time")
  kinds = [("wall", "ms")] + [("kernel", "kernel_ms")] * any(
      r.get(key) for r in rows.values() for key in r if key.endswith("_kernel_ms"))
  for kind, suffix in kinds:
    print(f"  {kind:<18} {'ours fwd':>8} {'flex fwd':>8} {'ours/flex':>9} "
          f"{'ours f+b':>8} {'flex f+b':>8} {'ours/flex':>9}")
    for name, r in rows.items():
      cells = []
      for mode in ("fwd", "fwd_bwd"):
        ours, flex = r.get(f"ours_{mode}_{suffix}"), r.get(f"flex_{mode}_{suffix}")
        flops = r[f"flops_{mode}"]
        cells.append(f"{_tf(flops, ours):>8} {_tf(flops, flex):>8} {_ratio(flex, ours):>9}")
      print(f"  {name:<18} {cells[0]} {cells[1]}")
  agree = {n: r["flex_vs_ours_rel_err"] for n, r in rows.items()
           if r.get("flex_vs_ours_rel_err") is not None}
  if agree:
    print("  flex vs ours forward outputs, rel err (bf16, ~1e-2 when they agree): "
          + ", ".join(f"{n} {e:.0e}" for n, e in agree.items()))
  print("time ratios: wall | kernel | kernel rounds median [range]  (targets: table/alibi fwd "
        "<= 1.15, sink/vanilla <= 1.05)")
  by_round = results["rounds"].get("ratios", {}) if results["rounds"] else {}
  for label in ratio_pairs():
    wall, kernel = (results["ratios"].get(f"{label} ({kind})") for kind in ("wall", "kernel"))
    rnd = by_round.get(label)
    if (wall is None and kernel is None and rnd is None) or (label.startswith("flex/")
                                                             and rnd is None):
      continue  # flex/ours without rounds: the table above has it
    rnd_s = (f"{rnd['median']:.3f} [{rnd['range'][0]:.3f}-{rnd['range'][1]:.3f}]"
             if rnd else "n/a")
    print(f"  {label:<36} {_num(wall):>6} | {_num(kernel):>6} | {rnd_s}")
  for s in results["skipped"]:
    print("  skipped:", s)
  for e in results["errors"]:
    print("  error:", e)
  print(f"  elapsed {results['elapsed_s']:.0f} s")


def _num(x):
  return "n/a" if x is None else f"{x:.3f}"


if __name__ == "__main__":
  main()
