"""Regenerates benchmarks/results/SUMMARY.md: the current tables against the
targets, from the newest results.

    python benchmarks/summarize.py

Results live in `benchmarks/results/<date>_<device>/`, in the harness's
schema (`pallas_attn.bench.SCHEMA`). Each table comes from the newest folder
whose files hold all of its cells, each cell from the latest file there that
has it, and names those files. A ratio is the per-round median [range] the
run recorded for it, else the ratio of the two times. Hand-written context
comes from results/NOTES.md, one `## <key>` section per table, of which
SUMMARY.md takes the first paragraph (what the rows are, which runs) and points
to the rest (the design, its evidence, what was tried); its `## history` (what
was tried and superseded) is listed by subject only: SUMMARY.md keeps to the
current tables (issue 43). Issue 39's delta-rule table
reads the newest `delta_rule_kernels.json` (per-kernel times, its own layout);
issues 41/42's newest `multi_gpu*.json` runs (`*_before.json`: the
code before).
"""
from __future__ import annotations

import glob
import json
import math
import os
import re
import statistics

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SCHEMA = "pallas_attn.bench/1"  # pallas_attn.bench.SCHEMA (no JAX needed here)
WALL = ("throughput", "amortized", "do_bench", "events")  # a wall-clock measure, newest first
OURS = "pallas_attn:mosaic_gpu"
MODES = {"fwd": "forward", "fwd_bwd": "forward+backward"}
TABLES = [("table", "rel_table_4k"), ("T5", "t5_buckets_4k")]
METHOD = ("Method. bf16 unless said; TFLOP/s count unmasked (q, kv) pairs, a backward counts "
          "2.5 forwards. JAX and PyTorch calls are timed by device throughput (`median_time_ms`: "
          "back-to-back calls, one wait per window) and, with PyTorch on the GPU, by kernel time "
          "(CUPTI), in alternating rounds (from 2026-11-28 every other round reversed: a 16k "
          "call right after a heavy one ran up to 8% slower): a ratio is the median [range] of "
          "the per-round ratios "
          "where the run recorded rounds, else the ratio of two times. Never `do_bench` on JAX "
          "(its events time JAX's dispatch too: 50-70 us per call); runs before 2026-11-22 timed "
          "JAX by `amortized_time_ms`; every row names its measure. One kernel varies by up to "
          "~10% between runs (CUPTI rounds on the H200 up to 4%): for A/Bs of ~1%, Nsight "
          "Compute's locked-clock durations; an A/B of two builds of one call in one process "
          "clears `pa.api._attention.clear_cache()` and `jax.clear_caches()` before compiling "
          "each build ahead of time (`jax.jit(f).lower(...).compile()`: a jitted function "
          "retraces after a clear, taking whatever build is current). Each table names "
          "its files under `benchmarks/results/` (git has earlier tables and the one-off "
          "scripts); under it, its issue's targets, each met or **missed**, then notes.")


class Folder:
  """The results files of one `<date>_<device>` folder, latest first."""

  def __init__(self, path: str):
    self.files = []
    for name in glob.glob(os.path.join(path, "*.json")):
      with open(name) as f:
        doc = json.load(f)
      if isinstance(doc, dict) and doc.get("schema") == SCHEMA and not doc.get("small"):
        doc["path"] = os.path.relpath(name, RESULTS)
        self.files.append(doc)
    self.files.sort(key=lambda d: (d.get("time", d["date"]), d["path"]), reverse=True)


class Source:
  """One table's cells: the newest folder holding measurements of all of
  `required` [(case, impl, mode, measures)], and the files its cells came from."""

  def __init__(self, folders: list[Folder], required: list):
    self.used = []
    for folder in folders:
      self.files = folder.files
      if all(self._find(*key, measured=True) for key in required):
        complete = [d for d in folder.files  # files holding them all come first
                    if all(self._find(*key, [d], measured=True) for key in required)]
        self.files = complete + [d for d in folder.files if d not in complete]
        return
    raise LookupError(f"no results hold {required[0]}")

  def _find(self, case, impl, mode, measures, files=None, measured=False):
    for measure in measures:
      for doc in files or self.files:
        for r in doc["rows"]:
          if ((r["case"], r["impl"], r["mode"], r["measure"]) == (case, impl, mode, measure)
              and not (measured and r["time_ms"] is None and "bytes" not in r["extra"])):
            return doc, r
    return None

  def row(self, case, impl, mode, measures=("kernel",)) -> dict | None:
    found = self._find(case, impl, mode, measures)
    if found is None:
      return None
    if found[0] not in self.used:
      self.used.append(found[0])
    return found[1]

  def failure(self, case, impl, mode) -> str | None:
    """The note of a row that could not run, whatever its measure."""
    for doc in self.files:
      for r in doc["rows"]:
        if (r["case"], r["impl"], r["mode"]) == (case, impl, mode) and r["time_ms"] is None:
          return r["note"]
    return None

  def ratio(self, of, over, measures=("kernel",)) -> tuple[float, list] | None:
    """(value, [low, high] or None): time of `of` over `over`, each (case, impl, mode)."""
    for doc in self.files:
      for r in doc["ratios"]:
        if (r["measure"] in measures and (tuple(r["of"].values()),
                                          tuple(r["over"].values())) == (of, over)):
          return r["median"], r["range"]
    a, b = self.row(*of, measures), self.row(*over, measures)
    if a and b and a["time_ms"] and b["time_ms"]:
      return a["time_ms"] / b["time_ms"], None
    return None

  def caption(self) -> str:
    """Device, date, versions and commit of the files used, and their names."""
    doc = self.used[0]
    versions = ", ".join(f"{k} {v}" for k, v in doc["versions"].items()
                         if v and k in ("jax", "torch", "triton", "flash-linear-attention"))
    commit = f"; commit {doc['commit']}" if doc.get("commit") else ""
    files = ", ".join(f"`{d['path']}`" for d in self.used)
    return f"{doc['device']}, {doc['date']}, {versions}{commit}. Files: {files}."


def table(header: list[str], rows: list[list[str]]) -> list[str]:
  return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
          + ["| " + " | ".join(r) + " |" for r in rows])


def num(x, spec=".2f") -> str:
  return "–" if x is None else format(x, spec)


def tflops(row) -> str:
  return "–" if row is None or row["tflops"] is None else f"{row['tflops']:.0f}"


def mib(row) -> str:
  return "–" if not row else f"{row['extra']['bytes'] / 2**20:.0f} MiB"


def decimal_bytes(row) -> str:
  if not row:
    return "–"
  if "bytes" not in row["extra"]:
    return "does not compile"
  size = row["extra"]["bytes"]
  return f"{size / 1e9:.3g} GB" if size >= 1e9 else f"{size / 1e6:.0f} MB"


def ratio_cell(found, with_range=False, spec=".2f") -> str:
  if found is None:
    return "–"
  value, span = found
  text = format(value, spec)
  if with_range and span:
    text += f" [{span[0]:{spec}}-{span[1]:{spec}}]"
  return text


def met(ok: bool) -> str:
  return "met" if ok else "**missed**"


class Failures:
  """Cells whose implementation could not run: "fails*", the reasons under the table."""

  def __init__(self):
    self.notes = {}

  def cell(self, src: Source, case, impl, mode) -> str:
    note = src.failure(case, impl, mode)
    if not note:
      return "–"
    self.notes.setdefault(note, f"{impl} {mode}")
    return "fails*"

  def lines(self) -> list[str]:
    return [""] + [f"\\* {where}: {note[:150]}" for note, where in self.notes.items()]


# ----------------------------------------------------------------------------- tables

VARIANT_ROWS = [("vanilla 4k", "vanilla_4k"), ("causal 4k", "causal_4k"),
                ("vanilla 16k", "vanilla_16k"), ("causal 16k", "causal_16k"),
                ("softcap 30", "softcap_4k"), ("ALiBi (causal)", "alibi_causal_4k"),
                ("window 256", "window256_4k"), ("window 1024", "window1024_4k"),
                ("8 documents (causal)", "documents8_4k"), ("sigmoid", "sigmoid_4k"),
                ("Dqk 192 / Dv 128", "vanilla_4k_dqk192"), ("d 64", "vanilla_4k_d64"),
                ("d 256", "vanilla_4k_d256")]
