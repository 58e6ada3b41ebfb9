"""Consistency of the decoder and its KV cache: cached, blocked and full passes agree."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.loop import KVCache
from specjax.models import RopeScaling
from specjax.models import gemma_style, transformer
from specjax.testing.models import tiny_config

# The forward jitted, as every caller runs it (eagerly each op of a forward dispatches alone).
forward = jax.jit(transformer.forward, static_argnames=("taps", "return_hidden", "write_cache"))

TOL = dict(atol=2e-5, rtol=2e-5)

CONFIGS = {
    "llama": tiny_config(vocab_size=97),
    "llama_tied_bias_qknorm": tiny_config(vocab_size=97, tie_embeddings=True, qkv_bias=True,
                                          qk_norm=True, num_kv_heads=1),
    "gemma2": gemma_style(tiny_config(vocab_size=97), sliding_window=5),
    "llama31_rope": tiny_config(vocab_size=97, rope_theta=500_000.0,
                                rope_scaling=RopeScaling(factor=8.0,
                                                            original_max_position_embeddings=16)),
}


def _model(name, seed=0):
  model = sj.init_params(CONFIGS[name], jax.random.key(seed))
  if CONFIGS[name].qkv_bias:  # give the zero-initialised biases real values
    layers = dict(model.params["layers"])
    for key in ("bq", "bk", "bv"):
      layers[key] = 0.1 * jax.random.normal(jax.random.key(7), layers[key].shape)
    model = sj.Model(dict(model.params, layers=layers), model.config)
  return model


def _tokens(batch, width, vocab, seed=1):
  return jax.random.randint(jax.random.key(seed), (batch, width), 0, vocab, jnp.int32)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_then_steps_equals_full_forward(name):
  model = _model(name)
  tokens = _tokens(3, 12, model.vocab_size)
  full = forward(model, tokens, jnp.zeros(3, jnp.int32)).logits  # [3, 12, V], no cache
  prompt_lengths = jnp.array([3, 6, 4], jnp.int32)
  cache = model.init_cache(3, 16)
  prefill = forward(model, tokens[:, :6], jnp.zeros(3, jnp.int32), cache)
  for b, length in enumerate(np.asarray(prompt_lengths)):
    np.testing.assert_allclose(prefill.logits[b, :length], full[b, :length], **TOL)
  cache = prefill.cache.with_lengths(prompt_lengths)
  step_fn = jax.jit(forward)
  for _ in range(5):  # each row continues from its own length
    positions = cache.lengths
    step_tokens = jnp.take_along_axis(tokens, positions[:, None], axis=1)
    out = step_fn(model, step_tokens, positions, cache)
    expected = jnp.take_along_axis(full, positions[:, None, None], axis=1)
    np.testing.assert_allclose(out.logits, expected, **TOL)
    cache = out.cache
  np.testing.assert_array_equal(cache.lengths, prompt_lengths + 5)


@pytest.mark.parametrize("name", ["llama", "llama_tied_bias_qknorm"])
@pytest.mark.parametrize("layout", ["stacked", "cpu"])
def test_logits_at_scores_only_the_chosen_rows(name, layout):
  """`logits_at` gives the full forward's logits at those rows (ragged, one or two per row, tied
  and untied output projections, the scan and the CPU layout), the same cache, and a whole
  `hidden`; `generate`, whose prefill scores only each row's last prompt token, keeps its tokens."""
  model = _model(name)
  model = model.for_platform("cpu") if layout == "cpu" else model
  tokens = _tokens(3, 9, model.vocab_size)
  starts = jnp.zeros(3, jnp.int32)
  run = jax.jit(lambda m, t, c, at: m(t, starts, c, return_hidden=True, logits_at=at))
  full = run(model, tokens, model.init_cache(3, 12), None)
  at = jnp.asarray([[8, 0], [3, 3], [5, 7]], jnp.int32)
  chosen = run(model, tokens, model.init_cache(3, 12), at)
  assert chosen.logits.shape == (3, 2, model.vocab_size)
  np.testing.assert_allclose(chosen.logits, jnp.take_along_axis(full.logits, at[..., None], 1),
                             **TOL)
  np.testing.assert_array_equal(chosen.hidden, full.hidden)
  np.testing.assert_array_equal(chosen.cache.k[0], full.cache.k[0])
  lengths = jnp.asarray([9, 4, 6], jnp.int32)
  out = sj.generate(model, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=5)
  rows = np.zeros((3, 14), np.int32)  # greedy by hand: a cache-free causal pass per token
  rows[:, :9] = np.asarray(tokens)
  for i in range(5):
    logits = np.asarray(forward(model, jnp.asarray(rows), starts).logits)
    for r, length in enumerate(np.asarray(lengths)):
      rows[r, length + i] = logits[r, length + i - 1].argmax()
  for r, length in enumerate(np.asarray(lengths)):
    np.testing.assert_array_equal(out.tokens[r], rows[r, length:length + 5])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_block_forward_equals_single_token_steps(name):
  model = _model(name)
  tokens = _tokens(2, 14, model.vocab_size, seed=2)
  offsets = jnp.array([4, 7], jnp.int32)
  cache = model.init_cache(2, 20)
  cache = forward(model, tokens[:, :7], jnp.zeros(2, jnp.int32), cache).cache.with_lengths(offsets)
  block = 5
  block_tokens = jax.vmap(lambda row, start: jax.lax.dynamic_slice(row, (start,), (block,)))(
      tokens, offsets)
  blocked = forward(model, block_tokens, offsets, cache)
  stepped_cache = cache
  for i in range(block):
    out = forward(model, block_tokens[:, i:i + 1], offsets + i, stepped_cache)
    np.testing.assert_allclose(blocked.logits[:, i], out.logits[:, 0], **TOL)
    stepped_cache = out.cache
  np.testing.assert_array_equal(blocked.cache.lengths, offsets + block)
  # Both paths leave the same keys in the valid slots.
  for b in range(2):
    end = int(offsets[b]) + block
    np.testing.assert_allclose(blocked.cache.k[:, b, :, :end], stepped_cache.k[:, b, :, :end],
                               **TOL)


