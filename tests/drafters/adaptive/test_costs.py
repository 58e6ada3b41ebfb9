"""Cost tables, acceptance profiles and `auto_num_draft`.

* `measure_costs` on a tiny model, saved as `cost_table_<backend>.json` and loaded back.
* `AcceptanceProfile.from_counts` and `expected_tokens` against hand-worked numbers.
* `choose_num_draft` picks the `k` that maximises `E[tokens | k] / (verify(k+1) + k * draft)` for
  a hand-written table and profile; the expected value is computed here independently, from the
  distribution of the number of accepted drafts.
* `auto_num_draft(drafter, calibration=DIR)` gives that `k`, bounded by the drafter's
  `max_draft` and with narrower widths for a confidence stop, and `sj.decode` runs with it (greedy
  still equals `sj.generate`); without the files, or without a calibration, it raises a
  ValueError that names `specjax calibrate`, before compiling.
* `specjax calibrate` end to end on the shipped toy pair (slow).
"""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.drafters.adaptive import auto_num_draft
from specjax.tuning import calibrate
from specjax.cli import main as cli
from specjax.drafters.adaptive import costs
from specjax.drafters.adaptive.costs import AcceptanceProfile, CostTable
from specjax.testing.models import tiny_config
from specjax.core.tracing import TRACE_COUNTS

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _table(verify_ms, draft_step_ms=0.5, generate_step_ms=10.0, backend=None,
           round_overhead_ms=0.0):
  return CostTable(verify_ms=tuple(verify_ms), draft_step_ms=draft_step_ms,
                   generate_step_ms=generate_step_ms,
                   backend=backend or jax.default_backend(), device_kind="hand-written",
                   jax_version=jax.__version__, batch=1, context=16, date="2025-01-01",
                   round_overhead_ms=round_overhead_ms)


def _profile(alpha):
  return AcceptanceProfile(tuple(alpha), {"temperature": 0.0, "top_k": None, "top_p": None},
                           rounds=1000, prompts=4, date="2025-01-01")


def _expected_tokens_by_distribution(alpha, k):
  """E[accepted + 1] from P(exactly n accepted) = prod_{i<=n} a_i * (1 - a_{n+1}) (n < k) and
  P(k accepted) = prod_{i<=k} a_i: written without `costs.expected_tokens`."""
  total = 0.0
  for n in range(k + 1):
    reach = float(np.prod(alpha[:n]))
    probability = reach * (1.0 - alpha[n]) if n < k else reach
    total += (n + 1) * probability
  return total


# Verify cost rises in steps (flat-ish then a jump), drafts cost 0.5 ms each: with these alphas
# k = 3 is the best ratio (worked out below).
VERIFY_MS = (10.0, 10.5, 11.0, 11.5, 16.0, 16.5, 17.0)
ALPHA = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4)


def test_expected_tokens_hand_worked():
  # alpha = (0.5, 0.5): 1 + 0.5 + 0.25 = 1.75 with k = 2; 1.5 with k = 1.
  assert costs.expected_tokens((0.5, 0.5), 2) == pytest.approx(1.75)
  assert costs.expected_tokens((0.5, 0.5), 1) == pytest.approx(1.5)
  for k in range(1, len(ALPHA) + 1):
    assert costs.expected_tokens(ALPHA, k) == pytest.approx(
        _expected_tokens_by_distribution(ALPHA, k))


def test_auto_picks_the_k_that_maximises_tokens_per_time():
  table, profile = _table(VERIFY_MS), _profile(ALPHA)
  ratios = {k: _expected_tokens_by_distribution(ALPHA, k) / (VERIFY_MS[k] + 0.5 * k)
            for k in range(1, 7)}
  # k = 3: (1 + .9 + .72 + .504) / (11.5 + 1.5) = 3.124 / 13 = 0.2403; k = 2: 2.62 / 12 = 0.2183;
  # k = 4: 3.4264 / 18 = 0.1904.
  best = max(ratios, key=ratios.get)
  assert best == 3
  choice = costs.choose_num_draft(table, profile)
  assert choice.num_draft == best
  assert choice.widths == (best + 1,)
  assert choice.expected_tokens == pytest.approx(_expected_tokens_by_distribution(ALPHA, best))
  assert choice.round_ms == pytest.approx(VERIFY_MS[best] + 0.5 * best)
  assert choice.speedup == pytest.approx(ratios[best] * 10.0)
  assert costs.choose_num_draft(table, profile, max_draft=2).num_draft == 2  # a Medusa bound
  # A table that covers fewer widths bounds k: widths 1..3 allow k <= 2.
  assert costs.choose_num_draft(_table(VERIFY_MS[:3]), profile).num_draft == 2


