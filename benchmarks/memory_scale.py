"""Time the memory model on a large graph: ``python -m benchmarks.memory_scale [--nodes N]``.

Builds a random DAG of N ops (cats making new buffers, slices making views) over
1-D tensors, fills fake values once, then times building the buffer model plus
the estimate (peak, per-node live bytes, lower bound): the work a reorder pass
repeats per candidate order.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

import savedhooks as sh


def random_graph(nodes: int, seed: int = 0) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """A random DAG of ``nodes`` cat/slice ops with mostly local inputs, and its example inputs."""
    rng = random.Random(seed)
    graph = torch.fx.Graph()
    inputs = [torch.randn(rng.randint(1, 64)) for _ in range(8)]
    values = [graph.placeholder(f"x{i}") for i in range(len(inputs))]
    for _ in range(nodes // 2):  # each step: a cat (new buffer) and a slice of it (a view, <= 64 elements)
        picked = {len(values) - 1 - min(int(rng.expovariate(0.2)), len(values) - 1) for _ in range(rng.randint(1, 3))}
        node = graph.call_function(torch.ops.aten.cat.default, ([values[i] for i in sorted(picked)],))
        values.append(graph.call_function(torch.ops.aten.slice.Tensor, (node, 0, 0, rng.randint(1, 64))))
    graph.output(tuple(values[-4:]))
    return torch.fx.GraphModule(torch.nn.Module(), graph), inputs


def main() -> None:
    """Print graph size and timings."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory_scale")
    parser.add_argument("--nodes", type=int, default=5000)
    args = parser.parse_args()
    gm, inputs = random_graph(args.nodes)
    start = time.perf_counter()
    sh.memory.estimate_peak(gm, *inputs)  # fills meta["val"] (fake propagation)
    propagate = time.perf_counter() - start
    times = []
    for _ in range(3):
        start = time.perf_counter()
        estimate = sh.memory.estimate_peak(gm)
        times.append(time.perf_counter() - start)
    nodes = len(estimate.node_names)
    print(f"{nodes} nodes: fake propagation {propagate:.2f} s (once); model + estimate + lower bound "
          f"{min(times):.3f} s (best of 3); peak {estimate.peak_bytes} B, lower bound {estimate.lower_bound} B")


if __name__ == "__main__":
    main()
