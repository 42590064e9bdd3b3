"""`pallas_attn.attention`: validation, analysis, padding and dispatch."""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_attn import _inputs, _templates, fp8
from pallas_attn import split_kv as split_kv_lib
from pallas_attn.kernels import backend
from pallas_attn.kernels import block_mask as block_mask_lib
from pallas_attn.kernels import block_mask_cache
from pallas_attn.kernels import lowering as lowering_lib
from pallas_attn.kernels import mosaic_forward
from pallas_attn.schedule import cache as tuning_cache
from pallas_attn.schedule.config import AttentionConfig, round_up
from pallas_attn.schedule.template import ProblemShape, Template
from pallas_attn.spec.analysis import VariantAnalysis, analyze_variant, consts_of
from pallas_attn.spec.trace import is_concrete
from pallas_attn.vjp import attention_vjp

def _pad_to(x, axis, length):
  pad = length - x.shape[axis]
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


def resolve_config(config, arg_name: str, template: Template, analysis: VariantAnalysis, q, k,
                   v) -> AttentionConfig:
  """The config of a pass (`arg_name` sets it) on `template`: an explicit
  one (checked), else a tuned one from the cache, else the template's
  heuristic. A cache miss never triggers tuning (see `pallas-attn tune`)."""
  if isinstance(config, AttentionConfig):
    template.check(config)
    return config
  if config not in (None, "auto"):
    raise TypeError(f"{arg_name} must be an AttentionConfig, 'auto' or None; got {config!r}")
  tuned = tuning_cache.lookup_config(template.name, analysis.fingerprint(), q_shape=q.shape,
                                     k_shape=k.shape, v_shape=v.shape, dtype=q.dtype)
  return tuned or template.default_config(
      ProblemShape.from_shapes(q.shape, k.shape, v.shape, q.dtype),
      block_sparse=analysis.mask_mod is not None,
      scores_per_position=analysis.scores_per_position)


