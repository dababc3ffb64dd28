"""What planning costs and how right its memory model is: ``sh.plan`` against one compiled step, per model.

``python -m benchmarks.plan_time [--models NAME ...] [--out docs/results/plan_time.md]``
runs each model in a fresh process, one at a time (the times are ratios within
that process), and per model measures:

- ``first``: plain ``torch.compile`` (inductor, no FX graph or AOTAutograd
  cache read), its first step timed: compiling and running one step without
  hooks, what a user pays anyway; then its activation peak (a later step);
- ``sh.policy()`` around the same compile: its peak;
- ``sh.plan`` at 0.7 of that peak, timed from the call to its return: the
  planning time over ``first``, the compiles and training steps it ran
  (``plan.compiles``, ``plan.steps``); its modelled peak without hooks
  (``plan.baseline_peak_bytes``) over the measured one; its floor over the
  policy's measured peak (at most 1: the floor is never above what the policy
  alone reaches); and the plan applied and compiled, its measured peak over
  the budget. An infeasible budget gives the error's floor.

Models: ``llama-4x256`` (a transformers Llama, hidden 256, MLP 768, 4 layers, 8
heads, 4 KV heads, vocabulary 8000; batch 4, sequence 256), and the zoo's
entries (:mod:`benchmarks.zoo`, size ``tiny``, dropout off). Rows go to a JSONL
file beside the page as each model ends (a rerun of some models replaces their rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import pathlib
import platform
import statistics
import sys
import time
import traceback
import warnings
from typing import Any

import torch

import savedhooks as sh
from benchmarks.sweep import _cold_compiles, _warm_up
from benchmarks.zoo import MIB, PLAN_FRACTION, _compiled, _measure, _policy, error_text, step_fn
from benchmarks.zoo_entries import ZOO

__all__ = ["MODELS", "PlanTimeRow", "build", "document", "main", "measure"]

LLAMA = "llama-4x256"
MODELS = (LLAMA, *ZOO)
OUT = pathlib.Path("docs/results/plan_time.md")
COMMAND = "python -m benchmarks.plan_time"


@dataclasses.dataclass
class PlanTimeRow:
    """One model's row (MiB and seconds; ratios as described in the module docstring).

    Attributes:
        name: the model.
        first_s: seconds to compile and run the first step without hooks.
        base_mib: the compiled step's measured peak without hooks.
        policy_mib: the compiled ``sh.policy()`` step's measured peak.
        budget_mib: the plan's budget.
        plan_s: seconds ``sh.plan`` took.
        compiles: compiles of the model that planning ran.
        steps: training steps that planning ran.
        modelled_base_mib: the planner's modelled peak without hooks.
        floor_mib: the planner's modelled floor (or an infeasible budget's floor).
        plan_mib: the plan's measured peak (None: infeasible).
        error: what raised, if anything.
    """

    name: str
    first_s: float | None = None
    base_mib: float | None = None
    policy_mib: float | None = None
    budget_mib: float | None = None
    plan_s: float | None = None
    compiles: int | None = None
    steps: int | None = None
    modelled_base_mib: float | None = None
    floor_mib: float | None = None
    plan_mib: float | None = None
    error: str = ""


def build(name: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor], Any]:
    """A model by name: ``(module, keyword inputs, loss of the output)``.

    Raises:
        KeyError: an unknown name.
    """
    if name == LLAMA:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                             num_key_value_heads=4, vocab_size=8000)  # fmt: skip
        ids = torch.randint(0, 8000, (4, 256))
        return LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}, lambda out: out.loss
    entry = ZOO[name]
    model, inputs = entry.build("tiny", dropout=False)
    return model, inputs, entry.loss_of


def measure(name: str) -> PlanTimeRow:
    """One model's row (see the module docstring); an exception is recorded in ``error``."""
    row = PlanTimeRow(name)
    try:
        _measure_into(row, name)
    except Exception as exc:
        row.error = error_text(exc)
        traceback.print_exc()
    return row


def _measure_into(row: PlanTimeRow, name: str) -> None:
    model, inputs, loss_of = build(name)
    with _cold_compiles(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="sh.plan: ", category=UserWarning)
        _warm_up()
        began = time.perf_counter()
        step = step_fn(_compiled(model), model, inputs, loss_of)
        step()
        row.first_s = time.perf_counter() - began
        base, _ = _measure(step, model, steps=0)
        row.base_mib = base / MIB
        row.policy_mib = _measure(step_fn(_compiled(model), model, inputs, loss_of, _policy), model)[0] / MIB
        torch._dynamo.reset()
        budget = int(PLAN_FRACTION * base)
        row.budget_mib = budget / MIB
        began = time.perf_counter()
        try:
            chosen = sh.plan(model, inputs, budget_bytes=budget, loss_fn=loss_of)
        except sh.InfeasibleBudgetError as exc:
            row.plan_s = time.perf_counter() - began
            row.floor_mib = None if exc.floor_bytes is None else exc.floor_bytes / MIB
            row.modelled_base_mib = None if exc.baseline_bytes is None else exc.baseline_bytes / MIB
            row.error = "infeasible"
            return
        row.plan_s = time.perf_counter() - began
        row.compiles, row.steps = chosen.compiles, chosen.steps
        row.modelled_base_mib = chosen.baseline_peak_bytes / MIB
        row.floor_mib = chosen.floor_bytes / MIB
        chosen.apply(model)
        try:
            hooks = chosen.hooks
            peak, _ = _measure(step_fn(_compiled(model), model, inputs, loss_of, lambda: sh.saved_tensors_hooks(hooks)),
                               model, steps=2)  # fmt: skip
        finally:
            chosen.revert(model)
        row.plan_mib = peak / MIB


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _fmt(value: float | int | None, fmt: str) -> str:
    return "" if value is None else fmt.format(value)


