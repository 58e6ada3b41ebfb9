"""`Gemma4AssistantDrafter`: a Gemma 4 assistant (`specjax.drafters.gemma4_assistant.network`)
as a chain `Drafter` for its Gemma 4 target.

Invariant between rounds, per row with `L = lengths[b]` (the last token, at `L - 1`, is not yet
processed by the target):

* `state.keys` / `state.values` hold, per kind (global, window), the target's keys and values of
  its store layer (`ModelConfig.kv_store_layer`) at positions `0 .. L - 2` (`state.lengths =
  L - 1` valid slots), copied from the target forwards that computed them: the prefill, then each
  round's verify (its written cache, or its deferred `KVBlock`). No extra target pass.
* `state.hidden` is the target's final normed hidden state at position `L - 2` (zeros for a
  one-token prompt), from the same forwards (`needs_hidden`).

`propose` runs `k` assistant steps at the constant position `L - 1`: step 1 reads
`[embed(token_{L-1}); hidden]`, step `j + 1` reads `[embed(d_j); post_projection output of step
j]` (as `transformers`' `SinglePositionMultiTokenCandidateGenerator`). Greedy: each draft is the
argmax (a point mass, `q = None`). Sampling: `d_j ~ warp(q_j)` from the `PURPOSE_DRAFT` stream of
its position, and `q_j` (tokens outside the selected centroids at `MASKED_LOGIT`: probability 0) is
handed to the verify: the law `d_j` was drawn from, given the earlier drafts. Exact at any
temperature, as for any draft model.

`observe` writes the verified block's keys/values (block index `j` holds position `L - 1 + j`)
and keeps the hidden state of block index `count - 1` (position `L_new - 2`); rejected entries
lie past the new length and are never read.

Not built: trees (`tree_drafter` refuses them; a tree's verify does not hand the drafter the
target's keys and values).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from specjax.core.cache import write_block
from specjax.core.sampling import PURPOSE_DRAFT, first_argmax, sample_token
from specjax.drafters.base import Drafter
from specjax.drafters.gemma4_assistant import network as assistant
from specjax.drafters.proposal import Proposal, check_confidence, proposed_count, top_probability

__all__ = ["AssistantState", "Gemma4AssistantDrafter"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AssistantState:
  """The drafter's state between rounds (see the module docstring)."""

  keys: tuple  # per kind used (global first): [B, KVH, S, D] the target's keys
  values: tuple  # same layout
  lengths: jax.Array  # [B] int32 valid slots (L - 1)
  hidden: jax.Array  # [B, E_t] the target's final normed hidden state at L - 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Gemma4AssistantDrafter(Drafter):
  """A Gemma 4 assistant drafting for its target.

  Attributes:
    network: an `AssistantNetwork`.
    target_embed: `[V, E_t]` the target's input embedding (scaled by `sqrt(E_t)` when read, as
      the target scales it).
    source_layers: static, per kind the assistant uses (global first, then window), the target
      layer whose keys and values it attends: the last layer of that kind with keys and values of
      its own (`ModelConfig.kv_store_layer`; `load_gemma4_assistant` fills them in).
    confidence: None, or a threshold in (0, 1] on each draft's top probability; static.
  """

  network: assistant.AssistantNetwork
  target_embed: jax.Array
  source_layers: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  confidence: float | None = dataclasses.field(default=None, metadata=dict(static=True))

  taps = ()
  needs_hidden = True

  def __post_init__(self):
    object.__setattr__(self, "confidence", check_confidence(self.confidence))
    c = self.network.config
    if len(self.source_layers) != len(self.kinds):
      raise ValueError(f"source_layers names {len(self.source_layers)} target layers for the "
                       f"assistant's {len(self.kinds)} layer kinds")
    shape = getattr(self.target_embed, "shape", None)
    if shape is not None and tuple(shape) != (c.vocab_size, c.backbone_dim):
      raise ValueError(f"target_embed has shape {tuple(shape)}, the assistant expects "
                       f"[{c.vocab_size}, {c.backbone_dim}] (the target's embedding)")

  @property
  def kinds(self) -> tuple[bool, ...]:
    """The layer kinds the assistant uses, global (True) first."""
    return tuple(kind for kind in (True, False) if kind in self.network.config.layer_global)

  @property
  def vocab_size(self) -> int:
    return self.network.config.vocab_size

  def forwards_per_round(self, num_draft: int) -> int:
    return num_draft

  def check_target(self, target) -> None:
    """Raises a clear `ValueError` (before tracing) when `target` is not a Gemma 4 model this
    assistant fits: its family, width (`backbone_hidden_size`), vocabulary, head widths, or the
    layers it reads."""
    check_assistant_target(self.network.config, getattr(target, "config", None),
                           self.source_layers)

  def tree_drafter(self, target, spec):
    del target
    raise ValueError(f"Gemma4AssistantDrafter drafts chains only; TreeSpec(builder="
                     f"{spec.builder!r}) is not built for it")

  # ---------------------------------------------------------------------------------------------

  def init(self, tokens, lengths, buffer_len, prefill):
    del tokens
    cache = prefill.cache
    if cache is None or prefill.hidden is None:
      raise ValueError("Gemma4AssistantDrafter.init needs the target prefill's cache and hidden "
                       "states")
    committed = jnp.maximum(lengths - 1, 0).astype(jnp.int32)
    keys = tuple(_pad_slots(cache.k[i], buffer_len) for i in self.source_layers)
    values = tuple(_pad_slots(cache.v[i], buffer_len) for i in self.source_layers)
    return AssistantState(keys, values, committed, _hidden_at(prefill.hidden, lengths - 2))

  def step_inputs(self, state: AssistantState):
    """`(kv, visible)` for `assistant.assistant_step` from the state."""
    kv = {kind: (k, v) for kind, k, v in zip(self.kinds, state.keys, state.values)}
    every, window = assistant.window_visible(self.network.config, state.lengths,
                                             state.keys[0].shape[2])
    return kv, {True: every, False: window}

  def embed(self, tokens: jax.Array) -> jax.Array:
    """The target's scaled embedding of `tokens [B]`: `[B, E_t]`."""
    rows = jnp.take(self.target_embed, tokens, axis=0)
    return rows * jnp.asarray(math.sqrt(self.network.config.backbone_dim), rows.dtype)

  def chain(self, state, sequence, lengths, num_draft, sampling, seeds):
    """`k` assistant steps at position `L - 1`: `(tokens [B, k] int32, logits [B, k, V])`."""
    kv, visible = self.step_inputs(state)
    token = jnp.take_along_axis(sequence, (lengths - 1)[:, None].astype(jnp.int32), axis=1)[:, 0]
    hidden = state.hidden
    positions = (lengths - 1).astype(jnp.int32)
    tokens, logits = [], []
    for j in range(num_draft):
      step_logits, hidden, _ = assistant.assistant_step(self.network, self.embed(token), hidden,
                                                        positions, kv, visible)
      if sampling.greedy:
        token = first_argmax(step_logits).astype(jnp.int32)
      else:
        token = sample_token(step_logits, sampling, seeds, lengths + j,
                             PURPOSE_DRAFT).astype(jnp.int32)
      tokens.append(token)
      logits.append(step_logits)
    return jnp.stack(tokens, axis=1), jnp.stack(logits, axis=1)

  def propose(self, state, sequence, lengths, *, num_draft, sampling, seeds, limits=None,
              stop=None):
    tokens, logits = self.chain(state, sequence, lengths, num_draft, sampling, seeds)
    tops = top_probability(logits)
    q = None if sampling.greedy else logits
    return state, Proposal(tokens, q, proposed_count(tops, self.confidence, stop, limits), tops)

  def observe(self, state, scored, block, emitted, count, lengths):
    del block, emitted
    width = scored.hidden.shape[1]
    starts = (lengths - 1).astype(jnp.int32)
    if scored.block_kv is not None:  # a deferred write: the block's own keys/values
      new_k = [scored.block_kv.k[i] for i in self.source_layers]
      new_v = [scored.block_kv.v[i] for i in self.source_layers]
    else:  # the written cache: the block's slots `L - 1 ..`
      new_k = [_read_slots(scored.cache.k[i], starts, width) for i in self.source_layers]
      new_v = [_read_slots(scored.cache.v[i], starts, width) for i in self.source_layers]
    kept = count > 0  # rows that are done keep their state
    keys = tuple(write_block(buf, blk, starts) for buf, blk in zip(state.keys, new_k))
    values = tuple(write_block(buf, blk, starts) for buf, blk in zip(state.values, new_v))
    hidden = _hidden_at(scored.hidden, count - 1)
    return AssistantState(
        keys, values, jnp.where(kept, lengths - 1 + count, state.lengths).astype(jnp.int32),
        jnp.where(kept[:, None], hidden, state.hidden))


