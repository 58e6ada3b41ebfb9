"""Layering: every specjax module imports, no import cycle, and the folders form one stack.

The import graph is read with `ast` from every `import` statement of a module, those inside
functions included: a lazy import is still a dependency, it only hides a cycle until the function
runs. Imports under `if TYPE_CHECKING:` never run and are not edges. Importing `a.b.c` also runs
the packages `a` and `a.b`, so those are edges too, except the importer's own enclosing packages
(Python initialises them first). Cycles are looked for between modules, and between the folders
of `specjax` (`specjax.io`, `specjax.drafters`, ...; a top-level module is its own node), where
two modules can each import the other's folder without any one module cycle. The `benchmarks`
package of the checkout is checked for module cycles too.

`LAYERS` stacks specjax's folders from the ground floor (`core`) to the front end (`cli`): a
module imports only from its own folder and the folders below it. The stack is the architecture:
draft (`drafters`) -> verify (`verify`) -> accept and advance (`loop`), on top of the models and
their checkpoints. The kernels (the checkout's `kernels/`, installed as `specjax.kernels`) stand
below the algorithm that calls them: they import only `core` and `trees`.
"""

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The folders of specjax, bottom first (a folder is all the modules under it; "specjax" is the
# package's own `__init__`, the public API).
LAYERS = (
    ("core", ("specjax.core",)),  # sampling, KV cache, outputs, validation, token buffers
    ("trees", ("specjax.trees",)),  # tree shapes and builders
    ("parallel", ("specjax.parallel",)),  # meshes and sharding rules
    ("kernels", ("specjax.kernels",)),  # Pallas TPU / GPU and C++ CPU kernels (kernels/)
    ("verify", ("specjax.verify",)),  # the exact rule, chain and tree, its dispatch and sharding
    ("models", ("specjax.models",)),  # the decoder, quantized leaves, the CPU layout
    ("io", ("specjax.io",)),  # GGUF, Hugging Face, Orbax, tokenizers
    ("constrain", ("specjax.constrain",)),  # grammars as token automata, the constrained law
    ("drafters", ("specjax.drafters",)),  # what proposes: models, heads, lookup, trees, adaptive
    ("loop", ("specjax.loop",)),  # state, round (draft -> verify -> advance), decode, stream
    ("exactness", ("specjax.exactness",)),  # sj.audit
    ("checkpoints", ("specjax.checkpoints",)),  # package data: the shipped checkpoints (checkpoints/)
    ("pretrained", ("specjax.pretrained",)),  # the pairs built from them
    ("training", ("specjax.training",)),  # optax training of drafts and heads
    ("tuning", ("specjax.tuning",)),  # calibration for adaptive length
    ("testing", ("specjax.testing",)),  # shared test harness and small models
    ("public api", ("specjax",)),
    ("integrations", ("specjax.integrations",)),  # optional: other libraries' engines (tunix)
    ("cli", ("specjax.cli",)),  # the specjax command
)

# Modules that import an optional extra's library, by the library they need: without it they are
# skipped (`pytest.importorskip`), not failed (tests/conftest.py lets those skips pass in CI).
OPTIONAL = {"specjax.integrations.tunix": "tunix",
            "specjax.integrations.tunix_config": "tunix"}


def _modules(*trees: tuple[pathlib.Path, str]) -> dict[str, pathlib.Path]:
  found = {}
  for base, prefix in trees:
    for path in sorted(base.rglob("*.py")):
      parts = list(path.relative_to(base).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      found[".".join([prefix] + parts)] = path
  return found


# specjax's modules, with the folders pyproject.toml maps into it (`package-dir`).
MODULES = _modules((ROOT / "specjax", "specjax"), (ROOT / "kernels", "specjax.kernels"),
                   (ROOT / "checkpoints", "specjax.checkpoints"))
BENCHMARKS = _modules((ROOT / "benchmarks", "benchmarks"))


def _type_checking_nodes(tree) -> set[int]:
  skipped = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
      skipped.update(id(inner) for child in node.body for inner in ast.walk(child))
  return skipped


def _known(name: str, known) -> str | None:
  """`name`, or the nearest enclosing package of it, among the modules in `known`."""
  while name and name not in known:
    name = name.rpartition(".")[0]
  return name or None


def imports(name: str, path: pathlib.Path, known) -> dict[str, list[int]]:
  """The modules of `known` that module `name` imports, anywhere in it, with the line numbers."""
  tree = ast.parse(path.read_text())
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  skipped = _type_checking_nodes(tree)
  targets: dict[str, list[int]] = {}
  for node in ast.walk(tree):
    if id(node) in skipped:
      continue
    if isinstance(node, ast.Import):
      named = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")
        base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
      # `from a import b` imports the module `a.b` where there is one, else a name of `a`.
      named = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
               for alias in node.names]
    else:
      continue
    for target in named:
      target = _known(target, known)
      if target is None or target == name:
        continue
      targets.setdefault(target, []).append(node.lineno)
      # Importing `a.b.c` runs `a` and `a.b` first: edges, unless they enclose the importer.
      parts = target.split(".")
      for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if parent in known and not (name + ".").startswith(parent + "."):
          targets.setdefault(parent, []).append(node.lineno)
  return targets


def import_graph(known) -> dict[str, dict[str, list[int]]]:
  """`{module: {imported module: [line, ...]}}` over the modules in `known` (name -> path)."""
  return {name: imports(name, path, known) for name, path in known.items()}


def _package(name: str) -> str:
  """The node of module `name` in the folder graph: `specjax.io.orbax` -> `specjax.io`."""
  return ".".join(name.split(".")[:2])


def package_graph(graph) -> dict[str, set[str]]:
  """The graph between the subpackages of `specjax` (`specjax.io`, ...), its top-level modules
  and its `__init__` (`specjax`)."""
  edges = {}
  for name, targets in graph.items():
    node = _package(name)
    edges.setdefault(node, set()).update(_package(t) for t in targets if _package(t) != node)
  return edges


def find_cycle(edges):
  """One cycle `[a, b, ..., a]` of a directed graph `{node: successors}`, or None."""
  state, stack = {}, []

  def dfs(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(edges.get(node, ())):
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


def _describe(cycle, graph, node=lambda name: name) -> str:
  """`a -> b (where); b -> a (where)`: per arrow, the imports that make it, as `module:line`
  (`node` maps a module to its node of the cycle's graph)."""
  steps = []
  for a, b in zip(cycle, cycle[1:]):
    where = dict.fromkeys(f"{m}:{line}" for m, targets in sorted(graph.items()) if node(m) == a
                          for t, lines in sorted(targets.items()) if node(t) == b
                          for line in lines)
    steps.append(f"{a} -> {b} ({', '.join(list(where)[:4])})")
  return "; ".join(steps)


def layer(name: str) -> int | None:
  """The index in `LAYERS` of module `name` (the most specific entry that covers it), or None."""
  best, depth = None, -1
  for index, (_, entries) in enumerate(LAYERS):
    for entry in entries:
      covers = name == entry or (entry != "specjax" and name.startswith(entry + "."))
      if covers and entry.count(".") > depth:
        best, depth = index, entry.count(".")
  return best


def upward_arrows(graph) -> dict[tuple[str, str], list[int]]:
  """`{(importer, imported): lines}` for every import of a module in a higher layer (modules in
  no layer are left out: `test_every_module_has_a_layer` names them)."""
  return {(name, target): lines for name, targets in sorted(graph.items())
          for target, lines in sorted(targets.items())
          if None not in (layer(name), layer(target)) and layer(target) > layer(name)}


GRAPH = import_graph(MODULES)
BENCHMARK_GRAPH = import_graph(BENCHMARKS)


def test_no_import_cycle_between_modules():
  cycle = find_cycle({name: set(targets) for name, targets in GRAPH.items()})
  assert cycle is None, "import cycle: " + _describe(cycle, GRAPH)


def test_no_import_cycle_between_subpackages():
  cycle = find_cycle(package_graph(GRAPH))
  assert cycle is None, "import cycle between packages: " + _describe(cycle, GRAPH, _package)


def test_no_import_cycle_in_benchmarks():
  cycle = find_cycle({name: set(targets) for name, targets in BENCHMARK_GRAPH.items()})
  assert cycle is None, "import cycle: " + _describe(cycle, BENCHMARK_GRAPH)


def test_no_arrow_back_up():
  arrows = [f"{a}:{lines[0]} -> {b} ({LAYERS[layer(a)][0]} below {LAYERS[layer(b)][0]})"
            for (a, b), lines in upward_arrows(GRAPH).items()]
  assert not arrows, "imports of a higher layer: " + "; ".join(arrows)


def test_the_cycle_finder_finds_a_cycle():
  """Power: the same search reports a planted cycle."""
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_imports_inside_functions(tmp_path):
  """Power: a function-level `from pkg import mod`, a relative import and `import pkg.mod` are
  edges, so are the packages they run; a `TYPE_CHECKING` import is not."""
  (tmp_path / "pkg" / "sub").mkdir(parents=True)
  files = {
      "pkg/__init__.py": "",
      "pkg/low.py": "def f():\n  from pkg import high\n",
      "pkg/high.py": "import typing\nif typing.TYPE_CHECKING:\n  from pkg import other\n"
                     "from . import low\n",
      "pkg/other.py": "def g():\n  import pkg.sub.leaf as leaf\n",
      "pkg/sub/__init__.py": "",
      "pkg/sub/leaf.py": "",
  }
  for name, text in files.items():
    (tmp_path / name).write_text(text)
  graph = import_graph(_modules((tmp_path / "pkg", "pkg")))
  assert set(graph["pkg.low"]) == {"pkg.high"} and set(graph["pkg.high"]) == {"pkg.low"}
  assert set(graph["pkg.other"]) == {"pkg.sub.leaf", "pkg.sub"}
  assert find_cycle({n: set(t) for n, t in graph.items()}) == ["pkg.high", "pkg.low", "pkg.high"]
  packages = package_graph({"specjax.a.x": {"specjax.b.y": [1]}, "specjax.b.y": {"specjax.a": [2]},
                            "specjax.a": {}, "specjax.b": {}})
  assert find_cycle(packages) == ["specjax.a", "specjax.b", "specjax.a"]


def test_the_layer_check_finds_an_arrow_back_up():
  """Power: a lazy import of the command line from a drafter is reported, its reverse is not."""
  graph = {"specjax.drafters.eagle.network": {"specjax.cli.main": [7]},
           "specjax.cli.main": {"specjax.io": [9]}}
  assert upward_arrows(graph) == {("specjax.drafters.eagle.network", "specjax.cli.main"): [7]}


def test_every_module_has_a_layer():
  missing = sorted(name for name in MODULES if layer(name) is None)
  assert not missing, f"modules in no layer (add them to LAYERS): {missing}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports(name):
  if name in OPTIONAL:
    pytest.importorskip(OPTIONAL[name])
  importlib.import_module(name)
