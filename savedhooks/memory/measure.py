"""Measured memory: the peak of a call, and live bytes after every node of a graph.

``measure_peak`` uses the CUDA caching allocator's statistics on GPU and the
profiler's allocation events, accumulated in time order, on CPU: the blocks
the call allocates, until they are freed. A free of a block from before the
call is left out: torch's CPU memory reporter keeps a block's size only while
a profiler records (``ProfiledCPUMemoryReporter`` in c10), so such a free is
dropped or, where the address held a block recorded in an earlier session and
freed since, reported with that old block's size; which one happens varies
from process to process.
Only a block allocated in an earlier session and still alive is freed with its
own size; :func:`measure_peaks` measures calls in turn in one session for that.

Kineto (the C++ profiler) writes two lines to stderr per session,
``USDT:... profiler_start`` and ``... profiler_stop``, at every log level it
prints anything; they are taken
out of what the session's start and stop write, and everything else is written
back (see :func:`_without_kineto_markers`).
``profile_graph`` runs a graph node by node, dropping each value after its last
use as compiled wrappers do, and counts the bytes of the real storages still
alive: what the model in ``estimate.py`` predicts, measured on real tensors
(real kernels decide what is a view and what is a copy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
from typing import Any, Callable, Iterator

import torch
import torch.fx

from savedhooks.memory.sizes import storage_key, tensor_storages

__all__ = [
    "CALL_MARK",
    "Allocation",
    "cpu_allocations",
    "cpu_memory_trace",
    "measure_peak",
    "measure_peaks",
    "profile_graph",
    "profiled_nodes",
    "traced_bytes",
]


def cpu_memory_trace(fn: Callable[[], Any], *, calling_thread_only: bool = False) -> list[int]:
    """Run ``fn`` under the profiler; return CPU live bytes after each allocation or free, in time order.

    Counts the blocks ``fn`` allocates, until they are freed. A block allocated
    before the call and freed during it is not counted: torch's CPU memory
    reporter sizes such a free only by chance (it keeps a block's size only
    while a profiler records), so counting it would make one call measure
    differently from process to process.

    Args:
        fn: the call to trace.
        calling_thread_only: count only what the thread that calls ``fn``
            allocates (freed on any thread). Other threads' allocations are
            recorded too (gloo's workers copy each all-gather through a buffer
            of their own), and one whose free falls after the profiler stops
            would count as held: to measure what a call leaves alive, pass
            ``True``.

    Returns:
        Live bytes relative to the start, one entry per counted allocation or free.

    Raises:
        Whatever ``fn`` raises.
    """
    nodes = profiled_nodes(fn)
    caller = next(n.start_tid for n in nodes if n.name == CALL_MARK) if calling_thread_only else None
    return [live for _, live in traced_bytes(cpu_allocations(nodes), caller)]


def profiled_nodes(fn: Callable[[], Any]) -> list[Any]:
    """Run ``fn`` under the CPU profiler with memory events; return every node of the profiler's event tree.

    ``fn``'s own mark (:data:`CALL_MARK`) is a root of the tree, on the
    calling thread; ops of other threads are roots of their own.

    Args:
        fn: the call to profile.

    Returns:
        The nodes (ops, allocations, frees), parents before their children.

    Raises:
        Whatever ``fn`` raises.
    """

    def marked() -> None:
        with torch.profiler.record_function(CALL_MARK):
            fn()

    tree = _profiled(marked).experimental_event_tree()
    return [n for root in tree for n in _walk(root)]


CALL_MARK = "savedhooks::measured_call"  # the profiler's name for the measured call (the root of its tree)


@dataclasses.dataclass(frozen=True)
class Allocation:
    """One CPU allocation (``nbytes > 0``) or free (``nbytes < 0``) the profiler recorded.

    Attributes:
        start_ns: when.
        thread: the profiler's id of the thread that made it.
        ptr: the address of the block.
        nbytes: its size, negative for a free.
    """

    start_ns: int
    thread: int
    ptr: int
    nbytes: int


def traced_bytes(records: list[Allocation], thread: int | None = None) -> list[tuple[int, int]]:
    """Live bytes of the blocks allocated within ``records``, after each allocation or free that counts, in time order.

    An allocation counts if ``thread`` made it (any allocation, with ``thread``
    None); its free counts on whichever thread it happens (a worker dropping the
    last reference to a buffer the caller allocated). A free of a block
    allocated before the records never counts: the profiler cannot size it
    reliably (:func:`cpu_memory_trace`).

    Args:
        records: the allocations and frees, in any order.
        thread: the thread whose allocations count; None for all.

    Returns:
        ``(start_ns, live bytes relative to the first record)`` per counted record.
    """
    owner: dict[int, int] = {}  # ptr -> thread, for blocks allocated during the records
    live, timeline = 0, []
    for r in sorted(records, key=lambda r: (r.start_ns, r.nbytes > 0)):  # at one time, a free before an allocation
        if r.nbytes > 0:
            owner[r.ptr] = r.thread
            counts = thread is None or r.thread == thread
        else:
            made_by = owner.pop(r.ptr, None)
            counts = made_by is not None and (thread is None or made_by == thread)
        if counts:
            live += r.nbytes
            timeline.append((r.start_ns, live))
    return timeline


def _walk(node: Any) -> Iterator[Any]:
    yield node
    for child in node.children:
        yield from _walk(child)


def cpu_allocations(nodes: list[Any]) -> list[Allocation]:
    """The CPU allocations and frees among the profiler's event-tree ``nodes``.

    Args:
        nodes: nodes of an event tree, as :func:`profiled_nodes` returns them.

    Returns:
        One :class:`Allocation` per CPU allocation or free, in the nodes' order.
    """
    allocations = []
    for node in nodes:
        fields = node.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == "cpu":
            allocations.append(Allocation(node.start_time_ns, node.start_tid, fields.ptr, fields.alloc_size))
    return allocations


def _profiled(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` under the CPU profiler with memory events; return kineto's results."""
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with _without_kineto_markers():
        prof.__enter__()
    try:
        fn()
    finally:
        with _without_kineto_markers():
            prof.__exit__(*sys.exc_info())
    return prof.profiler.kineto_results


