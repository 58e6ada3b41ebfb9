"""The decode loop: `state` (what a round carries), `round` (draft -> verify -> advance, chain or
tree), `decode` (the jitted `lax.while_loop`), `stream` (the same round, one host step at a time),
`generate` (plain decoding, the reference), `program` and `precompile` (a call's checked program,
run or compiled ahead).

Its pieces, for code that drives rounds itself: `init_state` builds the `DecodeState` (with the
target's `KVCache` and the row seeds of `row_seeds`), `round_step` is one round (`draft_step`,
then `verify_block`), and `DecodeStats` are its counters.
"""

from specjax.core.cache import KVCache
from specjax.core.outputs import DecodeStats
from specjax.core.sampling import row_seeds
from specjax.loop.round import draft_step, round_step, verify_block
from specjax.loop.state import DecodeState, init_state

__all__ = ["DecodeState", "DecodeStats", "KVCache", "draft_step", "init_state", "round_step",
           "row_seeds", "verify_block"]
