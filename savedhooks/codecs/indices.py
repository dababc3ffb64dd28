"""Lossless narrowing of max-pool indices: int64 values below the pooled plane's size in int16 or int32.

Max pooling saves, for every output element, the flat index of its maximum in the
input plane (``h * W + w`` in 2-D). Those indices are int64 (8 bytes) but below
the plane's size, which the compiled graph knows: a 32 x 32 plane needs int16. In
eager mode there is no graph to read the plane from, so the indices are kept.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import torch

from savedhooks.codecs.base import Codec, producing_op
from savedhooks.hooks import hook_context

__all__ = ["PoolIndices", "pool_plane"]

# op -> how many trailing dims of its input make the plane its indices count in
_POOL_DIMS = {
    "max_pool2d_with_indices": 2,
    "max_pool3d_with_indices": 3,
    "adaptive_max_pool2d": 2,
    "adaptive_max_pool3d": 3,
}


def pool_plane(node: torch.fx.Node) -> int | None:
    """Size of the plane that a saved max-pool index tensor indexes into.

    Args:
        node: the saved value's node in the forward graph.

    Returns:
        The number of elements of one pooled input plane (``H * W`` in 2-D), or
        None when ``node`` is not the indices output of a max pool with a static
        input shape.

    Raises:
        Nothing.
    """
    if node.op != "call_function" or node.target is not operator.getitem or node.args[1] != 1:
        return None
    pool = node.args[0]
    dims = _POOL_DIMS.get(producing_op(pool) or "")
    val = pool.args[0].meta.get("val") if pool.args and isinstance(pool.args[0], torch.fx.Node) else None
    if dims is None or not isinstance(val, torch.Tensor):
        return None
    sizes = val.shape[-dims:]
    return math.prod(sizes) if all(isinstance(s, int) for s in sizes) else None


@dataclasses.dataclass(frozen=True)
class PoolIndices(Codec):
    """Max-pool indices narrowed to int16 or int32 under compile (lossless; see the module notes)."""

    def accepts(self, x: torch.Tensor) -> bool:
        """int64 indices of a max pool whose plane fits int32, under compile."""
        ctx = hook_context()
        plane = pool_plane(ctx.node) if ctx is not None and x.dtype == torch.int64 else None
        return plane is not None and plane <= 2**31

    def encode(self, x: torch.Tensor) -> tuple[Any, ...]:
        """``(x in int16 or int32,)``: int16 when every index (below the plane size) fits."""
        plane = pool_plane(hook_context().node)
        return (x.to(torch.int16 if plane <= 2**15 else torch.int32),)

    def decode(self, payload: tuple[Any, ...]) -> torch.Tensor:
        """Widen back to int64."""
        (y,) = payload
        return y.to(torch.int64)
