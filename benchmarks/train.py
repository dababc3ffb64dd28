"""Training evidence: ``python -m benchmarks.train`` trains each model with and without lossy hooks.

Each benchmark model (``benchmarks.models``, same architecture and seeds) learns
a small synthetic task that it can learn in a few dozen steps, with fresh data
every step (the same data for every configuration):

* the language models (gpt2, llama): a Markov-chain language over 64 of their
  2048 tokens, each token followed by one of 4 fixed successors at random; the
  cross-entropy floor is ln 4 = 1.39 (from ln 2048 = 7.62 at random init);
* mlp: 10 classes given by a fixed random linear teacher on the input (the
  label is the argmax of ``W x``);
* cnn, vit: 10 classes of images, each a fixed smooth prototype (random 4 x 4
  per channel, upsampled, unit std) at 1/32 of the amplitude of unit Gaussian
  noise. (A linear teacher on 3072 or 150528 pixels is not learnable in a few
  hundred steps: both models' losses stay at or above ln 10.)

The recipe is the usual one for transformers: AdamW, the learning rate warmed up
linearly over the first ``warmup`` steps, the gradient norm clipped to ``clip``;
learning rate 1e-3, 3e-4 for the vit (:data:`LR`). Without warmup and clipping,
at 3e-3, a run is chaotic: a different rounding order alone (eager against
aot_eager, the same model, data and initialization) moves the final loss without
hooks by more than a codec does, and a codec comparison means nothing.

Configurations (``CONFIGS``): no hooks, ``sh.policy()``, ``sh.fp8()`` and
``sh.fp8(rounding="stochastic")`` (and, when named, ``sh.policy(centered=None)``,
which differs from the policy only with ``--backend inductor``);
the model compiled with ``--backend``
(default aot_eager, which saves the tensors that inductor would and compiles in
seconds on CPU). One row per model and configuration, one schema for the table
and the CSV, and a PNG of the loss curves. Losses are compared with no hooks as
ratios: ``final`` is the mean of the last 5 steps' losses, ``held-out`` the
trained model's loss on 16 batches that no run trained on (eager, no hooks,
``eval()``: it measures the weights, not the hooks).

``--seeds N`` repeats every run with seeds 0 .. N-1 (seed ``s`` draws other
initial weights and another training stream; the held-out batches stay the
same) and compares each run with no hooks at the same seed; a second table
gives each configuration's comparison as the mean over seeds, with the lowest
and highest. One seed's final loss averages only 5 batches, so it moves by
more than a codec does.
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

__all__ = ["CONFIGS", "DEFAULT_CONFIGS", "DEFAULT_LR", "LR", "TrainRow", "main", "train"]

_LAST = 5  # steps averaged into the final loss
_HELD_OUT = 16  # batches of the held-out loss
_HELD_OUT_STEP = 1_000_000  # task seeds of the held-out batches start here (training uses 0, 1, ...)
_SEED_STRIDE = 100_000  # seed s trains on the task seeds from s * _SEED_STRIDE (below the held-out ones)
_SEEDS = _HELD_OUT_STEP // _SEED_STRIDE  # seeds 0 .. _SEEDS - 1 fit below the held-out task seeds
LR: dict[str, float] = {"vit": 3e-4}  # learning rate per model; the others use DEFAULT_LR
DEFAULT_LR = 1e-3
CONFIGS: dict[str, Callable[[], Any] | None] = {
    "no hooks": None,
    "sh.policy()": sh.policy,
    "sh.fp8()": sh.fp8,
    "fp8 stochastic": lambda: sh.fp8(rounding="stochastic"),
    "sh.policy(uncentered)": lambda: sh.policy(centered=None),
}
DEFAULT_CONFIGS = ("no hooks", "sh.policy()", "sh.fp8()", "fp8 stochastic")  # run without --configs


@dataclasses.dataclass
class TrainRow:
    """One model trained with one configuration.

    Attributes:
        model: benchmark model name.
        config: a key of :data:`CONFIGS`.
        seed: the seed of the initial weights and of the training stream.
        steps: optimizer steps taken.
        first_loss: the first step's loss.
        final_loss: mean loss of the last 5 steps.
        mean_loss: mean loss over all steps.
        held_out_loss: the trained model's loss on held-out batches.
        final_vs_no_hooks: ``final_loss`` over the no-hook row's, minus 1, in percent.
        mean_vs_no_hooks: the same for ``mean_loss``.
        held_out_vs_no_hooks: the same for ``held_out_loss``.
        losses: every step's loss (CSV: space-separated).
    """

    model: str
    config: str
    seed: int
    steps: int
    first_loss: float
    final_loss: float
    mean_loss: float
    held_out_loss: float
    final_vs_no_hooks: float | None = None
    mean_vs_no_hooks: float | None = None
    held_out_vs_no_hooks: float | None = None
    losses: tuple[float, ...] = ()


# field, heading, format: one schema for the table and the CSV
COLUMNS = (
    ("model", "model", "{}"),
    ("config", "config", "{}"),
    ("seed", "seed", "{}"),
    ("steps", "steps", "{}"),
    ("first_loss", "first loss", "{:.4f}"),
    ("final_loss", "final loss", "{:.4f}"),
    ("mean_loss", "mean loss", "{:.4f}"),
    ("held_out_loss", "held-out loss", "{:.4f}"),
    ("final_vs_no_hooks", "final vs no hooks %", "{:+.2f}"),
    ("mean_vs_no_hooks", "mean vs no hooks %", "{:+.2f}"),
    ("held_out_vs_no_hooks", "held-out vs no hooks %", "{:+.2f}"),
)


def _task(workload, step: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], Callable[[Any], torch.Tensor]]:
    """Inputs and loss of one step of the model's task (see the module docstring), seeded by the step and seed."""
    g = torch.Generator().manual_seed(1000 + seed * _SEED_STRIDE + step)
    ((key, example),) = workload.inputs.items()
    if key == "input_ids":
        return _language(key, example, g)
    if example.dim() == 4:
        x, labels = _images(example, g)
    else:
        x = torch.randn(example.shape, generator=g)
        teacher = torch.randn(x[0].numel(), 10, generator=torch.Generator().manual_seed(7))
        labels = (x.flatten(1) @ teacher).argmax(1)
    return {key: x}, lambda out: torch.nn.functional.cross_entropy(getattr(out, "logits", out), labels)