def attention(q, k, v, *, score_mod=None, mask_mod=None, rownorm="softmax", scale=None,
              sinks=None, block_mask=None, config=None, bwd_config=None, interpret=None,
              implementation=None, return_lse=False, q_descale=None, k_descale=None,
              v_descale=None):
  """Attention with a user-defined variant, as one fused Pallas kernel.

  Layout as `jax.nn.dot_product_attention`: q `[B, Sq, Hq, Dqk]`, k
  `[B, Skv, Hkv, Dqk]`, v `[B, Skv, Hkv, Dv]` -> `[B, Sq, Hq, Dv]` in q's
  dtype; GQA/MQA when Hkv divides Hq (query head h reads kv head
  `h // (Hq // Hkv)`).

  Args:
    score_mod: `(score, b, h, q_idx, kv_idx) -> score`, elementwise on the
      scaled score `q.k * scale`; may close over arrays indexed by b, h,
      q_idx, kv_idx.
    mask_mod: `(b, h, q_idx, kv_idx) -> bool`, True keeps a position.
    rownorm: "softmax", "sigmoid", "relu", "none", or a callable on a row
      of scores (analyzed; it must be online-decomposable).
    scale: defaults to `1 / sqrt(Dqk)`.
    sinks: attention sinks (gpt-oss, StreamingLLM): float `[Hq]` logits,
      one per query head, each adding `exp(sinks[h])` to its rows' softmax
      denominator (a key of value 0 that every query sees). Differentiable.
      Softmax rownorms only; a rownorm written with a constant sink term
      (`exp(K - m) + sum(exp(s - m))`) is recognized by itself.
    block_mask: a `BlockMask` from `pallas_attn.block_mask` for the same
      mask_mod, reused across calls. One built from another mask_mod
      program (code, or captured arrays' shapes or dtypes) is rejected;
      one built over other captured values (another batch's document
      ids) too, where the mask's and the call's values are both concrete
      (eager calls; arrays closed over under jit). Where the call's are
      traced (ids passed as jit arguments, the usual training step), they
      cannot be compared: build the mask from the same ids in the same
      step (`pa.block_mask(mask_mod_of(ids), ...)`), not once for all batches.
    config: an `AttentionConfig`, "auto" or None (tuned cache entry if any,
      else a heuristic).
    bwd_config: the backward kernels' `AttentionConfig`, "auto" or None
      (tuned cache entry if any, else a heuristic). With a mask_mod, the
      forward uses the block mask's block_q and block_k; the backward keeps
      its own, with tile lists re-tiled from the same mask.
    interpret: None runs Pallas interpret mode on CPU and compiled kernels on GPU.
    implementation: the passes' lowering. None: Mosaic GPU (the Hopper
      templates: TMA, wgmma, warp specialization) on sm_90+ GPUs for each
      pass that it can lower, else Triton (`pallas-attn explain` says why;
      the backward also needs head dims up to 128 and takes Triton's passes
      when a captured array is differentiated); "mosaic_gpu" or "triton" to
      insist (an error if the forward cannot run).
    return_lse: also return the row statistic `[B, Hq, Sq]` float32:
      log-sum-exp for softmax (the sink's term included), the divisor h(stats) for normalized
      rownorms, None for elementwise rownorms.
    q_descale, k_descale, v_descale: with q, k, v all of one fp8 dtype
      (FlashAttention-3's names): real values are `x.astype(float32) *
      descale`, each descale None (1), a float32 scalar or `[B, Hq]` (q) /
      `[B, Hkv]` (k, v); score_mod and friends see the real scores and the
      output is bfloat16 (`pallas_attn.quantize_fp8` makes such inputs).
      Forward only. Descales are positive (a negative one gives NaN). On
      Hopper, e4m3 inputs with head dims up to 128 and softmax rownorms run
      both products on fp8 tensor cores; other calls are dequantized to
      bfloat16 before the kernels (`pallas-attn explain` says which).

  Masked positions get weight 0 under every rownorm and add nothing to row
  statistics; a row whose positions are all masked returns zeros (lse -inf).

  Differentiable (`jax.custom_vjp`; dq, dk, dv and the gradients of float
  arrays score_mod closes over come from Pallas kernels that recompute the
  scores from the saved row statistics).

  A few queries (Sq <= 16, Skv >= 256; `schedule.config.prefers_split_kv`)
  with no config, implementation or block_mask given run the forward on the
  split-KV decoding template (`decode_attention`'s; `pallas-attn explain`
  says which ran); differentiated, such a call runs the parallel template.
  """
  fp8_inputs = _inputs.check_fp8_prefill(q, k, v, q_descale, k_descale, v_descale)
  # An fp8 call is prepared as the bfloat16 call of its dequantized inputs.
  prepared = [jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) for x in (q, k, v)] if fp8_inputs else (
      q, k, v)
  call, consts, block_masks, sinks, core = _prepare(
      *prepared, score_mod=score_mod, mask_mod=mask_mod, rownorm=rownorm, scale=scale,
      sinks=sinks, block_mask=block_mask, config=config, bwd_config=bwd_config,
      interpret=interpret, implementation=implementation, allow_split_kv=True,
      fp8_dtype=q.dtype if fp8_inputs else None)
  output_factor = None
  if fp8_inputs and fp8_tensor_core_obstacle(call, q, v, core) is None:
    descales = fp8.kernel_descales(q_descale, k_descale, v_descale, q.shape[0], q.shape[2],
                                   k.shape[2])
    out, stat = fp8.forward_only(functools.partial(_attention, call=call))(
        q, k, v, consts, block_masks, sinks, descales)
  else:
    if fp8_inputs:
      q, k, v, output_factor = fp8.dequantized(q, k, v, q_descale, k_descale, v_descale)
    with backend.triton_deprecation_ignored():
      out, stat = core(q, k, v, consts, block_masks, sinks, call=call)
  if output_factor is not None:
    out = (out.astype(jnp.float32) * output_factor[:, None, :, None]).astype(out.dtype)
  if not return_lse:
    return out
  return out, (None if call.analysis.rownorm.kind == "elementwise" else stat)


def fp8_tensor_core_obstacle(call, q, v, core) -> str | None:
  """Why the prepared call of an fp8 prefill cannot run on fp8 tensor cores
  (`fp8.tensor_core_obstacle`), or None."""
  d_qk, d_v = call.padded_head_dims(q.shape[3], v.shape[3])
  return fp8.tensor_core_obstacle(q.dtype, call.analysis, call.config, call.forward_lowering,
                                  d_qk, d_v, parallel=core is _attention)


