"""Draft heads as drafters: greedy identity, the features they read, EAGLE-3 checkpoint import.

* Greedy decoding with an EAGLE-3 head, an MTP head and Medusa heads on a ragged batch (one row a
  single-token prompt) returns exactly `sj.generate`'s tokens. The tiny vocabulary (12 ids, a
  10-id draft vocabulary) makes random heads agree with the target often enough that rows accept
  different numbers of drafts per round.
* Features flow: after decoding, the head's KV cache and its carried output equal a head forward
  over the *target's* features of the final sequence (computed afresh, cache-free). A drafter
  that keeps its own drafted features for accepted tokens (the stale-feature bug) fails the same
  check, so the check can fail.
* EAGLE-3 import: a checkpoint written here in the public layout (config.json + safetensors:
  `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`) loads into an `EagleHead` whose forward
  equals an independent NumPy float64 implementation of that layout, over the target's taps and
  over one step fed with the head's own output; malformed checkpoints raise ValueError.
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.drafters import Drafter
from specjax.drafters.eagle import network as eagle
from specjax.drafters.medusa import network as medusa
from specjax.drafters.eagle.eagle3 import load_eagle3
from specjax.drafters.eagle.drafter import EagleDrafter
from specjax.drafters.medusa.drafter import MedusaDrafter
from specjax.io.eagle3 import read_eagle3
from specjax.testing.models import tiny_config
from specjax.models.transformer import forward
from specjax.loop.round import round_step
from specjax.core.sampling import row_seeds
from specjax.loop.state import init_state
from specjax.core.validation import pytree_classes

VOCAB = 12
DRAFT_IDS = [0, 1, 2, 3, 5, 6, 7, 8, 10, 11]
MAX_NEW = 24
NUM_DRAFT = 3


@pytest.fixture(scope="module")
def target():
  return sj.init_params(tiny_config(vocab_size=VOCAB, num_layers=4), jax.random.key(0))


@pytest.fixture(scope="module")
def batch():
  tokens = jnp.array([[5, 9, 2, 7, 1, 3], [3, 0, 0, 0, 0, 0], [11, 4, 6, 4, 0, 0]], jnp.int32)
  return tokens, jnp.array([6, 1, 4], jnp.int32)


def make_drafter(target, kind: str, cls=None):
  if kind == "medusa":
    config = medusa.MedusaConfig(embed_dim=target.config.embed_dim, num_heads=NUM_DRAFT,
                                 draft_vocab_size=len(DRAFT_IDS), vocab_size=VOCAB)
    heads = medusa.init_medusa(config, target, DRAFT_IDS)
    w = 0.3 * jax.random.normal(jax.random.key(2), heads.params["w"].shape)  # distinct heads
    return (cls or MedusaDrafter)(medusa.MedusaHeads(dict(heads.params, w=w), config))
  config = eagle.head_config_for(target.config, kind=kind, draft_vocab_size=len(DRAFT_IDS))
  head = eagle.init_head(config, target, jax.random.key(1), DRAFT_IDS)
  return (cls or EagleDrafter)(head, target.params["embed"])


def assert_greedy_equals_generate(target, drafter, batch, num_draft: int):
  """Greedy `decode` with `drafter` on the ragged batch returns `generate`'s tokens, accepts some
  drafts (so rollback after partial acceptance is exercised) and runs the drafter's
  `forwards_per_round` a round; returns the decode's stats."""
  tokens, lengths = batch
  expected = sj.generate(target, tokens, jax.random.key(0), lengths=lengths,
                         max_new_tokens=MAX_NEW)
  out = sj.decode(target, drafter, tokens, jax.random.key(5), lengths=lengths,
                  max_new_tokens=MAX_NEW, num_draft=num_draft)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  np.testing.assert_array_equal(out.num_tokens, expected.num_tokens)
  stats = out.stats
  assert int(np.sum(stats.accepted)) > 0
  per_round = drafter.forwards_per_round(num_draft)
  np.testing.assert_array_equal(stats.draft_calls, stats.rounds * per_round)
  return stats


@pytest.mark.parametrize("kind", ["eagle3", "mtp", "medusa"])
def test_greedy_equals_generate_ragged_batch(target, batch, kind):
  stats = assert_greedy_equals_generate(target, make_drafter(target, kind), batch, NUM_DRAFT)
  print(kind, stats.summary())


