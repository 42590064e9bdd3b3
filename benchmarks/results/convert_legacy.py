"""One-off: moves the result files into <date>_<device>/ folders and rewrites
those that feed SUMMARY.md's tables in the harness's schema (pallas_attn.bench
SCHEMA). Every number is copied from the old file; the old file is in git.
Run once from the repository root: python benchmarks/results/convert_legacy.py
"""
import json
import os
import re
import statistics
import subprocess

HERE = "benchmarks/results"
SCHEMA = "pallas_attn.bench/1"


def load(name):
  with open(os.path.join(HERE, name)) as f:
    return json.load(f)


def env_of(environment, **extra):
  """The schema's header from an old `environment` dict."""
  versions = {k: environment.get(k) for k in ("python", "jax", "jaxlib", "torch", "triton")
              if environment.get(k)}
  return {"device": environment["device"], "device_count": 1, "platform": "gpu",
          "date": environment["date"][:10], "versions": versions, **extra}


def row(case, impl, mode, time_ms, measure, tflops=None, gb_s=None, note="", rounds=None,
        **extra):
  return {"case": case, "impl": impl, "mode": mode, "time_ms": time_ms, "tflops": tflops,
          "gb_s": gb_s, "note": note, "measure": measure, "rounds": rounds, "extra": extra}


def ratio(of, over, median, low, high, rounds):
  key = lambda k: dict(zip(("case", "impl", "mode"), k))
  return {"of": key(of), "over": key(over), "measure": "kernel", "median": median,
          "range": [low, high], "rounds": rounds}


def write(folder, name, benchmark, header, rows, ratios, old, command, notes=""):
  """A results file in the schema, from the old file `old` (which git keeps)."""
  doc = {"schema": SCHEMA, "benchmark": benchmark, "commit": None, **header, "command": command,
         "notes": (notes + " " if notes else "") + f"Converted to the harness schema from "
                  f"benchmarks/results/{old} (git history has the original).",
         "rows": rows, "ratios": ratios}
  os.makedirs(os.path.join(HERE, folder), exist_ok=True)
  with open(os.path.join(HERE, folder, name), "w") as f:
    json.dump(doc, f, indent=1)
  subprocess.run(["git", "add", os.path.join(HERE, folder, name)], check=True)


def retire(old):
  subprocess.run(["git", "rm", "-q", os.path.join(HERE, old)], check=True)


# ----------------------------------------------------------------------------- bench_mosaic
MOSAIC_CASES = {"alibi_4k": "alibi_causal_4k", "dqk192_4k": "vanilla_4k_dqk192",
                "d64_4k": "vanilla_4k_d64", "d256_4k": "vanilla_4k_d256"}
MOSAIC_IMPLS = {"mosaic_gpu": "pallas_attn:mosaic_gpu", "triton": "pallas_attn:triton",
                "jax_mgpu_fp16": "jax_mosaic_fp16", "cudnn": "cudnn", "flex": "flex"}
MOSAIC_SHAPES = {"vanilla_16k": (1, 16384, 128, 128), "causal_16k": (1, 16384, 128, 128),
                 "dqk192_4k": (4, 4096, 192, 128), "d64_4k": (4, 4096, 64, 64),
                 "d256_4k": (4, 4096, 256, 256)}


def mosaic(old, new, command):
  d = load(old)
  rows, ratios = [], []
  for r in d["rows"]:
    case, mode = MOSAIC_CASES.get(r["row"], r["row"]), r["mode"].replace("fwdbwd", "fwd_bwd")
    batch, seq, d_qk, d_v = MOSAIC_SHAPES.get(r["row"], (4, 4096, 128, 128))
    flops = 2.0 * batch * 16 * seq * seq * (d_qk + d_v) * r["density"] * (
        3.5 if mode == "fwd_bwd" else 1.0)
    for side, tflops in r["tflops"].items():
      impl = MOSAIC_IMPLS[side.removesuffix("_throughput")]
      if side.endswith("_throughput"):
        rows.append(row(case, impl, mode, flops / tflops / 1e9, "throughput", tflops))
        continue
      extra = {}
      if side == "mosaic_gpu":
        extra["lowering"] = r.get("lowering")
      if side == "triton" and r.get("mosaic_vs_triton_rel_err") is not None:
        extra = {"rel_err": r["mosaic_vs_triton_rel_err"], "rel_err_vs": "pallas_attn:mosaic_gpu"}
      samples = r["kernel_ms_rounds"][side]
      rows.append(row(case, impl, mode, statistics.median(samples), "kernel", tflops,
                      rounds=samples, **extra))
    for side, error in r["errors"].items():
      rows.append(row(case, MOSAIC_IMPLS.get(side, side), mode, None, "kernel", note=error))
    for label, value in r.get("ratio_rounds", {}).items():
      peer = MOSAIC_IMPLS[label.split("/")[1]]
      ratios.append(ratio((case, peer, mode), (case, "pallas_attn:mosaic_gpu", mode),
                          value["median"], *value["range"], len(r["kernel_ms_rounds"]["mosaic_gpu"])))
  write("2026-11-25_h200", new, "training", env_of(d["environment"], commit="e32c658"), rows,
        ratios, old, command, "Ours is implementation='mosaic_gpu' (kernels as of 8cc4229).")
  retire(old)