def _prepare(q, k, v, *, score_mod=None, mask_mod=None, rownorm="softmax", scale=None,
             sinks=None, block_mask=None, config=None, bwd_config=None, interpret=None,
             implementation=None, allow_split_kv=False, fp8_dtype=None) -> tuple:
  """`attention`'s work before the kernels (checks, analysis, lowering,
  configs, block masks, sinks): `(call, consts, block_masks, sinks, core)`,
  `core` being `_attention` or, where `allow_split_kv` and the schedule
  prefer it for a few queries, the split-KV template's forward in front of
  it. `fp8_dtype`: q, k and v are of that fp8 dtype (prepared as bfloat16);
  where fp8 tensor cores take the call, the default tiles are fp8's
  (mosaic_forward.fp8_config), chosen before the block masks are built on
  them. The ring steps of pallas_attn.distributed call it too."""
  _inputs.check_attention_inputs(q, k, v)
  analysis = analyze_variant(score_mod, mask_mod, rownorm)
  interpret = backend.resolve_interpret(interpret)
  lowering = lowering_lib.choose(implementation, analysis, q.dtype, q.shape[3], v.shape[3],
                                 interpret, config, bwd_config)
  forward_template = _templates.FORWARD[lowering.forward]
  cfg = resolve_config(config, "config", forward_template, analysis, q, k, v)
  bwd_cfg = resolve_config(bwd_config, "bwd_config", _templates.BACKWARD[lowering.backward],
                           analysis, q, k, v)
  split_kv = None  # a few queries: the split-KV template (pallas_attn/split_kv.py)
  if (allow_split_kv and config in (None, "auto") and implementation is None
      and block_mask is None):
    split_kv = split_kv_lib.split_kv_call(analysis, q, k, v, scale, interpret)
  fp8_tiles = None  # fp8's own tiles, where fp8 tensor cores take them
  if fp8_dtype is not None and not isinstance(config, AttentionConfig):
    d_qk, d_v = lowering_lib.padded_head_dims(q.shape[3], v.shape[3], lowering.forward,
                                              lowering.backward)
    cfg, why = fp8.tensor_core_tiles(fp8_dtype, analysis, cfg, lowering.forward, d_qk, d_v,
                                     q.shape[1], parallel=split_kv is None)
    fp8_tiles = cfg if why is None else None
  block_masks = (None if split_kv else
                 _resolve_block_masks(block_mask, analysis, cfg, bwd_cfg, q, k, interpret))
  if block_masks is not None:
    fwd_mask, bwd_mask = block_masks
    if lowering.forward == lowering_lib.MOSAIC_GPU:
      fwd_mask = _retiled(fwd_mask, cfg.block_q, cfg.block_k)
      block_masks = fwd_mask, bwd_mask
    cfg = dataclasses.replace(cfg, block_q=fwd_mask.block_q, block_k=fwd_mask.block_k)
    forward_template.check(cfg)
    if fp8_tiles is not None and block_mask is not None:
      fp8.note_block_mask_tiles(fp8_dtype, analysis, cfg, fp8_tiles, lowering.forward, d_qk,
                                d_v)
    bwd_cfg = dataclasses.replace(bwd_cfg, block_q=bwd_mask.block_q, block_k=bwd_mask.block_k)
  sinks = _inputs.resolve_sinks(sinks, analysis, q.shape[2])
  consts = consts_of(analysis)
  call = _Call(analysis, cfg, bwd_cfg, None if scale is None else float(scale), interpret,
               lowering.forward, lowering.backward)
  core = (_attention if split_kv is None else
          functools.partial(split_kv_lib.split_kv_attention, split_kv=split_kv, dense=_attention))
  return call, consts, block_masks, sinks, core


def _mask_only(analysis: VariantAnalysis) -> VariantAnalysis:
  """The mask_mod part of an analysis, its traced captures cut from
  differentiation: tile lists are integers, and score_mod's arrays need not
  reach the mask kernel."""
  mask = analysis.mask_mod
  consts = tuple(c if is_concrete(c) else jax.lax.stop_gradient(c) for c in mask.traced.consts)
  mask = dataclasses.replace(mask, traced=dataclasses.replace(mask.traced, consts=consts))
  return dataclasses.replace(analysis, score_mod=None, mask_mod=mask)


