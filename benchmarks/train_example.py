"""How fast does the example language model (examples/train_lm.py) train with
our layers against the same model on cuDNN, XLA or Equinox's attention, and
where does a training step's time go?

    python benchmarks/train_example.py --variant softcap [--framework equinox] [--profile]

Runs the example (every model from the same weights on the same batches; its
training step timed by throughput in windows of about a second), which
writes its loss curves beside the results (train_lm_*.json / .png), and a
results file with a row per model: the step's ms, tokens/s and final losses.
`--profile` (PyTorch on the GPU) adds per model the step's kernel time,
grouped into attention, matmuls and the rest, and the device timeline of
back-to-back steps: its span per step and the idle gaps in it. `--small`
runs the example's tiny configuration. Writes `train_example_<framework>_<variant>.json`.
"""
from __future__ import annotations

import collections
import os
import sys

import harness

import optax  # noqa: E402

from pallas_attn import bench  # noqa: E402
from pallas_attn.bench import Row  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import train_lm  # noqa: E402

ATTENTION_KERNELS = ("pallas_attn", "mosaic", "attention", "flash", "fmha", "cudnn")
MATMUL_KERNELS = ("gemm", "cutlass", "nvjet", "sm90_xmma")


def profile_rows(case: str, args, record: dict) -> list[Row]:
  """Kernel time by group and the device timeline of each model's step."""
  cfg = train_lm.Config(**record["config"])
  train_ids, _, vocab = train_lm.load_corpus()
  if args.framework == "equinox":
    models = train_lm.equinox_models(args.variant, cfg, vocab)
  else:
    fns = train_lm.peer_attention_fns(args.variant, cfg, [p for p in record["results"]
                                                          if p != "pallas_attn"])
    models = train_lm.flax_models(args.variant, cfg, vocab, fns)
  batch = next(train_lm.batches(train_ids, cfg, 1, cfg.seed))
  rows = []
  for label, (params, apply) in models.items():
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4, b2=0.95))
    step, _ = train_lm.make_step(apply, optimizer)
    opt_state = optimizer.init(params)
    run = lambda: step(params, opt_state, batch)
    try:
      total, kernels = harness.kernel_time_ms(run, calls=5, warmup=1)
      span, idle = harness.timeline_ms(run, calls=3, warmup=1)
    except Exception as e:  # no PyTorch on a GPU: the rows say why
      rows.append(Row(case, label, "train_step", None, measure="kernel",
                      note=bench.failure_note(e)))
      continue
    groups = collections.defaultdict(float)
    for name, ms in kernels.items():
      lower = name.lower()
      groups["attention" if any(t in lower for t in ATTENTION_KERNELS) else
             "matmul" if any(t in lower for t in MATMUL_KERNELS) else "other"] += ms
    largest = sorted(kernels.items(), key=lambda item: -item[1])[:args.top]
    rows.append(Row(case, label, "train_step", total, measure="kernel", extra={
        "groups": dict(groups), "largest": [(name[:120], ms) for name, ms in largest]}))
    rows.append(Row(case, label, "train_step", span, measure="timeline",
                    extra={"idle_ms": idle}))
  return rows


def main(argv=None):
  parser = harness.parser(__doc__.splitlines()[0], rounds=0)
  parser.add_argument("--variant", default="vanilla", choices=train_lm.VARIANTS)
  parser.add_argument("--framework", default="flax", choices=("flax", "equinox"))
  parser.add_argument("--steps", type=int, default=None, help="training steps (example: 100)")
  parser.add_argument("--peers", default="auto", help="as the example's --peers")
  parser.add_argument("--profile", action="store_true", help="kernel groups and timeline")
  parser.add_argument("--top", type=int, default=12, help="largest kernels kept per model")
  args = parser.parse_args(argv)
  out = args.out or harness.default_out_dir(small=args.small)
  example_args = ["--variant", args.variant, "--framework", args.framework, "--out", out]
  example_args += (["--tiny"] if args.small else []) + (
      ["--steps", str(args.steps)] if args.steps else []) + (
      ["--peers", args.peers] if args.framework == "flax" else [])
  record = train_lm.main(example_args)
  case = f"train_lm_{args.framework}_{args.variant}"
  rows = [Row(case, label, "train_step", result.get("step_ms"), note="" if "step_ms" in result
              else "not timed off a GPU", extra={
                  "tokens_per_s": result.get("tokens_per_s"), "final_loss": result["losses"][-1],
                  "val_loss": result["val_loss"]})
          for label, result in record["results"].items()]
  rows += [Row(case, label, "train_step", None, note=reason)
           for label, reason in record["skipped"].items()]
  if args.profile:
    rows += profile_rows(case, args, record)
  args.out, args.tag = out, args.tag or f"{args.framework}_{args.variant}"
  harness.finish(args, "train_example", rows, notes=f"config {record['config']}")


if __name__ == "__main__":
  main()
