"""One process of `test_sharding.test_two_processes_match_single_process` (not a test itself).

Usage: python multihost_worker.py PROCESS_ID PORT OUT_DIR. Two of these, on one machine, form an
8-device CPU cluster through `jax.distributed` (4 devices each) and decode on a 2x4 mesh whose
`data` axis spans the two processes.
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

process_id, port, out_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.config.update("jax_num_cpu_devices", 4)
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=process_id, initialization_timeout=120)

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import specjax as sj  # noqa: E402
from specjax import parallel as sh  # noqa: E402
from specjax.loop.decode import decode  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.parallel.test_mesh import DRAFT_CONFIG, NEW_TOKENS, TARGET_CONFIG  # noqa: E402

# The same weights and prompts as the single-process fixtures (same seeds, same shapes).
target = sj.init_params(TARGET_CONFIG, jax.random.key(0))
draft = sj.init_params(DRAFT_CONFIG, jax.random.key(5))
tokens = np.asarray(jax.random.randint(jax.random.key(1), (8, 6), 1, 128), np.int32)
lengths = np.array([6, 3, 5, 1, 6, 2, 4, 6], np.int32)

mesh = sj.make_mesh()  # (processes, local devices) = (2, 4)
target, draft = sj.shard(target, mesh), sj.shard(draft, mesh)
with sh.use_mesh(mesh):
  generated = sj.generate(target, tokens, jax.random.key(2), lengths=lengths,
                          max_new_tokens=NEW_TOKENS)
  decoded = decode(target, draft, tokens, jax.random.key(2), lengths=lengths,
                   max_new_tokens=NEW_TOKENS, num_draft=3)
gather = lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
np.savez(os.path.join(out_dir, f"tokens_{process_id}.npz"), generate=gather(generated.tokens),
         decode=gather(decoded.tokens), process_count=jax.process_count(),
         device_count=jax.device_count(), mesh_shape=np.array(tuple(mesh.shape.values())))
jax.distributed.shutdown()
