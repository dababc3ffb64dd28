"""Static arena plans of the benchmark graphs: ``python -m benchmarks.arena [--models ...] [--size N]``.

For each benchmark model (:mod:`benchmarks.models`) under the ``sh``
configuration (``sh.fp8()`` inlined, :mod:`benchmarks.configs`), one aot_eager
training step records the forward and backward graphs. For each graph, in
torch's order and in the order the reorder pass chooses
(:func:`savedhooks.schedule.schedule` on :func:`savedhooks.compiler.passes.graph_problem`,
as :func:`savedhooks.compiler.passes.reorder_graph` runs it), it prints per arena strategy
the arena bytes over the liveness peak of the same buffers (what the graph
allocates: inputs are the caller's), and the best strategy at the CUDA
allocator's 512 B rounding. A second table says whether scoring orders by arena
bytes (``schedule(..., score="arena")``) changes the chosen order. Then it times
planning a ``--synthetic``-node graph (default 5,000; 0 skips).

The CUDA caching allocator's reserved bytes are not measured here (CPU only).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import savedhooks as sh
from benchmarks.configs import CONFIGS
from benchmarks.memory_scale import random_graph
from benchmarks.models import MODELS, make_workload
from benchmarks.tools.schedule_gap import _best_time, random_problem
from savedhooks.compiler.passes import graph_problem
from savedhooks.memory import ARENA_STRATEGIES, ArenaPlan, build_graph_memory, plan_arena, plan_lifetimes
from savedhooks.schedule import arena_of, problem_lifetimes, schedule

__all__ = ["ARENA_HEADER", "SCORE_HEADER", "arena_row", "model_graphs", "score_row"]

MIB = 2.0**20
DEFAULT_MODELS = ("mlp", "cnn", "gpt2", "llama", "vit")
EXACT_BUDGET = 2_000  # reorder_graph's default

ARENA_HEADER = (
    "| graph | nodes | buffers | order | liveness peak MiB | "
    + " | ".join(ARENA_STRATEGIES)
    + " | best, 512 B aligned | CUDA reserved |\n|---|---:|---:|---|---:|"
    + "---:|" * len(ARENA_STRATEGIES)
    + "---:|---|"
)
SCORE_HEADER = (
    "| graph | scored by peak: method, modelled peak MiB (inputs included), arena MiB | scored by arena: the same | "
    "order changed |\n|---|---|---|---|"
)


def _mib(nbytes: int) -> str:
    return f"{nbytes / MIB:.3f}"


def arena_row(graph: str, order: str, nodes: int, plans: dict[str, ArenaPlan], aligned: ArenaPlan) -> str:
    """One markdown row of the arena table.

    Args:
        graph: e.g. ``"gpt2 backward"``.
        order: which order was planned (``"torch"``, ``"reorder pass"``).
        nodes: nodes in the graph.
        plans: one plan per strategy of :data:`savedhooks.memory.ARENA_STRATEGIES`
            (alignment 1), of the same order.
        aligned: the ``"best"`` plan at 512 B alignment.

    Returns:
        The row: per strategy ``arena MiB (arena / liveness peak)``.

    Raises:
        KeyError: a strategy without a plan.
    """
    first = plans[next(iter(ARENA_STRATEGIES))]
    cells = [f"{_mib(plans[s].arena_bytes)} ({plans[s].ratio:.3f})" for s in ARENA_STRATEGIES]
    return (
        f"| {graph} | {nodes} | {len(first.lifetimes)} | {order} | {_mib(first.liveness_peak)} | "
        + " | ".join(cells)
        + f" | {_mib(aligned.arena_bytes)} ({aligned.ratio:.3f}) | not measured (CPU) |"
    )


def score_row(graph: str, by_peak, by_peak_arena: int, by_arena) -> str:
    """One markdown row of the scoring table.

    Args:
        graph: e.g. ``"gpt2 backward"``.
        by_peak: the default :class:`savedhooks.schedule.Schedule` (scored by peak).
        by_peak_arena: its order's arena bytes (best strategy).
        by_arena: the ``score="arena"`` schedule.

    Returns:
        The row.
    """
    changed = "yes" if by_arena.order != by_peak.order else "no"
    return (
        f"| {graph} | {by_peak.method}, {_mib(by_peak.peak)}, {_mib(by_peak_arena)} | "
        f"{by_arena.method}, {_mib(by_arena.peak)}, {_mib(by_arena.arena)} | {changed} |"
    )


def model_graphs(name: str, size: float, config: str = "sh") -> list[tuple[str, torch.fx.GraphModule, tuple[str, ...]]]:
    """The aot_eager forward and backward graphs of one training step of a benchmark model.

    Args:
        name: a key of :data:`benchmarks.models.MODELS`.
        size: the batch multiplier.
        config: a compiled configuration of :data:`benchmarks.configs.CONFIGS`.

    Returns:
        ``(label, graph, donated)`` per graph: the backward's saved activations
        are donated (freed after their last use, as torch's backends do).

    Raises:
        RuntimeError: the step did not record exactly one forward and one backward graph.
    """
    torch._dynamo.reset()
    workload = make_workload(name, size)
    step = CONFIGS[config].build(workload, "aot_eager")
    try:
        step.forward().backward()
    finally:
        step.close()
        torch._dynamo.reset()
    log = step.graphs
    if log is None or len(log.forward) != 1 or len(log.backward) != 1:
        raise RuntimeError(f"{name}: expected one forward and one backward aot_eager graph")
    backward = log.backward[0]
    return [
        (f"{name} forward", log.forward[0], ()),
        (f"{name} backward", backward, sh.memory.freed_inputs(backward)),
    ]


def _graph_rows(label: str, gm: torch.fx.GraphModule, donated: tuple[str, ...]) -> tuple[list[str], str]:
    memory = build_graph_memory(gm, donated)
    problem, bound = graph_problem(gm, donated)
    by_peak = schedule(problem, bound, exact_budget=EXACT_BUDGET)
    rows = []
    for order_label, order in (("torch", None), ("reorder pass", by_peak.order)):
        plans = {s: plan_arena(memory, order, s) for s in ARENA_STRATEGIES}
        for plan in plans.values():
            sh.memory.validate_arena(plan)
        aligned = plan_arena(memory, order, "best", alignment=sh.memory.CUDA_ALIGNMENT)
        sh.memory.validate_arena(aligned)
        rows.append(arena_row(label, order_label, len(memory.node_names), plans, aligned))
    by_arena = schedule(problem, bound, exact_budget=EXACT_BUDGET, score="arena")
    return rows, score_row(label, by_peak, arena_of(problem, by_peak.order), by_arena)


def _timings(nodes: int) -> list[str]:
    """Planning times on a ``nodes``-node graph of each synthetic kind (best of 3)."""
    gm, inputs = random_graph(nodes)
    sh.memory.estimate_peak(gm, *inputs)  # fills meta["val"]
    memory = build_graph_memory(gm)
    problem = random_problem(nodes, seed=0)
    lifetimes = problem_lifetimes(problem, list(range(problem.size)))
    kinds: list[tuple[str, Callable[[str], ArenaPlan]]] = [
        (
            f"the {len(memory.node_names)}-node FX graph of benchmarks.memory_scale (plan_arena on its GraphMemory)",
            lambda s: plan_arena(memory, strategy=s),
        ),
        (
            f"the {nodes}-node DAG of benchmarks.tools.schedule_gap.random_problem (a tenth of its buffers outlive it)",
            lambda s: plan_lifetimes(lifetimes, s),
        ),
    ]
    lines = []
    for description, plan in kinds:
        example = plan("best")
        times = {s: _best_time(lambda s=s, plan=plan: plan(s)) for s in [*ARENA_STRATEGIES, "best"]}
        lines.append(
            f"{description}: {len(example.lifetimes)} buffers; planning "
            + ", ".join(f"{s} {t:.3f} s" for s, t in times.items())
            + f" (best of 3); best arena / liveness peak {example.ratio:.4f}"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    """Print the arena table, the scoring table and the planning times.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        None.

    Raises:
        SystemExit: bad flags.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.arena", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(DEFAULT_MODELS), choices=list(MODELS), metavar="MODEL")
    parser.add_argument("--size", type=float, default=1.0, help="batch multiplier (default 1)")
    parser.add_argument("--config", default="sh", choices=[n for n, c in CONFIGS.items() if c.compiled])
    parser.add_argument("--synthetic", type=int, default=5000, help="nodes of the timed synthetic graph (0: skip)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    print(f"CPU, aot_eager, configuration {args.config!r}, --size {args.size:g}; cells: arena MiB "
          "(arena / liveness peak of the same buffers)\n")  # fmt: skip
    print(ARENA_HEADER, flush=True)
    scored = []
    for name in args.models:
        for label, gm, donated in model_graphs(name, args.size, args.config):
            rows, score = _graph_rows(label, gm, donated)
            print("\n".join(rows), flush=True)
            scored.append(score)
    if scored:
        print(f"\n{SCORE_HEADER}\n" + "\n".join(scored))
    if args.synthetic:
        print()
        print("\n".join(_timings(args.synthetic)))
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
