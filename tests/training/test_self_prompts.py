"""Self-written training prompts (`specjax.training.self_prompts`): the user turn's prefix under
the chat template, what the target writes being exactly what `specjax.generate` continues the
prefix with, reproducibility per batch, and the conversation shapes per kind (tiny model, real
tokenizer library)."""

import jax
import numpy as np
import pytest

import specjax as sj
from specjax.io import load_tokenizer
from specjax.testing.models import tiny_config
from specjax.core.sampling import GREEDY, Sampling
from specjax.training import self_prompts

TEMPLATE = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nBe kind.<|im_end|>\\n' }}"
            "{% endif %}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content']"
            " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def pair(chatml_tokenizer_dir):
  """A tiny random target and a byte-level BPE tokenizer with a ChatML template."""
  directory = chatml_tokenizer_dir(
      TEMPLATE, "Translate this text. Summarize the article, step by step.")
  tokenizer = load_tokenizer(directory)
  config = tiny_config(vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id,
                       eos_id=tokenizer.eos_id, max_len=1024)
  target = sj.init_params(config, jax.random.key(0))
  # Make the end-of-turn token likely, so that some requests end inside their budget.
  lm_head = target.params["lm_head"].at[:, tokenizer.eos_id].add(
      0.5 * np.abs(np.asarray(target.params["lm_head"])).max())
  return sj.Model(dict(target.params, lm_head=lm_head), config), tokenizer


def test_user_turn_prefix_is_where_the_content_goes(pair):
  _, tokenizer = pair
  history = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
  prefix = self_prompts.user_turn_prefix(tokenizer, history)
  full = tokenizer.render_chat(history + [{"role": "user", "content": "Translate this."}],
                               add_generation_prompt=False)
  assert full.startswith(prefix) and full[len(prefix):].startswith("Translate this.")
  assert prefix.endswith("<|im_start|>user\n") and "Be kind." in prefix


def test_requests_are_the_targets_own_continuations(pair):
  """Greedy: each request is opener + exactly what `specjax.generate` writes after the prefix,
  one row at a time (batching, padding and the cut at the end-of-turn token change nothing)."""
  target, tokenizer = pair
  convs = self_prompts.SelfWrittenConversations(target, tokenizer, 16, batch_size=16, seed=3,
                                                sampling=GREEDY, max_request_tokens=12,
                                                retries=0)
  batch = convs.batch(0)
  rng = np.random.default_rng([3, 0])
  checked = 0
  for row, conversation in enumerate(batch[:7]):  # the single-turn kinds
    kind = self_prompts.KINDS[row % len(self_prompts.KINDS)]
    choices = self_prompts.OPENERS[kind]
    opener = choices[rng.integers(len(choices))].format(
        lang=self_prompts.LANGUAGES[rng.integers(6)])
    budget = 12 * (3 if kind in self_prompts.LONG_KINDS else 1)
    ids = tokenizer.encode(self_prompts.user_turn_prefix(tokenizer, []) + opener, add_bos=False)
    out = sj.generate(target, np.asarray([ids], np.int32), jax.random.key(0),
                      max_new_tokens=budget, eos_id=tuple(tokenizer.eos_ids))
    new = [int(t) for t in np.asarray(out.tokens)[0, :int(out.num_tokens[0])]]
    ended = bool(new) and new[-1] in tokenizer.eos_ids
    text = tokenizer.decode(new[:-1] if ended else new)
    assert len(conversation) == 1 and conversation[0]["role"] == "user"
    if text.strip() and (ended or kind in self_prompts.LONG_KINDS):
      assert conversation[0]["content"] == (opener + text).strip()
      checked += 1
    else:  # an empty request, or a short one that did not end: the opener stands alone
      assert conversation[0]["content"] == (opener.strip() or "Hello!")
  assert checked >= 3


def test_batches_depend_only_on_seed_and_index(pair):
  target, tokenizer = pair
  sampling = Sampling(temperature=1.0)
  a = self_prompts.SelfWrittenConversations(target, tokenizer, 24, batch_size=8, seed=1,
                                            sampling=sampling, max_request_tokens=8,
                                            max_reply_tokens=8)
  b = self_prompts.SelfWrittenConversations(target, tokenizer, 24, batch_size=8, seed=1,
                                            sampling=sampling, max_request_tokens=8,
                                            max_reply_tokens=8)
  c = self_prompts.SelfWrittenConversations(target, tokenizer, 24, batch_size=8, seed=2,
                                            sampling=sampling, max_request_tokens=8,
                                            max_reply_tokens=8)
  second = a[8:16]
  assert b[0:8] and b[8:16] == second  # batch 0 first or not: the same batch 1
  assert c[8:16] != second
  assert len(a) == 24 and a[9] == second[1] and a[-1] == a[16:24][-1]
  for i, conversation in enumerate(second):
    kind = self_prompts.KINDS[(8 + i) % len(self_prompts.KINDS)]
    roles = [m["role"] for m in conversation]
    assert roles == (["user", "assistant", "user"] if kind == "multi_turn" else ["user"])
    assert all(isinstance(m["content"], str) and m["content"] for m in conversation)
    encoded = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    assert encoded[-3:] == tokenizer.encode("<|im_start|>assistant\n", add_bos=False)[-3:]


def test_bad_sizes_are_refused(pair):
  target, tokenizer = pair
  with pytest.raises(ValueError, match="count and batch_size"):
    self_prompts.SelfWrittenConversations(target, tokenizer, 0)
