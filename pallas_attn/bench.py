"""Benchmark harness, JAX side: a registry of cases, shared inputs, our
kernels and JAX's peers as compiled calls, one timer, and a results file of
one schema.

`pallas-attn bench` and the scripts in benchmarks/ run on it; their
benchmarks/harness.py adds the PyTorch peers and kernel time (CUPTI), which
need torch. Every implementation of a case runs on the same inputs
(`make_inputs`). A peer that cannot run a case (it cannot express the
variant, needs a GPU, or fails) gives a row with time None and the reason,
never an exception. TFLOP/s count only unmasked (q, kv) pairs, and a
forward+backward counts the backward as 2.5 forwards (`attention_flops`).
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from pallas_attn import variants as V
from pallas_attn.schedule.template import ProblemShape
from pallas_attn.schedule.timing import attention_flops, mask_density, median_time_ms

SCHEMA = "pallas_attn.bench/1"
MODES = ("fwd", "fwd_bwd")
# pallas_attn: the default lowering; pallas_attn:<lowering>: that one, n/a where it cannot run.
# cudnn: its own mask types only (cudnn:dense, for scripts, also takes a dense bias or mask).
# pallas_attn_fp8: the same inputs in e4m3 (quantize_fp8 per head, outside the timing).
IMPLS = ("pallas_attn", "pallas_attn:mosaic_gpu", "pallas_attn:triton", "pallas_attn_fp8",
         "cudnn", "jax_pallas_mha", "jax_mosaic_fp16", "xla")
VERSIONED = ("jax", "jaxlib", "torch", "triton", "flash-linear-attention", "mamba-ssm")
T5_BUCKETS, T5_MAX_DISTANCE = 32, 128


# ----------------------------------------------------------------------------- cases

@dataclasses.dataclass(frozen=True)
class Built:
  """A variant at one shape: `kwargs(params)` are `attention`'s keyword
  arguments; `params` (arrays or None) enter the jitted call as arguments,
  so that a case can differentiate them (closed-over arrays are constants)."""
  kwargs: Callable[[Any], dict]
  params: Any = None


@dataclasses.dataclass(frozen=True)
class Case:
  """One problem: a variant (a `VARIANTS` name, or `kwargs` given) at a shape.
  `grad_params`: the forward+backward also differentiates the variant's params."""
  name: str
  variant: str
  shape: ProblemShape
  grad_params: bool = False
  kwargs: dict | None = dataclasses.field(default=None, compare=False, hash=False)

  def build(self) -> Built:
    if self.kwargs is not None:
      return Built(lambda _: dict(self.kwargs))
    return VARIANTS[self.variant](self.shape)


def case(name: str, variant: str, batch: int, seq: int, *, seq_q: int | None = None,
         heads: int = 16, d_qk: int = 128, d_v: int | None = None, kv_heads: int | None = None,
         dtype: str = "bfloat16", grad_params: bool = False) -> Case:
  """q `[batch, seq_q (default seq), heads, d_qk]`, k and v `[batch, seq, kv_heads, d]`."""
  kv_heads, d_v = kv_heads or heads, d_v or d_qk
  return Case(name, variant, ProblemShape.from_shapes(
      (batch, seq_q or seq, heads, d_qk), (batch, seq, kv_heads, d_qk),
      (batch, seq, kv_heads, d_v), dtype), grad_params)


def seq_name(seq: int) -> str:
  """"4k" for 4096 (a whole number of 1024s), else the number."""
  return f"{seq // 1024}k" if seq % 1024 == 0 else str(seq)


def shrink(c: Case, seq: int = 128, heads: int = 2, d: int = 32) -> Case:
  """`c` at a tiny shape (same variant), to check a script on a CPU."""
  d_v = d if c.shape.d_v == c.shape.d_qk else d // 2
  return case(c.name, c.variant, 1, seq, heads=heads, d_qk=d, d_v=d_v, dtype=c.shape.dtype,
              grad_params=c.grad_params)


def document_ids(batch: int, seq: int, count: int = 8) -> jax.Array:
  """`[batch, seq]` ids of `count` equal documents."""
  return jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32) * count // seq, (batch, seq))


