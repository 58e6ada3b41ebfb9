"""Plain autoregressive generation, fully on device: prefill, then a `lax.while_loop`.

This is the baseline speculative decoding must reproduce: `decode` at temperature 0 returns exactly
`generate`'s tokens. One compiled program serves every `max_new_tokens` within a bucket of
`NEW_TOKEN_BUCKET` and every rng: those are traced values; only shapes, the model config and the
sampling settings are static.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from specjax.constrain.compile import constraint_inputs
from specjax.constrain.law import sample_constrained, stuck
from specjax.constrain.tables import ConstraintTables, advance, allowed_mask, mask_logits
from specjax.core import validation
from specjax.core.outputs import DecodeOutput, DecodeStats
from specjax.loop.program import Program
from specjax.parallel.rules import rules_scope
from specjax.core.sampling import (GREEDY, PURPOSE_SAMPLE, Sampling, no_distribution, row_seeds,
                                   sample_token, token_logprobs)
from specjax.core.sequence import clear_padding
from specjax.core.tracing import TRACE_COUNTS
from specjax.core.validation import NEW_TOKEN_BUCKET
from specjax.models.prefill import prefill

__all__ = ["GenerateState", "generate", "generate_start", "generate_step", "last_logits",
           "prepare_generate"]


def generate(model, tokens, rng, *, lengths=None, max_new_tokens: int = 64,
             sampling: Sampling = GREEDY, eos_id: int | tuple[int, ...] | None = None,
             pad_id: int | None = None, constraint=None,
             return_logprobs: bool = False) -> DecodeOutput:
  """Generates up to `max_new_tokens` tokens per row with the model alone.

  Args:
    model: a `specjax.Model` (or anything following the model protocol).
    tokens: `[B, T]` int prompt ids, right-padded.
    rng: a JAX PRNG key, or a `[B]` array of keys (one per row); unused when greedy. As in
      `specjax.decode`, a row's tokens depend only on its own key and prompt.
    lengths: `[B]` prompt lengths; None means every row is `T` tokens long.
    max_new_tokens: how many tokens to generate at most per row.
    sampling: temperature / top-k / top-p; the default is greedy.
    eos_id: a row stops after emitting this id, or any id of a sequence of them (the stop token is
      included in the output); None = never.
    pad_id: fills the output after each row's end; defaults to the model config's `pad_id`.
    constraint: a `specjax.Constraint` for every row, or a sequence of `B` of them (one per row,
      a ragged batch of grammars), or None. Each step then samples from the constrained law of
      `specjax.constrain.law`: the warped distribution (temperature, top-k, top-p on the
      unconstrained logits) restricted to the tokens the row's grammar state allows,
      renormalized (greedy: the argmax over the allowed tokens). The constraint's stop ids are
      allowed exactly where the text is a whole match, and end the row (they join `eos_id`). A
      row whose state allows nothing, or whose allowed tokens all have `-inf` logits, stops
      without emitting a token and is flagged in `stats.constraint_dead`.
    return_logprobs: also return each new token's log-probability, `log_softmax(logits / T)
      [token]` over the whole vocabulary (T = 1 when greedy; no top-k / top-p), as
      `specjax.decode` does (`DecodeOutput.logprobs`).

  Returns:
    `DecodeOutput(tokens [B, max_new_tokens], num_tokens [B], stats, logprobs)` (logprobs None
    unless `return_logprobs`).
  """
  return prepare_generate(model, tokens, rng, lengths=lengths, max_new_tokens=max_new_tokens,
                          sampling=sampling, eos_id=eos_id, pad_id=pad_id,
                          constraint=constraint, return_logprobs=return_logprobs).run()


def prepare_generate(model, tokens, rng, *, lengths=None, max_new_tokens: int = 64,
                     sampling: Sampling = GREEDY, eos_id: int | tuple[int, ...] | None = None,
                     pad_id: int | None = None, constraint=None,
                     return_logprobs: bool = False) -> Program:
  """`generate`'s checks, and the program the call runs (`specjax.precompile` compiles it).

  Takes `generate`'s arguments.

  Raises:
    ValueError: naming the problem, before anything is traced.
  """
  validation.check_model(model)
  tokens, lengths = validation.check_tokens(tokens, lengths, model.vocab_size)
  max_new_tokens = validation.check_count(max_new_tokens, "max_new_tokens")
  validation.check_context(lengths, tokens.shape[1], max_new_tokens, model.max_len)
  rng = validation.check_rng(rng, tokens.shape[0])
  eos = validation.check_eos(eos_id, model.vocab_size)
  validation.check_sampling(sampling)
  pad = validation.resolve_pad_id(model, pad_id)
  grammar = None
  if constraint is not None:
    grammar = constraint_inputs(constraint, tokens.shape[0], model.vocab_size)
    eos = grammar.stop_ids(eos)
  capacity = validation.round_up(max_new_tokens, NEW_TOKEN_BUCKET)
  static = dict(sampling=sampling, capacity=capacity, pad_id=int(pad),
                classes=validation.pytree_classes(model))
  if return_logprobs:  # only where asked: the default program's cache key is unchanged
    static["logprobs"] = True
  inputs = (model, tokens, lengths, rng, jnp.array(eos, jnp.int32),
            None if grammar is None else grammar.tables,
            None if grammar is None else grammar.schema)
  return Program(_generate, inputs, static, max_new_tokens)


def last_logits(logits: jax.Array, lengths: jax.Array) -> jax.Array:
  """The logits at each row's last prompt token: `[B, T, V]` -> `[B, V]`."""
  return jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]


@functools.partial(jax.jit, static_argnames=("sampling", "capacity", "pad_id", "rules",
                                             "classes", "logprobs"))
def _generate(model, tokens, lengths, rng, eos_ids, tables, schema, max_new_tokens, *,
              sampling: Sampling, capacity: int, pad_id: int, rules=None,
              classes=(), logprobs: bool = False) -> DecodeOutput:
  del classes  # a cache key only (`validation.pytree_classes`)
  TRACE_COUNTS["generate"] += 1
  with rules_scope(rules):
    return _generate_body(model, tokens, lengths, rng, eos_ids, max_new_tokens,
                          sampling=sampling, capacity=capacity, pad_id=pad_id, tables=tables,
                          schema=schema, logprobs=logprobs)


def _generate_body(model, tokens, lengths, rng, eos_ids, max_new_tokens, *, sampling: Sampling,
                   capacity: int, pad_id: int, tables=None, schema=None,
                   logprobs: bool = False) -> DecodeOutput:
  state = generate_start(model, tokens, lengths, row_seeds(rng, tokens.shape[0]), eos_ids,
                         max_new_tokens, sampling=sampling, capacity=capacity, pad_id=pad_id,
                         tables=tables, schema=schema, logprobs=logprobs)
  state = jax.lax.while_loop(lambda state: ~jnp.all(state.done),
                             lambda state: generate_step(model, state, sampling=sampling,
                                                         pad_id=pad_id),
                             state)
  return DecodeOutput(state.tokens, state.num_tokens, state.stats, state.logprobs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GenerateState:
  """What `generate`'s loop carries from one step to the next (`decode_stream` steps it from the
  host where an `AdaptiveDrafter` plans plain steps)."""

  cache: Any  # the model's cache; lengths = each row's prompt and new tokens but the last one
  token: jax.Array  # [B] int32 each row's last token, fed at the next step
  tokens: jax.Array  # [B, capacity] int32 the new tokens, `pad_id` past `num_tokens`
  num_tokens: jax.Array  # [B] int32
  done: jax.Array  # [B] bool
  seeds: jax.Array  # [B] uint32 per-row random-stream seeds (`sampling.row_seeds`)
  eos_ids: jax.Array  # [E] int32 stop ids, -1 = none
  max_new_tokens: jax.Array  # [] int32
  nonfinite: jax.Array  # [B] bool: the logits a row sampled from held a NaN or an infinity
  constraint_dead: jax.Array  # [B] bool: the row stopped because its grammar allowed no token
  # A grammar constraint (None without one): stacked tables, each row's schema and state.
  tables: ConstraintTables | None = None  # [G, ...] (`specjax.constrain.stack_tables`)
  schema: jax.Array | None = None  # [B] int32 index into the stacked tables
  grammar_state: jax.Array | None = None  # [B] int32 automaton state after the row's tokens
  # [B, capacity] float32 each new token's log-probability (`token_logprobs`), 0 past
  # `num_tokens`; None unless asked for
  logprobs: jax.Array | None = None

  @property
  def stats(self) -> DecodeStats:
    """The counters `generate` reports: one round and one target call per token, no drafts."""
    zeros = jnp.zeros_like(self.num_tokens)
    return DecodeStats(rounds=self.num_tokens, drafted=zeros, accepted=zeros,
                       accepted_per_position=jnp.zeros((self.num_tokens.shape[0], 0), jnp.int32),
                       target_calls=self.num_tokens, draft_calls=zeros, emitted=self.num_tokens,
                       nonfinite=self.nonfinite, constraint_dead=self.constraint_dead,
                       forced=zeros)


def generate_start(model, tokens, lengths, seeds, eos_ids, max_new_tokens, *, sampling: Sampling,
                   capacity: int, pad_id: int, tables=None, schema=None,
                   logprobs: bool = False) -> GenerateState:
  """The prefill and each row's first token: the state before `generate`'s first step.

  Args:
    model: the model.
    tokens: `[B, T]` int32 right-padded prompts; `lengths` `[B]` their lengths.
    seeds: `[B]` uint32 per-row seeds (`specjax.core.sampling.row_seeds`).
    eos_ids: `[E]` int32 stop ids, `[-1]` for none.
    max_new_tokens: `[]` int32 (traced) new tokens per row at most.
    sampling: the sampling settings.
    capacity: static upper bound on `max_new_tokens` (the buffers' size).
    pad_id: fills `GenerateState.tokens` past each row's end.
    tables: stacked `ConstraintTables` of a grammar constraint, or None.
    schema: `[B]` int32 each row's index into `tables` (with `tables`).
    logprobs: keep each new token's log-probability (`GenerateState.logprobs`).
  """
  batch, width = tokens.shape
  tokens = clear_padding(tokens, lengths)
  cache = model.init_cache(batch, width + capacity)
  # The prefill `decode` runs too (its cache is the same); where the model selects logit rows it
  # scores only each row's last prompt token.
  out = prefill(model, tokens, cache, lengths)
  if getattr(model, "selects_logit_rows", False):
    logits = out.logits[:, 0]
  else:
    logits = last_logits(out.logits, lengths)
  grammar_state = None
  if tables is None:
    first = sample_token(logits, sampling, seeds, lengths, PURPOSE_SAMPLE)
    emit = jnp.ones((batch,), bool)
    nonfinite = no_distribution(logits)
  else:
    schema = jnp.asarray(schema, jnp.int32)
    first, emit, grammar_state, nonfinite = _constrained_token(
        tables, schema, tables.initial[schema], logits, sampling, seeds, lengths)
  num_tokens = emit.astype(jnp.int32)
  first = jnp.where(emit, first, pad_id)
  kept = None
  if logprobs:
    kept = jnp.zeros((batch, capacity), jnp.float32).at[:, 0].set(
        jnp.where(emit, token_logprobs(logits, first, sampling), 0.0))
  return GenerateState(
      cache=out.cache.with_lengths(lengths), token=first,
      tokens=jnp.full((batch, capacity), pad_id, jnp.int32).at[:, 0].set(first),
      num_tokens=num_tokens,
      done=~emit | validation.is_eos(first, eos_ids) | (num_tokens >= max_new_tokens),
      seeds=seeds, eos_ids=eos_ids, max_new_tokens=max_new_tokens,
      nonfinite=nonfinite, constraint_dead=~emit, tables=tables, schema=schema,
      grammar_state=grammar_state, logprobs=kept)


def _constrained_token(tables, schema, state, logits, sampling: Sampling, seeds, positions):
  """`(token, emit, next_state, nonfinite)` of one constrained step (`specjax.constrain.law`):
  `emit` is False where the row's grammar leaves nothing to sample (the token is then unused)."""
  mask = allowed_mask(tables, state, schema)
  token = sample_constrained(logits, mask, sampling, seeds, positions, PURPOSE_SAMPLE)
  emit = ~stuck(logits, mask)
  nonfinite = emit & no_distribution(mask_logits(logits, mask))
  return token, emit, jnp.where(emit, advance(tables, state, token, schema), state), nonfinite


def generate_step(model, state: GenerateState, *, sampling: Sampling,
                  pad_id: int) -> GenerateState:
  """One token per live row: the model's forward over each row's last token, then a sample from
  its distribution at the next position. Done rows are left unchanged."""
  cache = state.cache
  step = model(state.token[:, None], cache.lengths, cache)
  logits = step.logits[:, 0]
  positions = cache.lengths + 1  # absolute position of the token being sampled
  live = ~state.done
  grammar_state = state.grammar_state
  if state.tables is None:
    new_token = sample_token(logits, sampling, state.seeds, positions, PURPOSE_SAMPLE)
    nonfinite = no_distribution(logits)
    dead = jnp.zeros_like(live)
  else:
    new_token, emit, next_state, nonfinite = _constrained_token(
        state.tables, state.schema, state.grammar_state, logits, sampling, state.seeds,
        positions)
    dead = live & ~emit
    live = live & emit
    grammar_state = jnp.where(live, next_state, state.grammar_state)
  rows = jnp.arange(new_token.shape[0], dtype=jnp.int32)
  num_tokens = state.num_tokens + live
  logprobs = state.logprobs
  if logprobs is not None:
    logprobs = logprobs.at[rows, state.num_tokens].set(
        jnp.where(live, token_logprobs(logits, new_token, sampling), 0.0), mode="drop")
  return dataclasses.replace(
      state, cache=step.cache.with_lengths(jnp.where(live, cache.lengths + 1, cache.lengths)),
      token=jnp.where(live, new_token, state.token),
      tokens=state.tokens.at[rows, state.num_tokens].set(jnp.where(live, new_token, pad_id),
                                                         mode="drop"),
      num_tokens=num_tokens, grammar_state=grammar_state, logprobs=logprobs,
      nonfinite=state.nonfinite | (live & nonfinite),
      constraint_dead=state.constraint_dead | dead,
      done=(state.done | dead | (live & validation.is_eos(new_token, state.eos_ids))
            | (num_tokens >= state.max_new_tokens)))
