"""Speculative decoding: one jit, one `lax.while_loop` over draft/verify rounds, fixed shapes.

Each round every live row drafts `k` tokens, the target verifies them in one forward pass over `k +
1` positions, and the row appends its accepted drafts plus one target token
(`specjax.loop.round.round_step`). Rows accept different numbers of tokens per round and each
advances by its own count: nothing advances a batch by its minimum acceptance.

Invariants at the start of a round, per row `b` with `L = lengths[b]`:
  * `tokens[b, :L]` is the prompt plus everything generated so far;
  * the target cache holds keys/values for `tokens[b, :L - 1]` (the last token is fed together with
    the drafts, which gives the target's distribution at all `k + 1` positions);
  * the drafter's state holds some prefix of `tokens[b, :L - 1]` and catches up by itself.
"""

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp

from specjax.core import validation
from specjax.core.sampling import GREEDY, Sampling, row_seeds
from specjax.core.tracing import TRACE_COUNTS
from specjax.core.validation import NEW_TOKEN_BUCKET
from specjax.drafters.ssd import SSDDrafter
from specjax.loop.arguments import (DEFAULT_NUM_DRAFT, DecodeArguments,  # noqa: F401 (their
                                    check_decode_arguments, resolve_num_draft)  # earlier home)
from specjax.loop.generate import prepare_generate
from specjax.loop.program import Program
from specjax.loop.round import draft_step, round_step, verify_block
from specjax.loop.ssd import prepare_ssd
from specjax.loop.state import DecodeOutput, DecodeState, finish, init_state
from specjax.parallel.rules import rules_scope
from specjax.trees.structure import TreeSpec

__all__ = ["DecodeState", "NEW_TOKEN_BUCKET", "decode", "draft_step", "init_state",
           "prepare_decode", "verify_block"]


def decode(target, draft, tokens, rng, *, lengths=None, max_new_tokens: int = 64,
           num_draft: int | None = None, sampling: Sampling = GREEDY,
           eos_id: int | tuple[int, ...] | None = None,
           pad_id: int | None = None, verify_impl: str = "auto",
           tree: TreeSpec | None = None,
           verify_widths: tuple[int, ...] | None = None, constraint=None,
           return_logprobs: bool = False) -> DecodeOutput:
  """Speculative decoding: the target's exact output distribution in fewer target passes.

  Args:
    target: the target `specjax.Model` (p).
    draft: the drafter (q): a smaller `specjax.Model`, or any `Drafter` such as
      `specjax.NGramDrafter()`. One built with `confidence=c` (`specjax.ModelDrafter(model,
      confidence=c)`, `EagleDrafter`, `MedusaDrafter`) stops drafting a row at its first draft
      whose top probability is below `c`: fewer drafts where it is unsure, the same exact output
      law (why: `specjax.drafters.model`). A `specjax.drafters.SSDDrafter` runs speculative
      speculative decoding (`specjax.loop.ssd`): the next round's drafts are prepared for the
      likely verification outcomes while the target verifies, on one device or, with the
      drafter's `mesh=` (a `role` axis of size 2), on devices of their own; the output is then an
      `SSDOutput` (these fields, and the outcome cache's `ssd` statistics). It takes no `tree`,
      `constraint` or `verify_widths`, `verify_impl` "auto" or "reference" only, and no
      `return_logprobs`.
    tokens: `[B, T]` int prompt ids, right-padded.
    rng: a JAX PRNG key, or a `[B]` array of keys (one per row). Row `b`'s random stream is
      seeded by `fold_in(rng, b)` or by its own key, and keyed by token position: a row's tokens
      depend only on its own key and prompt, not on its batch slot or neighbours.
    lengths: `[B]` prompt lengths; None = every row is `T` long.
    max_new_tokens: new tokens per row at most.
    num_draft: draft tokens per round (`k`), an int; None: 4, or the `max_draft` (`K`) of a
      `specjax.drafters.adaptive.AdaptiveDrafter`. To pick `k` from measured costs, pass
      `specjax.drafters.adaptive.auto_num_draft(draft, calibration=DIR)`'s `num_draft` and
      `widths`; to let every row draft its own `k` in `0 .. K` each round, pass
      `specjax.adaptive_drafter(draft, calibration=DIR)` as `draft` (it brings `K` and its verify
      widths; where drafting cannot beat a plain step, `AdaptivePlan.plain`, this runs
      `specjax.generate`).
    sampling: applied identically to target and draft; temperature 0 is greedy and returns exactly
      `specjax.generate`'s tokens.
    eos_id: a row stops after emitting it (or any id of a sequence of them); the stop token is
      included in the output; None = never.
    pad_id: fills the output after each row's end; defaults to the target config's `pad_id`.
    verify_impl: "auto", "reference", "kernel" or "interpret" (see
      `specjax.verify.dispatch.verify_tokens`).
    tree: a `specjax.TreeSpec` drafts a tree of continuations per round instead of a chain of
      `num_draft` tokens, in the same loop (`specjax.drafters.tree`: one target pass over the
      tree with an ancestor mask, exact tree verification, the accepted branch compacted in the
      cache). `draft` is then a draft model, a feature head (`EagleDrafter` for static, sampled
      and dynamic trees, `MedusaDrafter` for static and sampled ones) or, for
      `TreeSpec(builder="ngram")`, anything (None included). `verify_impl` picks the tree rule's
      implementation (also "pallas": the fused kernel, interpreted on CPU; the fused Pallas tree
      kernel on TPU/GPU under "auto"); leave `num_draft` and `verify_widths` out
      (`TreeSpec.widths` sets the tree's verify widths);
      `stats.accepted_per_position` is then `[B, depth]`.
    verify_widths: compiled verify widths (each in `[1, k + 1]`; `k + 1` is always added) for a
      drafter that stops rows early (`confidence=`): each round the target's forward runs at the
      smallest width holding every live row's drafts plus one, chosen on device (`lax.switch`).
      None = `k + 1` only (an `AdaptiveDrafter`'s own widths, which these must equal).
    constraint: a `specjax.Constraint` (`specjax.constrain.json_schema` / `regex`) for every
      row, or a sequence of `B` of them, or None. The output then follows exactly
      `specjax.generate(..., constraint=)`'s law (greedy: its tokens): the drafts follow the
      grammar (`specjax.drafters.grammar.GrammarDrafter` wraps the drafter; tokens the
      grammar forces are drafted for free, `stats.forced`), and the verify restricts the target's
      distribution at each position to what the row's automaton allows there. With `tree=`,
      every tree builder and tree drafter (`specjax.drafters.grammar_tree.GrammarTreeDrafter`
      wraps it): the builder draws or ranks each node's children from the draft's distribution
      restricted by that node's state, nodes the grammar does not allow are dropped, and the
      tree verify restricts the target's distribution at every node by its state
      (`stats.forced`: emitted path nodes whose parent allowed one token). The constraint's stop
      ids join `eos_id`.
    return_logprobs: also return each new token's log-probability under the target,
      `log_softmax(logits / T)[token]` over the whole vocabulary (T = 1 when greedy; no top-k /
      top-p; under a constraint, the unconstrained logits), taken from the logits the verify
      scored it with: no extra forward (`DecodeOutput.logprobs`).

  Returns:
    `DecodeOutput(tokens [B, max_new_tokens], num_tokens [B], stats, logprobs)` (logprobs None
    unless `return_logprobs`).

  Works on one device and on any mesh the weights live on (`jax.make_mesh` with Explicit axes,
  `specjax.make_mesh` with Auto axes, or a mix), inside or outside `jax.set_mesh`.
  """
  return prepare_decode(target, draft, tokens, rng, lengths=lengths,
                        max_new_tokens=max_new_tokens, num_draft=num_draft, sampling=sampling,
                        eos_id=eos_id, pad_id=pad_id, verify_impl=verify_impl, tree=tree,
                        verify_widths=verify_widths, constraint=constraint,
                        return_logprobs=return_logprobs).run()