def test_forwards_per_round_and_protocol(target):
  eagle3, mtp, heads = (make_drafter(target, kind) for kind in ("eagle3", "mtp", "medusa"))
  assert isinstance(eagle3, Drafter) and isinstance(heads, Drafter)
  assert eagle3.taps == (2, 2, 1) and not eagle3.needs_hidden
  assert mtp.taps == () and mtp.needs_hidden
  assert heads.taps == () and heads.needs_hidden
  assert eagle3.forwards_per_round(4) == 4 and heads.forwards_per_round(4) == 1
  assert eagle3.vocab_size == mtp.vocab_size == heads.vocab_size == VOCAB


def test_drafter_rejects_an_embedding_that_does_not_fit(target):
  head = make_drafter(target, "eagle3").head
  with pytest.raises(ValueError, match="target_embed"):
    EagleDrafter(head, target.params["embed"][:, :16])


def test_medusa_rejects_more_drafts_than_heads(target, batch):
  tokens, lengths = batch
  with pytest.raises(ValueError, match="Medusa heads"):
    sj.decode(target, make_drafter(target, "medusa"), tokens, jax.random.key(0),
              lengths=lengths, max_new_tokens=8, num_draft=NUM_DRAFT + 1)


# ---------------------------------------------------------------------------------------------
# Features flow.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StaleFeaturesEagle(EagleDrafter):
  """The bug the features-flow test must catch: accepted drafts keep the entries the head wrote
  with its own predicted features while drafting; only the last kept token's pair is fed with the
  target's feature."""

  def observe(self, state, scored, block, emitted, count, lengths):
    last = jnp.maximum(count - 1, 0)
    take = lambda x: jnp.take_along_axis(x, last[:, None, None], axis=1)  # [B, 1, E]
    features = take(self.features(scored))
    token = jnp.take_along_axis(emitted, last[:, None], axis=1)
    logits, hidden, cache = self._run(token, features, lengths - 1 + last, state.cache)
    kept = count > 0
    return type(state)(
        cache.with_lengths(jnp.where(kept, lengths - 1 + count, state.cache.lengths)),
        jnp.where(kept[:, None], hidden[:, 0], state.hidden),
        jnp.where(kept[:, None], logits[:, 0], state.logits))


@functools.partial(jax.jit, static_argnames=("num_draft", "classes"))
def _final_state(target, drafter, tokens, lengths, *, num_draft, classes):
  del classes  # a cache key only: StaleFeaturesEagle's treedef equals EagleDrafter's in jax 0.10
  batch = tokens.shape[0]
  state = init_state(target, drafter, tokens, lengths, jnp.int32(MAX_NEW), jnp.array([-1]),
                     row_seeds(jax.random.key(3), batch), num_draft=num_draft, capacity=64)
  step = functools.partial(round_step, target, drafter, num_draft=num_draft,
                           sampling=sj.Sampling())
  return jax.lax.while_loop(lambda s: ~jnp.all(s.done), step, state)


def final_state(target, drafter, tokens, lengths, *, num_draft):
  """`decode`'s loop, returning the whole state (the drafter's included). Keyed, like `decode`,
  on the drafter's classes (`pytree_classes`), so a subclass never runs its parent's program."""
  return _final_state(target, drafter, tokens, lengths, num_draft=num_draft,
                      classes=pytree_classes(target, drafter))


