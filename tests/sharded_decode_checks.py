"""Multi-device checks of decoding on a sequence-sharded KV cache, as one script.

tests/test_sharded_decode.py runs it in a subprocess on CPU with
`XLA_FLAGS=--xla_force_host_platform_device_count=N` (set before JAX
starts) and interpret-mode kernels; on a GPU machine (`--compiled`) over
every local GPU with compiled kernels. Each check runs
`sharded_decode_attention` (or `sharded_paged_attention`) under `jax.jit`
on a cache sharded over the mesh's "seq" axis and compares it with the
dense float32 reference (`attention_reference`) on the unsharded cache, query
i of sequence b at kv_lengths[b] - Sq + i. The sharded caches hold NaN past
each sequence's length, so reading a key it must not turns the output NaN.
One check also reads the compiled HLO: its collectives carry the shards'
outputs and statistics, never the cache. Exits non-zero on any failure.
"""
from __future__ import annotations

import functools
import math
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_attn as pa
from distributed_checks import parse_arguments, rel_err, run_checks
from pallas_attn import variants
from test_decode import reference

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
SHARD = 32  # cache positions per device
CONFIG = pa.DecodeConfig(block_k=16, num_splits=1)
SPLITS = pa.DecodeConfig(block_k=16, num_splits=2)  # each shard's keys split, then combined


