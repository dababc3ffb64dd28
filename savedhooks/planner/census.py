"""What the planner plans over: the saved tensors, their keys, and the step's memory timeline.

Design notes
------------
* A plan names saved tensors by a *plan key* that the hooks can compute again in
  any later process, with no run state: under ``torch.compile`` the saved value's
  node name, producing op, shape and dtype (``"addmm_1|addmm|512x256|float32"``);
  in eager mode (a loss run after the compiled model) ``"eager"``, the autograd
  node and the shape and dtype. Saved tensors that share a plan key (graph breaks
  repeat node names; eager tensors of one shape) get one choice together.
* The timeline is one training step as the memory model sees it
  (:mod:`savedhooks.memory`): the forward graphs in trace order, one point for
  the tensors an eager loss saves, then the backward graphs in reverse order.
  Each point holds the bytes alive above the step's inputs with nothing packed.
  A saved tensor packed with placement (the reorder pass: pack right after its
  producer, unpack right before its first use in the backward) holds only its
  payload from the point after its producer up to its first use: its *span*.
  Packing it lowers every point of its span by ``bytes - payload``.
* The model's output: the forward leaves it alive, and the loss point holds
  the loss's measured peak above it. A training loop either drops it once the
  loss has read it (``loss_fn(model(x)).backward()``, the default) or keeps it
  to the end of the step (``out = model(x)``). In the backward graphs the
  output's gradient is an input that their timelines do not count; the
  forward's retained output stands in for it (same bytes), which is right
  where the loop drops the output, and one output short where it keeps it.
  An output that the forward also saves (``GraphTimeline.saved_output``: a
  ``log_softmax`` head's result) is kept by the graphs in either loop.
* Under inductor a codec's decomposed decode (fp8 and bf16 of float32 tensors)
  is fused into each kernel that reads the unpacked tensor. A saved tensor whose
  backward readers are all pointwise or reduction kernels then holds only its
  payload from its first use to its last: packing it with such a codec also
  lowers those points (the *reread* intervals). One read by an extern kernel (a
  matrix product, a convolution) is materialized whole, possibly in an earlier
  kernel, and gets none.
* Under inductor the graphs are modelled as inductor runs them: in the order
  its scheduler chose for its kernels (kept by wrapping inductor's
  ``reorder_for_peak_memory`` while the survey compiles; the FX order is not
  the order the kernels run in, and can over-predict a backward), with its
  fusion and its in-place reuse, and call by call: on the CPU inductor's generated code runs consecutive kernels
  between extern kernels as one C++ function, allocating all their buffers
  before it and deleting what dies in it after it (modelled node by node,
  such a run's buffers would be counted as allocated later and freed earlier:
  the model would err low). The survey's calls are
  those of the graphs compiled without a plan's hooks; with them, a codec's
  opaque op (an extern kernel) may cut a run in two, freeing earlier than
  modelled: the model errs high there, and a plan's check, which records the
  graphs compiled with its hooks, has their calls.
* Saved tensors that are views of one storage (attention's q, k and v split
  from one projection) free it only when all of them are packed: they get one
  choice together, their spans starting after the last of them is made. A saved
  tensor whose storage a graph input or another graph output holds frees nothing
  when packed: it gets no span, so the planner never packs it for memory.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import weakref
from collections.abc import Collection, Mapping
from typing import Any

import torch

from savedhooks._torch import pytree
from savedhooks.fidelity.select import SavedTensor, concrete_size
from savedhooks.hooks import hook_context
from savedhooks.memory import build_graph_memory, freed_inputs, saved_activations, simulate
from savedhooks.memory.estimate import _input_bytes, _report_device
from savedhooks.memory.fusion import inlined_nodes, is_alias, is_view
from savedhooks.memory.graph import op_name, producing_op
from savedhooks.memory.sizes import size_hint, storage_key, tensor_nbytes
from savedhooks.planner.recording import (
    COPIED_INPUTS,
    DONATED,
    FUSED_KERNELS,
    REALIZED,
    KernelCall,
    kernel_calls,
    run_in_kernel_order,
)

__all__ = [
    "GraphTimeline",
    "Scope",
    "StepTimeline",
    "key_of_saved",
    "plan_key",
    "ranked_name",
    "step_timeline",
    "timeline_of",
]


def _shape(shape: Any) -> str:
    return "x".join(str(s) for s in shape) or "scalar"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_key(x: torch.Tensor) -> str:
    """The plan key of the saved tensor being packed (see the module notes).

    Args:
        x: the tensor a pack hook received.

    Returns:
        ``"node|op|shape|dtype"`` under compile, ``"eager|op|shape|dtype"`` in eager mode.
    """
    ctx = hook_context()
    shape = _shape(concrete_size(s) for s in x.shape)
    if ctx is None:
        op = type(x.grad_fn).__name__.removesuffix("Backward0") if x.grad_fn is not None else None
        return f"eager|{op}|{shape}|{_dtype(x.dtype)}"
    return f"{ctx.node.name}|{producing_op(ctx.node)}|{shape}|{_dtype(x.dtype)}"


_NUMBER = re.compile(r"_\d+$")
# graph -> {node name: ranked name}; names, not nodes, so that the entry does not keep its graph alive
_RANKED: weakref.WeakKeyDictionary[torch.fx.Graph, dict[str, str]] = weakref.WeakKeyDictionary()


def ranked_name(node: torch.fx.Node) -> str:
    """``node``'s name counted among the tensor-valued nodes of its graph alone.

    FX numbers the nodes of one base name in the order it makes them
    (``add``, ``add_1``, ...). Compiled with dynamic shapes, a graph also holds
    size arithmetic (``add_7 = sym_size + 1``), which shifts the numbers of the
    tensor ops after it. This name numbers only the nodes whose value is a
    tensor: in a graph without size arithmetic it is the node's own name, and
    the graph compiled again at dynamic shapes gives a tensor op the same one
    where it holds the same tensor ops before it (an op that decomposes
    otherwise at symbolic sizes still shifts those after it).

    Args:
        node: a node of a traced graph (``meta["val"]`` set by tracing).

    Returns:
        The base name with the node's rank among the tensor-valued nodes of
        that base name; the node's own name where its value is no tensor.
    """
    names = _RANKED.get(node.graph)
    if names is None or node.name not in names:
        names, counts = {}, collections.Counter()
        for other in node.graph.nodes:
            if isinstance(other.meta.get("val"), torch.Tensor):
                base = _NUMBER.sub("", other.name)
                names[other.name] = base if counts[base] == 0 else f"{base}_{counts[base]}"
                counts[base] += 1
        _RANKED[node.graph] = names
    return names.get(node.name, node.name)


def key_of_saved(saved: SavedTensor) -> str:
    """The plan key of a tensor listed by :class:`savedhooks.fidelity.select.Census`.

    Args:
        saved: a census entry (key ``"g<i>:<node>"`` or ``"eager:<n>"``).

    Returns:
        The same string :func:`plan_key` computes for it.
    """
    where, _, name = saved.key.partition(":")
    head = "eager" if where == "eager" else name
    return f"{head}|{saved.op}|{_shape(saved.shape)}|{_dtype(saved.dtype)}"


@dataclasses.dataclass(frozen=True)
class Scope:
    """Where a saved value comes from in the model, for a model of recomputing its blocks.

    Attributes:
        paths: the module paths (outermost first) that enclose the op making it
            and every op of the forward reading it (:func:`scope_of`): a block's
            own activations have the block among them; its output, which the
            next block reads, does not.
        made_by: the op that made its storage (views looked through; an
            overload-packet name such as ``"mm"``).
        nbytes: its bytes.
    """

    paths: tuple[str, ...]
    made_by: str
    nbytes: int


@dataclasses.dataclass(frozen=True)
class GraphTimeline:
    """One graph's share of the step timeline.

    Attributes:
        live: bytes alive during each node above the graph's inputs (a backward
            graph's saved inputs count as inputs: freeing them makes it negative).
        at: forward: saved node -> the node index that makes it (absent: it frees
            nothing when packed); backward: saved input -> its first use.
        retained: forward only: bytes the graph leaves alive (saved tensors, outputs).
        saved_output: forward only: bytes of the graph's outputs that its
            backward reads too (a ``log_softmax`` head's result): a loop that
            drops the output does not free them.
        together: forward only: saved node -> the saved nodes sharing its storage
            (views of one buffer, such as attention's q, k and v): packing frees
            it only when all are packed, so they get one choice.
        reread: backward only, modelled as inductor runs it: saved input ->
            the ``(start, end)`` interval from its first use to its last, where
            a fused decode holds only the payload; only for inputs that no
            extern kernel reads (those need the full tensor).
        scopes: forward only: saved node -> its :class:`Scope`.
    """

    live: tuple[int, ...]
    at: Mapping[str, int]
    retained: int = 0
    together: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    reread: Mapping[str, tuple[tuple[int, int], ...]] = dataclasses.field(default_factory=dict)
    saved_output: int = 0
    scopes: Mapping[str, Scope] = dataclasses.field(default_factory=dict)


def _storage(node: torch.fx.Node) -> int | None:
    val = node.meta.get("val")
    return storage_key(val) if isinstance(val, torch.Tensor) else None


def _storage_groups(graph: torch.fx.Graph, saved: set[str]) -> dict[str, tuple[str, ...]]:
    """Saved nodes whose packing can free their storage, each with the saved nodes sharing that storage.

    A storage that a graph input or a graph output other than the saved tensors
    holds is never freed by packing: its saved nodes are left out.
    """
    output = graph.find_nodes(op="output")[0]
    held = collections.Counter(_storage(n) for n in pytree.tree_leaves(output.args) if isinstance(n, torch.fx.Node))
    inputs = {_storage(n) for n in graph.find_nodes(op="placeholder")}
    members: dict[int, list[str]] = {}
    for node in graph.nodes:
        ref = _storage(node)
        if node.name in saved and node.op != "placeholder" and ref is not None and ref not in inputs:
            members.setdefault(ref, []).append(node.name)
    # each saved tensor is one output position; one more means a user output (or a duplicate) holds it too
    return {name: tuple(names) for ref, names in members.items() if held[ref] == len(names) for name in names}


def _call_spans(gm: torch.fx.GraphModule, memory: Any, calls: list[KernelCall]) -> list[tuple[int, int]]:
    """``memory``'s node indices cut into the calls of inductor's generated code: ``(first, last)`` per call.

    A call is a run of consecutive nodes that its kernels made (:func:`kernel_calls`;
    where none of them is in the graph, each node is a call). Lowering one FX node may make several
    buffers (an extern kernel's inputs copied first, a fill then a scatter):
    the node goes with the last of them, which holds its value, and a node
    whose view an extern kernel made goes with that kernel. The nodes that no
    kernel made (views, values computed inside a kernel) go with the run of
    generated code they sit in, or make one after an extern kernel. A made node
    away from its call's other nodes (placed where its inputs let it) starts a
    run of its own there.
    """
    position = {name: i for i, name in enumerate(memory.node_names)}
    nodes = {n.name: n for n in gm.graph.nodes}
    made: dict[int, int] = {}  # the last call whose buffer a node is the origin of: its value
    aliased: dict[int, int] = {}  # the first call whose buffer comes from a view of a node's value
    for c, call in enumerate(calls):
        for name in (n for n in call.made if n in position):
            made[position[name]] = c
            aliased.setdefault(position.get(_maker(nodes[name]).name, position[name]), c)
    call_at: dict[int, Any] = aliased | made
    if not call_at:
        return [(i, i) for i in range(len(memory.node_names))]
    spans: list[list[int]] = []
    current: Any = None
    for i in range(len(memory.node_names)):
        c = call_at.get(i)
        if c is None and isinstance(current, int) and calls[current].extern:
            c = ("after", current)  # generated code after an extern kernel: a run of its own
        if not spans or (c is not None and c != current):  # the nodes before the first call: a run of their own
            spans.append([i, i])
        spans[-1][1] = i
        current = c if c is not None else current
    return [(first, last) for first, last in spans]


def _per_call(memory: Any, spans: list[tuple[int, int]]) -> Any:
    """``memory`` with each call's buffers allocated before its first node and what dies in it freed after its last.

    Inductor's generated code allocates every buffer a call stores before it
    runs and deletes the inputs that die in it after it; the node-by-node model
    freed an input at its last reading node, before the call's later outputs
    were made.
    """
    allocs = [list(a) for a in memory.allocs]
    frees = [list(f) for f in memory.frees]
    for first, last in spans:
        for i in range(first + 1, last + 1):
            allocs[first] += allocs[i]
            allocs[i] = []
        for i in range(first, last):
            frees[last] += frees[i]
            frees[i] = []
    return dataclasses.replace(memory, allocs=tuple(map(tuple, allocs)), frees=tuple(map(tuple, frees)))


# ops that inductor lowers as a write into a copy of their first input, which is that input's own buffer
# when nothing reads it later (a fill then a scatter: an embedding's backward)
_SCATTERS = frozenset(
    {
        torch.ops.aten.index_put.default,
        torch.ops.aten._unsafe_index_put.default,
        torch.ops.aten._unsafe_masked_index_put_accumulate.default,
        torch.ops.aten.index_add.default,
        torch.ops.aten.scatter.src,
        torch.ops.aten.scatter.value,
        torch.ops.aten.scatter_add.default,
        torch.ops.aten.scatter_reduce.two,
    }
)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors have the same sizes and strides (at their hints; a size-1 dimension's stride aside).

    Then an element's index is the same in both.
    """

    def layout(t: torch.Tensor) -> list[tuple[int, int]]:
        return [(n, s if n != 1 else 0) for n, s in ((size_hint(n), size_hint(s)) for n, s in zip(t.shape, t.stride()))]

    try:
        return layout(a) == layout(b)
    except (TypeError, ValueError):
        return False


def _reused_in_place(
    gm: torch.fx.GraphModule, memory: Any, device: torch.device, spans: list[tuple[int, int]]
) -> list[int]:
    """Per node, the bytes inductor writes in place: an output that takes a same-size buffer dying where it is made.

    Inductor's generated code does this (``buf5 = buf2; del buf2  # reuse``
    before a fused pointwise kernel), a saved input included where AOTAutograd
    donated it (:data:`DONATED`; without that record, any saved activation):
    never an incoming gradient, nor a saved value the forward also returned
    (a model's logits that its loss read inside the graph: the kernel that
    makes the logits' gradient allocates it beside both), and only where the
    op reads the buffer at the index it writes (not through a transpose) and
    no other node of its fused kernel reads it (``decide_inplace_update``).
    The buffer model allocates before it frees, so without this rule a GELU
    backward counts its output on top of the matmul gradient it overwrites. A scatter
    (:data:`_SCATTERS`) writes into its first input's buffer where that input
    dies in it. ``memory`` is the node-by-node model (before :func:`_per_call`);
    the bytes a kernel reuses count over its whole call.
    """
    nodes = {n.name: n for n in gm.graph.nodes}
    position = {name: i for i, name in enumerate(memory.node_names)}
    donated = set(gm.meta[DONATED] if DONATED in gm.meta else saved_activations(gm))

    def own(buffers: tuple[int, ...]) -> tuple[int, ...]:
        """``buffers`` less the graph inputs inductor may not write in place."""
        return tuple(b for b in buffers if not memory.buffers[b].is_input or memory.buffers[b].name in donated)

    def taken(made: tuple[int, ...], dying: tuple[int, ...]) -> int:
        """Bytes of ``made`` that take the place of a same-size buffer among ``dying``."""
        pool = [memory.buffers[b].nbytes for b in dying if memory.buffers[b].device == device]
        total = 0
        for b in made:
            size = memory.buffers[b].nbytes
            if memory.buffers[b].device == device and size in pool:
                pool.remove(size)
                total += size
        return total

    span_of = {i: (first, last) for first, last in spans for i in range(first, last + 1)}
    kernels_of: dict[str, set[int]] = {}
    for k, names in enumerate(gm.meta.get(FUSED_KERNELS, ())):
        for name in names:
            kernels_of.setdefault(name, set()).add(k)

    def read_elsewhere(b: int, i: int) -> bool:
        """Whether another node of ``i``'s fused kernel that stores something (a reduction too) reads buffer ``b``.

        Inductor writes in place only into a buffer whose one remaining reader
        is the writing node, read at the index it writes
        (``SchedulerNode.decide_inplace_update``; a kernel's nodes complete
        together): a softmax's scores, read by its max, its sum and its
        exponential in one kernel, stay beside the exponential until the
        kernel ends.
        """
        mine = kernels_of.get(memory.node_names[i])
        first, last = span_of.get(i, (i, i))
        return bool(mine) and any(
            j != i and memory.allocs[j] and b in memory.reads[j] and mine & kernels_of.get(memory.node_names[j], set())
            for j in range(first, last + 1)
        )

    inlined = inlined_nodes(gm.graph, gm.meta.get(REALIZED, ()))

    def at_own_index(b: int, i: int) -> bool:
        """Whether node ``i`` reads buffer ``b`` only laid out as it writes its output (inductor's ``can_inplace``).

        A pointwise op reads its inputs through views and inlined pointwise
        nodes; a read through a transpose (a clone of a permuted tensor) or a
        broadcast reads another index than it writes, and inductor allocates
        the output beside the input.
        """
        node = nodes[memory.node_names[i]]
        made = nodes.get(memory.buffers[b].name)
        key, out = (_storage(made) if made is not None else None), node.meta.get("val")
        if key is None or not isinstance(out, torch.Tensor):
            return True
        frontier, seen = [node], set()
        while frontier:
            for arg in frontier.pop().all_input_nodes:
                val = arg.meta.get("val")
                if isinstance(val, torch.Tensor) and storage_key(val) == key:
                    if not _same_layout(val, out):
                        return False
                elif arg in inlined and arg not in seen:
                    seen.add(arg)
                    frontier.append(arg)
        return True

    def reusable(i: int) -> tuple[int, ...]:
        """The buffers dying at node ``i`` that its output may take: any for a pointwise op, a scatter's first input's."""
        node = nodes[memory.node_names[i]]
        if torch.Tag.pointwise in getattr(node.target, "tags", ()):
            return own(tuple(b for b in memory.frees[i] if at_own_index(b, i) and not read_elsewhere(b, i)))
        if node.target in _SCATTERS and isinstance(node.args[0], torch.fx.Node):
            into = position.get(_maker(node.args[0]).name)
            return own(tuple(b for b in memory.frees[i] if into is not None and b in memory.allocs[into]))
        return ()

    reused = [0] * len(memory.node_names)
    for first, last in spans:
        total = sum(taken(memory.allocs[i], reusable(i)) for i in range(first, last + 1))
        for i in range(first, last + 1):
            reused[i] = total
    return reused


def timeline_of(
    gm: torch.fx.GraphModule, saved: set[str] | None = None, fused: bool = False, copied: Collection[str] = ()
) -> GraphTimeline:
    """Summarize one AOTAutograd graph for the step timeline.

    Args:
        gm: a forward or backward graph with ``meta["val"]``.
        saved: forward graphs: the names its backward reads (the saved values);
            None for a backward graph.
        fused: model the graph as inductor runs it: in its kernels' order where
            it was kept (:func:`run_in_kernel_order`; the graph is reordered in
            place), with its fusion (see :func:`savedhooks.memory.build_graph_memory`;
            what inductor stored where :meth:`savedhooks.planner.recording.GraphRecorder.kernel_order` saw it)
            its in-place reuse (a pointwise kernel writes into a same-size
            buffer that dies with it), and its calls (:func:`kernel_calls`:
            buffers allocated before a call, freed after it). A forward's
            inputs that inductor returned as copies (:data:`COPIED_INPUTS`)
            are held from their first reader to the end.
        copied: backward graphs: the saved inputs that the forward's compile
            returned as copies (freed at their last use, as saved activations).

    Returns:
        A :class:`GraphTimeline`.

    Raises:
        ValueError: as :func:`savedhooks.memory.build_graph_memory`.
    """
    backward = saved is None
    if fused:
        run_in_kernel_order(gm)
    names = {n.name for n in gm.graph.find_nodes(op="placeholder")}
    donated = (*freed_inputs(gm), *sorted(set(copied) & names)) if backward else ()
    memory = build_graph_memory(gm, donated=donated, fused=fused, realized=gm.meta.get(REALIZED, ()))
    device = _report_device(memory)
    if fused:
        spans = _call_spans(gm, memory, kernel_calls(gm))
        reused = _reused_in_place(gm, memory, device, spans)
        memory = _per_call(memory, spans)
    during, after, _ = simulate(memory, device)
    if fused:
        during = [d - r for d, r in zip(during, reused)]
    inputs = _input_bytes(memory, device)
    live = tuple(d - inputs for d in during)
    index = {name: i for i, name in enumerate(memory.node_names)}
    copies = _copies(gm, saved) if fused and not backward else {}
    live = _with_copies(live, index, copies)
    if backward:
        first: dict[str, int] = {}
        for i, reads in enumerate(memory.inputs):
            for j in reads:
                first.setdefault(memory.node_names[j], i)
        saved_first = {n: first[n] for n in saved_activations(gm) if n in first}
        reread = _reread_intervals(gm, memory, saved_first) if fused else {}
        return GraphTimeline(live, saved_first, reread=reread)
    groups = _storage_groups(gm.graph, saved)
    # a storage is freed once all its saved views are packed and the forward has read it for the last time;
    # aliases (views, a multi-output op's getitem) compute nothing: inductor's order puts those only the
    # output reads at the end, where the storage was made by the op before them (attention's outputs)
    nodes = {n.name: n for n in gm.graph.nodes}
    last_read: dict[int | None, int] = {}
    for node in gm.graph.nodes:
        if node.name in index and not is_alias(node):
            for arg in node.all_input_nodes:
                last_read[_storage(arg)] = index[node.name]
    at = {
        n: max(max(index[_maker(nodes[m]).name] for m in group), last_read.get(_storage(nodes[n]), -1))
        for n, group in groups.items()
    }
    together = {n: group for n, group in groups.items() if len(group) > 1}
    retained = (after[-1] - inputs) if after else 0
    retained += sum(copies.values())
    scopes = {n: Scope(scope_of(nodes[n]), op_name(_maker(nodes[n]).target) or "", _nbytes(nodes[n])) for n in at}
    return GraphTimeline(live, at, retained, together, saved_output=_saved_output_bytes(gm.graph, saved), scopes=scopes)


# dynamo names a module by the source it read it from: ``L['self'].model.layers.0``, ``L['args'][0].layers.0``
_SOURCE = re.compile(r"^[A-Za-z_]+(\[[^\]]*\])+\.?")


def _nbytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    return tensor_nbytes(val) if isinstance(val, torch.Tensor) else 0


def _module_paths(node: torch.fx.Node) -> tuple[str, ...]:
    """The module paths (from the root module, outermost first) of the modules whose forward made ``node``."""
    stack = node.meta.get("nn_module_stack") or {}
    return tuple(_SOURCE.sub("", str(entry[0])) for entry in stack.values())


def scope_of(node: torch.fx.Node) -> tuple[str, ...]:
    """The module paths enclosing a forward node and all its readers in its graph (the outer part their stacks share).

    Read from the ``nn_module_stack`` that dynamo records and AOTAutograd
    carries onto the graphs' nodes: ``("model", "model.layers.0")`` for an
    activation that layer 0 makes and reads alone; ``("model",)`` for the
    layer's output, which layer 1 reads. Views are looked through (the
    storage's maker counts); readers without a stack (ops AOTAutograd
    added) do not narrow it. Empty where the maker has no stack.

    Args:
        node: a node of a forward graph.

    Returns:
        Module paths, outermost first.
    """
    maker = _maker(node)
    scope = _module_paths(maker)
    for reader in (*maker.users, *node.users):
        if reader.op == "output":
            continue
        theirs = _module_paths(reader)
        if not theirs:
            continue
        common = 0
        while common < min(len(scope), len(theirs)) and scope[common] == theirs[common]:
            common += 1
        scope = scope[:common]
    return scope


def _copies(gm: torch.fx.GraphModule, saved: set[str]) -> dict[torch.fx.Node, int]:
    """A forward's saved inputs that inductor returned as copies (:data:`COPIED_INPUTS`), with their bytes."""
    copied = set(gm.meta.get(COPIED_INPUTS, ())) & saved
    return {
        node: tensor_nbytes(node.meta["val"])
        for node in gm.graph.find_nodes(op="placeholder")
        if node.name in copied and isinstance(node.meta.get("val"), torch.Tensor)
    }


def _with_copies(live: tuple[int, ...], index: dict[str, int], copies: dict[torch.fx.Node, int]) -> tuple[int, ...]:
    """``live`` with each copied input (:func:`_copies`) held from its first reader (the copy is made for it) to the end."""
    held = [0] * len(live)
    for node, nbytes in copies.items():
        start = min((index[u.name] for u in node.users if u.name in index), default=len(live))
        for i in range(start, len(live)):
            held[i] += nbytes
    return tuple(v + h for v, h in zip(live, held))


def _saved_output_bytes(graph: torch.fx.Graph, saved: set[str]) -> int:
    """Bytes of a forward graph's outputs whose storage is also saved: returned twice, or a view of a saved value."""
    outputs = [n for n in pytree.tree_leaves(graph.find_nodes(op="output")[0].args) if isinstance(n, torch.fx.Node)]
    count = collections.Counter(n.name for n in outputs)
    saved_storages = {_storage(n) for n in outputs if n.name in saved} - {None}
    found: dict[int, int] = {}
    for node in outputs:
        ref, val = _storage(node), node.meta.get("val")
        also_user = count[node.name] > 1 if node.name in saved else ref in saved_storages
        if also_user and ref is not None and isinstance(val, torch.Tensor):
            found[ref] = tensor_nbytes(val)
    return sum(found.values())


def _maker(node: torch.fx.Node) -> torch.fx.Node:
    """The node that computed ``node``'s data, looking through aliases."""
    while is_alias(node) and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _reread_intervals(
    gm: torch.fx.GraphModule, memory: Any, saved: Mapping[str, int]
) -> dict[str, tuple[tuple[int, int], ...]]:
    """Per saved input that no extern kernel reads, the points from its first use to its last (see the notes)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    inlined = inlined_nodes(gm.graph, gm.meta.get(REALIZED, ()))
    buffer_of = {memory.buffers[b].name: b for b in range(len(memory.buffers)) if memory.buffers[b].is_input}
    found = {}
    for name in saved:
        b = buffer_of.get(name)
        points = [i for i, reads in enumerate(memory.reads) if b in reads] if b is not None else []
        if not points:
            continue
        if any(_needs_whole(nodes[memory.node_names[i]], inlined) for i in points):
            continue  # inductor materializes the decoded tensor for it, and may do so in an earlier kernel
        found[name] = ((points[0], points[-1] + 1),)
    return found


def _needs_whole(node: torch.fx.Node, inlined: set[torch.fx.Node]) -> bool:
    """An extern kernel (not a pointwise or reduction kernel, not inlined, not a view): it reads a materialized input."""
    if node.op != "call_function" or node in inlined or is_view(node):
        return False
    tags = getattr(node.target, "tags", ())
    return torch.Tag.pointwise not in tags and torch.Tag.reduction not in tags


@dataclasses.dataclass(frozen=True)
class StepTimeline:
    """The step's timeline and each saved tensor's span on it.

    Attributes:
        live: bytes alive at each point with nothing packed.
        spans: census key (``"g<i>:<node>"``, ``"eager:<n>"``) -> ``(start, end)``:
            the points where packing it frees its bytes (absent: it frees none).
        reread: census key -> the backward intervals after its first use where
            a fused decode holds only its payload (:attr:`GraphTimeline.reread`).
    """

    live: tuple[int, ...]
    spans: Mapping[str, tuple[int, int]]
    reread: Mapping[str, tuple[tuple[int, int], ...]] = dataclasses.field(default_factory=dict)


def step_timeline(
    forwards: list[GraphTimeline],
    backwards: list[GraphTimeline],
    eager: list[SavedTensor],
    loss_bytes: int = 0,
    held_output: int = 0,
) -> StepTimeline:
    """Lay the graphs of one step end to end (see the module notes).

    Args:
        forwards: forward graphs in trace order.
        backwards: their backward graphs in the order they ran (the reverse).
        eager: tensors saved outside the graphs (an eager loss), alive between
            the last forward and the first backward.
        loss_bytes: the measured peak of the eager loss, forward and backward,
            above the model's output: the loss point holds the larger of it and
            ``eager``'s bytes.
        held_output: bytes of the model's output that the training loop keeps
            through the backward, added to the backward's points. A backward
            graph takes the output's gradient as an input, which its timeline
            does not count; the forward's retained output stands in for it,
            which is right where the loop drops the output (0).

    Returns:
        A :class:`StepTimeline`.

    Raises:
        ValueError: the numbers of forward and backward graphs differ.
    """
    if len(forwards) != len(backwards):
        raise ValueError(f"{len(forwards)} forward graphs but {len(backwards)} backward graphs")
    live: list[int] = []
    starts: dict[int, tuple[int, int]] = {}
    held = 0
    for g, fw in enumerate(forwards):
        starts[g] = (len(live), 0)
        live.extend(held + v for v in fw.live)
        held += fw.retained
    loss_point = len(live)
    live.append(held + max(sum(t.bytes for t in eager), loss_bytes))
    for g in reversed(range(len(forwards))):
        held -= forwards[g].retained
        bw = backwards[len(forwards) - 1 - g]
        starts[g] = (starts[g][0], len(live))
        live.extend(held + forwards[g].retained + held_output + v for v in bw.live)
    spans: dict[str, tuple[int, int]] = {t.key: (loss_point, loss_point + 1) for t in eager}
    reread: dict[str, tuple[tuple[int, int], ...]] = {}
    for g, fw in enumerate(forwards):
        bw = backwards[len(forwards) - 1 - g]
        offset = starts[g][1]
        for name, made in fw.at.items():
            if name in bw.at:
                spans[f"g{g}:{name}"] = (starts[g][0] + made + 1, offset + bw.at[name])
                if name in bw.reread:
                    reread[f"g{g}:{name}"] = tuple((offset + a, offset + b) for a, b in bw.reread[name])
    return StepTimeline(tuple(live), spans, reread)
