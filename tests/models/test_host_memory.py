"""CPU weights in 2 MiB pages (`specjax.models.cpu.host_memory`): same values, the advice taken, and
a model in the CPU layout (float and quantized) that keeps its weights there and decodes the same
tokens."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.models.cpu import host_memory
from specjax.testing.models import tiny_config

THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_offered() -> bool:
  """Whether this Linux host grants `MADV_HUGEPAGE` (THP not `[never]`)."""
  return THP.exists() and "[never]" not in THP.read_text()


def _huge_page_eligible(x: jax.Array) -> bool:
  """Whether the memory mapping holding `x`'s buffer may be backed by huge pages: its
  `THPeligible` flag in /proc/self/smaps (1 where the mapping is advised under the `madvise`
  setting; XLA's own allocations under that setting read 0)."""
  address = x.unsafe_buffer_pointer()
  mapping = None
  for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
    head = line.split()[0]
    if "-" in head and ":" not in head:
      lo, hi = (int(part, 16) for part in head.split("-"))
      mapping = lo <= address < hi
    elif mapping and head == "THPeligible:":
      return line.split()[1] == "1"
  raise AssertionError(f"no mapping holds {address:#x}")


needs_thp = pytest.mark.skipif(not _thp_offered(), reason="this host offers no transparent huge "
                               "pages (/sys/kernel/mm/transparent_hugepage/enabled)")


@needs_thp
def test_a_large_array_moves_to_advised_memory_with_its_values():
  x = jax.random.normal(jax.random.key(0), (1024, 1024))  # 4 MiB
  madvise_only = "[madvise]" in THP.read_text()
  if madvise_only:  # XLA's allocation is not advised: the check below can tell the two apart
    assert not _huge_page_eligible(x)
  y = host_memory.on_huge_pages(x)
  assert _huge_page_eligible(y)
  assert y.dtype == x.dtype and y.shape == x.shape and y.sharding == x.sharding
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
  del x
  np.testing.assert_array_equal(np.asarray(y + 0), np.asarray(y))  # the mapping outlives x


def test_small_and_multi_device_arrays_stay_as_they_are():
  small = jnp.ones((64, 64))
  assert host_memory.on_huge_pages(small) is small
  assert host_memory.on_huge_pages(np.ones((1024, 1024))) is not None  # not a jax.Array: as is
  if len(jax.devices()) > 1:
    mesh = jax.make_mesh((len(jax.devices()),), ("x",))
    spread = jax.device_put(jnp.ones((1024, 1024)),
                            jax.sharding.NamedSharding(mesh, jax.P("x")))
    assert host_memory.on_huge_pages(spread) is spread


# gate/up [2 * 4096, 512]: 16 MiB in float32, 4 MiB in int8; down [512, 4096] 8 and 2 MiB.
BIG = tiny_config(vocab_size=97, embed_dim=512, num_heads=4, num_kv_heads=2, head_dim=128,
                  mlp_dim=4096)


@needs_thp
def test_the_cpu_layout_and_its_quantized_copy_keep_their_weights_in_huge_pages():
  target = sj.init_params(BIG, jax.random.key(0))
  cpu = target.for_platform("cpu")
  layer = cpu.params["layers"][0]
  for name in ("w_gate_up_t", "w_down_t"):  # panels where the kernel is built, else [out, in]
    assert all(_huge_page_eligible(leaf) for leaf in jax.tree.leaves(layer[name]))
  assert cpu.for_platform("cpu").params["layers"][0]["w_gate_up_t"] is layer["w_gate_up_t"]
  int8 = sj.quantize(cpu, 8, 32)
  assert _huge_page_eligible(int8.params["layers"][0]["w_gate_up_t"].values)
  assert _huge_page_eligible(int8.params["layers"][0]["w_down_t"].values)
  # Same math as the canonical layout: greedy tokens of plain and speculative decoding agree.
  prompts = jnp.asarray(np.random.default_rng(1).integers(1, 97, (2, 6)), jnp.int32)
  key = jax.random.key(0)
  plain = sj.generate(target, prompts, key, max_new_tokens=10)
  np.testing.assert_array_equal(sj.generate(cpu, prompts, key, max_new_tokens=10).tokens,
                                plain.tokens)
  spec = sj.decode(cpu, sj.self_drafter(cpu, 8, 32), prompts, key, max_new_tokens=10, num_draft=3)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
