"""Long runs: ``python -m benchmarks.long_run`` trains a zoo decoder on text, with and without savedhooks.

The model is a zoo entry (:mod:`benchmarks.zoo_entries`: a transformers
decoder from its default config, sizes shrunk, dropout as shipped) compiled
with inductor. It learns byte-level language modelling (tokens 0..255, the
zoo's tiny vocabulary) on a corpus that Python ships: the source files of a
fixed list of standard-library modules (:func:`corpus`), about 1.4 MB. Nothing
is downloaded. Every configuration sees the same initial weights and the same
batches (windows at offsets drawn from one seeded generator).

Configurations (:data:`CONFIGS`): no hooks; ``sh.policy()``; a plan for 0.7 of
the planner's modelled peak without hooks, made on the first batch
(:class:`savedhooks.integrations.transformers.PlanOnFirstBatch`; random
number generators restored after it) and applied for the run.

The recipe: AdamW, learning rate 1e-3 warmed up linearly over ``--warmup``
steps, gradient norm clipped to 1.0. The loss is smoothed by a trailing mean
over ``--window`` steps; each configuration is compared with no hooks by the
largest relative difference of the smoothed loss at any step after warm-up.
The results file (Markdown: the command, torch and transformers versions, the
device, one table) and the PNG of the curves are written by the same run;
``--csv`` adds every step's loss.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import importlib
import inspect
import pathlib
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

import savedhooks as sh
from benchmarks.zoo_entries import SIZES, ZOO

__all__ = ["CONFIGS", "CORPUS_MODULES", "LongRunRow", "corpus", "main", "run", "smoothed"]

CONFIGS = ("no hooks", "sh.policy()", "plan 0.7")
# standard-library modules whose source is the corpus (plain English docstrings and Python code)
CORPUS_MODULES = (
    "argparse", "collections", "csv", "dataclasses", "difflib", "email.message", "fractions", "functools",
    "heapq", "inspect", "json.decoder", "logging", "pathlib", "pickle", "random", "shutil", "statistics",
    "string", "tarfile", "textwrap", "threading", "typing", "unittest.case", "urllib.parse", "zipfile",
)  # fmt: skip
LR = 1e-3
CLIP = 1.0
SEED = 0


def corpus(modules: Sequence[str] = CORPUS_MODULES) -> torch.Tensor:
    """The training text as byte tokens: the source files of ``modules``, concatenated in order.

    Args:
        modules: importable standard-library module names.

    Returns:
        A 1-D int64 tensor of byte values (0..255).

    Raises:
        ImportError: a module does not import.
        OSError: a module's source is not available.
    """
    text = b"".join(inspect.getsource(importlib.import_module(name)).encode() for name in modules)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def smoothed(losses: Sequence[float], window: int) -> list[float]:
    """Trailing mean of ``losses`` over up to ``window`` steps (fewer at the start).

    Args:
        losses: per-step losses.
        window: steps averaged, >= 1.

    Returns:
        One value per step.

    Raises:
        ValueError: ``window`` < 1.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out, total = [], 0.0
    for i, loss in enumerate(losses):
        total += loss
        if i >= window:
            total -= losses[i - window]
        out.append(total / min(i + 1, window))
    return out


@dataclasses.dataclass
class LongRunRow:
    """One configuration's run (the table's and the CSV's schema).

    Attributes:
        model: the zoo entry.
        config: one of :data:`CONFIGS`.
        steps: optimizer steps.
        first_loss: the first step's loss.
        final_smoothed: the smoothed loss at the last step.
        max_rel_diff_pct: largest relative difference of the smoothed loss
            from no hooks after warm-up, in percent (signed: above no hooks is positive).
        at_step: the step where it is largest.
        seconds: wall time of the run (training and, for a plan, planning).
        losses: every step's loss.
    """

    model: str
    config: str
    steps: int
    first_loss: float
    final_smoothed: float
    max_rel_diff_pct: float = 0.0
    at_step: int = 0
    seconds: float = 0.0
    losses: list[float] = dataclasses.field(default_factory=list)


def _batches(tokens: torch.Tensor, batch: int, seq: int, steps: int, seed: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - seq, (steps, batch), generator=generator)
    out = []
    for row in starts:
        ids = torch.stack([tokens[s : s + seq] for s in row.tolist()])
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def run(config: str, model_name: str, size: str, steps: int, warmup: int, tokens: torch.Tensor) -> LongRunRow:
    """Train one configuration for ``steps`` steps and record its losses.

    Args:
        config: one of :data:`CONFIGS`.
        model_name: a causal LM of the zoo (``ZOO[name].family`` decoder or moe).
        size: a key of :data:`benchmarks.zoo_entries.SIZES`.
        steps: optimizer steps.
        warmup: steps of linear learning-rate warm-up.
        tokens: the corpus (:func:`corpus`).

    Returns:
        The row (comparisons with no hooks left at 0: :func:`main` fills them).

    Raises:
        ValueError: an unknown configuration.
    """
    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}; known: {CONFIGS}")
    from savedhooks.integrations.transformers import PlanOnFirstBatch

    start = time.perf_counter()
    dims = SIZES[size]
    batches = _batches(tokens, dims.batch, dims.seq, steps, SEED)
    model, _ = ZOO[model_name].build(size)
    torch.manual_seed(SEED)
    torch._dynamo.reset()
    hooks: Any = None
    plan = None
    if config == "sh.policy()":
        hooks = sh.policy()
    elif config == "plan 0.7":
        plan = PlanOnFirstBatch(fraction=0.7).make(model, batches[0])
        plan.apply(model)
        hooks = plan.hooks
    compiled = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, warmup)))
    losses = []
    try:
        for inputs in batches:
            optimizer.zero_grad(set_to_none=True)
            with sh.saved_tensors_hooks(hooks) if hooks is not None else contextlib.nullcontext():
                loss = compiled(**inputs).loss
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            schedule.step()
            losses.append(float(loss.detach()))
    finally:
        if plan is not None:
            plan.revert(model)
        torch._dynamo.reset()
    return LongRunRow(model_name, config, steps, losses[0], losses[-1], seconds=time.perf_counter() - start,
                      losses=losses)  # fmt: skip


