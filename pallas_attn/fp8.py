"""fp8 inputs: `quantize_fp8` turns a cache (or q, k, v) into fp8 values and
the descales `decode_attention` / `paged_attention` / `attention` take (real
values are `x.astype(float32) * descale`, FlashAttention-3's convention);
an fp8 prefill runs on fp8 wgmma where `tensor_core_obstacle` allows it
(`kernel_descales` its factors), else `dequantized` is its way in to the
16-bit kernels."""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from pallas_attn import _inputs
from pallas_attn.kernels import lowering, mosaic_forward

GRANULARITIES = ("tensor", "head")


def quantize_fp8(x, *, per: str = "head", dtype=jnp.float8_e4m3fn):
  """(x in `dtype`, its float32 descale) for a `[B, S, H, D]` cache or q, k,
  v of an fp8 prefill (or a `[num_pages, page_size, H, D]` pool with
  `per="tensor"`).

  per="head": one descale per sequence and head, `[B, H]`, from the largest
  magnitude of that head's keys (or values); per="tensor": one scalar. The
  values are scaled so that the largest maps to the dtype's largest finite
  value, then rounded to nearest."""
  if per not in GRANULARITIES:
    raise ValueError(f"per must be one of {GRANULARITIES}; got {per!r}")
  if jnp.dtype(dtype) not in tuple(map(jnp.dtype, _inputs.FP8_CACHE_DTYPES)):
    raise TypeError(f"dtype must be float8_e4m3fn or float8_e5m2; got {jnp.dtype(dtype)}")
  if getattr(x, "ndim", None) != 4:
    raise ValueError(f"x must be a [B, S, H, D] cache; got shape {getattr(x, 'shape', None)}")
  x = jnp.asarray(x, jnp.float32)
  largest = jnp.max(jnp.abs(x), axis=(1, 3) if per == "head" else None)
  descale = jnp.where(largest > 0, largest / float(jnp.finfo(dtype).max), 1.0)
  scale = descale[:, None, :, None] if per == "head" else descale
  limit = float(jnp.finfo(dtype).max)
  return jnp.clip(x / scale, -limit, limit).astype(dtype), descale.astype(jnp.float32)


def tensor_core_obstacle(dtype, analysis, config, forward_lowering: str, d_qk: int, d_v: int,
                         parallel: bool) -> str | None:
  """Why an fp8 prefill cannot run both products on fp8 wgmma (the Mosaic GPU
  forward), or None; such a call is dequantized to bfloat16 first
  (`dequantized`). `d_qk`, `d_v`: the padded head dims; `parallel`: the
  call runs the parallel template (not the split-KV one of a few queries)."""
  if forward_lowering != lowering.MOSAIC_GPU:
    return f"the forward runs on {forward_lowering}"
  if not parallel:
    return "a few queries run the split-KV template"
  if jnp.dtype(dtype) != jnp.dtype(jnp.float8_e4m3fn):
    return f"{jnp.dtype(dtype).name} inputs: the fp8 products take float8_e4m3fn"
  if analysis.rownorm.kind != "softmax":
    return (f"the '{analysis.rownorm.name}' rownorm's weights are not bounded by 1, which "
            "the weights' e4m3 tile needs")
  return mosaic_forward.fp8_obstacle(config, d_qk, d_v)


def tensor_core_tiles(dtype, analysis, config, forward_lowering: str, d_qk: int, d_v: int,
                      seq_q: int, parallel: bool) -> tuple:
  """(the forward's tiles, `tensor_core_obstacle`) of an fp8 prefill whose
  16-bit default tiles are `config`: fp8's own (mosaic_forward.fp8_config)
  where fp8 tensor cores take the call, else `config`."""
  fp8_config = mosaic_forward.fp8_config(config, seq_q)
  why = tensor_core_obstacle(dtype, analysis, fp8_config, forward_lowering, d_qk, d_v, parallel)
  return (config if why else fp8_config), why


_NOTED_MASK_TILES = set()


