"""How a sequence split over the devices of a mesh axis is laid out.

contiguous: device i of N holds positions `[i L, (i + 1) L)` of its local
length L (what `shard_map` gives for a sequence axis sharded on the mesh).

zigzag: the sequence is cut into 2N chunks of L / 2 and device i holds
chunks i and 2N - 1 - i. Under a causal mask every device then has the same
number of (query chunk, key chunk) pairs to compute, where the contiguous
layout gives the last device N times the first's work (Striped / zigzag
ring attention: Brandon et al. 2023; the layout of ring-flash-attention).

`position_map` gives a device's global positions; `to_zigzag` /
`from_zigzag` move contiguously sharded arrays into the zigzag layout and
back inside `shard_map`, in two rounds of sends (one `ppermute` of half a
shard per round and dtype, both directions at once; none where a round keeps
every half in place).
`zigzag_order` / `natural_order` permute a whole (unsharded) sequence into
the order whose contiguous shards are the zigzag layout, and back: a model
that keeps its tokens in that order from the embedding to the loss runs
every layer's ring with no relayout.

`pack` / `unpack` put several arrays into one flat buffer and back, so that
one collective moves them all: on GPUs the collectives of a program queue
one after another, and a kernel enqueued behind several of them starts only
once all but the last have finished (measured on four H200s: a ring step's
kernel waited for the transfer of k before v's overlapped it), where one
transfer per step overlaps the kernel whole.
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


def _zigzag_chunks(num_devices: int) -> list[int]:
  """The 2N chunks of a sequence in zigzag order: 0, 2N - 1, 1, 2N - 2, ..."""
  return [chunk for device in range(num_devices)
          for chunk in (device, 2 * num_devices - 1 - device)]


def _reorder(x, num_devices: int, axis: int, chunks: list[int]):
  """`x`'s 2N chunks along `axis` in the order `chunks`. An axis split over
  devices by an explicit sharding type is gathered for the move (chunks
  need not split evenly over the devices) and split again after it."""
  length = x.shape[axis]
  if length % (2 * num_devices):
    raise ValueError(f"the zigzag order cuts a sequence into 2 x {num_devices} equal chunks: "
                     f"length {length} (axis {axis}) does not split so")
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec = tuple(getattr(sharding, "spec", ())) + (None,) * x.ndim
  split = (getattr(sharding, "mesh", None) is not None and spec[axis] is not None
           and jax.sharding.AxisType.Explicit in getattr(sharding.mesh, "axis_types", ()))
  if split:
    whole = jax.sharding.PartitionSpec(*(None if i == axis else spec[i] for i in range(x.ndim)))
    x = jax.sharding.reshard(x, jax.sharding.NamedSharding(sharding.mesh, whole))
  parts = jnp.split(x, 2 * num_devices, axis=axis)
  moved = jnp.concatenate([parts[c] for c in chunks], axis=axis)
  if split:
    moved = jax.sharding.reshard(moved, sharding)
  return moved


def zigzag_order(x, num_devices: int, axis: int = 1):
  """`x`'s sequence axis `axis` (global positions in order) rearranged so that
  its contiguous split over `num_devices` gives device i chunks i and
  2N - 1 - i of 2N: the zigzag layout, balanced under causal masks.
  Apply it to q, k, v and segment ids (once, e.g. to the token ids before
  the embedding) and pass `sequence_order="zigzag"` to
  `context_parallel_attention`. An axis sharded with an explicit sharding
  type is gathered for the move and sharded again."""
  return _reorder(x, num_devices, axis, _zigzag_chunks(num_devices))


def natural_order(x, num_devices: int, axis: int = 1):
  """The inverse of `zigzag_order`: the sequence back in position order."""
  chunks = _zigzag_chunks(num_devices)
  return _reorder(x, num_devices, axis, sorted(range(len(chunks)), key=chunks.__getitem__))


def _zigzag_sources(num_devices: int) -> dict:
  """(device, slot) -> (device, slot) holding that chunk in the contiguous
  layout, where device i's slots 0 and 1 are chunks 2i and 2i + 1."""
  chunks = _zigzag_chunks(num_devices)
  return {(device, slot): divmod(chunks[2 * device + slot], 2)
          for device in range(num_devices) for slot in (0, 1)}


def _word(leaves) -> jnp.dtype:
  """The leaves' common dtype, else the widest unsigned integer type whose
  size divides every leaf's item size."""
  dtypes = {jnp.dtype(x.dtype) for x in leaves}
  if len(dtypes) == 1:
    return dtypes.pop()
  size = min(d.itemsize for d in dtypes)
  while any(d.itemsize % size for d in dtypes):
    size //= 2
  return jnp.dtype(f"uint{8 * size}")


