"""HBM traffic on TPU: a target step reads its weights and live cache about once.

The counter is `benchmarks.tpu_traffic.hbm_traffic`: the bytes a compiled TPU program reads from
and writes to HBM, from its HLO text, each `while` body counted its trip count times
(`cost_analysis()` counts a loop body once and adds VMEM traffic in). Checked here:

  * the counter on a plain loop: `fori_loop` over 8 stacked `[4096, 4096]` bfloat16 matrices
    (256 MiB, more than VMEM holds) reads each matrix once, 8 times the body's bytes;
  * the target step (`target(tokens [1, 1], starts, cache)`, the cache donated as in the decode
    loop) of the Qwen2.5-Coder-1.5B widths with 2 layers and its real vocabulary, bfloat16, on one
    v5e chip (`"v5e-1"`), is within `BAR` = 1.2x of its floor (`floor_bytes`: weights read once,
    the looked-up embedding row, the live KV cache), and not below it (a loop body counted once
    would be);
  * two wasteful steps are measured above 1.2x by the same functions: one that runs the forward
    twice, reading the weights twice, and one that does not donate its cache (XLA then copies the
    whole cache into the output buffer), at 4 rows of a 32k-slot cache;
  * the batch-64 greedy verify block reads its float32 logits where the lm-head wrote them (no
    relayout copy of a logits-sized array; v5e, and v6e's 2x2 mesh).

Skipped without libtpu (`pip install "jax[tpu]"`).
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

pytest.importorskip("libtpu")

from benchmarks import tpu_traffic  # noqa: E402  (after the skip: the compile tier needs libtpu)
from specjax.testing import tpu  # noqa: E402

TOPOLOGY = "v5e-1"
LAYERS = 2
LIVE, CAPACITY = 1024, 2048


@functools.lru_cache(maxsize=None)
def _measure(kind: str):
  """`(Traffic, floor dict)` of the 2-layer target step: "step" (as the decode loop runs it),
  "twice" (the forward run twice) or "undonated" (the cache not donated; 4 rows of 32k slots, all
  live, so that the cache is about a quarter of the traffic)."""
  undonated = kind == "undonated"
  capacity = 32_768 if undonated else CAPACITY
  live = capacity if undonated else LIVE
  fn, args, donate, model, cache, length, mesh = tpu_traffic.build(
      "target_step", topology=TOPOLOGY, batch=4 if undonated else 1, num_layers=LAYERS,
      capacity=capacity)
  if kind == "undonated":
    donate = ()
  if kind == "twice":
    def fn(model, tokens, starts, cache):  # pylint: disable=function-redefined
      first, _ = tpu_traffic.target_step(model, tokens, starts, cache)
      # The barrier hands the second forward its weights only once the first's logits exist,
      # so the two passes cannot share their reads.
      again, first = jax.lax.optimization_barrier((model, first))
      second, cache = tpu_traffic.target_step(again, tokens, starts, cache)
      return first + second, cache
  compiled = tpu_traffic.compile_program(fn, *args, mesh=mesh, donate=donate)
  traffic = tpu_traffic.hbm_traffic(compiled.text(), live_slots=live)
  floor = tpu_traffic.floor_bytes(model, cache, live=live, tokens_per_row=length)
  return traffic, floor


def test_loop_body_counted_per_trip():
  mesh = tpu.topology_mesh(TOPOLOGY)
  rep = NamedSharding(mesh, P())
  trips, n = 8, 4096
  w = jax.ShapeDtypeStruct((trips, n, n), jnp.bfloat16, sharding=rep)
  x = jax.ShapeDtypeStruct((1, n), jnp.bfloat16, sharding=rep)

  def run(w, x):
    return jax.lax.fori_loop(0, trips, lambda i, x: jnp.tanh(x @ w[i]), x)

  traffic = tpu_traffic.hbm_traffic(tpu_traffic.compile_program(run, w, x, mesh=mesh).text())
  weights = trips * n * n * 2
  assert [trip for _, trip, _ in traffic.loops] == [trips]
  assert 0.98 * weights <= traffic.hbm_bytes <= 1.1 * weights, (traffic.hbm_bytes, weights)


def test_target_step_within_bar_of_floor():
  traffic, floor = _measure("step")
  ratio = traffic.hbm_bytes / floor["floor"]
  assert [trip for _, trip, _ in traffic.loops] == [LAYERS]  # the scan over layers
  top = "\n".join(f"  {b / 1e6:9.1f} MB {op} {shape[:100]} {name}"
                  for b, op, shape, name in traffic.rows[:8])
  assert 0.98 <= ratio <= tpu_traffic.BAR, (
      f"target step: {traffic.hbm_bytes / 1e6:.1f} MB of HBM traffic, floor "
      f"{floor['floor'] / 1e6:.1f} MB ({ratio:.2f}x); largest:\n{top}")


@pytest.mark.parametrize("kind", ["twice", "undonated"])
def test_wasteful_step_is_caught(kind):
  traffic, floor = _measure(kind)
  ratio = traffic.hbm_bytes / floor["floor"]
  assert ratio > tpu_traffic.BAR, (kind, traffic.hbm_bytes, floor)


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_draft_step_reads_the_live_cache_once(chip):
  """The 24-layer 0.5B draft step at batch 64 (a packed cache, 2 heads of 64 per row; on v6e a
  2x2 mesh whose model axis cannot split the cache's one head group) attends through the cache
  kernel, which takes the whole stacked cache (no per-layer copy of a cache-sized buffer): with
  1,024 of 2,048 slots live it is within 1.2x of its floor; counted as if every slot were read
  (the dense einsums' reads) it would not be."""
  fn, args, donate, model, cache, length, mesh = tpu_traffic.build(
      "draft_step", topology=tpu_traffic.CHIPS[chip][0], batch=64)
  text = tpu_traffic.compile_program(fn, *args, mesh=mesh, donate=donate).text()
  assert "specjax_cache_attention" in text
  buffer = jax.tree.leaves(cache.k)[0]
  shard = buffer.sharding.shard_shape(buffer.shape)
  layer_shape = ",".join(str(n) for n in shard[1:])
  copies = [line for line in text.splitlines()
            if re.search(r"= \w+\[(\d+,)?" + layer_shape + r"\]\S* copy\(", line)]
  assert not copies, copies[:2]
  floor = tpu_traffic.floor_bytes(model, cache, live=LIVE, tokens_per_row=length)["floor"]
  live = tpu_traffic.hbm_traffic(text, live_slots=LIVE).hbm_bytes
  every_slot = tpu_traffic.hbm_traffic(text).hbm_bytes
  assert live <= tpu_traffic.BAR * floor < every_slot, (live, every_slot, floor)


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_verify_block_reads_its_logits_in_place(chip):
  """The batch-64 greedy verify block (`target(block [64, 7])` then `verify_tokens`, the 1.5B
  widths with 2 layers and the real 151,936-entry vocabulary) reads its float32 `[64, 7, V]`
  logits (on v6e each device's `[32, 7, V / 2]`) where the lm-head wrote them, token-major: the
  vocabulary argmax kernel runs on a view (no copy, reshape or pad of a logits-sized array), and the
  fused kernel, whose batch-major blocks made XLA copy the logits, does not run."""
  fn, args, donate, model, cache, length, mesh = tpu_traffic.build(
      "verify", topology=tpu_traffic.CHIPS[chip][0], batch=64, num_layers=LAYERS)
  text = tpu_traffic.compile_program(fn, *args, mesh=mesh, donate=donate).text()
  assert "vocab_argmax" in text and "fused_verify" not in text
  traffic = tpu_traffic.hbm_traffic(text, live_slots=LIVE)
  logits = 64 * 7 * model.config.vocab_size // (4 if chip == "v6e" else 1)  # per device
  relayouts = [(b, op, shape) for b, op, shape, _ in traffic.rows
               if op in ("copy", "reshape", "pad", "transpose")
               and any(math.prod(a.dims) >= logits for a in tpu_traffic._leaves(shape))]
  assert not relayouts, relayouts[:3]
