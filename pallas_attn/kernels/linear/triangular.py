"""(I + A)^-1 for a strictly lower-triangular A, by forward substitution.

The delta rule's UT transform turns a chunk's C sequential rank-one updates
into matrix products by inverting such a system per chunk. Written in
elementwise jnp ops on [..., C, C] arrays so that the same function runs
in plain JAX (any leading batch axes) and inside a Pallas kernel ([C, C]).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def invert_unit_lower(strictly_lower):
  """(I + A)^-1 for A [..., C, C] with zeros on and above the diagonal.

  Row i of T = (I + A)^-1 is e_i - sum_{j < i} A_ij T_j (T_j rows already
  solved): C - 1 steps of a [C] x [C, C] product, in float32.
  """
  a = strictly_lower.astype(jnp.float32)
  size = a.shape[-1]
  rows = lax.broadcasted_iota(jnp.int32, (size, size), 0)
  identity = (rows == lax.broadcasted_iota(jnp.int32, (size, size), 1)
              ).astype(jnp.float32)

  def solve_row(i, inverse):
    a_row = jnp.sum(jnp.where(rows == i, a, 0.0), axis=-2, keepdims=True)
    combined = jnp.sum(jnp.swapaxes(a_row, -1, -2) * inverse, axis=-2,
                       keepdims=True)  # sum_j A_ij T_j, [..., 1, C]
    return jnp.where(rows == i, identity - combined, inverse)

  start = jnp.broadcast_to(identity, a.shape)
  return lax.fori_loop(1, size, solve_row, start)
