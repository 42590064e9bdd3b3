"""Scheduling: device table, resource model and search space, timing, cache, tuner."""
import dataclasses
import json
import os
import re
import threading
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pallas_attn as pa
from pallas_attn import tuning, variants
from pallas_attn.schedule import cache as cache_lib
from pallas_attn.schedule import config as config_lib
from pallas_attn.schedule import device as device_lib
from pallas_attn.schedule import search_space as space_lib
from pallas_attn.schedule import template as template_lib
from pallas_attn.schedule import timing, tuner
from pallas_attn.schedule.config import AttentionConfig, DecodeConfig, LinearAttentionConfig

MOSAIC_TEMPLATES = ("forward_mosaic", "backward_mosaic")
H100 = device_lib.lookup_device("NVIDIA H100 80GB HBM3")
CPU = device_lib.lookup_device("cpu")


def shape(batch=1, seq_q=4096, seq_kv=None, heads=8, kv_heads=None, d_qk=128, d_v=None,
          dtype="bfloat16"):
  seq_kv, kv_heads, d_v = seq_kv or seq_q, kv_heads or heads, d_v or d_qk
  return template_lib.ProblemShape.from_shapes(
      (batch, seq_q, heads, d_qk), (batch, seq_kv, kv_heads, d_qk),
      (batch, seq_kv, kv_heads, d_v), dtype)


def prune_reason(template, config, problem, device):
  return template_lib.get(template).prune_reason(config, problem, device)


@pytest.fixture
def cache_path(tmp_path, monkeypatch):
  path = tmp_path / "tuning.json"
  monkeypatch.setenv(cache_lib.CACHE_ENV, str(path))
  return path


# --- Device table ---------------------------------------------------------------


@pytest.mark.parametrize("kind, name, smem_kib, warp", [
    ("NVIDIA H100 80GB HBM3", "h100", 227, 32),
    ("NVIDIA H200", "h200", 227, 32),
    ("NVIDIA A100-SXM4-80GB", "a100", 163, 32),
    ("AMD Instinct MI250X", "mi250", 64, 64),
    ("AMD Instinct MI300X", "mi300", 64, 64),
    ("NVIDIA L4", "nvidia", 99, 32),
    ("Some Future Accelerator", "nvidia", 99, 32),
])
def test_lookup_device(kind, name, smem_kib, warp):
  config = device_lib.lookup_device(kind)
  assert (config.name, config.smem_per_block, config.warp_size) == (name, smem_kib * 1024, warp)
  assert config.kind == kind and not config.interpret


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU entry")
def test_device_config_on_cpu_is_interpret():
  config = device_lib.device_config()
  assert config.interpret and config.smem_per_block is None and config.kind == "cpu"


def test_device_config_reads_core_count_and_rocm():
  pcie = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 PCIe",
                               core_count=114, compute_capability="9.0")
  assert device_lib.device_config(pcie).sm_count == 114
  amd = types.SimpleNamespace(platform="gpu", device_kind="gfx-unnamed",
                              compute_capability="gfx942")
  assert device_lib.device_config(amd).vendor == "amd"


# --- Configs ----------------------------------------------------------------------

TILE = "a power of two >= 16"
STAGES = "an integer in 1..8"
TRITON_WARPS = "one of 1, 2, 4, 8, 16"


@pytest.mark.parametrize("cls, field, value, allowed", [
    (AttentionConfig, "block_q", 48, TILE),
    (AttentionConfig, "block_q", 8, TILE),
    (AttentionConfig, "block_k", 0, TILE),
    (AttentionConfig, "block_k", 64.0, TILE),
    (AttentionConfig, "num_warps", 6, "one of 1, 2, 4, 8, 12, 16"),
    (AttentionConfig, "num_warps", 32, "one of 1, 2, 4, 8, 12, 16"),
    (AttentionConfig, "num_stages", 0, STAGES),
    (AttentionConfig, "num_stages", 9, STAGES),
    (AttentionConfig, "num_stages", True, STAGES),
    (LinearAttentionConfig, "chunk_size", 48, TILE),
    (LinearAttentionConfig, "block_v", 8, TILE),
    (LinearAttentionConfig, "num_warps", 12, TRITON_WARPS),
    (LinearAttentionConfig, "num_stages", 0, STAGES),
    (DecodeConfig, "block_k", 48, TILE),
    (DecodeConfig, "num_splits", 0, "an integer >= 1"),
    (DecodeConfig, "block_rows", 8, TILE),
    (DecodeConfig, "num_warps", 12, TRITON_WARPS),
    (DecodeConfig, "num_warps", None, TRITON_WARPS),
    (DecodeConfig, "num_stages", 9, STAGES),
])
def test_configs_reject_bad_fields(cls, field, value, allowed):
  """The error names the field, what it allows and the value given."""
  message = f"{cls.__name__}.{field} must be {allowed}"
  with pytest.raises(ValueError, match=re.escape(message) + f".*; got {re.escape(repr(value))}$"):
    cls(**{field: value})
  with pytest.raises(ValueError, match=re.escape(message)):
    cls.from_dict({**cls().to_dict(), field: value})


