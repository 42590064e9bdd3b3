"""Attention over several devices on JAX's SPMD.

* Batch/head sharding: `pallas_attn.attention` under `jax.jit` on inputs
  sharded over batch and heads runs one kernel per shard
  (partitioning.py, sharded_passes.py, offsets.py).
* Context parallelism: `context_parallel_attention` (a `shard_map` over a
  sequence axis) and `ring_attention` (inside your own `shard_map`) pass
  blocks of keys around a ring of devices (ring.py, layout.py);
  `zigzag_order` / `natural_order` put a sequence in the order of the
  balanced layout, so that the ring needs no relayout.
* Decoding on a KV cache split along its sequence: `decode_attention`
  under jit on the sharded cache, or `sharded_decode_attention` /
  `sharded_paged_attention` with the mesh axes named (each device decodes
  its shard, the parts merge by log-sum-exp after one all-gather of
  output-sized arrays; sharded_decode.py).
* `PEER_COPY_OPTIONS`: compiler options for a jit holding the ring, so that
  its transfers between GPUs of one process take the copy engines.
"""
from pallas_attn.distributed.context_parallel import context_parallel_attention
from pallas_attn.distributed.layout import natural_order, zigzag_order
from pallas_attn.distributed.one_program import PEER_COPY_OPTIONS
from pallas_attn.distributed.ring import ring_attention
from pallas_attn.distributed.sharded_decode import (sharded_decode_attention,
                                                    sharded_paged_attention)

__all__ = ["PEER_COPY_OPTIONS", "context_parallel_attention", "natural_order", "ring_attention",
           "sharded_decode_attention", "sharded_paged_attention", "zigzag_order"]
