"""The interface every kernel template implements, and the registry that names them.

A template (the parallel forward or backward on one lowering, the split-KV
forward, a chunked linear pass) is one `Template` object next to its
kernel: it owns its config dataclass (which validates its fields on
construction), its heuristic default, its resource model (why a config is
pruned for a shape on a device), its search axes and its cache bucket. The
generic search (search_space.py), the cache and the tuner reach templates
only through this interface, by the name a template registers under (the
name tuning caches and the CLI use), so adding a template edits nothing in
`schedule/`. `pallas_attn._templates` imports the package's template modules,
which register themselves; importing `pallas_attn` does that.

`TritonTemplate` is the resource model the Triton templates share: tiles
that are multiples of the MMA tile and no larger than the padded problem,
a power-of-two warp count within the program's threads, and estimates of
shared memory and fp32 accumulator registers within the device's.
"""
from __future__ import annotations

import abc
import dataclasses
import math
from typing import NamedTuple, Protocol

import jax.numpy as jnp

from pallas_attn.schedule.config import next_power_of_2
from pallas_attn.schedule.device import DeviceConfig, KiB


class Config(Protocol):
  """A template's config: a frozen dataclass of integer fields (None where a
  field is left to the schedule) that validates them on construction, and
  reads and writes the dicts that cache files hold."""

  def to_dict(self) -> dict: ...

  @classmethod
  def from_dict(cls, d: dict) -> "Config": ...


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


class Template(abc.ABC):
  """One kernel template as the scheduler sees it.

  name: what caches and the CLI call it; config_class: its config dataclass.
  """
  name: str
  config_class: type

  @abc.abstractmethod
  def default_config(self, shape: ProblemShape, device: DeviceConfig | None = None, *,
                     block_sparse: bool = False, scores_per_position: bool = False) -> Config:
    """The heuristic config the kernel runs when the cache has no entry.
    device: None for the current one (read only by templates whose
    heuristic depends on it); block_sparse: the variant has a mask_mod;
    scores_per_position: its score_mod is evaluated at every position
    (`VariantAnalysis.scores_per_position`)."""

  @abc.abstractmethod
  def prune_reason(self, config: Config, shape: ProblemShape,
                   device: DeviceConfig) -> str | None:
    """Why `config` cannot (or should not) run `shape` on `device`; None if it may."""

  @abc.abstractmethod
  def axes(self, shape: ProblemShape, device: DeviceConfig,
           default: Config) -> dict[str, tuple]:
    """The values searched per config field, around `default`."""

  def with_derived_fields(self, config: Config) -> Config:
    """`config` with the fields that follow from the others set (none here)."""
    return config

  def config_error(self, config: Config) -> str | None:
    """Why the kernel cannot take `config` whatever the shape, or None."""
    return None

  def check(self, config: Config) -> None:
    """Raises a ValueError saying why, where the kernel cannot take `config`."""
    error = self.config_error(config)
    if error:
      raise ValueError(error)

  def cache_bucket(self, shape: ProblemShape) -> dict:
    """The shape fields of this template's cache key: batch x query heads and
    the sequence lengths rounded up to powers of two (every length of a
    bucket pads to the same blocks, so one config serves it), the GQA
    group, head dims and dtype exact."""
    return dict(batch_heads=next_power_of_2(shape.batch * shape.heads_q),
                group=shape.heads_q // shape.heads_kv,
                seq_q=next_power_of_2(shape.seq_q), seq_kv=next_power_of_2(shape.seq_kv),
                d_qk=shape.d_qk, d_v=shape.d_v, dtype=shape.dtype)


# --- Registry -------------------------------------------------------------------

REGISTRY: dict[str, Template] = {}


def register(template: Template) -> Template:
  """Adds `template` under its name (a name is taken once); returns it."""
  taken = REGISTRY.get(template.name)
  if taken is not None and taken is not template:
    raise ValueError(f"a template named {template.name!r} is registered already: {taken!r}")
  REGISTRY[template.name] = template
  return template


def get(name: str) -> Template:
  """The template registered as `name`; a clear error for an unknown one."""
  if name not in REGISTRY:
    raise ValueError(f"unknown template {name!r}; known: {', '.join(REGISTRY)}")
  return REGISTRY[name]


# --- The Triton templates' resource model -----------------------------------------


@dataclasses.dataclass(frozen=True)
class ResourceUse:
  """Estimated on-chip use of one program.

  smem_bytes: shared memory of the pipelined and resident tiles.
  acc_registers: fp32 values held across the inner loop, per thread.
  """
  smem_bytes: int
  acc_registers: int


