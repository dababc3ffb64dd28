"""Predicted live bytes per node, the peak, and a lower bound valid for any order.

The model (as inductor's ``estimate_peak_memory_allocfree``): each node allocates
its new buffers, runs with everything live plus the scratch it allocates inside
itself (known for our own ops only, :mod:`savedhooks.memory.scratch`; the
"during" figure), then frees the buffers whose last use it was (the "after"
figure).

The lower bound: while node ``v`` runs, a buffer must be live if it already
exists (an input, or made by ``v`` or an ancestor of ``v``) and is still needed
(an output, or read by ``v`` or by a descendant of ``v``). That holds in every
topological order, so no reordering can go below the largest such sum.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx

from savedhooks._torch.aot import BACKWARD_FREES_GRADIENTS
from savedhooks._torch.tensors import FakeTensorMode, unset_fake_temporarily
from savedhooks.memory.graph import Buffer, GraphMemory, build_graph_memory

__all__ = [
    "PeakEstimate",
    "StepPrediction",
    "estimate_peak",
    "freed_inputs",
    "lower_bound",
    "predict_step",
    "saved_activations",
    "simulate",
    "simulate_order",
]


@dataclasses.dataclass(frozen=True)
class PeakEstimate:
    """The model's prediction for one device.

    Attributes:
        device: the device the figures are for.
        peak_bytes: the largest "during" figure.
        peak_node: the node running at the peak.
        peak_step: its index in :attr:`node_names`.
        node_names: the nodes, in order.
        live_during: live bytes while each node runs (after its allocations).
        live_after: live bytes after each node frees what died.
        at_peak: buffers live at the peak, largest first.
        lower_bound: bytes that any order of the graph must hold at some node.
    """

    device: torch.device
    peak_bytes: int
    peak_node: str
    peak_step: int
    node_names: tuple[str, ...]
    live_during: tuple[int, ...]
    live_after: tuple[int, ...]
    at_peak: tuple[Buffer, ...]
    lower_bound: int


def simulate(memory: GraphMemory, device: torch.device) -> tuple[list[int], list[int], list[set[int]]]:
    """Run the alloc/free model in the graph's order.

    Args:
        memory: the graph's buffers.
        device: count only buffers on this device.

    Returns:
        ``(live_during, live_after, live_sets_during)`` per node.
    """
    live, current = 0, set()
    during, after, sets = [], [], []
    for i, (made, freed) in enumerate(zip(memory.allocs, memory.frees)):
        for b in made:
            if memory.buffers[b].device == device:
                live += memory.buffers[b].nbytes
                current.add(b)
        during.append(live + memory.scratch_on(i, device))
        sets.append(set(current))
        for b in freed:
            if memory.buffers[b].device == device:
                live -= memory.buffers[b].nbytes
                current.discard(b)
        after.append(live)
    return during, after, sets


def simulate_order(memory: GraphMemory, order: list[int], device: torch.device) -> int:
    """Peak bytes on ``device`` when the graph's nodes run in ``order`` (alloc, run, free).

    Args:
        memory: the graph's buffers.
        order: a permutation of node indices (assumed topological).
        device: count only buffers on this device.

    Returns:
        The peak of the "during" figures. Inputs count from the start, wherever
        their placeholders sit in ``order``.

    Raises:
        ValueError: ``order`` is not a permutation of the nodes.
    """
    if sorted(order) != list(range(len(memory.node_names))):
        raise ValueError("order must be a permutation of the graph's nodes")
    last: dict[int, int] = {}
    for position, i in enumerate(order):
        for b in set(memory.allocs[i]) | set(memory.reads[i]):
            last[b] = position
    frees: dict[int, list[int]] = {}
    for b, position in last.items():
        if memory.buffers[b].freeable:
            frees.setdefault(position, []).append(b)
    # Inputs exist before the graph runs, wherever their placeholders sit in the order.
    live = peak = sum(b.nbytes for b in memory.buffers if b.is_input and b.device == device)
    for position, i in enumerate(order):
        live += sum(
            memory.buffers[b].nbytes
            for b in memory.allocs[i]
            if memory.buffers[b].device == device and not memory.buffers[b].is_input
        )
        peak = max(peak, live + memory.scratch_on(i, device))
        live -= sum(memory.buffers[b].nbytes for b in frees.get(position, ()) if memory.buffers[b].device == device)
    return peak


def lower_bound(memory: GraphMemory, device: torch.device) -> int:
    """Bytes on ``device`` that every topological order holds while some node runs.

    Args:
        memory: the graph's buffers and dependencies.
        device: count only buffers on this device.

    Returns:
        The bound (0 for an empty graph).
    """
    n = len(memory.node_names)
    if n == 0:
        return 0
    everyone = (1 << n) - 1
    ancestors = [0] * n
    for i, deps in enumerate(memory.inputs):
        for j in deps:
            ancestors[i] |= ancestors[j] | (1 << j)
    descendants = [0] * n
    users: list[list[int]] = [[] for _ in range(n)]
    for i, deps in enumerate(memory.inputs):
        for j in deps:
            users[j].append(i)
    for i in range(n - 1, -1, -1):
        for u in users[i]:
            descendants[i] |= descendants[u] | (1 << u)
    producer = {b: i for i, made in enumerate(memory.allocs) for b in made}
    readers: dict[int, list[int]] = {}
    for i, read in enumerate(memory.reads):
        for b in read:
            readers.setdefault(b, []).append(i)
    with unset_fake_temporarily():  # callable from a compiler, inside AOTAutograd's fake mode
        return _largest_sum(memory, device, producer, readers, ancestors, descendants, everyone, n)


def _largest_sum(memory, device, producer, readers, ancestors, descendants, everyone, n) -> int:
    total = torch.zeros(n, dtype=torch.float64)
    for buffer in memory.buffers:
        if buffer.device != device:
            continue
        p = producer[buffer.index]
        exists = everyone if buffer.is_input else descendants[p] | (1 << p)
        needed = everyone if not buffer.freeable else (1 << p)
        if buffer.freeable:
            for r in readers.get(buffer.index, ()):
                needed |= ancestors[r] | (1 << r)
        total += buffer.nbytes * _bits(exists & needed, n)
    total += torch.tensor([float(memory.scratch_on(i, device)) for i in range(n)], dtype=torch.float64)
    return int(total.max().item())


_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _bits(mask: int, n: int) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(mask.to_bytes((n + 7) // 8, "little")), dtype=torch.uint8)
    return ((raw.unsqueeze(1) & _BIT_WEIGHTS) != 0).view(-1)[:n].double()


def estimate_peak(
    gm: torch.fx.GraphModule, *example_inputs: Any, donated: tuple[str, ...] = (), device: Any = None
) -> PeakEstimate:
    """Predict the peak memory of running ``gm`` in its node order.

    Args:
        gm: an FX GraphModule (AOTAutograd, make_fx or dynamo output).
        *example_inputs: optional inputs; when given, fake values are propagated
            through the graph first (needed when nodes lack ``meta["val"]``).
        donated: placeholder names whose storage the graph may free.
        device: the device to report; default the first non-CPU device holding
            a buffer, else CPU.

    Returns:
        A :class:`PeakEstimate`.

    Raises:
        ValueError: nodes lack ``meta["val"]`` and no example inputs were given,
            or ``donated`` names a non-input.
    """
    if example_inputs:
        _propagate_fake_values(gm, example_inputs)
    memory = build_graph_memory(gm, donated)
    device = _report_device(memory) if device is None else _resolve_device(memory, device)
    during, after, sets = simulate(memory, device)
    step = max(range(len(during)), key=during.__getitem__) if during else 0
    at_peak = sorted((memory.buffers[b] for b in (sets[step] if sets else ())), key=lambda b: -b.nbytes)
    return PeakEstimate(
        device=device,
        peak_bytes=during[step] if during else 0,
        peak_node=memory.node_names[step] if during else "",
        peak_step=step,
        node_names=memory.node_names,
        live_during=tuple(during),
        live_after=tuple(after),
        at_peak=tuple(at_peak),
        lower_bound=lower_bound(memory, device),
    )


@dataclasses.dataclass(frozen=True)
class StepPrediction:
    """Predicted memory of one compiled training step, above what was live before it.

    Attributes:
        forward_peak: peak while the forward graph runs.
        retained: what the forward leaves alive (saved for backward, outputs).
        backward_peak: retained plus the backward graph's own peak.
        step_peak: the larger of the two peaks.
    """

    forward_peak: int
    retained: int
    backward_peak: int
    step_peak: int


def predict_step(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, device: Any = None) -> StepPrediction:
    """Predict a training step from its AOTAutograd forward and backward graphs.

    The backward graph frees each saved activation and each incoming gradient
    after its last use, as torch's backends run it (:func:`freed_inputs`);
    parameters (``primals_*``) are held by their owners.

    Args:
        forward: the forward graph (with ``meta["val"]``).
        backward: the backward graph.
        device: as for :func:`estimate_peak`.

    Returns:
        A :class:`StepPrediction`.

    Raises:
        ValueError: as for :func:`estimate_peak`.
    """
    fw = estimate_peak(forward, device=device)
    bw = estimate_peak(backward, donated=freed_inputs(backward), device=device)
    fw_inputs = _input_bytes(build_graph_memory(forward), fw.device)
    bw_inputs = _input_bytes(build_graph_memory(backward), bw.device)
    retained = fw.live_after[-1] - fw_inputs if fw.live_after else 0
    forward_peak = fw.peak_bytes - fw_inputs
    backward_peak = retained + bw.peak_bytes - bw_inputs
    return StepPrediction(forward_peak, retained, backward_peak, max(forward_peak, backward_peak))


def saved_activations(backward: torch.fx.GraphModule) -> tuple[str, ...]:
    """Inputs of an AOTAutograd backward graph that the forward saved for it: neither parameters nor gradients.

    Parameters (``primals_*``) are held by their owners and incoming gradients
    (``tangents_*``) come from the autograd engine; everything else was saved by
    the forward for this backward only.

    Args:
        backward: an AOTAutograd backward graph.

    Returns:
        Placeholder names.
    """
    return tuple(
        n.name for n in backward.graph.nodes if n.op == "placeholder" and not n.name.startswith(("primals", "tangents"))
    )


def freed_inputs(backward: torch.fx.GraphModule) -> tuple[str, ...]:
    """Inputs that an AOTAutograd backward graph frees after their last use: pass them as ``donated``.

    The saved activations (:func:`saved_activations`) and, from torch 2.13 on,
    the incoming gradients (``tangents_*``): torch 2.13 hands a compiled backward
    its gradients as one list that it empties ("to allow freeing individual
    grads mid-backward", in its runtime wrapper), and both aot_eager's generated
    code and inductor's (``del tangents_1``) drop each input at its last use.
    Before 2.13 the caller holds the gradients to the end of the backward. GPT-2 with
    checkpointed blocks, whose logits gradient is read first by the default
    order and late by a placed one, measures under aot_eager what is predicted
    with the gradients freed, not with them held (``tests/memory/test_memory.py``).
    Parameters are held by their
    owners. A gradient that something else keeps (``retain_grad`` on the model's
    output, a hook storing it) lives longer than predicted.

    Args:
        backward: an AOTAutograd backward graph.

    Returns:
        Placeholder names.
    """
    if not BACKWARD_FREES_GRADIENTS:
        return saved_activations(backward)
    return tuple(n.name for n in backward.graph.nodes if n.op == "placeholder" and not n.name.startswith("primals"))


def _report_device(memory: GraphMemory) -> torch.device:
    """The first non-CPU device holding a buffer, else CPU."""
    devices = {b.device for b in memory.buffers}
    return next((d for d in sorted(devices, key=str) if d.type != "cpu"), torch.device("cpu"))


def _resolve_device(memory: GraphMemory, device: Any) -> torch.device:
    """``device`` as the graph's buffers name it: ``"cuda"`` (no index) is the graph's first CUDA device.

    ``torch.device("cuda") != torch.device("cuda:0")``, and traced values carry the index.
    """
    device = torch.device(device)
    if device.index is not None:
        return device
    indexed = sorted({b.device for b in memory.buffers if b.device.type == device.type}, key=str)
    return indexed[0] if indexed else device


def _input_bytes(memory: GraphMemory, device: torch.device) -> int:
    return sum(b.nbytes for b in memory.buffers if b.is_input and b.device == device)


def _propagate_fake_values(gm: torch.fx.GraphModule, example_inputs: tuple[Any, ...]) -> None:
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*example_inputs)
