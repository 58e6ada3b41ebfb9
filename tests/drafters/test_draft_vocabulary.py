"""A self-draft over part of the vocabulary (`sj.self_drafter(vocab=..., context=...)`,
`restrict_output`, `specjax.tuning.draft_vocab`).

* `restrict_output` keeps exactly the chosen rows: its logits equal the whole model's at those ids
  (float tied, float untied, quantized), in every layout.
* A greedy draft is the argmax of the quantized copy's logits over the draft vocabulary, and with
  `context=M` over the draft vocabulary and the row's last M tokens: checked against the copy's
  own full-vocabulary logits.
* Exact: greedy decode equals `generate` (ragged batch, both layouts) while the target emits
  tokens the drafts cannot reach; sampled decode (N = 20,000 rows, seeded, ALPHA = 1e-3) matches
  the target's enumerated distribution at T = 1 and T = 0.7 with top-k / top-p, and a broken
  variant (the verify told a q with mass outside the draft vocabulary) is rejected at
  POWER_ALPHA = 1e-6 by the same test.
* `frequent_vocab` counts the target's own answers; bad input raises before compiling.
* `decode` with it exports for TPU under (1, 8) and (2, 4) meshes (the verify kernel inside, the
  copy's integers narrow, no CPU call).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.drafters import with_draft_vocab
from specjax.drafters.model import restrict_output
from specjax.models import quant
from specjax.models import weights
from specjax.testing.models import tiny_config
from specjax.tuning.draft_vocab import frequent_vocab, vocab_coverage

from tests.exactness.test_exactness import (ALPHA, POWER_ALPHA, PROMPT, SETTINGS, VOCAB,
                                            chi_square_pvalue, exact_joint, run_decode)

SUBSET = np.array([40, 3, 17, 5, 60, 8, 22, 9, 70, 11, 90, 13])  # unsorted on purpose


@pytest.fixture(scope="module")
def target():
  return sj.init_params(tiny_config(vocab_size=96, tie_embeddings=True), jax.random.key(4))


def _logits(model, tokens):
  return np.asarray(jax.jit(lambda m, t: m(t, jnp.zeros((t.shape[0],), jnp.int32)).logits)(
      model, tokens))


@pytest.mark.parametrize("kind", ["tied", "untied", "quantized"])
@pytest.mark.parametrize("layout", ["stacked", "cpu"])
def test_restrict_output_keeps_exactly_those_rows(target, kind, layout):
  model = target.for_platform("cpu") if layout == "cpu" else target
  if kind == "untied":
    config = dataclasses.replace(target.config, tie_embeddings=False)
    head = jax.random.normal(jax.random.key(1), (target.config.embed_dim, 96)) * 0.1
    model = dataclasses.replace(model, params=dict(model.params, lm_head=head), config=config)
  if kind == "quantized":
    model = sj.quantize(model, 8, 32)
  restricted, ids = restrict_output(model, SUBSET)
  np.testing.assert_array_equal(ids, np.sort(SUBSET))
  tokens = jnp.array([[5, 9, 2, 7, 1, 3, 8]], jnp.int32)
  whole, part = _logits(model, tokens), _logits(restricted, tokens)
  assert part.shape == (1, 7, len(SUBSET))
  np.testing.assert_allclose(part, whole[..., np.sort(SUBSET)], rtol=1e-5, atol=1e-5)
  # Layout changes keep the restriction (it is an untied head, not a copy of the embedding).
  np.testing.assert_allclose(_logits(restricted.stacked(), tokens), part, rtol=1e-5, atol=1e-5)


def _first_draft(drafter, tokens, lengths):
  cache = drafter.init(tokens, lengths, 16, None)
  seeds = jnp.zeros((tokens.shape[0],), jnp.uint32)
  buffer = jnp.zeros((tokens.shape[0], 16), jnp.int32).at[:, :tokens.shape[1]].set(tokens)
  _, proposal = drafter.propose(cache, buffer, lengths, num_draft=1, sampling=sj.Sampling(),
                                seeds=seeds)
  return np.asarray(proposal.tokens[:, 0])


@pytest.mark.parametrize("context", [0, 3])
def test_a_greedy_draft_is_the_copys_argmax_over_what_it_may_draft(target, context):
  tokens = jnp.array([[5, 9, 2, 7, 1, 3, 8], [3, 8, 4, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0]],
                     jnp.int32)
  lengths = jnp.array([7, 3, 1], jnp.int32)
  drafter = sj.self_drafter(target, bits=8, group=32, vocab=SUBSET, context=context)
  drafted = _first_draft(dataclasses.replace(drafter, share_prompt=False), tokens, lengths)
  full = _logits(sj.quantize(target, 8, 32), tokens)  # the copy's whole-vocabulary logits
  for b, n in enumerate(np.asarray(lengths)):
    allowed = set(SUBSET.tolist()) | set(np.asarray(tokens[b, max(0, n - context):n]).tolist()
                                         if context else set())
    mask = np.full(96, -np.inf)
    mask[sorted(allowed)] = 0.0
    assert drafted[b] == np.argmax(full[b, n - 1] + mask)
  if context:  # row 0's last tokens (1, 3, 8) are outside SUBSET: only the context reaches them
    plain = _first_draft(dataclasses.replace(drafter, share_prompt=False, context_vocab=0),
                         tokens, lengths)
    assert set(SUBSET.tolist()) >= set(plain.tolist())


@pytest.mark.parametrize("context", [0, 4])
@pytest.mark.parametrize("layout", ["stacked", "cpu"])
def test_greedy_decode_over_a_draft_vocabulary_equals_generate(target, context, layout):
  model = target if layout == "stacked" else target.for_platform("cpu")
  tokens = jnp.array([[5, 9, 2, 7, 1, 3, 8], [3, 8, 4, 0, 0, 0, 0], [1, 2, 0, 0, 0, 0, 0]],
                     jnp.int32)
  lengths = jnp.array([7, 3, 2], jnp.int32)
  key = jax.random.key(0)
  want = sj.generate(model, tokens, key, lengths=lengths, max_new_tokens=24)
  emitted = np.asarray(want.tokens)
  vocab = np.unique(emitted)[::2]  # half of what the target says: the rest is never drafted
  drafter = sj.self_drafter(model, bits=8, group=32, vocab=vocab, context=context)
  out = sj.decode(model, drafter, tokens, key, lengths=lengths, max_new_tokens=24, num_draft=4)
  np.testing.assert_array_equal(out.tokens, want.tokens)
  assert 0 < out.stats.summary()["accepted"] < 3 * 24


@pytest.mark.parametrize("context", [0, 4])
def test_a_separate_draft_model_over_a_draft_vocabulary_equals_generate(target, context):
  """`with_draft_vocab` on a separate draft model (another random model of the same vocabulary,
  int8, its own prefill): greedy tokens equal `generate`'s on a ragged batch, and it drafts only
  ids of the vocabulary or of each row's last `context` tokens."""
  draft = sj.quantize(sj.init_params(tiny_config(vocab_size=96, tie_embeddings=True,
                                                 num_layers=1), jax.random.key(9)), 8, 32)
  tokens = jnp.array([[5, 9, 2, 7, 1, 3, 8], [3, 8, 4, 0, 0, 0, 0], [1, 2, 0, 0, 0, 0, 0]],
                     jnp.int32)
  lengths = jnp.array([7, 3, 2], jnp.int32)
  key = jax.random.key(0)
  want = sj.generate(target, tokens, key, lengths=lengths, max_new_tokens=24)
  vocab = np.arange(0, 96, 3)
  drafter = with_draft_vocab(sj.ModelDrafter(draft), vocab, context=context)
  assert drafter.model.params["lm_head"].values.shape[0] == len(vocab)
  assert not drafter.share_prompt and drafter.context_vocab == context
  out = sj.decode(target, drafter, tokens, key, lengths=lengths, max_new_tokens=24, num_draft=4)
  np.testing.assert_array_equal(out.tokens, want.tokens)
  rows = [list(np.asarray(tokens)[b, :n]) + list(np.asarray(out.tokens)[b, :m])
          for b, (n, m) in enumerate(zip(np.asarray(lengths), np.asarray(out.num_tokens)))]
  sequence = np.zeros((3, 48), np.int32)
  for b, row in enumerate(rows):
    sequence[b, :len(row)] = row
  _, proposal = drafter.propose(drafter.init(tokens, lengths, 48), jnp.asarray(sequence),
                                jnp.asarray([len(r) for r in rows], jnp.int32), num_draft=3,
                                sampling=sj.Sampling(), seeds=jnp.zeros((3,), jnp.uint32))
  recent = {int(t) for row in rows for t in row[-context:]} if context else set()
  assert set(np.asarray(proposal.tokens).ravel()) <= set(vocab.tolist()) | recent


