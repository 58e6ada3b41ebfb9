"""A small language model as the drafter; `draft_chain`, the drafting loop with a confidence stop.

**Confidence stop.** A chain drafter with `confidence=c` stops drafting a row at its first draft
whose drafting distribution has top probability `max(softmax(logits)) < c` (the drafter's raw
logits: temperature 1, no top-k / top-p, so one threshold means the same at every sampling
setting); that draft and later ones are not proposed (`Proposal.num_drafted`), and the verify
samples the token at the stop slot from the target (the bonus). Once every row of the batch has
stopped, the drafting loop ends early (a `lax.while_loop`: no host sync).

Why this stays exact: the stop decision at slot `j` is a function of the drafter's own logits,
which depend only on the tokens before slot `j` (the accepted prefix and the drafts `1..j-1`)
and the drafter's own random stream, never on the target's logits or on the verify's random
numbers for slot `j`. So, given everything emitted before slot `j`, the token the verify emits
there is either the ratio test / residual outcome for a draft drawn from `q_j` (distributed as
`p_j` for every `q_j`) or a direct sample from `p_j` (the bonus): `p_j` either way, whichever
way the (independent) stop decision went.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from specjax.drafters.base import OwnModelDrafter
from specjax.models.quant import indivisible, quantize
from specjax.core.sampling import PURPOSE_DRAFT, first_argmax, sample_token
from specjax.models import quant
from specjax.models import weights
from specjax.models.cpu import panels as panel_layout
from specjax.models.layers import _softcap
from specjax.models.prefill import prefill as model_prefill
from specjax.drafters.proposal import Proposal, check_confidence, top_probability
from specjax.core.cache import check_cache_dtype, to_cache
from specjax.core.sequence import gather_tokens

__all__ = ["ModelDrafter", "draft_chain", "restrict_output", "self_drafter",
           "with_draft_vocab"]


def draft_chain(step: Callable, carry: Any, first: tuple, num_draft: int, *,
                confidence: float | None, limits: jax.Array | None = None, stop: Any = None
                ) -> tuple[Any, Proposal]:
  """Drafts `num_draft` tokens per row: `first`, then `num_draft - 1` calls of `step`.

  Args:
    step: `(carry, i, token [B]) -> (carry, (token [B], logits [B, V] or None, raw [B, N]))`
      feeds draft `i` (1-based) and drafts `i + 1`: its token, the full-vocabulary logits of the
      distribution it was drawn from (None when greedy), and the drafter's raw logits (for the
      confidence).
    carry: the step's loop state (e.g. a KV cache).
    first: `(token [B], logits [B, V] or None, raw [B, N])` of the first draft.
    num_draft: `k`.
    confidence: None = every row drafts `k` (a `lax.scan`); a threshold in (0, 1] = the
      confidence stop (see the module docstring; a `lax.while_loop` that ends when every row
      has stopped).
    limits: None, or `[B]` int32: row `b` drafts at most `limits[b]` tokens (0 = none; chosen before
      the round from past rounds only, e.g. `specjax.drafters.adaptive.drafter`); with a stop, the
      loop ends when every row has stopped.
    stop: None, or a stop rule decided in the loop (e.g.
      `specjax.drafters.adaptive.drafter.CostAwareStop`): `stop.init(batch) -> stats` and
      `stop(index, confidence [B], stats) -> (keep [B], stats)`, called for draft `index + 1` with
      its top probability before it is proposed (a function of the drafts before it, never of the
      draft itself); a row proposes a draft only while `keep` (and the threshold and limit) allow.

  Returns:
    `(carry after the last step run, Proposal(tokens [B, k], logits [B, k, V] or None,
    num_drafted [B] or None, confidence [B, k] or None))`: without a threshold, limits or stop
    rule every row drafts `k` and `num_drafted` and `confidence` are None.
  """
  token, logits, raw = first
  if confidence is None and limits is None and stop is None:
    def scan_step(state, i):
      carry, token = state
      carry, (token, logits, _) = step(carry, i, token)
      return (carry, token), (token, logits)

    (carry, _), (tokens, all_logits) = jax.lax.scan(
        scan_step, (carry, token), jnp.arange(1, num_draft, dtype=jnp.int32))
    tokens = jnp.concatenate([token[:, None], tokens.T], axis=1)  # [B, k]
    if logits is not None:
      all_logits = jnp.concatenate([logits[:, None], all_logits.transpose(1, 0, 2)], axis=1)
    return carry, Proposal(tokens, all_logits if logits is not None else None)

  batch = token.shape[0]
  tokens = jnp.zeros((batch, num_draft), jnp.int32).at[:, 0].set(token)
  all_logits = None
  if logits is not None:
    all_logits = jnp.zeros((batch, num_draft) + logits.shape[1:], logits.dtype)
    all_logits = all_logits.at[:, 0].set(logits)
  def confident(index, raw, stats):
    top = top_probability(raw)
    keep = True if confidence is None else top >= confidence
    if stop is not None:
      wants, stats = stop(index, top, stats)
      keep = keep & wants
    return keep, stats, top

  limits = jnp.full((batch,), num_draft, jnp.int32) if limits is None else limits
  keep, stats, top = confident(0, raw, None if stop is None else stop.init(batch))
  alive = (limits > 0) & keep  # [B] still drafting
  count = alive.astype(jnp.int32)
  tops = jnp.zeros((batch, num_draft), jnp.float32).at[:, 0].set(top)

  def cond(state):
    i, _, _, _, _, alive, _, _, _ = state
    return (i < num_draft) & jnp.any(alive)

  def body(state):
    i, carry, token, tokens, all_logits, alive, count, stats, tops = state
    carry, (token, logits, raw) = step(carry, i, token)
    tokens = jax.lax.dynamic_update_index_in_dim(tokens, token, i, axis=1)
    if all_logits is not None:
      all_logits = jax.lax.dynamic_update_index_in_dim(all_logits, logits, i, axis=1)
    keep, stats, top = confident(i, raw, stats)
    tops = jax.lax.dynamic_update_index_in_dim(tops, top, i, axis=1)
    alive = alive & (i < limits) & keep
    count = count + alive.astype(jnp.int32)
    return i + 1, carry, token, tokens, all_logits, alive, count, stats, tops

  _, carry, _, tokens, all_logits, _, count, _, tops = jax.lax.while_loop(
      cond, body, (jnp.int32(1), carry, token, tokens, all_logits, alive, count, stats, tops))
  return carry, Proposal(tokens, all_logits, count, tops)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelDrafter(OwnModelDrafter):
  """A small language model as the drafter: stochastic `q` at temperature > 0, argmax at 0.

  Each round it first catches up on the tokens it has not seen: the last round's correction or
  bonus token (and, when every draft was accepted, its own last draft, which it proposed but never
  fed). It does that in one block forward of two tokens, then up to `k - 1` single-token steps. It
  reads no target features (`observe` is the identity).

  Attributes:
    model: the draft `specjax.Model`.
    confidence: None, or a threshold in (0, 1]: a row stops drafting at its first draft whose
      top probability (raw softmax) is below it (see the module docstring; static: a new value
      compiles a new program).
    share_prompt: start from the target's keys/values over the prompt instead of running the
      draft model over it (`self_drafter`: the draft is the target's own quantized copy, whose
      keys and values differ from the target's by the quantization error). It saves the draft
      model's prefill, as costly as the target's for a copy of the same size (docs/design.md,
      "Quantized weights and self-drafting"). Exact all the same: the drafts
      and their distribution q come from the drafter's own forwards over that cache, and q is
      what the verify uses. Ignored where the target's cache has another layout.
    draft_ids: None, or `[N]` int32 target ids: the model's output projection keeps only those
      rows (`restrict_output`), so its logits are `[..., N]`. Greedy drafts are the argmax mapped
      through `draft_ids`; sampled ones are drawn from the warped full-vocabulary logits (`-inf`
      outside `draft_ids`), which go to the verify as `q`.
    context_vocab: `M` >= 0, with `draft_ids`: each row also scores its last `M` tokens (the
      prompt and output it may copy from: names, rare words, code identifiers outside
      `draft_ids`) through their rows of the model's whole output projection, so a draft can be
      any of `N + M` ids. Those rows come from `context_head`, or, where it is None, from the
      `embed` table (a tied model restricted by `restrict_output`). Static.
    context_head: None, or the model's whole output projection as a `[V, E]` table (float or
      quantized) for `context_vocab`: an untied model's rows, kept when `restrict_output`
      replaced its `lm_head` (`with_draft_vocab`).
    cache_dtype: None (the model's dtype), or the dtype of the draft model's KV cache, such as
      `"float8_e4m3fn"`: half a bfloat16 cache's memory, which is what lets a large batch fit a
      chip (docs/tpu.md). Entries are clipped into the type's range when written and widened to
      the model's dtype when attention reads them. Exact all the same: the drafts and their q come
      from the model's forwards over that cache, and q is what the verify uses; only the
      acceptance rate can change. Static.
  """

  model: Any
  confidence: float | None = dataclasses.field(default=None, metadata=dict(static=True))
  share_prompt: bool = dataclasses.field(default=False, metadata=dict(static=True))
  draft_ids: jax.Array | None = None
  context_vocab: int = dataclasses.field(default=0, metadata=dict(static=True))
  context_head: Any = None
  cache_dtype: str | None = dataclasses.field(default=None, metadata=dict(static=True))

  def __post_init__(self):
    object.__setattr__(self, "confidence", check_confidence(self.confidence))
    object.__setattr__(self, "cache_dtype", check_cache_dtype(self.cache_dtype))
    if not isinstance(self.context_vocab, int) or self.context_vocab < 0:
      raise ValueError(f"context_vocab must be an int >= 0, got {self.context_vocab!r}")
    if self.context_vocab and self.draft_ids is None:
      raise ValueError("context_vocab needs draft_ids (a restricted output projection)")

  def forwards_per_round(self, num_draft: int) -> int:
    return num_draft

  def init(self, tokens, lengths, buffer_len, prefill=None):
    batch = tokens.shape[0]
    if self.share_prompt and prefill is not None:
      target_cache = getattr(prefill, "cache", None)
      own = jax.eval_shape(lambda: self.model.init_cache(batch, buffer_len, self.cache_dtype))
      same = lambda a, b: (jax.tree.structure(a) == jax.tree.structure(b) and all(
          x.shape == y.shape for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))
      if target_cache is not None and same(target_cache, own):
        # A copy (in this cache's dtype): the target's cache and this one are separate buffers
        # in the loop state, which callers donate (`decode_stream`, `specjax.tuning.calibrate`).
        copy = lambda x, o: jnp.copy(x) if x.dtype == o.dtype else to_cache(x, o.dtype)
        return jax.tree.map(copy, target_cache, own).with_lengths(lengths - 1)
    cache = self.model.init_cache(batch, buffer_len, self.cache_dtype)
    # The target's prefill (one row of logits, chunks of a long prompt off CPU); only the cache
    # is kept.
    cache = model_prefill(self.model, tokens, cache, lengths).cache
    return cache.with_lengths(lengths - 1)  # the last prompt token is fed with the first draft

  # It tolerates rounds it was not asked to draft in (`AdaptiveDrafter` skips the drafter when no
  # row would draft): `propose` catches up on what it missed (`catch_up`).
  catches_up = True

  def catch_up(self, cache, sequence, lengths, width: int):
    """The cache fed the tokens it missed, up to `lengths - 2` (the last two are the round's first
    block): while some row lags, one forward of `width` tokens at each lagging row's
    `[cache.lengths, cache.lengths + width)` (rows that do not lag rewrite their last entries
    with the same tokens). A lag of `n` tokens costs `ceil(n / width)` forwards of `width`
    tokens: after a stretch of skipped rounds the drafts read the whole context again, not a gap
    in it. A `lax.while_loop`: no copy of the cache in a conditional branch, nothing run when
    no row lags."""
    def body(carry):
      cache, _ = carry
      lag = cache.lengths < lengths - 2
      start = jnp.where(lag, cache.lengths, jnp.minimum(cache.lengths, lengths - 1))
      out = self.model(gather_tokens(sequence, start, width), start, cache)
      caught = jnp.where(lag, jnp.minimum(start + width, lengths - 2), cache.lengths)
      return out.cache.with_lengths(caught), jnp.any(caught < lengths - 2)

    todo = jnp.any(cache.lengths < lengths - 2)
    cache, _ = jax.lax.while_loop(lambda carry: carry[1], body, (cache, todo))
    return cache

  # `propose` takes a `guide` (`specjax.drafters.grammar.Guide`): the drafts follow a grammar.
  guided = True

  def propose(self, cache, sequence, lengths, *, num_draft, sampling, seeds, limits=None,
              stop=None, guide=None):
    """The round's drafts (see the class docstring).

    With a `guide`, every draft is drawn from `guide.restrict(state, logits)`, the drafter's
    distribution restricted to what the row's automaton state allows there (`q'`, warped and
    restricted: drawn and reported with the identity warp), and the state advances along the
    drafts (`guide.advance`): the chain stays inside the grammar, so each draft is conditioned
    on the drafts before it as the verify will see them. The confidence stop still reads the
    raw logits."""
    cache = self.catch_up(cache, sequence, lengths, num_draft + 1)
    # Valid draft cache: what it has seen that is still in the sequence (rollback). After a
    # confidence stop the cache may hold more than that; `start` cuts it back.
    start = jnp.minimum(cache.lengths, lengths - 1)  # lengths - 2 or lengths - 1
    block = gather_tokens(sequence, start, 2)
    context = self._context(sequence, lengths)
    hidden = context is not None
    out = self.model(block, start, cache, return_hidden=hidden)
    pick = (lengths - 1 - start)[:, None, None]  # the logits after the last known token
    pick_row = lambda x: jnp.take_along_axis(x, pick, axis=1)[:, 0]
    logits = self._scores(pick_row(out.logits), pick_row(out.hidden) if hidden else None, context)
    cache = out.cache.with_lengths(lengths)
    ids = None  # the target ids of the draft logits' columns, [B, N (+ M)]
    if self.draft_ids is not None:
      ids = jnp.broadcast_to(self.draft_ids, (lengths.shape[0],) + self.draft_ids.shape)
      ids = ids if context is None else jnp.concatenate([ids, context[0]], axis=1)

    def draw(logits, positions, grammar=None):
      """(token, the full-vocabulary logits it was drawn from or None)."""
      if guide is not None:  # q' = the restriction to what `grammar` allows, drawn as it is
        full = logits if ids is None else self.full_logits(logits, ids)
        restricted, reported = guide.restrict(grammar, full)
        token = sample_token(restricted, guide.draw_sampling, seeds, positions, PURPOSE_DRAFT)
        return token, None if sampling.greedy else reported
      if ids is None:
        token = sample_token(logits, sampling, seeds, positions, PURPOSE_DRAFT)
        return token, None if sampling.greedy else logits
      if sampling.greedy:
        return jnp.take_along_axis(ids, first_argmax(logits)[:, None], axis=1)[:, 0], None
      full = self.full_logits(logits, ids)
      return sample_token(full, sampling, seeds, positions, PURPOSE_DRAFT), full

    def step(carry, i, token):
      cache, grammar = carry
      out = self.model(token[:, None], lengths + i - 1, cache, return_hidden=hidden)
      next_logits = self._scores(out.logits[:, 0], out.hidden[:, 0] if hidden else None, context)
      if guide is not None:
        grammar = guide.advance(grammar, token)
      return (out.cache, grammar), (*draw(next_logits, lengths + i, grammar), next_logits)

    grammar = None if guide is None else guide.state
    (cache, _), proposal = draft_chain(
        step, (cache, grammar), (*draw(logits, lengths, grammar), logits), num_draft,
        confidence=self.confidence, limits=limits, stop=stop)
    return cache, proposal

  def _context(self, sequence, lengths):
    """None, or `(recent [B, M], rows [B, M, E], valid [B, M])`: the row's last `M =
    context_vocab` tokens, their output-projection rows (the tied embedding's, dequantized) and
    which of them exist (a row shorter than `M` has fewer)."""
    if not self.context_vocab:
      return None
    width = self.context_vocab
    recent = gather_tokens(sequence, lengths - width, width)  # clipped at 0 for short rows
    valid = jnp.arange(width, dtype=jnp.int32)[None] >= (width - lengths)[:, None]
    recent = jnp.where(valid, recent, 0)
    table = self.model.params["embed"] if self.context_head is None else self.context_head
    rows = weights.embed(table, recent)  # [B, M, E]
    return recent, rows, valid

  def _scores(self, logits, hidden, context):
    """The draft vocabulary's logits `[B, N]`, then (with a context) the row's recent tokens'
    `[B, M]` (`-inf` where a row has none): `[B, N + M]`."""
    if context is None:
      return logits
    _, rows, valid = context
    extra = jnp.einsum("be,bme->bm", hidden, rows.astype(hidden.dtype),
                       preferred_element_type=jnp.float32)
    extra = _softcap(extra, self.model.config.final_logit_softcap)
    return jnp.concatenate([logits, jnp.where(valid, extra, -jnp.inf).astype(logits.dtype)], -1)

  def full_logits(self, logits: jax.Array, ids: jax.Array) -> jax.Array:
    """Draft-vocabulary logits `[B, n]` of ids `[B, n]` -> `[B, V]` (`-inf` elsewhere; an id
    listed twice keeps its larger logit, so the `-inf` of a missing context token never masks
    a real one)."""
    full = jnp.full(logits.shape[:-1] + (self.model.vocab_size,), -jnp.inf, logits.dtype)
    return full.at[jnp.arange(logits.shape[0])[:, None], ids].max(logits)

  def observe(self, state, scored, block, emitted, count, lengths):
    del scored, block, emitted, count, lengths
    return state


def self_drafter(target, bits: int = 8, group: int | None = None, *,
                 confidence: float | None = None, vocab=None, context: int = 0,
                 asymmetric: bool = False, embed_bits: int | None = None) -> ModelDrafter:
  """The target's own weights, quantized, as its drafter: speculation with no training at all.

  A copy of `target` with every projection (and the embedding / output projection) quantized
  per group (`specjax.quantize`), drafting as a `ModelDrafter`. On CPU its matmuls read int8 (a
  quarter of float32's bytes) or int4 through the CPU kernel; on TPU/GPU XLA dequantizes inside
  the dot. Exact like every draft model: the verify uses the copy's own (warped) distribution as
  q, so the output is the target's whatever the copy's error.
  It starts from the target's keys and values over the prompt (`ModelDrafter.share_prompt`):
  a decode runs one prefill, not two.

  It can be built inside the caller's `jax.jit` from traced weights (the current policy's copy,
  in a training-eval or RL step, then `specjax.decode` with it there): the quantization is
  `jax.numpy` (`specjax.quantize`) and the checks read shapes and settings only, so the copy is
  the one built outside, bit for bit. `vocab` is read on the host: concrete ids.

  Args:
    target: the target `specjax.Model` (any layout; call `for_platform()` first on CPU).
    bits: 8 (acceptance near 1 on the models measured) or 4 (cheaper, lower acceptance).
    group: input columns per scale (a positive multiple of 32 dividing the model's dimensions).
      None: `default_group(target, bits)` (int8: 64 where it divides the model's dimensions,
      else 32; int4: 32).
    confidence: the `ModelDrafter` confidence stop (None: every row drafts `num_draft`).
    vocab: None, or target ids (e.g. `specjax.tuning.draft_vocab.frequent_vocab`): the copy's
      output projection keeps only those rows (`restrict_output`), so a draft step reads
      `len(vocab)` of its `V` rows. Pays where the output projection is a large share of the
      weights (Gemma 3 270M: 168M of 268M parameters). A target token outside `vocab` is never
      drafted; the verify's residual still emits it, so the output stays the target's.
    context: with `vocab`, each row also scores its last `context` tokens
      (`ModelDrafter.context_vocab`): what it copies from its prompt stays draftable. Needs tied
      embeddings.
    asymmetric: int4 with a scale and an offset per group (`specjax.quantize`): a target whose
      weights were dequantized from 4-bit GGUF blocks with a minimum (Q4_1, Q4_K; SmolLM2's,
      most of Qwen2.5-Coder's) is reproduced to float32 rounding, so the int4 copy drafts about
      as well as an int8 one while reading 6 bits a weight instead of 8.
    embed_bits: None (as `bits`) or 8 / 4: the embedding's and output projection's width
      (`specjax.quantize`); e.g. `bits=4, asymmetric=True, embed_bits=8` copies SmolLM2's GGUF
      (Q4_1 layers, Q8_0 embedding) to float32 rounding.

  Raises:
    ValueError: unsupported `bits` or `group`, a group that does not divide a dimension, or a
      `vocab` that is not distinct ids in `[0, V)`, or a `context` without `vocab` or tied
      embeddings, or `asymmetric` with bits 8.
  """
  if not isinstance(context, int) or context < 0:
    raise ValueError(f"context must be an int >= 0, got {context!r}")
  if context and (vocab is None or not target.config.tie_embeddings):
    raise ValueError("context needs vocab and a target with tied embeddings (its embedding "
                     "table is the output projection the context rows are read from)")
  if group is None:
    group = default_group(target, bits)
  model = quantize(target, bits, group, asymmetric=asymmetric, embed_bits=embed_bits)
  drafter = ModelDrafter(model, confidence=confidence, share_prompt=True)
  return drafter if vocab is None else with_draft_vocab(drafter, vocab, context=context)


def with_draft_vocab(drafter: ModelDrafter, vocab, *, context: int = 0) -> ModelDrafter:
  """`drafter` (a `ModelDrafter`: a separate draft model or a self-drafter) drafting over the target
  ids `vocab` only: its model's output projection keeps those rows (`restrict_output`), so a draft
  step reads `len(vocab)` of its `V` rows. With `context`, each row also scores its last `context`
  tokens through their rows of the whole output projection (`ModelDrafter.context_vocab`): a
  tied model's embedding table, or an untied model's own `lm_head`, kept as
  `ModelDrafter.context_head` (a quantized head as it is; a float `[E, V]` one as a `[V, E]`
  copy). Exact like any drafter: a target token outside what the drafter can propose is still
  emitted, by the verify's residual or bonus sample.

  Raises:
    ValueError: `vocab` not distinct ids in `[0, V)`, an output projection already restricted,
      or `context` not an int >= 0.
  """
  if not isinstance(context, int) or context < 0:
    raise ValueError(f"context must be an int >= 0, got {context!r}")
  head = None
  params = drafter.model.params
  if context and not (drafter.model.config.tie_embeddings and "lm_head" not in params):
    head = params["lm_head"]  # kept `[V, E]`: quantized or panels as it is, a float copy else
    if not (quant.is_quantized(head) or panel_layout.is_panels(head)):
      head = jnp.asarray(head).T.copy()
  model, ids = restrict_output(drafter.model, vocab)
  return dataclasses.replace(drafter, model=model, draft_ids=ids, context_vocab=context,
                             context_head=head)


def restrict_output(model, ids):
  """`(model', ids [N] int32)`: `model` whose output projection keeps only the rows `ids`
  (sorted), so its logits are `[..., N]`: logit `j` is the logit of target id `ids[j]`.

  The restricted projection is the model's own rows (float or quantized), held as an untied
  `lm_head` (`tie_embeddings=False`; the input embedding stays whole), so layout changes
  (`stacked`, `for_platform`) keep it. Draft with it through `ModelDrafter(draft_ids=ids)`.

  Raises:
    ValueError: `ids` empty, not integers, repeated, or outside `[0, V)`; or `model`'s output
      projection already restricted.
  """
  import numpy as np

  vocab = model.config.vocab_size
  ids = np.asarray(ids)
  if ids.ndim != 1 or ids.shape[0] == 0 or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"vocab must be a non-empty 1-D array of token ids, got {ids.dtype} "
                     f"{ids.shape}")
  if ids.min() < 0 or ids.max() >= vocab:
    raise ValueError(f"vocab ids must lie in [0, {vocab}), got {ids.min()}..{ids.max()}")
  if np.unique(ids).shape[0] != ids.shape[0]:
    raise ValueError("vocab ids must be distinct")
  ids = np.sort(ids).astype(np.int32)
  p = model.params
  tied = model.config.tie_embeddings and "lm_head" not in p
  head = p["embed"] if tied else p["lm_head"]
  rows = jnp.asarray(ids)
  if quant.is_quantized(head):  # stored [V, E]
    if head.values.shape[0] != vocab:
      raise ValueError("the model's output projection is already restricted")
    head = head.map_rows(lambda a: a[rows])
  elif tied or panel_layout.is_panels(head):  # a float [V, E] -> the untied [E, N] to contract
    if head.shape[0] != vocab:
      raise ValueError("the model's output projection is already restricted")
    head = jnp.asarray(head[rows]).T.copy()  # a float array or panels (`PanelWeight`)
  else:  # float [E, V]
    if head.shape[1] != vocab:
      raise ValueError("the model's output projection is already restricted")
    head = jnp.asarray(head)[:, rows]
  config = dataclasses.replace(model.config, tie_embeddings=False)
  return dataclasses.replace(model, params=dict(p, lm_head=head), config=config), jnp.asarray(ids)


def default_group(target, bits: int) -> int:
  """The scale group `self_drafter` uses by default: 64 for int8 where 64 divides every quantized
  dimension (else 32), 32 for int4.

  An int8 scale per 64 columns instead of 32 reads fewer bytes per draft step and halves the
  kernel's per-group work, at the same acceptance (measured: docs/benchmarks.md, "The int8
  self-draft's scale group"). int4 keeps 32: its coarser steps need the finer scales.
  """
  return 64 if bits == 8 and not indivisible(target.config, 64) else 32