def _compare(rows: list[LongRunRow], window: int, warmup: int) -> None:
    """Fill each row's smoothed final loss and its largest relative difference from no hooks after warm-up."""
    reference = next((r for r in rows if r.config == "no hooks"), None)
    base = smoothed(reference.losses, window) if reference is not None else None
    for row in rows:
        mine = smoothed(row.losses, window)
        row.final_smoothed = mine[-1]
        if base is None or row is reference:
            continue
        diffs = [(100 * (m - b) / b, i) for i, (m, b) in enumerate(zip(mine, base)) if i >= warmup]
        if diffs:
            row.max_rel_diff_pct, row.at_step = max(diffs, key=lambda d: abs(d[0]))


def _table(rows: list[LongRunRow]) -> str:
    lines = [
        "| model | config | steps | first loss | final smoothed loss | largest smoothed difference vs no hooks % | at step | s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        diff = "" if r.config == "no hooks" else f"{r.max_rel_diff_pct:+.3f}"
        at = "" if r.config == "no hooks" else str(r.at_step)
        lines.append(f"| {r.model} | {r.config} | {r.steps} | {r.first_loss:.4f} | {r.final_smoothed:.4f} | "
                     f"{diff} | {at} | {r.seconds:.0f} |")  # fmt: skip
    return "\n".join(lines)


def _plot(rows: list[LongRunRow], window: int, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, rel) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=(2, 1))
    base = smoothed(rows[0].losses, window)  # no hooks comes first
    for row in rows:
        mine = smoothed(row.losses, window)
        ax.plot(mine, label=row.config, linewidth=1.2)
        rel.plot([100 * (m - b) / b for m, b in zip(mine, base)], label=row.config, linewidth=1.0)
    ax.set_ylabel(f"training loss\n(trailing mean of {window} steps)")
    ax.set_title(f"{rows[0].model}: byte-level LM on Python's standard-library source")
    ax.legend()
    rel.set_xlabel("step")
    rel.set_ylabel("vs no hooks (%)")
    rel.axhline(0, color="grey", linewidth=0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> list[LongRunRow]:
    """Run the configurations, compare them with no hooks, write the results file, the plot and the CSV.

    Args:
        argv: command-line arguments (``--help``); None: ``sys.argv``.

    Returns:
        The rows, in :data:`CONFIGS` order.

    Raises:
        SystemExit: bad arguments.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.long_run", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama", choices=[n for n, e in ZOO.items() if e.family == "decoder"])
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--window", type=int, default=25)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--out", type=pathlib.Path, help="the Markdown results file (the PNG goes beside it)")
    parser.add_argument("--csv", type=pathlib.Path, help="every step's loss")
    args = parser.parse_args(argv)
    if "no hooks" not in args.configs:
        parser.error("--configs must include 'no hooks' (the reference)")
    if SIZES[args.size].vocab < 256:
        parser.error(f"size {args.size!r} has a vocabulary under 256: byte tokens do not fit")
    tokens = corpus()
    rows = []
    for config in CONFIGS:
        if config in args.configs:
            rows.append(run(config, args.model, args.size, args.steps, args.warmup, tokens))
            print(f"{config}: {rows[-1].seconds:.0f} s, final loss {rows[-1].losses[-1]:.4f}", flush=True)
    _compare(rows, args.window, args.warmup)
    table = _table(rows)
    print(table)
    for path in (args.csv, args.out):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
    if args.csv:
        with args.csv.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["model", "config", "step", "loss"])
            for row in rows:
                writer.writerows([row.model, row.config, i, loss] for i, loss in enumerate(row.losses))
    if args.out:
        png = args.out.with_suffix(".png")
        _plot(rows, args.window, png)
        import transformers

        command = "python -m benchmarks.long_run " + " ".join(argv if argv is not None else sys.argv[1:])
        args.out.write_text(
            f"# Long run: {args.model}, size {args.size}\n\n"
            f"`{command.strip()}`; torch {torch.__version__}, transformers {transformers.__version__}; "
            f"device cpu ({platform.machine()}, {torch.get_num_threads()} threads).\n\n"
            f"Byte-level language modelling on {len(tokens):,} bytes of Python's standard-library source; "
            f"AdamW at {LR:g}, {args.warmup} warm-up steps, gradient norm clipped to {CLIP:g}; the same weights "
            f"and batches for every configuration. Smoothed loss: trailing mean over {args.window} steps; the "
            f"largest difference is over the steps after warm-up.\n\n{table}\n\n![loss curves]({png.name})\n"
        )
    return rows


if __name__ == "__main__":
    main()
