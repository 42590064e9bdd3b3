"""How fast is chunked linear attention (`pallas_attn.linear_attention`, with
decay) against flash-linear-attention, Mamba2's SSD kernels, XLA and the
token-by-token scan?

    python benchmarks/linear.py [--seq 4096 8192 16384] [--no-scan] [--passes]

Shapes, B4 (`--batch`), bf16 inputs: GLA (H16, Dk = Dv = 128, a gate per key feature),
the same with a scalar decay per head, and Mamba2-2.7B's SSD (H80, state 128,
head dim 64, scalar decay, no scale). Implementations: ours; fla's
`chunk_gla` / `chunk_simple_gla` (PyTorch); ours on Triton alone
(`ours_triton`: "ours" takes Mosaic GPU's forward where it runs); Mamba2's
`mamba_chunk_scan_combined` for the scalar decays (x = v / dt, dt = -log
decay, A = -1, B = k, C = q * scale: the same recurrence); the chunked jnp
version (XLA) and the `lax.scan` reference (its backward only where the
state tape fits in half the device). Forward and forward+backward (all
inputs differentiated; the output is kept, as in training) by throughput, and
ours, fla's and Mamba2's by kernel time in alternating rounds (ratios:
theirs / ours per round); TFLOP/s from `chunked_flops`, and each call's
first-call seconds (`first_call_s`: compile or autotune included). `--passes`
also times each pass of our kernels alone. Also our forward's compiled
memory at the longest S. Writes `linear.json` to `--out`.
"""
from __future__ import annotations

import importlib
import inspect

import harness

import jax  # noqa: E402 (after harness: it sets JAX's memory for PyTorch)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_attn import bench  # noqa: E402
from pallas_attn.bench import Row  # noqa: E402
from pallas_attn.kernels import backend  # noqa: E402
from pallas_attn.kernels.linear.reference import (  # noqa: E402
    chunked_linear_attention_jnp, linear_attention_reference)
from pallas_attn.linear import linear_attention  # noqa: E402
from pallas_attn.schedule.device import device_config  # noqa: E402

# The packages re-export functions named like these modules: import the modules.
forward_lib = importlib.import_module("pallas_attn.kernels.linear.chunked_forward")
linear_backward = importlib.import_module("pallas_attn.vjp.linear_backward")

SHAPES = {  # name: (heads, d_k, d_v, decay kind, scale)
    "gla_vector_h16_d128": (16, 128, 128, "vector", None),
    "scalar_decay_h16_d128": (16, 128, 128, "scalar", None),
    "mamba2_2.7b_h80_n128_p64": (80, 128, 64, "scalar", 1.0),
}
SMALL = {"gla_vector_h16_d128": (2, 32, 32, "vector", None),
         "scalar_decay_h16_d128": (2, 32, 32, "scalar", None),
         "mamba2_2.7b_h80_n128_p64": (2, 32, 16, "scalar", 1.0)}
IMPLS = ("ours", "ours_triton", "fla", "mamba2", "xla_chunked", "scan")
KERNEL_TIMED = ("ours", "ours_triton", "fla", "mamba2")  # the XLA versions are 4-200x slower


FLOP_CHUNK = 64  # the chunk the FLOP count assumes, whatever each implementation uses


def chunked_flops(batch, seq, heads, d_k, d_v, mode):
  """The chunked algorithm's FLOPs, counted once: per chunk of C tokens the
  dense products Q K^T (2 C^2 Dk) and P V (2 C^2 Dv), the state term Q S and
  the state update K^T V (2 C Dk Dv each); a backward counts two forwards."""
  per_token = 2 * FLOP_CHUNK * (d_k + d_v) + 4 * d_k * d_v
  return batch * seq * heads * per_token * (1 if mode == "fwd" else 3)


def make_inputs(batch, seq, heads, d_k, d_v, kind):
  """q, k, v, log_decay (GLA-style gates: log_sigmoid(x + 3) / 16), d_out."""
  keys = jax.random.split(jax.random.key(0), 5)
  shape = (batch, seq, heads)
  q, k = (jax.random.normal(key, shape + (d_k,), jnp.bfloat16) for key in keys[:2])
  v = jax.random.normal(keys[2], shape + (d_v,), jnp.bfloat16)
  gate = shape + ((d_k,) if kind == "vector" else ())
  log_decay = jax.nn.log_sigmoid(jax.random.normal(keys[3], gate, jnp.float32) + 3.0) / 16.0
  return q, k, v, log_decay, jax.random.normal(keys[4], shape + (d_v,), jnp.bfloat16)


def jax_call(attention, mode, inputs):
  """A compiled zero-argument forward, or forward+backward of every input but
  the last (q, k, v, log_decay, ...; the last is d_out). The forward+backward
  returns the output too, as a training step uses it (and PyTorch's autograd
  computes it): returning the gradients alone let XLA drop the Triton
  forward's output pass."""
  *args, d_out = inputs
  if mode == "fwd":
    fn = jax.jit(attention)
  else:
    def fn(*args_and_d_out):
      *args, d_out = args_and_d_out
      out, vjp = jax.vjp(attention, *args)
      return out, vjp(d_out.astype(out.dtype))
    fn, args = jax.jit(fn), (*args, d_out)
  jax.block_until_ready(fn(*args))
  return lambda: fn(*args)


