"""Overlap offload copies with compute: torch's asynchronous copy ops, placed by modelled time.

Design notes
------------
* Input: a graph the reorder pass has already ordered, whose pack and unpack
  chains move tensors between an accelerator and the host with
  ``savedhooks::offload`` (forward) and ``savedhooks::reload`` (backward)
  (:mod:`savedhooks.kernels.offload`). Alone, each is a copy ordered on the
  compute stream, so it stalls compute.
* Rewrite (torch's own ops, ``torch._functorch._activation_offloading``):
  ``offload(x)`` becomes ``savedhooks::offload_async(x)`` (torch's
  ``ao::offload`` writing into a slab of the host pool: a D2H copy on the
  transfer stream, after the compute stream has made ``x``) and ``ao::wait_tensor(host, None, x)``
  (the compute stream waits on the copy's event). ``x`` stays an input of the
  wait, so it is freed only after the wait, on a stream that the copy has
  already finished on: no ``record_stream``. ``reload(host)`` becomes
  ``ao::reload`` and ``ao::wait_tensor(device_copy, None, host)``. The waits
  never free anything themselves (no ``keepalive``), so a storage that another
  tensor still uses is never released, and a retained graph can unpack again.
* Placement: copies on the one transfer stream run in the order they are issued.
  Each forward wait sinks past the following nodes until their modelled time
  covers its copy's end; each backward reload rises above its wait (which stays
  right before the first user) until the copy ends in time. When the copies
  together take longer than the graph's modelled compute, no placement hides
  them, and the pass logs a warning with both times. Neither may lift
  the graph's modelled device peak above ``limit_bytes`` (default: the peak
  before overlap): a sunk wait keeps its source on the device longer, a hoisted
  reload holds its result sooner. Host bytes are counted apart (the memory model
  counts one device). A forward wait never sinks past a node that writes or
  resizes memory (an input's mutation, a storage resize): the copy, on another
  stream, may still be reading it.
* Times: a copy takes ``bytes / copy_bytes_per_s`` (default: torch's
  ``activation_offload_cpu_gpu_bw``, GB/s); a node takes ``node_seconds(node)``
  (default: torch's roofline estimate on a machine with a GPU, else a nominal
  one: FLOPs at 100 TFLOP/s or bytes at 2 TB/s, whichever is longer).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from savedhooks._torch.fx import side_effectful_functions
from savedhooks._torch.offload import HAS_AO_OPS, ao_ops
from savedhooks._torch.ops import schema_or_none
from savedhooks.memory import build_graph_memory, freed_inputs
from savedhooks.memory.estimate import _report_device
from savedhooks.memory.sizes import size_hint, tensor_nbytes
from savedhooks.memory.timing import TransferModel
from savedhooks.schedule import build_problem, live_profile

__all__ = ["Transfer", "hoist_starts", "overlap_transfers", "sink_waits"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One copy to place: where it is issued or waited on, how long it takes, what it holds.

    Attributes:
        at: the position it starts from (a forward wait's, a backward reload's).
        seconds: modelled copy time.
        nbytes: device bytes that moving it keeps alive over the nodes it passes.
    """

    at: int
    seconds: float
    nbytes: int


def sink_waits(
    transfers: list[Transfer],
    issued: list[int],
    ends: list[float],
    during: list[int],
    limit: int,
    stops: list[int] | None = None,
) -> list[int]:
    """Where each forward wait goes: after the first node whose end covers its copy, within ``limit``.

    Args:
        transfers: the waits, in graph order; ``at`` is the wait's position.
        issued: per wait, the position of the node that starts its copy.
        ends: per position, the modelled compute time when that node ends.
        during: per position, the modelled live device bytes while it runs
            (updated in place with what each accepted move adds).
        limit: the device peak no move may exceed.
        stops: per wait, the last position it may run after (default: the
            graph's last); the copy must have ended before the node after it
            (one that writes memory the copy may still be reading).

    Returns:
        Per wait, the position of the last node it runs after (its own ``at`` when it does not move).
    """
    stream_free, placed = 0.0, []
    stops = stops if stops is not None else [len(during) - 1] * len(transfers)
    for t, at, last in zip(transfers, issued, stops):
        done = stream_free = _copy_end(ends, at, stream_free, t)
        k = t.at
        while ends[k] < done and k < last and during[k + 1] + t.nbytes <= limit:
            k += 1
            during[k] += t.nbytes
        placed.append(k)
    return placed