def t5_bucket(relative_position):
  """T5's causal relative-position bucket (HF `_relative_position_bucket`,
  bidirectional=False; relative_position = kv - q): distances below 16 get a
  bucket each, longer ones log-spaced buckets up to T5_MAX_DISTANCE, beyond
  that the last. (The log's argument is clamped to 1: the same buckets,
  without a log(0) on the unused branch.)"""
  n = jnp.maximum(-relative_position, 0)
  exact = T5_BUCKETS // 2
  large = exact + (jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / exact)
                   / math.log(T5_MAX_DISTANCE / exact) * (T5_BUCKETS - exact)).astype(n.dtype)
  return jnp.where(n < exact, n, jnp.minimum(large, T5_BUCKETS - 1))


def _fixed(variant: V.Variant) -> Built:
  return Built(lambda _: variant.kwargs())


def _learned(make_kwargs, shape_of, seed: int, causal: bool = True):
  """A variant (causal unless said) with a learned float32 parameter of `shape_of(shape)`."""
  def build(shape: ProblemShape) -> Built:
    param = jax.random.normal(jax.random.key(seed), shape_of(shape), jnp.float32)
    mask = dict(mask_mod=V.causal().mask_mod) if causal else {}
    return Built(lambda p: dict(make_kwargs(p, shape), **mask), param)
  return build


def _sink_kwargs(sinks, _):
  return dict(sinks=sinks)


def _rel_table_kwargs(table, shape):
  return dict(score_mod=lambda s, b, h, qi, ki: s + table[h, qi - ki + shape.seq_kv - 1])


def _t5_kwargs(table, shape):
  return dict(score_mod=lambda s, b, h, qi, ki: s + table[h, t5_bucket(ki - qi)])


