"""Public calls that run as one jitted program per variant, shapes and options.

`context_parallel_attention` and the sharded decodes build a `shard_map`
around the user's score_mod / mask_mod. Called eagerly, each call would be
traced and compiled anew (the mods are new closures every time, e.g. from
`variants.causal()`), and JAX runs the ring's custom_vjp (symbolic zeros)
inside a shard_map only when staged. `as_one_program` runs such a function
inside one jit keyed by the mods' analysis (its fingerprint) and the static
options: the mods' captured arrays are operands and the mods are rebuilt
from the analysis (`as_mods`). Under an outer jit it is inlined.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax

from pallas_attn.spec.analysis import VariantAnalysis, analyze_variant, as_mods, consts_of

# XLA compiler options for a program holding the ring: collective-permutes
# between GPUs of one process run as peer copies on the copy engines instead
# of NCCL kernels on the SMs beside the attention kernels (others keep NCCL).
# Same run, two H200s, 64k causal: forward 15.68 -> 15.31 ms, forward+backward
# 66.40 -> 65.08 (`benchmarks/results/NOTES.md`). A user's jit takes them as
# `jax.jit(step, compiler_options=PEER_COPY_OPTIONS)`; eager calls use them.
PEER_COPY_OPTIONS = {"xla_gpu_collective_permute_mode": "COLLECTIVES_PEER_MEMORY"}


@dataclasses.dataclass(frozen=True, eq=False)
class _Program:
  """The static part of a call: the function, the analyzed mods (compared by
  fingerprint) and the other options (sorted (name, value) pairs)."""
  fn: Callable
  analysis: VariantAnalysis
  options: tuple

  @functools.cached_property
  def key(self) -> tuple:
    return (self.fn, self.analysis.fingerprint(), self.options)

  def __eq__(self, other):
    return isinstance(other, _Program) and self.key == other.key

  def __hash__(self):
    return hash(self.key)


def as_one_program(fn, arrays: dict, *, score_mod, mask_mod, rownorm, **options):
  """`fn(**arrays, score_mod=, mask_mod=, rownorm=, **options)` inside one jit:
  `arrays` (arrays, pytrees of them or None) are its operands, `options` and
  rownorm static (hashable; an unhashable one compiles this call alone).
  Called eagerly, the jit takes `PEER_COPY_OPTIONS` (under an outer jit,
  only that jit's options count)."""
  analysis = analyze_variant(score_mod, mask_mod, rownorm)
  consts = consts_of(analysis)
  program = _Program(fn, analysis, tuple(sorted(dict(options, rownorm=rownorm).items())))
  staged = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((arrays, consts)))
  try:
    hash(program)
  except TypeError:
    return jax.jit(functools.partial(_run, program=program),
                   compiler_options=None if staged else PEER_COPY_OPTIONS)(arrays, consts)
  return (_run_staged if staged else _run_eager)(arrays, consts, program=program)


def _run(arrays, consts, *, program: _Program):
  score_mod, mask_mod = as_mods(program.analysis, consts)
  return program.fn(**arrays, score_mod=score_mod, mask_mod=mask_mod, **dict(program.options))


_run_staged = jax.jit(_run, static_argnames="program")
_run_eager = jax.jit(_run, static_argnames="program", compiler_options=PEER_COPY_OPTIONS)