def hoist_starts(
    transfers: list[Transfer], floor: list[int], ends: list[float], during: list[int], limit: int
) -> list[int]:
    """Where each backward reload starts: as late as lets its copy end before its wait, within ``limit``.

    Args:
        transfers: the reloads, in graph order; ``at`` is the position of the
            reload right before its wait.
        floor: per reload, the first position it may take (after its inputs and
            after the previous reload: copies keep their order).
        ends: per position, the modelled compute time when that node ends.
        during: per position, the modelled live device bytes while it runs
            (updated in place with what each accepted move adds).
        limit: the device peak no move may exceed.

    Returns:
        Per reload, the position it runs before (its own ``at`` when it does not move).
    """
    stream_free, placed, previous = 0.0, [], 0
    for t, low in zip(transfers, floor):
        needed_by = ends[t.at - 1] if t.at > 0 else 0.0  # compute reaches the wait
        j, low = t.at, max(low, previous)
        while j > low and _copy_end(ends, j, stream_free, t) > needed_by and during[j - 1] + t.nbytes <= limit:
            j -= 1
            during[j] += t.nbytes
        stream_free, previous = _copy_end(ends, j, stream_free, t), j
        placed.append(j)
    return placed


def _copy_end(ends: list[float], issued: int, stream_free: float, transfer: Transfer) -> float:
    """When a copy issued at position ``issued`` ends: after compute reaches it and the stream is free."""
    return max(ends[issued - 1] if issued > 0 else 0.0, stream_free) + transfer.seconds


def overlap_transfers(gm: torch.fx.GraphModule, is_backward: bool, model: TransferModel | None = None) -> int:
    """Make the graph's offload copies asynchronous and place them to overlap compute.

    Args:
        gm: an ordered AOTAutograd forward or backward graph with ``meta["val"]``.
        is_backward: which one it is.
        model: times and memory limit (default :class:`TransferModel`).

    Returns:
        The number of copies rewritten (0 leaves the graph untouched: no copy
        between an accelerator and the host, or a torch without the ``ao`` ops,
        where the copies stay synchronous and a warning says so once).
    """
    target = torch.ops.savedhooks.reload.default if is_backward else torch.ops.savedhooks.offload.default
    nodes = [n for n in gm.graph.nodes if n.target is target and _overlappable(n, is_backward)]
    if not nodes:
        return 0
    if not HAS_AO_OPS:
        _log_synchronous_once()
        return 0
    model = model or TransferModel()
    ao = _ao_ops()
    pairs = [_split(gm.graph, n, ao, is_backward) for n in nodes]
    try:
        _place(gm, pairs, is_backward, model)
    except Exception as error:  # noqa: BLE001  the split graph is correct as it is: each copy then overlaps nothing
        log.info("savedhooks overlap: placement skipped: %s", error)
    gm.graph.lint()
    gm.recompile()
    return len(pairs)


def _overlappable(node: torch.fx.Node, is_backward: bool) -> bool:
    """A contiguous, non-empty copy between an accelerator and pinned host memory.

    The asynchronous copy out returns a contiguous host tensor, so only contiguous
    tensors are rewritten (their layout is the same either way); the others,
    empty ones and those of data-dependent size (the copies' events are keyed
    by data pointer, which empty tensors may share), and copies to or
    from pageable memory (``pin_memory=False``; both ops carry the flag as their
    third argument), stay synchronous.
    """
    source, dest = node.args[0].meta.get("val"), node.meta.get("val")
    if not isinstance(source, torch.Tensor) or not isinstance(dest, torch.Tensor) or not source.is_contiguous():
        return False
    numel = source.numel()
    if free_unbacked_symbols(numel) or size_hint(numel) == 0:  # a data-dependent size may be 0 at run time
        return False
    if not node.args[2]:
        return False
    device, host = (dest.device, source.device) if is_backward else (source.device, dest.device)
    return host.type == "cpu" and device.type != "cpu"


def _ao_ops():
    return ao_ops()  # registers ao::offload, ao::reload, ao::wait_tensor


@functools.cache
def _log_synchronous_once() -> None:
    log.warning("savedhooks overlap: torch %s has no asynchronous offload ops (torch 2.12+: ao::offload, "
                "ao::reload, ao::wait_tensor); offload copies stay synchronous on the compute stream",
                torch.__version__)  # fmt: skip


def _split(graph: torch.fx.Graph, node: torch.fx.Node, ao, is_backward: bool) -> tuple[torch.fx.Node, torch.fx.Node]:
    """Replace one copy node by ``(start, wait)``; the wait takes the node's place for its users."""
    source, val = node.args[0], node.meta["val"]
    with graph.inserting_before(node):
        if is_backward:
            start = graph.call_function(
                ao.reload.default, (source, val.device)
            )  # the host tensor's (contiguous) layout
        else:  # torch's ao::offload, writing into the host pool (savedhooks.kernels.offload)
            start = graph.call_function(torch.ops.savedhooks.offload_async.default, (source,))
        start.meta["val"] = val
        wait = graph.call_function(ao.wait_tensor.default, (start, None, source))
        wait.meta["val"] = val  # the same fake tensor: the memory model sees one storage
    node.replace_all_uses_with(wait)
    graph.erase_node(node)
    return start, wait


