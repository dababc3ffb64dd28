"""Timeline of one compiled training step's backward graph: ``python -m benchmarks.memory_timeline``.

Records the aot_eager forward and backward graphs of a 2-layer transformer (fp32,
CPU) under ``savedhooks.fp8()``, then plots predicted and measured live bytes per
node of each into ``benchmarks/results/`` and writes the graphs' JSON beside them.
"""

from __future__ import annotations

import pathlib

import torch
import functools

from torch._dynamo.backends.debugging import aot_eager, boxed_nop

import savedhooks as sh


def main() -> None:
    """Record, plot, export."""
    out = pathlib.Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    graphs: list[tuple[torch.fx.GraphModule, list]] = []

    def keep(gm, example_inputs):
        run = boxed_nop(gm, example_inputs)

        def call(args):
            graphs.append((gm, list(args)))
            return run(args)

        call._boxed_call = True
        return call

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(layer, torch.nn.Linear(256, 16))
    with sh.saved_tensors_hooks(sh.fp8()):
        loss = torch.compile(model, backend=functools.partial(aot_eager, fw_compiler=keep, bw_compiler=keep))(torch.randn(8, 128, 256)).square().mean()
    loss.backward()
    for (gm, args), part in zip(graphs, ("forward", "backward")):
        estimate = sh.memory.estimate_peak(gm)
        measured = sh.memory.profile_graph(gm, *args)
        png = sh.memory.plot_timeline(estimate, out / f"timeline_{part}.png", measured, f"transformer layer, fp8, {part}")
        sh.memory.graph_to_json(gm, path=out / f"graph_{part}.json")
        exact = sum(p == m for p, m in zip(estimate.live_after, measured))
        print(f"{part}: {len(measured)} nodes, predicted == measured at {exact}; peak {estimate.peak_bytes / 2**20:.2f} MiB "
              f"at {estimate.peak_node}, lower bound {estimate.lower_bound / 2**20:.2f} MiB -> {png}")


if __name__ == "__main__":
    main()
