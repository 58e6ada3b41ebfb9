"""SSD's role-split program compiles for TPU (libtpu's compiler, ahead of time, no TPU needed).

SSD's jitted program (`specjax.loop.ssd`: what `specjax.decode` runs for an `SSDDrafter` with a
role mesh) on a v5e 2x2 slice as a `(role, model) = (2, 2)` mesh (2 chips verify, 2 chips
pre-speculate; within a role the inputs are replicated), with the Qwen2.5-Coder 1.5B target and
0.5B draft widths at 2 layers each and their real vocabulary
(151,936), bfloat16 weights, batch 1, a 64-token prompt, 32 new tokens, `Sampling(temperature=0.7,
top_k=50, top_p=0.9)`, K = 3 and a budget of 4 branches (the smallest: `K + 1`), Saguaro C = 0.5.
The program must compile, fit a v5e chip's HBM, and hold the round's exchange (an all-reduce).

Cost: 70 s for the test (compile included) on a 2-core host at load average 2-5 (145 s at 7-8) at
the default effort, less at the tier's effort -1: `costly`, CI's second step, so the role-split
program is compiled on every CI run.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("libtpu")

from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from specjax.drafters.ssd import SSDDrafter  # noqa: E402
from specjax.loop import ssd  # noqa: E402
from specjax.testing import tpu  # noqa: E402
from specjax.testing import tpu_cases as tc  # noqa: E402

K = 3
BUDGET = 4


def _role_mesh():
  devices = np.asarray(tpu.topology_devices("v5e:2x2")).reshape(2, 2)
  return jax.sharding.Mesh(devices, ("role", "model"))


@pytest.mark.costly  # CI's second step: the role-split program compiles on every CI run
def test_ssd_role_split_compiles_on_v5e_2x2_at_real_vocabulary():
  mesh = _role_mesh()
  setup = tc.Setup()
  replicated = NamedSharding(mesh, P())
  from specjax.models.transformer import init_params  # pylint: disable=import-outside-toplevel
  shapes = lambda name: jax.eval_shape(
      lambda: init_params(setup.config(name), jax.random.key(0), jnp.bfloat16))
  target = tpu.abstract_like(shapes(setup.target), replicated)
  draft = tpu.abstract_like(shapes(setup.draft), replicated)
  drafter = SSDDrafter(draft, budget=BUDGET, saguaro=0.5, mesh=mesh)
  tokens = jax.ShapeDtypeStruct((1, setup.prompt_len), jnp.int32, sharding=replicated)
  lengths = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=replicated)
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated)
  eos = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=replicated)
  new = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)

  def fn(target, drafter, tokens, lengths, key, eos, new):
    return ssd._decode_ssd(target, drafter, tokens, lengths, key, eos, new,
                           sampling=setup.sampling, num_draft=K, capacity=setup.max_new_tokens,
                           pad_id=0)

  # At the tier's compile effort (`tpu.compile_call(effort=)`): every check still runs.
  compiled = tpu.compile_call(fn, target, drafter, tokens, lengths, key, eos, new, effort=-1)
  text = compiled.text()
  collectives = re.findall(r"= \S+ (all-reduce|all-gather|all-to-all|collective-permute|"
                           r"reduce-scatter)(?:-start)?\(", text)
  # The round's exchange is an all-reduce over `role`. Within a role the "model" axis is left to
  # XLA's partitioner, which adds its own collectives there (the one-collective property of the
  # pure role split is tested on CPU, tests/loop/test_ssd.py).
  assert "all-reduce" in collectives, collectives
  assert compiled.total_bytes < 16 * 2 ** 30  # fits a v5e chip's HBM
