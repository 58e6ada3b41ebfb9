"""Sharding: logical-axis rules (`rules`), meshes and placement (`mesh`), and the verify rule
under `shard_map` with rows and the vocabulary split over the mesh (`verify`).
"""

from specjax.parallel.mesh import (cache_shardings, call_context, make_mesh, param_shardings,
                                   param_specs, per_device_bytes, shard, shard_cache, use_mesh)
from specjax.parallel.rules import (DEFAULT_RULES, ShardingRules, active_rules, constrain,
                                    logical_axes, use_rules)

__all__ = ["DEFAULT_RULES", "ShardingRules", "active_rules", "cache_shardings", "call_context",
           "constrain", "logical_axes", "make_mesh", "param_shardings", "param_specs",
           "per_device_bytes", "shard", "shard_cache", "use_mesh", "use_rules"]
