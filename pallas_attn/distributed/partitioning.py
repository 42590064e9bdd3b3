"""Batch and head sharding of the attention passes under `jax.jit`.

Attention is independent across batch rows and heads, so a call whose
q/k/v are sharded over those axes (a `NamedSharding` on a `Mesh`) runs one
kernel per device on its shard. `partitioned` wraps a pass (the forward, or
the backward kernels) in `jax.experimental.custom_partitioning`: XLA's
partitioner calls back with the operands' shardings once it knows them (also
inside a jit whose shardings are only decided by propagation) and gets a
per-shard function, so no q/k/v is gathered.

Every operand says what each of its axes is (`Dims`): the batch, the query
heads, the kv heads, or something every shard needs whole. The partitioner
shards the first three like q's batch and head axes and replicates the
rest; a sharded sequence or head-dim axis is refused (that is context
parallelism: `pallas_attn.context_parallel_attention`), except the key
sequence of a pass that merges over it (`kv_sequence`: decoding against a
cache split along its sequence), whose shards get their offset and the
mesh axes to merge over. On the shard the pass sees global `b` and `h`
(distributed/offsets.py) and a `Shard` that sums, over the devices that
split a reduction (a gradient of an array not sharded like the batch or
heads), what each computed locally.

Outside a multi-device jit (one device, inside `shard_map`, eager) JAX
inlines the pass unchanged; under `jax.vmap`, which custom_partitioning
cannot batch, the pass runs vmapped and unpartitioned. Under explicit
sharding types the shardings are known while tracing and a `shard_map`
replaces the custom partitioning.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math

import jax
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

BATCH, HEADS, KV_HEADS, KV_SEQUENCE = "batch", "heads", "kv_heads", "kv_sequence"
# An axis read at b (or h) in one place and otherwise in another, or at b
# with another extent than the batch: it cannot follow the batch sharding.
MIXED = "mixed"
_ADDRESS_ROLES = {"b": BATCH, "h": HEADS}


@dataclasses.dataclass(frozen=True)
class Dims:
  """What each axis of one operand is: BATCH, HEADS, KV_HEADS, KV_SEQUENCE
  (the keys' positions, where a pass merges over them), MIXED or None
  (replicated). A pytree leaf, so that a tree of them mirrors the operands."""
  roles: tuple
  what: str = "an operand"  # for errors


@dataclasses.dataclass(frozen=True)
class Shard:
  """One shard's view: the global offsets of its first batch row, query
  head and key position ("b", "h", "kv"; absent where that axis is not
  sharded), and the mesh axes that split the batch, the heads and the keys."""
  offsets: dict
  batch_axes: tuple = ()
  head_axes: tuple = ()
  kv_axes: tuple = ()

  def sum_over_unsharded(self, pairs) -> list:
    """Each `x` of (x, dims) `pairs`, computed from this shard's rows and
    heads, summed over the shards that hold the same part of it: those that
    split an axis (batch or heads) that its `dims` do not follow. One psum
    per set of mesh axes, one after another (as layout.ordered_ppermutes)."""
    groups = collections.defaultdict(list)
    for n, (_, dims) in enumerate(pairs):
      axes = ((self.batch_axes if BATCH not in dims.roles else ())
              + (self.head_axes if HEADS not in dims.roles else ()))
      if axes:
        groups[axes].append(n)
    summed = [x for x, _ in pairs]
    previous = None
    for axes, members in groups.items():
      values = [summed[n] for n in members]
      if previous is not None:
        values, _ = jax.lax.optimization_barrier((values, previous))
      previous = jax.lax.psum(values, axes)
      for n, value in zip(members, previous):
        summed[n] = value
    return summed


UNSHARDED = Shard({})


def capture_dims(prog, consts, batch: int, heads: int) -> tuple:
  """`Dims` of each array a program captures, from how it reads it: an axis
  read only at b (h) and of the batch (head) extent follows the batch
  (heads); axes read at q, kv, constants or computed indices are
  replicated."""
  dims = []
  for n, const in enumerate(consts):
    shape = np.shape(const)
    seen = [set() for _ in shape]
    for use in () if prog is None else prog.uses:
      if use.capture == n:
        for axis, address in enumerate(use.axes):
          seen[axis].add(address)
    roles = []
    for size, addresses in zip(shape, seen):
      role = None
      indexed = addresses & set(_ADDRESS_ROLES)
      if size > 1 and indexed:
        address = next(iter(indexed))
        extent = batch if address == "b" else heads
        role = (_ADDRESS_ROLES[address] if len(addresses) == 1 and size == extent
                else MIXED)
      roles.append(role)
    dims.append(Dims(tuple(roles), f"a captured array of shape {tuple(shape)}"))
  return tuple(dims)


def _axis_names(entry) -> tuple:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _mesh_axes(mesh, q, k, v, kv_sequence: bool = False) -> tuple:
  """(batch mesh axes, head mesh axes, key-sequence mesh axes) from the
  operands' shardings (q's batch and heads, else k's); an error where a
  sequence (but k/v's with `kv_sequence`) or head-dim axis is sharded, or
  the heads do not split evenly."""
  kv_axes = {}
  for name, x in (("q", q), ("k", k), ("v", v)):
    sharding = x.sharding
    if not isinstance(sharding, NamedSharding):
      raise ValueError(
          f"pallas_attn.attention under jit: {name} has sharding {sharding}; give q/k/v a "
          "NamedSharding on a jax.sharding.Mesh (shard batch and/or heads)")
    spec = tuple(sharding.spec) + (None,) * (4 - len(sharding.spec))
    if kv_sequence and name != "q":
      kv_axes[name] = _axis_names(spec[1])
    for axis, what in ((1, "sequence"), (3, "head-dim")):
      if _axis_names(spec[axis]) and not (kv_sequence and name != "q" and axis == 1):
        raise ValueError(
            f"pallas_attn.attention: {name}'s {what} axis is sharded over mesh axes "
            f"{_axis_names(spec[axis])} ({name} sharding {sharding.spec}). attention shards "
            "batch and heads only; for a sequence split over devices use "
            "pallas_attn.context_parallel_attention (or ring_attention inside shard_map); "
            "decode_attention also takes a KV cache sharded along its sequence.")
  if kv_axes and kv_axes["k"] != kv_axes["v"]:
    raise ValueError(f"decoding: k_cache's sequence is sharded over mesh axes {kv_axes['k']} "
                     f"and v_cache's over {kv_axes['v']}; shard both alike")
  # q's batch and head axes, else k's (a small q replicated against a sharded cache)
  q_spec, k_spec = (tuple(x.sharding.spec) + (None,) * (4 - len(x.sharding.spec)) for x in (q, k))
  batch_axes = _axis_names(q_spec[0]) or _axis_names(k_spec[0])
  head_axes = _axis_names(q_spec[2]) or _axis_names(k_spec[2])
  seq_axes = kv_axes.get("k", ())
  count = math.prod(mesh.shape[a] for a in seq_axes)
  if k.shape[1] % count:
    raise ValueError(f"decoding: the cache length {k.shape[1]} does not split evenly over the "
                     f"{count} devices of mesh axes {seq_axes}")
  for axes, dims, what in ((batch_axes, (q.shape[0],), "batch"),
                           (head_axes, (q.shape[2], k.shape[2]), "query and kv head")):
    count = math.prod(mesh.shape[a] for a in axes)
    if any(d % count for d in dims):
      raise ValueError(
          f"pallas_attn.attention: the {what} counts {dims} do not split evenly over the "
          f"{count} devices of mesh axes {axes}; with GQA/MQA the kv heads are sharded "
          "with the query heads, so shard heads over at most Hkv devices (or repeat k/v "
          "heads)")
  if set(seq_axes) & set(batch_axes + head_axes):
    raise ValueError(f"decoding: mesh axes {sorted(set(seq_axes) & set(batch_axes + head_axes))} "
                     "split both the cache's sequence and the batch or heads")
  return batch_axes, head_axes, seq_axes


def _spec(dims: Dims, axes: dict, mesh) -> NamedSharding:
  for role in dims.roles:
    if role == MIXED and (axes[BATCH] or axes[HEADS]):
      raise ValueError(
          f"pallas_attn.attention: {dims.what} is read at b or h and at other indices (or "
          "has an extent other than the batch or head count), so it cannot be sharded with "
          "the batch/heads; read it at b (h) only, or index it differently")
  return NamedSharding(mesh, PartitionSpec(*(
      (axes.get(role) or None) if role != MIXED else None for role in dims.roles)))


def _shardings(mesh, q, k, v, dim_leaves, out_dims, kv_sequence: bool = False) -> tuple:
  """((batch mesh axes, head mesh axes, key-sequence mesh axes), the
  outputs' shardings, the operands') from the shardings of q, k, v (shapes
  with shardings)."""
  batch_axes, head_axes, seq_axes = _mesh_axes(mesh, q, k, v, kv_sequence)
  axes = {BATCH: batch_axes, HEADS: head_axes, KV_HEADS: head_axes, KV_SEQUENCE: seq_axes}
  to_sharding = functools.partial(_spec, axes=axes, mesh=mesh)
  return ((batch_axes, head_axes, seq_axes), jax.tree.map(to_sharding, out_dims),
          tuple(map(to_sharding, dim_leaves)))


def _sharding_rule(arg_dims, out_dims, group: int, kv_heads: int):
  """Shardy's rule: batch and head axes are shared factors (query heads as
  (kv head, group) so that both head counts split together; apart with a
  single kv head, which cannot be split), every other axis its own factor."""
  names = iter(f"x{n}" for n in range(1 << 30))
  heads = "k" if group == 1 else "(k g)" if kv_heads > 1 else "h"
  factor = {BATCH: "b", HEADS: heads, KV_HEADS: "k", KV_SEQUENCE: "s"}

  def operand(dims):
    return " ".join(factor.get(role) or next(names) for role in dims.roles)
  rule = (", ".join(map(operand, jax.tree.leaves(arg_dims))) + " -> "
          + ", ".join(map(operand, jax.tree.leaves(out_dims))))
  return rule, ({"g": group} if group > 1 and kv_heads > 1 else {})


def _on_shard(fn, tree, mesh, q, k, batch_axes, head_axes, kv_axes=()):
  """`fn` on one shard's flat operands, with its `Shard` (offsets from its
  place on the mesh axes that split q's batch and heads and k's sequence)."""
  def run(*local_leaves):
    offsets = {}
    for name, axes, extent in (("b", batch_axes, q.shape[0]), ("h", head_axes, q.shape[2]),
                               ("kv", kv_axes, k.shape[1])):
      if axes:
        size = extent // math.prod(mesh.shape[a] for a in axes)
        offsets[name] = jax.lax.axis_index(axes) * size
    return fn(Shard(offsets, batch_axes, head_axes, kv_axes),
              *jax.tree.unflatten(tree, local_leaves))
  return run


def explicit_mesh(q):
  """The mesh of q's sharding type where its axes are Explicit (the
  shardings are known while tracing), else None."""
  sharding = getattr(jax.typeof(q), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  explicit = getattr(jax.sharding.AxisType, "Explicit", None)
  if mesh is None or explicit not in getattr(mesh, "axis_types", ()):
    return None
  return mesh


def _shard_mapped(fn, leaves, tree, dim_leaves, out_dims, mesh, kv_sequence):
  """The explicit-sharding path: shardings are in the types, so a
  `shard_map` over the batch, head (and key-sequence) axes runs `fn` per shard."""
  q, k, v = (jax.typeof(x) for x in leaves[:3])
  axes, out_shardings, arg_shardings = _shardings(mesh, q, k, v, dim_leaves, out_dims,
                                                  kv_sequence)
  if not sum(axes, ()):
    return fn(UNSHARDED, *jax.tree.unflatten(tree, leaves))
  leaves = [jax.sharding.reshard(x, s) for x, s in zip(leaves, arg_shardings)]
  spec = lambda sharding: sharding.spec
  return jax.shard_map(
      _on_shard(fn, tree, mesh, q, k, *axes), mesh=mesh,
      in_specs=tuple(map(spec, arg_shardings)), out_specs=jax.tree.map(spec, out_shardings),
      axis_names=set(sum(axes, ())), check_vma=False)(*leaves)


def may_shard() -> bool:
  """Whether `partitioned` can run its function on shards (more than one
  device), where a kernel numbers batch and heads from 0."""
  return jax.device_count() > 1


def partitioned(fn, args, arg_dims, out_dims, *, group: int, kv_sequence: bool = False):
  """`fn(shard, *args)` run per shard of the batch/head sharding of q
  (`args[0]`; k and v are `args[1:3]`), and with `kv_sequence` of k/v's
  sequence sharding too (`fn` merges over `shard.kv_axes`).

  `arg_dims` / `out_dims` mirror `args` and `fn`'s outputs with a `Dims`
  per array. `group`: query heads per kv head.
  """
  if not may_shard():
    return fn(UNSHARDED, *args)
  leaves, tree = jax.tree.flatten(args)
  dim_leaves = tree.flatten_up_to(arg_dims)

  def inline(*leaves):
    return fn(UNSHARDED, *jax.tree.unflatten(tree, leaves))

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    try:
      return _shardings(mesh, *arg_shapes[:3], dim_leaves, out_dims, kv_sequence)[1]
    except (ValueError, AttributeError):  # GSPMD aborts on errors here; `partition` reports them
      return jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), out_dims)

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    axes, out_shardings, arg_shardings = _shardings(mesh, *arg_shapes[:3], dim_leaves,
                                                    out_dims, kv_sequence)
    return (mesh, _on_shard(fn, tree, mesh, *arg_shapes[:2], *axes), out_shardings,
            arg_shardings)

  mesh = next(filter(None, map(explicit_mesh, leaves[:3])), None)  # q's, else the cache's
  if mesh is not None:
    return _shard_mapped(fn, leaves, tree, dim_leaves, out_dims, mesh, kv_sequence)
  rule, factor_sizes = _sharding_rule(dim_leaves, out_dims, group, leaves[1].shape[2])
  sharded = custom_partitioning(inline)
  sharded.def_partition(partition, infer_sharding_from_operands=infer,
                        sharding_rule=rule, **factor_sizes)

  @jax.custom_batching.custom_vmap
  def run(*leaves):
    return sharded(*leaves)

  @run.def_vmap
  def _vmapped(axis_size, in_batched, *leaves):  # custom_partitioning has no batching rule
    del axis_size
    out = jax.vmap(inline, in_axes=[0 if b else None for b in in_batched])(*leaves)
    return out, jax.tree.map(lambda _: True, out)

  return run(*leaves)
