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
import pytest

CHECKS = pathlib.Path(__file__).with_name("distributed_checks.py")
REPO = CHECKS.parent.parent


def _run_checks(*args, env_update=None, timeout=900):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
  env.update(env_update or {})
  result = subprocess.run([sys.executable, str(CHECKS), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
  print(result.stdout)
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]


@pytest.mark.parametrize("group", ["sharding", "context parallel", "ring"])
def test_distributed_on_four_cpu_devices(group):
  """Interpret-mode kernels on 4 CPU devices (XLA_FLAGS before JAX starts);
  the checks whose names contain `group`, one subprocess per group so that
  pytest-xdist spreads them."""
  _run_checks("--only", group,
              env_update={"XLA_FLAGS": "--xla_force_host_platform_device_count=4",
                          "JAX_PLATFORMS": "cpu"})


@pytest.mark.gpu
def test_distributed_compiled_on_local_gpus():
  """Compiled kernels over every local GPU (NVLink multicast left off)."""
  if jax.device_count() < 2:
    pytest.skip(f"needs at least 2 GPUs; got {jax.devices()}")
  _run_checks("--compiled", env_update={"NCCL_NVLS_ENABLE": "0"})
