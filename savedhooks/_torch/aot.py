"""functorch / AOTAutograd internals: its config, the saved-tensor hook context, the rng prims of checkpointing.

``torch._functorch.config`` holds the options savedhooks reads or patches
(the autograd cache, eager backward lowering, the host-copy bandwidth used to
time offloads). While AOTAutograd inlines saved-tensor hooks into a compiled
graph it publishes the node being saved and both graphs through
``torch._functorch._aot_autograd.graph_compile._get_saved_tensor_hook_context``.
Checkpointed random ops are wrapped in ``torch._prims.rng_prims``'s
``run_and_save_rng_state`` / ``run_with_rng_state``.
"""

from __future__ import annotations

import contextlib

import torch
from torch._functorch import config
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

from savedhooks._torch.version import release

__all__ = ["BACKWARD_FREES_GRADIENTS", "compiling_graph", "config", "every_saved_value_hooked", "offload_bandwidth_gbps",
           "run_and_save_rng_state", "run_with_rng_state", "saved_tensor_hook_context"]

# A compiled backward takes its incoming gradients as one list that it empties, so that each is
# freed at its last use (torch 2.13+: the runtime wrapper's "freeing individual grads mid-backward").
# Before, its caller holds them to the end. Read by savedhooks.memory.freed_inputs.
BACKWARD_FREES_GRADIENTS = release() >= (2, 13)

_OFFLOAD_BANDWIDTH_GBPS = 50.0  # torch 2.12+'s default activation_offload_cpu_gpu_bw, for the releases without it



def every_saved_value_hooked() -> contextlib.AbstractContextManager:
    """Have AOTAutograd inline saved-tensor hooks for every saved value but the static inputs.

    torch's default (``saved_tensors_hooks_filtering_mode="donated"``) inlines
    them only for saved values that are intermediates of the graph: not for a
    value the forward also returns (a decoder's key and value with
    ``use_cache=True``), nor for saved values that share one storage.
    ``"no_static"`` leaves out only the static inputs (parameters, buffers).

    Returns:
        The ``torch._functorch.config`` patch, a context manager.
    """
    return config.patch(saved_tensors_hooks_filtering_mode="no_static")


def saved_tensor_hook_context() -> tuple[torch.fx.Node, torch.fx.Graph, torch.fx.Graph] | None:
    """What AOTAutograd is inlining a saved-tensor hook for, while it does.

    Returns:
        ``(node, fw_graph, bw_graph)``: the forward node whose value is saved
        and the forward and backward graphs; None outside the inlining (eager mode).
    """
    from torch._functorch._aot_autograd.graph_compile import _get_saved_tensor_hook_context

    state = _get_saved_tensor_hook_context()
    if not state:
        return None
    return state["_node"], state["_fw_graph"], state["_bw_graph"]


def offload_bandwidth_gbps() -> float:
    """The host-device copy bandwidth that timing of offloads assumes, in GB/s.

    Returns:
        ``torch._functorch.config.activation_offload_cpu_gpu_bw`` (torch 2.12+),
        else 50.0 (its default there).
    """
    return float(getattr(config, "activation_offload_cpu_gpu_bw", _OFFLOAD_BANDWIDTH_GBPS))


def compiling_graph() -> tuple[int, str] | None:
    """Which AOTAutograd graph is being compiled, while one is (a graph compiler or a post-grad pass runs).

    Returns:
        ``(aot_id, kind)``: ``aot_id`` is shared by a forward and its backward
        (one per dynamo graph), ``kind`` one of ``"forward"``, ``"backward"``,
        ``"inference"`` (a graph with no backward: no input needs a gradient)
        and ``"joint"``; None outside a compile, or where this release does not
        publish it (``torch._functorch._aot_autograd.logging_utils``).
    """
    try:
        from torch._functorch._aot_autograd.logging_utils import get_aot_compilation_context
    except ImportError:  # pragma: no cover - a release without it
        return None
    names, _, _ = get_aot_compilation_context()
    if not names:
        return None
    aot_id, _, kind = names[-1].partition("_")
    return (int(aot_id), kind) if aot_id.isdigit() else None
