"""Where examples/train_lm.py's training step spends its time, per kernel.

Builds the example's Flax model for a variant (ours and the XLA peer, the
same weights and batch), and reports for each training step the wall time
(back-to-back steps) and the host's time to dispatch one beside the device
time of every kernel (CUPTI), grouped into attention kernels, matmuls and
the rest, with the largest kernels listed, and the span of back-to-back
steps on the device's timeline with the idle gaps in it.

    python benchmarks/profile_train_step.py --variant softcap --out DIR
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import train_lm  # noqa: E402
from kernel_time import kernel_time_ms, timeline_ms  # noqa: E402
from pallas_attn.schedule.timing import median_time_ms  # noqa: E402

_ATTENTION = ("pallas_attn", "mosaic", "attention", "flash", "fmha", "cudnn")


def profile(label, params, apply, cfg, batch, top):
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4, b2=0.95))
  step, _ = train_lm.make_step(apply, optimizer)
  opt_state = optimizer.init(params)
  run = lambda: step(params, opt_state, batch)
  compiled = step.lower(params, opt_state, batch).compile()
  hlo = compiled.as_text()
  try:  # what keeps jit's C++ dispatch path off (private; a probe)
    call = compiled._executable.unsafe_call
    dispatch_flags = dict(ordered=bool(call.ordered_effects),
                          unordered=bool(call.has_unordered_effects),
                          host_callbacks=bool(call.has_host_callbacks))
  except Exception as e:
    dispatch_flags = dict(error=str(e)[:200])
  dispatch_flags["effects"] = str(jax.make_jaxpr(step)(params, opt_state, batch).effects)
  dispatch_flags["leaves"] = len(jax.tree.leaves((params, opt_state, batch)))
  census = {op: len(re.findall(rf" {op}\(", hlo))
            for op in ("conditional", "while", "custom-call", "copy-start", "send", "recv")}
  census["custom_call_targets"] = dict(collections.Counter(
      re.findall(r'custom_call_target="([^"]+)"', hlo)))
  jax.block_until_ready(run())
  wall = median_time_ms(run, warmup=2, reps=5, window_ms=train_lm.STEP_WINDOW_MS)
  started = time.perf_counter()  # host time to dispatch a step (the device runs behind)
  outs = [run() for _ in range(5)]
  dispatch = (time.perf_counter() - started) / 5 * 1e3
  jax.block_until_ready(outs)
  total, kernels = kernel_time_ms(run, calls=5, warmup=1)
  span, idle = timeline_ms(run, calls=3, warmup=1)
  groups = collections.defaultdict(float)
  for name, ms in kernels.items():
    kind = "attention" if any(t in name.lower() for t in _ATTENTION) else (
        "gemm" if any(t in name.lower() for t in ("gemm", "cutlass", "nvjet", "sm90_xmma"))
        else "other")
    groups[kind] += ms
  largest = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
  return dict(label=label, wall_ms=wall, dispatch_ms=dispatch, kernel_ms=total, span_ms=span,
              idle_ms=idle, hlo=census,
              dispatch_flags=dispatch_flags,
              groups=dict(groups), tokens_per_s=cfg.batch * cfg.seq_len / (wall / 1e3),
              largest=[(name[:120], ms) for name, ms in largest], kernels=kernels)


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--variant", default="softcap", choices=train_lm.VARIANTS)
  parser.add_argument("--peers", default="xla")
  parser.add_argument("--top", type=int, default=12)
  parser.add_argument("--out", default=".")
  args = parser.parse_args(argv)
  cfg = train_lm.Config()
  train_ids, _, vocab = train_lm.load_corpus()
  fns = train_lm.peer_attention_fns(args.variant, cfg, args.peers.split(","))
  models = train_lm.flax_models(args.variant, cfg, vocab,
                                {p: f for p, f in fns.items() if callable(f)})
  batch = next(train_lm.batches(train_ids, cfg, 1, cfg.seed))
  results = []
  for label, (params, apply) in models.items():
    result = profile(label, params, apply, cfg, batch, args.top)
    results.append(result)
    print(f"\n{label}: wall {result['wall_ms']:.2f} ms, host dispatch {result['dispatch_ms']:.2f} ms, "
          f"kernels {result['kernel_ms']:.2f} ms, back-to-back span {result['span_ms']:.2f} ms "
          f"(idle {result['idle_ms']:.2f}) "
          f"({', '.join(f'{k} {v:.2f}' for k, v in sorted(result['groups'].items()))})")
    print(f"  compiled HLO: {result['hlo']}\n  dispatch: {result['dispatch_flags']}")
    for name, ms in result["largest"]:
      print(f"  {ms:8.3f}  {name}")
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, f"profile_train_step_{args.variant}.json"), "w") as f:
    json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind,
                   config=cfg.__dict__, results=results), f, indent=1)


if __name__ == "__main__":
  main()
