"""Self-written training prompts: the target writes the user turns of its own training data.

The template prompts of `specjax.training.prompts` cover the kinds of requests a chat model gets,
but through a few dozen topics and sentence frames. A head trained on them predicts the target
well on prompts of that kind and much worse on prose requests written otherwise (on SmolLM2:
tau 2.6 on held-out template prompts, 1.3-1.5 on chat, translation and summarisation prompts
written by hand). An instruct model given its chat template up to the opening of a user turn writes
a plausible user request itself (the idea behind Magpie, Xu et al. 2024); started with an opening
phrase it writes a request of the asked kind: a text to summarise, a sentence to translate, a word
problem, some code. Multi-turn conversations are built the same way: the model writes a request,
answers it, and writes the follow-up. Nothing here reads a dataset or the held-out benchmark
prompts; every word comes from the target and the openers below.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.core.sampling import Sampling

LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese", "Dutch")

# Opening words of a user turn, per kind; the target writes the rest. "{lang}" is filled in.
OPENERS = {
    "open": ("",),
    "chat": ("Can you", "How can I", "What is the best way to", "I'm", "Why do", "Give me",
             "What are", "Write a", "I need", "Do you think"),
    "translate": ("Translate the following sentence into {lang}:",
                  "Translate this text into {lang}:\n\n", "How do you say this in {lang}?",
                  "Please translate into {lang}:"),
    "summarize": ("Summarize the following text in a few sentences:\n\n",
                  "Write a short summary of this article:\n\n",
                  "Here is a paragraph. Summarize it for me.\n\n"),
    "passage_qa": ("Read the text below and answer the question at the end.\n\n",
                   "Based on the following passage, answer my question.\n\nPassage:",
                   "Here is an article:\n\n"),
    "math": ("Solve this step by step:", "A math word problem:", "How many", "If a",
             "Calculate"),
    "code": ("Write a Python function", "In Python, how do I", "Write a JavaScript function",
             "Explain this code:\n\n```python\n", "Fix the bug in this code:\n\n```python\n",
             "How do I write a SQL query"),
}
KINDS = ("open", "chat", "translate", "summarize", "passage_qa", "math", "code", "multi_turn")
LONG_KINDS = ("summarize", "passage_qa")  # their requests carry a text: a longer budget
_SENTINEL = "\x00specjax-user-turn\x00"
_STREAM = 0x5E1F


def user_turn_prefix(tokenizer, history: list[dict]) -> str:
  """The rendered chat up to where the content of a new user turn after `history` begins."""
  text = tokenizer.render_chat(history + [{"role": "user", "content": _SENTINEL}],
                               add_generation_prompt=False)
  if text.count(_SENTINEL) != 1:
    raise ValueError("the chat template does not render a user turn's content verbatim")
  return text[:text.index(_SENTINEL)]


class SelfWrittenConversations(Sequence):
  """`count` conversations whose user turns the target writes, generated one batch at a time.

  Indexing by a batch-aligned slice (`[i * batch_size:(i + 1) * batch_size]`, as
  `selfdistill.generate_chunks` reads it) generates batch `i` from its own key (`seed`, `i`): a
  batch depends only on the seed and its index, so writing chunk 40 does not require writing
  chunks 0-39. Kinds cycle over `KINDS`; a request the target leaves empty (or one that does not
  fit its budget, for the short kinds) is replaced by one written with a fresh key, at most
  `retries` times, then by the opener alone.

  Args:
    target: the `specjax.Model` that writes (and, for multi-turn, answers) the requests.
    tokenizer: its `specjax.io.Tokenizer` (chat template, EOS ids).
    count: number of conversations.
    batch_size: conversations per batch (= rows per self-distillation chunk).
    seed: the generator's seed.
    sampling: how the requests are sampled.
    max_request_tokens: budget of a short request; the summarise / passage kinds get 3x.
    max_reply_tokens: budget of the first assistant reply of a multi-turn conversation.
  """

  def __init__(self, target, tokenizer, count: int, *, batch_size: int = 64, seed: int = 0,
               sampling: Sampling = Sampling(temperature=0.9, top_p=0.95),
               max_request_tokens: int = 64, max_reply_tokens: int = 96, retries: int = 1):
    if count < 1 or batch_size < 1:
      raise ValueError(f"count and batch_size must be >= 1, got {count} and {batch_size}")
    self.target, self.tokenizer, self.count = target, tokenizer, count
    self.batch_size, self.seed, self.sampling = batch_size, seed, sampling
    self.max_request_tokens, self.max_reply_tokens = max_request_tokens, max_reply_tokens
    self.retries = retries
    self._batches: dict[int, list[list[dict]]] = {}

  def __len__(self) -> int:
    return self.count

  def __getitem__(self, index):
    if isinstance(index, slice):
      start, stop, step = index.indices(self.count)
      if step != 1 or start % self.batch_size or (stop - start > self.batch_size):
        return [self[i] for i in range(start, stop, step)]
      return list(self.batch(start // self.batch_size)[:stop - start])
    if index < 0:
      index += self.count
    if not 0 <= index < self.count:
      raise IndexError(index)
    return self.batch(index // self.batch_size)[index % self.batch_size]

  def batch(self, i: int) -> list[list[dict]]:
    """Conversations `[i * batch_size, (i + 1) * batch_size)` (fewer in a short last batch)."""
    if i not in self._batches:
      if len(self._batches) >= 4:
        self._batches.clear()
      self._batches[i] = self._write(i)
    return self._batches[i]

  def _write(self, i: int) -> list[list[dict]]:
    rows = min(self.batch_size, self.count - i * self.batch_size)
    rng = np.random.default_rng([self.seed, i])
    # A stream of its own: the answer sampler of `generate_chunks` uses fold_in(PRNGKey(seed), i).
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(self.seed), _STREAM), i)
    kinds = [KINDS[(i * self.batch_size + r) % len(KINDS)] for r in range(rows)]
    openers = []
    for kind in kinds:
      choices = OPENERS["chat" if kind == "multi_turn" else kind]
      openers.append(choices[rng.integers(len(choices))].format(lang=LANGUAGES[rng.integers(6)]))
    histories: list[list[dict]] = [[] for _ in range(rows)]
    budgets = [self.max_request_tokens * (3 if k in LONG_KINDS else 1) for k in kinds]
    key, sub = jax.random.split(key)
    first = self._requests(histories, openers, budgets, sub)
    conversations = [[{"role": "user", "content": text}] for text in first]
    multi = [r for r, k in enumerate(kinds) if k == "multi_turn"]
    if multi:
      key, sub = jax.random.split(key)
      replies = self._complete([conversations[r] for r in multi], self.max_reply_tokens, sub)
      follow = [conversations[r] + [{"role": "assistant", "content": reply}]
                for r, reply in zip(multi, replies)]
      key, sub = jax.random.split(key)
      texts = self._requests(follow, [""] * len(multi), [self.max_request_tokens] * len(multi),
                             sub)
      for r, history, text in zip(multi, follow, texts):
        conversations[r] = history + [{"role": "user", "content": text}]
    return conversations

  def _requests(self, histories, openers, budgets, key) -> list[str]:
    """The target's user turns after `histories`, each starting with its opener."""
    prefixes = [self.tokenizer.encode(user_turn_prefix(self.tokenizer, h) + o, add_bos=False)
                for h, o in zip(histories, openers)]
    texts: list[str | None] = [None] * len(prefixes)
    for _ in range(self.retries + 1):
      todo = [r for r, t in enumerate(texts) if t is None]
      if not todo:
        break
      for budget in sorted({budgets[r] for r in todo}):
        group = [r for r in todo if budgets[r] == budget]
        size = sum(b == budget for b in budgets)  # retries keep the first attempt's shape
        key, sub = jax.random.split(key)
        written, ended = self._generate([prefixes[r] for r in group], budget, sub, rows=size)
        for r, text, done in zip(group, written, ended):
          # A short request must end within its budget; a text-carrying one may be cut.
          if text.strip() and (done or budgets[r] > self.max_request_tokens):
            texts[r] = (openers[r] + text).strip()
    return [t if t is not None else (o.strip() or "Hello!") for t, o in zip(texts, openers)]

  def _complete(self, conversations, budget: int, key) -> list[str]:
    """The target's assistant replies to `conversations` (a cut reply is kept as it is)."""
    prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True)
               for c in conversations]
    texts, _ = self._generate(prompts, budget, key)
    return [t.strip() or "I see." for t in texts]

  def _generate(self, prompts: list[list[int]], budget: int, key, rows: int = 0):
    """Sampled continuations: (decoded texts, whether each row reached an EOS)."""
    from specjax.loop.generate import generate
    pad = self.target.config.pad_id
    # Few distinct shapes, few compilations: widths in steps of 128, rows in powers of two.
    width = -(-max(map(len, prompts)) // 128) * 128
    rows = max(8, 1 << (max(rows, len(prompts)) - 1).bit_length())
    tokens = np.full((rows, width), pad, np.int32)
    lengths = np.ones((rows,), np.int32)
    for b, p in enumerate(prompts):
      tokens[b, :len(p)], lengths[b] = p, len(p)
    eos = tuple(self.tokenizer.eos_ids)
    out = generate(self.target, jnp.asarray(tokens), key, lengths=jnp.asarray(lengths),
                   max_new_tokens=budget, sampling=self.sampling, eos_id=eos)
    ids, counts = np.asarray(out.tokens), np.asarray(out.num_tokens)  # new tokens only
    texts, ended = [], []
    for row, n in zip(ids[:len(prompts)], counts):  # a row stops at its first EOS, kept
      done = n > 0 and int(row[n - 1]) in eos
      ended.append(bool(done))
      texts.append(self.tokenizer.decode(row[:n - 1] if done else row[:n]))
    return texts, ended
