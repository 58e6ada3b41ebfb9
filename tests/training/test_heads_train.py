"""Draft-head networks and their training: consistency of the training-time test with inference,
the losses, the data pipeline, bitwise resumption and checkpoint errors (tiny models)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafters.eagle import network as eagle
from specjax.drafters.medusa import network as medusa
from specjax.testing.models import tiny_config
from specjax.models.transformer import init_params
from specjax.training import head_run, heads, selfdistill

VOCAB = 64


@pytest.fixture(scope="module")
def target():
  return init_params(tiny_config(vocab_size=VOCAB, num_layers=6, pad_id=0), jax.random.PRNGKey(0))


def _draft_ids(size=40, seed=0):
  return np.sort(np.random.RandomState(seed).choice(VOCAB, size, replace=False)).astype(np.int32)


@pytest.mark.parametrize("kind", ["eagle3", pytest.param("mtp", marks=pytest.mark.slow)])
def test_training_unroll_equals_cached_inference(target, kind):
  """Step j of the training-time test for chain i == running the head with its KV cache over the
  true pairs 0..i, then j single steps on its own output features."""
  cfg = eagle.head_config_for(target.config, kind=kind, draft_vocab_size=40)
  head = eagle.init_head(cfg, target, jax.random.PRNGKey(1), _draft_ids())
  # Make the layer far from the identity so a wrong mask or position shows.
  head = eagle.EagleHead(jax.tree.map(lambda x: x * 3.0 if x.dtype == jnp.float32 and x.ndim == 2
                                      else x, head.params), cfg)
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 12), 0, VOCAB)
  # Each piece jitted, as training and decoding run them (eagerly they ran op by op).
  out = jax.jit(lambda target, tokens: target(tokens, jnp.zeros((2,), jnp.int32), taps=cfg.taps,
                                              return_hidden=not cfg.taps))(target, tokens)
  source = out.taps if cfg.taps else out.hidden
  embed = target.params["embed"]
  steps = jax.jit(lambda head, embed, tokens, source: heads.eagle_unroll(
      head, embed, tokens, source, num_steps=3))(head, embed, tokens, source)
  features = jax.jit(eagle.project_features)(head, source)
  head_forward = jax.jit(eagle.head_forward)
  for chain in (0, 6):
    cache = head.init_cache(2, 32)
    logits, hidden, cache = head_forward(head, embed, tokens[:, 1:chain + 2],
                                         features[:, :chain + 1], jnp.zeros(2, jnp.int32), cache)
    np.testing.assert_allclose(logits[:, -1], steps[0][:, chain], atol=2e-4, rtol=2e-4)
    for j in (1, 2):
      logits, hidden, cache = head_forward(head, embed, tokens[:, chain + 1 + j][:, None],
                                           hidden[:, -1:], cache.lengths, cache)
      np.testing.assert_allclose(logits[:, 0], steps[j][:, chain], atol=2e-4, rtol=2e-4)


def test_unroll_mask_is_needed(target):
  """Power check of the test above: letting step 1 see other chains' diagonal keys changes it."""
  cfg = eagle.head_config_for(target.config, kind="eagle3", draft_vocab_size=40)
  head = eagle.init_head(cfg, target, jax.random.PRNGKey(1), _draft_ids())
  q = jax.random.normal(jax.random.PRNGKey(3), (1, 6, 4, 8))
  k0, v0, k1, v1 = jax.random.normal(jax.random.PRNGKey(4), (4, 1, 6, 2, 8))
  right = heads._ttt_attention(q, k0, v0, [k1], [v1], 0.35)
  # chain t attending to chain t-1's step-1 key instead of its own must differ
  wrong = heads._ttt_attention(q, k0, v0, [jnp.roll(k1, 1, axis=1)], [v1], 0.35)
  assert float(jnp.abs(right - wrong)[:, 1:].max()) > 1e-3
  del head