def mosaic_memory():
  d = load("mosaic_memory_2026-11-25_h200.json")
  rows = []
  for r in d["memory"]:
    case = f"{r['variant']}_{r['seq'] // 1024}k"
    for key, size in r["bytes"].items():
      side, mode = key.rsplit("_", 1)
      rows.append(row(case, MOSAIC_IMPLS[side], mode.replace("fwdbwd", "fwd_bwd"), None,
                      "compiled_memory", bytes=size))
  write("2026-11-25_h200", "mosaic_memory.json", "training",
        env_of(d["environment"], commit="e32c658"), rows, [], "mosaic_memory_2026-11-25_h200.json",
        "benchmarks/bench_mosaic.py --memory-seqs 16384,65536",
        "XLA's memory analysis: temporaries + outputs, B1 H16 d128 bf16.")
  retire("mosaic_memory_2026-11-25_h200.json")


# ----------------------------------------------------------------------------- bench_parity
PARITY_CASES = {"alibi": "alibi_causal_4k", "rel_table": "rel_table_4k",
                "t5_buckets": "t5_buckets_4k", "vanilla_causal": "causal_4k", "sink": "sink_4k",
                "rel_table_dtable": "rel_table_dtable_4k",
                "t5_buckets_dtable": "t5_buckets_dtable_4k"}
PARITY_IMPLS = {"ours": "pallas_attn", "flex": "flex"}


def parity(old, folder, new, header_extra, command, notes):
  d = load(old)
  samples = (d.get("rounds") or {}).get("samples", {})
  rows = []
  for name, cell in d["rows"].items():
    case = PARITY_CASES[name]
    for side, impl in PARITY_IMPLS.items():
      for mode in ("fwd", "fwd_bwd"):
        if f"{side}_{mode}_ms" not in cell:
          continue
        flops = cell[f"flops_{mode}"]
        wall, kernel = cell[f"{side}_{mode}_ms"], cell.get(f"{side}_{mode}_kernel_ms")
        errors = [e.split(": ", 1)[1] for e in d["errors"]
                  if e.startswith(f"{side} {name} {mode}:")]
        extra = ({"rel_err": cell["flex_vs_ours_rel_err"], "rel_err_vs": "pallas_attn"}
                 if side == "flex" and mode == "fwd" and cell.get("flex_vs_ours_rel_err") else {})
        rows.append(row(case, impl, mode, wall, "throughput" if side == "ours" else "do_bench",
                        wall and flops / wall / 1e9, note=errors[0] if errors else ""))
        if kernel is not None:
          later = samples.get(f"{name} {side} {mode}")
          rows.append(row(case, impl, mode, kernel, "kernel", flops / kernel / 1e9,
                          **extra, **({"later_rounds": later} if later else {})))
  ratios = []
  for label, value in ((d.get("rounds") or {}).get("ratios") or {}).items():
    words = label.split()
    if words[0].startswith("flex/ours"):
      of, over = (PARITY_CASES[words[1]], "flex", words[2]), (PARITY_CASES[words[1]],
                                                               "pallas_attn", words[2])
    else:
      num, den = words[0].split("/")
      num, den = ("sink", "vanilla_causal") if num == "sink" else (num, den)
      of, over = (PARITY_CASES[num], "pallas_attn", words[1]), (PARITY_CASES[den],
                                                                "pallas_attn", words[1])
    ratios.append(ratio(of, over, value["median"], *value["range"], d["rounds"]["rounds"]))
  write(folder, new, "training", env_of(d["environment"], **header_extra), rows, ratios, old,
        command, notes)
  retire(old)


