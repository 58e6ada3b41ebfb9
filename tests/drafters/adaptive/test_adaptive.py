"""Adaptive draft length for chains: the per-row confidence stop and verify widths chosen on device.

* The rule with `num_drafted`: hand-worked greedy cases; a goodness-of-fit test of the token at
  the stop slot (it must be a sample from p, the bonus) that a deliberately broken rule (the
  token drawn from the residual of the drafter's unproposed distribution) fails; the Pallas
  kernels (interpret, `pltpu.InterpretParams()`, GPU interpret) and the vocabulary-sharded mesh
  path equal the reference token for token, rows with 0 drafts included.
* Decoding: greedy with a confidence stop and verify widths equals `sj.generate` on a ragged
  batch (a draft model and an EAGLE-3 head, `decode_stream` too); one top-level while loop and no
  callbacks in the jaxpr; one trace per shape bucket; a forced narrow width verifies exactly as
  the full width.
* Exactness of sampled decoding with an EAGLE-3 head and a confidence stop, with the pooled
  chi-square harness of tests/exactness/test_exactness.py (N = 20,000, ALPHA = 1e-3): the correct rule
  passes at temperature 1.0 and 0.7 with top-k / top-p, the broken rule fails (p < 1e-6). These
  decode-level runs are slow (about 35 s each); the rule-level test is the default's cheap case.
* Bad thresholds and widths raise a ValueError before anything is compiled.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from scipy import stats as scipy_stats

import specjax as sj
from specjax.core import sampling as S
from specjax.verify.dispatch import verify_tokens
from specjax.kernels import BlockSizes, GpuBlockSizes, fused_verify, fused_verify_gpu
from specjax.testing.models import tiny_config
from specjax.testing.rules import rule_stop_from_residual
from specjax.loop.round import verify_block
from specjax.verify.rule import verify_reference
from specjax.loop.state import init_state
from specjax.drafters.proposal import Proposal
from specjax.core.tracing import TRACE_COUNTS
from tests.exactness.test_exactness import ALPHA, N, NEW, POWER_ALPHA, PROMPT, VOCAB, chi_square_pvalue, \
    exact_joint, numpy_distribution
from tests.exactness.test_heads_exactness import make_eagle
from tests.verify.test_fused_verify import _case

STOP_SETTINGS = {
    "t1": sj.Sampling(temperature=1.0),
    "t0.7_topk5_topp0.9": sj.Sampling(temperature=0.7, top_k=5, top_p=0.9),
}
HEAD_CONFIDENCE = 0.5  # with the random 8-token head: about 0.9 of 2 drafts proposed per round


# ---------------------------------------------------------------------------------------------
# The rule.


def test_greedy_hand_worked_num_drafted():
  # V = 5, k = 2. Target argmax per slot: [3, 1, 4]; drafts [3, 1] (both right).
  # num_drafted 2: n = 2, bonus = argmax of slot 2 = 4 -> [3, 1, 4].
  # num_drafted 1: slot 1 is no draft: n = 1, the bonus is the argmax of slot 1 = 1 -> [3, 1, 0].
  # num_drafted 0: n = 0, the bonus is the argmax of slot 0 = 3 -> [3, 0, 0].
  target = jnp.array([[[0., 1., 2., 9., 3.], [0., 8., 7., 1., 2.], [1., 1., 1., 1., 5.]]] * 3)
  case = dict(target_logits=target, draft_logits=None, draft_tokens=jnp.array([[3, 1]] * 3),
              positions=jnp.array([4, 4, 4]), seeds=S.row_seeds(jax.random.key(0), 3),
              num_drafted=jnp.array([2, 1, 0]))
  want_n, want_tokens = [2, 1, 0], [[3, 1, 4], [3, 1, 0], [3, 0, 0]]
  for verify in (verify_reference, functools.partial(fused_verify, interpret=True),
                 functools.partial(fused_verify_gpu, interpret=True)):
    got = verify(**case, sampling=S.GREEDY)
    np.testing.assert_array_equal(got.num_accepted, want_n)
    np.testing.assert_array_equal(got.tokens, want_tokens)


def _stop_slot_pvalue(rule, num_drafted: int) -> tuple[float, np.ndarray]:
  """N rows, k = 2, one fixed p and q per slot over 8 tokens; every row proposes `num_drafted`
  drafts, each equal to q's mode. Returns the chi-square p-value of the token at the stop slot
  (rows that reached it) against p at that slot, from the float64 NumPy oracle."""
  rng = np.random.default_rng(5)
  sampling = sj.Sampling(temperature=1.0)
  target = rng.normal(size=(3, 8)).astype(np.float32) * 1.5
  draft = rng.normal(size=(2, 8)).astype(np.float32) * 1.5
  draft[:, :] += 3.0 * np.eye(8, dtype=np.float32)[np.argmax(target[:2], -1)]  # often accepted
  tokens = np.argmax(draft, -1)
  seeds = S.row_seeds(jax.random.key(7), N)
  result = jax.jit(lambda s: rule(
      jnp.broadcast_to(target, (N, 3, 8)), jnp.broadcast_to(draft, (N, 2, 8)),
      jnp.broadcast_to(jnp.asarray(tokens, jnp.int32), (N, 2)), sampling=sampling, seeds=s,
      positions=jnp.full((N,), 11, jnp.int32), num_drafted=jnp.full((N,), num_drafted)))(seeds)
  n = np.asarray(result.num_accepted)
  reached = n == num_drafted
  emitted = np.asarray(result.tokens)[reached, num_drafted]
  p = numpy_distribution(target[num_drafted], sampling)
  observed = np.bincount(emitted, minlength=8)
  expected = p * reached.sum()
  return float(scipy_stats.chisquare(observed, expected).pvalue), n


@pytest.mark.parametrize("num_drafted", [0, 1])
def test_stop_slot_token_is_a_sample_from_p(num_drafted):
  pvalue, n = _stop_slot_pvalue(verify_reference, num_drafted)
  assert np.all(n <= num_drafted)
  assert (n == num_drafted).sum() > N // 4  # the stop slot is reached often
  assert pvalue > ALPHA
  broken, _ = _stop_slot_pvalue(rule_stop_from_residual, num_drafted)
  assert broken < POWER_ALPHA


KERNEL_SAMPLINGS = [S.GREEDY, S.Sampling(temperature=1.0),
                    S.Sampling(temperature=0.7, top_k=5, top_p=0.9)]


def _stop_case(seed, sampling, with_draft_logits, batch=16, num_draft=3, vocab=200):
  case = _case(np.random.default_rng(seed), batch, num_draft, vocab, sampling=sampling,
               with_draft_logits=with_draft_logits)
  case["num_drafted"] = jnp.arange(batch, dtype=jnp.int32) % (num_draft + 1)  # 0 .. k, 0 .. k
  # Every third row gets a wrong token at one slot, so that rejections occur even when greedy.
  rows = np.arange(0, batch, 3)
  tokens = np.asarray(case["draft_tokens"]).copy()
  tokens[rows, rows % num_draft] = (tokens[rows, rows % num_draft] + 1) % vocab
  case["draft_tokens"] = jnp.asarray(tokens, jnp.int32)
  return case


def _run_kernel(mode, case, sampling):
  if mode == "interpret":
    return fused_verify(**case, sampling=sampling, block_sizes=BlockSizes(128, 8),
                        interpret=True)
  if mode == "tpu-interpret":
    return fused_verify(**case, sampling=sampling, block_sizes=BlockSizes(128, 8),
                        interpret=pltpu.InterpretParams())
  return fused_verify_gpu(**case, sampling=sampling, block_sizes=GpuBlockSizes(128, 8),
                          interpret=True)


# (mode, KERNEL_SAMPLINGS index, logits); the hand-worked greedy case runs interpret=True too.
DEFAULT_KERNEL_CASES = (("tpu-interpret", 1, True), ("gpu-interpret", 2, False))


@pytest.mark.parametrize("mode, sampling, with_draft_logits", [
    *[pytest.param(mode, KERNEL_SAMPLINGS[i], logits, id=f"{mode}-{i}-{logits}")
      for mode, i, logits in DEFAULT_KERNEL_CASES],
    *[pytest.param(mode, KERNEL_SAMPLINGS[i], logits, id=f"{mode}-{i}-{logits}",
                   marks=pytest.mark.slow)
      for mode in ("interpret", "tpu-interpret", "gpu-interpret")
      for i in range(len(KERNEL_SAMPLINGS)) for logits in (False, True)
      if (mode, i, logits) not in DEFAULT_KERNEL_CASES]])
def test_kernels_equal_reference_with_num_drafted(mode, sampling, with_draft_logits):
  case = _stop_case(len(mode) + int(with_draft_logits), sampling, with_draft_logits)
  want = verify_reference(**case, sampling=sampling)
  got = _run_kernel(mode, case, sampling)
  np.testing.assert_array_equal(got.num_accepted, want.num_accepted)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  n, drafted = np.asarray(want.num_accepted), np.asarray(case["num_drafted"])
  assert np.all(n <= drafted) and np.all(n[drafted == 0] == 0)
  assert (n == drafted).any() and (n < drafted).any()  # bonus at a stop and rejections occur


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["reference", "interpret"])
def test_vocab_sharded_mesh_path_honours_num_drafted(impl):
  sampling = KERNEL_SAMPLINGS[2]
  case = _stop_case(3, sampling, True, batch=8, vocab=100)  # 100 does not divide 4 shards
  want = verify_reference(**case, sampling=sampling)
  mesh = sj.make_mesh((2, 4))
  got = jax.jit(lambda c: verify_tokens(**c, sampling=sampling, impl=impl, mesh=mesh))(case)
  np.testing.assert_array_equal(got.num_accepted, want.num_accepted)
  np.testing.assert_array_equal(got.tokens, want.tokens)


# ---------------------------------------------------------------------------------------------
# Decoding with a confidence stop and verify widths.

CHAIN_VOCAB = 64


@pytest.fixture(scope="module")
def chain_target():
  return sj.init_params(tiny_config(vocab_size=CHAIN_VOCAB, num_layers=4), jax.random.key(20))


@pytest.fixture(scope="module")
def ragged():
  rng = np.random.default_rng(21)
  tokens = jnp.asarray(rng.integers(0, CHAIN_VOCAB, size=(3, 9)), jnp.int32)
  return tokens, jnp.array([9, 3, 6], jnp.int32)


def _draft_model(target, confidence):
  """The target with a noisy output layer: its argmax agrees with the target's about half the
  time, and its top probability (median about 0.16) spreads over the threshold."""
  head = target.params["lm_head"]
  noise = 0.6 * jnp.std(head) * jax.random.normal(jax.random.key(22), head.shape)
  params = dict(target.params, lm_head=head + noise)
  return sj.ModelDrafter(sj.Model(params, target.config), confidence=confidence)


def test_greedy_with_confidence_and_widths_one_loop_no_recompilation(chain_target, ragged):
  """Greedy with a confidence stop and verify widths equals `sj.generate` on a ragged batch, in
  one jitted program with one top-level while loop and no callbacks, traced once per bucket."""
  tokens, lengths = ragged
  drafter = _draft_model(chain_target, confidence=0.16)
  decode = functools.partial(sj.decode, chain_target, drafter, num_draft=4,
                             verify_widths=(1, 2, 3))
  before = TRACE_COUNTS["decode"]
  jaxpr = jax.make_jaxpr(lambda t, l: decode(t, jax.random.key(0), lengths=l,
                                             max_new_tokens=8))(tokens, lengths)
  assert "callback" not in str(jaxpr)
  calls = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("pjit", "jit")]
  body = calls[0].params["jaxpr"].jaxpr.eqns
  assert len([e for e in body if e.primitive.name == "while"]) == 1  # the round loop
  for max_new, seed in ((24, 0), (40, 1), (11, 2)):  # one bucket of max_new_tokens
    ref = sj.generate(chain_target, tokens, jax.random.key(seed), lengths=lengths,
                      max_new_tokens=max_new)
    out = decode(tokens, jax.random.key(seed), lengths=lengths, max_new_tokens=max_new)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.num_tokens, ref.num_tokens)
    summary = out.stats.summary()
    # The stop is exercised: rounds propose fewer than k drafts, and drafts are accepted and
    # rejected.
    assert 0 < summary["drafted"] < 4 * summary["rounds"]
    assert 0 < summary["accepted"] < summary["drafted"]
  assert TRACE_COUNTS["decode"] - before == 1  # the jaxpr's trace serves every call


@pytest.mark.parametrize("layout", ["stacked", "cpu"])
def test_a_narrow_verify_width_verifies_as_the_full_width(chain_target, ragged, layout):
  """`verify_block` with widths (1, 2, 3, 5) runs the forward over 1, 2, 3 or 5 positions
  (whatever the largest live count + 1 needs) and must give the full-width state exactly (the
  switch's forward defers its cache write to after the switch; the CPU layout's too)."""
  tokens, lengths = ragged
  if layout == "cpu":
    chain_target = chain_target.for_platform("cpu")
  drafter = sj.ModelDrafter(chain_target)
  state = jax.jit(lambda t, d, x, l: init_state(
      t, d, x, l, jnp.int32(16), jnp.array([-1]), jnp.arange(3, dtype=jnp.uint32), num_draft=4,
      capacity=64))(chain_target, drafter, tokens, lengths)
  # Slot 0 holds the target's own greedy choice after the prompt (accepted), then a 5 (mostly
  # rejected): rows reach their stop, or reject before it.
  greedy_next = jnp.argmax(chain_target(tokens, jnp.zeros(3, jnp.int32)).logits, -1)
  first = jnp.take_along_axis(greedy_next, (lengths - 1)[:, None], 1)
  drafts = jnp.concatenate([first, jnp.full((3, 3), 5, jnp.int32)], 1)
  run = jax.jit(lambda widths, s, p: verify_block(chain_target, drafter, s, p,
                                                  sampling=S.GREEDY, widths=widths),
                static_argnums=0)
  for counts in ([0, 0, 0], [1, 0, 1], [2, 1, 0], [4, 0, 0]):
    proposal = Proposal(drafts, None, jnp.array(counts, jnp.int32))
    narrow, full = run((1, 2, 3, 5), state, proposal), run(None, state, proposal)
    for name in ("tokens", "lengths", "done"):
      np.testing.assert_array_equal(getattr(narrow, name), getattr(full, name))
    kept = np.asarray(full.lengths - lengths)
    assert np.all(kept >= 1) and np.all(kept <= np.asarray(counts) + 1)
    for a, b in zip(jax.tree.leaves((narrow.target_cache.k, narrow.target_cache.v)),
                    jax.tree.leaves((full.target_cache.k, full.target_cache.v))):
      # [(L,) B, KVH, S, D]: compare each row's valid prefix (slots past it are scratch).
      slots = np.arange(a.shape[-2])[None] < np.asarray(full.lengths)[:, None] - 1  # [B, S]
      mask = slots[:, None, :, None]
      # The CPU layout reads blocks of up to 8 rows through its kernel and larger ones through
      # XLA's dot: the same products up to float32 summation order (~1e-6 on keys of ~0.01).
      np.testing.assert_allclose(np.asarray(a) * mask, np.asarray(b) * mask, rtol=1e-5,
                                 atol=5e-6)


@pytest.mark.parametrize("layout", ["stacked", "cpu"])
def test_verify_switch_copies_no_cache_buffer(chain_target, ragged, layout):
  """Inside the width switch the target cache is only read; its block is written after the switch.
  A cache updated inside a branch would be copied there, every layer, every round: the compiled
  round holds no copy of a cache-shaped buffer (structure of the program, not a timing)."""
  tokens, lengths = ragged
  target = chain_target if layout == "stacked" else chain_target.for_platform("cpu")
  drafter = sj.ModelDrafter(chain_target)
  state = jax.jit(lambda t, d, x, l: init_state(
      t, d, x, l, jnp.int32(16), jnp.array([-1]), jnp.arange(3, dtype=jnp.uint32), num_draft=4,
      capacity=64))(target, drafter, tokens, lengths)
  proposal = Proposal(jnp.zeros((3, 4), jnp.int32), None, jnp.array([1, 0, 2], jnp.int32))
  run = jax.jit(lambda s, p: verify_block(target, drafter, s, p, sampling=S.GREEDY,
                                          widths=(1, 2, 3, 5)), donate_argnums=0)
  hlo = run.lower(state, proposal).compile().as_text()
  assert " conditional(" in hlo
  layer = state.target_cache.layer_shape
  shapes = {"f32[" + ",".join(map(str, shape)) + "]"
            for shape in (layer, (target.config.num_layers,) + layer)}
  copies = [line.strip()[:100] for line in hlo.splitlines()
            if "=" in line and any(line.split("=", 1)[1].lstrip().startswith(x) for x in shapes)
            and line.split("=", 1)[1].split("(", 1)[0].split()[-1] == "copy"]
  assert not copies, copies


def _eagle(target, confidence):
  from specjax.drafters.eagle import network as eagle
  config = eagle.head_config_for(target.config, kind="eagle3", draft_vocab_size=32)
  head = eagle.init_head(config, target, jax.random.key(23), list(range(0, CHAIN_VOCAB, 2)))
  return sj.EagleDrafter(head, target.params["embed"], confidence=confidence)


@pytest.mark.slow
def test_eagle_greedy_with_confidence_and_widths_equals_generate(chain_target, ragged):
  tokens, lengths = ragged
  drafter = _eagle(chain_target, confidence=0.2)
  for max_new, seed in ((10, 1), (24, 2)):
    out = sj.decode(chain_target, drafter, tokens, jax.random.key(seed), lengths=lengths,
                    max_new_tokens=max_new, num_draft=3, verify_widths=(1, 2))
    ref = sj.generate(chain_target, tokens, jax.random.key(seed), lengths=lengths,
                      max_new_tokens=max_new)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    summary = out.stats.summary()
    assert 0 < summary["drafted"] < 3 * summary["rounds"]  # rows stop at 0, 1, 2 or 3 drafts


@pytest.mark.parametrize("make, message", [
    (lambda t: _draft_model(t, confidence=0.0), "confidence must be in"),
    (lambda t: _draft_model(t, confidence=1.5), "confidence must be in"),
    (lambda t: _draft_model(t, confidence=float("nan")), "confidence must be in"),
    (lambda t: _draft_model(t, confidence="high"), "confidence must be None or a number"),
    (lambda t: _eagle(t, confidence=-0.2), "confidence must be in"),
    (lambda t: _eagle(t, confidence=True), "confidence must be None or a number"),
])
def test_bad_thresholds_raise(chain_target, make, message):
  with pytest.raises(ValueError, match=message):
    make(chain_target)


@pytest.mark.parametrize("kwargs, message", [
    (dict(verify_widths=(0, 5)), "outside"),
    (dict(verify_widths=(2, 6)), "outside"),
    (dict(verify_widths=(2.0,)), "must hold ints"),
    (dict(verify_widths=3), "sequence of ints"),
    (dict(num_draft="fast"), "num_draft must be an int"),
    (dict(num_draft="auto"), "num_draft must be an int"),
    (dict(tree=sj.TreeSpec("static", depth=2, width=1), verify_widths=(2,)), "with tree="),
    (dict(tree=sj.TreeSpec("static", depth=2, width=1), num_draft=4), "with tree="),
])
def test_bad_widths_and_counts_raise_before_compiling(chain_target, ragged, kwargs, message):
  tokens, lengths = ragged
  before = TRACE_COUNTS["decode"]
  with pytest.raises(ValueError, match=message):
    sj.decode(chain_target, _draft_model(chain_target, 0.2), tokens, jax.random.key(0),
              lengths=lengths, **{**({} if "tree" in kwargs else {"num_draft": 4}), **kwargs})
  assert TRACE_COUNTS["decode"] == before


@pytest.mark.slow
def test_streamed_greedy_with_confidence_and_widths_equals_generate(chain_target, ragged):
  tokens, lengths = ragged
  ref = sj.generate(chain_target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=24)
  streamed = [[] for _ in range(3)]
  for new, _ in sj.decode_stream(chain_target, _draft_model(chain_target, confidence=0.16),
                                 tokens, jax.random.key(0), lengths=lengths, max_new_tokens=24,
                                 num_draft=4, verify_widths=(1, 2, 3)):
    for row, part in zip(streamed, new):
      row.extend(part.tolist())
  for b, row in enumerate(streamed):
    assert row == np.asarray(ref.tokens)[b, :int(ref.num_tokens[b])].tolist()


# ---------------------------------------------------------------------------------------------
# Exactness of sampled decoding with a confidence stop (the harness of tests/exactness/test_exactness.py).


@pytest.fixture(scope="module")
def heads_target():
  # The target of tests/exactness/test_heads_exactness.py: 4 layers, so the EAGLE-3 taps exist.
  return sj.init_params(tiny_config(vocab_size=VOCAB, num_layers=4), jax.random.key(10))


def _stop_decode_pvalue(target, sampling, verify_impl="auto"):
  drafter = dataclasses.replace(make_eagle(target, "eagle3"), confidence=HEAD_CONFIDENCE)
  tokens = jnp.tile(jnp.asarray(PROMPT, jnp.int32), (N, 1))
  out = sj.decode(target, drafter, tokens, jax.random.key(0), max_new_tokens=NEW, num_draft=2,
                  sampling=sampling, verify_impl=verify_impl, verify_widths=(1, 2))
  assert np.all(np.asarray(out.num_tokens) == NEW)
  pvalue = chi_square_pvalue(np.asarray(out.tokens), exact_joint(target, sampling))
  summary = out.stats.summary()
  print(f"confidence {HEAD_CONFIDENCE}: p = {pvalue:.3g}, drafted {summary['drafted']} in "
        f"{summary['rounds']} rounds, accepted {summary['accepted']}")
  return pvalue, summary


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(STOP_SETTINGS))
def test_eagle_with_confidence_stop_matches_target_distribution(heads_target, name):
  pvalue, summary = _stop_decode_pvalue(heads_target, STOP_SETTINGS[name])
  # Rows stop at 0, 1 and 2 drafts, and drafts are accepted and rejected.
  assert 0.2 * summary["rounds"] < summary["drafted"] < 1.8 * summary["rounds"]
  assert 0 < summary["accepted"] < summary["drafted"]
  assert pvalue > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(STOP_SETTINGS))
def test_stop_slot_drawn_from_the_residual_is_detected(heads_target, name):
  pvalue, _ = _stop_decode_pvalue(heads_target, STOP_SETTINGS[name],
                                  verify_impl=rule_stop_from_residual)
  assert pvalue < POWER_ALPHA
