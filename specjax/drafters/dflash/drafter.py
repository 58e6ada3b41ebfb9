"""`DFlashDrafter`: a DFlash block drafter (`specjax.drafters.dflash.network`) as a `Drafter`.

Invariant between rounds, per row with `L = lengths[b]`: the drafter's cache holds the keys and
values of the context entries of positions `0 .. L - 2`, each built from the *target's* features
of that position (taken from the target forward that scored it: the prefill, then each round's
verify; no extra target pass).

* `init` projects the prefill's taps into context entries (one per prompt position).
* `propose` runs the drafter once over the block `[token_{L-1}, MASK x (B - 1)]` at positions
  `L - 1 .. L + B - 2`; its slots `1 .. k` give the marginals `q_1 .. q_k` of positions
  `L .. L + k - 1`. The block always has the checkpoint's `block_size` slots (the drafter was
  trained on that shape; bidirectional attention makes later mask slots change earlier
  marginals), and `k <= block_size - 1` of them are proposed.
* `observe` writes the context entries of the round's verified block: block index `j < count`
  holds the target's features of position `lengths - 1 + j`, so the committed length becomes
  `lengths - 1 + count`. Entries past it (rejected drafts) are never read: rollback is the
  length, as for the target's cache.

Proposal modes (`mode`, static):

* `"argmax"`: every draft is the argmax of its marginal, proposed as a point mass (`q = None`).
  Exact at any temperature (the verify rule with a point-mass `q` emits `p` exactly).
* `"sampled"`: draft `x_i ~ warp(q_i)` with the `PURPOSE_DRAFT` stream of its position, and
  `q_i` handed to the verify. Each `q_i` is a marginal that does not depend on the earlier drafts
  of the round, so it is the law `x_i` was drawn from: exact. Greedy: the argmax, as above.

Trees: `TreeSpec(builder="ddtree")` (and "static" / "sampled") through
`specjax.drafters.dflash.tree`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.core.sampling import PURPOSE_DRAFT, first_argmax, sample_token
from specjax.drafters.base import Drafter
from specjax.drafters.dflash import network as dflash
from specjax.drafters.proposal import Proposal, check_confidence, proposed_count, top_probability

__all__ = ["DFlashDrafter", "DFlashState", "MODES"]

MODES = ("argmax", "sampled")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DFlashState:
  """The drafter's state between rounds (see the module docstring for the invariant)."""

  keys: jax.Array  # [N, B, S, KVH, D] context keys (normed, rotated) per drafter layer
  values: jax.Array  # [N, B, S, KVH, D]
  lengths: jax.Array  # [B] int32 committed context entries (L - 1)


