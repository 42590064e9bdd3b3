"""How fast do attention variants train, forward and forward+backward, against
cuDNN, FlexAttention, SDPA, our Triton template and JAX's own Pallas kernels?

    python benchmarks/training.py --suite variants --modes fwd --rounds 3
    python benchmarks/training.py --suite terms masks causal pallas_ref
    python benchmarks/training.py --suite memory tune
    python benchmarks/training.py --small --cases vanilla_4k causal_4k   # CPU check

Suites (bf16, 16 heads; a case's batch holds 16k tokens unless named):
* variants: issue 15's rows, B4 S4k or B1 S16k d128, and d 64 / 256 / Dqk 192:
  ours on Mosaic GPU against cuDNN, Flex, SDPA, our Triton template and JAX's
  Mosaic GPU attention (fp16, forward).
* terms: issue 14's computed-index captures (a relative-position table, T5
  buckets) and sinks, beside ALiBi and causal attention, against Flex; the
  `_dtable` cases also differentiate the table. Ratios: table / ALiBi,
  sink / causal.
* masks: the masked variants against Flex, cuDNN (a dense bias or mask where
  it has no mask type) and XLA, forward.
* causal: causal against dense attention at S 4k / 8k / 16k and sliding
  windows at 16k, with JAX's Pallas `mha` and cuDNN, forward.
* user_4k, user_16k: every built-in variant in both mask forms and the
  README's recipes (`USER_VARIANTS`), B4 S4k / B1 S16k d128, against Flex and
  cuDNN; each row keeps its first call's seconds and stages (trace, lower,
  compile, run), the latency a user pays per variant (user_4k adds an fp32
  Dqk 192 / Dv 128 case for that).
* pallas_ref: softmax, d 64 / 128, causal or not, S 1k / 4k / 16k, against
  JAX's Pallas `mha` and cuDNN.
* memory: XLA's compiled bytes (temporaries + outputs) of the forward and
  forward+backward at S 16k and 64k (B1 H16 d128): linear in S.
* tune: tuned against heuristic forward configs, and the time tuning takes.
* fp8: issue 40's prefill rows, ours on e4m3 q, k, v (per-head descales)
  against ours and cuDNN in bf16, forward; each fp8 row's `extra` holds the
  errors of `fp8_accuracy`.

Every measurement of a suite is timed by throughput; with PyTorch on the
GPU, also by kernel time in `--rounds` alternating rounds (a suite's rounds
alternate over each case, or over all its cases where it has cross-case
ratios). Writes `training_<suites>.json` to `--out`.
"""
from __future__ import annotations

import dataclasses
import os
import time

import harness

import jax  # noqa: E402 (after harness: it sets JAX's memory for PyTorch)
import jax.numpy as jnp  # noqa: E402

from pallas_attn import bench  # noqa: E402
from pallas_attn.bench import Row, case  # noqa: E402

TOKENS = 16384