ISSUE_VARIANTS = VARIANT_ROWS[:11]  # d 64 and d 256 are not among issue 15's variants


def variants(folders) -> list[str]:
  src = Source(folders, [(c, OURS, m, ("kernel",)) for _, c in VARIANT_ROWS
                         for m in ("fwd", "fwd_bwd")])
  peers = ("cudnn", "flex", "pallas_attn:triton")
  rows, speed = [], {}
  for label, c in VARIANT_ROWS:
    cells = [tflops(src.row(c, impl, "fwd")) for impl in (OURS, *peers, "jax_mosaic_fp16")]
    cells += [tflops(src.row(c, impl, "fwd_bwd")) for impl in (OURS, *peers)]
    for peer in peers:
      for mode in MODES:
        speed[label, peer, mode] = src.ratio((c, peer, mode), (c, OURS, mode))
        cells.append(ratio_cell(speed[label, peer, mode], with_range=peer == "cudnn"))
    rows.append([label] + cells)
  header = ["row", "ours fwd", "cuDNN fwd", "Flex fwd", "Triton fwd", "JAX Mosaic fwd (fp16)",
            "ours f+b", "cuDNN f+b", "Flex f+b", "Triton f+b", "fwd / cuDNN", "f+b / cuDNN",
            "fwd / Flex", "f+b / Flex", "fwd / Triton", "f+b / Triton"]
  lines = [src.caption(), "", *table(header, rows), ""]
  for mode, floor in (("fwd", 1.0), ("fwd_bwd", 0.9)):
    found = {label: speed[label, "cudnn", mode] for label, _ in VARIANT_ROWS[:4]}
    lowest = min(f[1][0] if f[1] else f[0] for f in found.values())
    lines.append(f"- {MODES[mode].capitalize()} >= {floor}x cuDNN on vanilla and causal: "
                 + ", ".join(f"{label} {f[0]:.2f}" for label, f in found.items())
                 + f" (lowest round {lowest:.2f}): "
                 f"{met(min(f[0] for f in found.values()) >= floor)}.")
  for peer, rows_of, floor, what in (
      ("flex", ISSUE_VARIANTS, 1.2, "Every variant of the issue (rows to Dqk 192) >= 1.2x Flex"),
      ("pallas_attn:triton", VARIANT_ROWS, 1.0, "Never slower than our Triton template")):
    found = sorted((speed[label, peer, m], label, m) for label, _ in rows_of
                   for m in MODES if speed[label, peer, m])
    (low, label, mode), high = found[0], found[-1][0]
    lines.append(f"- {what}, forward and forward+backward: {ratio_cell(low, True)} ({label} "
                 f"{MODES[mode]}) to {high[0]:.2f}: {met(low[0] >= floor)}.")
  return lines + memory_line(folders)


USER_ROWS = [  # label, the case without a mask and with a causal one (None: no such form)
    ("vanilla", "vanilla", "causal"), ("softcap 30", "softcap", "softcap_causal"),
    ("ALiBi", "alibi", "alibi_causal"), ("window 256", "window256_bidir", "window256"),
    ("8 documents", "documents8_bidir", "documents8"), ("sigmoid", "sigmoid", "sigmoid_causal"),
    ("ReLU", "relu", "relu_causal"), ("prefix-LM", None, "prefix_lm"),
    ("sinks", "sink_bidir", "sink"), ("off-by-one softmax", "off_by_one", "off_by_one_causal"),
    ("retention", None, "retention"), ("abs-sum clamp (README)", "abs_clamp", "abs_clamp_causal"),
    ("softcap over documents (README)", None, "softcap_documents8"),
    ("Gemma-2 local: softcap 50, window 4096", None, "gemma2_local")]
USER_SEQS = ("4k", "16k")


def _user_cases():
  return [(label, form, variant) for label, *forms in USER_ROWS
          for form, variant in zip(("none", "causal"), forms) if variant]


def _newest_first(src: Source) -> Source:
  """A table's cells from the newest file that has them (a rerun of some rows
  wins), A/B experiments' files (`ab_*`) aside."""
  src.files = sorted((d for d in src.files if not os.path.basename(d["path"]).startswith("ab_")),
                     key=lambda d: (d.get("time", d["date"]), d["path"]), reverse=True)
  return src


def newest_cells(folders, required: list, prefix: str = "") -> Source:
  """A table's cells from the newest file of any folder that has them (a
  rerun of some rows on one GPU wins over a whole table run on a bigger
  host), among the files whose names start with `prefix`, A/B experiments'
  files aside."""
  merged = Folder.__new__(Folder)
  merged.files = [d for folder in folders for d in folder.files
                  if os.path.basename(d["path"]).startswith(prefix)]
  return _newest_first(Source([merged], required))


def user_variants(folders) -> list[str]:
  """Issue 37's table: each cell from the newest run of the user suites
  (`training_user*` files, any folder) that has it."""
  src = newest_cells(folders, [(f"vanilla_{s}", "pallas_attn", m, ("kernel",))
                               for s in USER_SEQS for m in MODES], prefix="training_user")
  calls, cached = first_call_source(folders)
  slowest = {m: (0.0, "") for m in MODES}
  missing = {m: [] for m in MODES}
  rows, flex, cudnn = [], {}, {}
  for label, form, variant in _user_cases():
    cells = [label, form]
    for seq in USER_SEQS:
      c = f"{variant}_{seq}"
      for mode in MODES:
        ours = src.row(c, "pallas_attn", mode)
        cells.append(tflops(ours) if ours and ours["time_ms"] else
                     "fails" if src.failure(c, "pallas_attn", mode) else "–")
        for peer, found in (("flex", flex), ("cudnn", cudnn)):
          found[label, form, seq, mode] = src.ratio((c, peer, mode), (c, "pallas_attn", mode))
          cells.append(ratio_cell(found[label, form, seq, mode]))
    firsts = [first_call_s(calls, f"{variant}_4k", m) for m in MODES]
    for m, x in zip(MODES, firsts):
      slowest[m] = max(slowest[m], (x or 0.0, f"{label} ({form})"))
      missing[m] += [] if x else [f"{label} ({form})"]
    rows.append(cells + [" / ".join(num(x, ".1f") for x in firsts)])
  header = ["variant", "mask"] + [f"{seq} {h}" for seq in USER_SEQS for mode in ("fwd", "f+b")
                                  for h in (f"ours {mode}", f"{mode} / Flex", f"{mode} / cuDNN")]
  header.append("first call s, fwd / f+b")
  lines = [src.caption() + " Last column (first calls): " + calls.caption(), "",
           *table(header, rows), ""]
  for name, found, floor in (("Flex", flex, 1.2), ("cuDNN", cudnn, 1.0)):
    low = sorted((v[0], key) for key, v in found.items() if v)
    missed = [f"{k[0]} ({k[1]}) {k[2]} {'f+b' if k[3] == 'fwd_bwd' else k[3]} {v:.2f}"
              for v, k in low if v < floor]
    lines.append(f"- >= {floor}x {name} on every row it expresses: {len(low)} rows, lowest "
                 f"{low[0][0]:.2f}: " + (met(True) if not missed
                                          else met(False) + ": " + "; ".join(missed)) + ".")
  for m, limit in (("fwd", 5.0), ("fwd_bwd", 10.0)):
    x, where = slowest[m]
    lines.append(f"- First {MODES[m]} under {limit:g} s for every variant (B4 S4k): slowest "
                 f"{where} {x:.1f} s: {met(x < limit and not missing[m])}"
                 + (f" (not measured: {', '.join(missing[m])})" if missing[m] else "") + ".")
  fp32 = "alibi_causal_4k_fp32_dqk192"
  lines.append(f"- float32 Dqk 192 / Dv 128 causal ALiBi: first call "
               + " / ".join(num(first_call_s(calls, fp32, m), ".1f") for m in MODES)
               + " s (fwd / f+b); a second process reading JAX's persistent cache: "
               + ", ".join(f"{c.removesuffix('_4k')} {num(cached[c, 'fwd'], '.1f')} / "
                           f"{num(cached[c, 'fwd_bwd'], '.1f')}" for c, m in cached
                           if m == "fwd" and (c, "fwd_bwd") in cached) + " s.")
  return lines


