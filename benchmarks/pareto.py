"""Peak against step time: ``sh.plan`` at several budgets next to what users would otherwise pick.

``python -m benchmarks.pareto --models gpt2 llama --size 8`` measures, per model,
under inductor (plain ``torch.compile``), with the loss compiled with the model
(``--eager-loss``: run it eagerly on the compiled model's output):

* ``compiled``: no hooks (the reference for the ratios);
* ``checkpoint``: ``torch.utils.checkpoint`` per block;
* ``sh``: fp8 for every saved floating tensor (``sh.fp8()``);
* ``torch fp8``: torch's own fp8 activation pass (:data:`benchmarks.torch_options.TORCH_FP8`);
* ``budget <f>``: torch's min-cut partitioner under ``activation_memory_budget=f``;
* ``plan checkpoint``: ``sh.plan`` with ``budget_bytes`` = the checkpoint row's
  measured activation peak (a plan must fit what checkpointing reaches); a plan recomputes
  the blocks it chose (``plan.apply``) and packs with ``plan.hooks``;
* ``plan <f>``: ``sh.plan`` at ``f`` of its modelled no-hook peak, and
  ``plan floor`` at the lowest peak it can reach: the modelled floor, or the
  lowest checked peak where a plan with every candidate packed peaks below it
  with its hooks (:func:`benchmarks.configs.lowest_budget`) or every plan
  checked at it peaks above (:func:`benchmarks.configs.plan_or_lowest`); with ``--min-sqnr-db``, every
  plan under that fidelity limit (``sh.plan(..., min_sqnr_db=...)``; the floor row at the lowest budget
  found that meets it, and each plan's predicted SQNR printed with its log).

Each row is measured as the main job measures (``benchmarks.run.measure``: one
warm-up step, the peak of one step, the median of ``--repeats`` steps, the
worst parameter-gradient SQNR against eager without hooks); a plan's
``predicted_mib`` is its modelled peak. The model is surveyed once per
recompute setting (``sh.planner.Planner``) and planned per budget; the log of
each plan (which recompute settings met the budget, at what modelled time) is
printed. Writes ``pareto.csv`` (the main
job's row schema) and ``pareto.png`` (step time against activation peak).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import time

import torch

import savedhooks as sh
from benchmarks.__main__ import RESULTS
from benchmarks.configs import CONFIGS, Config, lowest_budget, memory_budget, plan_or_lowest, planned, planner_for
from benchmarks.models import MODELS, Workload, make_workload
from benchmarks.report import plot_pareto, table, write_csv
from benchmarks.run import MIB, Row, error_text, measure, reference_grads, row_line, with_baselines

__all__ = ["ALTERNATIVES", "CUDA_ALTERNATIVES", "main", "run_model"]


# the alternatives measured next to the plans; on CUDA also host offload, torch's and ours
ALTERNATIVES = ("compiled", "checkpoint", "sh", "torch fp8")
CUDA_ALTERNATIVES = ("save_on_cpu", "sh offload", "torch offload")


def _measured(
    workload: Workload, config: Config, device: str, repeats: int, reference, predicted: int | None = None
) -> Row:
    try:
        row, _ = measure(workload, config, "inductor", device, repeats, reference)
    except Exception as exc:  # one failing alternative must not end the run (the plans' own errors do)
        if config.name.startswith("plan"):
            raise
        row = Row(workload.name, config.name, "inductor", device, error=error_text(exc))
        print(f"FAILED {workload.name} / {config.name}: {row.error}", flush=True)
        return row
    row = row if predicted is None else dataclasses.replace(row, predicted_mib=predicted / MIB)
    print(row_line(row), flush=True)  # each row as it is measured: a run cut short keeps what it did
    return row


def run_model(
    name: str,
    size: float,
    fractions: list[float],
    memory_budgets: list[float],
    repeats: int,
    eager_loss: bool,
    device: str = "cpu",
    min_sqnr_db: float | None = None,
) -> list[Row]:
    """Measure one model's rows (see the module docstring).

    Args:
        name: a model of ``benchmarks.models.MODELS``.
        size: batch multiplier.
        fractions: plan budgets as fractions of the modelled no-hook peak.
        memory_budgets: torch's ``activation_memory_budget`` values.
        repeats: timed steps per row.
        eager_loss: run the loss eagerly instead of compiling it with the model.
        device: ``"cpu"``, or ``"cuda"`` (adds :data:`CUDA_ALTERNATIVES`; the
            plans may then offload).
        min_sqnr_db: the plans' fidelity limit (``sh.plan(..., min_sqnr_db=...)``), or None.

    Returns:
        The rows, with ratios filled in.

    Raises:
        Whatever building or running a configuration raises.
    """
    workload = make_workload(name, size, device)
    workload.compiled_loss = not eager_loss
    reference = reference_grads(workload)
    alternatives = ALTERNATIVES + (CUDA_ALTERNATIVES if device == "cuda" else ())
    rows = [_measured(workload, CONFIGS[c], device, repeats, reference) for c in alternatives]
    rows += [_measured(workload, memory_budget(f), device, repeats, reference) for f in memory_budgets]
    planner = planner_for(workload, "inductor", min_sqnr_db)
    checkpoint = next(r for r in rows if r.config == "checkpoint")
    budgets = {} if checkpoint.error else {"checkpoint": int(checkpoint.activation_mib * MIB)}
    budgets |= {f"{f:g}": int(f * planner.baseline_bytes) for f in fractions}
    budgets["floor"] = lowest = lowest_budget(planner)
    for label, budget in budgets.items():
        if budget < lowest:
            print(f"{name}: plan {label}: {budget / MIB:.1f} MiB is below the floor {lowest / MIB:.1f}")
            continue
        try:
            plan = plan_or_lowest(planner, budget) if label == "floor" else planner.plan(budget)
        except (sh.InfeasibleBudgetError, sh.InfeasibleFidelityError) as error:  # checked, or min_sqnr_db
            print(f"{name}: plan {label}: {error}")
            continue
        chosen = "; ".join(line for line in plan.log if line.startswith(("recompute", "kept", "fidelity")))
        print(f"{name}: plan {label}: {chosen}")
        rows.append(_measured(workload, planned(label, plan), device, repeats, reference, plan.predicted_peak_bytes))
    return with_baselines(rows)


def main(argv: list[str] | None = None) -> int:
    """Run the models, print the table, write the CSV and the plot.

    Args:
        argv: the command line (default ``sys.argv[1:]``).

    Returns:
        0.

    Raises:
        SystemExit: bad flags.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pareto", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"], choices=list(MODELS), metavar="MODEL")
    parser.add_argument("--size", type=float, default=8.0, help="batch multiplier (default 8)")
    parser.add_argument("--fractions", nargs="*", type=float, default=[0.8, 0.6],
                        help="plan budgets as fractions of the modelled no-hook peak (default 0.8 0.6)")
    parser.add_argument("--memory-budgets", nargs="*", type=float, default=[0.3, 0.6],
                        help="torch activation_memory_budget values (default 0.3 0.6)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per row (default 3)")
    parser.add_argument("--eager-loss", action="store_true", help="run the loss eagerly (default: compiled with it)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where to run (cuda adds save_on_cpu and sh offload rows; default cpu)")
    parser.add_argument("--min-sqnr-db", type=float, default=None,
                        help="the plans' fidelity limit: sh.plan(..., min_sqnr_db=...) (default none)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS, help="folder for pareto.csv and pareto.png")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    start = time.perf_counter()
    rows = []
    for name in args.models:
        rows += run_model(
            name, args.size, args.fractions, args.memory_budgets, args.repeats, args.eager_loss, args.device,
            args.min_sqnr_db,
        )
    print(table(rows))
    csv = write_csv(rows, args.out / "pareto.csv")
    png = plot_pareto(rows, args.out / "pareto.png", title=f"{args.device.upper()}, inductor, --size {args.size:g}")
    print(f"\n{len(rows)} rows, {time.perf_counter() - start:.0f} s; wrote {csv}, {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
