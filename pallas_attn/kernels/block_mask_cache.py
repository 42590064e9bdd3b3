"""Eager block-mask builds: compiled builders, cached per mask and shape.

`block_mask` (`pallas_attn.block_mask`) and `attention` build a mask_mod's
tile lists with a builder compiled once per mask program, shapes and tiles
(`compiled_builder`), that takes mask_mod's captured arrays as arguments: a
new closure of the same code over new arrays of the same shapes reuses it.
Finding the builder for a mask_mod by its analysis' fingerprint costs a
trace and an analysis; a walk over mask_mod's Python closure (`_Walk`) finds
it without either where what mask_mod reads is plain.
"""
from __future__ import annotations

import builtins
import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np

from pallas_attn.kernels import backend
from pallas_attn.kernels.block_mask import (TILE_BOUNDS, BlockMask, build_block_masks,
                                            build_bounded_masks)
from pallas_attn.schedule.config import clamp_block, heuristic_config
from pallas_attn.spec.analysis import VariantAnalysis, analyze_variant
from pallas_attn.spec.mask_bounds import has_tile_bounds
from pallas_attn.spec.trace import is_concrete, staging

_BUILDERS: dict = {}  # fingerprint, argument types, shapes -> compiled builder
_TRACED: dict = {}    # block_mask's jaxpr text, shapes -> (compiled builder, capture positions)
_CACHE_MAX = 64


def clear():
  """Drops every compiled builder (with `jax.clear_caches()`, a process's
  compiled programs: each holds a few of the kernel's memory mappings)."""
  _BUILDERS.clear()
  _TRACED.clear()


def _remember(cache: dict, key, value):
  """Stores `value` under `key`, dropping the oldest entry past `_CACHE_MAX`."""
  if len(cache) >= _CACHE_MAX:
    cache.pop(next(iter(cache)))
  cache[key] = value
  return value


def _arg_types(consts) -> tuple:
  """What a compiled builder is specialized to in its arguments."""
  return tuple((jax.typeof(c), getattr(c, "sharding", None)) for c in consts)


def _with_consts(analysis: VariantAnalysis, consts) -> VariantAnalysis:
  mask = analysis.mask_mod
  return dataclasses.replace(analysis, mask_mod=dataclasses.replace(
      mask, traced=dataclasses.replace(mask.traced, consts=tuple(consts))))


def compiled_builder(analysis: VariantAnalysis, batch, heads, seq_q, seq_kv, tilings, interpret):
  """`build_block_masks` of `analysis` as a compiled function of mask_mod's
  captured arrays (concrete), cached per fingerprint, argument types, shapes,
  tilings and interpret mode: new values of the same shapes reuse it, and no
  value is baked in. A compiled executable runs at once when called, so it
  is called only where operations run now (`built_masks`, `block_mask`).
  """
  consts = analysis.mask_mod.traced.consts
  key = (analysis.fingerprint(), _arg_types(consts), batch, heads, seq_q, seq_kv, tilings,
         interpret)
  if key not in _BUILDERS:
    program = _with_consts(analysis, ())  # keeps no captured values alive
    build = lambda consts: build_block_masks(_with_consts(program, consts), batch, heads, seq_q,
                                             seq_kv, tilings, interpret)
    _remember(_BUILDERS, key, jax.jit(build).lower(consts).compile())
  return _BUILDERS[key]


HOST_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


def host_builder(analysis: VariantAnalysis, batch, heads, seq_q, seq_kv, tilings):
  """`build_bounded_masks` of `analysis` compiled for the host CPU as a
  function of mask_mod's captured arrays (NumPy), cached as
  `compiled_builder`'s: it runs at once, also inside a trace, and no device
  kernel is compiled or run."""
  consts = tuple(np.asarray(c) for c in analysis.mask_mod.traced.consts)
  cpu = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
  args = tuple(jax.ShapeDtypeStruct(c.shape, c.dtype, sharding=cpu) for c in consts)
  key = ("host", analysis.fingerprint(), args, batch, heads, seq_q, seq_kv, tilings)
  if key not in _BUILDERS:
    program = _with_consts(analysis, ())
    build = lambda consts: build_bounded_masks(_with_consts(program, consts), batch, heads,
                                               seq_q, seq_kv, tilings)
    _remember(_BUILDERS, key, jax.jit(build).lower(args).compile(HOST_COMPILER_OPTIONS))
  return _BUILDERS[key], consts


