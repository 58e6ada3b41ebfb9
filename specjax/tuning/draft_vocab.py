"""A draft vocabulary with no training data: the ids a target itself uses most.

`frequent_vocab` samples the target's own answers (temperature 1) to chat prompts (the training
templates' conversations by default, never a benchmark prompt), counts the ids of the prompts and
the answers, and keeps the `size` most frequent (the end-of-turn ids always). A self-draft whose
output projection keeps only those rows (`specjax.self_drafter(target, vocab=ids)`) reads
`size` of the `V` rows per draft step: on Gemma 3 270M, whose 262,144-row output projection holds
63% of its weights, that is most of a draft step's bytes. Exact whatever the ids: a target token
outside them is never drafted, and the verify's residual emits it with the target's probability.
"""

from __future__ import annotations

import numpy as np

__all__ = ["frequent_vocab", "vocab_coverage"]


def frequent_vocab(target, tokenizer, size: int, *, prompts=None, count: int = 256,
                   max_new_tokens: int = 96, batch: int = 16, seed: int = 0,
                   eos_ids=None) -> np.ndarray:
  """The `size` ids the target uses most, sorted, as `[size]` int32.

  Args:
    target: the target `specjax.Model`.
    tokenizer: its `specjax.io.Tokenizer` (chat template, end-of-turn ids).
    size: how many ids to keep, in `[1, V]`. Ids never seen fill the rest in id order.
    prompts: texts to answer; default `count` training-template conversations
      (`specjax.tuning.calibrate.profile_prompts`), chat-templated with the tokenizer's own
      template or, where it has none (a base model such as Gemma 3 270M), specjax's built-in
      one for the model's family.
    count: conversations when `prompts` is None.
    max_new_tokens: answer tokens per prompt.
    batch: prompts per `generate` call.
    seed: the sampling seed.
    eos_ids: ids kept whatever their counts (default: the tokenizer's end-of-turn ids).

  Raises:
    ValueError: `size` outside `[1, V]`.
  """
  import jax

  from specjax.core.sampling import Sampling
  from specjax.loop.generate import generate
  from specjax.training.selfdistill import frequent_ids
  from specjax.tuning.calibrate import profile_prompts

  vocab = target.config.vocab_size
  if not isinstance(size, (int, np.integer)) or not 1 <= size <= vocab:
    raise ValueError(f"size must be an int in [1, {vocab}], got {size!r}")
  eos = tuple(int(i) for i in (tokenizer.eos_ids if eos_ids is None else eos_ids))
  if prompts is None and hasattr(tokenizer, "render_chat"):  # a specjax Tokenizer
    from specjax.io.chat import with_chat_template
    tokenizer = with_chat_template(tokenizer, target.config.family)
  tokens, lengths = profile_prompts(tokenizer, prompts, count=count)
  tokens, lengths = np.asarray(tokens, np.int32), np.asarray(lengths, np.int32)
  counts = np.zeros((vocab,), np.int64)
  for b in range(tokens.shape[0]):
    np.add.at(counts, tokens[b, :lengths[b]], 1)
  width = -(-tokens.shape[1] // 32) * 32  # one compile for every batch
  for start in range(0, tokens.shape[0], batch):
    rows = np.zeros((batch, width), np.int32)
    part = tokens[start:start + batch]
    rows[:part.shape[0], :part.shape[1]] = part
    row_lengths = np.full((batch,), 1, np.int32)
    row_lengths[:part.shape[0]] = lengths[start:start + batch]
    out = generate(target, rows, jax.random.key(seed + start), lengths=row_lengths,
                   max_new_tokens=max_new_tokens, sampling=Sampling(temperature=1.0),
                   eos_id=eos or None)
    new, num = np.asarray(out.tokens), np.asarray(out.num_tokens)
    for b in range(part.shape[0]):
      np.add.at(counts, new[b, :num[b]], 1)
  return frequent_ids(counts, int(size), keep=[i for i in eos if 0 <= i < vocab])


def vocab_coverage(ids, tokens) -> float:
  """The share of `tokens` (any shape, ids) that lie in `ids`."""
  tokens = np.asarray(tokens).ravel()
  return float(np.isin(tokens, np.asarray(ids)).mean()) if tokens.size else float("nan")
