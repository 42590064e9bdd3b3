"""How long does building a block mask take, against FlexAttention's
`create_block_mask`, and what does building it inside the jitted call add to
a forward?

    python benchmarks/block_mask.py [--calls 100]

* Builds (B1, H16; Flex with B = H = None, the same work as none of the masks
  depends on h): the first call (compilation) and the median of `--calls`
  later calls, each waited for. Causal and sliding-window (1024) masks pass
  the same function each call; `documents8` a new closure over new ids of the
  same shape each call (8 causal documents, as a per-batch build does), on
  both sides; `documents8_same` one closure every call; `documents8_jit` ours
  inside a jitted function of the ids. Flex eager, and compiled
  (`_compile=True`). Target: under 1 ms at 16k after the first call.
* The document-masked forward (bf16 B1 H16 d128 at the longest S): `prebuilt`
  passes block_mask= built at the forward's tiles; `built_in_jit` passes the
  ids as a jit argument, so the mask is built in every call (target: at most
  10% over prebuilt); `built_in_jit_no_bounds` the same with every position
  evaluated (no tile bounds); `closed_over` closes over concrete ids (built
  once, at trace time, from tile bounds on the host). By throughput and
  kernel time in alternating rounds.

Writes `block_mask.json` to `--out`.
"""
from __future__ import annotations

import itertools
import statistics
import time

import harness

import jax  # noqa: E402 (after harness: it sets JAX's memory for PyTorch)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_attn as pa  # noqa: E402
from pallas_attn import _templates, bench  # noqa: E402
from pallas_attn.api import resolve_config  # noqa: E402
from pallas_attn.bench import Row  # noqa: E402
from pallas_attn.kernels import block_mask as bm_lib  # noqa: E402
from pallas_attn.kernels.lowering import TRITON  # noqa: E402

DOCUMENTS, ID_SETS = 8, 4  # the per-batch builds cycle through ID_SETS sets of ids


def causal(b, h, qi, ki):
  return qi >= ki


def window(b, h, qi, ki):
  return (qi >= ki) & (qi - ki < 1024)


def document_mask(ids):
  """Causal attention within the documents of `ids` `[B, S]` (or `[S]` for Flex)."""
  if ids.ndim == 1:
    return lambda b, h, qi, ki: (ids[qi] == ids[ki]) & (qi >= ki)
  return lambda b, h, qi, ki: (ids[b, qi] == ids[b, ki]) & (qi >= ki)


