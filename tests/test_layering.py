"""Layering: every specjax module imports, no import cycle among them, no module over 450 lines.

The cycle check walks module-level imports (what runs at import time; imports inside functions and
under `if TYPE_CHECKING:` are not edges) with `ast`, so it sees a cycle even where Python's import
order happens to hide it.
"""

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specjax"
KERNELS = ROOT / "kernels"  # installed as specjax.kernels
MAX_LINES = 450


def _modules() -> dict[str, pathlib.Path]:
  found = {}
  for base, prefix in ((PACKAGE, "specjax"), (KERNELS, "specjax.kernels")):
    for path in sorted(base.rglob("*.py")):
      parts = list(path.relative_to(base).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      found[".".join([prefix] + parts)] = path
  return found


MODULES = _modules()


def _is_type_checking(node) -> bool:
  return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _module_level_imports(name: str, path: pathlib.Path) -> set[str]:
  """specjax modules `name` imports when it is imported."""
  tree = ast.parse(path.read_text())
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  targets = set()

  def visit(body):
    for node in body:
      if _is_type_checking(node):
        continue
      if isinstance(node, ast.Import):
        targets.update(alias.name for alias in node.names)
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                          + ([node.module] if node.module else []))
        modules = {f"{base}.{alias.name}" for alias in node.names} & set(MODULES)
        targets.update(modules or {base})
      elif isinstance(node, (ast.If, ast.Try, ast.With)):
        for field in ("body", "orelse", "finalbody"):
          visit(getattr(node, field, []) or [])
        for handler in getattr(node, "handlers", []):
          visit(handler.body)

  visit(tree.body)
  # A package's own ancestors are always initialised before it (`from specjax import x` only
  # needs `specjax.x`), so they are not edges.
  ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
  return {t for t in targets if t in MODULES and t != name and t not in ancestors}


def _edges() -> dict[str, set[str]]:
  return {name: _module_level_imports(name, path) for name, path in MODULES.items()}


def _find_cycle(edges):
  state, stack = {}, []

  def dfs(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(edges[node]):
      if state.get(nxt) == "open":
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state:
        cycle = dfs(nxt)
        if cycle:
          return cycle
    stack.pop()
    state[node] = "done"
    return None

  for node in sorted(edges):
    if node not in state:
      cycle = dfs(node)
      if cycle:
        return cycle
  return None


def test_no_import_cycle():
  cycle = _find_cycle(_edges())
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
  """Power: the same search reports a planted cycle."""
  assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports(name):
  importlib.import_module(name)


def test_no_module_over_the_line_limit():
  long = {name: n for name, path in MODULES.items()
          if (n := len(path.read_text().splitlines())) > MAX_LINES}
  assert not long, f"modules over {MAX_LINES} lines: {long}"