def first_call_source(folders) -> tuple:
  """(Source of the first-call rows, {(case, mode): seconds in a second
  process reading JAX's persistent compilation cache}). First calls are
  ours by throughput rows' `first_call_s` (variants one after another in one
  process: the newest folder with a whole user_4k suite's, its float32 case
  included, not a rerun of some rows); files named `*cache_read*` hold the
  second process's, and no `*cache*` file is a fresh process's."""
  fresh = [Folder.__new__(Folder) for _ in folders]
  for f, folder in zip(fresh, folders):
    f.files = [d for d in folder.files if "cache" not in d["path"]]
  src = _newest_first(Source(fresh, [(c, "pallas_attn", m, ("throughput",)) for m in MODES
                                     for c in ("vanilla_4k", "alibi_causal_4k_fp32_dqk192")]))
  reads = [[d for d in folder.files if "cache_read" in d["path"]] for folder in folders]
  newest = next((files for files in reads if files), [])  # the newest folder that has some
  cached = {(r["case"], r["mode"]): r["extra"].get("first_call_s")
            for d in newest for r in d["rows"] if r["measure"] == "throughput"}
  return src, cached


def first_call_s(src: Source, case: str, mode: str) -> float | None:
  row = src.row(case, "pallas_attn", mode, ("throughput",)) or {}
  return row.get("extra", {}).get("first_call_s")


def memory_line(folders) -> list[str]:
  src = Source(folders, [(f"vanilla_{s}", OURS, m, ("compiled_memory",))
                         for s in ("16k", "64k") for m in MODES])
  size = {(impl, s, m): mib(src.row(f"vanilla_{s}", impl, m, ("compiled_memory",)))
          for impl in (OURS, "cudnn") for s in ("16k", "64k") for m in MODES}
  return [f"- Memory linear in S (XLA's compiled temporaries + outputs, B1 H16 d128, vanilla; "
          f"`{src.used[0]['path']}`): forward {size[OURS, '16k', 'fwd']} at 16k and "
          f"{size[OURS, '64k', 'fwd']} at 64k, forward+backward {size[OURS, '16k', 'fwd_bwd']} / "
          f"{size[OURS, '64k', 'fwd_bwd']} (cuDNN {size['cudnn', '16k', 'fwd_bwd']} / "
          f"{size['cudnn', '64k', 'fwd_bwd']})."]


TERM_ROWS = [("ALiBi (arithmetic bias, separable)", "alibi_causal_4k"),
             ("relative-position table `t[h, q-kv+S-1]`", "rel_table_4k"),
             ("T5 buckets `t[h, bucket(q-kv)]`, 32 buckets", "t5_buckets_4k"),
             ("vanilla causal", "causal_4k"), ("sinks (per-head logits)", "sink_4k")]
DTABLE_ROWS = [("relative table, table differentiated", "rel_table_dtable_4k"),
               ("T5 buckets, table differentiated", "t5_buckets_dtable_4k")]


def terms(folders) -> list[str]:
  fails = Failures()
  out = []
  for rows_spec, modes in ((TERM_ROWS, MODES), (DTABLE_ROWS, ("fwd_bwd",))):
    src = Source(folders, [(c, "pallas_attn", m, ("kernel",)) for _, c in rows_spec
                           for m in modes])
    where = f" ({src.files[0]['device'].split()[1]}, {src.files[0]['date']})" if out else ""
    for label, c in rows_spec:
      cells = []
      for mode in MODES:
        ours, flex = src.row(c, "pallas_attn", mode), src.row(c, "flex", mode)
        cells += [tflops(ours), tflops(flex) if flex else fails.cell(src, c, "flex", mode),
                  ratio_cell(src.ratio((c, "flex", mode), (c, "pallas_attn", mode)))]
      out.append(([label + where] + cells, src))
  header = ["variant", "ours fwd", "Flex fwd", "ours/Flex fwd", "ours f+b", "Flex f+b",
            "ours/Flex f+b"]
  main, dtable = out[0][1], out[-1][1]
  flex = lambda c, m: main.ratio((c, "flex", m), (c, "pallas_attn", m))[0]
  ours_fb = lambda c: (c, "pallas_attn", "fwd_bwd")
  cost = " / ".join(f"{dtable.ratio(ours_fb(c), ours_fb(without))[0]:.1f}x"
                    for (_, c), (_, without) in zip(DTABLE_ROWS, TABLES))
  lines = [main.caption() + f" Table-differentiated rows ({cost} the forward+backward without, "
           f"same run): {dtable.caption()}", "",
           *table(header, [r for r, _ in out]), *fails.lines(), "",
           "- At least 1.0x Flex, forward and forward+backward, for both tables: " + ", ".join(
               f"{name} {flex(c, 'fwd'):.2f} / {flex(c, 'fwd_bwd'):.2f}" for name, c in TABLES)
           + f": {met(min(flex(c, m) for _, c in TABLES for m in MODES) >= 1.0)}."]
  for what, pairs, ceiling in (
      ("A gather at most 1.15x ALiBi's time", [(n, c, "alibi_causal_4k") for n, c in TABLES],
       1.15), ("Sinks within 5% of vanilla", [("sink / causal", "sink_4k", "causal_4k")], 1.05)):
    found = {(c, m): main.ratio((c, "pallas_attn", m), (d, "pallas_attn", m))
             for _, c, d in pairs for m in MODES}
    lines.append(f"- {what}: " + "; ".join(f"{MODES[m]} " + ", ".join(
        f"{name} {ratio_cell(found[c, m], True, '.3f')}" for name, c, _ in pairs) for m in MODES)
        + f": {met(max(f[0] for f in found.values()) <= ceiling)}.")
  return lines


def block_mask(folders) -> list[str]:
  masks = [("causal", "causal"), ("window 1024", "window1024"), ("8 documents", "documents8")]
  seqs = ("4k", "8k", "16k")
  src = Source(folders, [(f"{m}_{s}", "pallas_attn", "build", ("wall",)) for _, m in masks
                         for s in seqs])
  ms = lambda c, impl: (src.row(c, impl, "build", ("wall",)) or {}).get("time_ms")
  rows = [[s] + [num(ms(f"{m}_{s}", impl), ".3f") for _, m in masks
                 for impl in ("pallas_attn", "flex")] for s in seqs]
  header = ["S"] + [f"{label} {side} ms" for label, _ in masks for side in ("ours", "Flex")]
  ways = ("prebuilt", "built_in_jit", "built_in_jit_no_bounds", "closed_over")
  fwd = {(w, m): src.row("documents8_16k", w, "fwd", measures)["time_ms"]
         for w in ways for m, measures in (("wall", WALL), ("kernel", ("kernel",)))}
  vs = lambda w: " / ".join(f"{(fwd[w, m] / fwd['prebuilt', m] - 1) * 100:+.0f}%"
                            for m in ("wall", "kernel"))
  worst = max(ms(f"{m}_16k", "pallas_attn") for _, m in masks)
  added = max(fwd["built_in_jit", m] / fwd["prebuilt", m] - 1 for m in ("wall", "kernel"))
  return [src.caption() + " Eager builds, B1 H16: the median call after the first, each "
          "waited for.", "", *table(header, rows), "",
          f"- An eager build under 1 ms at 16k after the first call: at most {worst:.3f} ms: "
          f"{met(worst < 1.0)}.",
          f"- Building inside jit adds at most 10% to a 16k document-masked forward: "
          f"{vs('built_in_jit')}: {met(added <= 0.10)} (bf16 B1 H16 d128, ms by throughput / "
          "kernel time: " + "; ".join(f"{w} {fwd[w, 'wall']:.3f} / {fwd[w, 'kernel']:.3f}"
                                      + ("" if w == "prebuilt" else f" ({vs(w)})")
                                      for w in ways) + ")."]


