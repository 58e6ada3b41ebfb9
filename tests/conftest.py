"""Test set-up: 8 simulated CPU devices (for sharding tests), float32, default matmul precision.

`JAX_PLATFORMS` defaults to `cpu`, except in a run that selects the compiled-kernel tests
(`pytest -m tpu` or `-m gpu` on a TPU VM or GPU machine), where JAX picks the accelerator.

No global `jax_default_matmul_precision` pin: the tests run at the precision users get (on CPU,
float32 matmuls are exact float32 either way; on TPU/GPU the greedy-identity tests then check what
users run). With `SPECJAX_STRICT_IMPORTS=1` (CI), a test module or test skipped because an
optional dependency could not be imported (the transformers peer, notebook tools) fails instead,
except the optional extras the `test` extra leaves out (`OPTIONAL_EXTRAS`: tunix).
"""

import os
import re

import pytest


def _accelerator_run(markexpr: str) -> bool:
  """Whether the mark expression selects the compiled-kernel tests (`-m tpu`, `-m "gpu or tpu"`):
  then JAX may pick the accelerator; otherwise everything runs on CPU's 8 simulated devices."""
  return bool(re.search(r"\b(tpu|gpu)\b", markexpr)
              and not re.search(r"\bnot\s+(tpu|gpu)\b", markexpr))


# XLA's backend (LLVM) optimization level for the tests' programs: SPECJAX_TEST_XLA_OPT_LEVEL,
# 0 unless set; "default" keeps XLA's own level. Compiling takes most of a test's time on CPU
# (about 80% of tests/loop/test_decode.py at XLA's default level), and level 0 roughly halves it;
# runs that are mostly compute (CI's slow step: large-N chi-squares, the real models) keep XLA's
# level. The level changes how fast the compiled code runs, not its semantics: float arithmetic
# stays IEEE float32 at every level (no fast-math), two of specjax's programs that a test compares
# are compiled the same way, and comparisons with torch, NumPy or the C++ kernel carry
# tolerances. An XLA_FLAGS that names a level wins.
# At level 0 the tests' programs also compile with XLA:CPU's older fusion emitters
# (`--xla_cpu_use_fusion_emitters=false`): they generate each fusion's loops directly instead of
# through the newer MLIR pipeline, and took 43 s of backend compiling where the newer ones took
# 107 s, on tests/loop/test_generate.py and a hybrid greedy test (154 -> 91 s wall, one process
# each, load average 5). Their arithmetic is float32 too, but some transcendental functions are
# approximated differently, so a comparison with torch can move by a few float32 ulps of the
# logits' scale; an XLA_FLAGS that names the flag wins.


def pytest_configure(config):
  # Before any test module imports jax (here, not at import time, so that pytest-xdist's workers,
  # whose command line is not pytest's, read the same mark expression).
  if not _accelerator_run(config.getoption("markexpr", "") or ""):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    level = os.environ.get("SPECJAX_TEST_XLA_OPT_LEVEL", "0")
    if "xla_backend_optimization_level" not in flags and level != "default":
      flags = f"{flags} --xla_backend_optimization_level={int(level)}".strip()
      if "xla_cpu_use_fusion_emitters" not in flags:
        flags += " --xla_cpu_use_fusion_emitters=false"
      os.environ["XLA_FLAGS"] = flags
  import jax
  jax.config.update("jax_num_cpu_devices", 8)


STRICT_IMPORTS = os.environ.get("SPECJAX_STRICT_IMPORTS", "") not in ("", "0")
# Libraries of optional extras that the `test` extra does not install: a test that needs one skips
# through `pytest.importorskip`, and that skip stays a skip. CI's steps 1-3 run without them; its
# last step installs `specjax[tunix]` and sets SPECJAX_OPTIONAL_EXTRAS="" so that there a missing
# tunix fails.
OPTIONAL_EXTRAS = tuple(os.environ.get("SPECJAX_OPTIONAL_EXTRAS", "tunix").split())


def _import_skip(report) -> bool:
  if not report.skipped or not isinstance(report.longrepr, tuple):
    return False
  reason = str(report.longrepr[-1])
  if any(f"could not import '{name}'" in reason for name in OPTIONAL_EXTRAS):
    return False
  return "could not import" in reason or "peer" in reason