# ----------------------------------------------------------------------------- others
def block_mask():
  d = load("block_mask_2026-11-23_h100_corners.json")
  names = {"sliding_window_1024": "window1024", "documents_8": "documents8",
           "documents_8_same": "documents8_same", "documents_8_jit": "documents8_jit"}
  rows = []
  for r in d["eager"]:
    case = f"{names.get(r['mask'], r['mask'])}_{r['seq'] // 1024}k"
    breakdown = {k: r[k] for k in ("host_ms", "dispatch_ms", "builder_ms", "fast_path")
                 if r[k] is not None}
    rows.append(row(case, "pallas_attn", "build", r["ms"], "wall", first_ms=r["first_ms"],
                    **breakdown))
    if r["flex_ms"] is not None:
      rows.append(row(case, "flex", "build", r["flex_ms"], "wall", first_ms=r["flex_first_ms"]))
  for r in d["forward"]:
    case = f"documents8_{r['seq'] // 1024}k"
    tiles = {"block_q": r["block_q"], "block_k": r["block_k"]}
    rows.append(row(case, r["case"], "fwd", r["ms"], "throughput", **tiles))
    rows.append(row(case, r["case"], "fwd", r["kernel_ms"], "kernel", kernels=r["kernels"]))
  write("2026-11-23_h100", "block_mask.json", "block_mask",
        env_of(d["environment"], commit="82efbab"), rows, [],
        "block_mask_2026-11-23_h100_corners.json", "benchmarks/bench_block_mask.py",
        "B1 H16; the forward bf16 d128 with 8 causal documents.")
  retire("block_mask_2026-11-23_h100_corners.json")


def train_lm(framework, variant):
  old = f"train_lm_{framework}_{variant}_2026-11-24_h200.json"
  d = load(old)
  case = f"train_lm_{framework}_{variant}"
  rows = [row(case, label, "train_step", r["step_ms"], "throughput",
              tokens_per_s=r["tokens_per_s"], final_loss=r["losses"][-1],
              val_loss=r["val_loss"]) for label, r in d["results"].items()]
  rows += [row(case, label, "train_step", None, "throughput", note=reason)
           for label, reason in d["skipped"].items()]
  header = {"device": d["device"], "device_count": 1, "platform": "gpu", "date": "2026-11-24",
            "versions": {"jax": d["jax"]}}
  write("2026-11-24_h200", f"train_example_{framework}_{variant}.json", "train_example", header,
        rows, [], old, f"python examples/train_lm.py --variant {variant} --framework {framework}",
        f"config {d['config']}; at 70f0847 plus the one-second step windows; the example's own "
        f"file (loss curves) is kept beside.")


def decode():
  d = load("decode_2026-11-23_h200.json")
  rows = []
  for name, cell in d["cases"].items():
    gbytes = cell["kv_bytes"] / 1e9
    for impl in ("decode", "paged", "attention", "parallel", "cudnn", "flex"):
      e = cell[impl]
      extra = {"rel_err": e["rel_err_vs_reference"]} if e.get("rel_err_vs_reference") is not None else {}
      rows.append(row(name, impl, "decode", e["ms"], "events" if impl == "flex" else "throughput",
                      gb_s=gbytes / e["ms"] * 1e3, **extra))
      rows.append(row(name, impl, "decode", e["kernel_ms"], "kernel",
                      gb_s=gbytes / e["kernel_ms"] * 1e3))
  write("2026-11-23_h200", "decode.json", "decoding", env_of(d["environment"]), rows, [],
        "decode_2026-11-23_h200.json", "benchmarks/bench_decode.py",
        f"HBM peak {d['hbm_peak_tb_s']} TB/s. bf16 Hq32 Hkv8 d128; rel_err against cuDNN's "
        "output (decode's where cuDNN has none).")
  retire("decode_2026-11-23_h200.json")


