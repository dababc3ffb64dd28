"""``torch.nn.Module`` internals: a module's own buffer table.

``Module._buffers`` is the dict a module keeps its buffers in (None entries
included); writing into it puts a tensor back without ``Module.__setattr__``'s
checks and hooks.
"""

from __future__ import annotations

import torch

__all__ = ["own_buffers"]


def own_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """The module's own buffer table (not its submodules'), live: writes go to the module.

    Args:
        module: a module.

    Returns:
        ``module._buffers``.
    """
    return module._buffers
