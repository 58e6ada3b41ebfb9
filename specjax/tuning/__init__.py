"""Measurement that tunes a drafter to a machine: `calibrate` (cost tables and acceptance profiles
for
`specjax.adaptive_drafter` and `specjax.drafters.adaptive.auto_num_draft`)."""
