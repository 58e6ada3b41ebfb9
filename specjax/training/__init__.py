"""Training with optax: target LMs, distilled drafts, and draft heads on the target's features."""
