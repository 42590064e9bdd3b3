"""The chunked template's backward in one Mosaic GPU kernel (Hopper).

The Triton backward (linear_backward.py) runs the state pass in reverse,
storing the state cotangent dS leaving every chunk, then a parallel gradient
pass reading them back. Here one program per (Dv block, head, batch) walks
the chunks from the last with dS in float32 wgmma registers, reading the
states S the forward stored (the state entering each chunk, in the input
dtype). Per chunk, with g its cumulative base-2 log decays, D_ij = 2^(g_i -
g_j) for i >= j, w = 2^(g_last - g) and r = 2^g (the algebra of
linear_backward.py; the transposed tiles have keys along their rows, as the
attention backward's, so that they are wgmma's register operand):

  P^T  = (K Q^T) * D^T,  dA^T = (V dO^T) * D^T,  dA = (dO V^T) * D
  dv   = scale * P^T dO + w * (K dS)
  dk   = scale * dA^T Q + w * (V dS^T)              (this Dv block's part)
  dq   = scale * (dA K + r * (dO S^T))              (this Dv block's part)
  dS  <- 2^g_last dS + Q^T (scale * r * dO)

A producer warpgroup streams q, k, v, dO, S (and g) by TMA into a ring; one
consumer warpgroup issues the products. dq and dk are sums over the Dv
blocks: each program writes its part, the wrapper adds them (as the Triton
pass does).

With a gate per key feature ("vector") the chunk's q and k slots take the
forward's anchored factors, Q~ = Q 2^(g - g_m) and K~ = K 2^(g_m - g) (m
the chunk's middle row), and every term is written with them and row or
column factors: P^T = K~ Q~^T, dA = dO V^T (no decay of its own), dS enters
as 2^(g_last - g_m) dS, dk = 2^(g_m - g) (V dS'^T + dA^T Q~), dq = 2^(g -
g_m) (scale 2^g_m (dO S^T) + dA K~), dS <- 2^g_m (dS' + Q~^T scale dO); dk
and dq go FEATURE_SLICE columns at a time (the gates scale them
elementwise) and straight to device memory (the rings leave no shared
memory to stage them).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_attn.kernels import mosaic_backend as mb
from pallas_attn.kernels.linear.mosaic_forward import (ANCHOR, BLOCK_V, CHUNK,
                                                     carry_through_chunks, stream_chunks)

FEATURE_SLICE = 64  # Dk columns per step of the vector kind's elementwise scaling
_CONSUMER_REGISTERS = 232


def _kernel(q_ref, k_ref, v_ref, do_ref, states_ref, *refs, decay_kind: str, stages: int,
            num_chunks: int, scale: float):
  decay, vector = decay_kind != "none", decay_kind == "vector"
  refs = list(refs)
  g_ref = refs.pop(0) if decay else None
  (d_final_ref, dq_ref, dk_ref, dv_ref, d_initial_ref, q_smem, k_smem, v_smem, do_smem,
   s_smem, *refs) = refs
  g_smem = refs.pop(0) if decay else None
  f32_stage = None if vector else refs.pop(-3)  # vector: no room; parts go straight out
  ds_smem, scaled_do_smem, dv_stage, ready, free = refs
  dtype = q_ref.dtype
  block = lax.axis_index("v")
  columns = pl.ds(block * BLOCK_V, BLOCK_V)
  b, h, wg = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("wg")
  chunk_of = lambda i: num_chunks - 1 - i  # the walk goes from the last chunk

  def sources(c):
    rows = pl.ds(c * CHUNK, CHUNK)
    chunk = [(q_ref.at[b, rows, h], q_smem), (k_ref.at[b, rows, h], k_smem),
             (v_ref.at[b, rows, h, columns], v_smem), (do_ref.at[b, rows, h, columns], do_smem),
             (states_ref.at[b, h, c, :, columns], s_smem)]
    if decay:
      chunk.append((g_ref.at[b, rows, h] if vector else g_ref.at[b, h, rows], g_smem))
    return chunk

  pl.when(wg == 1)(functools.partial(stream_chunks, num_chunks, stages, sources, ready, free,
                                     reverse=True))

  @pl.when(wg == 0)
  def _consumer():
    mb.plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")
    tile_layout = mb.plgpu.Layout.WGMMA
    row_layout, column_layout = tile_layout.reduce(1), tile_layout.reduce(0)
    shape = (CHUNK, CHUNK)
    rows_of = lambda x, like: lax.broadcast_in_dim(x, like.shape, (0,))
    columns_of = lambda x, like: lax.broadcast_in_dim(x, like.shape, (1,))

    def stage_f32(value, destination):
      """Writes a float32 [C, Dk] part through shared memory by TMA, once the
      previous use of the staging buffer has been read out."""
      mb.plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      f32_stage[...] = value
      mb.plgpu.commit_smem()
      mb.plgpu.copy_smem_to_gmem(f32_stage, destination)

    def step(i, ds_ref):
      c, slot = chunk_of(i), lax.rem(i, stages)
      rows = pl.ds(c * CHUNK, CHUNK)
      q_t, k_t, v_t, do_t, state_t = (q_smem.at[slot], k_smem.at[slot], v_smem.at[slot],
                                      do_smem.at[slot], s_smem.at[slot])
      width = q_t.shape[-1]
      mb.plgpu.barrier_wait(ready.at[slot])
      key_rows = mb.tile_indices(0, shape, 0)
      query_columns = mb.tile_indices(0, shape, 1)
      causal_t = key_rows <= query_columns  # [key j, query i]: i >= j
      causal = key_rows >= query_columns    # [query i, key j]
      g_at = lambda row, layout, cols=slice(None): mb.load_ref(
          g_smem.at[slot, row, cols], layout=layout, optimized=False)
      if vector:  # Q~ = Q 2^(g - g_m), K~ = K 2^(g_m - g) over the slot's q and k
        for first in range(0, width, FEATURE_SLICE):
          cols = pl.ds(first, FEATURE_SLICE)
          g = mb.load_ref(g_smem.at[slot, :, cols], layout=tile_layout, optimized=False)
          g_anchor = columns_of(g_at(ANCHOR, column_layout, cols), g)
          for tile, sign in ((q_t, 1.0), (k_t, -1.0)):
            x = mb.load_ref(tile.at[:, cols], layout=tile_layout).astype(jnp.float32)
            tile.at[:, cols][...] = (x * jnp.exp2(sign * (g - g_anchor))).astype(dtype)
        # dS enters the products as 2^(g_last - g_m) dS (dv's K~ dS, dk's V dS^T)
        g_anchor_rows, g_last_rows = g_at(ANCHOR, row_layout), g_at(CHUNK - 1, row_layout)
        d_state = ds_ref[...] * rows_of(jnp.exp2(g_last_rows - g_anchor_rows), ds_ref)
      else:
        d_state = ds_ref[...]
      ds_smem[...] = d_state.astype(dtype)
      mb.plgpu.commit_smem()
      if decay and not vector:
        # Two loads told apart (optimized=False): merged into one by CSE, one
        # value would need both layouts and JAX 0.11's layout inference fails.
        g_rows = mb.load_ref(g_smem.at[slot], layout=row_layout)
        g_columns = mb.load_ref(g_smem.at[slot], layout=column_layout, optimized=False)
        g_last = g_smem[slot, CHUNK - 1]
        # [j, i] tiles: 2^(g_i - g_j); [i, j] tiles take its transpose's formula
        gap_t = (lax.broadcast_in_dim(-g_rows, shape, (0,))
                 + lax.broadcast_in_dim(g_columns, shape, (1,)))
        decay_t = jnp.exp2(jnp.where(causal_t, gap_t, 0.0))
        to_end = jnp.exp2(g_last - g_rows)   # w, along rows
        from_start = jnp.exp2(g_rows)        # r, along rows

      # P^T and dA^T: keys along the rows, for dv and dk.
      scores_t, dp_t = mb.products(((k_t, q_t), (v_t, do_t)), shape)
      if decay and not vector:
        scores_t, dp_t = scores_t * decay_t, dp_t * decay_t
      p_t = (jnp.where(causal_t, scores_t, 0.0) * scale).astype(dtype)
      da_t = (jnp.where(causal_t, dp_t, 0.0) * scale).astype(dtype)

      def dv_part(acc_ref):
        mb.plgpu.wgmma(acc_ref, k_t, ds_smem)
        if decay and not vector:
          acc_ref[...] = acc_ref[...] * rows_of(to_end, acc_ref)
        mb.plgpu.wgmma(acc_ref, p_t, do_t)
        return acc_ref[...]

      dv = pl.run_scoped(dv_part, mb.plgpu.ACC((CHUNK, BLOCK_V), jnp.float32))
      # The last chunk's dv has left dv_stage (its dk and dq parts may still be going).
      mb.plgpu.wait_smem_to_gmem(0 if vector else 2, wait_read_only=True)
      dv_stage[...] = dv.astype(dv_stage.dtype)
      mb.plgpu.commit_smem()
      mb.plgpu.copy_smem_to_gmem(dv_stage, dv_ref.at[b, rows, h, columns])

      # dA, queries along the rows, for dq.
      (dp,) = mb.products(((do_t, v_t),), shape)
      if decay and not vector:
        dp = dp * jnp.exp2(jnp.where(causal, -gap_t, 0.0))
      da = (jnp.where(causal, dp, 0.0) * scale).astype(dtype)

      if vector:  # per FEATURE_SLICE columns: the gates scale them elementwise
        for first in range(0, width, FEATURE_SLICE):
          cols = pl.ds(first, FEATURE_SLICE)
          part = (CHUNK, FEATURE_SLICE)

          def dk_slice(acc_ref):  # 2^(g_m - g) (V (2^(g_last - g_m) dS)^T + dA^T Q~)
            mb.plgpu.wgmma(acc_ref, v_t, ds_smem.at[cols].T)
            mb.plgpu.wgmma(acc_ref, da_t, q_t.at[:, cols])
            return acc_ref[...]

          def dq_slice(acc_ref):  # 2^(g - g_m) (scale 2^g_m (dO S^T) + dA K~)
            mb.plgpu.wgmma(acc_ref, do_t, state_t.at[cols].T)
            g_anchor = g_at(ANCHOR, column_layout, cols)
            acc_ref[...] = acc_ref[...] * columns_of(scale * jnp.exp2(g_anchor), acc_ref)
            mb.plgpu.wgmma(acc_ref, da, k_t.at[:, cols])
            return acc_ref[...]

          dk = pl.run_scoped(dk_slice, mb.plgpu.ACC(part, jnp.float32))
          dq = pl.run_scoped(dq_slice, mb.plgpu.ACC(part, jnp.float32))
          g = mb.load_ref(g_smem.at[slot, :, cols], layout=tile_layout, optimized=False)
          gap = g - columns_of(g_at(ANCHOR, column_layout, cols), g)
          dk_ref.at[block, b, rows, h, cols][...] = dk * jnp.exp2(-gap)
          dq_ref.at[block, b, rows, h, cols][...] = dq * jnp.exp2(gap)
      else:
        def dk_part(acc_ref):  # scale dA^T Q + w (V dS^T)
          mb.plgpu.wgmma(acc_ref, v_t, ds_smem.T)
          if decay:
            acc_ref[...] = acc_ref[...] * rows_of(to_end, acc_ref)
          mb.plgpu.wgmma(acc_ref, da_t, q_t)
          return acc_ref[...]

        def dq_part(acc_ref):  # scale (dA K + r (dO S^T))
          mb.plgpu.wgmma(acc_ref, do_t, state_t.T)
          factor = scale * from_start if decay else jnp.float32(scale)
          acc_ref[...] = acc_ref[...] * (rows_of(factor, acc_ref) if decay else factor)
          mb.plgpu.wgmma(acc_ref, da, k_t)
          return acc_ref[...]

        stage_f32(pl.run_scoped(dk_part, mb.plgpu.ACC((CHUNK, width), jnp.float32)),
                  dk_ref.at[block, b, rows, h])
        stage_f32(pl.run_scoped(dq_part, mb.plgpu.ACC((CHUNK, width), jnp.float32)),
                  dq_ref.at[block, b, rows, h])

      # dS for the chunk before: 2^g_last dS + (Q 2^g)^T (scale dO).
      d_out = mb.load_ref(do_t, layout=tile_layout).astype(jnp.float32)
      factor = scale * from_start if decay and not vector else jnp.float32(scale)
      scaled_do_smem[...] = (d_out * (rows_of(factor, d_out) if factor.ndim else factor)
                             ).astype(dtype)
      mb.plgpu.commit_smem()
      if vector:  # Q 2^g = Q~ 2^g_m: 2^g_m (2^(g_last - g_m) dS + Q~^T (scale dO))
        ds_ref[...] = d_state
        mb.plgpu.wgmma(ds_ref, q_t.T, scaled_do_smem)
        ds_ref[...] = ds_ref[...] * rows_of(jnp.exp2(g_anchor_rows), ds_ref)
      else:
        if decay:
          ds_ref[...] = ds_ref[...] * jnp.exp2(g_last)
        mb.plgpu.wgmma(ds_ref, q_t.T, scaled_do_smem)
        ds_ref[...] = ds_ref[...]  # waits for the product before the slot is freed
      mb.plgpu.barrier_arrive(free.at[slot])
      return None

    carry_through_chunks(d_final_ref, d_initial_ref, (b, h, slice(None), columns), num_chunks,
                         lambda ds_ref: None, step)


def backward(q, k, v, log_decay_cum, chunk_states, d_out, d_final, *, decay_kind: str,
             scale: float, stages: int = 2):
  """dq, dk (float32), dv and d(initial state): the contract of
  linear_backward.chunked_backward, for the states either forward stored.
  The vector kind's factors assume `mosaic_forward.gates_in_range`."""
  batch, seq_len, heads, d_feature = q.shape
  d_v = v.shape[-1]
  num_chunks, num_blocks_v = seq_len // CHUNK, d_v // BLOCK_V
  d_out = d_out.astype(q.dtype)
  transforms = mb.smem_transforms()
  smem = lambda shape, dtype: mb.plgpu.SMEM(shape, dtype, transforms=transforms)
  decays = ()
  if decay_kind == "scalar":
    decays = (jnp.swapaxes(log_decay_cum, 1, 2),)  # [B, H, S]: TMA rows
  elif decay_kind == "vector":
    decays = (log_decay_cum,)

  def scratch_for(stages):
    scratch = [smem((stages, CHUNK, d_feature), q.dtype),
               smem((stages, CHUNK, d_feature), k.dtype),
               smem((stages, CHUNK, BLOCK_V), v.dtype),
               smem((stages, CHUNK, BLOCK_V), q.dtype),
               smem((stages, d_feature, BLOCK_V), chunk_states.dtype)]
    if decay_kind == "scalar":
      scratch.append(mb.plgpu.SMEM((stages, CHUNK), jnp.float32))
    elif decay_kind == "vector":
      scratch.append(mb.plgpu.SMEM((stages, CHUNK, d_feature), jnp.float32))
    scratch += [smem((d_feature, BLOCK_V), q.dtype),          # dS leaving the chunk
                smem((CHUNK, BLOCK_V), q.dtype),              # scale (* r) * dO
                smem((CHUNK, BLOCK_V), v.dtype)]              # dv's staging
    if decay_kind != "vector":  # the vector kind's rings leave no room for it
      scratch.append(mb.plgpu.SMEM((CHUNK, d_feature), jnp.float32))  # dk's and dq's staging
    return scratch + [mb.plgpu.Barrier(num_arrivals=5 + len(decays), num_barriers=stages),
                      mb.plgpu.Barrier(num_arrivals=1, num_barriers=stages)]

  stages = mb.deepest_ring(scratch_for, min(stages, num_chunks))
  scratch = scratch_for(stages)
  part = jax.ShapeDtypeStruct((num_blocks_v, batch, seq_len, heads, d_feature), jnp.float32)
  kernel = mb.kernel(
      functools.partial(_kernel, decay_kind=decay_kind, stages=stages, num_chunks=num_chunks,
                        scale=scale),
      name="linear_attention_mosaic_bwd",
      out_type=[part, part, jax.ShapeDtypeStruct(v.shape, v.dtype),
                jax.ShapeDtypeStruct(d_final.shape, jnp.float32)],
      scratch_types=scratch,
      grid=(num_blocks_v, heads, batch),
      grid_names=("v", "h", "b"),
      num_threads=2,
      thread_name="wg",
      compiler_params=mb.compiler_params(False),
  )
  dq, dk, dv, d_initial = kernel(q, k, v, d_out, chunk_states, *decays,
                                 d_final.astype(jnp.float32))
  return dq.sum(0), dk.sum(0), dv, d_initial
