"""(I + A)^-1 for a strictly lower-triangular A: block forward substitution.

The delta rule's UT transform turns a chunk's C sequential rank-one updates
into matrix products by inverting such a system per chunk. Written in
elementwise jnp ops and a matrix product on [..., C, C] arrays so that the
same function runs in plain JAX (any leading batch axes) and inside a
Pallas kernel ([C, C], the kernel's dot passed in).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

# Diagonal blocks inverted by elimination; larger blocks are merged by
# products. Elimination of a whole 64-token chunk (63 elementwise steps)
# took 0.90 ms of DeltaNet's 1.12 ms forward on an H200 (B4 S4096 H16
# D128). The UT transform of 64-token chunks on an H200 (2026-11-26, same
# shape, kernel ms, none / scalar / per-feature decay): 16-row blocks 0.28
# / 0.30 / 0.60, 8-row 0.24 / 0.25 / 0.55, 4-row 0.21 / 0.22 / 0.51, 2-row
# 0.21 / 0.22 / 0.76, 1-row (merges only) 0.23 / 0.24 / 1.10.
ELIMINATION_BLOCK = 4


def _highest_matmul(a, b):
  return jnp.matmul(a, b, precision=lax.Precision.HIGHEST)


def invert_unit_lower(strictly_lower, *, matmul=None, block: int | None = None):
  """(I + A)^-1 in float32 for A [..., C, C] with zeros on and above the
  diagonal (C a power of two).

  1. The diagonal blocks of `block` rows, all at once, by elimination:
     (I + D)^-1 = (I - d_{b-1} e_{b-1}^T) ... (I - d_0 e_0^T) for D's
     columns d_s; step s applies column s of every block.
  2. Merges of neighbouring blocks up to C: for a lower-left block Y
     between inverted diagonal blocks X^-1 and Z^-1, [[X, 0], [Y, Z]]^-1 =
     [[X^-1, 0], [-Z^-1 Y X^-1, Z^-1]], i.e. T <- T - T Y T for the
     block-diagonal T and Y masked to the lower-left blocks.
  Both are block forward substitution reordered, as accurate.

  matmul: the product of two [..., C, C] float32 arrays (a kernel passes its
  float32-exact dot); plain JAX's at highest precision by default.
  block: the eliminated blocks' rows (`ELIMINATION_BLOCK` by default).
  """
  matmul = matmul or _highest_matmul
  a = strictly_lower.astype(jnp.float32)
  size = a.shape[-1]
  block = min(block or ELIMINATION_BLOCK, size)
  rows = lax.broadcasted_iota(jnp.int32, (size, size), 0)
  cols = lax.broadcasted_iota(jnp.int32, (size, size), 1)
  same_block = rows // block == cols // block
  diagonal_blocks = jnp.where(same_block, a, 0.0)

  def eliminate(step, inverse):
    # Column `step` of each block of D, and row `step` of each block of T:
    # both block diagonal, so one masked sum picks each block's own.
    column = jnp.sum(jnp.where(cols % block == step, diagonal_blocks, 0.0),
                     axis=-1, keepdims=True)
    row = jnp.sum(jnp.where(rows % block == step, inverse, 0.0), axis=-2,
                  keepdims=True)
    return inverse - jnp.where(same_block, column * row, 0.0)

  identity = (rows == cols).astype(jnp.float32)
  inverse = lax.fori_loop(0, block - 1, eliminate,
                          jnp.broadcast_to(identity, a.shape))
  width = block
  while width < size:
    lower_left = ((rows // (2 * width) == cols // (2 * width))
                  & (rows // width != cols // width))
    inverse = inverse - matmul(matmul(inverse, jnp.where(lower_left, a, 0.0)),
                               inverse)
    width *= 2
  return inverse