def id_sets(seq):
  """`ID_SETS` `[1, S]` ids of 8 documents: equal ones, then with the boundaries moved."""
  positions = jnp.arange(seq, dtype=jnp.int32)
  return [jnp.minimum((positions + n * seq // (2 * DOCUMENTS * ID_SETS)) * DOCUMENTS // seq,
                      DOCUMENTS - 1)[None] for n in range(ID_SETS)]


def call_times_ms(call, wait, calls):
  """(first call, median of the `calls` after it) in ms, each call waited for."""
  times = []
  for _ in range(calls + 1):
    start = time.perf_counter()
    wait(call())
    times.append((time.perf_counter() - start) * 1e3)
  return times[0], statistics.median(times[1:])


def our_builds(seq, heads):
  """mask name -> zero-argument call building the next block mask (B1)."""
  build = lambda mask_mod: pa.block_mask(mask_mod, 1, heads, seq, seq)
  ids = id_sets(seq)
  cycle, jit_cycle = itertools.cycle(ids), itertools.cycle(ids)
  same = document_mask(ids[0])
  in_jit = jax.jit(lambda ids: build(document_mask(ids)))
  return {"causal": lambda: build(causal), "window1024": lambda: build(window),
          "documents8": lambda: build(document_mask(next(cycle))),
          "documents8_same": lambda: build(same),
          "documents8_jit": lambda: in_jit(next(jit_cycle))}


def flex_builds(seq, compile_):
  """`our_builds` with Flex's `create_block_mask`, where it has the same call."""
  torch = harness.require_torch()
  from torch.nn.attention.flex_attention import create_block_mask
  ids = [torch.from_numpy(np.asarray(x[0])).cuda() for x in id_sets(seq)]
  cycle, same = itertools.cycle(ids), document_mask(ids[0])
  build = lambda mask_mod: create_block_mask(mask_mod, None, None, seq, seq, device="cuda",
                                             _compile=compile_)
  return {"causal": lambda: build(causal), "window1024": lambda: build(window),
          "documents8": lambda: build(document_mask(next(cycle))),
          "documents8_same": lambda: build(same)}


def build_rows(seqs, heads, calls) -> list[Row]:
  rows = []
  for seq in seqs:
    sides = {"pallas_attn": lambda: (our_builds(seq, heads), jax.block_until_ready),
             "flex": lambda: (flex_builds(seq, False), harness.wait_torch),
             "flex_compiled": lambda: (flex_builds(seq, True), harness.wait_torch)}
    for impl, side in sides.items():
      try:
        builds, wait = side()
      except Exception as e:  # no PyTorch: the Flex builds say why
        rows += [Row(f"{mask}_{bench.seq_name(seq)}", impl, "build", None, measure="wall",
                     note=bench.failure_note(e)) for mask in ("causal", "window1024")]
        continue
      for mask, build in builds.items():
        name = f"{mask}_{bench.seq_name(seq)}"
        try:
          first, later = call_times_ms(build, wait, calls)
        except Exception as e:  # recorded; the others go on
          rows.append(Row(name, impl, "build", None, measure="wall", note=bench.failure_note(e)))
          continue
        rows.append(Row(name, impl, "build", later, measure="wall", extra={"first_ms": first}))
  return rows


def forward_builders(seq, heads, d):
  """{(case, way, "fwd"): build} of the document-masked forward four ways."""
  c = bench.case(f"documents8_{bench.seq_name(seq)}", "documents8", 1, seq, heads=heads, d_qk=d)
  inputs = bench.make_inputs(c)
  q, k, v = inputs.q, inputs.k, inputs.v
  ids = bench.document_ids(1, seq)
  mask = document_mask(ids)
  cfg = resolve_config(None, "config", _templates.FORWARD[TRITON], pa.analyze_variant(mask_mod=mask),
                       q, k, v)
  prebuilt = pa.block_mask(mask, 1, heads, seq, seq, block_q=cfg.block_q, block_kv=cfg.block_k)
  in_jit = lambda q, k, v, ids: pa.attention(q, k, v, mask_mod=document_mask(ids))
  ways = {
      "prebuilt": (lambda q, k, v, bm: pa.attention(q, k, v, mask_mod=mask, block_mask=bm),
                   (q, k, v, prebuilt), True),
      "built_in_jit": (in_jit, (q, k, v, ids), True),
      "built_in_jit_no_bounds": (lambda *a: in_jit(*a), (q, k, v, ids), False),
      "closed_over": (lambda q, k, v: pa.attention(q, k, v, mask_mod=mask), (q, k, v), True),
  }

  def build(fn, args, bounds):
    jitted = jax.jit(fn)
    bm_lib.TILE_BOUNDS = bounds  # read when the call is traced, here
    try:
      jax.block_until_ready(jitted(*args))
    finally:
      bm_lib.TILE_BOUNDS = True
    return lambda: jitted(*args)
  flops = bench.case_flops(c, "fwd", inputs.built)
  return ({(c.name, way, "fwd"): (lambda spec=spec: build(*spec)) for way, spec in ways.items()},
          {(c.name, "fwd"): flops})


def main(argv=None):
  parser = harness.parser(__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=None,
                      help="builds timed per mask after the first (default 100; 5 small)")
  args = parser.parse_args(argv)
  seqs, heads, d, calls = ((256, 512), 2, 32, 5) if args.small else ((4096, 8192, 16384), 16,
                                                                      128, 100)
  rows = build_rows(seqs, heads, args.calls or calls)
  builders, flops = forward_builders(seqs[-1], heads, d)
  forward_rows, ratios = harness.measure_calls(builders, rounds=args.rounds,
                                               budget=harness.Budget(args.budget_s),
                                               flops=flops)
  harness.finish(args, "block_mask", rows + forward_rows, ratios)


if __name__ == "__main__":
  main()
