"""Training evidence: ``python -m benchmarks.train`` trains each model with and without lossy hooks.

Each benchmark model (``benchmarks.models``, same architecture and seeds) learns
a small synthetic task that it can learn in a few dozen steps, with fresh data
every step (the same data for every configuration):

* the language models (gpt2, llama): a Markov-chain language over 64 of their
  2048 tokens, each token followed by one of 4 fixed successors at random; the
  cross-entropy floor is ln 4 = 1.39 (from ln 2048 = 7.62 at random init);
* mlp, cnn, vit: 10 classes given by a fixed random linear teacher on the input
  (the label is the argmax of ``W x``).

Configurations (``CONFIGS``): no hooks, ``sh.policy()``, ``sh.fp8()`` and
``sh.fp8(rounding="stochastic")``; AdamW, the model compiled with ``--backend``
(default aot_eager, which saves the tensors that inductor would and compiles in
seconds on CPU). One row per model and configuration, one schema for the table
and the CSV, and a PNG of the loss curves. Losses are compared with no hooks as
ratios: ``final`` is the mean of the last 5 steps' losses.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import pathlib
from collections.abc import Callable
from typing import Any

import torch

import savedhooks as sh
from benchmarks.models import _cross_entropy, make_workload

__all__ = ["CONFIGS", "TrainRow", "main", "train"]

_LAST = 5  # steps averaged into the final loss
CONFIGS: dict[str, Callable[[], Any] | None] = {
    "no hooks": None,
    "sh.policy()": sh.policy,
    "sh.fp8()": sh.fp8,
    "fp8 stochastic": lambda: sh.fp8(rounding="stochastic"),
}


@dataclasses.dataclass
class TrainRow:
    """One model trained with one configuration.

    Attributes:
        model: benchmark model name.
        config: a key of :data:`CONFIGS`.
        steps: optimizer steps taken.
        first_loss: the first step's loss.
        final_loss: mean loss of the last 5 steps.
        mean_loss: mean loss over all steps.
        final_vs_no_hooks: ``final_loss`` over the no-hook row's, minus 1, in percent.
        mean_vs_no_hooks: the same for ``mean_loss``.
        losses: every step's loss (CSV: space-separated).
    """

    model: str
    config: str
    steps: int
    first_loss: float
    final_loss: float
    mean_loss: float
    final_vs_no_hooks: float | None = None
    mean_vs_no_hooks: float | None = None
    losses: tuple[float, ...] = ()


# field, heading, format: one schema for the table and the CSV
COLUMNS = (
    ("model", "model", "{}"),
    ("config", "config", "{}"),
    ("steps", "steps", "{}"),
    ("first_loss", "first loss", "{:.4f}"),
    ("final_loss", "final loss", "{:.4f}"),
    ("mean_loss", "mean loss", "{:.4f}"),
    ("final_vs_no_hooks", "final vs no hooks %", "{:+.2f}"),
    ("mean_vs_no_hooks", "mean vs no hooks %", "{:+.2f}"),
)


def _task(workload, step: int) -> tuple[dict[str, torch.Tensor], Callable[[Any], torch.Tensor]]:
    """Inputs and loss of one step of the model's task (see the module docstring), seeded by the step."""
    g = torch.Generator().manual_seed(1000 + step)
    ((key, example),) = workload.inputs.items()
    if key == "input_ids":
        vocab, used = 2048, 64
        successors = torch.randint(0, used, (used, 4), generator=torch.Generator().manual_seed(7))
        batch, seq = example.shape
        ids = torch.empty(batch, seq + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(0, used, (batch,), generator=g)
        picks = torch.randint(0, 4, (batch, seq), generator=g)
        for t in range(seq):
            ids[:, t + 1] = successors[ids[:, t], picks[:, t]]
        targets = torch.nn.functional.one_hot(ids[:, 1:], vocab).float()
        loss_of = _cross_entropy(targets)  # the benchmark's own soft-target loss
        return {key: ids[:, :-1]}, lambda out: loss_of(out.logits)
    x = torch.randn(example.shape, generator=g)
    teacher = torch.randn(x[0].numel(), 10, generator=torch.Generator().manual_seed(7))
    labels = (x.flatten(1) @ teacher).argmax(1)
    return {key: x}, lambda out: torch.nn.functional.cross_entropy(getattr(out, "logits", out), labels)


def train(
    name: str, config: str, steps: int, size: float = 1.0, backend: str | None = "aot_eager", lr: float = 3e-3
) -> TrainRow:
    """Train one model with one configuration; see the module docstring.

    Args:
        name: benchmark model name.
        config: a key of :data:`CONFIGS`.
        steps: optimizer steps (at least 1).
        size: batch multiplier of the model's workload.
        backend: ``torch.compile`` backend, or None for eager.
        lr: AdamW learning rate.

    Returns:
        A :class:`TrainRow` without the comparison columns (see :func:`compare`).

    Raises:
        KeyError: unknown model or configuration.
        ValueError: ``steps`` < 1.
    """
    if steps < 1:
        raise ValueError(f"train: steps must be >= 1, got {steps}")
    make_hooks = CONFIGS[config]
    workload = make_workload(name, size)
    model = workload.model
    fn = model if backend is None else torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        inputs, loss_of = _task(workload, step)
        context = sh.saved_tensors_hooks(make_hooks()) if make_hooks else contextlib.nullcontext()
        with context:
            loss = loss_of(fn(**inputs))
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return TrainRow(name, config, steps, losses[0], _mean(losses[-_LAST:]), _mean(losses), losses=tuple(losses))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def compare(rows: list[TrainRow]) -> list[TrainRow]:
    """Fill the ``*_vs_no_hooks`` columns from each model's no-hook row.

    Args:
        rows: rows from :func:`train`.

    Returns:
        The same rows, changed in place.

    Raises:
        Nothing (a model without a no-hook row keeps empty columns).
    """
    base = {r.model: r for r in rows if r.config == "no hooks"}
    for r in rows:
        b = base.get(r.model)
        if b is not None:
            r.final_vs_no_hooks = 100 * (r.final_loss / b.final_loss - 1)
            r.mean_vs_no_hooks = 100 * (r.mean_loss / b.mean_loss - 1)
    return rows


def table(rows: list[TrainRow]) -> str:
    """Markdown table of the rows (every column of :data:`COLUMNS`)."""
    lines = [
        "| " + " | ".join(c[1] for c in COLUMNS) + " |",
        "|" + "|".join("---" if c[2] == "{}" else "---:" for c in COLUMNS) + "|",
    ]
    for r in rows:
        cells = [_cell(getattr(r, c[0]), c[2]) for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return fmt.format(value)


def write_csv(rows: list[TrainRow], path: pathlib.Path) -> pathlib.Path:
    """Write the rows (the :data:`COLUMNS` fields, then ``losses`` space-separated)."""
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([c[0] for c in COLUMNS] + ["losses"])
        for r in rows:
            writer.writerow([getattr(r, c[0]) for c in COLUMNS] + [" ".join(f"{v:.6g}" for v in r.losses)])
    return path


def plot(rows: list[TrainRow], path: pathlib.Path) -> pathlib.Path:
    """Loss curves, one panel per model, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4 * len(models), 3.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        for r in rows:
            if r.model == model:
                ax.plot(range(1, len(r.losses) + 1), r.losses, label=r.config, linewidth=1)
        ax.set_title(model)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """Command line: see ``python -m benchmarks.train --help``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.train", description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "gpt2", "llama", "vit"])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--size", type=float, default=1.0)
    parser.add_argument("--backend", default="aot_eager", help='torch.compile backend, or "eager" for none')
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmark_results"))
    args = parser.parse_args(argv)
    backend = None if args.backend == "eager" else args.backend
    rows = []
    for model in args.models:
        for config in args.configs:
            rows.append(train(model, config, args.steps, args.size, backend, args.lr))
            print(
                f"{model:6s} {config:16s} first {rows[-1].first_loss:.4f} final {rows[-1].final_loss:.4f}", flush=True
            )
    compare(rows)
    print(
        f"\ntorch {torch.__version__}, backend {args.backend}, size {args.size}, {args.steps} steps, AdamW lr {args.lr}\n"
    )
    print(table(rows))
    print(f"\n{write_csv(rows, args.out / 'train.csv')}\n{plot(rows, args.out / 'train_loss.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
