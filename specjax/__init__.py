"""specjax: exact speculative decoding in JAX for Cloud TPU (compiled for TPU in CI, not yet run
on one; developed and measured on CPU).

The top level is the small public API: decoding (`decode`, `generate`, `decode_stream`,
`precompile`, `audit`), sampling settings and outputs, loaders, the drafters and tree shapes, and
meshes. Everything else lives in its subpackage: the loop's pieces in `specjax.loop`, the model
types in `specjax.models`, further drafters and the `Drafter` protocol in `specjax.drafters`
(adaptive length and calibrations in `specjax.drafters.adaptive`), checkpoints and tokenizers in
`specjax.io`, shipped pairs in `specjax.pretrained`, sharding rules in `specjax.parallel`, the
audit's report in `specjax.exactness`, grammar constraints (`sj.constrain.json_schema`,
`sj.constrain.regex`, their tables and the constrained law) in `specjax.constrain`.
"""

from specjax import constrain
from specjax.constrain import Constraint
from specjax.core.outputs import DecodeOutput
from specjax.core.sampling import Sampling
from specjax.drafters import EagleDrafter, ModelDrafter, NGramDrafter, SuffixDrafter, self_drafter
from specjax.drafters.adaptive import adaptive_drafter
from specjax.exactness.audit import audit
from specjax.io import from_gguf, from_hf
from specjax.loop.decode import decode
from specjax.loop.generate import generate
from specjax.loop.precompile import precompile
from specjax.loop.stream import decode_stream
from specjax.models import Model, ModelConfig, init_params, quantize
from specjax.parallel import make_mesh, shard
from specjax.pretrained import load_default, load_pair
from specjax.trees import TreeSpec

__version__ = "0.1.0"

__all__ = [
    # Decoding.
    "decode", "generate", "decode_stream", "precompile", "audit", "Sampling", "Model",
    "DecodeOutput", "Constraint",
    # Models: loaders, and a model from a config (`init_params(ModelConfig(...), key)`).
    "load_pair", "load_default", "from_hf", "from_gguf", "self_drafter", "quantize",
    "ModelConfig", "init_params",
    # Drafters, trees, meshes.
    "ModelDrafter", "NGramDrafter", "SuffixDrafter", "EagleDrafter", "adaptive_drafter",
    "TreeSpec", "make_mesh", "shard",
]
