"""Tuned vs heuristic forward times on a GPU, with the time tuning took, to JSON.

  python benchmarks/bench_tune.py --out DIR

Cases: softmax attention (vanilla and causal) at d=64/128 and S=4k/16k, and
the softcap, alibi and sliding_window variants at d=128, S=4k. Each case
tunes the forward template with a capped space and budget (well under two
minutes a case; the whole run stops starting cases after --total-budget).
Writes DIR/bench_tune.json (rewritten after every case, so a cut-off run
keeps what it measured) and DIR/tuning.json (the tuning cache it filled, for
`pallas-attn cache merge`), then prints a table.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import sys
import time

import jax
import jaxlib

from pallas_attn import AttentionConfig, variants
from pallas_attn.schedule import cache as cache_lib
from pallas_attn.schedule.search_space import ProblemShape, format_config
from pallas_attn.schedule.timing import attention_flops, mask_density
from pallas_attn.schedule.tuner import tune_attention

HEADS = 16
BATCH_BY_SEQ = {4096: 4, 16384: 1}


@dataclasses.dataclass(frozen=True)
class Case:
  variant: str
  seq: int
  d: int

  @property
  def name(self) -> str:
    return f"{self.variant} S={self.seq} d={self.d}"

  def shape(self, dtype: str) -> ProblemShape:
    b, s, h, d = BATCH_BY_SEQ[self.seq], self.seq, HEADS, self.d
    return ProblemShape.from_shapes((b, s, h, d), (b, s, h, d), (b, s, h, d), dtype)


CASES = tuple(
    [Case(v, s, d) for v in ("vanilla", "causal") for d in (64, 128) for s in (4096, 16384)]
    + [Case(v, 4096, 128) for v in ("softcap", "alibi", "sliding_window")])


def run_case(case: Case, args) -> dict:
  shape = case.shape(args.dtype)
  variant = variants.by_name(case.variant, num_heads=shape.heads_q, seq_q=shape.seq_q,
                             seq_kv=shape.seq_kv).kwargs()
  progress = (lambda line: print(f"  {line}", file=sys.stderr, flush=True)) \
      if args.verbose else None
  result = tune_attention(shape.q_shape, shape.k_shape, shape.v_shape, dtype=shape.dtype,
                          **variant, template="forward", budget_s=args.budget,
                          max_candidates=args.max_candidates, progress=progress)
  density = mask_density(variant.get("mask_mod"), shape.seq_q, shape.seq_kv)
  flops = attention_flops(shape.batch, shape.heads_q, shape.seq_q, shape.seq_kv,
                          shape.d_qk, shape.d_v, density=density)
  tflops = lambda ms: None if ms is None else flops / (ms * 1e-3) / 1e12
  return {
      "case": case.name, "variant": case.variant, "shape": dataclasses.asdict(shape),
      "mask_density": density,
      "heuristic_config": result.baseline.to_dict(), "heuristic_ms": result.baseline_ms,
      "heuristic_tflops": tflops(result.baseline_ms),
      "tuned_config": result.best.to_dict(), "tuned_ms": result.best_ms,
      "tuned_tflops": tflops(result.best_ms), "speedup": result.speedup,
      "tuning_s": result.elapsed_s, "timed": sum(t.ok for t in result.trials),
      "rejected": [f"{format_config(t.config)}: {t.error}"
                   for t in result.trials if not t.ok],
      "skipped": result.skipped,
  }


def table(results: list[dict]) -> str:
  fmt = lambda x, spec: "n/a" if x is None else format(x, spec)
  lines = [f"{'case':<28} {'heur ms':>9} {'tuned ms':>9} {'speedup':>8} "
           f"{'TFLOP/s':>8} {'tune s':>7}  tuned config"]
  for r in results:
    if "error" in r:
      lines.append(f"{r['case']:<28} failed: {r['error']}")
      continue
    lines.append(
        f"{r['case']:<28} {fmt(r['heuristic_ms'], '9.3f')} {r['tuned_ms']:9.3f} "
        f"{fmt(r['speedup'], '7.2f')}x {r['tuned_tflops']:8.1f} {r['tuning_s']:7.1f}  "
        f"{format_config(AttentionConfig.from_dict(r['tuned_config']))}")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, type=pathlib.Path, help="output directory")
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
  parser.add_argument("--budget", type=float, default=15.0,
                      help="seconds per case before no new candidate starts")
  parser.add_argument("--max-candidates", type=int, default=12,
                      help="candidates per case, nearest the heuristic first")
  parser.add_argument("--total-budget", type=float, default=360.0,
                      help="seconds after which no new case starts")
  parser.add_argument("--verbose", action="store_true", help="per-candidate progress")
  args = parser.parse_args(argv)
  args.out.mkdir(parents=True, exist_ok=True)
  os.environ[cache_lib.CACHE_ENV] = str(args.out / "tuning.json")

  report = {
      "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
                   "pallas_attn": cache_lib.package_version(),
                   "python": platform.python_version()},
      "settings": {"dtype": args.dtype, "budget_s": args.budget,
                   "max_candidates": args.max_candidates, "heads": HEADS,
                   "batch_by_seq": BATCH_BY_SEQ},
      "results": [],
  }
  start = time.perf_counter()
  for case in CASES:
    if time.perf_counter() - start > args.total_budget:
      report["results"].append({"case": case.name, "error": "skipped: total budget spent"})
      continue
    print(f"{case.name} ...", flush=True)
    try:
      result = run_case(case, args)
    except Exception as e:  # Keep going: one failing case must not lose the others.
      result = {"case": case.name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    report["results"].append(result)
    (args.out / "bench_tune.json").write_text(json.dumps(report, indent=1))
  report["total_s"] = time.perf_counter() - start
  (args.out / "bench_tune.json").write_text(json.dumps(report, indent=1))
  print(f"\n{report['device']}, {args.dtype}, jax {jax.__version__}; "
        f"{report['total_s']:.0f} s in all; JSON in {args.out}")
  print(table(report["results"]))
  return 0


if __name__ == "__main__":
  sys.exit(main())