def pack(leaves) -> jax.Array:
  """The arrays `leaves` as one flat array: concatenated where they share a
  dtype (differentiable), else their bytes in unsigned words (not)."""
  word = _word(leaves)
  return jnp.concatenate([(x if x.dtype == word else jax.lax.bitcast_convert_type(x, word))
                          .reshape(-1) for x in leaves])


def unpack(message: jax.Array, like) -> list:
  """The arrays `pack` put in `message`, shaped and typed as those of `like`."""
  word, start, leaves = message.dtype, 0, []
  for x in like:
    if x.dtype == word:
      leaves.append(message[start:start + x.size].reshape(x.shape))
      start += x.size
      continue
    ratio = jnp.dtype(x.dtype).itemsize // word.itemsize
    size = x.size * ratio
    words = message[start:start + size].reshape(x.shape + ((ratio,) if ratio > 1 else ()))
    leaves.append(jax.lax.bitcast_convert_type(words, x.dtype))
    start += size
  return leaves


def _send_rounds(sources: dict) -> list[dict]:
  """`sources` ((device, slot) -> (device, slot) it takes its half from) as
  two rounds in which every device sends one of its halves and receives
  one: per round, device -> (slot it sends, device it sends to, slot the
  receiver puts it in). Each device sends two halves and receives two, so
  the moves form cycles alternating between senders and receivers, whose
  edges alternate between the rounds (a 2-regular bipartite multigraph is
  two perfect matchings)."""
  edges = [(source, source_slot, device, slot)
           for (device, slot), (source, source_slot) in sorted(sources.items())]
  sent, received = collections.defaultdict(list), collections.defaultdict(list)
  for i, (source, _, device, _) in enumerate(edges):
    sent[source].append(i)
    received[device].append(i)
  round_of = {}
  for first in range(len(edges)):
    edge = first
    while edge not in round_of:  # around one cycle
      round_of[edge] = 0
      partner = next(i for i in received[edges[edge][2]] if i != edge)
      round_of[partner] = 1
      edge = next(i for i in sent[edges[partner][0]] if i != partner)
  rounds = [{}, {}]
  for i, (source, source_slot, device, slot) in enumerate(edges):
    rounds[round_of[i]][source] = (source_slot, device, slot)
  return rounds


def _per_device(values: list, axis_name):
  """`values[i]` on device i of `axis_name`: a Python value where all agree."""
  if len(set(values)) == 1:
    return values[0]
  return jnp.asarray(values)[jax.lax.axis_index(axis_name)]


def _move_chunks(arrays, axis_name, sources: dict) -> list:
  """Each device's two halves of each (array, axis) of `arrays` replaced by
  the halves `sources` names, in two rounds (`_send_rounds`): per round
  and dtype, one `ppermute` of one half of every array (packed, so that
  gradients flow through), both directions at once; a round in which every
  device keeps its half moves nothing."""
  num = len(sources) // 2
  groups = collections.defaultdict(list)  # dtype -> indices of the arrays
  for i, (x, _) in enumerate(arrays):
    groups[jnp.dtype(x.dtype)].append(i)
  rounds = _send_rounds(sources)
  parts = [[None, None] for _ in arrays]  # per array, the halves of rounds 0 and 1
  sends, unpacks = [], []
  for n, plan in enumerate(rounds):
    perm = [(device, plan[device][1]) for device in range(num)]
    sent_slot = _per_device([plan[device][0] for device in range(num)], axis_name)
    for members in groups.values():
      halves = []
      for i in members:
        x, axis = arrays[i]
        half = x.shape[axis] // 2
        halves.append(jax.lax.dynamic_slice_in_dim(x, sent_slot * half, half, axis))
      if all(a == b for a, b in perm):  # every device keeps this half
        for i, part in zip(members, halves):
          parts[i][n] = part
      else:
        sends.append((pack(halves), perm))
        unpacks.append((n, members, halves))
  for message, (n, members, halves) in zip(ordered_ppermutes(sends, axis_name), unpacks):
    for i, part in zip(members, unpack(message, halves)):
      parts[i][n] = part
  # The slot of round 0's half on each device; round 1's half takes the other.
  to_slot = {target: slot for _, target, slot in rounds[0].values()}
  slot = _per_device([to_slot[device] for device in range(num)], axis_name)
  out = []
  for (first, second), (_, axis) in zip(parts, arrays):
    if isinstance(slot, int):
      pair = (first, second) if slot == 0 else (second, first)
    else:
      pair = (jnp.where(slot == 0, first, second), jnp.where(slot == 0, second, first))
    out.append(jnp.concatenate(pair, axis=axis))
  return out


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
