"""DFlash block drafters: parity with an independent reference, the checkpoint layout, bad input,
and greedy identity with `generate`.

Parity. The reference is assembled here from `transformers`' Qwen3 modules (`Qwen3DecoderLayer`'s
projections, per-head q/k RMSNorms, SwiGLU MLP and layer norms, `Qwen3RMSNorm`,
`Qwen3RotaryEmbedding`, `apply_rotary_pos_emb`, `repeat_kv`, PyTorch's SDPA) wired as the
published architecture: the target's layer outputs at `target_layer_ids` (Hugging Face's
`hidden_states[i + 1]` of a `transformers` Qwen3 target) concatenated -> `fc` -> `hidden_norm`;
per layer `K = k_norm(k_proj([ctx; x]))`, `V = v_proj([ctx; x])`, queries from the block only,
no mask inside the block, RoPE at absolute positions; final norm; the target's `lm_head` at block
slots 1.. . Random weights (norms too), float32. Its weights are saved in the published layout and
loaded with `load_dflash`; the target with `sj.from_hf`. specjax's logits (through the drafter's
own `init` / `observe` / `block_logits`, i.e. the cached context) must match to float32 rounding
(`PARITY_ATOL`); two broken variants, attention causal inside the block and taps shifted by one
layer, must miss by more than `BROKEN_MIN`.
"""

import dataclasses
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.drafters import DFlashDrafter, load_dflash
from specjax.drafters.dflash import network as dflash
from specjax.drafters.dflash.checkpoint import save_dflash, target_tables
from specjax.loop.state import target_features
from specjax.models.transformer import ForwardOutput
from specjax.testing.models import tiny_config

torch = pytest.importorskip("torch", reason="the transformers peer needs torch (install the "
                            "'peer' extra: pip install -e .[peer])")
transformers = pytest.importorskip("transformers", reason="the peer implementation (install the "
                                   "'peer' extra: pip install -e .[peer])")
from transformers.models.qwen3 import modeling_qwen3 as qwen3  # noqa: E402

PARITY_ATOL = 1e-4  # float32; the measured difference is printed (about 1e-6)
BROKEN_MIN = 1e-2
VOCAB, HIDDEN, TARGET_LAYERS = 96, 32, 4
# The target's layers 1 and 3: tap 2, and the last layer, which the published drafter reads as
# Hugging Face's hidden_states[4], the final normed state.
LAYER_IDS = (1, 3)
BLOCK = 6
MASK = 95
PROMPTS = ([5, 17, 33, 2, 8, 41, 9, 60, 12, 7, 30], [11, 4, 70, 22, 5])


def _qwen3_config(**overrides):
  base = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
              num_hidden_layers=TARGET_LAYERS, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10_000.0,
              tie_word_embeddings=False, initializer_range=0.15)
  base.update(overrides)
  config = transformers.Qwen3Config(**base)
  config._attn_implementation = "eager"
  return config


def _randomize_norms(module):
  with torch.no_grad():
    for name, param in module.named_parameters():
      if "norm" in name:
        param.copy_(1.0 + 0.2 * torch.randn_like(param))