def test_rollback_then_rewrite_equals_never_written():
  model = _model("llama")
  tokens = _tokens(2, 8, model.vocab_size, seed=3)
  cache = model.init_cache(2, 16)
  base = forward(model, tokens[:, :5], jnp.zeros(2, jnp.int32), cache).cache
  base = base.with_lengths(jnp.array([5, 3], jnp.int32))
  junk = _tokens(2, 4, model.vocab_size, seed=4)
  dirty = forward(model, junk, base.lengths, base).cache  # written, then rejected
  rolled_back = dirty.with_lengths(base.lengths)
  block = _tokens(2, 3, model.vocab_size, seed=5)
  clean = forward(model, block, base.lengths, base)
  reused = forward(model, block, rolled_back.lengths, rolled_back)
  np.testing.assert_allclose(reused.logits, clean.logits, atol=1e-6, rtol=1e-6)
  # Partial rollback: keep the first junk token, drop the rest; equals writing only it.
  one = forward(model, junk[:, :1], base.lengths, base).cache
  partial = dirty.with_lengths(base.lengths + 1)
  np.testing.assert_allclose(forward(model, block, partial.lengths, partial).logits,
                             forward(model, block, one.lengths, one).logits, atol=1e-6, rtol=1e-6)


def test_stale_slots_past_length_are_never_read():
  model = _model("llama")
  tokens = _tokens(1, 6, model.vocab_size, seed=6)
  cache = model.init_cache(1, 12)
  poisoned = KVCache(cache.k.at[:, :, :, 6:].set(1e4), cache.v.at[:, :, :, 6:].set(-1e4),
                        cache.lengths)
  a = forward(model, tokens, jnp.zeros(1, jnp.int32), cache).logits
  b = forward(model, tokens, jnp.zeros(1, jnp.int32), poisoned).logits
  np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)


