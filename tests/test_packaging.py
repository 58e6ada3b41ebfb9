"""Packaging: the folders pyproject.toml maps into specjax (`kernels/` as `specjax.kernels`,
`checkpoints/` as `specjax.checkpoints`) reach the wheel, with their C++ sources and checkpoint
files, and import from it.

pyproject.toml lists the packages by name (a folder outside `specjax/` cannot be found as a
subpackage), so a new package folder that the list misses would be left out of the wheel silently:
`test_pyproject_lists_every_package_folder` holds the list against the tree.
"""

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
# What a wheel is built from: the metadata, the readme and the folders that become packages.
BUILD_INPUTS = ("pyproject.toml", "README.md", "specjax", "kernels", "checkpoints")
LEFT_OUT = ("specjax.testing",)  # test helpers of the checkout (pyproject.toml says why)


def _package_dir() -> dict[str, str]:
  return {"specjax": "specjax", **SETUPTOOLS["package-dir"]}


def package_folders() -> dict[str, pathlib.Path]:
  """`{package name: folder}` for every folder with an `__init__.py` under the folders that
  pyproject.toml maps to a package name (`specjax/`, `kernels/`, `checkpoints/`)."""
  found = {}
  for name, folder in _package_dir().items():
    for init in sorted((ROOT / folder).rglob("__init__.py")):
      parts = init.parent.relative_to(ROOT / folder).parts
      found[".".join((name, *parts))] = init.parent
  return found


def test_pyproject_maps_kernels_and_checkpoints_into_specjax():
  assert SETUPTOOLS["package-dir"] == {"specjax.kernels": "kernels",
                                       "specjax.checkpoints": "checkpoints"}
  data = SETUPTOOLS["package-data"]
  assert {"*.cc", "*.h"} <= set(data["specjax.kernels.cpu"])
  assert "eagle3_smollm2/**/*" in data["specjax.checkpoints"]


def test_pyproject_lists_every_package_folder():
  """Every package folder is in pyproject's `packages` (but the test helpers), and nothing else."""
  folders = package_folders()
  nested = {name for name in folders if name.startswith(tuple(p + "." for p in LEFT_OUT))}
  want = set(folders) - set(LEFT_OUT) - nested
  listed = set(SETUPTOOLS["packages"])
  assert listed == want, (f"missing from pyproject.toml's packages: {sorted(want - listed)}; "
                          f"listed without a folder: {sorted(listed - want)}")


def test_the_package_check_sees_a_missing_package(tmp_path, monkeypatch):
  """Power: a package folder that pyproject does not list is reported."""
  (tmp_path / "specjax" / "newpart").mkdir(parents=True)
  for folder in ("specjax", "specjax/newpart", "kernels", "checkpoints"):
    (tmp_path / folder).mkdir(exist_ok=True)
    (tmp_path / folder / "__init__.py").write_text("")
  monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
  assert set(package_folders()) == {"specjax", "specjax.newpart", "specjax.kernels",
                                    "specjax.checkpoints"}
  with pytest.raises(AssertionError, match=r"missing from pyproject.toml's packages: "
                                           r"\['specjax.newpart'\]"):
    test_pyproject_lists_every_package_folder()


def test_the_checkout_kernels_folder_does_not_shadow_the_kernels_distribution():
  """From the checkout's root (first on sys.path, as under pytest or `python -m benchmarks`), the
  top-level name `kernels` is the installed distribution (Hugging Face's kernel hub, which
  transformers imports), not this folder; without one it is an ImportError, not this folder."""
  code = ("import importlib.metadata, json\n"
          "try:\n"
          "  import kernels\n"
          "  found = kernels.__file__\n"
          "except ImportError as error:\n"
          "  found = 'ImportError: ' + str(error)\n"
          "try:\n"
          "  installed = importlib.metadata.version('kernels')\n"
          "except importlib.metadata.PackageNotFoundError:\n"
          "  installed = None\n"
          "print(json.dumps([found, installed]))\n")
  done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  found, installed = json.loads(done.stdout.strip().splitlines()[-1])
  if installed is None:
    assert found.startswith("ImportError: ") and "is specjax.kernels" in found, found
  else:
    assert not pathlib.Path(found).resolve().is_relative_to(ROOT / "kernels"), found