def _place(gm: torch.fx.GraphModule, pairs, is_backward: bool, model: TransferModel) -> None:

    order = [n for n in gm.graph.nodes if n.op != "output"]
    position = {n: i for i, n in enumerate(order)}
    memory = build_graph_memory(gm, freed_inputs(gm) if is_backward else ())
    device = _report_device(memory)
    fixed = [i for i, n in enumerate(order) if n.op in ("placeholder", "get_attr")]
    problem = build_problem(memory, device, (), fixed)
    during = live_profile(problem, list(range(problem.size)))
    limit = model.limit_bytes if model.limit_bytes is not None else max(during, default=0)
    moving = {n for pair in pairs for n in pair}
    ends, clock = [], 0.0
    for n in order:
        clock += 0.0 if n in moving else model.seconds(n)
        ends.append(clock)
    bandwidth = model.bandwidth()
    copy_seconds = [_nbytes(start) / bandwidth for start, _ in pairs]
    _warn_if_copies_outlast_compute(sum(copy_seconds), clock, is_backward)
    if is_backward:
        transfers = [
            Transfer(position[start], seconds, problem.alloc[position[start]])
            for (start, _), seconds in zip(pairs, copy_seconds)
        ]
        floor = [max((position[a] + 1 for a in start.all_input_nodes), default=0) for start, _ in pairs]
        starts = hoist_starts(transfers, floor, ends, during, limit)
        for (start, _), j in zip(pairs, starts):
            anchor = next((n for n in order[j:] if n not in moving), None)  # the wait at the latest
            if anchor is not None and position[anchor] < position[start]:
                anchor.prepend(start)
        moved = sum(j < t.at for t, j in zip(transfers, starts))
    else:
        transfers = [
            Transfer(position[wait], seconds, _freed_by(problem, position[wait]))
            for (_, wait), seconds in zip(pairs, copy_seconds)
        ]
        writes = [i for i, n in enumerate(order) if _mutates(n)]  # a copy may still be reading what they write
        stops = [next((i - 1 for i in writes if i > position[wait]), len(order) - 1) for _, wait in pairs]
        spots = sink_waits(transfers, [position[start] for start, _ in pairs], ends, during, limit, stops)
        for (_, wait), k in sorted(zip(pairs, spots), key=lambda p: (-p[1], -position[p[0][1]])):
            anchor = next((n for n in reversed(order[: k + 1]) if n not in moving), None)  # the start at the earliest
            if anchor is not None and position[anchor] > position[wait]:
                anchor.append(wait)
        moved = sum(k > t.at for t, k in zip(transfers, spots))
    log.info(
        "savedhooks overlap (%s): %d async copies, %d moved, limit %d bytes",
        "backward" if is_backward else "forward",
        len(pairs),
        moved,
        limit,
    )


def _mutates(node: torch.fx.Node) -> bool:
    """A node that may write or resize memory: a mutable schema (an input's ``copy_``) or a side effect.

    Functionalized graphs keep a few: input mutations, and inductor's
    ``resize_storage_bytes_``, whose schema marks no write but which torch lists
    as side-effectful. The copies' own waits are not barriers.
    """
    if node.op != "call_function" or node.target is torch.ops.ao.wait_tensor.default:
        return False
    schema = schema_or_none(node.target)
    return (schema is not None and schema.is_mutable) or node.target in side_effectful_functions


def _warn_if_copies_outlast_compute(copying: float, computing: float, is_backward: bool) -> None:
    """Say when no placement can hide the copies: together they take longer than the graph's compute."""
    if copying > computing:
        log.warning(
            "savedhooks overlap (%s): its copies take %.3g ms at the modelled bandwidth, longer than the graph's "
            "modelled compute (%.3g ms), so the step waits on them. Offload fewer bytes (sh.offload(sh.fp8()), "
            "min_bytes, keep_needed_soon) or let sh.plan choose per tensor.",
            "backward" if is_backward else "forward",
            copying * 1e3,
            computing * 1e3,
        )


def _nbytes(node: torch.fx.Node) -> int:
    return tensor_nbytes(node.meta["val"])


def _freed_by(problem, node: int) -> int:
    """Device bytes whose last toucher is ``node`` (kept alive while it sinks)."""
    return sum(
        size
        for size, touchers, freeable in zip(problem.sizes, problem.touchers, problem.freeable)
        if freeable and touchers and max(touchers) == node
    )
