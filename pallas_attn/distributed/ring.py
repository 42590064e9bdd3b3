"""Ring attention: a sequence split over the devices of one mesh axis.

Inside `shard_map`, each of the N devices keeps its queries and passes its
block of keys and values around the ring (`lax.ppermute` to the next
device). At step t it attends its queries to the block that started t
devices back, with `pallas_attn.attention` (one fused kernel, the row
statistic returned), and folds the partial result into its rows: softmax
rownorms by log-sum-exp (`out = sum_t exp(lse_t - lse) out_t`), elementwise
ones by a plain sum. The transfer of the next block is issued before the
step's kernel and its result held until the kernel's (`_behind`), so that
XLA's asynchronous collectives overlap the two; the forward's is one buffer
(`layout.pack`), since on GPUs a kernel queued behind several collectives
waited for all but the last of them.
The last step's block goes no further: a device sends N - 1 blocks.

score_mod and mask_mod see global positions: each step wraps them so that
`q_idx` and `kv_idx` are the positions of the local queries and of the
visiting keys in the whole sequence (distributed/layout.py), and `b` / `h`
the global batch row and head where the same shard_map also splits those.
The arrays they close over are read at those global indices (as gathers:
keep them replicated). Per-position ids that must travel with the keys
(packed documents) are passed as `segment_ids` instead: the ring passes
each device's ids along with its keys and values. Backward steps whose
tiles the mask all removes (a causal mask's future blocks, a sliding
window's blocks out of reach) run no kernel (`lax.cond` on the step's block
mask); forward steps run theirs, which finds no tile, so that the host is
not held by the cond's predicate (see `_forward`).

The backward is a second ring with the same steps: each device keeps dq
(float32), and a block's dk/dv accumulator, in the keys' dtype (each device
adds its part in float32), follows the block one step behind, so that its
transfer also overlaps a kernel, from the device after the block's own back
to it, which adds its part last (N - 1 transfers of each). Each step runs
attention's backward kernels for (local queries, visiting keys) on the
merged log-sum-exp and softmax's row terms rowsum(dO * O) - d_lse, made
once per head group (`api._recorded_gradients`): no forward is recomputed,
no output is read and nothing per step is kept, so memory stays that of one
device's shard (differentiating through the forward ring instead would
save every step's keys, values and partial output). Its messages are not
packed: each array goes as it is (see `_backward`).

Long shards run the ring in head groups (`head_groups`), one group's ring
after the other's, so that its buffers (the blocks in flight, the
travelling dk / dv, the float32 accumulators) hold a group's heads; a
caller whose shards are in another layout (`context_parallel_attention`'s
natural order) passes its moves (`Relayout`), done per group inside the
forward and backward, so that no moved copy of a whole shard is kept for
the backward either; where the keys may stay in the caller's layout
(`kv_layout`, context_parallel's ring of two) only the query side moves.
The backward writes dq into the saved output's array (the same shape and
dtype where Dqk = Dv), which it no longer needs once a group has read its
heads: the output's bytes are not held twice.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from pallas_attn import _inputs, api
from pallas_attn.distributed import layout as layout_lib
from pallas_attn.distributed.offsets import uses_index_value
from pallas_attn.vjp import attention_vjp
from pallas_attn.spec.analysis import VariantAnalysis, analyze_variant, as_mods, consts_of


@dataclasses.dataclass(frozen=True)
class Relayout:
  """Moves of the caller's shards into the ring's layout and back: each takes
  and returns a list of (array, its sequence axis) pairs (context_parallel's
  zigzag moves). Done per head group inside the ring's forward and backward,
  so that no moved copy of a whole shard is kept for the backward.
  `moves_keys` False: only the query side moves (queries, output, their
  statistics, cotangents and dq); keys, values and their gradients stay in
  the caller's layout, which the ring takes as its `kv_layout`."""
  to_ring: Callable
  from_ring: Callable
  moves_keys: bool = True


@dataclasses.dataclass(frozen=True)
class _Ring:
  """The static part of one ring call."""
  axis_name: object
  layout: str
  analysis: VariantAnalysis   # the user's score_mod / mask_mod / rownorm
  options: dict               # rownorm, scale and attention's tile/lowering options
  batch_axis: object = None   # mesh axes of the same shard_map splitting batch / heads
  head_axis: object = None
  head_groups: int = 1        # rings run one after another, each on Hkv / head_groups kv heads
  relayout: Relayout | None = None  # the caller's layout -> `layout` and back (None: the same)
  kv_layout: str | None = None      # the keys' layout where it is not `layout`