def _write_rows(buffer: jax.Array, block: jax.Array, starts: jax.Array) -> jax.Array:
  """`buffer [N, B, S, ...]` with `block [N, B, T, ...]` written at slot `starts[b]` of row `b`."""
  def one(row, new, start):
    index = (0, start) + (0,) * (row.ndim - 2)
    return jax.lax.dynamic_update_slice(row, new.astype(row.dtype), index)
  return jax.vmap(one, in_axes=(1, 1, 0), out_axes=1)(buffer, block, starts.astype(jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DFlashDrafter(Drafter):
  """A DFlash block drafter for a target.

  Attributes:
    network: a `DFlashNetwork`.
    target_embed: `[V, H]` the target's input embedding (the block is embedded with it).
    target_head: `[H, V]` the target's output projection (the drafter's logits).
    mode: "argmax" or "sampled" (module docstring); static.
    confidence: None, or a threshold in (0, 1]: a row proposes only its leading drafts whose top
      probability under the drafter (temperature 1) is at least this; static.
  """

  network: dflash.DFlashNetwork
  target_embed: jax.Array
  target_head: jax.Array
  mode: str = dataclasses.field(default="argmax", metadata=dict(static=True))
  confidence: float | None = dataclasses.field(default=None, metadata=dict(static=True))

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"DFlashDrafter.mode must be one of {MODES}, got {self.mode!r}")
    object.__setattr__(self, "confidence", check_confidence(self.confidence))
    c = self.network.config
    embed = getattr(self.target_embed, "shape", None)  # absent for pytree placeholders
    head = getattr(self.target_head, "shape", None)
    if embed is not None and tuple(embed) != (c.vocab_size, c.embed_dim):
      raise ValueError(f"target_embed has shape {tuple(embed)}, the drafter expects "
                       f"[{c.vocab_size}, {c.embed_dim}] (the target's embedding)")
    if head is not None and tuple(head) != (c.embed_dim, c.vocab_size):
      raise ValueError(f"target_head has shape {tuple(head)}, the drafter expects "
                       f"[{c.embed_dim}, {c.vocab_size}] (the target's output projection)")

  @property
  def config(self) -> dflash.DFlashConfig:
    return self.network.config

  @property
  def taps(self) -> tuple[int, ...]:
    return self.network.config.taps

  @property
  def needs_hidden(self) -> bool:
    return self.network.config.reads_final

  @property
  def vocab_size(self) -> int:
    return self.network.config.vocab_size

  @property
  def max_draft(self) -> int:
    """A round drafts at most `block_size - 1` tokens (the mask slots of one block)."""
    return self.network.config.block_size - 1

  def forwards_per_round(self, num_draft: int) -> int:
    del num_draft
    return 1

  def check_target(self, target) -> None:
    """Raises a clear `ValueError` (before tracing) when `target` is not the model this drafter
    was built for: its width, vocabulary or layer count (`target_layer_ids`)."""
    c, tc = self.network.config, getattr(target, "config", None)
    if tc is None:
      return
    if tc.vocab_size != c.vocab_size:
      raise ValueError(f"the DFlash drafter's vocabulary ({c.vocab_size}) does not match the "
                       f"target's ({tc.vocab_size})")
    if tc.embed_dim != c.embed_dim:
      raise ValueError(f"the DFlash drafter's width (hidden_size {c.embed_dim}) does not match "
                       f"the target's embed_dim ({tc.embed_dim})")
    if c.num_target_layers is not None and c.num_target_layers != tc.num_layers:
      raise ValueError(f"the DFlash drafter was trained on a target with num_target_layers = "
                       f"{c.num_target_layers}, this target has {tc.num_layers} layers")
    if max(c.target_layer_ids) >= tc.num_layers:
      raise ValueError(f"target_layer_ids {list(c.target_layer_ids)} name layers past the "
                       f"target's {tc.num_layers}")

  def tree_drafter(self, target, spec):
    """This drafter's tree drafter for `spec` (`specjax.drafters.tree.tree_drafter` calls it)."""
    from specjax.drafters.dflash.tree import DFlashTreeDrafter, check_tree_spec
    self.check_target(target)
    check_tree_spec(self, spec)
    return DFlashTreeDrafter(self, spec)

  # ---------------------------------------------------------------------------------------------

  def _context(self, out, positions):
    features = dflash.gather_features(self.network.config, out.taps, out.hidden)
    return dflash.context_kv(self.network, dflash.project_context(self.network, features),
                             positions)

  def init(self, tokens, lengths, buffer_len, prefill):
    batch, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    keys, values = self._context(prefill, positions)  # [N, B, T, KVH, D]
    pad = ((0, 0), (0, 0), (0, buffer_len - width), (0, 0), (0, 0))
    return DFlashState(jnp.pad(keys, pad), jnp.pad(values, pad),
                       jnp.maximum(lengths - 1, 0).astype(jnp.int32))

  def block_logits(self, state: DFlashState, sequence, lengths, num: int | None = None,
                   causal: bool = False) -> jax.Array:
    """`[B, num, V]` float32 marginal logits of positions `L .. L + num - 1` (default all
    `block_size - 1`), from one forward over the block."""
    c = self.network.config
    num = c.block_size - 1 if num is None else num
    anchor = jnp.take_along_axis(sequence, (lengths - 1)[:, None].astype(jnp.int32), axis=1)
    block = jnp.concatenate(
        [anchor, jnp.full((anchor.shape[0], c.block_size - 1), c.mask_token_id, jnp.int32)],
        axis=1).astype(jnp.int32)
    embedded = jnp.take(self.target_embed, block, axis=0)
    positions = (lengths - 1)[:, None] + jnp.arange(c.block_size, dtype=jnp.int32)[None]
    visible = jnp.arange(state.keys.shape[2])[None] < state.lengths[:, None]
    hidden = dflash.block_hidden(self.network, embedded, positions, state.keys, state.values,
                                 visible, causal=causal)
    return dflash.output_logits(c, hidden[:, 1:1 + num], self.target_head)

  def propose(self, state, sequence, lengths, *, num_draft, sampling, seeds, limits=None,
              stop=None):
    if num_draft > self.max_draft:
      raise ValueError(f"num_draft ({num_draft}) exceeds what this DFlash drafter drafts in one "
                       f"block ({self.max_draft}: block_size - 1)")
    logits = self.block_logits(state, sequence, lengths, num_draft)  # [B, k, V]
    tokens, q = self.draft(logits, sampling, seeds, lengths)
    tops = top_probability(logits)
    return state, Proposal(tokens, q, proposed_count(tops, self.confidence, stop, limits), tops)

  def draft(self, logits, sampling, seeds, lengths):
    """Drafts from the block's marginals `[B, k, V]`: `(tokens [B, k], q logits or None)`."""
    if sampling.greedy or self.mode == "argmax":
      return first_argmax(logits).astype(jnp.int32), None
    positions = lengths[:, None] + jnp.arange(logits.shape[1], dtype=jnp.int32)[None]
    tokens = sample_token(logits, sampling, seeds[:, None], positions, PURPOSE_DRAFT)
    return tokens.astype(jnp.int32), logits

  def observe(self, state, scored, block, emitted, count, lengths):
    del block, emitted
    width = (scored.taps if scored.taps is not None else scored.hidden[None]).shape[2]
    positions = (lengths - 1)[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
    keys, values = self._context(scored, positions)
    starts = lengths - 1
    kept = count > 0  # rows that are done keep their state
    return DFlashState(_write_rows(state.keys, keys, starts),
                       _write_rows(state.values, values, starts),
                       jnp.where(kept, lengths - 1 + count, state.lengths).astype(jnp.int32))
