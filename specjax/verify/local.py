"""Which verify implementation runs on one device's rows: `local_verify(..., impl=...)`.

(`specjax.verify.dispatch.verify_tokens` is the front door: it wraps this in `shard_map` under a
mesh.)

`impl`:
  "reference"  `specjax.verify.rule.verify_reference`, pure jnp, on any platform.
  "kernel"     the fused Pallas kernel compiled for the platform the computation is lowered for:
               Mosaic (`specjax.kernels.fused_verify`) on TPU, Triton (`fused_verify_gpu`) on
               CUDA and ROCm.
               There is no compiled CPU kernel: lowering "kernel" for CPU raises (jax: no branch
               for platform cpu).
  "interpret"  the TPU kernel in Pallas interpret mode (`interpret=True`), any platform; for tests.
  "auto"       (default) `jax.lax.platform_dependent`: TPU -> the Mosaic kernel, CUDA / ROCm ->
               the Triton kernel, CPU -> the reference.

On TPU (and in "interpret") a greedy rule over `[B, k+1, V]` logits laid out token-major -- `B` a
multiple of 8 and `k + 1` not, where XLA:TPU lays the logits out as `[k+1, B, V]` to avoid
padding (`specjax.kernels.vocab_reduce.flatten_order`) -- runs `verify_rule` with the Pallas
argmax of `PallasVocab` instead of the fused kernel: that argmax reads the logits through a
bitcast view, one pass, where the fused kernel's `[block_b, k+1, V]` blocks need the batch-major
layout and XLA copied the whole float32 logits into it (0.54 GB of a 6.2 GB verify at batch 64,
Qwen2.5 vocabulary; `benchmarks.tpu_traffic`). Greedy needs only the argmax: the same tokens.

The choice follows the platform the computation is *lowered* for, not the host's default backend:
`jax.export(..., platforms=["tpu"])` from a CPU machine lowers the TPU branch, i.e. the kernel,
and `platforms=["cuda"]` the Triton kernel. Exporting the Triton kernel needs
`disabled_checks=GPU_EXPORT_DISABLED_CHECKS` (see `fused_verify_gpu`: the Triton custom call has
no serialization compatibility guarantee).

Limitation (jax 0.10): a multi-platform export that includes "cpu" (e.g. `platforms=["cpu",
"tpu"]`) fails with "Only interpret mode is supported on CPU backend", because jax lowers every
kept `platform_dependent` branch for every requested platform, so the TPU branch's `pallas_call`
is lowered for CPU too. Export per platform instead.
"""

from __future__ import annotations

import functools

import jax

from specjax.kernels.fused_verify import BlockSizes, fused_verify
from specjax.kernels.fused_verify_gpu import fused_verify_gpu
from specjax.kernels.vocab_reduce import PallasVocab, flatten_order
from specjax.verify.rule import LocalVocab, verify_reference, verify_rule
from specjax.core.sampling import Sampling, VerifyResult

VERIFY_IMPLS = ("auto", "reference", "kernel", "interpret")


def local_verify(target_logits: jax.Array, draft_logits: jax.Array | None,
                 draft_tokens: jax.Array, *, sampling: Sampling, seeds: jax.Array,
                 positions: jax.Array, num_drafted: jax.Array | None = None, impl: str = "auto",
                 block_sizes: BlockSizes | None = None) -> VerifyResult:
  """The speculative accept/reject rule, by the implementation `impl` names (see module doc).

  Args:
    target_logits: `[B, k+1, V]` raw target logits.
    draft_logits: `[B, k, V]` raw draft logits, or None for a point-mass drafter.
    draft_tokens: `[B, k]` int32.
    sampling: static sampling settings.
    seeds: `[B]` uint32 per-row stream seeds.
    positions: `[B]` int32 absolute position of each row's first draft token.
    num_drafted: `[B]` int32 drafts each row really proposes; None = all `k` (see
      `specjax.verify.rule.verify_rule`).
    impl: "auto" | "reference" | "kernel" | "interpret".
    block_sizes: the TPU / interpret kernel's `BlockSizes` (default: `BlockSizes.get_default`);
      the GPU kernel always takes `GpuBlockSizes.get_default`.

  Returns:
    `VerifyResult(num_accepted [B], tokens [B, k+1])`, the same tokens whichever `impl` runs.
  """
  if impl not in VERIFY_IMPLS:
    raise ValueError(f"verify impl must be one of {VERIFY_IMPLS}, got {impl!r}")
  kwargs = dict(sampling=sampling, seeds=seeds, positions=positions, num_drafted=num_drafted)
  reference = functools.partial(verify_reference, **kwargs)
  if impl == "reference":
    return reference(target_logits, draft_logits, draft_tokens)
  def kernel(target_logits, draft_logits, draft_tokens, interpret):
    if sampling.greedy and flatten_order(target_logits.shape) == "token":
      return verify_rule(PallasVocab(interpret=interpret), target_logits, draft_logits,
                         draft_tokens, **kwargs)
    return fused_verify(target_logits, draft_logits, draft_tokens, interpret=interpret,
                        block_sizes=block_sizes, **kwargs)

  if impl == "interpret":
    return kernel(target_logits, draft_logits, draft_tokens, interpret=True)

  def mosaic(target_logits, draft_logits, draft_tokens):
    return kernel(target_logits, draft_logits, draft_tokens, interpret=False)

  def triton(target_logits, draft_logits, draft_tokens):
    return fused_verify_gpu(target_logits, draft_logits, draft_tokens, interpret=False, **kwargs)

  branches = dict(tpu=mosaic, cuda=triton, rocm=triton)
  if impl == "auto":
    branches["cpu"] = reference  # "kernel" has no CPU branch: lowering it for CPU is an error
  return jax.lax.platform_dependent(target_logits, draft_logits, draft_tokens, **branches)


def local_vocab_ops(impl: str):
  """The local reductions of the vocabulary-sharded rule for `impl` (see `ShardedVocab`):
  Pallas kernels on TPU ("auto", "kernel") or interpreted ("interpret"), jnp elsewhere."""
  if impl == "interpret":
    return PallasVocab(interpret=True)
  if impl == "reference":
    return LocalVocab()
  return _PlatformVocab(PallasVocab(interpret=False), LocalVocab(), impl == "auto")


class _PlatformVocab:
  """Pallas reductions when lowered for TPU, jnp for other platforms (`lax.platform_dependent`);
  "kernel" has no CPU branch, as `local_verify`."""

  vocab = None

  def __init__(self, tpu, other, with_cpu: bool):
    self.tpu, self.other, self.with_cpu = tpu, other, with_cpu

  def ids(self, x):
    return self.other.ids(x)

  def gather_at(self, x, ids):
    return self.other.gather_at(x, ids)

  def _pick(self, name, *args):
    branches = dict(tpu=getattr(self.tpu, name), cuda=getattr(self.other, name),
                    rocm=getattr(self.other, name))
    if self.with_cpu:
      branches["cpu"] = getattr(self.other, name)
    return jax.lax.platform_dependent(*args, **branches)

  def max(self, x):
    return self._pick("max", x)

  def sum(self, x):
    return self._pick("sum", x)

  def max_and_argmax(self, x):
    return self._pick("max_and_argmax", x)

  def argmax(self, x):
    return self._pick("argmax", x)

  def sum_at_least(self, x, weights, thresholds):
    return self._pick("sum_at_least", x, weights, thresholds)