TRAIN_ROWS = [("Flax, softcap 30 (cuDNN cannot)", "train_lm_flax_softcap", "xla",
               "XLA (dense jnp)"),
              ("Flax, vanilla (causal)", "train_lm_flax_vanilla", "cudnn", "cuDNN"),
              ("Flax, vanilla", "train_lm_flax_vanilla", "xla", "XLA"),
              ("Equinox, vanilla", "train_lm_equinox_vanilla", "equinox",
               "`eqx.nn.MultiheadAttention`")]


def train_example(folders) -> list[str]:
  step = lambda c, impl: (c, impl, "train_step", ("throughput",))
  src = Source(folders, [step(c, impl) for _, c, peer, _ in TRAIN_ROWS
                         for impl in ("pallas_attn", peer)])
  rows, ratio = [], {}
  for label, c, peer, peer_label in TRAIN_ROWS:
    ours, theirs = src.row(*step(c, "pallas_attn")), src.row(*step(c, peer))
    speed = lambda r: f"{r['extra']['tokens_per_s'] / 1e3:.1f}k tok/s ({r['time_ms']:.1f} ms)"
    ratio[peer, c] = ours["extra"]["tokens_per_s"] / theirs["extra"]["tokens_per_s"]
    rows.append([label, speed(ours), f"{peer_label} {speed(theirs)}", f"{ratio[peer, c]:.2f}x",
                 f"{ours['extra']['final_loss']:.3f} / {theirs['extra']['final_loss']:.3f}"])
  cudnn, xla = ratio["cudnn", "train_lm_flax_vanilla"], ratio["xla", "train_lm_flax_softcap"]
  return [src.caption(), "", *table(["run", "ours", "peer", "ratio", "final loss ours / peer"],
                                    rows), "",
          f"- Within 5% of the cuDNN model where cuDNN expresses the variant: {cudnn:.2f}x: "
          f"{met(cudnn >= 0.95)}.",
          f"- At least 3x the XLA model where it cannot: {xla:.2f}x: {met(xla >= 3.0)}."]


DECODE_ROWS = [("B8 8k", "b8_8k"), ("B8 32k", "b8_32k"), ("B1 128k", "b1_128k"),
               ("B64 4k", "b64_4k"), ("B8 32k, Sq=4", "b8_32k_sq4"),
               ("B1 128k, Sq=4", "b1_128k_sq4"), ("B8 32k, window 4096", "b8_32k_window4k"),
               ("B1 128k, window 4096", "b1_128k_window4k")]


def decoding(folders) -> list[str]:
  impls = ["decode", "paged", "attention", "parallel", "cudnn", "flex", "sdpa"]
  src = Source(folders, [(c, "decode", "decode", WALL) for _, c in DECODE_ROWS])
  cell = {(c, i): src.row(c, i, "decode", WALL) for _, c in DECODE_ROWS for i in impls}
  impls = [i for i in impls if any(cell[c, i] for _, c in DECODE_ROWS)]

  def text(c, i):
    r = cell[c, i]
    if r is None or r["time_ms"] is None:
      return "–"
    return f"{r['time_ms']:.4f}" + ("" if "window" in c else f" \\| {r['gb_s'] / 1e3:.2f}")
  rows = [[label] + [text(c, i) for i in impls] for label, c in DECODE_ROWS]
  found = re.search(r"HBM peak ([\d.]+) TB/s", src.used[0]["notes"])
  peak = float(found[1]) if found else float("nan")
  over = lambda c, i: cell[c, i]["time_ms"] / cell[c, "decode"]["time_ms"]
  fraction = {c: cell[c, "decode"]["gb_s"] / 1e3 / peak for c in ("b8_32k", "b1_128k")}
  sq1 = [over(c, "cudnn") for c in ("b8_8k", "b8_32k", "b1_128k", "b64_4k")]
  sq4 = [over(c, "cudnn") for c in ("b8_32k_sq4", "b1_128k_sq4")]
  flex = [over(c, "flex") for c in ("b8_8k", "b8_32k", "b1_128k")]
  parallel = [over(c, "parallel") for _, c in DECODE_ROWS if "window" not in c]
  flex_b64 = cell["b64_4k", "flex"]["gb_s"] / 1e3 / peak
  return [src.caption() + f" ms \\| TB/s of K/V bytes read (HBM peak {peak} TB/s); window "
          "rows in ms, cuDNN on the keys sliced to the window.", "",
          *table(["case", *impls], rows), "",
          f"- HBM fraction at B8 32k {fraction['b8_32k']:.2f} and B1 128k "
          f"{fraction['b1_128k']:.2f} (>= 0.80): {met(min(fraction.values()) >= 0.795)}.",
          f"- Against cuDNN {min(sq1):.2f}-{max(sq1):.2f}x at Sq=1, " + " / ".join(
              f"{x:.1f}x" for x in sq4) + f" at Sq=4 (>= 1.0): {met(min(sq1 + sq4) >= 1.0)}.",
          "- Against Flex " + " / ".join(f"{x:.1f}x" for x in flex) + " at B8 8k / B8 32k / B1 "
          f"128k (>= 3x): {met(min(flex) >= 3.0)}; {over('b64_4k', 'flex'):.2f}x at B64 4k, "
          f"where Flex itself reads at {flex_b64:.0%} of peak (3x is past the HBM limit).",
          "- A 4096 window reads only the window: " + " and ".join(
              f"{cell[c, 'decode']['time_ms']:.4f} ms over {size}" for c, size in (
                  ("b1_128k_window4k", "a 128k cache"), ("b8_32k_window4k", "32k")))
          + f". The parallel template is {min(parallel):.1f}-{max(parallel):.1f}x slower."]


FP8_DECODE_ROWS = [("B8 8k", "b8_8k"), ("B8 32k", "b8_32k"), ("B1 128k", "b1_128k")]


def fp8_decoding(folders) -> list[str]:
  """Issue 40's decode table: the e4m3 cache against our bf16 cache and
  cuDNN's (kernel time ratios, bf16 time / fp8 time), with the errors
  against float32 attention (`decoding.fp8_accuracy`)."""
  src = Source(folders, [(c, "decode_fp8", "decode", ("kernel",)) for _, c in FP8_DECODE_ROWS])
  speedup = lambda c, bf16, fp8: src.ratio((c, bf16, "decode"), (c, fp8, "decode"))
  rows, ratios = [], []
  for label, c in FP8_DECODE_ROWS:
    fp8 = src.row(c, "decode_fp8", "decode")
    found = [speedup(c, "decode", "decode_fp8"), speedup(c, "cudnn", "decode_fp8"),
             speedup(c, "paged", "paged_fp8")]
    ratios += [f[0] for f in found if f]
    errors = fp8["extra"].get("rel_err_f32", {})
    error = lambda key: num(errors.get(key), ".4f")
    rows.append([label, f"{fp8['time_ms']:.4f}", f"{fp8['gb_s'] / 2e3:.2f}",
                 *(ratio_cell(f) for f in found),
                 " / ".join(error(k + suffix) for suffix in ("", "_outliers")
                            for k in ("bf16", "fp8_vs_dequantized", "fp8_vs_bf16_inputs"))])
  header = ["case", "fp8 decode ms", "fp8 TB/s read", "bf16 decode / fp8", "cuDNN bf16 / fp8",
            "paged bf16 / paged fp8",
            "rel. error: bf16, fp8 vs dequantized, fp8 vs bf16 inputs; same with outliers"]
  return [f"Kernel time per call, median of alternating rounds. {src.caption()}", "",
          *table(header, rows), "",
          f"- fp8-cache decode >= 1.8x our bf16 decode and cuDNN's: {min(ratios):.2f}-"
          f"{max(ratios):.2f}: {met(min(ratios) >= 1.8)}."]


FP8_PREFILL_ROWS = [("vanilla B4 S4k", "vanilla_4k", 1.5), ("causal B4 S4k", "causal_4k", 1.5),
                    ("vanilla B1 S16k", "vanilla_16k", 1.5), ("causal B1 S16k", "causal_16k", 1.5),
                    ("softcap B4 S4k", "softcap_4k", 1.4),
                    ("relative table B4 S4k", "rel_table_4k", 1.4)]