def test_configs_accept_the_allowed_values():
  for warps in (1, 2, 4, 8, 12, 16):
    assert AttentionConfig(num_warps=warps).num_warps == warps
  for stages in range(1, 9):
    assert LinearAttentionConfig(num_stages=stages).num_stages == stages
  assert AttentionConfig(16, 256, 16, 8) == AttentionConfig.from_dict(
      AttentionConfig(16, 256, 16, 8).to_dict())
  assert LinearAttentionConfig(16, 16, 1, 1).chunk_size == 16
  assert DecodeConfig() == DecodeConfig(None, None, None, 4, None)  # the schedule fills them
  assert DecodeConfig(16, 1, 16, 1, 1).num_splits == 1


@pytest.mark.parametrize("template", list(template_lib.REGISTRY))
@pytest.mark.parametrize("kind", ["NVIDIA H100 80GB HBM3", "AMD Instinct MI300X", "cpu"])
def test_default_configs_are_valid(template, kind):
  """The heuristics construct valid configs for short, odd and long shapes
  (construction would raise)."""
  device = device_lib.lookup_device(kind)
  for seq_q, seq_kv in ((1, 1), (1, 100000), (16, 4096), (65, 63), (5000, 300)):
    for d_qk, d_v in ((8, 8), (40, 96), (128, 128), (192, 128), (256, 256)):
      for dtype in ("bfloat16", "float32"):
        problem = shape(seq_q=seq_q, seq_kv=seq_kv, heads=8, kv_heads=2, d_qk=d_qk, d_v=d_v,
                        dtype=dtype)
        for block_sparse in (False, True):
          template_lib.get(template).default_config(problem, device, block_sparse=block_sparse)


# --- Resource model and search space ---------------------------------------------


def test_resource_use_forward():
  use = template_lib.get("forward").resource_use(AttentionConfig(128, 64, 8, 3), shape(),
                                                 H100)
  assert use.smem_bytes == (3 * 64 * (128 + 128) + 128 * 128) * 2  # K/V stages + Q tile
  assert use.acc_registers == (128 * 128 + 128 * 64) // 256


@pytest.mark.parametrize("template, config, reason", [
    ("forward", AttentionConfig(64, 256, 4, 4), "smem 528 KiB > 227 KiB limit"),
    ("forward", AttentionConfig(128, 128, 4, 1), "fp32 accumulators 256 regs/thread > 255"),
    ("forward", AttentionConfig(16, 16, 8, 1), "2 MMA tiles of 16x16 < 8 warps"),
    ("forward", AttentionConfig(128, 64, 12, 2), "num_warps 12 is not a power of two"),
    ("backward", AttentionConfig(128, 128, 8, 4), "smem"),
    ("linear_forward", LinearAttentionConfig(64, 256, 4, 2), "block_v 256 > padded d_v 128"),
])
def test_prune_reasons(template, config, reason):
  assert reason in prune_reason(template, config, shape(), H100)


def test_tiles_off_the_mma_tile_are_pruned():
  wide_mma = dataclasses.replace(H100, mma_tile=(32, 8, 16))
  assert "block_q 16 is not a multiple of the 32-wide MMA tile" in prune_reason(
      "forward", AttentionConfig(16, 64, 4, 1), shape(), wide_mma)


