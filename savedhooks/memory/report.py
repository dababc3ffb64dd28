"""Look at a graph's memory: JSON export for offline analysis, and a timeline plot."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import torch.fx

from savedhooks.memory.estimate import PeakEstimate
from savedhooks.memory.graph import build_graph_memory

__all__ = ["graph_to_json", "plot_timeline"]


def graph_to_json(gm: torch.fx.GraphModule, donated: tuple[str, ...] = (), path: str | pathlib.Path | None = None) -> dict[str, Any]:
    """Export the buffer model: nodes (with what they allocate, read and free) and buffers.

    Args:
        gm: a graph with ``meta["val"]`` (see :func:`~savedhooks.memory.estimate_peak`).
        donated: placeholder names the graph may free.
        path: if given, the JSON is also written there.

    Returns:
        ``{"nodes": [...], "buffers": [...]}``, plain JSON types only.

    Raises:
        ValueError: as for :func:`~savedhooks.memory.build_graph_memory`.
    """
    memory = build_graph_memory(gm, donated)
    data = {
        "nodes": [
            {"name": name, "inputs": list(inputs), "allocs": list(allocs), "reads": list(reads), "frees": list(frees)}
            for name, inputs, allocs, reads, frees in zip(
                memory.node_names, memory.inputs, memory.allocs, memory.reads, memory.frees
            )
        ],
        "buffers": [
            {
                "index": b.index,
                "name": b.name,
                "nbytes": b.nbytes,
                "device": str(b.device),
                "is_input": b.is_input,
                "freeable": b.freeable,
                "users": [i for i, reads in enumerate(memory.reads) if b.index in reads],
            }
            for b in memory.buffers
        ],
    }
    if path is not None:
        pathlib.Path(path).write_text(json.dumps(data, indent=1))
    return data


def plot_timeline(
    estimate: PeakEstimate, path: str | pathlib.Path, measured: list[int] | None = None, title: str = "", top: int = 5
) -> pathlib.Path:
    """Plot live bytes per node: predicted (during and after each node), measured if given.

    The peak is marked and the largest buffers live at it are labelled.

    Args:
        estimate: from :func:`~savedhooks.memory.estimate_peak`.
        path: where to write the PNG.
        measured: live bytes after each node, e.g. from
            :func:`~savedhooks.memory.profile_graph`.
        title: plot title.
        top: how many buffers at the peak to label.

    Returns:
        The path written.

    Raises:
        ImportError: matplotlib is not installed (``pip install savedhooks[bench]``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2.0**20
    steps = range(len(estimate.node_names))
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(steps, [b / mib for b in estimate.live_during], label="predicted, while the node runs", lw=1)
    ax.plot(steps, [b / mib for b in estimate.live_after], label="predicted, after its frees", lw=1)
    if measured is not None:
        ax.plot(steps, [b / mib for b in measured], "k.", ms=2, label="measured, after each node")
    ax.axhline(estimate.lower_bound / mib, color="grey", ls=":", label="lower bound (any order)")
    ax.plot([estimate.peak_step], [estimate.peak_bytes / mib], "rv")
    labels = "\n".join(f"{b.name}: {b.nbytes / mib:.2f} MiB" for b in estimate.at_peak[:top])
    ax.annotate(
        f"peak {estimate.peak_bytes / mib:.2f} MiB at {estimate.peak_node}\n{labels}",
        (estimate.peak_step, estimate.peak_bytes / mib), fontsize=7, va="top", ha="left",
        xytext=(5, -5), textcoords="offset points",
    )  # fmt: skip
    ax.set_xlabel("node")
    ax.set_ylabel(f"live MiB ({estimate.device})")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
