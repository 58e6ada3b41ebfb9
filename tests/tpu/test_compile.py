"""The compile tier: every specjax program compiles for TPU (libtpu's compiler, ahead of time).

Each case of `specjax.testing.tpu_cases.CASES` (generate; decode with every drafter; every tree
builder; decode_stream's and the audit's programs; the verify kernels called directly) is lowered
and compiled for abstract TPU devices with `specjax.testing.tpu.compile_call`: Mosaic's VMEM
budgets, block shapes and layouts and XLA:TPU's partitioner and memory are checked as on the
chip, with nothing allocated. A compiler rejection fails the test with the compiler's message
(`tpu.TpuCompileError`); nothing here is skipped or expected to fail, except that the whole
module is skipped without libtpu (`pip install "jax[tpu]"`).

Setup (`tpu_cases.Setup`): Qwen2.5-Coder 1.5B target and 0.5B draft widths, 2 layers each,
vocabulary 151,936, 64-token prompts, 32 new tokens, `Sampling(temperature=0.7, top_k=50,
top_p=0.9)`, k = 4. The Gemma 4 cases (`gemma4_generate`, `gemma4_assistant`) bring their own
target (`Case.target`): 4 layers at Gemma 4 E2B's widths, vocabulary 262,144.

Costs: seconds per compile, one process on a 2-core host that other work shared (load average 1
to 7 while measuring; an idle host is faster): `DEFAULT_SECONDS`, `MATRIX_SECONDS`.

**Default selection** (CI step 1): every case once on "v5e-1" (one v5e chip, Colab's TPU) at
batch 1, bfloat16, except `verify_sharded`, which needs a mesh that splits the vocabulary and runs
on "v5e-1x4"; the cases in `DEFAULT_COSTLY` (over 20 s, except the dynamic tree and the sharded
verify) move to `costly`. Measured: about 320 s for the default selection and 360 s for
`DEFAULT_COSTLY` (all 40 default-setup tests 11:18 in one process; 13:22, about 450 s and 350 s,
in a run at load average 5), before the two Gemma 4 cases joined `DEFAULT_COSTLY` (about 100 s
more, measured alone at load average 6).

**Costly** (CI step 2, `-m costly`), chosen by measured cost:
  * `test_case_compiles` for `DEFAULT_COSTLY` (the default setup);
  * `test_matrix` on the issue's table, "v5e-1x4" B = 8, "v6e-2x2" B = 64, "v5e-4x4" B = 64,
    plus "v5p-1x4" B = 8, bfloat16: `generate` and the verify kernels under `shard_map` at the
    chain's and the largest and dynamic trees' shapes on every topology, and the draft model's
    decode (the chain kernel and the vocabulary-sharded verify inside it) on v5e 4x4: the
    programs whose partitioning, rows per device and VMEM blocks change with the mesh and the
    chip. A decode compiles 5 to 20 times slower on these meshes than on one chip
    (`MATRIX_SECONDS`), so every other case there is `slow` (`-m slow`, before a release; not
    timed as a whole: at those ratios, hours per topology), as are the vocabulary-sharded verify
    called alone and the draft model's decode on the other three (`MATRIX_SLOW`);
  * `test_drafter_on_a_mesh` (under `-m slow`, for CI's time): the Gemma 4 assistant
    (`gemma4_assistant`, 151.1 s) and DFlash's sampled chain (`dflash`, 97.7 s) on "v5e-1x4"
    B = 8 at their real vocabularies (262,144 and 151,936; load average 6 to 6.5);
  * `test_dtype_and_vocab`: the draft model with float32 weights and with Llama's 128,256 and
    Gemma's 262,144 vocabularies (at the same widths) on "v5e-1" B = 1 (about 50 s); the same
    on "v6e-2x2" B = 64 (float32) and "v5e-1x4" B = 8 (vocabularies), and generate and the
    dynamic tree in every variant, under `slow`.

`test_vmem_overflow_is_a_compile_error` is the tier's negative control: a verify block forced
past v5e's VMEM must be rejected by the compiler, naming the kernel and the limit.

Compiler effort: the cases compile at XLA's `exec_time_optimization_effort` = `TIER_EFFORT` (-1,
the least time spent on the program's speed), which takes 18 to 55% off a compile (one process,
the two efforts alternating, twice each: on a quiet host `tree_dynamic` 44 -> 36 s, `hybrid` 23 ->
15 s, the v6e (2, 2) B = 64 `draft_model` 180 -> 86 s; at load average 3 `generate` 14.8 -> 8.8 s,
`self_int8` 83 -> 37 s). Mosaic still compiles every kernel and checks its VMEM and layouts, the
partitioner still runs and memory is still fitted; the buffers differ by under 5% (`draft_model`
1.370 against 1.367 GiB, `tree_dynamic` 1.395 against 1.382). The negative control, the memory
bounds (`test_memory.py`), the cache layout (`test_cache_layout.py`), the traffic bars
(`test_traffic.py`) and the benchmarks compile at XLA's default effort, so those programs are also
checked as a user's `jax.jit` compiles them.

Scheduling: every test here is one independent compile (no shared fixtures), and
`tests/conftest.py` has `pytest -n 2 --dist loadfile` hand them to the two workers one at a time,
instead of one worker taking the whole file.
"""