def _pad_slots(buffer, slots):
  """`[B, KVH, S, D]` padded (or cut) to `slots` slots."""
  have = buffer.shape[2]
  if have >= slots:
    return buffer[:, :, :slots]
  return jnp.pad(buffer, ((0, 0), (0, 0), (0, slots - have), (0, 0)))


def _read_slots(buffer, starts, width):
  """`[B, width, KVH, D]`: slots `starts[b] ..` of `buffer [B, KVH, S, D]` (clamped)."""
  index = jnp.clip(starts[:, None] + jnp.arange(width, dtype=jnp.int32), 0, buffer.shape[2] - 1)
  block = jnp.take_along_axis(buffer, index[:, None, :, None], axis=2)
  return block.swapaxes(1, 2)


def _hidden_at(hidden, index):
  """`[B, E]`: `hidden [B, T, E]` at `index [B]`, zeros where `index < 0`."""
  at = jnp.take_along_axis(hidden, jnp.maximum(index, 0)[:, None, None].astype(jnp.int32),
                           axis=1)[:, 0]
  return jnp.where((index >= 0)[:, None], at, 0).astype(hidden.dtype)


def check_assistant_target(c: assistant.AssistantConfig, tc, source_layers) -> None:
  """Raises a `ValueError` naming the field when target config `tc` does not fit assistant `c`."""
  if tc is None:
    return
  if not str(getattr(tc, "family", "")).startswith("gemma4"):
    raise ValueError(f"a Gemma 4 assistant drafts for a Gemma 4 target (gemma4_text); this "
                     f"target's family is {getattr(tc, 'family', None)!r}")
  if tc.embed_dim != c.backbone_dim:
    raise ValueError(f"the assistant's backbone_hidden_size ({c.backbone_dim}) does not match "
                     f"the target's width (embed_dim {tc.embed_dim})")
  if tc.vocab_size != c.vocab_size:
    raise ValueError(f"the assistant's vocabulary ({c.vocab_size}) does not match the target's "
                     f"({tc.vocab_size})")
  kinds = tuple(kind for kind in (True, False) if kind in c.layer_global)
  for kind, layer in zip(kinds, source_layers):
    name = "global" if kind else "window"
    if not 0 <= layer < tc.num_cache_layers or tc.is_global(layer) != kind:
      raise ValueError(f"the assistant reads the target's {name} keys/values from layer {layer}, "
                       f"which is not a {name} layer with keys and values of its own")
    head_dim = c.global_head_dim if kind else c.head_dim
    if tc.layer_head_dim(layer) != head_dim:
      raise ValueError(f"the assistant's {name} head_dim ({head_dim}) does not match the "
                       f"target's ({tc.layer_head_dim(layer)})")
    kv_heads = c.global_kv_heads if kind else c.num_kv_heads
    if tc.layer_kv_heads(layer) != kv_heads:
      raise ValueError(f"the assistant's {name} key/value heads ({kv_heads}) do not match the "
                       f"target's ({tc.layer_kv_heads(layer)})")
    if c.num_heads % kv_heads:
      raise ValueError(f"the assistant's num_attention_heads ({c.num_heads}) is not a multiple "
                       f"of the target's {name} key/value heads ({kv_heads})")