class ReferenceDFlash(torch.nn.Module):
  """The published DFlash drafter, assembled from `transformers`' Qwen3 modules."""

  def __init__(self, config, num_layers: int, num_taps: int):
    super().__init__()
    self.config = config
    self.layers = torch.nn.ModuleList(qwen3.Qwen3DecoderLayer(config, i)
                                      for i in range(num_layers))
    self.fc = torch.nn.Linear(num_taps * config.hidden_size, config.hidden_size, bias=False)
    self.hidden_norm = qwen3.Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    self.norm = qwen3.Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    self.rotary = qwen3.Qwen3RotaryEmbedding(config)

  def forward(self, target_hidden, noise, positions):
    """`target_hidden [B, C, n*H]`, `noise [B, T, H]` (the embedded block), `positions [B, C + T]`
    -> `[B, T, H]` after the final norm."""
    ctx = self.hidden_norm(self.fc(target_hidden))
    cos, sin = self.rotary(noise, positions)
    batch, length, _ = noise.shape
    head_dim = self.config.head_dim
    x = noise
    for layer in self.layers:
      attn = layer.self_attn
      h = layer.input_layernorm(x)
      q = attn.q_norm(attn.q_proj(h).view(batch, length, -1, head_dim)).transpose(1, 2)
      both = torch.cat([ctx, h], dim=1)
      k = attn.k_norm(attn.k_proj(both).view(batch, both.shape[1], -1, head_dim)).transpose(1, 2)
      v = attn.v_proj(both).view(batch, both.shape[1], -1, head_dim).transpose(1, 2)
      q, _ = qwen3.apply_rotary_pos_emb(q, q, cos[:, -length:], sin[:, -length:])
      k, _ = qwen3.apply_rotary_pos_emb(k, k, cos, sin)
      groups = self.config.num_attention_heads // self.config.num_key_value_heads
      k, v = qwen3.repeat_kv(k, groups), qwen3.repeat_kv(v, groups)
      out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=head_dim ** -0.5)
      x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
      x = x + layer.mlp(layer.post_attention_layernorm(x))
    return self.norm(x)


def write_checkpoint(reference, path, *, layout="nested", num_target_layers=TARGET_LAYERS,
                     layer_ids=LAYER_IDS, extra=None):
  """The reference's weights in the published layout (config.json + model.safetensors)."""
  from safetensors.torch import save_file
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  tensors = {"fc.weight": reference.fc.weight, "hidden_norm.weight": reference.hidden_norm.weight,
             "norm.weight": reference.norm.weight}
  for i, layer in enumerate(reference.layers):
    for name, value in layer.state_dict().items():
      tensors[f"layers.{i}.{name}"] = value
  save_file({k: v.detach().contiguous() for k, v in tensors.items()},
            str(path / "model.safetensors"))
  c = reference.config
  inner = {"mask_token_id": MASK, "target_layer_ids": list(layer_ids)}
  config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": c.hidden_size, "num_hidden_layers": len(reference.layers),
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size,
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": 10_000.0,
            "num_target_layers": num_target_layers, "dflash_config": inner}
  if layout == "nested":
    inner["block_size"] = BLOCK
  else:
    config["block_size"] = BLOCK
  config.update(extra or {})
  (path / "config.json").write_text(json.dumps(config))
  return path


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
  """(HF target, specjax target, reference drafter, its checkpoint directory)."""
  torch.manual_seed(0)
  hf_target = transformers.Qwen3ForCausalLM(_qwen3_config()).eval().float()
  _randomize_norms(hf_target)
  target_dir = tmp_path_factory.mktemp("qwen3_target")
  hf_target.save_pretrained(target_dir)
  target = sj.from_hf(target_dir)
  reference = ReferenceDFlash(_qwen3_config(), num_layers=2, num_taps=len(LAYER_IDS))
  with torch.no_grad():
    for p in reference.parameters():
      p.copy_(0.15 * torch.randn_like(p))
  _randomize_norms(reference)
  reference.eval()
  return hf_target, target, reference, write_checkpoint(reference,
                                                         tmp_path_factory.mktemp("dflash"))


def reference_logits(hf_target, reference, prompt) -> np.ndarray:
  """`[B - 1, V]` the reference's block logits after `prompt` (context: positions 0 .. L - 2)."""
  length = len(prompt)
  ids = torch.tensor([prompt])
  with torch.no_grad():
    states = hf_target(ids, output_hidden_states=True).hidden_states
    target_hidden = torch.cat([states[i + 1][:, :length - 1] for i in LAYER_IDS], dim=-1)
    block = torch.tensor([[prompt[-1]] + [MASK] * (BLOCK - 1)])
    noise = hf_target.get_input_embeddings()(block)
    positions = torch.arange(length - 1 + BLOCK)[None]
    hidden = reference(target_hidden, noise, positions)
    return hf_target.lm_head(hidden[:, 1:]).float().numpy()[0]


