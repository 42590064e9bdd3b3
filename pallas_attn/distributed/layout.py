"""How a sequence split over the devices of a mesh axis is laid out.

contiguous: device i of N holds positions `[i L, (i + 1) L)` of its local
length L (what `shard_map` gives for a sequence axis sharded on the mesh).

zigzag: the sequence is cut into 2N chunks of L / 2 and device i holds
chunks i and 2N - 1 - i. Under a causal mask every device then has the same
number of (query chunk, key chunk) pairs to compute, where the contiguous
layout gives the last device N times the first's work (Striped / zigzag
ring attention: Brandon et al. 2023; the layout of ring-flash-attention).

`position_map` gives a device's global positions; `to_zigzag` /
`from_zigzag` move a contiguously sharded array into the zigzag layout and
back inside `shard_map`, with at most four `ppermute`s of half a shard.
"""
from __future__ import annotations

import collections

import jax
import jax.numpy as jnp

CONTIGUOUS, ZIGZAG = "contiguous", "zigzag"
LAYOUTS = (CONTIGUOUS, ZIGZAG)


def check_layout(layout: str, *lengths: int):
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
  if layout == ZIGZAG and any(n % 2 for n in lengths):
    raise ValueError(f"the zigzag layout holds two equal chunks per device: local sequence "
                     f"lengths {lengths} must be even")


def position_map(layout: str, device, length: int, num_devices: int):
  """`local index -> global position` on `device` (a traced index) of a
  sequence of `length` per device."""
  if layout == CONTIGUOUS:
    offset = device * length
    return lambda i: i + offset
  half = length // 2
  first = device * half                          # chunk i
  second = (2 * num_devices - 2 - device) * half  # chunk 2N - 1 - i, less its local start
  return lambda i: i + jnp.where(i < half, first, second)


def _zigzag_sources(num_devices: int) -> dict:
  """(device, slot) -> (device, slot) holding that chunk in the contiguous
  layout, where device i's slots 0 and 1 are chunks 2i and 2i + 1."""
  sources = {}
  for device in range(num_devices):
    for slot, chunk in enumerate((device, 2 * num_devices - 1 - device)):
      sources[(device, slot)] = divmod(chunk, 2)
  return sources


def _move_chunks(arrays, axis_name, sources: dict) -> list:
  """Each device's two halves of each (array, axis) of `arrays` replaced by
  the halves `sources` names: one `ppermute` per array and (source slot,
  target slot) pair, each a partial permutation of the devices."""
  routes = collections.defaultdict(list)
  for (device, slot), (source, source_slot) in sources.items():
    routes[(source_slot, slot)].append((source, device))
  routes = sorted(routes.items())
  halves = [jnp.split(x, 2, axis=axis) for x, axis in arrays]
  sends = [(parts[source_slot], perm) for parts in halves for (source_slot, _), perm in routes]
  received = iter(ordered_ppermutes(sends, axis_name))
  moved = []
  for (x, axis), parts in zip(arrays, halves):
    out = [jnp.zeros_like(parts[0]), jnp.zeros_like(parts[1])]
    for (_, slot), _ in routes:
      out[slot] = out[slot] + next(received)
    moved.append(jnp.concatenate(out, axis=axis))
  return moved


def ordered_ppermutes(sends, axis_name) -> list:
  """`lax.ppermute(x, axis_name, perm)` for each (x, perm) of `sends`. On
  CPU one after another: XLA:CPU's runtime can mix up the participants of
  collective-permutes that run at the same time, so there each one's operand
  waits (`optimization_barrier`) for the previous one's result. GPUs keep
  them independent, free to overlap with compute."""
  sequential = jax.default_backend() == "cpu"
  received = []
  for x, perm in sends:
    if received and sequential:
      x, _ = jax.lax.optimization_barrier((x, received[-1]))
    received.append(jax.lax.ppermute(x, axis_name, perm))
  return received


def to_zigzag(arrays, axis_name, num_devices: int) -> list:
  """Contiguously sharded arrays, each given as (array, its sequence axis),
  in the zigzag layout."""
  return _move_chunks(arrays, axis_name, _zigzag_sources(num_devices))


def from_zigzag(arrays, axis_name, num_devices: int) -> list:
  """The inverse of `to_zigzag`."""
  inverse = {source: target for target, source in _zigzag_sources(num_devices).items()}
  return _move_chunks(arrays, axis_name, inverse)
