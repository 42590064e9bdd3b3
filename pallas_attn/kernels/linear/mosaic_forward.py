"""The chunked template's forward in one Mosaic GPU kernel (Hopper).

The Triton lowering (chunked_forward.py) runs two passes: a sequential state
pass that stores the state entering every chunk, then a parallel output pass
that reads them back. Here one program per (Dv block, head, batch) walks the
chunks in order with its [Dk, block_v] state in float32 wgmma registers, so
the states go to device memory only when the backward keeps them (B H S/C Dk
Dv of them: at B4 H16 S4096 d128, 134 MB in bf16, 2.7x q, k and v together).
Per chunk, with g the chunk's cumulative base-2 log decays and S the state
entering it (the algebra of chunked_forward.py):

  o  = scale * (2^g * (Q S) + ((Q K^T) * D) V),   D_ij = 2^(g_i - g_j), i >= j
  S <- 2^g_last * S + K^T (2^(g_last - g) * V)

A producer warpgroup streams the q, k, v (and g) chunks by TMA into a ring
of `stages` slots. One consumer warpgroup issues Q K^T and Q S together,
weighs the scores, then P V (P from registers) and K^T V' (K^T read
transposed from shared memory) on the tensor cores. Q S reads the state in
the input dtype from shared memory, as the Triton output pass reads its
stored states; the carried state stays float32.

With a gate per key feature ("vector", GLA) the decay sits inside the Dk
contraction, so the operands carry it: Q 2^g for Q S, K 2^(g_last - g) for
the update (both factors <= 1), and for the scores Q 2^(g - g_m) K^T
2^(g_m - g) around the chunk's middle row m, two factors up to 2^span each,
the chunk's decay from its first row to m or from m to its last
(`anchored_operands`: one elementwise XLA pass before the kernel, which
streams the four and each chunk's g_last, so that no scaling sits on the
consumer's path and the float32 gates take no shared memory).
`gates_in_range` checks the spans of a call against SPAN_LIMIT at run time;
beyond it the Triton passes run (their row blocks keep every factor <= 1).

Scope (`obstacle` says what falls back to Triton): 16-bit inputs and
outputs (bfloat16 for per-feature gates: float16 overflows at 2^16, and its
first run here gave NaNs), 64-token chunks, Dk' 64 or 128, Dv' a multiple
of 64, and enough programs to fill the GPU (each walks its sequence alone,
so with few of them the Triton passes' parallel output pass keeps more SMs
busy). The delta rule's forward (delta_rule.delta_rule_forward_mosaic)
passes its W as `pseudo_keys` and its U~ as v: each chunk's values are then
U~ - W S, one more product from the state the kernel holds.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_attn.kernels import mosaic_backend as mb

CHUNK = 64        # tokens per chunk: the M of one warpgroup's wgmma
BLOCK_V = 64      # Dv columns per program: 128 rows of the float32 state in 64 registers
FEATURE_WIDTHS = (64, 128)
ANCHOR = CHUNK // 2 - 1  # the vector kind's split row: two factors of half the chunk's span
SPAN_LIMIT = 64.0  # base 2: factors up to 2^64 leave bfloat16 q and k room to 2^127
_PRODUCER_REGISTERS = 40
_CONSUMER_REGISTERS = 232


def obstacle(*, decay_kind: str, dtype, out_dtype, d_feature: int, d_values: int,
             chunk_size: int) -> str | None:
  """Why this kernel cannot run a call, or None (sizes padded as the
  kernels see them)."""
  reason = mb.unavailable()
  if reason:
    return reason
  if jnp.dtype(dtype).itemsize != 2:
    return f"{jnp.dtype(dtype).name} inputs (the kernel takes 16-bit ones)"
  if decay_kind == "vector" and jnp.dtype(dtype) != jnp.bfloat16:
    return (f"{jnp.dtype(dtype).name} inputs with a gate per key feature: the anchored "
            f"factors (up to 2^{SPAN_LIMIT:.0f}) need bfloat16's exponent range")
  if jnp.dtype(out_dtype).itemsize != 2:
    return "normalize's float32 output (the kernel writes 16-bit ones)"
  if chunk_size != CHUNK:
    return f"chunk_size {chunk_size} (the kernel takes {CHUNK})"
  if d_feature not in FEATURE_WIDTHS:
    return f"padded Dk {d_feature} (the kernel takes {' or '.join(map(str, FEATURE_WIDTHS))})"
  if d_values % BLOCK_V:
    return f"padded Dv {d_values} (the kernel takes multiples of {BLOCK_V})"
  return None


def gates_in_range(log_decay_cum) -> jax.Array:
  """Whether every chunk's per-feature decay from its first row to ANCHOR and
  from ANCHOR to its last spans at most SPAN_LIMIT (base 2): a traced bool
  over the vector kind's cumulative log decays [B, S, H, Dk]."""
  batch, seq_len, heads, width = log_decay_cum.shape
  g = log_decay_cum.reshape(batch, seq_len // CHUNK, CHUNK, heads, width)
  span = jnp.maximum(g[:, :, 0] - g[:, :, ANCHOR], g[:, :, ANCHOR] - g[:, :, -1])
  return jnp.max(span) <= SPAN_LIMIT


def anchored_operands(q, k, log_decay_cum, *, ut_keys: bool = False):
  """The vector kind's operands: (Q 2^g, K 2^(g_last - g), Q 2^(g - g_m),
  K 2^(g_m - g)), each [B, S, H, Dk] in q's dtype, and g_last [B, H, S / C,
  Dk] float32, for g each chunk's cumulative log decays (base 2), g_m its
  row ANCHOR's and g_last its last row's; with `ut_keys` also the delta
  rule's K 2^(g - g_m) and K 2^g (`delta_rule.ut_transform`), from the same
  pass. Products in float32, as the Triton passes form them."""
  batch, seq_len, heads, width = q.shape
  chunks = (batch, seq_len // CHUNK, CHUNK, heads, width)
  g = log_decay_cum.reshape(chunks)
  anchor, last = g[:, :, ANCHOR:ANCHOR + 1], g[:, :, CHUNK - 1:]
  q32, k32 = (x.reshape(chunks).astype(jnp.float32) for x in (q, k))
  from_start, from_anchor = jnp.exp2(g), jnp.exp2(g - anchor)  # Q's and the UT keys'
  scaled = [q32 * from_start, k32 * jnp.exp2(last - g), q32 * from_anchor,
            k32 * jnp.exp2(anchor - g)]
  ut = [k32 * from_anchor, k32 * from_start] if ut_keys else []
  return ([x.astype(q.dtype).reshape(q.shape) for x in scaled]
          + [jnp.transpose(last[:, :, 0], (0, 2, 1, 3))]
          + [x.astype(k.dtype).reshape(k.shape) for x in ut])


def unless_gates_out_of_range(decay_kind: str, log_decay_cum, mosaic, fallback):
  """`mosaic()`, or for per-feature gates a run-time choice: `mosaic()` where
  `gates_in_range` holds, else `fallback()` (the Triton passes)."""
  if decay_kind != "vector":
    return mosaic()
  return lax.cond(gates_in_range(log_decay_cum), mosaic, fallback)


def too_few_programs(num_programs: int, sm_count: int | None) -> str | None:
  """Why the Triton passes are the better default for a grid of
  `num_programs` (B * H * Dv' / BLOCK_V), or None: each program walks its
  sequence alone, while the Triton output pass spreads the chunks over
  every SM. On an H100 at S 4096 (d 128): 32 programs ran 0.131 ms against
  Triton's 0.108, 64 ran 0.129 against 0.142, 80 (Mamba2's 80 heads, Dv
  64) 0.131 against 0.214."""
  if sm_count and num_programs * 3 < sm_count:
    return (f"{num_programs} programs (B * H * Dv / {BLOCK_V}) for {sm_count} SMs: the Triton "
            "passes spread the chunks over more")
  return None


def stream_chunks(num_chunks: int, stages: int, sources, ready, free, *,
                  reverse: bool = False):
  """The producer warpgroup's walk: per chunk c (from the last with `reverse`), TMA copies
  of `sources(c)`, [(device memory ref, shared memory ring)], into slot
  `step % stages` of each ring, all arriving on `ready`; the first waits
  for the consumer to `free` the slot (mosaic_backend.refill)."""
  mb.plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")

  def load(step, carry):
    c = num_chunks - 1 - step if reverse else step
    mb.refill(step, stages, [(source, ring, ready, free if n == 0 else None)
                             for n, (source, ring) in enumerate(sources(c))])
    return carry

  lax.fori_loop(0, num_chunks, load, None)


def carry_through_chunks(start_ref, end_ref, at, num_chunks: int, first, step):
  """A consumer's walk: a [Dk, BLOCK_V] float32 state (or cotangent) read
  from `start_ref.at[at]` into wgmma registers (an accumulator ref), handed
  to `first(ref)`, then to `step(i, ref)` for each chunk, and written to
  `end_ref.at[at]` once every store by TMA has left."""
  def walk(ref):
    ref[...] = mb.load_ref(start_ref.at[at], layout=mb.plgpu.Layout.WGMMA, optimized=False)
    first(ref)
    lax.fori_loop(0, num_chunks, lambda i, carry: step(i, ref), None)
    return ref[...]

  end_ref.at[at][...] = pl.run_scoped(
      walk, mb.plgpu.ACC((start_ref.shape[2], BLOCK_V), jnp.float32))
  mb.plgpu.wait_smem_to_gmem(0)


def _kernel(q_ref, k_ref, v_ref, *refs, decay_kind: str, stages: int, num_chunks: int,
            scale: float, store_states: bool, delta: bool):
  """Vector kind: q_ref and k_ref hold Q 2^g and K 2^(g_last - g), the refs
  after v (and W) the scores' Q 2^(g - g_m) and K 2^(g_m - g), then g_last
  (`anchored_operands`); scalar: g [B, H, S]."""
  decay, vector = decay_kind != "none", decay_kind == "vector"
  refs = list(refs)
  w_ref = refs.pop(0) if delta else None  # the delta rule's W; v_ref holds its U~
  score_refs = [refs.pop(0) for _ in range(2 if vector else 0)]
  g_ref = refs.pop(0) if decay else None
  initial_ref, out_ref, final_ref = refs[:3]
  del refs[:3]
  states_ref = refs.pop(0) if store_states else None
  q_smem, k_smem, v_smem = refs[:3]
  del refs[:3]
  w_smem = refs.pop(0) if delta else None
  score_smem = [refs.pop(0) for _ in range(2 if vector else 0)]
  g_smem = refs.pop(0) if decay else None
  values_smem = refs.pop(0) if decay and not vector else None  # 2^(g_last - g) V
  state_smem, o_smem, ready, free = refs
  dtype = q_ref.dtype
  columns = pl.ds(lax.axis_index("v") * BLOCK_V, BLOCK_V)
  b, h, wg = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("wg")

  def sources(c):
    rows = pl.ds(c * CHUNK, CHUNK)
    chunk = [(q_ref.at[b, rows, h], q_smem), (k_ref.at[b, rows, h], k_smem),
             (v_ref.at[b, rows, h, columns], v_smem)]
    if delta:
      chunk.append((w_ref.at[b, rows, h], w_smem))
    chunk += [(ref.at[b, rows, h], ring) for ref, ring in zip(score_refs, score_smem)]
    if decay:
      chunk.append((g_ref.at[b, h, c] if vector else g_ref.at[b, h, rows], g_smem))
    return chunk

  pl.when(wg == 1)(functools.partial(stream_chunks, num_chunks, stages, sources, ready, free))

  @pl.when(wg == 0)
  def _consumer():
    mb.plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")
    tile_layout = mb.plgpu.Layout.WGMMA
    row_layout, column_layout = tile_layout.reduce(1), tile_layout.reduce(0)
    # TMA groups in flight that a wait may leave: with stored states, the
    # state store issued after the output store being waited for.
    later_stores = 1 if store_states else 0

    def publish(c, state):
      """Makes `state` (entering chunk c, in the input dtype) the operand of
      chunk c's Q S and, for the backward, stores it."""
      if store_states:  # the previous state's store has left state_smem
        mb.plgpu.wait_smem_to_gmem(later_stores, wait_read_only=True)
      state_smem[...] = state
      mb.plgpu.commit_smem()
      if store_states:
        mb.plgpu.copy_smem_to_gmem(state_smem, states_ref.at[b, h, c, :, columns])

    def step(c, state_ref):
      slot = lax.rem(c, stages)
      rows = pl.ds(c * CHUNK, CHUNK)
      q_tile, k_tile, v_tile = q_smem.at[slot], k_smem.at[slot], v_smem.at[slot]
      mb.plgpu.barrier_wait(ready.at[slot])
      if delta:  # the chunk's values U = U~ - W S, over U~ in the slot
        def pseudo_values(acc_ref):
          mb.plgpu.wgmma(acc_ref, w_smem.at[slot], state_smem)
          return acc_ref[...]

        correction = pl.run_scoped(pseudo_values, mb.plgpu.ACC((CHUNK, BLOCK_V), jnp.float32))
        u = mb.load_ref(v_tile, layout=tile_layout).astype(jnp.float32) - correction
        v_tile[...] = u.astype(dtype)
        mb.plgpu.commit_smem()

      def chunk(s_ref, o_ref):
        score_q, score_k = ([ring.at[slot] for ring in score_smem] if vector
                            else (q_tile, k_tile))
        mb.plgpu.wgmma(s_ref, score_q, score_k.T)
        mb.plgpu.wgmma(o_ref, q_tile, state_smem)
        values = v_tile
        if decay and not vector:  # 2^(g_last - g) V for the state, while Q K^T and Q S run
          g_rows = mb.load_ref(g_smem.at[slot], layout=row_layout)
          g_last = g_smem[slot, CHUNK - 1]
          to_end = lax.broadcast_in_dim(jnp.exp2(g_last - g_rows), (CHUNK, BLOCK_V), (0,))
          v = mb.load_ref(v_tile, layout=tile_layout).astype(jnp.float32)
          values_smem[...] = (v * to_end).astype(dtype)
          mb.plgpu.commit_smem()
          values = values_smem
        s = s_ref[...]
        shape = (CHUNK, CHUNK)
        causal = mb.tile_indices(0, shape, 0) >= mb.tile_indices(0, shape, 1)
        if vector:  # the state decays per Dk row
          g_last = mb.load_ref(g_smem.at[slot], layout=row_layout, optimized=False)
          state_ref[...] = state_ref[...] * lax.broadcast_in_dim(
              jnp.exp2(g_last), state_ref.shape, (0,))
        elif decay:
          g_columns = mb.load_ref(g_smem.at[slot], layout=column_layout)
          gap = (lax.broadcast_in_dim(g_rows, shape, (0,))
                 - lax.broadcast_in_dim(g_columns, shape, (1,)))
          s = s * jnp.exp2(jnp.where(causal, gap, 0.0))
          o_ref[...] = o_ref[...] * lax.broadcast_in_dim(jnp.exp2(g_rows), (CHUNK, BLOCK_V),
                                                         (0,))
          state_ref[...] = state_ref[...] * jnp.exp2(g_last)
        weights = jnp.where(causal, s, 0.0).astype(dtype)
        # P V, then the state's update behind it; the output waits for the first.
        mb.plgpu.wgmma(o_ref, weights, v_tile)
        mb.plgpu.wgmma(state_ref, k_tile.T, values)
        return mb.plgpu.wgmma_accumulator_load(o_ref, wait_n=1)

      out = pl.run_scoped(chunk, mb.plgpu.ACC((CHUNK, CHUNK), jnp.float32),
                          mb.plgpu.ACC((CHUNK, BLOCK_V), jnp.float32))
      mb.plgpu.wait_smem_to_gmem(later_stores, wait_read_only=True)  # o_smem is free
      o_smem[...] = (out * scale).astype(o_smem.dtype)
      mb.plgpu.commit_smem()
      mb.plgpu.copy_smem_to_gmem(o_smem, out_ref.at[b, rows, h, columns])
      state = state_ref[...].astype(dtype)
      mb.plgpu.barrier_arrive(free.at[slot])

      @pl.when(c + 1 < num_chunks)
      def _():
        publish(c + 1, state)

      return None

    carry_through_chunks(initial_ref, final_ref, (b, h, slice(None), columns), num_chunks,
                         lambda state_ref: publish(0, state_ref[...].astype(dtype)), step)


def forward(q, k, v, log_decay_cum, initial_state, *, decay_kind: str, scale: float,
            store_states: bool, stages: int = 2, pseudo_keys=None,
            vector_operands=None):
  """o [B, S, H, Dv] in q's dtype, the final state [B, H, Dk, Dv] float32
  and, with `store_states`, the state entering each chunk [B, H, S / C, Dk,
  Dv] in q's dtype (the backward's residual, as chunked_forward returns it;
  else None). Inputs as chunked_forward's, padded: S a multiple of CHUNK;
  log_decay_cum None, [B, S, H] or [B, S, H, Dk] float32 (decay kinds
  "none", "scalar", "vector"; `chunk_cumulative_log_decay`). The vector
  kind's factors assume `gates_in_range`. With `pseudo_keys` (the delta
  rule's W [B, S, H, Dk] of 64-token chunks, delta_rule.ut_transform) v is
  its U~, and each chunk's values are U~ - W S. vector_operands: the
  vector kind's `anchored_operands`, where the caller formed them."""
  batch, seq_len, heads, d_feature = q.shape
  d_v = v.shape[-1]
  num_chunks = seq_len // CHUNK
  delta = pseudo_keys is not None
  streamed = ()  # beyond q, k, v (and W): the vector kind's score operands, then g
  if decay_kind == "scalar":
    streamed = (jnp.swapaxes(log_decay_cum, 1, 2),)  # [B, H, S]: TMA rows
  elif decay_kind == "vector":
    q, k, *streamed = vector_operands or anchored_operands(q, k, log_decay_cum)
  transforms = mb.smem_transforms()
  smem = lambda shape, dtype: mb.plgpu.SMEM(shape, dtype, transforms=transforms)

  def scratch_for(stages):
    scratch = [smem((stages, CHUNK, d_feature), q.dtype),
               smem((stages, CHUNK, d_feature), k.dtype),
               smem((stages, CHUNK, BLOCK_V), v.dtype)]
    if delta:
      scratch.append(smem((stages, CHUNK, d_feature), pseudo_keys.dtype))
    if decay_kind == "scalar":
      scratch += [mb.plgpu.SMEM((stages, CHUNK), jnp.float32),
                  smem((CHUNK, BLOCK_V), v.dtype)]          # 2^(g_last - g) V
    elif decay_kind == "vector":
      scratch += [smem((stages, CHUNK, d_feature), q.dtype),  # Q 2^(g - g_m)
                  smem((stages, CHUNK, d_feature), k.dtype),  # K 2^(g_m - g)
                  mb.plgpu.SMEM((stages, d_feature), jnp.float32)]  # g_last
    return scratch + [smem((d_feature, BLOCK_V), q.dtype),  # the state entering the chunk
                      smem((CHUNK, BLOCK_V), q.dtype),      # the output chunk
                      mb.plgpu.Barrier(num_arrivals=3 + delta + len(streamed),
                                       num_barriers=stages),
                      mb.plgpu.Barrier(num_arrivals=1, num_barriers=stages)]

  stages = mb.deepest_ring(scratch_for, min(stages, num_chunks))
  scratch = scratch_for(stages)
  out_type = [jax.ShapeDtypeStruct((batch, seq_len, heads, d_v), q.dtype),
              jax.ShapeDtypeStruct((batch, heads, d_feature, d_v), jnp.float32)]
  if store_states:
    out_type.append(jax.ShapeDtypeStruct((batch, heads, num_chunks, d_feature, d_v), q.dtype))
  kernel = mb.kernel(
      functools.partial(_kernel, decay_kind=decay_kind, stages=stages,
                        num_chunks=num_chunks, scale=scale, store_states=store_states,
                        delta=delta),
      name="linear_attention_mosaic_fwd",
      out_type=out_type,
      scratch_types=scratch,
      # Dv blocks fastest: programs running together read the same q and k chunks.
      grid=(d_v // BLOCK_V, heads, batch),
      grid_names=("v", "h", "b"),
      num_threads=2,
      thread_name="wg",
      compiler_params=mb.compiler_params(False),
  )
  outputs = kernel(q, k, v, *((pseudo_keys,) if delta else ()), *streamed,
                   initial_state.astype(jnp.float32))
  o, final_state = outputs[:2]
  return o, final_state, (outputs[2] if store_states else None)