def _language(
    key: str, example: torch.Tensor, g: torch.Generator
) -> tuple[dict[str, torch.Tensor], Callable[[Any], torch.Tensor]]:
    """A batch of the Markov-chain language, and the benchmark's own soft-target loss on it."""
    vocab, used = 2048, 64
    successors = torch.randint(0, used, (used, 4), generator=torch.Generator().manual_seed(7))
    batch, seq = example.shape
    ids = torch.empty(batch, seq + 1, dtype=torch.long)
    ids[:, 0] = torch.randint(0, used, (batch,), generator=g)
    picks = torch.randint(0, 4, (batch, seq), generator=g)
    for t in range(seq):
        ids[:, t + 1] = successors[ids[:, t], picks[:, t]]
    targets = torch.nn.functional.one_hot(ids[:, 1:], vocab).float()
    loss_of = _cross_entropy(targets)
    return {key: ids[:, :-1]}, lambda out: loss_of(out.logits)


def _images(example: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Images of 10 classes: a class's smooth prototype at 1/32 amplitude in unit noise, and the labels."""
    batch, channels, height, width = example.shape
    coarse = torch.randn(10, channels, 4, 4, generator=torch.Generator().manual_seed(7))
    prototypes = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)
    prototypes = prototypes / prototypes.flatten(1).std(1).view(-1, 1, 1, 1)
    labels = torch.randint(0, 10, (batch,), generator=g)
    return prototypes[labels] / 32 + torch.randn(example.shape, generator=g), labels


def _held_out_loss(workload) -> float:
    """The model's mean loss on the held-out batches: eager, no hooks, ``eval()``, no gradient."""
    model = workload.model
    model.eval()
    with torch.no_grad():
        losses = []
        for i in range(_HELD_OUT):
            inputs, loss_of = _task(workload, _HELD_OUT_STEP + i)
            losses.append(float(loss_of(model(**inputs))))
    model.train()
    return _mean(losses)


def train(
    name: str,
    config: str,
    steps: int,
    size: float = 1.0,
    backend: str | None = "aot_eager",
    lr: float | None = None,
    warmup: int = 20,
    clip: float | None = 1.0,
    seed: int = 0,
) -> TrainRow:
    """Train one model with one configuration; see the module docstring.

    Args:
        name: benchmark model name.
        config: a key of :data:`CONFIGS`.
        steps: optimizer steps (at least 1).
        size: batch multiplier of the model's workload.
        backend: ``torch.compile`` backend, or None for eager.
        lr: AdamW learning rate after warmup; None: the model's (:data:`LR`, else :data:`DEFAULT_LR`).
        warmup: steps over which the learning rate rises linearly to ``lr`` (0: none).
        clip: the gradient norm is clipped to this before each step (None: no clipping).
        seed: the initial weights' seed and the training stream's (0 to 9).

    Returns:
        A :class:`TrainRow` without the comparison columns (see :func:`compare`).

    Raises:
        KeyError: unknown model or configuration.
        ValueError: ``steps`` < 1 or more than 100000, ``lr`` or ``clip`` not positive, ``warmup`` negative,
            ``seed`` outside 0 to 9.
    """
    if not 1 <= steps <= _SEED_STRIDE:
        raise ValueError(f"train: steps must be from 1 to {_SEED_STRIDE}, got {steps}")
    if not 0 <= seed < _SEEDS:
        raise ValueError(f"train: seed must be from 0 to {_SEEDS - 1}, got {seed}")
    if (lr is not None and lr <= 0) or (clip is not None and clip <= 0) or warmup < 0:
        raise ValueError(f"train: lr and clip must be positive and warmup >= 0, got {lr}, {clip}, {warmup}")
    make_hooks = CONFIGS[config]
    torch._dynamo.reset()  # each run compiles its own model: earlier runs' graphs count toward the recompile limit
    workload = make_workload(name, size, seed=seed)
    model = workload.model
    fn = model if backend is None else torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=LR.get(name, DEFAULT_LR) if lr is None else lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warmup) if warmup else 1.0)
    losses = []
    for step in range(steps):
        inputs, loss_of = _task(workload, step, seed)
        context = sh.saved_tensors_hooks(make_hooks()) if make_hooks else contextlib.nullcontext()
        with context:
            loss = loss_of(fn(**inputs))
            loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    held_out = _held_out_loss(workload)
    return TrainRow(
        name, config, seed, steps, losses[0], _mean(losses[-_LAST:]), _mean(losses), held_out, losses=tuple(losses)
    )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def compare(rows: list[TrainRow]) -> list[TrainRow]:
    """Fill the ``*_vs_no_hooks`` columns from the no-hook row of the same model and seed.

    Args:
        rows: rows from :func:`train`.

    Returns:
        The same rows, changed in place.

    Raises:
        Nothing (a model and seed without a no-hook row keep empty columns).
    """
    base = {(r.model, r.seed): r for r in rows if r.config == "no hooks"}
    for r in rows:
        b = base.get((r.model, r.seed))
        if b is not None:
            r.final_vs_no_hooks = 100 * (r.final_loss / b.final_loss - 1)
            r.mean_vs_no_hooks = 100 * (r.mean_loss / b.mean_loss - 1)
            r.held_out_vs_no_hooks = 100 * (r.held_out_loss / b.held_out_loss - 1)
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


