"""A `tokenizers.Tokenizer` built from the `tokenizer.ggml.*` metadata of a GGUF file.

Two vocabularies are supported:

* `gpt2` (byte-level BPE: SmolLM, Llama 3, Qwen2/3): the file's tokens and merges, split first by the
  pre-tokenizer regex its `tokenizer.ggml.pre` names, then mapped to the byte alphabet.
* `llama` for Gemma files (SentencePiece BPE with byte fallback): the file stores no merges, so they
  are rebuilt from the vocabulary: every split of a token into two tokens, ranked by the position
  of the merged token in the file (Gemma's scores do not follow its merge order; its token order
  does), longer left pieces first. Spaces become U+2581 before the model sees them, and the file's
  tokens made of real spaces are respelled with U+2581. This reproduces transformers' GGUF
  tokenizer id for id.

Control tokens (`token_type` 3) are added as special tokens and user-defined ones (4) as plain
added tokens, so both are matched whole in text.
"""

from __future__ import annotations

CONTROL, USER_DEFINED = 3, 4
_SPACE = "\u2581"

# tokenizer.ggml.pre -> split regex applied before the byte-level mapping; absent = GPT-2's own
# regex inside the ByteLevel pre-tokenizer.
_CL100K = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama-bpe": _CL100K, "llama3": _CL100K, "llama-v3": _CL100K, "smaug-bpe": _CL100K,
           "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2}
_GPT2_PRE = (None, "default", "gpt2", "smollm", "gpt-2")

# Names of end-of-turn tokens that stop a chat reply, when the file marks them as control tokens.
END_OF_TURN_NAMES = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>")


def byte_alphabet() -> dict[int, str]:
  """GPT-2's reversible byte -> printable character map (printable Latin-1 bytes map to
  themselves, the other 68 bytes to U+0100 onwards, in byte order)."""
  printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
  mapping = {b: chr(b) for b in printable}
  extra = 0
  for b in range(256):
    if b not in mapping:
      mapping[b] = chr(256 + extra)
      extra += 1
  return mapping


def _added_tokens(backend, tokens, types, keep):
  from tokenizers import AddedToken

  special = [AddedToken(t, normalized=False, special=True)
             for t, kind in zip(tokens, types) if kind == CONTROL and keep(t)]
  plain = [AddedToken(t, normalized=False, special=False)
           for t, kind in zip(tokens, types) if kind == USER_DEFINED and keep(t)]
  if special:
    backend.add_special_tokens(special)
  if plain:
    backend.add_tokens(plain)


def _byte_level(metadata: dict, tokens: list[str], types) -> "Tokenizer":
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

  alphabet = byte_alphabet()
  letters = set(alphabet.values())
  spelled = [t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8"))
             for t in tokens]
  merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
  backend = Tokenizer(models.BPE({t: i for i, t in enumerate(spelled)}, merges, fuse_unk=False,
                                 byte_fallback=False))
  pre = metadata.get("tokenizer.ggml.pre")
  if pre in _SPLITS:
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  elif pre in _GPT2_PRE:
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  else:
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: "
                     f"{', '.join(sorted(set(_SPLITS) | {'gpt2', 'smollm', 'default'}))})")
  backend.decoder = decoders.ByteLevel()
  _added_tokens(backend, tokens, types, keep=lambda t: set(t) <= letters)
  return backend


def _sentencepiece_gemma(metadata: dict, tokens: list[str], types) -> "Tokenizer":
  from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

  spelled = [_SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
  vocab = {t: i for i, t in enumerate(spelled)}
  merges = []
  for token in spelled:  # file order = merge priority
    for cut in range(len(token) - 1, 0, -1):  # longer left piece first
      left, right = token[:cut], token[cut:]
      if left in vocab and right in vocab:
        merges.append((left, right))
  unk = metadata.get("tokenizer.ggml.unknown_token_id")
  backend = Tokenizer(models.BPE(vocab, merges, unk_token=None if unk is None else spelled[unk],
                                 fuse_unk=True, byte_fallback=True))
  backend.normalizer = normalizers.Replace(" ", _SPACE)
  backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
  backend.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(),
                                       decoders.Fuse()])
  _added_tokens(backend, spelled, types, keep=lambda t: t in vocab)
  return backend


def tokenizer_from_gguf(metadata: dict, where: str = "GGUF file"):
  """`(tokenizers.Tokenizer, special)`: the backend and a dict of special ids
  (`bos_id`, `eos_id`, `pad_id`, `eos_ids`, `add_bos`, `chat_template`).

  Raises:
    ValueError: no vocabulary in the file, or a tokenizer model/pre-tokenizer not supported.
  """
  kind = metadata.get("tokenizer.ggml.model")
  tokens = metadata.get("tokenizer.ggml.tokens")
  if kind is None or tokens is None:
    raise ValueError(f"{where} has no tokenizer (tokenizer.ggml.model/tokens are missing)")
  tokens = list(tokens)
  types = list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
  arch = metadata.get("general.architecture", "")
  if kind == "gpt2":
    backend = _byte_level(metadata, tokens, types)
  elif kind == "llama" and arch.startswith("gemma"):
    backend = _sentencepiece_gemma(metadata, tokens, types)
  else:
    raise ValueError(f"{where}: GGUF tokenizer model {kind!r} for architecture {arch!r} is not "
                     "supported (byte-level BPE 'gpt2', or Gemma's sentencepiece 'llama'); load "
                     "a Hugging Face tokenizer directory instead")

  def token_id(key):
    value = metadata.get(f"tokenizer.ggml.{key}")
    return None if value is None else int(value)

  eos = token_id("eos_token_id")
  eos_ids = [eos] if eos is not None else []
  for key in ("eot_token_id", "eom_token_id"):
    if token_id(key) is not None:
      eos_ids.append(token_id(key))
  for name in END_OF_TURN_NAMES:
    index = backend.token_to_id(name)
    if index is not None and types[index] == CONTROL:
      eos_ids.append(index)
  add_bos = metadata.get("tokenizer.ggml.add_bos_token")
  special = dict(bos_id=token_id("bos_token_id"), eos_id=eos, pad_id=token_id("padding_token_id"),
                 eos_ids=list(dict.fromkeys(eos_ids)),
                 add_bos=bool(add_bos) if add_bos is not None else kind == "llama",
                 chat_template=metadata.get("tokenizer.chat_template"))
  return backend, special