def test_a_per_round_overhead_counts_in_every_round():
  # A fixed cost per round favours longer rounds. With 100 ms per round on top of the table
  # above: k = 3: 3.124 / 113 = 0.0276; k = 5: 3.5776 / 119 = 0.0301; k = 6: 3.638 / 120 = 0.0303.
  overhead = 100.0
  ratios = {k: _expected_tokens_by_distribution(ALPHA, k) / (VERIFY_MS[k] + 0.5 * k + overhead)
            for k in range(1, 7)}
  best = max(ratios, key=ratios.get)
  assert best == 6
  choice = costs.choose_num_draft(_table(VERIFY_MS, round_overhead_ms=overhead), _profile(ALPHA))
  assert choice.num_draft == best
  assert choice.round_ms == pytest.approx(VERIFY_MS[best] + 0.5 * best + overhead)
  assert choice.speedup == pytest.approx(ratios[best] * 10.0)
  with pytest.raises(ValueError, match="non-negative"):
    _table(VERIFY_MS, round_overhead_ms=-1.0)


def test_a_table_written_before_the_overhead_was_measured_loads_with_none(tmp_path):
  path = _table(VERIFY_MS).save(tmp_path)
  data = json.loads(path.read_text())
  del data["round_overhead_ms"]
  path.write_text(json.dumps(data))
  assert CostTable.load(tmp_path).round_overhead_ms == 0.0


def test_widths_for_a_confidence_stop():
  # k = 4: start from 5 (3.0 ms); 4 costs 2.1 <= 0.9 * 3.0 -> kept; 3 costs 2.0 > 0.9 * 2.1 = 1.89
  # -> not; 2 costs 1.05 <= 1.89 -> kept; 1 costs 1.0 > 0.9 * 1.05 -> not.
  table = _table((1.0, 1.05, 2.0, 2.1, 3.0))
  assert costs.choose_widths(table, 4) == (2, 4, 5)
  # Nearly flat costs up to 5 positions, free drafts, alpha 0.99: k = 4 (4.90 tokens / 1.24 ms
  # against 3.94 / 1.18 for k = 3); widths: 5 (1.2 ms); 4, 3 cost more than 0.9 * 1.2 = 1.08;
  # 2 costs 1.05 -> kept; 1 costs 1.0 > 0.9 * 1.05 -> not.
  table = _table((1.0, 1.05, 1.1, 1.15, 1.2), draft_step_ms=0.01)
  choice = costs.choose_num_draft(table, _profile((0.99,) * 4), confidence_stop=True)
  assert choice.num_draft == 4 and choice.widths == (2, 5)
  plain = costs.choose_num_draft(table, _profile((0.99,) * 4))
  assert plain.num_draft == 4 and plain.widths == (5,)


def test_profile_from_counts_and_round_trip(tmp_path):
  # 100 rounds; draft 1 accepted 80 times, draft 2 40 times (of the 80 that reached it), draft 3
  # 10 times (of 40): alpha = (0.8, 0.5, 0.25).
  profile = AcceptanceProfile.from_counts(100, [80, 40, 10], sampling=sj.Sampling(0.7, top_k=5),
                                          prompts=3)
  assert profile.alpha == pytest.approx((0.8, 0.5, 0.25))
  path = profile.save(tmp_path)
  assert path.name == "acceptance_profile.json"
  loaded = AcceptanceProfile.load(tmp_path)
  assert loaded == profile
  assert loaded.sampling == {"temperature": 0.7, "top_k": 5, "top_p": None}


@pytest.fixture(scope="module")
def tiny():
  target = sj.init_params(tiny_config(vocab_size=64), jax.random.key(30))
  draft = sj.init_params(tiny_config(vocab_size=64, num_layers=1), jax.random.key(31))
  return target, draft


@pytest.mark.costly
def test_measure_save_load_round_trip(tiny, tmp_path):
  target, draft = tiny
  table = calibrate.measure_costs(target, sj.ModelDrafter(draft), max_width=3, context=8,
                                  repeats=2)
  assert len(table.verify_ms) == 3 and all(v > 0 for v in table.verify_ms)
  assert table.draft_step_ms >= 0 and table.generate_step_ms >= 0
  # Whole decode rounds timed at k = 1 and k = W - 1 = 2: each round costs something, and the
  # overhead is their mean excess over the table's forward + draft steps (clipped at 0).
  round_ms = {int(k): v for k, v in table.notes["round_ms"].items()}
  assert sorted(round_ms) == [1, 2] and all(v > 0 for v in round_ms.values())
  excess = [round_ms[k] - table.verify_ms[k] - k * table.draft_step_ms for k in (1, 2)]
  assert table.round_overhead_ms == pytest.approx(max(np.mean(excess), 0.0))
  assert table.backend == jax.default_backend() and table.batch == 1
  path = table.save(tmp_path)
  assert path.name == f"cost_table_{jax.default_backend()}.json"
  data = json.loads(path.read_text())
  for key in ("device_kind", "jax_version", "batch", "date", "verify_ms", "draft_step_ms",
              "generate_step_ms", "round_overhead_ms"):
    assert key in data
  assert data["jax_version"] == jax.__version__
  assert CostTable.load(tmp_path) == table


