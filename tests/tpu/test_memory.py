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


# Full depth (28 + 24 layers), about 60 s and 135 s of compiling at XLA's default effort: CI's
# costly step.
@pytest.mark.costly
def test_the_batch64_pair_fits_one_v5e_chip_with_an_8bit_draft_cache():
  """The Qwen2.5-Coder 1.5B + 0.5B decode at batch 64, 3,584 + 512 tokens, on one v5e chip
  (`benchmarks.tpu_memory`'s case, compiled the same way): with the draft model's KV cache in
  float8_e4m3fn it fits 16 GiB, KV caches included. Its twin, the same decode with the draft
  cache in bfloat16, must not fit, and must need at least the bytes the 8-bit cache saves more."""
  from benchmarks import tpu_memory  # noqa: PLC0415  (a benchmark's case, not the library's)
  case = next(c for c in tpu_memory.CASES if c.name == "qwen-1.5b+0.5b v5e-1 B=64 3584+512")
  narrow = tpu_memory.compile_case(case, "decode-fp8")
  wide = tpu_memory.compile_case(case, "decode")
  gib = 1 << 30
  assert narrow["status"] == wide["status"] == "ok", (narrow.get("message"), wide.get("message"))
  saved = wide["kv_cache_bytes"] - narrow["kv_cache_bytes"]  # half the draft model's cache
  assert saved > 1.5 * gib
  assert narrow["fits"], f"{narrow['total_bytes'] / gib:.2f} GiB on a 16 GiB chip"
  assert not wide["fits"], (
      f"the bfloat16 draft cache now fits ({wide['total_bytes'] / gib:.2f} GiB): update the "
      "README's memory table and this twin")
  assert wide["total_bytes"] - narrow["total_bytes"] >= saved