@dataclasses.dataclass(frozen=True)
class _Place:
  """Where this device sits: ring size and index, b/h offsets or None."""
  num: int
  index: jax.Array
  batch_offset: jax.Array | None
  head_offset: jax.Array | None


def _place(ring: _Ring, q, group_heads: int, group) -> _Place:
  """This device's place, for head group `group` of `group_heads` query
  heads (of q's, this device's)."""
  num = lax.axis_size(ring.axis_name)
  batch, head = [None if axes is None else lax.axis_index(axes) * q.shape[dim]
                 for axes, dim in ((ring.batch_axis, 0), (ring.head_axis, 2))]
  if ring.head_groups > 1:
    head = group * group_heads + (0 if head is None else head)
  return _Place(num, lax.axis_index(ring.axis_name), batch, head)


def _global_variant(ring: _Ring, place: _Place, consts, q_len: int, kv_len: int, step,
                    q_ids, kv_ids) -> tuple:
  """(score_mod, mask_mod) of step `step` on local indices: the user's
  programs at global b, h and positions, and the segment ids' document mask."""
  q_pos = layout_lib.position_map(ring.layout, place.index, q_len, place.num)
  source = (place.index - step) % place.num  # the device this step's keys started on
  kv_pos = layout_lib.position_map(ring.kv_layout or ring.layout, source, kv_len, place.num)

  def shift(x, offset):
    return x if offset is None else x + offset

  def global_indices(prog):
    """The indices `prog` sees; b and h shifted only where it reads them, so
    that a program of positions alone (a causal mask) captures no head
    group's offset: its block masks are the same for every group."""
    b_offset, h_offset = (offset if uses_index_value(prog, name, reads_too=True) else None
                          for name, offset in (("b", place.batch_offset),
                                               ("h", place.head_offset)))

    def indices(b, h, q_idx, kv_idx):
      return shift(b, b_offset), shift(h, h_offset), q_pos(q_idx), kv_pos(kv_idx)
    return indices

  user_score, user_mask = as_mods(ring.analysis, consts)
  score_mod = mask_mod = None
  if user_score is not None:
    score_indices = global_indices(ring.analysis.score_mod)

    def score_mod(score, b, h, q_idx, kv_idx):
      return user_score(score, *score_indices(b, h, q_idx, kv_idx))
  if user_mask is not None or q_ids is not None:
    mask_indices = global_indices(ring.analysis.mask_mod)

    def mask_mod(b, h, q_idx, kv_idx):
      keep = None
      if user_mask is not None:
        keep = user_mask(*mask_indices(b, h, q_idx, kv_idx))
      if q_ids is not None:
        same = q_ids[b, q_idx] == kv_ids[b, kv_idx]
        keep = same if keep is None else keep & same
      return keep
  return score_mod, mask_mod


def _step(ring: _Ring, place: _Place, step, q, block, q_ids, consts) -> tuple:
  """(the call, its captured arrays and block masks, whether any tile is
  kept) of ring step `step`: the local queries against the visiting `block`
  (k, v and the kv ids where there are any)."""
  k, v, kv_ids = (*block, None)[:3]  # a message's leaves: k, v and the ids if any
  score_mod, mask_mod = _global_variant(ring, place, consts, q.shape[1], k.shape[1], step,
                                        q_ids, kv_ids)
  call, step_consts, block_masks, _, _ = api._prepare(q, k, v, score_mod=score_mod,
                                                   mask_mod=mask_mod, **ring.options)
  live = True
  if block_masks is not None:
    lists = block_masks[0]
    live = (jnp.sum(lists.kv_partial_num) + jnp.sum(lists.kv_full_num)) > 0
  return call, step_consts, block_masks, live


def _when(live, compute, skipped):
  """`compute()` where `live`, else `skipped()`: no kernel for an empty step."""
  if live is True:
    return compute()
  return lax.cond(live, compute, skipped)


def _pass_on(ring: _Ring, place: _Place, message):
  """`message` (an array, or a list of arrays: one collective each) sent to
  the next device of the ring."""
  perm = [(i, (i + 1) % place.num) for i in range(place.num)]
  return lax.ppermute(message, ring.axis_name, perm)


