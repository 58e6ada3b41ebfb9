"""specjax: exact speculative decoding in JAX for Cloud TPU (compiled for TPU in CI, not yet run
on one; developed and measured on CPU)."""

from specjax.core.cache import KVCache
from specjax.io import from_gguf, from_hf, load, save
from specjax.loop.decode import DecodeState, decode, draft_step, init_state
from specjax.drafters import (Drafter, ModelDrafter, NGramDrafter, Proposal, self_drafter,
                              with_draft_vocab)
from specjax.drafters.eagle.drafter import EagleDrafter
from specjax.drafters.medusa.drafter import MedusaDrafter
from specjax.drafters.hybrid import HybridDrafter
from specjax.drafters.suffix import SuffixCorpus, SuffixDrafter
from specjax.drafters.eagle.eagle3 import load_eagle3
from specjax.loop.generate import generate
from specjax.loop.precompile import precompile
from specjax.models import Model, ModelConfig, RopeScaling, init_params
from specjax.models.quant import QuantizedWeight, dequantize_model, quantize
from specjax.core.outputs import DecodeOutput, DecodeStats
from specjax.core.sampling import Sampling, row_seeds
from specjax.loop.stream import decode_stream
from specjax.trees.structure import TreeSpec
from specjax.loop.round import round_step, verify_block
from specjax.parallel import ShardingRules, make_mesh, shard
from specjax.io.tokenizer import Tokenizer, load_tokenizer
from specjax.pretrained.pairs import PAIRS, DefaultPair, load_default, load_pair
from specjax.exactness.audit import AuditReport, audit
from specjax.drafters.adaptive.drafter import AdaptiveDrafter, adaptive_drafter
from specjax.drafters.adaptive.costs import AutoChoice, Calibration, auto_num_draft

__version__ = "0.1.0"

__all__ = [
    "DecodeOutput", "DecodeStats", "KVCache", "Model", "ModelConfig", "RopeScaling", "Sampling",
    "generate", "init_params", "precompile",
    "DecodeState", "Drafter", "ModelDrafter", "NGramDrafter", "Proposal", "decode", "draft_step",
    "init_state", "round_step", "row_seeds", "verify_block", "decode_stream",
    "self_drafter", "with_draft_vocab", "QuantizedWeight", "quantize", "dequantize_model",
    "EagleDrafter", "MedusaDrafter", "HybridDrafter", "load_eagle3", "TreeSpec",
    "from_gguf", "from_hf", "load", "save",
    "Tokenizer", "load_tokenizer",
    "ShardingRules", "make_mesh", "shard",
    "DefaultPair", "PAIRS", "load_default", "load_pair",
    "AuditReport", "audit",
    "AdaptiveDrafter", "AutoChoice", "Calibration", "adaptive_drafter", "auto_num_draft",
    "SuffixCorpus", "SuffixDrafter",
]
