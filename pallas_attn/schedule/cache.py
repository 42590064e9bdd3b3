"""The persistent tuning cache: the best config per call signature, as JSON on disk.

The file lives at `$PALLAS_ATTN_CACHE` if set (a file path), else
`$XDG_CACHE_HOME/pallas_attn/tuning.json` (default `~/.cache/...`):

  {"format": 1,
   "entries": {"<key string>": {"key": {<CacheKey fields>},
                                "config": {<config fields>},
                                "time_ms": 0.41, "baseline_ms": 0.52,
                                "tuned_at": "2025-01-01T00:00:00Z"}}}

A key names the template, the variant's fingerprint, the template's shape
bucket (`Template.cache_bucket`: batch*heads and sequence lengths rounded up
to powers of two, head dims, the GQA group and the dtype exact), the device
kind and the jax and pallas_attn versions. Every sequence length in a bucket
pads to the same power of two, so a config stored for the bucket is valid
for all of it. Templates are found by name in the registry
(schedule/template.py).

Writers take a lock file where the OS has one, re-read the file, apply their
change and replace the file atomically (temp file + `os.replace`), so
concurrent tuners neither corrupt the file nor drop each other's entries.
Lookups never tune: a miss returns None.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import pathlib
import tempfile
import warnings
from typing import Callable

import jax

from pallas_attn._version import __version__
from pallas_attn.schedule import template as template_lib
from pallas_attn.schedule.device import current_device_kind
from pallas_attn.schedule.template import Config, ProblemShape

try:
  import fcntl
except ImportError:  # Not POSIX: atomic replace only.
  fcntl = None

CACHE_ENV = "PALLAS_ATTN_CACHE"
FORMAT_VERSION = 1
_CACHES: dict[pathlib.Path, TuningCache] = {}
_WARNED: set = set()  # cache files (and entries) already reported unreadable


class CacheFileError(ValueError):
  """A cache file that cannot be read or is not a tuning cache."""


def package_version() -> str:
  """pallas_attn's version (a cache-key field)."""
  return __version__


def default_cache_path() -> pathlib.Path:
  """`$PALLAS_ATTN_CACHE`, else the user's cache dir."""
  override = os.environ.get(CACHE_ENV)
  if override:
    return pathlib.Path(override).expanduser()
  base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
  return pathlib.Path(base) / "pallas_attn" / "tuning.json"


@dataclasses.dataclass(frozen=True)
class CacheKey:
  """What a tuned config is valid for."""
  template: str
  fingerprint: str
  batch_heads: int  # next power of two of batch * query heads
  group: int  # query heads per kv head
  seq_q: int  # next power of two
  seq_kv: int  # next power of two
  d_qk: int
  d_v: int
  dtype: str
  device_kind: str
  jax_version: str
  pallas_attn_version: str

  @classmethod
  def create(cls, template: str, fingerprint: str, shape: ProblemShape, *,
             device_kind: str | None = None) -> "CacheKey":
    return cls(
        template=template, fingerprint=fingerprint,
        **template_lib.get(template).cache_bucket(shape),
        device_kind=current_device_kind() if device_kind is None else device_kind,
        jax_version=jax.__version__, pallas_attn_version=package_version())

  def to_string(self) -> str:
    return "|".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())


def _read_entries(path: pathlib.Path, *, missing_ok: bool = True) -> dict[str, dict]:
  try:
    text = path.read_text()
  except FileNotFoundError:
    if missing_ok:
      return {}
    raise CacheFileError(f"no tuning cache at {path}") from None
  except OSError as e:
    raise CacheFileError(f"cannot read tuning cache {path}: {e}") from e
  try:
    data = json.loads(text)
  except json.JSONDecodeError as e:
    raise CacheFileError(f"tuning cache {path} is not valid JSON: {e}") from e
  if not (isinstance(data, dict) and data.get("format") == FORMAT_VERSION
          and isinstance(data.get("entries"), dict)):
    raise CacheFileError(
        f"{path} is not a pallas_attn tuning cache (format {FORMAT_VERSION})")
  return data["entries"]


def _write_entries(path: pathlib.Path, entries: dict[str, dict]) -> None:
  """Writes atomically: a temp file in the same directory, then `os.replace`."""
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "w") as f:
      json.dump({"format": FORMAT_VERSION, "entries": entries}, f, indent=1,
                sort_keys=True)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(tmp)
    raise


@contextlib.contextmanager
def _locked(path: pathlib.Path):
  """Serializes read-modify-write cycles on `path` across processes."""
  if fcntl is None:
    yield
    return
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path.with_name(f".{path.name}.lock"), "a") as lock:
    fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _is_faster(new: dict, old: dict) -> bool:
  new_ms, old_ms = new.get("time_ms"), old.get("time_ms")
  return new_ms is not None and (old_ms is None or new_ms < old_ms)


