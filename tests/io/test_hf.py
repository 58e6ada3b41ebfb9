"""Hugging Face import checked against the `transformers` PyTorch implementation as the peer.

For every supported family a small random-weight model is built from a config (no download), saved
with `save_pretrained` (safetensors) and imported with `sj.from_hf`. Logits must match the PyTorch
forward on a right-padded batch of different prompt lengths (float32, valid positions only, max abs
diff < `LOGIT_ATOL`), and greedy `sj.generate` must return exactly the tokens of `transformers`'
greedy `generate`.

Random weights are drawn at a moderate scale (`initializer_range`) so the top two logits are rarely
within float32 noise of each other; norm weights and biases, which Hugging Face initialises to
constants, get random values too, so a mis-mapped norm or bias cannot hide.
"""

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import specjax as sj
from specjax.io import load, load_tokenizer, save
from specjax.models import RopeScaling
from specjax.io import orbax as checkpoint

torch = pytest.importorskip("torch", reason="the transformers peer needs torch (install the "
                            "'peer' extra: pip install -e .[peer])")
transformers = pytest.importorskip("transformers", reason="the peer implementation (install the "
                                   "'peer' extra: pip install -e .[peer])")

LOGIT_ATOL = 2e-4  # float32 on CPU; measured differences are ~1e-6 (see the test output)
NEW_TOKENS = 32
PROMPT_LENGTHS = (13, 7, 2)  # longer than the sliding windows below, so the windows matter

_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               initializer_range=0.15, rms_norm_eps=1e-6)


def _config(kind, **overrides):
  return getattr(transformers, kind)(**{**_COMMON, **overrides})


FAMILIES = {
    # Llama 3.1-style frequency scaling, non-default theta, GQA, untied output head.
    "llama3_scaled_rope": lambda: _config(
        "LlamaConfig", rope_theta=500_000.0, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=16)),
    # Tied embeddings, multi-head (no GQA), head_dim different from hidden_size / heads.
    "llama_tied_mha": lambda: _config(
        "LlamaConfig", rope_theta=1_000.0, tie_word_embeddings=True, num_key_value_heads=4,
        head_dim=24),
    # Multi-query attention and a sliding window on every layer.
    "mistral_sliding": lambda: _config(
        "MistralConfig", rope_theta=20_000.0, num_key_value_heads=1, sliding_window=5),
    # q/k/v bias, tied embeddings.
    "qwen2_bias": lambda: _config(
        "Qwen2Config", rope_theta=1_000_000.0, tie_word_embeddings=True),
    # q/k RMSNorm per head, head_dim different from hidden_size / heads.
    "qwen3_qk_norm": lambda: _config(
        "Qwen3Config", rope_theta=50_000.0, head_dim=32, tie_word_embeddings=False),
    # Embedding scale, (1 + w) norms, GeGLU, tied embeddings, multi-query attention.
    "gemma": lambda: _config(
        "GemmaConfig", head_dim=16, num_key_value_heads=1, rope_theta=5_000.0),
    # Soft-capping, alternating sliding windows, post norms, query_pre_attn_scalar.
    "gemma2": lambda: _config(
        "Gemma2Config", head_dim=16, num_hidden_layers=4, sliding_window=5,
        attn_logit_softcapping=4.0, final_logit_softcapping=15.0, query_pre_attn_scalar=24),
    # q/k norm, local/global RoPE bases, linear RoPE scaling on global layers, every 3rd global.
    "gemma3_text": lambda: _config(
        "Gemma3TextConfig", head_dim=16, num_hidden_layers=4, sliding_window=5,
        query_pre_attn_scalar=16, layer_types=["sliding_attention", "sliding_attention",
                                               "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": dict(rope_type="linear", factor=4.0,
                                                rope_theta=100_000.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=1_000.0)}),
}


def _build_hf_model(hf_config, seed=0):
  torch.manual_seed(seed)
  hf_config._attn_implementation = "eager"
  model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
  gemma = hf_config.model_type.startswith("gemma")
  with torch.no_grad():
    for name, param in model.named_parameters():
      if "norm" in name:  # Llama scales by w (init 1), Gemma by 1 + w (init 0)
        param.copy_((0.0 if gemma else 1.0) + 0.2 * torch.randn_like(param))
      elif name.endswith(".bias"):
        param.copy_(0.2 * torch.randn_like(param))
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  return model.eval().float()


def _prompts(vocab_size, seed=1):
  rng = np.random.default_rng(seed)
  width = max(PROMPT_LENGTHS)
  tokens = np.zeros((len(PROMPT_LENGTHS), width), np.int32)
  for row, length in enumerate(PROMPT_LENGTHS):
    tokens[row, :length] = rng.integers(3, vocab_size, length)
  return tokens, np.asarray(PROMPT_LENGTHS, np.int32)