def context_parallel():
  d = load("context_parallel_2026-11-24_h200x2.json")
  rows = []
  for r in d["rows"]:
    case = f"causal_{r['seq'] // 1024}k"
    for side, impl in (("single", "pallas_attn"), ("ring", "ring")):
      for mode in ("fwd", "fwd_bwd"):
        cell = r[side][mode]
        rows.append(row(case, impl, mode, cell["ms"], "throughput", cell["tflops"],
                        devices=r[side]["devices"],
                        compiled_bytes_per_gpu=cell["compiled_bytes_per_gpu"],
                        peak_bytes_per_gpu=cell["peak_bytes_per_gpu"]))
  header = env_of(d["environment"], commit="7f52c5e")
  header["device_count"] = 2
  write("2026-11-24_h200x2", "multi_gpu.json", "multi_gpu", header, rows, [],
        "context_parallel_2026-11-24_h200x2.json",
        "benchmarks/bench_context_parallel.py --seqs 131072",
        "NCCL_NVLS_ENABLE=0; causal bf16 B1 H16 d128.")
  retire("context_parallel_2026-11-24_h200x2.json")


MASK_CASES = {"vanilla": "vanilla_4k", "causal": "causal_4k", "softcap": "softcap_4k",
              "alibi": "alibi_4k", "sliding_window_256": "window256_4k",
              "sliding_window_1024": "window1024_4k", "documents_8": "documents8_4k"}


def masks():
  old = "masks_2026-11-21_h200_sixth.json"
  d = load(old)
  peers = d["peers"]
  rows = []
  for r in peers["peers"]:
    case = MASK_CASES[r["variant"]]
    for impl, key, measure in (("pallas_attn", "ours_ms", "amortized"),
                               ("xla", "xla_ms", "amortized"),
                               ("cudnn:dense", "cudnn_ms", "amortized"),
                               ("flex", "flex_ms", "do_bench"),
                               ("pallas_attn", "ours_kernel_ms", "kernel"),
                               ("cudnn:dense", "cudnn_kernel_ms", "kernel"),
                               ("flex", "flex_kernel_ms", "kernel")):
      if r[key] is not None:
        rows.append(row(case, impl, "fwd", r[key], measure, r["flops"] / r[key] / 1e9))
  write("2026-11-21_h200", "masks.json", "training", env_of(peers["environment"],
                                                            commit="cde077a"),
        rows, [], old, "benchmarks/bench_masks.py --parts peers",
        "Ours (the Triton template of that date) with a block mask built once; B4 H16 S4096 "
        "d128 bf16.")

  wide = d["causal_window_wide_keys"]
  rows = []
  for r in wide["causal"]:
    size = f"{r['seq'] // 1024}k"
    for case, impl, key in ((f"vanilla_{size}", "pallas_attn", "dense"),
                            (f"causal_{size}", "pallas_attn", "causal"),
                            (f"causal_{size}", "jax_pallas_mha", "pallas_ref_causal"),
                            (f"causal_{size}", "cudnn", "cudnn_causal")):
      rows.append(row(case, impl, "fwd", r[f"{key}_ms"], "amortized"))
      if r.get(f"{key}_kernel_ms") is not None:
        rows.append(row(case, impl, "fwd", r[f"{key}_kernel_ms"], "kernel"))
  for r in wide["window"]:
    rows.append(row(f"window{r['window']}_{r['seq'] // 1024}k", "pallas_attn", "fwd", r["ms"],
                    "amortized"))
  write("2026-11-21_h200", "causal.json", "training", env_of(wide["environment"]), rows, [], old,
        "benchmarks/bench_masks.py --parts causal window",
        "After masked variants took 128x128 forward tiles (the Triton template); bf16 H16 d128, "
        "16k tokens.")

  rows = []
  for r in d["causal_tiles_ab"]:
    config = "heuristic" if r["cfg"] is None else "x".join(map(str, r["cfg"]))
    for case, key in ((f"causal_{r['seq'] // 1024}k", "causal_ms"),
                      (f"vanilla_{r['seq'] // 1024}k", "dense_ms")):
      rows.append(row(case, f"pallas_attn:{config}", "fwd", statistics.median(r[key]), "kernel",
                      rounds=r[key]))
  write("2026-11-21_h200", "ab_causal_tiles.json", "ab", env_of(wide["environment"]), rows, [],
        old, "a one-off A/B script (not kept)",
        "The A/B that chose 128x128 forward tiles for masked variants: the causal forward per "
        "tile config (block_q x block_k x warps x stages; heuristic = the old 128x64) beside the "
        "dense heuristic forward, two alternating rounds.")
  retire(old)


