"""The parallel forward template, lowered with Pallas Mosaic GPU (Hopper).

Same template as kernels/parallel_forward.py (one program per q block,
batch and query head folding kv tiles into the online row state; where
every q block keeps a few kv tiles, one program per SM looping over them,
`persistent_grid`), laid out
the way FlashAttention-3 uses a Hopper SM: one producer warpgroup streams
K/V tiles by TMA into a ring of `num_stages` shared-memory slots, and
`block_q / 64` consumer warpgroups of 64 query rows each run QK^T and PV
with `wgmma`. On unmasked tiles a consumer issues tile j's QK^T and tile
j-1's PV together and weighs tile j while the PV runs (_overlapped_loop),
the two consumers issuing independently; masked tiles go one step at a
time, the consumers ping-ponging on a shared barrier so that one's softmax
overlaps the other's matrix products (fold_block).

What is variant-specific comes from the same places as the Triton
template's: score_mod and mask_mod run on `[64, block_k]` accumulator-layout
tiles through tiles.TileContext (indices as full iota tiles, captured arrays
read from device memory by mosaic_backend.capture_loader; a separable bias
from a row vector and a column vector, spec/separable.py), and the row
state is online.OnlineRowNorm with Mosaic's row layout. Producer and
consumers visit the same kv blocks in the same order: the full ones of the
q block's list unmasked, then the partial ones masked (or, without a block
mask, every key block, the ragged last one masked).

`TEMPLATE` is the forward as the scheduler sees it (schedule/template.py);
`MosaicTemplate` is what it shares with the backward's: the knobs are the
tiles (64 rows per consumer warpgroup, so block_q / 64 consumers) and the
ring depth, num_warps follows from the tiles, and shared memory comes from
the kernels' own accounting.
"""
from __future__ import annotations

import abc
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_attn.kernels import fp8_values
from pallas_attn.kernels import lowering as lowering_lib
from pallas_attn.kernels import mosaic_backend as mb
from pallas_attn.kernels.online import LOG2E
from pallas_attn.kernels.parallel_forward import ForwardPlan
from pallas_attn.schedule import device as device_lib
from pallas_attn.schedule.config import AttentionConfig, next_power_of_2
from pallas_attn.schedule.template import Template, register, shared_memory_reason
from pallas_attn.spec.mask_bounds import kept_kv_tiles


# softmax's lazy running max for fp8 calls, log2 units, in the unmasked
# (overlapped) loop (online.OnlineRowNorm.max_growth; FlashAttention-4's
# threshold; None: exact everywhere): weights reach 2**8, within e4m3's 448,
# and a warp whose rows kept their max skips the accumulator's rescale
# (rescale_unless_unit). Same process on an H200 (benchmarks/results/NOTES.md):
# fp8 vanilla B4 S4096 0.629 -> 0.598 ms, B1 S16384 2.41 -> 2.30; with a
# mask_mod, causal 4k 0.398 -> 0.389, 16k 1.237 -> 1.195. Masked tiles keep
# the exact max (lazy there too, window 256 ran 0.232 -> 0.266 ms), and 16-bit
# calls keep it everywhere (2-9% slower lazy: their weights in registers).
MAX_GROWTH = 8.0


def lazy_max_growth(analysis, fp8: bool) -> float | None:
  """The running max's bound in the forward's unmasked loop where it keeps a
  lazy max (MAX_GROWTH: fp8 softmax calls), else None (exact)."""
  return MAX_GROWTH if fp8 and analysis.rownorm.kind == "softmax" else None


def _visits(plan: ForwardPlan, list_refs, b, h, qi):
  """The kv blocks q block `qi` visits (mosaic_backend.block_visits): listed,
  or every one, masked with a mask_mod, else only the ragged last."""
  num_plain = 0 if plan.analysis.mask_mod is not None else plan.seq_kv // plan.block_k
  return mb.block_visits(list_refs, b, h, qi, num_plain, plan.num_kv_blocks)


