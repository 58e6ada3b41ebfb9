"""The Colab notebooks run top to bottom on CPU at their small size (`SPECJAX_NOTEBOOK_SMALL=1`),
executed with nbclient in a `python3` kernel of this interpreter (marked slow: run with
`-m slow`), and are stored without outputs and open with a Colab badge and an install cell."""

import os
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

COLAB = pathlib.Path(__file__).resolve().parents[2] / "colab"
NOTEBOOKS = ["quickstart", "benchmark", "train_a_draft"]


@pytest.fixture(autouse=True)
def small_kernel_env(monkeypatch):
  # The kernel inherits this process's environment: small sizes, CPU, this interpreter's packages.
  monkeypatch.setenv("SPECJAX_NOTEBOOK_SMALL", "1")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  monkeypatch.setenv("PATH", str(pathlib.Path(sys.executable).parent) + os.pathsep
                     + os.environ.get("PATH", ""))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_stripped_and_opens_with_badge_and_install(name):
  notebook = nbformat.read(COLAB / f"{name}.ipynb", as_version=4)
  first, install = notebook.cells[0], notebook.cells[1]
  assert first.cell_type == "markdown" and "colab.research.google.com" in first.source
  assert install.cell_type == "code" and "pip" in install.source and "import specjax" in install.source
  for cell in notebook.cells:
    if cell.cell_type == "code":
      assert not cell.outputs and cell.execution_count is None
  assert any('platform == "tpu"' in c.source for c in notebook.cells)


@pytest.mark.slow  # minutes per notebook on a loaded 2-core CPU (decode compiles per batch shape)
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_top_to_bottom_on_cpu(name):
  notebook = nbformat.read(COLAB / f"{name}.ipynb", as_version=4)
  client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(COLAB)}})
  client.execute()  # raises CellExecutionError on the first failing cell
  text = "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code"
                 for o in c.outputs)
  assert "devices:" in text
  if name in ("quickstart", "train_a_draft"):
    assert "specjax exactness audit" in text
