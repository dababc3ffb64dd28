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
  is split back (:mod:`savedhooks.unfuse`) so that the ``mm`` may run early, and
  fused again where it did not move. Beyond dataflow, in-place writes, RNG and
  side effects keep their order (:func:`ordering_edges`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import operator
import pathlib
import re
from collections.abc import Iterator

import torch
import torch.fx
from torch._dynamo.backends.debugging import aot_eager, boxed_nop
from torch._inductor.custom_graph_pass import CustomGraphPass

import savedhooks.kernels.offload as offload_ops
from savedhooks.hostmem.overlap import overlap_transfers
from savedhooks.schedule import STRATEGIES, Problem, Schedule, build_problem, hoist_frees, peak_of, schedule, sink_free
from savedhooks.unfuse import join_adjacent, split_late_addmm

__all__ = [
    "ReorderPass",
    "backend",
    "graph_problem",
    "has_hook_chains",
    "inductor_placement",
    "is_backward_graph",
    "ordering_edges",
    "place_hooks",
    "reorder_for_memory",
    "reorder_graph",
    "reorder_pass",
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

    Raises:
        Nothing.
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
    if not isinstance(target, torch._ops.OpOverload):
        return set().union(*(node_buffers.get(a, set()) for a in node.all_input_nodes))
    written: set[int] = set()
    schema = target._schema
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
    from savedhooks.memory import build_graph_memory, lower_bound
    from savedhooks.memory.estimate import _report_device

    memory = build_graph_memory(gm, donated, fused)
    device = _report_device(memory)
    nodes = [n for n in gm.graph.nodes if n.op != _OUTPUT]
    fixed = [i for i, n in enumerate(nodes) if n.op in ("placeholder", "get_attr")]
    return build_problem(memory, device, ordering_edges(gm, memory), fixed), lower_bound(memory, device)


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
            result = dataclasses.replace(result, order=sunk, method=result.method + "+sink")
    hoisted = hoist_frees(problem, result.order) if score == "peak" else result.order
    if hoisted != result.order:
        result = dataclasses.replace(result, order=hoisted, method=result.method + "+hoist")
    nodes = [n for n in gm.graph.nodes if n.op != _OUTPUT]
    if result.order != list(range(len(nodes))):
        output = gm.graph.output_node()
        for i in result.order:
            output.prepend(nodes[i])
        gm.graph.lint()
        gm.recompile()
    return result


def place_hooks(gm: torch.fx.GraphModule, is_backward: bool) -> Schedule | None:
    """Hook placement alone: packs right after last use, unpacks right before first use.

    The graph's own order plus :func:`savedhooks.schedule.place`, kept only when
    the memory model finds it lower (never worse than torch's order).

    Args:
        gm: an AOTAutograd forward or backward graph (with ``meta["val"]``).
        is_backward: which one it is (a backward frees its saved activations).

    Returns:
        The :class:`savedhooks.schedule.Schedule`, or None when the graph has no
        fake values to judge by (left as it is).

    Raises:
        Nothing.
    """
    return _reorder(gm, is_backward, strategies=("input",), exact_budget=0)


def reorder_for_memory(gm: torch.fx.GraphModule, is_backward: bool, fused: bool = False) -> Schedule | None:
    """The full pass: every portfolio strategy with placement, then the exact search.

    Args:
        gm: an AOTAutograd forward or backward graph (with ``meta["val"]``).
        is_backward: which one it is (a backward frees its saved activations).
        fused: the graph goes to inductor: judge orders with its fusion modelled.

    Returns:
        The :class:`savedhooks.schedule.Schedule`, or None when the graph has no
        fake values to judge by (left as it is).

    Raises:
        Nothing.
    """
    return _reorder(gm, is_backward, fused=fused)


def _reorder(gm: torch.fx.GraphModule, is_backward: bool, **options) -> Schedule | None:
    from savedhooks.memory import freed_inputs

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

    Raises:
        Nothing.
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

    Raises:
        Nothing.
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

    Returns:
        None.

    Raises:
        Nothing.
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


def _hook_values(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    values = [n for n in graph.nodes if n.op == "placeholder" and _HOOK_VALUE.search(n.name)]
    if graph.nodes:
        values += [n for n in graph.output_node().all_input_nodes if _HOOK_VALUE.search(n.name)]
    return values


class ReorderPass(CustomGraphPass):
    """The reorder pass as inductor's ``post_grad_custom_post_pass`` (a CustomGraphPass).

    By default it reorders backward graphs only: there inductor leaves the
    unpacks at the start and ours measured 3x lower (README, "Inductor"). In
    forward graphs inductor's fusion decides more than the order does, and an
    FX-level order can lose (``benchmarks.reorder_inductor``):

    * with inductor's ``reorder_for_peak_memory`` on, ours measured 1.05x to
      1.15x of its order on all three models; its fused kernels write outputs
      in place into dying inputs, which depends on what each kernel fuses;
    * with it off, ours measured 0.30x and 0.40x of torch's order on the MLPs
      but 1.15x on the transformer: inductor fused the placed pack kernels with
      one another into one kernel at the end of the graph, so the full-size
      activations lived to the end again (the model predicted 0.47x).

    With ``hooked_only`` it leaves graphs without inlined hooks untouched (the
    pass that entering :func:`savedhooks.saved_tensors_hooks` installs).

    In every graph it runs (forward graphs too, when they offload), copies
    between an accelerator and the host made by ``sh.offload`` become torch's
    asynchronous copy ops, placed to overlap compute
    (:func:`savedhooks.hostmem.overlap_transfers`). A forward graph that
    offloads and is not reordered gets its hooks placed first
    (:func:`place_hooks`): torch inlines every pack at the end of the forward
    and inductor runs each copy where the graph has it (README, "On a GPU").

    ``uuid()`` digests this file, the scheduler and the memory model, plus the
    options, so inductor's FX graph cache misses when the pass changes and hits
    when it does not.
    """

    def __init__(self, forward: bool = False, hooked_only: bool = False) -> None:
        self.forward = forward
        self.hooked_only = hooked_only

    def __call__(self, graph: torch.fx.Graph) -> None:
        is_backward = is_backward_graph(graph)
        if self.hooked_only and not has_hook_chains(graph):
            return
        reorder = is_backward or self.forward
        offloads = any(n.target is torch.ops.savedhooks.offload.default for n in graph.nodes)
        if not (reorder or offloads):
            return
        gm = graph.owning_module
        if gm is None:  # inductor hands over the graph of a GraphModule; keep it that way
            gm = torch.fx.GraphModule(torch.nn.Module(), graph)
        if reorder:
            split = split_late_addmm(gm.graph)
            reorder_for_memory(gm, is_backward, fused=True)
            if join_adjacent(gm.graph, split):
                gm.recompile()
        elif offloads:  # copies to the host are extern kernels, left at the end where torch inlined them
            place_hooks(gm, is_backward)
        overlap_transfers(gm, is_backward)  # offload copies (accelerator <-> host) only

    def uuid(self) -> str:
        from torch._functorch import config as functorch_config

        bandwidth = functorch_config.activation_offload_cpu_gpu_bw  # times the overlap of offload copies
        options = f"forward={self.forward}:hooked_only={self.hooked_only}:copy_gbps={bandwidth}"
        return hashlib.sha256(f"{_SOURCE_DIGEST}:{options}".encode()).hexdigest()

    def __repr__(self) -> str:
        return f"ReorderPass(forward={self.forward}, hooked_only={self.hooked_only})"


def reorder_pass(forward: bool = False) -> ReorderPass:
    """The pass to give inductor: ``torch.compile(model, options={"post_grad_custom_post_pass": sh.reorder_pass()})``.

    Args:
        forward: reorder forward graphs too (default: backward graphs only, where
            it measured lower than inductor's own scheduling; see :class:`ReorderPass`).

    Returns:
        A :class:`ReorderPass` (one shared instance per option: equal passes, equal cache keys).

    Raises:
        Nothing.
    """
    return _REORDER_PASSES[bool(forward), False]


def _with_pass(slot, ours: ReorderPass):
    """``slot`` (inductor's post-grad pass setting: None, a pass, or a list/tuple) with ``ours`` run last."""
    passes = tuple(slot) if isinstance(slot, (list, tuple)) else (() if slot is None else (slot,))
    if any(isinstance(p, ReorderPass) for p in passes):  # already placed (sh.reorder_pass(), a nested block)
        return slot
    return ours if not passes else (*passes, ours)


@contextlib.contextmanager
def inductor_placement(enabled: bool = True) -> Iterator[None]:
    """Make inductor place inlined hooks in the graphs compiled inside the block.

    Adds the reorder pass (hooked graphs only) to inductor's
    ``post_grad_custom_post_pass``, after any pass already set there (torch runs
    a tuple of passes in order and keys its FX graph cache on all their uuids),
    and has AOTAutograd compile the backward graph together with the forward
    (``force_non_lazy_backward_lowering``): torch otherwise compiles it at the
    first ``backward()``, after the block has exited. It also turns off
    inductor's buffer-reuse pool (``allow_buffer_reuse``): that pool keeps a freed
    buffer allocated until a later buffer of the same size takes it over, so a
    dequantized activation, freed right after its matmul, stayed allocated
    through the next layer's backward (ViT at batch 32: 24.6 MiB across the
    attention backward, 0.92x the step peak with it off). Freeing at the last use
    never holds more bytes; in-place reuse (``inplace_buffers``) is kept. Entered
    by :class:`savedhooks.saved_tensors_hooks`; all settings are restored on exit.

    Args:
        enabled: False leaves inductor's settings as they are (the opt-out).

    Returns:
        A context manager (yielding nothing).

    Raises:
        Nothing.
    """
    if not enabled:
        yield
        return
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    slot = _with_pass(inductor_config.post_grad_custom_post_pass, _REORDER_PASSES[False, True])
    with inductor_config.patch(post_grad_custom_post_pass=slot, allow_buffer_reuse=False), \
            functorch_config.patch(force_non_lazy_backward_lowering=True):  # fmt: skip
        yield


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
        reorder_for_memory(gm, is_backward)
        overlap_transfers(gm, is_backward)
        # run as aot_eager does: an Interpreter that drops inputs and values after their last use
        return boxed_nop(gm, example_inputs)

    return compiler


def _inductor_backend(gm: torch.fx.GraphModule, example_inputs):
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches={"post_grad_custom_post_pass": _REORDER_PASSES[False, False]})


# The pass's behaviour lives in this file, the scheduler, the memory model and the offload overlap: all in the digest.
_HERE = pathlib.Path(__file__).parent
_SOURCE_DIGEST = hashlib.sha256(
    b"".join(p.read_bytes() for p in [_HERE / "passes.py", _HERE / "unfuse.py", *sorted((_HERE / "schedule").glob("*.py")),
                                      *sorted((_HERE / "memory").glob("*.py")), _HERE / "hostmem" / "overlap.py",
                                      pathlib.Path(offload_ops.__file__)])
).hexdigest()
# One shared instance per option: equal passes, equal cache keys.
_REORDER_PASSES = {(f, h): ReorderPass(forward=f, hooked_only=h) for f in (False, True) for h in (False, True)}
# torch's own aot_eager (its min-cut partitioner, its input-mutation handling) with
# placement added: the same graphs as "aot_eager", only reordered.
_AOT_EAGER_BACKEND = functools.partial(aot_eager, fw_compiler=_placing(False), bw_compiler=_placing(True))