@dataclasses.dataclass(frozen=True)
class _PVOperands:
  """How a consumer hands a tile's weights and V to the PV wgmma. 16-bit
  inputs: the weights from registers, V's `[keys, d]` tile. fp8 ones: the
  weights go through e4m3 shared-memory tiles (Pallas infers no layout for
  8-bit A operands in registers; regrouped into one by hand they ran 3-4%
  slower, `benchmarks/results/NOTES.md`), in 16-byte rows whose keys are permuted
  within each 64-key group (mosaic_backend.store_fp8_weights: 2-byte stores
  of column pairs had cost 3-6% of the kernel), and V arrives transposed,
  `[d, keys]` (8-bit wgmma takes no transposed B), its keys in the same
  order (kernels/fp8_values.py).
  A tile's weights pass `cast` after its softmax, then `store(w, j)`: with
  one fp8 weight tile (fp8_weight_tiles) once the previous tile's PV has
  read it, with two into tile j % 2 beside that PV, which reads the other
  (`stores_beside_pv`); `weights(held)` is what the PV takes."""
  dtype: object         # the weights' dtype: V's
  v_smem: object        # the K/V ring's V slots
  p_tiles: object = None  # fp8: this consumer's [1 or 2, rows, block_k] weight tiles

  @property
  def stores_beside_pv(self) -> bool:
    return self.p_tiles is not None and self.p_tiles.shape[0] == 2

  def cast(self, w):
    return w if self.p_tiles is not None else w.astype(self.dtype)

  def store(self, w, j):
    if self.p_tiles is None:
      return w
    tile = lax.rem(jnp.asarray(j, jnp.int32), self.p_tiles.shape[0])
    mb.store_fp8_weights(w.astype(self.dtype), self.p_tiles.at[tile])
    mb.plgpu.commit_smem()
    return tile

  def weights(self, held):
    return held if self.p_tiles is None else self.p_tiles.at[held]

  def values(self, slot):
    return self.v_smem.at[slot] if self.p_tiles is None else self.v_smem.at[slot].T