def features_mismatch(target, drafter, tokens, lengths) -> float:
  """Max |difference| between the head's cache/output after decoding and a fresh head forward
  over the target's features of each final sequence."""
  state = final_state(target, drafter, tokens, lengths, num_draft=NUM_DRAFT)
  final_lengths = np.asarray(state.lengths)
  assert np.all(final_lengths == np.asarray(lengths) + MAX_NEW)
  assert len(set(np.asarray(state.stats.accepted).tolist())) > 1  # ragged acceptance
  width = int(final_lengths.max())
  sequence = state.tokens[:, :width]
  out = forward(target, sequence, jnp.zeros(len(final_lengths), jnp.int32), taps=drafter.taps,
                return_hidden=drafter.needs_hidden)
  features = drafter.features(out)  # [B, W, E]: the target's own features
  shifted = jnp.concatenate([sequence[:, 1:], jnp.zeros_like(sequence[:, :1])], axis=1)
  cache = drafter.head.init_cache(len(final_lengths), state.draft_state.cache.max_len)
  _, hidden, expected = eagle.head_forward(drafter.head, drafter.target_embed, shifted,
                                           features, jnp.zeros(len(final_lengths), jnp.int32),
                                           cache)
  got = state.draft_state.cache
  np.testing.assert_array_equal(got.lengths, final_lengths - 1)
  slot_axis = got.k.shape.index(got.max_len, 2)  # whatever the cache layout, [.., S, ..]
  by_slot = lambda x: np.moveaxis(np.asarray(x), slot_axis, 0)  # [S, 1, B, ...]
  worst = 0.0
  for b, length in enumerate(final_lengths):
    valid = slice(0, length - 1)  # pairs (feature_t, token_{t+1}) for t <= L - 2
    for name in ("k", "v"):
      diff = np.abs(by_slot(getattr(got, name))[valid, :, b]
                    - by_slot(getattr(expected, name))[valid, :, b])
      worst = max(worst, float(diff.max()))
    worst = max(worst, float(np.abs(np.asarray(state.draft_state.hidden[b])
                                    - np.asarray(hidden[b, length - 2])).max()))
  return worst


@pytest.mark.parametrize("kind", ["eagle3", pytest.param("mtp", marks=pytest.mark.slow)])
def test_head_cache_holds_the_targets_features(target, batch, kind):
  tokens, lengths = batch
  assert features_mismatch(target, make_drafter(target, kind), tokens, lengths) < 1e-4


def test_medusa_reads_the_targets_hidden_state_at_the_last_scored_position(target, batch):
  tokens, lengths = batch
  drafter = make_drafter(target, "medusa")
  state = final_state(target, drafter, tokens, lengths, num_draft=NUM_DRAFT)
  final_lengths = np.asarray(state.lengths)
  out = forward(target, state.tokens[:, :int(final_lengths.max())],
                jnp.zeros(len(final_lengths), jnp.int32), return_hidden=True)
  want = np.asarray(out.hidden)[np.arange(len(final_lengths)), final_lengths - 2]
  np.testing.assert_allclose(np.asarray(state.draft_state.hidden), want, atol=1e-4)


def test_stale_features_are_detected(target, batch):
  tokens, lengths = batch
  drafter = make_drafter(target, "eagle3", StaleFeaturesEagle)
  assert features_mismatch(target, drafter, tokens, lengths) > 1e-2


# ---------------------------------------------------------------------------------------------
# EAGLE-3 checkpoint import.

H, HEADS, KV_HEADS, HEAD_DIM, MLP = 32, 4, 2, 8, 48
EPS, THETA = 1e-5, 5000.0


def write_eagle3(path, target, *, draft_ids, taps=(1, 2, 3), embed=False, overrides=None,
                 drop=(), seed=7, extra=None):
  """A random EAGLE-3 checkpoint in the public layout (PyTorch `[out, in]` weights); `extra`:
  more tensors by name (e.g. P-EAGLE's `mask_hidden`)."""
  from safetensors.numpy import save_file
  rng = np.random.default_rng(seed)
  dense = lambda out, inp: (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)
  norm = lambda: (1.0 + 0.1 * rng.standard_normal(H)).astype(np.float32)
  vocab = target.config.vocab_size
  ids = np.asarray(draft_ids)
  t2d = np.zeros(vocab, bool)
  t2d[ids] = True
  tensors = {
      "fc.weight": dense(H, len(taps) * H),
      "midlayer.input_layernorm.weight": norm(), "midlayer.hidden_norm.weight": norm(),
      "midlayer.self_attn.q_proj.weight": dense(HEADS * HEAD_DIM, 2 * H),
      "midlayer.self_attn.k_proj.weight": dense(KV_HEADS * HEAD_DIM, 2 * H),
      "midlayer.self_attn.v_proj.weight": dense(KV_HEADS * HEAD_DIM, 2 * H),
      "midlayer.self_attn.o_proj.weight": dense(H, HEADS * HEAD_DIM),
      "midlayer.post_attention_layernorm.weight": norm(),
      "midlayer.mlp.gate_proj.weight": dense(MLP, H), "midlayer.mlp.up_proj.weight": dense(MLP, H),
      "midlayer.mlp.down_proj.weight": dense(H, MLP),
      "norm.weight": norm(), "lm_head.weight": dense(len(ids), H),
      "d2t": (ids - np.arange(len(ids))).astype(np.int64), "t2d": t2d,
  }
  if embed:
    tensors["embed_tokens.weight"] = rng.standard_normal((vocab, H)).astype(np.float32)
  tensors.update(extra or {})
  for name in drop:
    tensors.pop(name)
  config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM, "intermediate_size": MLP, "rms_norm_eps": EPS,
            "rope_theta": THETA, "max_position_embeddings": 256, "num_hidden_layers": 1,
            "vocab_size": vocab, "draft_vocab_size": len(ids), "hidden_act": "silu",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(taps)}}
  config.update(overrides or {})
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.json").write_text(json.dumps(config))
  save_file(tensors, str(path / "model.safetensors"))
  return {k: np.asarray(v, np.float64) if v.dtype.kind == "f" else v for k, v in tensors.items()}