def test_sparse_teacher_restricted_to_the_draft_vocabulary():
  """Top-k teacher: renormalised over the ids inside the draft vocabulary, argmax flagged."""
  top_logits = jnp.array([[[3.0, 2.0, 1.0]], [[5.0, 0.0, -1.0]]])  # [B=2, T=1, K=3]
  top_ids = jnp.array([[[7, 2, 9]], [[4, 2, 7]]])
  draft_index = jnp.full((10,), -1, jnp.int32).at[jnp.array([2, 7])].set(jnp.array([0, 1]))
  probs, slots, in_vocab, argmax = heads.cached_signals(top_logits, top_ids, draft_index)
  e = np.exp([3.0, 2.0])
  np.testing.assert_allclose(probs[0, 0], [e[0] / e.sum(), e[1] / e.sum(), 0.0], rtol=1e-6)
  np.testing.assert_array_equal(slots[0, 0], [1, 0, 0])
  np.testing.assert_array_equal(in_vocab[:, 0], [True, False])
  np.testing.assert_array_equal(argmax[:, 0], [7, 4])
  logits = jnp.array([[[0.5, 1.5]]])
  ce = heads.soft_cross_entropy(probs[:1], logits, slots[:1])
  log_q = jax.nn.log_softmax(logits[0, 0])
  np.testing.assert_allclose(ce[0, 0], -(probs[0, 0, 0] * log_q[1] + probs[0, 0, 1] * log_q[0]),
                             rtol=1e-6)


def test_soft_cross_entropy_is_minimised_by_the_target():
  probs = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(0), (5, 10)))
  at_target = heads.soft_cross_entropy(probs, jnp.log(probs))
  other = heads.soft_cross_entropy(probs, jax.random.normal(jax.random.PRNGKey(1), (5, 10)))
  np.testing.assert_allclose(at_target, -jnp.sum(probs * jnp.log(probs), -1), rtol=1e-5)
  assert bool(jnp.all(other > at_target))


def test_frequent_ids_ranks_by_count_then_id():
  counts = np.array([0, 5, 5, 1, 9, 0, 2])
  np.testing.assert_array_equal(selfdistill.frequent_ids(counts, 3), [1, 2, 4])
  np.testing.assert_array_equal(selfdistill.frequent_ids(counts, 5), [1, 2, 3, 4, 6])
  # growing a vocabulary: the kept ids stay (even unseen ones), the most frequent others fill it
  np.testing.assert_array_equal(selfdistill.frequent_ids(counts, 4, keep=[0, 4]), [0, 1, 2, 4])
  with pytest.raises(ValueError, match="cannot keep 3 ids"):
    selfdistill.frequent_ids(counts, 2, keep=[0, 1, 2])


def test_extend_draft_vocab_keeps_the_old_logits(target):
  """A grown head gives the old head's logits on the old ids; a new id's column is the target's
  row carried through the map that took the target's rows to the head's trained columns (here
  a known map M, recovered exactly since the 40 old ids outnumber the 32 embedding dims)."""
  cfg = eagle.head_config_for(target.config, kind="eagle3", draft_vocab_size=40)
  small = eagle.init_head(cfg, target, jax.random.PRNGKey(1), _draft_ids(40))
  m = jax.random.normal(jax.random.PRNGKey(5), (32, 32)) * 0.3 + 0.5 * jnp.eye(32)
  out_rows = eagle.target_output_head(target)
  small = eagle.EagleHead({**small.params, "lm_head": m @ out_rows[:, _draft_ids(40)]}, cfg)
  new_ids = selfdistill.frequent_ids(np.arange(VOCAB)[::-1].copy(), 56, keep=_draft_ids(40))
  big = heads.extend_draft_vocab(small, target, new_ids)
  assert big.config.draft_vocab_size == 56
  np.testing.assert_array_equal(big.draft_ids, new_ids)
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 6), 0, VOCAB)
  feats = jax.random.normal(jax.random.PRNGKey(3), (2, 6, target.config.embed_dim))
  embed = target.params["embed"]
  run = lambda h: eagle.head_forward(h, embed, tokens, feats, jnp.zeros(2, jnp.int32),
                                     h.init_cache(2, 16))[0]
  a, b = eagle.to_target_logits(small, run(small)), eagle.to_target_logits(big, run(big))
  old = np.asarray(_draft_ids(40))
  np.testing.assert_array_equal(b[..., old], a[..., old])
  added = np.setdiff1d(new_ids, old)
  assert np.all(np.isfinite(np.asarray(b[..., added]))) and np.all(np.isinf(a[..., added]))
  np.testing.assert_allclose(big.params["lm_head"][:, np.searchsorted(new_ids, added)],
                             m @ out_rows[:, added], rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match="must contain every id"):
    heads.extend_draft_vocab(small, target, np.arange(56, dtype=np.int32))


