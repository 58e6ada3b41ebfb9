"""Gemma 4 text targets through `sj.from_hf`, checked against `transformers`' `Gemma4ForCausalLM`.

Small random-weight models (no download) in the published tensor layout, saved with
`save_pretrained` and loaded with `sj.from_hf`: window and global layers with their own head
widths and key/value heads, proportional (partial) RoPE on the global layers, `attention_k_eq_v`
on and off, KV-shared layers, per-layer embeddings (PLE), layer scalars, final logit
soft-capping. Logits must equal the PyTorch forward's to float32 rounding on a right-padded batch
of ragged prompts (with and without a KV cache); greedy `sj.generate` and greedy `sj.decode` must
return `transformers`' greedy tokens exactly.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.gemma4")

# Max abs logit difference from transformers' float32 forward (logit scale about 5): at most
# 6.4e-5 with XLA:CPU's default fusion emitters, 2.8e-4 with the older ones the tests compile with
# (tests/conftest.py; `k_eq_v`, about 5e-5 of the logits' scale). A wrong norm, RoPE or mask moves
# logits by O(1).
LOGIT_ATOL = 5e-4
PROMPT_LENGTHS = (9, 4, 13)
NEW_TOKENS = 8


def gemma4_text_config(**overrides):
  """A small `Gemma4TextConfig`: 6 layers (window, window, global, window, window, global), the
  last two sharing the keys/values of layers 2 (global) and 3 (window), PLE on, k_eq_v on."""
  fields = dict(
      vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=6,
      num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
      num_global_key_value_heads=1, attention_k_eq_v=True,
      layer_types=["sliding_attention", "sliding_attention", "full_attention",
                   "sliding_attention", "sliding_attention", "full_attention"],
      sliding_window=4, hidden_size_per_layer_input=8, vocab_size_per_layer_input=96,
      num_kv_shared_layers=2, final_logit_softcapping=30.0, max_position_embeddings=128,
      rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                       "full_attention": {"rope_type": "proportional",
                                          "partial_rotary_factor": 0.25,
                                          "rope_theta": 1_000_000.0}},
      pad_token_id=0, eos_token_id=1, bos_token_id=2, initializer_range=0.2)
  fields.update(overrides)
  return transformers.Gemma4TextConfig(**fields)


def build_hf_gemma4(config, seed=0):
  """A random-weight `Gemma4ForCausalLM` (eager attention) whose norms and layer scalars are
  random too, so that a mis-mapped norm or scalar cannot hide."""
  torch.manual_seed(seed)
  config._attn_implementation = "eager"
  model = transformers.Gemma4ForCausalLM(config)
  with torch.no_grad():
    for name, param in model.named_parameters():
      if "norm" in name:  # Gemma 4 scales by w (init 1)
        param.copy_(1.0 + 0.2 * torch.randn_like(param))
    for name, buffer in model.named_buffers():
      if name.endswith("layer_scalar"):
        buffer.copy_(0.5 + torch.rand_like(buffer))
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  return model.eval().float()


VARIANTS = {
    "k_eq_v": {},
    "separate_v": dict(attention_k_eq_v=False, num_global_key_value_heads=None),
    "no_ple_no_sharing": dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                              final_logit_softcapping=None),
}


@pytest.fixture(name="saved", scope="module", params=sorted(VARIANTS))
def _saved(request, tmp_path_factory):
  hf_model = build_hf_gemma4(gemma4_text_config(**VARIANTS[request.param]))
  path = tmp_path_factory.mktemp("gemma4_" + request.param)
  hf_model.save_pretrained(path)
  return request.param, hf_model, path


def _prompts(vocab_size, seed=1):
  rng = np.random.default_rng(seed)
  tokens = np.zeros((len(PROMPT_LENGTHS), max(PROMPT_LENGTHS)), np.int32)
  for row, length in enumerate(PROMPT_LENGTHS):
    tokens[row, :length] = rng.integers(3, vocab_size, length)
  return tokens, np.asarray(PROMPT_LENGTHS, np.int32)


def _hf_logits(hf_model, tokens, lengths):
  mask = (np.arange(tokens.shape[1])[None] < lengths[:, None]).astype(np.int64)
  with torch.no_grad():
    out = hf_model(input_ids=torch.from_numpy(tokens.astype(np.int64)),
                   attention_mask=torch.from_numpy(mask))
  return out.logits.float().numpy()


def test_config_maps_every_gemma4_field(saved):
  name, hf_model, path = saved
  c = sj.from_hf(path).config
  hf = hf_model.config
  assert c.family == "gemma4_text" and c.per_layer_only
  assert (c.num_layers, c.embed_dim, c.head_dim) == (6, 48, 8)
  assert c.global_head_dim == 16
  assert c.global_kv_heads == (1 if hf.attention_k_eq_v else 2)
  assert c.kv_shared_layers == hf.num_kv_shared_layers
  assert c.per_layer_input_dim == hf.hidden_size_per_layer_input
  assert [c.is_global(i) for i in range(6)] == [t == "full_attention" for t in hf.layer_types]
  if c.kv_shared_layers:  # HF: the last layer of each kind before the shared ones stores K/V
    assert [c.kv_source(i) for i in range(6)] == [0, 1, 2, 3, 3, 2]


def test_logits_match_transformers(saved):
  name, hf_model, path = saved
  model = sj.from_hf(path)
  tokens, lengths = _prompts(model.vocab_size)
  expected = _hf_logits(hf_model, tokens, lengths)
  starts = jnp.zeros(len(lengths), jnp.int32)
  got = np.asarray(model(jnp.asarray(tokens), starts).logits)
  cached = np.asarray(model(jnp.asarray(tokens), starts, model.init_cache(len(lengths), 32)).logits)
  diffs = [np.abs(got[row, :n] - expected[row, :n]).max() for row, n in enumerate(lengths)]
  cached_diffs = [np.abs(cached[row, :n] - expected[row, :n]).max()
                  for row, n in enumerate(lengths)]
  print(f"gemma4 {name}: max abs logit diff {max(diffs):.2e} (cached {max(cached_diffs):.2e}), "
        f"logit scale {np.abs(expected).max():.1f}")
  assert np.abs(expected).max() > 1.0  # the comparison is not between near-zero logits
  assert max(diffs) < LOGIT_ATOL, diffs
  assert max(cached_diffs) < LOGIT_ATOL, cached_diffs


def test_step_by_step_decode_equals_full_forward(saved):
  """A prefill, then one token at a time through the cache (window and shared layers reading
  their buffers), equals the full forward: the cache is written and read as the block is."""
  _, _, path = saved
  model = sj.from_hf(path)
  tokens, _ = _prompts(model.vocab_size, seed=3)
  tokens = jnp.asarray(tokens)
  batch, width = tokens.shape
  full = np.asarray(model(tokens, jnp.zeros(batch, jnp.int32)).logits)
  cache = model.init_cache(batch, width + 2)
  out = model(tokens[:, :5], jnp.zeros(batch, jnp.int32), cache)
  steps = [np.asarray(out.logits)]
  cache = out.cache
  for position in range(5, width):
    out = model(tokens[:, position:position + 1], jnp.full((batch,), position, jnp.int32), cache)
    steps.append(np.asarray(out.logits))
    cache = out.cache
  np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=LOGIT_ATOL)


def _transformers_greedy(hf_model, tokens, lengths):
  rows = []
  for row, length in enumerate(lengths):
    prompt = torch.from_numpy(tokens[row:row + 1, :length].astype(np.int64))
    with torch.no_grad():
      rows.append(hf_model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                    max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, length:].numpy())
  return np.stack(rows)


def test_greedy_generate_and_decode_match_transformers(saved):
  name, hf_model, path = saved
  model = sj.from_hf(path)
  tokens, lengths = _prompts(model.vocab_size, seed=2)
  theirs = _transformers_greedy(hf_model, tokens, lengths)
  greedy = sj.Sampling(temperature=0.0)
  out = sj.generate(model, jnp.asarray(tokens), jax.random.key(0), lengths=jnp.asarray(lengths),
                    max_new_tokens=NEW_TOKENS, sampling=greedy)
  np.testing.assert_array_equal(np.asarray(out.tokens), theirs, err_msg=f"generate, {name}")
  spec = sj.decode(model, sj.NGramDrafter(), jnp.asarray(tokens), jax.random.key(0),
                   lengths=jnp.asarray(lengths), max_new_tokens=NEW_TOKENS, num_draft=3,
                   sampling=greedy)
  np.testing.assert_array_equal(np.asarray(spec.tokens), theirs, err_msg=f"decode, {name}")


def test_for_platform_keeps_the_unstacked_layout(saved):
  _, _, path = saved
  model = sj.from_hf(path)
  assert not model.is_stacked and not model.for_platform("cpu").is_stacked
  with pytest.raises(ValueError, match="unstacked layout"):
    model.stacked()


def _edited(path, tmp_path, **changes):
  import shutil
  target = tmp_path / "edited"
  shutil.copytree(path, target)
  config = json.loads((target / "config.json").read_text())
  config.update(changes)
  (target / "config.json").write_text(json.dumps(config))
  return target


@pytest.mark.parametrize("changes, message", [
    (dict(enable_moe_block=True), "enable_moe_block"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    (dict(vocab_size_per_layer_input=8), "vocab_size_per_layer_input"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(per_layer_config={"2": {"head_dim": 16}, "5": {"head_dim": 32}}), "differ in shape"),
])
def test_unsupported_gemma4_features_are_named(saved, tmp_path, changes, message):
  name, _, path = saved
  if name != "k_eq_v":
    pytest.skip("one variant is enough")
  with pytest.raises(ValueError, match=message):
    sj.from_hf(_edited(path, tmp_path, **changes))


def test_multimodal_wrapper_loads_its_text_config(saved, tmp_path):
  """A `gemma4` config.json (the multimodal wrapper) loads from its `text_config`."""
  name, _, path = saved
  if name != "k_eq_v":
    pytest.skip("one variant is enough")
  text = json.loads((path / "config.json").read_text())
  wrapped = _edited(path, tmp_path, model_type="gemma4", text_config=text)
  assert sj.from_hf(wrapped).config == sj.from_hf(path).config
