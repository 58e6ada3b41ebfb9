"""The `Drafter` protocol's declared members: every built-in drafter subclasses `Drafter` and has
its defaults (`max_len`, `max_draft`, `confidence`, `catches_up`, `plain`, `extra_slots`,
`forwards_in_round`) or its own values; a `DrafterWrapper` forwards the attributes to the drafter
it wraps, except where it has a field of its own (`AdaptiveDrafter.max_draft`, `.plain`), also
after a pytree round trip; a drafter that follows the protocol without subclassing it is told
which members it lacks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.drafters import Drafter, HybridDrafter, MedusaDrafter, as_drafter
from specjax.drafters.adaptive import AdaptiveDrafter
from specjax.drafters.medusa import network as medusa
from specjax.drafters.tree import extra_slots, tree_drafter
from specjax.testing.models import tiny_config

VOCAB = 32


@pytest.fixture(scope="module")
def target():
  return sj.init_params(tiny_config(vocab_size=VOCAB, num_layers=2), jax.random.key(0))


@pytest.fixture(scope="module")
def heads(target):
  config = medusa.MedusaConfig(target.config.embed_dim, 3, 16, VOCAB)
  return MedusaDrafter(medusa.init_medusa(config, target, list(range(16))), confidence=0.3)


def test_the_defaults(target):
  ngram = sj.NGramDrafter()
  assert isinstance(ngram, Drafter)
  assert (ngram.max_len, ngram.max_draft, ngram.confidence, ngram.catches_up, ngram.plain) == (
      None, None, None, False, False)
  assert ngram.extra_slots(4) == 5  # a chain writes its last token and k drafts
  assert ngram.forwards_in_round((), 4) == ngram.forwards_per_round(4) == 0
  model = sj.ModelDrafter(target, confidence=0.5)
  assert (model.max_len, model.catches_up, model.confidence) == (target.max_len, True, 0.5)


def test_a_wrapper_forwards_and_its_own_fields_win(target, heads):
  hybrid = HybridDrafter(heads)
  assert (hybrid.max_draft, hybrid.confidence, hybrid.vocab_size) == (3, 0.3, VOCAB)
  assert (hybrid.max_len, hybrid.catches_up, hybrid.plain) == (None, False, False)
  adaptive = AdaptiveDrafter(sj.ModelDrafter(target, confidence=0.2), 2, (1.0, 1.4, 1.5),
                             (0.5, 0.5), plain=True)
  for wrapper in (adaptive, jax.tree.unflatten(*reversed(jax.tree.flatten(adaptive)))):
    assert (wrapper.max_draft, wrapper.plain) == (2, True)  # its own fields
    assert (wrapper.max_len, wrapper.catches_up, wrapper.confidence) == (target.max_len, True, 0.2)
    assert wrapper.extra_slots(2) == 3


def test_an_adaptive_round_that_skipped_the_drafter_counts_no_forwards(target):
  adaptive = AdaptiveDrafter(sj.ModelDrafter(target), 2, (1.0, 1.4, 1.5), (0.5, 0.5))
  tokens = jnp.array([[1, 2, 3], [4, 5, 6]], jnp.int32)
  state = adaptive.init(tokens, jnp.array([3, 3], jnp.int32), 16, None)
  state = dataclasses.replace(state, skipped=jnp.array([True, False]))
  np.testing.assert_array_equal(adaptive.forwards_in_round(state, 2), [0, 2])


def test_a_tree_drafter_writes_its_tree(target):
  spec = sj.TreeSpec("static", depth=2, width=2)
  drafter = tree_drafter(target, target, spec)
  assert drafter.extra_slots(spec.depth) == extra_slots(spec) > spec.depth + 1


class _Structural:
  """The protocol's required members only, without subclassing `Drafter`."""

  vocab_size, taps, needs_hidden = None, (), False

  def forwards_per_round(self, num_draft):
    return 0

  def init(self, tokens, lengths, buffer_len, prefill):
    return ()

  def propose(self, state, sequence, lengths, *, num_draft, sampling, seeds):
    raise NotImplementedError

  def observe(self, state, scored, block, emitted, count, lengths):
    return state


def test_a_drafter_without_the_declared_members_is_told_which():
  with pytest.raises(ValueError, match=r"no max_len, max_draft, confidence, catches_up, plain, "
                     r"forwards_in_round, extra_slots \(subclass specjax.drafters.Drafter"):
    as_drafter(_Structural())
