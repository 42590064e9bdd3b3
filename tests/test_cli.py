"""The pallas-attn command line, on tiny shapes in interpret mode."""
import json
import re
import sys
import types

import pytest

import pallas_attn
from pallas_attn import bench, cli

TINY = ["--batch", "1", "--heads", "2", "--seq-q", "32", "--d-qk", "16", "--dtype", "float32"]
CAUSAL_FILE = """
def mask_mod(b, h, q_idx, kv_idx):
  return q_idx >= kv_idx

rownorm = "softmax"
"""


@pytest.fixture(autouse=True)
def cache_path(tmp_path, monkeypatch):
  path = tmp_path / "tuning.json"
  monkeypatch.setenv("PALLAS_ATTN_CACHE", str(path))
  return path


@pytest.fixture
def variant_file(tmp_path):
  path = tmp_path / "my_causal.py"
  path.write_text(CAUSAL_FILE)
  return str(path)


def run(capsys, *argv):
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


def usage_error(capsys, *argv):
  with pytest.raises(SystemExit) as exc:
    cli.main(list(argv))
  assert exc.value.code == 2
  return capsys.readouterr().err


def test_tune_then_explain_uses_the_cache(capsys, variant_file, cache_path):
  code, out, err = run(capsys, "explain", variant_file, *TINY)
  assert code == 0 and "heuristic (no tuned cache entry)" in out
  assert "mask_mod" in out and "forward search space on" in out

  code, out, err = run(capsys, "tune", variant_file, *TINY, "--budget", "60")
  assert code == 0, err
  assert "[1/4]" in err and "search space" in err
  assert "best:" in out and "speedup over the heuristic:" in out
  assert len(json.loads(cache_path.read_text())["entries"]) == 1

  code, out, _ = run(capsys, "explain", variant_file, *TINY, "--templates", "forward")
  assert code == 0 and "[from the tuning cache]" in out


def test_explain_shows_the_configs_of_the_passes_that_run(capsys, monkeypatch):
  """Where Mosaic GPU runs a pass, explain shows that template's config and space."""
  from pallas_attn.kernels import backend, mosaic_backend
  monkeypatch.setattr(mosaic_backend, "unavailable", lambda: None)
  monkeypatch.setattr(backend, "default_interpret", lambda: False)
  code, out, _ = run(capsys, "explain", "causal", "--seq-q", "256", "--d-qk", "64")
  assert code == 0
  assert "forward_mosaic: block_q=128 block_k=128 num_warps=12 num_stages=2" in out
  assert "backward_mosaic: block_q=128 block_k=128 num_warps=12 num_stages=4" in out
  assert "\nforward:" not in out


def test_explain_shows_the_dq_programs(capsys):
  """The backward's dq programs: three consumers where an unmasked softmax of
  the score (or of a function of it alone) with 128-wide heads has 2k
  queries or more, else block_q rows."""
  for variant, seq, rows in (("vanilla", 4096, 192), ("vanilla", 1024, 128),
                             ("causal", 4096, 128), ("softcap", 4096, 192),
                             ("alibi", 4096, 128)):
    code, out, _ = run(capsys, "explain", variant, "--seq-q", str(seq), "--seq-kv", str(seq),
                       "--d-qk", "128", "--templates", "backward_mosaic")
    assert code == 0 and f"dq programs: {rows} query rows" in out, (variant, seq, out)


