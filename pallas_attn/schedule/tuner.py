"""Grid-search tuner: compile candidates in parallel, time them, keep the fastest correct one.

`tune` is generic: it takes `build(config) -> zero-arg callable returning
arrays` and the candidate configs, so it serves every template. The baseline
(the heuristic default) runs first and its output is the reference every
other candidate must match. The rest are compiled (by their first call) a
pool-sized chunk at a time in a thread pool, checked, then timed one by one
so that timings do not overlap compilation. Candidates not started when the
time budget runs out are skipped.

`tune_template` tunes one template's search space for a shape and stores
the winner in the persistent cache: it reaches the template only by its
registered name (schedule/template.py); what to run comes from the caller's
`build` (`pallas_attn.tuning.tune_attention` builds `attention`'s passes).
Tuning never happens implicitly.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from pallas_attn.schedule import cache
from pallas_attn.schedule.device import device_config
from pallas_attn.schedule.search_space import format_config, search_space
from pallas_attn.schedule.template import ProblemShape
from pallas_attn.schedule.timing import median_time_ms

_TOLERANCES = {"bfloat16": 2e-2, "float16": 5e-3}
_FP32_TOLERANCE = 1e-3  # float32 and anything else: tile order (and TF32) only


@dataclasses.dataclass(frozen=True)
class Trial:
  """One candidate's outcome: a time, or why it was rejected."""
  config: Any
  time_ms: float | None = None
  rel_error: float | None = None
  error: str | None = None

  @property
  def ok(self) -> bool:
    return self.time_ms is not None


@dataclasses.dataclass(frozen=True)
class TuningResult:
  """The fastest correct config, the baseline it beat, and every trial."""
  best: Any
  best_ms: float
  baseline: Any
  baseline_ms: float | None  # None when the baseline itself failed
  trials: tuple[Trial, ...]
  skipped: int  # candidates left untried when the budget ran out
  elapsed_s: float

  @property
  def speedup(self) -> float | None:
    """Baseline time over best time (>= 1), or None without a baseline time."""
    return None if self.baseline_ms is None else self.baseline_ms / self.best_ms


def default_tolerance(dtype) -> float:
  """Relative error bound between two tilings of the same computation in `dtype`."""
  return _TOLERANCES.get(jnp.dtype(dtype).name, _FP32_TOLERANCE)


def relative_error(out, ref) -> float:
  """max |out - ref| / max |ref| over all arrays (the worst leaf); NaN if any output is NaN."""
  out_leaves, out_tree = jax.tree.flatten(out)
  ref_leaves, ref_tree = jax.tree.flatten(ref)
  if out_tree != ref_tree:
    raise ValueError(f"output structure {out_tree} differs from the reference's {ref_tree}")
  worst = 0.0
  for o, r in zip(out_leaves, ref_leaves):
    if o.shape != r.shape:
      raise ValueError(f"output shape {o.shape} differs from the reference's {r.shape}")
    o, r = jnp.asarray(o, jnp.float32), jnp.asarray(r, jnp.float32)
    err = float(jnp.max(jnp.abs(o - r), initial=0.0) /
                jnp.maximum(jnp.max(jnp.abs(r), initial=0.0), 1e-30))
    if math.isnan(err):
      return err
    worst = max(worst, err)
  return worst


def _describe(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def _compile(build: Callable, config) -> tuple[Callable | None, Any, str | None]:
  """Builds and runs `config` once (compiling it): (fn, output, None) or (None, None, error)."""
  try:
    fn = build(config)
    out = jax.block_until_ready(fn())
  except Exception as e:  # A candidate may fail to lower or compile; skip it.
    return None, None, _describe(e)
  return fn, out, None


def _compile_and_check(build: Callable, config, reference, rtol: float):
  fn, out, error = _compile(build, config)
  if error:
    return None, Trial(config, error=error)
  try:
    err = relative_error(out, reference)
  except ValueError as e:
    return None, Trial(config, error=str(e))
  if not err <= rtol:  # NaN fails too.
    return None, Trial(config, rel_error=err,
                       error=f"relative error {err:.3g} > {rtol:.3g} vs the baseline")
  return fn, Trial(config, rel_error=err)


def _timed(trial: Trial, fn: Callable, timer: Callable[[Callable], float]) -> Trial:
  try:
    return dataclasses.replace(trial, time_ms=timer(fn))
  except Exception as e:  # A run that compiled can still fail at launch.
    return dataclasses.replace(trial, error=_describe(e))


def _all_finite(tree) -> bool:
  return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree)
             if jnp.issubdtype(x.dtype, jnp.inexact))


