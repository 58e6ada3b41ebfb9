"""Data of LM training: the byte-level BPE tokenizer and cached token streams of the corpus."""

from __future__ import annotations

import os
import pathlib

import numpy as np

from specjax.training import corpus


PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)  # ids 0, 1, 2


def train_tokenizer(documents, vocab_size: int = 8192, path: str | os.PathLike | None = None):
  """Trains a byte-level BPE (`tokenizers`) with `<pad>`=0, `<bos>`=1, `<eos>`=2.

  Encoding with special tokens prepends `<bos>`, as every training document starts with it.

  Args:
    documents: `corpus.Document`s (the training split only).
    vocab_size: total vocabulary including the special tokens.
    path: where to save `tokenizer.json`; None = do not save.

  Returns:
    The `tokenizers.Tokenizer`.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tokenizer.train_from_iterator((d.text for d in documents), trainer, length=len(documents))
  tokenizer.post_processor = processors.TemplateProcessing(
      single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))])
  if path is not None:
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
  return tokenizer

def corpus_stream(tokenizer_path: str | os.PathLike, split: corpus.Split = "train",
                  cache_dir: str | os.PathLike | None = None) -> np.ndarray:
  """The token stream of a corpus split, encoded with a `tokenizer.json` (cached as .npy)."""
  from tokenizers import Tokenizer
  tokenizer = Tokenizer.from_file(str(tokenizer_path))
  documents = corpus.load(split)
  key = corpus.file_list_hash(d.path for d in documents)
  cache = None
  if cache_dir is not None:
    digest = _file_digest(tokenizer_path)
    cache = pathlib.Path(cache_dir) / f"stream-{split}-{key}-{digest}.npy"
    if cache.exists():
      return np.load(cache)

  def encode(texts):
    return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]

  stream = corpus.token_stream(encode, documents, tokenizer.token_to_id(BOS),
                               tokenizer.token_to_id(EOS))
  if cache is not None:
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.save(cache, stream)
  return stream

def _file_digest(path) -> str:
  import hashlib
  return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()[:12]