def test_explain_says_how_an_fp8_prefill_runs(capsys, monkeypatch):
  """On fp8 tensor cores where the Mosaic forward takes the call, else
  dequantized, with the reason."""
  code, out, _ = run(capsys, "explain", "causal", "--seq-q", "256", "--d-qk", "128",
                     "--dtype", "float8_e4m3fn")
  assert code == 0 and "dequantized to bfloat16 before the kernels (the forward runs on" in out
  from pallas_attn.kernels import backend, mosaic_backend
  monkeypatch.setattr(mosaic_backend, "unavailable", lambda: None)
  monkeypatch.setattr(backend, "default_interpret", lambda: False)
  for dtype, d, says in (("float8_e4m3fn", 128, "both products on fp8 wgmma"),
                         ("float8_e4m3fn", 64, "take head dims padded to 128"),
                         ("float8_e5m2", 128, "the fp8 products take float8_e4m3fn")):
    code, out, _ = run(capsys, "explain", "causal", "--seq-q", "256", "--d-qk", str(d),
                       "--dtype", dtype)
    assert code == 0 and says in out, out
    three_consumers = "tiles block_q=192 block_k=128 num_warps=16 num_stages=2"
    assert (three_consumers in out) == (says == "both products on fp8 wgmma"), out
    lazy = "a lazy running max in unmasked tiles (a row's moves when a tile raises it by over 8"
    assert (lazy in out) == (says == "both products on fp8 wgmma"), out


def test_explain_verbose_lists_pruned_configs(capsys, variant_file):
  code, out, _ = run(capsys, "explain", variant_file, *TINY, "--verbose")
  assert code == 0 and "pruned block_q=64" in out and "> padded seq_q 32" in out


@pytest.fixture
def rel_table_file(tmp_path):
  """A relative-position table read at q - kv (a hoisted diagonal term), 16 heads."""
  path = tmp_path / "rel.py"
  path.write_text("import jax.numpy as jnp\ntable = jnp.zeros((16, 8191))\n"
                  "def score_mod(s, b, h, q_idx, kv_idx):\n"
                  "  return s + table[h, q_idx - kv_idx + 4095]\n")
  return str(path)