@pytest.fixture(name="saved", scope="module", params=sorted(FAMILIES))
def _saved(request, tmp_path_factory):
  """(family name, Hugging Face model, its save_pretrained directory)."""
  hf_model = _build_hf_model(FAMILIES[request.param]())
  path = tmp_path_factory.mktemp(request.param)
  hf_model.save_pretrained(path)
  return request.param, hf_model, path


def _hf_logits(hf_model, tokens, lengths):
  mask = (np.arange(tokens.shape[1])[None] < lengths[:, None]).astype(np.int64)
  with torch.no_grad():
    out = hf_model(input_ids=torch.from_numpy(tokens.astype(np.int64)),
                   attention_mask=torch.from_numpy(mask))
  return out.logits.float().numpy()


def test_logits_match_transformers(saved):
  name, hf_model, path = saved
  model = sj.from_hf(path)
  assert model.dtype == jnp.float32
  tokens, lengths = _prompts(model.vocab_size)
  expected = _hf_logits(hf_model, tokens, lengths)
  got = np.asarray(model(jnp.asarray(tokens), jnp.zeros(len(lengths), jnp.int32)).logits)
  # The cached path (prefill into a KV cache) must agree too.
  cached = np.asarray(model(jnp.asarray(tokens), jnp.zeros(len(lengths), jnp.int32),
                            model.init_cache(len(lengths), 32)).logits)
  diffs = [np.abs(got[row, :n] - expected[row, :n]).max() for row, n in enumerate(lengths)]
  cached_diffs = [np.abs(cached[row, :n] - expected[row, :n]).max()
                  for row, n in enumerate(lengths)]
  print(f"{name}: max abs logit diff {max(diffs):.2e} (cached {max(cached_diffs):.2e}), "
        f"logit scale {np.abs(expected).max():.1f}")
  assert max(diffs) < LOGIT_ATOL, (name, diffs)
  assert max(cached_diffs) < LOGIT_ATOL, (name, cached_diffs)


@pytest.mark.costly
def test_greedy_decode_matches_transformers(saved):
  name, hf_model, path = saved
  model = sj.from_hf(path)
  tokens, lengths = _prompts(model.vocab_size, seed=2)
  out = sj.generate(model, jnp.asarray(tokens), jax.random.key(0), lengths=jnp.asarray(lengths),
                    max_new_tokens=NEW_TOKENS, sampling=sj.Sampling(temperature=0.0))
  ours = np.asarray(out.tokens)
  np.testing.assert_array_equal(np.asarray(out.num_tokens), NEW_TOKENS)
  for row, length in enumerate(lengths):
    prompt = torch.from_numpy(tokens[row:row + 1, :length].astype(np.int64))
    with torch.no_grad():
      theirs = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                 max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, length:].numpy()
    if not np.array_equal(ours[row], theirs):
      step = int(np.argmax(ours[row] != theirs))
      context = np.concatenate([tokens[row, :length], theirs[:step]])[None]
      logits = _hf_logits(hf_model, context, np.asarray([context.shape[1]]))[0, -1]
      top2 = np.sort(logits)[-2:]
      pytest.fail(f"{name} row {row}: first difference at new token {step} "
                  f"(ours {ours[row, step]}, transformers {theirs[step]}); transformers' top-2 "
                  f"logit gap there is {top2[1] - top2[0]:.2e}")


def test_gemma3_multimodal_checkpoint_text_part(tmp_path):
  """A Gemma3ForConditionalGeneration checkpoint: the text decoder is imported, the vision tower
  and projector are skipped, and text-only logits match."""
  text = dict(_COMMON, head_dim=16, num_hidden_layers=4, sliding_window=5,
              query_pre_attn_scalar=16, rope_theta=100_000.0, rope_local_base_freq=1_000.0,
              rope_scaling=dict(rope_type="linear", factor=4.0), sliding_window_pattern=3)
  vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                image_size=28, patch_size=14)
  hf_config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                        mm_tokens_per_image=4, image_token_index=127,
                                        boi_token_index=125, eoi_token_index=126)
  torch.manual_seed(0)
  hf_model = transformers.Gemma3ForConditionalGeneration(hf_config).eval()
  with torch.no_grad():
    for name, param in hf_model.named_parameters():
      if "norm" in name and "language_model" in name:
        param.copy_(0.2 * torch.randn_like(param))
  hf_model.save_pretrained(tmp_path)
  model = sj.from_hf(tmp_path)
  assert model.config.family == "gemma3_text"
  assert (model.config.sliding_window_pattern, model.config.rope_local_theta) == (3, 1_000.0)
  tokens, lengths = _prompts(120)
  expected = _hf_logits(hf_model, tokens, lengths)
  got = np.asarray(model(jnp.asarray(tokens), jnp.zeros(len(lengths), jnp.int32)).logits)
  diff = max(np.abs(got[row, :n] - expected[row, :n]).max() for row, n in enumerate(lengths))
  print(f"gemma3 (multimodal checkpoint, text only): max abs logit diff {diff:.2e}")
  assert diff < LOGIT_ATOL