def test_sliding_window_limits_attention():
  config = gemma_style(tiny_config(vocab_size=31), sliding_window=3, sliding_window_pattern=100)
  model = sj.init_params(config, jax.random.key(0))
  tokens = _tokens(1, 10, 31, seed=8)
  changed = tokens.at[0, 0].set((tokens[0, 0] + 1) % 31)
  a = forward(model, tokens, jnp.zeros(1, jnp.int32)).logits
  b = forward(model, changed, jnp.zeros(1, jnp.int32)).logits
  # With every layer local (window 3, 2 layers) token 0 reaches at most positions 0..4.
  np.testing.assert_allclose(a[0, 5:], b[0, 5:], atol=1e-6)
  assert np.max(np.abs(a[0, 1:3] - b[0, 1:3])) > 1e-4


def test_cache_room_and_write_bounds():
  cache = KVCache.create(2, 3, 10, 1, 4)
  cache = cache.with_lengths(jnp.array([0, 4, 10]))
  np.testing.assert_array_equal(cache.room(), [10, 6, 0])


def _reference_stream(model, tokens):
  """The residual stream entering every layer (and after the last), by a hand-written Llama
  forward: no cache, no scan, plain jnp per layer. `[L + 1, B, T, E]`."""
  c, p = model.config, model.params
  b, t = tokens.shape
  pos = jnp.arange(t, dtype=jnp.float32)
  inv = 1.0 / c.rope_theta ** (jnp.arange(0, c.head_dim, 2, dtype=jnp.float32) / c.head_dim)
  angles = jnp.concatenate([pos[:, None] * inv] * 2, axis=-1)  # [T, D]

  def norm(x, w):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + c.norm_eps) * w

  def rope(x):  # [B, T, H, D]
    half = c.head_dim // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * jnp.cos(angles)[:, None] + rotated * jnp.sin(angles)[:, None]

  x = p["embed"][tokens]
  stream = [x]
  group = c.num_heads // c.num_kv_heads
  causal = jnp.tril(jnp.ones((t, t), bool))
  for i in range(c.num_layers):
    lp = {name: w[i] for name, w in p["layers"].items()}
    h = norm(x, lp["attn_norm"])
    q = rope((h @ lp["wq"]).reshape(b, t, c.num_heads, c.head_dim))
    k = rope((h @ lp["wk"]).reshape(b, t, c.num_kv_heads, c.head_dim))
    v = (h @ lp["wv"]).reshape(b, t, c.num_kv_heads, c.head_dim)
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(c.head_dim)
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, -1) @ lp["wo"]
    h = norm(x, lp["mlp_norm"])
    x = x + (jax.nn.silu(h @ lp["w_gate"]) * (h @ lp["w_up"])) @ lp["w_down"]
    stream.append(x)
  return jnp.stack(stream)


def test_taps_equal_a_hand_unrolled_forward():
  config = tiny_config(vocab_size=97, num_layers=4)
  model = sj.init_params(config, jax.random.key(3))
  tokens = _tokens(2, 6, 97, seed=9)
  stream = _reference_stream(model, tokens)  # [L + 1, B, T, E]
  taps = (4, 0, 2, 2)  # any order, repeats allowed, L = after the last layer
  plain = forward(model, tokens, jnp.zeros(2, jnp.int32))
  out = forward(model, tokens, jnp.zeros(2, jnp.int32), taps=taps, return_hidden=True)
  assert out.taps.shape == (4, 2, 6, config.embed_dim)
  np.testing.assert_allclose(out.taps, stream[np.array(taps)], **TOL)
  np.testing.assert_array_equal(out.logits, plain.logits)  # taps never change the logits
  assert plain.taps is None and plain.hidden is None
  # With a cache: a prefill and then a block continue the same stream.
  cache = model.init_cache(2, 16)
  first = forward(model, tokens[:, :4], jnp.zeros(2, jnp.int32), cache, taps=taps)
  rest = jax.jit(forward, static_argnames="taps")(model, tokens[:, 4:], jnp.full(2, 4, jnp.int32),
                                                   first.cache, taps=taps)
  np.testing.assert_allclose(jnp.concatenate([first.taps, rest.taps], axis=2),
                             stream[np.array(taps)], **TOL)


