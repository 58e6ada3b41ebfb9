"""Synthetic acceptance: a verify rule that accepts each draft with a fixed probability.

BENCHMARK ONLY. The rule is not exact: outputs are not the target's distribution and, with a
random draft, greedy identity does not hold. It exists to measure the decode loop's speed at a
chosen acceptance on random-weight targets of growing size, where no trained draft exists. Every
record that used it carries `SYNTHETIC_LABEL`.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from specjax.models.config import ModelConfig
from specjax.models.transformer import Model, init_params
from specjax.core.sampling import (PURPOSE_RESIDUAL, Sampling, VerifyResult, leading_true,
                                   sample_token, uniform)

SYNTHETIC_LABEL = ("SYNTHETIC ACCEPTANCE (benchmark only): each draft is accepted with a fixed "
                   "probability, not by the exact rule; outputs are not the target's "
                   "distribution and greedy identity does not hold")
PURPOSE_SYNTHETIC = 101  # a random stream of its own, apart from the exact rule's purposes

# Random-weight targets for the synthetic mode (Llama layout; parameters with vocab 8192).
SYNTHETIC_SIZES = {
    "tiny": dict(embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64),
    "12M": dict(embed_dim=256, num_layers=6, num_heads=4, num_kv_heads=4, head_dim=64,
                mlp_dim=1024),
    "50M": dict(embed_dim=512, num_layers=10, num_heads=8, num_kv_heads=8, head_dim=64,
                mlp_dim=2048),
    "126M": dict(embed_dim=768, num_layers=12, num_heads=12, num_kv_heads=12, head_dim=64,
                 mlp_dim=3072),
    "400M": dict(embed_dim=1024, num_layers=24, num_heads=16, num_kv_heads=16, head_dim=64,
                 mlp_dim=4096),
}
SYNTHETIC_DRAFT = dict(embed_dim=128, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=64,
                       mlp_dim=256)


@functools.lru_cache(maxsize=None)  # one function object per rate: `decode` compiles it once
def synthetic_verify(acceptance: float) -> Callable[..., VerifyResult]:
  """A verify rule (the signature of `verify_impl=` callables) accepting at a fixed rate.

  Draft `j` of a row is accepted with probability `acceptance`, independently, decided by a
  counter-based hash of the row's seed and the token's position (on device, deterministic); the
  leading accepted drafts are kept and the target's own choice (argmax, or a sample at temperature
  > 0) at the first rejection (or the bonus position) follows. BENCHMARK ONLY: this is not exact.

  Args:
    acceptance: the per-draft acceptance probability, in [0, 1].

  Returns:
    The rule, for `specjax.decode(..., verify_impl=rule)`.
  """
  acceptance = float(acceptance)
  if not 0.0 <= acceptance <= 1.0:
    raise ValueError(f"synthetic acceptance must be in [0, 1], got {acceptance}")

  def rule(target_logits, draft_logits, draft_tokens, *, sampling: Sampling, seeds,
           positions) -> VerifyResult:
    del draft_logits
    batch, k = draft_tokens.shape
    seeds = jnp.asarray(seeds, jnp.uint32)  # [B]
    index = jnp.arange(k + 1, dtype=jnp.int32)
    token_positions = positions.astype(jnp.int32)[:, None] + index  # [B, k+1]
    u = uniform(seeds[:, None], token_positions[:, :k], 0, PURPOSE_SYNTHETIC)  # [B, k]
    num_accepted = leading_true(u < jnp.float32(acceptance))  # [B]
    choice = sample_token(target_logits, sampling, seeds[:, None], token_positions,
                          PURPOSE_RESIDUAL)  # [B, k+1]
    final = jnp.take_along_axis(choice, num_accepted[:, None], axis=1)[:, 0]  # [B]
    tokens = jnp.where(index[None, :k] < num_accepted[:, None], draft_tokens.astype(jnp.int32), 0)
    tokens = jnp.concatenate([tokens, jnp.zeros((batch, 1), jnp.int32)], axis=1)  # [B, k+1]
    tokens = jnp.where(index[None] == num_accepted[:, None], final[:, None], tokens)
    return VerifyResult(num_accepted, tokens)

  rule.__name__ = f"synthetic_verify_{acceptance}"
  rule.synthetic_acceptance = acceptance
  return rule


def random_pair(target_size: str, *, vocab_size: int = 8192, max_len: int = 1024,
                draft: dict | None = None, seed: int = 0) -> tuple[Model, Model]:
  """A random-weight target of a `SYNTHETIC_SIZES` size and a small random draft."""
  if target_size not in SYNTHETIC_SIZES:
    raise ValueError(f"unknown random model size {target_size!r}; one of "
                     + ", ".join(SYNTHETIC_SIZES))
  common = dict(vocab_size=vocab_size, max_len=max_len, bos_id=1, eos_id=2, pad_id=0)
  target_config = ModelConfig(**common, **SYNTHETIC_SIZES[target_size])
  draft_fields = SYNTHETIC_SIZES["tiny"] if target_size == "tiny" else (draft or SYNTHETIC_DRAFT)
  draft_config = ModelConfig(**common, **draft_fields)
  keys = jax.random.split(jax.random.key(seed))
  return init_params(target_config, keys[0]), init_params(draft_config, keys[1])
