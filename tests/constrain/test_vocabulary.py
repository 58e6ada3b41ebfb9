"""Token spellings: the bytes `token_bytes` gives each id concatenate to the encoded text, and
agree with the tokenizer's own decoder, for byte-level BPE (SmolLM2) and SentencePiece (Gemma 3)."""

import pytest

from specjax.constrain import token_bytes

TEXTS = ("café", " naïve 日本語", '{"name": "Zoë", "n": 12}', "emoji 🙂 ok",
         "\ttab\nnew line", "  two spaces")


def test_bytes_of_encoded_text_concatenate_to_the_text(tokenizer):
  spelled = token_bytes(tokenizer)
  assert len(spelled) == tokenizer.vocab_size
  for text in TEXTS:
    ids = tokenizer.encode(text, add_bos=False)
    assert b"".join(spelled[i] for i in ids) == text.encode("utf-8"), text


def test_a_multibyte_character_split_across_tokens(tokenizer):
  spelled = token_bytes(tokenizer)
  ids = tokenizer.encode("🙂")
  assert len(ids) > 1  # the 4-byte emoji is several byte tokens in SmolLM2's vocabulary
  pieces = [spelled[i] for i in ids]
  assert all(len(piece) < 4 for piece in pieces) and b"".join(pieces) == "🙂".encode()


def test_a_space_prefixed_token(tokenizer):
  spelled = token_bytes(tokenizer)
  the = tokenizer.token_to_id("Ġthe")  # byte-level BPE spells the leading space as Ġ
  assert the is not None and spelled[the] == b" the"


def test_every_token_agrees_with_the_tokenizer_decoder(tokenizer):
  """Every id whose bytes are whole UTF-8 decodes, through the tokenizer's own decoder, to the
  same text; special tokens stand for no text."""
  spelled = token_bytes(tokenizer)
  backend = tokenizer.backend
  special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
  checked = 0
  for index, piece in enumerate(spelled):
    if index in special:
      assert piece is None, index
      continue
    try:
      text = piece.decode("utf-8")
    except UnicodeDecodeError:
      continue  # a part of a multi-byte character: the decoder shows a replacement character
    assert backend.decode([index], skip_special_tokens=False) == text, index
    checked += 1
  assert checked > 0.9 * tokenizer.vocab_size


def test_sentencepiece_byte_fallback():
  from specjax.io.gguf import find_packaged_gguf
  from specjax.io.tokenizer import load_tokenizer
  try:
    tok = load_tokenizer(find_packaged_gguf("gemma3-270m"))
  except FileNotFoundError as error:
    pytest.skip(str(error))
  spelled = token_bytes(tok)
  for text in TEXTS:
    ids = tok.encode(text, add_bos=False)
    assert b"".join(spelled[i] for i in ids) == text.encode("utf-8"), text
  newline = tok.token_to_id("<0x0A>")
  if newline is not None:
    assert spelled[newline] == b"\n"
