"""Every GPU kernel lowered for CUDA on any machine: `jax.export` with
platforms=["cuda"] runs Pallas' Mosaic GPU lowering (register layouts,
shapes, the ops it supports) and its Triton lowering (to Triton IR)
without a GPU, so CI
catches a kernel that no longer lowers (a layout, a shape, an op a backend
lacks) for the Mosaic GPU kernels, which interpret mode cannot run at all,
and for the Triton kernels on the compiled path's shapes and parameters.
What lowering does not reach (ptxas, Triton's compiler, the results, the
speed) stays with the compiled `gpu` / `hopper` tests."""
import dataclasses
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import pytest

import pallas_attn as pa
from pallas_attn import variants
from pallas_attn.kernels import mosaic_backend, mosaic_forward
from pallas_attn.schedule import device

pytestmark = pytest.mark.skipif(mosaic_backend.plgpu is None,
                                reason="jax.experimental.pallas.mosaic_gpu does not import")

B, S, HQ, HKV = 2, 300, 4, 2
# Triton kernels lower to an XLA custom call that jax.export does not promise to keep
# loadable across versions; only lowering is asked of it here.
_TRITON = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")


def _lowered(fn, *shapes) -> str:
  """The StableHLO text of `fn` lowered for CUDA."""
  exported = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[_TRITON])
  return exported(*shapes).mlir_module()


def _kernels(text: str) -> set[str]:
  """The Mosaic GPU kernels in a lowering, by name."""
  return set(re.findall(r"emit_c_interface\\00(\w+?)_mosaic_gpu\\00", text))


@pytest.fixture
def on_hopper(monkeypatch):
  """Mosaic GPU taken to be available (the lowering needs no GPU)."""
  monkeypatch.setattr(mosaic_backend, "unavailable", functools.cache(lambda: None))


def _shapes(dtype=jnp.bfloat16, d=128):
  return (jax.ShapeDtypeStruct((B, S, HQ, d), dtype), jax.ShapeDtypeStruct((B, S, HKV, d), dtype),
          jax.ShapeDtypeStruct((B, S, HKV, d), dtype))


def _gradients(implementation, kwargs):
  def loss(q, k, v):
    return pa.attention(q, k, v, implementation=implementation, interpret=False,
                        **kwargs).astype(jnp.float32).sum()
  return jax.grad(loss, (0, 1, 2))