def numpy_eagle3(w, embed, tokens, features, positions):
  """The EAGLE-3 layer of the public layout in float64 NumPy, written from its definition:

  residual = feature; x = [rms(embed(token)) * input_layernorm | rms(feature) * hidden_norm];
  residual += o_proj(attn(q, k, v of x, RoPE at `positions`, causal, GQA));
  residual += down(silu(gate(h)) * up(h)) with h = rms(residual) * post_attention_layernorm;
  logits = lm_head(rms(residual) * norm). Returns (logits [T, N], residual [T, H]).
  """
  rms = lambda x, g: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS) * g
  lin = lambda x, name: x @ w[name].T
  m = "midlayer."
  t = len(tokens)
  x = np.concatenate([rms(embed[tokens], w[m + "input_layernorm.weight"]),
                      rms(features, w[m + "hidden_norm.weight"])], -1)
  q = lin(x, m + "self_attn.q_proj.weight").reshape(t, HEADS, HEAD_DIM)
  k = lin(x, m + "self_attn.k_proj.weight").reshape(t, KV_HEADS, HEAD_DIM)
  v = lin(x, m + "self_attn.v_proj.weight").reshape(t, KV_HEADS, HEAD_DIM)
  inv = 1.0 / THETA ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
  angle = np.asarray(positions, np.float64)[:, None] * inv
  cos = np.cos(np.concatenate([angle, angle], -1))[:, None]
  sin = np.sin(np.concatenate([angle, angle], -1))[:, None]
  half = HEAD_DIM // 2
  rope = lambda a: a * cos + np.concatenate([-a[..., half:], a[..., :half]], -1) * sin
  q, k = rope(q), rope(k)
  k, v = np.repeat(k, HEADS // KV_HEADS, axis=1), np.repeat(v, HEADS // KV_HEADS, axis=1)
  scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(HEAD_DIM)
  scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  attn = np.einsum("hts,shd->thd", probs, v).reshape(t, HEADS * HEAD_DIM)
  residual = features + lin(attn, m + "self_attn.o_proj.weight")
  h = rms(residual, w[m + "post_attention_layernorm.weight"])
  gate = lin(h, m + "mlp.gate_proj.weight")
  residual = residual + lin(gate / (1 + np.exp(-gate)) * lin(h, m + "mlp.up_proj.weight"),
                            m + "mlp.down_proj.weight")
  return lin(rms(residual, w["norm.weight"]), "lm_head.weight"), residual


@pytest.fixture(scope="module")
def import_target():
  return sj.init_params(tiny_config(vocab_size=40, num_layers=5, embed_dim=H),
                        jax.random.key(4))


IMPORT_IDS = list(range(0, 37, 3)) + [38]


def test_eagle3_import_forward_equals_numpy_layout(import_target, tmp_path):
  target = import_target
  w = write_eagle3(tmp_path / "head", target, draft_ids=IMPORT_IDS, taps=(3, 1, 4))
  drafter = load_eagle3(tmp_path / "head", target)
  head = drafter.head
  assert head.config.taps == (1, 3, 4)  # the residual stream entering layers 1, 3, 4, in order
  assert head.config.draft_vocab_size == len(IMPORT_IDS)
  np.testing.assert_array_equal(head.draft_ids, IMPORT_IDS)

  sequence = np.array([3, 17, 5, 29, 8, 8, 31, 2, 11], np.int32)
  t = len(sequence) - 1  # pairs (feature_j, token_{j+1}) for j < t
  out = forward(target, jnp.asarray(sequence)[None], jnp.zeros((1,), jnp.int32),
                taps=head.config.taps)
  taps = np.asarray(out.taps, np.float64)[:, 0]  # [3, T+1, H]
  fused = np.concatenate(list(taps), -1) @ w["fc.weight"].T  # [T+1, H]
  embed = np.asarray(target.params["embed"], np.float64)
  want_logits, want_hidden = numpy_eagle3(w, embed, sequence[1:], fused[:t], np.arange(t))

  cache = head.init_cache(1, 32)
  features = drafter.features(out)[:, :t]
  logits, hidden, cache = eagle.head_forward(head, drafter.target_embed,
                                             jnp.asarray(sequence[1:])[None], features,
                                             jnp.zeros((1,), jnp.int32), cache)
  np.testing.assert_allclose(np.asarray(logits[0]), want_logits, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(hidden[0]), want_hidden, rtol=1e-4, atol=1e-4)

  # One drafting step: the head's own output feature with a drafted token, through the cache.
  drafted = 21
  step_logits, _, _ = eagle.head_forward(head, drafter.target_embed,
                                         jnp.array([[drafted]], jnp.int32), hidden[:, -1:],
                                         jnp.array([t], jnp.int32), cache)
  chain = np.concatenate([fused[:t], want_hidden[-1:]])
  want_step, _ = numpy_eagle3(w, embed, np.append(sequence[1:], drafted), chain, np.arange(t + 1))
  np.testing.assert_allclose(np.asarray(step_logits[0, 0]), want_step[-1], rtol=1e-4, atol=1e-4)

  # The full-vocabulary view: draft id i lands on target id i + d2t[i], -inf elsewhere.
  full = np.asarray(drafter.full_logits(logits))[0]
  np.testing.assert_allclose(full[:, IMPORT_IDS], want_logits, rtol=1e-4, atol=1e-4)
  outside = np.setdiff1d(np.arange(40), IMPORT_IDS)
  assert np.all(np.isneginf(full[:, outside]))


@pytest.mark.slow
def test_eagle3_import_decodes_greedy_like_generate(import_target, tmp_path):
  target = import_target
  write_eagle3(tmp_path / "head", target, draft_ids=IMPORT_IDS, embed=True)
  drafter = load_eagle3(tmp_path / "head", target)
  assert drafter.target_embed.shape == (40, H)  # the checkpoint's own embed_tokens
  tokens = jnp.array([[4, 9, 1, 30], [7, 2, 0, 0]], jnp.int32)
  lengths = jnp.array([4, 2], jnp.int32)
  expected = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=12)
  out = sj.decode(target, drafter, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=12,
                  num_draft=2)
  np.testing.assert_array_equal(out.tokens, expected.tokens)