def fp8_prefill(folders) -> list[str]:
  """Issue 40's prefill table: e4m3 q, k, v against our bf16 forward and
  cuDNN's (kernel time ratios, bf16 time / fp8 time), with the errors of
  `training.fp8_accuracy`; the newest run of any folder."""
  src = newest_cells(folders, [(c, "pallas_attn_fp8", "fwd", ("kernel",))
                               for _, c, _ in FP8_PREFILL_ROWS], prefix="training_fp8")
  rows, short = [], []
  for label, c, target in FP8_PREFILL_ROWS:
    fp8 = src.row(c, "pallas_attn_fp8", "fwd")
    ours = src.ratio((c, "pallas_attn", "fwd"), (c, "pallas_attn_fp8", "fwd"))
    cudnn = src.ratio((c, "cudnn", "fwd"), (c, "pallas_attn_fp8", "fwd"))
    if not ours or ours[0] < target:
      short.append(f"{label} {num(ours and ours[0])} (target {target})")
    extra = src.row(c, "pallas_attn_fp8", "fwd", ("throughput",))["extra"]
    error = lambda key: num(extra.get(key), ".4f")
    rows.append([label, f"{fp8['time_ms']:.3f}", tflops(fp8), ratio_cell(ours, True),
                 ratio_cell(cudnn),
                 " / ".join(error(k + suffix) for suffix in ("", "_outliers")
                            for k in ("bf16_vs_f32", "fp8_vs_dequantized",
                                      "fp8_vs_bf16_inputs"))])
  header = ["case (d 128, H16)", "fp8 ms", "fp8 TFLOP/s", "our bf16 / fp8", "cuDNN bf16 / fp8",
            "rel. error: bf16, fp8 vs dequantized, fp8 vs bf16 inputs; same with outliers"]
  return [f"Forward kernel time per call, median of alternating rounds. {src.caption()}", "",
          *table(header, rows), "",
          "- fp8 prefill >= 1.5x our bf16 forward (vanilla, causal), >= 1.4x (softcap, "
          f"relative table): {met(not short)}" + (f" ({'; '.join(short)})." if short else ".")]


def _multi_gpu_docs() -> tuple[list, dict | None]:
  """(every `multi_gpu*.json` but `*_before.json`, newest run first, so
  that each case's newest run wins; the newest `multi_gpu_before.json` or
  None)."""
  paths = glob.glob(os.path.join(RESULTS, "*_*", "multi_gpu*.json"))
  if not paths:
    raise LookupError("no multi_gpu results")
  paths.sort(key=os.path.basename)
  paths.sort(key=os.path.dirname, reverse=True)
  docs, befores = [], []
  for path in paths:
    with open(path) as f:
      doc = json.load(f)
    doc["path"] = os.path.relpath(path, RESULTS)
    (befores if path.endswith("_before.json") else docs).append(doc)
  # The newest run first, whatever its folder (hosts of one day share a date).
  newest_first = lambda d: d.get("time", d["date"])
  docs.sort(key=newest_first, reverse=True)
  befores.sort(key=newest_first, reverse=True)
  return docs, (befores[0] if befores else None)


def _row(doc, case, impl, mode) -> dict | None:
  """The row of one run with a time, or None."""
  return next((r for r in doc["rows"] if (r["case"], r["impl"], r["mode"]) == (case, impl, mode)
               and r["time_ms"]), None)


def _cell(docs, case, impl, mode) -> dict | None:
  for doc in docs:
    for r in doc["rows"]:
      if (r["case"], r["impl"], r["mode"]) == (case, impl, mode):
        doc["used"] = True
        return r
  return None


def _peak_gib(r) -> float:
  return max(r["extra"]["peak_bytes_per_gpu"]) / 2**30


def multi_gpu(folders) -> list[str]:
  """Issues 41 and 42: the ring over 2 and 4 GPUs and sharded decoding against
  one GPU, each case from the newest `multi_gpu*.json` that has it, and the
  newest `multi_gpu*_before.json` (the code before, its one-GPU times
  from the same folder's run where it has none)."""
  docs, before = _multi_gpu_docs()
  # The code before's one-GPU times: its own, else those its folder's run measured beside it.
  same_run = before and [before] + [d for d in docs if os.path.dirname(d["path"])
                                    == os.path.dirname(before["path"])]
  ring_rows, speedup, peaks = [], {}, {}
  for seq in ("64k", "128k", "256k"):
    ones = [_cell(docs, f"causal_{seq}", "pallas_attn", mode) for mode in MODES]
    if not all(r and r["time_ms"] for r in ones):
      continue
    cells = [seq, " / ".join(f"{r['time_ms']:.1f}" for r in ones)]
    gib = [f"{_peak_gib(ones[-1]):.2f}"]  # forward+backward's
    for n in (2, 4):
      runs = [_cell(docs, f"causal_{seq}", f"ring_{n}gpu", mode) for mode in MODES]
      olds = [before and _cell(same_run if impl == "pallas_attn" else [before],
                               f"causal_{seq}", impl, mode)
              for mode in MODES for impl in ("pallas_attn", f"ring_{n}gpu")]
      was = ""
      if all(r and r["time_ms"] for r in olds):
        was = " (before " + " / ".join(f"{olds[2 * i]['time_ms'] / olds[2 * i + 1]['time_ms']:.2f}x"
                                       for i in range(len(MODES))) + ")"
      # Inputs already in the zigzag order, against the one GPU of the same run.
      ordered_run = next((d for d in docs if all(
          _row(d, f"causal_{seq}", impl, mode) for mode in MODES
          for impl in ("pallas_attn", f"ring_preordered_{n}gpu"))), None)
      if ordered_run is not None:
        ordered_run["used"] = True
        was = (" (inputs in zigzag order " + " / ".join(
            f"{_row(ordered_run, f'causal_{seq}', 'pallas_attn', m)['time_ms'] / _row(ordered_run, f'causal_{seq}', f'ring_preordered_{n}gpu', m)['time_ms']:.2f}x"
            for m in MODES) + ")" + was)
      if all(r and r["time_ms"] for r in runs):
        for mode, one, r in zip(MODES, ones, runs):
          speedup[seq, mode, n] = one["time_ms"] / r["time_ms"]
        peaks[seq, "fwd_bwd", n] = _peak_gib(runs[-1]) / _peak_gib(ones[-1])
        cells.append(" / ".join(f"{r['time_ms']:.1f}" for r in runs) + " = " + " / ".join(
            f"{speedup[seq, m, n]:.2f}x" for m in MODES) + was)
        gib.append(f"{_peak_gib(runs[-1]):.2f}")
      else:
        cells.append(("not run" if all(r is None for r in runs) else "failed") + was)
        gib.append("–")
    ring_rows.append(cells + [" / ".join(gib)])
  for seq in ("1024k", "2048k"):
    one = _cell(docs, f"decode_{seq}", "decode", "decode")
    for n in (2, 4):
      r = _cell(docs, f"decode_{seq}", f"decode_{n}gpu", "decode")
      if one and r and one["time_ms"] and r["time_ms"]:
        speedup[seq, "decode", n] = one["time_ms"] / r["time_ms"]
  used = [d for d in docs if d.get("used")] + ([before] if before else [])
  doc = used[0]
  versions = ", ".join(f"{k} {v}" for k, v in doc["versions"].items()
                       if v and k in ("jax", "torch"))
  files = ", ".join(f"`{d['path']}` ({d['date']}, a host of {d['device_count']} GPUs)"
                    for d in used)
  at = lambda key: f"{speedup[key]:.2f}x" if key in speedup else "not measured"
  share = lambda key: f"{peaks[key]:.2f}x" if key in peaks else "not measured"
  ring_41 = min(speedup.get((seq, m, 2), 0) for seq in ("64k", "128k") for m in MODES)
  return [f"{doc['device']}, {versions}. Files: {files}.", "",
          *table(["S", "1 GPU ms, fwd / f+b", "ring over 2 GPUs: ms = speedup", "ring over 4 GPUs",
                  "f+b peak GiB per GPU, 1 / 2 / 4"], ring_rows),
          "- Issue 41 (2 GPUs): ring >= 1.9x at 64k and 128k: " + ", ".join(
              f"{seq} " + " / ".join(at((seq, m, 2)) for m in MODES) for seq in ("64k", "128k"))
          + f": {met(ring_41 >= 1.9)}"
          f"; ring peak per GPU <= 0.6x one GPU's at 128k forward+backward: "
          f"{share(('128k', 'fwd_bwd', 2))}: "
          f"{met(peaks.get(('128k', 'fwd_bwd', 2), 9) <= 0.6)}; decoding a 1M cache >= 1.8x: "
          f"{at(('1024k', 'decode', 2))}: {met(speedup.get(('1024k', 'decode', 2), 0) >= 1.8)}.",
          "- Issue 42 (4 GPUs): ring >= 3.6x at 256k: " + " / ".join(
              at(("256k", m, 4)) for m in MODES)
          + f": {met(min(speedup.get(('256k', m, 4), 0) for m in MODES) >= 3.6)}; ring peak per "
          f"GPU <= 0.35x one GPU's at 256k: {share(('256k', 'fwd_bwd', 4))}: "
          f"{met(peaks.get(('256k', 'fwd_bwd', 4), 9) <= 0.35)}; decoding a 2M cache >= 3.5x: "
          f"{at(('2048k', 'decode', 4))}: {met(speedup.get(('2048k', 'decode', 4), 0) >= 3.5)}."]