@pytest.mark.parametrize("quantized", [False, True])
def test_an_untied_draft_model_scores_its_context_through_its_own_head(target, quantized):
  """An untied draft model keeps its whole `lm_head` for the context rows (`context_head`): the
  first draft's logits over the context are the full model's logits of those ids (a quantized
  head: up to the kernel's int8 rounding of the hidden state, far from what the embedding's rows
  would give), and greedy `decode` still equals `generate`."""
  untied = sj.init_params(tiny_config(vocab_size=96, tie_embeddings=False, num_layers=1),
                          jax.random.key(9))
  untied = sj.quantize(untied, 8, 32) if quantized else untied
  drafter = with_draft_vocab(sj.ModelDrafter(untied), SUBSET, context=3)
  assert drafter.context_head is not None and drafter.context_vocab == 3
  tokens = jnp.array([[5, 9, 2, 7, 1, 3, 8], [3, 8, 4, 0, 0, 0, 0]], jnp.int32)
  lengths = jnp.array([7, 3], jnp.int32)
  full = _logits(untied, tokens)  # [B, T, V]
  context = drafter._context(tokens, lengths)
  out = drafter.model(tokens, jnp.zeros((2,), jnp.int32), return_hidden=True)
  hidden = jnp.take_along_axis(out.hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
  scores = np.asarray(drafter._scores(jnp.zeros((2, len(SUBSET))), hidden, context))[:, -3:]
  tolerance = 3e-2 if quantized else 1e-4
  embed = np.asarray(weights.embed(untied.params["embed"], jnp.arange(96)))
  for b, n in enumerate([7, 3]):
    recent = np.asarray(tokens)[b, n - 3:n]
    np.testing.assert_allclose(scores[b], full[b, n - 1, recent], atol=tolerance)
    assert np.abs(np.asarray(hidden)[b] @ embed[recent].T - scores[b]).max() > 10 * tolerance
  key = jax.random.key(0)
  want = sj.generate(target, tokens, key, lengths=lengths, max_new_tokens=16)
  got = sj.decode(target, drafter, tokens, key, lengths=lengths, max_new_tokens=16, num_draft=3)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  with pytest.raises(ValueError, match="context must be an int"):
    with_draft_vocab(sj.ModelDrafter(untied), SUBSET, context=-1)
  assert with_draft_vocab(sj.ModelDrafter(untied), SUBSET).context_head is None


@pytest.fixture(scope="module")
def small_target():
  return sj.init_params(tiny_config(vocab_size=VOCAB, tie_embeddings=True), jax.random.key(10))


# Of the 8 ids, 3 and 6 are draftable only as context (PROMPT ends 3, 1), 4 and 7 never.
SMALL_SUBSET = np.array([0, 1, 2, 5])


def _small_drafter(target):
  return sj.self_drafter(target, bits=4, group=32, vocab=SMALL_SUBSET, context=2)


def _untied_model_drafter(target):
  """A separate untied int8 draft model (1 layer, its own weights) over the same subset and its
  last 2 tokens, scored through its own output projection (`context_head`)."""
  del target
  small = sj.init_params(tiny_config(vocab_size=VOCAB, tie_embeddings=False, num_layers=1),
                         jax.random.key(11))
  return with_draft_vocab(sj.ModelDrafter(sj.quantize(small, 8, 32)), SMALL_SUBSET, context=2)


DRAFTERS = {"self": _small_drafter, "untied_model": _untied_model_drafter}


def _told_mass_outside(target_logits, draft_logits, draft_tokens, **kwargs):
  """The broken variant: drafts come from the draft vocabulary, but the verify is told a q whose
  ids outside it carry the row's largest finite logit instead of -inf (so they survive top-k /
  top-p too)."""
  from specjax.verify.rule import verify_reference
  finite = jnp.where(jnp.isfinite(draft_logits), draft_logits, -jnp.inf)
  top = jnp.max(finite, axis=-1, keepdims=True)
  leaky = jnp.where(jnp.isfinite(draft_logits), draft_logits, top)
  return verify_reference(target_logits, leaky, draft_tokens, **kwargs)


@pytest.mark.costly
@pytest.mark.parametrize("name,kind", [("t1", "self"), ("t0.7_topk3", "self"),
                                       ("t1", "untied_model"),
                                       pytest.param("t0.9_topp0.8", "self",
                                                    marks=pytest.mark.slow)])
def test_sampled_decode_over_a_draft_vocabulary_matches_the_target(small_target, name, kind):
  sampling = SETTINGS[name]
  tokens, stats = run_decode(small_target, DRAFTERS[kind](small_target), sampling)
  assert 0.05 < stats.summary()["acceptance_rate"] < 0.999
  assert chi_square_pvalue(tokens, exact_joint(small_target, sampling)) > ALPHA


@pytest.mark.slow  # the power checks: CI's slow step
@pytest.mark.parametrize("name,kind", [("t1", "self"), ("t0.7_topk3", "self"),
                                       ("t1", "untied_model")])
def test_a_q_with_mass_outside_the_draft_vocabulary_is_rejected(small_target, name, kind):
  sampling = SETTINGS[name]
  tokens, _ = run_decode(small_target, DRAFTERS[kind](small_target), sampling,
                         verify_impl=_told_mass_outside)
  assert chi_square_pvalue(tokens, exact_joint(small_target, sampling)) < POWER_ALPHA


def test_frequent_vocab_counts_the_targets_own_answers(target):
  class Ids:  # prompts given as ids: the tokenizer is only asked to encode and for its EOS ids
    eos_ids = (95,)
    chat_template = None

    def encode_batch(self, texts):
      rows = [[int(t) for t in text.split()] for text in texts]
      out = np.zeros((len(rows), max(map(len, rows))), np.int32)
      for i, row in enumerate(rows):
        out[i, :len(row)] = row
      return out, np.asarray([len(r) for r in rows], np.int32)

  prompts = ["5 9 2 7", "3 8 4", "1 2"]
  ids = frequent_vocab(target, Ids(), 10, prompts=prompts, max_new_tokens=12, batch=2)
  assert ids.dtype == np.int32 and len(ids) == 10 and np.all(np.diff(ids) > 0)
  assert 95 in ids  # the end-of-turn id stays whatever its count
  # Oracle: the same generate calls' answers, counted here by hand.
  answers = []
  for start in (0, 2):
    part = [[int(t) for t in p.split()] for p in prompts[start:start + 2]]
    rows = np.zeros((2, 32), np.int32)
    lens = np.ones((2,), np.int32)
    for i, row in enumerate(part):
      rows[i, :len(row)] = row
      lens[i] = len(row)
    out = sj.generate(target, rows, jax.random.key(start), lengths=lens, max_new_tokens=12,
                      sampling=sj.Sampling(temperature=1.0), eos_id=(95,))
    answers += [np.asarray(out.tokens[i, :int(out.num_tokens[i])]) for i in range(len(part))]
  seen = np.concatenate(answers + [np.asarray([int(t) for p in prompts for t in p.split()])])
  counts = np.bincount(seen, minlength=96)
  top = np.argsort(-counts, kind="stable")[:5]
  assert set(top.tolist()) <= set(ids.tolist())
  # The 9 most frequent ids (and the EOS) cover at least what the 9 largest counts add up to.
  assert vocab_coverage(ids, seen) >= np.sort(counts)[::-1][:9].sum() / len(seen) - 1e-9
  assert vocab_coverage([1, 2, 3], [[1, 1], [4, 5]]) == 0.5
  assert np.isnan(vocab_coverage([1, 2, 3], []))


@pytest.mark.parametrize("kwargs,message", [
    (dict(vocab=[]), "non-empty 1-D"),
    (dict(vocab=[[1, 2]]), "non-empty 1-D"),
    (dict(vocab=[0.5, 2.0]), "non-empty 1-D"),
    (dict(vocab=[1, 96]), r"in \[0, 96\)"),
    (dict(vocab=[-1, 3]), r"in \[0, 96\)"),
    (dict(vocab=[3, 3]), "distinct"),
    (dict(context=2), "context needs vocab"),
    (dict(vocab=[1, 2], context=-1), "context must be an int"),
])
def test_bad_draft_vocabularies_raise(target, kwargs, message):
  with pytest.raises(ValueError, match=message):
    sj.self_drafter(target, bits=8, group=32, **kwargs)


def test_bad_frequent_vocab_sizes_and_models_raise(target):
  with pytest.raises(ValueError, match=r"size must be an int in \[1, 96\]"):
    frequent_vocab(target, None, 0)
  with pytest.raises(ValueError, match="context_vocab needs draft_ids"):
    sj.ModelDrafter(target, context_vocab=3)
  restricted, _ = restrict_output(sj.quantize(target, 8, 32), SUBSET)
  with pytest.raises(ValueError, match="already restricted"):
    restrict_output(restricted, SUBSET)
  untied = dataclasses.replace(target.config, tie_embeddings=False)
  model = dataclasses.replace(target, config=untied,
                              params=dict(target.params, lm_head=jnp.zeros((32, 96))))
  with pytest.raises(ValueError, match="tied embeddings"):
    sj.self_drafter(model, bits=8, group=32, vocab=SUBSET, context=2)
  assert quant.is_quantized(restricted.params["lm_head"])


@pytest.mark.parametrize("shape", [(1, 8), (2, 4)], ids=str)
def test_decode_over_a_draft_vocabulary_exports_for_tpu(target, shape):
  mesh = sj.make_mesh(shape)
  tokens = jnp.array([[5, 9, 2, 7, 1, 3]] * 4 + [[3, 8, 4, 0, 0, 0]] * 4, jnp.int32)
  lengths = jnp.array([6] * 4 + [3] * 4, jnp.int32)
  drafter = sj.self_drafter(target, bits=8, group=32, vocab=SUBSET, context=4)
  drafter = dataclasses.replace(drafter, model=sj.shard(drafter.model, mesh))

  def run(target, drafter, tokens, lengths, rng):
    return sj.decode(target, drafter, tokens, rng, lengths=lengths, max_new_tokens=8,
                     num_draft=3, sampling=sj.Sampling(temperature=0.7, top_k=20)).tokens

  with jax.set_mesh(mesh):
    text = jax.export.export(jax.jit(run), platforms=["tpu"])(
        sj.shard(target, mesh), drafter, tokens, lengths, jax.random.key(3)).mlir_module()
  assert "specjax_cpu" not in text and "tpu_custom_call" in text
  assert "i8" in text  # the copy's integers travel narrow
