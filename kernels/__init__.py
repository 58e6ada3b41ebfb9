"""The hardware-specific kernels of specjax (the checkout's top-level `kernels/`, installed as
`specjax.kernels`; README.md here says what is where).

`fused_verify` is the fused rejection-sampling verify (tiles over the vocabulary; TPU Mosaic and
interpret mode), `fused_verify_gpu` the same for GPUs (Triton); `tree_verify` / `tree_verify_gpu`
decide a draft tree's nodes the same way. `vocab_reduce.PallasVocab` holds the local reductions of
the vocabulary-sharded rule. `cpu/` holds the C++ kernels of the CPU model layout and the module
that builds and binds them (`specjax.kernels.cpu.kernel`).

The jnp references these kernels equal, and the dispatch that picks a kernel or a reference, are
specjax's own: `specjax.verify.rule.verify_reference`, `specjax.verify.local.local_verify` (one
device's rows) and `specjax.verify.dispatch.verify_tokens` (the mesh-aware front door).

This folder is a package only as `specjax.kernels`. Where the checkout's root stands on `sys.path`
ahead of site-packages (pytest, `python -m benchmarks` or `specjax bench` in the checkout), the name
`kernels` would find it first and shadow the `kernels` distribution (Hugging Face's kernel hub,
which transformers imports): imported under that name, this file loads the installed distribution
in its own place, or raises ImportError where there is none (`tests/test_packaging.py`).
"""

if __name__ == "kernels":
  import importlib.machinery
  import importlib.util
  import pathlib
  import sys

  _checkout = pathlib.Path(__file__).resolve().parents[1]
  _spec = importlib.machinery.PathFinder.find_spec(
      __name__, [entry for entry in sys.path if pathlib.Path(entry or ".").resolve() != _checkout])
  if _spec is None:
    raise ImportError(f"{_checkout / 'kernels'} is specjax.kernels, not a top-level package "
                      "(and no `kernels` distribution is installed)")
  _module = importlib.util.module_from_spec(_spec)
  sys.modules[__name__] = _module  # the import system returns what sys.modules holds
  try:
    _spec.loader.exec_module(_module)
  except BaseException:
    del sys.modules[__name__]
    raise
else:
  from specjax.kernels.fused_verify import BlockSizes, fused_verify
  from specjax.kernels.fused_verify_gpu import (GPU_EXPORT_DISABLED_CHECKS, GpuBlockSizes,
                                                fused_verify_gpu)
  from specjax.kernels.vocab_reduce import PallasVocab

  __all__ = ["BlockSizes", "GPU_EXPORT_DISABLED_CHECKS", "GpuBlockSizes", "PallasVocab",
             "fused_verify", "fused_verify_gpu"]