def softmax_case(variant: str, seq: int, d: int = 128) -> bench.Case:
  """Softmax attention at S `seq`, batch 16k tokens / S (at least 1)."""
  return case(f"{variant}_{bench.seq_name(seq)}" + (f"_d{d}" if d != 128 else ""), variant,
              max(1, TOKENS // seq), seq, d_qk=d)


# Every built-in variant in both mask forms where it has two, and the README's
# recipes (issue 37's table; `bench.VARIANTS` says what each is).
USER_VARIANTS = (
    "vanilla", "causal", "softcap", "softcap_causal", "alibi", "alibi_causal",
    "window256_bidir", "window256", "documents8_bidir", "documents8", "sigmoid",
    "sigmoid_causal", "relu", "relu_causal", "prefix_lm", "sink_bidir", "sink", "off_by_one",
    "off_by_one_causal", "retention", "abs_clamp", "abs_clamp_causal", "softcap_documents8",
    "gemma2_local")
CASES = {c.name: c for c in [
    *(softmax_case(v, s, d) for v in ("vanilla", "causal") for d in (64, 128)
      for s in (1024, 4096, 8192, 16384, 65536) if d == 128 or s < 65536),
    *(softmax_case(v, 4096) for v in ("softcap", "alibi", "alibi_causal", "window256",
                                      "window1024", "documents8", "sigmoid", "rel_table",
                                      "t5_buckets", "sink")),
    softmax_case("window256", 16384), softmax_case("window1024", 16384),
    case("vanilla_4k_dqk192", "vanilla", 4, 4096, d_qk=192, d_v=128),
    softmax_case("vanilla", 4096, 256),
    *(softmax_case(v, s) for v in USER_VARIANTS for s in (4096, 16384)),
    case("alibi_causal_4k_fp32_dqk192", "alibi_causal", 4, 4096, d_qk=192, d_v=128,
         dtype="float32"),
    case("rel_table_dtable_4k", "rel_table", 4, 4096, grad_params=True),
    case("t5_buckets_dtable_4k", "t5_buckets", 4, 4096, grad_params=True),
]}


@dataclasses.dataclass(frozen=True)
class Suite:
  """Cases, the implementations compared (ours first) and modes; `together`:
  one set of rounds over all cases (for `pairs`, cross-case time ratios);
  `accuracy`: errors per case, added to its first implementation's rows."""
  cases: tuple
  impls: tuple
  modes: tuple = bench.MODES
  together: bool = False
  pairs: tuple = ()
  accuracy: object = None


def fp8_accuracy(c: bench.Case) -> dict:
  """Relative errors (Frobenius) of the fp8 call against float32 attention
  on its dequantized inputs (`fp8_vs_dequantized`: the kernel's own) and on
  the bf16 inputs it was quantized from (`fp8_vs_bf16_inputs`: the
  quantization's too), beside the bf16 call's against float32 attention on
  its inputs (`bf16_vs_f32`); on the case's inputs and with channel 3 of k
  and v scaled by 20 (`_outliers`). One sequence and two heads, so that the
  reference's scores fit; q, k, v are float32 normals rounded to bf16, as
  in decoding.fp8_accuracy (normals drawn in bf16 take few distinct values,
  whose e4m3 rounding errors add up: 5-17% against about 4%)."""
  import numpy as np
  from pallas_attn import attention, attention_reference
  from pallas_attn.fp8 import quantize_fp8
  inputs = bench.make_inputs(dataclasses.replace(c, shape=dataclasses.replace(
      c.shape, dtype="float32")))
  kwargs = inputs.built.kwargs(inputs.built.params)
  part = lambda x: x[:1, :, :2].astype(jnp.bfloat16)
  err = lambda x, ref: harness.rel_err([np.asarray(x, np.float32)], [ref])
  found = {}
  for label, boost in (("", 1.0), ("_outliers", 20.0)):
    q, k, v = (part(x) for x in (inputs.q, inputs.k, inputs.v))
    k, v = (x.at[..., 3].multiply(boost) for x in (k, v))
    quantized = [quantize_fp8(x) for x in (q, k, v)]
    real = [x8.astype(jnp.float32) * d[:, None, :, None] for x8, d in quantized]
    (q8, qd), (k8, kd), (v8, vd) = quantized
    fp8 = attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, **kwargs)
    reference = lambda *xs: np.asarray(attention_reference(*(x.astype(jnp.float32) for x in xs),
                                                           **kwargs))
    found[f"fp8_vs_dequantized{label}"] = err(fp8, reference(*real))
    found[f"fp8_vs_bf16_inputs{label}"] = err(fp8, reference(q, k, v))
    found[f"bf16_vs_f32{label}"] = err(attention(q, k, v, **kwargs), reference(q, k, v))
  return found


def _pairs(ours: str, pairs, modes=bench.MODES):
  return tuple(((of, ours, m), (over, ours, m)) for of, over in pairs for m in modes)


SUITES = {
    "variants": Suite(
        ("vanilla_4k", "causal_4k", "vanilla_16k", "causal_16k", "softcap_4k",
         "alibi_causal_4k", "window256_4k", "window1024_4k", "documents8_4k", "sigmoid_4k",
         "vanilla_4k_dqk192", "vanilla_4k_d64", "vanilla_4k_d256"),
        ("pallas_attn:mosaic_gpu", "cudnn", "flex", "sdpa", "pallas_attn:triton",
         "jax_mosaic_fp16")),
    "terms": Suite(
        ("alibi_causal_4k", "rel_table_4k", "t5_buckets_4k", "causal_4k", "sink_4k",
         "rel_table_dtable_4k", "t5_buckets_dtable_4k"), ("pallas_attn", "flex"), together=True,
        pairs=_pairs("pallas_attn", [("rel_table_4k", "alibi_causal_4k"),
                                     ("t5_buckets_4k", "alibi_causal_4k"),
                                     ("sink_4k", "causal_4k")])
        + _pairs("pallas_attn", [("rel_table_dtable_4k", "rel_table_4k"),
                                 ("t5_buckets_dtable_4k", "t5_buckets_4k")], ("fwd_bwd",))),
    "masks": Suite(
        ("vanilla_4k", "causal_4k", "softcap_4k", "alibi_4k", "window256_4k", "window1024_4k",
         "documents8_4k"), ("pallas_attn", "flex", "cudnn:dense", "xla"), ("fwd",)),
    "causal": Suite(
        ("vanilla_4k", "causal_4k", "vanilla_8k", "causal_8k", "vanilla_16k", "causal_16k",
         "window256_16k", "window1024_16k"), ("pallas_attn", "jax_pallas_mha", "cudnn"),
        ("fwd",), together=True,
        pairs=_pairs("pallas_attn", [(f"{v}_{s}", f"vanilla_{s}") for s in ("4k", "8k", "16k")
                                     for v in ("causal", "window256", "window1024")
                                     if v == "causal" or s == "16k"], ("fwd",))),
    # issue 37: every user variant against Flex and cuDNN; each row's first call and its
    # stages (`first_call_s`, `trace_s`, ...) are the compile latency a user pays
    **{f"user_{seq}": Suite(tuple(f"{v}_{seq}" for v in USER_VARIANTS)
                            + (("alibi_causal_4k_fp32_dqk192",) if seq == "4k" else ()),
                            ("pallas_attn", "flex", "cudnn")) for seq in ("4k", "16k")},
    "fp8": Suite(
        ("vanilla_4k", "causal_4k", "vanilla_16k", "causal_16k", "softcap_4k", "rel_table_4k"),
        ("pallas_attn_fp8", "pallas_attn", "cudnn"), ("fwd",), accuracy=fp8_accuracy),
    "pallas_ref": Suite(
        tuple(f"{v}_{bench.seq_name(s)}" + ("_d64" if d == 64 else "") for d in (64, 128)
              for v in ("vanilla", "causal") for s in (1024, 4096, 16384)),
        ("pallas_attn", "cudnn", "jax_pallas_mha")),
}
MEMORY_CASES = ("vanilla_16k", "causal_16k", "vanilla_64k", "causal_64k")
MEMORY_IMPLS = ("pallas_attn:mosaic_gpu", "pallas_attn:triton", "cudnn", "xla")
TUNE_CASES = tuple(f"{v}_{s}" + ("_d64" if d == 64 else "") for v in ("vanilla", "causal")
                   for d in (64, 128) for s in ("4k", "16k")) + ("softcap_4k", "alibi_4k",
                                                                  "window256_4k")


def run_suite(suite: Suite, args, budget, checkpoint=lambda rows, ratios: None
              ) -> tuple[list[Row], list]:
  cases = [CASES[n] for n in suite.cases if not args.cases or n in args.cases]
  if args.small:
    cases = [bench.shrink(c) for c in cases]
  items = [(c, m) for c in cases for m in suite.modes if m in args.modes
           and not (c.grad_params and m == "fwd")]
  impls = list(args.impls or suite.impls)
  groups = [items] if suite.together else [[i for i in items if i[0] is c] for c in cases]
  rows, ratios = [], []
  for group in filter(None, groups):
    r, q = harness.measure(group, impls, rounds=args.rounds, budget=budget, pairs=suite.pairs)
    if suite.accuracy:
      for c in {c.name: c for c, _ in group}.values():
        errors = suite.accuracy(c)
        for row in r:
          if row.case == c.name and row.impl == impls[0]:
            row.extra.update(errors)
    rows += r
    ratios += q
    checkpoint(rows, ratios)  # this suite's cases so far
  return rows, ratios


def memory_rows(args) -> list[Row]:
  """Compiled bytes (temporaries + outputs) of each implementation's forward
  and forward+backward, from abstract inputs (nothing is allocated)."""
  rows = []
  for name in MEMORY_CASES:
    if args.cases and name not in args.cases:
      continue
    c = bench.shrink(CASES[name], seq=256 if "64k" in name else 64) if args.small else CASES[name]
    built, s = c.build(), c.shape
    q, k, v = (jax.ShapeDtypeStruct(x, s.dtype) for x in (s.q_shape, s.k_shape, s.v_shape))
    for impl in args.impls or MEMORY_IMPLS:
      for mode in args.modes:
        try:
          forward, params = bench.jax_forward(impl, c, built)
          fn = forward if mode == "fwd" else jax.grad(
              lambda q, k, v, p: jnp.sum(forward(q, k, v, p).astype(jnp.float32)), (0, 1, 2))
          stats = jax.jit(fn).lower(q, k, v, params).compile().memory_analysis()
          size = int(stats.temp_size_in_bytes + stats.output_size_in_bytes)
          rows.append(Row(c.name, impl, mode, None, measure="compiled_memory",
                          extra={"bytes": size}))
        except Exception as e:  # e.g. XLA's dense scores at 64k do not fit
          rows.append(Row(c.name, impl, mode, None, measure="compiled_memory",
                          note=bench.failure_note(e)))
  return rows


def tune_rows(args, budget, out: str) -> list[Row]:
  """Tuned against heuristic configs of the forward template that runs each
  case (12 s and 10 candidates per case), into a cache file of its own."""
  from pallas_attn import analyze_variant
  from pallas_attn.cli import running_templates
  from pallas_attn.schedule import cache as cache_lib
  from pallas_attn.tuning import tune_attention
  os.environ[cache_lib.CACHE_ENV] = os.path.join(out, "tuning_cache.json")
  rows = []
  for name in TUNE_CASES:
    if args.cases and name not in args.cases:
      continue
    c = bench.shrink(CASES[name]) if args.small else CASES[name]
    if budget.spent():
      rows.append(Row(c.name, "tuned", "fwd", None, note="skipped: time budget"))
      continue
    s, built = c.shape, c.build()
    kwargs = built.kwargs(None)
    template = running_templates(analyze_variant(**kwargs), s)[0]
    started = time.perf_counter()
    try:
      result = tune_attention(s.q_shape, s.k_shape, s.v_shape, dtype=s.dtype, **kwargs,
                              template=template, budget_s=12.0, max_candidates=10)
    except Exception as e:  # one failing case must not lose the others
      rows.append(Row(c.name, "tuned", "fwd", None, note=bench.failure_note(e)))
      continue
    flops = bench.case_flops(c, "fwd", built)
    for impl, ms, config in (("heuristic", result.baseline_ms, result.baseline),
                             ("tuned", result.best_ms, result.best)):
      rows.append(Row(c.name, impl, "fwd", ms, **bench.rates(ms, flops), extra={
          "template": template, "config": config.to_dict(),
          "tuning_s": time.perf_counter() - started}))
  return rows


def main(argv=None):
  parser = harness.parser(__doc__.splitlines()[0])
  parser.add_argument("--suite", nargs="+", default=["variants"],
                      choices=[*SUITES, "memory", "tune"])
  parser.add_argument("--modes", nargs="+", default=list(bench.MODES), choices=bench.MODES)
  parser.add_argument("--cases", nargs="+", default=None, help="only these cases")
  parser.add_argument("--impls", nargs="+", default=None,
                      help="implementations, ours first (default: the suite's)")
  args = parser.parse_args(argv)
  args.tag = args.tag or "_".join(args.suite + (args.modes if len(args.modes) == 1 else []))
  out = args.out or harness.default_out_dir(small=args.small)
  budget = harness.Budget(args.budget_s)
  rows, ratios = [], []
  for name in args.suite:
    if name == "memory":
      rows += memory_rows(args)
    elif name == "tune":
      rows += tune_rows(args, budget, out)
    else:
      suite_rows, suite_ratios = run_suite(
          SUITES[name], args, budget,
          lambda r, q: harness.checkpoint(args, "training", rows + r, ratios + q))
      rows += suite_rows
      ratios += suite_ratios
  harness.finish(args, "training", rows, ratios)


if __name__ == "__main__":
  main()
