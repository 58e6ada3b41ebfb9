"""Per-position losses of LM training and draft distillation."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy (nats). logits `[B, T, V]` float32, labels `[B, T]`."""
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(log_probs, labels[..., None], axis=-1))

def tv_distance(target_logits: jax.Array, draft_logits: jax.Array,
                temperature: float = 1.0) -> jax.Array:
  """Per-position `1 - sum_x min(p(x), q(x))`: `[...]`, one minus the acceptance probability."""
  p = jax.nn.softmax(target_logits / temperature, axis=-1)
  q = jax.nn.softmax(draft_logits / temperature, axis=-1)
  return 1.0 - jnp.sum(jnp.minimum(p, q), axis=-1)

def forward_kl(target_logits: jax.Array, draft_logits: jax.Array,
               temperature: float = 1.0) -> jax.Array:
  """Per-position `KL(p || q)` of the warped distributions: `[...]`."""
  log_p = jax.nn.log_softmax(target_logits / temperature, axis=-1)
  log_q = jax.nn.log_softmax(draft_logits / temperature, axis=-1)
  return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