def built_masks(analysis: VariantAnalysis, batch, heads, seq_q, seq_kv, tilings,
                interpret) -> tuple:
  """`build_block_masks` of `analysis`, compiling and running no device
  kernel while a function is traced: where operations run now and
  mask_mod's captured arrays are concrete, by its compiled builder; in a
  trace with them concrete (closed over), from the tile bounds on the host
  CPU (`host_builder`; the lists are NumPy constants of the trace); else,
  and where no bound reaches mask_mod's result, in the traced program."""
  consts = analysis.mask_mod.traced.consts
  shape = (batch, heads, seq_q, seq_kv, tilings, interpret)
  if not all(map(is_concrete, consts)):
    return build_block_masks(analysis, *shape)
  if not staging():
    return compiled_builder(analysis, *shape)(consts)
  if not (TILE_BOUNDS and has_tile_bounds(analysis)):
    return build_block_masks(analysis, *shape)
  build, host_consts = host_builder(analysis, *shape[:5])
  return tuple(jax.tree.map(np.asarray, m) for m in build(host_consts))


_MASK_ARGS = [jax.ShapeDtypeStruct((), jnp.int32)] * 4


def _traced_key(mask_mod):
  """(mask_mod's jaxpr as text and its captures' types, its captured
  arrays): what the analysis fingerprint hashes, from one trace and no
  analysis. None where mask_mod does not trace (the analysis then says why)
  or captures traced values."""
  try:
    closed = jax.make_jaxpr(mask_mod)(*_MASK_ARGS)
  except Exception:  # analyze_variant reports it
    return None, ()
  if not all(map(is_concrete, closed.consts)):
    return None, ()
  return (str(closed.jaxpr), _arg_types(closed.consts)), tuple(closed.consts)


def _positions(consts, captured):
  """Where each of the analysis' `consts` is among `captured` (the arrays of
  `_traced_key`'s trace), or None if one is not (an array held inside a
  nested jit: then every call runs the analysis)."""
  positions = [next((n for n, c in enumerate(captured) if c is x), None) for x in consts]
  return None if None in positions else tuple(positions)


# Eager builds without a trace. What mask_mod's trace can depend on is its
# code and what that code reads: closure cells, defaults and the globals it
# names, and so on through the functions among them. `_Walk` describes that
# as a hashable key, with every concrete jax Array by its type alone and
# collected as a leaf, so a new closure of the same code over new arrays of
# the same shapes (per-batch document ids) finds the builder of the first
# and passes it the new arrays. A key is cached only after a trace with the
# leaves abstract shows that the jaxpr cannot depend on their values (as it
# would through `int(x)`); values the walk cannot describe (objects, other
# modules, tracers) fall back to tracing mask_mod on every call.

class _Unkeyable(Exception):
  """A value `_Walk` cannot describe."""


_LIBRARIES = frozenset(["jax", "jaxlib", "numpy", "ml_dtypes", "math", "operator", "functools",
                        "builtins", "typing"])
_LIBRARY_MODULES = _LIBRARIES | {"pallas_attn"}  # module objects that hold no user values
_SCALARS = frozenset([bool, int, str, bytes, type(None), type(Ellipsis)])
_MAX_NODES = 2000  # values one walk may visit before giving up (huge global containers)


def _library(module, names=_LIBRARIES) -> bool:
  return isinstance(module, str) and module.partition(".")[0] in names


@functools.lru_cache(maxsize=512)
def _code_names(code) -> tuple:
  """Names that `code` and the code nested in it (lambdas, comprehensions)
  look up: globals, builtins and attribute names alike."""
  names = list(code.co_names)
  for c in code.co_consts:
    if isinstance(c, types.CodeType):
      names.extend(_code_names(c))
  return tuple(dict.fromkeys(names))