_COLUMNS = (
    ("model", lambda r: r.name, "{}"),
    ("first step s", lambda r: r.first_s, "{:.1f}"),
    ("plan s", lambda r: r.plan_s, "{:.1f}"),
    ("plan / first step", lambda r: _ratio(r.plan_s, r.first_s), "{:.2f}"),
    ("compiles", lambda r: r.compiles, "{}"),
    ("steps", lambda r: r.steps, "{}"),
    ("base MiB", lambda r: r.base_mib, "{:.2f}"),
    ("modelled base / measured", lambda r: _ratio(r.modelled_base_mib, r.base_mib), "{:.3f}"),
    ("policy MiB", lambda r: r.policy_mib, "{:.2f}"),
    ("floor / policy", lambda r: _ratio(r.floor_mib, r.policy_mib), "{:.3f}"),
    ("budget MiB", lambda r: r.budget_mib, "{:.2f}"),
    ("plan / budget", lambda r: _ratio(r.plan_mib, r.budget_mib), "{:.3f}"),
    ("error", lambda r: r.error, "{}"),
)


def document(rows: list[PlanTimeRow], header: str) -> str:
    """The results page: the header line, a summary, and one row per model."""
    ratios = [r.plan_s / r.first_s for r in rows if r.plan_s and r.first_s]
    model_errors = [abs(r.modelled_base_mib / r.base_mib - 1) for r in rows if r.modelled_base_mib and r.base_mib]
    floors = [r.floor_mib / r.policy_mib for r in rows if r.floor_mib and r.policy_mib]
    plans = [r.plan_mib / r.budget_mib for r in rows if r.plan_mib and r.budget_mib]
    lines = ["# Planning time and the planner's memory model", "", header, "", (
        f"{len(rows)} models. Planning time over the first compiled step: median "
        f"{_fmt(statistics.median(ratios) if ratios else None, '{:.2f}')}x, largest "
        f"{_fmt(max(ratios, default=None), '{:.2f}')}x. Modelled peak without hooks within 5 % of the measured on "
        f"{sum(e <= 0.05 for e in model_errors)} of {len(model_errors)}; floor at or below the policy's measured "
        f"peak on {sum(f <= 1 for f in floors)} of {len(floors)}; plan within 1.05 of its budget on "
        f"{sum(p <= 1.05 for p in plans)} of {len(plans)}."
    ), "", "| " + " | ".join(c[0] for c in _COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(get(row), fmt) for _, get, fmt in _COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def _load(path: pathlib.Path) -> dict[str, PlanTimeRow]:
    if not path.exists():
        return {}
    rows = [PlanTimeRow(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    return {r.name: r for r in rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS, metavar="MODEL",
                        help=f"models to run (default: all): {', '.join(MODELS)}")
    parser.add_argument("--out", type=pathlib.Path, default=OUT, help="markdown page (its rows in a .jsonl beside it)")
    args = parser.parse_args(argv)
    rows_file = args.out.with_suffix(".jsonl")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = _load(rows_file)
    began = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    with context.Pool(1, maxtasksperchild=1) as pool:  # a fresh process per model: compile caches and state
        for name in args.models:
            row = pool.apply(measure, (name,))
            rows[name] = row
            print(f"{name}: plan {_fmt(_ratio(row.plan_s, row.first_s), '{:.2f}')}x {row.error}", file=sys.stderr,
                  flush=True)  # fmt: skip
            rows_file.write_text("".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in rows.values()))
            _write_page(args.out, rows, time.perf_counter() - began)  # after each model: a stopped run keeps its rows
    return 0


def _write_page(out: pathlib.Path, rows: dict[str, PlanTimeRow], seconds: float) -> None:
    ordered = [rows[n] for n in MODELS if n in rows]
    header = (f"`{COMMAND}`; torch {torch.__version__}, savedhooks {sh.__version__}; device cpu ({platform.machine()}, "
              f"{os.cpu_count()} cores; one model at a time); last run {seconds:.0f} s. "
              f"Budget: {PLAN_FRACTION} of the compiled step's peak.")  # fmt: skip
    out.write_text(document(ordered, header))


if __name__ == "__main__":
    raise SystemExit(main())