def earlier(folders) -> list[str]:
  """Issues resolved on the Triton template, one line each (causal, backward
  and tuning; its masks table is now issue 37's), then linear attention's table."""
  return ([causal(folders), pallas_ref(folders), "- " + tuning(folders), ""]
          + linear(folders))


def causal(folders) -> str:
  seqs = ("4k", "8k", "16k")
  src = Source(folders, [(f"{v}_{s}", "pallas_attn", "fwd", ("kernel",))
                         for v in ("vanilla", "causal") for s in seqs])
  ours = lambda c: (c, "pallas_attn", "fwd")
  dense = [src.ratio(ours(f"causal_{s}"), ours(f"vanilla_{s}"))[0] for s in seqs]
  wall = [src.ratio(ours(f"causal_{s}"), ours(f"vanilla_{s}"), WALL)[0] for s in seqs]
  ref = [src.ratio((f"causal_{s}", "jax_pallas_mha", "fwd"), ours(f"causal_{s}"))[0]
         for s in seqs]
  window = {w: src.row(f"window{w}_16k", "pallas_attn", "fwd", WALL)["time_ms"]
            for w in (256, 1024)}
  dense_causal = src.row("causal_16k", "pallas_attn", "fwd", WALL)["time_ms"]
  join = lambda xs: " / ".join(f"{x:.2f}" for x in xs)
  return (f"- **Causal against dense** (forward kernel time, 16k tokens: B = 16k / S): causal / "
          f"dense {join(dense)} at S = 4k / 8k / 16k (wall {join(wall)}), <= 0.55x: "
          f"{met(max(dense) <= 0.55)}; JAX's Pallas reference causal / ours {join(ref)}. Windows "
          f"at S = 16k (wall) {window[256]:.2f} ms (256) and {window[1024]:.2f} ms (1024) against "
          f"{dense_causal:.2f} dense causal: {dense_causal / window[1024]:.1f}x, >= 5x: "
          f"{met(dense_causal / window[1024] >= 5)}. {src.caption()}")


BF16_PEAK_TFLOPS = 989  # H100 / H200 SXM, dense
CHUNKED_ROWS = [  # label, case
    ("scalar decay H16 d128, B4 4k", "scalar_decay_h16_d128_4k"),
    ("scalar decay H16 d128, B4 8k", "scalar_decay_h16_d128_8k"),
    *((f"Mamba2-2.7B, B{b} {n}", f"mamba2_2.7b_h80_n128_p64{'' if b == 4 else f'_b{b}'}_{n}")
      for b, n in ((1, "2k"), (1, "4k"), (1, "8k"), (4, "4k"), (8, "2k"), (8, "4k"), (8, "8k")))]


def _gla_on_mosaic(folders) -> Source:
  """The newest run of GLA with our Triton passes beside ours and fla, both modes."""
  case = "gla_vector_h16_d128_4k"
  return Source(folders, [(case, impl, mode, ("kernel",)) for impl in ("ours_triton", "fla")
                          for mode in MODES])


def chunked_hopper(folders) -> list[str]:
  """Issue 38's table: ours (the Mosaic GPU kernels where they run) against
  fla, Mamba2's Triton SSD and our Triton passes, forward and f+b; GLA's
  newest run in a line under it."""
  src = Source(folders, [("scalar_decay_h16_d128_4k", "ours_triton", "fwd", ("kernel",))])
  fails, rows = Failures(), []
  over = {}  # (peer, mode, kind) -> ratios
  for label, case in CHUNKED_ROWS:
    kind = "mamba2" if case.startswith("mamba2") else "scalar"
    cells = [label]
    for mode in MODES:
      mine = src.row(case, "ours", mode)
      if mine is None:
        cells += ["–"] * 4
        continue
      cells.append(f"{mine['time_ms']:#.3g} ({mine['tflops']:.0f}, "
                   f"{100 * mine['tflops'] / BF16_PEAK_TFLOPS:.0f}%)")
      for peer in ("fla", "mamba2", "ours_triton"):
        found = src.ratio((case, peer, mode), (case, "ours", mode))
        if found:
          over.setdefault((peer, mode, kind), []).append(found[0])
        cells.append(ratio_cell(found) if found or src.failure(case, peer, mode) is None
                     else fails.cell(src, case, peer, mode))
    first = [src.row(case, impl, "fwd", ("throughput",)) for impl in ("ours", "fla")]
    cells.append(" / ".join(num(r and r["extra"].get("first_call_s"), ".1f") for r in first))
    rows.append(cells)
  header = ["row", "ours fwd ms (TFLOP/s, % peak)", "fla / ours", "Mamba2 / ours",
            "Triton / ours", "ours f+b ms (TFLOP/s, % peak)", "fla / ours f+b",
            "Mamba2 / ours f+b", "Triton / ours f+b", "first call s, ours / fla"]
  low = lambda key: min(over.get(key, [0.0]))
  footnote = "".join(f"\\* {where}: {note.split('. ')[0]}. "
                     for note, where in fails.notes.items())

  gla, case = _gla_on_mosaic(folders), "gla_vector_h16_d128_4k"
  gla_ms = lambda impl, mode, key="time_ms": (gla.row(case, impl, mode) or {}).get(key)
  gla_over = lambda impl, mode: gla.ratio((case, impl, mode), (case, "ours", mode))
  gla_fla = {mode: gla_over("fla", mode) for mode in MODES}
  gla_line = "GLA (a gate per key feature), H16 d128, B4 4k: " + "; ".join(
      f"{MODES[mode]} ours {num(gla_ms('ours', mode), '.3f')} ms "
      f"({num(gla_ms('ours', mode, 'tflops'), '.0f')} TFLOP/s) against fla's "
      f"{num(gla_ms('fla', mode), '.3f')} and our Triton passes' "
      f"{num(gla_ms('ours_triton', mode), '.3f')} (fla / ours {ratio_cell(gla_fla[mode])}, "
      f"Triton / ours {ratio_cell(gla_over('ours_triton', mode))})" for mode in MODES
  ) + f". {gla.caption()}"
  gla_met = lambda mode: met(bool(gla_fla[mode]) and gla_fla[mode][0] >= 1.5)
  triton_over = {mode: over.get(("ours_triton", mode, "mamba2"), [])
                 + over.get(("ours_triton", mode, "scalar"), []) for mode in MODES}
  spread = lambda xs: f"{min(xs, default=0):.2f}-{max(xs, default=0):.2f}"

  memory = {n: src.row(f"mamba2_2.7b_h80_n128_p64_b1_{n}", "ours", "fwd", ("compiled_memory",))
            for n in ("4k", "8k")}
  return [f"Kernel time per call, the median of alternating rounds; ratios: peer time / ours. "
          f"{src.caption()}", "", *table(header, rows), "", footnote.strip(), "", gla_line, "",
          f"- Mamba2 SSD forward >= 2.0x Mamba2's Triton kernels: lowest "
          f"{low(('mamba2', 'fwd', 'mamba2')):.2f}: {met(low(('mamba2', 'fwd', 'mamba2')) >= 2)}; "
          f"forward+backward >= 1.65x: lowest {low(('mamba2', 'fwd_bwd', 'mamba2')):.2f}: "
          f"{met(low(('mamba2', 'fwd_bwd', 'mamba2')) >= 1.65)}.",
          f"- Scalar decay forward >= 1.5x fla: lowest {low(('fla', 'fwd', 'scalar')):.2f}: "
          f"{met(low(('fla', 'fwd', 'scalar')) >= 1.5)}; GLA forward >= 1.5x fla: "
          f"{ratio_cell(gla_fla['fwd'])}: {gla_met('fwd')}; forward+backward >= 1.5x fla where "
          f"fla runs (GLA; fla refuses the scalar decay's backward): "
          f"{ratio_cell(gla_fla['fwd_bwd'])}: {gla_met('fwd_bwd')}.",
          f"- No regression of the Triton path (it runs the delta rule, small grids, float16 or "
          f"too strong per-feature gates): it takes {spread(triton_over['fwd'])}x the Mosaic "
          f"kernels' time forward, {spread(triton_over['fwd_bwd'])}x forward+backward.",
          f"- Memory linear in S (our forward's compiled bytes, arguments included, Mamba2-2.7B "
          f"B1): {mib(memory['4k'])} at 4k, {mib(memory['8k'])} at 8k."]


