"""FX internals: whether symbolic tracing runs, the ops FX keeps as side-effectful, its shape config.

``torch.fx._symbolic_trace.is_fx_symbolic_tracing``, ``torch.fx.node._side_effectful_functions``
(the set dead-code elimination never removes from) and ``torch.fx.experimental._config``
(symbolic shapes' options, e.g. duck sizing) have no public spelling in torch 2.13.
"""

from __future__ import annotations

import torch.fx
import torch.fx.experimental._config as shapes_config
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from torch.fx.node import _side_effectful_functions as side_effectful_functions

__all__ = ["is_fx_symbolic_tracing", "rename_node", "shapes_config", "side_effectful_functions"]


def rename_node(node: torch.fx.Node, name: str) -> None:
    """Give a node a new name in its graph (FX's ``Node._rename``: the graph's namespace follows).

    Args:
        node: a node of a graph.
        name: the name it gets (made unique by the graph's namespace).
    """
    node._rename(name)
