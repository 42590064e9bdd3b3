"""Decoding on a KV cache sharded over its sequence axis
(`pallas_attn.distributed.sharded_decode_attention` / `sharded_paged_attention`).

The multi-device checks (tests/sharded_decode_checks.py) need several
devices from the start of JAX, so they run in a subprocess: on CPU with 4
and with 8 host devices and interpret-mode kernels, on a GPU machine
compiled over every local GPU. The tests here run in
this process: errors, a one-device mesh against `decode_attention`, and
the live key blocks a sliding window leaves each shard.
"""
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_attn as pa
from pallas_attn import variants as V
from pallas_attn.spec.analysis import consts_of
from pallas_attn.distributed.sharded_decode import _global_variant
from pallas_attn.spec.analysis import analyze_variant
from pallas_attn.spec.mask_bounds import live_kv_blocks
from test_distributed import run_check_script

CHECKS = pathlib.Path(__file__).with_name("sharded_decode_checks.py")
CONFIG = pa.DecodeConfig(block_k=16, num_splits=1)


@pytest.mark.parametrize("devices", [4, 8])
def test_sharded_decode_on_cpu_devices(devices):
  """Every check of sharded_decode_checks.py on `devices` CPU devices
  (XLA_FLAGS before JAX starts), one subprocess per device count."""
  flags = [os.environ.get("XLA_FLAGS"), f"--xla_force_host_platform_device_count={devices}"]
  run_check_script(CHECKS, env_update={"XLA_FLAGS": " ".join(filter(None, flags)),
                                       "JAX_PLATFORMS": "cpu"})


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_sharded_decode_compiled_on_local_gpus():
  """Compiled kernels over every local GPU (NVLink multicast left off)."""
  run_check_script(CHECKS, "--compiled", env_update={"NCCL_NVLS_ENABLE": "0"})


def _inputs(seq=32, seq_q=2, batch=2):
  rng = np.random.default_rng(0)
  shapes = ((batch, seq_q, 4, 16), (batch, seq, 2, 16), (batch, seq, 2, 16))
  return tuple(jnp.asarray(rng.standard_normal(s, np.float32)) for s in shapes)


def _mesh():
  return jax.make_mesh((1,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:1])


def test_one_device_mesh_equals_decode_attention():
  """Eager, on a one-device mesh: the single-device decode, causal with sinks."""
  q, k, v = _inputs()
  lengths = jnp.asarray([7, 32], jnp.int32)
  kwargs = dict(sinks=jnp.linspace(-1.0, 1.0, 4), config=CONFIG, interpret=True,
                **V.causal().kwargs())
  out = pa.sharded_decode_attention(q, k, v, lengths, mesh=_mesh(), axis_name="seq", **kwargs)
  want = pa.decode_attention(q, k, v, lengths, **kwargs)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(rownorm=V.retention_norm), ValueError, "normalized"),
    (dict(rownorm=V.off_by_one_softmax), ValueError, "sinks=jnp.full"),
    (dict(sinks=jnp.zeros(3)), ValueError, r"sinks must be \[Hq\]"),
    (dict(batch_axis="seq"), ValueError, "different mesh axes"),
    (dict(axis_name="model"), ValueError, "not in the mesh"),
], ids=["normalized", "rownorm-sink", "sinks-shape", "same-axes", "unknown-axis"])
def test_errors(kwargs, error, match):
  q, k, v = _inputs()
  kwargs = dict(dict(mesh=_mesh(), axis_name="seq"), **kwargs)
  with pytest.raises(error, match=match):
    pa.sharded_decode_attention(q, k, v, jnp.asarray([4, 32], jnp.int32), **kwargs)


def test_uneven_split_and_lengths_are_rejected():
  q, k, v = _inputs(seq=30)
  mesh = jax.make_mesh((1, 1), ("data", "seq"), devices=jax.devices()[:1],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with pytest.raises(ValueError, match="outside"):
    pa.sharded_decode_attention(q, k, v, jnp.asarray([1, 30], jnp.int32), mesh=mesh,
                                axis_name="seq")

  class FakeMesh:  # a 4-way sequence axis, to reach the check without 4 devices
    shape = {"seq": 4}
  with pytest.raises(ValueError, match="split evenly"):
    pa.sharded_decode_attention(q, k, v, jnp.asarray([4, 30], jnp.int32), mesh=FakeMesh(),
                                axis_name="seq")


def test_a_sliding_window_reads_only_the_shards_it_reaches():
  """The wrapped mask keeps tile bounds: each shard's live key blocks are
  those of the window at the global positions, none on shards it does not
  reach (lengths 5, 67, 128; shards of 32 keys; blocks of 16; Sq = 4)."""
  lengths, shard, seq_q = jnp.asarray([5, 67, 128], jnp.int32), 32, 4
  live = []
  for device in range(4):
    offset = jnp.int32(device * shard)
    local = jnp.clip(lengths - offset, 0, shard)
    _, mask = _global_variant(None, V.sliding_window(5).mask_mod, lengths - local, offset, None)
    analysis = analyze_variant(mask_mod=mask)
    ranges = live_kv_blocks(analysis, consts_of(analysis)[1], local, local - seq_q, seq_q, 2, 4,
                            16, 2)
    live.append(np.asarray(ranges)[:, 0].tolist())
  # Window keys: [0, 5) on shard 0; [59, 67) on shards 1 (block 1) and 2
  # (block 0); [120, 128) on shard 3 (block 1). Empty ranges are [0, 0).
  assert live == [[[0, 1], [0, 0], [0, 0]], [[0, 0], [1, 2], [0, 0]],
                  [[0, 0], [0, 1], [0, 0]], [[0, 0], [0, 0], [1, 2]]]