def _behind(received, results):
  """(`received`, `results`): a transfer's result held back until the step's
  `results` exist (`optimization_barrier`). XLA finishes a collective right
  before its first use; that use had been the unpacking of the next block,
  which XLA ordered before the step's kernel, so the transfer had finished
  before the kernel started and never overlapped it."""
  if received is None:
    return received, results
  return lax.optimization_barrier((received, results))


def _reweighted(out, lse, merged):
  """A softmax output `[B, Sq, Hq, Dv]` normalized by `lse` `[B, Hq, Sq]`,
  renormalized to the larger denominator `merged` (rows empty in both: 0)."""
  safe = jnp.where(merged == -jnp.inf, 0.0, merged)
  return out * jnp.transpose(jnp.exp(lse - safe), (0, 2, 1))[..., None]


def _merge(kind: str, acc, part):
  """Folds one step's (output, row statistic) into the running one."""
  out, lse = acc
  part_out, part_lse = part
  part_out = part_out.astype(jnp.float32)
  if kind == "elementwise":
    return out + part_out, lse
  merged = jnp.logaddexp(lse, part_lse)
  return _reweighted(out, lse, merged) + _reweighted(part_out, part_lse, merged), merged


def _forward(ring: _Ring, place: _Place, q, k, v, q_ids, kv_ids, consts):
  """(output `[B, Sq, Hq, Dv]`, log-sum-exp `[B, Hq, Sq]`) over the ring,
  merged in float32; inputs and results in the ring's layout."""
  kind = ring.analysis.rownorm.kind
  own = [x for x in (k, v, kv_ids) if x is not None]

  def attend(step, block, acc):
    """Step `step`'s (output, row statistic) folded into `acc` (None: alone).
    An empty step runs its kernel too (its programs find no tile: zeros, lse
    -inf): a `lax.cond` reads its predicate on the host, which then cannot
    run ahead of the device (64k and 128k forward over two H200s 0.5-2.5%
    slower with it, `benchmarks/results/NOTES.md`)."""
    call, step_consts, block_masks, _ = _step(ring, place, step, q, block, q_ids, consts)
    part = api._attention(q, *block[:2], step_consts, block_masks, None, call=call)
    return part if acc is None else _merge(kind, acc, part)

  def body(step, carry):
    message, acc = carry
    return _behind(_pass_on(ring, place, message),
                   attend(step, layout_lib.unpack(message, own), acc))

  # Step 0 attends this device's own keys while they go to the next device
  # (k, v and ids in one buffer, one transfer a step); steps 1 .. N - 2
  # attend the block received while passing it on; the last step's block goes
  # no further: N - 1 transfers a device.
  if place.num == 1:
    return attend(0, own, None)
  received, (out, lse) = _behind(_pass_on(ring, place, layout_lib.pack(own)),
                                 attend(0, own, None))
  acc = (out.astype(jnp.float32), lse)
  if place.num > 2:
    received, acc = lax.fori_loop(1, place.num - 1, body, (received, acc))
  out, lse = attend(place.num - 1, layout_lib.unpack(received, own), acc)
  return out.astype(q.dtype), lse  # saved in q's dtype, as attention saves its output