def _kernel(q_ref, k_ref, v_ref, *refs, plan: ForwardPlan, consumers: int, stages: int,
            num_q_blocks: int, heads: int, batch: int, persistent: bool, shared_qo: bool,
            fp8: bool):
  consumer_registers, producer_registers = mb.registers(consumers)
  n_caps = len(plan.operands)
  cap_refs, rest = refs[:n_caps], refs[n_caps:]
  sink_ref = descale_ref = None
  if plan.has_sink:
    sink_ref, rest = rest[0], rest[1:]
  if fp8:
    descale_ref, rest = rest[0], rest[1:]
  list_refs = None
  if plan.block_sparse:
    list_refs, rest = rest[:4], rest[4:]
  out_ref, lse_ref, q_smem, *rest = rest
  o_smem = q_smem if shared_qo else rest.pop(0)
  p_smem = None
  if fp8:  # the weight tiles and the output tile share their shared memory
    p_smem, o_smem = o_smem
  lse_smem, *rest = rest
  k_smem, v_smem, q_ready, k_ready, v_ready, k_free, v_free, *schedule = rest
  schedule = schedule[0] if schedule else None
  bk, rows = plan.block_k, mb.WG_ROWS
  wg = lax.axis_index("wg")

  def work(b, h, q, step, body):
    """`body(b, h, qi, visits, step) -> step` for one (b, h, q block) item."""
    qi = num_q_blocks - 1 - q  # heaviest (last) q blocks first
    return body(b, h, qi, _visits(plan, list_refs, b, h, qi), step)

  def for_each_item(body):
    """Runs `body` over this program's items, threading the ring's step."""
    if not persistent:
      return work(lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("q"), 0, body)
    programs, first = lax.axis_size("sm"), lax.axis_index("sm")
    items = heads * num_q_blocks * batch
    count = items // programs + (first < items % programs).astype(jnp.int32)

    def one(n, step):  # items in the per-item grid's launch order: heads fastest
      item = n * programs + first
      return work(lax.div(item, heads * num_q_blocks), lax.rem(item, heads),
                  lax.rem(lax.div(item, heads), num_q_blocks), step, body)

    return lax.fori_loop(0, count, one, jnp.int32(0))

  def schedule_barrier():
    if schedule is not None:
      mb.plgpu.barrier_arrive(schedule)
      mb.plgpu.barrier_wait(schedule)

  @pl.when(wg == consumers)
  def _producer():
    mb.plgpu.set_max_registers(producer_registers, action="decrease")

    def produce(b, h, qi, visits, step):
      del qi
      kv_head = lax.div(h, jnp.array(plan.group, h.dtype))

      def load(step, kv_block, sub, masked, carry):
        del sub, masked
        keys = pl.ds(kv_block * bk, bk)
        v_tile = v_ref.at[b, kv_head, :, keys] if fp8 else v_ref.at[b, keys, kv_head]
        mb.refill(step, stages, ((k_ref.at[b, keys, kv_head], k_smem, k_ready, k_free),
                                 (v_tile, v_smem, v_ready, v_free)))
        return carry

      return mb.fold_visits(visits, load, None, step=step)[1]

    for_each_item(produce)

  @pl.when(wg < consumers)
  def _consumer():
    mb.plgpu.set_max_registers(consumer_registers, action="increase")

    def attend(b, h, qi, visits, step0, q_start):
      num_visits = visits[0][0] + visits[1][0]
      q_tile, o_tile, lse_tile = q_smem.at[wg], o_smem.at[wg], lse_smem.at[wg]
      mb.plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_start, rows), h], q_tile, q_ready.at[wg])
      tile = dataclasses.replace(plan.tile, fast_math=False,
                                 loader=mb.capture_loader(b, h, "q", q_start, rows)
                                 ).with_program_loads(cap_refs)
      online = dataclasses.replace(plan.online, fast_math=False, rows=mb.ROWS)  # masked steps
      lazy = lazy_max_growth(plan.analysis, fp8)
      unmasked_online = dataclasses.replace(online, max_growth=lazy)
      fold = plan.folds_log2 and plan.scale > 0
      separable = plan.analysis.separable_bias
      # Softmax of `score + R(q) + C(kv)` is softmax of `score + C(kv)`: a row's
      # constant cancels. So the tile adds the column part only, in the exp2's
      # log2 units, and the lse gets the row part back at the end.
      fold_bias = (separable and sink_ref is None and plan.scale > 0
                   and plan.online.logits_are_scores())
      qk_scale = plan.scale * LOG2E if fold or fold_bias else plan.scale
      if fp8:  # the real scores: the e4m3 product times q's and k's descales
        qk_scale = qk_scale * descale_ref[b, h, 0]
      pv = _PVOperands(v_ref.dtype, v_smem, p_smem.at[wg] if fp8 else None)
      if separable:  # the bias's part along the rows, once (spec/separable.py)
        bias_rows = mb.separable_rows(tile, b, h, cap_refs, "q", q_start, rows)
      affine = fold_bias and plan.analysis.affine_columns
      if affine:  # and along the columns, once, plus a number per tile
        columns0, origin, column_shift = mb.affine_separable_columns(
            tile, b, h, cap_refs, q_start, bk)
        columns0 = columns0 * LOG2E  # held as a vector (a tile would hold 64 registers)
        bias_rows = bias_rows + origin
      sink2 = None if sink_ref is None else sink_ref[h]
      d_v = o_tile.shape[-1]
      row_state = tuple(online.init(rows, d_v, sink2)[1:])
      mb.plgpu.barrier_wait(q_ready.at[wg])

      def weigh(s, kv_block, masked: bool, row_state):
        """One tile's scores -> (float32 weights, the accumulator's per-row
        factor or None, the new row state)."""
        kv_start = kv_block * bk
        # Index tiles are built per step, not held across the loop (64 registers each).
        q_idx = mb.tile_indices(q_start, (rows, bk), 0)
        kv_idx = mb.tile_indices(kv_start, (rows, bk), 1)
        keep = plan.tile_keep(tile, masked, b, h, q_idx, kv_idx, cap_refs, kv_start, bk)
        state = (None,) + row_state  # the accumulator stays in its wgmma registers
        norm = online if masked else unmasked_online
        if fold:  # the scale goes inside the exp2: one multiply-add per score (+6% at 4k)
          w, acc_factor, state = norm.weigh(state, s, keep, log2_logits=s,
                                            logit_scale=qk_scale)
        elif affine:  # as fold_bias, the columns from a vector made once and a number per tile
          logits = s * qk_scale + lax.broadcast_in_dim(columns0, (rows, bk), (1,))
          w, acc_factor, state = norm.weigh(state, s, keep, log2_logits=logits,
                                            logit_shift=column_shift(kv_start) * LOG2E)
        elif fold_bias:  # one multiply-add per score, and the exp2's subtraction
          columns = mb.separable_columns(tile, b, h, cap_refs, "q", q_start, kv_start, bk)
          logits = s * qk_scale + lax.broadcast_in_dim(columns * LOG2E, (rows, bk), (1,))
          w, acc_factor, state = norm.weigh(state, s, keep, log2_logits=logits)
        else:
          scorer = (mb.with_separable_bias(tile, b, h, cap_refs, "q", q_start, bias_rows, kv_start,
                                           bk) if separable else tile)
          s = scorer.score(s * qk_scale, b, h, q_idx, kv_idx, cap_refs, kv_start, bk)
          w, acc_factor, state = norm.weigh(state, s, keep, kv_idx=kv_idx)
        return w, acc_factor, state[1:]

      def fold_block(step, kv_block, sub, masked: bool, state):
        del sub  # one sub-step per visit
        slot = lax.rem(step, stages)

        def qk(acc_ref):
          mb.plgpu.wgmma(acc_ref, q_tile, k_smem.at[slot].T)
          schedule_barrier()
          return acc_ref[...]

        s = pl.run_scoped(qk, mb.plgpu.ACC((rows, bk), jnp.float32))
        mb.plgpu.barrier_arrive(k_free.at[slot])
        w, acc_factor, row_state = weigh(s, kv_block, masked, tuple(state[1:]))
        held = pv.store(pv.cast(w), 0)
        acc = online.rescale(state[0], acc_factor)
        if schedule is not None:
          mb.plgpu.barrier_arrive(schedule)
        mb.plgpu.barrier_wait(v_ready.at[slot])
        if schedule is not None:
          mb.plgpu.barrier_wait(schedule)

        def product(acc_ref):
          mb.plgpu.wgmma(acc_ref, pv.weights(held), pv.values(slot))
          nxt = step + 1

          @pl.when(nxt < step0 + num_visits)
          def _():
            mb.plgpu.barrier_wait(k_ready.at[lax.rem(nxt, stages)])

        acc = pl.run_state(product)(mb.plgpu.ACC.init(acc))
        mb.plgpu.barrier_arrive(v_free.at[slot])
        return (acc,) + row_state

      # The unmasked visits overlap each tile's softmax with the previous
      # tile's PV (_overlapped_loop); masked tiles, which need more registers,
      # and 16-bit 256-key tiles (a score tile and the weights held for the PV
      # overflow the registers: d 64 ran 462 -> 338 TFLOP/s on an H200; fp8's
      # weights wait in shared memory) take one step at a time (fold_block).
      full_num, full_at = visits[0]
      if (bk <= 128 or fp8) and not (isinstance(full_num, int) and full_num == 0):
        acc, row_state = _overlapped_loop(
            full_num, full_at, weigh, mb.rescale_unless_unit if lazy else online.rescale,
            row_state, q_tile=q_tile, k_smem=k_smem,
            pv=pv, barriers=(k_ready, v_ready, k_free, v_free), stages=stages, block_k=bk,
            d_v=d_v, may_be_empty=plan.block_sparse, first_step=step0)
        skip = full_num
      else:
        acc, skip = online.rows.zeros_tile(rows, d_v), 0
      # fold_block's consumers pass a shared barrier twice per step, the second
      # one phase behind: one's softmax runs while the other's products do.
      if schedule is not None:
        pl.when(wg == 1)(schedule_barrier)

      @pl.when(num_visits > skip)
      def _():
        mb.plgpu.barrier_wait(k_ready.at[lax.rem(step0 + skip, stages)])

      state, _ = mb.fold_visits(visits, fold_block, (acc,) + row_state, step=step0, skip=skip)
      if schedule is not None:
        pl.when(wg == 0)(schedule_barrier)
      out, lse = online.finalize(state)
      if fold_bias:
        lse = lse + bias_rows
      if fp8:  # v's descale
        out = out * descale_ref[b, h, 1]
      o_tile[...] = out.astype(o_tile.dtype)
      lse_tile[...] = lse
      mb.plgpu.commit_smem()
      mb.plgpu.copy_smem_to_gmem(o_tile, out_ref.at[b, pl.ds(q_start, rows), h])
      mb.plgpu.copy_smem_to_gmem(lse_tile, lse_ref.at[b, h, pl.ds(q_start, rows)])
      # Only the stores' reads of shared memory hold the program (the writes land by the
      # kernel's end; the next item's q load may then take the tile): a window of 256 keys
      # leaves a program three tiles, and its forward ran 0.1479 -> 0.1461 ms at 4k on an
      # H200 (`ab_epilogue_read_only_windows.json`).
      mb.plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def consume(b, h, qi, visits, step0):
      q_start = qi * plan.block_q + wg * rows
      if q_ref.shape[1] % plan.block_q:  # the last q block is ragged (q_rows_multiple)
        pl.when(q_start < q_ref.shape[1])(lambda: attend(b, h, qi, visits, step0, q_start))
        pl.when(q_start >= q_ref.shape[1])(lambda: mb.turn_ring(
            visits, stages, ((k_ready, (k_free,)), (v_ready, (v_free,))), step=step0))
      else:
        attend(b, h, qi, visits, step0, q_start)
      return step0 + visits[0][0] + visits[1][0]

    for_each_item(consume)