def _resolve_block_masks(block_mask, analysis, cfg, bwd_cfg, q, k, interpret):
  """(forward, backward) block masks, or None without a mask_mod.

  The forward's is the caller's block mask (checked) or one built at cfg's
  blocks; the backward's has bwd_cfg's blocks. Built ones come from
  `block_mask_cache.built_masks`: no kernel compiled or run while a
  function is traced.
  """
  batch, seq_q, heads, _ = q.shape
  seq_kv = k.shape[1]
  if analysis.mask_mod is None:
    if block_mask is not None:
      raise ValueError("block_mask was given without the mask_mod it was built from")
    return None
  bwd_blocks = (bwd_cfg.block_q, bwd_cfg.block_k)
  if block_mask is not None:
    _check_block_mask(block_mask, analysis.mask_mod, batch, heads, seq_q, seq_kv)
    masks = block_mask, _retiled(block_mask, *bwd_blocks)
  else:
    shape = (batch, heads, seq_q, seq_kv, ((cfg.block_q, cfg.block_k), bwd_blocks), interpret)
    with backend.triton_deprecation_ignored():
      masks = block_mask_cache.built_masks(_mask_only(analysis), *shape)
  # The kernels read the lists. Without the digest (checked), a passed mask
  # and a built one are pytrees of one structure, of [Bm, Hm, ...] leaves.
  return tuple(dataclasses.replace(m, digest=None) for m in masks)


def _retiled(block_mask, block_q: int, block_k: int):
  """`block_mask` on other tiles, or itself where the sizes do not divide."""
  if block_mask.can_retile(block_q, block_k):
    return block_mask.with_blocks(block_q, block_k)
  return block_mask


def _check_block_mask(block_mask, mask_prog, batch, heads, seq_q, seq_kv):
  """A passed block mask fits the call: its shapes, the mask_mod program it
  was built from, and its captured values where both sides' are concrete
  (under a trace whose arguments they are, they cannot be compared)."""
  if not isinstance(block_mask, block_mask_lib.BlockMask):
    raise TypeError(f"block_mask must come from pallas_attn.block_mask; got {type(block_mask)}")
  if (block_mask.seq_q, block_mask.seq_kv) != (seq_q, seq_kv):
    raise ValueError(f"block_mask was built for (Sq, Skv) = ({block_mask.seq_q}, "
                     f"{block_mask.seq_kv}), not ({seq_q}, {seq_kv})")
  bm_b, bm_h = block_mask.kv_partial_num.shape[:2]
  if bm_b not in (1, batch) or bm_h not in (1, heads):
    raise ValueError(f"block_mask has batch/head extents ({bm_b}, {bm_h}); expected 1 or "
                     f"({batch}, {heads})")
  rebuild = ("rebuild it with pallas_attn.block_mask(mask_mod, B, H, Sq, Skv) for the "
             "mask_mod you pass")
  if block_mask.program != block_mask_lib.program_fingerprint(mask_prog):
    raise ValueError("block_mask was built from a different mask_mod (its code, or the shapes "
                     f"or dtypes of the arrays it captures, differ); {rebuild}")
  consts = mask_prog.traced.consts
  if (block_mask.digest is not None and all(map(is_concrete, (block_mask.digest, *consts)))
      and not block_mask_lib.built_over(block_mask, consts)):
    raise ValueError("block_mask was built from the same mask_mod code over other captured "
                     f"values, e.g. another batch's document ids; {rebuild}")


@dataclasses.dataclass(frozen=True, eq=False)
class _Call:
  """The static part of one call, equal for calls that may share a compiled
  program: same analyzed programs (the fingerprint: captured values are
  arguments, not part of it), tiles, scale and lowering."""
  analysis: VariantAnalysis
  config: AttentionConfig
  bwd_config: AttentionConfig
  scale: float | None
  interpret: bool
  forward_lowering: str
  backward_lowering: str

  @functools.cached_property
  def key(self) -> tuple:
    return (self.analysis.fingerprint(), self.analysis.rownorm.name, self.config,
            self.bwd_config, self.scale, self.interpret, self.forward_lowering,
            self.backward_lowering)

  def padded_head_dims(self, d_qk: int, d_v: int) -> tuple[int, int]:
    """The head dims as the kernels of both passes take them."""
    return lowering_lib.padded_head_dims(d_qk, d_v, self.forward_lowering,
                                         self.backward_lowering)

  def __eq__(self, other):
    return isinstance(other, _Call) and self.key == other.key

  def __hash__(self):
    return hash(self.key)


