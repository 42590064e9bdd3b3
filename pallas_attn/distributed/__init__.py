"""Attention over several devices on JAX's SPMD.

* Batch/head sharding: `pallas_attn.attention` under `jax.jit` on inputs
  sharded over batch and heads runs one kernel per shard
  (partitioning.py, sharded_passes.py, offsets.py).
* Context parallelism: `context_parallel_attention` (a `shard_map` over a
  sequence axis) and `ring_attention` (inside your own `shard_map`) pass
  blocks of keys around a ring of devices (ring.py, layout.py).
"""
from pallas_attn.distributed.context_parallel import context_parallel_attention
from pallas_attn.distributed.ring import ring_attention

__all__ = ["context_parallel_attention", "ring_attention"]
