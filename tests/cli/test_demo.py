"""`specjax demo`'s timing and reporting, without the shipped weights.

Pure functions on fake timings (the alternating order, continued from one conversation to the
next), the suite figure read from the committed results, the held-out conversations (one per suite
category, asked nowhere else), and the whole command on a tiny random pair put in place of
`specjax.load_pair`: its report, and a target whose weights are all NaN, which must be named in a
warning and exit non-zero.
"""

import dataclasses
import json
import re

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
  # The next conversation continues the alternation: its first pair (index 3) is generate first.
  calls.clear()
  later = demo.time_pairs({"decode": call("decode"), "generate": call("generate")}, 1,
                          clock=lambda: now[0], block=lambda result: result, first=3)
  assert later["order"] == [("generate", "decode")] and calls == ["generate", "decode"]


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


def test_the_questions_were_asked_by_no_tuning_run():
  """The streamed question and every message of the timed conversations appear in none of the
  suite's prompt files, the k-choosing questions or the head's training prompts."""
  from benchmarks.self_draft import CODE_QUESTIONS, QUESTIONS
  assert demo.QUESTION not in CODE_QUESTIONS + QUESTIONS
  elsewhere = [path.read_text().lower()
               for path in (demo.ROOT / "benchmarks" / "prompts").glob("*.json")]
  elsewhere.append((demo.ROOT / "specjax" / "training" / "prompts.py").read_text().lower())
  elsewhere.append((demo.ROOT / "benchmarks" / "self_draft.py").read_text().lower())
  assert not any("leap year" in text for text in elsewhere)
  messages = [m["content"] for _, conversation in demo.DEMO_SET for m in conversation]
  assert len(messages) == 8  # the multi-turn conversation has three
  words = lambda text: re.sub(r"[^a-z0-9]+", " ", text.lower()).split()
  shingles = lambda ws, n: {" ".join(ws[i:i + n]) for i in range(len(ws) - n + 1)}
  seen = set().union(*(shingles(words(text), 6) for text in elsewhere))
  for message in messages:  # no run of 6 words in common
    assert not shingles(words(message), 6) & seen, message


