"""Training at tiny size: the loss falls, resuming is exact, distillation moves the draft to the
target, and the corpus split is deterministic and disjoint by module."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from specjax.training import corpus
from specjax.training.evaluate import evaluate
from specjax.training.loop import train
from specjax.training.losses import tv_distance
from specjax.training.state import TrainConfig, init_state, state_model
from specjax.testing.models import tiny_config
from specjax.models.transformer import Model

SEQ_LEN = 16


def _stream(length=4000, vocab=64, seed=0):
  """A learnable token stream: a noisy order-2 recurrence over `vocab` ids."""
  rng = np.random.default_rng(seed)
  out = [3, 5]
  for _ in range(length - 2):
    nxt = (out[-1] * 7 + out[-2] * 3 + 1) % (vocab - 3) + 3
    out.append(nxt if rng.random() > 0.1 else int(rng.integers(3, vocab)))
  return np.asarray(out, np.int32)


def _config(**overrides):
  base = dict(steps=40, batch_size=8, seq_len=SEQ_LEN, learning_rate=1e-2, warmup_steps=5)
  base.update(overrides)
  return TrainConfig(**base)


def test_lm_loss_goes_down():
  stream = _stream()
  model_config = tiny_config()
  windows = corpus.eval_windows(stream, SEQ_LEN, 16)
  before = evaluate(Model(init_state(model_config, _config())["params"], model_config),
                      windows)["loss"]
  state = train(model_config, _config(), stream, progress=False)
  after = evaluate(state_model(state, model_config), windows)["loss"]
  assert int(state["step"]) == 40
  assert after < before - 0.4, (before, after)


def test_resume_equals_uninterrupted_run(tmp_path):
  """Stop after 5 steps, restore from the Orbax checkpoint, run to 10: bitwise equal to a run of
  10 steps without interruption (same compiled step, same data by step, same restored arrays)."""
  stream = _stream()
  model_config = tiny_config()
  config = _config(steps=10)
  straight = train(model_config, config, stream, progress=False)
  partial = train(model_config, config, stream, checkpoint_dir=tmp_path, stop_at=5,
                    progress=False)
  assert int(partial["step"]) == 5
  resumed = train(model_config, config, stream, checkpoint_dir=tmp_path, progress=False)
  assert int(resumed["step"]) == 10
  for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_batch_order_depends_only_on_step():
  stream = _stream()
  a = corpus.batch_at(stream, 7, 8, SEQ_LEN, seed=1)
  b = corpus.batch_at(stream, 7, 8, SEQ_LEN, seed=1)
  np.testing.assert_array_equal(a, b)
  assert a.shape == (8, SEQ_LEN + 1)
  # One epoch visits every window exactly once.
  count = corpus.num_windows(len(stream), SEQ_LEN)
  seen = np.concatenate([corpus.batch_at(stream, s, 1, SEQ_LEN)[:, 0] for s in range(count)])
  starts = stream[np.arange(count) * SEQ_LEN]
  np.testing.assert_array_equal(np.sort(seen), np.sort(starts))


@pytest.fixture(scope="module")
def tiny_target():
  target_config = tiny_config(embed_dim=48)
  target_state = train(target_config, _config(steps=30), _stream(), progress=False)
  return state_model(target_state, target_config)


@pytest.mark.parametrize("loss,on_policy", [("tv", 0.0), ("fkl", 0.25)])
def test_distillation_moves_draft_to_target(loss, on_policy, tiny_target):
  stream = _stream()
  windows = corpus.eval_windows(stream, SEQ_LEN, 16)
  target = tiny_target
  draft_config = tiny_config(num_layers=1, embed_dim=16, mlp_dim=32)
  config = _config(task="distill", steps=30, seed=1, distill_loss=loss, on_policy=on_policy,
                   on_policy_prefix=4)
  fresh = Model(init_state(draft_config, config)["params"], draft_config)
  before = evaluate(fresh, windows, target=target)
  state = train(draft_config, config, stream, target=target, progress=False)
  after = evaluate(state_model(state, draft_config), windows, target=target)
  assert after["tv"] < before["tv"] - 0.1, (before, after)
  assert after["greedy_agreement"] > before["greedy_agreement"] + 0.1, (before, after)


def test_tv_distance_is_one_minus_overlap():
  p = jnp.log(jnp.array([0.5, 0.3, 0.2]))
  q = jnp.log(jnp.array([0.2, 0.3, 0.5]))
  # min = 0.2 + 0.3 + 0.2 = 0.7, so TV = 0.3.
  np.testing.assert_allclose(tv_distance(p, q), 0.3, atol=1e-6)
  np.testing.assert_allclose(tv_distance(p, p), 0.0, atol=1e-6)


def test_corpus_split_is_deterministic_and_disjoint_by_module(tmp_path):
  files = corpus.list_files()
  assert files == corpus.list_files()
  assert files == sorted(files) and files
  assert not any(part in ("test", "tests", "idle_test", "site-packages")
                 for f in files for part in f.split("/")[:-1])
  train_docs, heldout_docs = corpus.load("train"), corpus.load("heldout")
  train_modules = {d.module for d in train_docs}
  heldout_modules = {d.module for d in heldout_docs}
  assert heldout_modules and not train_modules & heldout_modules
  assert len(train_docs) + len(heldout_docs) == len(files)
  assert [d.path for d in corpus.load("heldout")] == [d.path for d in heldout_docs]
  total = sum(len(d.text) for d in train_docs + heldout_docs)
  share = sum(len(d.text) for d in heldout_docs) / total
  assert 0.05 <= share < 0.15

  # A synthetic tree: exclusions apply and the split never cuts a module in two.
  for name in ("a.py", "pkg/__init__.py", "pkg/sub.py", "pkg/tests/t.py", "test/x.py",
               "site-packages/s.py", "b.py", "c.py", "_sysconfigdata_x.py"):
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(f"# {name}\r\nx = 1\n" * 10)
  assert corpus.list_files(tmp_path) == ["a.py", "b.py", "c.py", "pkg/__init__.py", "pkg/sub.py"]
  docs = corpus.load("all", root=tmp_path)
  assert all("\r" not in d.text for d in docs)
  held = corpus.heldout_modules(docs, 0.3)
  assert held and held < {"a", "b", "c", "pkg"}
  held_paths = {d.path for d in corpus.load("heldout", root=tmp_path, heldout_fraction=0.3)}
  assert held_paths == {d.path for d in docs if d.module in held}
