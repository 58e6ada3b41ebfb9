"""The explicit draft-length modes: `sj.adaptive_drafter` and
`specjax.drafters.adaptive.auto_num_draft` (each with `calibration=DIR`) choose the draft length;
`decode` takes only an int `num_draft`.

* Every entry point that takes `num_draft` (`decode`, `decode_stream`, `audit`) rejects a string
  with a ValueError before anything is traced (the jitted loops are replaced by functions that
  fail the test if they are reached).
* `sj.adaptive_drafter` builds the wrapper from a calibration (its plan's K, round costs, priors,
  copy priors, `plain` flag and verify widths); `max_draft` and the drafter's own `max_draft`
  bound K.
* `decode` takes K and the widths from the wrapper; a `num_draft` or `verify_widths` beside it must
  equal them, anything else raises before tracing.
* Greedy `decode` and `decode_stream` with the wrapper equal `sj.generate` on a ragged batch, and
  the loop runs at the wrapper's K.
* A wrapper that plans plain steps (`plain`): `decode` runs `sj.generate`, and so does
  `decode_stream`, so at temperature > 0 its tokens (and final counters) are `decode`'s for the
  same key.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
import specjax.loop.decode as decode_module
import specjax.loop.generate as generate_module
import specjax.loop.stream as stream_module
from specjax.drafters.adaptive import costs
from specjax.drafters.adaptive.drafter import AdaptiveDrafter
from specjax.drafters.adaptive.costs import AcceptanceProfile, Calibration, CostTable
from specjax.loop.decode import check_decode_arguments
from specjax.testing.models import tiny_config
from specjax.core.tracing import TRACE_COUNTS

VOCAB = 64


def _calibration(verify_ms, alpha, lookup=None):
  table = CostTable(verify_ms=tuple(verify_ms), draft_step_ms=1.0,
                    generate_step_ms=verify_ms[0], backend=jax.default_backend(),
                    device_kind="hand-written", jax_version=jax.__version__, batch=1, context=16,
                    date="2026-01-01")
  profile = lambda a: AcceptanceProfile(tuple(a), {"temperature": 0.0, "top_k": None,
                                                   "top_p": None},
                                        rounds=1000, prompts=4, date="2026-01-01")
  measured = profile(alpha)
  if lookup is not None:
    measured = dataclasses.replace(measured, head=profile(alpha), lookup=profile(lookup))
  return Calibration(table, measured)


# Flat verify costs (as on a TPU): K = 4 by default (tests/drafters/adaptive/test_adaptive_rows.py).
FLAT = _calibration([10.0, 12.0, 12.0, 12.5, 13.0], [0.6, 0.6, 0.6, 0.6])


@pytest.fixture(scope="module")
def target():
  return sj.init_params(tiny_config(vocab_size=VOCAB, num_layers=2), jax.random.key(40))


@pytest.fixture(scope="module")
def draft():
  return sj.init_params(tiny_config(vocab_size=VOCAB, num_layers=1), jax.random.key(41))


@pytest.fixture(scope="module")
def ragged():
  rng = np.random.default_rng(42)
  tokens = jnp.asarray(rng.integers(0, VOCAB, size=(3, 8)), jnp.int32)
  return tokens, jnp.array([8, 2, 5], jnp.int32)


# --- num_draft is an int ----------------------------------------------------------------------

def _decode(target, draft, tokens, lengths, **kwargs):
  return sj.decode(target, draft, tokens, jax.random.key(0), lengths=lengths,
                   max_new_tokens=8, **kwargs)


def _stream(target, draft, tokens, lengths, **kwargs):
  return next(sj.decode_stream(target, draft, tokens, jax.random.key(0), lengths=lengths,
                               max_new_tokens=8, **kwargs))


def _audit(target, draft, tokens, lengths, **kwargs):
  prompts = [np.asarray(row[:n]).tolist() for row, n in zip(tokens, lengths)]
  return sj.audit(target, draft, prompts, max_new_tokens=8, num_samples=2, **kwargs)


ENTRY_POINTS = {"decode": _decode, "decode_stream": _stream, "audit": _audit}


@pytest.fixture
def nothing_traced(monkeypatch):
  """The jitted programs of every entry point fail the test if they are reached."""
  def reached(*args, **kwargs):
    raise AssertionError("validation let the call through to a jitted program")
  for module, name in ((decode_module, "_decode"), (stream_module, "_start"),
                       (stream_module, "_round"), (generate_module, "_generate")):
    if hasattr(module, name):
      monkeypatch.setattr(module, name, reached)
  before = dict(TRACE_COUNTS)
  yield
  assert dict(TRACE_COUNTS) == before


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("num_draft", ["auto", "adaptive", "4"])
def test_a_string_num_draft_raises_before_tracing(target, draft, ragged, nothing_traced, entry,
                                                  num_draft):
  tokens, lengths = ragged
  with pytest.raises(ValueError, match=f"num_draft must be an int, got '{num_draft}'"):
    ENTRY_POINTS[entry](target, draft, tokens, lengths, num_draft=num_draft)


# --- adaptive_drafter --------------------------------------------------------------------------

def _fields(wrapper) -> dict:
  return {f.name: getattr(wrapper, f.name) for f in dataclasses.fields(wrapper)
          if f.name != "drafter"}


def test_adaptive_drafter_is_the_wrapper_of_the_plan(draft):
  """`AdaptiveDrafter(drafter, plan.max_draft, plan.round_ms, plan.prior,
  copy_prior=plan.copy_prior, plain=plan.plain, widths=plan.widths)` for the calibration's
  `costs.adaptive_plan`."""
  measured = _calibration([10.0, 12.0, 12.0, 12.5, 13.0, 13.2], [0.6, 0.5, 0.5, 0.4, 0.4],
                          lookup=[0.9, 0.9, 0.8, 0.8, 0.7])
  plan = costs.adaptive_plan(measured.costs, measured.profile)
  assert plan.copy_prior is not None and len(plan.widths) > 1  # both travel with the wrapper
  want = AdaptiveDrafter(sj.ModelDrafter(draft), plan.max_draft, plan.round_ms, plan.prior,
                         copy_prior=plan.copy_prior, plain=plan.plain, widths=plan.widths)
  built = sj.adaptive_drafter(draft, calibration=measured)  # a model becomes a ModelDrafter
  assert isinstance(built.drafter, sj.ModelDrafter) and built.drafter.model is draft
  assert _fields(built) == _fields(want)
  # Options reach the wrapper; a calibration directory reads as the Calibration it holds.
  assert not sj.adaptive_drafter(draft, calibration=measured, token_stop=False).token_stop


def test_adaptive_drafter_reads_a_calibration_directory(draft, tmp_path):
  FLAT.costs.save(tmp_path)
  FLAT.profile.save(tmp_path)
  assert (_fields(sj.adaptive_drafter(draft, calibration=tmp_path))
          == _fields(sj.adaptive_drafter(draft, calibration=FLAT)))
  with pytest.raises(ValueError, match="acceptance_profile.json not found"):
    sj.adaptive_drafter(draft, calibration=tmp_path / "elsewhere")


@dataclasses.dataclass(frozen=True)
class _TwoHeads(sj.NGramDrafter):
  """A drafter that drafts at most 2 tokens (as a Medusa drafter with 2 heads)."""

  max_draft = 2


def test_adaptive_drafter_bounds_k(draft):
  assert sj.adaptive_drafter(draft, calibration=FLAT).max_draft == 4
  assert sj.adaptive_drafter(draft, calibration=FLAT, max_draft=3).max_draft == 3
  assert (_fields(sj.adaptive_drafter(draft, calibration=FLAT, max_draft=3))
          == _fields(AdaptiveDrafter(sj.NGramDrafter(), **_plan_args(FLAT, 3))))
  assert sj.adaptive_drafter(_TwoHeads(), calibration=FLAT).max_draft == 2
  assert sj.adaptive_drafter(_TwoHeads(), calibration=FLAT, max_draft=3).max_draft == 2
  assert sj.adaptive_drafter(_TwoHeads(), calibration=FLAT, max_draft=1).max_draft == 1
  with pytest.raises(ValueError, match="max_draft must be >= 1"):
    sj.adaptive_drafter(draft, calibration=FLAT, max_draft=0)
  with pytest.raises(ValueError, match="already adaptive"):
    sj.adaptive_drafter(sj.adaptive_drafter(draft, calibration=FLAT), calibration=FLAT)


def _plan_args(measured, max_draft):
  plan = costs.adaptive_plan(measured.costs, measured.profile, max_draft=max_draft)
  return dict(max_draft=plan.max_draft, round_ms=plan.round_ms, prior=plan.prior,
              copy_prior=plan.copy_prior, plain=plan.plain, widths=plan.widths)


def test_decode_takes_k_and_widths_from_the_wrapper(target, draft, ragged, nothing_traced):
  tokens, lengths = ragged
  rows = sj.adaptive_drafter(draft, calibration=FLAT, max_draft=3)
  plan = costs.adaptive_plan(FLAT.costs, FLAT.profile, max_draft=3)
  check = lambda **kwargs: check_decode_arguments(
      target, rows, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=8,
      sampling=sj.Sampling(), eos_id=None, verify_impl="auto", **kwargs)
  for given in (dict(num_draft=None), dict(num_draft=3),
                dict(num_draft=None, verify_widths=plan.widths)):
    args = check(**given)
    assert (args.num_draft, args.widths) == (3, plan.widths)
  assert plan.widths != (4,)
  for given in (dict(num_draft=4), dict(num_draft=2), dict(num_draft=None, verify_widths=(4,))):
    with pytest.raises(ValueError, match=r"an AdaptiveDrafter brings its own K = 3 and verify "
                       r"widths .*: leave num_draft and verify_widths out"):
      check(**given)
  # A hand-built wrapper without widths verifies at K + 1 only.
  bare = AdaptiveDrafter(sj.ModelDrafter(draft), 2, (1.0, 1.4, 1.5), (0.5, 0.5))
  args = check_decode_arguments(target, bare, tokens, jax.random.key(0), lengths=lengths,
                                max_new_tokens=8, num_draft=None, sampling=sj.Sampling(),
                                eos_id=None, verify_impl="auto")
  assert (args.num_draft, args.widths) == (2, (3,))
  with pytest.raises(ValueError, match="outside"):
    check_decode_arguments(target, dataclasses.replace(bare, widths=(0, 3)), tokens,
                           jax.random.key(0), lengths=lengths, max_new_tokens=8, num_draft=None,
                           sampling=sj.Sampling(), eos_id=None, verify_impl="auto")


@pytest.mark.costly
def test_greedy_with_the_wrapper_equals_generate(target, draft, ragged):
  """A ragged batch, greedy: `decode` and `decode_stream` with `sj.adaptive_drafter(...)` (no
  `num_draft`) give `sj.generate`'s tokens, and the loop drafts up to the wrapper's K = 3 (the
  default would be 4)."""
  tokens, lengths = ragged
  # The target as its own drafter always agrees: each row's k fixed from its history (no token
  # stop, whose confidences would be a random model's) reaches K after the first round.
  rows = sj.adaptive_drafter(target, calibration=FLAT, max_draft=3, token_stop=False)
  ref = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=20)
  out = sj.decode(target, rows, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=20)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.num_tokens, ref.num_tokens)
  assert out.stats.accepted_per_position.shape == (3, 3)
  assert int(np.max(np.asarray(out.stats.accepted_per_position)[:, 2])) > 0  # slot K was used
  streamed = [[] for _ in range(3)]
  for new, _ in sj.decode_stream(target, rows, tokens, jax.random.key(0), lengths=lengths,
                                 max_new_tokens=20):
    for b, row in enumerate(new):
      streamed[b].extend(int(t) for t in row)
  for b in range(3):
    assert streamed[b] == np.asarray(ref.tokens[b, :int(ref.num_tokens[b])]).tolist()
  noisy = sj.decode(target, sj.adaptive_drafter(draft, calibration=FLAT), tokens,
                    jax.random.key(0), lengths=lengths, max_new_tokens=20)
  np.testing.assert_array_equal(noisy.tokens, ref.tokens)
  assert noisy.stats.accepted_per_position.shape == (3, 4)


def test_stream_with_a_plain_wrapper_samples_decode_s_tokens(target, draft, ragged):
  """At temperature 1 a plain wrapper's `decode` is `sj.generate`; the stream's tokens are the same
  (a stream of width-1 verify rounds would draw them from the verify's random streams instead)."""
  tokens, lengths = ragged
  plain = AdaptiveDrafter(sj.ModelDrafter(draft), 2, (1.0, 1.4, 1.5), (0.5, 0.5), plain=True)
  common = dict(lengths=lengths, max_new_tokens=12, sampling=sj.Sampling(temperature=1.0),
                eos_id=3)
  out = sj.decode(target, plain, tokens, jax.random.key(5), **common)
  ref = sj.generate(target, tokens, jax.random.key(5), **common)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  streamed, last = [[] for _ in range(3)], None
  for new, state in sj.decode_stream(target, plain, tokens, jax.random.key(5), **common):
    for b, row in enumerate(new):
      streamed[b].extend(int(t) for t in row)
    last = state.stats.summary()
  for b in range(3):
    assert streamed[b] == np.asarray(out.tokens[b, :int(out.num_tokens[b])]).tolist()
  assert last == out.stats.summary()
