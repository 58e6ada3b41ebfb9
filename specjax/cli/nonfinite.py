"""What the command line says when a call's target logits were not finite (`stats.nonfinite`).

`specjax.decode` and `specjax.generate` flag a row whose target logits held a NaN or an infinity
(broken weights, or an overflow): its tokens are then not the target's (an all-NaN model decodes to
token 0). `specjax generate` and `specjax demo` print `warning(rows)` and exit with
`NONFINITE_EXIT` when any row is flagged.
"""

from __future__ import annotations

import numpy as np

NONFINITE_EXIT = 1  # not 2: that is argparse's and `CliError`'s usage error


def nonfinite_rows(*stats) -> list[int]:
  """The rows flagged in any of `stats` (`DecodeStats`, or None for a call not made), sorted."""
  flagged = None
  for item in stats:
    if item is None:
      continue
    rows = np.asarray(item.nonfinite, bool).reshape(-1)
    flagged = rows if flagged is None else flagged | rows
  return [] if flagged is None else np.flatnonzero(flagged).tolist()


def warning(rows: list[int]) -> str:
  """One line naming the flagged `rows`."""
  which = f"row{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows))}"
  return (f"warning: the target's logits were not finite ({which}): the weights may be broken; "
          "the tokens printed are not the target's")
