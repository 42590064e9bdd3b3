"""The README's Python examples run as written, on small inputs that the
surrounding prose defines (q, k, v, segment ids, a mesh, a KV cache).

The single-device ones run here; the sharded ones (batch/head sharding,
context parallelism, decoding on a sequence-sharded cache) run in a
subprocess over 8 simulated CPU devices. The multi-host example
(`jax.distributed.initialize`) and the persistent-cache lines are not run.
"""
import pathlib
import re

import jax
import jax.numpy as jnp
from test_distributed import run_check_script

README = pathlib.Path(__file__).parent.parent / "README.md"


def readme_blocks() -> list[str]:
  """The README's ```python blocks, in order."""
  return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def block_with(*needles: str) -> str:
  """The one README block containing every string of `needles`."""
  found = [b for b in readme_blocks() if all(n in b for n in needles)]
  assert len(found) == 1, f"{len(found)} README blocks contain {needles}"
  return found[0]


def _qkv(batch, seq, heads, dim, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return [jax.random.normal(key, (batch, seq, heads, dim), jnp.float32) for key in keys]


def test_short_tour():
  batch, seq = 2, 64
  q, k, v = _qkv(batch, seq, 16, 32)
  segment_ids = jnp.repeat(jnp.arange(4)[None], batch, 0).repeat(seq // 4, 1)
  names = dict(q=q, k=k, v=v, B=batch, S=seq, segment_ids=segment_ids)
  exec(block_with("import pallas_attn as pa", "slopes"), names)  # noqa: S102
  out = names["out"]
  assert out.shape == q.shape and bool(jnp.all(jnp.isfinite(out)))


def test_layer_examples():
  from flax import nnx
  names = dict(nnx=nnx, rngs=nnx.Rngs(0), key=jax.random.key(0))
  exec(block_with("pa_flax.MultiHeadAttention"), names)  # noqa: S102
  exec(block_with("pa_eqx.MultiheadAttention"), names)  # noqa: S102
  x = jnp.ones((2, 16, 512))
  assert names["layer"](x, decode=False).shape == x.shape
  assert names["attention"](x[0], x[0], x[0]).shape == x[0].shape


_SHARDED = """
import jax, jax.numpy as jnp, numpy as np
import pallas_attn as pa

def normal(seed, shape):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)

q, k, v = (normal(i, (2, 128, 4, 16)) for i in range(3))
reference = pa.attention_reference(q, k, v, **pa.variants.causal().kwargs())
{batch_heads}
np.testing.assert_allclose(out, reference, rtol=1e-4, atol=1e-5)

q, k, v = (normal(i, (2, 128, 4, 16)) for i in range(3))
doc_ids = jnp.repeat(jnp.arange(4)[None], 2, 0).repeat(32, 1)
{context_parallel}
document_causal = lambda b, h, qi, ki: (doc_ids[b, qi] == doc_ids[b, ki]) & (qi >= ki)
np.testing.assert_allclose(out, pa.attention_reference(q, k, v, mask_mod=document_causal),
                           rtol=1e-4, atol=1e-5)

q = normal(0, (2, 1, 8, 16))
k_cache, v_cache = (normal(i, (2, 256, 2, 16)) for i in (1, 2))
kv_lengths = jnp.array([200, 37], jnp.int32)
want = pa.decode_attention(q, k_cache, v_cache, kv_lengths,
                           **pa.variants.sliding_window(4096).kwargs())
{decode}
np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
"""


def test_sharded_examples_on_eight_cpu_devices(tmp_path):
  script = tmp_path / "readme_sharded.py"
  script.write_text(_SHARDED.format(
      batch_heads=block_with('("data", "model")'),
      context_parallel=block_with("pa.context_parallel_attention(q, k, v, mesh=mesh"),
      decode=block_with("pa.decode_attention(")))
  run_check_script(script, env_update={
      "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
