"""Held-out evaluation of trained models: perplexity, distance to a target, greedy acceptance."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.transformer import Model
from specjax.training.lm import logits_of
from specjax.training.losses import tv_distance


def evaluate(model: Model, windows: np.ndarray, target: Model | None = None,
             batch_size: int = 8) -> dict[str, float]:
  """Held-out metrics over `[W, T + 1]` windows.

  Returns:
    `{"loss", "perplexity"}` of the model on the data; with a `target`, also the mean
    total-variation distance to it (`tv`, one minus the sampling acceptance rate per position) and
    the share of positions where both argmaxes agree (`greedy_agreement`).
  """
  model = model.astype(jnp.float32)
  target = target.astype(jnp.float32) if target is not None else None

  @jax.jit
  def scores(model, target, batch):
    logits = logits_of(model.params, model.config, batch[:, :-1])
    log_probs = jax.nn.log_softmax(logits, -1)
    nll = -jnp.take_along_axis(log_probs, batch[:, 1:, None], -1)[..., 0]
    out = {"nll": jnp.sum(nll)}
    if target is not None:
      target_logits = logits_of(target.params, target.config, batch[:, :-1])
      out["tv"] = jnp.sum(tv_distance(target_logits, logits))
      out["agree"] = jnp.sum(jnp.argmax(logits, -1) == jnp.argmax(target_logits, -1))
    return out

  totals: dict[str, float] = {}
  count = 0
  for i in range(0, len(windows), batch_size):
    batch = jnp.asarray(windows[i:i + batch_size])
    for key, value in scores(model, target, batch).items():
      totals[key] = totals.get(key, 0.0) + float(value)
    count += batch.shape[0] * (batch.shape[1] - 1)
  loss = totals["nll"] / count
  result = {"loss": loss, "perplexity": math.exp(loss)}
  if target is not None:
    result["tv"] = totals["tv"] / count
    result["greedy_agreement"] = totals["agree"] / count
  return result

def acceptance(target: Model, draft: Model, windows: np.ndarray, *, prompt_len: int = 64,
               max_new_tokens: int = 64, num_draft: int = 4, batch_size: int = 8,
               check_generate: bool = False) -> dict:
  """Greedy speculative decoding from the first `prompt_len` tokens of each window.

  Returns:
    `{"acceptance_rate", "tokens_per_round", "accepted_per_position", "rounds", "drafted",
    "accepted"}` summed over all prompts, plus `"matches_generate"` (every row's tokens equal
    `specjax.generate`'s) when `check_generate`.
  """
  target, draft = target.astype(jnp.float32), draft.astype(jnp.float32)
  batches = ((jnp.asarray(windows[i:i + batch_size, :prompt_len]), None)
             for i in range(0, len(windows), batch_size))
  return _greedy_acceptance(target, draft, batches, num_draft=num_draft,
                            max_new_tokens=max_new_tokens, check_generate=check_generate)


def drafter_acceptance(target: Model, drafter, prompts: list[list[int]], *, num_draft: int = 4,
                       max_new_tokens: int = 64, eos_id=None, batch_size: int = 4,
                       check_generate: bool = True) -> dict:
  """Greedy speculative decoding of token-id prompts with any drafter (e.g. an `EagleDrafter`).

  Prompts are right-padded into batches of ragged lengths.

  Returns:
    `{"tokens_per_round" (tau), "acceptance_rate", "accepted_per_position", "rounds", "drafted",
    "accepted"}` summed over the prompts, and `"matches_generate"` when `check_generate`.
  """
  pad = target.config.pad_id

  def batches():
    for i in range(0, len(prompts), batch_size):
      rows = prompts[i:i + batch_size]
      width = -(-max(map(len, rows)) // 32) * 32
      ids = np.full((len(rows), width), pad, np.int32)
      for b, r in enumerate(rows):
        ids[b, :len(r)] = r
      yield ids, np.asarray([len(r) for r in rows], np.int32)

  return _greedy_acceptance(target, drafter, batches(), num_draft=num_draft,
                            max_new_tokens=max_new_tokens, check_generate=check_generate,
                            eos_id=eos_id)


def _greedy_acceptance(target: Model, drafter, batches, *, num_draft: int, max_new_tokens: int,
                       check_generate: bool, eos_id=None) -> dict:
  """Greedy speculative decoding of `(ids [B, T], lengths [B] or None)` batches, summed.

  Returns:
    The dict `acceptance` and `drafter_acceptance` describe.
  """
  from specjax.loop.decode import decode
  from specjax.loop.generate import generate
  from specjax.core.sampling import Sampling
  greedy = Sampling(temperature=0.0)
  rng = jax.random.PRNGKey(0)
  totals = {"rounds": 0, "drafted": 0, "accepted": 0}
  per_position = np.zeros((num_draft,), np.int64)
  matches = True
  for ids, lengths in batches:
    out = decode(target, drafter, ids, rng, lengths=lengths, max_new_tokens=max_new_tokens,
                 num_draft=num_draft, sampling=greedy, eos_id=eos_id)
    summary = out.stats.summary()
    for key in totals:
      totals[key] += int(summary[key])
    per_position += np.asarray(summary["accepted_per_position"], np.int64)
    if check_generate:
      reference = generate(target, ids, rng, lengths=lengths, max_new_tokens=max_new_tokens,
                           sampling=greedy, eos_id=eos_id)
      matches &= bool(np.array_equal(np.asarray(reference.tokens), np.asarray(out.tokens)))
  result = dict(totals,
                acceptance_rate=totals["accepted"] / max(totals["drafted"], 1),
                tokens_per_round=(totals["accepted"] + totals["rounds"]) / max(totals["rounds"], 1),
                accepted_per_position=per_position.tolist())
  if check_generate:
    result["matches_generate"] = matches
  return result