def _write_chunks(directory, count, target=None, rows=4, seed=0):
  """Real self-distillation chunks from the tiny target (random prompts, 8-token answers)."""
  if target is None:
    target = init_params(tiny_config(vocab_size=VOCAB, num_layers=6, pad_id=0),
                         jax.random.PRNGKey(0))
  rng = np.random.RandomState(seed)
  prompts = {str(i): rng.randint(1, VOCAB, size=rng.randint(3, 8)).tolist()
             for i in range(count * rows)}
  conversations = [[{"role": "user", "content": str(i)}] for i in range(count * rows)]
  selfdistill.generate_chunks(target, lambda m: prompts[m[-1]["content"]], conversations,
                              directory, batch_size=rows, max_new_tokens=8, eos_id=5,
                              taps=(2, 3, 3), top_k=8, prefill_rows=2, seed=seed,
                              log=lambda _: None)


@pytest.mark.parametrize("layout", ["stacked", "per_layer"])
def test_recorded_features_equal_a_fresh_forward(target, tmp_path, layout):
  """What generation recorded at every kept position == the target's forward over the stored
  sequence (features, top-k ids), and greedy chunks hold the target's greedy continuation; the
  same for the per-layer CPU layout (`for_platform`), whose prefill caches are joined per layer."""
  _write_chunks(tmp_path, 2, target if layout == "stacked" else target.for_platform("cpu"))
  for index in (0, 1):
    chunk = selfdistill.load_chunk(selfdistill.chunk_path(tmp_path, index))
    tokens = jnp.asarray(chunk["tokens"])
    out = target(tokens, jnp.zeros((tokens.shape[0],), jnp.int32), taps=(2, 3, 3),
                 return_hidden=True)
    for b in range(tokens.shape[0]):
      n = int(chunk["lengths"][b])
      np.testing.assert_allclose(np.moveaxis(np.asarray(chunk["taps"][b, :n], np.float32), 1, 0),
                                 out.taps[:, b, :n], atol=2e-2, rtol=2e-2)
      np.testing.assert_allclose(np.asarray(chunk["hidden"][b, :n], np.float32),
                                 out.hidden[b, :n], atol=2e-2, rtol=2e-2)
      np.testing.assert_array_equal(chunk["top_ids"][b, :n, 0], np.argmax(out.logits[b, :n], -1))
      if index == 0:  # greedy chunk: each answer token is the argmax after the previous one
        p = int(chunk["prompt_lengths"][b])
        np.testing.assert_array_equal(chunk["tokens"][b, p:n],
                                      np.argmax(out.logits[b, p - 1:n - 1], -1))


def test_generator_writes_only_the_chunks_asked_for(target, tmp_path):
  """`only=` writes just those chunk indices, each equal to the same chunk of a full run."""
  _write_chunks(tmp_path / "all", 3, target)
  rng = np.random.RandomState(0)
  prompts = {str(i): rng.randint(1, VOCAB, size=rng.randint(3, 8)).tolist() for i in range(12)}
  selfdistill.generate_chunks(target, lambda m: prompts[m[-1]["content"]],
                              [[{"role": "user", "content": str(i)}] for i in range(12)],
                              tmp_path / "some", batch_size=4, max_new_tokens=8, eos_id=5,
                              taps=(2, 3, 3), top_k=8, prefill_rows=2, only=[2],
                              log=lambda _: None)
  assert sorted(p.name for p in (tmp_path / "some").iterdir()) == [
      selfdistill.chunk_path(tmp_path, 2).name]
  a = selfdistill.load_chunk(selfdistill.chunk_path(tmp_path / "all", 2))
  b = selfdistill.load_chunk(selfdistill.chunk_path(tmp_path / "some", 2))
  for key in a:
    np.testing.assert_array_equal(a[key], b[key])


def test_batches_are_a_function_of_the_step(target, tmp_path):
  _write_chunks(tmp_path, 3, target)
  a = selfdistill.HeadData(tmp_path, [0, 1, 2], batch_size=4, seq_len=16, rows_per_chunk=4)
  b = selfdistill.HeadData(tmp_path, [0, 1, 2], batch_size=4, seq_len=16, rows_per_chunk=4)
  for step in (5, 0, 7, 2):
    x, y = a.batch_at(step), b.batch_at(step)
    np.testing.assert_array_equal(x["tokens"], y["tokens"])
    np.testing.assert_array_equal(x["mask"], y["mask"])
  # one epoch (3 steps) masks exactly the positions whose next token is an answer token
  expected = 0
  for c in range(3):
    chunk = selfdistill.load_chunk(selfdistill.chunk_path(tmp_path, c))
    expected += int(np.sum(np.minimum(chunk["lengths"], 16) - chunk["prompt_lengths"]))
  assert sum(int(a.batch_at(s)["mask"].sum()) for s in range(3)) == expected