def torch_call(kind, scale, mode, inputs, impl):
  """fla's or Mamba2's forward (no grad) or forward+backward on our inputs."""
  torch = harness.require_torch()
  q, k, v, g, d_out = (torch.from_numpy(np.array(jnp.asarray(x, jnp.float32))).cuda()
                       for x in inputs)
  q, k, v, d_out = (x.to(torch.bfloat16) for x in (q, k, v, d_out))
  if impl == "fla":
    from fla.ops.gla import chunk_gla
    from fla.ops.simple_gla import chunk_simple_gla
    op = chunk_gla if kind == "vector" else chunk_simple_gla
    options = {"scale": scale}
    if "head_first" in inspect.signature(op).parameters:  # older releases
      options["head_first"] = False  # our [B, T, H, D] layout
    leaves = [q, k, v, g]
    forward = lambda q, k, v, g: op(q, k, v, g, **options)[0]
  else:
    if kind != "scalar":
      raise NotImplementedError("Mamba2's SSD has one decay per head and step")
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    dt = -g  # exp(dt * A) with A = -1 is the step's decay; x * dt is v
    leaves = [v / dt[..., None].to(v.dtype), dt, -torch.ones(q.shape[2], device="cuda"),
              k, q * (scale or q.shape[-1] ** -0.5)]
    forward = lambda x, dt, a, b, c: mamba_chunk_scan_combined(x, dt, a, b, c, chunk_size=256)
  return torch_timed(torch, forward, leaves, d_out, mode)


def torch_timed(torch, forward, leaves, d_out, mode):
  """A warmed-up zero-argument call of `forward(*leaves)` (no grad), or of its
  gradients with respect to every leaf given d_out."""
  if mode == "fwd":
    def call():
      with torch.no_grad():
        return forward(*leaves)
  else:
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    call = lambda: torch.autograd.grad(forward(*leaves), leaves, d_out)
  call()
  torch.cuda.synchronize()
  return call


def builders(name, shape, inputs, modes, impls, scan_backward):
  """{(case, impl, mode): () -> compiled call} of one shape at one S."""
  _, d_k, d_v, kind, scale = shape
  jax_fns = {
      "ours": lambda q, k, v, g: linear_attention(q, k, v, log_decay=g, scale=scale),
      "ours_triton": lambda q, k, v, g: linear_attention(q, k, v, log_decay=g, scale=scale,
                                                         implementation="triton"),
      "xla_chunked": lambda q, k, v, g: chunked_linear_attention_jnp(
          q, k, v, log_decay=g, scale=scale)[0],
      "scan": lambda q, k, v, g: linear_attention_reference(q, k, v, log_decay=g,
                                                            scale=scale)[0]}
  return call_builders(
      name, jax_fns, inputs, modes, impls, scan_backward,
      lambda impl, mode: torch_call(kind, scale, mode, inputs, impl))


def call_builders(name, jax_fns, jax_inputs, modes, impls, scan_backward,
                  torch_build):
  """{(case, impl, mode): build}: `jax_fns[impl]` on jax_inputs through
  `jax_call`, other impls by `torch_build(impl, mode)`; the scan's backward
  refused unless `scan_backward`."""
  found = {}
  for mode in modes:
    for impl in impls:
      if impl in jax_fns:
        build = lambda fn=jax_fns[impl], mode=mode: jax_call(fn, mode, jax_inputs)
        if impl == "scan" and mode == "fwd_bwd" and not scan_backward:
          build = _refuse("the scan's per-step state tape exceeds half the device's memory")
      else:
        build = lambda impl=impl, mode=mode: torch_build(impl, mode)
      found[name, impl, mode] = build
  return found


def _refuse(reason):
  def build():
    raise NotImplementedError(reason)
  return build


