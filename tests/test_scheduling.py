"""CI's test scheduling (`tests/conftest.py`): under `pytest -n 2 --dist loadfile` a test file is
one unit of work (its module fixtures are built once), except the TPU compile tier's files, whose
tests are units of their own (independent compiles, handed to whichever worker is free)."""

from tests import conftest


def test_a_file_stays_whole_and_a_compile_tier_test_stands_alone():
  assert conftest.work_unit("tests/loop/test_decode.py::test_x[a-b]") == "tests/loop/test_decode.py"
  assert conftest.work_unit("tests/verify/test_fused_verify.py::TestFusedVerify::test_y") == (
      "tests/verify/test_fused_verify.py")
  assert conftest.work_unit("tests/tpu/__init__.py") == "tests/tpu/__init__.py"
  for tier in ("tests/tpu/test_compile.py::test_matrix[v6e-2x2-B64-draft_model]",
               "tests/tpu/test_memory.py::test_temporaries_grow_linearly_in_the_prompt[decode]"):
    assert conftest.work_unit(tier) == tier


def _collect(files, markexpr):
  import subprocess
  import sys
  out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist",
                        "-p", "no:cacheprovider", "-m", markexpr, *files],
                       capture_output=True, text=True, check=True).stdout
  return {line for line in out.splitlines() if "::" in line}


def test_every_thinned_parametrization_exists_and_leaves_one_in_ci():
  """tests/ci_thinned.txt names collected tests only, and every function it thins keeps at least
  one parametrization in CI's selection (`not slow`: a stale or mistyped line would silently thin
  nothing, or all; a line for a function `slow` by its own marks thins nothing)."""
  thinned = conftest.thinned_node_ids()
  assert thinned
  files = sorted({node.split("::", 1)[0] for node in thinned})
  collected = _collect(files, "slow or not slow")
  assert thinned <= collected, sorted(thinned - collected)[:5]
  in_ci = {node.split("[", 1)[0] for node in _collect(files, "not slow")}
  left_out = sorted({node.split("[", 1)[0] for node in thinned} - in_ci)
  assert not left_out, f"no parametrization left in CI: {left_out[:5]}"
