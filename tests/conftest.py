"""Shared test helpers: run modes, random inputs, error metrics."""
import functools
import importlib.metadata
import importlib.util
import math
import os
import sys


def _cpu_only() -> bool:
  """JAX can compile for the CPU alone: JAX_PLATFORMS=cpu, or no accelerator
  plugin installed (CUDA and ROCm come as `jax_plugins`)."""
  if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
    return True
  return (importlib.util.find_spec("jax_plugins") is None
          and not importlib.metadata.entry_points(group="jax_plugins"))


def _add_xla_flag(flag: str):
  """`--name=value` added to XLA_FLAGS unless they set that name already."""
  flags = os.environ.get("XLA_FLAGS", "")
  if flag.split("=")[0] not in flags:
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [flags, flag]))


# XLA reads its flags when JAX starts its backends (ON_GPU below), in each
# pytest-xdist worker; test_distributed.py passes them on to its subprocesses.
if _cpu_only():
  # Interpret-mode kernels are large XLA CPU programs that run for milliseconds on
  # the tests' shapes: LLVM's optimizations took about half of their compilation
  # time and bought nothing.
  _add_xla_flag("--xla_backend_optimization_level=0")
else:
  # XLA autotunes the kernel of each new dot it compiles for a GPU: the float32
  # references' gradients took 11 s each to compile for an H200, 0.6-1.5 s without
  # (2026-11-28). The tests time nothing, and XLA does not autotune our kernels
  # (custom calls).
  _add_xla_flag("--xla_gpu_autotune_level=0")

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops each test module's compiled programs after it. An XLA CPU
  executable holds a few memory mappings; a pytest-xdist worker that kept
  every module's (about 30,000 mappings halfway through the suite) ran past
  Linux's limit (vm.max_map_count, 65530) late in the run, where LLVM's next
  compilation crashed the worker with a segmentation fault."""
  yield
  from pallas_attn.kernels import block_mask_cache
  block_mask_cache.clear()
  jax.clear_caches()

# Every kernel test runs in interpret mode (CPU, CI) and compiled (GPU only).
MODES = [pytest.param(True, id="interpret"),
         pytest.param(False, id="compiled", marks=pytest.mark.gpu)]


def modes(cases: dict, interpreted) -> list:
  """Parameters `(*case, interpret)` for `cases` ({id: argument tuple}): every case
  compiled (`gpu`), those named in `interpreted` also in interpret mode. In interpret
  mode a kernel compilation per case is most of a test's time, and cases that take
  the same path through the kernels as another add nothing there."""
  unknown = set(interpreted) - set(cases)
  assert not unknown, unknown
  params = []
  for name, case in cases.items():
    if name in interpreted:
      params.append(pytest.param(*case, True, id=f"{name}-interpret"))
    params.append(pytest.param(*case, False, id=f"{name}-compiled", marks=pytest.mark.gpu))
  return params


@pytest.fixture(params=MODES)
def default_mode(request, monkeypatch):
  """MODES for code that passes no `interpret` (the layers, the example):
  sets the default that `interpret=None` resolves to."""
  from pallas_attn.kernels import backend
  monkeypatch.setattr(backend, "default_interpret", lambda: request.param)
  return request.param

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 5e-3}

# Random ragged shapes for property tests: `@given(**RANDOM_SHAPES)` draws the
# arguments of `qkv` (query heads are kv_heads * group) and a causal flag.
RANDOM_SHAPES = dict(
    batch=st.integers(1, 2), seq_q=st.integers(1, 40), seq_kv=st.integers(1, 40),
    kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 2]),
    d_qk=st.sampled_from([8, 16, 24]), d_v=st.sampled_from([8, 16, 40]),
    causal=st.booleans(), seed=st.integers(0, 1000))


def _hopper() -> bool:
  from pallas_attn.kernels import mosaic_backend
  return ON_GPU and mosaic_backend.unavailable() is None


def pytest_collection_modifyitems(config, items):
  """The one place GPU-only tests are skipped: `gpu` (compiled kernels),
  `hopper` (compiled Mosaic GPU kernels) and `multi_gpu` (two GPUs or more).
  `hopper` and `multi_gpu` tests are `gpu` tests too, so that `-m gpu`
  selects every compiled test (it had left out the Mosaic linear suite)."""
  reasons = {"gpu": None if ON_GPU else "needs a GPU (compiled kernels)",
             "hopper": None if _hopper() else "needs a Hopper GPU (Mosaic GPU compiled)",
             "multi_gpu": None if ON_GPU and jax.device_count() >= 2 else "needs 2+ GPUs"}
  for item in items:
    if ("hopper" in item.keywords or "multi_gpu" in item.keywords) and "gpu" not in item.keywords:
      item.add_marker(pytest.mark.gpu)
    why = next((reason for marker, reason in reasons.items()
                if reason and marker in item.keywords), None)
    if why:
      item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture
def exact_matmuls():
  """float32 matmuls at full precision (GPUs default to TF32), for tests
  whose reference is a framework's own layer rather than attention_reference."""
  with jax.default_matmul_precision("highest"):
    yield


