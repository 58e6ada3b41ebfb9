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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from specjax.constrain.compile import constraint_inputs
from specjax.drafters.grammar import GrammarDrafter
from specjax.drafters.grammar_tree import GrammarTreeDrafter
from specjax.core import validation
from specjax.drafters.adaptive.drafter import AdaptiveDrafter
from specjax.drafters import as_drafter
from specjax.drafters.tree import tree_drafter
from specjax.loop.generate import prepare_generate
from specjax.loop.program import Program
from specjax.parallel.rules import rules_scope
from specjax.loop.round import check_verify_widths, draft_step, round_step, verify_block
from specjax.core.sampling import GREEDY, Sampling, row_seeds
from specjax.loop.state import DecodeOutput, DecodeState, finish, init_state
from specjax.core.tracing import TRACE_COUNTS
from specjax.core.validation import NEW_TOKEN_BUCKET
from specjax.verify.dispatch import check_verify_impl
from specjax.trees.structure import TreeSpec

__all__ = ["DecodeState", "NEW_TOKEN_BUCKET", "decode", "draft_step", "init_state",
           "prepare_decode", "verify_block"]


class DecodeArguments(NamedTuple):
  """`decode`'s arguments after validation."""

  drafter: Any
  tokens: jax.Array  # [B, T] int32
  lengths: jax.Array  # [B] int32
  rng: jax.Array  # one key or [B] keys
  max_new_tokens: int
  num_draft: int
  eos_ids: jax.Array  # [E] int32
  capacity: int  # max_new_tokens rounded up to the bucket
  widths: tuple[int, ...]  # compiled verify widths, sorted, ending in num_draft + 1


DEFAULT_NUM_DRAFT = 4


def resolve_num_draft(drafter, num_draft, *, verify_widths=None) -> tuple[int, tuple[int, ...]]:
  """`(k, verify widths)` from `decode`'s `num_draft` and `verify_widths`.

  None is `DEFAULT_NUM_DRAFT`, or an `AdaptiveDrafter`'s own `K`: the wrapper brings `K` and its
  widths, and a `num_draft` or `verify_widths` given beside it must equal them.

  Raises:
    ValueError: a bad count or width, or one that contradicts the `AdaptiveDrafter`'s.
  """
  if num_draft is not None:
    num_draft = validation.check_count(num_draft, "num_draft")
  if not isinstance(drafter, AdaptiveDrafter):
    num_draft = DEFAULT_NUM_DRAFT if num_draft is None else num_draft
    return num_draft, check_verify_widths(verify_widths, num_draft)
  k = drafter.max_draft
  widths = check_verify_widths(drafter.widths, k)
  if num_draft not in (None, k) or (verify_widths is not None
                                    and check_verify_widths(verify_widths, k) != widths):
    raise ValueError(f"an AdaptiveDrafter brings its own K = {k} and verify widths {widths}: "
                     f"leave num_draft and verify_widths out (got num_draft={num_draft!r}, "
                     f"verify_widths={verify_widths!r})")
  return k, widths


def check_decode_arguments(target, draft, tokens, rng, *, lengths, max_new_tokens, num_draft,
                           sampling, eos_id, verify_impl, verify_widths=None,
                           tree: TreeSpec | None = None, constraint=None) -> DecodeArguments:
  """Validates `decode`'s arguments before anything is traced (also used by `decode_stream`).

  Raises:
    ValueError: naming the problem (see `decode`).
  """
  validation.check_model(target, "target")
  if isinstance(draft, GrammarDrafter) and (constraint is not None or tree is not None):
    raise ValueError("draft is already a GrammarDrafter (it carries its grammar): leave "
                     "constraint= and tree= out")
  if isinstance(draft, GrammarTreeDrafter):
    if constraint is not None:
      raise ValueError("draft is already a GrammarTreeDrafter (it carries its grammar): leave "
                       "constraint= out")
    if tree != draft.spec:
      raise ValueError(f"a GrammarTreeDrafter drafts the trees of its own TreeSpec: pass "
                       f"tree={draft.spec!r} (got tree={tree!r})")
  if tree is None:
    drafter = as_drafter(draft)
    num_draft, widths = resolve_num_draft(drafter, num_draft, verify_widths=verify_widths)
    scratch = 0
  else:
    if num_draft is not None or verify_widths is not None:
      raise ValueError("with tree=, the tree spec sets the draft shape (TreeSpec.widths the "
                       "verify widths): leave num_draft and verify_widths out (got "
                       f"num_draft={num_draft!r})")
    drafter = draft if isinstance(draft, GrammarTreeDrafter) else tree_drafter(target, draft, tree)
    num_draft, widths = tree.depth, (tree.depth + 1,)
    scratch = drafter.extra_slots(num_draft)  # a round's tree block lies past the new tokens
  check_target = getattr(drafter, "check_target", None)
  if callable(check_target):  # a drafter built for one target (its widths, layers) checks it
    check_target(target)
  tokens, lengths = validation.check_tokens(tokens, lengths, target.vocab_size)
  max_new_tokens = validation.check_count(max_new_tokens, "max_new_tokens")
  if drafter.vocab_size is not None and drafter.vocab_size != target.vocab_size:
    raise ValueError(f"draft vocabulary ({drafter.vocab_size}) does not match the target's "
                     f"({target.vocab_size}): speculative decoding needs one shared tokenizer")
  # A tree's scratch already lies past the new tokens; a chain's last round may score up to k
  # positions past them, which a model must either survive or have reserved.
  reserve = lambda model: 0 if tree is not None else validation.reserved_positions(model,
                                                                                    num_draft)
  validation.check_context(lengths, tokens.shape[1], max_new_tokens + scratch, target.max_len,
                           "target", reserve(target))
  if drafter.max_len is not None:
    validation.check_context(lengths, tokens.shape[1], max_new_tokens + scratch,
                             drafter.max_len, "draft", reserve(getattr(drafter, "model", None)))
  rng = validation.check_rng(rng, tokens.shape[0])
  eos = validation.check_eos(eos_id, target.vocab_size)
  if constraint is not None and not drafter.plain:  # else `generate(..., constraint=)` runs
    grammar = constraint_inputs(constraint, tokens.shape[0], target.vocab_size)
    wrapper = GrammarDrafter if tree is None else GrammarTreeDrafter
    drafter = wrapper(drafter, grammar.tables, grammar.schema)
    eos = grammar.stop_ids(eos)
  eos_ids = jnp.array(eos, jnp.int32)
  validation.check_sampling(sampling)
  check_verify_impl(verify_impl, tree=tree is not None)
  capacity = validation.round_up(max_new_tokens, NEW_TOKEN_BUCKET)
  return DecodeArguments(drafter, tokens, lengths, rng, max_new_tokens, num_draft, eos_ids,
                         capacity, widths)


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
      law (why: `specjax.drafters.model`).
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
  target's distribution by definition.

  Raises:
    ValueError: naming the problem (see `decode`), before anything is traced.
  """
  args = check_decode_arguments(target, draft, tokens, rng, lengths=lengths,
                                max_new_tokens=max_new_tokens, num_draft=num_draft,
                                sampling=sampling, eos_id=eos_id, verify_impl=verify_impl,
                                verify_widths=verify_widths, tree=tree, constraint=constraint)
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

