"""Adaptive draft length: `drafter` (`adaptive_drafter`, the per-row, per-round length), `stop`
(confidence stop rules), `costs` (cost tables, acceptance profiles, `auto_num_draft`)."""
