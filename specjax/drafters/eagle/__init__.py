"""EAGLE-3 and MTP heads: `network` (the one-layer head, its config, init and checkpoints),
`drafter` (`EagleDrafter`), `tree` (its draft trees), `eagle3` (EAGLE-3 checkpoints of the
reference implementation as drafters)."""
