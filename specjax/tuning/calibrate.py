"""Calibration for adaptive length: the cost table and the acceptance profile of a pair.

`measure_costs` times, on this backend, the target's forward over 1..W positions, the drafter's
draft steps, one plain generate step and whole decode rounds (`cost_table_<backend>.json`);
`measure_acceptance` measures the drafter's per-position acceptance on a few prompts
(`acceptance_profile.json`; greedy by default, or the given sampling).
`specjax.drafters.adaptive.auto_num_draft` and `specjax.adaptive_drafter` read them; `specjax
calibrate` (`specjax.cli.calibrate`) writes them beside a checkpoint. Heavy imports happen inside
the functions, so importing this module is instant.
"""

from __future__ import annotations

import functools
import math
import time

DEFAULT_PROMPTS = ("def fibonacci(n):\n", "import os\n\n\ndef ", "class Stack:\n    def ",
                   "The capital of France is", "Once upon a time,", "for i in range(")


def _best_ms(thunks: dict, repeats: int) -> dict:
  """The fastest of `repeats` timed calls of each thunk, in milliseconds, after one warm-up call
  each. The thunks take turns (round robin), so a burst of load on a shared machine hits every
  measurement alike instead of one of them."""
  import jax

  for fn in thunks.values():
    jax.block_until_ready(fn())
  best = {name: math.inf for name in thunks}
  for _ in range(repeats):
    for name, fn in thunks.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      best[name] = min(best[name], time.perf_counter() - start)
  return {name: seconds * 1e3 for name, seconds in best.items()}


def _without_stop(drafter):
  from specjax.drafters.base import with_confidence
  if drafter.confidence is not None:
    return with_confidence(drafter, None)
  return drafter


