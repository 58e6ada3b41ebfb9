"""Adaptive draft length: `drafter` (`adaptive_drafter`, the per-row, per-round length), `stop`
(confidence stop rules), `costs` (cost tables, acceptance profiles, `auto_num_draft`)."""

from specjax.drafters.adaptive.costs import AutoChoice, Calibration, auto_num_draft
from specjax.drafters.adaptive.drafter import AdaptiveDrafter, adaptive_drafter

__all__ = ["AdaptiveDrafter", "AutoChoice", "Calibration", "adaptive_drafter", "auto_num_draft"]