def _overlapped_loop(count, block_at, weigh, rescale, row_state, *, q_tile, k_smem, pv,
                     barriers, stages: int, block_k: int, d_v: int, may_be_empty: bool,
                     first_step=0):
  """A consumer's walk over its first `count` kv visits (blocks
  `block_at(j)`, unmasked) with FlashAttention-3's intra-warpgroup overlap:
  step j issues QK^T of tile j and, behind it, tile j-1's PV, then weighs
  tile j (score_mod, softmax) while that PV runs. The accumulator stays in
  one wgmma register set across the walk; the first QK^T and the last PV
  sit outside the loop. The consumers issue their products without ordering
  each other (FlashAttention-3's turn-taking, consumer wg waiting for the
  other's issue before its own, made the loop 4-5% slower: Nsight Compute's
  locked-clock kernel time on an H200, vanilla 4k 1.075 -> 1.030 ms, 16k
  4.03 -> 3.84 ms without it; fp8's loop too, 0.685 -> 0.747 ms at vanilla
  4k with 256-key tiles, `benchmarks/results/NOTES.md`). Ring slots count
  from `first_step`. Returns (accumulator, row state).

  The walk is one branch of a cond when it may be empty: a cond around the
  first step or the last PV alone makes ptxas serialize every wgmma of the
  kernel (C7513: moves into wgmma registers inside a pipeline stage)."""
  k_ready, v_ready, k_free, v_free = barriers
  rows = q_tile.shape[0]

  def scores(slot, pending):
    def issue(s_ref):
      mb.plgpu.wgmma(s_ref, q_tile, k_smem.at[slot].T)
      if pending is not None:
        o_ref, w_prev, prev = pending
        mb.plgpu.wgmma(o_ref, w_prev, pv.values(prev))
      return mb.plgpu.wgmma_accumulator_load(s_ref, wait_n=0 if pending is None else 1)

    s = pl.run_scoped(issue, mb.plgpu.ACC((rows, block_k), jnp.float32))
    mb.plgpu.barrier_arrive(k_free.at[slot])
    return s

  def walk(o_ref):
    mb.plgpu.barrier_wait(k_ready.at[lax.rem(first_step, stages)])
    w, _, state = weigh(scores(lax.rem(first_step, stages), None), block_at(0), False, row_state)
    held = pv.store(pv.cast(w), 0)

    def step(j, carry):
      held, state = carry
      slot, prev = lax.rem(first_step + j, stages), lax.rem(first_step + j - 1, stages)
      mb.plgpu.barrier_wait(k_ready.at[slot])
      mb.plgpu.barrier_wait(v_ready.at[prev])
      s = scores(slot, (o_ref, pv.weights(held), prev))
      w, acc_factor, state = weigh(s, block_at(j), False, state)
      w = pv.cast(w)
      if pv.stores_beside_pv:
        held = pv.store(w, j)
      acc = o_ref[...]  # waits for tile j-1's PV
      mb.plgpu.barrier_arrive(v_free.at[prev])
      if not pv.stores_beside_pv:
        held = pv.store(w, j)
      if acc_factor is not None:
        o_ref[...] = rescale(acc, acc_factor)
      return held, state

    held, state = lax.fori_loop(1, count, step, (held, state))
    last = lax.rem(first_step + count - 1, stages)
    mb.plgpu.barrier_wait(v_ready.at[last])
    mb.plgpu.wgmma(o_ref, pv.weights(held), pv.values(last))
    acc = o_ref[...]
    mb.plgpu.barrier_arrive(v_free.at[last])
    return acc, state

  run = lambda: pl.run_scoped(walk, mb.plgpu.ACC((rows, d_v), jnp.float32))
  if not may_be_empty:
    return run()
  return lax.cond(count > 0, run, lambda: (mb.ROWS.zeros_tile(rows, d_v), row_state))