def measure_costs(target, drafter, *, batch: int = 1, max_width: int = 9, context: int = 64,
                  repeats: int = 5, sampling=None, seed: int = 0, notes: dict | None = None):
  """Measures a `specjax.drafters.adaptive.costs.CostTable` on this process's default backend.

  Besides the forwards and the draft steps it times whole `specjax.decode` calls at `k = 1` and
  `k = W - 1` for two output lengths in one bucket: their difference over the difference in
  rounds is what one round really costs, and what it costs beyond `verify(k + 1) + k *
  draft_step` is the table's `round_overhead_ms` (the mean of the two).

  Args:
    target: the target model.
    drafter: a `specjax.drafters.Drafter` (a draft `Model` is wrapped with `as_drafter` by the
      caller).
      Its confidence stop, if any, is switched off to time full steps.
    batch: rows per forward.
    max_width: W, the widest verify block timed.
    context: prompt length the forwards run after (random token ids).
    repeats: timed calls per measurement; the fastest is kept.
    sampling: the sampling settings while timed (default greedy).
    seed: for the random prompt.
    notes: extra facts stored with the table.

  Returns:
    The `CostTable` (not saved: call `.save(directory)`).
  """
  import jax
  import jax.numpy as jnp
  import numpy as np

  from specjax.drafters.adaptive.costs import CostTable, _now
  from specjax.loop.decode import decode
  from specjax.loop.generate import generate
  from specjax.core.sampling import GREEDY
  from specjax.loop.state import prefill, target_features

  if max_width < 2:
    raise ValueError(f"max_width must be >= 2 (one draft), got {max_width}")
  sampling = GREEDY if sampling is None else sampling
  drafter = _without_stop(drafter)
  tokens = jax.random.randint(jax.random.key(seed), (batch, context), 0, target.vocab_size,
                              jnp.int32)
  lengths = jnp.full((batch,), context, jnp.int32)
  buffer_len = context + 2 * max_width + 2
  kwargs = target_features(drafter)
  start = jax.jit(lambda t, x: prefill(t, x, t.init_cache(batch, buffer_len), **kwargs))
  out = start(target, tokens)
  cache = out.cache.with_lengths(lengths - 1)

  forward = jax.jit(lambda t, block, cache: t(block, lengths - 1, cache, **kwargs),
                    donate_argnums=2)
  sequence = jnp.concatenate([tokens, jnp.zeros((batch, buffer_len - context), jnp.int32)], 1)
  seeds = jnp.arange(batch, dtype=jnp.uint32)
  propose = jax.jit(lambda d, s, k: d.propose(s, sequence, lengths, num_draft=k,
                                              sampling=sampling, seeds=seeds),
                    static_argnums=2, donate_argnums=1)
  state = {"cache": out.cache.with_lengths(lengths - 1),
           "draft": drafter.init(tokens, lengths, buffer_len, out)}

  blocks = {w: tokens[:, :w] for w in range(1, max_width + 1)}

  def verify_once(width):  # the cache is donated and threaded through (written in place)
    scored = forward(target, blocks[width], state["cache"])
    state["cache"] = scored.cache.with_lengths(lengths - 1)
    return scored.logits

  def propose_once(k):
    state["draft"], proposal = propose(drafter, state["draft"], k)
    return proposal.tokens

  short, long = 8, 40  # one output bucket: one compiled program
  key = jax.random.key(seed)
  thunks = {("verify", w): functools.partial(verify_once, w) for w in range(1, max_width + 1)}
  thunks.update({("draft", k): functools.partial(propose_once, k) for k in (1, max_width - 1)})
  thunks.update({("generate", n): functools.partial(
      lambda n: generate(target, tokens, key, max_new_tokens=n).tokens, n) for n in (short, long)})
  round_ks, few, many = sorted({1, max_width - 1}), 8, 56  # one output bucket per k
  rounds = {}
  for k in round_ks:
    for n in (few, many):
      def run(k=k, n=n):
        return decode(target, drafter, tokens, key, max_new_tokens=n, num_draft=k,
                      sampling=sampling)
      rounds[k, n] = int(np.max(np.asarray(run().stats.rounds)))
      thunks["round", k, n] = lambda run=run: run().tokens
  best = _best_ms(thunks, repeats)
  verify_ms = [best["verify", w] for w in range(1, max_width + 1)]
  draft_ms = {k: best["draft", k] for k in (1, max_width - 1)}
  steps = max_width - 2
  draft_step = (draft_ms[max_width - 1] - draft_ms[1]) / steps if steps else draft_ms[1]
  generate_ms = {n: best["generate", n] for n in (short, long)}
  generate_step = (generate_ms[long] - generate_ms[short]) / (long - short)
  if not generate_step > 0:  # timing noise on a tiny model: the slope is not a cost
    generate_step = generate_ms[long] / long  # the mean per token, prefill included: an upper bound

  round_ms, overhead = {}, {}
  for k in round_ks:  # a round's cost from two decode lengths; what it costs beyond the table's
    extra = rounds[k, many] - rounds[k, few]
    if extra < 1:
      raise ValueError(f"decode at k = {k} took {rounds[k, many]} rounds for {many} tokens and "
                       f"{rounds[k, few]} for {few}: no rounds to time")
    round_ms[k] = (best["round", k, many] - best["round", k, few]) / extra
    overhead[k] = round_ms[k] - verify_ms[k] - k * max(draft_step, 0.0)

  device = jax.devices()[0]
  facts = dict(target=type(target).__name__, drafter=type(drafter).__name__,
               repeats=repeats, draft_propose_ms={str(k): v for k, v in draft_ms.items()},
               generate_ms={str(n): v for n, v in generate_ms.items()},
               round_ms={str(k): v for k, v in round_ms.items()},
               round_overhead_ms_by_k={str(k): v for k, v in overhead.items()},
               rounds={f"{k},{n}": r for (k, n), r in rounds.items()})
  facts.update(notes or {})
  return CostTable(verify_ms=tuple(verify_ms), draft_step_ms=max(draft_step, 0.0),
                   generate_step_ms=max(generate_step, 0.0), backend=jax.default_backend(),
                   device_kind=device.device_kind, jax_version=jax.__version__, batch=batch,
                   context=context, date=_now(), notes=facts,
                   round_overhead_ms=max(float(np.mean(list(overhead.values()))), 0.0))