# kineto's session markers: "USDT:2026-01-01 12:00:00 123:123 SyncActivityProfilerHandler.cpp:52] profiler_start"
_KINETO_MARKER = re.compile(rb"^(USDT|STAGE):[^\]]*\] (profiler_start|profiler_stop|Completed Stage: .*)$")


@contextlib.contextmanager
def _without_kineto_markers() -> Iterator[None]:
    """Capture what file descriptor 2 receives inside the block; write it back without kineto's session markers.

    Only the profiler's start or stop runs inside (never the measured call), so
    what else they write to stderr, warnings included, still reaches it, after
    the block. Where fd 2 cannot be redirected, nothing is captured.
    """
    _flush_stderr()
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            _flush_stderr()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = [line for line in capture.read().splitlines(keepends=True)
                    if not _KINETO_MARKER.match(line.rstrip(b"\r\n"))]  # fmt: skip
            if kept:
                os.write(2, b"".join(kept))


def _flush_stderr() -> None:
    if sys.stderr is not None:  # None under pythonw
        sys.stderr.flush()


def measure_peak(fn: Callable[..., Any], *args: Any, device: Any = None, **kwargs: Any) -> int:
    """Measured peak bytes of ``fn(*args, **kwargs)`` above what was live when it started.

    Args:
        fn: the call to measure (a training step, a compiled graph, ...).
        *args: its positional arguments.
        device: ``"cuda"`` (allocator statistics) or ``"cpu"`` (profiler events);
            default CUDA when available, else CPU.
        **kwargs: its keyword arguments.

    Returns:
        The peak in bytes (0 if nothing was allocated).

    Raises:
        Whatever ``fn`` raises.
    """
    device = _measured_device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn(*args, **kwargs)
        torch.cuda.synchronize(device)
        return max(torch.cuda.max_memory_allocated(device) - start, 0)
    return max(cpu_memory_trace(lambda: fn(*args, **kwargs)), default=0)


