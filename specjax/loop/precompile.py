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

import contextvars
import functools

import jax

from specjax.parallel.mesh import under_auto_axes

_COMPILING: contextvars.ContextVar[bool] = contextvars.ContextVar("specjax_precompile",
                                                                  default=False)
_PRECOMPILABLE: set = set()  # `specjax.decode` and `specjax.generate` (`precompilable`)


def precompilable(fn):
  """Marks `fn` (an entry point whose program runs through `run_jitted`) as one `precompile`
  takes."""
  _PRECOMPILABLE.add(fn)
  return fn


class _Compiled(Exception):
  """Carries the compiled executable out of the call `precompile` made."""

  def __init__(self, compiled):
    super().__init__("specjax.precompile")
    self.compiled = compiled


def run_jitted(jitted, static: dict, *args):
  """`jitted(*args, **static)` (under `jax.sharding.auto_axes` where `under_auto_axes` says so),
  or, inside `precompile`, its compiled executable handed to `precompile` without running it."""
  fn = functools.partial(jitted, **static)
  wrapped = under_auto_axes(fn)
  if not _COMPILING.get():
    return wrapped(*args)
  if wrapped is not fn:
    raise ValueError("specjax.precompile: inside a trace on a mesh with Explicit axes the "
                     "caller's own jit compiles the program; call precompile outside it")
  raise _Compiled(jitted.lower(*args, **static).compile())


def precompile(fn, *args, **kwargs) -> jax.stages.Compiled:
  """Compiles the program `fn(*args, **kwargs)` would run (`fn` is `specjax.decode` or
  `specjax.generate`) and caches it for that call, without running it.

  The arguments are checked as the call checks them. Where the call would run no program of its
  own (a `specjax.decode` whose `AdaptiveDrafter` plans plain steps runs `specjax.generate`), the
  program it does run is compiled.

  Returns:
    The `jax.stages.Compiled` executable (its `cost_analysis()`, `as_text()`, ...).

  Raises:
    TypeError: `fn` is not `specjax.decode` or `specjax.generate`.
    ValueError: called inside a trace (the caller's `jax.jit` compiles the program there), or
      what the call itself raises for its arguments.
  """
  if fn not in _PRECOMPILABLE:
    raise TypeError(f"precompile takes specjax.decode or specjax.generate, got {fn!r}")
  if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((args, kwargs))):
    raise ValueError("specjax.precompile is called outside jax.jit: inside a trace the caller's "
                     "own jit compiles the program")
  token = _COMPILING.set(True)
  try:
    fn(*args, **kwargs)
  except _Compiled as done:
    return done.compiled
  finally:
    _COMPILING.reset(token)
  raise AssertionError(f"{fn.__name__} returned without reaching its compiled program")