def _backward(ring: _Ring, place: _Place, q, k, v, q_ids, kv_ids, consts, lse, delta, d_out):
  """(dq, dk, dv) over a second ring: dq stays; each block's dk/dv
  accumulator, in the keys' dtype (each device adds its part in float32),
  starts on the device the block visits after its own, follows it one step
  behind (so that its transfer also overlaps a kernel) and returns to the
  block's device, which adds its own part last. A device sends N - 1 blocks
  and N - 1 accumulators. `delta`: softmax's rowsum(dO * O) minus the lse's
  cotangent (None for elementwise rownorms), so that the steps read no
  output. Everything in the ring's layout.

  A message's arrays go as they are, one collective each, not packed into
  one buffer as the forward's: the packed copy of a block sat at the
  backward's memory peak (step 0: the block, its packed copy and the block
  received), and the backward's steps ran as fast without it (two H200s,
  `benchmarks/results/NOTES.md`)."""
  d_out = d_out.astype(q.dtype)
  block_like = [x for x in (k, v, kv_ids) if x is not None]

  def gradients(step, block):
    call, step_consts, block_masks, live = _step(ring, place, step, q, block, q_ids, consts)

    def compute():
      return api._recorded_gradients(q, *block[:2], step_consts, block_masks, None, lse,
                                     delta, d_out, call=call)
    return _when(live, compute, lambda: tuple(jnp.zeros(x.shape, x.dtype)
                                              for x in (q, *block[:2])))

  def added(acc, grads):
    """The accumulators `acc` plus `grads`, summed in float32, in k's / v's dtype."""
    return [(a.astype(jnp.float32) + g.astype(jnp.float32)).astype(x.dtype)
            for a, g, x in zip(acc, grads, (k, v))]

  def visit(step, block, acc, dq, *, passes_block: bool):
    """Step `step` >= 1 on the visiting `block`. Sends the block on where a
    later step needs it (`passes_block`) and `acc`, the accumulator of the
    block visited one step before (None at step 1: that block is this
    device's own). Returns (the next step's block, this block's accumulator
    with this step's part, dq)."""
    sends = (list(block) if passes_block else []) + list(acc or [])
    received = _pass_on(ring, place, sends) if sends else None
    received, (g_q, g_k, g_v) = _behind(received, gradients(step, block))
    # What the previous device sent this step: the next block, and this block's accumulator.
    received = received or []
    next_block = received[:len(block)] if passes_block else None
    if acc is None:  # this block's accumulator starts here
      acc = [g.astype(x.dtype) for g, x in ((g_k, k), (g_v, v))]
    else:
      acc = added(received[len(received) - 2:], (g_k, g_v))
    return next_block, acc, dq + g_q.astype(jnp.float32)

  num = place.num
  received = _pass_on(ring, place, block_like) if num > 1 else None
  # This device's block: its part is added last.
  received, (g_q, own_k, own_v) = _behind(received, gradients(0, block_like))
  if num == 1:
    return g_q.astype(q.dtype), own_k.astype(k.dtype), own_v.astype(v.dtype)
  block, acc, dq = visit(1, received, None, g_q.astype(jnp.float32), passes_block=num > 2)
  if num > 3:
    block, acc, dq = lax.fori_loop(
        2, num - 1, lambda step, carry: visit(step, *carry, passes_block=True),
        (block, acc, dq))
  if num > 2:
    _, acc, dq = visit(num - 1, block, acc, dq, passes_block=False)
  # The last block's accumulator lacks only its own device's part: it goes home.
  dk, dv = added(_pass_on(ring, place, acc), (own_k, own_v))
  return dq.astype(q.dtype), dk, dv


def _check_captures_not_differentiated(score_consts):
  for c in score_consts:
    if c.perturbed and jnp.issubdtype(jnp.result_type(c.value), jnp.floating):
      raise ValueError(
          "ring_attention does not differentiate arrays that score_mod closes over (a float "
          f"array of shape {jnp.shape(c.value)} is being differentiated); wrap it in "
          "jax.lax.stop_gradient, or use pallas_attn.attention with batch/head sharding")


def moved(move, *arrays) -> list:
  """`arrays` ((array or None, sequence axis) pairs) moved by `move` (a
  `Relayout`'s; None: as they are)."""
  if move is None:
    return [x for x, _ in arrays]
  present = [(x, axis) for x, axis in arrays if x is not None]
  moved_arrays = iter(move(present))
  return [None if x is None else next(moved_arrays) for x, _ in arrays]


def _moved(ring: _Ring, direction: str, *arrays, keys=()) -> list:
  """`arrays` (the query side's) and then `keys` (the key side's) moved by
  the ring's relayout, `direction` "to_ring" or "from_ring"; the keys stay
  as they are where the relayout does not move them."""
  move = ring.relayout and getattr(ring.relayout, direction)
  if not (move and ring.relayout.moves_keys):
    return moved(move, *arrays) + [x for x, _ in keys]
  return moved(move, *arrays, *keys)