# ----------------------------------------------------------------------------------------------
# Loading details: sharded safetensors, dtypes, shardings


@pytest.fixture(name="llama", scope="module")
def _llama(tmp_path_factory):
  hf_model = _build_hf_model(FAMILIES["llama3_scaled_rope"]())
  path = tmp_path_factory.mktemp("llama")
  hf_model.save_pretrained(path)
  return hf_model, path


def test_sharded_safetensors_index(llama, tmp_path):
  hf_model, single = llama
  hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
  assert (tmp_path / "model.safetensors.index.json").is_file()
  assert len(list(tmp_path.glob("*.safetensors"))) > 2
  a, b = sj.from_hf(single), sj.from_hf(tmp_path)
  for name, leaf in checkpoint.flatten(a.params).items():
    np.testing.assert_array_equal(leaf, checkpoint.flatten(b.params)[name], err_msg=name)


def test_weights_are_transposed_hf_tensors(llama):
  hf_model, path = llama
  model = sj.from_hf(path)
  state = {k: v.numpy() for k, v in hf_model.state_dict().items()}
  np.testing.assert_array_equal(model.params["embed"], state["model.embed_tokens.weight"])
  np.testing.assert_array_equal(model.params["lm_head"], state["lm_head.weight"].T)
  np.testing.assert_array_equal(model.params["layers"]["wq"][1],
                                state["model.layers.1.self_attn.q_proj.weight"].T)
  np.testing.assert_array_equal(model.params["layers"]["mlp_norm"][2],
                                state["model.layers.2.post_attention_layernorm.weight"])
  assert model.config.rope_scaling == RopeScaling(
      kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
      original_max_position_embeddings=16)
  assert model.config.rope_theta == 500_000.0
  assert (model.config.bos_id, model.config.eos_id) == (1, 2)


def test_bfloat16_checkpoint(llama, tmp_path):
  hf_model, _ = llama
  bf16 = _build_hf_model(FAMILIES["llama3_scaled_rope"]()).to(torch.bfloat16)
  bf16.save_pretrained(tmp_path)
  model = sj.from_hf(tmp_path)
  assert model.dtype == jnp.bfloat16
  expected = bf16.state_dict()["model.layers.0.self_attn.k_proj.weight"].float().numpy().T
  np.testing.assert_array_equal(np.asarray(model.params["layers"]["wk"][0], np.float32), expected)
  as_f32 = sj.from_hf(tmp_path, dtype=jnp.float32)
  assert as_f32.dtype == jnp.float32
  np.testing.assert_array_equal(as_f32.params["layers"]["wk"][0], expected)
  del hf_model


def test_import_into_2x4_mesh_then_save_and_load(llama, tmp_path):
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py sets 8 CPU devices)")
  _, path = llama
  # Auto axes: the forward pass below relies on sharding propagation, not explicit sharding types.
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  reference = sj.from_hf(path)
  shardings = jax.tree.map(lambda x: NamedSharding(mesh, P(*([None] * (x.ndim - 1) + ["model"]))),
                           reference.params)
  model = sj.from_hf(path, sharding=shardings)
  for name, leaf in checkpoint.flatten(model.params).items():
    np.testing.assert_array_equal(leaf, checkpoint.flatten(reference.params)[name])
    assert leaf.addressable_shards[0].data.shape[-1] == leaf.shape[-1] // 4, name
  save(model, tmp_path / "orbax")
  restored = load(tmp_path / "orbax", sharding=shardings)
  tokens = jnp.asarray(_prompts(model.vocab_size)[0])
  starts = jnp.zeros((tokens.shape[0],), jnp.int32)
  np.testing.assert_allclose(restored(tokens, starts).logits, reference(tokens, starts).logits,
                             atol=1e-5)


def test_progress_callback(llama):
  _, path = llama
  seen = []
  sj.from_hf(path, progress=lambda done, total, name: seen.append((done, total, name)))
  total = seen[0][1]
  assert [s[0] for s in seen] == list(range(1, total + 1))
  assert total == 3 + 3 * 9  # embed, final norm, lm_head + 9 tensors per layer


# ----------------------------------------------------------------------------------------------
# Clear errors


def _copy(path, tmp_path) -> pathlib.Path:
  target = tmp_path / "copy"
  shutil.copytree(path, target)
  return target


def _edit_config(path, **changes):
  config = json.loads((path / "config.json").read_text())
  config.update(changes)
  (path / "config.json").write_text(json.dumps(config))


