"""Broken twins of SSD's loop, for proving that its exactness tests can fail.

`decode_ssd_variant(target, drafter, tokens, rng, variant=..., **decode_kwargs)` runs
`specjax.decode`'s SSD program (the same checks, the same placement) with one step of the loop
replaced by a named bug (`specjax.loop.ssd.NEGATIVE_CONTROLS`):

* "k_only": the outcome cache keyed by k alone, ignoring t*, so a branch drafted after the wrong
  prefix is served, but verified with the q its drafts were drawn from. Speculative sampling is
  exact for any proposal distribution used consistently, so this twin is still exact (it accepts
  fewer drafts): a test must pass it.
* "k_only_realised_q": keyed by k alone, the served (wrong-prefix) drafts verified with q
  re-scored by the draft at the realised prefix: not exact.
* "unscaled_q": Saguaro sampling's drafts (C < 1) verified with the unscaled q: not exact.
* "wrong_branch_q": a hit verified with the q of the neighbouring branch slot: not exact.

The public `specjax.decode` and `specjax.loop.ssd.decode_ssd` have no way to select them.
"""

from __future__ import annotations

import dataclasses

from specjax.drafters.ssd import SSDDrafter
from specjax.loop.decode import prepare_decode
from specjax.loop.ssd import NEGATIVE_CONTROLS, SSDOutput

__all__ = ["VARIANTS", "decode_ssd_variant"]

VARIANTS = NEGATIVE_CONTROLS


def decode_ssd_variant(target, drafter: SSDDrafter, tokens, rng, *, variant: str,
                       **decode_kwargs) -> SSDOutput:
  """`specjax.decode(target, drafter, tokens, rng, **decode_kwargs)` run as the broken twin
  `variant`.

  Raises:
    ValueError: `variant` not in `VARIANTS`, a drafter that is not an `SSDDrafter`, or what
      `specjax.decode` raises for the arguments.
  """
  if variant not in VARIANTS:
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
  if not isinstance(drafter, SSDDrafter):
    raise ValueError(f"the SSD variants need an SSDDrafter, got {type(drafter).__name__}")
  program = prepare_decode(target, drafter, tokens, rng, **decode_kwargs)
  return dataclasses.replace(program, static={**program.static, "variant": variant}).run()
