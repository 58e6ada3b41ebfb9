"""The real suite's speedup on hand-written records: greedy, generate's total time over decode's
(the same text); sampled, the ratio of per-token times, each call over its own emitted tokens,
mean over the prompts. Pure functions: no model, no timing."""

import pytest

from benchmarks import real_summary, report
from benchmarks.drafters import DrafterEntry


def _record(sampling, category, prefill_s, generate, decode):
  """One prompt's record: `generate` and `decode` are `(seconds, new tokens)`; the drafter is
  "d", two rounds with every draft accepted at k = 2."""
  return {"sampling": sampling, "category": category, "id": f"{category}-0",
          "prefill_s": prefill_s,
          "calls": {"generate": {"seconds": generate[0], "new_tokens": generate[1]},
                    "d": {"seconds": decode[0], "new_tokens": decode[1], "rounds": 2,
                          "accepted": 4, "accepted_per_position": [2, 2],
                          "first_divergence_from_generate": None}}}


# Two prompts, sampled: the texts differ in length between the calls.
#   prompt 1: generate 2.0 s for 20 tokens = 100 ms/token, decode 1.0 s for 25 = 40 ms/token
#   prompt 2: generate 3.0 s for 10 tokens = 300 ms/token, decode 0.5 s for 5 = 100 ms/token
SAMPLED = [_record("T=0.7", "code", 0.1, (2.0, 20), (1.0, 25)),
           _record("T=0.7", "math", 0.1, (3.0, 10), (0.5, 5))]


def test_per_token_times_are_each_calls_own():
  # generate: (100 + 300) / 2 = 200 ms; decode: (40 + 100) / 2 = 70 ms per token.
  assert real_summary.per_token_ms(SAMPLED, "generate") == pytest.approx(200.0)
  assert real_summary.per_token_ms(SAMPLED, "d") == pytest.approx(70.0)
  # Without the 0.1 s prefill: generate (95 + 290) / 2 = 192.5, decode (36 + 80) / 2 = 58.
  assert real_summary.per_token_ms(SAMPLED, "generate", exclude_prefill=True) == pytest.approx(
      192.5)
  assert real_summary.per_token_ms(SAMPLED, "d", exclude_prefill=True) == pytest.approx(58.0)


def test_a_sampled_speedup_is_the_ratio_of_per_token_times():
  # 200 / 70 = 2.857; the ratio of summed tokens/s would read (30 / 1.5) / (30 / 5.0) = 3.33.
  assert real_summary.speedup(SAMPLED, "d", "T=0.7") == pytest.approx(200 / 70)
  assert real_summary.per_token_speedup(SAMPLED, "d") == pytest.approx(200 / 70)
  assert real_summary.speedup(SAMPLED, "d", "T=0.7", exclude_prefill=True) == pytest.approx(
      192.5 / 58)


def test_a_greedy_speedup_is_unchanged():
  # The same text on both sides: (2.0 + 3.0) / (1.0 + 0.5) = 3.33, the ratio of tokens/s.
  greedy = [_record("greedy", "code", 0.1, (2.0, 20), (1.0, 20)),
            _record("greedy", "math", 0.1, (3.0, 10), (0.5, 10))]
  assert real_summary.speedup(greedy, "d", "greedy") == pytest.approx(5.0 / 1.5)
  # Without the prefills: 4.8 / 1.3.
  assert real_summary.speedup(greedy, "d", "greedy", exclude_prefill=True) == pytest.approx(
      4.8 / 1.3)


def test_the_summary_and_the_table_label_each_sampling():
  greedy = [_record("greedy", "code", 0.1, (2.0, 20), (1.0, 20)),
            _record("greedy", "math", 0.1, (3.0, 10), (0.5, 10))]
  costs = {"target_step_s": 0.1, "verify_s": {2: 0.12}, "draft_round_s": {"d": 0.02}}
  summary = real_summary.summarize(greedy + SAMPLED, [DrafterEntry("d", None, 2)], costs)
  rows = {(r["sampling"], r["category"]): r for r in summary}
  assert rows["greedy", "all"]["speedup"] == pytest.approx(5.0 / 1.5)
  assert rows["T=0.7", "all"]["speedup"] == pytest.approx(200 / 70)
  assert rows["T=0.7", "all"]["generate_ms_per_token"] == pytest.approx(200.0)
  assert rows["T=0.7", "all"]["decode_ms_per_token"] == pytest.approx(70.0)
  assert rows["T=0.7", "all"]["speedup_excl_prefill"] == pytest.approx(192.5 / 58)
  assert rows["T=0.7", "code"]["speedup"] == pytest.approx(100 / 40)
  assert rows["greedy", "all"]["generate_ms_per_token"] == pytest.approx(5000 / 30)
  assert "per-token" in rows["T=0.7", "all"]["speedup_basis"]
  result = {"model_description": "hand-written", "summary": summary, "costs": costs,
            "environment": {"date": "today", "device": "cpu", "platform": "cpu", "cpu_count": 2,
                            "jax": "0"},
            "settings": {"prompts": 2, "prompts_per_category": 1, "max_new_tokens": 32},
            "wall_s": 60.0, "load_s": 1.0}
  table = report.real_table(result)
  assert ("| category | drafter | k | a | tau | generate tok/s | decode tok/s | speedup | "
          "loop speedup |") in table
  assert ("| category | drafter | k | a | tau | generate ms/token | decode ms/token | per-token "
          "speedup | loop per-token speedup |") in table
  assert "| **overall** | d | 2 | 1.00 | 7.50 | 200.00 | 70.00 | **2.86x** |" in table
