"""Medusa heads: `network` (the heads, their config, init and checkpoints), `drafter`
(`MedusaDrafter`), `tree` (their draft trees)."""
