"""`benchmarks/experiments/body_ab.py`: two source trees in alternating processes, here the same
tree on both sides (the shipped SmolLM2 pair, one conversation, 4 tokens): each process runs the
tree it was given, the runs alternate base / new, and both sides' tokens are the same."""

import json
import pathlib

import pytest

from benchmarks.experiments import body_ab

ROOT = pathlib.Path(__file__).resolve().parents[2]


# `slow` for CI's time budget: two processes load SmolLM2 and compile decode and generate (~1 min).
@pytest.mark.slow
def test_two_trees_alternate_and_agree(tmp_path):
  from specjax.io.gguf import find_packaged_gguf
  try:
    find_packaged_gguf("smollm2")
  except FileNotFoundError as error:
    pytest.skip(str(error))
  out = tmp_path / "ab.json"
  result = body_ab.main(["--base", str(ROOT), "--new", str(ROOT), "--pair", "smollm2-q4",
                         "--conversations", "1", "--repeats", "1", "--rounds", "1",
                         "--budget", "4", "--out", str(out)])
  assert json.loads(out.read_text())["summary"] == result["summary"]
  assert [run["side"] for run in result["runs"]] == ["base", "new"]
  assert all(run["root"] == str(ROOT) for run in result["runs"])
  assert result["tokens_identical_across_trees"]
  code = result["runs"][0]["calls"]["code"]
  assert code["identical"] and code["new_tokens"] == 4
  assert set(result["summary"]) == {"code/decode", "code/generate"}
  assert all(row["new_over_base"] > 0 for row in result["summary"].values())
