"""The parallel backward (dq, and dk/dv), lowered with Pallas Mosaic GPU (Hopper).

The passes and the per-tile algebra are those of vjp/parallel_backward.py
(`tile_gradients`: recomputed scores, the variant's programs and their
`jax.vjp`, the row terms of vjp/attention_vjp.py); the layout is that of
kernels/mosaic_forward.py. A program is `consumers` warpgroups of 64 fixed
rows each, fed by a producer warpgroup that streams 64-row tiles of the other
side by TMA through a ring of `num_stages` shared-memory slots:

* dq: a program owns block_q queries of one head (192, three consumers, on
  an unmasked softmax of the score or of a function of it alone:
  `dq_program_rows`) and streams K and V tiles;
  per step S = Q K^T, dP = dO V^T, dS, then dQ += dS K.
* dk/dv: a program owns block_k keys of one kv head and streams, for each
  query head of its GQA group, Q, dO and the row terms; per step the
  transposed tile S^T = K Q^T, dP^T = V dO^T, the weights P^T and dS^T,
  then dV += P^T dO and dK += dS^T Q (wgmma takes the register operand on
  the left, so the program's own rows must be the tile's rows). Its
  consumers start staggered, each once the one before has its first S^T and
  dP^T, so that one's elementwise work runs beside the other's products
  rather than in lockstep (dk/dv kernel 0.5-5% faster, gradients bitwise
  equal; one H200, `benchmarks/results/NOTES.md`).

Visits come from the block mask at (block_q, block_k) (or every block, as
the Triton passes); each visited block is streamed in 64-row sub-steps.
A diagonal term (spec/diagonal.py) is read from its vector over q - kv, as
`[q, kv]` tiles in the dq kernel and `[kv, q]` tiles in the dk/dv kernel
(mosaic_backend.diagonal_tile). Capture gradients are not lowered here:
calls that need them run the Triton passes (vjp/attention_vjp.py decides).

`TEMPLATE` is the backward as the scheduler sees it (schedule/template.py):
a config must leave both kernels' rings the depth it asks for.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_attn.kernels import lowering as lowering_lib
from pallas_attn.kernels import mosaic_backend as mb
from pallas_attn.kernels.mosaic_forward import MosaicTemplate
from pallas_attn.kernels.online import LOG2E
from pallas_attn.kernels.parallel_forward import softmax_of_logits
from pallas_attn.schedule.config import AttentionConfig
from pallas_attn.schedule.template import register
from pallas_attn.vjp.parallel_backward import (BackwardPlan, softmax_lse2,
                                               softmax_tile_gradients, softmax_weights,
                                               split_inputs, tile_gradients)

SUB = mb.WG_ROWS  # rows per consumer warpgroup and per streamed dk/dv tile
DQ_STEP_KEYS = 64  # keys per streamed dq tile (at most block_k)
SMEM_BYTES = 220 * 1024  # a Hopper block's shared memory, less a margin for barriers
WIDE_DQ_ROWS = 192  # three consumer warpgroups: the dq programs of `dq_program_rows`' calls


def _ring_stages(requested: int, fixed: int, per_stage: int) -> int:
  """The ring depth: as asked, as far as shared memory holds it (at least 1)."""
  return max(1, min(requested, (SMEM_BYTES - fixed) // per_stage))


def ring_depths(config: AttentionConfig, d_qk: int, d_v: int, itemsize: int,
                row_terms: bool, rows_given: bool = False,
                dq_rows: int | None = None) -> tuple[int, int]:
  """The dq and dk/dv kernels' ring depths for `config` on padded head dims:
  `config.num_stages`, capped by shared memory beside each kernel's resident
  tiles (a dq program's `dq_rows`, by default block_q). `row_terms`: a
  softmax rownorm, whose (lse2, delta) rows the dk/dv ring carries; the dq
  kernel computes them, staging the output tile, unless `rows_given`."""
  dq_rows = config.block_q if dq_rows is None else dq_rows
  fixed = dq_rows * (d_qk + d_v) * itemsize
  if row_terms and not rows_given:
    fixed += dq_rows * (d_v * itemsize + 2 * 4)
  step_keys = min(DQ_STEP_KEYS, config.block_k)
  dq = _ring_stages(config.num_stages, fixed, step_keys * (d_qk + d_v) * itemsize)
  dkv = _ring_stages(config.num_stages, (config.block_k // SUB) * SUB * (d_qk + d_v) * itemsize,
                     SUB * (d_qk + d_v) * itemsize + (2 * SUB * 4 if row_terms else 0))
  return dq, dkv


def dq_program_rows(analysis, block_q: int, seq_q_pad: int, d_qk: int, d_v: int,
                    block_mask=None) -> int:
  """The query rows a dq program owns: block_q, or WIDE_DQ_ROWS (three
  consumers, 160 registers each) on an unmasked softmax of the scores or of
  a function of the score alone (softcap) with 128-wide heads from 2k padded
  queries. One H200, same process, dq kernel ms: plain 1.098 -> 1.073 (B4
  S4096), 4.48 -> 4.23 (B1 S16384), forward+backward equal at 4k and 1-2%
  faster at 2k / 8k / 16k; softcap 1.525 -> 1.429, 6.14 -> 5.56
  (forward+backward 2%); ALiBi, whose bias vectors take registers, slower
  (1.145 -> 1.174, 4.51 -> 4.61: `benchmarks/results/NOTES.md`). Masked calls
  keep the block mask's rows (192-row mask tiles slowed the causal kernels).
  The last program's rows may end past q's: its consumers past the end only
  turn the ring."""
  score_alone = analysis.score_mod is None or analysis.score_mod.deps <= {"score"}
  wide = (analysis.mask_mod is None and block_mask is None and score_alone
          and softmax_of_logits(analysis))
  if wide and block_q == 128 and (d_qk, d_v) == (128, 128) and seq_q_pad >= 2048:
    return WIDE_DQ_ROWS
  return block_q


def describe_dq_programs(analysis, config: AttentionConfig, seq_q: int, d_qk: int,
                         d_v: int) -> str:
  """The dq kernel's programs at a shape (padded head dims), for `pallas-attn explain`."""
  rows = dq_program_rows(analysis, config.block_q, -(-seq_q // config.block_q) * config.block_q,
                         d_qk, d_v)
  return (f"dq programs: {rows} query rows, {rows // SUB} consumer warpgroups"
          + (" (unmasked softmax of the score or a function of it alone, 128-wide heads,"
             " 2k+ queries)" if rows != config.block_q
             else ""))


def _zeros(rows: int, cols: int):
  return mb.as_tile(jnp.zeros((rows, cols), jnp.float32))


def _gradients(plan, tile, s, dp, rows, keep, position, cap_refs, window):
  """(weights, ds) of one tile, autodiff's primitives bound as Mosaic lowers them."""
  weights, ds, _, _ = tile_gradients(plan, tile, s * plan.score_scale, dp, rows, keep,
                                     position, cap_refs, window, (), lower=mb.lowerable)
  return weights, ds


def row_inputs(rownorm, out, stat, d_stat):
  """What the dq kernel derives the softmax row terms from: (lse in log2
  units, the output, the lse cotangent or None); None for elementwise
  rownorms. The dq kernel computes `delta = rowsum(dO * O) - d_stat` from
  the tiles it loads anyway and writes both terms for the dk/dv kernel.
  (`backward` also takes the terms made already, `[B, H, 2, Sq_pad]`.)"""
  if rownorm.kind == "elementwise":
    return None
  return softmax_lse2(stat), out, d_stat


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, *refs, plan: BackwardPlan, stages: int,
               rows_per_program: int, num_q_blocks: int, step_keys: int, num_row_refs: int):
  row_refs, cap_refs, list_refs, rest = split_inputs(plan, refs, num_row_refs)
  dq_ref, *rest = rest
  computes_rows = num_row_refs > 1  # (lse2, out[, d_stat]); else the rows given, or none
  if computes_rows:
    rows_out_ref, *rest = rest
    o_smem, rows_smem, o_ready, *rest = rest
  (q_smem, do_smem, k_smem, v_smem, q_ready, do_ready, kv_ready, k_free, v_free) = rest
  dtype = q_ref.dtype
  consumers = rows_per_program // SUB
  consumer_registers, producer_registers = mb.registers(consumers)
  sub_steps = plan.block_k // step_keys
  qi = num_q_blocks - 1 - lax.axis_index("q")  # heaviest (last) q blocks first
  b, h, wg = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("wg")
  num_plain = 0 if plan.analysis.mask_mod is not None else plan.seq_kv // plan.block_k
  visits = mb.block_visits(list_refs, b, h, qi, num_plain, plan.num_kv_blocks)

  @pl.when(wg == consumers)
  def _producer():
    mb.plgpu.set_max_registers(producer_registers, action="decrease")
    kv_head = lax.div(h, jnp.array(plan.group, h.dtype))

    def load(step, kv_block, sub, masked, carry):
      del masked
      at = (b, pl.ds(kv_block * plan.block_k + sub * step_keys, step_keys), kv_head)
      mb.refill(step, stages, ((k_ref.at[at], k_smem, kv_ready, k_free),
                               (v_ref.at[at], v_smem, kv_ready, v_free)))
      return carry

    mb.fold_visits(visits, load, None, sub_steps=sub_steps)

  def attend(q_start):
    """A consumer's 64 rows from `q_start`: its dq (and row terms)."""
    q_tile, do_tile = q_smem.at[wg], do_smem.at[wg]
    mb.plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_start, SUB), h], q_tile, q_ready.at[wg])
    mb.plgpu.copy_gmem_to_smem(do_ref.at[b, pl.ds(q_start, SUB), h], do_tile, do_ready.at[wg])
    tile = dataclasses.replace(plan.tile, loader=mb.capture_loader(b, h, "q", q_start, SUB)
                               ).with_program_loads(cap_refs)
    q_idx = mb.tile_indices(q_start, (SUB, step_keys), 0)
    fold_bias, log2_scale = plan.folds_separable_bias, plan.scale * LOG2E
    if plan.analysis.separable_bias:
      bias_rows = mb.separable_rows(tile, b, h, cap_refs, "q", q_start, SUB)
    q_rows = pl.ds(q_start, SUB)
    row_layout = mb.plgpu.Layout.WGMMA.reduce(1)
    if computes_rows:
      lse2_ref, out_ref, *d_stat_ref = row_refs
      mb.plgpu.copy_gmem_to_smem(out_ref.at[b, q_rows, h], o_smem.at[wg], o_ready.at[wg])
    mb.plgpu.barrier_wait(q_ready.at[wg])
    mb.plgpu.barrier_wait(do_ready.at[wg])
    rows = ()
    if row_refs and not computes_rows:  # softmax's (lse2, delta), given
      rows = tuple(mb.load_ref(row_refs[0].at[b, h, n, q_rows], layout=row_layout,
                               optimized=False) for n in range(2))
    elif row_refs:  # softmax: lse2 and delta = rowsum(dO * O) - d_stat
      lse2 = mb.load_ref(lse2_ref.at[b, h, q_rows], layout=row_layout, optimized=False)
      mb.plgpu.barrier_wait(o_ready.at[wg])
      tile_of = lambda ref: mb.load_ref(ref, layout=mb.plgpu.Layout.WGMMA)
      delta = jnp.sum(tile_of(o_smem.at[wg]).astype(jnp.float32)
                      * tile_of(do_tile).astype(jnp.float32), axis=1)
      if d_stat_ref:
        delta = delta - mb.load_ref(d_stat_ref[0].at[b, h, q_rows], layout=row_layout,
                                    optimized=False)
      rows = (lse2, delta)
      rows_smem.at[wg, 0][...] = lse2
      rows_smem.at[wg, 1][...] = delta
      mb.plgpu.commit_smem()
      mb.plgpu.copy_smem_to_gmem(rows_smem.at[wg], rows_out_ref.at[b, h, :, q_rows])
    if rows and fold_bias:  # the bias's part along the rows joins lse2
      rows = (rows[0] - bias_rows * LOG2E, rows[1])

    def keep_and_rows(kv_start, masked):
      """(kv_idx, keep, the row terms' tiles) of the step at `kv_start`."""
      kv_idx = mb.tile_indices(kv_start, (SUB, step_keys), 1)
      keep = plan.tile_keep(tile, masked, b, h, q_idx, kv_idx, cap_refs, kv_start, step_keys)
      return kv_idx, keep, tuple(lax.broadcast_in_dim(r, (SUB, step_keys), (0,)) for r in rows)

    def softmax_ds(slot, kv_start, masked, k_slot, v_slot):
      """dS of a plain softmax step (`fold_bias` or `plan.folds_log2`), its
      two products waited for one at a time: the weights are made while dP's
      product still runs (dq kernel 2-5% faster, gradients bitwise equal; the
      same in the dk/dv kernel, with the dV update also running beside dS,
      was 1-6% slower: benchmarks/results/NOTES.md)."""
      def scoped(s_ref, dp_ref):
        mb.plgpu.wgmma(s_ref, q_tile, k_slot.T)
        mb.plgpu.wgmma(dp_ref, do_tile, v_slot.T)
        _, keep, (lse2, delta) = keep_and_rows(kv_start, masked)
        s = mb.plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # S is done, dP may run on
        if fold_bias:
          columns = mb.separable_columns(tile, b, h, cap_refs, "q", q_start, kv_start, step_keys)
          logits2 = s * log2_scale + lax.broadcast_in_dim(columns * LOG2E, (SUB, step_keys), (1,))
        else:
          logits2 = s * plan.score_scale
        w = softmax_weights(logits2, lse2, keep)
        dp = mb.plgpu.wgmma_accumulator_load(dp_ref, wait_n=0)
        mb.plgpu.barrier_arrive(v_free.at[slot])
        return (w * (dp - delta)).astype(dtype)

      return pl.run_scoped(scoped, mb.plgpu.ACC((SUB, step_keys), jnp.float32),
                           mb.plgpu.ACC((SUB, step_keys), jnp.float32))

    def visit(step, kv_block, sub, masked: bool, dq):
      slot = lax.rem(step, stages)
      kv_start = kv_block * plan.block_k + sub * step_keys
      k_slot, v_slot = k_smem.at[slot], v_smem.at[slot]
      mb.plgpu.barrier_wait(kv_ready.at[slot])
      if fold_bias or plan.folds_log2:
        ds = softmax_ds(slot, kv_start, masked, k_slot, v_slot)
      else:
        s, dp = mb.products(((q_tile, k_slot), (do_tile, v_slot)), (SUB, step_keys))
        mb.plgpu.barrier_arrive(v_free.at[slot])
        kv_idx, keep, row_tiles = keep_and_rows(kv_start, masked)
        scorer = (mb.with_separable_bias(tile, b, h, cap_refs, "q", q_start, bias_rows,
                                         kv_start, step_keys)
                  if plan.analysis.separable_bias else tile)
        _, ds = _gradients(plan, scorer, s, dp, row_tiles, keep, (b, h, q_idx, kv_idx),
                           cap_refs, (kv_start, step_keys))

      def dq_update(acc_ref):
        mb.plgpu.wgmma(acc_ref, ds.astype(dtype), k_slot)

      dq = pl.run_state(dq_update)(mb.plgpu.ACC.init(dq))
      mb.plgpu.barrier_arrive(k_free.at[slot])
      return dq

    dq, _ = mb.fold_visits(visits, visit, _zeros(SUB, q_ref.shape[-1]), sub_steps=sub_steps)
    q_tile[...] = (dq * plan.scale).astype(dtype)
    mb.plgpu.commit_smem()
    mb.plgpu.copy_smem_to_gmem(q_tile, dq_ref.at[b, pl.ds(q_start, SUB), h])
    mb.plgpu.wait_smem_to_gmem(0)

  @pl.when(wg < consumers)
  def _consumer():
    mb.plgpu.set_max_registers(consumer_registers, action="increase")
    q_start = qi * rows_per_program + wg * SUB
    if q_ref.shape[1] % rows_per_program:  # the last program's rows end past q's
      pl.when(q_start < q_ref.shape[1])(lambda: attend(q_start))
      pl.when(q_start >= q_ref.shape[1])(lambda: mb.turn_ring(
          visits, stages, ((kv_ready, (v_free, k_free)),), sub_steps=sub_steps))
    else:
      attend(q_start)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, *refs, plan: BackwardPlan, stages: int):
  row_refs, cap_refs, list_refs, rest = split_inputs(plan, refs)
  rows_ref = row_refs[0] if row_refs else None
  (dk_ref, dv_ref, k_smem, v_smem, q_smem, do_smem, *rest) = rest
  rows_smem = rest.pop(0) if rows_ref is not None else None
  k_ready, v_ready, ready, free, *lag = rest
  dtype = q_ref.dtype
  consumers = plan.block_k // SUB
  sub_steps = plan.block_q // SUB
  ki, b, kv_head = lax.axis_index("kv"), lax.axis_index("b"), lax.axis_index("h")
  wg = lax.axis_index("wg")
  num_plain = 0 if plan.analysis.mask_mod is not None else plan.num_q_blocks
  # Padded query rows have dO = 0; outside plain softmax their scores could
  # still make non-finite derivatives, so they are masked.
  mask_rows = not plan.folds_log2 and plan.seq_q % plan.block_q != 0
  fold_bias = plan.folds_separable_bias
  log2_scale = plan.scale * LOG2E

  def head_of(g):
    return kv_head * plan.group + g

  def over_heads(body, carry):
    """Folds `body(h, carry, step) -> (carry, step)` over the group's query heads."""
    def one(g, c):
      return body(head_of(g), *c)
    if plan.group == 1:
      return one(0, (carry, 0))
    return lax.fori_loop(0, plan.group, one, (carry, 0))

  def visits_of(h):
    return mb.block_visits(list_refs, b, h, ki, num_plain, plan.num_q_blocks)

  consumer_registers, producer_registers = mb.registers(consumers)

  @pl.when(wg == consumers)
  def _producer():
    mb.plgpu.set_max_registers(producer_registers, action="decrease")

    def head(h, carry, step):
      def load(step, q_block, sub, masked, carry):
        del masked
        q_rows = pl.ds(q_block * plan.block_q + sub * SUB, SUB)
        copies = [(q_ref.at[b, q_rows, h], q_smem, ready, free),  # one wait frees the slot
                  (do_ref.at[b, q_rows, h], do_smem, ready, None)]
        if rows_ref is not None:
          copies.append((rows_ref.at[b, h, :, q_rows], rows_smem, ready, None))
        mb.refill(step, stages, copies)
        return carry

      return mb.fold_visits(visits_of(h), load, carry, step, sub_steps=sub_steps)

    over_heads(head, None)

  @pl.when(wg < consumers)
  def _consumer():
    mb.plgpu.set_max_registers(consumer_registers, action="increase")
    kv_start = ki * plan.block_k + wg * SUB
    k_tile, v_tile = k_smem.at[wg], v_smem.at[wg]
    kv_rows = (b, pl.ds(kv_start, SUB), kv_head)
    mb.plgpu.copy_gmem_to_smem(k_ref.at[kv_rows], k_tile, k_ready.at[wg])
    mb.plgpu.copy_gmem_to_smem(v_ref.at[kv_rows], v_tile, v_ready.at[wg])
    kv_idx = mb.tile_indices(kv_start, (SUB, SUB), 0)
    mb.plgpu.barrier_wait(k_ready.at[wg])
    mb.plgpu.barrier_wait(v_ready.at[wg])
    if lag:  # start once the previous consumer has its first products (module docstring)
      pl.when(wg > 0)(lambda: mb.plgpu.barrier_wait(lag[0].at[jnp.maximum(wg, 1) - 1]))

    def release_next(step):
      """Lets the next consumer start once this one's step `step` is 0: its
      first products are done, or it has no steps at all."""
      if lag:
        pl.when(jnp.logical_and(wg < consumers - 1, step == 0))(
            lambda: mb.plgpu.barrier_arrive(lag[0].at[wg]))

    def head(h, acc, step):
      tile = dataclasses.replace(plan.kv_tile, loader=mb.capture_loader(b, h, "kv", kv_start, SUB)
                                 ).with_program_loads(cap_refs)
      if plan.analysis.separable_bias:
        bias_rows = mb.separable_rows(tile, b, h, cap_refs, "kv", kv_start, SUB)
      if fold_bias:  # the keys' part of the bias, in log2 units; the queries' joins lse2
        bias_rows2 = bias_rows * LOG2E

      def visit(step, q_block, sub, masked: bool, acc):
        dk, dv = acc
        slot = lax.rem(step, stages)
        q_start = q_block * plan.block_q + sub * SUB
        q_slot, do_slot = q_smem.at[slot], do_smem.at[slot]
        mb.plgpu.barrier_wait(ready.at[slot])  # q, dO and the row terms

        s, dp = mb.products(((k_tile, q_slot), (v_tile, do_slot)), (SUB, SUB))
        release_next(step)
        rows = ()
        if rows_ref is not None:
          rows = [mb.load_ref(rows_smem.at[slot, n], layout=mb.plgpu.Layout.WGMMA.reduce(0))
                  for n in range(plan.num_row_terms)]
          if fold_bias:
            rows[0] = rows[0] - LOG2E * mb.separable_columns(tile, b, h, cap_refs, "kv",
                                                             kv_start, q_start, SUB)
          rows = tuple(lax.broadcast_in_dim(r, (SUB, SUB), (1,)) for r in rows)
        q_idx = mb.tile_indices(q_start, (SUB, SUB), 1)
        keep = plan.tile_keep(tile, masked, b, h, q_idx, kv_idx, cap_refs, q_start, SUB)
        if mask_rows:
          valid = q_idx < plan.seq_q
          keep = valid if keep is None else jnp.logical_and(keep, valid)
        if fold_bias:
          logits2 = s * log2_scale + lax.broadcast_in_dim(bias_rows2, (SUB, SUB), (0,))
          w, ds = softmax_tile_gradients(logits2, dp, rows, keep)
        else:
          scorer = (mb.with_separable_bias(tile, b, h, cap_refs, "kv", kv_start, bias_rows,
                                           q_start, SUB)
                    if plan.analysis.separable_bias else tile)
          w, ds = _gradients(plan, scorer, s, dp, rows, keep, (b, h, q_idx, kv_idx), cap_refs,
                             (q_start, SUB))

        def updates(refs):
          dv_ref, dk_ref = refs
          mb.plgpu.wgmma(dv_ref, w.astype(dtype), do_slot)
          mb.plgpu.wgmma(dk_ref, ds.astype(dtype), q_slot)

        dv, dk = pl.run_state(updates)((mb.plgpu.ACC.init(dv), mb.plgpu.ACC.init(dk)))
        mb.plgpu.barrier_arrive(free.at[slot])
        return dk, dv

      return mb.fold_visits(visits_of(h), visit, acc, step, sub_steps=sub_steps)

    init = (_zeros(SUB, k_ref.shape[-1]), _zeros(SUB, v_ref.shape[-1]))
    (dk, dv), steps = over_heads(head, init)
    release_next(steps)  # a program without steps lets the next consumer go all the same
    k_tile[...] = (dk * plan.scale).astype(dtype)
    v_tile[...] = dv.astype(dtype)
    mb.plgpu.commit_smem()
    mb.plgpu.copy_smem_to_gmem(k_tile, dk_ref.at[kv_rows])
    mb.plgpu.copy_smem_to_gmem(v_tile, dv_ref.at[kv_rows])
    mb.plgpu.wait_smem_to_gmem(0)


