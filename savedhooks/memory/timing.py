"""How long a graph's nodes and host-device copies take, as modelled: what offload placement reads.

* :class:`TransferModel`: copy bandwidth (torch's ``activation_offload_cpu_gpu_bw``
  by default), per-node run time (torch's roofline estimate on a GPU, else
  :func:`nominal_seconds`) and the device peak a placement may not exceed.
* :func:`backward_seconds_before_use`: the modelled backward compute before a
  saved value's first use, what can hide its copy back (read by the offload
  codec while its hooks are traced, and by the overlap pass).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable

import torch
import torch.fx

from savedhooks._torch import aot, inductor, pytree
from savedhooks.memory.graph import backward_uses
from savedhooks.memory.sizes import float_hint, size_hint, storage_key, tensor_nbytes

__all__ = ["TransferModel", "backward_seconds_before_use", "makes_cuda_tensor", "nominal_seconds"]

_NOMINAL_FLOPS = 100e12
_NOMINAL_BYTES_PER_S = 2e12


@dataclasses.dataclass(frozen=True)
class TransferModel:
    """How :func:`overlap_transfers` times copies and nodes, and how much memory it may add.

    Attributes:
        copy_bytes_per_s: host-device copy bandwidth; None reads torch's
            ``torch._functorch.config.activation_offload_cpu_gpu_bw`` (GB/s).
        node_seconds: the modelled run time of one FX node; None: torch's
            roofline estimate where a GPU is present, else :func:`nominal_seconds`.
        limit_bytes: the modelled device peak the placement may not exceed; None:
            the graph's own modelled peak before overlap.
    """

    copy_bytes_per_s: float | None = None
    node_seconds: Callable[[torch.fx.Node], float] | None = None
    limit_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.copy_bytes_per_s is not None and not self.copy_bytes_per_s > 0:
            raise ValueError(f"TransferModel: copy_bytes_per_s must be positive, got {self.copy_bytes_per_s!r}")
        if self.node_seconds is not None and not callable(self.node_seconds):
            raise TypeError(f"TransferModel: node_seconds must be callable, got {self.node_seconds!r}")
        if self.limit_bytes is not None and (not isinstance(self.limit_bytes, int) or self.limit_bytes < 0):
            raise ValueError(f"TransferModel: limit_bytes must be a non-negative int, got {self.limit_bytes!r}")

    def bandwidth(self) -> float:
        """Copy bandwidth.

        Returns:
            Bytes per second: ``copy_bytes_per_s``, or torch's
            ``activation_offload_cpu_gpu_bw`` (GB/s) converted.
        """
        if self.copy_bytes_per_s is not None:
            return float(self.copy_bytes_per_s)
        return aot.offload_bandwidth_gbps() * 1024**3

    def seconds(self, node: torch.fx.Node) -> float:
        """Modelled run time of ``node`` on the compute stream.

        Args:
            node: an FX node with ``meta["val"]``.

        Returns:
            Seconds from ``node_seconds``; else 0 for placeholders, outputs and
            attribute reads, torch's roofline estimate for a node on a GPU
            (torch 2.12+), :func:`nominal_seconds` for the rest.

        Raises:
            Whatever ``node_seconds`` raises.
        """
        # a time computed from symbolic sizes is read at their hints: float() or a compare
        # would add a guard to the graph being compiled (seen with dynamic=True on torch 2.11)
        if self.node_seconds is not None:
            return float_hint(self.node_seconds(node))
        if node.op != "call_function":
            return 0.0
        roofline = inductor.estimate_roofline_runtime_ms  # None on torch 2.11
        if roofline is not None and torch.cuda.is_available() and makes_cuda_tensor(node):
            return float_hint(roofline(node)) / 1e3
        return nominal_seconds(node)


def makes_cuda_tensor(node: torch.fx.Node) -> bool:
    """Whether ``node`` makes a CUDA tensor (what torch's roofline estimate times).

    Args:
        node: an FX node (its ``meta["val"]``: a tensor, a structure of them, or none).

    Returns:
        True when some tensor of its value is on CUDA.
    """
    return any(
        isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in pytree.tree_leaves(node.meta.get("val"))
    )


def nominal_seconds(node: torch.fx.Node) -> float:
    """A GPU-free estimate of a node's run time: FLOPs at 100 TFLOP/s or bytes at 2 TB/s, the longer.

    Args:
        node: an FX node whose inputs and output carry ``meta["val"]``.

    Returns:
        Seconds; 0 for placeholders, outputs and nodes that make no new storage.
    """
    if node.op != "call_function":
        return 0.0
    out = [t for t in pytree.tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor)]
    args, kwargs = pytree.tree_map_only(torch.fx.Node, lambda a: a.meta.get("val"), (node.args, node.kwargs))
    ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    storages = {storage_key(t) for t in ins}
    if not out or all(storage_key(t) in storages for t in out):  # a view or an alias
        return 0.0
    moved = sum(tensor_nbytes(t) for t in (*ins, *out))
    seconds = moved / _NOMINAL_BYTES_PER_S
    from torch.utils.flop_counter import flop_registry

    counter = flop_registry.get(getattr(node.target, "overloadpacket", None))
    if counter is not None:
        with contextlib.suppress(TypeError, ValueError, RuntimeError):  # a counter that rejects these: bytes alone
            seconds = max(seconds, size_hint(counter(*args, out_val=node.meta.get("val"), **kwargs)) / _NOMINAL_FLOPS)
    return seconds


def backward_seconds_before_use(saved: str, backward: torch.fx.Graph, model: TransferModel | None = None) -> float:
    """Modelled backward compute that runs before a saved tensor's first use: what can hide its copy back.

    Args:
        saved: the saved value's name (a placeholder of ``backward``).
        backward: the backward graph (AOTAutograd's, with ``meta["val"]``).
        model: how nodes are timed (default :class:`TransferModel`).

    Returns:
        Seconds of the nodes before the first node that reads the value (through
        ``detach`` / ``alias``); every node's when nothing reads it.
    """
    model = model or TransferModel()
    readers = {user for user, _ in backward_uses(saved, backward)}
    clock = _clock(backward, model)
    if any(n not in clock for n in readers):  # the graph changed since it was timed
        clock = _clock(backward, model, fresh=True)
    return min((clock[n] for n in readers), default=clock[None])


# Per backward graph and model: each node's start time (None: the graph's end). A pack hook asks
# once per saved tensor while AOTAutograd inlines the hooks one saved tensor after another, so the
# graph is timed once, as the partitioner made it: the unpack chains inlined meanwhile at its start
# are not compute that hides a copy (placement moves each to right before its first use).
_CLOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _clock(backward: torch.fx.Graph, model: TransferModel, fresh: bool = False) -> dict[torch.fx.Node | None, float]:
    per_model = _CLOCKS.setdefault(backward, {})
    if fresh or model not in per_model:
        starts, elapsed = {}, 0.0
        for node in backward.nodes:
            starts[node] = elapsed
            elapsed += model.seconds(node)
        starts[None] = elapsed
        per_model[model] = starts
    return per_model[model]