from __future__ import annotations

import dataclasses
import re
import time

import jax.numpy as jnp
import pytest

pytest.importorskip("libtpu")

from specjax.testing import tpu  # noqa: E402  (after the skip: the tier needs libtpu)
from specjax.testing import tpu_cases as tc  # noqa: E402
from specjax.kernels.blocks import MAX_CHUNK, BlockSizes  # noqa: E402
from specjax.kernels.fused_verify import fused_verify  # noqa: E402

DEFAULT = tc.Setup()  # "v5e-1", B = 1, bfloat16, V = 151,936
TIER_EFFORT = -1.0  # XLA's exec_time_optimization_effort for the cases (module docstring)

# Seconds to compile each case for its default setup (one process on a 2-core host shared with
# other work; `python -m pytest tests/tpu/test_compile.py --durations=0`).
DEFAULT_SECONDS: dict[str, float] = {
    "tree_sampled_without_replacement": 77.6, "tree_dynamic_eagle3": 75.9,
    "tree_sampled_eagle3": 43.4, "verify_sharded": 41.4, "tree_dynamic": 40.6,
    "tree_static": 31.4, "draft_vocab": 28.3, "tree_sampled": 27.9, "adaptive": 27.1,
    "audit_control": 23.8, "tree_static_eagle3": 22.3, "stream_round": 19.3, "self_int4": 18.9,
    "self_q4": 17.5, "tree_static_medusa": 17.3, "eagle3_parallel": 15.5, "self_int8": 13.6,
    "draft_model_confidence": 13.1, "hybrid": 10.9, "eagle3": 10.0, "mtp": 9.9, "medusa": 9.6,
    "tree_ngram": 9.1, "tree_ngram_suffix": 9.0, "draft_model": 8.5, "draft_model_kernel": 8.3,
    "stream_start": 7.6, "suffix": 5.5, "audit_scoring": 4.8, "generate": 4.7, "constrained": 17.0,
    "tree_verify_sampled_without_replacement": 4.4, "ngram": 3.9,
    # Measured at load average 0.7, alone (2026-12-08).
    "draft_model_fp8_cache": 9.8,
    # Measured at load average 4.3, beside "constrained" in 31.9 s in the same process.
    "constrained_tree": 33.8,
    # The Gemma 4 target (its own `Setup.target`; V = 262,144), at load average 6 to 6.5, in one
    # process with the two `test_drafter_on_a_mesh` cases.
    "gemma4_generate": 42.1, "gemma4_assistant": 57.7}
# Default-setup cases moved to `costly` for the default selection's time budget (every case over
# 20 s, except the two programs whose VMEM and gathers the tier first caught: the dynamic tree and
# the vocabulary-sharded verify). All 40 default-setup tests took 11:18 in one process.
DEFAULT_COSTLY: frozenset[str] = frozenset(
    name for name, seconds in DEFAULT_SECONDS.items()
    if seconds > 20 and name not in ("tree_dynamic", "verify_sharded"))

MATRIX = (("v5e-1x4", 8), ("v6e-2x2", 64), ("v5e-4x4", 64), ("v5p-1x4", 8))
# Seconds per compile on the matrix's topologies (bfloat16; same host as `DEFAULT_SECONDS`).
MATRIX_SECONDS = {
    "v5e-1x4": dict(generate=19.3, draft_model=71.1, ngram=37.1, eagle3=115.8, tree_dynamic=104.5,
                    fused_verify=4.7, fused_verify_point_mass=3.5, verify_sharded=43.7,
                    tree_verify_sampled_without_replacement=8.9, tree_verify_dynamic=2.1),
    "v5p-1x4": dict(generate=14.4, draft_model=95.7, ngram=37.6, eagle3=125.7, tree_dynamic=73.0,
                    fused_verify=6.2, fused_verify_point_mass=2.6, verify_sharded=58.4,
                    tree_verify_sampled_without_replacement=8.9, tree_verify_dynamic=1.9),
    "v6e-2x2": dict(generate=30.0, draft_model=165.5, ngram=90.5, eagle3=141.1,
                    tree_dynamic=100.4, fused_verify=8.5, fused_verify_point_mass=2.9,
                    verify_sharded=76.3, tree_verify_sampled_without_replacement=11.8,
                    tree_verify_dynamic=1.9),
    "v5e-4x4": dict(generate=13.9, draft_model=64.3, ngram=28.0, eagle3=110.4, tree_dynamic=90.6,
                    fused_verify=4.4, fused_verify_point_mass=2.6, verify_sharded=42.6,
                    tree_verify_sampled_without_replacement=8.8, tree_verify_dynamic=1.7),
}
# The cases `test_matrix` knows (CI's costly step runs them as `MATRIX_SLOW` allows; every other
# case on every topology runs under `-m slow`): generate, the draft model (the chain kernel inside
# decode), the vocabulary-sharded verify, and the kernels under `shard_map` (point-mass chain, the
# largest and the dynamic tree).
MATRIX_CASES = ("generate", "draft_model", "verify_sharded", "fused_verify",
                "fused_verify_point_mass", "tree_verify_sampled_without_replacement",
                "tree_verify_dynamic")