def test_tiles_larger_than_padded_sequence_are_pruned():
  short = shape(seq_q=40, seq_kv=100)
  assert prune_reason("forward", AttentionConfig(64, 128, 4, 1), short, H100) is None
  assert "padded seq_q 64" in prune_reason(
      "forward", AttentionConfig(128, 64, 4, 1), short, H100)


def test_smaller_shared_memory_prunes_more():
  a100 = device_lib.lookup_device("NVIDIA A100-SXM4-80GB")
  config = AttentionConfig(128, 128, 8, 3)  # 224 KiB
  assert prune_reason("forward", config, shape(), H100) is None
  assert "> 163 KiB limit" in prune_reason("forward", config, shape(), a100)


@pytest.mark.parametrize("template", list(template_lib.REGISTRY))
@pytest.mark.parametrize("kind", ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB",
                                  "AMD Instinct MI300X"])
def test_search_space_partitions_the_product(template, kind):
  device = device_lib.lookup_device(kind)
  space = space_lib.search_space(template, shape(), device)
  axes = space_lib.default_axes(template, shape(), device)
  assert len(space.candidates) + len(space.pruned) == np.prod([len(v) for v in axes.values()])
  assert space.candidates, space.summary(verbose=True)
  assert all(prune_reason(template, c, shape(), device) is None
             for c in space.candidates)
  assert all(p.reason for p in space.pruned)


def test_search_space_order_and_axes():
  space = space_lib.search_space("forward", shape(), H100)
  assert space.candidates[0] == space.default == AttentionConfig(128, 64, 8, 3)
  small = space_lib.search_space("forward", shape(), H100, block_q=(64, 128), num_stages=(2,))
  assert {(c.block_q, c.num_stages) for c in small.candidates} <= {(64, 2), (128, 2)}
  with pytest.raises(ValueError, match="unknown axes"):
    space_lib.search_space("forward", shape(), H100, chunk_size=(16,))
  with pytest.raises(ValueError, match="unknown template"):
    space_lib.search_space("sideways", shape(), H100)


