"""pallas_attn.distributed on several devices: batch/head sharding under jit,
context-parallel ring attention (tests/distributed_checks.py has the checks).

The checks need several devices from the start of JAX, so they run in a
subprocess: on CPU with 4 host devices and interpret-mode kernels; on a GPU
machine (`gpu` marker) compiled over every local GPU.
"""
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pallas_attn as pa

CHECKS = pathlib.Path(__file__).with_name("distributed_checks.py")
REPO = CHECKS.parent.parent


def run_check_script(script, *args, env_update=None, timeout=900):
  """Runs a checks script in a subprocess (the repository on PYTHONPATH,
  `env_update` over this process' environment); fails with its output."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
  env.update(env_update or {})
  result = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
  print(result.stdout)
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]


@pytest.mark.parametrize("group", ["sharding", "context parallel", "ring"])
def test_distributed_on_four_cpu_devices(group):
  """Interpret-mode kernels on 4 CPU devices (XLA_FLAGS before JAX starts);
  the checks whose names contain `group`, one subprocess per group so that
  pytest-xdist spreads them."""
  flags = [os.environ.get("XLA_FLAGS"), "--xla_force_host_platform_device_count=4"]
  run_check_script(CHECKS, "--only", group,
                   env_update={"XLA_FLAGS": " ".join(filter(None, flags)), "JAX_PLATFORMS": "cpu"})


def test_zigzag_rings_on_eight_cpu_devices():
  """The zigzag checks (relayout in and out, inputs already in the zigzag
  order, ALiBi with sinks in bf16) on a ring of 8: any mesh size, not only 4."""
  flags = [os.environ.get("XLA_FLAGS"), "--xla_force_host_platform_device_count=8"]
  run_check_script(CHECKS, "--only", "zigzag",
                   env_update={"XLA_FLAGS": " ".join(filter(None, flags)), "JAX_PLATFORMS": "cpu"})


def test_ring_memory_on_eight_cpu_devices():
  """The ring's gradient holds as much on 8 devices as on 4 (not one shard
  per step): compiled, not run, so interpret mode costs no kernel time."""
  flags = [os.environ.get("XLA_FLAGS"), "--xla_force_host_platform_device_count=8"]
  run_check_script(CHECKS, "--only", "ring memory",
                   env_update={"XLA_FLAGS": " ".join(filter(None, flags)), "JAX_PLATFORMS": "cpu"})


def test_zigzag_order_round_trip_and_chunks():
  """Device i's contiguous shard of the zigzag order is chunks i and 2N - 1 - i."""
  x = jnp.arange(2 * 24).reshape(2, 24)
  ordered = pa.distributed.zigzag_order(x, 3)
  chunks = np.asarray(ordered[0]).reshape(6, 4) // 4
  assert chunks[:, 0].tolist() == [0, 5, 1, 4, 2, 3]
  np.testing.assert_array_equal(pa.distributed.natural_order(ordered, 3), x)


@pytest.mark.parametrize("num", [2, 3, 4, 8])
def test_zigzag_moves_in_two_rounds_of_sends(num):
  """The zigzag moves and their inverse split into two rounds in which each
  device sends one half and receives one, every half reaching its slot."""
  from pallas_attn.distributed import layout
  forward = layout._zigzag_sources(num)
  for sources in (forward, {source: target for target, source in forward.items()}):
    rounds = layout._send_rounds(sources)
    reached = {}
    for plan in rounds:
      assert sorted(plan) == list(range(num))
      assert sorted(target for _, target, _ in plan.values()) == list(range(num))
      reached.update({(target, slot): (device, sent)
                      for device, (sent, target, slot) in plan.items()})
    assert reached == sources


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(sequence_order="reversed"), ValueError, "sequence_order must be one of"),
    (dict(sequence_order="zigzag", load_balance=False), ValueError, "contradicts"),
    (dict(q_descale=1.0, v_descale=1.0), TypeError, "no fp8 inputs \\(q_descale, v_descale"),
    (dict(block_mask=object()), TypeError, "takes no block_mask: each ring step"),
    (dict(seq_axis="sequence"), ValueError, "seq_axis 'sequence' is not an axis of the mesh"),
    (dict(batch_axis=("data", "seq")), ValueError, "batch_axis 'data' is not an axis"),
])
def test_context_parallel_argument_errors(kwargs, error, match):
  mesh = jax.make_mesh((1,), ("seq",), devices=jax.devices()[:1])
  x = jnp.ones((1, 8, 2, 16))
  kwargs = dict(dict(mesh=mesh, seq_axis="seq"), **kwargs)
  with pytest.raises(error, match=match):
    pa.context_parallel_attention(x, x, x, **kwargs)
  with pytest.raises(ValueError, match="2 x 3 equal chunks"):
    pa.distributed.zigzag_order(x, 3)