@pytest.mark.parametrize("case, message", [
    (dict(drop=("midlayer.hidden_norm.weight",)), "missing midlayer.hidden_norm"),
    (dict(overrides={"hidden_size": 16}), "shape"),
    (dict(overrides={"draft_vocab_size": 7}), "draft_vocab_size"),
    (dict(draft_ids=[5, 3, 9]), "d2t"),
    (dict(overrides={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 9, 2]}}), "taps"),
    (dict(overrides={"eagle_aux_hidden_state_layer_ids": [1, 2]}), "fc.weight reads 3"),
    (dict(overrides={"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}), "rope_scaling"),
])
def test_eagle3_import_rejects_malformed_checkpoints(import_target, tmp_path, case, message):
  case = dict(case)
  draft_ids = case.pop("draft_ids", IMPORT_IDS)
  write_eagle3(tmp_path / "head", import_target, draft_ids=draft_ids, **case)
  with pytest.raises(ValueError, match=message):
    load_eagle3(tmp_path / "head", import_target)


def test_eagle3_import_rejects_a_corrupt_or_missing_checkpoint(import_target, tmp_path):
  with pytest.raises(ValueError, match="config.json"):
    read_eagle3(tmp_path)
  write_eagle3(tmp_path / "head", import_target, draft_ids=IMPORT_IDS)
  weights = tmp_path / "head" / "model.safetensors"
  weights.write_bytes(weights.read_bytes()[:200])
  with pytest.raises(ValueError, match="corrupt"):
    load_eagle3(tmp_path / "head", import_target)
