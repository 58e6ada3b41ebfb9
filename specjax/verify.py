"""`verify_tokens`: which implementation of the exact accept/reject rule runs.

(`verify_block`, the round's use of it, lives in `specjax.round`.)
"""

from __future__ import annotations

from specjax import kernels, sharding
from specjax.sampling import Sampling, VerifyResult, verify_reference

VERIFY_IMPLS = ("auto", "reference", "kernel", "interpret")


def check_verify_impl(impl):
  if not (callable(impl) or impl in VERIFY_IMPLS):
    raise ValueError(f"verify_impl must be one of {VERIFY_IMPLS} or a callable, got {impl!r}")
  return impl


def verify_tokens(target_logits, draft_logits, draft_tokens, *, sampling: Sampling, seeds,
                  positions, impl: str = "auto") -> VerifyResult:
  """Runs the accept/reject rule with the chosen implementation.

  Args:
    impl: "reference" (pure jnp), "kernel" (the fused Pallas kernel, compiled for the platform it
      is lowered for), "interpret" (the kernel in Pallas interpret mode, for CPU tests), or "auto":
      the kernel where the computation is lowered for TPU or GPU, the reference on CPU. "auto"
      follows the lowering platform (`lax.platform_dependent`), not the host's default backend, so
      exporting for TPU from a CPU machine picks the kernel. Under an active mesh that splits the
      vocabulary ("auto" and "reference"), the vocab-sharded rule `specjax.sharding.sharded_verify`
      runs instead, so full-vocabulary logits are never gathered. A callable with the signature of
      `verify_reference` is used as the rule itself (for experiments and for the tests that prove
      the exactness checks can tell a wrong rule from a right one).
    Other arguments: see `specjax.sampling.verify_reference`.
  """
  check_verify_impl(impl)
  kwargs = dict(sampling=sampling, seeds=seeds, positions=positions)
  if callable(impl):
    return impl(target_logits, draft_logits, draft_tokens, **kwargs)
  if impl in ("auto", "reference"):
    if sharding.vocab_is_sharded():  # under a mesh that splits the vocabulary: never gather it
      return sharding.sharded_verify(target_logits, draft_logits, draft_tokens, **kwargs)
  if impl == "reference":
    return verify_reference(target_logits, draft_logits, draft_tokens, **kwargs)
  return kernels.verify_dispatch(target_logits, draft_logits, draft_tokens, impl=impl, **kwargs)
