"""Compatibility names: mesh rules and placement live in `specjax.parallel` (`rules`, `mesh`), and
the vocabulary-sharded verify in `specjax.parallel.verify`.
"""

from __future__ import annotations

from specjax.parallel.mesh import (cache_shardings, make_mesh, param_shardings,  # noqa: F401
                                   param_specs, per_device_bytes, shard, shard_cache, use_mesh)
from specjax.parallel.rules import (CACHE_AXES, DEFAULT_RULES, KEY_VALUE_AXES,  # noqa: F401
                                    LOGICAL_AXES, LOGITS_AXES, MLP_AXES, QUERY_AXES,
                                    RESIDUAL_AXES, ShardingRules, active_rules, constrain,
                                    logical_axes, use_rules, vocab_is_sharded)
from specjax.parallel.verify import ShardedVocab, sharded_verify, sharded_warp_logits  # noqa: F401