def test_mosaic_search_spaces():
  """The Mosaic templates search tiles and ring depth; warps follow the tiles;
  shared memory prunes what the kernels could not allocate."""
  forward = space_lib.search_space("forward_mosaic", shape(), H100)
  assert forward.candidates[0] == forward.default == AttentionConfig(128, 128, 12, 2)
  assert all(c.num_warps == 4 * (c.block_q // 64 + 1) for c in forward.candidates)
  assert AttentionConfig(128, 64, 12, 4) in forward.candidates
  reason = prune_reason("forward_mosaic", AttentionConfig(128, 256, 12, 2), shape(), H100)
  assert "> 227 KiB limit" in reason
  backward = space_lib.search_space("backward_mosaic", shape(), H100)
  assert backward.default == AttentionConfig(128, 128, 12, 4) in backward.candidates
  assert {c.block_k for c in backward.candidates} == {64, 128}
  reason = prune_reason("backward_mosaic", AttentionConfig(128, 128, 12, 8), shape(), H100)
  assert "shared memory holds 3 (dq) and 4 (dk/dv) ring slots" in reason
  assert "run 12" in prune_reason("forward_mosaic", AttentionConfig(128, 64, 8, 2), shape(),
                                  H100)
  assert "block_q 64, 128 or 192" in prune_reason(
      "forward_mosaic", AttentionConfig(32, 64, 8, 2), shape(), H100)


@pytest.mark.parametrize("template", MOSAIC_TEMPLATES)
def test_tuning_a_mosaic_template_where_it_cannot_run_says_why(template):
  s = shape(batch=1, seq_q=64, heads=1, d_qk=64)
  with pytest.raises(ValueError, match="cannot run this call"):
    tuning.tune_attention(s.q_shape, s.k_shape, s.v_shape, template=template, store=False)


@pytest.mark.gpu
@pytest.mark.hopper
def test_tune_mosaic_templates_then_attention_uses_them(cache_path):
  """Both Mosaic passes tuned on a small shape, stored, and picked up by
  attention(): its results equal the heuristic configs' results."""
  import pallas_attn as pa
  s = shape(batch=1, seq_q=256, heads=2, d_qk=64)
  for template in MOSAIC_TEMPLATES:
    result = tuning.tune_attention(s.q_shape, s.k_shape, s.v_shape, template=template,
                                  max_candidates=3, warmup=1, reps=2)
    assert result.trials[0].ok, result.trials[0].error
    assert _lookup(template=template, fingerprint=pa.analyze_variant().fingerprint(),
                   s=s) == result.best
  q, k, v = (jax.random.normal(jax.random.PRNGKey(i), sh, jnp.bfloat16)
             for i, sh in enumerate((s.q_shape, s.k_shape, s.v_shape)))
  loss = lambda q, k, v, **kw: jnp.sum(pa.attention(q, k, v, **kw).astype(jnp.float32) ** 2)
  tuned = jax.grad(loss, (0, 1, 2))(q, k, v)
  heuristic = jax.grad(functools.partial(
      loss, config=template_lib.get("forward_mosaic").default_config(s),
      bwd_config=template_lib.get("backward_mosaic").default_config(s)),
      (0, 1, 2))(q, k, v)
  for a, b in zip(tuned, heuristic):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=5e-2, atol=5e-2)


def test_interpret_space_is_tiny():
  space = space_lib.search_space("forward", shape(seq_q=32, d_qk=16), CPU)
  assert set(space.candidates) == {AttentionConfig(q, k, 4, 3) for q in (16, 32) for k in (16, 32)}


@settings(max_examples=40, deadline=None)
@given(seq_q=st.integers(1, 20000), seq_kv=st.integers(1, 20000),
       d=st.sampled_from([16, 40, 64, 96, 128, 256]),
       dtype=st.sampled_from(["bfloat16", "float32"]),
       kind=st.sampled_from(["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB",
                             "AMD Instinct MI250X"]))
def test_candidates_fit_the_device(seq_q, seq_kv, d, dtype, kind):
  device = device_lib.lookup_device(kind)
  problem = shape(seq_q=seq_q, seq_kv=seq_kv, d_qk=d, dtype=dtype)
  for template in ("forward", "backward"):
    for c in space_lib.search_space(template, problem, device).candidates:
      use = template_lib.get(template).resource_use(c, problem, device)
      assert use.smem_bytes <= device.smem_per_block
      assert use.acc_registers <= template_lib.register_budget(c.num_warps, device)
      assert c.block_q <= max(16, 2 ** (seq_q - 1).bit_length())
      assert c.block_k <= max(16, 2 ** (seq_kv - 1).bit_length())


def test_masked_default_takes_wide_key_blocks():
  """Under a mask_mod, heads up to 128 default to 128x128 forward tiles;
  dense variants, small heads and larger heads keep theirs."""
  forward = lambda d, block_sparse: template_lib.get("forward").default_config(
      shape(d_qk=d, d_v=d), block_sparse=block_sparse)
  assert (forward(128, True).block_q, forward(128, True).block_k) == (128, 128)
  assert forward(128, False).block_k == 64
  assert forward(64, True) == forward(64, False)
  assert forward(256, True) == forward(256, False)


def test_per_position_scores_and_float32_take_smaller_default_tiles():
  """A score_mod evaluated at every position keeps 64-wide key blocks under a
  mask (RetNet's decay overflowed shared memory on 128x128); float32 inputs
  take 32x32 tiles in both passes (TF32x3 products stage their operand splits)."""
  forward = template_lib.get("forward")
  masked = forward.default_config(shape(), block_sparse=True, scores_per_position=True)
  assert (masked.block_q, masked.block_k) == (128, 64)
  for template in ("forward", "backward"):
    config = template_lib.get(template).default_config(shape(dtype="float32"))
    assert (config.block_q, config.block_k, config.num_stages) == (32, 32, 2)
  analysis = lambda v: pa.analyze_variant(**{k: x for k, x in v.kwargs().items()
                                            if k in ("score_mod", "mask_mod", "rownorm")})
  assert analysis(variants.retention_parallel(num_heads=4)).scores_per_position
  assert not analysis(variants.alibi(num_heads=4)).scores_per_position
  assert not analysis(variants.causal()).scores_per_position


def test_problem_shape_validation():
  with pytest.raises(ValueError, match="multiple of kv heads"):
    shape(heads=6, kv_heads=4)
  with pytest.raises(ValueError, match="inconsistent"):
    template_lib.ProblemShape.from_shapes((1, 8, 2, 16), (1, 8, 2, 32), (1, 8, 2, 16), "float32")


# --- Timing ---------------------------------------------------------------------


def test_attention_flops():
  fwd = timing.attention_flops(2, 8, 1024, 2048, 64, 128)
  assert fwd == 2 * 2 * 8 * 1024 * 2048 * (64 + 128)
  assert timing.attention_flops(2, 8, 1024, 2048, 64, 128, mode="fwd_bwd") == 3.5 * fwd
  assert timing.attention_flops(2, 8, 1024, 2048, 64, 128, density=0.25) == fwd / 4
  with pytest.raises(ValueError):
    timing.attention_flops(1, 1, 1, 1, 1, 1, mode="bwd")


def test_mask_density():
  causal = lambda b, h, q, k: q >= k
  assert timing.mask_density(causal, 64, 64) == pytest.approx(65 / 128)
  assert timing.mask_density(None, 64, 64) == 1.0
  window = lambda b, h, q, k: jnp.abs(q - k) < 64
  assert timing.mask_density(window, 8192, 8192) == pytest.approx(127 / 8192, rel=0.1)


def test_median_time_ms_times_windows_of_calls():
  """warmup calls, then reps windows; a window holds one call (or
  `min_calls`) when the warm-up call alone outlasts it, more when calls are
  short."""
  calls = []
  def fn():
    calls.append(1)
    return jnp.ones(3)
  assert timing.median_time_ms(fn, warmup=2, reps=5, window_ms=0.0) > 0
  assert len(calls) == 7
  calls.clear()
  timing.median_time_ms(fn, warmup=2, reps=5, window_ms=1e6)
  assert len(calls) == 2 + 5 * timing.MAX_CALLS_PER_WINDOW
  calls.clear()
  timing.median_time_ms(fn, warmup=2, reps=5, window_ms=0.0, min_calls=3)
  assert len(calls) == 2 + 5 * 3


# --- Cache ------------------------------------------------------------------------


def test_cache_key_buckets():
  key = lambda s: cache_lib.CacheKey.create("forward", "fp", s, device_kind="X")
  assert key(shape(seq_q=3000, batch=3)) == key(shape(seq_q=4096, batch=4))
  assert key(shape(seq_q=4096)) != key(shape(seq_q=4097))
  assert key(shape(d_qk=96)) != key(shape(d_qk=128))
  assert key(shape(dtype="float32")) != key(shape())
  k = key(shape(batch=3, heads=8, kv_heads=2, seq_q=1000, seq_kv=3000))
  assert (k.batch_heads, k.group, k.seq_q, k.seq_kv) == (32, 4, 1024, 4096)
  assert k.jax_version == jax.__version__ and k.pallas_attn_version
  assert "device_kind=X" in k.to_string()


def test_default_cache_path(monkeypatch, tmp_path):
  monkeypatch.delenv(cache_lib.CACHE_ENV, raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert cache_lib.default_cache_path() == tmp_path / "pallas_attn" / "tuning.json"
  monkeypatch.setenv(cache_lib.CACHE_ENV, str(tmp_path / "mine.json"))
  assert cache_lib.default_cache_path() == tmp_path / "mine.json"


def _lookup(template="forward", fingerprint="fp", s=None):
  s = s or shape(seq_q=64, d_qk=16)
  return cache_lib.lookup_config(template, fingerprint, q_shape=s.q_shape,
                                 k_shape=s.k_shape, v_shape=s.v_shape, dtype=s.dtype)


def _store(config, template="forward", fingerprint="fp", s=None, **stats):
  s = s or shape(seq_q=64, d_qk=16)
  return cache_lib.store_config(template, fingerprint, config, q_shape=s.q_shape,
                                k_shape=s.k_shape, v_shape=s.v_shape, dtype=s.dtype,
                                **stats)


def test_store_and_lookup(cache_path):
  assert _lookup() is None
  config = AttentionConfig(32, 16, 4, 2)
  _store(config, time_ms=1.0, baseline_ms=2.0)
  assert _lookup() == config
  assert _lookup(s=shape(seq_q=50, d_qk=16)) == config  # same bucket
  assert _lookup(fingerprint="other") is None
  assert _lookup(template="backward") is None
  linear = LinearAttentionConfig(32, 16, 4, 1)
  _store(linear, template="linear_forward")
  assert _lookup(template="linear_forward") == linear
  data = json.loads(cache_path.read_text())
  assert data["format"] == 1 and len(data["entries"]) == 2
  entry = next(e for e in data["entries"].values() if e["key"]["template"] == "forward")
  assert entry["config"] == config.to_dict() and entry["time_ms"] == 1.0
  with pytest.raises(TypeError):
    _store(linear, template="forward")


def test_corrupt_cache_warns_and_misses(cache_path):
  cache_path.write_text("{not json")
  with pytest.warns(UserWarning, match="not valid JSON"):
    assert _lookup() is None
  with pytest.raises(cache_lib.CacheFileError):
    cache_lib.get_cache().entries()


def test_invalid_cache_entry_warns_and_misses(cache_path):
  """An entry a config now rejects (stored before the rule) is a miss, not
  an error in the user's call; the other entries still load."""
  import pallas_attn as pa
  fingerprint = pa.analyze_variant().fingerprint()
  s = shape(batch=1, seq_q=32, heads=2, d_qk=16, dtype="float32")
  key = _store(AttentionConfig(32, 16, 4, 2), fingerprint=fingerprint, s=s)
  _store(AttentionConfig(16, 16, 4, 1), template="backward", fingerprint=fingerprint, s=s)
  data = json.loads(cache_path.read_text())
  data["entries"][key.to_string()]["config"]["block_q"] = 48
  cache_path.write_text(json.dumps(data))
  q, k, v = (jax.random.normal(jax.random.PRNGKey(i), x, jnp.float32)
             for i, x in enumerate((s.q_shape, s.k_shape, s.v_shape)))
  with pytest.warns(UserWarning, match="AttentionConfig.block_q must be a power of two.*48"):
    out = pa.attention(q, k, v)
  np.testing.assert_allclose(out, pa.attention_reference(q, k, v), rtol=1e-5, atol=1e-5)
  assert _lookup(fingerprint=fingerprint, s=s) is None
  assert _lookup(template="backward", fingerprint=fingerprint, s=s) == AttentionConfig(
      16, 16, 4, 1)


def test_merge_export_clear(tmp_path, cache_path):
  _store(AttentionConfig(32, 32, 4, 1), time_ms=2.0)
  shipped = cache_lib.TuningCache(tmp_path / "shipped.json")
  key = cache_lib.CacheKey.create("forward", "fp", shape(seq_q=64, d_qk=16))
  other = cache_lib.CacheKey.create("forward", "fp2", shape(seq_q=64, d_qk=16))
  shipped.put(key, AttentionConfig(16, 16, 4, 1), time_ms=1.0)
  shipped.put(other, AttentionConfig(16, 32, 4, 1), time_ms=3.0)
  mine = cache_lib.get_cache()
  assert mine.merge(shipped.path) == 2  # the faster shared entry and the new one
  assert _lookup() == AttentionConfig(16, 16, 4, 1)
  slower = cache_lib.TuningCache(tmp_path / "slower.json")
  slower.put(key, AttentionConfig(32, 16, 4, 1), time_ms=5.0)
  assert mine.merge(slower.path) == 0
  assert mine.export(tmp_path / "out.json") == 2
  assert cache_lib.TuningCache(tmp_path / "out.json").entries() == mine.entries()
  assert mine.clear() == 2 and _lookup() is None
  with pytest.raises(cache_lib.CacheFileError, match="no tuning cache"):
    mine.merge(tmp_path / "missing.json")


def test_concurrent_writers_keep_every_entry(cache_path):
  def write(i):
    key = cache_lib.CacheKey.create("forward", f"fp{i}", shape(seq_q=64, d_qk=16))
    for _ in range(5):
      cache_lib.TuningCache(cache_path).put(key, AttentionConfig(16, 16, 4, 1), time_ms=i)
  threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(cache_lib.TuningCache(cache_path).entries()) == 8
  assert not [p for p in os.listdir(cache_path.parent) if p.endswith(".tmp")]


# --- Tuner ------------------------------------------------------------------------


def _fake_build(outputs, failures=()):
  """Builds returning fixed outputs per block_q (block_q in `failures` raises)."""
  def build(config):
    if config.block_q in failures:
      raise RuntimeError(f"cannot compile {config.block_q}\nmore detail")
    fn = lambda: outputs[config.block_q]
    fn.block_q = config.block_q
    return fn
  return build


def _fake_timer(ms_by_block_q):
  return lambda fn: ms_by_block_q[fn.block_q]


CANDIDATES = [AttentionConfig(q, 16, 4, 1) for q in (16, 32, 64, 128)]


def test_tune_keeps_fastest_correct():
  ref = jnp.arange(4, dtype=jnp.float32) + 1
  outputs = {16: ref, 32: ref.at[0].add(1e-5), 64: ref * 1.5, 128: ref.at[0].set(jnp.nan)}
  lines = []
  result = tuner.tune(_fake_build(outputs), CANDIDATES, budget_s=60,
                      timer=_fake_timer({16: 2.0, 32: 1.0, 64: 0.1, 128: 0.1}),
                      progress=lines.append, workers=2)
  assert result.best == CANDIDATES[1] and result.best_ms == 1.0
  assert result.baseline == CANDIDATES[0] and result.speedup == 2.0
  rejected = {t.config.block_q: t.error for t in result.trials if not t.ok}
  assert set(rejected) == {64, 128} and "relative error 0.5" in rejected[64]
  assert "relative error nan" in rejected[128]
  assert len(lines) == 4 and lines[0].startswith("[1/4]")


def test_tune_baseline_failure_and_budget():
  ref = jnp.ones(3)
  outputs = {q: ref for q in (16, 32, 64, 128)}
  result = tuner.tune(_fake_build(outputs, failures=(16,)), CANDIDATES,
                      timer=lambda fn: 1.0, workers=1)
  assert result.baseline_ms is None and result.speedup is None
  assert "cannot compile 16" in result.trials[0].error
  assert result.best == CANDIDATES[1]
  quick = tuner.tune(_fake_build(outputs), CANDIDATES, budget_s=0, timer=lambda fn: 1.0)
  assert len(quick.trials) == 1 and quick.skipped == 3
  with pytest.raises(RuntimeError, match="no candidate config ran"):
    tuner.tune(_fake_build(outputs, failures=(16, 32, 64, 128)), CANDIDATES,
               timer=lambda fn: 1.0)


def test_relative_error_and_tolerance():
  ref = (jnp.ones((2, 2)), jnp.full((3,), 2.0))
  assert tuner.relative_error(ref, ref) == 0.0
  assert tuner.relative_error((ref[0], ref[1].at[0].set(2.5)), ref) == pytest.approx(0.25)
  with pytest.raises(ValueError):
    tuner.relative_error(ref[0], ref)
  assert tuner.default_tolerance(jnp.bfloat16) > tuner.default_tolerance(jnp.float32)


def test_tune_attention_forward_on_interpret(cache_path):
  """Real kernels in interpret mode: tiny space, stored, then found by lookup."""
  from pallas_attn import analyze_variant
  causal = lambda b, h, q, k: q >= k
  s = shape(batch=1, seq_q=32, heads=2, d_qk=16, dtype="float32")
  result = tuning.tune_attention(s.q_shape, s.k_shape, s.v_shape, dtype="float32",
                                mask_mod=causal, budget_s=60, warmup=1, reps=2)
  assert all(t.ok for t in result.trials) and len(result.trials) == 4
  fingerprint = analyze_variant(mask_mod=causal).fingerprint()
  assert _lookup(fingerprint=fingerprint, s=s) == result.best


def test_tune_attention_backward_on_interpret(cache_path):
  s = shape(batch=1, seq_q=32, heads=2, d_qk=16, dtype="float32")
  result = tuning.tune_attention(s.q_shape, s.k_shape, s.v_shape, dtype="float32",
                                template="backward", max_candidates=2, warmup=1, reps=2,
                                store=False)
  assert sum(t.ok for t in result.trials) == 2
  assert not cache_path.exists()


def test_tune_attention_masked_backward_searches_its_own_blocks(cache_path):
  """Under a mask_mod each pass runs the block mask on its own tiles, so
  the backward's tiles are searched, not pinned to the forward's."""
  s = shape(batch=1, seq_q=32, heads=2, d_qk=16, dtype="float32")
  forward = AttentionConfig(16, 32, 4, 3)
  # The two candidates nearest the default, (32, 32) and (16, 32), already differ, and
  # (32, 32) from the forward's tiles; each further one is another backward compilation.
  result = tuning.tune_attention(s.q_shape, s.k_shape, s.v_shape, dtype="float32",
                                mask_mod=lambda b, h, q, k: q >= k, template="backward",
                                forward_config=forward, max_candidates=2, warmup=1, reps=2,
                                store=False)
  assert all(t.ok for t in result.trials)
  assert len({(t.config.block_q, t.config.block_k) for t in result.trials}) > 1


def test_tune_linear_attention_is_found_by_linear_attention(cache_path):
  """Tiles tuned for a decay form and shape are what linear_attention then
  runs (config None or "auto"); another form's calls keep the heuristic."""
  from pallas_attn import linear as linear_lib
  from pallas_attn.spec import linear as linear_spec
  q_shape, v_shape = (1, 64, 2, 16), (1, 64, 2, 16)
  axes = {"chunk_size": (16, 32), "block_v": (16,), "num_warps": (4,), "num_stages": (2,)}
  result = tuning.tune_linear_attention(q_shape, v_shape, decay="step", dtype="float32",
                                        axes=axes, warmup=1, reps=2)
  assert all(t.ok for t in result.trials) and len(result.trials) == 3  # the default too
  q, k, v, log_decay, _, _ = tuning._linear_inputs(q_shape, v_shape, "step", False,
                                                    jnp.float32, 0)
  check = functools.partial(linear_spec.check_linear_attention, q_mod=None, k_mod=None,
                            normalize=False, scale=None, initial_state=None)
  spec = check(q, k, v, log_decay=log_decay)
  for config in (None, "auto"):
    assert linear_lib.resolve_config(spec, None, config)[0] == result.best
  other = check(q, k, v, log_decay=None)
  assert linear_lib.resolve_config(other, None, None)[0] == linear_lib.tuned_template(
      other).default_config(template_lib.ProblemShape.from_shapes(*linear_lib.tile_shapes(other),
                                                     "float32"))
  out = pa.linear_attention(q, k, v, log_decay=log_decay, config="auto")
  want = pa.linear_attention(q, k, v, log_decay=log_decay, config=result.best)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="mode must be one of"):
    tuning.tune_linear_attention(q_shape, v_shape, mode="train")
  with pytest.raises(ValueError, match="decay must be one of"):
    tuning.tune_linear_attention(q_shape, v_shape, decay="gla")


def test_tune_needs_candidates():
  with pytest.raises(ValueError, match="nothing to tune"):
    tuner.tune(lambda c: None, [])


# --- A template from outside schedule/ ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToyConfig:
  block: int = 32

  def __post_init__(self):
    config_lib.check_value("ToyConfig.block", self.block, config_lib.TILE)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict) -> "ToyConfig":
    return cls(**d)


