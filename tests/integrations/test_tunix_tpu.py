"""SpecjaxRollout's two programs compile for TPU (libtpu's compiler, ahead of time, nothing
allocated; the tier of tests/tpu/test_compile.py).

A tunix Qwen2 policy at Qwen2.5-Coder-0.5B's widths and vocabulary (151,936) with 2 layers,
bfloat16 weights in tunix's own layout, T = 0.7 with top-k 50 and top-p 0.9, k = 4, 64-token
prompts and 32 new tokens with logprobs: the weights program (the policy converted and its int8
copy quantized from the traced weights) and the rollout program (decode with that copy), on one
v5e chip at batch 1 and on a v5e (1, 4) mesh at batch 8 (`costly`: CI's second step, where
tunix is installed). Skipped, through `pytest.importorskip`, without tunix or libtpu.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("tunix")
pytest.importorskip("libtpu")

from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from tunix.models.qwen2 import model as qwen2_lib  # noqa: E402

import specjax as sj  # noqa: E402
from specjax.integrations import tunix_weights  # noqa: E402
from specjax.integrations.tunix import _build, _DrafterSpec, _rollout  # noqa: E402
from specjax.testing import tpu  # noqa: E402

REAL = tpu.REAL_CONFIGS["qwen2.5-coder-0.5b"]
SAMPLING = sj.Sampling(temperature=0.7, top_k=50, top_p=0.9)


def _abstract_policy(mesh):
  config = qwen2_lib.ModelConfig(
      num_layers=2, vocab_size=REAL.vocab_size, embed_dim=REAL.embed_dim,
      hidden_dim=REAL.mlp_dim, num_heads=REAL.num_heads, head_dim=REAL.head_dim,
      num_kv_heads=REAL.num_kv_heads, rope_theta=int(REAL.rope_theta), norm_eps=REAL.norm_eps,
      use_tied_embedding=True, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  module = nnx.eval_shape(lambda: qwen2_lib.Qwen2(config, rngs=nnx.Rngs(0)))
  params = tunix_weights.policy_params(nnx.state(module, nnx.Param))
  params = tpu.abstract_like(params, NamedSharding(mesh, P()))
  return module, params


@pytest.mark.costly
@pytest.mark.parametrize("topology,batch", [("v5e-1", 1), ("v5e-1x4", 8)])
def test_rollout_programs_compile_for_tpu(topology, batch):
  mesh = tpu.topology_mesh(topology)
  module, params = _abstract_policy(mesh)
  config = tunix_weights.model_config(module, 128)
  dtype = tunix_weights.compute_dtype(module)
  spec = _DrafterSpec("self", bits=8)
  build = lambda p: _build(p, None, config=config, dtype=dtype, spec=spec, keep_policy=False)
  drafter_program = tpu.compile_call(build, params, mesh=mesh)
  _, drafter = jax.eval_shape(build, params)
  drafter = tpu.abstract_like(drafter, NamedSharding(mesh, P()))
  tokens, key = tpu.abstract_tokens(mesh, batch, 64)
  lengths = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=tokens.sharding.update(
      spec=P(tokens.sharding.spec[0])))
  rollout_program = tpu.compile_call(
      lambda p, d, t, n, k: _rollout(p, d, t, n, k, config=config, dtype=dtype, num_draft=4,
                                     sampling=SAMPLING, max_new_tokens=32, eos_ids=(151645,),
                                     logprobs=True),
      params, drafter, tokens, lengths, key, mesh=mesh)
  for program in (drafter_program, rollout_program):
    assert program.total_bytes < 16 * 2 ** 30  # fits a v5e chip's HBM
