"""Compile a model and keep its graphs as inductor runs them: the survey's recording backend.

Design notes
------------
* :class:`GraphRecorder` sits in inductor's post-grad pass slot and keeps each
  forward and backward graph; under inductor the reorder pass runs first (the
  plan's hooks will get it), so the graphs are ordered as the plan runs them.
* Inside :meth:`GraphRecorder.kernel_order` it also keeps the order in which
  inductor's scheduler runs the kernels (it wraps inductor's
  ``reorder_for_peak_memory``, the scheduler's last reordering; torch has no
  hook after it); :func:`run_in_kernel_order` reorders a recorded graph so.
* Each backend is a new object, so that dynamo compiles afresh instead of
  reusing an earlier compile of the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import heapq
from collections.abc import Callable, Iterator
from typing import Any

import torch

from savedhooks._torch import inductor, pytree
from savedhooks._torch.aot import compiling_graph
from savedhooks._torch.dynamo import boxed_nop
from savedhooks._torch.inductor import CustomGraphPass, V
from savedhooks._torch.inductor import ir as inductor_ir
from savedhooks.compiler.api import placed_aot_eager, reorder_pass
from savedhooks.compiler.passes import is_backward_graph, reorder_for_memory, unhook_names
from savedhooks.memory.fusion import is_alias
from savedhooks.memory.scratch import EXTERN_STRIDES

__all__ = [
    "AOT_ID",
    "COPIED_INPUTS",
    "DONATED",
    "FUSED_KERNELS",
    "REALIZED",
    "GraphRecorder",
    "KernelCall",
    "fresh_backend",
    "kernel_calls",
    "recording_backend",
    "run_in_kernel_order",
]


class GraphRecorder(CustomGraphPass):
    """A post-grad pass that keeps inductor's forward and backward graphs (never cached: it must see every compile).

    ``before``, if given, is a post-grad pass run on each graph first (the reorder pass).
    With ``unhook``, graphs compiled under hooks whose pack returns its input (the
    planner's census) get their saved values' names back first
    (:func:`savedhooks.compiler.passes.unhook_names`): they are then the graphs compiled
    without hooks, and ``before`` treats them as such.

    Inside :meth:`kernel_order` it also keeps the order inductor's scheduler
    runs each graph's kernels in (see :func:`run_in_kernel_order`).
    """

    def __init__(self, before: Callable[[torch.fx.Graph], None] | None = None, unhook: bool = False) -> None:
        self.forwards: list[torch.fx.GraphModule] = []
        self.backwards: list[torch.fx.GraphModule] = []
        self.inferences: list[torch.fx.GraphModule] = []
        self._last: torch.fx.GraphModule | None = None
        self._before = before
        self.unhook = unhook

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.unhook:
            unhook_names(graph)
        if self._before is not None:
            self._before(graph)
        # the graph's own module holds its constants (get_attr nodes: a tensor the forward built from literals)
        root = graph.owning_module if graph.owning_module is not None else torch.nn.Module()
        self._last = self.keep(torch.fx.GraphModule(root, graph))

    def keep(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        """File a compiled graph under its kind: forward, backward, or inference (a graph with no backward).

        Each graph's ``meta[AOT_ID]`` is AOTAutograd's id, which a forward shares
        with its backward (None where the release does not publish it); a graph
        AOTAutograd compiles for inference (no input needs a gradient) saves
        nothing for a backward and is kept in :attr:`inferences`.

        Args:
            gm: the graph.

        Returns:
            ``gm``.
        """
        where = compiling_graph()
        gm.meta[AOT_ID] = where[0] if where else None
        if where and where[1] == "inference":
            self.inferences.append(gm)
        else:
            (self.backwards if is_backward_graph(gm.graph) else self.forwards).append(gm)
        return gm

    def uuid(self) -> None:
        return None

    @contextlib.contextmanager
    def kernel_order(self) -> Iterator[None]:
        """Keep, per recorded graph, the FX nodes of each kernel in the order inductor's scheduler chose.

        Wraps ``torch._inductor.memory.reorder_for_peak_memory`` (inductor's
        last reordering of its kernels, which the scheduler imports when it runs)
        for the duration: there is no hook after it. The order lands in the
        graph's ``meta["savedhooks_kernel_order"]``, the FX nodes whose values
        inductor stored (its buffers' origin nodes) in ``meta["savedhooks_realized"]``,
        the kernels its generated code runs as one call in
        ``meta["savedhooks_kernel_calls"]`` (:func:`kernel_calls`), the strides
        of the tensors it passes each aten fallback kernel in that FX node's
        ``meta`` (:data:`~savedhooks.memory.scratch.EXTERN_STRIDES`), the FX
        nodes lowered into each of its (fused) kernels in :data:`FUSED_KERNELS`, the
        inputs whose buffers it may write in place in ``meta["savedhooks_donated"]``
        (:data:`DONATED`); a compile nested in the graph's run (a codec's eager path) is not recorded.

        Returns:
            A context manager.
        """
        inductor_memory = inductor.memory

        original = inductor_memory.reorder_for_peak_memory

        def reorder(nodes: Any, *args: Any, **kwargs: Any) -> Any:
            ordered = original(nodes, *args, **kwargs)
            subs = [sub for snode in ordered for sub in snode.get_nodes()]
            if self._last is not None and _compiles(subs, self._last.graph):
                self._last.meta[_KERNEL_ORDER] = [
                    [o.name for o in (sub.node.get_origins() if getattr(sub, "node", None) is not None else ())]
                    for sub in subs
                ]
                self._last.meta[_CALLS] = _calls(ordered)
                self._last.meta[FUSED_KERNELS] = [
                    sorted(
                        {
                            o.name
                            for sub in snode.get_nodes()
                            if getattr(sub, "node", None) is not None
                            for o in sub.node.get_origins()
                        }
                    )
                    for snode in ordered
                ]
                self._last.meta[REALIZED] = sorted(
                    origin.name
                    for snode in ordered
                    for buffer in _stored(snode)
                    if (origin := getattr(buffer.node, "origin_node", None)) is not None
                )
                _record_extern_strides(ordered, self._last.graph)
                self._last.meta[COPIED_INPUTS] = _copied_inputs(self._last.graph)
                self._last.meta[DONATED] = _donated_inputs()
            return ordered

        inductor_memory.reorder_for_peak_memory = reorder
        try:
            yield
        finally:
            inductor_memory.reorder_for_peak_memory = original


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One call of inductor's generated code (see :func:`kernel_calls`).

    Attributes:
        made: the FX nodes whose values its kernels made (their buffers' origin nodes).
        extern: an extern kernel (or a template): it runs its own op, not code inductor generated.
    """

    made: tuple[str, ...]
    extern: bool


def _calls(ordered: list[Any]) -> list[KernelCall]:
    """The calls of inductor's generated code that run the scheduler nodes ``ordered``.

    Inductor's C++ backend gathers consecutive kernels of the CPU into one
    function until an extern kernel, a template or another device comes: their
    buffers are allocated before it, and the inputs that die in it are deleted
    after it (``Scheduler.flush``). It also ends a function at 500 arguments,
    which this leaves out. Any other node is a call of its own (a Triton kernel
    is called, and what dies in it freed, right after its code is made).
    """
    calls: list[KernelCall] = []
    run: list[str] = []
    for snode in ordered:
        made = [
            origin.name
            for sub in snode.get_nodes()
            if (origin := getattr(getattr(sub, "node", None), "origin_node", None)) is not None
        ]
        device = snode.get_device()
        extern = snode.is_extern() or snode.is_template()
        if not extern and (device is None or device.type == "cpu"):
            run += made
            continue
        if not made and extern and getattr(snode, "node", None) is not None:
            # no origin node (an in-place scatter, a fallback with several outputs): the op it runs
            made = [o.name for o in snode.node.get_origins() if _runs_an_op(o)]
        if run:
            calls.append(KernelCall(tuple(run), extern=False))
            run = []
        calls.append(KernelCall(tuple(made), extern))
    if run:
        calls.append(KernelCall(tuple(run), extern=False))
    return calls


def _record_extern_strides(ordered: list[Any], graph: torch.fx.Graph) -> None:
    """Set :data:`~savedhooks.memory.scratch.EXTERN_STRIDES` on the FX nodes of ``graph`` that inductor runs as
    aten fallback kernels: the strides of the tensors it passes them, in argument order (none where one is
    symbolic: the graph's strides stand)."""
    nodes = {n.name: n for n in graph.nodes}
    for snode in ordered:
        kernel = getattr(snode, "node", None)
        op = getattr(kernel, "op_overload", None)
        if not snode.is_extern() or op is None:
            continue
        try:
            strides = [tuple(int(s) for s in x.get_stride()) for x in kernel.inputs]
        except (AttributeError, NotImplementedError, TypeError):  # an input without a layout; a symbolic stride
            continue
        for origin in kernel.get_origins():
            if origin.target is op and origin.name in nodes:
                nodes[origin.name].meta[EXTERN_STRIDES] = strides


def _runs_an_op(node: torch.fx.Node) -> bool:
    """Whether an FX node among an extern kernel's origins is the op it runs, not one lowered into its inputs."""
    return (
        node.op == "call_function"
        and not is_alias(node)
        and torch.Tag.pointwise not in getattr(node.target, "tags", ())
    )


def _stored(snode: Any) -> list[Any]:
    """The buffers of a scheduler node (a kernel, fused or not) that inductor allocates.

    A buffer that every reader of reads inside the same fused kernel is removed
    when inductor generates that kernel (``Kernel.remove_kernel_local_buffers``,
    by ``Scheduler.can_buffer_be_removed_through_fusion``): it never takes
    memory. Mutated buffers are kept, as inductor keeps them.
    """
    fused = {sub.get_name() for sub in snode.get_nodes()}
    return [
        buffer
        for sub in snode.get_nodes()
        for buffer in sub.get_outputs()
        if buffer.get_mutations() or not all(user.is_weak or user.get_name() in fused for user in buffer.users)
    ]


def _compiles(subs: list[Any], graph: torch.fx.Graph) -> bool:
    """Whether the scheduler nodes ``subs`` were made from ``graph``: not from a compile nested in its run.

    A codec's eager path may compile its own function while the recorded graph
    runs (the fp8 op of an eager loss), after that graph's compile: its kernels
    are no kernels of the graph.
    """
    origins = [o for sub in subs if getattr(sub, "node", None) is not None for o in sub.node.get_origins()]
    return any(o.graph is graph for o in origins)


def _copied_inputs(graph: torch.fx.Graph) -> tuple[str, ...]:
    """The graph's inputs that it returns as a copy inductor made: a convolution's input in channels_last.

    Inductor lowers a convolution's input or weight to the layout the kernel
    wants (channels_last on the CPU) and returns that copy where the FX graph
    returns the input itself (saved for the backward's convolution): the copy
    is a new buffer, held from the forward to its last use in the backward.
    Read from the graph being compiled (``V.graph``) at scheduling time.
    """
    lowering = V.graph
    outputs = pytree.tree_leaves(graph.find_nodes(op="output")[0].args)
    if len(outputs) != len(lowering.graph_outputs):
        return ()
    copied = set()
    for node, out in zip(outputs, lowering.graph_outputs):
        if isinstance(node, torch.fx.Node) and node.op == "placeholder" and node.name in lowering.graph_inputs:
            try:
                name = out.get_name()
            except (AttributeError, NotImplementedError):
                continue
            if name not in lowering.graph_inputs:
                copied.add(node.name)
    return tuple(sorted(copied))


def _donated_inputs() -> tuple[str, ...]:
    """The graph's inputs whose buffers inductor may reuse in place: AOTAutograd's donated buffers.

    Only a backward's saved activations that no forward output or input holds
    are donated (``collect_bw_donated_buffer_idxs``); inductor's scheduler
    writes a dying input in place only if it is one (``get_donated_buffers``).
    Incoming gradients (``tangents_*``) and saved values that are also the
    model's outputs (logits a loss inside the graph read) never are: a kernel
    reading them for the last time still allocates its output.
    Read from the graph being compiled (``V.graph``) at scheduling time.
    """
    donated = getattr(inductor_ir, "DonatedBuffer", None)
    inputs = getattr(V.graph, "graph_inputs_original", None) or {}
    return tuple(sorted(name for name, value in inputs.items() if donated is not None and isinstance(value, donated)))


_KERNEL_ORDER = "savedhooks_kernel_order"
_CALLS = "savedhooks_kernel_calls"
REALIZED = "savedhooks_realized"  # graph meta: the FX nodes whose values inductor stored
FUSED_KERNELS = "savedhooks_fused_kernels"  # graph meta: per kernel inductor generated, the FX nodes lowered into it
COPIED_INPUTS = "savedhooks_copied_inputs"  # graph meta: inputs returned as inductor's copies (_copied_inputs)
DONATED = "savedhooks_donated"  # graph meta: the inputs inductor may write in place (_donated_inputs)
AOT_ID = "savedhooks_aot_id"  # graph module meta: AOTAutograd's id, one per forward and its backward (GraphRecorder.keep)


def kernel_calls(gm: torch.fx.GraphModule) -> list[KernelCall]:
    """The calls of inductor's generated code for ``gm``, in order (:meth:`GraphRecorder.kernel_order`).

    On the CPU, consecutive kernels between extern kernels are one C++
    function: every buffer they store is allocated before it runs, and the
    inputs that die in it are deleted after it.

    Args:
        gm: a graph recorded by a :class:`GraphRecorder`.

    Returns:
        One :class:`KernelCall` per call; empty if none were kept.
    """
    return list(gm.meta.get(_CALLS, ()))


def run_in_kernel_order(gm: torch.fx.GraphModule) -> bool:
    """Reorder ``gm``'s nodes as inductor ran its kernels (:meth:`GraphRecorder.kernel_order`), where it knows.

    A node runs with the first kernel made from it; a node no kernel came from
    (views, placeholders) runs right before its first user that has a position.
    Placeholders stay first. Where that order is not topological (an op split into
    several kernels, a fill then a scatter, is placed with its first), a node
    waits for its inputs. If no kernel order was kept, the graph is left as it is.

    Args:
        gm: a graph recorded by a :class:`GraphRecorder`.

    Returns:
        Whether the graph was reordered.
    """
    kernels = gm.meta.get(_KERNEL_ORDER)
    if not kernels:
        return False
    first: dict[str, int] = {}
    for i, names in enumerate(kernels):
        for name in names:
            first.setdefault(name, i)
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    index = {n: i for i, n in enumerate(nodes)}
    key: dict[torch.fx.Node, tuple[int, int]] = {}
    for node in reversed(nodes):  # users first
        if node.op == "placeholder":
            key[node] = (-1, index[node])
        elif node.name in first:
            key[node] = (first[node.name], index[node])
        else:
            later = [key[u][0] for u in node.users if u in key]
            key[node] = (min(later, default=len(kernels)), index[node])
    # kernel order where it is topological; a node whose inputs come later (an op split into several kernels,
    # e.g. a fill then a scatter) waits for them
    waiting = {n: sum(1 for a in n.all_input_nodes if a in index) for n in nodes}
    ready = [(key[n], n.name) for n in nodes if not waiting[n]]
    by_name = {n.name: n for n in nodes}
    heapq.heapify(ready)
    order = []
    while ready:
        node = by_name[heapq.heappop(ready)[1]]
        order.append(node)
        for user in node.users:
            if user in waiting:
                waiting[user] -= 1
                if not waiting[user]:
                    heapq.heappush(ready, (key[user], user.name))
    if len(order) != len(nodes):
        return False
    output = gm.graph.output_node()
    for node in order:
        output.prepend(node)
    return True


def fresh_backend(backend: str, **keywords: Any) -> Callable[..., Any]:
    """``backend`` as a new object, so that dynamo compiles afresh instead of reusing an earlier compile.

    Args:
        backend: ``"aot_eager"`` or ``"inductor"``.
        **keywords: passed on to torch's ``aot_eager`` or inductor's ``compile_fx``.

    Returns:
        A ``torch.compile`` backend that compiles as ``backend`` does; aot_eager
        inside :func:`savedhooks.hooks.contract.placed_compile`, as the plan runs it
        (``sh.backend("aot_eager")``), so that the codecs pack what they pack there.

    Raises:
        ValueError: another backend.
    """
    if backend == "aot_eager":
        return functools.partial(placed_aot_eager, **keywords)
    if backend == "inductor":
        return functools.partial(inductor.compile_fx, **keywords)
    raise ValueError(f"plan: backend must be 'inductor' or 'aot_eager', got {backend!r}")


def _keeping(recorder: GraphRecorder, unhook: bool, is_backward: bool) -> Callable[..., Any]:
    """An aot_eager graph compiler that keeps each graph, ordered as ``sh.backend("aot_eager")`` orders it.

    The plan runs under that placement, as under inductor (where the recorder runs
    the reorder pass first); the graph that runs is the one torch generated.
    """

    def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        run = boxed_nop(gm, example_inputs)  # the code torch generated, before the graph changes below
        if unhook:
            unhook_names(gm.graph)
        reorder_for_memory(gm, is_backward)
        recorder.keep(gm)
        return run

    return compiler


def recording_backend(backend: str, unhook: bool = False) -> tuple[Callable[..., Any], GraphRecorder, bool]:
    """A ``torch.compile`` backend that compiles as ``backend`` does and keeps its AOTAutograd graphs.

    A new backend object each call, so that dynamo compiles afresh instead of
    reusing what an earlier compile of the model cached.

    Args:
        backend: ``"aot_eager"``, or ``"inductor"`` (graphs after its post-grad passes).
        unhook: the compile runs under hooks whose pack returns its input: record
            the graphs as compiled without hooks (see :class:`GraphRecorder`).

    Returns:
        ``(backend, recorder, fused)``: ``recorder`` fills as graphs compile;
        ``fused`` says whether to model them as inductor runs them.

    Raises:
        ValueError: another backend.
    """
    if backend == "aot_eager":
        recorder = GraphRecorder()  # not a pass here: the compilers below keep (and rename) the graphs
        compilers = {
            "fw_compiler": _keeping(recorder, unhook, False),
            "bw_compiler": _keeping(recorder, unhook, True),
        }
        return fresh_backend(backend, **compilers), recorder, False
    # inductor: the backward as the plan's hooks will have it, ordered by the reorder pass (in torch's order
    # gpt2's tied loss head ran its weight-gradient matmul last and held the logits' gradient to the end)
    recorder = GraphRecorder(before=reorder_pass(), unhook=unhook)
    return fresh_backend(backend, config_patches={"post_grad_custom_post_pass": recorder}), recorder, True
