"""examples/train_lm.py's tiny configuration (interpret mode on CPU, as CI
runs it; compiled on GPU through `default_mode`)."""
import importlib.util
import json
import pathlib
import sys

import numpy as np
import pytest

for _module in ("flax", "equinox", "optax"):
  pytest.importorskip(_module, reason="needs the test extra: pip install '.[test]'")

pytestmark = pytest.mark.usefixtures("exact_matmuls")
EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_lm.py"


@pytest.fixture(scope="module")
def train_lm():
  spec = importlib.util.spec_from_file_location("train_lm", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  sys.modules["train_lm"] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("args", [
    pytest.param(["--variant", "alibi_window", "--steps", "50"], id="flax-alibi_window"),
    pytest.param(["--framework", "equinox", "--steps", "6"], id="equinox-vanilla")])
def test_tiny_run_learns_and_matches_its_peer(train_lm, args, default_mode, tmp_path):
  record = train_lm.main(["--tiny", "--out", str(tmp_path), *args])
  results = record["results"]
  ours = np.asarray(results["pallas_attn"]["losses"])
  peer = next(label for label in results if label != "pallas_attn")
  assert ours[-1] < ours[0], ours  # it learns
  # Same weights, same batches: the curves agree to float32 rounding, every step.
  np.testing.assert_allclose(ours, results[peer]["losses"], rtol=1e-4)
  written = json.loads(next(tmp_path.glob("train_lm_*.json")).read_text())
  assert written["results"]["pallas_attn"]["losses"] == list(ours)


def test_same_arguments_same_losses(train_lm, default_mode, tmp_path):
  runs = [train_lm.main(["--tiny", "--steps", "4", "--peers", "none", "--out",
                         str(tmp_path / str(n))])["results"]["pallas_attn"]["losses"]
          for n in range(2)]
  assert runs[0] == runs[1]


def test_check_steps_compares_attention_gradients(train_lm, default_mode, tmp_path):
  record = train_lm.main(["--tiny", "--check-steps", "2", "--out", str(tmp_path)])
  checks = record["check_steps"]
  assert [c["step"] for c in checks] == [1, 2]
  for check in checks:
    assert {layer["param"].split(".")[-2] for layer in check["layers"]} == {
        "query", "key", "value", "out"}
    assert max(layer["rel_err"] for layer in check["layers"]) < 1e-4, check
    assert check["loss"] == pytest.approx(check["peer_loss"], rel=1e-5)
