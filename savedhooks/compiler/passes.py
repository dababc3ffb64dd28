"""Reorder compiled graphs for memory: place inlined hooks, then the lowest-peak order.

torch 2.13 inlines pack into the forward graph's epilogue and unpack into the
backward graph's prologue, so every full-size saved tensor stays alive to the end
of the forward, and every unpacked one from the start of the backward.

* Placement: forward nodes used only by outputs (a pack chain: the ops turning a
  saved tensor into its payload) go right after the last use of what they read,
  so the full-size tensor dies there; backward nodes computed only from inputs
  (an unpack chain) go right before their first user. Both are found by dataflow,
  so user hooks (``@savedhooks.hook``) are placed as well as codecs.
* Ordering: :mod:`savedhooks.schedule`'s portfolio (each strategy followed by
  placement) and exact search, judged by :mod:`savedhooks.memory`; the graph's
  own order wins ties, so the result is never worse than torch's.
* Sinking (graphs for inductor): the model gives a pointwise node that inductor
  fuses into its consumers no buffer, so the search may leave it anywhere; but
  inductor stores such a node after all when its expression grows large, at its
  place in the graph. :func:`savedhooks.schedule.sink_free` then moves every node
  that allocates nothing right before its first user (same modelled peak).
* Only the order changes, never what is computed, with one exception for
  inductor: an ``addmm`` that inductor fused from an ``mm`` and a later ``add``
  is split back (:mod:`savedhooks.compiler.unfuse`) so that the ``mm`` may run early, and
  fused again where it did not move. Beyond dataflow, in-place writes, RNG and
  side effects keep their order (:func:`ordering_edges`).

How the pass reaches the compilers (inductor's post-grad slot, ``sh.backend``,
the hooks' context) is :mod:`savedhooks.compiler.api`.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import re

import torch
import torch.fx

from savedhooks._torch.ops import OpOverload, schema_of
from savedhooks.memory import build_graph_memory, freed_inputs, lower_bound
from savedhooks.memory.estimate import _report_device
from savedhooks.schedule import STRATEGIES, Problem, Schedule, build_problem, hoist_frees, peak_of, schedule, sink_free

__all__ = [
    "graph_problem",
    "has_hook_chains",
    "is_backward_graph",
    "ordering_edges",
    "pack_chain_nodes",
    "place_hooks",
    "reorder_for_memory",
    "reorder_graph",
    "unhook_names",
]

_OUTPUT = "output"
log = logging.getLogger(__name__)


def ordering_edges(gm: torch.fx.GraphModule, memory) -> list[tuple[int, int]]:
    """Order constraints beyond dataflow: in-place writes, RNG and side effects.

    A node writing a buffer (any alias of it) stays after every earlier node that
    touches the buffer and before every later one; nodes with side effects (RNG
    included, as reordering two random ops changes their draws) keep their order
    among themselves. A call whose writes cannot be read from an operator schema
    is taken to write everything it reads.

    Args:
        gm: the graph.
        memory: its :func:`savedhooks.memory.build_graph_memory`.

    Returns:
        ``(before, after)`` pairs of node indices (``memory.node_names`` order).
    """
    index = {name: i for i, name in enumerate(memory.node_names)}
    node_buffers: dict[torch.fx.Node, set[int]] = {}
    edges: list[tuple[int, int]] = []
    accesses: dict[int, list[tuple[int, bool]]] = {}
    previous_impure = None
    for node in gm.graph.nodes:
        if node.name not in index:
            continue
        i = index[node.name]
        node_buffers[node] = set(memory.allocs[i]) | set(memory.reads[i])
        written = _written_buffers(node, node_buffers)
        for b in node_buffers[node]:
            accesses.setdefault(b, []).append((i, b in written))
        if node.op == "call_function" and node.is_impure():
            if previous_impure is not None:
                edges.append((previous_impure, i))
            previous_impure = i
    for seq in accesses.values():
        for k, (i, writes) in enumerate(seq):
            if writes:
                edges += [(j, i) for j, _ in seq[:k]] + [(i, j) for j, _ in seq[k + 1 :]]
    return edges


def _written_buffers(node: torch.fx.Node, node_buffers) -> set[int]:
    if node.op in ("placeholder", "get_attr"):
        return set()
    target = node.target
    if target is operator.getitem:
        return set()
    if not isinstance(target, OpOverload):
        return set().union(*(node_buffers.get(a, set()) for a in node.all_input_nodes))
    written: set[int] = set()
    schema = schema_of(target)
    for k, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = node.args[k] if k < len(node.args) else node.kwargs.get(argument.name)
        for arg in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(arg, torch.fx.Node):
                written |= node_buffers.get(arg, set())
    return written


def graph_problem(gm: torch.fx.GraphModule, donated: tuple[str, ...] = (), fused: bool = False) -> tuple[Problem, int]:
    """The scheduling problem of ``gm`` and the lower bound on any order's peak.

    Args:
        gm: a graph whose nodes carry ``meta["val"]``.
        donated: placeholders the graph may free after their last use.
        fused: model inductor's fusion (see :func:`savedhooks.memory.build_graph_memory`).

    Returns:
        ``(problem, lower bound in bytes)``; node ``i`` of the problem is the
        graph's ``i``-th non-output node. Placeholders are fixed first.

    Raises:
        ValueError: nodes lack ``meta["val"]``.
    """
    memory = build_graph_memory(gm, donated, fused)
    device = _report_device(memory)
    nodes = [n for n in gm.graph.nodes if n.op != _OUTPUT]
    fixed = [i for i, n in enumerate(nodes) if n.op in ("placeholder", "get_attr")]
    chains = pack_chain_nodes(gm.graph)
    chains = [i for i, n in enumerate(nodes) if n in chains]
    return build_problem(memory, device, ordering_edges(gm, memory), fixed, chains), lower_bound(memory, device)


def reorder_graph(
    gm: torch.fx.GraphModule,
    donated: tuple[str, ...] = (),
    strategies: tuple[str, ...] = tuple(STRATEGIES),
    exact_budget: int = 2_000,
    fused: bool = False,
    score: str = "peak",
) -> Schedule:
    """Reorder ``gm`` in place to the lowest modelled peak the portfolio finds.

    Placeholders keep their order (the signature) and the output stays last.

    Args:
        gm: a graph whose nodes carry ``meta["val"]``.
        donated: placeholders the graph may free after their last use.
        strategies: names from :data:`savedhooks.schedule.STRATEGIES`.
        exact_budget: state budget of the exact search (0 to skip it).
        fused: judge orders as inductor runs them (pointwise chains fused), and
            then sink what allocates nothing to its first user
            (:func:`savedhooks.schedule.sink_free`; method ``"...+sink"``): a
            pointwise node that inductor stores after all is stored when needed.
        score: ``"peak"`` (default) or ``"arena"``: minimize the arena bytes of a
            static plan (:func:`savedhooks.memory.plan_arena`) instead of the
            liveness peak alone (see :func:`savedhooks.schedule.schedule`).

    Last, :func:`savedhooks.schedule.hoist_frees` runs what frees more than it
    allocates sooner where the peak allows (method ``"...+hoist"``).

    Returns:
        The :class:`savedhooks.schedule.Schedule` applied (its ``order`` indexes
        the nodes as they were).

    Raises:
        ValueError: nodes lack ``meta["val"]``, an unknown strategy or score.
    """
    problem, bound = graph_problem(gm, donated, fused)
    result = schedule(problem, bound, strategies, exact_budget, score=score)
    if fused:
        sunk = sink_free(problem, result.order)
        if sunk != result.order and peak_of(problem, sunk) <= result.peak:
            result = dataclasses.replace(result, order=sunk, peak=peak_of(problem, sunk), method=result.method + "+sink")
    hoisted = hoist_frees(problem, result.order) if score == "peak" else result.order
    if hoisted != result.order:  # hoisting can lower the peak too: report the order's own
        result = dataclasses.replace(result, order=hoisted, peak=peak_of(problem, hoisted), method=result.method + "+hoist")
    nodes = [n for n in gm.graph.nodes if n.op != _OUTPUT]
    if result.order != list(range(len(nodes))):
        output = gm.graph.output_node()
        for i in result.order:
            output.prepend(nodes[i])
        gm.graph.lint()
        gm.recompile()
    return result


def place_hooks(gm: torch.fx.GraphModule, is_backward: bool, fused: bool = False) -> Schedule | None:
    """Hook placement: packs right after last use, unpacks right before first use.

    The graph's own order plus :func:`savedhooks.schedule.place`, kept unless
    the memory model finds it higher (never worse than torch's order).

    Args:
        gm: an AOTAutograd forward or backward graph (with ``meta["val"]``).
        is_backward: which one it is (a backward frees its saved activations).
        fused: the graph goes to inductor: judge the orders with its fusion
            modelled (a pack's temporaries live inside one kernel); what
            allocates nothing then sinks to its first user and what frees
            more than it makes is hoisted (:func:`reorder_graph`).

    Returns:
        The :class:`savedhooks.schedule.Schedule`, or None when the graph has no
        fake values to judge by (left as it is).
    """
    return _reorder(gm, is_backward, strategies=("input",), exact_budget=0, fused=fused)


def reorder_for_memory(gm: torch.fx.GraphModule, is_backward: bool, fused: bool = False) -> Schedule | None:
    """The full pass: every portfolio strategy with placement, then the exact search.

    Args:
        gm: an AOTAutograd forward or backward graph (with ``meta["val"]``).
        is_backward: which one it is (a backward frees its saved activations).
        fused: the graph goes to inductor: judge orders with its fusion modelled.

    Returns:
        The :class:`savedhooks.schedule.Schedule`, or None when the graph has no
        fake values to judge by (left as it is).
    """
    return _reorder(gm, is_backward, fused=fused)


def _reorder(gm: torch.fx.GraphModule, is_backward: bool, **options) -> Schedule | None:
    donated = freed_inputs(gm) if is_backward else ()
    try:
        result = reorder_graph(gm, donated, **options)
    except ValueError as error:  # no fake values to judge by: leave the graph as it is
        log.info("savedhooks reorder skipped: %s", error)
        return None
    log.info("savedhooks reorder (%s): %s, modelled peak %d -> %d bytes",
             "backward" if is_backward else "forward", result.method, result.input_peak, result.peak)
    return result


def is_backward_graph(graph: torch.fx.Graph) -> bool:
    """Whether an AOTAutograd graph is a backward graph (it takes ``tangents_*`` inputs).

    Args:
        graph: a forward or backward graph from AOTAutograd.

    Returns:
        True for a backward graph.
    """
    return any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)


# AOTAutograd names the values that inlined pack hooks return "<saved>_hook_<i>":
# forward outputs, and the backward's inputs.
_HOOK_VALUE = re.compile(r"_hook_\d+$")


def has_hook_chains(graph: torch.fx.Graph) -> bool:
    """Whether AOTAutograd inlined saved-tensor hooks into ``graph``.

    A forward graph then returns packed values, a backward graph takes them as
    inputs; AOTAutograd names them ``<saved>_hook_<i>``.

    Args:
        graph: a forward or backward graph from AOTAutograd.

    Returns:
        True when some placeholder (backward) or output value (forward) is a
        packed saved tensor.
    """
    return bool(_hook_values(graph))


def unhook_names(graph: torch.fx.Graph) -> None:
    """Give the values AOTAutograd named ``<saved>_hook_<i>`` their saved tensors' names back.

    Under hooks whose pack returns its input (a census) the graphs are those
    compiled without hooks but for these names; renamed, their nodes carry the
    names that the hook context gave the saved tensors, and :func:`has_hook_chains`
    is False. A name already in the graph is left alone. A GraphModule's code is
    not regenerated (call ``recompile()`` to run the renamed graph's code).

    Args:
        graph: a forward or backward graph from AOTAutograd (renamed in place).
    """
    taken = {n.name for n in graph.nodes}
    for node in _hook_values(graph):
        name = _HOOK_VALUE.sub("", node.name)
        if name in taken:  # a value of the graph has that name (a user's "<x>_hook_<i>"): keep this one's
            continue
        taken.add(name)
        node.name = name  # AOTAutograd removed the node of that name; the namespace still holds it
        if node.op == "placeholder":
            node.target = name  # a placeholder's argument name


def pack_chain_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes of a forward graph that lead only to packed values (its inlined pack hooks).

    Args:
        graph: a forward or backward graph from AOTAutograd.

    Returns:
        Every node other than placeholders and attributes, with at least one
        user, whose users are all such nodes, or the output where the node is
        a value AOTAutograd named ``<saved>_hook_<i>`` (empty for a backward
        graph and for a graph without hooks; a node with an unused user is not
        one, which only keeps it where it is).
    """
    packed = {n for n in _hook_values(graph) if n.op != "placeholder"}
    chains: set[torch.fx.Node] = set()
    for node in reversed(graph.nodes):
        if node.op in ("placeholder", "get_attr", "output") or not node.users:
            continue
        if all(u in chains or (u.op == "output" and node in packed) for u in node.users):
            chains.add(node)
    return chains


def _hook_values(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    values = [n for n in graph.nodes if n.op == "placeholder" and _HOOK_VALUE.search(n.name)]
    if graph.nodes:
        values += [n for n in graph.output_node().all_input_nodes if _HOOK_VALUE.search(n.name)]
    return values
