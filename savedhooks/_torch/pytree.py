"""torch's pytree functions (``torch.utils._pytree``; torch 2.13 has no public spelling of the module).

Re-exported unchanged: the functions that flatten nested containers of tensors
and FX nodes (args, kwargs, outputs) throughout savedhooks.
"""

from __future__ import annotations

from torch.utils._pytree import tree_leaves, tree_map, tree_map_only

__all__ = ["tree_leaves", "tree_map", "tree_map_only"]
