"""Search spaces of the kernel templates, pruned by a resource model before compiling.

A template's space is the product of its tile and launch axes (an axis value
a config rejects, e.g. a tile that is no power of two, raises there). Before
the tuner compiles anything, each config is checked against the problem shape
(multiples of the tensor-core tile, no tile larger than the padded sequence)
and against the device (shared memory of the pipelined tiles, fp32
accumulator registers per thread, threads per program). A pruned config keeps
the reason, e.g. "smem 264 KiB > 227 KiB limit".

The resource model follows the Triton templates: head dims are padded to a
power of two (at least 16); the forward pipelines K/V tiles (`num_stages`
deep) next to a resident Q tile; the backward runs a dK/dV kernel (resident
K/V, pipelined Q/dO) and a dQ kernel (the mirror image), and a config must
fit both; the linear templates pipeline q/k/v(/dO) chunks and keep the
recurrent state in registers. It is an estimate for pruning, not a
substitute for timing. The Mosaic GPU templates ("forward_mosaic",
"backward_mosaic") take their shared memory from the kernels' own
accounting; their knobs are the tiles (64 rows per consumer warpgroup, so
block_q / 64 consumers) and the ring depth, and num_warps follows from the
tiles (the consumers and the producer warpgroup).
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import jax.numpy as jnp

from pallas_attn.schedule.config import (AttentionConfig, DecodeConfig, LinearAttentionConfig,
                                         heuristic_config, heuristic_decode_config,
                                         next_power_of_2, padded_head_dim)
from pallas_attn.schedule.device import DeviceConfig, KiB, device_config

Config = AttentionConfig | LinearAttentionConfig | DecodeConfig

# `pallas_attn.attention`'s passes, lowered with Triton and with Mosaic GPU, and the
# split-KV template (`decode_attention`).
ATTENTION_TEMPLATES = ("forward", "backward", "forward_mosaic", "backward_mosaic", "decode")
MOSAIC_TEMPLATES = ("forward_mosaic", "backward_mosaic")
TEMPLATES: dict[str, type] = {
    "forward": AttentionConfig,
    "backward": AttentionConfig,
    "forward_mosaic": AttentionConfig,
    "backward_mosaic": AttentionConfig,
    "linear_forward": LinearAttentionConfig,
    "linear_backward": LinearAttentionConfig,
    "decode": DecodeConfig,
}
BLOCK_CHOICES = (16, 32, 64, 128, 256)
CHUNK_CHOICES = (16, 32, 64, 128)
BLOCK_V_CHOICES = (16, 32, 64, 128)
MOSAIC_BLOCK_Q_CHOICES = (64, 128)  # one or two consumer warpgroups
MOSAIC_BLOCK_K_CHOICES = {"forward_mosaic": (64, 128, 256), "backward_mosaic": (64, 128)}
MOSAIC_STAGE_CHOICES = (1, 2, 3, 4, 6, 8)


def config_class(template: str) -> type:
  """The config dataclass of a template; a clear error for an unknown one."""
  if template not in TEMPLATES:
    raise ValueError(f"unknown template {template!r}; known: {', '.join(TEMPLATES)}")
  return TEMPLATES[template]


@dataclasses.dataclass(frozen=True)
class ProblemShape:
  """The sizes a schedule depends on.

  Layout: q [B, Sq, Hq, Dqk], k [B, Skv, Hkv, Dqk], v [B, Skv, Hkv, Dv].
  """
  batch: int
  heads_q: int
  heads_kv: int
  seq_q: int
  seq_kv: int
  d_qk: int
  d_v: int
  dtype: str  # canonical name, e.g. "bfloat16"

  @classmethod
  def from_shapes(cls, q_shape, k_shape, v_shape, dtype) -> "ProblemShape":
    if not (len(q_shape) == len(k_shape) == len(v_shape) == 4):
      raise ValueError(f"expected rank-4 q/k/v shapes [B,S,H,D]; got {q_shape}, "
                       f"{k_shape}, {v_shape}")
    (b, sq, hq, dqk), (bk, skv, hkv, dk), (bv, sv, hv, dv) = q_shape, k_shape, v_shape
    if not (b == bk == bv and skv == sv and hkv == hv and dqk == dk):
      raise ValueError(f"inconsistent q/k/v shapes {q_shape}, {k_shape}, {v_shape}")
    if hq % hkv:
      raise ValueError(f"query heads {hq} are not a multiple of kv heads {hkv}")
    return cls(int(b), int(hq), int(hkv), int(sq), int(skv), int(dqk), int(dv),
               jnp.dtype(dtype).name)

  @property
  def itemsize(self) -> int:
    return jnp.dtype(self.dtype).itemsize

  @property
  def q_shape(self) -> tuple[int, ...]:
    return (self.batch, self.seq_q, self.heads_q, self.d_qk)

  @property
  def k_shape(self) -> tuple[int, ...]:
    return (self.batch, self.seq_kv, self.heads_kv, self.d_qk)

  @property
  def v_shape(self) -> tuple[int, ...]:
    return (self.batch, self.seq_kv, self.heads_kv, self.d_v)


def format_config(config: Config) -> str:
  """`block_q=128 block_k=64 num_warps=8 num_stages=3`: for progress lines and tables."""
  return " ".join(f"{k}={v}" for k, v in config.to_dict().items())


def decode_schedule(shape: ProblemShape, device: DeviceConfig,
                    base: DecodeConfig | None = None) -> DecodeConfig:
  """The split-KV template's config for a shape (`seq_kv`: the cache's
  length) on a device: `base`'s fields where set, the schedule's
  (`heuristic_decode_config`) elsewhere."""
  return heuristic_decode_config(
      shape.batch, shape.heads_kv, shape.seq_q * (shape.heads_q // shape.heads_kv),
      shape.seq_kv, shape.d_qk, shape.d_v, itemsize=shape.itemsize, sm_count=device.sm_count,
      smem_per_block=device.smem_per_block, base=base)


def default_config(template: str, shape: ProblemShape, *, block_sparse: bool = False,
                   device: DeviceConfig | None = None) -> Config:
  """The heuristic config the kernels use when the cache has no entry (no
  tuning); `block_sparse`: the variant has a mask_mod; `device` (default:
  the current one) sizes the split-KV template's splits."""
  config_class(template)
  if template == "decode":
    return decode_schedule(shape, device_config() if device is None else device)
  if template == "forward":
    return heuristic_config(shape.seq_q, shape.seq_kv, shape.d_qk, shape.d_v,
                            block_sparse=block_sparse, itemsize=shape.itemsize)
  if template == "backward":
    from pallas_attn.vjp.parallel_backward import heuristic_backward_config
    return heuristic_backward_config(shape.seq_q, shape.seq_kv, shape.d_qk, shape.d_v)
  if template in MOSAIC_TEMPLATES:
    from pallas_attn.kernels import lowering
    if template == "forward_mosaic":
      return lowering.heuristic_mosaic_config(shape.seq_q, shape.seq_kv, shape.d_qk, shape.d_v,
                                              block_sparse=block_sparse)
    return lowering.heuristic_mosaic_backward_config(shape.seq_q, shape.seq_kv, shape.d_qk,
                                                     shape.d_v)
  # The linear templates' heuristic, on the padded widths they run with.
  from pallas_attn.kernels.linear.chunked_forward import heuristic_linear_config
  return heuristic_linear_config(shape.seq_kv, padded_head_dim(shape.d_qk),
                                 padded_head_dim(shape.d_v))


