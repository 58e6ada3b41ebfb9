"""Drafters: the `Drafter` protocol and the built-in drafters.

A draft model (`ModelDrafter`, `self_drafter`, `with_draft_vocab`), prompt lookup
(`NGramDrafter`), suffix drafting (`SuffixDrafter` over a `SuffixCorpus`), feature heads
(`EagleDrafter`, `load_eagle3`, `MedusaDrafter`: `specjax.drafters.eagle`,
`specjax.drafters.medusa`), prompt lookup in front of one (`HybridDrafter`), DFlash block
drafters (`DFlashDrafter`, `load_dflash`: `specjax.drafters.dflash`, with DDTree trees), Gemma 4
assistants (`Gemma4AssistantDrafter`, `load_gemma4_assistant`: `specjax.drafters.gemma4_assistant`)
and the draft of speculative speculative decoding (`SSDDrafter`: `specjax.decode` runs its own
loop).
Adaptive draft length is `specjax.drafters.adaptive`.
"""

from specjax.drafters.base import DEFAULT_MEMBERS, REQUIRED_MEMBERS, Drafter
from specjax.drafters.dflash.checkpoint import load_dflash
from specjax.drafters.dflash.drafter import DFlashDrafter
from specjax.drafters.eagle.drafter import EagleDrafter
from specjax.drafters.gemma4_assistant.checkpoint import load_gemma4_assistant
from specjax.drafters.gemma4_assistant.drafter import Gemma4AssistantDrafter
from specjax.drafters.eagle.eagle3 import load_eagle3
from specjax.drafters.hybrid import HybridDrafter
from specjax.drafters.medusa.drafter import MedusaDrafter
from specjax.drafters.model import ModelDrafter, self_drafter, with_draft_vocab
from specjax.drafters.ngram import NGramDrafter
from specjax.drafters.ssd import SSDDrafter
from specjax.drafters.proposal import Proposal
from specjax.drafters.suffix import SuffixCorpus, SuffixDrafter

__all__ = ["DFlashDrafter", "Drafter", "EagleDrafter", "Gemma4AssistantDrafter", "HybridDrafter",
           "MedusaDrafter", "ModelDrafter", "NGramDrafter", "Proposal", "SSDDrafter",
           "SuffixCorpus", "SuffixDrafter", "as_drafter", "load_dflash", "load_eagle3",
           "load_gemma4_assistant", "self_drafter", "with_draft_vocab"]


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