VARIANTS = {
    "vanilla": variants.Variant("vanilla"),
    "causal": variants.causal(),
    "window": variants.sliding_window(96),
    "alibi_causal": variants.alibi(num_heads=HQ) + variants.causal(),
    "softcap": variants.softcap(30.0),
    "alibi": variants.alibi(num_heads=HQ),
    "sinks": variants.sink(jnp.zeros((HQ,))),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_mosaic_forward_and_backward_lower(name, on_hopper):
  text = _lowered(_gradients("mosaic_gpu", VARIANTS[name].kwargs()), *_shapes())
  assert _kernels(text) == {"pallas_attn_mosaic_forward", "pallas_attn_mosaic_dq",
                            "pallas_attn_mosaic_dkv"}


def test_wide_dq_programs_lower(on_hopper, monkeypatch):
  """Unmasked softmax of the score (or of a function of the score alone:
  softcap) from 2k queries lowers three-consumer dq programs, the last one's
  rows ending past q's (2100 queries pad to 2176); a masked call and a bias
  of the positions (ALiBi) keep 128 rows."""
  from pallas_attn.vjp import mosaic_backward
  rule, chosen = mosaic_backward.dq_program_rows, []
  monkeypatch.setattr(mosaic_backward, "dq_program_rows",
                      lambda *args: chosen.append(rule(*args)) or chosen[-1])
  shapes = [jax.ShapeDtypeStruct((1, 2100, heads, 128), jnp.bfloat16) for heads in (HQ, HKV, HKV)]
  for name, rows in (("vanilla", 192), ("softcap", 192), ("causal", 128), ("alibi", 128)):
    chosen.clear()
    _lowered(_gradients("mosaic_gpu", VARIANTS[name].kwargs()), *shapes)
    assert chosen == [rows], name


@pytest.mark.parametrize("name", ["causal", "alibi_causal"])
def test_triton_forward_and_backward_lower(name):
  text = _lowered(_gradients("triton", VARIANTS[name].kwargs()), *_shapes(d=64))
  assert "xla.gpu.triton" in text and not _kernels(text)


def test_persistent_grid_lowers(on_hopper, monkeypatch):
  """The forward's per-SM loop over items (sliding windows at scale), forced on this small call."""
  monkeypatch.setattr(mosaic_forward, "persistent_grid", lambda *args: True)
  five_sms = dataclasses.replace(device.device_config(), sm_count=5)
  monkeypatch.setattr(mosaic_forward.device_lib, "device_config", lambda: five_sms)
  kwargs = variants.sliding_window(96).kwargs()
  text = _lowered(lambda q, k, v: pa.attention(q, k, v, implementation="mosaic_gpu",
                                               interpret=False, **kwargs), *_shapes())
  assert _kernels(text) == {"pallas_attn_mosaic_forward"}


@pytest.mark.parametrize("seq, padded, name", [(300, 384, "causal"), (256, 256, "causal"),
                                                (300, 384, "vanilla")])
def test_fp8_prefill_lowers(on_hopper, seq, padded, name):
  """e4m3 inputs on fp8 wgmma: V goes in transposed, still e4m3 (not dequantized first).
  At S 256 the second 192-row q block is ragged: q is not padded to 384. The lazy
  running max of the unmasked tiles and its warp-voted rescale (inline Mosaic GPU)
  lower too."""
  q = jax.ShapeDtypeStruct((B, seq, HQ, 128), jnp.float8_e4m3fn)
  k = v = jax.ShapeDtypeStruct((B, seq, HKV, 128), jnp.float8_e4m3fn)
  q_scale = jax.ShapeDtypeStruct((B, HQ), jnp.float32)
  kv_scale = jax.ShapeDtypeStruct((B, HKV), jnp.float32)
  kwargs = VARIANTS[name].kwargs()
  fn = lambda q, k, v, qd, kd, vd: pa.attention(q, k, v, q_descale=qd, k_descale=kd,
                                                v_descale=vd, interpret=False, **kwargs)
  text = _lowered(fn, q, k, v, q_scale, kv_scale, kv_scale)
  assert _kernels(text) == {"pallas_attn_mosaic_forward"}
  assert f"tensor<{B}x{HKV}x128x{padded}xf8E4M3FN>" in text  # [B, Hkv, D, S padded]
  assert f"tensor<{B}x{padded}x{HQ}x128xbf16>" in text  # the output, as q's rows
  assert "vote.sync" in text  # the lazy max's rescale


@pytest.mark.parametrize("tiles", [None, (128, 64)])
def test_fp8_prefill_with_a_block_mask(on_hopper, tiles):
  """A block mask built at the fp8 forward's tiles (what the warning names)
  keeps the call on fp8 tensor cores; one at other tiles runs it dequantized,
  with a warning that says why and which tiles to build it at."""
  from pallas_attn import fp8
  fp8._NOTED_MASK_TILES.clear()
  q = jax.ShapeDtypeStruct((B, 384, HQ, 128), jnp.float8_e4m3fn)
  k = v = jax.ShapeDtypeStruct((B, 384, HKV, 128), jnp.float8_e4m3fn)
  scales = (jax.ShapeDtypeStruct((B, HQ), jnp.float32),
            *[jax.ShapeDtypeStruct((B, HKV), jnp.float32)] * 2)
  causal = VARIANTS["causal"].mask_mod
  block_q, block_kv = tiles or (192, 128)
  mask = pa.block_mask(causal, B, HQ, 384, 384, block_q=block_q, block_kv=block_kv,
                       interpret=True)
  fn = lambda q, k, v, qd, kd, vd: pa.attention(q, k, v, q_descale=qd, k_descale=kd,
                                                v_descale=vd, mask_mod=causal, block_mask=mask,
                                                interpret=False)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    text = _lowered(fn, q, k, v, *scales)
  noted = [str(w.message) for w in caught if "fp8 tensor cores" in str(w.message)]
  on_tensor_cores = f"tensor<{B}x{HKV}x128x384xf8E4M3FN>" in text  # V transposed, still e4m3
  assert on_tensor_cores == (tiles is None)
  if tiles is None:
    assert not noted
  else:
    assert len(noted) == 1 and "block_q=192, block_kv=128" in noted[0], noted


def test_three_consumers_are_fp8_only(on_hopper):
  """192-row programs lower for fp8 inputs only; 16-bit ones are refused with the reason."""
  from pallas_attn.schedule.config import AttentionConfig
  config = AttentionConfig(block_q=192, block_k=128, num_warps=16, num_stages=2)
  fn = lambda q, k, v: pa.attention(q, k, v, config=config, interpret=False)
  with pytest.raises(ValueError, match="block_q 192 .* is for fp8 inputs"):
    _lowered(fn, *_shapes())


@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_decode_lowers(cache):
  """Split-KV decoding (Triton) from a contiguous and a paged cache."""
  dtype = jnp.bfloat16 if cache == "bf16" else jnp.float8_e4m3fn
  q = jax.ShapeDtypeStruct((B, 1, 32, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((B, 4096, 8, 128), dtype)
  pages = jax.ShapeDtypeStruct((B * 256 + 3, 16, 8, 128), dtype)
  table = jax.ShapeDtypeStruct((B, 256), jnp.int32)
  lengths = jax.ShapeDtypeStruct((B,), jnp.int32)
  scales = (jax.ShapeDtypeStruct((B, 8), jnp.float32),) * 2 if cache == "fp8" else ()

  contiguous = lambda q, k, v, n, *s: pa.decode_attention(
      q, k, v, n, interpret=False, **dict(zip(("k_descale", "v_descale"), s)))
  paged = lambda q, k, v, t, n, *s: pa.paged_attention(
      q, k, v, t, n, interpret=False, **dict(zip(("k_descale", "v_descale"), s)))
  assert "xla.gpu.triton" in _lowered(contiguous, q, k, k, lengths, *scales)
  assert "xla.gpu.triton" in _lowered(paged, q, pages, pages, table, lengths, *scales)


def test_linear_attention_lowers(on_hopper):
  """The chunked-recurrent pattern's Mosaic GPU kernels (scalar decay: forward and backward;
  the gated delta rule: the forward, its gradient runs Triton's passes) and Triton's."""
  x = jax.ShapeDtypeStruct((B, 256, HQ, 128), jnp.bfloat16)
  gate = jax.ShapeDtypeStruct((B, 256, HQ), jnp.float32)

  def attend(q, k, v, log_decay, beta=None):
    return pa.linear_attention(q, k, v, log_decay=log_decay, beta=beta, interpret=False,
                               implementation="mosaic_gpu")
  loss = lambda *args: attend(*args).astype(jnp.float32).sum()
  text = _lowered(jax.grad(loss, (0, 1, 2)), x, x, x, gate)
  assert _kernels(text) == {"linear_attention_mosaic_fwd", "linear_attention_mosaic_bwd"}
  assert "xla.gpu.triton" in text
  assert _kernels(_lowered(attend, x, x, x, gate, gate)) == {"linear_attention_mosaic_fwd"}
