"""Verification: the exact accept/reject rule for chains (`rule`) and trees (`tree_rule`), its
sharded form (`sharded`), the fused Pallas kernels that compute it (`kernels/`), and the one front
door that picks among them (`dispatch`)."""