_COMPARED = (("final_vs_no_hooks", "final"), ("mean_vs_no_hooks", "mean"), ("held_out_vs_no_hooks", "held-out"))


def summary(rows: list[TrainRow]) -> str:
    """Markdown table of each model and configuration over its seeds: the comparisons' mean, lowest and highest.

    Args:
        rows: rows after :func:`compare`; rows without a comparison are left out.

    Returns:
        One line per model and configuration other than no hooks, in first-seen
        order: for each ``*_vs_no_hooks`` column, ``mean (lowest .. highest)``
        over the seeds, in percent.
    """
    groups: dict[tuple[str, str], list[TrainRow]] = {}
    for r in rows:
        if r.config != "no hooks" and r.final_vs_no_hooks is not None:
            groups.setdefault((r.model, r.config), []).append(r)
    heads = [f"{label} vs no hooks %: mean (lowest .. highest)" for _, label in _COMPARED]
    lines = ["| model | config | seeds | " + " | ".join(heads) + " |", "|---|---|---:|" + "---:|" * len(heads)]
    for (model, config), group in groups.items():
        cells = []
        for field, _ in _COMPARED:
            values = [getattr(r, field) for r in group]
            cells.append(f"{_mean(values):+.2f} ({min(values):+.2f} .. {max(values):+.2f})")
        lines.append(f"| {model} | {config} | {len(group)} | " + " | ".join(cells) + " |")
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
    """Loss curves, one panel per model, one line per configuration (of the lowest seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first_seed = min(r.seed for r in rows)
    rows = [r for r in rows if r.seed == first_seed]
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
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--size", type=float, default=1.0)
    parser.add_argument("--backend", default="aot_eager", help='torch.compile backend, or "eager" for none')
    parser.add_argument("--lr", type=float, default=None, help=f"AdamW learning rate (default: {DEFAULT_LR}, {LR})")
    parser.add_argument("--warmup", type=int, default=20, help="steps of linear learning-rate warmup")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (0: none)")
    parser.add_argument("--seeds", type=int, default=1, help="runs per model and configuration, seeds 0 .. N-1")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmark_results"))
    args = parser.parse_args(argv)
    if not 1 <= args.seeds <= _SEEDS:
        parser.error(f"--seeds must be from 1 to {_SEEDS}, got {args.seeds}")
    backend = None if args.backend == "eager" else args.backend
    rows = []
    for model in args.models:
        for seed in range(args.seeds):
            for config in args.configs:
                row = train(
                    model, config, args.steps, args.size, backend, args.lr, args.warmup, args.clip or None, seed
                )
                rows.append(row)
                print(
                    f"{model:6s} {config:16s} seed {seed} first {row.first_loss:.4f} final {row.final_loss:.4f}",
                    flush=True,
                )
    compare(rows)
    print(
        f"\ntorch {torch.__version__}, backend {args.backend}, size {args.size}, {args.steps} steps, "
        f"AdamW lr {args.lr or f'{DEFAULT_LR}, {LR}'}, warmup {args.warmup}, clip {args.clip or 'none'}\n"
    )
    print(table(rows))
    if args.seeds > 1:
        print(f"\nOver seeds 0 .. {args.seeds - 1}:\n\n{summary(rows)}")
    print(f"\n{write_csv(rows, args.out / 'train.csv')}\n{plot(rows, args.out / 'train_loss.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