def assert_missing_extra_fails(monkeypatch, framework: str):
  """Without `framework` installed, `pallas_attn.layers.<framework>` (a lazy
  import) raises an ImportError that names the extra to install."""
  import pallas_attn.layers
  monkeypatch.setitem(sys.modules, framework, None)
  monkeypatch.delitem(sys.modules, f"pallas_attn.layers.{framework}")
  monkeypatch.delattr(pallas_attn.layers, framework)
  with pytest.raises(ImportError, match=rf"\[{framework}\]"):
    getattr(pallas_attn.layers, framework)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _draw(seed, size, distribution):
  return getattr(jax.random, distribution)(jax.random.PRNGKey(seed), (size,), jnp.float32)


def random(shape, dtype=jnp.float32, seed=0, distribution="normal"):
  """`jax.random.normal(PRNGKey(seed), shape, float32)` (or `uniform`) cast to
  `dtype`, the same values, taken as the first elements of a draw of a
  power-of-two size: with partitionable threefry (JAX's default) element i of
  a draw depends on i alone. One compiled draw then serves every shape up to
  its size; a draw of each shape cost a compilation (about a second on CPU)
  for each new shape in each process. Inside a trace (a jitted or differentiated
  loss) the draw is still made eagerly, and enters the trace as a constant."""
  with jax.ensure_compile_time_eval():
    if not jax.config.jax_threefry_partitionable:
      key = jax.random.PRNGKey(seed)
      return getattr(jax.random, distribution)(key, shape, jnp.float32).astype(dtype)
    n = math.prod(shape)
    flat = np.asarray(_draw(seed, max(1024, 1 << (n - 1).bit_length()), distribution))
    return jnp.asarray(flat[:n].reshape(shape)).astype(dtype)


def qkv(batch=2, seq_q=37, seq_kv=45, heads=4, kv_heads=2, d_qk=24, d_v=40,
        dtype=jnp.float32, seed=0):
  """Random q, k, v with ragged lengths, GQA and dqk != dv by default."""
  return (random((batch, seq_q, heads, d_qk), dtype, seed),
          random((batch, seq_kv, kv_heads, d_qk), dtype, seed + 1),
          random((batch, seq_kv, kv_heads, d_v), dtype, seed + 2))


def rel_err(x, ref):
  x = np.asarray(jnp.asarray(x, jnp.float32))
  ref = np.asarray(jnp.asarray(ref, jnp.float32))
  assert not np.isnan(x).any(), "NaN in result"
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def assert_close(x, ref, dtype=jnp.float32, factor=1.0):
  err = rel_err(x, ref)
  assert err <= TOLERANCE[dtype] * factor, f"relative error {err:.3e}"
