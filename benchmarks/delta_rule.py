"""How fast is the delta rule (`pallas_attn.linear_attention(..., beta=...)`)
against flash-linear-attention and the token-by-token scan?

    python benchmarks/delta_rule.py [--seq 4096 8192] [--no-scan]

Shapes, B4, bf16 inputs, L2-normed q and k, beta = sigmoid: DeltaNet (no
decay), Gated DeltaNet (a scalar decay per step and head) and KDA (a decay
per key feature), each at H16 Dk = Dv = 128 and Gated DeltaNet also at
Qwen3-Next's linear-attention heads (H32, Dk = Dv = 128). Implementations:
ours (the Mosaic GPU forward where it runs), ours_triton (`implementation="triton"`); fla's `chunk_delta_rule`, `chunk_gated_delta_rule`, `chunk_kda`
(PyTorch); the `lax.scan` reference (its backward only where the state tape
fits in half the device). Forward and forward+backward (all inputs
differentiated: q, k, v, beta and log_decay) by throughput, ours and fla's by
kernel time in alternating rounds. Writes `delta_rule.json` to `--out`.
"""
from __future__ import annotations

import importlib

import harness

import jax  # noqa: E402 (after harness: it sets JAX's memory for PyTorch)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from linear import (  # noqa: E402
    call_builders, scan_backward_fits, sweep_parser, torch_timed)
from pallas_attn import bench  # noqa: E402
from pallas_attn.kernels.linear.reference import delta_rule_reference  # noqa: E402
from pallas_attn.linear import linear_attention  # noqa: E402

SHAPES = {  # name: (heads, d_k, d_v, decay kind)
    "deltanet_h16_d128": (16, 128, 128, "none"),
    "gated_deltanet_h16_d128": (16, 128, 128, "scalar"),
    "gated_deltanet_qwen3_next_h32_d128": (32, 128, 128, "scalar"),
    "kda_h16_d128": (16, 128, 128, "vector"),
}
SMALL = {name: (2, 32, 32, kind) for name, (_, _, _, kind) in SHAPES.items()}
IMPLS = ("ours", "ours_triton", "fla", "scan")
KERNEL_TIMED = ("ours", "ours_triton", "fla")
FLA_OPS = {"none": ("fla.ops.delta_rule", "chunk_delta_rule"),
           "scalar": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
           "vector": ("fla.ops.kda", "chunk_kda")}


def _l2_normalize(x):
  x = x.astype(jnp.float32)
  return (x / jnp.linalg.norm(x, axis=-1, keepdims=True)).astype(jnp.bfloat16)


def make_inputs(batch, seq, heads, d_k, d_v, kind):
  """q, k (unit rows), v, beta (sigmoid), log_decay (log_sigmoid(x + 3) / 16,
  None without decay), d_out."""
  keys = jax.random.split(jax.random.key(0), 6)
  shape = (batch, seq, heads)
  q, k = (_l2_normalize(jax.random.normal(key, shape + (d_k,))) for key in keys[:2])
  v = jax.random.normal(keys[2], shape + (d_v,), jnp.bfloat16)
  beta = jax.nn.sigmoid(jax.random.normal(keys[3], shape)).astype(jnp.bfloat16)
  log_decay = None
  if kind != "none":
    gate = shape + ((d_k,) if kind == "vector" else ())
    log_decay = jax.nn.log_sigmoid(jax.random.normal(keys[4], gate) + 3.0) / 16.0
  d_out = jax.random.normal(keys[5], shape + (d_v,), jnp.bfloat16)
  return q, k, v, beta, log_decay, d_out


def torch_call(kind, mode, inputs):
  """fla's forward (no grad) or forward+backward on our inputs."""
  torch = harness.require_torch()
  q, k, v, beta, log_decay, d_out = inputs
  cuda = lambda x, dtype: torch.from_numpy(  # fla's layout is ours, [B, S, H, D]
      np.array(jnp.asarray(x, jnp.float32))).cuda().to(dtype)
  leaves = [cuda(x, torch.bfloat16) for x in (q, k, v, beta)]
  if log_decay is not None:
    leaves.append(cuda(log_decay, torch.float32))
  d_out = cuda(d_out, torch.bfloat16)
  module, name = FLA_OPS[kind]
  op = getattr(importlib.import_module(module), name)
  if kind == "none":
    forward = lambda q, k, v, beta: op(q=q, k=k, v=v, beta=beta)[0]
  else:
    forward = lambda q, k, v, beta, g: op(q=q, k=k, v=v, g=g, beta=beta)[0]
  return torch_timed(torch, forward, leaves, d_out, mode)


def builders(name, kind, inputs, modes, impls, scan_backward):
  """{(case, impl, mode): () -> compiled call} of one shape at one S."""
  differentiated = tuple(x for x in inputs if x is not None)
  jax_fns = {
      "ours": lambda q, k, v, beta, g=None: linear_attention(
          q, k, v, beta=beta, log_decay=g),
      "ours_triton": lambda q, k, v, beta, g=None: linear_attention(
          q, k, v, beta=beta, log_decay=g, implementation="triton"),
      "scan": lambda q, k, v, beta, g=None: delta_rule_reference(
          q, k, v, beta, log_decay=g)[0].astype(q.dtype)}
  return call_builders(name, jax_fns, differentiated, modes, impls, scan_backward,
                       lambda impl, mode: torch_call(kind, mode, inputs))


def main(argv=None):
  args = sweep_parser(__doc__, SHAPES, IMPLS, [4096, 8192]).parse_args(argv)
  shapes, batch, seqs = (SMALL, 1, [64]) if args.small else (SHAPES, 4, args.seq)
  impls = [i for i in args.impls if not (args.no_scan and i == "scan")]
  budget = harness.Budget(args.budget_s)
  rows, ratios = [], []
  for shape_name in args.shapes:
    heads, d_k, d_v, kind = shapes[shape_name]
    for seq in sorted(seqs):
      name = f"{shape_name}_{bench.seq_name(seq)}"
      inputs = make_inputs(batch, seq, heads, d_k, d_v, kind)
      found = builders(name, kind, inputs, args.modes, impls,
                       scan_backward_fits(batch, seq, heads, d_k, d_v))
      r, q = harness.measure_calls(found, rounds=args.rounds, budget=budget, heads_second=(),
                                   kernel_impls=KERNEL_TIMED)
      rows += r
      ratios += q
      harness.checkpoint(args, "delta_rule", rows, ratios)
  harness.finish(args, "delta_rule", rows, ratios)


if __name__ == "__main__":
  main()
