"""The package's modules import down the layers: no cycles.

Reads every module's imports (function-local ones included) with `ast` and
fails on any cycle among pallas_attn's modules, naming it. A package's
`__init__` counts as a module that imports what it re-exports.
"""
import ast
import pathlib

import pallas_attn

ROOT = pathlib.Path(pallas_attn.__file__).parent


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict:
  """module -> the pallas_attn modules it imports."""
  modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
  graph = {}
  for name, path in modules.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        targets.update(a.name for a in node.names)
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative import
          base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                          + ([base] if base else []))
        for alias in node.names:
          target = f"{base}.{alias.name}"
          targets.add(target if target in modules else base)
    graph[name] = {t for t in targets if t in modules and t != name}
  return graph


def find_cycle(graph: dict) -> list | None:
  """One cycle of `graph` as a list of modules, or None."""
  state = {}  # module -> "active" | "done"
  stack = []

  def visit(node):
    state[node] = "active"
    stack.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == "active":
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state:
        cycle = visit(nxt)
        if cycle:
          return cycle
    stack.pop()
    state[node] = "done"
    return None

  for node in sorted(graph):
    if node not in state:
      cycle = visit(node)
      if cycle:
        return cycle
  return None


def test_finds_a_planted_cycle():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
  cycle = find_cycle(import_graph())
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_schedule_depends_on_nothing_above_it():
  """The scheduler's modules (configs, device model, cache, search, tuner)
  reach templates through schedule/template.py's registry, never by
  importing kernels, vjp or the API modules that run them."""
  graph = import_graph()
  climbing = {(module, target) for module, targets in graph.items()
              if module.startswith("pallas_attn.schedule.") for target in targets
              if not target.startswith("pallas_attn.schedule.")
              and target != "pallas_attn._version"}
  assert not climbing, "schedule imports from above: " + ", ".join(
      f"{module} -> {target}" for module, target in sorted(climbing))