WINDOWS = {"window256": 256, "window1024": 1024, "window4096": 4096}  # causal, bottom-right
# name -> the variant at a shape. Peers express some of them (see the peers below).
VARIANTS: dict[str, Callable[[ProblemShape], Built]] = {
    "vanilla": lambda s: Built(lambda _: {}),
    "causal": lambda s: _fixed(V.causal()),
    "softcap": lambda s: _fixed(V.softcap(30.0)),
    "alibi": lambda s: _fixed(V.alibi(num_heads=s.heads_q)),
    "alibi_causal": lambda s: _fixed(V.alibi(num_heads=s.heads_q) + V.causal()),
    **{name: (lambda s, size=size: _fixed(V.sliding_window(size, seq_q=s.seq_q,
                                                           seq_kv=s.seq_kv)))
       for name, size in WINDOWS.items()},
    "documents8": lambda s: _fixed(V.document(document_ids(s.batch, s.seq_kv), causal=True)),
    "sigmoid": lambda s: _fixed(V.sigmoid(seq_kv=s.seq_kv)),
    # relative-position table t[h, q - kv + S - 1]: a computed index (a gather in the kernel)
    "rel_table": _learned(_rel_table_kwargs, lambda s: (s.heads_q, 2 * s.seq_kv - 1), 20),
    "t5_buckets": _learned(_t5_kwargs, lambda s: (s.heads_q, T5_BUCKETS), 21),
    "sink": _learned(_sink_kwargs, lambda s: (s.heads_q,), 22),
    # the other mask form of the rows above, and the built-ins not among them (issue 37)
    "softcap_causal": lambda s: _fixed(V.softcap(30.0) + V.causal()),
    "window256_bidir": lambda s: _fixed(V.sliding_window(256, causal=False, seq_q=s.seq_q,
                                                         seq_kv=s.seq_kv)),
    "documents8_bidir": lambda s: _fixed(V.document(document_ids(s.batch, s.seq_kv))),
    "sigmoid_causal": lambda s: _fixed(V.sigmoid(seq_kv=s.seq_kv) + V.causal()),
    "relu": lambda s: _fixed(V.relu(seq_kv=s.seq_kv)),
    "relu_causal": lambda s: _fixed(V.relu(seq_kv=s.seq_kv) + V.causal()),
    "prefix_lm": lambda s: _fixed(V.prefix_lm(s.seq_kv // 2, seq_q=s.seq_q, seq_kv=s.seq_kv)),
    "sink_bidir": _learned(_sink_kwargs, lambda s: (s.heads_q,), 22, causal=False),
    "off_by_one": lambda s: _fixed(V.Variant("off_by_one", rownorm=V.off_by_one_softmax)),
    "off_by_one_causal": lambda s: _fixed(V.causal() + V.Variant(
        "off_by_one", rownorm=V.off_by_one_softmax)),
    "retention": lambda s: _fixed(V.retention_parallel(num_heads=s.heads_q)),
    # the README's recipes: RetNet's abs-sum clamp as a rownorm, Gemma-2's soft-capping
    # over packed documents, and Gemma-2's local layers (soft-capping, a 4096 window)
    "abs_clamp": lambda s: _fixed(V.Variant("abs_clamp", rownorm=V.retention_norm)),
    "abs_clamp_causal": lambda s: _fixed(V.causal() + V.Variant(
        "abs_clamp", rownorm=V.retention_norm)),
    "softcap_documents8": lambda s: _fixed(V.softcap(30.0) + V.document(
        document_ids(s.batch, s.seq_kv), causal=True)),
    "gemma2_local": lambda s: _fixed(V.softcap(50.0) + V.sliding_window(
        4096, seq_q=s.seq_q, seq_kv=s.seq_kv)),
}


@dataclasses.dataclass(frozen=True)
class Inputs:
  """One case's random inputs, shared by every implementation."""
  q: jax.Array
  k: jax.Array
  v: jax.Array
  dout: jax.Array  # the forward+backward's cotangent
  built: Built


def make_inputs(c: Case, seed: int = 0) -> Inputs:
  keys = jax.random.split(jax.random.key(seed), 4)
  s = c.shape
  q, k, v = (jax.random.normal(key, shape, s.dtype)
             for key, shape in zip(keys, (s.q_shape, s.k_shape, s.v_shape)))
  dout = jax.random.normal(keys[3], s.q_shape[:3] + (s.d_v,), s.dtype)
  return Inputs(q, k, v, dout, c.build())


def case_flops(c: Case, mode: str, built: Built) -> float:
  """Matmul FLOPs of one call, unmasked pairs only (density measured on up to
  4096 positions per axis)."""
  s = c.shape
  mask_mod = built.kwargs(built.params).get("mask_mod")
  density = mask_density(mask_mod, s.seq_q, s.seq_kv, max_points=4096)
  return attention_flops(s.batch, s.heads_q, s.seq_q, s.seq_kv, s.d_qk, s.d_v,
                         density=density, mode=mode)


# ----------------------------------------------------------------------------- JAX sides

def _cudnn(c: Case, dense: bool):
  """`jax.nn.dot_product_attention(implementation="cudnn")` for the variant:
  windows as bottom-right `local_window_size`s; with `dense`, ALiBi and the
  document mask as a dense bias / mask (read in full, no skipping: how a
  cuDNN user would write them)."""
  s = c.shape
  dense_forms = ("alibi", "documents8", "documents8_bidir") if dense else ()
  if c.variant not in ("vanilla", "causal", "window256_bidir", *WINDOWS, *dense_forms):
    raise NotImplementedError(f"cannot express variant {c.variant!r}")
  if jax.default_backend() != "gpu":
    raise NotImplementedError("needs a CUDA GPU")
  if s.dtype not in ("bfloat16", "float16") or s.d_qk != s.d_v:
    raise NotImplementedError("cuDNN attention needs bf16/fp16 and d_qk == d_v")
  static, arrays = dict(is_causal=c.variant in ("causal", "documents8", *WINDOWS)), {}
  if c.variant in WINDOWS:
    static["local_window_size"] = (WINDOWS[c.variant] - 1, 0)
  elif c.variant == "window256_bidir":
    static["local_window_size"] = (255, 255)
  elif c.variant == "alibi":
    positions = jnp.arange(s.seq_kv, dtype=jnp.float32)
    bias = V.alibi_slopes(s.heads_q)[:, None, None] * (positions[None, :] - positions[:, None])
    arrays["bias"] = bias[None].astype(s.dtype)
  elif c.variant.startswith("documents8"):
    ids = document_ids(s.batch, s.seq_kv)
    arrays["mask"] = ids[:, None, :, None] == ids[:, None, None, :]
  forward = lambda q, k, v, arrays: jax.nn.dot_product_attention(
      q, k, v, implementation="cudnn", **static, **arrays)
  return forward, arrays  # arrays as arguments: a dense bias is no jit constant


def _causal_flag(c: Case) -> bool:
  """Whether JAX's own kernels (softmax, optionally causal) express the variant."""
  if c.variant not in ("vanilla", "causal"):
    raise NotImplementedError(f"cannot express variant {c.variant!r}")
  if c.shape.d_qk != c.shape.d_v:
    raise NotImplementedError("needs d_qk == d_v")
  return c.variant == "causal"


def _pallas_mha(c: Case, interpret: bool):
  from jax.experimental.pallas.ops.gpu import attention as pallas_ops
  s, causal = c.shape, _causal_flag(c)
  blocks = pallas_ops.BlockSizes.get_default()
  for seq, block in ((s.seq_q, blocks.block_q), (s.seq_kv, blocks.block_k)):
    if seq % min(seq, block):
      raise NotImplementedError(f"needs sequence lengths that are multiples of {block}")
  group = s.heads_q // s.heads_kv

  def mha(q, k, v, _):
    # JAX's kernel has no GQA: repeat kv heads (outside the kernel, inside the timing).
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    return pallas_ops.mha(q, k, v, None, sm_scale=1.0 / math.sqrt(s.d_qk), causal=causal,
                          interpret=interpret)
  return mha


def _jax_mosaic(c: Case):
  """JAX's Mosaic GPU flash attention (fp16 only: it takes nothing else)."""
  causal = _causal_flag(c)
  if jax.default_backend() != "gpu":
    raise NotImplementedError("needs a CUDA GPU")
  from jax.experimental.pallas.ops.gpu import attention_mgpu
  config = attention_mgpu.TuningConfig(block_q=64, block_kv=128 if c.shape.d_qk <= 128 else 64,
                                       max_concurrent_steps=2, causal=causal)
  return lambda q, k, v, _: attention_mgpu.attention(q, k, v, config)


def _check_mosaic(kwargs: dict, shape: ProblemShape, interpret: bool):
  """NotImplementedError (an n/a row) with the reason the Mosaic forward cannot run."""
  from pallas_attn.kernels import lowering
  from pallas_attn.spec.analysis import analyze_variant
  analysis = analyze_variant(**{k: kwargs[k] for k in ("score_mod", "mask_mod", "rownorm")
                                if k in kwargs})
  why = lowering.mosaic_obstacle(analysis, shape.dtype, shape.d_qk, shape.d_v, interpret)
  if why:
    raise NotImplementedError(why)


def jax_forward(impl: str, c: Case, built: Built,
                interpret: bool | None = None) -> tuple[Callable, Any]:
  """(`(q, k, v, params) -> out`, params) of one JAX implementation;
  NotImplementedError where it cannot express the case or run here."""
  from pallas_attn.kernels import backend
  interpret = backend.resolve_interpret(interpret)
  if impl == "pallas_attn_fp8":
    from pallas_attn import attention

    def fp8_forward(q8, k8, v8, p):  # p: (the variant's params, the three descales)
      params, (qd, kd, vd) = p
      return attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                       **built.kwargs(params), interpret=interpret)
    return fp8_forward, built.params
  if impl.startswith("pallas_attn"):
    from pallas_attn import attention
    lowering = impl.partition(":")[2] or None
    if lowering == "mosaic_gpu":
      _check_mosaic(built.kwargs(built.params), c.shape, interpret)
    return (lambda q, k, v, p: attention(q, k, v, **built.kwargs(p), interpret=interpret,
                                         implementation=lowering)), built.params
  if impl == "xla":
    from pallas_attn.reference import attention_reference
    return (lambda q, k, v, p: attention_reference(q, k, v, **built.kwargs(p))), built.params
  if impl in ("cudnn", "cudnn:dense"):
    return _cudnn(c, dense=impl == "cudnn:dense")
  if impl == "jax_pallas_mha":
    return _pallas_mha(c, interpret), None
  if impl == "jax_mosaic_fp16":
    return _jax_mosaic(c), None
  raise ValueError(f"unknown implementation {impl!r}; known: {', '.join(IMPLS)}")


def jax_call(impl: str, c: Case, mode: str, inputs: Inputs,
             interpret: bool | None = None) -> Callable[[], Any]:
  """A zero-argument call of `impl` on `inputs`, compiled and run once (so
  that a failure shows here, not in a timer): the forward, or the gradients
  of <forward, dout> with respect to q, k, v (and the params with `grad_params`)."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  forward, params = jax_forward(impl, c, inputs.built, interpret)
  args = (inputs.q, inputs.k, inputs.v, params)
  if impl == "jax_mosaic_fp16":
    if mode != "fwd":
      raise NotImplementedError("forward only")
    args = tuple(x.astype(jnp.float16) for x in args[:3]) + (None,)
  if impl == "pallas_attn_fp8":
    if mode != "fwd":
      raise NotImplementedError("forward only")
    from pallas_attn.fp8 import quantize_fp8
    (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(x) for x in args[:3])
    args = (q8, k8, v8, (params, (qd, kd, vd)))
  if mode == "fwd":
    fn = jax.jit(forward)
  else:
    def loss(q, k, v, p, dout):
      return jnp.sum(forward(q, k, v, p).astype(jnp.float32) * dout.astype(jnp.float32))
    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3) if c.grad_params else (0, 1, 2)))
    args += (inputs.dout,)
  return first_call(fn, args)


def first_call(fn, args) -> Callable:
  """A zero-argument call of `fn` (jitted) on `args`, compiled and run once;
  the seconds each stage of that first call took are its `.stages` (trace:
  Python tracing, our analysis included; lower: to MLIR, the Pallas kernels'
  lowerings included; compile: XLA's and the kernels' compilers; run: the
  first execution)."""
  stages, clock = {}, time.perf_counter
  start = clock()
  traced = fn.trace(*args)
  stages["trace"], start = clock() - start, clock()
  lowered = traced.lower()
  stages["lower"], start = clock() - start, clock()
  compiled = lowered.compile()
  stages["compile"], start = clock() - start, clock()
  jax.block_until_ready(compiled(*args))
  stages["run"] = clock() - start

  def call():
    return compiled(*args)
  call.stages = stages
  return call


# ----------------------------------------------------------------------------- rows and timing

@dataclasses.dataclass
class Row:
  """One measurement. `measure`: throughput (back-to-back calls, one wait per
  window), kernel (summed CUPTI kernel durations per call), or what else a
  script records (wall, compiled_memory, timeline; runs before 2026-11-22
  also amortized, do_bench, events, tuner); `rounds`: each
  alternating round's time where there were rounds (`time_ms` is their
  median). time_ms None: the implementation could not run (note says why)."""
  case: str
  impl: str
  mode: str
  time_ms: float | None
  tflops: float | None = None
  gb_s: float | None = None
  note: str = ""
  measure: str = "throughput"
  rounds: list | None = None
  extra: dict = dataclasses.field(default_factory=dict)


def failure_note(e: BaseException) -> str:
  """An exception as one short line."""
  text = " ".join(str(e).split())
  if isinstance(e, NotImplementedError) and text:  # a reason, not a failure
    return text[:200]
  return f"{type(e).__name__}: {text}"[:200] if text else type(e).__name__


def timed_row(name: str, impl: str, mode: str, call: Callable, flops: float | None = None, *,
              gbytes: float | None = None, warmup: int = 3, reps: int = 10,
              wait: Callable = jax.block_until_ready) -> Row:
  """A throughput row of a zero-argument call (`median_time_ms`); the rate
  from `flops` (TFLOP/s) or `gbytes` read (GB/s)."""
  try:
    ms = median_time_ms(call, warmup=warmup, reps=reps, wait=wait)
  except Exception as e:  # A peer that fails shows n/a, never aborts the run.
    return Row(name, impl, mode, None, note=failure_note(e))
  return Row(name, impl, mode, ms, **rates(ms, flops, gbytes))


def rates(ms: float | None, flops: float | None = None, gbytes: float | None = None) -> dict:
  """Row keywords: TFLOP/s of `flops`, GB/s of `gbytes`, in `ms`."""
  if not ms:
    return {}
  return {"tflops": flops and flops / ms / 1e9, "gb_s": gbytes and gbytes / ms * 1e3}


def alternating_rounds(calls: dict, rounds: int, measure: Callable[[Callable], float]):
  """({key: [ms per round]}, {key: first error}): every call measured once
  per round, in turn, `rounds` times (a kernel's speed drifts by up to ~10%
  between calls; alternation exposes every side to the same drift), every
  other round in reverse order, so that no side always follows the same one
  (on an H200 a 16k fp8 forward timed right after a 16k bf16 one ran 6-8%
  slower than after other fp8 calls). A failed measurement is None."""
  samples, errors = {key: [] for key in calls}, {}
  order = list(calls.items())
  for r in range(rounds):
    for key, call in (order if r % 2 == 0 else order[::-1]):
      try:
        samples[key].append(measure(call))
      except Exception as e:  # recorded; the others go on
        samples[key].append(None)
        errors.setdefault(key, failure_note(e))
  return samples, errors


def round_ratio(of: list, over: list) -> dict | None:
  """Median and range of the per-round ratios of two sides' times."""
  values = sorted(a / b for a, b in zip(of, over) if a and b)
  if not values:
    return None
  return {"median": statistics.median(values), "range": [values[0], values[-1]],
          "rounds": len(values)}