def tune(build: Callable[[Any], Callable[[], Any]], candidates, *, baseline=None,
         budget_s: float = 60.0, rtol: float | None = None,
         timer: Callable[[Callable], float] = median_time_ms, workers: int | None = None,
         progress: Callable[[str], None] | None = None) -> TuningResult:
  """Times every candidate config of `build` and returns the fastest correct one.

  build: config -> zero-arg callable returning the output arrays.
  baseline: the reference config (default: the first candidate); it is always
    timed, and outputs must match its output within `rtol` (default by the
    output dtype). If it fails, the first candidate that runs becomes the
    reference.
  budget_s: no new candidate starts after this many seconds.
  timer: fn -> milliseconds (median of repeated runs after warm-up).
  workers: threads compiling at once (default: min(8, CPUs)).
  """
  start = time.perf_counter()
  deadline = start + budget_s
  report = progress or (lambda _: None)
  queue = list(dict.fromkeys(candidates))
  if baseline is None and not queue:
    raise ValueError("nothing to tune: no candidates and no baseline")
  baseline = queue[0] if baseline is None else baseline
  queue = [baseline] + [c for c in queue if c != baseline]
  total = len(queue)
  trials: list[Trial] = []

  def record(trial: Trial) -> None:
    trials.append(trial)
    outcome = f"{trial.time_ms:.4g} ms" if trial.ok else f"rejected: {trial.error}"
    report(f"[{len(trials)}/{total}] {format_config(trial.config)}: {outcome}")

  reference = None
  while reference is None and queue:
    config = queue.pop(0)
    fn, out, error = _compile(build, config)
    if error is None and not _all_finite(out):
      error = "non-finite output"
    if error:
      record(Trial(config, error=error))
      continue
    trial = _timed(Trial(config, rel_error=0.0), fn, timer)
    record(trial)
    if trial.ok:
      reference = out
  if reference is None:
    raise RuntimeError("no candidate config ran: " + "; ".join(
        f"{format_config(t.config)}: {t.error}" for t in trials))
  if rtol is None:
    rtol = max(default_tolerance(x.dtype) for x in jax.tree.leaves(reference))

  workers = workers or min(8, os.cpu_count() or 1)
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    while queue and time.perf_counter() < deadline:
      chunk, queue = queue[:workers], queue[workers:]
      checked = pool.map(
          functools.partial(_compile_and_check, build, reference=reference, rtol=rtol),
          chunk)
      for fn, trial in checked:
        record(_timed(trial, fn, timer) if fn else trial)
  if queue:
    report(f"time budget of {budget_s:g} s spent; skipped {len(queue)} candidates")

  best = min((t for t in trials if t.ok), key=lambda t: t.time_ms)
  return TuningResult(
      best=best.config, best_ms=best.time_ms, baseline=baseline,
      baseline_ms=trials[0].time_ms,  # the baseline always runs first
      trials=tuple(trials), skipped=len(queue),
      elapsed_s=time.perf_counter() - start)


def tune_template(template: str, fingerprint: str, build: Callable, shape: ProblemShape, *,
                  budget_s: float = 60.0, max_candidates: int | None = None,
                  axes: dict | None = None, warmup: int = 3, reps: int = 10,
                  store: bool = True, block_sparse: bool = False,
                  scores_per_position: bool = False,
                  progress: Callable[[str], None] | None = None) -> TuningResult:
  """Tunes `build` over `template`'s search space on this device; stores the winner.

  The heuristic default is the baseline and reference. axes: overrides of
  the values searched per config field, e.g. {"num_stages": (2, 3)};
  max_candidates keeps the candidates nearest the default. block_sparse,
  scores_per_position: facts of the variant its heuristic default reads.
  """
  space = search_space(template, shape, device_config(), block_sparse=block_sparse,
                       scores_per_position=scores_per_position,
                       **(axes or {}))
  report = progress or (lambda _: None)
  report(space.summary())
  result = tune(build, space.candidates[:max_candidates], baseline=space.default,
                budget_s=budget_s,
                timer=functools.partial(median_time_ms, warmup=warmup, reps=reps),
                progress=report)
  if store:
    cache.store_config(template, fingerprint, result.best, q_shape=shape.q_shape,
                       k_shape=shape.k_shape, v_shape=shape.v_shape, dtype=shape.dtype,
                       time_ms=result.best_ms, baseline_ms=result.baseline_ms)
  return result