def _over_head_groups(ring: _Ring, q, k, group_fn, results, start=None):
  """`group_fn(place, head_slice, kv_head_slice, acc)` for each head group,
  one after another (a loop, so that one group's buffers are reused by the
  next), its results (arrays, with their head axis, shaped as `results`)
  written into `start`'s arrays (None: zeros shaped as `results`); `acc`
  holds them as they are before the group's are written, so a group may read
  its own heads of a start array whose buffer the results take over. A slice
  is a function that takes an array and its head axis and returns that
  group's heads."""
  groups = ring.head_groups
  group_heads, group_kv_heads = q.shape[2] // groups, k.shape[2] // groups
  if start is None:
    start = [None] * len(results)
  start = [jnp.zeros(shape_dtype.shape, shape_dtype.dtype) if x is None else x
           for x, (shape_dtype, _) in zip(start, results)]

  def run(group, acc):
    def head_slice(heads):
      return lambda x, axis: (x if groups == 1 else
                              lax.dynamic_slice_in_dim(x, group * heads, heads, axis))
    place = _place(ring, q, group_heads, group)
    return group_fn(place, head_slice(group_heads), head_slice(group_kv_heads), acc)

  if groups == 1:
    return run(0, start)

  def body(group, acc):
    return [lax.dynamic_update_slice_in_dim(a, part, group * (a.shape[axis] // groups), axis)
            for a, part, (_, axis) in zip(acc, run(group, acc), results)]
  return lax.fori_loop(0, groups, body, start)


def _grouped_forward(ring: _Ring, q, k, v, q_ids, kv_ids, consts):
  """(output, log-sum-exp) in the caller's layout: per head group, its q, k,
  v moved into the ring's layout, the ring, the results moved back."""
  q_ids, kv_ids = _moved(ring, "to_ring", (q_ids, 1), keys=[(kv_ids, 1)])

  def group(place, heads, kv_heads, _):
    moved = _moved(ring, "to_ring", (heads(q, 2), 1),
                   keys=[(kv_heads(k, 2), 1), (kv_heads(v, 2), 1)])
    out, lse = _forward(ring, place, *moved, q_ids, kv_ids, consts)
    return _moved(ring, "from_ring", (out, 1), (lse, 2))

  batch, seq_q, heads, _ = q.shape
  results = [(jax.ShapeDtypeStruct((batch, seq_q, heads, v.shape[3]), q.dtype), 2),
             (jax.ShapeDtypeStruct((batch, heads, seq_q), jnp.float32), 1)]
  return tuple(_over_head_groups(ring, q, k, group, results))


def _grouped_backward(ring: _Ring, residuals, d_out, d_lse):
  """(dq, dk, dv) in the caller's layout: per head group, softmax's row
  terms made from its heads of the output (rowsum(dO * O) - d_lse), its
  inputs, statistics, row terms and cotangents moved into the ring's layout,
  the backward ring, its gradients moved back. The output itself is neither
  moved nor read by the steps. Where dq and the saved output agree in shape
  and dtype, dq is written into the output's array, each group reading its
  heads of the output before writing its dq there: the backward holds no
  second array of that size (a quarter of a GPU's inputs, outputs and
  gradients)."""
  q, k, v, q_ids, kv_ids, consts, out, lse = residuals
  q_ids, kv_ids = _moved(ring, "to_ring", (q_ids, 1), keys=[(kv_ids, 1)])
  out_becomes_dq = out.shape == q.shape and out.dtype == q.dtype
  softmax = ring.analysis.rownorm.kind == "softmax"

  def group(place, heads, kv_heads, acc):
    saved_out = acc[0] if out_becomes_dq else out
    delta = (attention_vjp.row_delta(heads(saved_out, 2), heads(d_out, 2), heads(d_lse, 1))
             if softmax else None)
    moved = _moved(ring, "to_ring", (heads(q, 2), 1), (heads(d_out, 2), 1),
                   (heads(lse, 1), 2), (delta, 2),
                   keys=[(kv_heads(k, 2), 1), (kv_heads(v, 2), 1)])
    g_q, g_d_out, g_lse, g_delta, g_k, g_v = moved
    dq, dk, dv = _backward(ring, place, g_q, g_k, g_v, q_ids, kv_ids, consts, g_lse, g_delta,
                           g_d_out)
    return _moved(ring, "from_ring", (dq, 1), keys=[(dk, 1), (dv, 1)])

  results = [(jax.ShapeDtypeStruct(x.shape, x.dtype), 2) for x in (q, k, v)]
  start = [out if out_becomes_dq else None, None, None]
  return tuple(_over_head_groups(ring, q, k, group, results, start))


def _ring(ring: _Ring, q, k, v, q_ids, kv_ids, consts):
  """The differentiable ring: (output, log-sum-exp), in the caller's layout."""
  core = jax.custom_vjp(functools.partial(_grouped_forward, ring))

  def fwd(q, k, v, q_ids, kv_ids, consts):
    _check_captures_not_differentiated(consts[0])
    primals = jax.custom_derivatives.custom_vjp_primal_tree_values(
        (q, k, v, q_ids, kv_ids, consts))
    out, lse = _grouped_forward(ring, *primals)
    return (out, lse), (*primals, out, lse)

  def bwd(residuals, cotangents):
    *_, consts, out, lse = residuals
    zero = lambda ct, like: (jnp.zeros(like.shape, like.dtype)
                             if isinstance(ct, jax.custom_derivatives.SymbolicZero) else ct)
    d_out, d_lse = (zero(ct, like) for ct, like in zip(cotangents, (out, lse)))
    dq, dk, dv = _grouped_backward(ring, residuals, d_out, d_lse)
    return dq, dk, dv, None, None, jax.tree.map(lambda _: None, consts)

  core.defvjp(fwd, bwd, symbolic_zeros=True)
  try:
    return core(q, k, v, q_ids, kv_ids, consts)
  except NotImplementedError as error:  # a shard_map run eagerly
    if "symbolic_zeros" not in str(error):
      raise
    raise ValueError(
        "ring_attention ran in a shard_map outside jit, where JAX cannot run its custom_vjp "
        "(symbolic zeros, for the clear error on differentiated captured arrays): wrap the "
        "shard_map'ed function in jax.jit (context_parallel_attention does so itself)"
    ) from None


GROUP_BLOCK_BYTES = 32 << 20


def default_head_groups(k) -> int:
  """The fewest head groups (a divisor of k's heads) whose block of keys
  (this device's shard, a group's heads) is at most `GROUP_BLOCK_BYTES`:
  long shards run in groups, holding a fraction of the ring's buffers, while
  each group's kernels still cover hundreds of thousands of rows."""
  batch, seq, heads, dim = k.shape
  block = batch * seq * dim * jnp.dtype(k.dtype).itemsize
  return next(g for g in range(1, heads + 1)
              if heads % g == 0 and block * (heads // g) <= GROUP_BLOCK_BYTES or g == heads)


def segment_id_pair(segment_ids, batch: int, seq_q: int, seq_kv: int):
  """(q ids `[B, Sq]`, kv ids `[B, Skv]`) int32 from `segment_ids` (one
  array for both, or a pair), or (None, None)."""
  if segment_ids is None:
    return None, None
  pair = segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids, segment_ids)
  ids = []
  for x, length, name in zip(pair, (seq_q, seq_kv), ("query", "key")):
    x = jnp.asarray(x, jnp.int32)
    if x.ndim == 1:
      x = jnp.broadcast_to(x, (batch, x.shape[0]))
    if x.shape != (batch, length):
      raise ValueError(f"segment_ids: the {name} ids must be [B, S] = [{batch}, {length}] "
                       f"(this device's shard) or [S]; got shape {x.shape}")
    ids.append(x)
  return tuple(ids)


def check_rownorm(analysis: VariantAnalysis, sinks):
  """Raises for rownorms whose row statistic the ring cannot merge."""
  rownorm = analysis.rownorm
  if rownorm.kind == "normalized":
    raise ValueError(
        f"ring attention merges softmax rownorms by log-sum-exp and elementwise ones by a sum; "
        f"rownorm '{rownorm.name}' is normalized (g(s) / h(row statistics)), whose statistic "
        "cannot be merged from each step's divisor. Use pallas_attn.attention with "
        "batch/head sharding for it")
  if rownorm.sink is not None:
    raise ValueError(
        f"rownorm '{rownorm.name}' has a sink term; with ring attention pass rownorm="
        f"'softmax' and sinks=jnp.full((Hq,), {rownorm.sink:g}) instead (the sink is added "
        "once, after the ring)")
  if sinks is not None and rownorm.kind != "softmax":
    raise ValueError(f"sinks add a term to a softmax denominator; rownorm '{rownorm.name}' "
                     f"is {rownorm.kind}")


def _with_sinks(out, lse, sinks, head_offset):
  """The ring's result with one sink term per head added to each row's
  softmax denominator (after the merge, so that it counts once)."""
  heads = out.shape[2]
  sinks = jnp.asarray(sinks, jnp.float32)
  if head_offset is not None:
    sinks = lax.dynamic_slice_in_dim(sinks, head_offset, heads)
  if sinks.shape != (heads,):
    raise ValueError(f"sinks must be [Hq] (one logit per query head); got {sinks.shape}")
  merged = jnp.logaddexp(lse, sinks[None, :, None])
  return _reweighted(out.astype(jnp.float32), lse, merged).astype(out.dtype), merged


def ring_attention(q, k, v, *, axis_name, layout="contiguous", segment_ids=None,
                   score_mod=None, mask_mod=None, rownorm="softmax", scale=None, sinks=None,
                   return_lse=False, batch_axis=None, head_axis=None, head_groups=None,
                   config=None, bwd_config=None, interpret=None, implementation=None,
                   relayout: Relayout | None = None, kv_layout: str | None = None):
  """`pallas_attn.attention` over a sequence split on mesh axis `axis_name`,
  for use inside `jax.shard_map`.

  q `[B, Sq, Hq, Dqk]`, k `[B, Skv, Hkv, Dqk]`, v `[B, Skv, Hkv, Dv]` are this
  device's shards of the sequence, laid out by `layout`: "contiguous"
  (device i holds the i-th block of positions) or "zigzag" (chunks i and
  2N - 1 - i of 2N; balances causal masks; `context_parallel_attention`
  permutes into it); k and v by `kv_layout` where it differs (None: the
  same). score_mod and mask_mod see global positions (and
  global b / h where `batch_axis` / `head_axis` name the mesh axes the same
  shard_map splits them over); the arrays they close over are read at
  those indices. `segment_ids`: this device's `[B, S]` document ids (or a
  pair (query ids, key ids)), which travel around the ring with the keys;
  a query keeps only keys of its own document (ANDed with mask_mod).
  `sinks`: `[Hq]` logits for all (global) query heads. The other arguments
  are `attention`'s; softmax and elementwise rownorms only. `head_groups`:
  the heads split into that many groups (dividing Hkv), each group's ring
  run after the previous one's, so that the ring's buffers (the blocks in
  flight, the travelling dk / dv, float32 accumulators) hold one group's
  heads; None picks the fewest groups whose key block stays within
  `GROUP_BLOCK_BYTES` (one group for short shards). `relayout`: the inputs'
  and results' layout differs from `layout`; these moves convert (per
  group; `context_parallel_attention` uses it). Returns the
  output, and with `return_lse` the log-sum-exp `[B, Hq, Sq]` (None for
  elementwise rownorms). Differentiable in q, k, v and sinks.
  """
  _inputs.check_attention_inputs(q, k, v)
  layout_lib.check_layout(layout, q.shape[1])
  layout_lib.check_layout(kv_layout or layout, k.shape[1])
  if relayout is not None and not relayout.moves_keys and kv_layout is None:
    raise ValueError("a relayout that leaves the keys in place needs their layout (kv_layout)")
  analysis = analyze_variant(score_mod, mask_mod, rownorm)
  check_rownorm(analysis, sinks)
  q_ids, kv_ids = segment_id_pair(segment_ids, q.shape[0], q.shape[1], k.shape[1])
  options = dict(rownorm=rownorm, scale=scale, config=config, bwd_config=bwd_config,
                 interpret=interpret, implementation=implementation)
  if head_groups is None:
    head_groups = default_head_groups(k)
  if head_groups < 1 or k.shape[2] % head_groups:
    raise ValueError(f"head_groups ({head_groups}) must be a positive divisor of the number "
                     f"of key/value heads on this device ({k.shape[2]})")
  ring = _Ring(axis_name, layout, analysis, options, batch_axis, head_axis, head_groups,
               relayout, kv_layout)
  consts = consts_of(analysis)
  out, lse = _ring(ring, q, k, v, q_ids, kv_ids, consts)
  if sinks is not None:
    head_offset = None if head_axis is None else lax.axis_index(head_axis) * q.shape[2]
    out, lse = _with_sinks(out, lse, sinks, head_offset)
  if not return_lse:
    return out
  return out, (None if analysis.rownorm.kind == "elementwise" else lse)
