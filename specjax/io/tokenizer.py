"""Tokenizers: a thin, batch-friendly wrapper around a Hugging Face `tokenizers` backend, with the
model's chat template.

`load_tokenizer(path)` accepts a directory (as written by `save_pretrained`, or a converted specjax
checkpoint), a tokenizer.json file, or a GGUF file (the vocabulary is rebuilt from its metadata,
`specjax.io.gguf_vocab`). Special ids are taken, in order of precedence, from
generation_config.json, tokenizer_config.json, and the special tokens of tokenizer.json; for a
GGUF, from `tokenizer.ggml.*`. `eos_ids` includes the model's end-of-turn token.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Iterable, Sequence

import numpy as np

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")

# Conventional names of special tokens, tried when no config file names them.
_BOS_NAMES = ("<|begin_of_text|>", "<bos>", "<s>", "<|startoftext|>", "<|im_start|>")
_EOS_NAMES = ("<|end_of_text|>", "<eos>", "</s>", "<|endoftext|>", "<|im_end|>")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")


def _read_json(path: pathlib.Path) -> dict:
  if not path.is_file():
    return {}
  try:
    data = json.loads(path.read_text())
  except json.JSONDecodeError as error:
    raise ValueError(f"corrupt {path}: {error}") from None
  return data if isinstance(data, dict) else {}


def _token_content(value) -> str | None:
  if isinstance(value, dict):
    return value.get("content")
  return value if isinstance(value, str) else None


class Tokenizer:
  """Text <-> token ids, with batch encoding into a right-padded `[B, T]` int32 array.

  Attributes:
    vocab_size: number of ids, added tokens included.
    bos_id: beginning-of-sequence id, or None.
    eos_id: end-of-sequence id (the first, when several stop generation), or None.
    eos_ids: every id that ends generation.
    pad_id: the id used for right padding (the pad token, else `eos_id`, else 0).
    add_bos: whether `encode`/`encode_batch` prepend `bos_id` by default (what the tokenizer's
      own post-processing does).
    chat_template: the model's Jinja2 chat template, or None.
  """

  def __init__(self, tokenizer, *, bos_id: int | None = None, eos_id: int | None = None,
               pad_id: int | None = None, eos_ids: Sequence[int] | None = None,
               add_bos: bool | None = None, files: dict[str, pathlib.Path] | None = None,
               chat_template: str | None = None):
    self._tokenizer = tokenizer
    self.chat_template = chat_template
    self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
    self.bos_id = bos_id
    self.eos_ids: tuple[int, ...] = tuple(eos_ids) if eos_ids else (
        () if eos_id is None else (eos_id,))
    self.eos_id = eos_id if eos_id is not None else (self.eos_ids[0] if self.eos_ids else None)
    self.pad_id: int = pad_id if pad_id is not None else (
        self.eos_id if self.eos_id is not None else 0)
    if add_bos is None:
      add_bos = bos_id is not None and self._post_processing_adds_bos()
    self.add_bos: bool = bool(add_bos)
    self._files = dict(files or {})
    for name, value in (("bos_id", self.bos_id), ("eos_id", self.eos_id), ("pad_id", self.pad_id)):
      if value is not None and not 0 <= value < self.vocab_size:
        raise ValueError(f"{name} {value} is outside the vocabulary (size {self.vocab_size})")

  @property
  def backend(self):
    """The underlying `tokenizers.Tokenizer`."""
    return self._tokenizer

  def _post_processing_adds_bos(self) -> bool:
    ids = self._tokenizer.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == self.bos_id

  def _with_bos(self, ids: list[int], add_bos: bool | None) -> list[int]:
    add = self.add_bos if add_bos is None else add_bos
    if add:
      if self.bos_id is None:
        raise ValueError("add_bos=True but the tokenizer has no BOS token")
      return [self.bos_id] + ids
    return ids

  def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
    """Token ids of `text` (no EOS; BOS when `add_bos`, default `self.add_bos`)."""
    if not isinstance(text, str):
      raise ValueError(f"encode expects a str, got {type(text).__name__}")
    return self._with_bos(self._tokenizer.encode(text, add_special_tokens=False).ids, add_bos)

  def encode_batch(self, texts: Iterable[str], add_bos: bool | None = None,
                   pad_to_multiple_of: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Encodes several texts into one right-padded batch.

    Args:
      texts: the strings.
      add_bos: prepend `bos_id`; None = `self.add_bos`.
      pad_to_multiple_of: round the width up to a multiple of this (fewer compiled shapes).

    Returns:
      `(ids [B, T] int32 padded with pad_id, lengths [B] int32)`, `T` = the longest row rounded up.
    """
    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts:
      raise ValueError("encode_batch needs at least one text")
    if not all(isinstance(t, str) for t in texts):
      raise ValueError("encode_batch expects strings")
    if pad_to_multiple_of < 1:
      raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    rows = [self._with_bos(e.ids, add_bos)
            for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]
    lengths = np.asarray([len(r) for r in rows], np.int32)
    width = -(-int(lengths.max()) // pad_to_multiple_of) * pad_to_multiple_of
    ids = np.full((len(rows), width), self.pad_id, np.int32)
    for i, row in enumerate(rows):
      ids[i, :len(row)] = row
    return ids, lengths

  def decode(self, ids, skip_special_tokens: bool = True) -> str | list[str]:
    """Text of token ids: a list, NumPy or JAX array; `[T]` gives a str, `[B, T]` a list of str."""
    array = np.asarray(ids)
    if array.ndim == 0:
      array = array[None]
    if array.ndim > 2:
      raise ValueError(f"decode expects [T] or [B, T] ids, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
      raise ValueError(f"decode expects integer ids, got {array.dtype}")
    if array.ndim == 2:
      return self._tokenizer.decode_batch([row.tolist() for row in array],
                                          skip_special_tokens=skip_special_tokens)
    return self._tokenizer.decode(array.tolist(), skip_special_tokens=skip_special_tokens)

  def token_to_id(self, token: str) -> int | None:
    return self._tokenizer.token_to_id(token)

  def special_tokens(self) -> dict[str, str | None]:
    """`{"bos_token": ..., "eos_token": ..., "pad_token": ...}` as strings (chat templates)."""
    text = lambda i: None if i is None else self._tokenizer.id_to_token(i)
    return {"bos_token": text(self.bos_id), "eos_token": text(self.eos_id),
            "pad_token": text(self.pad_id)}

  def render_chat(self, messages, add_generation_prompt: bool = True, *,
                  chat_template: str | None = None, **variables) -> str:
    """The conversation as text under the model's chat template (`specjax.io.chat.render`).

    Args:
      messages: [{"role": "system" | "user" | "assistant", "content": str}, ...].
      add_generation_prompt: end with the header that opens the assistant's reply.
      chat_template: a template to use instead of the tokenizer's own.
      **variables: extra template variables.

    Raises:
      ValueError: no chat template, malformed messages, or a template error.
    """
    from specjax.io import chat
    template = chat_template or self.chat_template
    if not template:
      raise ValueError("this tokenizer has no chat template (none in the GGUF metadata, "
                       "tokenizer_config.json or chat_template.jinja); pass chat_template=, e.g. "
                       "specjax.io.chat.builtin_template('gemma') or ('chatml')")
    return chat.render(template, messages, add_generation_prompt=add_generation_prompt,
                       special_tokens=self.special_tokens(), **variables)

  def apply_chat_template(self, messages, add_generation_prompt: bool = True, *,
                          chat_template: str | None = None, **variables) -> list[int]:
    """Token ids of a conversation, as `transformers`' `apply_chat_template(..., tokenize=True)`:
    the rendered text encoded without an extra BOS (templates write their own).

    Args:
      messages: [{"role": "system" | "user" | "assistant", "content": str}, ...].
      add_generation_prompt: end with the header that opens the assistant's reply.
      chat_template: a template to use instead of the tokenizer's own.
      **variables: extra template variables.
    """
    text = self.render_chat(messages, add_generation_prompt, chat_template=chat_template,
                            **variables)
    return self.encode(text, add_bos=False)

  def save(self, directory: str | os.PathLike) -> pathlib.Path:
    """Writes tokenizer.json and any config files it was loaded from into `directory`."""
    import shutil
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    self._tokenizer.save(str(directory / "tokenizer.json"))
    for name, source in self._files.items():
      if name != "tokenizer.json" and source.is_file():
        shutil.copyfile(source, directory / name)
    if "tokenizer_config.json" not in self._files:  # built from a GGUF: record what it held
      config = {**self.special_tokens(), "add_bos_token": self.add_bos}
      if self.chat_template:
        config["chat_template"] = self.chat_template
      (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
      generation = {"bos_token_id": self.bos_id, "eos_token_id": list(self.eos_ids),
                    "pad_token_id": self.pad_id}
      (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return directory

  def __repr__(self):
    return (f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, pad_id={self.pad_id}, add_bos={self.add_bos})")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
  """Loads a tokenizer.json (the file, or a directory holding it) and its special ids.

  Args:
    path: a directory with tokenizer.json (and optionally tokenizer_config.json,
      special_tokens_map.json, generation_config.json, chat_template.jinja), a tokenizer.json
      file, or a `.gguf` file.

  Returns:
    A `specjax.io.Tokenizer`.

  Raises:
    FileNotFoundError: no tokenizer.json at `path`.
    ValueError: a corrupt file.
  """
  from tokenizers import Tokenizer as Backend

  path = pathlib.Path(path)
  if path.is_file() and _is_gguf(path):
    return _load_gguf(path)
  if path.is_dir():
    directory, file = path, path / "tokenizer.json"
  else:
    directory, file = path.parent, path
  if not file.is_file():
    hint = (" (only a sentencepiece tokenizer.model: convert it with transformers' "
            "PreTrainedTokenizerFast and save_pretrained)"
            if (directory / "tokenizer.model").is_file() else "")
    raise FileNotFoundError(f"no tokenizer.json at {path}{hint}")
  try:
    backend = Backend.from_file(str(file))
  except Exception as error:  # tokenizers raises a bare Exception on malformed JSON.
    raise ValueError(f"corrupt tokenizer file {file}: {error}") from None

  files = {name: directory / name for name in TOKENIZER_FILES if (directory / name).is_file()}
  files["tokenizer.json"] = file
  generation = _read_json(directory / "generation_config.json")
  config = {**_read_json(directory / "special_tokens_map.json"),
            **_read_json(directory / "tokenizer_config.json")}
  special = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}

  def from_token(key: str, names: Sequence[str]) -> int | None:
    content = _token_content(config.get(key))
    if content is not None:
      token_id = backend.token_to_id(content)
      if token_id is not None:
        return token_id
    for name in names:
      if name in special:
        return special[name]
    return None

  def as_ids(value) -> list[int]:
    if value is None:
      return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]

  bos = as_ids(generation.get("bos_token_id")) or as_ids(from_token("bos_token", _BOS_NAMES))
  eos_ids = as_ids(generation.get("eos_token_id")) or as_ids(from_token("eos_token", _EOS_NAMES))
  pad = as_ids(generation.get("pad_token_id")) or as_ids(from_token("pad_token", _PAD_NAMES))
  add_bos = config.get("add_bos_token")
  from specjax.io.chat import template_from_directory
  return Tokenizer(backend, bos_id=bos[0] if bos else None, eos_ids=eos_ids,
                   pad_id=pad[0] if pad else None,
                   add_bos=add_bos if isinstance(add_bos, bool) else None, files=files,
                   chat_template=template_from_directory(directory, config))


def _is_gguf(path: pathlib.Path) -> bool:
  with open(path, "rb") as stream:
    return stream.read(4) == b"GGUF"


def _load_gguf(path: pathlib.Path) -> Tokenizer:
  from specjax.io.gguf_file import GGUFFile
  from specjax.io.gguf_vocab import tokenizer_from_gguf

  backend, special = tokenizer_from_gguf(GGUFFile(path).metadata, str(path))
  return Tokenizer(backend, **special)