# --- Resource model -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ResourceUse:
  """Estimated on-chip use of one program.

  smem_bytes: shared memory of the pipelined and resident tiles.
  acc_registers: fp32 values held across the inner loop, per thread.
  """
  smem_bytes: int
  acc_registers: int


def resource_use(template: str, config: Config, shape: ProblemShape,
                 device: DeviceConfig) -> ResourceUse:
  """Shared memory and accumulator registers of `config` (the larger kernel's, for backward)."""
  config_class(template)
  dqk, dv = padded_head_dim(shape.d_qk), padded_head_dim(shape.d_v)
  item = shape.itemsize
  stages = config.num_stages
  threads = config.num_warps * device.warp_size
  if template == "forward":
    bq, bk = config.block_q, config.block_k
    smem = (stages * bk * (dqk + dv) + bq * dqk) * item
    fp32 = bq * dv + bq * bk  # output accumulator + score tile
  elif template == "backward":
    bq, bk = config.block_q, config.block_k
    dkv_kernel = (bk * (dqk + dv) + stages * bq * (dqk + dv)) * item
    dq_kernel = (bq * (dqk + dv) + stages * bk * (dqk + dv)) * item
    smem = max(dkv_kernel, dq_kernel)
    # dK/dV accumulators (or dQ) plus the score and dP tiles.
    fp32 = max(bk * (dqk + dv), bq * dqk) + 2 * bq * bk
  elif template == "decode":
    rows, bk = config.block_rows, config.block_k
    smem = (stages * bk * (dqk + dv) + rows * dqk) * item
    fp32 = rows * dv + rows * bk  # output accumulator + score tile
  elif template == "linear_forward":
    c, bv = config.chunk_size, config.block_v
    smem = stages * c * (2 * dqk + bv) * item
    fp32 = dqk * bv + c * c + c * bv  # state + intra-chunk scores + output chunk
  else:  # linear_backward
    c, bv = config.chunk_size, config.block_v
    smem = stages * c * (2 * dqk + 2 * bv) * item
    fp32 = 2 * dqk * bv + 2 * c * c + c * (dqk + bv)  # state, dstate, scores, grads
  return ResourceUse(smem_bytes=smem, acc_registers=math.ceil(fp32 / threads))


