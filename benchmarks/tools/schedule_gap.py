"""How far the ordering portfolio is from optimal: ``python -m benchmarks.tools.schedule_gap``.

* 200 random 150-node DAGs (:func:`random_problem`): the portfolio's peak against
  the exact search's optimum; where the search runs out of budget, against the
  best lower bound it proved (reported apart: it overstates the gap).
* The aot_eager forward and backward graphs of the test models under ``sh.fp8()``.
* The portfolio (no exact search) on a 5,000-node graph, timed, and the whole FX
  pass on the 5,000-node graph of ``benchmarks.memory_scale``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import savedhooks as sh
from benchmarks.memory_scale import random_graph
from savedhooks.compiler.passes import reorder_graph
from savedhooks.schedule import Problem, schedule

__all__ = ["random_problem"]


def random_problem(nodes: int, seed: int, window: int = 6, fixed: int = 2) -> Problem:
    """A random layered DAG shaped like a model's graph.

    Each node makes one buffer (1 to 64 KiB, a tenth of them views of size 0) and
    reads one to three of the last ``window`` nodes' buffers; about a tenth of the
    buffers are graph outputs (kept), and a fifth of the nodes use scratch (up to
    32 KiB, as a pack's temporaries). The first ``fixed`` nodes are inputs.

    Args:
        nodes: how many nodes (``> fixed``).
        seed: the random seed.
        window: how far back a node reads (bounds the graph's width).
        fixed: how many input nodes.

    Returns:
        A :class:`savedhooks.schedule.Problem`.

    Raises:
        ValueError: ``nodes <= fixed``.
    """
    if nodes <= fixed:
        raise ValueError(f"random_problem: need more than {fixed} nodes, got {nodes}")
    rng = random.Random(seed)
    preds: list[tuple[int, ...]] = [()] * fixed
    for v in range(fixed, nodes):
        preds.append(tuple(sorted({rng.randrange(max(0, v - window), v) for _ in range(rng.randint(1, 3))})))
    sizes = [rng.randint(1, 64) * 1024 for _ in range(nodes)]
    for v in range(fixed, nodes):
        if rng.random() < 0.1:
            sizes[v] = 0
    touchers = [{v} for v in range(nodes)]
    for v, ps in enumerate(preds):
        for p in ps:
            touchers[p].add(v)
    outputs = {v for v in range(fixed, nodes) if rng.random() < 0.1} | {nodes - 1}
    users = [[] for _ in range(nodes)]
    for v, ps in enumerate(preds):
        for p in ps:
            users[p].append(v)
    early, late = set(), set()
    for v in range(nodes - 1, fixed - 1, -1):
        if all(u in early for u in users[v]):
            early.add(v)
    for v in range(fixed, nodes):
        if all(p < fixed or p in late for p in preds[v]):
            late.add(v)
    return Problem(
        preds=tuple(preds),
        fixed=tuple(range(fixed)),
        alloc=tuple(0 if v < fixed else sizes[v] for v in range(nodes)),
        sizes=tuple(sizes),
        touchers=tuple(tuple(sorted(t)) for t in touchers),
        freeable=tuple(v >= fixed and v not in outputs for v in range(nodes)),
        base=sum(sizes[:fixed]),
        early=frozenset(early),
        late=frozenset(late),
        scratch=tuple(0 if v < fixed or rng.random() >= 0.2 else rng.randint(1, 32) * 1024 for v in range(nodes)),
    )


def _gaps(problems, budget: int) -> tuple[list[float], list[float], int]:
    """Relative gaps of the portfolio: to the optimum where proven, else to the bound proved.

    Returns ``(gaps to optimal, gaps to a lower bound where unproven, how many the
    exact search improved)``.
    """
    to_optimal, to_bound, improved = [], [], 0
    for problem in problems:
        portfolio = schedule(problem, exact_budget=0)
        best = schedule(problem, exact_budget=budget)
        improved += best.peak < portfolio.peak
        if best.optimal:
            to_optimal.append((portfolio.peak - best.peak) / best.peak if best.peak else 0.0)
        else:
            to_bound.append((portfolio.peak - best.lower_bound) / best.lower_bound)
    return to_optimal, to_bound, improved


def _model_problems():
    """Problems of the aot_eager forward/backward graphs of the acceptance models under fp8."""
    from benchmarks.acceptance import MODELS, test_models
    from savedhooks.compiler.passes import graph_problem
    from savedhooks.memory import freed_inputs

    models = test_models()
    out = []
    cases = [(name, make(), torch.randn(*shape)) for name, (make, shape) in MODELS.items()]
    cases.append(("CNN", models.cnn(), torch.randn(4, 3, 16, 16)))
    for name, model, x in cases:
        capture = models.GraphCapture()
        models.train_step_grads(model, torch.compile(model, backend=capture.backend), x, sh.fp8())
        torch._dynamo.reset()
        for (gm, _), is_backward in zip(capture.graphs, capture.is_backward):
            problem, bound = graph_problem(gm, freed_inputs(gm) if is_backward else ())
            out.append((f"{name} {'backward' if is_backward else 'forward'}", problem, bound))
    return out


def main() -> None:
    """Print the gap table and the 5,000-node timing."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tools.schedule_gap")
    parser.add_argument("--graphs", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=150)
    parser.add_argument("--budget", type=int, default=50_000, help="exact search states per graph")
    args = parser.parse_args()

    start = time.perf_counter()
    problems = [random_problem(args.nodes, seed) for seed in range(args.graphs)]
    to_optimal, to_bound, improved = _gaps(problems, args.budget)
    print(f"{args.graphs} random {args.nodes}-node DAGs ({time.perf_counter() - start:.0f} s): optimum proven on "
          f"{len(to_optimal)}; there the portfolio's gap to optimal is mean {100 * statistics.mean(to_optimal):.2f} %, "
          f"worst {100 * max(to_optimal):.2f} %; the exact search beat the portfolio on {improved}")
    if to_bound:
        print(f"  unproven ({len(to_bound)}): gap to the lower bound proved, mean "
              f"{100 * statistics.mean(to_bound):.2f} %, worst {100 * max(to_bound):.2f} % (the optimum lies between)")
    print("| graph | nodes | input order | portfolio | best | optimal | gap of portfolio |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for name, problem, bound in _model_problems():
        portfolio = schedule(problem, bound, exact_budget=0)
        best = schedule(problem, bound, exact_budget=args.budget)
        floor = best.peak if best.optimal else best.lower_bound
        gap = (portfolio.peak - floor) / floor if floor else 0.0
        print(f"| {name} | {problem.size} | {portfolio.input_peak} | {portfolio.peak} ({portfolio.method}) | "
              f"{best.peak} | {'yes' if best.optimal else f'bound {best.lower_bound}'} | {100 * gap:.2f} % |")

    big = random_problem(5000, seed=0)
    print(f"portfolio (input, LPMF, BFS, DFS, smallest-first DFS, bytes-freed, beam; each raw and placed) "
          f"on a 5000-node DAG: "
          f"{_best_time(lambda: schedule(big, exact_budget=0)):.2f} s (best of 3)")
    gm, inputs = random_graph(5000)
    sh.memory.estimate_peak(gm, *inputs)  # fills meta["val"]
    print(f"reorder_graph on the {len(gm.graph.nodes)}-node FX graph of benchmarks.memory_scale (memory model, "
          f"lower bound, portfolio, applying the order): {_best_time(lambda: reorder_graph(gm)):.2f} s (best of 3)")


def _best_time(run) -> float:
    times = []
    for _ in range(3):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


if __name__ == "__main__":
    main()
