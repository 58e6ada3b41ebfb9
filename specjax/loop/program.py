"""A checked `decode` or `generate` call: its jitted program and the arguments it runs on.

`specjax.decode` and `specjax.generate` check their arguments and build a `Program`
(`specjax.loop.decode.prepare_decode`, `specjax.loop.generate.prepare_generate`); the call runs
it (`Program.run`) and `specjax.precompile` compiles it without running it (`Program.compile`).
Both go through the same mesh handling (`specjax.parallel.mesh.call_context`) with the same
arguments, so the executable `precompile` compiles is the one the call then finds in the jit
cache.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from specjax.core.outputs import DecodeOutput
from specjax.parallel.mesh import call_context, under_auto_axes

__all__ = ["Program"]


@dataclasses.dataclass(frozen=True)
class Program:
  """A `decode` or `generate` call after its checks.

  Attributes:
    jitted: the `jax.jit` program (`specjax.loop.decode._decode`, `specjax.loop.generate._generate`),
      called as `jitted(*inputs, max_new_tokens, **static, rules=...)`.
    inputs: its models, drafter and arrays (placed on the call's mesh by `call_context`).
    static: its static keyword arguments but `rules` (the call's sharding rules, which
      `call_context` reads).
    max_new_tokens: new tokens per row at most: the program's traced count, and the output
      columns the call returns (the program's buffers are rounded up to a bucket).
  """

  jitted: Callable[..., Any]
  inputs: tuple
  static: dict
  max_new_tokens: int

  def _bound(self, rules) -> Callable[..., Any]:
    return functools.partial(self.jitted, **self.static, rules=rules)

  def run(self) -> DecodeOutput:
    """Runs the program (under `jax.sharding.auto_axes` where `under_auto_axes` says so).

    Returns:
      `DecodeOutput(tokens [B, max_new_tokens], num_tokens [B], stats)` on the caller's mesh.
    """
    with call_context(self.inputs) as call:
      run = under_auto_axes(self._bound(call.rules))
      out = run(*call.inputs, jnp.int32(self.max_new_tokens))
      cut = lambda x: None if x is None else x[:, :self.max_new_tokens]
      out = DecodeOutput(cut(out.tokens), out.num_tokens, out.stats, cut(out.logprobs))
      return call.output(out)

  def compile(self) -> jax.stages.Compiled:
    """Lowers and compiles the program for these arguments, without running it.

    Raises:
      ValueError: inside a trace on a mesh with Explicit axes (the caller's own jit compiles the
        program there).
    """
    with call_context(self.inputs) as call:
      bound = self._bound(call.rules)
      if under_auto_axes(bound) is not bound:
        raise ValueError("specjax.precompile: inside a trace on a mesh with Explicit axes the "
                         "caller's own jit compiles the program; call precompile outside it")
      return self.jitted.lower(*call.inputs, jnp.int32(self.max_new_tokens), **self.static,
                               rules=call.rules).compile()