def test_unsupported_architecture(llama, tmp_path):
  path = _copy(llama[1], tmp_path)
  _edit_config(path, model_type="gpt2", architectures=["GPT2LMHeadModel"])
  with pytest.raises(ValueError, match=r"unsupported architecture 'gpt2'.*supported"):
    sj.from_hf(path)


def test_mixture_of_experts_is_named(llama, tmp_path):
  path = _copy(llama[1], tmp_path)
  _edit_config(path, model_type="mixtral", num_local_experts=8)
  with pytest.raises(ValueError, match="mixture-of-experts"):
    sj.from_hf(path)


def test_unsupported_rope_type(llama, tmp_path):
  path = _copy(llama[1], tmp_path)
  _edit_config(path, rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=10_000.0))
  with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
    sj.from_hf(path)


def test_unsupported_feature_o_proj_bias(llama, tmp_path):
  path = _copy(llama[1], tmp_path)
  _edit_config(path, attention_bias=True)
  with pytest.raises(ValueError, match="attention_bias"):
    sj.from_hf(path)


def test_missing_tensor(llama, tmp_path):
  from safetensors.numpy import load_file, save_file
  path = _copy(llama[1], tmp_path)
  tensors = load_file(path / "model.safetensors")
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"):
    sj.from_hf(path)


def test_unexpected_tensor(llama, tmp_path):
  from safetensors.numpy import load_file, save_file
  path = _copy(llama[1], tmp_path)
  tensors = load_file(path / "model.safetensors")
  tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)
  save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"does not understand.*o_proj.bias"):
    sj.from_hf(path)


def test_shape_mismatch(llama, tmp_path):
  path = _copy(llama[1], tmp_path)
  _edit_config(path, intermediate_size=96)
  with pytest.raises(ValueError, match=r"shape mismatch: layers/w_down: expected \(3, 96, 64\), "
                     r"found \(3, 128, 64\)"):
    sj.from_hf(path)


def test_truncated_safetensors(llama, tmp_path):
  path = _copy(llama[1], tmp_path)
  data = (path / "model.safetensors").read_bytes()
  (path / "model.safetensors").write_bytes(data[:len(data) // 2])
  with pytest.raises(ValueError, match="corrupt safetensors file"):
    sj.from_hf(path)


def test_missing_shard(llama, tmp_path):
  llama[0].save_pretrained(tmp_path, max_shard_size="40KB")
  shards = sorted(tmp_path.glob("model-*.safetensors"))
  shards[-1].unlink()
  with pytest.raises(ValueError, match=f"safetensors file .*{shards[-1].name} is missing"):
    sj.from_hf(tmp_path)


def test_no_config_or_no_weights(llama, tmp_path):
  path = _copy(llama[1], tmp_path)
  (path / "model.safetensors").rename(path / "pytorch_model.bin")
  with pytest.raises(ValueError, match="no safetensors weights.*pytorch_model.bin"):
    sj.from_hf(path)
  (path / "config.json").unlink()
  with pytest.raises(FileNotFoundError, match="no config.json"):
    sj.from_hf(path)


# ----------------------------------------------------------------------------------------------
# `specjax convert`


def test_convert_command(llama, tmp_path, capsys):
  from tokenizers import Tokenizer, models, pre_tokenizers

  from specjax.cli import main as cli

  hf_model, source = llama
  hf_dir = _copy(source, tmp_path)
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(125)}}
  backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  backend.pre_tokenizer = pre_tokenizers.Whitespace()
  backend.save(str(hf_dir / "tokenizer.json"))
  out = tmp_path / "converted"

  assert cli.main(["convert", str(hf_dir), str(out)]) == 0
  printed = capsys.readouterr()
  assert "llama, 3 layers" in printed.out and "tokenizer.json" in printed.out
  converted, direct = load(out), sj.from_hf(hf_dir)
  assert converted.config == direct.config
  for name, leaf in checkpoint.flatten(direct.params).items():
    np.testing.assert_array_equal(checkpoint.flatten(converted.params)[name], leaf)
  assert load_tokenizer(out).encode("w4 w7 w1") == [7, 10, 4]
  assert (hf_model.config.bos_token_id, hf_model.config.eos_token_id) == (
      converted.config.bos_id, converted.config.eos_id)

  assert cli.main(["convert", str(hf_dir), str(out)]) == 2
  assert "already exists" in capsys.readouterr().err
  assert cli.main(["convert", str(hf_dir), str(out), "--overwrite", "--dtype", "bfloat16"]) == 0
  assert load(out).dtype == jnp.bfloat16

  _edit_config(hf_dir, model_type="falcon")
  assert cli.main(["convert", str(hf_dir), str(tmp_path / "other")]) == 2
  assert "unsupported architecture 'falcon'" in capsys.readouterr().err
  assert not (tmp_path / "other").exists()