def ragged_lengths(batch: int, seq: int):
  """Shorter than one shard, across several shards, the whole cache (and a
  fourth from the second shard)."""
  return jnp.asarray([5, seq // 2 + 3, seq, SHARD + 1][:batch], jnp.int32)


def random_inputs(batch, seq_q, seq, heads=8, kv_heads=2, d_qk=16, d_v=32, dtype=jnp.float32,
                  seed=0):
  """q, k, v from NumPy's generator (no per-shape compile of jax.random)."""
  rng = np.random.default_rng(seed)
  shapes = ((batch, seq_q, heads, d_qk), (batch, seq, kv_heads, d_qk),
            (batch, seq, kv_heads, d_v))
  return tuple(jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for shape in shapes)


def poisoned(x, lengths):
  """The cache with NaN at every position past each sequence's length."""
  positions = np.arange(x.shape[1])[None, :, None, None]
  keep = positions < np.asarray(lengths)[:, None, None, None]
  return jnp.asarray(np.where(keep, np.asarray(x, np.float32), np.nan), x.dtype)


def seq_mesh(num):
  return jax.make_mesh((num,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))


def check_decode(num, interpret, *, seq_q, kwargs=None, dtype=jnp.float32, config=CONFIG,
                 batch=3, batch_split=1, sinks=None, seed=0, hlo=False):
  """sharded_decode_attention under jit on a cache sharded over "seq" (and
  with batch_split > 1 the batch over "data") against the reference:
  output, and the log-sum-exp for softmax rownorms; with `hlo`, the
  compiled program's collectives too (`check_collectives`)."""
  kwargs = dict(kwargs or {})
  seq = SHARD * (num // batch_split)
  # The batch-split case uses explicit sharding types (arrays resharded inside).
  kind = jax.sharding.AxisType.Explicit if batch_split > 1 else jax.sharding.AxisType.Auto
  mesh = jax.make_mesh((batch_split, num // batch_split), ("data", "seq"), axis_types=(kind,) * 2)
  q, k, v = random_inputs(batch, seq_q, seq, dtype=dtype, seed=seed)
  lengths = ragged_lengths(batch, seq)
  batch_axis = "data" if batch_split > 1 else None
  softmax = pa.analyze_variant(rownorm=kwargs.get("rownorm", "softmax")).rownorm.kind == "softmax"
  cache = NamedSharding(mesh, P(batch_axis, "seq"))
  k_s, v_s = (jax.device_put(poisoned(x, lengths), cache) for x in (k, v))
  if sinks is not None:
    kwargs["sinks"] = sinks

  def ours(q, k, v, lengths):
    return pa.distributed.sharded_decode_attention(
        q, k, v, lengths, mesh=mesh, axis_name="seq", batch_axis=batch_axis, config=config,
        interpret=interpret, return_lse=True, **kwargs)
  compiled = jax.jit(ours).lower(q, k_s, v_s, lengths).compile()
  out, lse = compiled(q, k_s, v_s, lengths)
  want_out, want_lse = reference(q, k, v, lengths, return_lse=True, **kwargs)
  assert out.shape == q.shape[:3] + (v.shape[3],) and out.dtype == dtype, (out.shape, out.dtype)
  errors = [rel_err(out, want_out)]
  if softmax:
    errors.append(rel_err(lse, want_lse))
  else:
    assert lse is None
  assert max(errors) <= TOLERANCE[dtype], f"relative errors {errors}"
  summary = f"lengths {np.asarray(lengths).tolist()} of {seq}, max relative error {max(errors):.1e}"
  if hlo:
    summary += "; " + check_collectives(compiled.as_text(), out.size + lse.size, num)
  return summary


def check_decode_attention_sharded(num, interpret, *, axis_type, split, seed=5, fp8=False):
  """`decode_attention` itself under jit on a cache with a NamedSharding
  (`split`: the sequence over all devices, or over half of them and the
  batch or the heads over two), ALiBi at global heads, causal, sinks:
  against the reference, and its HLO moves no cache. `fp8`: a bf16 query
  against an e4m3 cache with per-head descales (sharded with the batch and
  heads), against the reference on the dequantized cache."""
  names = {"sequence": ("seq",), "batch": ("data", "seq"), "heads": ("seq", "heads")}[split]
  shape = (num,) if split == "sequence" else ((2, num // 2) if split == "batch" else (num // 2, 2))
  mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))
  spec = {"sequence": P(None, "seq"), "batch": P("data", "seq"),
          "heads": P(None, "seq", "heads")}[split]
  seq = SHARD * num
  q, k, v = random_inputs(2, 3, seq, seed=seed)
  lengths = ragged_lengths(2, seq)
  kwargs = (variants.alibi(slopes=jnp.linspace(0.1, 0.8, 8)) + variants.causal()).kwargs()
  kwargs["sinks"] = jnp.linspace(-1.0, 2.0, 8)
  dtype, scales = jnp.float32, {}
  if fp8:
    dtype, q = jnp.bfloat16, q.astype(jnp.bfloat16)
    (k, k_descale), (v, v_descale) = (pa.quantize_fp8(x) for x in (k, v))
    scales = dict(k_descale=k_descale, v_descale=v_descale)
  k_s, v_s = (jax.device_put(poisoned(x, lengths), NamedSharding(mesh, spec)) for x in (k, v))

  def ours(q, k, v, lengths):
    return pa.decode_attention(q, k, v, lengths, config=CONFIG, interpret=interpret,
                               **kwargs, **scales)
  compiled = jax.jit(ours).lower(q, k_s, v_s, lengths).compile()
  out = compiled(q, k_s, v_s, lengths)
  if fp8:
    k, v = (x.astype(jnp.float32) * scales[f"{n}_descale"][:, None, :, None]
            for n, x in (("k", k), ("v", v)))
  want = reference(q, k, v, lengths, **kwargs)
  error = rel_err(out, want)
  assert error <= TOLERANCE[dtype], f"relative error {error}"
  merge = out.size + out.shape[0] * out.shape[2] * out.shape[1]
  return (f"mesh {dict(mesh.shape)} {spec}, max relative error {error:.1e}; "
          + check_collectives(compiled.as_text(), merge, num))


def check_forward_only(num, interpret):
  """Differentiating `decode_attention` on a sharded cache raises the same
  clear error as on one device (not the partitioner's missing rule)."""
  mesh = jax.make_mesh((num,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
  q, k, v = random_inputs(2, 1, SHARD * num, seed=7)
  lengths = ragged_lengths(2, SHARD * num)
  k_s, v_s = (jax.device_put(x, NamedSharding(mesh, P(None, "seq"))) for x in (k, v))
  loss = lambda q: pa.decode_attention(q, k_s, v_s, lengths, config=CONFIG,
                                       interpret=interpret).sum()
  try:
    jax.grad(loss)(q)
  except TypeError as error:
    assert "forward-only" in str(error), error
    return "TypeError: " + str(error)[:60]
  raise AssertionError("differentiating decode_attention did not raise")


def check_eager_calls(num, interpret):
  """sharded_decode_attention called outside jit, twice with the variant
  rebuilt: the second call compiles nothing (one program per variant,
  shapes and options) and gives the same output, which matches the reference."""
  from pallas_attn.distributed import one_program
  mesh = jax.make_mesh((num,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
  q, k, v = random_inputs(2, 1, SHARD * num, seed=8)
  lengths = ragged_lengths(2, SHARD * num)
  call = lambda: pa.sharded_decode_attention(q, k, v, lengths, mesh=mesh, axis_name="seq",
                                             config=CONFIG, interpret=interpret,
                                             **variants.causal().kwargs())
  out = call()
  compiled = one_program._run_eager._cache_size()
  again = call()
  assert one_program._run_eager._cache_size() == compiled, "the second eager call compiled"
  assert rel_err(again, out) == 0.0
  error = rel_err(out, reference(q, k, v, lengths, **variants.causal().kwargs()))
  assert error <= TOLERANCE[jnp.float32], f"relative error {error}"
  return f"max relative error {error:.1e}"


def check_rownorm_sink(num, interpret):
  """A rownorm with its own sink (off-by-one softmax): on a batch-sharded
  cache as on one device; on a sequence-sharded one, the error that asks
  for `sinks=` (which the merge adds once)."""
  mesh = jax.make_mesh((2, num // 2), ("data", "seq"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  q, k, v = random_inputs(2, 1, SHARD * num, seed=6)
  lengths = ragged_lengths(2, SHARD * num)
  rownorm = variants.off_by_one_softmax
  run = jax.jit(lambda q, k, v, n: pa.decode_attention(q, k, v, n, rownorm=rownorm, config=CONFIG,
                                                       interpret=interpret))
  batch = NamedSharding(mesh, P("data"))
  k_b, v_b = (jax.device_put(x, batch) for x in (k, v))
  error = rel_err(run(q, k_b, v_b, lengths), reference(q, k, v, lengths, rownorm=rownorm))
  assert error <= TOLERANCE[jnp.float32], f"relative error {error}"
  sequence = NamedSharding(mesh, P(None, "seq"))
  k_s, v_s = (jax.device_put(x, sequence) for x in (k, v))
  try:
    run(q, k_s, v_s, lengths)
  except Exception as e:  # raised while partitioning, wrapped by XLA
    assert "pass rownorm='softmax' and sinks=" in str(e), str(e)[-2000:]
  else:
    raise AssertionError("a sink rownorm on a sequence-sharded cache was not refused")
  return f"batch-sharded: max relative error {error:.1e}; sequence-sharded: refused"


def check_paged(num, interpret, *, seq_q=2, page_size=4):
  """sharded_paged_attention: each device's positions in pages of its own
  pool, through a shuffled page table of local indices."""
  mesh = seq_mesh(num)
  batch, seq = 2, SHARD * num
  pages_per_device = SHARD // page_size  # per sequence
  pool = batch * pages_per_device + 1  # one spare page per device
  q, k, v = random_inputs(batch, seq_q, seq, seed=3)
  lengths = ragged_lengths(batch, seq)
  rng = np.random.default_rng(0)
  table = np.zeros((batch, num * pages_per_device), np.int32)
  k_pages = np.full((num * pool, page_size) + k.shape[2:], np.nan, np.float32)
  v_pages = np.full((num * pool, page_size) + v.shape[2:], np.nan, np.float32)
  k_host, v_host = (np.asarray(poisoned(x, lengths)) for x in (k, v))
  for device in range(num):
    order = rng.permutation(pool)
    for b in range(batch):
      for slot in range(pages_per_device):
        local = int(order[b * pages_per_device + slot])
        first = (device * pages_per_device + slot) * page_size
        table[b, device * pages_per_device + slot] = local
        k_pages[device * pool + local] = k_host[b, first:first + page_size]
        v_pages[device * pool + local] = v_host[b, first:first + page_size]
  k_pages, v_pages = (jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("seq")))
                      for x in (k_pages, v_pages))
  table = jax.device_put(jnp.asarray(table), NamedSharding(mesh, P(None, "seq")))
  causal = variants.causal().kwargs()

  @jax.jit
  def ours(q, k_pages, v_pages, table, lengths):
    return pa.distributed.sharded_paged_attention(
        q, k_pages, v_pages, table, lengths, mesh=mesh, axis_name="seq", config=CONFIG,
        interpret=interpret, **causal)
  out = ours(q, k_pages, v_pages, table, lengths)
  want = reference(q, k, v, lengths, **causal)
  error = rel_err(out, want)
  assert error <= TOLERANCE[jnp.float32], f"relative error {error}"
  return f"page size {page_size}, {pool} pages per device, max relative error {error:.1e}"


_COLLECTIVE = re.compile(r"= (.*?) (all-gather|all-to-all|collective-permute|all-reduce|"
                         r"reduce-scatter)(-start)?\(")


def collectives(hlo: str) -> list:
  """(op, element count of its largest result array, line) per collective of an HLO text."""
  found = []
  for line in hlo.splitlines():
    match = _COLLECTIVE.search(line)
    if match:
      shapes = re.findall(r"\b(?:f32|bf16|f16|s32|pred|u32)\[([\d,]*)\]", match.group(1))
      size = max((math.prod(int(d) for d in s.split(",") if d) for s in shapes), default=0)
      found.append((match.group(2), size, line.strip()[:160]))
  return found


def check_collectives(hlo: str, merge_elements: int, num: int) -> str:
  """The compiled program moves no cache: no all-to-all or permute, and its
  all-gathers / all-reduces carry at most the `num` shards' [B, Sq, Hq, Dv]
  outputs and [B, Hq, Sq] statistics (`merge_elements` per shard)."""
  found = collectives(hlo)
  moved = [line for op, _, line in found if op not in ("all-reduce", "all-gather")]
  assert not moved, f"collectives other than all-gather / all-reduce: {moved}"
  big = [line for _, size, line in found if size > num * merge_elements]
  assert not big, f"collectives larger than the merge's ({num} x {merge_elements} elements): {big}"
  assert found, "no collective: the shards' parts were not merged"
  return f"{len(found)} collectives of at most {max(s for _, s, _ in found)} elements"


def cases(num, interpret):
  """(name, check) pairs for `num` devices (the batch split needs 4 or more)."""
  causal, window = variants.causal(), variants.sliding_window(5)  # window < SHARD
  seq = SHARD * num
  ids = jnp.asarray(np.arange(3 * seq).reshape(3, seq) // 13 % 4, jnp.int32)
  # A closed-over [B, S] array read at global key positions (a gather of the whole array).
  alibi_documents = variants.alibi(num_heads=8) + variants.document(ids, causal=True)
  sinks = jnp.linspace(-1.0, 2.0, 8)
  decode = functools.partial(check_decode, num, interpret)
  found = [
      ("Sq=1, GQA 8/2, sinks", lambda: decode(seq_q=1, sinks=sinks)),
      ("Sq=4, causal, splits", lambda: decode(seq_q=4, kwargs=causal.kwargs(), config=SPLITS,
                                              seed=1)),
      ("Sq=4, sliding window 5 + sinks, splits; HLO: no cache all-gather",
       lambda: decode(seq_q=4, kwargs=window.kwargs(), sinks=sinks, config=SPLITS, seed=2,
                      hlo=True)),
      ("Sq=4, ALiBi + causal documents, bf16", lambda: decode(
          seq_q=4, kwargs=alibi_documents.kwargs(), dtype=jnp.bfloat16, seed=3)),
      ("Sq=2, paged, causal", lambda: check_paged(num, interpret)),
      ("differentiating a sharded decode raises", lambda: check_forward_only(num, interpret)),
      ("sharded_decode_attention outside jit, twice", lambda: check_eager_calls(num, interpret)),
  ]
  for axis_type in (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit):
    splits = ("sequence", "batch", "heads") if num >= 4 else ("sequence",)
    for split in splits:
      found.append((f"decode_attention on a sharded cache ({split}, {axis_type.name}); HLO",
                    functools.partial(check_decode_attention_sharded, num, interpret,
                                      axis_type=axis_type, split=split)))
  found.append(("decode_attention on an fp8 cache split over its sequence; HLO",
                functools.partial(check_decode_attention_sharded, num, interpret,
                                  axis_type=jax.sharding.AxisType.Auto, split="sequence",
                                  fp8=True)))
  if num >= 4:
    found.append(("off-by-one softmax (a rownorm sink) on sharded caches",
                  lambda: check_rownorm_sink(num, interpret)))
    found.append(("decode_attention on an fp8 cache split over batch and sequence; HLO",
                  functools.partial(check_decode_attention_sharded, num, interpret,
                                    axis_type=jax.sharding.AxisType.Explicit, split="batch",
                                    fp8=True)))
    found.append(("Sq=4, sigmoid (elementwise), batch split over an explicit axis",
                  lambda: decode(seq_q=4, batch=4, batch_split=2, seed=4, kwargs=dict(
                      rownorm="sigmoid", score_mod=lambda s, b, h, q_idx, kv_idx: s - 2.0 + 0.5 * b,
                      mask_mod=causal.mask_mod))))
  return found


def main():
  args = parse_arguments()
  num = jax.device_count()
  if num < 2 or num % 2:
    sys.exit(f"needs an even number of devices; got {jax.devices()}")
  run_checks(cases(num, not args.compiled), args.only)


if __name__ == "__main__":
  main()