class TuningCache:
  """One cache file. Reads are memoized until the file changes on disk."""

  def __init__(self, path: str | os.PathLike):
    self.path = pathlib.Path(path)
    self._snapshot: tuple[tuple, dict[str, dict]] | None = None

  def entries(self) -> dict[str, dict]:
    """All entries by key string (memoized while the file is unchanged).

    Every write replaces the file, so a new inode, mtime or size means new contents.
    """
    try:
      st = self.path.stat()
    except FileNotFoundError:
      return {}
    signature = (st.st_ino, st.st_mtime_ns, st.st_size)
    if self._snapshot is None or self._snapshot[0] != signature:
      self._snapshot = (signature, _read_entries(self.path))
    return self._snapshot[1]

  def get(self, key: CacheKey) -> dict | None:
    return self.entries().get(key.to_string())

  def _update(self, change: Callable[[dict[str, dict]], int]) -> int:
    with _locked(self.path):
      entries = _read_entries(self.path)
      changed = change(entries)
      if changed:
        _write_entries(self.path, entries)
    return changed

  def put(self, key: CacheKey, config: Config, *, time_ms: float | None = None,
          baseline_ms: float | None = None) -> None:
    """Stores (or replaces) the config for `key`."""
    entry = {
        "key": dataclasses.asdict(key), "config": config.to_dict(),
        "time_ms": time_ms, "baseline_ms": baseline_ms,
        "tuned_at": datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%dT%H:%M:%SZ"),
    }

    def add(entries):
      entries[key.to_string()] = entry
      return 1

    self._update(add)

  def merge(self, other_path: str | os.PathLike) -> int:
    """Adds another cache file's entries (e.g. a shipped one); returns how many changed.

    On a shared key the faster measured entry wins; an entry without a time
    never replaces one with a time.
    """
    incoming = _read_entries(pathlib.Path(other_path), missing_ok=False)

    def merge_into(entries):
      changed = 0
      for key, entry in incoming.items():
        if key not in entries or _is_faster(entry, entries[key]):
          entries[key] = entry
          changed += 1
      return changed

    return self._update(merge_into)

  def export(self, path: str | os.PathLike) -> int:
    """Writes all entries to `path` (a cache file others can `merge`); returns the count."""
    entries = _read_entries(self.path)
    _write_entries(pathlib.Path(path), entries)
    return len(entries)

  def clear(self) -> int:
    """Removes every entry; returns how many there were."""

    def drop_all(entries):
      count = len(entries)
      entries.clear()
      return count

    return self._update(drop_all)


def get_cache(path: str | os.PathLike | None = None) -> TuningCache:
  """The cache at `path`, default `default_cache_path()` (re-read from the env each call)."""
  path = pathlib.Path(path) if path is not None else default_cache_path()
  cache = _CACHES.get(path)
  if cache is None:
    cache = _CACHES[path] = TuningCache(path)
  return cache


def lookup_config(template: str, fingerprint: str, *, q_shape, k_shape, v_shape,
                  dtype) -> Config | None:
  """The cached config for this call on the current device, or None (never tunes).

  An unreadable cache file, or an entry whose config its class now rejects
  (stored before a rule was added), is reported once as a warning and
  treated as a miss; re-tuning the shape replaces the entry.
  """
  shape = ProblemShape.from_shapes(q_shape, k_shape, v_shape, dtype)
  key = CacheKey.create(template, fingerprint, shape)
  cache = get_cache()
  try:
    entry = cache.get(key)
  except CacheFileError as e:
    _warn_once(cache.path, f"{e}; using heuristic configs")
    return None
  if entry is None:
    return None
  try:
    return template_lib.get(template).config_class.from_dict(entry["config"])
  except ValueError as e:
    _warn_once((cache.path, key), f"tuning cache {cache.path}: ignoring the {template} entry "
               f"for this shape: {e}; using heuristic configs")
    return None


def _warn_once(what, message: str) -> None:
  if what not in _WARNED:
    _WARNED.add(what)
    warnings.warn(message, stacklevel=3)


def store_config(template: str, fingerprint: str, config: Config, *, q_shape, k_shape,
                 v_shape, dtype, time_ms: float | None = None,
                 baseline_ms: float | None = None) -> CacheKey:
  """Stores a tuned config for this call on the current device; returns its key."""
  config_class = template_lib.get(template).config_class
  if not isinstance(config, config_class):
    raise TypeError(f"template {template!r} takes a {config_class.__name__}, got {config!r}")
  shape = ProblemShape.from_shapes(q_shape, k_shape, v_shape, dtype)
  key = CacheKey.create(template, fingerprint, shape)
  get_cache().put(key, config, time_ms=time_ms, baseline_ms=baseline_ms)
  return key