def test_the_timed_set_has_one_conversation_per_suite_category():
  suite = json.loads((demo.ROOT / "benchmarks" / "prompts" / "real.json").read_text())
  names = {"multi_turn": "multi-turn chat", "translation": "translation",
           "summarization": "summarization", "qa": "QA over a text", "math": "math",
           "code": "code"}
  assert [category for category, _ in demo.DEMO_SET] == [names[c] for c in suite["categories"]]
  for _, conversation in demo.DEMO_SET:
    assert conversation[-1]["role"] == "user"
    assert [m["role"] for m in conversation] == ["user", "assistant"] * (
        len(conversation) // 2) + ["user"]
  assert demo.DEMO_SET[-1][1] == [{"role": "user", "content": demo.QUESTION}]


@pytest.fixture(scope="module")
def tiny_pair(pair_dirs):
  """test_cli's random tiny target, its draft (flatter logits) and the tiny GGUF's tokenizer with
  its chat template."""
  # A context of 1024 (RoPE: no position table to grow) holds the timed conversations, which this
  # tokenizer's 300 ids spell in up to about 560 tokens.
  longer = lambda model: sj.Model(model.params, dataclasses.replace(model.config, max_len=1024))
  return (longer(load(pair_dirs / "target")), longer(load(pair_dirs / "draft")),
          load_tokenizer(pair_dirs / "tiny.gguf"))


def _with_pair(monkeypatch, target, draft, tokenizer):
  pair = DefaultPair(target=target, draft=draft, tokenizer=tokenizer, num_draft=3,
                     description="a tiny random pair")
  monkeypatch.setattr(sj, "load_pair", lambda name: pair)


def test_demo_times_every_conversation_and_prints_the_suites_figure(tiny_pair, monkeypatch,
                                                                    capsys):
  _with_pair(monkeypatch, *tiny_pair)
  code = cli.main(["demo", "--pair", "smollm2-q4", "--max-new-tokens", "8", "--timed-tokens", "6",
                   "--repeats", "2"])
  captured = capsys.readouterr()
  out = captured.out
  assert code == 0, out + captured.err
  assert f"user: {demo.QUESTION}" in out
  assert "answer ended with EOS: " in out and "streamed answer: " in out
  assert "timing 6 conversation(s), up to 6 new tokens each, 2 pair(s) of calls each" in out
  for category, _ in demo.DEMO_SET:
    assert f"  {category}: " in out
  assert "over 6 conversations no run saw, one per suite category (summed generate time" in out
  assert "output identical to generate: True" in out and "tokens differ" not in out
  assert "the real suite on this pair (benchmarks/results/readme_smollm2_q4/real.json" in out
  assert "this run / the suite's" not in out  # 6 tokens is not the suite's budget of 64
  assert "warning" not in out


# Six conversations compiled and run again at 64 tokens (54 to 119 s): `slow` for CI's time; CI
# runs the demo at its own budget (above).
@pytest.mark.slow
def test_demo_at_the_suites_budget_compares_with_it(tiny_pair, monkeypatch, capsys):
  """No --timed-tokens: the suite's own budget for the pair (64 for smollm2-q4), and the ratio of
  the two figures; --prompt times the user's question alone."""
  _with_pair(monkeypatch, *tiny_pair)
  assert cli.main(["demo", "--pair", "smollm2-q4", "--max-new-tokens", "4"]) == 0
  out = capsys.readouterr().out
  assert "up to 64 new tokens each, 1 pair(s) of calls each" in out
  assert "this run / the suite's: " in out
  assert cli.main(["demo", "--pair", "smollm2-q4", "--max-new-tokens", "5", "--prompt",
                   "def add(a, b):"]) == 0
  out = capsys.readouterr().out
  assert "timing 1 conversation(s), up to 5 new tokens each" in out and "  your question: " in out
  assert "over your question" in out and "this run / the suite's" not in out


def test_demo_names_non_finite_logits_and_exits_non_zero(tiny_pair, monkeypatch, capsys):
  target, draft, tokenizer = tiny_pair
  broken = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), target)
  _with_pair(monkeypatch, broken, draft, tokenizer)
  code = cli.main(["demo", "--pair", "smollm2-q4", "--max-new-tokens", "4"])
  out = capsys.readouterr().out
  assert code == 1
  assert ("warning: the target's logits were not finite (row 0): the weights may be broken"
          in out)
  assert "speedup over" not in out and "timing" not in out  # nothing timed


def test_the_cli_runs_the_shipped_pair_at_its_measured_k(tiny_pair, pair_dirs, monkeypatch):
  """`specjax generate` / `audit` / `calibrate` without --num-draft: the shipped pair's own k
  (`load_default().num_draft`), 4 for a pair nobody measured or for prompt lookup; a given k wins."""
  import argparse

  from specjax.cli.pair_args import DEFAULT_NUM_DRAFT, load_pair
  target, draft, tokenizer = tiny_pair
  pair = DefaultPair(target=target, draft=draft, tokenizer=tokenizer, num_draft=3,
                     description="a tiny random pair")
  monkeypatch.setattr(sj, "load_default", lambda: pair)
  args = lambda **kw: argparse.Namespace(**dict(dict(target=None, gguf=None, draft=None,
                                                     tokenizer=None, dtype="float32",
                                                     num_draft=None), **kw))
  shipped = args()
  assert load_pair(shipped)[1] is draft and shipped.num_draft == 3
  lookup = args(draft="ngram")
  assert isinstance(load_pair(lookup)[1], sj.NGramDrafter) and lookup.num_draft == 4
  given = args(num_draft=5)
  load_pair(given)
  assert given.num_draft == 5
  own = args(target=str(pair_dirs / "target"), draft=str(pair_dirs / "draft"))
  load_pair(own)
  assert own.num_draft == DEFAULT_NUM_DRAFT == 4
