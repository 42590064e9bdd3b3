"""Context parallelism: `attention` on q/k/v sharded along the sequence.

`context_parallel_attention` wraps `ring_attention` in a `jax.shard_map`
over the mesh: the sequence axis is split over `seq_axis` (and batch and
heads, optionally, over `batch_axis` and `head_axis`). With load balancing
it moves each device's shard into the zigzag layout first (two chunks per
device, so that every device has the same causal work; over two devices
the queries' alone, see `_context_parallel`) and the result back, with
`ppermute`s of half a shard: around the ring where it runs in one head
group, inside its forward and backward for one group at a time where it
runs in several (so that no moved copy of a whole shard is kept for the
backward); inputs already in the zigzag order
(`sequence_order="zigzag"`, `layout.zigzag_order`) need no moves.
"""
from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec

from pallas_attn.distributed import layout as layout_lib
from pallas_attn.distributed import ring as ring_lib
from pallas_attn.distributed.one_program import as_one_program
from pallas_attn.kernels import backend
from pallas_attn.spec.analysis import analyze_variant
from pallas_attn.spec.mask_bounds import keeps_nothing_between


def _balances(mask_mod, seq_kv: int) -> bool:
  """Whether the zigzag layout evens out the work: mask_mod is causal-like,
  its first query keeping not the last key for any b, h and captured
  values (by tile bounds; true of causal masks, causal windows and causal
  documents). Without a mask every device has the same work anyway."""
  if mask_mod is None:
    return False
  analysis = analyze_variant(mask_mod=mask_mod)
  return keeps_nothing_between(analysis, (0, 0), (seq_kv - 1, seq_kv - 1))


SEQUENCE_ORDERS = ("natural", "zigzag")


def context_parallel_attention(q, k, v, *, mesh, seq_axis, batch_axis=None, head_axis=None,
                               segment_ids=None, load_balance=None, sequence_order="natural",
                               return_lse=False, **attention_kwargs):
  """`pallas_attn.attention` with the sequence split over mesh axis `seq_axis`.

  q `[B, Sq, Hq, Dqk]`, k `[B, Skv, Hkv, Dqk]`, v `[B, Skv, Hkv, Dv]` (global
  arrays, e.g. sharded `P(batch_axis, seq_axis, head_axis)`); the output is
  sharded so. Each device computes its queries against every block of keys
  in a ring (`ring_attention`), never holding more than two blocks of keys.
  score_mod and mask_mod see global positions, batch rows and heads, as on
  one device. `segment_ids` (`[B, S]` or `[S]`, or a pair for queries and
  keys): document ids, sharded with the sequence, ANDed into the mask as
  `variants.document` would be; pass them here rather than closing over
  them, so that each device holds its shard and the key ids travel with
  the keys. `load_balance`: None (auto) uses the zigzag layout when the
  mask is causal-like (see `_balances`), True / False force it; the
  inputs' shards are moved into it and the output back. With
  `sequence_order="zigzag"` the inputs (and segment ids) are already in
  that order along the sequence (`pallas_attn.distributed.zigzag_order`),
  and so is the output (and the lse): no moves, the zigzag layout whatever
  the mask; positions seen by score_mod / mask_mod stay the natural ones.
  `attention_kwargs`: score_mod, mask_mod, rownorm (softmax or elementwise),
  scale, sinks, head_groups (`ring_attention`'s), config, bwd_config,
  interpret, implementation. Called outside jit (eagerly, or differentiated
  eagerly) it runs as one jitted program, compiled once per variant, shapes
  and options.
  """
  _check_arguments(mesh, attention_kwargs, seq_axis=seq_axis, batch_axis=batch_axis,
                   head_axis=head_axis)
  arrays = dict(q=q, k=k, v=v, segment_ids=segment_ids,
                sinks=attention_kwargs.pop("sinks", None))
  mods = {name: attention_kwargs.pop(name, default) for name, default in
          (("score_mod", None), ("mask_mod", None), ("rownorm", "softmax"))}
  return as_one_program(_context_parallel, arrays, mesh=mesh, seq_axis=seq_axis,
                        batch_axis=batch_axis, head_axis=head_axis, load_balance=load_balance,
                        sequence_order=sequence_order, return_lse=return_lse, **mods,
                        **attention_kwargs)


def _check_arguments(mesh, attention_kwargs, **axes):
  """Clear errors for `attention` keywords the ring does not take and for
  mesh axes the mesh lacks (else a TypeError naming ring_attention, or a
  KeyError)."""
  descales = [name for name in ("q_descale", "k_descale", "v_descale") if name in attention_kwargs]
  if descales:
    raise TypeError(
        f"context_parallel_attention takes no fp8 inputs ({', '.join(descales)} given): its "
        "ring runs bfloat16, float16 or float32 blocks. Dequantize first (x.astype(jnp.bfloat16)"
        " * descale), or run pallas_attn.attention on fp8 inputs sharded over batch and heads")
  if "block_mask" in attention_kwargs:
    raise TypeError("context_parallel_attention takes no block_mask: each ring step attends "
                    "another block of keys, whose tiles it classifies from mask_mod itself; "
                    "pass mask_mod alone")
  for name, axis in axes.items():
    for part in (axis if isinstance(axis, tuple) else (axis,)):
      if part is not None and part not in mesh.shape:
        raise ValueError(f"{name} {part!r} is not an axis of the mesh (its axes: "
                         f"{tuple(mesh.shape)})")


