"""`specjax demo`'s timing and reporting, without the shipped weights.

Pure functions on fake timings (the alternating order, the paired ratios and their median), the
suite figure read from the committed results, and the whole command on a tiny random pair put in
place of `specjax.load_pair`: its report, and a target whose weights are all NaN, which must be
named in a warning and exit non-zero.
"""

import json

import jax
import jax.numpy as jnp
import pytest

import specjax as sj
from specjax.cli import demo
from specjax.cli import main as cli
from specjax.io.orbax import load
from specjax.io.tokenizer import load_tokenizer
from specjax.pretrained.pairs import DefaultPair
from tests.cli.test_cli import pair_dirs  # noqa: F401  (the fixture)


def test_the_order_alternates_from_pair_to_pair():
  assert [demo.call_order(i) for i in range(3)] == [
      ("decode", "generate"), ("generate", "decode"), ("decode", "generate")]


def test_time_pairs_alternates_and_keeps_each_pairs_times():
  """A fake clock that each call advances by its own scripted duration."""
  durations = {"decode": [1.0, 2.0, 1.5], "generate": [3.0, 3.0, 4.5]}
  now, calls = [0.0], []

  def call(name):
    def run():
      calls.append(name)
      now[0] += durations[name][sum(c == name for c in calls) - 1]
      return f"{name}-{len(calls)}"
    return run

  timed = demo.time_pairs({"decode": call("decode"), "generate": call("generate")}, 3,
                          clock=lambda: now[0], block=lambda result: result)
  assert calls == ["decode", "generate", "generate", "decode", "decode", "generate"]
  assert timed["order"] == [("decode", "generate"), ("generate", "decode"),
                            ("decode", "generate")]
  assert timed["decode"] == durations["decode"] and timed["generate"] == durations["generate"]
  assert timed["results"] == {"decode": "decode-5", "generate": "generate-6"}
  # Ratios 3.0 / 1.0 = 3.0, 3.0 / 2.0 = 1.5, 4.5 / 1.5 = 3.0: median 3.0. (The best-of-each
  # ratio the demo printed before, min(generate) / min(decode) = 3.0 / 1.0, is the same here by
  # chance; the ratio of the means would be 3.5 / 1.5 = 2.33.)
  median, ratios = demo.paired_speedup(timed["decode"], timed["generate"])
  assert ratios == pytest.approx([3.0, 1.5, 3.0]) and median == pytest.approx(3.0)


def test_paired_speedup_median_of_an_even_count_and_bad_input():
  # 2 / 1 = 2.0 and 3 / 2 = 1.5: the median of two is their mean, 1.75.
  median, ratios = demo.paired_speedup([1.0, 2.0], [2.0, 3.0])
  assert ratios == [2.0, 1.5] and median == pytest.approx(1.75)
  with pytest.raises(ValueError, match="as many"):
    demo.paired_speedup([1.0], [1.0, 2.0])
  with pytest.raises(ValueError, match="at least one"):
    demo.paired_speedup([], [])


def test_suite_figure_reads_the_committed_run(tmp_path):
  figure = demo.suite_figure("qwen2.5-coder")
  assert figure["file"].endswith("readme_qwen/real_qwen2.5-coder-1.5b.json") and figure["found"]
  # benchmarks/results/readme_qwen: 1037 tokens emitted in 232 rounds over the 18 greedy prompts;
  # the summary's overall greedy speedup 1.84x.
  assert figure["tau"] == pytest.approx(1037 / 232)
  assert figure["speedup"] == pytest.approx(1.8385, abs=1e-4)
  assert (figure["prompts"], figure["num_draft"], figure["max_new_tokens"]) == (18, 6, 96)
  line = demo.suite_line("qwen2.5-coder", figure)
  assert "greedy 1.84x overall over 18 prompts" in line and "tau 4.47" in line
  assert "readme_qwen" in line
  assert "no committed figure" in demo.suite_line("gemma3-270m", demo.suite_figure("gemma3-270m"))
  absent = demo.suite_figure("smollm2-q4", root=tmp_path)
  assert absent == {"file": demo.SUITE_RESULTS["smollm2-q4"][0], "found": False}
  assert "not in this install" in demo.suite_line("smollm2-q4", absent)


def test_every_suite_file_holds_its_pairs_drafter_at_the_pairs_k():
  from specjax.pretrained.pairs import PAIRS
  for pair, (relative, drafter) in demo.SUITE_RESULTS.items():
    result = json.loads((demo.ROOT / relative).read_text())
    entry = next(d for d in result["drafters"] if d["name"] == drafter)
    assert entry["num_draft"] == PAIRS[pair][1], pair


def test_the_question_was_asked_by_no_tuning_run():
  from benchmarks.self_draft import CODE_QUESTIONS, QUESTIONS
  assert demo.QUESTION not in CODE_QUESTIONS + QUESTIONS
  prompts = (demo.ROOT / "benchmarks" / "prompts").glob("*.json")
  assert not any("leap year" in path.read_text().lower() for path in prompts)
  training = (demo.ROOT / "specjax" / "training" / "prompts.py").read_text().lower()
  assert "leap year" not in training


@pytest.fixture(scope="module")
def tiny_pair(pair_dirs):
  """test_cli's random tiny target, its draft (flatter logits) and the tiny GGUF's tokenizer with
  its chat template."""
  return (load(pair_dirs / "target"), load(pair_dirs / "draft"),
          load_tokenizer(pair_dirs / "tiny.gguf"))


def _with_pair(monkeypatch, target, draft, tokenizer):
  pair = DefaultPair(target=target, draft=draft, tokenizer=tokenizer, num_draft=3,
                     description="a tiny random pair")
  monkeypatch.setattr(sj, "load_pair", lambda name: pair)


def test_demo_reports_the_paired_ratios_and_the_suites_figure(tiny_pair, monkeypatch, capsys):
  _with_pair(monkeypatch, *tiny_pair)
  code = cli.main(["demo", "--pair", "smollm2-q4", "--max-new-tokens", "8", "--repeats", "3"])
  out = capsys.readouterr().out
  assert code == 0, out
  assert f"user: {demo.QUESTION}" in out
  assert "answer ended with EOS: " in out
  for line in ("pair 1 (decode first)", "pair 2 (generate first)", "pair 3 (decode first)"):
    assert line in out
  assert "(median of 3 paired ratios, generate time / decode time" in out
  assert "output identical to generate: True" in out
  assert "the real suite on this pair (benchmarks/results/readme_smollm2_q4/real.json" in out
  assert "warning" not in out


def test_demo_names_non_finite_logits_and_exits_non_zero(tiny_pair, monkeypatch, capsys):
  target, draft, tokenizer = tiny_pair
  broken = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), target)
  _with_pair(monkeypatch, broken, draft, tokenizer)
  code = cli.main(["demo", "--pair", "smollm2-q4", "--max-new-tokens", "4"])
  out = capsys.readouterr().out
  assert code == 1
  assert ("warning: the target's logits were not finite (row 0): the weights may be broken"
          in out)
  assert "paired ratios" not in out  # nothing timed
