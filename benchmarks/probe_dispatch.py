"""Probe: host time per call of a jitted attention at a tiny shape (device
time negligible), per lowering: what each kernel launch costs the host.

Asked because examples/train_lm.py's step took 16 ms of host dispatch with
our layers against 6 ms with XLA's attention (profile_train_step.py). On an
H200 (2026-11-23): Mosaic GPU 33 us per call, Triton 38, cuDNN 65, XLA 44:
a Mosaic launch costs the host no more than the others.

    python benchmarks/probe_dispatch.py
"""
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax
import jax.numpy as jnp

import pallas_attn as pa

q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (1, 128, 1, 128), jnp.bfloat16)
           for i in range(3))
fns = {impl: jax.jit(lambda q, k, v, impl=impl: pa.attention(q, k, v, implementation=impl))
       for impl in ("mosaic_gpu", "triton")}
fns["cudnn"] = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v,
                                                                    implementation="cudnn"))
fns["xla"] = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla"))
for name, fn in fns.items():
  jax.block_until_ready(fn(q, k, v))
  for calls in (200, 200):
    start = time.perf_counter()
    outs = [fn(q, k, v) for _ in range(calls)]
    host = (time.perf_counter() - start) / calls * 1e6
    jax.block_until_ready(outs)
    total = (time.perf_counter() - start) / calls * 1e6
  print(f"{name:<12} host {host:8.1f} us/call, with the device {total:8.1f} us/call", flush=True)
