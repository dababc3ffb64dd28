"""Buffers of an FX graph: one per storage, with sizes, producers, users and frees.

Design notes
------------
* Storage identity comes from ``node.meta["val"]``: FakeTensors keep their
  storages, so views, ``detach`` and in-place results share the storage of their
  base, and multi-output ops give one storage per output. This is the alias
  information AOTAutograd's partitioner and inductor use as well.
* A buffer is freed after the last node that reads any alias of it. Graph outputs
  live to the end. A ``getitem`` reads the whole tuple of a multi-output op (the
  Python code torch generates holds the tuple to its last ``getitem``), but as
  inductor runs the graph (``fused``) only the output it takes: attention's
  log-sum-exp, saved and placed at the end of the forward in inductor's order,
  does not hold attention's output there (packed and freed long before).
  Graph inputs are owned by the caller: freed only when donated.
* Symbolic sizes use their hints. Devices are kept apart: host buffers of an
  offload do not count against the GPU.
* Who reads a value, looking through ``detach`` / ``alias``
  (:func:`uses_through_aliases`, :func:`backward_uses`), and which op made it
  (:func:`producing_op`): what the codecs' rules, the overlap pass and the
  planner's census ask of a saved value's node.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Collection
from typing import Any

import torch
import torch.fx

from savedhooks.memory.fusion import inlined_nodes
from savedhooks.memory.scratch import op_scratch_bytes
from savedhooks.memory.sizes import allocated_bytes, size_hint, storage_key, tensor_storages

__all__ = [
    "ALIAS_OPS",
    "Buffer",
    "GraphMemory",
    "op_name",
    "backward_uses",
    "build_graph_memory",
    "producing_op",
    "through_aliases",
    "uses_through_aliases",
]


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One storage of the graph.

    Attributes:
        index: position in :attr:`GraphMemory.buffers`.
        name: the node that first produced it (or the input placeholder).
        nbytes: storage size in bytes (symbolic sizes at their hints).
        device: where it lives.
        is_input: a graph input (owned by the caller).
        freeable: may be freed after its last use (not an output; not an input
            unless donated).
    """

    index: int
    name: str
    nbytes: int
    device: torch.device
    is_input: bool
    freeable: bool


@dataclasses.dataclass(frozen=True)
class GraphMemory:
    """The memory-relevant view of a graph, in its node order.

    Attributes:
        node_names: non-output nodes, in order (placeholders included).
        inputs: per node, the indices of the nodes it reads (data dependencies).
        buffers: all buffers.
        allocs: per node, the buffers it creates.
        reads: per node, the buffers it reads (through any alias).
        frees: per node, the buffers freed after it runs (their last use).
        scratch: per node, ``(device, bytes)`` it allocates and frees inside
            itself (:func:`savedhooks.memory.scratch.op_scratch_bytes`), or None.
    """

    node_names: tuple[str, ...]
    inputs: tuple[tuple[int, ...], ...]
    buffers: tuple[Buffer, ...]
    allocs: tuple[tuple[int, ...], ...]
    reads: tuple[tuple[int, ...], ...]
    frees: tuple[tuple[int, ...], ...]
    scratch: tuple[tuple[torch.device, int] | None, ...] = ()

    def scratch_on(self, node: int, device: torch.device) -> int:
        """Scratch bytes of ``node`` on ``device`` (0 if none there)."""
        entry = self.scratch[node] if self.scratch else None
        return entry[1] if entry is not None and entry[0] == device else 0


def _value_of_getitems(node: torch.fx.Node) -> tuple[Any, ...] | None:
    """A tuple-valued node without ``meta["val"]``, read from its ``getitem`` users' values (None if it cannot be).

    AOTAutograd leaves none on the higher-order ops that a checkpointed random
    op becomes (``run_and_save_rng_state``, ``run_with_rng_state``); each output
    it returns is read through a ``getitem`` that has one. An output nothing
    reads is left out (None).
    """
    items: dict[int, Any] = {}
    for user in node.users:
        if user.target is not operator.getitem or not isinstance(user.args[1], int) or "val" not in user.meta:
            return None
        items[user.args[1]] = user.meta["val"]
    return tuple(items.get(i) for i in range(max(items) + 1)) if items else None


def _nbytes(t: torch.Tensor) -> int:
    """A storage's bytes as its device's allocator counts them (CUDA's rounds each block up)."""
    return allocated_bytes(size_hint(t.untyped_storage().nbytes()), t.device)


