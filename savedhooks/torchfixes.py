"""Work-arounds for torch 2.13 bugs met on savedhooks' own code paths.

Design notes
------------
* **Checkpointed random ops.** When a checkpointed region holds an op that
  draws random numbers (SDPA on CPU, dropout), the partitioner's
  ``functionalize_rng_ops`` saves the generator state for the recompute: the
  forward outputs ``getitem(run_and_save_rng_state(...), 0)`` (an auto-generated
  name such as ``getitem_4``) and the backward reads it as a new placeholder
  named ``rng_state_output_<k>``. AOTAutograd's inlining of saved-tensor hooks
  then matches forward outputs to backward inputs *by name* and fails with
  ``AssertionError: could not find saved tensor getitem_4 in bw_g_inputs`` (for
  torch's own GraphModule hooks as well). Both graphs list the states in the
  same order (the partitioner appends them to the forward's outputs and inserts
  the placeholders before the tangents, one per random op), so the k-th forward
  state is renamed after the k-th backward placeholder before the hook is
  inlined. Names carry no meaning at run time (outputs and inputs are matched by
  position), so the rename changes nothing but the assertion.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from savedhooks.contract import HookContext

__all__ = ["align_rng_state_names", "rng_state_outputs"]

_BACKWARD_STATE_PREFIX = "rng_state_output_"  # torch/_functorch/partitioners.py: functionalize_rng_ops


def rng_state_outputs(fw_graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The generator states a forward graph saves for checkpointed random ops, in output order.

    Args:
        fw_graph: a partitioned forward graph.

    Returns:
        The ``getitem(run_and_save_rng_state(...), 0)`` nodes among its outputs.

    Raises:
        Nothing.
    """
    run_and_save = torch._prims.rng_prims.run_and_save_rng_state
    outputs = fw_graph.output_node().args[0]
    return [
        n
        for n in outputs
        if isinstance(n, torch.fx.Node)
        and n.target is operator.getitem
        and n.args[1] == 0
        and isinstance(n.args[0], torch.fx.Node)
        and n.args[0].target is run_and_save
    ]


def align_rng_state_names(ctx: HookContext) -> None:
    """Give each saved generator state its backward placeholder's name (see the module notes).

    Idempotent; does nothing when the graphs hold no such states or when their
    counts disagree (an unknown layout: torch's own assertion then speaks).

    Args:
        ctx: the graphs AOTAutograd is inlining hooks into.

    Returns:
        None.

    Raises:
        Nothing.
    """
    forward = rng_state_outputs(ctx.fw_graph)
    if not forward:
        return
    backward = [n for n in ctx.bw_graph.find_nodes(op="placeholder") if n.name.startswith(_BACKWARD_STATE_PREFIX)]
    if len(forward) != len(backward):
        return
    for state, placeholder in zip(forward, backward):
        state._rename(placeholder.name)