@pytest.mark.parametrize("kind", ["eagle3", pytest.param("mtp", marks=pytest.mark.slow),
                                  pytest.param("medusa", marks=pytest.mark.slow)])
def test_resumed_run_equals_uninterrupted_run_bitwise(target, tmp_path, kind):
  _write_chunks(tmp_path / "data", 4, target)
  config = heads.HeadTrainConfig(kind=kind, steps=6, batch_size=4, seq_len=16, ttt_steps=3,
                                 draft_vocab_size=32, warmup_steps=2, learning_rate=3e-3)
  common = dict(chunks=[0, 1, 2], eval_chunks=[3], rows_per_chunk=4, log_every=1, eval_every=3,
                eval_batches=1, checkpoint_every=2, progress=False, log=lambda _: None)
  full = head_run.train_head(target, tmp_path / "data", tmp_path / "full", config, **common)
  head_run.train_head(target, tmp_path / "data", tmp_path / "split", config, max_steps=3,
                      **common)
  resumed = head_run.train_head(target, tmp_path / "data", tmp_path / "split", config, **common)
  for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(resumed.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  log = [json.loads(line) for line in (tmp_path / "full" / "log.jsonl").read_text().splitlines()]
  losses = [entry["loss"] for entry in log if "loss" in entry]
  assert len(losses) == 6 and all(np.isfinite(losses))
  assert any("eval_tau_proxy" in entry for entry in log)
  assert (tmp_path / "full" / "head").is_dir()


def test_run_grows_the_vocabulary_of_the_head_it_starts_from(target, tmp_path):
  """`init_from` with a larger `draft_vocab_size`: the run keeps the saved head's ids, adds the
  most frequent other answer ids of the vocabulary chunks, and resumes bitwise."""
  _write_chunks(tmp_path / "data", 3, target)
  cfg = eagle.head_config_for(target.config, kind="eagle3", draft_vocab_size=20)
  eagle.save_head(eagle.init_head(cfg, target, jax.random.PRNGKey(1), _draft_ids(20)),
                  tmp_path / "small")
  config = heads.HeadTrainConfig(kind="eagle3", steps=4, batch_size=4, seq_len=16, ttt_steps=2,
                                 draft_vocab_size=30, warmup_steps=1, learning_rate=3e-3)
  common = dict(chunks=[0, 1, 2], vocab_chunks=[0, 1], rows_per_chunk=4, log_every=1,
                eval_every=100, checkpoint_every=2, progress=False, log=lambda _: None,
                init_from=tmp_path / "small")
  full = head_run.train_head(target, tmp_path / "data", tmp_path / "full", config, **common)
  head_run.train_head(target, tmp_path / "data", tmp_path / "split", config, max_steps=2,
                      **common)
  resumed = head_run.train_head(target, tmp_path / "data", tmp_path / "split", config, **common)
  counts = selfdistill.token_counts(tmp_path / "data", [0, 1], VOCAB)
  np.testing.assert_array_equal(full.draft_ids,
                                selfdistill.frequent_ids(counts, 30, keep=_draft_ids(20)))
  assert set(_draft_ids(20).tolist()) <= set(np.asarray(full.draft_ids).tolist())
  for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(resumed.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_training_lowers_the_loss(target, tmp_path):
  """A few dozen steps on a fixed small data set must fit it (the loss falls by a clear margin)."""
  _write_chunks(tmp_path / "data", 2, target)
  config = heads.HeadTrainConfig(kind="eagle3", steps=40, batch_size=4, seq_len=16, ttt_steps=2,
                                 draft_vocab_size=48, warmup_steps=4, learning_rate=1e-2)
  head_run.train_head(target, tmp_path / "data", tmp_path / "run", config, chunks=[0, 1],
                      rows_per_chunk=4, log_every=1, eval_every=1000, checkpoint_every=1000,
                      progress=False, log=lambda _: None)
  log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
  losses = [entry["loss"] for entry in log if "loss" in entry]
  assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])


