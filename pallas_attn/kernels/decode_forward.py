"""The split-KV (flash-decoding) forward template.

Decoding runs a few query tokens against a long KV cache: the work is
reading the cache. One program per (row block, split, batch, kv head)
folds a contiguous run of the sequence's key blocks into the online row
state of the variant's rownorm class, for a tile whose rows are the query
heads of the kv head's GQA group times the query tokens (row
`i * group + g`: token i of head `kv_head * group + g`), so each K/V byte
is read once. With one split the program finalizes and writes the output;
with more, each writes its partial state and `combine` merges them
(`OnlineRowNorm.merge`: log-sum-exp for softmax).

The variant-specific parts are the parallel template's: score_mod and
mask_mod evaluated on tiles by the interpreter (`tiles.TileContext`), with
`h` and `q_idx` per-row columns; captured arrays read by head or query
index are gathered at each row's index (`tiles.gathered_per_row`), the
others blocked as in the parallel template.

Ragged lengths: sequence b's keys are `[0, kv_len[b])` and only their
blocks are split; keys at or past its length are never read (the last
block's rows are clamped to the last key and masked), so the cache is
never padded or copied. With a mask_mod whose tile bounds decide blocks,
the live blocks' range comes per (sequence, kv head) from
`spec.mask_bounds.live_kv_blocks` and only it is split. The cache is contiguous
`[B, S_max, Hkv, D]` or paged `[num_pages, page_size, Hkv, D]` read through
a page table (clamped into the pages: no out-of-bounds read).

`TEMPLATE` is the template as the scheduler sees it (schedule/template.py):
K/V tiles pipelined `num_stages` deep next to a resident tile of packed
query rows, the keys split `num_splits` ways.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_attn.kernels import backend, tiles
from pallas_attn.kernels.online import LOG2E
from pallas_attn.kernels.parallel_forward import VariantPlan, streamed_kv_use
from pallas_attn.schedule.config import DecodeConfig, heuristic_decode_config, next_power_of_2
from pallas_attn.schedule.device import DeviceConfig, device_config
from pallas_attn.schedule.template import ProblemShape, TileCheck, TritonTemplate, register

KEY_BLOCK_CHOICES = (32, 64, 128, 256)  # block_k searched


@dataclasses.dataclass(frozen=True)
class DecodePlan(VariantPlan):
  """Static parameters of one split-KV kernel instance. Its analysis reads
  by head or query index as gathers (tiles.gathered_per_row); seq_q is the
  query tokens per sequence; the sink logits apply when finalizing."""
  d_qk: int
  d_v: int
  max_length: int            # keys a sequence may have (S_max, or pages x page size)
  queries_at_end: bool       # token i at kv_len - seq_q + i (decoding), else at i
  page_size: int | None      # paged cache; None: contiguous
  has_ranges: bool           # live kv block ranges from mask_bounds.live_kv_blocks
  config: DecodeConfig       # complete (heuristic_decode_config)
  descaled: bool = False     # an fp8 cache: k's descale folds into the scores, v's the output
  v_pairs: bool = False      # an e4m3 V read as uint16 column pairs (`pair_view`)
  pairs_asm: bool = False    # their conversion in PTX (backend.e4m3_pairs_supported)

  @property
  def v_width(self) -> int:
    """Columns of V as the kernel reads it (column pairs: half)."""
    return self.d_v // 2 if self.v_pairs else self.d_v

  @property
  def rows(self) -> int:
    return self.group * self.seq_q

  @property
  def row_blocks(self) -> int:
    return -(-self.rows // self.config.block_rows)

  @property
  def finalizes(self) -> bool:
    """One split: the kernel writes the output itself, no combine step."""
    return self.config.num_splits == 1


def _columns(width: int, true_width: int):
  """`[1, width]` column indices for a power-of-two `width`, those past
  `true_width` clamped to its last column (read twice, never out of bounds)."""
  cols = tiles.tile_indices(0, width, axis=1)
  return cols if width == true_width else jnp.minimum(cols, true_width - 1)


def _decode_kernel(lengths_ref, *refs, plan: DecodePlan):
  refs = list(refs)
  ranges_ref = refs.pop(0) if plan.has_ranges else None
  table_ref = refs.pop(0) if plan.page_size else None
  q_ref, k_ref, v_ref = refs[:3]
  cap_refs = refs[3:3 + len(plan.operands)]
  refs = refs[3 + len(plan.operands):]
  descale_refs = (refs.pop(0), refs.pop(0)) if plan.descaled else None
  sink_ref = refs.pop(0) if plan.has_sink and plan.finalizes else None
  out_ref, stats_ref = refs
  cfg, group = plan.config, plan.group
  bk, block_rows = cfg.block_k, cfg.block_rows
  # Row blocks of one split launch together, so that the later ones find its keys in L2.
  split, row_block = pl.program_id(0) // plan.row_blocks, pl.program_id(0) % plan.row_blocks
  b, kv_head = pl.program_id(1), pl.program_id(2)
  online, tile = plan.online, plan.tile

  kv_len = jnp.clip(lengths_ref[...], 0, plan.max_length)
  if plan.has_ranges:
    first, end = ranges_ref[0], ranges_ref[1]
  else:
    first, end = 0, pl.cdiv(kv_len, bk)
  per_split = pl.cdiv(end - first, cfg.num_splits)
  start = first + split * per_split
  stop = jnp.minimum(start + per_split, end)
  num_inside = kv_len // bk  # blocks that end at or before the sequence's length

  # Rows past the packed ones repeat the last: same inputs, same values, so
  # their (duplicate) stores write what the last row writes.
  rows = jnp.minimum(tiles.tile_indices(row_block * block_rows, block_rows, axis=0),
                     plan.rows - 1)
  token, member = rows // group, rows % group
  h = kv_head * group + member
  q_idx = token + (kv_len - plan.seq_q if plan.queries_at_end else 0)
  d_qk, d_v = (next_power_of_2(max(16, d)) for d in (plan.d_qk, plan.v_width))
  qk_cols, v_cols = _columns(d_qk, plan.d_qk), _columns(d_v, plan.v_width)
  q = q_ref[token, member, qk_cols]
  if d_qk != plan.d_qk:
    q = jnp.where(tiles.tile_indices(0, d_qk, axis=1) < plan.d_qk, q, 0)
  fold = plan.folds_log2
  qk_scale = plan.scale * LOG2E if fold else plan.scale
  v_scale = None
  if descale_refs is not None:  # real K = K8 * k_descale: a factor of every score
    q, q_factor = _float16_query(q)
    qk_scale, v_scale = qk_scale * descale_refs[0][0] * q_factor, descale_refs[1][0]

  slices = not plan.page_size and (d_qk, d_v) == (plan.d_qk, plan.v_width)

  def key_index(kv_start, tail: bool):
    """The leading index of one block's keys in the K/V refs: a slice of a
    contiguous cache (whole rows, off the ragged tail), else positions, the
    tail's clamped to the last key, through the table of a paged cache."""
    if slices and not tail:
      return (pl.ds(kv_start, bk),)
    positions = tiles.tile_indices(kv_start, bk, axis=0)
    if tail:  # past the length: the last key again (masked below)
      positions = jnp.minimum(positions, jnp.maximum(kv_len - 1, 0))
    if not plan.page_size:
      return (positions,)
    page = jnp.clip(table_ref[positions // plan.page_size], 0, k_ref.shape[0] - 1)
    return (page, positions % plan.page_size)

  def load(ref, index, cols):
    return ref[index + ((slice(None),) if isinstance(index[0], pl.Slice) else (cols,))]

  def fold_block(kv_block, state, tail: bool):
    kv_start = pl.multiple_of(kv_block * bk, bk)
    index = key_index(kv_start, tail)
    k, v = load(k_ref, index, qk_cols), load(v_ref, index, v_cols)
    # An fp8 cache converts to float16 on load (its descales apply outside).
    # An e4m3 V comes as column pairs, two products; else V is transposed in
    # registers first and its product takes it as `[Dv, keys]`: Triton's
    # loop then ran 2-3.5% faster (one H100; benchmarks/results/NOTES.md).
    transposed = k.dtype != q.dtype and not plan.v_pairs
    if k.dtype != q.dtype:
      k = k.astype(q.dtype)
    if plan.v_pairs:
      v = backend.e4m3_pairs_to_float16(v, asm=plan.pairs_asm)
    elif transposed:
      v = v.T.astype(q.dtype)
    s = backend.dot(q, k, trans_b=True, fp32_exact=plan.fp32_exact) * qk_scale
    kv_idx = tiles.tile_indices(kv_start, bk, axis=1)
    s = tile.score(s, b, h, q_idx, kv_idx, cap_refs, kv_start, bk)
    keep = tile.mask(b, h, q_idx, kv_idx, cap_refs, kv_start, bk)
    if tail:
      in_bounds = kv_idx < kv_len
      keep = in_bounds if keep is None else jnp.logical_and(keep, in_bounds)
    return online.update(state, s, keep, v, kv_idx=kv_idx, log2_logits=s if fold else None,
                         v_transposed=transposed)

  sink2 = sink_ref[h] if sink_ref is not None else None
  state = online.init(block_rows, (d_v, d_v) if plan.v_pairs else d_v, sink2)
  if plan.page_size or bk <= plan.max_length:  # else no block ends inside a sequence
    state = jax.lax.fori_loop(start, jnp.minimum(stop, num_inside),
                              lambda j, st: fold_block(j, st, False), state)
  state = jax.lax.fori_loop(jnp.maximum(start, num_inside), stop,
                            lambda j, st: fold_block(j, st, True), state)
  # Real V = V8 * v_descale: the output is linear in V, partial or final.
  scaled = (lambda out: out) if v_scale is None else (lambda out: out * v_scale)

  def store(index, out):
    """Output columns; column pairs' even and odd groups interleave."""
    if not plan.v_pairs:
      out_ref[index + (v_cols,)] = scaled(out).astype(out_ref.dtype)
      return
    for parity, group in enumerate(out):
      out_ref[index + (2 * v_cols + parity,)] = scaled(group).astype(out_ref.dtype)

  if plan.finalizes:
    out, stat = online.finalize(state)
    store((token, member), out)
    stats_ref[member[:, 0], token[:, 0]] = stat[:, 0]
    return
  store((rows,), state[0])
  for n, value in enumerate(online.partial_statistics(state)):
    stats_ref[n, rows[:, 0]] = value[:, 0]


def _input_specs(plan: DecodePlan, num_pages, max_pages, ranges_shape, capture_arrays):
  """BlockSpecs of the inputs, for the grid (split x row block, b, kv head)."""
  d_qk, group, seq_q = plan.d_qk, plan.group, plan.seq_q
  specs = [pl.BlockSpec((None,), lambda i, b, h: (b,))]
  if ranges_shape is not None:
    per_head = ranges_shape[1] > 1
    specs.append(pl.BlockSpec((None, None, 2),
                              lambda i, b, h: (b, h if per_head else 0, 0)))
  if plan.page_size:
    specs.append(pl.BlockSpec((None, max_pages), lambda i, b, h: (b, 0)))
  specs.append(pl.BlockSpec((None, seq_q, None, group, d_qk),
                            lambda i, b, h: (b, 0, h, 0, 0)))
  for d in (d_qk, plan.v_width):
    if plan.page_size:
      specs.append(pl.BlockSpec((num_pages, plan.page_size, None, d),
                                lambda i, b, h: (0, 0, h, 0)))
    else:
      specs.append(pl.BlockSpec((None, plan.max_length, None, d),
                                lambda i, b, h: (b, 0, h, 0)))
  specs += [tiles.capture_block_spec(op, x.shape, blocked="q", block=1)
            for op, x in zip(plan.operands, capture_arrays)]
  return specs


FLOAT16_QUERY_MAX = 2.0 ** 14  # scaled query magnitudes stay under float16's 65504


def _float16_query(q):
  """An fp8 cache's products run in float16: on Hopper e4m3 pairs convert to
  float16 in one instruction and to bfloat16 in several, which left decode
  as slow as from a bfloat16 cache at half the bytes. The query tile
  follows, divided by the power of two that brings its largest magnitude
  under FLOAT16_QUERY_MAX (exact); returns (float16 tile, that power of two:
  a factor of the scores). Formed in the kernel: as an XLA pass it cost
  two launches, 4 us of B8 8k's 65 (one H100, 2026-11-27)."""
  q32 = q.astype(jnp.float32)
  shift = jnp.maximum(jnp.ceil(jnp.log2(jnp.max(jnp.abs(q32)) / FLOAT16_QUERY_MAX)), 0.0)
  shift = jnp.where(shift <= 127.0, shift, 0.0)  # inf or NaN queries: kept as they are
  return (q32 * jnp.exp2(-shift)).astype(jnp.float16), jnp.exp2(shift)


def pair_view(v):
  """An e4m3 array `[..., D]` (D even) as uint16 `[..., D // 2]`: the same
  bytes, column 2i in element i's low byte, 2i + 1 in its high byte."""
  return jax.lax.bitcast_convert_type(v.reshape(*v.shape[:-1], v.shape[-1] // 2, 2), jnp.uint16)


def forward(q, k, v, lengths, ranges, page_table, capture_arrays, sinks, descales=None, *,
            plan: DecodePlan, interpret: bool):
  """Runs the split-KV kernel and, with several splits, the combine step.

  q `[B, Sq, Hq, Dqk]`; k, v `[B, S_max, Hkv, D]` or, with `page_table`
  `[B, max_pages]`, `[num_pages, page_size, Hkv, D]` (in q's dtype, or an
  fp8 cache with `descales`: k's and v's, `[B, Hkv]` or scalars); lengths `[B]`
  int32 keys per sequence; ranges `[B, Hm, 2]` live kv blocks or None;
  sinks `[Hq]` float32 natural-log sink logits or None. Returns (out
  `[B, Sq, Hq, Dv]` in q's dtype, row statistic `[B, Hq, Sq]` float32 as
  `OnlineRowNorm.finalize` gives it).
  """
  batch, seq_q, heads, _ = q.shape
  heads_kv = k.shape[2]
  cfg, group = plan.config, plan.group
  q5 = q.reshape(batch, seq_q, heads_kv, group, q.shape[-1])
  in_specs = _input_specs(plan, k.shape[0], None if page_table is None else page_table.shape[1],
                          None if ranges is None else ranges.shape, capture_arrays)
  inputs = [lengths.astype(jnp.int32)]
  if ranges is not None:
    inputs.append(ranges)
  if plan.page_size:
    inputs.append(page_table.astype(jnp.int32))
  inputs += [q5, k, pair_view(v) if plan.v_pairs else v, *capture_arrays]
  for descale in descales if plan.descaled else ():  # [B, Hkv] or a scalar, as [.., 1]
    per_head = descale.ndim == 2
    inputs.append(descale.reshape(*(descale.shape if per_head else (1, 1)), 1))
    in_specs.append(pl.BlockSpec((None, None, 1), (lambda i, b, h: (b, h, 0)) if per_head
                                 else (lambda i, b, h: (0, 0, 0))))
  sink2 = None if sinks is None else sinks.astype(jnp.float32) * LOG2E
  grid = (cfg.num_splits * plan.row_blocks, batch, heads_kv)
  blocks = plan.row_blocks
  d_v = plan.d_v
  if plan.finalizes:
    if sink2 is not None:
      inputs.append(sink2)
      in_specs.append(pl.BlockSpec((heads,), lambda i, b, h: (0,)))
    out_shape = [jax.ShapeDtypeStruct((batch, seq_q, heads_kv, group, d_v), q.dtype),
                 jax.ShapeDtypeStruct((batch, heads_kv, group, seq_q), jnp.float32)]
    out_specs = [pl.BlockSpec((None, seq_q, None, group, d_v),
                              lambda i, b, h: (b, 0, h, 0, 0)),
                 pl.BlockSpec((None, None, group, seq_q),
                              lambda i, b, h: (b, h, 0, 0))]
  else:
    rows, splits = plan.rows, cfg.num_splits
    num_stats = max(plan.online.num_partial_statistics, 1)  # elementwise: unused
    out_shape = [jax.ShapeDtypeStruct((batch, heads_kv, splits, rows, d_v), jnp.float32),
                 jax.ShapeDtypeStruct((batch, heads_kv, splits, num_stats, rows), jnp.float32)]
    out_specs = [pl.BlockSpec((None, None, None, rows, d_v),
                              lambda i, b, h: (b, h, i // blocks, 0, 0)),
                 pl.BlockSpec((None, None, None, num_stats, rows),
                              lambda i, b, h: (b, h, i // blocks, 0, 0))]
  call = backend.pallas_call(
      functools.partial(_decode_kernel, plan=plan),
      out_shape=out_shape,
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      num_warps=cfg.num_warps,
      num_stages=cfg.num_stages,
      interpret=interpret,
      name="pallas_attn_decode",
  )
  out, stats = call(*inputs)
  if plan.finalizes:
    return out.reshape(batch, seq_q, heads, d_v), stats.reshape(batch, heads, seq_q)
  return combine(out, stats, sink2, plan=plan, dtype=q.dtype)


def combine(acc, stats, sink2, *, plan: DecodePlan, dtype):
  """Merges the splits' partial states (`OnlineRowNorm.merge`) and unpacks
  the rows: acc `[B, Hkv, splits, rows, Dv]`, stats `[B, Hkv, splits, n,
  rows]` -> (out `[B, Sq, Hq, Dv]`, row statistic `[B, Hq, Sq]`)."""
  batch, heads_kv, _, rows, d_v = acc.shape
  online, group, seq_q = plan.online, plan.group, plan.seq_q
  acc = jnp.moveaxis(acc, 2, 0)
  statistics = tuple(jnp.moveaxis(stats[:, :, :, n, :, None], 2, 0)
                     for n in range(online.num_partial_statistics))
  if sink2 is not None:  # row i * group + g has head kv_head * group + g
    sink2 = jnp.tile(sink2.reshape(heads_kv, 1, group), (1, seq_q, 1)).reshape(heads_kv, rows, 1)
  out, stat = online.finalize(online.merge(acc, statistics, sink2))
  out = out.reshape(batch, heads_kv, seq_q, group, d_v).transpose(0, 2, 1, 3, 4)
  if online.kind == "elementwise":  # no row statistic
    stat = jnp.zeros((batch, heads_kv, rows, 1), jnp.float32)
  stat = stat.reshape(batch, heads_kv, seq_q, group).transpose(0, 1, 3, 2)
  return (out.reshape(batch, seq_q, heads_kv * group, d_v).astype(dtype),
          stat.reshape(batch, heads_kv * group, seq_q))


class DecodeTemplate(TritonTemplate):
  name = "decode"
  config_class = DecodeConfig

  def schedule(self, shape: ProblemShape, device: DeviceConfig,
               base: DecodeConfig | None = None, paged: bool = False) -> DecodeConfig:
    """The config for a shape (`seq_kv`: the cache's length; `paged`: in
    pages) on a device: `base`'s fields where set, the schedule's
    (`heuristic_decode_config`) elsewhere."""
    return heuristic_decode_config(
        shape.batch, shape.heads_kv, shape.seq_q * (shape.heads_q // shape.heads_kv),
        shape.seq_kv, shape.d_qk, shape.d_v, itemsize=shape.itemsize,
        sm_count=device.sm_count, smem_per_block=device.smem_per_block, base=base, paged=paged)

  def default_config(self, shape, device=None, *, block_sparse=False,
                     scores_per_position=False):
    return self.schedule(shape, device_config() if device is None else device)

  def tile_checks(self, config, shape, device):
    mma_m, mma_n, mma_k = device.mma_tile
    packed = shape.seq_q * (shape.heads_q // shape.heads_kv)
    return [TileCheck("block_rows", config.block_rows, mma_m,
                      max(mma_m, next_power_of_2(packed)), "padded query rows"),
            TileCheck("block_k", config.block_k, max(mma_n, mma_k),
                      max(16, next_power_of_2(shape.seq_kv)), "padded seq_kv")]

  def shape_reason(self, config, shape, device):
    key_blocks = -(-shape.seq_kv // config.block_k)
    if not 1 <= config.num_splits <= key_blocks:
      return f"num_splits {config.num_splits} not in [1, {key_blocks} key blocks]"
    return super().shape_reason(config, shape, device)

  def score_tile(self, config):
    return config.block_rows, config.block_k

  def resource_use(self, config, shape, device):
    return streamed_kv_use(config.block_rows, config.block_k, config, shape, device)

  def tile_axes(self, shape, device, default):
    splits = default.num_splits
    return {"block_k": KEY_BLOCK_CHOICES,
            "num_splits": tuple(sorted({max(1, splits // 2), splits, 2 * splits, 4 * splits})),
            "block_rows": (default.block_rows,)}


TEMPLATE = register(DecodeTemplate())
