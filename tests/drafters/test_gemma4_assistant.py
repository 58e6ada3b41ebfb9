"""Gemma 4 assistant drafters, checked against `transformers`' `Gemma4AssistantForCausalLM`.

A random-weight `transformers` Gemma 4 target (tests/models/test_gemma4.py's: window and global
layers, KV-shared layers, PLE, k_eq_v) loaded with `sj.from_hf`, and a random-weight 2-layer
assistant (one window layer, one global layer) saved with `save_pretrained` in the published
layout and loaded with `load_gemma4_assistant`. Parity: on a ragged batch, the drafter's logits
of 3 greedy draft steps equal the reference's, which runs the published candidate generator's
loop by hand: the target's `shared_kv_states` (its store layers' keys/values of positions
`0 .. L - 2`) and `hidden_states[-1]` at `L - 2`, the target's embedding of the last token,
position `L - 1`, each step's argmax and projected state fed to the next. With and without
ordered embeddings (the centroid-selected vocabulary: the same tokens masked, the same values
elsewhere). Two broken drafters must miss: the target's keys/values read from the first layer of
each kind instead of the store layers, and the ordered vocabulary not mapped through
`token_ordering`. Greedy `sj.decode` must equal `sj.generate` on ragged batches; bad targets
fail before compiling.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.drafters import Gemma4AssistantDrafter, load_gemma4_assistant
from specjax.drafters.gemma4_assistant import network as assistant

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.gemma4_assistant")

from tests.models.test_gemma4 import build_hf_gemma4, gemma4_text_config  # noqa: E402

LOGIT_ATOL = 1e-4
BROKEN_MIN = 1e-2
PROMPT_LENGTHS = (12, 7, 10)
STEPS = 3


def hf_assistant(ordered: bool, seed=3):
  text = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
              attention_k_eq_v=True, num_global_key_value_heads=1,  # the target's K/V heads
              layer_types=["sliding_attention", "full_attention"], sliding_window=4,
              hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
              max_position_embeddings=128, model_type="gemma4_text",
              rope_parameters={"sliding_attention": {"rope_type": "default",
                                                     "rope_theta": 10_000.0},
                               "full_attention": {"rope_type": "proportional",
                                                  "partial_rotary_factor": 0.25,
                                                  "rope_theta": 1_000_000.0}})
  config = transformers.Gemma4AssistantConfig(
      text_config=text, backbone_hidden_size=48, use_ordered_embeddings=ordered,
      num_centroids=8, centroid_intermediate_top_k=3)
  torch.manual_seed(seed)
  config._attn_implementation = "eager"
  config.get_text_config()._attn_implementation = "eager"
  model = transformers.Gemma4AssistantForCausalLM(config)
  with torch.no_grad():
    for name, param in model.named_parameters():
      if "norm" in name:
        param.copy_(1.0 + 0.2 * torch.randn_like(param))
      elif param.ndim == 2:
        param.copy_(torch.randn_like(param) / param.shape[1] ** 0.5)
    for name, buffer in model.named_buffers():
      if name.endswith("layer_scalar"):
        buffer.copy_(0.5 + torch.rand_like(buffer))
      elif name.endswith("token_ordering"):
        buffer.copy_(torch.randperm(buffer.shape[0]))
  return model.eval().float()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  hf_target = build_hf_gemma4(gemma4_text_config())
  root = tmp_path_factory.mktemp("gemma4_assistant")
  hf_target.save_pretrained(root / "target")
  pairs = {}
  for ordered in (False, True):
    model = hf_assistant(ordered)
    path = root / f"assistant_ordered_{ordered}"
    model.save_pretrained(path)
    pairs[ordered] = (model, path)
  return hf_target, sj.from_hf(root / "target"), pairs


def _prompts(vocab_size, lengths=PROMPT_LENGTHS, seed=5):
  rng = np.random.default_rng(seed)
  tokens = np.zeros((len(lengths), max(lengths)), np.int32)
  for row, length in enumerate(lengths):
    tokens[row, :length] = rng.integers(3, vocab_size, length)
  return tokens, np.asarray(lengths, np.int32)


def reference_steps(hf_target, hf_model, prompt):
  """The assistant's logits over `STEPS` greedy steps after `prompt` (`[L]`), as `transformers`'
  candidate generator runs it: positions `0 .. L - 2` processed by the target, the last token
  and position `L - 1` handed to the assistant."""
  length = len(prompt)
  ids = torch.from_numpy(prompt[None].astype(np.int64))
  with torch.no_grad():
    out = hf_target(input_ids=ids[:, :length - 1], use_cache=False, output_hidden_states=True,
                    return_shared_kv_states=True)
    kv = {kind: (k[:, :, :length - 1], v[:, :, :length - 1])
          for kind, (k, v) in out.shared_kv_states.items()}
    hidden = out.hidden_states[-1][:, -1:]
    token = ids[:, length - 1:]
    position = torch.tensor([[length - 1]])
    steps = []
    for _ in range(STEPS):
      embedded = hf_target.get_input_embeddings()(token)
      step = hf_model(inputs_embeds=torch.cat([embedded, hidden], dim=-1), position_ids=position,
                      shared_kv_states=kv, use_cache=False)
      steps.append(step.logits[0, 0].numpy())
      token = step.logits.argmax(dim=-1)
      hidden = step.last_hidden_state
  return np.stack(steps)


def specjax_steps(target, drafter, tokens, lengths):
  batch, width = tokens.shape
  prefill = target(jnp.asarray(tokens), jnp.zeros(batch, jnp.int32),
                   target.init_cache(batch, width + 8), return_hidden=True)
  state = drafter.init(jnp.asarray(tokens), jnp.asarray(lengths), width + 8, prefill)
  _, logits = drafter.chain(state, jnp.asarray(tokens), jnp.asarray(lengths), STEPS,
                            sj.Sampling(temperature=0.0), jnp.zeros(batch, jnp.uint32))
  return np.asarray(logits)


def logit_gap(ours, theirs):
  """Max abs difference where the reference scores a token; inf where the masked sets differ
  (`transformers` fills unselected tokens with min - 1, specjax with `MASKED_LOGIT`)."""
  masked = ours <= assistant.MASKED_LOGIT
  their_masked = theirs == theirs.min() if masked.any() else np.zeros_like(masked)
  if masked.any() and not np.array_equal(masked, their_masked):
    return np.inf
  return float(np.abs(np.where(masked, 0, ours) - np.where(masked, 0, theirs)).max())


def _gaps(world, ordered, drafter=None):
  hf_target, target, pairs = world
  hf_model, path = pairs[ordered]
  drafter = drafter or load_gemma4_assistant(path, target)
  tokens, lengths = _prompts(target.vocab_size)
  ours = specjax_steps(target, drafter, tokens, lengths)
  gaps = []
  for row, length in enumerate(lengths):
    theirs = reference_steps(hf_target, hf_model, tokens[row, :length])
    gaps.append(max(logit_gap(ours[row, j], theirs[j]) for j in range(STEPS)))
  return max(gaps)


@pytest.mark.parametrize("ordered", [False, True], ids=["full_vocab", "ordered_embeddings"])
def test_logits_match_transformers(world, ordered):
  gap = _gaps(world, ordered)
  print(f"gemma4 assistant (ordered={ordered}): max abs logit diff {gap:.2e}")
  assert gap < LOGIT_ATOL


def test_broken_kv_source_is_rejected(world):
  """Keys/values read from the first layer of each kind (0: window, 2: global) instead of the
  store layers (3, 2 -> the target's window store is layer 3): the parity check misses."""
  _, target, pairs = world
  drafter = load_gemma4_assistant(pairs[False][1], target)
  assert drafter.source_layers == (2, 3)
  broken = dataclasses.replace(drafter, source_layers=(2, 0))
  gap = _gaps(world, False, broken)
  print(f"broken KV source: max abs logit diff {gap:.2e}")
  assert gap > BROKEN_MIN


def test_broken_ordering_is_rejected(world):
  """The ordered vocabulary taken in cluster order (token_ordering ignored): the parity check
  misses."""
  _, target, pairs = world
  drafter = load_gemma4_assistant(pairs[True][1], target)
  params = dict(drafter.network.params,
                token_ordering=jnp.arange(target.vocab_size, dtype=jnp.int32))
  broken = dataclasses.replace(drafter, network=dataclasses.replace(drafter.network,
                                                                    params=params))
  gap = _gaps(world, True, broken)
  print(f"broken ordering: max abs logit diff {gap:.2e}")
  assert gap > BROKEN_MIN


@pytest.mark.parametrize("ordered", [False, True], ids=["full_vocab", "ordered_embeddings"])
def test_greedy_decode_equals_generate(world, ordered):
  _, target, pairs = world
  drafter = load_gemma4_assistant(pairs[ordered][1], target)
  tokens, lengths = _prompts(target.vocab_size, lengths=(5, 11, 2, 8), seed=9)
  greedy = sj.Sampling(temperature=0.0)
  ref = sj.generate(target, jnp.asarray(tokens), jax.random.key(0), lengths=jnp.asarray(lengths),
                    max_new_tokens=10, sampling=greedy)
  out = sj.decode(target, drafter, jnp.asarray(tokens), jax.random.key(0),
                  lengths=jnp.asarray(lengths), max_new_tokens=10, num_draft=3, sampling=greedy)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
  assert int(np.asarray(out.stats.drafted).sum()) > 0


@pytest.mark.costly
def test_greedy_decode_with_verify_widths(world):
  """Verify widths make the target defer its cache write (a `KVBlock`): the drafter reads the
  block's keys/values from there instead."""
  _, target, pairs = world
  drafter = load_gemma4_assistant(pairs[True][1], target, confidence=0.3)
  tokens, lengths = _prompts(target.vocab_size, lengths=(6, 3, 9), seed=4)
  greedy = sj.Sampling(temperature=0.0)
  ref = sj.generate(target, jnp.asarray(tokens), jax.random.key(0), lengths=jnp.asarray(lengths),
                    max_new_tokens=9, sampling=greedy)
  out = sj.decode(target, drafter, jnp.asarray(tokens), jax.random.key(0),
                  lengths=jnp.asarray(lengths), max_new_tokens=9, num_draft=3, sampling=greedy,
                  verify_widths=(2, 4))
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))


