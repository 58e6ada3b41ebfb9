"""Memory at long prompts on TPU: the compiled programs' temporaries grow linearly in the prompt.

`sj.generate` and `sj.decode` (a draft model, k = 4, T = 0.7 sampling) are compiled with libtpu's
compiler, ahead of time, for one v5e chip at the widths of Qwen2.5-Coder-1.5B (target) and 0.5B
(draft) with 2 layers each, in bfloat16, batch 1, at two prompt lengths `T` and `4 T`.
`memory_analysis()`'s temporaries must grow about 4x, not 16x: a prefill whose attention
materialized its `[heads, T, T]` scores (or whose output projection scored every prompt position)
grows quadratically. The tolerance: at most `LINEAR_BOUND` = 6x for the 4x longer prompt (linear
terms give about 4x, constant ones less; a quadratic term that is a fifth of the temporaries at `T`
already reaches 6.4x).

Skipped without libtpu (`pip install "jax[tpu]"`).
"""

import functools

import jax.numpy as jnp
import pytest

import specjax as sj

pytest.importorskip("libtpu")

from specjax.testing import tpu  # noqa: E402  (after the skip: the compile tier needs libtpu)

SHORT, LONG = 2048, 8192  # prompt lengths (LONG = 4 * SHORT)
NEW_TOKENS = 64
LINEAR_BOUND = 6.0  # temp(LONG) / temp(SHORT) at most; linear is about 4, quadratic 16
SAMPLING = sj.Sampling(temperature=0.7, top_k=50, top_p=0.9)


@functools.lru_cache(maxsize=None)
def _models():
  mesh = tpu.topology_mesh("v5e-1")
  target = tpu.abstract_model(tpu.with_layers(tpu.REAL_CONFIGS["qwen2.5-coder-1.5b"], 2), mesh,
                              jnp.bfloat16)
  draft = tpu.abstract_model(tpu.with_layers(tpu.REAL_CONFIGS["qwen2.5-coder-0.5b"], 2), mesh,
                             jnp.bfloat16)
  return mesh, target, draft


@functools.lru_cache(maxsize=None)
def _compiled(program: str, length: int) -> tpu.Compiled:
  mesh, target, draft = _models()
  tokens, rng = tpu.abstract_tokens(mesh, 1, length)
  if program == "generate":
    def run(target, tokens, rng):
      return sj.generate(target, tokens, rng, max_new_tokens=NEW_TOKENS, sampling=SAMPLING)
    return tpu.compile_call(run, target, tokens, rng, mesh=mesh)

  def run(target, draft, tokens, rng):
    return sj.decode(target, draft, tokens, rng, max_new_tokens=NEW_TOKENS, num_draft=4,
                     sampling=SAMPLING)
  return tpu.compile_call(run, target, draft, tokens, rng, mesh=mesh)


# `decode` (about 240 s for its two compiles at XLA's default effort) is `slow` for CI's time.
@pytest.mark.parametrize("program", ["generate", pytest.param("decode", marks=pytest.mark.slow)])
def test_temporaries_grow_linearly_in_the_prompt(program):
  short, long = _compiled(program, SHORT), _compiled(program, LONG)
  ratio = long.temp_bytes / short.temp_bytes
  gib = 1 << 30
  assert ratio <= LINEAR_BOUND, (
      f"{program}: temporaries {short.temp_bytes / gib:.2f} GiB at a {SHORT}-token prompt, "
      f"{long.temp_bytes / gib:.2f} GiB at {LONG} ({ratio:.1f}x for 4x the prompt; linear is "
      f"about 4x, quadratic 16x)")
  assert long.total_bytes < 16 * gib  # one v5e chip's HBM