def pass_builders(name, shape, inputs):
  """{(case, "ours", pass): build} of each pass of our kernels alone."""
  _, d_k, d_v, kind, scale = shape
  q, k, v, log_decay, d_out = inputs
  config = forward_lib.heuristic_linear_config(q.shape[1], d_k, d_v)
  schedule = forward_lib.ChunkedSchedule(
      decay_kind=kind, scale=scale or d_k ** -0.5, chunk_size=config.chunk_size,
      block_v=config.block_v, num_warps=config.num_warps, num_stages=config.num_stages,
      interpret=backend.resolve_interpret(None), out_dtype="bfloat16",
      sm_count=device_config().sm_count)
  g = forward_lib.chunk_cumulative_log_decay(log_decay, schedule.chunk_size,
                                             interpret=schedule.interpret)
  initial = jnp.zeros((q.shape[0], q.shape[2], d_k, d_v), jnp.float32)
  _, _, states = jax.jit(forward_lib.chunked_forward, static_argnums=5)(
      q, k, v, g, initial, schedule)
  passes = {
      "decay_cumsum": (lambda ld: forward_lib.chunk_cumulative_log_decay(
          ld, schedule.chunk_size, interpret=schedule.interpret), (log_decay,)),
      "state_fwd": (lambda k, v, g, s: forward_lib.state_pass(k, v, g, s, schedule,
                                                             reverse=False), (k, v, g, initial)),
      "chunked_forward": (lambda *a: forward_lib.chunked_forward(*a, schedule),
                          (q, k, v, g, initial)),
      "state_bwd": (lambda q, do, g, s: forward_lib.state_pass(q, do, g, s, schedule,
                                                              reverse=True),
                    (q, d_out, g, initial)),
      "chunked_backward": (lambda *a: linear_backward.chunked_backward(*a, schedule),
                           (q, k, v, g, states, d_out, initial)),
  }

  def build(fn, args):
    jitted = jax.jit(fn)
    jax.block_until_ready(jitted(*args))
    return lambda: jitted(*args)
  return {(name, "ours", part): (lambda fn=fn, args=args: build(fn, args))
          for part, (fn, args) in passes.items()}


def memory_row(name, shape, inputs) -> Row:
  """Our forward's compiled memory, arguments included."""
  _, _, _, _, scale = shape
  q, k, v, g, _ = inputs
  try:
    stats = jax.jit(lambda q, k, v, g: linear_attention(q, k, v, log_decay=g, scale=scale)
                    ).lower(q, k, v, g).compile().memory_analysis()
    size = int(stats.argument_size_in_bytes + stats.output_size_in_bytes
               + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
    return Row(name, "ours", "fwd", None, measure="compiled_memory", extra={"bytes": size})
  except Exception as e:  # no memory analysis on this backend
    return Row(name, "ours", "fwd", None, measure="compiled_memory", note=bench.failure_note(e))


def sweep_parser(doc, shapes, impls, seqs):
  """The command line of a recurrence benchmark: S, shapes, impls, modes."""
  parser = harness.parser(doc.splitlines()[0])
  parser.add_argument("--seq", type=int, nargs="+", default=seqs)
  parser.add_argument("--shapes", nargs="+", default=list(shapes), choices=list(shapes))
  parser.add_argument("--impls", nargs="+", default=list(impls), choices=impls)
  parser.add_argument("--modes", nargs="+", default=list(bench.MODES), choices=bench.MODES)
  parser.add_argument("--no-scan", action="store_true", help="leave out the (slow) scan")
  return parser


def scan_backward_fits(batch, seq, heads, d_k, d_v) -> bool:
  """Whether the scan's backward fits in half the device (unknown memory:
  assume it does). Its tape is a float32 state per step, and XLA asked for
  about four tapes' worth at once (H200, the delta rule, B4 S4096 H16 D128:
  49 and 65 GiB allocations for a 17 GB tape, then out of memory)."""
  device_bytes = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
  tape = seq * batch * heads * d_k * d_v * 4
  return device_bytes is None or 8 * tape < 0.5 * device_bytes


def main(argv=None):
  parser = sweep_parser(__doc__, SHAPES, IMPLS, [4096, 8192, 16384])
  parser.add_argument("--passes", action="store_true", help="also time each of our passes")
  parser.add_argument("--batch", type=int, nargs="+", default=[4],
                      help="batch sizes (rows of a batch other than 4 are named _b<batch>)")
  args = parser.parse_args(argv)
  shapes, batches, seqs = (SMALL, [1], [128]) if args.small else (SHAPES, args.batch, args.seq)
  impls = [i for i in args.impls if not (args.no_scan and i == "scan")]
  budget = harness.Budget(args.budget_s)
  rows, ratios = [], []
  for shape_name in args.shapes:
    shape = shapes[shape_name]
    heads, d_k, d_v, kind, _ = shape
    for batch, seq in ((b, s) for b in batches for s in sorted(seqs)):
      suffix = "" if batch == 4 or args.small else f"_b{batch}"
      name = f"{shape_name}{suffix}_{bench.seq_name(seq)}"
      inputs = make_inputs(batch, seq, heads, d_k, d_v, kind)
      found = builders(name, shape, inputs, args.modes, impls,
                       scan_backward_fits(batch, seq, heads, d_k, d_v))
      if args.passes:
        found.update(pass_builders(name, shape, inputs))
      flops = {(name, mode): chunked_flops(batch, seq, heads, d_k, d_v, mode)
               for mode in bench.MODES}
      r, q = harness.measure_calls(found, rounds=args.rounds, budget=budget, heads_second=(),
                                   kernel_impls=KERNEL_TIMED, flops=flops)
      rows += r
      ratios += q
      if seq == max(seqs):
        rows.append(memory_row(name, shape, inputs))
      harness.checkpoint(args, "linear", rows, ratios)
  harness.finish(args, "linear", rows, ratios)


if __name__ == "__main__":
  main()