def build_graph_memory(
    gm: torch.fx.GraphModule, donated: tuple[str, ...] = (), fused: bool = False, realized: Collection[str] = ()
) -> GraphMemory:
    """Build the buffer model of a graph whose nodes carry ``meta["val"]``.

    Args:
        gm: a GraphModule from AOTAutograd, make_fx or dynamo (with fake values).
        donated: names of placeholders whose storage may be freed after last use.
        fused: model the graph as inductor runs it: pointwise nodes that it
            computes inside their consumers (:func:`savedhooks.memory.fusion.inlined_nodes`)
            get no buffer, and their consumers read what they read.
        realized: with ``fused``, names of nodes inductor stored although the
            rule inlines them (see :func:`~savedhooks.memory.fusion.inlined_nodes`).

    Returns:
        A :class:`GraphMemory`.

    Raises:
        ValueError: a node that produces tensors has no ``meta["val"]``, or a
            tensor without a storage (sparse), or a donated name is not a
            placeholder.
    """
    placeholders = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    unknown = set(donated) - placeholders
    if unknown:
        raise ValueError(f"donated names are not graph inputs: {sorted(unknown)}")
    storage_to_buffers: dict[int, set[int]] = {}
    inlined = inlined_nodes(gm.graph, realized) if fused else set()
    buffers: list[dict[str, Any]] = []
    node_names: list[str] = []
    allocs: list[list[int]] = []
    reads: list[set[int]] = []
    node_buffers: dict[torch.fx.Node, set[int]] = {}
    node_index: dict[torch.fx.Node, int] = {}
    inputs: list[tuple[int, ...]] = []
    scratch: list[tuple[torch.device, int] | None] = []
    output_buffers: set[int] = set()

    for node in gm.graph.nodes:
        if node.op == "output":
            for arg in node.all_input_nodes:
                output_buffers |= node_buffers.get(arg, set())
            continue
        value = node.meta["val"] if "val" in node.meta else _value_of_getitems(node)
        if "val" not in node.meta and value is None and node.users and node.op != "get_attr":
            raise ValueError(f"node {node.name} has no meta['val']: pass example inputs to fill it")
        tensors = tensor_storages(value)
        mine: set[int] = set()
        new: list[int] = []
        for t in tensors:
            ref = storage_key(t)
            if ref is None:
                raise ValueError(f"node {node.name}: a {t.layout} tensor has no storage to count")
            if ref not in storage_to_buffers and node in inlined:  # computed in its consumers' kernels
                storage_to_buffers[ref] = set().union(*(node_buffers.get(a, set()) for a in node.all_input_nodes))
            elif ref not in storage_to_buffers:
                storage_to_buffers[ref] = {len(buffers)}
                buffers.append(
                    dict(name=node.name, nbytes=_nbytes(t), device=t.device, is_input=node.op == "placeholder")
                )
                new.append(len(buffers) - 1)
            mine |= storage_to_buffers[ref]
        node_buffers[node] = mine
        inputs.append(tuple(sorted(node_index[a] for a in node.all_input_nodes if a in node_index)))
        node_index[node] = len(node_names)
        node_names.append(node.name)
        allocs.append(new)
        extra = 0 if node in inlined else op_scratch_bytes(node, fused)
        scratch.append((tensors[0].device, extra) if extra and tensors else None)
        if fused and node.target is operator.getitem and mine:  # inductor: one output's storage, not the tuple
            reads.append(set(mine))
        else:
            reads.append(set().union(*(node_buffers.get(a, set()) for a in node.all_input_nodes)))

    last_use = {b: -1 for b in range(len(buffers))}
    for i, (made, used) in enumerate(zip(allocs, reads)):
        for b in set(made) | used:
            last_use[b] = i
    frees: list[list[int]] = [[] for _ in node_names]
    built = []
    for b, info in enumerate(buffers):
        freeable = b not in output_buffers and (not info["is_input"] or info["name"] in donated)
        built.append(Buffer(index=b, freeable=freeable, **info))
        if freeable:
            frees[last_use[b]].append(b)
    return GraphMemory(
        node_names=tuple(node_names),
        inputs=tuple(inputs),
        buffers=tuple(built),
        allocs=tuple(tuple(a) for a in allocs),
        reads=tuple(tuple(sorted(r)) for r in reads),
        frees=tuple(tuple(f) for f in frees),
        scratch=tuple(scratch),
    )


# Ops through which a saved value reaches its real backward users unchanged.
ALIAS_OPS = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def uses_through_aliases(nodes: list[torch.fx.Node]) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """The nodes that read ``nodes``, looking through ``detach`` / ``alias``.

    Args:
        nodes: values of one graph.

    Returns:
        ``(user, value it reads)`` pairs, the value being one of ``nodes`` or
        one of their aliases.
    """
    frontier, uses = list(nodes), []
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.target in ALIAS_OPS:
                frontier.append(user)
            else:
                uses.append((user, node))
    return uses


def backward_uses(name: str, bw_graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """The backward nodes that read a saved value, looking through ``detach`` / ``alias``.

    Args:
        name: the saved value's name (a placeholder of ``bw_graph``).
        bw_graph: the backward graph being compiled.

    Returns:
        ``(user, value it reads)`` pairs, the value being the placeholder or one
        of its aliases; empty when no placeholder has that name.
    """
    return uses_through_aliases([n for n in bw_graph.find_nodes(op="placeholder") if n.name == name])


def through_aliases(node: torch.fx.Node) -> torch.fx.Node:
    """The value ``node`` aliases, looking back through ``detach`` / ``alias`` (``node`` itself if none).

    Args:
        node: a node of an FX graph.

    Returns:
        The first node up the chain that is not one of :data:`ALIAS_OPS`.
    """
    while node.op == "call_function" and node.target in ALIAS_OPS:
        node = node.args[0]
    return node


def producing_op(node: torch.fx.Node) -> str | None:
    """Name of the aten op that produced a saved value, looking through ``detach`` and ``getitem``.

    Args:
        node: the saved value's node in the forward graph.

    Returns:
        The op's overload-packet name (``"native_layer_norm"``), or None when the
        node is not an op call.
    """
    node = through_aliases(node)
    while node.op == "call_function" and node.target is operator.getitem:
        node = through_aliases(node.args[0])
    return op_name(node.target)


def op_name(target: Any) -> str | None:
    """The overload-packet name of an op (``"addmm"``), or a callable's ``__name__``.

    Args:
        target: a node's ``target`` (an op overload, a function), or None.

    Returns:
        The name, or None when ``target`` has neither.
    """
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", None) if packet is not None else getattr(target, "__name__", None)