def prepare_decode(target, draft, tokens, rng, *, lengths=None, max_new_tokens: int = 64,
                   num_draft: int | None = None, sampling: Sampling = GREEDY,
                   eos_id: int | tuple[int, ...] | None = None, pad_id: int | None = None,
                   verify_impl: str = "auto", tree: TreeSpec | None = None,
                   verify_widths: tuple[int, ...] | None = None, constraint=None,
                   return_logprobs: bool = False) -> Program:
  """`decode`'s checks, and the program the call runs (`specjax.precompile` compiles it).

  Takes `decode`'s arguments. Where the drafter is `plain` (drafting cannot beat a plain step:
  `AdaptivePlan.plain`) the program is `specjax.generate`'s: the target's own loop, which is the
  target's distribution by definition. Where it is an `SSDDrafter`, the program is SSD's loop
  (`specjax.loop.ssd.prepare_ssd`).

  Raises:
    ValueError: naming the problem (see `decode`), before anything is traced.
  """
  args = check_decode_arguments(target, draft, tokens, rng, lengths=lengths,
                                max_new_tokens=max_new_tokens, num_draft=num_draft,
                                sampling=sampling, eos_id=eos_id, verify_impl=verify_impl,
                                verify_widths=verify_widths, tree=tree, constraint=constraint)
  if isinstance(args.drafter, SSDDrafter):  # its own loop: two halves and an exchange per round
    return prepare_ssd(target, args, sampling=sampling, pad_id=pad_id,
                       return_logprobs=return_logprobs)
  if args.drafter.plain:
    return prepare_generate(target, tokens, rng, lengths=lengths, max_new_tokens=max_new_tokens,
                            sampling=sampling, eos_id=eos_id, pad_id=pad_id,
                            constraint=constraint, return_logprobs=return_logprobs)
  static = dict(sampling=sampling, num_draft=args.num_draft, capacity=args.capacity,
                pad_id=validation.resolve_pad_id(target, pad_id), verify_impl=verify_impl,
                widths=args.widths, classes=validation.pytree_classes(target, args.drafter))
  if return_logprobs:  # only where asked: the default program's cache key is unchanged
    static["logprobs"] = True
  inputs = (target, args.drafter, args.tokens, args.lengths, args.rng, args.eos_ids)
  return Program(_decode, inputs, static, args.max_new_tokens)


@functools.partial(jax.jit, static_argnames=("sampling", "num_draft", "capacity", "pad_id",
                                             "verify_impl", "widths", "rules", "classes",
                                             "logprobs"))
def _decode(target, drafter, tokens, lengths, rng, eos_ids, max_new_tokens, *, sampling,
            num_draft, capacity, pad_id, verify_impl, widths=None, rules=None,
            classes=(), logprobs: bool = False) -> DecodeOutput:
  del classes  # a cache key only (`validation.pytree_classes`)
  TRACE_COUNTS["decode"] += 1
  with rules_scope(rules):
    seeds = row_seeds(rng, tokens.shape[0])  # [B]
    state = init_state(target, drafter, tokens, lengths, max_new_tokens, eos_ids, seeds,
                       num_draft=num_draft, capacity=capacity, logprobs=logprobs)
    state = jax.lax.while_loop(
        lambda state: ~jnp.all(state.done),
        lambda state: round_step(target, drafter, state, num_draft=num_draft, sampling=sampling,
                                 verify_impl=verify_impl, widths=widths),
        state)
    return finish(state, capacity, pad_id)