def _padded(q, k, v, call: _Call):
  """(core spec, q, k, v padded to the blocks of both passes and the kernels'
  head dims, padded query length, padded Dv)."""
  batch, seq_q, heads, d_qk = q.shape
  seq_kv, d_v = k.shape[1], v.shape[3]
  cfg, bwd_cfg = call.config, call.bwd_config
  q_rows = (mosaic_forward.q_rows_multiple(cfg.block_q)
            if call.forward_lowering == lowering_lib.MOSAIC_GPU else cfg.block_q)
  seq_q_pad = round_up(seq_q, math.lcm(q_rows, bwd_cfg.block_q))
  seq_kv_pad = round_up(seq_kv, math.lcm(cfg.block_k, bwd_cfg.block_k))
  d_qk_pad, d_v_pad = call.padded_head_dims(d_qk, d_v)
  qp = _pad_to(_pad_to(q, 1, seq_q_pad), 3, d_qk_pad)
  kp = _pad_to(_pad_to(k, 1, seq_kv_pad), 3, d_qk_pad)
  vp = _pad_to(_pad_to(v, 1, seq_kv_pad), 3, d_v_pad)
  scale = call.scale
  spec = attention_vjp.CoreSpec(
      analysis=call.analysis, scale=float(1.0 / math.sqrt(d_qk) if scale is None else scale),
      seq_q=seq_q, seq_kv=seq_kv, group=heads // k.shape[2], fp32_exact=q.dtype == jnp.float32,
      config=cfg, bwd_config=bwd_cfg, interpret=call.interpret,
      forward_lowering=call.forward_lowering, backward_lowering=call.backward_lowering)
  return spec, qp, kp, vp, seq_q_pad, d_v_pad


@functools.partial(jax.jit, static_argnames="call")
def _attention(q, k, v, consts, block_masks, sinks, descales=None, *, call: _Call):
  """Pads to the blocks of both passes, runs the differentiable core, unpads.

  Jitted with the call's static part as the key, so that eager calls
  (outside any jit) compile once per variant and shape, not on every call;
  under an outer jit it is inlined. With fp8 `descales`
  (`fp8.kernel_descales`) it runs the fp8 forward alone.
  """
  seq_q, d_v = q.shape[1], v.shape[3]
  spec, qp, kp, vp, _, _ = _padded(q, k, v, call)
  if descales is not None:
    out, stat = attention_vjp.fp8_forward(qp, kp, vp, consts, block_masks, sinks, descales,
                                          spec=spec)
  else:
    out, stat = attention_vjp.attention_core(qp, kp, vp, consts, block_masks, sinks, spec=spec)
  return out[:, :seq_q, :, :d_v], stat[:, :, :seq_q]


@functools.partial(jax.jit, static_argnames="call")
def _recorded_gradients(q, k, v, consts, block_masks, sinks, stat, delta, d_out, *,
                        call: _Call):
  """(dq, dk, dv): attention's backward kernels at (q, k, v), given the row
  statistic `stat` `[B, Hq, Sq]` and the row terms `delta` = rowsum(dO * O)
  minus the statistic's cotangent (None for elementwise rownorms) instead of
  the output, and the output's cotangent `d_out`; no forward runs.

  Ring attention's backward steps: each block of keys against the rows
  merged over all blocks, whose statistic and delta its part needs."""
  seq_q, seq_kv = q.shape[1], k.shape[1]
  spec, qp, kp, vp, seq_q_pad, d_v_pad = _padded(q, k, v, call)
  pad_rows = lambda x, value: jnp.pad(x, [(0, 0), (0, 0), (0, seq_q_pad - seq_q)],
                                      constant_values=value)
  d_out = _pad_to(_pad_to(d_out.astype(q.dtype), 1, seq_q_pad), 3, d_v_pad)
  dq, dk, dv = attention_vjp.recorded_gradients(
      qp, kp, vp, consts, block_masks, sinks, pad_rows(stat, -jnp.inf),
      None if delta is None else pad_rows(delta, 0.0), d_out, spec=spec)
  return (dq[:, :seq_q, :, :q.shape[3]], dk[:, :seq_kv, :, :k.shape[3]],
          dv[:, :seq_kv, :, :v.shape[3]])