def test_default_head_groups_bound_the_key_block():
  """The ring's default groups: the fewest (dividing the key heads) whose
  key block per device is at most GROUP_BLOCK_BYTES; one for short shards."""
  ring = pa.distributed.ring
  groups = lambda seq, heads, dtype=jnp.bfloat16: ring.default_head_groups(
      jax.ShapeDtypeStruct((1, seq, heads, 128), dtype))
  assert ring.GROUP_BLOCK_BYTES == 32 << 20
  assert groups(4096, 16) == 1            # 16 MiB of keys
  assert groups(65536, 16) == 8           # 256 MiB: 8 groups of 2 heads
  assert groups(65536, 8) == 4
  assert groups(65536, 16, jnp.float32) == 16
  assert groups(1 << 20, 2) == 2          # never more groups than heads
  assert groups(65536, 12) == 6           # 2 heads of 16 MiB a group
  mesh = jax.make_mesh((1,), ("seq",), devices=jax.devices()[:1])
  x = jnp.ones((1, 8, 2, 16))
  with pytest.raises(ValueError, match="head_groups .* divisor"):
    pa.context_parallel_attention(x, x, x, mesh=mesh, seq_axis="seq", head_groups=3)


def test_ring_shifts_only_the_indices_a_program_reads():
  """The ring gives a user program global b / h only where it reads them: a
  causal mask captures no head group's offset (its block masks are the same
  for every group), ALiBi's slope reads h, a document mask's ids read b."""
  from pallas_attn.spec.analysis import analyze_variant
  from pallas_attn.distributed.offsets import uses_index_value
  reads = lambda prog, name: uses_index_value(prog, name, reads_too=True)
  ids = jnp.zeros((2, 64), jnp.int32)
  causal = analyze_variant(mask_mod=pa.variants.causal().mask_mod).mask_mod
  alibi = analyze_variant(score_mod=pa.variants.alibi(num_heads=4).score_mod).score_mod
  documents = analyze_variant(mask_mod=pa.variants.document(ids).mask_mod).mask_mod
  assert not reads(causal, "h") and not reads(causal, "b")
  assert reads(alibi, "h") and not reads(alibi, "b")
  assert reads(documents, "b") and not reads(documents, "h")
  assert not reads(None, "h")


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_distributed_compiled_on_local_gpus():
  """Compiled kernels over every local GPU (NVLink multicast left off)."""
  run_check_script(CHECKS, "--compiled", env_update={"NCCL_NVLS_ENABLE": "0"})


@pytest.mark.gpu
def test_ring_attention_compiled_on_one_device_mesh():
  """The ring's structure (step 0 before the loop, the float32 merge, the
  backward ring on recorded statistics) with compiled kernels where only one
  GPU is at hand: a one-device mesh, causal GQA at a ragged length, output and
  gradients against the float32 reference."""
  mesh = jax.make_mesh((1,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:1])
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (2, 1000, 4, 128), jnp.bfloat16)
  k, v = (jax.random.normal(key, (2, 1000, 2, 128), jnp.bfloat16) for key in keys[1:])
  causal = pa.variants.causal().kwargs()
  ring = jax.shard_map(lambda q, k, v: pa.ring_attention(q, k, v, axis_name="seq", **causal),
                       mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"),
                       check_vma=False)

  def loss(attend):
    return lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) ** 2)
  got = jax.jit(jax.value_and_grad(loss(ring), (0, 1, 2)))(q, k, v)
  want = jax.jit(jax.value_and_grad(
      loss(lambda q, k, v: pa.attention_reference(q, k, v, **causal)), (0, 1, 2)))(q, k, v)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert not np.isnan(g).any()
    assert np.linalg.norm(g - w) <= 1e-2 * np.linalg.norm(w)
