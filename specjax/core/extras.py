"""Optional dependencies: `require` imports one, or says which extra of specjax installs it.

The core install (`pip install specjax`) brings what `import specjax`, `decode` / `generate`,
`audit` and loading GGUF, Hugging Face and Orbax checkpoints need; the extras (pyproject.toml)
bring the rest: `[train]` (optax, flax, transformers), `[bench]` (matplotlib, torch, transformers,
accelerate), `[test]` (both, and the test tools).
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str) -> ModuleType:
  """Imports `module`; where its package is missing, an ImportError naming `extra`.

  Args:
    module: dotted module name, e.g. "flax.nnx".
    extra: the extra of specjax that installs its package, e.g. "train".

  Raises:
    ImportError: the package is not installed (the message gives the pip command). An import
      that fails inside an installed package is raised unchanged.
  """
  try:
    return importlib.import_module(module)
  except ModuleNotFoundError as error:
    package = module.split(".")[0]
    if error.name is None or error.name.split(".")[0] != package:
      raise
    raise ImportError(f"{package} is not installed: this needs the `{extra}` extra of specjax "
                      f"(pip install 'specjax[{extra}]')", name=package) from error
