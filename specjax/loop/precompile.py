"""`specjax.precompile`: compile what a `decode` or `generate` call would run, without running it.

A first call of `specjax.decode` or `specjax.generate` traces and compiles its program, then runs
it. `precompile(fn, *args, **kwargs)` takes the same arguments, checks them exactly as the call
would (bad input fails here, before any compilation), compiles the program and caches it where
the call finds it: the later call with arguments of the same shapes, dtypes and static settings
runs at once. Nothing is generated, so a notebook or a server can pay the compilation up front
without paying a whole generation as well (the demo saves one decode and one generate this way).

The value `max_new_tokens` is an argument of the compiled program, not part of its shape: any
count in the same bucket of 64 (`specjax.core.validation.NEW_TOKEN_BUCKET`) reuses it.
"""

from __future__ import annotations

import jax

from specjax.loop.decode import decode, prepare_decode
from specjax.loop.generate import generate, prepare_generate

__all__ = ["precompile"]

# Each entry point and the step it shares with `precompile`: its checks and the program it runs.
_PREPARE = {decode: prepare_decode, generate: prepare_generate}


def precompile(fn, *args, **kwargs) -> jax.stages.Compiled:
  """Compiles the program `fn(*args, **kwargs)` would run (`fn` is `specjax.decode` or
  `specjax.generate`) and caches it for that call, without running it.

  The arguments are checked as the call checks them (the call's own preparation step,
  `prepare_decode` or `prepare_generate`). Where the call would run no program of its own (a
  `specjax.decode` whose `AdaptiveDrafter` plans plain steps runs `specjax.generate`), the
  program it does run is compiled.

  Returns:
    The `jax.stages.Compiled` executable (its `cost_analysis()`, `as_text()`, ...).

  Raises:
    TypeError: `fn` is not `specjax.decode` or `specjax.generate`.
    ValueError: called inside a trace (the caller's `jax.jit` compiles the program there), or
      what the call itself raises for its arguments.
  """
  prepare = _PREPARE.get(fn)
  if prepare is None:
    raise TypeError(f"precompile takes specjax.decode or specjax.generate, got {fn!r}")
  if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((args, kwargs))):
    raise ValueError("specjax.precompile is called outside jax.jit: inside a trace the caller's "
                     "own jit compiles the program")
  return prepare(*args, **kwargs).compile()