def test_head_checkpoint_round_trip_and_corrupt_file(target, tmp_path):
  cfg = eagle.head_config_for(target.config, kind="eagle3", draft_vocab_size=40)
  head = eagle.init_head(cfg, target, jax.random.PRNGKey(1), _draft_ids())
  eagle.save_head(head, tmp_path / "h")
  loaded = eagle.load_head(tmp_path / "h")
  assert loaded.config == head.config
  for a, b in zip(jax.tree.leaves(head.params), jax.tree.leaves(loaded.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  meta = [p for p in (tmp_path / "h").iterdir() if p.suffix == ".json"]
  assert meta
  meta[0].write_text("{not json")
  with pytest.raises(ValueError):
    eagle.load_head(tmp_path / "h")
  with pytest.raises(FileNotFoundError):
    eagle.load_head(tmp_path / "missing")


def test_head_checkpoint_with_truncated_weights_is_a_clear_error(target, tmp_path):
  cfg = eagle.head_config_for(target.config, kind="mtp", draft_vocab_size=40)
  head = eagle.init_head(cfg, target, jax.random.PRNGKey(1), _draft_ids())
  eagle.save_head(head, tmp_path / "h")
  blobs = [p for p in (tmp_path / "h").rglob("*") if p.is_file() and p.suffix != ".json"]
  for blob in blobs:
    blob.write_bytes(b"garbage")
  with pytest.raises(ValueError):
    eagle.load_head(tmp_path / "h")


def test_head_validation(target):
  cfg = eagle.head_config_for(target.config, kind="eagle3", draft_vocab_size=40)
  with pytest.raises(ValueError, match="increasing"):
    eagle.init_head(cfg, target, jax.random.PRNGKey(1), _draft_ids()[::-1])
  with pytest.raises(ValueError, match="draft_ids"):
    eagle.init_head(cfg, target, jax.random.PRNGKey(1), _draft_ids(30))
  head = eagle.init_head(cfg, target, jax.random.PRNGKey(1), _draft_ids())
  with pytest.raises(ValueError, match="feature"):
    eagle.project_features(head, jnp.zeros((2, 1, 3, 32)))
  with pytest.raises(ValueError, match="taps"):
    eagle.HeadConfig(32, 4, 2, 8, 64, num_taps=3, taps=(1, 2), draft_vocab_size=8, vocab_size=64)


def test_to_target_logits_puts_minus_inf_outside_the_draft_vocabulary(target):
  cfg = eagle.head_config_for(target.config, kind="mtp", draft_vocab_size=40)
  ids = _draft_ids()
  head = eagle.init_head(cfg, target, jax.random.PRNGKey(1), ids)
  draft = jax.random.normal(jax.random.PRNGKey(5), (3, 40))
  full = eagle.to_target_logits(head, draft)
  np.testing.assert_array_equal(np.asarray(full[:, ids]), np.asarray(draft))
  outside = np.setdiff1d(np.arange(VOCAB), ids)
  assert np.all(np.isneginf(np.asarray(full[:, outside])))


def test_medusa_starts_as_the_target_head(target):
  ids = _draft_ids()
  heads_ = medusa.init_medusa(medusa.MedusaConfig(32, 3, 40, VOCAB), target, ids)
  out = target(jnp.ones((1, 5), jnp.int32), jnp.zeros((1,), jnp.int32), return_hidden=True)
  logits = medusa.medusa_forward(heads_, out.hidden)  # [1, 5, 3, 40]
  for i in range(3):  # zero-initialised residual: each head reproduces the target's logits rows
    np.testing.assert_allclose(logits[:, :, i], out.logits[..., ids], atol=1e-4, rtol=1e-4)


def test_cli_trains_and_exports_a_head(target, tmp_path):
  """`specjax train head` on a saved tiny target; the exported head loads and drafts."""
  from specjax.cli import main as cli
  from specjax.io.orbax import save
  save(target, tmp_path / "target")
  _write_chunks(tmp_path / "data", 2, target)
  code = cli.main(["train", "head", "--target", str(tmp_path / "target"), "--data",
                   str(tmp_path / "data"), "--run-dir", str(tmp_path / "run"), "--kind", "mtp",
                   "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--ttt-steps", "2",
                   "--draft-vocab", "24", "--warmup", "1", "--chunks", "1", "--eval-chunks", "0",
                   "--gen-batch", "4", "--no-progress"])
  assert code == 0
  head = eagle.load_head(tmp_path / "run" / "head")
  assert head.config.taps == () and head.config.draft_vocab_size == 24
  exported, step = head_run.export_head(target, tmp_path / "run", tmp_path / "exported",
                                        dtype=jnp.bfloat16)
  assert step == 2
  again = eagle.load_head(tmp_path / "exported")
  np.testing.assert_allclose(np.asarray(again.params["lm_head"]),
                             np.asarray(head.params["lm_head"]), rtol=1e-2, atol=1e-2)
