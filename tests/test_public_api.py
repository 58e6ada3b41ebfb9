"""The public API: `specjax.__all__` is small and every name in it resolves; the top level has
nothing else but its subpackages (no lazy re-exports of the names that left it); each of those
names has one home, a subpackage whose `__all__` exports it; `specjax.loop` exports the loop's
pieces."""

import importlib
import types

import pytest

import specjax

MAX_TOP_LEVEL = 25  # 24, and `Constraint` (grammar-constrained generation, issue 63)

# Every name that left the top level, and the subpackage that exports it.
HOMES = {
    "DecodeState": "specjax.loop", "DecodeStats": "specjax.loop", "KVCache": "specjax.loop",
    "draft_step": "specjax.loop", "init_state": "specjax.loop", "round_step": "specjax.loop",
    "row_seeds": "specjax.loop", "verify_block": "specjax.loop",
    "QuantizedWeight": "specjax.models", "RopeScaling": "specjax.models",
    "dequantize_model": "specjax.models",
    "Drafter": "specjax.drafters", "HybridDrafter": "specjax.drafters",
    "MedusaDrafter": "specjax.drafters", "Proposal": "specjax.drafters",
    "SuffixCorpus": "specjax.drafters", "load_eagle3": "specjax.drafters",
    "with_draft_vocab": "specjax.drafters",
    "AdaptiveDrafter": "specjax.drafters.adaptive", "AutoChoice": "specjax.drafters.adaptive",
    "Calibration": "specjax.drafters.adaptive", "auto_num_draft": "specjax.drafters.adaptive",
    "Tokenizer": "specjax.io", "load": "specjax.io", "load_tokenizer": "specjax.io",
    "save": "specjax.io",
    "ShardingRules": "specjax.parallel",
    "DefaultPair": "specjax.pretrained", "PAIRS": "specjax.pretrained",
    "AuditReport": "specjax.exactness",
}

LOOP_PIECES = ("DecodeState", "KVCache", "draft_step", "init_state", "round_step", "row_seeds",
               "verify_block")


def test_all_is_small_and_every_name_resolves():
  names = specjax.__all__
  assert len(names) <= MAX_TOP_LEVEL, names
  assert len(set(names)) == len(names)
  for name in names:
    assert getattr(specjax, name) is not None, name


def test_the_top_level_holds_nothing_but_all_and_subpackages():
  others = {name for name in vars(specjax) if not name.startswith("_")} - set(specjax.__all__)
  assert all(isinstance(getattr(specjax, name), types.ModuleType) for name in others), sorted(
      name for name in others if not isinstance(getattr(specjax, name), types.ModuleType))
  for name in HOMES:
    assert not hasattr(specjax, name), name


@pytest.mark.parametrize("name", sorted(HOMES))
def test_every_name_that_left_has_a_home(name):
  home = importlib.import_module(HOMES[name])
  assert name in home.__all__
  assert getattr(home, name) is not None


def test_the_loop_exports_its_pieces():
  import specjax.loop as loop
  assert set(LOOP_PIECES) <= set(loop.__all__)
  for name in loop.__all__:
    assert getattr(loop, name) is not None, name


@pytest.mark.parametrize("home", sorted(set(HOMES.values())))
def test_every_name_a_home_exports_resolves(home):
  module = importlib.import_module(home)
  for name in module.__all__:
    assert getattr(module, name) is not None, f"{home}.{name}"
