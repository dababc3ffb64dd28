"""Place inlined saved-tensor hooks where they free memory soonest.

torch 2.13 inlines pack into the forward graph's epilogue and unpack into the
backward graph's prologue, so every full-size saved tensor stays alive to the end
of the forward, and every unpacked one from the start of the backward.

Placement (this file):
* forward: a node used only by graph outputs (a pack chain: the ops turning a
  saved tensor into its payload) moves to right after the last *other* use of its
  inputs, so the full-size tensor dies there;
* backward: a node computed only from graph inputs (an unpack chain: payload to
  full-size tensor) moves to right before its first user.
Both are found by dataflow, so user hooks (``@savedhooks.hook``) are placed as
well as codecs. Neither changes what is computed: only the order.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import pathlib

import torch
import torch.fx
from torch._dynamo.backends.debugging import aot_eager, boxed_nop
from torch._inductor.custom_graph_pass import CustomGraphPass

__all__ = [
    "ReorderPass",
    "backend",
    "is_backward_graph",
    "place_hooks",
    "place_packs",
    "place_unpacks",
    "reorder_pass",
]

_OUTPUT = "output"
log = logging.getLogger(__name__)


def _output_only(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Nodes whose every use leads only to the graph's outputs, in graph order."""
    only: set[torch.fx.Node] = set()
    for node in reversed(graph.nodes):
        if node.op in ("placeholder", _OUTPUT) or not node.users:
            continue
        if all(user.op == _OUTPUT or user in only for user in node.users):
            only.add(node)
    return [n for n in graph.nodes if n in only]


def _input_only(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Non-placeholder nodes computed only from graph inputs (and constants), in graph order."""
    only: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op in ("placeholder", _OUTPUT, "get_attr"):
            continue
        inputs = node.all_input_nodes
        if inputs and all(a.op == "placeholder" or a in only for a in inputs) and not node.is_impure():
            only.add(node)
    return [n for n in graph.nodes if n in only]


def place_packs(gm: torch.fx.GraphModule) -> int:
    """Move output-only chains to right after the last other use of their inputs.

    Args:
        gm: a forward graph.

    Returns:
        How many nodes moved.

    Raises:
        Nothing.
    """
    graph = gm.graph
    chain = _output_only(graph)
    members = set(chain)
    moved = 0
    for node in chain:  # graph order: a chain's first op moves before the ops that read it
        position = {n: i for i, n in enumerate(graph.nodes)}
        anchor = None
        for arg in node.all_input_nodes:
            candidates = [arg] + [u for u in arg.users if u not in members and u.op != _OUTPUT]
            last = max(candidates, key=position.__getitem__)
            if anchor is None or position[last] > position[anchor]:
                anchor = last
        if anchor is not None and anchor.next is not node and position[anchor] < position[node]:
            anchor.append(node)
            moved += 1
    graph.lint()
    gm.recompile()
    return moved


def place_unpacks(gm: torch.fx.GraphModule) -> int:
    """Move input-only chains to right before their first user.

    Args:
        gm: a backward graph.

    Returns:
        How many nodes moved.

    Raises:
        Nothing.
    """
    graph = gm.graph
    moved = 0
    for node in reversed(_input_only(graph)):  # last first: a chain is pulled down link by link
        position = {n: i for i, n in enumerate(graph.nodes)}
        first_user = min(node.users, key=position.__getitem__, default=None)
        if first_user is not None and first_user.prev is not node and position[first_user] > position[node]:
            first_user.prepend(node)
            moved += 1
    graph.lint()
    gm.recompile()
    return moved


def place_hooks(gm: torch.fx.GraphModule, is_backward: bool) -> int:
    """Apply :func:`place_packs` (forward) or :func:`place_unpacks` (backward), if it helps.

    The memory model judges: when the new order's modelled peak is not lower than
    the input order's, the input order is restored (never worse than torch's).

    Args:
        gm: an AOTAutograd forward or backward graph (with ``meta["val"]``).
        is_backward: which one it is.

    Returns:
        How many nodes moved (0 when the input order was kept).

    Raises:
        Nothing.
    """
    from savedhooks.memory import estimate_peak, saved_activations

    # judged as torch runs it: a backward drops its saved activations after their last use
    donated = saved_activations(gm) if is_backward else ()
    original = list(gm.graph.nodes)
    try:
        before = estimate_peak(gm, donated=donated).peak_bytes
    except ValueError:  # no fake values to judge by: leave the graph as it is
        return 0
    moved = place_unpacks(gm) if is_backward else place_packs(gm)
    after = estimate_peak(gm, donated=donated).peak_bytes
    log.info("savedhooks placement (%s): moved %d nodes, modelled peak %d -> %d bytes",
             "backward" if is_backward else "forward", moved, before, after)
    if moved and after >= before:
        _restore(gm, original)
        return 0
    return moved


def _restore(gm: torch.fx.GraphModule, order: list[torch.fx.Node]) -> None:
    output = gm.graph.output_node()
    for node in order:
        if node is not output:
            output.prepend(node)
    gm.graph.lint()
    gm.recompile()


def is_backward_graph(graph: torch.fx.Graph) -> bool:
    """Whether an AOTAutograd graph is a backward graph (it takes ``tangents_*`` inputs).

    Args:
        graph: a forward or backward graph from AOTAutograd.

    Returns:
        True for a backward graph.

    Raises:
        Nothing.
    """
    return any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)


class ReorderPass(CustomGraphPass):
    """Hook placement as inductor's ``post_grad_custom_post_pass`` (a CustomGraphPass).

    ``uuid()`` is a digest of this file, so inductor's FX graph cache misses when
    the pass changes and hits when it does not.
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        gm = graph.owning_module
        if gm is None:  # inductor hands over the graph of a GraphModule; keep it that way
            gm = torch.fx.GraphModule(torch.nn.Module(), graph)
        place_hooks(gm, is_backward_graph(graph))

    def uuid(self) -> str:
        return _SOURCE_DIGEST


