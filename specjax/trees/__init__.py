"""Draft trees as a proposal shape: `structure` (`TreeSpec`, `Tree`, masks, paths) and `builders`
(static, dynamic and n-gram trees from a drafter's distributions)."""

from specjax.trees.structure import Tree, TreeSpec

__all__ = ["Tree", "TreeSpec"]