class TileCheck(NamedTuple):
  """A tile dimension `value` of config field `axis`: a multiple of `multiple`
  (the MMA tile), at most `bound` (`bound_name` in the reason; None: no bound)."""
  axis: str
  value: int
  multiple: int
  bound: int | None
  bound_name: str

  def reason(self) -> str | None:
    if self.value % self.multiple:
      return f"{self.axis} {self.value} is not a multiple of the {self.multiple}-wide MMA tile"
    if self.bound is not None and self.value > self.bound:
      return f"{self.axis} {self.value} > {self.bound_name} {self.bound}"
    return None


def _kib(n: int) -> str:
  return f"{round(n / KiB, 1):g} KiB"


def shared_memory_reason(smem_bytes: int, device: DeviceConfig) -> str | None:
  """Why `smem_bytes` of shared memory do not fit one program on `device`, or None."""
  if device.smem_per_block is not None and smem_bytes > device.smem_per_block:
    return f"smem {_kib(smem_bytes)} > {_kib(device.smem_per_block)} limit"
  return None


def register_budget(num_warps: int, device: DeviceConfig) -> int | None:
  """Registers a thread may hold at `num_warps` without spilling (None: unlimited)."""
  if device.registers_per_sm is None or device.max_registers_per_thread is None:
    return None
  threads = num_warps * device.warp_size
  return min(device.max_registers_per_thread, device.registers_per_sm // threads)


def accumulator_registers(fp32_values: int, config: Config, device: DeviceConfig) -> int:
  """Registers per thread for `fp32_values` float32 values held across a
  program's inner loop, spread over its `config.num_warps` warps."""
  return math.ceil(fp32_values / (config.num_warps * device.warp_size))


class TritonTemplate(Template):
  """A template lowered with Triton. Head dims count as padded to powers of
  two (at least 16); its config has `num_warps` and `num_stages` fields,
  searched over the device's choices (interpret mode keeps the default's:
  there they have no effect)."""

  @abc.abstractmethod
  def tile_checks(self, config: Config, shape: ProblemShape,
                  device: DeviceConfig) -> list[TileCheck]:
    """The config's tile dimensions against the MMA tile and the padded shape."""

  @abc.abstractmethod
  def score_tile(self, config: Config) -> tuple[int, int]:
    """Rows and columns of the tile the program's warps share the MMAs of."""

  @abc.abstractmethod
  def resource_use(self, config: Config, shape: ProblemShape,
                   device: DeviceConfig) -> ResourceUse:
    """Shared memory and accumulator registers of one program (the larger
    kernel's, where the template runs several)."""

  @abc.abstractmethod
  def tile_axes(self, shape: ProblemShape, device: DeviceConfig,
                default: Config) -> dict[str, tuple]:
    """The values searched per tile field."""

  def shape_reason(self, config: Config, shape: ProblemShape,
                   device: DeviceConfig) -> str | None:
    """Why the tiles do not fit the shape (the first failing check), or None."""
    return next(filter(None, (c.reason() for c in self.tile_checks(config, shape, device))),
                None)

  def prune_reason(self, config, shape, device):
    reason = self.shape_reason(config, shape, device)
    if reason:
      return reason
    warps = config.num_warps
    if warps & (warps - 1):  # e.g. a Mosaic GPU warp count (AttentionConfig)
      return f"num_warps {warps} is not a power of two (Triton)"
    if device.interpret:
      return None  # Interpret mode: no on-chip limits, launch parameters unused.
    if warps * device.warp_size > device.max_threads_per_block:
      return (f"num_warps {warps} x {device.warp_size} threads > "
              f"{device.max_threads_per_block} per program")
    rows, cols = self.score_tile(config)
    mma_m, mma_n, _ = device.mma_tile
    mma_tiles = (rows // mma_m) * (cols // mma_n)
    if mma_tiles < warps:
      return f"{mma_tiles} MMA tiles of {rows}x{cols} < {warps} warps"
    use = self.resource_use(config, shape, device)
    reason = shared_memory_reason(use.smem_bytes, device)
    if reason:
      return reason
    budget = register_budget(warps, device)
    if budget is not None and use.acc_registers > budget:
      return (f"fp32 accumulators {use.acc_registers} regs/thread > {budget} "
              f"budget at {warps} warps")
    return None

  def axes(self, shape, device, default):
    if device.interpret:
      launch = {"num_warps": (default.num_warps,), "num_stages": (default.num_stages,)}
    else:
      launch = {"num_warps": device.num_warps_choices,
                "num_stages": device.num_stages_choices}
    return {**self.tile_axes(shape, device, default), **launch}