VARIANT_CASES = ("generate", "draft_model", "tree_dynamic")
DTYPE_SETUPS = (("v5e-1", 1), ("v6e-2x2", 64))
VOCAB_SETUPS = (("v5e-1", 1), ("v5e-1x4", 8))


def default_setup(case: tc.Case) -> tc.Setup:
  """The setup a case runs on in the default selection."""
  if case.needs_model_axis:
    return dataclasses.replace(DEFAULT, topology="v5e-1x4")
  return DEFAULT


def check_compiles(name: str, setup: tc.Setup) -> tpu.Compiled:
  """Compiles case `name` for `setup`; a compiler rejection fails the test with its message."""
  start = time.perf_counter()
  setup = tc.case_setup(name, setup)  # a Gemma 4 case's own target
  try:
    compiled = tc.compile_case(name, setup, effort=TIER_EFFORT)
  except tpu.TpuCompileError as error:
    pytest.fail(f"{name} [{setup.describe()}] does not compile for TPU:\n{error}", pytrace=False)
  print(f"\n{name} [{setup.describe()}]: compiled in {time.perf_counter() - start:.1f} s, "
        f"{compiled.total_bytes / 2**30:.2f} GiB per device")
  return compiled


# The DFlash drafter keeps one case at the real vocabulary in CI: its sampled chain (`dflash`,
# 31.6 s at load average 6) in the costly step on one chip (on "v5e-1x4" B = 8,
# `test_drafter_on_a_mesh`, under `-m slow`); its DDTree tree (63.8 s there) under `-m slow`.
# The EAGLE-3 head's three trees (47 to 140 s each at load average 4) are `slow` too, for CI's
# time: CI compiles every tree builder over the draft model and a head's static tree with Medusa.
# So are the constrained tree (75 s; the constrained chain stays), the audit's control program
# (37 s; its scoring program stays in the default selection) and the Gemma 4 target's `generate`
# (34 s; the Gemma 4 assistant's decode holds the same target forward).
DEFAULT_SLOW: frozenset[str] = frozenset({"tree_ddtree_dflash", "tree_static_eagle3",
                                          "tree_sampled_eagle3", "tree_dynamic_eagle3",
                                          "constrained_tree", "audit_control", "gemma4_generate"})
EXTRA_COSTLY: frozenset[str] = frozenset({"dflash"})


def _default_params():
  def marks(name):
    if name in DEFAULT_SLOW:
      return [pytest.mark.slow]
    return [pytest.mark.costly] if name in DEFAULT_COSTLY | EXTRA_COSTLY else []
  return [pytest.param(name, marks=marks(name), id=name) for name in tc.CASES]


@pytest.mark.parametrize("name", _default_params())
def test_case_compiles(name):
  check_compiles(name, default_setup(tc.CASES[name]))


def test_registry_describes_every_case():
  for name, case in tc.CASES.items():
    assert case.name == name
    assert case.description and "\n" not in case.description, name


# CI's time (90 minutes for every step on 2 cores) leaves the costly step `generate` and the
# kernels under `shard_map` on every topology, and the draft model's decode on the 16-chip v5e 4x4
# (4 hosts, B = 64); on the others (94 to 179 s each at effort -1) it is `slow`. The
# vocabulary-sharded verify called alone is `slow` on every topology (94 to 177 s each): the
# default selection compiles it on "v5e-1x4", and the draft model's decode holds the same verify
# under the same vocabulary split.
MATRIX_SLOW = frozenset([("verify_sharded", topology) for topology, _ in MATRIX]
                        + [("draft_model", topology) for topology, _ in MATRIX
                           if topology != "v5e-4x4"])