def ratio_entry(of: tuple, over: tuple, measure: str, ratio: dict) -> dict:
  """A results-file ratio: time of `of` over time of `over`, each (case, impl, mode)."""
  key = lambda k: dict(zip(("case", "impl", "mode"), k))
  return {"of": key(of), "over": key(over), "measure": measure, **ratio}


# ----------------------------------------------------------------------------- results file

def git_commit() -> str | None:
  """This checkout's commit ("+dirty" with uncommitted changes), or None.
  `$PALLAS_ATTN_COMMIT` names it instead where the checkout's git metadata
  is not the code's (a working tree copied to another machine keeps a stale
  .git: runs on the GPU machine recorded an older commit)."""
  if os.environ.get("PALLAS_ATTN_COMMIT"):
    return os.environ["PALLAS_ATTN_COMMIT"]
  here = os.path.dirname(os.path.abspath(__file__))
  try:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, text=True,
                            capture_output=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           cwd=here, text=True, capture_output=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return None
  return commit + ("+dirty" if dirty else "")


def versions() -> dict:
  """Installed versions of the packages a benchmark may use (None: absent)."""
  found = {"python": sys.version.split()[0]}
  for name in VERSIONED:
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      found[name] = None
  return found


def environment() -> dict:
  """Device, date, versions and commit: the header of a results file."""
  devices, now = jax.devices(), datetime.datetime.now()
  return {"device": devices[0].device_kind, "device_count": len(devices),
          "platform": devices[0].platform, "date": now.date().isoformat(),
          "time": now.isoformat(timespec="seconds"), "versions": versions(),
          "commit": git_commit()}