def register_budget(num_warps: int, device: DeviceConfig) -> int | None:
  """Registers a thread may hold at `num_warps` without spilling (None: unlimited)."""
  if device.registers_per_sm is None or device.max_registers_per_thread is None:
    return None
  threads = num_warps * device.warp_size
  return min(device.max_registers_per_thread, device.registers_per_sm // threads)


def _kib(n: int) -> str:
  return f"{round(n / KiB, 1):g} KiB"


def _tile_reason(axis: str, value: int, multiple: int, bound: int | None,
                 bound_name: str) -> str | None:
  if value % multiple:
    return f"{axis} {value} is not a multiple of the {multiple}-wide MMA tile"
  if bound is not None and value > bound:
    return f"{axis} {value} > {bound_name} {bound}"
  return None


def mosaic_num_warps(template: str, block_q: int, block_k: int) -> int:
  """The warps a Mosaic GPU program runs: its consumer warpgroups (64 rows
  each; the backward's dq and dk/dv programs own block_q and block_k rows)
  and the producer's."""
  rows = block_q if template == "forward_mosaic" else max(block_q, block_k)
  return 4 * (rows // 64 + 1)


def _mosaic_prune_reason(template: str, config: AttentionConfig, shape: ProblemShape,
                         device: DeviceConfig) -> str | None:
  from pallas_attn.kernels import lowering
  error = (lowering.mosaic_config_error if template == "forward_mosaic"
           else lowering.mosaic_backward_config_error)(config)
  if error:
    return error
  for axis, value, seq in (("block_q", config.block_q, shape.seq_q),
                           ("block_k", config.block_k, shape.seq_kv)):
    if value > max(64, next_power_of_2(seq)):
      return f"{axis} {value} > padded {'seq_q' if axis == 'block_q' else 'seq_kv'}"
  warps = mosaic_num_warps(template, config.block_q, config.block_k)
  if config.num_warps != warps:
    return f"num_warps {config.num_warps}: these tiles run {warps} (consumers and producer)"
  if device.interpret:
    return None
  d_qk, d_v = (lowering.padded_head_dim(d, lowering.MOSAIC_GPU)
               for d in (shape.d_qk, shape.d_v))
  if template == "forward_mosaic":
    from pallas_attn.kernels.mosaic_forward import shared_memory_bytes
    smem = shared_memory_bytes(config, d_qk, d_v, shape.itemsize)
    if device.smem_per_block is not None and smem > device.smem_per_block:
      return f"smem {_kib(smem)} > {_kib(device.smem_per_block)} limit"
    return None
  from pallas_attn.vjp.mosaic_backward import ring_depths
  dq_depth, dkv_depth = ring_depths(config, d_qk, d_v, shape.itemsize, row_terms=True)
  if config.num_stages > max(dq_depth, dkv_depth):
    return (f"num_stages {config.num_stages}: shared memory holds {dq_depth} (dq) and "
            f"{dkv_depth} (dk/dv) ring slots")
  return None


def prune_reason(template: str, config: Config, shape: ProblemShape,
                 device: DeviceConfig) -> str | None:
  """Why `config` cannot (or should not) run `shape` on `device`; None if it may."""
  if template in MOSAIC_TEMPLATES:
    return _mosaic_prune_reason(template, config, shape, device)
  mma_m, mma_n, mma_k = device.mma_tile
  if template == "decode":
    rows, cols = config.block_rows, config.block_k
    packed = shape.seq_q * (shape.heads_q // shape.heads_kv)
    checks = [
        ("block_rows", rows, mma_m, max(mma_m, next_power_of_2(packed)), "padded query rows"),
        ("block_k", cols, max(mma_n, mma_k), max(16, next_power_of_2(shape.seq_kv)),
         "padded seq_kv"),
    ]
    key_blocks = -(-shape.seq_kv // cols)
    if not 1 <= config.num_splits <= key_blocks:
      return f"num_splits {config.num_splits} not in [1, {key_blocks} key blocks]"
  elif config_class(template) is AttentionConfig:
    rows, cols = config.block_q, config.block_k
    checks = [
        ("block_q", rows, mma_m, next_power_of_2(shape.seq_q), "padded seq_q"),
        ("block_k", cols, max(mma_n, mma_k), next_power_of_2(shape.seq_kv),
         "padded seq_kv"),
    ]
  else:
    rows = cols = config.chunk_size
    checks = [
        ("chunk_size", rows, max(mma_m, mma_n, mma_k),
         next_power_of_2(max(shape.seq_q, shape.seq_kv)), "padded seq"),
        ("block_v", config.block_v, mma_n, padded_head_dim(shape.d_v), "padded d_v"),
    ]
  for check in checks:
    reason = _tile_reason(*check)
    if reason:
      return reason
  warps = config.num_warps
  if warps & (warps - 1):  # a Mosaic GPU warp count (AttentionConfig) on a Triton template
    return f"num_warps {warps} is not a power of two (Triton)"
  if device.interpret:
    return None  # Interpret mode: no on-chip limits, launch parameters unused.
  if warps * device.warp_size > device.max_threads_per_block:
    return (f"num_warps {warps} x {device.warp_size} threads > "
            f"{device.max_threads_per_block} per program")
  mma_tiles = (rows // mma_m) * (cols // mma_n)
  if mma_tiles < warps:
    return f"{mma_tiles} MMA tiles of {rows}x{cols} < {warps} warps"
  use = resource_use(template, config, shape, device)
  if device.smem_per_block is not None and use.smem_bytes > device.smem_per_block:
    return f"smem {_kib(use.smem_bytes)} > {_kib(device.smem_per_block)} limit"
  budget = register_budget(warps, device)
  if budget is not None and use.acc_registers > budget:
    return (f"fp32 accumulators {use.acc_registers} regs/thread > {budget} "
            f"budget at {warps} warps")
  return None


# --- Search space -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrunedConfig:
  config: Config
  reason: str


@dataclasses.dataclass(frozen=True)
class SearchSpace:
  """The configs worth timing for one template, shape and device.

  candidates: configs that pass the resource model, nearest the default
    first (so a time budget that cuts the list keeps the likeliest ones).
  pruned: the others, each with the reason.
  """
  template: str
  shape: ProblemShape
  device: DeviceConfig
  default: Config
  candidates: tuple[Config, ...]
  pruned: tuple[PrunedConfig, ...]

  def summary(self, *, verbose: bool = False) -> str:
    lines = [f"{self.template} search space on {self.device.name}: "
             f"{len(self.candidates)} candidates, {len(self.pruned)} pruned"]
    if verbose:
      lines += [f"  pruned {format_config(p.config)}: {p.reason}" for p in self.pruned]
    return "\n".join(lines)


def default_axes(template: str, shape: ProblemShape, device: DeviceConfig, *,
                 block_sparse: bool = False) -> dict[str, tuple[int, ...]]:
  """The values searched per config field. Interpret mode keeps the default's launch parameters."""
  default = default_config(template, shape, block_sparse=block_sparse, device=device)
  if template in MOSAIC_TEMPLATES:  # num_warps follows from the tiles (search_space)
    return {"block_q": MOSAIC_BLOCK_Q_CHOICES, "block_k": MOSAIC_BLOCK_K_CHOICES[template],
            "num_warps": (default.num_warps,), "num_stages": MOSAIC_STAGE_CHOICES}
  if device.interpret:
    launch = {"num_warps": (default.num_warps,), "num_stages": (default.num_stages,)}
  else:
    launch = {"num_warps": device.num_warps_choices,
              "num_stages": device.num_stages_choices}
  if template == "decode":
    splits = default.num_splits
    tiles = {"block_k": (32, 64, 128, 256),
             "num_splits": tuple(sorted({max(1, splits // 2), splits, 2 * splits, 4 * splits})),
             "block_rows": (default.block_rows,)}
  elif config_class(template) is AttentionConfig:
    tiles = {"block_q": BLOCK_CHOICES, "block_k": BLOCK_CHOICES}
  else:
    tiles = {"chunk_size": CHUNK_CHOICES, "block_v": BLOCK_V_CHOICES}
  return {**tiles, **launch}


def _distance(config: Config, default: Config) -> float:
  return sum(abs(math.log2(a / b)) for a, b in
             zip(dataclasses.astuple(config), dataclasses.astuple(default)))


def _with_derived_fields(template: str, config: Config) -> Config:
  if template in MOSAIC_TEMPLATES:
    return dataclasses.replace(
        config, num_warps=mosaic_num_warps(template, config.block_q, config.block_k))
  return config


def search_space(template: str, shape: ProblemShape, device: DeviceConfig | None = None, *,
                 block_sparse: bool = False, **axes: tuple[int, ...]) -> SearchSpace:
  """Enumerates and prunes the space; `axes` overrides the values of config fields.
  block_sparse: the variant has a mask_mod (its default config differs).

  Example: `search_space("forward", shape, block_q=(32, 64), num_stages=(2,))`.
  """
  cls = config_class(template)
  device = device_config() if device is None else device
  fields = [f.name for f in dataclasses.fields(cls)]
  unknown = set(axes) - set(fields)
  if unknown:
    raise ValueError(f"unknown axes {sorted(unknown)} for {template}; fields: {fields}")
  values = {**default_axes(template, shape, device, block_sparse=block_sparse), **axes}
  default = default_config(template, shape, block_sparse=block_sparse, device=device)
  candidates, pruned = [], []
  configs = {_with_derived_fields(template, cls(**dict(zip(fields, combo))))
             for combo in itertools.product(*(values[f] for f in fields))}
  for config in sorted(configs, key=dataclasses.astuple):
    reason = prune_reason(template, config, shape, device)
    if reason:
      pruned.append(PrunedConfig(config, reason))
    else:
      candidates.append(config)
  candidates.sort(key=lambda c: (_distance(c, default), dataclasses.astuple(c)))
  return SearchSpace(template, shape, device, default, tuple(candidates), tuple(pruned))