def _context_parallel(q, k, v, *, mesh, seq_axis, batch_axis=None, head_axis=None,
                      segment_ids=None, load_balance=None, sequence_order="natural",
                      return_lse=False, **attention_kwargs):
  """`context_parallel_attention`'s program (traced inside `as_one_program`)."""
  num = mesh.shape[seq_axis]
  seq_q, seq_kv = q.shape[1], k.shape[1]
  for name, length in (("q", seq_q), ("k/v", seq_kv)):
    if length % num:
      raise ValueError(f"context_parallel_attention: the {name} sequence ({length}) must "
                       f"split evenly over the {num} devices of mesh axis {seq_axis!r}")
  if sequence_order not in SEQUENCE_ORDERS:
    raise ValueError(f"sequence_order must be one of {SEQUENCE_ORDERS}; got {sequence_order!r}")
  preordered = sequence_order == "zigzag"
  if preordered and load_balance is False:
    raise ValueError("sequence_order='zigzag' is the load-balanced layout already; "
                     "load_balance=False contradicts it (pass inputs in natural order instead)")
  if load_balance is None:
    load_balance = num > 1 and _balances(attention_kwargs.get("mask_mod"), seq_kv)
  layout = layout_lib.ZIGZAG if load_balance or preordered else layout_lib.CONTIGUOUS
  layout_lib.check_layout(layout, seq_q // num, seq_kv // num)
  qkv_spec = PartitionSpec(batch_axis, seq_axis, head_axis, None)
  ids = ring_lib.segment_id_pair(segment_ids, q.shape[0], seq_q, seq_kv)
  ids_spec = PartitionSpec(batch_axis, seq_axis)
  out_specs = qkv_spec
  if return_lse:
    out_specs = (qkv_spec, PartitionSpec(batch_axis, head_axis, seq_axis))

  moves, kv_layout = None, None
  if layout == layout_lib.ZIGZAG and not preordered:
    # Over two devices the keys need not move: with the queries in the zigzag
    # layout each device's work against all keys is the same (chunks i and
    # 3 - i of 4) whichever half of the keys it holds, and no block is passed
    # on, so that no step waits for another device's longer one. Over more,
    # contiguous keys would make a device's steps uneven and a forwarded
    # block late (a model of the ring: 15% slower at 8 devices).
    keys_stay = num == 2
    moves = ring_lib.Relayout(lambda arrays: layout_lib.to_zigzag(arrays, seq_axis, num),
                              lambda arrays: layout_lib.from_zigzag(arrays, seq_axis, num),
                              moves_keys=not keys_stay)
    kv_layout = layout_lib.CONTIGUOUS if keys_stay else None
  head_groups = attention_kwargs.pop("head_groups", None)

  def local(q, k, v, q_ids, kv_ids):
    groups = ring_lib.default_head_groups(k) if head_groups is None else head_groups
    # One group: the moves outside the ring (differentiated by JAX: the backward
    # keeps the moved inputs rather than moving them again); several: inside it.
    outside = moves is not None and groups == 1
    if outside:
      keys = [(k, 1), (v, 1), (kv_ids, 1)] if moves.moves_keys else []
      q, q_ids, *moved_keys = ring_lib.moved(moves.to_ring, (q, 1), (q_ids, 1), *keys)
      if moved_keys:
        k, v, kv_ids = moved_keys
    result = ring_lib.ring_attention(
        q, k, v, axis_name=seq_axis, layout=layout,
        segment_ids=None if q_ids is None else (q_ids, kv_ids), return_lse=return_lse,
        batch_axis=batch_axis, head_axis=head_axis, head_groups=groups,
        relayout=None if outside else moves, kv_layout=kv_layout, **attention_kwargs)
    if not outside:
      return result
    out, lse = result if return_lse else (result, None)
    out, lse = ring_lib.moved(moves.from_ring, (out, 1), (lse, 2))
    return (out, lse) if return_lse else out

  in_specs = (qkv_spec,) * 3 + (ids_spec,) * 2
  args = [_resharded(x, mesh, spec) for x, spec in zip((q, k, v, *ids), in_specs)]
  with backend.triton_deprecation_ignored():
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)(*args)


def _resharded(x, mesh, spec):
  """`x` as `shard_map` takes it: on a mesh of explicit axes, resharded to `spec`."""
  if x is None or jax.sharding.AxisType.Explicit not in getattr(mesh, "axis_types", ()):
    return x
  return jax.sharding.reshard(x, NamedSharding(mesh, spec))