def _edit(path, tmp_path, **changes):
  target = tmp_path / "edited"
  shutil.copytree(path, target)
  config = json.loads((target / "config.json").read_text())
  config.update(changes)
  (target / "config.json").write_text(json.dumps(config))
  return target


def test_bad_targets_and_configs_fail_before_compiling(world, tmp_path):
  _, target, pairs = world
  path = pairs[False][1]
  wider = sj.from_hf(_target_with(world, tmp_path / "a", hidden_size=64))
  with pytest.raises(ValueError, match="backbone_hidden_size"):
    load_gemma4_assistant(path, wider)
  qwen = sj.init_params(sj.ModelConfig(vocab_size=96, embed_dim=48, num_layers=2, num_heads=4,
                                       num_kv_heads=2, head_dim=8, mlp_dim=64, family="qwen3"),
                        jax.random.key(0))
  with pytest.raises(ValueError, match="Gemma 4 target"):
    load_gemma4_assistant(path, qwen)
  other_vocab = sj.from_hf(_target_with(world, tmp_path / "b", vocab_size=128,
                                        vocab_size_per_layer_input=128))
  with pytest.raises(ValueError, match="vocabulary"):
    load_gemma4_assistant(path, other_vocab)
  drafter = load_gemma4_assistant(path, target)
  with pytest.raises(ValueError, match="backbone_hidden_size|vocabulary|Gemma 4"):
    sj.decode(qwen, drafter, jnp.ones((1, 4), jnp.int32), jax.random.key(0), max_new_tokens=2)
  with pytest.raises(ValueError, match="model_type"):
    load_gemma4_assistant(_edit(path, tmp_path / "c", model_type="gemma4_text"), target)
  with pytest.raises(ValueError, match="chains only"):
    sj.decode(target, drafter, jnp.ones((1, 4), jnp.int32), jax.random.key(0), max_new_tokens=2,
              tree=sj.TreeSpec(builder="static", depth=2, width=2, num_nodes=4))


def _target_with(world, path, **changes):
  model = build_hf_gemma4(gemma4_text_config(**changes))
  model.save_pretrained(path)
  return path
