"""Drafters: the `Drafter` protocol and the built-in drafters (a draft model, prompt lookup).

Feature heads live in `specjax.drafters.eagle.drafter`; `specjax.drafters.hybrid` puts prompt lookup in
front of one."""

from specjax.drafters.base import DEFAULT_MEMBERS, REQUIRED_MEMBERS, Drafter
from specjax.drafters.model import ModelDrafter, self_drafter, with_draft_vocab
from specjax.drafters.ngram import NGramDrafter
from specjax.drafters.suffix import SuffixCorpus, SuffixDrafter
from specjax.drafters.proposal import Proposal

__all__ = ["Drafter", "ModelDrafter", "NGramDrafter", "Proposal", "SuffixCorpus", "SuffixDrafter",
           "as_drafter", "self_drafter",
           "with_draft_vocab"]


def as_drafter(draft) -> Drafter:
  """A `specjax.Model` (or protocol-following model) becomes a `ModelDrafter`; drafters pass.

  Raises:
    ValueError: `draft` is neither a model nor a complete `Drafter`.
  """
  if isinstance(draft, Drafter):
    return draft
  if hasattr(draft, "init_cache") and hasattr(draft, "vocab_size"):
    return ModelDrafter(draft)
  if hasattr(draft, "propose"):
    missing = [name for name in REQUIRED_MEMBERS + DEFAULT_MEMBERS if not hasattr(draft, name)]
    raise ValueError(f"draft {type(draft).__name__} does not follow the Drafter protocol: no "
                     f"{', '.join(missing)} (subclass specjax.drafters.Drafter for the defaults "
                     "of the optional members; see specjax.drafters.base)")
  raise ValueError(f"draft must be a specjax.Model, a model following the specjax protocol, or a "
                   f"Drafter (e.g. specjax.NGramDrafter()), got {type(draft).__name__}")