def _measured_device(device: Any) -> torch.device:
    """The device a measure reads: ``device``, else CUDA where available, else the CPU."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def measure_peaks(*fns: Callable[[], Any], device: Any = None) -> list[int]:
    """Measured peak bytes of each call in turn, above what was live when that call started.

    The calls run one after another in one measurement, so what a later call
    frees of what an earlier one allocated counts (a backward freeing the
    forward's saved tensors): on CPU, :func:`measure_peak` of the backward alone
    would not count those frees (see :func:`cpu_memory_trace`).

    Args:
        *fns: the calls, each without arguments (a forward, then its backward).
        device: ``"cuda"`` or ``"cpu"``, as for :func:`measure_peak`.

    Returns:
        One peak per call, in order (0 where live bytes never rose above the
        call's start). Another thread's allocation counts in the call running
        when it was made.

    Raises:
        ValueError: no call was given.
        Whatever a call raises.
    """
    if not fns:
        raise ValueError("measure_peaks: give at least one call")
    device = _measured_device(device)
    if device.type == "cuda":
        return [measure_peak(fn, device=device) for fn in fns]
    marks = [f"{CALL_MARK}[{i}]" for i in range(len(fns))]

    def run_all() -> None:
        for mark, fn in zip(marks, fns):
            with torch.profiler.record_function(mark):
                fn()

    nodes = profiled_nodes(run_all)
    timeline = traced_bytes(cpu_allocations(nodes))
    spans = {n.name: (n.start_time_ns, n.end_time_ns) for n in nodes if n.name in marks}
    peaks = []
    for mark in marks:
        start, end = spans[mark]
        before = ([live for t, live in timeline if t < start][-1:] or [0])[0]
        during = [live for t, live in timeline if start <= t <= end]
        peaks.append(max([0, *(live - before for live in during)]))
    return peaks


def profile_graph(gm: torch.fx.GraphModule, *args: Any, donated: tuple[str, ...] = (), device: Any = "cpu") -> list[int]:
    """Run ``gm`` node by node and measure live bytes on ``device`` after each node.

    Values are dropped after their last use; inputs stay referenced (the caller
    owns them) unless named in ``donated``. The count is over unique storages of
    the tensors still referenced, inputs included, so it lines up with
    ``estimate_peak(...).live_after``.

    Args:
        gm: the graph to run.
        *args: real inputs, one per placeholder.
        donated: placeholder names to release after their last use.
        device: the device to count.

    Returns:
        Live bytes after each non-output node, in graph order.

    Raises:
        ValueError: the number of inputs does not match the placeholders.
    """
    device = torch.device(device)
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != len(args):
        raise ValueError(f"profile_graph: {len(placeholders)} placeholders, {len(args)} inputs")
    last_use: dict[torch.fx.Node, int] = {}
    for i, node in enumerate(gm.graph.nodes):
        for arg in node.all_input_nodes:
            last_use[arg] = i
    outputs = set(gm.graph.output_node().all_input_nodes)
    feed = iter(args)
    env: dict[torch.fx.Node, Any] = {}
    kept: list[Any] = []  # the caller's references to inputs fed so far (not donated)
    live_after = []
    for i, node in enumerate(nodes):
        if node.op == "placeholder":
            env[node] = next(feed)
            if node.name not in donated:
                kept.append(env[node])
        else:
            env[node] = _run_node(gm, node, env)
        for dead in [n for n in env if last_use.get(n, -1) <= i and n not in outputs]:
            del env[dead]
        live_after.append(_live_bytes(list(env.values()) + kept, device))
    return live_after


def _run_node(gm: torch.fx.GraphModule, node: torch.fx.Node, env: dict[torch.fx.Node, Any]) -> Any:
    args = torch.fx.node.map_arg(node.args, env.__getitem__)
    kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    if node.op == "call_module":
        return gm.get_submodule(node.target)(*args, **kwargs)
    if node.op == "get_attr":
        value = gm
        for part in node.target.split("."):
            value = getattr(value, part)
        return value
    raise ValueError(f"profile_graph: cannot run node {node.name} ({node.op})")


def _live_bytes(values: list[Any], device: torch.device) -> int:
    seen: dict[int, int] = {}
    for t in tensor_storages(values):
        if t.device == device or (device.index is None and t.device.type == device.type):  # "cuda" is any CUDA
            seen[storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())