def backward(q, k, v, d_out, rows, capture_arrays, block_mask, *, plan: BackwardPlan,
             config: AttentionConfig, interpret: bool):
  """Runs the Mosaic GPU dq and dk/dv kernels on padded inputs; the contract
  of parallel_backward.backward for calls whose captures need no gradient
  (softmax and elementwise rownorms), returning as rows the row terms the dq
  kernel computed (softmax's `[B, H, 2, Sq_pad]` lse2 and delta), or None.
  `rows`: `row_inputs`' (the dq kernel computes the terms), the terms
  themselves (`[B, H, 2, Sq_pad]` float32: no output is read), or None.
  `config.block_q` / `block_k` are the rows a dq / dk-dv program owns (64
  per consumer warpgroup; `dq_program_rows` may widen the dq programs) and the block
  mask's tiles; `config.num_stages` the depth of the 64-row ring."""
  del interpret  # compiled only (mosaic_backend.unavailable)
  if any(kind is not None for kind in plan.grad_kinds):
    raise ValueError("the Mosaic GPU backward does not lower capture gradients")
  batch, seq_q_pad, heads, d_qk = q.shape
  seq_kv_pad, kv_heads, d_v = k.shape[1], k.shape[2], v.shape[-1]
  num_q_blocks, num_kv_blocks = seq_q_pad // plan.block_q, seq_kv_pad // plan.block_k
  item = q.dtype.itemsize
  transforms = mb.smem_transforms()
  smem = lambda shape, dtype: mb.plgpu.SMEM(shape, dtype, transforms=transforms)
  params = mb.compiler_params(plan.fast_math)
  kernel_plan = dataclasses.replace(plan, fast_math=False)  # approximations: compiler_params
  barriers = lambda count, arrivals=1: mb.plgpu.Barrier(num_arrivals=arrivals,
                                                        num_barriers=count)

  rows_per_dq = dq_program_rows(plan.analysis, plan.block_q, seq_q_pad, d_qk, d_v, block_mask)
  dq_blocks = -(-seq_q_pad // rows_per_dq)
  consumers = rows_per_dq // SUB
  step_keys = min(DQ_STEP_KEYS, plan.block_k)
  rows_given = rows is not None and not isinstance(rows, tuple)
  stages, dkv_stages = ring_depths(config, d_qk, d_v, item, rows is not None, rows_given,
                                   rows_per_dq)
  dq_rows, row_outputs, row_scratch = (), [], []
  if rows_given:
    dq_rows = (rows,)
  elif rows is not None:  # softmax: the kernel writes [B, H, 2, Sq_pad] (lse2, delta)
    lse2, out, d_stat = rows
    dq_rows = (lse2, out) + (() if d_stat is None else (d_stat,))
    row_outputs = [jax.ShapeDtypeStruct((batch, heads, 2, seq_q_pad), jnp.float32)]
    row_scratch = [smem((consumers, SUB, d_v), out.dtype),
                   mb.plgpu.SMEM((consumers, 2, SUB), jnp.float32), barriers(consumers)]
  q_lists = () if block_mask is None else block_mask.q_major(num_q_blocks)
  dq, *row_terms = mb.kernel(
      functools.partial(_dq_kernel, plan=kernel_plan, stages=stages,
                        rows_per_program=rows_per_dq, num_q_blocks=dq_blocks,
                        step_keys=step_keys, num_row_refs=len(dq_rows)),
      name="pallas_attn_mosaic_dq",
      out_type=[jax.ShapeDtypeStruct(q.shape, q.dtype), *row_outputs],
      scratch_types=[
          *row_scratch,
          smem((consumers, SUB, d_qk), q.dtype),
          smem((consumers, SUB, d_v), q.dtype),
          smem((stages, step_keys, d_qk), k.dtype),
          smem((stages, step_keys, d_v), v.dtype),
          barriers(consumers), barriers(consumers), barriers(stages, 2),  # K and V arrive
          barriers(stages, consumers), barriers(stages, consumers),
      ],
      grid=(heads, dq_blocks, batch),  # heads fastest, as the forward's
      grid_names=("h", "q", "b"),
      num_threads=consumers + 1,
      thread_name="wg",
      compiler_params=params,
  )(q, k, v, d_out, *dq_rows, *capture_arrays, *q_lists)
  if rows_given:
    row_terms = [rows]

  consumers = plan.block_k // SUB
  stages = dkv_stages
  kv_lists = () if block_mask is None else block_mask.kv_major(num_kv_blocks)
  rows_scratch = [mb.plgpu.SMEM((stages, 2, SUB), jnp.float32)] if row_terms else []
  dk, dv = mb.kernel(
      functools.partial(_dkv_kernel, plan=kernel_plan, stages=stages),
      name="pallas_attn_mosaic_dkv",
      out_type=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      scratch_types=[
          smem((consumers, SUB, d_qk), k.dtype),
          smem((consumers, SUB, d_v), v.dtype),
          smem((stages, SUB, d_qk), q.dtype),
          smem((stages, SUB, d_v), q.dtype),
          *rows_scratch,
          barriers(consumers), barriers(consumers),
          barriers(stages, 3 if row_terms else 2),  # q, dO (and row terms) arrive
          barriers(stages, consumers),
          *([barriers(consumers - 1)] if consumers > 1 else []),  # the staggered starts
      ],
      grid=(kv_heads, num_kv_blocks, batch),  # heads fastest (+2-5% f+b, H200 A/B)
      grid_names=("h", "kv", "b"),
      num_threads=consumers + 1,
      thread_name="wg",
      compiler_params=params,
  )(q, k, v, d_out, *row_terms, *capture_arrays, *kv_lists)
  return dq, dk, dv, (None,) * len(plan.grad_kinds), (row_terms[0] if row_terms else None)


class MosaicBackwardTemplate(MosaicTemplate):
  name = "backward_mosaic"
  block_k_choices = (64, 128)

  def default_config(self, shape, device=None, *, block_sparse=False,
                     scores_per_position=False):
    return lowering_lib.heuristic_mosaic_backward_config(shape.seq_q, shape.seq_kv, shape.d_qk,
                                                         shape.d_v)

  def config_error(self, config):
    return lowering_lib.mosaic_backward_config_error(config)

  def obstacle(self, analysis, dtype, d_qk, d_v, interpret):
    return lowering_lib.mosaic_backward_obstacle(analysis, dtype, d_qk, d_v, interpret)

  def consumer_rows(self, block_q, block_k):
    return max(block_q, block_k)  # the dq programs own block_q rows, the dk/dv ones block_k

  def memory_reason(self, config, d_qk, d_v, itemsize, device):
    dq_depth, dkv_depth = ring_depths(config, d_qk, d_v, itemsize, row_terms=True)
    if config.num_stages > max(dq_depth, dkv_depth):
      return (f"num_stages {config.num_stages}: shared memory holds {dq_depth} (dq) and "
              f"{dkv_depth} (dk/dv) ring slots")
    return None


TEMPLATE = register(MosaicBackwardTemplate())
