"""The Triton backend's deprecation warning is ignored only around our own kernels' lowering."""
import subprocess
import sys
import warnings

import jax.numpy as jnp
import pytest

import pallas_attn as pa
from pallas_attn.kernels import backend

causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx


def test_importing_pallas_attn_leaves_the_warning_filters_alone():
  code = ("import warnings, jax; before = list(warnings.filters); import pallas_attn; "
          "assert warnings.filters == before, [f for f in warnings.filters if f not in before]")
  run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert run.returncode == 0, run.stderr


# Shapes no other test compiles, so that the kernels are built inside the call.
CALLS = {
    "attention": lambda: pa.attention(*[jnp.ones((1, 24, 2, 16))] * 3, mask_mod=causal),
    "decode_attention": lambda: pa.decode_attention(
        jnp.ones((1, 1, 2, 16)), *[jnp.ones((1, 40, 1, 16))] * 2, jnp.array([33])),
    "linear_attention": lambda: pa.linear_attention(*[jnp.ones((1, 24, 2, 16))] * 3),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_calls_do_not_show_the_triton_deprecation(name, monkeypatch):
  """JAX 0.11 warns when it lowers a Triton pallas_call; here (JAX 0.10, or
  interpret mode) a stand-in gives the warning where the kernels are built.
  Neither reaches the caller, whose filters are as they were."""
  built = []

  def warning_pallas_call(*args, **kwargs):
    built.append(kwargs["name"])
    warnings.warn(f"{backend.TRITON_DEPRECATION} and will be removed", DeprecationWarning)
    return pallas_call(*args, **kwargs)

  pallas_call = backend.pallas_call
  monkeypatch.setattr(backend, "pallas_call", warning_pallas_call)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    filters = list(warnings.filters)
    CALLS[name]()
    assert warnings.filters == filters
  assert built
  assert not [w for w in caught if backend.TRITON_DEPRECATION in str(w.message)]
