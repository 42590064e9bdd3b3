"""How a traced score_mod / mask_mod reads the arrays it closes over.

The callables are traced on scalar indices, so `bias[b, h, q_idx, kv_idx]`
becomes a `dynamic_slice` of a captured constant by index variables (after
JAX's negative-index normalization `select_n(i < 0, i, i + n)`). This pass
walks the flat jaxpr symbolically and resolves every such read to a
`CaptureUse`: which captured array, and for each of its axes which index
addresses it. The kernel then loads exactly the block it needs (a slope per
head, a row of per-key biases per kv block) instead of a dense tensor.

An axis addressed by a computed integer expression (`table[h, q - kv + c]`,
a T5 bucket of `q - kv`, `starts[b, doc_ids[b, kv]]`) makes the read a
gather: the expression is evaluated on the tile and the array is read at
those positions, clamped into its bounds as a `dynamic_slice` clamps. Only
such reads gather; b, h and constants still select the block the kernel
sees.

score_mod's subexpressions that depend on the positions only through
`q_idx - kv_idx` and are costly per position (spec/diagonal.py) are read as
one more kind of use: a term, evaluated per call over the diagonals.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from pallas_attn.spec import blockeval, diagonal
from pallas_attn.spec.blockeval import needed_equations
from pallas_attn.spec.diagonal import DIAGONAL
from pallas_attn.spec.trace import TracedFn, VariantError, is_literal, source_line

INDEX_NAMES = ("b", "h", "q", "kv")
GATHERED = "gathered"  # an axis read at a computed index


def position_free(axes) -> bool:
  """Whether a read with these axes is indexed by b, h and constants only
  (no q / kv position, gather or term): one value per program and head."""
  return not {"q", "kv", GATHERED, DIAGONAL} & set(axes)


_DISPLAY = {"b": "b", "h": "h", "q": "q_idx", "kv": "kv_idx", GATHERED: "<computed>",
            DIAGONAL: "q_idx - kv_idx"}


@dataclasses.dataclass(frozen=True)
class CaptureUse:
  """One read of a captured array: `axes[i]` is 'b', 'h', 'q', 'kv', a fixed
  int or GATHERED. A gather (any GATHERED axis) has no 'q'/'kv' axes: they
  are gathered too, and `index_vars` holds the jaxpr var of each GATHERED
  axis's index, in axis order. A hoisted term (`term`: its index in the
  program's `terms`; `capture` None) has axes ('h', DIAGONAL) or (0,
  DIAGONAL)."""
  capture: int | None
  axes: tuple
  index_vars: tuple = ()
  term: int | None = None

  @property
  def is_term(self) -> bool:
    return self.term is not None

  @property
  def is_gather(self) -> bool:
    return GATHERED in self.axes

  def describe(self, shape) -> str:
    idx = ", ".join(_DISPLAY.get(a, str(a)) if isinstance(a, str) else str(a)
                    for a in self.axes)
    if self.is_term:
      return f"term#{self.term}[{idx}]"
    return f"capture#{self.capture}{list(shape)}[{idx}]"


@dataclasses.dataclass(frozen=True)
class ElementwiseProgram:
  """A traced elementwise callable ready for the in-kernel interpreter.

  inputs: names of the jaxpr's invars ('score', 'b', 'h', 'q', 'kv').
  loads: (var, use index) pairs: values read from captured arrays.
  skip: eqn indices replaced by those loads (the indexing chain).
  deps: which inputs the result depends on, through data or addressing.
  terms: the hoisted diagonal terms (spec/diagonal.py) that term uses read;
  unhoisted: the same program without them, where they cannot be hoisted
  (a differentiated array they read, decoding).
  separable: score_mod is `score + R(b, h, q_idx) + C(b, h, kv_idx)` reading
  captured arrays by b, h and constants only (spec/separable.py).
  affine_kv: separable, with C affine in kv_idx (spec/separable.py).
  """
  traced: TracedFn
  inputs: tuple
  uses: tuple  # tuple[CaptureUse]
  loads: tuple
  skip: frozenset
  deps: frozenset
  terms: tuple = ()
  unhoisted: ElementwiseProgram | None = None
  separable: bool = False
  affine_kv: bool = False

  def without_terms(self) -> ElementwiseProgram:
    return self if self.unhoisted is None else self.unhoisted

  def evaluate(self, inputs, captures, overrides=None, differentiable: bool = False):
    """The program's output on (tile) values: `inputs` in `self.inputs`
    order, `captures[u]` the value of use u (as the kernels load it);
    `differentiable` as in `blockeval.evaluate`."""
    jaxpr = self.traced.jaxpr
    env = {var: captures[use_index] for var, use_index in self.loads}
    env.update(zip(jaxpr.invars, inputs))
    out, = blockeval.evaluate(jaxpr, env, jaxpr.outvars, self.skip, overrides, differentiable)
    return out

  def kernel_equations(self) -> list:
    """Indices of the equations a kernel runs (hoisted terms and capture
    reads excluded; gather index expressions included)."""
    jaxpr = self.traced.jaxpr
    outputs = list(jaxpr.outvars) + [v for use in self.uses for v in use.index_vars]
    known = {var for var, _ in self.loads}
    return [n for n in needed_equations(jaxpr, outputs, known) if n not in self.skip]

  @property
  def name(self) -> str:
    return self.traced.name


@dataclasses.dataclass
class _View:
  """A captured array partially indexed: addr per axis, None = still open;
  starts: the index var of each addressed axis (None for constants)."""
  capture: int
  shape: tuple
  addr: list
  starts: list
  open_axes: list  # axes of the array that the current value still has


_FOLDABLE = frozenset(["lt", "le", "gt", "ge", "eq", "ne", "add", "sub", "mul", "select_n",
                       "convert_element_type"])


def _fold_scalar_constant(eqn, values):
  """Evaluates a scalar integer/boolean primitive whose operands are all
  constants (e.g. `select_n(1 < 0, 1, 1 + n)` for a constant index), else None."""
  if (eqn.primitive.name not in _FOLDABLE or any(v is None for v in values)
      or eqn.outvars[0].aval.shape != () or np.dtype(eqn.outvars[0].aval.dtype).kind not in "biu"):
    return None
  with jax.ensure_compile_time_eval():
    return np.asarray(eqn.primitive.bind(*[np.asarray(v) for v in values], **eqn.params)).item()


def _resolved_use(view: _View) -> CaptureUse:
  """The read of a fully indexed view: blocked by b, h, q, kv and constants,
  or, with a computed index on any axis, a gather also on its q/kv axes."""
  if GATHERED not in view.addr:
    return CaptureUse(view.capture, tuple(view.addr))
  axes = tuple(GATHERED if a in ("q", "kv") else a for a in view.addr)
  return CaptureUse(view.capture, axes,
                    tuple(s for a, s in zip(axes, view.starts) if a == GATHERED))


def analyze_elementwise(traced: TracedFn, inputs: tuple,
                        hoist: bool = False) -> ElementwiseProgram:
  """Resolves capture reads and dependencies of an elementwise callable;
  with `hoist`, also its diagonal terms (see `_hoisted`)."""
  jaxpr = traced.jaxpr
  tags = {}    # var -> ('idx'|'neg'|'wrap', name) | _View
  deps = {}    # var -> frozenset of input names
  for var, name in zip(jaxpr.invars, inputs):
    deps[var] = frozenset([name])
    if name in INDEX_NAMES:
      tags[var] = ("idx", name)
  uses, loads, skip = [], [], set()
  single = {}  # var holding a one-element capture (or its slice) -> that capture's use

  def add_use(use):
    if use not in uses:
      uses.append(use)
    return uses.index(use)

  for i, (var, const) in enumerate(zip(jaxpr.constvars, traced.consts)):
    shape = tuple(np.shape(const))
    if all(d == 1 for d in shape):
      single[var] = add_use(CaptureUse(i, (0,) * len(shape)))
      loads.append((var, single[var]))
      deps[var] = frozenset()
    else:
      tags[var] = _View(i, shape, [None] * len(shape), [None] * len(shape),
                        list(range(len(shape))))
      deps[var] = frozenset()

  def dep(v):
    return frozenset() if is_literal(v) else deps.get(v, frozenset())

  def tag(v):
    return None if is_literal(v) else tags.get(v)

  def const_value(v):
    """The value of a literal or folded scalar constant, else None."""
    if is_literal(v):
      return v.val
    t = tags.get(v)
    return t[1] if isinstance(t, tuple) and t[0] == "const" else None

  for n, eqn in enumerate(jaxpr.eqns):
    prim = eqn.primitive.name
    in_tags = [tag(v) for v in eqn.invars]
    out = eqn.outvars[0] if eqn.outvars else None
    views = [t for t in in_tags if isinstance(t, _View)]
    if (prim in ("dynamic_slice", "slice", "squeeze", "reshape") and eqn.invars
        and not is_literal(eqn.invars[0]) and eqn.invars[0] in single):
      # Indexing a one-element capture (slopes[h] with one head) reads its element.
      single[out] = single[eqn.invars[0]]
      loads.append((out, single[out]))
      deps[out] = frozenset()
      skip.add(n)
      continue
    if prim == "dynamic_slice" and isinstance(in_tags[0], _View):
      view = dataclasses.replace(in_tags[0], addr=list(in_tags[0].addr),
                                 starts=list(in_tags[0].starts),
                                 open_axes=list(in_tags[0].open_axes))
      sizes = eqn.params["slice_sizes"]
      for axis, start, size in zip(view.open_axes, eqn.invars[1:], sizes):
        start_tag = tag(start)
        dim = view.shape[axis]
        if dim == 1:
          view.addr[axis] = 0  # broadcast axis: any index reads element 0
          continue
        if size == dim:
          continue  # axis kept whole (the start is clamped to 0)
        if size != 1:
          raise VariantError(
              f"{traced.name} slices a captured array of shape {view.shape} "
              f"with a window of {size} at {source_line(eqn)}; index every "
              "axis with a single b, h, q_idx, kv_idx or a constant.")
        if const_value(start) is not None:
          view.addr[axis] = int(const_value(start))
          continue
        view.addr[axis] = start_tag[1] if start_tag is not None and start_tag[0] == "idx" \
            else GATHERED
        view.starts[axis] = start
      skip.add(n)
      if all(a is not None for a in view.addr):
        use = _resolved_use(view)
        loads.append((out, add_use(use)))
        deps[out] = frozenset(a for a in use.axes if a in INDEX_NAMES).union(
            *[dep(v) for v in use.index_vars])
      else:
        tags[out] = view
        deps[out] = frozenset()
      continue
    if views:
      if prim == "squeeze" and isinstance(in_tags[0], _View):
        view = in_tags[0]
        dims = set(eqn.params["dimensions"])
        kept = [a for p, a in enumerate(view.open_axes) if p not in dims]
        tags[out] = dataclasses.replace(view, open_axes=kept)
        deps[out] = frozenset()
        skip.add(n)
        continue
      raise VariantError(
          f"{traced.name} uses a captured array of shape {views[0].shape} "
          f"in '{prim}' at {source_line(eqn)} before indexing all its axes; "
          "read captured arrays elementwise, e.g. bias[b, h, q_idx, kv_idx].")
    # Negative-index normalization that jnp indexing inserts: on an index
    # variable it yields that index; on constants it folds to a constant.
    folded = _fold_scalar_constant(eqn, [const_value(v) for v in eqn.invars])
    if folded is not None:
      tags[out] = ("const", folded)
    elif prim == "lt" and in_tags[0] and in_tags[0][0] == "idx" and is_literal(eqn.invars[1]):
      tags[out] = ("neg", in_tags[0][1])
    elif prim == "add" and in_tags[0] and in_tags[0][0] == "idx" and is_literal(eqn.invars[1]):
      tags[out] = ("wrap", in_tags[0][1])
    elif (prim == "select_n" and len(in_tags) == 3 and all(in_tags)
          and in_tags[0][0] == "neg" and in_tags[1][0] == "idx"
          and in_tags[2][0] == "wrap"
          and in_tags[0][1] == in_tags[1][1] == in_tags[2][1]):
      tags[out] = ("idx", in_tags[1][1])
    elif prim in ("convert_element_type", "squeeze", "reshape",
                  "broadcast_in_dim") and in_tags[0] and in_tags[0][0] == "idx":
      tags[out] = in_tags[0]
    merged = frozenset().union(*[dep(v) for v in eqn.invars])
    for v in eqn.outvars:
      deps[v] = merged
  out_deps = frozenset().union(*[dep(v) for v in jaxpr.outvars])
  program = ElementwiseProgram(traced=traced, inputs=tuple(inputs), uses=tuple(uses),
                               loads=tuple(loads), skip=frozenset(skip), deps=out_deps)
  return _hoisted(program) if hoist else program


def _hoisted(program: ElementwiseProgram) -> ElementwiseProgram:
  """`program` reading its diagonal terms as term uses (first), keeping the
  capture uses the kernel still needs, in their order; itself if it has no
  terms."""
  jaxpr = program.traced.jaxpr
  terms = diagonal.find_terms(jaxpr, program.inputs)
  if not terms:
    return program
  term_uses = [CaptureUse(None, ("h" if t.per_head else 0, DIAGONAL), term=n)
               for n, t in enumerate(terms)]
  known = {var for var, _ in program.loads} | {t.var for t in terms}
  loaded_by = {}
  for var, use_index in program.loads:
    loaded_by.setdefault(use_index, []).append(var)
  # The reads still needed: by the output, or by the index of a needed gather.
  outputs, kept = list(jaxpr.outvars), set()
  while True:
    live = set(outputs)
    for n in needed_equations(jaxpr, outputs, known):
      live.update(v for v in jaxpr.eqns[n].invars if not is_literal(v))
    now = {u for u, vars_ in loaded_by.items() if live & set(vars_)}
    if now == kept:
      break
    kept = now
    outputs = list(jaxpr.outvars) + [v for u in kept for v in program.uses[u].index_vars]
  order = sorted(kept)
  uses = tuple(term_uses) + tuple(program.uses[u] for u in order)
  renumber = {u: len(terms) + n for n, u in enumerate(order)}
  loads = tuple((t.var, n) for n, t in enumerate(terms)) + tuple(
      (var, renumber[u]) for var, u in program.loads if u in renumber)
  return dataclasses.replace(program, uses=uses, loads=loads, terms=terms, unhoisted=program)
