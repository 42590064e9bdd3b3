"""V for the fp8 forward's PV product: `[B, S, H, D]` e4m3 in, `[B, H, D, S]`
out with each 64-key group's keys in the order the forward stores its
weights (mosaic_backend.fp8_weight_key_order, `reference` here).

8-bit wgmma takes V K-major, so the fp8 forward reads it transposed, and its
weight tiles go to shared memory in 16-byte rows whose keys are permuted
within each 64-key group (mosaic_backend.store_fp8_weights). This Triton
kernel moves a `[block_keys, D]` tile per program, permuting and
transposing it on chip: 0.020 ms for the 33.5 MB of V of a B4 S4096 H16 d128
call on an H200 (3.4 TB/s read and written; 64- to 256-key tiles on 2 to 8
warps within 1 us of it), where XLA's transpose with the permutation took 0.024.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_attn.kernels import backend
from pallas_attn.kernels.mosaic_backend import FP8_KEY_GROUP, fp8_weight_key_order

BLOCK_KEYS = 256


def reference(v):
  """The layout in plain JAX: transposed, then permuted per key group."""
  return fp8_weight_key_order(jnp.transpose(v, (0, 2, 3, 1)))


def _kernel(v_ref, out_ref):
  tile = v_ref[...]  # [block_keys, D]
  keys, d = tile.shape
  # A group's key 8 m + 2 t + e goes to position 16 t + 2 m + e.
  grouped = tile.reshape(keys // FP8_KEY_GROUP, 8, 4, 2, d)
  out_ref[...] = jnp.transpose(grouped, (0, 2, 1, 3, 4)).reshape(keys, d).T


def transposed_values(v, *, interpret: bool):
  """`reference(v)` for `[B, S, H, D]` values, S a multiple of FP8_KEY_GROUP."""
  batch, seq, heads, d = v.shape
  if seq % FP8_KEY_GROUP:
    raise ValueError(f"the fp8 forward's values need a multiple of {FP8_KEY_GROUP} keys; "
                     f"got {seq}")
  block = BLOCK_KEYS if seq % BLOCK_KEYS == 0 else FP8_KEY_GROUP
  return backend.pallas_call(
      _kernel,
      out_shape=jax.ShapeDtypeStruct((batch, heads, d, seq), v.dtype),
      grid=(batch, heads, seq // block),
      in_specs=[pl.BlockSpec((None, block, None, d), lambda b, h, s: (b, s, h, 0))],
      out_specs=pl.BlockSpec((None, None, d, block), lambda b, h, s: (b, h, 0, s)),
      num_warps=4, num_stages=2, interpret=interpret, name="pallas_attn_fp8_values",
  )(v)
