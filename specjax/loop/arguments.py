"""`decode`'s argument checks, shared by every entry point that runs rounds: `decode`,
`decode_stream`, SSD's loop (`specjax.loop.ssd`) and the audit.

Everything here runs before anything is traced, and raises a `ValueError` that names the
problem.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from specjax.constrain.compile import constraint_inputs
from specjax.core import validation
from specjax.core.validation import NEW_TOKEN_BUCKET
from specjax.drafters import as_drafter
from specjax.drafters.adaptive.drafter import AdaptiveDrafter
from specjax.drafters.grammar import GrammarDrafter
from specjax.drafters.grammar_tree import GrammarTreeDrafter
from specjax.drafters.ssd import SSDDrafter
from specjax.drafters.tree import tree_drafter
from specjax.loop.round import check_verify_widths
from specjax.trees.structure import TreeSpec
from specjax.verify.dispatch import check_verify_impl

__all__ = ["DEFAULT_NUM_DRAFT", "DecodeArguments", "check_decode_arguments", "resolve_num_draft"]


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
  if isinstance(draft, SSDDrafter):
    check_ssd_options(tree=tree, constraint=constraint, verify_widths=verify_widths,
                      verify_impl=verify_impl)
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
  if isinstance(drafter, SSDDrafter):
    drafter.branches(num_draft)  # its fan-out budget covers every outcome length k = 0 .. K
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




# What SSD's loop (`specjax.loop.ssd`) does not run, and why: each is an option of `decode`.
_SSD_UNSUPPORTED = {
    "tree": "SSD drafts chains of num_draft tokens per outcome branch",
    "constraint": "SSD's branches are drafted without a grammar",
    "verify_widths": "SSD verifies K drafts (a hit) or none (a miss): its rounds have no "
                     "variable width",
}


def check_ssd_options(*, tree, constraint, verify_widths, verify_impl) -> None:
  """Rejects the options of `decode` that SSD's loop does not run, naming each.

  Raises:
    ValueError: `tree=`, `constraint=` or `verify_widths=` given, or a `verify_impl` other than
      "auto" or "reference" (SSD's target half runs the reference rule on the served drafts' q).
  """
  given = dict(tree=tree, constraint=constraint, verify_widths=verify_widths)
  for name, value in given.items():
    if value is not None:
      raise ValueError(f"an SSDDrafter does not support {name}= ({_SSD_UNSUPPORTED[name]}): leave "
                       f"it out (got {name}={value!r})")
  if not (isinstance(verify_impl, str) and verify_impl in ("auto", "reference")):
    raise ValueError(f"an SSDDrafter verifies with the reference rule: verify_impl must be "
                     f"'auto' or 'reference', got {verify_impl!r}")