def _padded(prompts):
  width = max(len(p) for p in prompts)
  tokens = np.zeros((len(prompts), width), np.int32)
  for row, p in enumerate(prompts):
    tokens[row, :len(p)] = p
  return jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts], jnp.int32)


def specjax_logits(target, drafter, prompts, *, causal=False, split=None) -> np.ndarray:
  """`[B, block - 1, V]` through the drafter's own state: `init` on the prompts (or, with `split`,
  on their first `split` tokens, then `observe` of the rest as one verified block)."""
  tokens, lengths = _padded(prompts)
  out = target(tokens, jnp.zeros_like(lengths), None, **target_features(drafter))
  buffer = tokens.shape[1] + BLOCK + 4
  if split is None:
    state = drafter.init(tokens, lengths, buffer, out)
  else:
    first = jnp.minimum(lengths, split)
    state = drafter.init(tokens, first, buffer, out)
    count = lengths - first  # positions first - 1 .. lengths - 2 arrive as one block
    width = int(count.max()) + 1
    index = (first - 1)[:, None] + jnp.arange(width)[None]
    index = jnp.clip(index, 0, tokens.shape[1] - 1)[:, :, None]
    taps = jnp.take_along_axis(out.taps, index[None], axis=2)
    hidden = None if out.hidden is None else jnp.take_along_axis(out.hidden, index, axis=1)
    state = drafter.observe(state, ForwardOutput(out.logits, hidden=hidden, taps=taps), None,
                            None, count, first)
  return np.asarray(drafter.block_logits(state, tokens, lengths, causal=causal))


def _max_diff(target, hf_target, reference, drafter, **kwargs) -> float:
  ours = specjax_logits(target, drafter, PROMPTS, **kwargs)
  return max(float(np.abs(ours[row] - reference_logits(hf_target, reference, p)).max())
             for row, p in enumerate(PROMPTS))


@pytest.mark.parametrize("split", [None, 4])
def test_logits_match_reference(peer, split):
  hf_target, target, reference, path = peer
  drafter = load_dflash(path, target)
  diff = _max_diff(target, hf_target, reference, drafter, split=split)
  print(f"max |specjax - reference| = {diff:.3g}")
  assert diff < PARITY_ATOL


def test_causal_block_fails_parity(peer):
  hf_target, target, reference, path = peer
  diff = _max_diff(target, hf_target, reference, load_dflash(path, target), causal=True)
  print(f"causal inside the block: max diff {diff:.3g}")
  assert diff > BROKEN_MIN


def test_taps_shifted_by_one_layer_fail_parity(peer):
  hf_target, target, reference, path = peer
  drafter = load_dflash(path, target)
  config = dataclasses.replace(drafter.network.config,
                               target_layer_ids=tuple(i - 1 for i in LAYER_IDS))
  shifted = dataclasses.replace(drafter, network=dflash.DFlashNetwork(drafter.network.params,
                                                                      config))
  diff = _max_diff(target, hf_target, reference, shifted)
  print(f"taps shifted by one layer: max diff {diff:.3g}")
  assert diff > BROKEN_MIN


def test_top_level_block_size_layout_loads_the_same(peer, tmp_path):
  hf_target, target, reference, _ = peer
  path = write_checkpoint(reference, tmp_path / "top", layout="top")
  drafter = load_dflash(path, target)
  assert drafter.network.config.block_size == BLOCK
  assert _max_diff(target, hf_target, reference, drafter) < PARITY_ATOL