def build_wheel(tmp_path: pathlib.Path) -> pathlib.Path:
  """Builds the wheel from a fresh copy of the build inputs (an in-tree build reuses `build/`,
  where a file the package data no longer names would linger and reach the wheel)."""
  source = tmp_path / "source"
  source.mkdir()
  ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
  for name in BUILD_INPUTS:
    if (ROOT / name).is_dir():
      shutil.copytree(ROOT / name, source / name, ignore=ignore)
    else:
      shutil.copy2(ROOT / name, source / name)
  out = tmp_path / "wheel"
  # Without build isolation where setuptools is here: no index needed.
  isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
  done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q",
                         "-w", str(out), str(source)], capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  wheels = list(out.glob("specjax-*.whl"))
  assert len(wheels) == 1, wheels
  return wheels[0]


@pytest.mark.costly  # builds the wheel (about half a minute) and imports specjax from it
def test_the_wheel_carries_the_kernels_and_checkpoints_and_imports_them(tmp_path):
  wheel = build_wheel(tmp_path)
  names = set(zipfile.ZipFile(wheel).namelist())

  def files(folder, pattern="**/*"):
    return {path.relative_to(ROOT / folder).as_posix()
            for path in (ROOT / folder).glob(pattern)
            if path.is_file() and "__pycache__" not in path.parts}

  kernel_sources = files("kernels", "cpu/*.cc") | files("kernels", "cpu/*.h")
  assert {"cpu/cpu_gemv.cc", "cpu/cpu_attention.cc", "cpu/cpu_quant.h"} <= kernel_sources
  want = {f"specjax/kernels/{name}" for name in kernel_sources | files("kernels", "**/*.py")}
  want.add("specjax/kernels/README.md")
  head = files("checkpoints", "eagle3_smollm2/**/*")
  assert "eagle3_smollm2/tree/_METADATA" in head
  want |= {f"specjax/checkpoints/{name}" for name in head | files("checkpoints", "draft_vocab/*")}
  want |= {"specjax/checkpoints/__init__.py", "specjax/checkpoints/README.md"}
  want |= {f"specjax/{name}" for name in files("specjax", "**/*.py")
           if not name.startswith("testing/")}
  assert not want - names, f"missing from the wheel: {sorted(want - names)[:20]}"
  # The toy fixture, the test helpers and the unmapped folder names stay out.
  strays = sorted(n for n in names if n.startswith(("specjax/checkpoints/toy/", "specjax/testing/",
                                                     "kernels/", "checkpoints/")))
  assert not strays, strays

  # Imported from the unpacked wheel (first on the path, from outside the checkout): the kernels,
  # the CPU kernel's sources where its build looks for them, and a shipped checkpoint.
  site = tmp_path / "site"
  zipfile.ZipFile(wheel).extractall(site)
  code = (
      "import json, specjax, specjax.kernels\n"
      "from specjax.kernels import fused_verify\n"
      "from specjax.kernels.cpu import kernel\n"
      "from specjax.pretrained.pairs import HEAD_DIR, default_dir\n"
      "print(json.dumps({'specjax': specjax.__file__, 'kernels': specjax.kernels.__file__,\n"
      "  'sources': {str(p): p.is_file() for p in kernel.SOURCES + kernel.HEADERS},\n"
      "  'checkpoints': str(default_dir()),\n"
      "  'head': json.loads((default_dir() / HEAD_DIR / 'specjax_tree.json').read_text()) != {}}))\n")
  env = {**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"}
  done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  seen = json.loads(done.stdout.strip().splitlines()[-1])
  for key in ("specjax", "kernels", "checkpoints"):
    assert pathlib.Path(seen[key]).is_relative_to(site), (key, seen[key])
  assert {pathlib.Path(p).name for p in seen["sources"]} == {pathlib.Path(n).name
                                                              for n in kernel_sources}
  assert all(pathlib.Path(p).is_relative_to(site) and found for p, found in seen["sources"].items())
  assert seen["head"]