def device_slug(count: int = 1) -> str:
  """"h200", "h100", ... ("cpu" off a GPU), "h200x2" for `count` GPUs."""
  device = jax.devices()[0]
  found = re.search(r"[a-z]\d{2,4}", device.device_kind.lower())
  slug = found.group(0) if found and device.platform == "gpu" else device.platform
  return slug + (f"x{count}" if count > 1 else "")


def write_results(path: str, benchmark: str, rows: list[Row], ratios: list = (), *,
                  env: dict | None = None, notes: str = "", small: bool = False) -> dict:
  """Writes (and returns) a results file: environment, command, rows, ratios.
  `small`: tiny shapes that check a script, no measurement to summarize."""
  doc = {"schema": SCHEMA, "benchmark": benchmark, **(env or environment()),
         "command": " ".join(sys.argv), "notes": notes, "small": small,
         "rows": [dataclasses.asdict(r) for r in rows], "ratios": list(ratios)}
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(doc, f, indent=1)
  return doc


# ----------------------------------------------------------------------------- CLI

def bench_variant(name: str, variant: dict, shape: ProblemShape, *, mode: str = "fwd",
                  impls=IMPLS, warmup: int = 3, reps: int = 10,
                  interpret: bool | None = None, seed: int = 0) -> list[Row]:
  """Throughput rows of each implementation of one variant (`variant`:
  attention kwargs; `name` a `VARIANTS` name lets peers express it)."""
  c = Case(name, name, shape, kwargs=variant)
  inputs = make_inputs(c, seed)
  flops = case_flops(c, mode, inputs.built)
  rows = []
  for impl in impls:
    try:
      call = jax_call(impl, c, mode, inputs, interpret)
    except Exception as e:  # A peer that cannot run shows n/a, never aborts the table.
      rows.append(Row(name, impl, mode, None, note=failure_note(e)))
      continue
    rows.append(timed_row(name, impl, mode, call, flops, warmup=warmup, reps=reps))
  return rows


