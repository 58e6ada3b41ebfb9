"""Verification: the exact accept/reject rule for chains (`rule`) and trees (`tree_rule`), its
sharded form (`sharded`), and the dispatch that picks a fused kernel (`specjax.kernels`, the
checkout's `kernels/`) or the reference: on one device's rows (`local`) and the one mesh-aware
front door (`dispatch`)."""
