"""Next-token cross-entropy training of a language model (the target, or a data-only draft)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from specjax.models.config import ModelConfig
from specjax.models.transformer import Model, forward
from specjax.training.losses import cross_entropy
from specjax.training.state import TrainConfig, apply_gradients


def logits_of(params, model_config, tokens):
  """Cache-free forward logits `[B, T, V]` of `Model(params, model_config)` over `tokens`."""
  starts = jnp.zeros((tokens.shape[0],), jnp.int32)
  return forward(Model(params, model_config), tokens, starts).logits


@functools.partial(jax.jit, static_argnames=("model_config", "config"), donate_argnums=(0,))
def lm_step(state: dict, batch: jax.Array, *, model_config: ModelConfig,
            config: TrainConfig) -> tuple[dict, dict]:
  """One cross-entropy step on a `[B, T + 1]` batch; donates and returns the state."""
  def loss_fn(params):
    return cross_entropy(logits_of(params, model_config, batch[:, :-1]), batch[:, 1:])

  loss, grads = jax.value_and_grad(loss_fn)(state["params"])
  return apply_gradients(state, grads, config), {"loss": loss, "grad_norm": optax.tree.norm(grads)}
