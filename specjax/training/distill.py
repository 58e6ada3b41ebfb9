"""Draft distillation: the draft learns a frozen target's next-token distribution.

The loss targets acceptance: `"tv"` is the total-variation distance `1 - sum_x min(p(x), q(x))`,
exactly one minus the probability that speculative sampling accepts the draft token; `"fkl"` is
`KL(p || q)`. With `on_policy > 0` that share of each batch is replaced by sequences the draft
samples itself from a data prefix (DistillSpec), so the draft is taught where it goes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from specjax.models.config import ModelConfig
from specjax.models.transformer import Model, forward
from specjax.training.lm import logits_of
from specjax.training.losses import forward_kl, tv_distance
from specjax.training.state import TrainConfig, apply_gradients


def sample_continuations(model: Model, prefix: jax.Array, length: int, rng: jax.Array,
                         temperature: float = 1.0) -> jax.Array:
  """Samples `length` tokens after each row of `prefix` ([B, P]) with the model's KV cache.

  Returns:
    `[B, P + length]` int32: the prefix followed by the sampled tokens.
  """
  b, p = prefix.shape
  cache = model.init_cache(b, p + length, jnp.float32)
  out = forward(model, prefix, jnp.zeros((b,), jnp.int32), cache)

  def step(carry, key):
    logits, cache, position = carry
    token = jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)  # [B]
    out = forward(model, token[:, None], jnp.full((b,), position, jnp.int32), cache)
    return (out.logits[:, 0], out.cache, position + 1), token

  keys = jax.random.split(rng, length)
  _, sampled = jax.lax.scan(step, (out.logits[:, -1], out.cache, jnp.int32(p)), keys)
  return jnp.concatenate([prefix, sampled.T], axis=1)

@functools.partial(jax.jit, static_argnames=("model_config", "config"), donate_argnums=(0,))
def distill_step(state: dict, batch: jax.Array, target: Model, *, model_config: ModelConfig,
                 config: TrainConfig) -> tuple[dict, dict]:
  """One distillation step: the draft matches the frozen `target` on `batch` ([B, T + 1]).

  With `config.on_policy`, the first `num_on_policy` rows keep `on_policy_prefix` data tokens and
  continue with tokens the current draft samples (no gradient through sampling).
  """
  rng, sample_rng = jax.random.split(state["rng"])
  tokens = batch[:, :-1]
  n = config.num_on_policy
  if n:
    prefix = tokens[:n, :config.on_policy_prefix]
    sampled = sample_continuations(Model(state["params"], model_config), prefix,
                                   tokens.shape[1] - config.on_policy_prefix, sample_rng)
    tokens = jnp.concatenate([sampled, tokens[n:]], axis=0)
  target_logits = jax.lax.stop_gradient(logits_of(target.params, target.config, tokens))
  divergence = tv_distance if config.distill_loss == "tv" else forward_kl

  def loss_fn(params):
    draft_logits = logits_of(params, model_config, tokens)
    per_position = divergence(target_logits, draft_logits, config.distill_temperature)
    return jnp.mean(per_position), draft_logits

  (loss, draft_logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
  state = apply_gradients(dict(state, rng=rng), grads, config)
  agree = jnp.mean(jnp.argmax(draft_logits, -1) == jnp.argmax(target_logits, -1))
  return state, {"loss": loss, "grad_norm": optax.tree.norm(grads), "greedy_agreement": agree}