@pytest.mark.parametrize("taps", [(5,), (-1,), ("a",), 3])
def test_bad_taps_raise_before_tracing(taps):
  model = _model("llama")
  with pytest.raises(ValueError, match="taps"):
    forward(model, _tokens(1, 2, 97), jnp.zeros(1, jnp.int32), taps=taps)


@pytest.mark.costly
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_unstacked_layers_equal_the_stacked_scan(name):
  """The CPU layout (per-layer weights and cache buffers, an unrolled loop) computes exactly what
  the stacked `lax.scan` computes: same logits, taps and cached keys, prefill and steps."""
  stacked = _model(name)
  unstacked = stacked.unstacked()
  fused = unstacked.with_fused_projections()  # CPU: one fused [out, in] copy per projection
  assert stacked.is_stacked and not unstacked.is_stacked
  layer = set(fused.params["layers"][0])
  assert {f"{n}_t" for n in ("wqkv", "wo", "w_gate_up", "w_down")} <= layer
  assert not any(name.endswith("_halves") for name in layer)  # one copy of each weight
  assert not {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"} & set(fused.params["layers"][0])
  assert unstacked.init_cache(2, 16).per_layer and not stacked.init_cache(2, 16).per_layer
  tokens = _tokens(2, 10, stacked.vocab_size, seed=11)
  step = jax.jit(forward, static_argnames="taps")
  outs = {}
  for label, m in (("stacked", stacked), ("unstacked", unstacked), ("fused", fused)):
    out = step(m, tokens[:, :6], jnp.zeros(2, jnp.int32), m.init_cache(2, 16), taps=(0, 1, 2))
    logits = [out.logits]
    for i in range(6, 10):  # single-token steps continue each layout's own cache
      out = step(m, tokens[:, i:i + 1], jnp.full(2, i, jnp.int32), out.cache, taps=(0, 1, 2))
      logits.append(out.logits)
    cache = out.cache.stacked()
    if label == "stacked":  # its slots rounded up to CACHE_SLOT_MULTIPLE; the extra ones unwritten
      assert cache.k.shape[-2] == transformer.CACHE_SLOT_MULTIPLE
      assert not jnp.any(cache.k[..., 16:, :]) and not jnp.any(cache.v[..., 16:, :])
    outs[label] = (jnp.concatenate(logits, axis=1), out.taps, cache.k[..., :16, :],
                   cache.v[..., :16, :])
  # XLA fuses the unrolled layers' elementwise ops differently from the scan body (e.g. tanh
  # soft-capping, GeGLU), so the last bits may differ; the dots see the same operands.
  for other in ("unstacked", "fused"):
    for a, b in zip(outs["stacked"], outs[other]):
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  # Batch 1: the CPU layout's one-row steps and its prefill read the same single copy.
  out = step(fused, tokens[:1, :6], jnp.zeros(1, jnp.int32), fused.init_cache(1, 16), taps=(0, 1, 2))
  logits = [out.logits]
  for i in range(6, 10):
    out = step(fused, tokens[:1, i:i + 1], jnp.full(1, i, jnp.int32), out.cache, taps=(0, 1, 2))
    logits.append(out.logits)
  cache = out.cache.stacked()
  row0 = (outs["stacked"][0][:1],) + tuple(x[:, :1] for x in outs["stacked"][1:])  # [n|L, B, ..]
  for a, b in zip(row0, (jnp.concatenate(logits, axis=1), out.taps, cache.k, cache.v)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  # Round trips and mixed layouts (a cache in the other layout is converted, not rejected).
  for back in (unstacked.stacked(), fused.stacked(), fused.without_fused_projections().stacked()):
    chex.assert_trees_all_equal(back.params, stacked.params)  # structure, then every leaf
  mixed = forward(unstacked, tokens[:, :6], jnp.zeros(2, jnp.int32), stacked.init_cache(2, 16))
  assert not mixed.cache.per_layer
  np.testing.assert_allclose(mixed.logits, outs["stacked"][0][:, :6], atol=1e-5, rtol=1e-5)
  mixed = forward(stacked, tokens[:, :6], jnp.zeros(2, jnp.int32), unstacked.init_cache(2, 16))
  assert mixed.cache.per_layer
  np.testing.assert_allclose(mixed.logits, outs["stacked"][0][:, :6], atol=1e-5, rtol=1e-5)


def test_unstacked_generate_and_decode_give_the_stacked_tokens():
  target = _model("llama")
  draft = sj.init_params(tiny_config(vocab_size=97, num_layers=1), jax.random.key(5))
  prompts = _tokens(2, 5, 97, seed=12)
  key = jax.random.key(0)
  plain = sj.generate(target, prompts, key, max_new_tokens=12)
  plain_u = sj.generate(target.unstacked(), prompts, key, max_new_tokens=12)
  np.testing.assert_array_equal(plain.tokens, plain_u.tokens)
  plain_cpu = sj.generate(target.for_platform("cpu"), prompts, key, max_new_tokens=12)
  np.testing.assert_array_equal(plain.tokens, plain_cpu.tokens)
  spec = sj.decode(target, draft, prompts, key, max_new_tokens=12, num_draft=3)
  spec_u = sj.decode(target.unstacked(), draft.unstacked(), prompts, key, max_new_tokens=12,
                     num_draft=3)
  np.testing.assert_array_equal(spec.tokens, spec_u.tokens)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)  # greedy speculative == plain


def test_for_platform_picks_the_layout():
  model = _model("llama")
  assert not model.for_platform("cpu").is_stacked
  assert "wqkv_t" in model.for_platform("cpu").params["layers"][0]
  with pytest.raises(ValueError, match="unstacked"):
    model.with_fused_projections()
  assert model.unstacked().for_platform("tpu").is_stacked
  assert model.for_platform("gpu").is_stacked


def test_output_copy_of_a_tied_model_gives_the_same_logits_and_tokens():
  """Without the CPU kernel, CPU's `for_platform` carries an `[E, V]` copy of a tied output
  projection (with it, the kernel reads the embedding as it lies and there is no copy): same
  logits (up to float32 summation order), same greedy tokens either way; TPU/GPU layouts drop
  it; untied models have nothing to copy."""
  model = _model("llama_tied_bias_qknorm")
  assert model.config.tie_embeddings and "lm_head" not in model.params
  cpu = model.for_platform("cpu")
  assert ("lm_head" in cpu.params) == (not cpu.cpu_kernel)
  copied = model.unstacked().with_fused_projections(cpu_kernel=False).with_output_copy()
  np.testing.assert_array_equal(copied.params["lm_head"], np.asarray(model.params["embed"]).T)
  assert "lm_head" not in copied.for_platform("tpu").params
  tokens = _tokens(2, 9, model.vocab_size, seed=3)
  zeros = jnp.zeros(2, jnp.int32)
  key = jax.random.key(1)
  reference = sj.generate(model, tokens, key, max_new_tokens=10).tokens
  for variant in (cpu, copied):
    np.testing.assert_allclose(forward(variant, tokens, zeros).logits,
                               forward(model, tokens, zeros).logits, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(sj.generate(variant, tokens, key, max_new_tokens=10).tokens,
                                  reference)
  untied = sj.init_params(tiny_config(vocab_size=97, tie_embeddings=False), jax.random.key(2))
  assert untied.with_output_copy() is untied
