"""Writes tests/ci_thinned.txt: the parametrizations CI leaves to `pytest -m slow`.

CI (`.ci/run`) must finish within 90 minutes on a 2-core host, and nearly all of a CPU test's time
is compiling its programs. So CI runs every test function, but a function's parametrizations only
in part: the cheapest one, and every other one measured at or under `--keep-under` seconds. The
rest are listed in tests/ci_thinned.txt, which tests/conftest.py marks `slow`; `pytest -m slow`
still runs them before a release. Functions in `WHOLE` keep every parametrization (each one is a
different drafter, kernel or model whose own check lives nowhere else in CI). The TPU compile
tier (tests/tpu) chooses its CI matrix itself (tests/tpu/test_compile.py).

Input: logs of one line per test phase, "<seconds> <phase> <nodeid> <outcome>" (a
`pytest_runtest_logreport` hook that appends `report.duration`, `report.when`, `report.nodeid`
and `report.outcome`), from runs of CI's steps 1 and 2 on one host, with the current marks: a
function whose parametrizations are all `slow` by their own marks must not be listed, which
tests/test_scheduling.py checks.

  python .ci/thin.py LOG [LOG ...] [--keep-under 2] > tests/ci_thinned.txt
"""

import argparse
import collections
import sys

# Parametrized over what they check, not over a setting: every parametrization stays in CI. A
# check and its broken twin (`broken`, `power`, `exact` parameters), a drafter, tree builder,
# model architecture or weight layout per parametrization, and the per-feature chi-squares.
WHOLE = (
    "tests/tpu/",
    "tests/exactness/test_exactness.py::",
    "tests/exactness/test_tree_exactness.py::",
    "tests/exactness/test_exactness_harness.py::test_harness_small_n_sees_the_classic_bug",
    "tests/drafters/adaptive/test_adaptive_rows.py::test_sampled_adaptive_decode_matches_",
    "tests/drafters/adaptive/test_adaptive_rows.py::test_sampled_decode_with_skipped_rounds_",
    "tests/drafters/test_parallel_head.py::test_parallel_tree_matches_target_distribution",
    "tests/drafters/test_parallel_head.py::test_each_slot_draws_from_the_q_it_hands_verify",
    "tests/drafters/test_parallel_head.py::test_greedy_equals_generate_ragged_batch",
    "tests/drafters/test_heads.py::test_greedy_equals_generate_ragged_batch",
    "tests/drafters/test_hybrid.py::test_greedy_equals_generate_ragged_batch",
    "tests/trees/test_trees.py::",
    "tests/models/test_quant.py::test_greedy_self_draft_equals_generate",
    "tests/models/test_gemma4.py::",
    "tests/models/test_cpu_panels.py::",
    "tests/models/test_one_body.py::",
    "tests/io/test_hf.py::",
)


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("logs", nargs="+")
  parser.add_argument("--keep-under", type=float, default=2.0)
  args = parser.parse_args(argv)
  seconds = collections.Counter()
  skipped = set()
  for path in args.logs:
    seen = set()
    for line in open(path):
      parts = line.rstrip("\n").split(" ")
      if len(parts) < 4 or parts[1] not in ("setup", "call", "teardown"):
        continue
      value, phase, nodeid = float(parts[0]), parts[1], " ".join(parts[2:-1])
      if (phase, nodeid) in seen:  # xdist's controller logs each worker's report again
        continue
      seen.add((phase, nodeid))
      seconds[nodeid] += value
      if parts[-1] == "skipped":
        skipped.add(nodeid)
  groups = collections.defaultdict(list)
  for nodeid, value in seconds.items():
    if "[" in nodeid and not nodeid.startswith(WHOLE) and nodeid not in skipped:
      groups[nodeid.split("[", 1)[0]].append((value, nodeid))
  thinned = []
  for items in groups.values():
    items.sort()
    thinned += [(value, nodeid) for value, nodeid in items[1:] if value > args.keep_under]
  print("# Parametrizations CI leaves to `pytest -m slow` (written by .ci/thin.py; seconds")
  print("# measured on a 2-core host, CI's steps 1 and 2). tests/conftest.py marks each one")
  print("# `slow`.")
  for value, nodeid in sorted(thinned, key=lambda x: x[1]):
    print(f"{value:.1f}\t{nodeid}")
  print(f"{len(thinned)} parametrizations, {sum(v for v, _ in thinned):.0f} s of "
        f"{sum(seconds.values()):.0f} s", file=sys.stderr)


if __name__ == "__main__":
  main()