LINEAR_SHAPES = [("GLA H16 Dk=Dv=128", "gla_vector_h16_d128"),
                 ("scalar decay H16", "scalar_decay_h16_d128"),
                 ("Mamba2-2.7B H80 N128 P64", "mamba2_2.7b_h80_n128_p64")]


def linear(folders) -> list[str]:
  seqs = ("4k", "8k", "16k")
  src = Source(folders, [(f"{s}_{n}", "ours", m, ("kernel",)) for _, s in LINEAR_SHAPES
                         for n in seqs for m in ("fwd", "fwd_bwd")])
  fails, rows, fla_over, wall = Failures(), [], [], {}
  for label, shape in LINEAR_SHAPES:
    cells = []
    for mode in ("fwd", "fwd_bwd"):
      ours, fla, found = [], [], []
      for n in seqs:
        c = f"{shape}_{n}"
        mine, theirs = src.row(c, "ours", mode), src.row(c, "fla", mode)
        found.append(src.ratio((c, "fla", mode), (c, "ours", mode)))
        if found[-1] and mode == "fwd":
          fla_over.append(found[-1][0])
        ours.append(f"{mine['time_ms']:#.3g}")
        fla.append(f"{theirs['time_ms']:#.3g}" if theirs else fails.cell(src, c, "fla", mode))
        for impl in ("fla", "scan", "xla_chunked"):
          wall[impl, c, mode] = src.ratio((c, impl, mode), (c, "ours", mode), WALL)
      same = lambda xs: xs[0] if len(set(xs)) == 1 else " / ".join(xs)
      cells += [" / ".join(ours), same(fla),
                " / ".join(ratio_cell(f) for f in found) if any(found) else "–"]
    rows.append([label, *cells])
  header = ["shape", "ours fwd", "fla fwd", "fla/ours fwd", "ours f+b", "fla f+b",
            "fla/ours f+b"]
  shapes = [s for _, s in LINEAR_SHAPES]
  walls = lambda impl, mode: [wall[impl, f"{s}_{n}", mode] for s in shapes for n in seqs]
  scan = [wall["scan", f"{s}_4k", "fwd"][0] for s in shapes]
  memory = [src.row(f"{s}_16k", "ours", "fwd", ("compiled_memory",)) for s in shapes]
  gla_fb = [f for f in (src.ratio((f"{shapes[0]}_{n}", "fla", "fwd_bwd"),
                                  (f"{shapes[0]}_{n}", "ours", "fwd_bwd")) for n in seqs) if f]
  join = lambda found: " / ".join(num(w and w[0]) for w in found)
  fla_wall = ["; ".join(f"{label.split()[0]} {join(walls('fla', 'fwd')[i * 3:i * 3 + 3])}"
                        for i, (label, _) in enumerate(LINEAR_SHAPES)),
              join(walls("fla", "fwd_bwd")[:3])]
  chunked = [w[0] for w in walls("xla_chunked", "fwd") if w]
  spread = max(r["range"][1] - r["range"][0] for d in src.used for r in d["ratios"])
  footnote = "".join(f"\\* {where}: {note.split('. ')[0]}. " for note, where in fails.notes.items())
  return [f"**Linear attention**, kernel time per call (ms) at S = 4k / 8k / 16k; fla / ours: "
          f"median of the per-round ratios (ranges within "
          f"{math.ceil(spread * 100) / 100:.2f}). {src.caption()}", "",
          *table(header, rows), "",
          f"{footnote}Wall clock, fla / ours: forward {fla_wall[0]}; GLA forward+backward "
          f"{fla_wall[1]}. Against the `lax.scan` reference at 4k (forward): "
          + " / ".join(f"{x:.0f}x" for x in scan) + f"; the chunked pure-XLA version is "
          f"{min(chunked):.1f}-{max(chunked):.1f}x slower than ours (forward). Peak forward "
          "memory at 16k (arguments included): " + ", ".join(
              f"{label.split()[0]} {decimal_bytes(r)}" for (label, _), r in zip(LINEAR_SHAPES,
                                                                              memory) if r)
          + f". Targets: >= 10x the scan reference: {met(min(scan) >= 10)}; within 1.2x of "
          f"flash-linear-attention (forward fla/ours {min(fla_over):.2f}-{max(fla_over):.2f} by "
          f"kernel time, GLA forward+backward {min(f[0] for f in gla_fb):.2f}x ahead): "
          f"{met(min(fla_over) >= 1 / 1.2)}."]


def pallas_ref(folders) -> str:
  kinds = [(d, causal) for d in (64, 128) for causal in (False, True)]
  seqs = {False: ("1k", "4k", "16k"), True: ("4k", "16k")}
  case = lambda d, causal, s: f"{'causal' if causal else 'vanilla'}_{s}" + (
      "_d64" if d == 64 else "")
  src = Source(folders, [(case(d, causal, s), impl, "fwd_bwd", WALL) for d, causal in kinds
                         for s in seqs[causal] for impl in ("pallas_attn", "jax_pallas_mha")])
  ratios, cudnn, ours = [], [], []
  for d, causal in kinds:
    for s in seqs[causal]:
      c = case(d, causal, s)
      ratios.append(src.ratio((c, "jax_pallas_mha", "fwd_bwd"), (c, "pallas_attn", "fwd_bwd"),
                              WALL)[0])
      ours.append(src.row(c, "pallas_attn", "fwd_bwd", WALL)["tflops"])
      cudnn.append(src.row(c, "cudnn", "fwd_bwd", WALL)["tflops"] / ours[-1])
  held = Source(folders, [(f"vanilla_{s}", "pallas_attn", m, ("compiled_memory",))
                          for s in ("16k", "64k") for m in MODES])
  memory = {(impl, s, m): decimal_bytes(held.row(f"vanilla_{s}", impl, m, ("compiled_memory",)))
            for impl in ("pallas_attn", "cudnn", "xla") for s in ("16k", "64k") for m in MODES}
  return (f"- **Forward+backward against JAX's Pallas reference** (one run, wall; B = 16k / S, "
          f"H16, d 64 and 128, causal or not, S = 1k-16k): ours {min(ours):.0f}-{max(ours):.0f} "
          f"TFLOP/s, the reference's time / ours {min(ratios):.2f}-{max(ratios):.2f}, >= 2x: "
          f"{met(min(ratios) >= 2)}; cuDNN ran "
          f"{min(cudnn):.1f}-{max(cudnn):.1f}x ours. Compiled memory (B1 H16 d128): forward "
          f"{memory['pallas_attn', '16k', 'fwd']} at 16k and {memory['pallas_attn', '64k', 'fwd']}"
          f" at 64k, forward+backward {memory['pallas_attn', '16k', 'fwd_bwd']} / "
          f"{memory['pallas_attn', '64k', 'fwd_bwd']} (cuDNN {memory['cudnn', '16k', 'fwd_bwd']} /"
          f" {memory['cudnn', '64k', 'fwd_bwd']}; XLA {memory['xla', '16k', 'fwd_bwd']} at 16k, "
          f"{memory['xla', '64k', 'fwd_bwd']} at 64k). {held.caption()}")


