"""`benchmarks/experiments/kernel_ab.py`: two builds of the CPU kernel compared in one process."""

import json

import numpy as np
import pytest

from benchmarks.experiments import kernel_ab
from specjax.kernels.cpu import kernel

# `slow`: a benchmark script's machinery, outside CI's time budget.
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not kernel.available(), reason="the CPU kernel is not built here")]


def test_two_builds_are_compared_in_pairs(tmp_path):
  out = tmp_path / "ab.json"
  record = kernel_ab.main(["--model", "tiny", "--base", "HEAD", "--widths", "1,4",
                           "--repeats", "3", "--steps", "2", "--out", str(out)])
  saved = json.loads(out.read_text())
  assert saved["widths"] == [1, 4] and [r["width"] for r in saved["rows"]] == [1, 4]
  for row in record["rows"]:
    assert len(row["ratios"]) == 3
    assert all(np.isfinite(row["ratios"])) and min(row["ratios"]) > 0
    assert row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"]
  assert out.with_suffix(".png").stat().st_size > 0


def test_a_trace_that_calls_the_wrong_build_is_refused():
  """Names without the base suffix: the base side's forward would run this build's kernel (as a
  trace reused from JAX's caches would), and the lowered text shows it."""
  same = {attribute: getattr(kernel, attribute) for attribute in kernel._HANDLERS}
  with pytest.raises(RuntimeError, match="does not call its kernel"):
    kernel_ab.compare(kernel_ab.tiny_model(), same, [1], repeats=1, steps=1)


def test_an_unknown_revision_is_a_clear_error(tmp_path):
  with pytest.raises(ValueError, match="git cannot show"):
    kernel_ab.base_sources("no-such-revision-here", tmp_path)


def test_a_quantized_copy_is_compared(tmp_path):
  """`--copy self-q4 --vocab N`: the model's asymmetric 4-bit copy over N output ids, as a
  self-drafter runs it; both sides call their build's quantized product."""
  out = tmp_path / "ab.json"
  record = kernel_ab.main(["--model", "tiny", "--copy", "self-q4", "--vocab", "64", "--base",
                           "HEAD", "--widths", "1", "--repeats", "2", "--steps", "2",
                           "--out", str(out), "--no-plot"])
  assert record["copy"] == "self-q4" and record["vocab"] == 64
  copy = kernel_ab.quantized_copy(kernel_ab.tiny_model(), "self-q4", 64)
  assert copy.params["lm_head"].values.shape[0] == 64 and copy.params["lm_head"].offsets is None
  with pytest.raises(ValueError, match="unknown copy"):
    kernel_ab.quantized_copy(kernel_ab.tiny_model(), "self-int3")
