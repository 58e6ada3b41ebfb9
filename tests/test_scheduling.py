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


def test_every_thinned_parametrization_exists_and_leaves_one_in_ci():
  """tests/ci_thinned.txt names collected tests only, and every function it thins keeps at least
  one parametrization in CI (a stale or mistyped line would silently thin nothing, or all)."""
  import subprocess
  import sys
  thinned = conftest.thinned_node_ids()
  assert thinned
  files = sorted({node.split("::", 1)[0] for node in thinned})
  out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist",
                        "-p", "no:cacheprovider", "-m", "slow or not slow", *files],
                       capture_output=True, text=True, check=True).stdout
  collected = {line for line in out.splitlines() if "::" in line}
  assert thinned <= collected, sorted(thinned - collected)[:5]
  for function in {node.split("[", 1)[0] for node in thinned}:
    siblings = {node for node in collected if node.split("[", 1)[0] == function}
    assert siblings - thinned, f"{function}: every parametrization thinned"
