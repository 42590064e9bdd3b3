"""Multi-device checks of pallas_attn.distributed, as one script.

tests/test_distributed.py runs it in a subprocess: on CPU with
`XLA_FLAGS=--xla_force_host_platform_device_count=4` (set before JAX
starts) and interpret-mode kernels, on GPUs compiled over all local
devices. Each check compares outputs and gradients with the dense float32
reference (`attention_reference`, the single-device semantics); the
batch/head-sharded ones also read the compiled HLO. Several checks share
one process so that JAX starts once. Exits non-zero on any failure.
"""
from __future__ import annotations

import argparse
import functools
import re
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_attn as pa
from pallas_attn import variants
from pallas_attn.distributed import ring as ring_lib
from pallas_attn.schedule.config import AttentionConfig

from random_variants import random_variant  # tests/, this script's folder

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def rel_err(x, ref):
  x = np.asarray(jnp.asarray(x, jnp.float32))
  ref = np.asarray(jnp.asarray(ref, jnp.float32))
  assert not np.isnan(x).any(), "NaN in result"
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def random_qkv(batch, seq, heads, kv_heads, d_qk, d_v, dtype, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  shapes = ((batch, seq, heads, d_qk), (batch, seq, kv_heads, d_qk), (batch, seq, kv_heads, d_v))
  return tuple(jax.random.normal(key, shape, jnp.float32).astype(dtype)
               for key, shape in zip(keys, shapes))


def output_and_grads(fn, args, n_diff, seed=1, hlo=False):
  """fn(*args) and the gradient of <fn(*args), r> w.r.t. the first n_diff
  args, from one compiled program (and its HLO text with `hlo`)."""
  def run(*args):
    out, pullback = jax.vjp(lambda *d: fn(*d, *args[n_diff:]), *args[:n_diff])
    cotangent = jax.random.normal(jax.random.PRNGKey(seed), out.shape, jnp.float32)
    return out, pullback(cotangent.astype(out.dtype))
  compiled = jax.jit(run).lower(*args).compile()
  return (compiled(*args), compiled.as_text()) if hlo else compiled(*args)


def compare(name, got, want, dtype):
  got_out, got_grads = got
  want_out, want_grads = want
  errors = [rel_err(got_out, want_out)] + [rel_err(g, w) for g, w in zip(got_grads, want_grads)]
  assert max(errors) <= TOLERANCE[dtype], f"{name}: relative errors {errors}"
  return f"max relative error {max(errors):.2e}"


def float_collectives(hlo: str) -> list:
  """The all-gather / all-to-all ops of an HLO text that move floating arrays."""
  found = []
  for line in hlo.splitlines():
    op = re.search(r"= (.*?) (all-gather|all-to-all)(-start)?\(", line)
    if op and re.search(r"\b(f32|bf16|f16)\[", op.group(1)):
      found.append(line.strip()[:160])
  return found


def check_batch_head_sharding(config, interpret, mesh_shape):
  """attention under jit on q/k/v sharded over batch and heads: outputs and
  gradients (of q, k, v, a per-head captured array and sinks) as on one
  device, with global b/h in score_mod / mask_mod (also in the index of a
  replicated array's gather) and no float all-gather in the compiled
  forward or backward; under vmap (which custom_partitioning cannot batch)
  gradients from unpartitioned passes."""
  mesh = jax.make_mesh(mesh_shape, ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  batch, seq, heads, kv_heads = 2 * mesh_shape[0], 24, 2 * mesh_shape[1], mesh_shape[1]
  q, k, v = random_qkv(batch, seq, heads, kv_heads, 16, 8, jnp.float32)
  ids = jnp.asarray(np.random.RandomState(0).randint(0, 3, (batch, seq)).cumsum(1) // 2,
                    jnp.int32)
  slopes = jnp.linspace(0.1, 0.5, heads)
  sinks = jnp.linspace(-1.0, 1.0, heads)
  neighbours = jnp.linspace(-0.5, 0.5, heads)  # replicated, gathered at a computed head

  def variant(slopes, ids):
    def score_mod(s, b, h, q_idx, kv_idx):  # b and h as values, slopes read at h
      return (s + slopes[h] * (kv_idx - q_idx) * 0.1 + 0.05 * h - 0.03 * b
              + 0.2 * neighbours[(h + 1) % heads])
    def mask_mod(b, h, q_idx, kv_idx):  # ids read at b; head 1 is not causal
      return (ids[b, q_idx] == ids[b, kv_idx]) & ((q_idx >= kv_idx) | (h % 2 == 1))
    return dict(score_mod=score_mod, mask_mod=mask_mod)

  def ours(q, k, v, slopes, sinks, ids):
    return pa.attention(q, k, v, sinks=sinks, config=config, bwd_config=config,
                        interpret=interpret, **variant(slopes, ids))

  def reference(q, k, v, slopes, sinks, ids):
    return pa.attention_reference(q, k, v, sinks=sinks, **variant(slopes, ids))

  qkv_sharding = NamedSharding(mesh, P("data", None, "model"))
  args = [jax.device_put(x, qkv_sharding) for x in (q, k, v)]
  args += [jax.device_put(slopes, NamedSharding(mesh, P("model"))), sinks,
           jax.device_put(ids, NamedSharding(mesh, P("data")))]
  got, hlo = output_and_grads(ours, args, 5, hlo=True)
  summary = compare("batch/head sharding", got, output_and_grads(reference, args, 5),
                    jnp.float32)
  assert got[0].sharding.is_equivalent_to(qkv_sharding, 4), got[0].sharding
  gathered = float_collectives(hlo)  # of the forward and the backward
  assert not gathered, f"float all-gathers / all-to-alls {gathered}"

  def loss(attention, q, k, v):
    return jnp.sum(attention(q, k, v) ** 2)
  vanilla = lambda q, k, v: pa.attention(q, k, v, config=config, bwd_config=config,
                                         interpret=interpret)
  stacked = [jnp.stack([x, 2 * x]) for x in args[:3]]
  got = jax.jit(jax.vmap(jax.grad(functools.partial(loss, vanilla))))(*stacked)
  want = jax.grad(functools.partial(loss, pa.attention_reference))(*(x[1] for x in stacked))
  vmap_error = rel_err(got[1], want)
  assert vmap_error <= TOLERANCE[jnp.float32], f"vmap of grad: relative error {vmap_error}"
  return summary


def check_sharded_terms(config, interpret, mesh_shape):
  """Hoisted diagonal terms (a relative-position table, also times a
  function of h) on q/k/v sharded over batch and heads: the call keeps them
  hoisted (one vector per head, evaluated on each shard at its global heads),
  and outputs and gradients, the table's included (through the program
  without the terms), match one device's."""
  mesh = jax.make_mesh(mesh_shape, ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  batch, seq, heads, kv_heads = 2 * mesh_shape[0], 24, 2 * mesh_shape[1], mesh_shape[1]
  q, k, v = random_qkv(batch, seq, heads, kv_heads, 16, 16, jnp.float32, seed=3)
  table = jax.random.normal(jax.random.PRNGKey(5), (heads, 2 * seq - 1), jnp.float32)

  def score_mod_of(table):
    def score_mod(s, b, h, q_idx, kv_idx):  # h indexes the table and scales it
      return s + table[h, q_idx - kv_idx + seq - 1] * (1.0 + 0.25 * h)
    return score_mod
  causal = variants.causal().mask_mod

  def ours(q, k, v, table):
    return pa.attention(q, k, v, score_mod=score_mod_of(table), mask_mod=causal, config=config,
                        bwd_config=config, interpret=interpret)

  def reference(q, k, v, table):
    return pa.attention_reference(q, k, v, score_mod=score_mod_of(table), mask_mod=causal)

  call = pa.api._prepare(q, k, v, score_mod=score_mod_of(table), mask_mod=causal,
                         config=config, bwd_config=config, interpret=interpret)[0]
  assert call.analysis.score_mod.terms, "the diagonal term was not hoisted on several devices"
  qkv_sharding = NamedSharding(mesh, P("data", None, "model"))
  args = [jax.device_put(x, qkv_sharding) for x in (q, k, v)] + [table]
  got = output_and_grads(ours, args, 4)
  return compare("sharded terms", got, output_and_grads(reference, args, 4), jnp.float32)


def check_fp8_sharding(config, interpret, mesh_shape):
  """fp8 attention under jit on q, k, v and their descales sharded over batch
  and heads: the output the float32 reference gives on the dequantized
  inputs, sharded as q. Compiled on Hopper (head dims 128) it runs the fp8
  tensor-core forward with each shard's descales; in interpret mode, the
  dequantized path."""
  mesh = jax.make_mesh(mesh_shape, ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  batch, heads, kv_heads = 2 * mesh_shape[0], 2 * mesh_shape[1], mesh_shape[1]
  d = 16 if interpret else 128
  quantized = [pa.quantize_fp8(x) for x in random_qkv(batch, 40, heads, kv_heads, d, d,
                                                       jnp.float32)]
  real = [x8.astype(jnp.float32) * descale[:, None, :, None] for x8, descale in quantized]
  qkv_sharding = NamedSharding(mesh, P("data", None, "model"))
  args = [jax.device_put(x8, qkv_sharding) for x8, _ in quantized]
  args += [jax.device_put(descale, NamedSharding(mesh, P("data", "model")))
           for _, descale in quantized]
  kwargs = variants.causal().kwargs()

  @jax.jit
  def ours(q8, k8, v8, q_descale, k_descale, v_descale):
    return pa.attention(q8, k8, v8, q_descale=q_descale, k_descale=k_descale,
                        v_descale=v_descale, config=config, interpret=interpret, **kwargs)
  got = ours(*args)
  error = rel_err(got, pa.attention_reference(*real, **kwargs))
  limit = TOLERANCE[jnp.bfloat16] * (1 if interpret else 2)  # e4m3 weights on tensor cores
  assert error <= limit, f"fp8 sharding: relative error {error:.2e}"
  assert got.sharding.is_equivalent_to(qkv_sharding, 4), got.sharding
  return f"relative error {error:.1e}"


def check_explicit_sharding(config, interpret, mesh_shape):
  """Explicit sharding types (a shard_map per pass) with a normalized
  rownorm (whose row statistics the backward also reads), and a sharded
  sequence axis refused with a pointer to context parallelism."""
  mesh = jax.make_mesh(mesh_shape, ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  q, k, v = random_qkv(2 * mesh_shape[0], 20, 2 * mesh_shape[1], mesh_shape[1], 16, 16,
                       jnp.float32)
  rownorm = variants.retention_norm

  def ours(q, k, v):
    return pa.attention(q, k, v, rownorm=rownorm, config=config, bwd_config=config,
                        interpret=interpret)
  args = [jax.device_put(x, NamedSharding(mesh, P("data", None, "model"))) for x in (q, k, v)]
  # The reference runs on one device: JAX 0.11's explicit sharding types refuse its
  # einsum of q against GQA-repeated (head-unsharded) keys.
  summary = compare("explicit sharding", output_and_grads(ours, args, 3),
                    output_and_grads(lambda *a: pa.attention_reference(*a, rownorm=rownorm),
                                     (q, k, v), 3), jnp.float32)
  sequence_sharded = jax.device_put(q, NamedSharding(mesh, P(None, "data")))
  try:
    jax.jit(ours)(sequence_sharded, *args[1:])
  except ValueError as e:
    assert "context_parallel_attention" in str(e), e
  else:
    raise AssertionError("a sequence-sharded q was not refused")
  return summary


class _StepCounter:
  """Counts ring steps whose block mask keeps a tile, through ring._step's
  `live` (the position maps put every step's masks right)."""

  def __init__(self):
    self.live = []
    self._step = ring_lib._step

  def __enter__(self):
    def step(*args, **kwargs):
      made = self._step(*args, **kwargs)
      live = made[-1]
      if live is not True:
        jax.debug.callback(lambda x: self.live.append(bool(x)), live)
      return made
    ring_lib._step = step
    return self

  def __exit__(self, *exc):
    ring_lib._step = self._step


def check_context_parallel(config, interpret, num, name, *, kwargs, reference_kwargs=None,
                           dtype=jnp.float32, sinks=None, load_balance=None, segment_ids=None,
                           split_batch=False, expect_live=None, preordered=False,
                           head_groups=None, d_v=8):
  """context_parallel_attention over a ring of `num` devices (with
  `split_batch`, num / 2 devices and the batch over 2) against the dense
  reference: output and gradients of q, k, v (and sinks), and no float
  all-gather in the compiled forward and backward. `preordered`:
  the inputs and ids put in the zigzag order first (`zigzag_order`), the
  call told so (`sequence_order="zigzag"`), its output put back.
  `head_groups`: the ring's, one group's ring after another's. Dqk is 16,
  Dv `d_v` (16: dq takes over the saved output's array)."""
  data = 2 if split_batch and num >= 4 else 1
  mesh = jax.make_mesh((data, num // data), ("data", "seq"),
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  seq = 8 * num
  q, k, v = random_qkv(2, seq, 4, 2, 16, d_v, dtype, seed=len(name))
  reference_kwargs = dict(kwargs if reference_kwargs is None else reference_kwargs)

  def with_sinks(kwargs, sinks):
    return dict(kwargs, **({"sinks": sinks[0]} if sinks else {}))

  shards = num // data
  order = ((lambda x: pa.distributed.zigzag_order(x, shards)) if preordered
           else (lambda x: x))

  def ours(q, k, v, *sinks):
    out = pa.context_parallel_attention(
        *map(order, (q, k, v)), mesh=mesh, seq_axis="seq",
        batch_axis="data" if data > 1 else None, config=config, bwd_config=config,
        interpret=interpret, load_balance=load_balance,
        segment_ids=None if segment_ids is None else order(segment_ids),
        sequence_order="zigzag" if preordered else "natural", head_groups=head_groups,
        **with_sinks(kwargs, sinks))
    return pa.distributed.natural_order(out, shards) if preordered else out

  def reference(q, k, v, *sinks):
    return pa.attention_reference(q, k, v, **with_sinks(reference_kwargs, sinks))
  args = (q, k, v) + ((sinks,) if sinks is not None else ())
  with _StepCounter() as counter:
    got, hlo = output_and_grads(ours, args, len(args), hlo=True)
    jax.block_until_ready(got)
    jax.effects_barrier()
  summary = compare(name, got, output_and_grads(reference, args, len(args)), dtype)
  if not preordered:  # (zigzag_order itself regathers a sharded sequence axis)
    gathered = float_collectives(hlo)  # the ring's forward and backward move blocks only
    assert not gathered, f"{name}: float all-gathers / all-to-alls {gathered}"
  if expect_live is not None:  # forward and backward each visit num steps per device
    live = sum(counter.live)
    assert live == expect_live, f"{name}: {live} ring steps kept tiles, expected {expect_live}"
    summary += f", {live} of {2 * num * num} steps kept tiles"
  return summary


def check_context_parallel_eager(config, interpret, num):
  """context_parallel_attention called outside jit, as the README's example:
  the output and (autodiff outside jit, on a mesh of Auto axes) the
  gradients match the reference, and a second call with the variant rebuilt
  compiles nothing new (one program per variant, shapes and options)."""
  from pallas_attn.distributed import one_program
  mesh = jax.make_mesh((num,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
  q, k, v = random_qkv(1, 8 * num, 4, 2, 16, 16, jnp.float32, seed=11)

  def ours(q, k, v):
    return pa.context_parallel_attention(q, k, v, mesh=mesh, seq_axis="seq", config=config,
                                         bwd_config=config, interpret=interpret,
                                         **variants.causal().kwargs())
  def reference(q, k, v):
    return pa.attention_reference(q, k, v, **variants.causal().kwargs())
  loss = lambda fn: lambda *x: jnp.sum(fn(*x) * jnp.cos(fn(*x)))
  got = ours(q, k, v), jax.grad(loss(ours), (0, 1, 2))(q, k, v)
  compiled = one_program._run_eager._cache_size()
  again = ours(q, k, v)
  assert one_program._run_eager._cache_size() == compiled, "the second call compiled"
  assert rel_err(again, got[0]) == 0.0
  want = reference(q, k, v), jax.grad(loss(reference), (0, 1, 2))(q, k, v)
  return compare("context parallel, eager", got, want, jnp.float32)


def check_ring_in_shard_map(config, interpret, num):
  """ring_attention inside a user's shard_map that also splits the heads:
  score_mod sees global heads and positions (ALiBi's slopes[h]), sinks
  are given for all heads; the same shard_map run eagerly raises a clear
  error (wrap it in jit)."""
  heads_split = 2 if num % 2 == 0 and num > 2 else 1
  mesh = jax.make_mesh((heads_split, num // heads_split), ("model", "seq"),
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  seq = 8 * (num // heads_split)
  q, k, v = random_qkv(1, seq, 2 * heads_split, heads_split, 16, 16, jnp.float32, seed=7)
  variant = variants.alibi(num_heads=2 * heads_split) + variants.causal()
  sinks = jnp.linspace(-1.0, 1.0, 2 * heads_split)

  def ours(q, k, v, sinks):
    spec = P(None, "seq", "model")
    def local(q, k, v):
      return pa.ring_attention(q, k, v, axis_name="seq", head_axis="model", sinks=sinks,
                               config=config, bwd_config=config, interpret=interpret,
                               **variant.kwargs())
    args = [jax.sharding.reshard(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
    return jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec,
                         check_vma=False)(*args)

  def reference(q, k, v, sinks):
    return pa.attention_reference(q, k, v, sinks=sinks, **variant.kwargs())
  summary = compare("ring_attention in shard_map", output_and_grads(ours, (q, k, v, sinks), 4),
                    output_and_grads(reference, (q, k, v, sinks), 4), jnp.float32)
  try:  # the shard_map run eagerly: a clear error (JAX runs the custom_vjp only when staged)
    ours(q, k, v, sinks)
  except ValueError as error:
    assert "outside jit" in str(error), error
  else:
    raise AssertionError("an eager shard_map of ring_attention ran")
  return summary


def check_ring_memory(config, interpret, num):
  """The ring's backward keeps one device's shard, not one per step: the
  compiled gradient's temporary memory on `num` devices is that on half as
  many, at the same local length (both loops run at least twice: XLA
  simplifies a loop of one step, and buffers with it); differentiating
  through the forward ring would keep each step's keys, values and partial
  output. The shards are long enough (1024 positions) that their arrays
  outweigh the per-step constants (block masks, statistics) that compiled
  programs also hold."""
  def temp_bytes(devices):
    mesh = jax.make_mesh((devices,), ("seq",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:devices])
    spec = NamedSharding(mesh, P(None, "seq"))
    x = jax.sharding.reshard(jnp.ones((1, 1024 * devices, 2, 16)), spec)
    ring = jax.shard_map(
        lambda q, k, v: pa.ring_attention(q, k, v, axis_name="seq", config=config,
                                          bwd_config=config, interpret=interpret),
        mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"), check_vma=False)
    grad = jax.jit(jax.grad(lambda q, k, v: ring(q, k, v).sum(), (0, 1, 2)))
    return grad.lower(x, x, x).compile().memory_analysis().temp_size_in_bytes
  half, many = temp_bytes(num // 2), temp_bytes(num)
  assert many <= 1.1 * half, f"temporary bytes: {many} on {num} devices, {half} on {num // 2}"
  return f"gradient temporaries {many} bytes on {num} devices, {half} on {num // 2}"


def context_parallel_cases(num):
  """(name, keyword arguments of check_context_parallel) for a ring of num devices."""
  seq = 8 * num
  ids = jnp.asarray(np.repeat(np.arange(4), seq // 4)[None].repeat(2, 0), jnp.int32)
  ids = ids.at[1].set(jnp.asarray(np.arange(seq) * 3 // seq, jnp.int32))
  causal = variants.causal()
  document = variants.document(ids, causal=True)
  window = variants.sliding_window(5)
  alibi = variants.alibi(num_heads=4) + causal
  # Steps that run a kernel: unbalanced causal runs device i's steps from
  # device <= i; a window of 5 over local blocks of 8 reaches one block back.
  steps = num * (num + 1) // 2
  return [
      ("vanilla (GQA, Dqk != Dv)", dict(kwargs={})),
      ("causal, contiguous", dict(kwargs=causal.kwargs(), load_balance=False,
                                  expect_live=2 * steps)),
      ("document ids + causal, zigzag", dict(kwargs=causal.kwargs(), segment_ids=ids,
                                             reference_kwargs=document.kwargs())),
      ("document ids + causal, inputs in zigzag order", dict(
          kwargs=causal.kwargs(), segment_ids=ids, reference_kwargs=document.kwargs(),
          preordered=True)),
      ("sliding window, contiguous", dict(kwargs=window.kwargs(), load_balance=False,
                                          expect_live=2 * (2 * num - 1))),
      ("ALiBi + causal + sinks, zigzag, bf16",
       dict(kwargs=alibi.kwargs(), sinks=jnp.linspace(-1.0, 2.0, 4), dtype=jnp.bfloat16)),
      ("ALiBi + document ids + causal + sinks, two head groups (GQA, Dqk = Dv)", dict(
          kwargs=alibi.kwargs(), segment_ids=ids, sinks=jnp.linspace(-1.0, 2.0, 4),
          reference_kwargs=(variants.alibi(num_heads=4) + document).kwargs(), head_groups=2,
          d_v=16)),
      # Over a ring of two (the batch split too where there are four devices)
      # the keys stay in place and only the query side moves.
      ("document ids + causal, zigzag, batch split too", dict(
          kwargs=causal.kwargs(), segment_ids=ids, reference_kwargs=document.kwargs(),
          split_batch=True)),
      ("ALiBi + causal, zigzag, two head groups, batch split too", dict(
          kwargs=alibi.kwargs(), head_groups=2, d_v=16, split_batch=True)),
      ("sigmoid, batch split too", dict(kwargs=dict(
          rownorm="sigmoid", score_mod=lambda s, b, h, q_idx, kv_idx: s - 2.0 + 0.5 * b),
          split_batch=True)),
      *random_cases(seq),
  ]


def random_cases(seq: int, count: int = 3) -> list:
  """Random compositions (tests/random_variants.py: built-in variants and
  arrays closed over, read at global positions, sinks, elementwise rownorms)."""
  cases = []
  for seed in range(count):
    name, kwargs = random_variant(np.random.default_rng(3000 + seed), 2, 4, seq, seq, most=3)
    cases.append((f"random composition {seed} ({name})", dict(kwargs=kwargs)))
  return cases


def parse_arguments():
  """A checks script's options: --compiled (GPU) and --only NAME."""
  parser = argparse.ArgumentParser()
  parser.add_argument("--compiled", action="store_true",
                      help="compiled kernels (GPU) instead of interpret mode")
  parser.add_argument("--only", default="", help="run the checks whose names contain this")
  return parser.parse_args()


def main():
  args = parse_arguments()
  interpret = not args.compiled
  num = jax.device_count()
  if num < 2:
    sys.exit(f"needs at least 2 devices; got {jax.devices()}")
  config = AttentionConfig(block_q=16, block_k=16, num_warps=4, num_stages=1) if interpret \
      else None
  mesh_shapes = [(2, num // 2)] if num >= 4 else [(num, 1), (1, num)]
  checks = []
  for shape in mesh_shapes:
    checks.append((f"batch/head sharding {shape}",
                   lambda shape=shape: check_batch_head_sharding(config, interpret, shape)))
  checks.append(("hoisted terms, batch/head sharding",
                 lambda: check_sharded_terms(config, interpret, mesh_shapes[0])))
  checks.append(("fp8 batch/head sharding",
                 lambda: check_fp8_sharding(config, interpret, mesh_shapes[0])))
  checks.append(("explicit sharding",
                 lambda: check_explicit_sharding(config, interpret, mesh_shapes[0])))
  for name, case in context_parallel_cases(num):
    checks.append((f"context parallel: {name}",
                   lambda name=name, case=case: check_context_parallel(
                       config, interpret, num, name, **case)))
  checks.append(("context parallel, eager (outside jit)",
                 lambda: check_context_parallel_eager(config, interpret, num)))
  checks.append(("ring_attention in shard_map",
                 lambda: check_ring_in_shard_map(config, interpret, num)))
  if num >= 8:  # the ring's loop runs at least twice on half of them too
    checks.append(("ring memory", lambda: check_ring_memory(config, interpret, num)))
  run_checks(checks, args.only)


def run_checks(checks, only: str = ""):
  """Runs each (name, check) whose name contains `only`, printing its summary or its
  traceback; exits non-zero after all of them if any failed."""
  failed = []
  for name, check in checks:
    if only not in name:
      continue
    try:
      start = time.perf_counter()
      summary = check()
      print(f"ok    {name}: {summary} ({time.perf_counter() - start:.1f} s)", flush=True)
    except Exception:  # report every check, then fail
      failed.append(name)
      print(f"FAIL  {name}\n{traceback.format_exc()}", flush=True)
  if failed:
    sys.exit(f"{len(failed)} failed: {failed}")


if __name__ == "__main__":
  main()