def tuning(folders) -> str:
  cases = [c + s for c in ("vanilla_", "causal_") for s in ("4k", "16k", "4k_d64", "16k_d64")]
  src = Source(folders, [(c, "tuned", "fwd", ("tuner", "throughput")) for c in cases])
  speed, seconds = [], []
  for r in src.files[0]["rows"]:  # the latest run holding every case
    if r["impl"] == "tuned" and r["time_ms"]:
      base = src.row(r["case"], "heuristic", "fwd", (r["measure"],))
      speed.append(base["time_ms"] / r["time_ms"])
      seconds.append(r["extra"]["tuning_s"])
  return (f"**Tuning**: tuned >= 1.15x heuristic in under 2 minutes per shape: "
          f"{statistics.mean(speed):.2f}x mean ({min(speed):.2f}-{max(speed):.2f}), "
          f"{min(seconds):.1f}-{max(seconds):.1f} s per case (12 s, 10 candidates; "
          f"`{src.used[0]['path']}`): "
          f"{met(statistics.mean(speed) >= 1.15 and max(seconds) < 120)}.")


# label, decay kind, the run of the shipped defaults (`pallas_attn/kernels/linear/delta_rule.py`)
DELTA_ROWS = [("DeltaNet, H16", "deltanet_h16_d128_4k"),
              ("Gated DeltaNet, H16", "gated_deltanet_h16_d128_4k"),
              ("Gated DeltaNet, H32 (Qwen3-Next)", "gated_deltanet_qwen3_next_h32_d128_4k"),
              ("KDA, H16", "kda_h16_d128_4k")]


def delta_rule(folders) -> list[str]:
  """Issue 39's table: ours (the Mosaic GPU forward where it runs) against
  fla's chunk kernels and our Triton passes, forward and f+b."""
  src = newest_cells(folders, [(case, "ours", "fwd", ("kernel",)) for _, case in DELTA_ROWS])
  fails, rows, over = Failures(), [], {mode: [] for mode in MODES}
  for label, case in DELTA_ROWS:
    cells = [label]
    for mode in MODES:
      mine = src.row(case, "ours", mode)
      if mine is None or mine["time_ms"] is None:
        cells += [fails.cell(src, case, "ours", mode), "–", "–"]
        continue
      cells.append(f"{mine['time_ms']:#.3g}")
      for peer in ("fla", "ours_triton"):
        found = src.ratio((case, peer, mode), (case, "ours", mode))
        if found and peer == "fla":
          over[mode].append((found[0], label))
        cells.append(ratio_cell(found) if found else fails.cell(src, case, peer, mode))
    rows.append(cells)
  header = ["row", "ours fwd ms", "fla / ours", "Triton / ours", "ours f+b ms",
            "fla / ours f+b", "Triton / ours f+b"]
  lines = [f"Kernel time per call, the median of alternating rounds; B4 S4096 d128 bf16. "
           f"{src.caption()}", "", *table(header, rows), *fails.lines(), ""]
  for mode in MODES:
    found = over[mode]
    lines.append(f"- {MODES[mode].capitalize()} >= 1.2x fla"
                 + (" where fla's backward runs" if mode == "fwd_bwd" else "") + ": "
                 + ", ".join(f"{label} {x:.2f}" for x, label in found)
                 + f": {met(bool(found) and min(x for x, _ in found) >= 1.2)}.")
  scan = [(found[0], label) for label, case in DELTA_ROWS if (found := src.ratio(
      (case, "scan", "fwd"), (case, "ours", "fwd"), ("throughput",)))]
  lines.append("- Forward >= 20x the `lax.scan` of the recurrence (throughput): "
               + ", ".join(f"{label} {x:.0f}x" for x, label in scan)
               + f": {met(len(scan) == len(DELTA_ROWS) and min(x for x, _ in scan) >= 20)}.")
  return lines


SECTIONS = [("user_variants", "Issue 37: every variant in both mask forms, and first calls", user_variants),
            ("variants", "Issue 15: the Mosaic GPU forward and backward", variants),
            ("terms", "Issue 14: computed-index captures, sinks", terms),
            ("block_mask", "Issue 14, item 3: block-mask builds", block_mask),
            ("train_example", "Issue 16: a small LM trained with the layers", train_example),
            ("decoding", "Issue 17: split-KV decoding", decoding),
            ("fp8_decoding", "Issue 40: decoding from an fp8 cache", fp8_decoding),
            ("fp8_prefill", "Issue 40: fp8 prefill on fp8 tensor cores", fp8_prefill),
            ("multi_gpu", "Issues 41 and 42: several GPUs of one host", multi_gpu),
            ("chunked_hopper", "Issue 38: the chunked-recurrent pattern on Hopper",
             chunked_hopper),
            ("delta_rule", "Issue 39: the delta rule (DeltaNet, Gated DeltaNet, KDA)", delta_rule),
            ("earlier", "Earlier issues (resolved): the latest measurements", earlier)]


HISTORY = "history"  # NOTES.md's section of what was tried and superseded: listed by subject


def history(body: list[str]) -> list[str]:
  """NOTES.md's history bullets by subject: each one's words before its first
  ` (` or `:`."""
  subjects = [re.split(r" \(|:", line[2:], maxsplit=1)[0] for line in body
              if line.startswith("- ")]
  return [f"In `NOTES.md` (`## {HISTORY}`), one line each: "
          + "; ".join(s[:1].lower() + s[1:] if s[:1] != "`" else s for s in subjects) + "."]


def lead(key: str, body: list[str]) -> list[str]:
  """A NOTES.md section's first paragraph (what the table's rows are and which
  runs they come from) and, where it goes on, where the rest is: the design,
  its evidence and what was tried stay in NOTES.md."""
  text = "\n".join(body).strip()
  if not text:
    return []
  first, _, rest = text.partition("\n\n")
  more = [f"More in `NOTES.md`, `## {key}`."]
  return ["", *first.splitlines()] + (["", *more] if rest.strip() else [])


def notes() -> dict[str, list[str]]:
  """NOTES.md's sections by key."""
  found, key = {}, None
  with open(os.path.join(RESULTS, "NOTES.md")) as f:
    for line in f.read().splitlines():
      if line.startswith("## "):
        key = line[3:].strip()
        found[key] = []
      elif key is not None:
        found[key].append(line)
  return found


def main():
  folders = [Folder(p) for p in sorted(glob.glob(os.path.join(RESULTS, "*_*/")), reverse=True)]
  written = notes()
  lines = ["# Benchmark results: the current tables against the targets", "",
           "Generated by `benchmarks/summarize.py` from the newest runs in "
           "`benchmarks/results/<date>_<device>/` and `NOTES.md` (edit those, not this file).",
           "", METHOD]
  for key, title, make in SECTIONS:
    try:
      made = make(folders)
    except (LookupError, TypeError, ValueError, ZeroDivisionError) as e:  # a run lacks cells
      made = [f"(no results to table: {type(e).__name__}: {e})"]
    lines += ["", f"## {title}", "", *made]
    lines += lead(key, written.pop(key, []))
  past = written.pop(HISTORY, [])
  for key, body in written.items():
    lines += ["", f"## {key}", *lead(key, body)]
  if any(past):
    lines += ["", "## History: what was tried, the one-off scripts' findings", "", *history(past)]
  text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).rstrip() + "\n"
  with open(os.path.join(RESULTS, "SUMMARY.md"), "w") as f:
    f.write(text)
  print(f"wrote {os.path.join(RESULTS, 'SUMMARY.md')}: {text.count(chr(10))} lines")


if __name__ == "__main__":
  main()
