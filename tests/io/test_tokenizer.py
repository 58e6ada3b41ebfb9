"""`load_tokenizer`: a byte-level BPE trained here on stdlib sources, raw and as saved by
`transformers`; batch encoding, decoding and special ids."""

import json
import pathlib
import shutil
import sysconfig

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.io import load_tokenizer

SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2
TEXTS = ["def fib(n):\n    return n", "import os\n", "x", "class Tokenizer(object):\n  pass  # é ✓"]


def _training_files() -> list[str]:
  stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
  return [str(stdlib / name) for name in ("textwrap.py", "bisect.py", "heapq.py", "shlex.py")]


@pytest.fixture(name="trained", scope="module")
def _trained(tmp_path_factory) -> pathlib.Path:
  """A directory holding only a tokenizer.json that adds <s> in post-processing."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

  backend = Tokenizer(models.BPE())
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  backend.train(_training_files(), trainer)
  backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
      ("<s>", 1)])
  directory = tmp_path_factory.mktemp("trained")
  backend.save(str(directory / "tokenizer.json"))
  return directory


def test_special_ids_from_tokenizer_json(trained):
  tok = load_tokenizer(trained)
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert tok.eos_ids == (2,)
  assert tok.vocab_size == 600
  assert tok.add_bos  # the post-processor prepends <s>


def test_file_or_directory(trained):
  a = load_tokenizer(trained)
  b = load_tokenizer(trained / "tokenizer.json")
  assert a.encode(TEXTS[0]) == b.encode(TEXTS[0])


def test_encode_decode_round_trip(trained):
  tok = load_tokenizer(trained)
  for text in TEXTS:
    ids = tok.encode(text, add_bos=False)
    assert all(isinstance(i, int) for i in ids)
    assert 1 not in ids and 2 not in ids
    assert tok.decode(ids) == text
    assert tok.encode(text) == [1] + ids  # default add_bos follows the post-processor
    assert tok.decode(tok.encode(text)) == text  # <s> is skipped
  # BPE merges learnt from the training files: common code takes fewer tokens than half its bytes.
  common = "    def __init__(self"
  assert len(tok.encode(common, add_bos=False)) < len(common) // 2


def test_encode_batch(trained):
  tok = load_tokenizer(trained)
  ids, lengths = tok.encode_batch(TEXTS, add_bos=True)
  assert ids.dtype == np.int32 and lengths.dtype == np.int32
  assert ids.shape == (len(TEXTS), lengths.max())
  for row, text in enumerate(TEXTS):
    expected = tok.encode(text, add_bos=True)
    assert lengths[row] == len(expected)
    assert ids[row, :lengths[row]].tolist() == expected
    assert (ids[row, lengths[row]:] == tok.pad_id).all()
  no_bos, no_bos_lengths = tok.encode_batch(TEXTS, add_bos=False)
  np.testing.assert_array_equal(no_bos_lengths, lengths - 1)
  np.testing.assert_array_equal(no_bos[0, :no_bos_lengths[0]], ids[0, 1:lengths[0]])
  wide, _ = tok.encode_batch(TEXTS, pad_to_multiple_of=16)
  assert wide.shape[1] % 16 == 0 and wide.shape[1] >= ids.shape[1]


def test_decode_arrays_and_special_tokens(trained):
  tok = load_tokenizer(trained)
  ids, lengths = tok.encode_batch(TEXTS[:2])
  # NumPy rows, JAX rows and a whole padded [B, T] batch (pad and <s> are special: skipped).
  assert tok.decode(ids[1, :lengths[1]]) == TEXTS[1]
  assert tok.decode(jnp.asarray(ids[0, :lengths[0]])) == TEXTS[0]
  assert tok.decode(jnp.asarray(ids)) == TEXTS[:2]
  with_eos = tok.encode("x = 1", add_bos=True) + [tok.eos_id]
  assert tok.decode(with_eos) == "x = 1"
  assert tok.decode(with_eos, skip_special_tokens=False) == "<s>x = 1</s>"
  assert tok.decode(np.int32(with_eos[1])) == tok.decode(with_eos[1:2])


def test_errors(trained, tmp_path):
  tok = load_tokenizer(trained)
  with pytest.raises(ValueError, match="at least one"):
    tok.encode_batch([])
  with pytest.raises(ValueError, match="integer ids"):
    tok.decode(np.asarray([1.5, 2.0]))
  with pytest.raises(ValueError, match="expects a str"):
    tok.encode(123)
  with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
    load_tokenizer(tmp_path)
  (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
  with pytest.raises(ValueError, match="corrupt tokenizer file"):
    load_tokenizer(tmp_path)


def test_config_files_set_special_ids(trained, tmp_path):
  shutil.copy(trained / "tokenizer.json", tmp_path / "tokenizer.json")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": {"content": "</s>"}, "eos_token": "<s>", "pad_token": None,
       "add_bos_token": False}))
  tok = load_tokenizer(tmp_path)
  assert (tok.bos_id, tok.eos_id, tok.add_bos) == (2, 1, False)
  assert tok.pad_id == 0  # named <pad> in tokenizer.json
  # generation_config.json wins for ids; a list of stop ids is kept whole.
  (tmp_path / "generation_config.json").write_text(json.dumps(
      {"bos_token_id": 1, "eos_token_id": [2, 0], "pad_token_id": 2}))
  tok = load_tokenizer(tmp_path)
  assert (tok.bos_id, tok.eos_id, tok.eos_ids, tok.pad_id) == (1, 2, (2, 0), 2)
  assert tok.encode("x") == tok.encode("x", add_bos=False)  # add_bos_token: false


def test_save_keeps_config_files(trained, tmp_path):
  shutil.copy(trained / "tokenizer.json", tmp_path / "tokenizer.json")
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
  load_tokenizer(tmp_path).save(tmp_path / "copy")
  copy = load_tokenizer(tmp_path / "copy")
  assert copy.eos_ids == (2, 1)
  assert copy.encode(TEXTS[3]) == load_tokenizer(tmp_path).encode(TEXTS[3])


def test_matches_transformers_saved_tokenizer(trained, tmp_path):
  transformers = pytest.importorskip("transformers", reason="the peer implementation (install "
                                     "the 'peer' extra: pip install -e .[peer])")
  from tokenizers import Tokenizer as Backend

  hf = transformers.PreTrainedTokenizerFast(
      tokenizer_object=Backend.from_file(str(trained / "tokenizer.json")),
      bos_token="<s>", eos_token="</s>", pad_token="<pad>", padding_side="right")
  hf.save_pretrained(tmp_path)
  assert (tmp_path / "tokenizer_config.json").is_file()
  tok = load_tokenizer(tmp_path)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (hf.bos_token_id, hf.eos_token_id,
                                                   hf.pad_token_id)
  assert tok.vocab_size == len(hf)
  batch = hf(TEXTS, padding=True, return_tensors="np")
  ids, lengths = tok.encode_batch(TEXTS)  # default add_bos: as transformers does
  np.testing.assert_array_equal(ids, batch["input_ids"])
  np.testing.assert_array_equal(lengths, batch["attention_mask"].sum(axis=1))
  for row, text in enumerate(TEXTS):
    assert tok.encode(text) == hf(text)["input_ids"]
    assert tok.decode(ids[row]) == hf.decode(batch["input_ids"][row], skip_special_tokens=True)
    assert (tok.decode(ids[row], skip_special_tokens=False)
            == hf.decode(batch["input_ids"][row], skip_special_tokens=False))


def test_gguf_tokenizer_saves_as_a_directory(tmp_path):
  """A tokenizer built from GGUF metadata, saved and reloaded from tokenizer.json + configs:
  same ids, special ids, end-of-turn ids and chat template."""
  from specjax.io.gguf import find_packaged_gguf
  try:
    path = find_packaged_gguf("smollm2")
  except FileNotFoundError as error:
    pytest.skip(str(error))
  built = load_tokenizer(path)
  built.save(tmp_path)
  again = load_tokenizer(tmp_path)
  for text in ("Hello  world\n\n", "<|im_start|>user\nçà 123<|im_end|>", "def f():\n\treturn 1"):
    assert again.encode(text) == built.encode(text)
  assert (again.bos_id, again.eos_ids, again.pad_id, again.add_bos) == (
      built.bos_id, built.eos_ids, built.pad_id, built.add_bos) == (1, (2,), 2, False)
  assert again.chat_template == built.chat_template and "<|im_start|>" in built.chat_template