class _Walk:
  """`value(v)` -> (key, v'): a hashable description of `v` and, with
  `substitute` (one value per leaf), `v` rebuilt with those in place of its
  leaves (functions re-created over new cells and globals)."""

  def __init__(self, substitute=None):
    self.leaves, self._leaf_of, self._active = [], {}, set()
    self._substitute, self._nodes = substitute, 0

  def value(self, v):
    self._nodes += 1
    if self._nodes > _MAX_NODES:
      raise _Unkeyable("too large")
    t = type(v)
    if t in _SCALARS:
      return (t, v), v
    if t is float:
      return (t, v.hex()), v  # -0.0 is not 0.0, as a traced literal
    if t is complex:
      return (t, v.real.hex(), v.imag.hex()), v
    if isinstance(v, jax.Array):
      return self._array(v)
    if t is tuple or t is list:
      parts = [self.value(x) for x in v]
      return (t, *(k for k, _ in parts)), t(x for _, x in parts) if self._substitute else v
    if t is dict:
      parts = [(self.value(k)[0], k, self.value(x)) for k, x in v.items()]
      key = (t, *((kk, xk) for kk, _, (xk, _) in parts))
      return key, {k: x for _, k, (_, x) in parts} if self._substitute else v
    if t is types.FunctionType:
      return self._function(v)
    if isinstance(v, functools.partial) and _library(t.__module__):  # jax's Partial too
      (fk, f), (ak, a), (kk, kw) = (self.value(x) for x in (v.func, v.args, v.keywords))
      return (t, fk, ak, kk), t(f, *a, **kw) if self._substitute else v
    if t is types.ModuleType:
      if _library(v.__name__, _LIBRARY_MODULES):
        return (t, v.__name__), v
      raise _Unkeyable(f"module {v.__name__}")
    if isinstance(v, np.ndarray):  # mutable: by value, where small
      if v.dtype.hasobject or v.nbytes > 4096:
        raise _Unkeyable("numpy array")
      return (t, v.shape, v.dtype.str, v.tobytes()), v
    if isinstance(v, np.generic):
      return (t, v.tobytes()), v
    if isinstance(v, np.dtype):
      return (t, v.str), v
    # Library objects (jnp.int32, jax.nn.relu, np.add, min): themselves.
    if _library(t.__module__) and _library(getattr(v, "__module__", t.__module__)):
      try:
        hash(v)
      except TypeError:
        raise _Unkeyable(t.__name__) from None
      return ("object", v), v
    raise _Unkeyable(t.__name__)

  def _array(self, x):
    if not is_concrete(x):
      raise _Unkeyable("traced array")
    n = self._leaf_of.get(id(x))
    if n is not None:  # one array met twice is one argument; two arrays are two
      key = ("same", n)
    else:
      n = self._leaf_of[id(x)] = len(self.leaves)
      self.leaves.append(x)
      key = ("array", jax.typeof(x), x.sharding)
    return key, x if self._substitute is None else self._substitute[n]

  def _function(self, fn):
    if _library(fn.__module__) and not fn.__closure__:
      return ("object", fn), fn
    if id(fn) in self._active:
      raise _Unkeyable("recursive function")
    self._active.add(id(fn))
    code, scope = fn.__code__, fn.__globals__
    names, new_globals = [], {}
    for name in _code_names(code):
      if name in scope:
        key, value = self.value(scope[name])
        names.append((name, key))
        new_globals[name] = value
      else:  # a builtin, an attribute, or a NameError at trace time
        names.append((name, name in builtins.__dict__))
    try:
      cells = [self.value(c.cell_contents) for c in fn.__closure__ or ()]
    except ValueError:  # an empty cell
      raise _Unkeyable("empty closure cell") from None
    defaults = self.value(fn.__defaults__)
    kwdefaults = self.value(fn.__kwdefaults__)
    self._active.discard(id(fn))
    key = (types.FunctionType, code, tuple(names), tuple(k for k, _ in cells), defaults[0],
           kwdefaults[0])
    if not self._substitute:
      return key, fn
    new = types.FunctionType(code, {**scope, **new_globals}, fn.__name__, defaults[1],
                             tuple(types.CellType(c) for _, c in cells))
    new.__kwdefaults__ = kwdefaults[1]
    return key, new


def _closure_key(mask_mod):
  """(`_Walk`'s key of mask_mod, its leaves), or (None, ()) where it has none."""
  walk = _Walk()
  try:
    return walk.value(mask_mod)[0], walk.leaves
  except _Unkeyable:
    return None, ()


def _value_independent(mask_mod, leaves) -> bool:
  """Whether mask_mod traces with its leaves abstract (then its jaxpr is a
  function of the walk's key alone), none of them left a constant."""
  def rebuilt(leaves, *indices):
    return _Walk(substitute=leaves).value(mask_mod)[1](*indices)
  avals = [jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=jax.typeof(x).weak_type)
           for x in leaves]
  try:
    closed = jax.make_jaxpr(rebuilt)(avals, *_MASK_ARGS)
  except Exception:
    return False
  return not any(c is x for c in closed.consts for x in leaves)