SHORT_ITEM_TILES = 8


def persistent_grid(analysis, block_q: int, block_k: int, seq_q: int, seq_kv: int, items: int,
                    sm_count: int | None) -> bool:
  """Whether the forward runs one program per SM, each looping over every
  SM-th (b, h, q block) item, instead of one program per item: where every
  item is a few kv tiles, at most SHORT_ITEM_TILES in the middle q block
  and no more in the last (by mask_mod's tile bounds: sliding windows,
  short sequences). There a program's fixed costs (its launch, the q load,
  the output store) weigh, and the producer streams the next item's K/V
  while the consumers store: causal window 256, B4 H16 S4096 on an H200,
  0.146 -> 0.129 ms (cuDNN 0.137), window 1024 (9 tiles) 0.256 either way.
  Long items keep a program each: launched in order as SMs free up, the
  running programs stay on neighbouring q blocks, sharing their heads' K/V
  in L2, and take causal's heaviest blocks first; the static loop ran
  vanilla 16k 3.22 -> 3.50 ms and causal 16k 1.55 -> 1.82
  (`benchmarks/results/NOTES.md`)."""
  if not sm_count or items <= sm_count:
    return False
  num_kv_blocks = -(-seq_kv // block_k)

  def tiles(q_block):
    if analysis.mask_mod is None:
      return num_kv_blocks
    start = q_block * block_q
    return kept_kv_tiles(analysis, (start, start + block_q - 1), block_k, num_kv_blocks)

  num_q_blocks = -(-seq_q // block_q)
  middle = tiles(num_q_blocks // 2)
  return middle <= SHORT_ITEM_TILES and tiles(num_q_blocks - 1) <= middle


def describe_grid(analysis, config: AttentionConfig, batch: int, heads: int, seq_q: int,
                  seq_kv: int, sm_count: int | None) -> str:
  """The forward's grid at a shape, for `pallas-attn explain`."""
  items = batch * heads * -(-seq_q // config.block_q)
  if persistent_grid(analysis, config.block_q, config.block_k, seq_q, seq_kv, items, sm_count):
    return (f"grid: one program per SM ({sm_count}) looping over {items} (b, h, q block) items "
            f"(every q block keeps at most {SHORT_ITEM_TILES} kv tiles)")
  return f"grid: one program per (b, h, q block) item ({items})"


def shared_memory_bytes(config: AttentionConfig, d_qk: int, d_v: int, itemsize: int,
                        fp8: bool = False) -> int:
  """Shared memory of one program at `config` on padded head dims: the q
  tile (the output tile shares it when the head dims agree and it is not
  fp8's bfloat16 output, which shares fp8's weight tiles, fp8_weight_tiles),
  the row statistics and the K/V ring."""
  rows = config.block_q
  if fp8:
    weights = fp8_weight_tiles(config.block_k) * rows * config.block_k
    q_and_out = rows * d_qk + max(weights, 2 * rows * d_v)
  else:
    q_and_out = rows * (d_qk if d_qk == d_v else d_qk + d_v) * itemsize
  return q_and_out + rows * 4 + config.num_stages * config.block_k * (d_qk + d_v) * itemsize


FP8_HEAD_DIM = 128  # fp8's tiles: 128-byte swizzled rows, shared memory at 128 keys


def fp8_weight_tiles(block_k: int) -> int:
  """Weight tiles per fp8 consumer: two at 128 keys, where tile j's weights
  then go to shared memory while tile j-1's PV runs (causal 4k 0.407 ->
  0.396 ms, 16k 1.338 -> 1.316 on an H200, outputs bitwise equal); one at
  256, whose PV reads twice the bytes beside the store (vanilla 16k 2.36 ->
  2.42 with two, 4k equal; `benchmarks/results/NOTES.md`)."""
  return 2 if block_k <= 128 else 1


FP8_ROWS = 192  # fp8 programs: three consumer warpgroups


def fp8_config(config: AttentionConfig, seq_q: int) -> AttentionConfig:
  """An fp8 call's tiles from its 16-bit default: three consumer warpgroups
  of 64 rows over 128-key tiles. fp8's weights wait in shared memory, so a
  consumer holds a score tile and its accumulator, which fit the 160
  registers of three (`mosaic_backend.registers`); the third adds the independent work
  that two lacked (Nsight Compute: 0.55 eligible warps per scheduler). One
  H200, kernel ms against two consumers (256-key tiles without a mask_mod,
  128 with one; `benchmarks/results/NOTES.md`): vanilla B4 S4096 0.659 ->
  0.639, causal 0.397 either way, vanilla B1 S16384 2.480 -> 2.390, causal
  1.324 -> 1.259; rings of three or four slots ran slower. Short query
  sequences and 64-key tiles keep their tiles."""
  if seq_q <= 128 or config.block_k < 128:
    return config
  return dataclasses.replace(config, block_q=FP8_ROWS, block_k=128, num_stages=2,
                             num_warps=mb.num_warps(FP8_ROWS))


def q_rows_multiple(block_q: int) -> int:
  """What the forward needs q's rows padded to: whole q blocks, but whole
  64-row consumer tiles at 192 rows, whose last q block may then end past
  q's rows; its consumers wholly past the end load and store nothing and
  only turn the ring (`_kernel`), where padding S 4096 to 4224 would cost a
  copy of q and of the output."""
  return mb.WG_ROWS if block_q % 128 else block_q


def fp8_obstacle(config: AttentionConfig, d_qk: int, d_v: int) -> str | None:
  """Why the fp8 forward cannot take these tiles and padded head dims, or None."""
  if (d_qk, d_v) != (FP8_HEAD_DIM, FP8_HEAD_DIM):
    return (f"fp8 tensor cores take head dims padded to {FP8_HEAD_DIM}; these pad to "
            f"({d_qk}, {d_v})")
  if config.block_k % 128:
    return f"fp8 tensor cores take 128-key tiles or multiples; block_k is {config.block_k}"
  smem = shared_memory_bytes(config, d_qk, d_v, 1, fp8=True) + mb.SMEM_SLACK
  if smem > mb.HOPPER_SMEM:
    return (f"the fp8 tiles of {config} need {smem // 1024} KiB of shared memory, over "
            f"{mb.HOPPER_SMEM // 1024}")
  return None


def forward(q, k, v, capture_arrays, sinks, block_mask_arrays, *, plan: ForwardPlan,
            config: AttentionConfig, interpret: bool, descales=None):
  """Runs the Mosaic GPU forward on padded inputs; the contract of
  parallel_forward.forward (softmax and elementwise rownorms: no row
  statistics beyond the lse). `config.block_q` is the q rows per program
  (64 per consumer warpgroup), `config.num_stages` the K/V ring depth.

  fp8 q, k, v (e4m3, `fp8_obstacle` None) take `descales` `[B, Hq, 2]`
  float32: per query head, the factor of its scores (q's descale times its
  kv head's k descale) and of its output (v's); both products run on fp8
  wgmma and the output is bfloat16. V is transposed here (one pass over V's
  bytes, kernels/fp8_values.py) for the PV product's K-major operand, its
  keys in the order of the weights' tiles."""
  del interpret  # compiled only (mosaic_backend.unavailable)
  batch, seq_q_pad, heads, d_qk = q.shape
  d_v = v.shape[-1]
  fp8 = descales is not None
  out_dtype = jnp.bfloat16 if fp8 else q.dtype
  consumers = plan.block_q // mb.WG_ROWS
  if consumers == 3 and not fp8:
    raise ValueError(
        "block_q 192 (three consumer warpgroups) is for fp8 inputs: 16-bit weights, held in "
        "registers beside the score tile, overflow a third consumer's 160 (a causal B4 S4096 "
        "bfloat16 forward ran 0.640 ms against 0.441 at block_q 128 on an H200); use 128")
  stages = max(1, min(config.num_stages, plan.num_kv_blocks))
  num_q_blocks = -(-seq_q_pad // plan.block_q)
  transforms = mb.smem_transforms(q.dtype.itemsize)
  # The output tile reuses q's shared memory when the head dims and dtypes agree.
  shared_qo = d_qk == d_v and not fp8
  scratch = [mb.plgpu.SMEM((consumers, mb.WG_ROWS, d_qk), q.dtype, transforms=transforms)]
  if not shared_qo:
    o_scratch = mb.plgpu.SMEM((consumers, mb.WG_ROWS, d_v), out_dtype,
                              transforms=mb.smem_transforms(jnp.dtype(out_dtype).itemsize))
    if fp8:  # the weight tiles, dead by the time the output is stored
      weight_tiles = (consumers, fp8_weight_tiles(plan.block_k), mb.WG_ROWS, plan.block_k)
      o_scratch = mb.plgpu.RefUnion(
          mb.plgpu.SMEM(weight_tiles, v.dtype, transforms=transforms), o_scratch)
    scratch.append(o_scratch)
  scratch.append(mb.plgpu.SMEM((consumers, mb.WG_ROWS), jnp.float32))
  if fp8:
    v = fp8_values.transposed_values(v, interpret=False)  # [B, Hkv, Dv, Skv], keys permuted
  v_tile = (d_v, plan.block_k) if fp8 else (plan.block_k, d_v)
  scratch += [
      mb.plgpu.SMEM((stages, plan.block_k, d_qk), k.dtype, transforms=transforms),
      mb.plgpu.SMEM((stages, *v_tile), v.dtype, transforms=transforms),
      mb.plgpu.Barrier(num_barriers=consumers),
      mb.plgpu.Barrier(num_barriers=stages),
      mb.plgpu.Barrier(num_barriers=stages),
      mb.plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),
      mb.plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),
  ]
  if consumers == 2:
    scratch.append(mb.plgpu.Barrier(num_arrivals=consumers))  # fold_block's ping-pong
  sink_inputs = () if sinks is None else (sinks.astype(jnp.float32) * LOG2E,)
  descale_inputs = (descales,) if fp8 else ()
  items = heads * num_q_blocks * batch
  sm_count = device_lib.device_config().sm_count
  persistent = persistent_grid(plan.analysis, plan.block_q, plan.block_k, seq_q_pad, plan.seq_kv,
                               items, sm_count)
  if persistent:
    grid, grid_names = (sm_count,), ("sm",)
  else:
    grid, grid_names = (heads, num_q_blocks, batch), ("h", "q", "b")
  kernel = mb.kernel(
      functools.partial(_kernel, plan=plan, consumers=consumers, stages=stages,
                        num_q_blocks=num_q_blocks, heads=heads, batch=batch,
                        persistent=persistent, shared_qo=shared_qo, fp8=fp8),
      name="pallas_attn_mosaic_forward",
      out_type=[jax.ShapeDtypeStruct((batch, seq_q_pad, heads, d_v), out_dtype),
                jax.ShapeDtypeStruct((batch, heads, seq_q_pad), jnp.float32)],
      scratch_types=scratch,
      # Heads vary fastest: programs running together share a q block and
      # differ in head (as JAX's Mosaic kernel orders them). Same-run A/B on
      # an H200: +9% forward over q-fastest, vanilla and causal, 4k and 16k.
      grid=grid,
      grid_names=grid_names,
      num_threads=consumers + 1,
      thread_name="wg",
      compiler_params=mb.compiler_params(plan.fast_math),
  )
  out, lse = kernel(q, k, v, *capture_arrays, *sink_inputs, *descale_inputs, *block_mask_arrays)
  return out, lse, None


class MosaicTemplate(Template):
  """The parallel templates on Mosaic GPU (the forward here, the backward in
  vjp/mosaic_backward.py)."""
  config_class = AttentionConfig
  lowering = lowering_lib.MOSAIC_GPU
  block_q_choices = (64, 128)  # one or two consumer warpgroups
  block_k_choices: tuple
  stage_choices = (1, 2, 3, 4, 6, 8)

  @abc.abstractmethod
  def consumer_rows(self, block_q: int, block_k: int) -> int:
    """The rows a program's consumer warpgroups own."""

  @abc.abstractmethod
  def memory_reason(self, config: AttentionConfig, d_qk: int, d_v: int, itemsize: int,
                    device) -> str | None:
    """Why the kernels cannot hold `config`'s tiles in shared memory, or None."""

  @abc.abstractmethod
  def obstacle(self, analysis, dtype, d_qk: int, d_v: int, interpret: bool) -> str | None:
    """Why this lowering cannot run the pass for a call, or None."""

  def num_warps(self, block_q: int, block_k: int) -> int:
    return mb.num_warps(self.consumer_rows(block_q, block_k))

  def with_derived_fields(self, config):
    return dataclasses.replace(config, num_warps=self.num_warps(config.block_q, config.block_k))

  def prune_reason(self, config, shape, device):
    error = self.config_error(config)
    if error:
      return error
    for axis, value, seq, seq_name in (("block_q", config.block_q, shape.seq_q, "seq_q"),
                                       ("block_k", config.block_k, shape.seq_kv, "seq_kv")):
      if value > max(mb.WG_ROWS, next_power_of_2(seq)):
        return f"{axis} {value} > padded {seq_name}"
    warps = self.num_warps(config.block_q, config.block_k)
    if config.num_warps != warps:
      return f"num_warps {config.num_warps}: these tiles run {warps} (consumers and producer)"
    if device.interpret:
      return None
    d_qk, d_v = (lowering_lib.padded_head_dim(d, lowering_lib.MOSAIC_GPU)
                 for d in (shape.d_qk, shape.d_v))
    return self.memory_reason(config, d_qk, d_v, shape.itemsize, device)

  def axes(self, shape, device, default):
    return {"block_q": self.block_q_choices, "block_k": self.block_k_choices,
            "num_warps": (default.num_warps,), "num_stages": self.stage_choices}


class MosaicForwardTemplate(MosaicTemplate):
  name = "forward_mosaic"
  block_k_choices = (64, 128, 256)

  def default_config(self, shape, device=None, *, block_sparse=False,
                     scores_per_position=False):
    return lowering_lib.heuristic_mosaic_config(shape.seq_q, shape.seq_kv, shape.d_qk,
                                                shape.d_v, block_sparse=block_sparse)

  def config_error(self, config):
    return lowering_lib.mosaic_config_error(config)

  def obstacle(self, analysis, dtype, d_qk, d_v, interpret):
    return lowering_lib.mosaic_obstacle(analysis, dtype, d_qk, d_v, interpret)

  def consumer_rows(self, block_q, block_k):
    return block_q

  def memory_reason(self, config, d_qk, d_v, itemsize, device):
    return shared_memory_reason(shared_memory_bytes(config, d_qk, d_v, itemsize), device)


TEMPLATE = register(MosaicForwardTemplate())
