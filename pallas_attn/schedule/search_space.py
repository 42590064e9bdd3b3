"""Search spaces of the kernel templates, pruned by their resource models before compiling.

A template's space is the product of the values its `axes` give per config
field (an axis value a config rejects, e.g. a tile that is no power of two,
raises there). Before the tuner compiles anything, each config goes through
the template's `prune_reason`: checked against the problem shape and the
device (schedule/template.py), a pruned config keeps the reason, e.g.
"smem 264 KiB > 227 KiB limit". The code here is generic: it reaches a
template only by its registered name.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

from pallas_attn.schedule.device import DeviceConfig, device_config
from pallas_attn.schedule.template import Config, ProblemShape, get


def format_config(config: Config) -> str:
  """`block_q=128 block_k=64 num_warps=8 num_stages=3`: for progress lines and tables."""
  return " ".join(f"{k}={v}" for k, v in config.to_dict().items())


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
                 block_sparse: bool = False,
                 scores_per_position: bool = False) -> dict[str, tuple[int, ...]]:
  """The values searched per config field, around the template's default."""
  found = get(template)
  return found.axes(shape, device,
                    found.default_config(shape, device, block_sparse=block_sparse,
                                         scores_per_position=scores_per_position))


def _distance(config: Config, default: Config) -> float:
  return sum(abs(math.log2(a / b)) for a, b in
             zip(dataclasses.astuple(config), dataclasses.astuple(default)))


def search_space(template: str, shape: ProblemShape, device: DeviceConfig | None = None, *,
                 block_sparse: bool = False, scores_per_position: bool = False,
                 **axes: tuple[int, ...]) -> SearchSpace:
  """Enumerates and prunes the space; `axes` overrides the values of config fields.
  block_sparse, scores_per_position: facts of the variant its default config
  reads (Template.default_config).

  Example: `search_space("forward", shape, block_q=(32, 64), num_stages=(2,))`.
  """
  found = get(template)
  device = device_config() if device is None else device
  fields = [f.name for f in dataclasses.fields(found.config_class)]
  unknown = set(axes) - set(fields)
  if unknown:
    raise ValueError(f"unknown axes {sorted(unknown)} for {template}; fields: {fields}")
  default = found.default_config(shape, device, block_sparse=block_sparse,
                                 scores_per_position=scores_per_position)
  values = {**found.axes(shape, device, default), **axes}
  candidates, pruned = [], []
  configs = {found.with_derived_fields(found.config_class(**dict(zip(fields, combo))))
             for combo in itertools.product(*(values[f] for f in fields))}
  for config in sorted(configs, key=dataclasses.astuple):
    reason = found.prune_reason(config, shape, device)
    if reason:
      pruned.append(PrunedConfig(config, reason))
    else:
      candidates.append(config)
  candidates.sort(key=lambda c: (_distance(c, default), dataclasses.astuple(c)))
  return SearchSpace(template, shape, device, default, tuple(candidates), tuple(pruned))