def pytest_collectreport(report):
  if STRICT_IMPORTS and _import_skip(report):
    report.outcome = "failed"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  report = outcome.get_result()
  if STRICT_IMPORTS and _import_skip(report):
    report.outcome = "failed"


def _has_platform(platform: str) -> bool:
  import jax
  try:
    return bool(jax.devices(platform))
  except RuntimeError:
    return False


# Parametrizations that CI leaves to `pytest -m slow` for its time: every test function still
# runs in CI, in its cheapest parametrization and every one measured under 2 s (.ci/thin.py
# writes the list from measured runs and says which functions keep every parametrization).
THINNED_FILE = os.path.join(os.path.dirname(__file__), "ci_thinned.txt")


def thinned_node_ids() -> frozenset[str]:
  """The node ids in `THINNED_FILE` (lines "<seconds>\t<node id>"; "#" starts a comment)."""
  with open(THINNED_FILE, encoding="utf-8") as f:
    return frozenset(line.rstrip("\n").split("\t", 1)[1] for line in f
                     if line.strip() and not line.startswith("#"))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
  """Tests marked `tpu` / `gpu` (compiled kernels) run only where that device exists; the
  parametrizations in `THINNED_FILE` are `slow`."""
  del config
  thinned = thinned_node_ids()
  for item in items:
    if item.nodeid in thinned:
      item.add_marker(pytest.mark.slow)
  for platform in ("tpu", "gpu"):
    # The marker itself, not `item.keywords`: those also hold the test's package names, and the
    # TPU compile tier (tests/tpu) runs on any host.
    marked = [item for item in items if item.get_closest_marker(platform) is not None]
    if marked and not _has_platform(platform):
      backend = "cuda" if platform == "gpu" else platform
      skip = pytest.mark.skip(reason=f"needs a {platform.upper()} (where there is one, "
                                     f"`pytest -m {platform}` or JAX_PLATFORMS={backend},cpu "
                                     "selects it)")
      for item in items:
        if item.get_closest_marker(platform) is not None:
          item.add_marker(skip)


# Test files whose tests are independent compiles with no shared fixtures (the TPU compile tier:
# each test one program, minutes on the wider meshes). Under `--dist loadfile` (the README's
# command, CI's steps 1 and 2) every other file stays whole in one worker, so its module fixtures
# are built once; these are handed to whichever worker is free, test by test, so that one worker
# does not take a whole file of compiles while the other idles.
PER_TEST_FILES = ("tests/tpu/test_",)


def work_unit(nodeid: str) -> str:
  """The scheduler's unit of work for a test: its file, or the test itself in `PER_TEST_FILES`."""
  if nodeid.startswith(PER_TEST_FILES):
    return nodeid
  return nodeid.split("::", 1)[0]


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent without xdist
def pytest_xdist_make_scheduler(config, log):
  if config.getvalue("dist") != "loadfile":
    return None
  from xdist.scheduler import LoadFileScheduling

  class FilesWithTpuTestsSpread(LoadFileScheduling):
    def _split_scope(self, nodeid: str) -> str:
      return work_unit(nodeid)

  return FilesWithTpuTestsSpread(config, log)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops JAX's compiled programs after each test module, so that one long pytest process does
  not accumulate every module's executables (tests of 8-device meshes compile large programs)."""
  yield
  import jax
  jax.clear_caches()


@pytest.fixture(scope="session")
def chatml_tokenizer_dir(tmp_path_factory):
  """`make(template, corpus) -> directory`: a saved transformers tokenizer (byte-level BPE with
  `<|endoftext|>` / `<|im_start|>` / `<|im_end|>`, 400 ids) trained on `corpus`, with the Jinja
  chat `template`."""
  transformers = pytest.importorskip("transformers")
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  def make(template: str, corpus: str):
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                  "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator([corpus] * 50, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>")
    fast.chat_template = template
    directory = tmp_path_factory.mktemp("hf_tokenizer")
    fast.save_pretrained(directory)
    return directory
  return make