LINEAR_IMPLS = {"ours": "ours", "fla": "fla", "scan": "scan", "xla_chunked": "xla_chunked"}


def linear():
  old = "linear_2026-11-21_h200_sixth.json"
  d = load(old)
  rows, ratios = [], []
  for run in d["bench_linear"].values():
    for r in run["results"]:
      case = f"{r['shape']}_{r['seq_len'] // 1024}k"
      for impl in LINEAR_IMPLS:
        cell = r[impl]
        measure = "do_bench" if impl == "fla" else "amortized"
        for mode in ("fwd", "fwd_bwd"):
          ms = cell.get(f"{mode}_ms")
          if isinstance(ms, float):
            rows.append(row(case, impl, mode, ms, measure))
          elif cell.get(f"{mode}_error") or cell.get("error") or isinstance(ms, str):
            rows.append(row(case, impl, mode, None, measure,
                            note=cell.get(f"{mode}_error") or cell.get("error") or ms))
      kt = r.get("kernel_time", {})
      for mode in ("fwd", "fwd_bwd"):
        for impl in ("ours", "fla"):
          if f"{impl}_{mode}_ms" in kt:
            rows.append(row(case, impl, mode, kt[f"{impl}_{mode}_ms"], "kernel"))
        if f"fla_over_ours_{mode}" in kt:
          ratios.append(ratio((case, "fla", mode), (case, "ours", mode),
                              kt[f"fla_over_ours_{mode}"], *kt[f"fla_over_ours_{mode}_range"],
                              kt["rounds"]))
    for shape, sizes in run["forward_memory_at_longest_seq"].items():
      if sizes["seq_len"] == 16384:
        rows.append(row(f"{shape}_16k", "ours", "fwd", None, "compiled_memory",
                        bytes=sizes["peak_bytes"]))
  meta = d["bench_linear"]["s4096"]["meta"]
  header = {"device": meta["device"], "device_count": 1, "platform": "gpu",
            "date": "2026-11-21", "versions": {"flash-linear-attention" if k == "fla" else k: v
                                              for k, v in meta["versions"].items()}}
  write("2026-11-21_h200", "linear.json", "linear", dict(header, commit="cde077a"), rows, ratios,
        old,
        "benchmarks/bench_linear.py --seq 4096 --rounds 3; --seq 8192 / 16384 --skip-scan "
        "--rounds 3 (three invocations)",
        "B4 bf16; the kernel-time rows are medians of 3 alternating rounds, ours and fla's. "
        "The timer investigation of that run (timer_check, kernels_before_timer_change) is in "
        "the original.")
  retire(old)


PREF_IMPLS = {"pallas_attn": "pallas_attn", "cudnn": "cudnn", "pallas_ref": "jax_pallas_mha",
              "xla": "xla"}


def softmax_pass(old, mode, new):
  d = load(old)
  rows = []
  for r in d["softmax"]:
    case = f"{'causal' if r['causal'] else 'vanilla'}_{r['seq'] // 1024}k" + (
        "_d64" if r["d"] == 64 else "")
    for side, impl in PREF_IMPLS.items():
      if side in r:
        cell = r[side]
        rows.append(row(case, impl, mode, cell and cell["ms"], "amortized",
                        cell and cell["tflops"]))
  for r in d["variants"]:
    name = {"sliding_window": "window256", "dqk192_dv128": "vanilla_dqk192"}.get(
        r["variant"], r["variant"])
    for side in ("pallas_attn", "xla"):
      cell = r.get(side)
      rows.append(row(f"{name}_4k", side, mode, cell and cell["ms"], "amortized",
                      cell and cell["tflops"]))
  for r in d["memory"]:
    for side in ("pallas_attn", "cudnn", "xla"):
      if f"{side}_bytes" in r:
        size = r[f"{side}_bytes"]
        rows.append(row(f"vanilla_{r['seq'] // 1024}k", side, mode, None, "compiled_memory",
                        note="" if size else "does not compile", **({"bytes": size} if size else {})))
  write("2026-11-21_h200", new, "training", env_of(d["environment"]), rows, [], old,
        f"benchmarks/bench_{'backward' if mode == 'fwd_bwd' else 'forward'}.py",
        "bf16 H16, batch 16k tokens / S; the Triton template of that date; amortized_time_ms "
        "for every side.")
  retire(old)