def describe_shape(shape: ProblemShape) -> str:
  return (f"B={shape.batch} Hq={shape.heads_q} Hkv={shape.heads_kv} Sq={shape.seq_q} "
          f"Skv={shape.seq_kv} Dqk={shape.d_qk} Dv={shape.d_v} {shape.dtype}")


def _rate(r: Row) -> str:
  if r.tflops is not None:
    return f"{r.tflops:.2f} TFLOP/s"
  if r.gb_s is not None:
    return f"{r.gb_s:.0f} GB/s"
  if "bytes" in r.extra:
    return f"{r.extra['bytes'] / 2**20:.0f} MiB"
  return ""


def format_table(rows: list[Row]) -> str:
  """Fixed-width table of rows; "n/a" where an implementation could not run."""
  header = ("case", "impl", "mode", "measure", "ms", "rate", "note")
  cells = [header] + [
      (r.case, r.impl, r.mode, r.measure, "n/a" if r.time_ms is None else f"{r.time_ms:.4g}",
       _rate(r), r.note) for r in rows]
  widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                   for row in cells)


def pivot_table(rows: list[Row]) -> str:
  """A short table: one line per case and mode, one column per implementation,
  each cell its rate (TFLOP/s, else GB/s, else ms; MiB of compiled memory) by
  kernel time where measured, else by the first other measure; "n/a" where it
  could not run."""
  impls = list(dict.fromkeys(r.impl for r in rows))
  line_mode = lambda r: r.mode + (" memory" if r.measure == "compiled_memory" else "")
  lines = list(dict.fromkeys((r.case, line_mode(r)) for r in rows))
  best = {}
  for r in rows:
    key = (r.case, line_mode(r), r.impl)
    if key not in best or (r.measure == "kernel" and r.time_ms is not None):
      best[key] = r

  def cell(r: Row | None) -> str:
    if r is None:
      return ""
    if "bytes" in r.extra:
      return f"{r.extra['bytes'] / 2**20:.3g} MiB"
    if r.time_ms is None:
      return "n/a"
    number = lambda x: f"{x:.0f}" if x >= 100 else f"{x:.3g}"
    return (number(r.tflops) if r.tflops is not None else f"{number(r.gb_s)} GB/s"
            if r.gb_s is not None else f"{r.time_ms:.3g} ms")
  cells = [("case", "mode", *impls)] + [
      (case, mode, *(cell(best.get((case, mode, impl))) for impl in impls))
      for case, mode in lines]
  widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
  return "\n".join("  ".join(c.rjust(w) if i > 1 else c.ljust(w)
                             for i, (c, w) in enumerate(zip(row, widths))).rstrip()
                   for row in cells)


def format_ratios(ratios: list) -> str:
  """One line per ratio: time of one side over another's, median [range] of rounds."""
  name = lambda k: f"{k['case']} {k['impl']} {k['mode']}"
  return "\n".join(f"{name(r['of'])} / {name(r['over'])}: {r['median']:.3f} "
                   f"[{r['range'][0]:.3f}-{r['range'][1]:.3f}] ({r['measure']}, "
                   f"{r['rounds']} rounds)" for r in ratios)
