"""Global batch and head indices for kernels that run on one shard.

A kernel on a shard of the batch or head axis numbers its programs from 0,
but score_mod and mask_mod must see the global `b` and `h`. `with_offsets`
rewrites the analyzed programs so that every equation that uses `b` or `h`
as a value sees `local + offset`, with the offset a captured scalar (a
traced value: each shard's differs). Captured arrays addressed by `b` or
`h` keep their blocked, local reads: the partitioner shards them with the
batch or heads, so local block `b` of the shard is global row
`b + offset`. Gathered axes evaluate their index expressions on the
global values and are replicated.

The rewrite prepends `b = b_local + b_offset` to the program's jaxpr: the
equations the analysis skipped (the reads of blocked captures) still take
the local index, everything else the global one.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_attn.spec.analysis import VariantAnalysis
from pallas_attn.spec.captures import CaptureUse, ElementwiseProgram

_INDEX = jax.ShapeDtypeStruct((), jnp.int32)


def uses_index_value(prog: ElementwiseProgram | None, name: str, *,
                     reads_too: bool = False) -> bool:
  """Whether `prog` computes with index `name` ('b' or 'h') beyond reading
  blocked captures with it (which the kernel does at the local index); with
  `reads_too`, those reads count as well (ring attention reads the user's
  arrays at global indices). A hoisted diagonal term of the head counts:
  its vector, evaluated per call on the shard (kernels/tiles.py), must see
  the global head."""
  if prog is None or name not in prog.inputs:
    return False
  if name == "h" and any(term.per_head for term in prog.terms):
    return True
  jaxpr = prog.traced.jaxpr
  index_var = jaxpr.invars[prog.inputs.index(name)]
  if reads_too:
    return index_var in jaxpr.outvars or any(index_var in eqn.invars for eqn in jaxpr.eqns)
  return any(index_var in jaxpr.eqns[n].invars for n in prog.kernel_equations())


def _shifted(prog: ElementwiseProgram, offsets: dict) -> tuple:
  """(`prog` with each index of `offsets` shifted by a new scalar capture,
  the captures' values in order). `offsets`: index name -> int32 scalar.

  The offsets' uses come first: kernels load uses in order, and a gather's
  index expression may need the global index before its read."""
  jaxpr = prog.traced.jaxpr
  invars, prefix, constvars = list(jaxpr.invars), [], []
  offset_uses = []
  loads = [(var, use + len(offsets)) for var, use in prog.loads]
  consts = list(prog.traced.consts)
  for name, offset in offsets.items():
    add = jax.make_jaxpr(lambda i, off: i + off)(_INDEX, _INDEX).jaxpr
    local, offset_var = add.invars
    position = prog.inputs.index(name)
    prefix.append(add.eqns[0].replace(outvars=[invars[position]]))
    invars[position] = local
    constvars.append(offset_var)
    loads.append((offset_var, len(offset_uses)))
    offset_uses.append(CaptureUse(len(consts), ()))
    consts.append(offset)
  uses = offset_uses + list(prog.uses)
  fields = {"invars": invars, "constvars": list(jaxpr.constvars) + constvars,
            "eqns": prefix + list(jaxpr.eqns)}
  if hasattr(jaxpr, "consts"):  # JAX 0.11: a jaxpr replaced without consts
    fields["consts"] = tuple(consts)  # turns its constvars into invars
  new_jaxpr = jaxpr.replace(**fields)
  traced = dataclasses.replace(prog.traced, jaxpr=new_jaxpr, consts=tuple(consts))
  program = dataclasses.replace(prog, traced=traced, uses=tuple(uses), loads=tuple(loads),
                                skip=frozenset(n + len(prefix) for n in prog.skip))
  return program, tuple(consts[len(prog.traced.consts):])


def with_offsets(analysis: VariantAnalysis, consts: tuple, offsets: dict) -> tuple:
  """(the analysis whose programs see `index + offsets[index]` for 'b' and
  'h', its captured arrays: `consts` (score_mod's, mask_mod's) with the
  offsets appended to the programs that use them as values)."""
  programs, new_consts = [], []
  for prog, prog_consts in zip((analysis.score_mod, analysis.mask_mod), consts):
    needed = {name: off for name, off in offsets.items() if uses_index_value(prog, name)}
    if needed:
      prog, extra = _shifted(prog, needed)
      prog_consts = tuple(prog_consts) + extra
    programs.append(prog)
    new_consts.append(tuple(prog_consts))
  analysis = dataclasses.replace(analysis, score_mod=programs[0], mask_mod=programs[1])
  return analysis, tuple(new_consts)