def test_decode_auto_runs_the_chosen_k(tiny, tmp_path):
  target, draft = tiny
  _table(VERIFY_MS).save(tmp_path)
  _profile(ALPHA).save(tmp_path)
  tokens = jnp.array([[3, 1, 4, 1, 5], [9, 2, 6, 0, 0]], jnp.int32)
  lengths = jnp.array([5, 3], jnp.int32)
  choice = auto_num_draft(draft, calibration=tmp_path)
  assert (choice.num_draft, choice.widths) == (3, (4,))  # as worked out above; no stop: k + 1
  out = sj.decode(target, draft, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=12,
                  num_draft=choice.num_draft, verify_widths=choice.widths)
  assert out.stats.accepted_per_position.shape == (2, 3)  # k = 3
  ref = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=12)
  np.testing.assert_array_equal(out.tokens, ref.tokens)


@dataclasses.dataclass(frozen=True)
class _Bounded(sj.NGramDrafter):
  """A drafter that drafts at most 2 tokens a round (as a Medusa drafter with 2 heads)."""

  max_draft = 2


@dataclasses.dataclass(frozen=True)
class _Stopping(sj.NGramDrafter):
  """A drafter with a confidence stop."""

  confidence = 0.5


def test_auto_num_draft_reads_the_drafter(tmp_path):
  """A drafter's `max_draft` bounds k and a confidence stop adds the narrower widths, as
  `choose_num_draft` is told them; a directory and a `Calibration` give the same choice."""
  table, profile = _table(VERIFY_MS), _profile(ALPHA)
  table.save(tmp_path)
  profile.save(tmp_path)
  measured = costs.Calibration(table, profile)
  plain = auto_num_draft(sj.NGramDrafter(), calibration=measured)
  assert plain == costs.choose_num_draft(table, profile)
  assert auto_num_draft(sj.NGramDrafter(), calibration=tmp_path) == plain
  bounded = _Bounded()
  assert auto_num_draft(bounded, measured) == costs.choose_num_draft(table, profile,
                                                                        max_draft=2)
  assert auto_num_draft(bounded, measured).num_draft == 2 < plain.num_draft
  stopping = _Stopping()
  choice = auto_num_draft(stopping, measured)
  assert choice == costs.choose_num_draft(table, profile, confidence_stop=True)
  assert choice.widths == costs.choose_widths(table, choice.num_draft) != plain.widths


def test_missing_calibration_raises_before_compiling(tiny, tmp_path):
  _, draft = tiny
  before = TRACE_COUNTS["decode"]
  with pytest.raises(ValueError, match="needs a calibration"):
    auto_num_draft(draft, calibration=None)
  with pytest.raises(ValueError, match=r"cost_table_\w+\.json, acceptance_profile\.json not "
                     r"found.*specjax calibrate --out"):
    auto_num_draft(draft, calibration=tmp_path)
  _profile(ALPHA).save(tmp_path)
  _table(VERIFY_MS, backend="some-other-backend").save(tmp_path)  # not this backend's
  with pytest.raises(ValueError, match=f"cost_table_{jax.default_backend()}.json not found"):
    auto_num_draft(draft, calibration=tmp_path)
  assert TRACE_COUNTS["decode"] == before


def test_bad_tables_raise(tmp_path):
  with pytest.raises(ValueError, match="finite, non-negative"):
    _table((1.0, float("nan")))
  with pytest.raises(ValueError, match="probabilities"):
    _profile((0.5, 1.5))
  with pytest.raises(ValueError, match="cover no num_draft"):
    costs.choose_num_draft(_table((1.0,)), _profile((0.5,)))
  path = _table(VERIFY_MS).save(tmp_path)
  path.write_text(path.read_text().replace('"format": 1', '"format": 99'))
  with pytest.raises(ValueError, match="format"):
    CostTable.load(tmp_path)


@pytest.mark.slow
def test_calibrate_command_on_the_toy_pair(tmp_path, capsys):
  toy = ROOT / "checkpoints" / "toy"
  status = cli.main(["calibrate", "--out", str(tmp_path), "--target", str(toy / "target"),
                     "--draft", str(toy / "draft"), "--tokenizer", str(toy / "tokenizer.json"),
                     "--max-width", "4", "--repeats", "2", "--context", "16",
                     "--max-new-tokens", "16", "--prompt", "def f(x):\n", "--prompt",
                     "import os\n"])
  assert status == 0
  printed = capsys.readouterr().out
  assert "specjax.drafters.adaptive.auto_num_draft picks k =" in printed
  calibration = costs.load_calibration(tmp_path)
  assert len(calibration.costs.verify_ms) == 4 and len(calibration.profile.alpha) == 3
  assert calibration.profile.rounds > 0


def test_calibrate_rejects_a_bad_width(tmp_path, capsys):
  assert cli.main(["calibrate", "--out", str(tmp_path), "--max-width", "1"]) == 2
  assert "--max-width must be >= 2" in capsys.readouterr().err


def test_a_cost_table_without_a_positive_generate_step_is_refused():
  """Plans are priced in generate steps: a zero step (a timing slope lost in noise) is a clear
  error at construction, not a division by zero inside `adaptive_drafter`."""
  with pytest.raises(ValueError, match="positive generate step"):
    _table([1.0, 1.2], generate_step_ms=0.0)
  assert _table([1.0, 1.2], generate_step_ms=1e-3).generate_step_ms == 1e-3