def test_save_in_published_layout_round_trips(peer, tmp_path):
  _, target, _, path = peer
  drafter = load_dflash(path, target)
  for layout, dtype in (("nested", "float32"), ("top", "bfloat16")):
    saved = save_dflash(drafter.network, tmp_path / layout, layout=layout, dtype=dtype)
    again = load_dflash(saved, target)
    assert again.network.config == drafter.network.config
    tol = 0 if dtype == "float32" else 1e-2
    for a, b in zip(jax.tree.leaves(drafter.network.params), jax.tree.leaves(again.network.params)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------------
# Bad input: a clear ValueError naming the problem, before anything compiles.


def _copy(path, tmp_path) -> pathlib.Path:
  out = tmp_path / "copy"
  shutil.copytree(path, out)
  return out


def _edit(path, **changes):
  config = json.loads((path / "config.json").read_text())
  config.update(changes)
  (path / "config.json").write_text(json.dumps(config))


def test_truncated_safetensors(peer, tmp_path):
  path = _copy(peer[3], tmp_path)
  data = (path / "model.safetensors").read_bytes()
  (path / "model.safetensors").write_bytes(data[:len(data) // 2])
  with pytest.raises(ValueError, match="corrupt safetensors file"):
    load_dflash(path, peer[1])


def test_missing_tensor(peer, tmp_path):
  from safetensors.numpy import load_file, save_file
  path = _copy(peer[3], tmp_path)
  tensors = load_file(str(path / "model.safetensors"))
  del tensors["layers.1.self_attn.k_norm.weight"]
  save_file(tensors, str(path / "model.safetensors"))
  with pytest.raises(ValueError, match=r"missing layers\.1\.self_attn\.k_norm\.weight"):
    load_dflash(path, peer[1])


def test_missing_config_fields(peer, tmp_path):
  path = _copy(peer[3], tmp_path)
  _edit(path, dflash_config={"target_layer_ids": list(LAYER_IDS)})
  with pytest.raises(ValueError, match="mask_token_id is missing"):
    load_dflash(path, peer[1])
  _edit(path, dflash_config={"mask_token_id": MASK})
  with pytest.raises(ValueError, match="target_layer_ids must be a non-empty list"):
    load_dflash(path, peer[1])


def test_dflash2_is_refused(peer, tmp_path):
  path = _copy(peer[3], tmp_path)
  _edit(path, architectures=["DFlash2DraftModel"])
  with pytest.raises(ValueError, match="DFlash2"):
    load_dflash(path, peer[1])


def test_target_width_mismatch(peer):
  wide = sj.init_params(tiny_config(vocab_size=VOCAB, embed_dim=48, num_layers=TARGET_LAYERS),
                        jax.random.key(0))
  with pytest.raises(ValueError, match="hidden_size \\(32\\) does not match the target's "
                     "embed_dim \\(48\\)"):
    load_dflash(peer[3], wide)


def test_vocabulary_mismatch(peer):
  other = sj.init_params(tiny_config(vocab_size=128, embed_dim=HIDDEN, num_layers=TARGET_LAYERS),
                         jax.random.key(0))
  with pytest.raises(ValueError, match="vocab_size \\(96\\) does not match the target's "
                     "vocabulary \\(128\\)"):
    load_dflash(peer[3], other)


def test_target_layer_count_mismatch(peer, tmp_path):
  shallow = sj.init_params(tiny_config(vocab_size=VOCAB, embed_dim=HIDDEN, num_layers=3),
                           jax.random.key(0))
  with pytest.raises(ValueError, match="num_target_layers = 4, this target has 3 layers"):
    load_dflash(peer[3], shallow)
  path = _copy(peer[3], tmp_path)  # no num_target_layers: target_layer_ids alone must fit
  config = json.loads((path / "config.json").read_text())
  del config["num_target_layers"]
  (path / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r"target_layer_ids \[1, 3\] name layers past the "
                     "target's 3"):
    load_dflash(path, shallow)


def test_layer_ids_outside_the_stated_target(peer, tmp_path):
  path = _copy(peer[3], tmp_path)
  _edit(path, dflash_config={"mask_token_id": MASK, "target_layer_ids": [1, 4],
                             "block_size": BLOCK})
  with pytest.raises(ValueError, match="target_layer_ids \\[1, 4\\] must lie in "
                     "0..num_target_layers - 1 \\(4\\)"):
    load_dflash(path, peer[1])


def test_decode_checks_the_target_before_compiling(peer):
  drafter = load_dflash(peer[3], peer[1])
  shallow = sj.init_params(tiny_config(vocab_size=VOCAB, embed_dim=HIDDEN, num_layers=3),
                           jax.random.key(0))
  tokens = jnp.asarray([PROMPTS[1]], jnp.int32)
  with pytest.raises(ValueError, match="num_target_layers = 4"):
    sj.decode(shallow, drafter, tokens, jax.random.key(0), max_new_tokens=4, num_draft=2)
  with pytest.raises(ValueError, match="num_target_layers = 4"):
    sj.decode(shallow, drafter, tokens, jax.random.key(0), max_new_tokens=4,
              tree=sj.TreeSpec(builder="ddtree", depth=2, width=2))
  with pytest.raises(ValueError, match="exceeds what this DFlash drafter drafts in one block"):
    sj.decode(peer[1], drafter, tokens, jax.random.key(0), max_new_tokens=4, num_draft=BLOCK)
  with pytest.raises(ValueError, match="not 'dynamic'"):
    sj.decode(peer[1], drafter, tokens, jax.random.key(0), max_new_tokens=4,
              tree=sj.TreeSpec(builder="dynamic", depth=2, width=2))
  with pytest.raises(ValueError, match="tree of depth 6 exceeds the DFlash block's 5 drafts"):
    sj.decode(peer[1], drafter, tokens, jax.random.key(0), max_new_tokens=4,
              tree=sj.TreeSpec(builder="ddtree", depth=6, width=2))
  with pytest.raises(ValueError, match="'ddtree' tree is built from a block drafter"):
    sj.decode(peer[1], shallow, tokens, jax.random.key(0), max_new_tokens=4,
              tree=sj.TreeSpec(builder="ddtree", depth=2, width=2))
  with pytest.raises(ValueError, match="mode must be one of"):
    DFlashDrafter(drafter.network, drafter.target_embed, drafter.target_head, mode="beam")


# ---------------------------------------------------------------------------------------------
# Greedy identity with `generate` on a ragged batch, for every proposal mode.

GREEDY_VOCAB = 16  # small, so that random weights still accept some drafts (checked below)


@pytest.fixture(scope="module")
def small():
  target = sj.init_params(tiny_config(vocab_size=GREEDY_VOCAB, num_layers=3), jax.random.key(3))
  config = dflash.DFlashConfig(embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                               head_dim=8, mlp_dim=64, vocab_size=GREEDY_VOCAB, block_size=5,
                               mask_token_id=GREEDY_VOCAB - 1, target_layer_ids=(0, 2),
                               num_target_layers=3)
  embed, head = target_tables(target)
  network = dflash.init_network(config, jax.random.key(4), scale=0.3)
  tokens, lengths = _padded([[1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 3, 11], [4, 4, 4, 4, 4, 2]])
  return target, network, embed, head, tokens, lengths


# The argmax chain and DDTree in the default selection; the sampled chain (greedy: the same
# argmax drafts, about 5 s) in CI's costly step.
@pytest.mark.parametrize("mode,tree", [
    ("argmax", None),
    pytest.param("sampled", None, marks=pytest.mark.costly),
    ("argmax", sj.TreeSpec(builder="ddtree", depth=4, width=3, num_nodes=12))])
def test_greedy_matches_generate_on_ragged_batch(small, mode, tree):
  target, network, embed, head, tokens, lengths = small
  drafter = DFlashDrafter(network, embed, head, mode=mode)
  ref = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=20)
  kwargs = dict(num_draft=4) if tree is None else dict(tree=tree)
  out = sj.decode(target, drafter, tokens, jax.random.key(0), lengths=lengths,
                  max_new_tokens=20, **kwargs)
  np.testing.assert_array_equal(np.asarray(out.num_tokens), np.asarray(ref.num_tokens))
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
  summary = out.stats.summary()
  print(mode, tree and tree.builder, summary["tokens_per_round"])
  assert summary["accepted"] > 0  # drafts were accepted and rejected: both paths exercised
  assert summary["rounds"] > 20 * 3 / (4 + 1)