def reorder_pass() -> ReorderPass:
    """The pass to give inductor: ``torch.compile(model, options={"post_grad_custom_post_pass": sh.reorder_pass()})``.

    Args:
        None.

    Returns:
        A :class:`ReorderPass` (one shared instance: equal passes, equal cache keys).

    Raises:
        Nothing.
    """
    return _REORDER_PASS


def backend(base: str = "aot_eager"):
    """A ``torch.compile`` backend that applies hook placement without touching configs.

    Args:
        base: ``"aot_eager"`` (graphs run by aten, no inductor) or ``"inductor"``.

    Returns:
        A callable to pass as ``torch.compile(model, backend=...)``.

    Raises:
        ValueError: ``base`` is neither.
    """
    if base == "aot_eager":
        return _AOT_EAGER_BACKEND
    if base == "inductor":
        return _inductor_backend
    raise ValueError(f"savedhooks.backend: base must be 'aot_eager' or 'inductor', got {base!r}")


def _placing(is_backward: bool):
    def compiler(gm: torch.fx.GraphModule, example_inputs):
        place_hooks(gm, is_backward)
        # run as aot_eager does: an Interpreter that drops inputs and values after their last use
        return boxed_nop(gm, example_inputs)

    return compiler


def _inductor_backend(gm: torch.fx.GraphModule, example_inputs):
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches={"post_grad_custom_post_pass": _REORDER_PASS})


_SOURCE_DIGEST = hashlib.sha256(pathlib.Path(__file__).read_bytes()).hexdigest()
_REORDER_PASS = ReorderPass()
# torch's own aot_eager (its min-cut partitioner, its input-mutation handling) with
# placement added: the same graphs as "aot_eager", only reordered.
_AOT_EAGER_BACKEND = functools.partial(aot_eager, fw_compiler=_placing(False), bw_compiler=_placing(True))
