"""`specjax.precompile`: the call's program compiled ahead and found by the call; nothing run."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.core.tracing import TRACE_COUNTS
from specjax.testing.models import tiny_config

VOCAB = 53


@pytest.fixture(scope="module")
def models():
  target = sj.init_params(tiny_config(vocab_size=VOCAB, embed_dim=24), jax.random.key(3))
  draft = sj.init_params(tiny_config(vocab_size=VOCAB, num_layers=1, embed_dim=16, mlp_dim=32),
                         jax.random.key(4))
  return target, draft


TOKENS = jnp.array([[4, 8, 15, 16, 23], [42, 7, 0, 0, 0]], jnp.int32)
LENGTHS = jnp.array([5, 2], jnp.int32)


class _Compiles(logging.Handler):
  """Collects the names of the programs XLA compiles (`jax_log_compiles`)."""

  def __init__(self):
    super().__init__()
    self.names = []

  def emit(self, record):
    message = record.getMessage()
    if "Finished XLA compilation of" in message:
      self.names.append(message)


@pytest.fixture
def compiles():
  handler = _Compiles()
  logger = logging.getLogger("jax")
  logger.addHandler(handler)
  previous = logger.level
  logger.setLevel(logging.WARNING)
  with jax.log_compiles(True):
    yield handler.names
  logger.removeHandler(handler)
  logger.setLevel(previous)


def _of(names, program):
  return [n for n in names if f"jit({program})" in n]


@pytest.mark.parametrize("which", ["decode", "generate"])
def test_the_call_after_precompile_neither_traces_nor_compiles(models, compiles, which):
  """Precompile traces and compiles the program once; the call with the same shapes and settings
  (another `max_new_tokens` in the same bucket of 64 as well) then does neither, and returns what
  a call that compiled for itself returns. Fails if the call misses the cache (a second
  `jit(_decode)` compilation, a second trace)."""
  target, draft = models
  rng = jax.random.key(0)
  common = dict(lengths=LENGTHS, sampling=sj.Sampling(temperature=0.8, top_k=7), eos_id=3)
  if which == "decode":
    fn, args, program = sj.decode, (target, draft, TOKENS, rng), "_decode"
    common.update(num_draft=3)
  else:
    fn, args, program = sj.generate, (target, TOKENS, rng), "_generate"
  traces = TRACE_COUNTS[which]
  compiled = sj.precompile(fn, *args, max_new_tokens=40, **common)
  assert isinstance(compiled, jax.stages.Compiled)
  assert TRACE_COUNTS[which] == traces + 1
  assert len(_of(compiles, program)) == 1
  out = fn(*args, max_new_tokens=33, **common)
  assert TRACE_COUNTS[which] == traces + 1
  assert len(_of(compiles, program)) == 1, compiles
  # The same tokens as a fresh program's (the cache dropped, so this call compiles its own).
  jax.clear_caches()
  fresh = fn(*args, max_new_tokens=33, **common)
  assert len(_of(compiles, program)) == 2
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(fresh.tokens))
  np.testing.assert_array_equal(np.asarray(out.num_tokens), np.asarray(fresh.num_tokens))


def test_precompile_of_a_plain_adaptive_decode_compiles_generate(models, compiles):
  """Where the drafter plans plain steps `decode` runs `generate`'s program: precompile compiles
  that one, and the call then neither traces nor compiles."""
  from specjax.drafters.adaptive.drafter import AdaptiveDrafter
  target, draft = models
  plain = AdaptiveDrafter(sj.ModelDrafter(draft), 2, (1.0, 1.4, 1.5), (0.5, 0.5), plain=True)
  common = dict(lengths=LENGTHS, sampling=sj.Sampling(temperature=0.8), max_new_tokens=9)
  before = dict(TRACE_COUNTS)
  compiled = sj.precompile(sj.decode, target, plain, TOKENS, jax.random.key(0), **common)
  assert isinstance(compiled, jax.stages.Compiled)
  assert TRACE_COUNTS["generate"] == before["generate"] + 1
  assert TRACE_COUNTS["decode"] == before["decode"]
  out = sj.decode(target, plain, TOKENS, jax.random.key(0), **common)
  assert TRACE_COUNTS["generate"] == before["generate"] + 1
  assert len(_of(compiles, "_generate")) == 1 and not _of(compiles, "_decode")
  ref = sj.generate(target, TOKENS, jax.random.key(0), **common)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))


def test_precompile_checks_the_arguments_first(models, compiles):
  """Bad input is the call's own clear error, raised before anything is traced or compiled."""
  target, draft = models
  traces = TRACE_COUNTS["decode"]
  bad = TOKENS.at[0, 0].set(VOCAB + 5)
  with pytest.raises(ValueError, match="ids outside"):
    sj.precompile(sj.decode, target, draft, bad, jax.random.key(0), lengths=LENGTHS)
  with pytest.raises(ValueError, match="max_new_tokens"):
    sj.precompile(sj.generate, target, TOKENS, jax.random.key(0), max_new_tokens=0)
  assert TRACE_COUNTS["decode"] == traces
  assert not _of(compiles, "_decode") and not _of(compiles, "_generate")


def test_precompile_takes_only_decode_and_generate_outside_jit(models):
  target, _ = models
  with pytest.raises(TypeError, match="specjax.decode or specjax.generate"):
    sj.precompile(sj.decode_stream, target, target, TOKENS, jax.random.key(0))

  @jax.jit
  def inside(tokens):
    return sj.precompile(sj.generate, target, tokens, jax.random.key(0), max_new_tokens=4)

  with pytest.raises(ValueError, match="outside jax.jit"):
    inside(TOKENS)
  # The flag does not leak: a plain call afterwards runs.
  out = sj.generate(target, TOKENS, jax.random.key(0), max_new_tokens=4)
  assert out.tokens.shape == (2, 4)
