"""`benchmarks/experiments/layout_ab.py`: the CPU layout's two float32 weight layouts compared
in one process."""

import json

import jax
import numpy as np
import pytest

import specjax as sj
from benchmarks.experiments import layout_ab
from specjax.kernels.cpu import kernel
from specjax.models.cpu import panels
from specjax.testing.models import tiny_config

# `slow`: a benchmark script's machinery, outside CI's time budget.
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not kernel.available(), reason="the CPU kernel is not built here")]


def test_the_two_layouts_are_timed_in_pairs(tmp_path):
  out = tmp_path / "layouts.json"
  record = layout_ab.main(["--model", "tiny", "--widths", "1,4,12", "--repeats", "3",
                           "--steps", "2", "--out", str(out)])
  saved = json.loads(out.read_text())
  assert saved["base"] == "rows" and [r["width"] for r in saved["rows"]] == [1, 4, 12]
  for row in record["rows"]:
    assert len(row["ratios"]) == 3 and all(np.isfinite(row["ratios"]))
    assert row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"]
  first = record["rows"][0]
  assert first["rows_steps_median"] == first["panels_steps_median"] == 1.0
  assert out.with_suffix(".png").stat().st_size > 0


def test_the_base_side_has_the_layout_it_names():
  """`--base rows`: every weight row-major; `--base embedding`: the layers stay in panels and only
  a tied embedding goes back to `[V, E]`. Both give the panel model's logits."""
  model = sj.init_params(tiny_config(vocab_size=100, tie_embeddings=True),
                         jax.random.key(0)).for_platform("cpu")
  layer = model.params["layers"][0]
  assert panels.is_panels(layer["w_down_t"]) and panels.is_panels(model.params["embed"])
  rows = layout_ab.row_major(model)
  assert not panels.is_panels(rows.params["layers"][0]["w_down_t"])
  assert not panels.is_panels(rows.params["embed"])
  embedding = layout_ab.row_major(model, layers=False)
  assert embedding.params["layers"][0]["w_down_t"] is layer["w_down_t"]
  assert not panels.is_panels(embedding.params["embed"])
  record = layout_ab.compare({"rows": embedding, "panels": model}, [1, 3], repeats=2, steps=1)
  assert [r["width"] for r in record["rows"]] == [1, 3]