_CLOSURES: dict = {}  # (_closure_key, shape) -> (compiled builder, capture positions) | None


def _eager_builder(mask_mod, shape):
  """(build, argument): `build(argument)[0]` is mask_mod's block mask at `shape`."""
  key, leaves = _closure_key(mask_mod)
  try:
    entry = _CLOSURES.get((key, *shape), _CLOSURES)
  except TypeError:  # an unhashable value in the key
    key = None
  if key is not None:
    key = (key, *shape)
    if entry is not _CLOSURES and entry is not None:
      build, positions = entry
      return build, tuple(leaves[p] for p in positions)
    if entry is _CLOSURES:  # first seen: analyzed once, below, and remembered
      # Through a new function: JAX reuses a function object's last trace,
      # also when the values it reads (in the key) have changed since.
      fresh = lambda b, h, q_idx, kv_idx: mask_mod(b, h, q_idx, kv_idx)
      analysis = analyze_variant(mask_mod=fresh)
      consts = analysis.mask_mod.traced.consts
      positions = _positions(consts, leaves)
      entry = None
      if (all(map(is_concrete, consts)) and positions is not None
          and _value_independent(mask_mod, leaves)):
        entry = (compiled_builder(analysis, *shape), positions)
      _remember(_CLOSURES, key, entry)
      if entry is not None:
        return entry[0], consts
  traced_key, captured = _traced_key(mask_mod)
  traced_key = None if traced_key is None else (traced_key, *shape)
  if traced_key not in _TRACED:
    analysis = analyze_variant(mask_mod=mask_mod)
    consts = analysis.mask_mod.traced.consts
    if not all(map(is_concrete, consts)):
      return (lambda _: build_block_masks(analysis, *shape)), None
    build = compiled_builder(analysis, *shape)
    positions = _positions(consts, captured)
    if traced_key is None or positions is None:
      return build, consts
    _remember(_TRACED, traced_key, (build, positions))
  build, positions = _TRACED[traced_key]
  return build, tuple(captured[p] for p in positions)


@functools.lru_cache(maxsize=256)
def _shape(batch, heads, seq_q, seq_kv, block_q, block_kv, interpret) -> tuple:
  """`compiled_builder`'s shape arguments for `block_mask`'s."""
  default = heuristic_config(seq_q, seq_kv, 128, 128)
  block_q = clamp_block(block_q or default.block_q, seq_q)
  block_k = clamp_block(block_kv or default.block_k, seq_kv)
  return (batch, heads, seq_q, seq_kv, ((block_q, block_k),),
          backend.resolve_interpret(interpret))


def block_mask(mask_mod, batch, heads, seq_q, seq_kv, *, block_q=None, block_kv=None,
               interpret=None) -> BlockMask:
  """Builds the tile lists of `mask_mod` once, for reuse across calls and layers.

  Pass the result as `attention(..., mask_mod=mask_mod, block_mask=bm)`. The
  block sizes become the kernel's block_q / block_k (defaults: the dense
  heuristic's, 128x64 for d=128, not the 128x128 tiles a mask_mod alone
  gets: a block mask can be coarsened for the other pass, not refined, so
  the backward runs on these tiles too). An fp8 prefill's fp8 tensor cores
  take 192x128 (`pallas-attn explain VARIANT --dtype float8_e4m3fn`): at
  other tiles the call runs dequantized to bfloat16 and warns.

  The first call per mask, shapes and blocks compiles a builder that takes
  mask_mod's captured arrays as arguments. Later calls with the same
  mask_mod, or a new closure of the same code over new arrays of the same
  shapes (new document ids), run it without tracing mask_mod, where what
  mask_mod reads is plain (closures, globals and defaults of functions,
  arrays, numbers, containers; see `_Walk`); otherwise they trace it once.
  Inside a jitted function it compiles and runs no builder (`built_masks`):
  from the tile bounds on the host where mask_mod's arrays are closed over,
  else as part of the traced program.

  The mask records mask_mod's program and a digest of its captured values,
  which `attention` checks (see its `block_mask` argument); the digest is
  computed by the builder, on device, with no transfer.
  """
  shape = _shape(batch, heads, seq_q, seq_kv, block_q, block_kv, interpret)
  if staging():
    return built_masks(analyze_variant(mask_mod=mask_mod), *shape)[0]
  build, argument = _eager_builder(mask_mod, shape)
  return build(argument)[0]
