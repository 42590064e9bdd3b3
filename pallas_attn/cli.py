"""pallas-attn: tune, benchmark and explain attention variants; manage the tuning cache.

  pallas-attn tune causal --seq-q 4096 --d-qk 128 --budget 60
  pallas-attn bench vanilla causal softcap --seq-q 4096
  pallas-attn explain my_variant.py --seq-q 2048
  pallas-attn explain-linear --decay step --batch 4 --heads 16 --seq-q 4096 --d-qk 128
  pallas-attn tune-linear --decay step --batch 4 --heads 16 --seq-q 4096 --budget 120
  pallas-attn demo ...
  pallas-attn cache list | clear | export PATH | merge PATH

A variant is a built-in name (`pallas_attn.variants.NAMES`) or a Python file
that defines `VARIANT` (a Variant) or any of `score_mod`, `mask_mod`,
`rownorm`.
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys

from pallas_attn import bench as bench_lib
from pallas_attn import _templates
from pallas_attn.schedule import cache as cache_lib
from pallas_attn.schedule import template as template_lib
from pallas_attn.schedule.search_space import format_config, search_space
from pallas_attn.schedule.template import ProblemShape
from pallas_attn.tuning import (ATTENTION_TEMPLATES, LINEAR_DECAYS, LINEAR_MODES,
                                linear_decay_shape, tune_attention, tune_linear_attention)

DTYPES = ("bfloat16", "float16", "float32")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")  # explain only: an fp8 prefill's q, k, v
_FILE_NAMES = ("score_mod", "mask_mod", "rownorm")


class UsageError(Exception):
  """A bad argument found after parsing (unknown variant, unreadable file, ...)."""


def _positive_int(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
  return value


def _positive_float(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
  if not value > 0:
    raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
  return value


def _load_variant_file(path: pathlib.Path) -> dict:
  if not path.is_file():
    raise UsageError(f"no such variant file: {path}")
  spec = importlib.util.spec_from_file_location(f"_pallas_attn_variant_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except Exception as e:  # The user's file: report whatever it raised.
    raise UsageError(f"cannot load variant file {path}: {type(e).__name__}: {e}") from e
  if hasattr(module, "VARIANT"):
    return dict(module.VARIANT.kwargs())
  found = {name: getattr(module, name) for name in _FILE_NAMES if hasattr(module, name)}
  if not found:
    raise UsageError(f"{path} defines neither VARIANT nor any of {', '.join(_FILE_NAMES)}")
  return found


def load_variant(spec: str, shape: ProblemShape) -> dict:
  """The attention kwargs (score_mod, mask_mod, rownorm) of a variant name or .py file."""
  path = pathlib.Path(spec)
  if spec.endswith(".py") or path.exists():
    return _load_variant_file(path)
  from pallas_attn import variants
  if spec not in variants.NAMES:
    raise UsageError(f"unknown variant {spec!r}; known variants: "
                     f"{', '.join(variants.NAMES)} (or a path to a .py file)")
  return dict(variants.by_name(spec, num_heads=shape.heads_q, seq_q=shape.seq_q,
                               seq_kv=shape.seq_kv).kwargs())


def _shape(args) -> ProblemShape:
  heads_kv = args.kv_heads or args.heads
  if args.heads % heads_kv:
    raise UsageError(f"--heads {args.heads} is not a multiple of --kv-heads {heads_kv}")
  seq_kv, d_v = args.seq_kv or args.seq_q, args.d_v or args.d_qk
  return ProblemShape.from_shapes(
      (args.batch, args.seq_q, args.heads, args.d_qk),
      (args.batch, seq_kv, heads_kv, args.d_qk),
      (args.batch, seq_kv, heads_kv, d_v), args.dtype)


def _chosen_config(template: str, analysis, shape: ProblemShape):
  """The config `attention(config="auto")` would use, and where it came from."""
  config = cache_lib.lookup_config(template, analysis.fingerprint(), q_shape=shape.q_shape,
                                   k_shape=shape.k_shape, v_shape=shape.v_shape,
                                   dtype=shape.dtype)
  if config is not None:
    return config, "from the tuning cache"
  return (template_lib.get(template).default_config(
      shape, block_sparse=analysis.mask_mod is not None,
      scores_per_position=analysis.scores_per_position), "heuristic (no tuned cache entry)")


def running_templates(analysis, shape: ProblemShape) -> list[str]:
  """The forward and backward templates `attention` runs here for this call
  (the split-KV template's forward for a few queries)."""
  from pallas_attn import split_kv
  from pallas_attn.kernels import backend, lowering
  choice = lowering.choose(None, analysis, shape.dtype, shape.d_qk, shape.d_v,
                           backend.default_interpret())
  forward = (_templates.DECODE if split_kv.prefers_split_kv(shape.seq_q, shape.seq_kv)
             else _templates.FORWARD[choice.forward])
  return [forward.name, _templates.BACKWARD[choice.backward].name]


def _progress(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


def cmd_tune(args) -> int:
  from pallas_attn.schedule.device import current_device_kind
  from pallas_attn.spec.analysis import analyze_variant
  shape = _shape(args)
  variant = load_variant(args.variant, shape)
  if args.template is None:
    args.template = running_templates(
        analyze_variant(**{k: v for k, v in variant.items() if k != "sinks"}), shape)[0]
  print(f"tuning {args.variant} ({args.template}) for {bench_lib.describe_shape(shape)} "
        f"on {current_device_kind()}, budget {args.budget:g} s", flush=True)
  try:
    result = tune_attention(
        shape.q_shape, shape.k_shape, shape.v_shape, dtype=shape.dtype, **variant,
        template=args.template, budget_s=args.budget, max_candidates=args.max_candidates,
        store=not args.no_store, progress=_progress)
  except RuntimeError as e:
    print(f"pallas-attn: tuning failed: {e}", file=sys.stderr)
    return 1
  return _report_tuning(result, args)


def _report_tuning(result, args) -> int:
  """Prints what a tuning run timed, the winner against the heuristic, and where it went."""
  tried = sum(t.ok for t in result.trials)
  print(f"timed {tried} of {len(result.trials) + result.skipped} configs in "
        f"{result.elapsed_s:.1f} s ({result.skipped} skipped by the budget)")
  print(f"best:      {format_config(result.best)}  {result.best_ms:.4g} ms")
  if result.baseline_ms is None:
    print(f"heuristic: {format_config(result.baseline)}  failed "
          f"({result.trials[0].error})")
  else:
    print(f"heuristic: {format_config(result.baseline)}  {result.baseline_ms:.4g} ms")
    print(f"speedup over the heuristic: {result.speedup:.2f}x")
  if not args.no_store:
    print(f"stored in {cache_lib.default_cache_path()}")
  return 0


def cmd_tune_linear(args) -> int:
  """Tunes linear_attention's tiles for a decay form and shape; stores the winner."""
  from pallas_attn.schedule.device import current_device_kind
  shape = _shape(args)
  print(f"tuning linear attention, decay {args.decay}{', delta rule' if args.delta else ''}"
        f"{', normalize' if args.normalize else ''} ({args.mode}) for "
        f"{bench_lib.describe_shape(shape)} on {current_device_kind()}, budget "
        f"{args.budget:g} s", flush=True)
  try:
    result = tune_linear_attention(
        shape.q_shape, shape.v_shape, decay=args.decay, delta=args.delta,
        normalize=args.normalize, dtype=shape.dtype, mode=args.mode, budget_s=args.budget,
        max_candidates=args.max_candidates, store=not args.no_store, progress=_progress)
  except RuntimeError as e:
    print(f"pallas-attn: tuning failed: {e}", file=sys.stderr)
    return 1
  return _report_tuning(result, args)


def cmd_bench(args) -> int:
  shape = _shape(args)
  variants = [(name, load_variant(name, shape)) for name in args.variants]
  print(f"{bench_lib.describe_shape(shape)}, {args.mode}", flush=True)
  rows = []
  for name, variant in variants:
    rows += bench_lib.bench_variant(name, variant, shape, mode=args.mode,
                                    impls=args.impls, warmup=args.warmup, reps=args.reps)
  print(bench_lib.format_table(rows))
  if args.json:
    bench_lib.write_results(args.json, "cli", rows)
    print(f"wrote {args.json}")
  return 0


def _describe_terms(template: str, analysis, shape: ProblemShape, config) -> str:
  """What the hoisted terms cost in one pass (sequence lengths padded to
  this pass's blocks; the call pads to both passes'): the Triton templates
  load bank tiles, the Mosaic GPU ones read the terms' vectors as pairs."""
  from pallas_attn.kernels import lowering, tiles
  from pallas_attn.schedule.config import round_up
  seq_q, seq_kv = round_up(shape.seq_q, config.block_q), round_up(shape.seq_kv, config.block_k)
  if template_lib.get(template).lowering == lowering.MOSAIC_GPU:
    size = tiles.term_bytes(analysis, shape.heads_q, seq_q, seq_kv)
    return (f"diagonal terms: read as neighbour pairs of their float32 vectors over q - kv "
            f"([heads, Sq + Skv - 1, 2] per term, {size / 2**10:.0f} KiB), one load per pair a "
            f"thread's tile holds; no bank")
  size = tiles.term_bytes(analysis, shape.heads_q, seq_q, seq_kv, config.block_k)
  return (f"diagonal banks: {size / 2**20:.0f} MiB of float32 built per call "
          f"([heads, Sq + Skv, {config.block_k}] per term; linear in S)")


def cmd_explain(args) -> int:
  from pallas_attn.schedule.device import device_config
  from pallas_attn.spec.analysis import analyze_variant
  fp8_dtype = args.dtype if args.dtype in FP8_DTYPES else None
  if fp8_dtype:  # prepared as the bfloat16 call of its dequantized inputs (api.attention)
    args.dtype = "bfloat16"
  shape = _shape(args)
  variant = load_variant(args.variant, shape)
  sinks = variant.pop("sinks", None)
  analysis = analyze_variant(**variant)
  device = device_config()
  print(f"variant {args.variant}")
  print(analysis.describe())
  from pallas_attn.kernels import backend, lowering
  chosen = lowering.choose(None, analysis, shape.dtype, shape.d_qk, shape.d_v,
                           backend.default_interpret())
  print(chosen.describe())
  from pallas_attn import split_kv
  print(split_kv.describe_dispatch(analysis, shape.q_shape, shape.k_shape, shape.v_shape,
                                   shape.dtype))
  if analysis.mask_mod is not None and not split_kv.prefers_split_kv(shape.seq_q, shape.seq_kv):
    from pallas_attn.kernels.block_mask import describe_build
    print(describe_build(analysis, shape.batch, shape.heads_q, shape.seq_q, shape.seq_kv))
  if sinks is not None:
    print(f"sinks: {list(sinks.shape)} logits, one per query head, start each row's softmax state")
  if fp8_dtype:
    from pallas_attn import _templates, fp8
    config, _ = _chosen_config(_templates.FORWARD[chosen.forward].name, analysis, shape)
    d_qk, d_v = lowering.padded_head_dims(shape.d_qk, shape.d_v, chosen.forward, chosen.backward)
    config, why = fp8.tensor_core_tiles(
        fp8_dtype, analysis, config, chosen.forward, d_qk, d_v, shape.seq_q,
        parallel=not split_kv.prefers_split_kv(shape.seq_q, shape.seq_kv))
    print(fp8.prefill_note(why, analysis) + ("" if why else f"; tiles {format_config(config)}"))
  print(f"shape {bench_lib.describe_shape(shape)}; device {device.kind} ({device.name} entry)")
  for template in args.templates or running_templates(analysis, shape):
    config, source = _chosen_config(template, analysis, shape)
    print(f"{template}: {format_config(config)}  [{source}]")
    if template == "forward_mosaic":
      from pallas_attn.kernels import mosaic_forward
      print("  " + mosaic_forward.describe_grid(analysis, config, shape.batch, shape.heads_q,
                                                shape.seq_q, shape.seq_kv, device.sm_count))
    if template == "backward_mosaic":
      from pallas_attn.vjp import mosaic_backward
      d_qk, d_v = lowering.padded_head_dims(shape.d_qk, shape.d_v, lowering.MOSAIC_GPU)
      print("  " + mosaic_backward.describe_dq_programs(analysis, config, shape.seq_q, d_qk, d_v))
    if template != "decode" and analysis.score_mod is not None and analysis.score_mod.terms:
      print("  " + _describe_terms(template, analysis, shape, config))
    reason = template_lib.get(template).prune_reason(config, shape, device)
    if reason:
      print(f"  warning: the resource model rejects it: {reason}")
    print("  " + search_space(template, shape, device,
                              block_sparse=analysis.mask_mod is not None,
                              scores_per_position=analysis.scores_per_position).summary(
        verbose=args.verbose).replace("\n", "\n  "))
  return 0


def cmd_explain_linear(args) -> int:
  """Which lowering `linear_attention` runs at a shape, and why."""
  import jax.numpy as jnp
  from pallas_attn.linear import linear_attention_lowering
  shape = _shape(args)
  batch, seq, heads, _ = shape.q_shape
  dtype = jnp.dtype(args.dtype)
  q, v = jnp.zeros(shape.q_shape, dtype), jnp.zeros(shape.v_shape, dtype)
  gate_shape = linear_decay_shape(args.decay, shape.q_shape)
  log_decay = None if gate_shape is None else jnp.zeros(gate_shape, jnp.float32)
  beta = jnp.zeros((batch, seq, heads), dtype) if args.delta else None
  lowering = linear_attention_lowering(q, q, v, log_decay=log_decay, beta=beta,
                                       normalize=args.normalize)
  print(f"linear attention, decay {args.decay}{', delta rule' if args.delta else ''}"
        f"{', normalize' if args.normalize else ''}; shape {bench_lib.describe_shape(shape)}")
  print(lowering.describe())
  return 0


def cmd_demo(args) -> int:
  from pallas_attn import demo
  return demo.main(args.extra)


def _add_tuning_args(parser) -> None:
  parser.add_argument("--budget", type=_positive_float, default=60.0, metavar="SECONDS",
                      help="stop starting new candidates after this long (default 60)")
  parser.add_argument("--max-candidates", type=_positive_int, default=None, metavar="N",
                      help="time at most the N candidates nearest the heuristic")
  parser.add_argument("--no-store", action="store_true", help="do not write the cache")


def _add_linear_args(parser) -> None:
  parser.add_argument("--decay", choices=LINEAR_DECAYS, default="step",
                      help="log_decay's form: none, one per head, per step and head, "
                      "per key feature (GLA)")
  parser.add_argument("--delta", action="store_true", help="the delta rule (beta given)")
  parser.add_argument("--normalize", action="store_true")


def _format_entry(entry: dict) -> str:
  key = entry.get("key", {})
  time_ms, baseline_ms = entry.get("time_ms"), entry.get("baseline_ms")
  timing = "" if time_ms is None else f"  {time_ms:.4g} ms"
  if time_ms and baseline_ms:
    timing += f" ({baseline_ms / time_ms:.2f}x)"
  return (f"{key.get('template')}  fp={key.get('fingerprint')}  "
          f"BH<={key.get('batch_heads')} group={key.get('group')} Sq<={key.get('seq_q')} "
          f"Skv<={key.get('seq_kv')} Dqk={key.get('d_qk')} Dv={key.get('d_v')} "
          f"{key.get('dtype')}  {key.get('device_kind')}  jax {key.get('jax_version')} "
          f"pallas_attn {key.get('pallas_attn_version')}\n"
          f"    {' '.join(f'{k}={v}' for k, v in entry.get('config', {}).items())}{timing}")


def cmd_cache(args) -> int:
  cache = cache_lib.get_cache()
  try:
    if args.action == "list":
      entries = cache.entries()
      print(f"{cache.path}: {len(entries)} entries")
      for key in sorted(entries):
        print(_format_entry(entries[key]))
    elif args.action == "clear":
      print(f"removed {cache.clear()} entries from {cache.path}")
    elif args.action == "export":
      print(f"exported {cache.export(args.path)} entries to {args.path}")
    else:
      print(f"merged {cache.merge(args.path)} entries from {args.path} into {cache.path}")
  except cache_lib.CacheFileError as e:
    print(f"pallas-attn: error: {e}", file=sys.stderr)
    return 1
  return 0


def _add_shape_args(parser: argparse.ArgumentParser, seq: int, dtypes=DTYPES) -> None:
  group = parser.add_argument_group("shape")
  group.add_argument("--batch", type=_positive_int, default=1)
  group.add_argument("--heads", type=_positive_int, default=8, help="query heads")
  group.add_argument("--kv-heads", type=_positive_int, default=None,
                     help="key/value heads (default: --heads)")
  group.add_argument("--seq-q", type=_positive_int, default=seq)
  group.add_argument("--seq-kv", type=_positive_int, default=None,
                     help="default: --seq-q")
  group.add_argument("--d-qk", type=_positive_int, default=64)
  group.add_argument("--d-v", type=_positive_int, default=None, help="default: --d-qk")
  group.add_argument("--dtype", choices=dtypes, default="bfloat16")


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="pallas-attn", description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  variant_help = "a built-in variant name or a .py file defining one"

  tune = commands.add_parser("tune", help="tune a variant's tiles and store them in the cache")
  tune.add_argument("variant", help=variant_help)
  _add_shape_args(tune, seq=1024)
  tune.add_argument("--template", choices=ATTENTION_TEMPLATES, default=None,
                    help="the pass to tune (default: the forward template that runs here)")
  _add_tuning_args(tune)
  tune.set_defaults(run=cmd_tune)

  tune_linear = commands.add_parser(
      "tune-linear", help="tune linear_attention's tiles (and so its lowering) for a shape")
  _add_linear_args(tune_linear)
  tune_linear.add_argument("--mode", choices=LINEAR_MODES, default="fwd_bwd",
                           help="time the forward with its backward (training, default) or "
                           "the forward alone")
  _add_shape_args(tune_linear, seq=4096)
  _add_tuning_args(tune_linear)
  tune_linear.set_defaults(run=cmd_tune_linear)

  bench = commands.add_parser("bench", help="TFLOP/s of our kernels next to cuDNN, "
                              "JAX's Pallas attention and XLA")
  bench.add_argument("variants", nargs="*", default=["vanilla", "causal"],
                     metavar="VARIANT", help=variant_help + " (default: vanilla causal)")
  _add_shape_args(bench, seq=4096)
  bench.add_argument("--mode", choices=bench_lib.MODES, default="fwd")
  bench.add_argument("--impls", nargs="+", choices=bench_lib.IMPLS,
                     default=list(bench_lib.IMPLS))
  bench.add_argument("--warmup", type=_positive_int, default=3)
  bench.add_argument("--reps", type=_positive_int, default=10)
  bench.add_argument("--json", metavar="PATH", default=None,
                     help="also write the rows as a results file (benchmarks' schema)")
  bench.set_defaults(run=cmd_bench)

  explain = commands.add_parser("explain", help="show what the compiler decides for a variant")
  explain.add_argument("variant", help=variant_help)
  _add_shape_args(explain, seq=1024, dtypes=DTYPES + FP8_DTYPES)
  explain.add_argument("--templates", nargs="+", choices=ATTENTION_TEMPLATES, default=None,
                       help="default: the forward and backward templates that run here")
  explain.add_argument("--verbose", action="store_true",
                       help="list every pruned config with its reason")
  explain.set_defaults(run=cmd_explain)

  explain_linear = commands.add_parser(
      "explain-linear", help="show which lowering linear_attention runs at a shape, and why")
  _add_linear_args(explain_linear)
  _add_shape_args(explain_linear, seq=4096)
  explain_linear.set_defaults(run=cmd_explain_linear)

  # Every argument after `demo` (--help included) goes to pallas_attn.demo.main.
  demo = commands.add_parser("demo", add_help=False,
                             help="run the demo (arguments are passed on)")
  demo.set_defaults(run=cmd_demo)

  cache = commands.add_parser("cache", help="manage the tuning cache "
                              f"(${cache_lib.CACHE_ENV} overrides its path)")
  actions = cache.add_subparsers(dest="action", required=True, metavar="ACTION")
  actions.add_parser("list", help="print every entry")
  actions.add_parser("clear", help="remove every entry")
  export = actions.add_parser("export", help="write the entries to a file others can merge")
  export.add_argument("path")
  merge = actions.add_parser("merge", help="add the entries of another cache file")
  merge.add_argument("path")
  cache.set_defaults(run=cmd_cache)
  return parser


def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  args, extra = parser.parse_known_args(argv)
  if extra and args.command != "demo":
    parser.error(f"unrecognized arguments: {' '.join(extra)}")
  args.extra = extra
  from pallas_attn.spec.trace import VariantError
  try:
    return args.run(args)
  except UsageError as e:
    parser.error(str(e))
  except VariantError as e:
    print(f"pallas-attn: the variant cannot be compiled:\n{e}", file=sys.stderr)
    return 1


if __name__ == "__main__":
  sys.exit(main())