def _matrix_params():
  params = []
  for topology, batch in MATRIX:
    for name in tc.CASES:
      costly = name in MATRIX_CASES and (name, topology) not in MATRIX_SLOW
      params.append(pytest.param(topology, batch, name,
                                 marks=[pytest.mark.costly if costly else pytest.mark.slow],
                                 id=f"{topology}-B{batch}-{name}"))
  return params


@pytest.mark.parametrize("topology, batch, name", _matrix_params())
def test_matrix(topology, batch, name):
  check_compiles(name, dataclasses.replace(DEFAULT, topology=topology, batch=batch))


def _variant_mark(name, topology):
  """The draft model on one chip (the chain kernel's blocks depend on dtype and vocabulary) in
  CI's costly step; the other variants under `-m slow`."""
  return pytest.mark.costly if (name, topology) == ("draft_model", "v5e-1") else pytest.mark.slow


def _variant_params():
  params = []
  for name in VARIANT_CASES:
    for topology, batch in DTYPE_SETUPS:
      params.append(pytest.param(name, topology, batch, jnp.float32, None,
                                 marks=_variant_mark(name, topology),
                                 id=f"{name}-{topology}-B{batch}-f32"))
    for vocab in (tc.VOCABS["llama"], tc.VOCABS["gemma"]):
      for topology, batch in VOCAB_SETUPS:
        params.append(pytest.param(name, topology, batch, jnp.bfloat16, vocab,
                                   marks=_variant_mark(name, topology),
                                   id=f"{name}-{topology}-B{batch}-V{vocab}"))
  return params


@pytest.mark.parametrize("name, topology, batch, dtype, vocab", _variant_params())
def test_dtype_and_vocab(name, topology, batch, dtype, vocab):
  check_compiles(name, dataclasses.replace(DEFAULT, topology=topology, batch=batch, dtype=dtype,
                                           vocab=vocab))


# Drafters outside `MATRIX_CASES` compiled on a (1, 4) v5e mesh at B = 8 and their real
# vocabulary: the Gemma 4 assistant (its store layers' keys/values and ordered-embedding gathers
# beside the vocabulary split over "model") and DFlash's sampled chain.
# Under `-m slow` since CI's time budget ran out (235 and 155 s at load average 5 to 6); CI's
# costly step compiles both on one chip (`test_case_compiles`).
MESH_CASES = ("gemma4_assistant", "dflash")


@pytest.mark.slow
@pytest.mark.parametrize("name", MESH_CASES)
def test_drafter_on_a_mesh(name):
  check_compiles(name, dataclasses.replace(DEFAULT, topology="v5e-1x4", batch=8))


@pytest.mark.slow  # 148 s; CI compiles the constrained decode on one chip (`test_case_compiles`)
def test_constrained_decode_on_a_mesh():
  """The grammar-constrained decode on a (1, 4) v5e mesh (the vocabulary split over "model"):
  its masks are full-vocabulary `[B, k + 1, V]` arrays beside the sharded logits."""
  check_compiles("constrained", dataclasses.replace(DEFAULT, topology="v5e-1x4", batch=8))


def test_vmem_overflow_is_a_compile_error():
  """The negative control: `fused_verify` on float32 `[16, 7, 151936]` target and `[16, 6,
  151936]` draft logits with blocks of 8 rows x the whole vocabulary (two grid steps, so each
  block is double-buffered: about 150 MiB) cannot fit v5e's 128 MiB of VMEM, and the compiler
  must say so, naming the kernel. (`block_c` stays at the kernel's 2048-lane chunk: a body over
  the whole 151,936-lane tile at once takes Mosaic many minutes to compile before it fails.)"""
  batch, vocab, k = 16, tc.VOCABS["qwen"], 6
  setup = dataclasses.replace(DEFAULT, batch=batch)
  args = (setup.rows((batch, k + 1, vocab), jnp.float32),
          setup.rows((batch, k, vocab), jnp.float32), setup.rows((batch, k), jnp.int32),
          setup.rows((batch,), jnp.uint32), setup.rows((batch,), jnp.int32))
  blocks = BlockSizes(block_v=1 << 20, block_b=8, block_c=MAX_CHUNK)  # tile = whole vocabulary

  def fn(target, draft, tokens, seeds, positions):
    return fused_verify(target, draft, tokens, sampling=setup.sampling, seeds=seeds,
                        positions=positions, block_sizes=blocks)

  with pytest.raises(tpu.TpuCompileError) as raised:
    tpu.compile_call(fn, *args, mesh=setup.mesh)
  message = str(raised.value)
  assert "fused_verify" in message, message[:3000]
  assert re.search(r"memory space vmem|vmem capacity|scoped ?vmem", message, re.IGNORECASE), (
      message[:3000])
