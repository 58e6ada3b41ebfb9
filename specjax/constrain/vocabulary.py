"""The bytes each token id stands for, read from a specjax `Tokenizer`.

A grammar matches text, so the automaton needs every token's exact bytes, not its display string.
Two spellings cover the tokenizers specjax loads:

* Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2): a token string spells each byte as one printable
  character (`bytes_to_unicode`: `Ġ` is the space 0x20, `Ċ` the newline 0x0A, and a multi-byte
  UTF-8 character such as `é` is two characters, `Ã©`, possibly split across two tokens).
* SentencePiece with byte fallback (Llama 2, Mistral, Gemma): `▁` is a space and `<0x0A>` is the
  single byte 0x0A; other characters are their UTF-8 encoding.

Added tokens are spelt as their content, through the same rule (the tokenizer's decoder runs over
them too), except the special ones (`<|im_end|>`, `<|endoftext|>`,
...), which stand for no text: a grammar never allows them (the stop ids are handled apart).
"""

from __future__ import annotations

import functools
import json
import re

from specjax.io.gguf_vocab import byte_alphabet

__all__ = ["token_bytes"]

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
  """The inverse of byte-level BPE's byte -> printable character map."""
  return {char: byte for byte, char in byte_alphabet().items()}


def _decoder_kind(spec: dict) -> str:
  """"byte_level" or "sentencepiece" from a `tokenizers` JSON decoder spec."""
  decoder = spec.get("decoder") or {}
  parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
  kinds = {part.get("type") for part in parts}
  if "ByteLevel" in kinds:
    return "byte_level"
  replaces_metaspace = any(part.get("type") == "Replace" and "▁" in json.dumps(part)
                           for part in parts)
  if "Metaspace" in kinds or "ByteFallback" in kinds or replaces_metaspace:
    return "sentencepiece"
  raise ValueError(f"constrained decoding does not know how this tokenizer spells bytes "
                   f"(decoder {sorted(k for k in kinds if k)}); byte-level BPE and SentencePiece "
                   f"tokenizers are supported")


def _byte_level(token: str) -> bytes | None:
  table = _unicode_to_byte()
  if any(char not in table for char in token):
    return None  # not a byte-level spelling: a token no text encodes to
  return bytes(table[char] for char in token)


def _sentencepiece(token: str) -> bytes:
  match = _BYTE_TOKEN.fullmatch(token)
  if match:
    return bytes([int(match.group(1), 16)])
  return token.replace("▁", " ").encode("utf-8")


def token_bytes(tokenizer) -> list[bytes | None]:
  """The bytes of every token id, `None` for ids that stand for no text.

  Args:
    tokenizer: a `specjax.io.Tokenizer` (anything with `.backend`, a `tokenizers.Tokenizer`, and
      `.vocab_size`).

  Returns:
    A list of length `tokenizer.vocab_size`: `token_bytes(tok)[i]` is what id `i` adds to the
    text, byte for byte (so the bytes of `tok.encode(text)` concatenate to `text.encode()`);
    `None` for special tokens, empty tokens and ids with no token.

  Raises:
    ValueError: a tokenizer whose byte spelling is neither byte-level BPE nor SentencePiece.
  """
  backend = tokenizer.backend
  spell = (_byte_level if _decoder_kind(json.loads(backend.to_str())) == "byte_level"
           else _sentencepiece)
  out: list[bytes | None] = [None] * tokenizer.vocab_size
  for token, index in backend.get_vocab(with_added_tokens=False).items():
    if 0 <= index < len(out):
      out[index] = spell(token)
  for index, added in backend.get_added_tokens_decoder().items():
    if 0 <= index < len(out):
      # The decoder runs over added tokens too (Gemma's added `▁▁` is two spaces).
      out[index] = None if added.special else (spell(added.content)
                                               or added.content.encode("utf-8"))
  return [value if value else None for value in out]
