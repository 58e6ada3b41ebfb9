"""Speculative decoding inside a Flax training loop's jitted eval step.

A Flax target (NNX or Linen, `specjax.models.flax_decoder`) and a smaller Flax draft learn a toy
language (each token is followed by the next id, modulo the vocabulary, with a little noise) with
optax. Every few steps a jitted eval step builds specjax models from the *current* parameters
(`specjax.models.adapter`), calls `specjax.decode` on a batch of prompts and reports the
acceptance rate. Parameters are arguments of the eval step, so it is traced and compiled once for
the whole run, whatever their values.

    python examples/flax_train_eval.py --kind nnx
    python examples/flax_train_eval.py --kind linen
"""

from __future__ import annotations

import argparse
import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import specjax as sj
from specjax.loop import KVCache
from specjax.models.adapter import CacheSpec, LinenModel, NNXModel
from specjax.models.flax_decoder import DecoderConfig, LinenDecoder, NNXDecoder

VOCAB = 32
TARGET = DecoderConfig(vocab_size=VOCAB, embed_dim=32, num_layers=2, num_heads=4, mlp_dim=64,
                       max_len=64)
DRAFT = DecoderConfig(vocab_size=VOCAB, embed_dim=16, num_layers=1, num_heads=2, mlp_dim=32,
                      max_len=64)
TRACES = collections.Counter()


def toy_batch(rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
  """Sequences counting up modulo VOCAB, with 10% of tokens replaced by random ones."""
  start = rng.integers(0, VOCAB, (batch, 1))
  seqs = (start + np.arange(length)) % VOCAB
  noise = rng.random((batch, length)) < 0.1
  return np.where(noise, rng.integers(0, VOCAB, (batch, length)), seqs).astype(np.int32)


def build(kind: str, config: DecoderConfig, seed: int):
  """`(as_model(params) -> specjax model, params)` for a fresh NNX or Linen decoder."""
  spec = CacheSpec.from_config(config)
  if kind == "nnx":
    graphdef, state = nnx.split(NNXDecoder(config, rngs=nnx.Rngs(seed)))
    return (lambda params: NNXModel(graphdef, params, spec)), state
  if kind == "linen":
    module = LinenDecoder(config)
    tokens = jnp.zeros((1, 4), jnp.int32)
    cache = empty_cache(spec, 1, 4)
    params = module.init(jax.random.key(seed), tokens, jnp.zeros((1,), jnp.int32), cache)
    return (lambda params: LinenModel(module, params, spec)), params
  raise ValueError(f"kind must be 'nnx' or 'linen', got {kind!r}")


def empty_cache(spec: CacheSpec, batch: int, length: int) -> KVCache:
  return KVCache.create(spec.num_layers, batch, length, spec.num_kv_heads, spec.head_dim)


def make_train_step(as_model, optimizer):
  def loss_fn(params, batch):
    logits = as_model(params)(batch[:, :-1], jnp.zeros((batch.shape[0],), jnp.int32)).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

  @jax.jit
  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return train_step


def make_eval_step(as_target, as_draft, *, max_new_tokens: int, num_draft: int):
  """A jitted eval step: greedy speculative decoding with the current params of both models."""

  @jax.jit
  def eval_step(target_params, draft_params, prompts, rng):
    TRACES["eval_step"] += 1  # runs only while tracing
    out = sj.decode(as_target(target_params), as_draft(draft_params), prompts, rng,
                    max_new_tokens=max_new_tokens, num_draft=num_draft)
    acceptance = jnp.sum(out.stats.accepted) / jnp.maximum(jnp.sum(out.stats.drafted), 1)
    return out.tokens, acceptance

  return eval_step


def run(kind: str = "nnx", *, steps: int = 60, eval_every: int = 20, batch: int = 16,
        length: int = 24, max_new_tokens: int = 12, num_draft: int = 3, seed: int = 0,
        log=print) -> dict:
  """Trains target and draft together and evaluates with `specjax.decode` every `eval_every`.

  Returns:
    `dict(acceptance=[...] per eval (before training first), eval_tokens=[...], traces (how
    often the eval step was traced), target_params, as_target, prompts)`.
  """
  TRACES.clear()
  as_target, target_params = build(kind, TARGET, seed)
  as_draft, draft_params = build(kind, DRAFT, seed + 1)
  optimizer = optax.adam(1e-2)
  target_opt, draft_opt = optimizer.init(target_params), optimizer.init(draft_params)
  train_target = make_train_step(as_target, optimizer)
  train_draft = make_train_step(as_draft, optimizer)
  eval_step = make_eval_step(as_target, as_draft, max_new_tokens=max_new_tokens,
                             num_draft=num_draft)
  data = np.random.default_rng(seed)
  prompts = jnp.asarray(toy_batch(np.random.default_rng(seed + 100), 4, 6))
  record = dict(acceptance=[], eval_tokens=[], prompts=prompts, as_target=as_target)
  for step in range(steps + 1):
    if step % eval_every == 0:
      tokens, acceptance = eval_step(target_params, draft_params, prompts, jax.random.key(step))
      record["acceptance"].append(float(acceptance))
      record["eval_tokens"].append(np.asarray(tokens))
      log(f"[{kind}] step {step:4d}: speculative acceptance rate {float(acceptance):.1%}")
    if step == steps:
      break
    tokens = jnp.asarray(toy_batch(data, batch, length))
    target_params, target_opt, target_loss = train_target(target_params, target_opt, tokens)
    draft_params, draft_opt, draft_loss = train_draft(draft_params, draft_opt, tokens)
  log(f"[{kind}] final losses: target {float(target_loss):.3f}, draft {float(draft_loss):.3f}; "
      f"eval step traced {TRACES['eval_step']} time(s)")
  record["target_params"] = target_params
  record["traces"] = TRACES["eval_step"]
  return record


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--kind", choices=("nnx", "linen"), default="nnx")
  parser.add_argument("--steps", type=int, default=200)
  args = parser.parse_args(argv)
  run(args.kind, steps=args.steps, eval_every=max(1, args.steps // 5))


if __name__ == "__main__":
  main()