def test_explain_says_what_the_diagonal_banks_cost(capsys, rel_table_file):
  code, out, _ = run(capsys, "explain", rel_table_file, "--heads", "16", "--seq-q", "4000",
                     "--templates", "forward")
  line, = [line for line in out.splitlines() if "diagonal banks" in line]
  config = re.search(r"forward: block_q=(\d+) block_k=(\d+)", out)
  block_q, block_k = int(config[1]), int(config[2])
  pad = lambda n, block: -(-n // block) * block
  expected = 16 * (pad(4000, block_q) + pad(4000, block_k)) * block_k * 4
  assert code == 0 and f"{expected / 2**20:.0f} MiB" in line and f", {block_k}] per term" in line


def test_explain_says_mosaic_reads_term_vectors(capsys, rel_table_file):
  code, out, _ = run(capsys, "explain", rel_table_file, "--heads", "16", "--seq-q", "4096",
                     "--templates", "forward_mosaic")
  line, = [line for line in out.splitlines() if "diagonal terms" in line]
  assert code == 0 and "1024 KiB" in line and "no bank" in line  # 16 x 8191 x 2 float32


def test_explain_says_what_the_block_mask_costs(capsys, tmp_path, variant_file):
  code, out, _ = run(capsys, "explain", variant_file, *TINY, "--templates", "forward")
  assert code == 0 and "block mask: a constant of the jitted call" in out
  documents = tmp_path / "documents.py"
  documents.write_text("import jax.numpy as jnp\nids = jnp.arange(32) // 8\n"
                       "def mask_mod(b, h, q_idx, kv_idx):\n"
                       "  return ids[q_idx] == ids[kv_idx]\n")
  code, out, _ = run(capsys, "explain", str(documents), *TINY, "--templates", "forward")
  line, = [line for line in out.splitlines() if line.startswith("block mask:")]
  assert code == 0 and "rebuilt in each call" in line and "1 x 1 x 32 x 32" in line
  assert "pallas_attn.block_mask(...)" in line


def test_tune_no_store(capsys, variant_file, cache_path):
  code, out, _ = run(capsys, "tune", variant_file, *TINY, "--max-candidates", "2",
                     "--no-store")
  assert code == 0 and "timed 2 of 2 configs" in out and not cache_path.exists()


def test_tune_linear_no_store(capsys, cache_path):
  code, out, _ = run(capsys, "tune-linear", "--decay", "head", *TINY, "--seq-q", "64",
                     "--max-candidates", "2", "--no-store")
  assert code == 0 and "decay head" in out and "timed 2 of 2 configs" in out
  assert not cache_path.exists()


@pytest.mark.parametrize("argv, message", [
    ([], "required"),
    (["tune", "x.py", "--batch", "0"], "expected a positive integer, got 0"),
    (["tune", "x.py", "--budget", "-1"], "expected a positive number"),
    (["tune", "x.py", "--template", "sideways"], "invalid choice"),
    (["tune", "x.py", "--heads", "6", "--kv-heads", "4"], "not a multiple of --kv-heads 4"),
    (["tune", "missing.py"], "no such variant file: missing.py"),
    (["cache", "list", "--bogus"], "unrecognized arguments: --bogus"),
    (["cache", "shred"], "invalid choice"),
])
def test_bad_arguments(capsys, argv, message):
  assert message in usage_error(capsys, *argv)


def test_unloadable_variant_files(capsys, tmp_path):
  broken = tmp_path / "broken.py"
  broken.write_text("raise ImportError('no such thing')\n")
  assert "cannot load variant file" in usage_error(capsys, "explain", str(broken))
  empty = tmp_path / "empty.py"
  empty.write_text("x = 1\n")
  assert "defines neither VARIANT nor" in usage_error(capsys, "explain", str(empty))


def test_uncompilable_variant_is_reported(capsys, tmp_path):
  sorting = tmp_path / "sorting.py"
  sorting.write_text("import jax.numpy as jnp\n"
                     "def score_mod(score, b, h, q_idx, kv_idx):\n"
                     "  return jnp.sort(jnp.stack([score, score]))[0]\n")
  code, _, err = run(capsys, "explain", str(sorting))
  assert code == 1 and "cannot be compiled" in err and "score_mod" in err


def test_unknown_variant_lists_known_ones(capsys):
  message = usage_error(capsys, "tune", "no_such_variant", *TINY)
  assert "unknown variant 'no_such_variant'" in message and "causal" in message


def test_tune_builtin_variant(capsys):
  code, out, err = run(capsys, "tune", "causal", *TINY, "--max-candidates", "2")
  assert code == 0, err
  assert "best:" in out


def test_cache_commands(capsys, tmp_path, cache_path):
  code, out, _ = run(capsys, "cache", "list")
  assert code == 0 and "0 entries" in out
  shipped = tmp_path / "shipped.json"
  shipped.write_text(json.dumps({"format": 1, "entries": {"k": {
      "key": {"template": "forward", "fingerprint": "abc"},
      "config": {"block_q": 16, "block_k": 16, "num_warps": 4, "num_stages": 1},
      "time_ms": 1.5, "baseline_ms": 3.0}}}))
  assert run(capsys, "cache", "merge", str(shipped))[1].startswith("merged 1 entries")
  code, out, _ = run(capsys, "cache", "list")
  assert "1 entries" in out and "fp=abc" in out and "block_q=16" in out and "(2.00x)" in out
  exported = tmp_path / "exported.json"
  assert run(capsys, "cache", "export", str(exported))[1].startswith("exported 1 entries")
  assert json.loads(exported.read_text())["entries"].keys() == {"k"}
  assert run(capsys, "cache", "clear")[1].startswith("removed 1 entries")
  bad = tmp_path / "bad.json"
  bad.write_text("[]")
  code, _, err = run(capsys, "cache", "merge", str(bad))
  assert code == 1 and "not a pallas_attn tuning cache" in err


def test_bench_file_variant(capsys, variant_file):
  code, out, err = run(capsys, "bench", variant_file, *TINY, "--seq-q", "64",
                       "--warmup", "1", "--reps", "2")
  assert code == 0, err
  rows = {line.split()[1]: line for line in out.splitlines()[2:]}
  assert set(rows) == set(bench.IMPLS)
  assert "cannot express variant" in rows["cudnn"] and "n/a" in rows["cudnn"]
  assert "n/a" not in rows["pallas_attn"] and "n/a" not in rows["xla"]


def test_bench_builtin_peers(capsys):
  code, out, err = run(capsys, "bench", "vanilla", "causal", *TINY, "--seq-q", "64",
                       "--impls", "xla", "jax_pallas_mha", "cudnn", "--warmup", "1",
                       "--reps", "2")
  assert code == 0, err
  lines = out.splitlines()[2:]
  assert len(lines) == 6
  assert all("n/a" not in line for line in lines if " xla " in line)


def test_bench_fwd_bwd_xla(capsys, variant_file):
  code, out, err = run(capsys, "bench", variant_file, *TINY, "--mode", "fwd_bwd",
                       "--impls", "xla", "--warmup", "1", "--reps", "2")
  assert code == 0, err
  assert "fwd_bwd" in out.splitlines()[0] and "n/a" not in out.splitlines()[2]


def test_format_table():
  table = bench.format_table([bench.Row("causal", "xla", "fwd", 1.23456, tflops=7.891),
                              bench.Row("causal", "cudnn", "fwd", None, note="needs a GPU")])
  lines = table.splitlines()
  assert lines[0].split() == ["case", "impl", "mode", "measure", "ms", "rate", "note"]
  assert lines[1].split() == ["causal", "xla", "fwd", "throughput", "1.235", "7.89", "TFLOP/s"]
  assert lines[2].split()[:5] == ["causal", "cudnn", "fwd", "throughput", "n/a"]


def test_bench_writes_results_file(capsys, tmp_path):
  path = tmp_path / "bench.json"
  code, out, err = run(capsys, "bench", "causal", *TINY, "--impls", "xla", "cudnn",
                       "--warmup", "1", "--reps", "2", "--json", str(path))
  assert code == 0, err
  doc = json.loads(path.read_text())
  assert doc["schema"] == bench.SCHEMA and doc["benchmark"] == "cli"
  assert {"device", "date", "versions", "commit"} <= doc.keys() and "jax" in doc["versions"]
  by_impl = {r["impl"]: r for r in doc["rows"]}
  assert by_impl["xla"]["time_ms"] > 0 and by_impl["cudnn"]["time_ms"] is None


def test_demo_delegates(capsys, monkeypatch):
  seen = []
  fake = types.SimpleNamespace(main=lambda argv=None: seen.append(argv) or 0)
  monkeypatch.setitem(sys.modules, "pallas_attn.demo", fake)
  monkeypatch.setattr(pallas_attn, "demo", fake, raising=False)
  assert cli.main(["demo", "--steps", "3", "--help"]) == 0
  assert seen == [["--steps", "3", "--help"]]


def test_bench_variant_peers_in_interpret_mode():
  """The peers of expressible variants run (cuDNN only on a GPU)."""
  shape = bench.ProblemShape.from_shapes((1, 64, 4, 16), (1, 64, 2, 16), (1, 64, 2, 16),
                                         "float32")
  rows = bench.bench_variant("causal", {"mask_mod": lambda b, h, q, k: q >= k}, shape,
                             impls=("cudnn", "jax_pallas_mha", "xla"), warmup=1, reps=2)
  by_impl = {r.impl: r for r in rows}
  assert by_impl["jax_pallas_mha"].time_ms > 0 and by_impl["xla"].tflops > 0
  assert by_impl["cudnn"].time_ms is None and by_impl["cudnn"].note


def test_explain_linear_says_which_lowering_runs_and_why(capsys):
  code, out, _ = run(capsys, "explain-linear", "--decay", "feature", *TINY)
  assert code == 0
  assert "decay feature" in out
  assert "on triton (mosaic_gpu not used: " in out
  code, out, _ = run(capsys, "explain-linear", "--decay", "none", "--delta", *TINY)
  assert code == 0 and "delta rule" in out and "backward on triton" in out


def test_alternating_rounds_reverse_every_other_round():
  """Every other round runs in reverse, so no side always follows the same one."""
  seen = []
  calls = {name: (lambda name=name: seen.append(name) or 1.0) for name in "abc"}
  samples, errors = bench.alternating_rounds(calls, 3, lambda call: call())
  assert seen == list("abccbaabc") and errors == {}
  assert samples == {name: [1.0] * 3 for name in "abc"}
