"""The KV cache keeps one layout on TPU: no whole-cache copy in `generate`'s or `decode`'s program.

A scatter into the stacked `[L, B, KVH, S, D]` cache made XLA:TPU carry the decode loop's cache
with the update window minor and copy all of it into attention's layout (and hold a second cache
at the prefill's exit). On TPU the write now runs `specjax.kernels.kv_write` (via
`specjax.models.cache_write`), which fixes the row-major layout. Compiled here with libtpu for one
v5e chip at the Qwen2.5-Coder-1.5B widths (head_dim 128) with 2 layers, bfloat16, batch 64, a
1,024-token prompt and 512 new tokens, T = 0.7 with top-k and top-p:

  * no instruction of the compiled program produces a copy or relayout of a whole K or V buffer
    (an HLO `copy`, or a fusion whose output is the buffer's shape but which is not an in-place
    write), and the temporaries hold less than two caches (8 layers, so that the cache, 2 GiB,
    outweighs the prefill's per-layer buffers and the activations, about 1.3 GiB whatever the
    depth: 1.65 caches were measured);
  * the negative control: the same program with the scatter forced back on TPU
    (`cache_write._tpu_write` patched to `write_stacked_block`) shows the copies, and its
    temporaries hold at least two caches (3.08 measured). So the check can fail.

Both are `costly` (CI's second step): about 90 s each at load 2.

Skipped without libtpu (`pip install "jax[tpu]"`).
"""

import re

import jax
import jax.numpy as jnp
import pytest

import specjax as sj

pytest.importorskip("libtpu")

from specjax.core import cache as cache_lib  # noqa: E402
from specjax.models import cache_write  # noqa: E402
from specjax.testing import tpu  # noqa: E402

BATCH, PROMPT, NEW, LAYERS = 64, 3584, 512, 8
SAMPLING = sj.Sampling(temperature=0.7, top_k=50, top_p=0.9)


def _compile():
  mesh = tpu.topology_mesh("v5e-1")
  target = tpu.abstract_model(tpu.with_layers(tpu.REAL_CONFIGS["qwen2.5-coder-1.5b"], LAYERS), mesh,
                              jnp.bfloat16)
  tokens, rng = tpu.abstract_tokens(mesh, BATCH, PROMPT)

  def run(target, tokens, rng):
    return sj.generate(target, tokens, rng, max_new_tokens=NEW, sampling=SAMPLING)
  jax.clear_caches()
  compiled = tpu.compile_call(run, target, tokens, rng, mesh=mesh)
  cache = jax.eval_shape(lambda: target.init_cache(BATCH, PROMPT + NEW))
  return compiled, cache


def _whole_cache_copies(text: str, shape) -> list[str]:
  dims = ",".join(map(str, shape))
  pattern = re.compile(r"= bf16\[" + dims + r"\]\{[^}]*\} (copy|fusion)\(")
  lines = [line.strip() for line in text.splitlines() if pattern.search(line)]
  # In-place writes (dynamic-update-slice / scatter fusions) output the buffer too; not copies.
  return [line for line in lines
          if not re.search(r"(dynamic.update.slice|scatter)[\w.\-]*_fusion|calls=%fused_computation"
                           r"[\w.\-]*, .*op_name=\"[^\"]*(dynamic_update_slice|scatter)", line)]


@pytest.mark.slow  # 82 to 85 s at XLA's default effort: CI's time
def test_generate_holds_one_cache_and_copies_none():
  compiled, cache = _compile()
  copies = _whole_cache_copies(compiled.text(), cache.k.shape)
  cache_bytes = 2 * cache.k.size * cache.k.dtype.itemsize
  assert not copies, "\n".join(c[:300] for c in copies[:5])
  assert compiled.temp_bytes < 2 * cache_bytes, (compiled.temp_bytes, cache_bytes)


@pytest.mark.slow  # 72 to 87 s: with the check above
def test_negative_control_scatter_on_tpu_copies_the_cache(monkeypatch):
  monkeypatch.setattr(cache_write, "_tpu_write", cache_lib.write_stacked_block)
  compiled, cache = _compile()
  cache_bytes = 2 * cache.k.size * cache.k.dtype.itemsize
  copies = _whole_cache_copies(compiled.text(), cache.k.shape)
  assert copies, "the scatter's program was expected to copy the cache"
  assert compiled.temp_bytes >= 2 * cache_bytes, (compiled.temp_bytes, cache_bytes)
