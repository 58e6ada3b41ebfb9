"""Independent references for the grammar tests, in NumPy and outlines-core alone (nothing from
`specjax.constrain` but the compiled pattern and the stop ids): the masked warped law, and the
allowed set of a token prefix read off outlines-core's `Index`."""

import numpy as np
from scipy import stats as scipy_stats


def warp(x: np.ndarray, top_k, top_p) -> np.ndarray:
  """float64 `[V]` temperature-scaled logits -> keep mask of top-k then top-p (ties kept), by
  sorting: the k-th largest value, and the value at which the sorted cumulative mass of the
  top-k survivors first reaches `top_p`."""
  keep = x > -np.inf
  if top_k is not None and top_k < x.size:
    keep &= x >= np.sort(x)[::-1][top_k - 1]
  if top_p is not None and top_p < 1.0:
    values = np.sort(x[keep])[::-1]
    mass = np.cumsum(np.exp(values - values[0]))
    keep &= x >= values[np.argmax(mass >= top_p * mass[-1])]
  return keep


def masked_law(logits: np.ndarray, mask: np.ndarray, temperature: float, top_k=None,
               top_p=None) -> np.ndarray:
  """The contract's law for one row: the warped distribution restricted to `mask`, renormalized;
  where that restriction is empty, the masked logits warped instead. Greedy: one-hot argmax."""
  x = np.asarray(logits, np.float64)
  if temperature == 0:
    out = np.zeros(x.size)
    out[np.argmax(np.where(mask, x, -np.inf))] = 1.0
    return out
  x = x / temperature
  keep = warp(x, top_k, top_p) & mask
  if not keep.any():
    x = np.where(mask, x, -np.inf)
    keep = warp(x, top_k, top_p)
  weights = np.where(keep, np.exp(x - x[keep].max()), 0.0)
  return weights / weights.sum()


def completable(index, stop: int) -> set:
  """The Index's states from which one of its final states can be reached."""
  transitions = index.get_transitions()
  live, changed = set(index.get_final_states()), True
  while changed:
    changed = False
    for state, row in transitions.items():
      if state not in live and any(t != stop and n in live for t, n in row.items()):
        live.add(state)
        changed = True
  return live


class IndexWalk:
  """Walks outlines-core's `Index` of a constraint's pattern along emitted tokens: the allowed
  set is the Index's, less the stop id and tokens into states that cannot complete, plus every
  stop id in final states."""

  def __init__(self, constraint, tokenizer, vocab_size: int):
    import outlines_core
    # The outlines-core Vocabulary the constraint was built on (token bytes, stop ids left out).
    from specjax.constrain.compile import _vocabulary
    self.index = outlines_core.Index(constraint.pattern,
                                     _vocabulary(tokenizer, constraint.eos_ids))
    self.stops = constraint.eos_ids
    self.live = completable(self.index, self.stops[0])
    self.vocab_size = vocab_size

  def initial(self):
    return self.index.get_initial_state()

  def mask(self, state) -> np.ndarray:
    mask = np.zeros(self.vocab_size, bool)
    for token in self.index.get_allowed_tokens(state):
      if token not in self.stops and self.index.get_next_state(state, token) in self.live:
        mask[token] = True
    if self.index.is_final_state(state):
      mask[list(self.stops)] = True
    return mask

  def advance(self, state, token):
    return self.index.get_next_state(state, token)


def chi_square_pvalue(samples: np.ndarray, law: np.ndarray) -> float:
  """Goodness of fit of integer `samples` to `law` (cells with expected count < 5 pooled); a
  sample outside the law's support fails outright."""
  observed = np.bincount(samples, minlength=law.size).astype(np.float64)
  assert observed[law == 0].sum() == 0, "sampled a token the law gives probability 0"
  support = law > 0
  observed, expected = observed[support], law[support] * len(samples)
  small = expected < 5
  if small.any():
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
  expected *= observed.sum() / expected.sum()
  return float(scipy_stats.chisquare(observed, expected).pvalue)