class ToyTemplate(template_lib.Template):
  """A one-field template: blocks up to the query length."""
  name = "toy"
  config_class = ToyConfig

  def default_config(self, shape, device=None, *, block_sparse=False, scores_per_position=False):
    return ToyConfig(32)

  def prune_reason(self, config, shape, device):
    return None if config.block <= shape.seq_q else f"block {config.block} > seq_q"

  def axes(self, shape, device, default):
    return {"block": (16, 32, 64, 128)}


@pytest.fixture
def toy_template():
  toy = template_lib.register(ToyTemplate())
  yield toy
  del template_lib.REGISTRY[toy.name]


def test_a_registered_template_is_searched_tuned_and_cached(toy_template, cache_path):
  """The generic search, tuner and cache take a template defined outside
  schedule/ by its registered name; a second template may not take the name."""
  s = shape(seq_q=64, d_qk=16)
  space = space_lib.search_space("toy", s, CPU)
  assert space.candidates == (ToyConfig(32), ToyConfig(16), ToyConfig(64))  # nearest first
  assert space.pruned == (space_lib.PrunedConfig(ToyConfig(128), "block 128 > seq_q"),)
  result = tuner.tune_template("toy", "fp", lambda config: (lambda: jnp.ones(4)), s,
                               warmup=1, reps=1)
  assert result.baseline == ToyConfig(32) and result.best in space.candidates
  assert _lookup(template="toy", s=s) == result.best
  with pytest.raises(ValueError, match="registered already"):
    template_lib.register(ToyTemplate())
