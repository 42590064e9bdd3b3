"""Decoding against a KV cache whose sequence axis is split over devices.

A long context's cache may not fit one device: `sharded_decode_attention`
takes a cache `[B, S_max, Hkv, D]` sharded over mesh axis `axis_name` on
its sequence axis (device i holds positions `[i * S_loc, (i + 1) * S_loc)`,
S_loc = S_max / N) and the queries replicated over that axis. Inside a
`jax.shard_map` each device runs the single-device split-KV decode
(split_kv.py) on its shard, with `kv_lengths[b] - i * S_loc` keys (clamped
into [0, S_loc]: a shard past a sequence's end keeps nothing), and returns
its output and its rows' log-sum-exp. score_mod and mask_mod are wrapped so
that they see global positions: key j of the shard at `i * S_loc + j`,
query t at `kv_lengths[b] - Sq + t` (and the global batch row and head
where those are split too), so causal masks and sliding windows are exact,
and a window's tile bounds still skip the shards and blocks it does not
reach. `partitioned_decode` is the same per shard for `decode_attention`
under `jax.jit`, on whatever sharding XLA's partitioner finds
(distributed/partitioning.py with `kv_sequence`).

The parts merge by log-sum-exp: one `all_gather` over `axis_name` of each
shard's output and `[B, Hq, Sq]` log-sum-exp, then on every device the
outputs weighted by `exp(lse_i - max)` over the weights' sum; a sink logit
joins the merge once (not once per shard). Elementwise rownorms merge by a
plain `psum`. What crosses devices is O(N * B * Sq * Hq * Dv) per device;
the cache never moves.

`sharded_paged_attention` does the same on paged caches, each device
holding its positions in pages of its own pool.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from pallas_attn import _inputs, split_kv
from pallas_attn.distributed import layout
from pallas_attn.distributed.context_parallel import _resharded
from pallas_attn.distributed.one_program import as_one_program
from pallas_attn.distributed.partitioning import (BATCH, HEADS, KV_HEADS, KV_SEQUENCE, Dims,
                                                  Shard, partitioned)
from pallas_attn.kernels import backend
from pallas_attn.spec.analysis import VariantAnalysis, analyze_variant, as_mods, consts_of


def _check_rownorm(analysis: VariantAnalysis, sinks, heads: int):
  """The `[Hq]` sinks (or None); raises for rownorms whose parts cannot merge."""
  rownorm = analysis.rownorm
  if rownorm.kind == "normalized":
    raise ValueError(
        f"sharded decoding merges the shards' parts by log-sum-exp (softmax rownorms) or by "
        f"a sum (elementwise ones); rownorm '{rownorm.name}' is normalized (g(s) / h(row "
        "statistics)), whose output cannot be merged from each shard's normalized output "
        "and h. Gather the cache's sequence axis and use pallas_attn.decode_attention for it")
  if rownorm.sink is not None:
    raise ValueError(
        f"rownorm '{rownorm.name}' has a sink term, which each shard's decode would add once; "
        f"with sharded decoding pass rownorm='softmax' and sinks=jnp.full((Hq,), "
        f"{rownorm.sink:g}) instead (the sink joins the merge once)")
  return _inputs.resolve_sinks(sinks, analysis, heads)


def _global_variant(score_mod, mask_mod, q_shift, kv_offset, batch_offset, head_offset=None):
  """(score_mod, mask_mod) on a shard's local indices, calling the user's at
  global ones: b + batch_offset, h + head_offset, q_idx + q_shift[b]
  (q_shift `[B]`: the global length minus the shard's), kv_idx + kv_offset."""
  def indices(b, h, q_idx, kv_idx):
    global_b = b if batch_offset is None else b + batch_offset
    global_h = h if head_offset is None else h + head_offset
    return global_b, global_h, q_idx + q_shift[b], kv_idx + kv_offset

  wrapped_score = wrapped_mask = None
  if score_mod is not None:
    def wrapped_score(score, b, h, q_idx, kv_idx):
      return score_mod(score, *indices(b, h, q_idx, kv_idx))
  if mask_mod is not None:
    def wrapped_mask(b, h, q_idx, kv_idx):
      return mask_mod(*indices(b, h, q_idx, kv_idx))
  return wrapped_score, wrapped_mask


def _merge(kind: str, out, lse, sinks, axis_name):
  """This device's part (out `[B, Sq, Hq, Dv]`, lse `[B, Hq, Sq]`) merged
  with the other shards' over `axis_name`: (out float32, lse). One
  collective: every shard's part is gathered (packed into one buffer) and
  each device merges them; a `pmax` followed by a `psum` costs two
  collectives' latency, and XLA:GPU ran the `pmax` as a kernel that took as
  long as the decode itself (four H200s, 2026-11-26)."""
  out = out.astype(jnp.float32)
  if kind == "elementwise":
    return lax.psum(out, axis_name), None
  gathered = lax.all_gather(layout.pack([out, lse]), axis_name)
  outs, lses = jax.vmap(lambda message: layout.unpack(message, [out, lse]))(gathered)
  top = jnp.max(lses, axis=0)
  if sinks is not None:
    top = jnp.maximum(top, sinks[None, :, None])
  safe = jnp.where(top == -jnp.inf, 0.0, top)
  weights = jnp.exp(lses - safe)  # 0 for a shard that kept nothing
  total = jnp.sum(outs * jnp.transpose(weights, (0, 1, 3, 2))[..., None], axis=0)
  denominator = jnp.sum(weights, axis=0)
  if sinks is not None:
    denominator = denominator + jnp.exp(sinks[None, :, None] - safe)
  empty = denominator == 0.0
  out = total / jnp.transpose(jnp.where(empty, 1.0, denominator), (0, 2, 1))[..., None]
  lse = jnp.where(empty, -jnp.inf, safe + jnp.log(jnp.where(empty, 1.0, denominator)))
  return out, lse


def _stacked_descales(k_descale, v_descale, k, batch: int, k_name: str = "k_cache"):
  """`[B, Hkv, 2]` float32 (k's, v's descale), partitioned with the batch
  and kv heads; None for a cache that is not fp8 (`_inputs.descales`)."""
  descales = _inputs.descales(k_descale, v_descale, k, batch, k_name)
  if descales is None:
    return None
  return jnp.stack([_inputs.per_head_descale(x, batch, k.shape[2]) for x in descales], axis=-1)


def _decode_shard(shard: Shard, q, k, v, lengths, page_table, sinks, descales, *, score_mod,
                  mask_mod, shard_length: int, analysis: VariantAnalysis, options, return_lse):
  """One shard's decode (`shard`: its offsets, "kv" where it holds a run of
  `shard_length` cache positions), merged over `shard.kv_axes`."""
  offset = shard.offsets.get("kv")
  merged = bool(shard.kv_axes)
  if merged:
    _check_rownorm(analysis, sinks, q.shape[2])
  shard_lengths = lengths if offset is None else jnp.clip(lengths - offset, 0, shard_length)
  score_mod, mask_mod = _global_variant(score_mod, mask_mod, lengths - shard_lengths,
                                        0 if offset is None else offset, shard.offsets.get("b"),
                                        shard.offsets.get("h"))
  out, lse = split_kv.decode_with_statistic(
      q, k, v, shard_lengths, page_table=page_table, score_mod=score_mod, mask_mod=mask_mod,
      rownorm=options["rownorm"], sinks=None if merged else sinks, scale=options["scale"],
      config=options["config"], interpret=options["interpret"],
      **({} if descales is None else dict(k_descale=descales[..., 0],
                                           v_descale=descales[..., 1])))
  if merged:
    out, lse = _merge(analysis.rownorm.kind, out, lse, sinks, shard.kv_axes)
  out = out.astype(q.dtype)
  return (out, lse) if return_lse else out


Q_DIMS = Dims((BATCH, None, HEADS, None), "q")
CACHE_DIMS = Dims((BATCH, KV_SEQUENCE, KV_HEADS, None), "the KV cache")
OUT_DIMS = Dims((BATCH, None, HEADS, None), "the output")


def partitioned_decode(q, k, v, lengths, *, score_mod, mask_mod, rownorm, sinks, scale, config,
                       interpret, k_descale=None, v_descale=None):
  """`decode_attention`'s output on a cache however XLA's partitioner finds
  it sharded (distributed/partitioning.py): batch and heads like q, and the
  cache's sequence, whose shards decode their run of positions and merge
  as `sharded_decode_attention`'s do; captured arrays replicated."""
  analysis = analyze_variant(score_mod, mask_mod, rownorm)
  if sinks is not None:  # checked here; a rownorm's own sink stays in the rownorm
    sinks = _inputs.resolve_sinks(sinks, analysis, q.shape[2])
  consts = consts_of(analysis)
  descales = _stacked_descales(k_descale, v_descale, k, q.shape[0])
  options = dict(rownorm=rownorm, scale=scale, config=config, interpret=interpret)

  def local(shard, q, k, v, lengths, consts, sinks, descales):
    local_score, local_mask = as_mods(analysis, consts)
    return _decode_shard(shard, q, k, v, lengths, None, sinks, descales,
                         score_mod=local_score, mask_mod=local_mask, shard_length=k.shape[1],
                         analysis=analysis, options=options, return_lse=False)

  replicated = lambda x: Dims((None,) * jnp.ndim(x), "a captured array")
  arg_dims = (Q_DIMS, CACHE_DIMS, CACHE_DIMS, Dims((BATCH,), "kv_lengths"),
              jax.tree.map(replicated, consts), None if sinks is None else Dims((HEADS,), "sinks"),
              None if descales is None else Dims((BATCH, KV_HEADS, None), "the descales"))
  with backend.triton_deprecation_ignored():
    return partitioned(local, (q, k, v, lengths, consts, sinks, descales), arg_dims, OUT_DIMS,
                       group=q.shape[2] // k.shape[2], kv_sequence=True)


def _run(q, k, v, lengths, page_table, sinks, descales, *, mesh, axis_name, batch_axis,
         shard_length, analysis, options, return_lse):
  """The shard_map over the mesh; the cache's sharded axis is 1 (contiguous)
  or 0 (pages, with the page table's axis 1)."""
  paged = page_table is not None
  batch = PartitionSpec(batch_axis)
  cache = (PartitionSpec(axis_name) if paged
           else PartitionSpec(batch_axis, axis_name))
  in_specs = [batch, cache, cache, batch]
  args = [q, k, v, lengths]
  if paged:
    in_specs.append(PartitionSpec(batch_axis, axis_name))
    args.append(page_table)
  if sinks is not None:
    in_specs.append(PartitionSpec())
    args.append(jnp.asarray(sinks, jnp.float32))
  if descales is not None:
    in_specs.append(batch)
    args.append(descales)
  with_lse = return_lse and analysis.rownorm.kind != "elementwise"
  out_specs = (batch, PartitionSpec(batch_axis)) if with_lse else batch

  def local(q, k, v, lengths, *rest):
    rest = list(rest)
    table = rest.pop(0) if paged else None
    local_sinks = rest.pop(0) if sinks is not None else None
    local_descales = rest.pop(0) if descales is not None else None
    offsets = {"kv": lax.axis_index(axis_name) * shard_length}
    if batch_axis is not None:
      offsets["b"] = lax.axis_index(batch_axis) * q.shape[0]
    shard = Shard(offsets, () if batch_axis is None else (batch_axis,), (), (axis_name,))
    return _decode_shard(shard, q, k, v, lengths, table, local_sinks, local_descales,
                         score_mod=options["score_mod"], mask_mod=options["mask_mod"],
                         shard_length=shard_length, analysis=analysis, options=options,
                         return_lse=with_lse)

  args = [_resharded(x, mesh, spec) for x, spec in zip(args, in_specs)]
  with backend.triton_deprecation_ignored():
    result = jax.shard_map(local, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs,
                           check_vma=False)(*args)
  return (result, None) if return_lse and not with_lse else result


def _run_program(q, k, v, lengths, page_table, sinks, descales, *, score_mod, mask_mod,
                 rownorm, scale, config, interpret, **run_options):
  """`_run` as `as_one_program` calls it (the mods rebuilt from their analysis)."""
  options = dict(score_mod=score_mod, mask_mod=mask_mod, rownorm=rownorm, scale=scale,
                 config=config, interpret=interpret)
  return _run(q, k, v, lengths, page_table, sinks, descales,
              analysis=analyze_variant(score_mod, mask_mod, rownorm), options=options,
              **run_options)


def _check_mesh(mesh, axis_name, batch_axis, batch: int, length: int, what: str) -> int:
  """The number of shards of the cache's sequence; raises for an uneven split."""
  for name in (axis_name,) + (() if batch_axis is None else (batch_axis,)):
    if name not in mesh.shape:
      raise ValueError(f"mesh axis {name!r} is not in the mesh {dict(mesh.shape)}")
  if batch_axis == axis_name:
    raise ValueError(f"batch_axis and axis_name are both {axis_name!r}: the batch and the "
                     "cache's sequence must be split over different mesh axes")
  num = mesh.shape[axis_name]
  if length % num:
    raise ValueError(f"sharded decoding: the cache's {what} ({length}) must split evenly over "
                     f"the {num} devices of mesh axis {axis_name!r}")
  if batch_axis is not None and batch % mesh.shape[batch_axis]:
    raise ValueError(f"sharded decoding: the batch ({batch}) must split evenly over the "
                     f"{mesh.shape[batch_axis]} devices of mesh axis {batch_axis!r}")
  return num


def sharded_decode_attention(q, k_cache, v_cache, kv_lengths, *, mesh, axis_name,
                             batch_axis=None, score_mod=None, mask_mod=None,
                             rownorm="softmax", sinks=None, scale=None, config=None,
                             interpret=None, return_lse=False, k_descale=None,
                             v_descale=None):
  """`pallas_attn.decode_attention` on a KV cache whose sequence axis is
  split over mesh axis `axis_name`.

  q `[B, Sq, Hq, D]` and kv_lengths `[B]` (replicated, or split over
  `batch_axis` with the cache's batch); k_cache `[B, S_max, Hkv, D]` and
  v_cache `[B, S_max, Hkv, Dv]` global arrays, sharded e.g.
  `P(batch_axis, axis_name)`: device i of `axis_name` holds positions
  `[i * S_max / N, (i + 1) * S_max / N)`; S_max must split evenly. Works
  under `jax.jit` and eagerly (arrays are resharded to that layout where
  needed). Positions and keyword arguments are `decode_attention`'s:
  score_mod / mask_mod see global key positions and query i of sequence b
  at `kv_lengths[b] - Sq + i`; `config` applies to each device's shard.

  Each device decodes its shard and the parts merge by log-sum-exp after
  one `all_gather` of the `[B, Sq, Hq, Dv]` outputs and `[B, Hq, Sq]`
  log-sum-exps over `axis_name` (elementwise rownorms: one `psum`); the
  cache is never gathered. Softmax and elementwise rownorms; `sinks` count once.
  Returns the output `[B, Sq, Hq, Dv]` in q's dtype (sharded like q), and
  with `return_lse` the log-sum-exp `[B, Hq, Sq]` (None for elementwise
  rownorms). Forward only.
  """
  split_kv.validate(q, k_cache, v_cache, kv_lengths, "k_cache", "v_cache")
  seq = k_cache.shape[1]
  num = _check_mesh(mesh, axis_name, batch_axis, q.shape[0], seq, "sequence length")
  lengths = split_kv.checked_lengths(kv_lengths, q.shape[1], seq)
  sinks = _check_rownorm(analyze_variant(score_mod, mask_mod, rownorm), sinks, q.shape[2])
  descales = _stacked_descales(k_descale, v_descale, k_cache, q.shape[0])
  return as_one_program(
      _run_program, dict(q=q, k=k_cache, v=v_cache, lengths=lengths, page_table=None,
                         sinks=sinks, descales=descales),
      score_mod=score_mod, mask_mod=mask_mod, rownorm=rownorm, scale=scale, config=config,
      interpret=interpret, mesh=mesh, axis_name=axis_name, batch_axis=batch_axis,
      shard_length=seq // num, return_lse=return_lse)


def sharded_paged_attention(q, k_pages, v_pages, page_table, kv_lengths, *, mesh, axis_name,
                            batch_axis=None, score_mod=None, mask_mod=None,
                            rownorm="softmax", sinks=None, scale=None, config=None,
                            interpret=None, return_lse=False, k_descale=None,
                            v_descale=None):
  """`pallas_attn.paged_attention` on a paged cache split over mesh axis
  `axis_name`: each device holds a run of positions in its own pool of pages.

  k_pages `[N * P, page_size, Hkv, D]`, v_pages `[N * P, page_size, Hkv,
  Dv]`: device i's pool is pages `[i * P, (i + 1) * P)` (sharded
  `P(axis_name)` on axis 0); page_table `[B, N * M]` int32 (sharded
  `P(batch_axis, axis_name)`): device i holds positions `[i * M * page_size,
  (i + 1) * M * page_size)` of each sequence, position p on row
  `p % page_size` of its local page `page_table[b, p // page_size]`, an
  index into its own pool in [0, P). The other arguments, the positions
  and what crosses devices are `sharded_decode_attention`'s. Page indices
  of the pages a sequence uses are checked when concrete; otherwise
  clamped into the device's pool.
  """
  split_kv.validate(q, k_pages, v_pages, kv_lengths, "k_pages", "v_pages", paged=True)
  split_kv.check_page_table(page_table, q.shape[0], "N * max_pages")
  num = _check_mesh(mesh, axis_name, batch_axis, q.shape[0], page_table.shape[1],
                    "page table's pages per sequence")
  if k_pages.shape[0] % num:
    raise ValueError(f"sharded paged decoding: the pages ({k_pages.shape[0]}) must split "
                     f"evenly over the {num} devices of mesh axis {axis_name!r}")
  page_size = k_pages.shape[1]
  shard_length = page_table.shape[1] // num * page_size
  lengths = split_kv.checked_lengths(kv_lengths, q.shape[1], shard_length * num)
  split_kv.check_pages(page_table, lengths, page_size, k_pages.shape[0] // num)
  sinks = _check_rownorm(analyze_variant(score_mod, mask_mod, rownorm), sinks, q.shape[2])
  descales = _stacked_descales(k_descale, v_descale, k_pages, q.shape[0], "k_pages")
  return as_one_program(
      _run_program, dict(q=q, k=k_pages, v=v_pages, lengths=lengths,
                         page_table=page_table.astype(jnp.int32), sinks=sinks,
                         descales=descales),
      score_mod=score_mod, mask_mod=mask_mod, rownorm=rownorm, scale=scale, config=config,
      interpret=interpret, mesh=mesh, axis_name=axis_name, batch_axis=batch_axis,
      shard_length=shard_length, return_lse=return_lse)