def measure_acceptance(target, drafter, tokens, lengths, *, num_draft: int, sampling,
                       max_new_tokens: int = 64, seed: int = 0):
  """The drafter's `AcceptanceProfile` over `num_draft` positions on the given prompts.

  A confidence stop, if the drafter has one, is switched off, so that every position is drafted
  and `alpha_j` is measured for every `j`. For a `HybridDrafter` the profile also holds its
  head's alone (`AcceptanceProfile.head`: a second decode with the head) and its copies'
  (`.lookup`, `lookup_counts` over the text the first decode emitted).
  """
  import dataclasses

  import jax
  import numpy as np

  from specjax.drafters.adaptive.costs import AcceptanceProfile
  from specjax.loop.decode import decode
  from specjax.drafters import as_drafter
  from specjax.drafters.hybrid import HybridDrafter

  drafter = _without_stop(as_drafter(drafter))

  def measure(drafter):
    out = decode(target, drafter, tokens, jax.random.key(seed), lengths=lengths,
                 max_new_tokens=max_new_tokens, num_draft=num_draft, sampling=sampling)
    return out, AcceptanceProfile.from_counts(
        int(np.sum(out.stats.rounds)), np.asarray(out.stats.accepted_per_position).sum(0),
        sampling=sampling, prompts=int(tokens.shape[0]))

  out, profile = measure(drafter)
  if not isinstance(drafter, HybridDrafter):
    return profile
  reached, accepted = lookup_counts(drafter, tokens, lengths, out.tokens, out.num_tokens,
                                    num_draft)
  lookup = AcceptanceProfile.from_counts(int(reached), accepted, sampling=sampling,
                                         prompts=int(tokens.shape[0]))
  return dataclasses.replace(profile, head=measure(drafter.drafter)[1], lookup=lookup)


def lookup_counts(drafter, tokens, lengths, new_tokens, new_lengths, num_draft: int):
  """`(positions, accepted [num_draft])`: a `HybridDrafter`'s copies scored against a text.

  At every position of each row's emitted text (`new_tokens [B, N]`, `new_lengths [B]`, after
  the prompt `tokens`, `lengths`) where the row's text so far has a match, the copy of
  `num_draft` tokens is compared with the tokens the text goes on with: `accepted[j]` counts the
  positions whose first `j + 1` copies all equal them (so `accepted[j] / accepted[j - 1]` is
  `alpha_{j + 1}`, as for decode rounds; copies past the text's end count as wrong). Under
  greedy this is exactly how often they would be accepted; for sampled text the chance that a
  sample equals a copy is the chance a point-mass draft of it is accepted.
  """
  import jax.numpy as jnp
  import numpy as np

  tokens, new_tokens = np.asarray(tokens), np.asarray(new_tokens)
  lengths, new_lengths = np.asarray(lengths), np.asarray(new_lengths)
  positions, accepted = 0, np.zeros(num_draft, np.int64)
  for row in range(tokens.shape[0]):
    text = np.concatenate([tokens[row, :lengths[row]], new_tokens[row, :new_lengths[row]]])
    padded = np.pad(text, (0, num_draft), constant_values=-1).astype(np.int32)
    starts = np.arange(int(lengths[row]), len(text), dtype=np.int32)
    copies, found = drafter.lookup(jnp.broadcast_to(padded, (len(starts), len(padded))),
                                   jnp.asarray(starts), num_draft)
    follows = np.lib.stride_tricks.sliding_window_view(padded, num_draft)[starts]
    held = np.cumprod(np.asarray(copies) == follows, axis=1) * np.asarray(found)[:, None]
    positions += int(np.sum(found))
    accepted += held.sum(0)
  return positions, accepted


def profile_prompts(tokenizer, prompts=None, count: int = 6):
  """`(tokens, lengths)` of the acceptance-profile prompts: the given texts; else, for a chat
  model (a tokenizer with a chat template), `count` conversations of the training templates
  (`specjax.training.prompts`, never the held-out benchmark prompts), chat-templated; else
  `DEFAULT_PROMPTS`."""
  import numpy as np

  if prompts or getattr(tokenizer, "chat_template", None) is None:
    return tokenizer.encode_batch(list(prompts or DEFAULT_PROMPTS))
  from specjax.training.prompts import training_conversations
  conversations = training_conversations(count * 50, seed=123)[::50]  # spread over templates
  rows = [tokenizer.apply_chat_template(c) for c in conversations]
  tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
  for i, row in enumerate(rows):
    tokens[i, :len(row)] = row
  return tokens, np.asarray([len(r) for r in rows], np.int32)