def tune():
  old = "tune_2026-11-21_h200.json"
  d = load(old)
  rows = []
  for r in d["results"]:
    variant, seq, dim = re.match(r"(\w+) S=(\d+) d=(\d+)", r["case"]).groups()
    case = {"softcap": "softcap50", "sliding_window": "window256"}.get(variant, variant) + (
        f"_{int(seq) // 1024}k" + ("_d64" if dim == "64" else ""))
    for impl in ("heuristic", "tuned"):
      rows.append(row(case, impl, "fwd", r[f"{impl}_ms"], "tuner", r[f"{impl}_tflops"],
                      template="forward", config=r[f"{impl}_config"],
                      tuning_s=r["tuning_s"]))
  header = {"device": d["device"], "device_count": 1, "platform": "gpu", "date": "2026-11-21",
            "versions": d["versions"]}
  write("2026-11-21_h200", "tune.json", "training", header, rows, [], old,
        "benchmarks/bench_tune.py",
        f"settings {d['settings']}; softcap50 is softcap at cap 50 (variants.by_name).")
  retire(old)


KEPT_LOGS = {"gpu_tests_2026-11-25_h200.log", "gpu_tests_rest_2026-11-25_h200.log",
             "gpu_tests_term_pairs_2026-11-24_h200.log", "gpu_tests_layers_2026-11-24_h200.log",
             "gpu_tests_decode_2026-11-23_h200.log"}
SUPERSEDED = re.compile(r"^(mosaic(_backward)?_2026-11-2[34]|parity_|masks_|linear_2026-11-21_h200"
                        r"_(fifth|partial)|forward_2026-11-21_h200_initial|block_mask_2026-11-23"
                        r"_h100(_mosaic)?\.json$|gpu_tests_)")


def move_rest():
  """The other files into <date>_<device>/ without the date and device in their
  names (undated ones are of 2026-11-21); superseded runs and logs deleted."""
  for name in sorted(os.listdir(HERE)):
    path = os.path.join(HERE, name)
    if os.path.isdir(path) or name in ("SUMMARY.md", "NOTES.md", os.path.basename(__file__)):
      continue
    if SUPERSEDED.match(name) and name not in KEPT_LOGS:
      retire(name)
      continue
    found = re.search(r"_(\d{4}-\d{2}-\d{2})_(h100|h200x2|h200)", name)
    if found:
      folder = f"{found.group(1)}_{found.group(2)}"
    else:
      found = re.search(r"_(h100|h200)(?=[_.])", name)
      folder = f"2026-11-21_{found.group(1)}"
    os.makedirs(os.path.join(HERE, folder), exist_ok=True)
    subprocess.run(["git", "mv", path, os.path.join(HERE, folder, name[:found.start()]
                                                    + name[found.end():])], check=True)


def main():
  mosaic("mosaic_2026-11-25_h200_fwd.json", "mosaic_fwd.json",
         "benchmarks/bench_mosaic.py --modes fwd --rounds 3")
  mosaic("mosaic_2026-11-25_h200_fwdbwd.json", "mosaic_fwdbwd.json",
         "benchmarks/bench_mosaic.py --modes fwdbwd --rounds 3")
  mosaic_memory()
  parity("parity_2026-11-24_h200_term_pairs.json", "2026-11-24_h200", "parity_term_pairs.json",
         {}, "benchmarks/bench_parity.py --rows alibi rel_table t5_buckets vanilla_causal sink "
         "--no-checks --rounds 3", "Committed after 1e68ca8; B4 H16 S4096 d128 bf16 causal, "
         "block mask built once. Kernel rows: one measurement; later_rounds: the rounds the "
         "ratios come from.")
  parity("parity_2026-11-23_h100_hoisted.json", "2026-11-23_h100", "parity_hoisted.json", {},
         "benchmarks/bench_parity.py", "B4 H16 S4096 d128 bf16 causal, block mask built once.")
  block_mask()
  for framework, variant in (("flax", "softcap"), ("flax", "vanilla"), ("equinox", "vanilla")):
    train_lm(framework, variant)
  decode()
  context_parallel()
  masks()
  linear()
  softmax_pass("backward_2026-11-21_h200.json", "fwd_bwd", "backward.json")
  softmax_pass("forward_2026-11-21_h200.json", "fwd", "forward.json")
  tune()
  move_rest()


if __name__ == "__main__":
  main()
