"""The split-KV template's calls: what `decode_attention`,
`paged_attention` (decode.py), their sharded forms (distributed/) and the
path `attention` takes for a few queries run.

Each runs the split-KV template (kernels/decode_forward.py) with the
variant's analysis, as `attention` runs the parallel one: score_mod,
mask_mod (captured arrays included), every online rownorm class and sinks.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_attn import _inputs, _templates
from pallas_attn.kernels import backend, decode_forward, tiles
from pallas_attn.schedule import cache as tuning_cache
from pallas_attn.schedule.config import MAX_DECODE_QUERIES, DecodeConfig, prefers_split_kv
from pallas_attn.schedule.device import device_config
from pallas_attn.schedule.search_space import format_config
from pallas_attn.schedule.template import ProblemShape
from pallas_attn.spec.analysis import VariantAnalysis, analyze_variant, consts_of
from pallas_attn.spec.mask_bounds import live_kv_blocks
from pallas_attn.spec.trace import is_concrete


def decode_with_statistic(q, k, v, lengths, *, page_table=None, score_mod=None, mask_mod=None,
                          rownorm="softmax", sinks=None, scale=None, config=None,
                          interpret=None, k_descale=None, v_descale=None):
  """`decode_attention`'s (or with `page_table`, `paged_attention`'s)
  (output `[B, Sq, Hq, Dv]`, row statistic `[B, Hq, Sq]` float32: the
  natural log-sum-exp of each row's weights for softmax rownorms, -inf for
  a row that kept no key; zeros for elementwise ones).

  For callers that merge decodes over parts of one cache
  (distributed/sharded_decode.py): `lengths` `[B]` are not checked against
  Sq, as a part may hold fewer keys than the queries, or none (they are
  clamped into [0, S_max]; a row with no key gives zeros), and page
  indices are clamped, not checked.
  """
  paged = page_table is not None
  names = ("k_pages", "v_pages") if paged else ("k_cache", "v_cache")
  validate(q, k, v, lengths, *names, paged=paged)
  max_length = page_table.shape[1] * k.shape[1] if paged else k.shape[1]
  return run_decode(q, k, v, jnp.asarray(lengths, jnp.int32), page_table, max_length,
                    score_mod=score_mod, mask_mod=mask_mod, rownorm=rownorm, sinks=sinks,
                    scale=scale, config=config, interpret=interpret, k_descale=k_descale,
                    v_descale=v_descale)


def validate(q, k, v, kv_lengths, k_name, v_name, paged=False):
  _inputs.check_qkv(q, k, v, k_name=k_name, v_name=v_name,
                    kv_layout="[num_pages, page_size, Hkv, D]" if paged else "[B, S, Hkv, D]",
                    fp8_cache=True)
  if k.shape[:3] != v.shape[:3]:
    raise ValueError(f"{k_name} {k.shape} and {v_name} {v.shape} differ before the head dim")
  if not paged and k.shape[0] != q.shape[0]:
    raise ValueError(f"batch sizes differ: q {q.shape}, {k_name} {k.shape}")
  if not 1 <= q.shape[1] <= MAX_DECODE_QUERIES:
    raise ValueError(f"decoding takes 1 to {MAX_DECODE_QUERIES} query tokens per sequence; "
                     f"got Sq = {q.shape[1]} (use pallas_attn.attention for more)")
  if min(k.shape[1], q.shape[3]) == 0:
    raise ValueError("cache length and head dims must be positive")
  if (getattr(kv_lengths, "shape", None) != (q.shape[0],)
      or not jnp.issubdtype(kv_lengths.dtype, jnp.integer)):
    raise ValueError(f"kv_lengths must be an integer [B] = [{q.shape[0]}] array; got "
                     f"{getattr(kv_lengths, 'dtype', type(kv_lengths).__name__)} "
                     f"{getattr(kv_lengths, 'shape', '')}")


def checked_lengths(kv_lengths, seq_q: int, max_length: int):
  """kv_lengths as int32, checked against [Sq, S_max] when concrete."""
  if is_concrete(kv_lengths):
    lengths = np.asarray(kv_lengths)
    bad = np.flatnonzero((lengths < seq_q) | (lengths > max_length))
    if bad.size:
      b = int(bad[0])
      raise ValueError(f"kv_lengths[{b}] = {int(lengths[b])} is outside [Sq, S_max] = "
                       f"[{seq_q}, {max_length}]: a sequence holds its {seq_q} new tokens' "
                       "keys and at most the cache's length")
  return jnp.asarray(kv_lengths, jnp.int32)


def check_page_table(page_table, batch: int, columns: str):
  """Raises unless page_table is an integer [B, columns] array."""
  if (getattr(page_table, "ndim", None) != 2 or page_table.shape[0] != batch
      or not jnp.issubdtype(page_table.dtype, jnp.integer)):
    raise ValueError(f"page_table must be an integer [B, {columns}] = [{batch}, ...] "
                     f"array; got {getattr(page_table, 'dtype', type(page_table).__name__)} "
                     f"{getattr(page_table, 'shape', '')}")


def check_pages(page_table, lengths, page_size: int, num_pages: int):
  """Raises for a page index outside [0, num_pages) among the pages the
  sequences use, where the table and the lengths are concrete (which pages
  a sequence uses depends on its length)."""
  if not (is_concrete(page_table) and is_concrete(lengths)):
    return
  table = np.asarray(page_table)
  used = np.arange(table.shape[1])[None, :] < -(-np.asarray(lengths)[:, None] // page_size)
  bad = np.argwhere(used & ((table < 0) | (table >= num_pages)))
  if bad.size:
    b, slot = (int(i) for i in bad[0])
    raise ValueError(f"page_table[{b}, {slot}] = {int(table[b, slot])} is not a page index "
                     f"in [0, {num_pages}) (sequence {b} uses its first "
                     f"{int(used[b].sum())} pages)")


def resolve_config(config, analysis: VariantAnalysis, q, k_shape, v_shape,
                   cache_dtype=None, paged: bool = False) -> DecodeConfig:
  """The complete split-KV config of a call: an explicit `DecodeConfig`
  with the schedule's fields where it leaves them None, else a tuned one
  from the cache, else the schedule's. k_shape / v_shape are the logical
  cache shapes `[B, S_max, Hkv, D]`; the schedule sizes the streamed tiles
  by `cache_dtype` (default q's: an fp8 cache's differ) and splits a
  `paged` cache differently."""
  if config not in (None, "auto") and not isinstance(config, DecodeConfig):
    raise TypeError(f"config must be a DecodeConfig, 'auto' or None; got {config!r}")
  if not isinstance(config, DecodeConfig):
    config = tuning_cache.lookup_config(_templates.DECODE.name, analysis.fingerprint(),
                                        q_shape=q.shape, k_shape=k_shape, v_shape=v_shape,
                                        dtype=q.dtype)
  shape = ProblemShape.from_shapes(q.shape, k_shape, v_shape, cache_dtype or q.dtype)
  return _templates.DECODE.schedule(shape, device_config(), base=config, paged=paged)


@dataclasses.dataclass(frozen=True, eq=False)
class _DecodeCall:
  """The static part of one split-KV call (see api._Call)."""
  analysis: VariantAnalysis
  config: DecodeConfig
  scale: float | None
  interpret: bool
  queries_at_end: bool  # decoding (token i at kv_len - Sq + i); False: attention's positions
  page_size: int | None

  @functools.cached_property
  def key(self) -> tuple:
    return (self.analysis.fingerprint(), self.analysis.rownorm.name, self.config, self.scale,
            self.interpret, self.queries_at_end, self.page_size)

  def __eq__(self, other):
    return isinstance(other, _DecodeCall) and self.key == other.key

  def __hash__(self):
    return hash(self.key)


def run_decode(q, k, v, lengths, page_table, max_length, *, score_mod, mask_mod, rownorm,
               sinks, scale, config, interpret, k_descale=None, v_descale=None):
  """(output, row statistic) of the split-KV template on a checked cache
  (an fp8 one with its descales)."""
  analysis = analyze_variant(score_mod, mask_mod, rownorm)
  sinks = _inputs.resolve_sinks(sinks, analysis, q.shape[2])
  heads_kv = k.shape[2]
  cfg = resolve_config(config, analysis, q, (q.shape[0], max_length, heads_kv, k.shape[3]),
                       (q.shape[0], max_length, heads_kv, v.shape[3]), cache_dtype=k.dtype,
                       paged=page_table is not None)
  call = _DecodeCall(analysis, cfg, None if scale is None else float(scale),
                     backend.resolve_interpret(interpret), queries_at_end=True,
                     page_size=None if page_table is None else k.shape[1])
  consts = consts_of(analysis)
  descales = _inputs.descales(k_descale, v_descale, k, q.shape[0],
                              "k_pages" if page_table is not None else "k_cache")
  with backend.triton_deprecation_ignored():
    return _forward_only(q, k, v, lengths, page_table, consts, sinks, descales, call=call)


def forward_only(fn, *args):
  """`fn(*args)`, raising a clear error when differentiated: decoding is
  inference (a sharded cache's decode takes it too)."""
  core = jax.custom_jvp(fn)

  def no_derivative(primals, tangents):
    raise TypeError("decode_attention and paged_attention are forward-only (inference); "
                    "for gradients use pallas_attn.attention on the cache sliced to the "
                    "sequence")
  core.defjvp(no_derivative)
  return core(*args)


@functools.partial(jax.jit, static_argnames="call")
def _forward_only(q, k, v, lengths, page_table, consts, sinks, descales, *,
                  call: _DecodeCall):
  """`_forward` (output, row statistic), raising a clear error when differentiated."""
  return forward_only(functools.partial(_forward, call=call), q, k, v, lengths, page_table,
                      consts, sinks, descales)


def _forward(q, k, v, lengths, page_table, consts, sinks, descales=None, *,
             call: _DecodeCall):
  """(out `[B, Sq, Hq, Dv]`, row statistic `[B, Hq, Sq]`) of the split-KV
  template; `descales` (`_inputs.descales`) for an fp8 cache."""
  batch, seq_q, heads, d_qk = q.shape
  heads_kv, d_v = k.shape[2], v.shape[3]
  group = heads // heads_kv
  cfg = call.config
  paged = call.page_size is not None
  max_length = page_table.shape[1] * call.page_size if paged else k.shape[1]
  analysis = tiles.gathered_per_row(call.analysis)
  kv_pad = -(-max_length // cfg.block_k) * cfg.block_k
  capture_arrays, operands = tiles.capture_operands(analysis, seq_q, kv_pad, consts)
  ranges = None
  if analysis.mask_mod is not None:
    clipped = jnp.clip(lengths, 0, max_length)
    first_query = clipped - seq_q if call.queries_at_end else jnp.zeros_like(clipped)
    ranges = live_kv_blocks(call.analysis, consts[1], clipped, first_query, seq_q, heads_kv,
                            group, cfg.block_k, kv_pad // cfg.block_k)
  fp32_exact = q.dtype == jnp.float32
  plan = decode_forward.DecodePlan(
      analysis=analysis, operands=operands,
      scale=float(1.0 / math.sqrt(d_qk) if call.scale is None else call.scale),
      seq_q=seq_q, group=group, d_qk=d_qk, d_v=d_v, max_length=max_length,
      queries_at_end=call.queries_at_end, page_size=call.page_size,
      has_ranges=ranges is not None, has_sink=sinks is not None, fp32_exact=fp32_exact,
      fast_math=not (fp32_exact or call.interpret), config=cfg,
      descaled=descales is not None,
      v_pairs=v.dtype == jnp.float8_e4m3fn and d_v % 2 == 0,
      pairs_asm=not call.interpret and backend.e4m3_pairs_supported())
  return decode_forward.forward(q, k, v, lengths, ranges, page_table, capture_arrays, sinks,
                                descales, plan=plan, interpret=call.interpret)


def split_kv_call(analysis: VariantAnalysis, q, k, v, scale, interpret: bool):
  """The split-KV call for `attention`'s inputs where the schedule prefers
  it (`prefers_split_kv`), else None."""
  if not prefers_split_kv(q.shape[1], k.shape[1]):
    return None
  cfg = resolve_config(None, analysis, q, k.shape, v.shape)
  return _DecodeCall(analysis, cfg, None if scale is None else float(scale), interpret,
                     queries_at_end=False, page_size=None)


@functools.partial(jax.jit, static_argnames=("call", "split_kv", "dense"))
def split_kv_attention(q, k, v, consts, block_masks, sinks, *, call, split_kv: _DecodeCall,
                       dense):
  """`attention`'s (out, row statistic) on the split-KV template, every key
  valid and query i at position i. Differentiated, the call runs `dense`
  (api's parallel path, forward and backward) instead: the split-KV
  template has no backward."""
  def primal(q, k, v, consts, block_masks, sinks):
    lengths = jnp.full((q.shape[0],), k.shape[1], jnp.int32)
    return _forward(q, k, v, lengths, None, consts, sinks, call=split_kv)

  core = jax.custom_vjp(primal)
  core.defvjp(lambda *args: jax.vjp(functools.partial(dense, call=call), *args),
              lambda pullback, cotangent: pullback(cotangent))
  return core(q, k, v, consts, block_masks, sinks)


def describe_dispatch(analysis: VariantAnalysis, q_shape, k_shape, v_shape, dtype) -> str:
  """Which forward template `attention` runs for these shapes (`pallas-attn explain`)."""
  if not prefers_split_kv(q_shape[1], k_shape[1]):
    return "forward template: parallel (one program per query block, batch and head)"
  q = jax.ShapeDtypeStruct(q_shape, dtype)
  cfg = resolve_config(None, analysis, q, k_shape, v_shape)
  return (f"forward template: split-KV decoding on triton (tiles of {q_shape[2] // k_shape[2]} query "
          f"heads x {q_shape[1]} tokens, keys split {cfg.num_splits} ways; "
          f"{format_config(cfg)}; differentiated: the parallel template)")