def note_block_mask_tiles(dtype, analysis, config, fp8_tiles, forward_lowering: str, d_qk: int,
                          d_v: int) -> None:
  """Warns, once per tiles, where a given block mask's tiles (`config`'s)
  keep an fp8 prefill off fp8 tensor cores that its own tiles (`fp8_tiles`)
  would run on: the call still runs, dequantized to bfloat16, at bfloat16's
  rate, and nothing else would say why (`pallas-attn explain` does not see
  the mask)."""
  tiles = (config.block_q, config.block_k)
  why = tensor_core_obstacle(dtype, analysis, config, forward_lowering, d_qk, d_v, parallel=True)
  if why is None or tiles in _NOTED_MASK_TILES:
    return
  _NOTED_MASK_TILES.add(tiles)
  warnings.warn(
      f"fp8 attention: the block mask's {tiles[0]}x{tiles[1]} tiles keep this call off fp8 "
      f"tensor cores ({why}), so it runs dequantized to bfloat16; build the mask at the fp8 "
      f"forward's tiles: pa.block_mask(..., block_q={fp8_tiles.block_q}, "
      f"block_kv={fp8_tiles.block_k})", stacklevel=4)


def prefill_note(why: str | None, analysis) -> str:
  """What an fp8 prefill of `analysis` runs (`pallas-attn explain`), from
  `tensor_core_obstacle`."""
  if why is None:
    growth = mosaic_forward.lazy_max_growth(analysis, fp8=True)
    lazy = ("" if growth is None else
            f"; a lazy running max in unmasked tiles (a row's moves when a tile raises it by "
            f"over {growth:g} in log2 units, warps whose rows kept theirs skip the rescale)")
    return ("fp8 q / k / v: both products on fp8 wgmma (e4m3 weights through shared memory, "
            "V transposed by one pass; three consumer warpgroups of 64 rows over 128-key "
            "tiles past 128 queries, the forward's tiles below), descales folded into the "
            f"score scale and the output; bfloat16 output{lazy}")
  return (f"fp8 q / k / v: dequantized to bfloat16 before the kernels ({why}; q's and k's "
          "descales folded into q, v's into the output): bfloat16's rate plus one "
          "conversion pass")


def _refuse_gradient(_, cotangent):
  raise ValueError("fp8 attention is forward only (FlashAttention-3's fp8 path is too): "
                   "differentiate a bfloat16 call, e.g. on x.astype(jnp.bfloat16) * descale")


def forward_only(fn):
  """`fn`, whose differentiation raises a clear error."""
  wrapped = jax.custom_vjp(fn)
  wrapped.defvjp(lambda *args: (fn(*args), None), _refuse_gradient)
  return wrapped


_forward_only = forward_only(lambda x: x)


def _per_query_head(descale, batch: int, heads: int, kv_heads: int):
  """A kv-head descale as `[B, Hq]`: each query head's kv head's."""
  return jnp.repeat(_inputs.per_head_descale(descale, batch, kv_heads), heads // kv_heads, axis=1)


def _score_factor(q_descale, k_descale, batch: int, heads: int, kv_heads: int):
  """`[B, Hq]`: what turns the fp8 product of q and k into the real scores,
  q's descale times its kv head's k descale."""
  return (_inputs.per_head_descale(q_descale, batch, heads)
          * _per_query_head(k_descale, batch, heads, kv_heads))


def kernel_descales(q_descale, k_descale, v_descale, batch: int, heads: int, kv_heads: int):
  """`[B, Hq, 2]` float32 for the fp8 kernel: per query head, its scores'
  factor (q's descale times its kv head's k descale) and its output's (v's).
  The kernel's softmax takes the scores' factor inside its exp2, valid for a
  positive factor: a negative one (a negative descale) is NaN here, so that
  the output says so instead of being silently wrong."""
  score = _score_factor(q_descale, k_descale, batch, heads, kv_heads)
  score = jnp.where(score >= 0, score, jnp.nan)
  return jnp.stack([score, _per_query_head(v_descale, batch, heads, kv_heads)], axis=-1)


def dequantized(q, k, v, q_descale, k_descale, v_descale):
  """(q', k', v' in bfloat16, the output's [B, Hq] float32 factor) of an fp8
  prefill: scores from q' and k' are the real ones (q' = q * q_descale *
  k_descale of its kv head, rounded once to bfloat16; k' and v' exact), and
  the output times v's descale of each query head's kv head is the real
  output (every rownorm weighs v linearly). Differentiating in the inputs or
  their descales raises, as it does on fp8 tensor cores (`forward_only`)."""
  batch, _, heads, _ = q.shape
  kv_heads = k.shape[2]
  q, k, v = (_forward_only(x) for x in (q, k, v))
  q_descale, k_descale, v_descale = (None if d is None else _forward_only(d)
                                     for d in (q_descale, k_descale, v_descale))
  q_factor = _score_factor(q_descale, k_descale, batch, heads, kv_heads)
  q = (q.astype(jnp.float32) * q_factor[:, None, :, None]).astype(jnp.bfloat16)
  return (q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
          _per_query_head(v_descale, batch, heads, kv_heads))
