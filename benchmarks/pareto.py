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
printed.

With ``--rounds N`` (default 10; 0: off), every row of a model is then built
again on its own copy and timed in turn with the others
(:func:`benchmarks.step_time.time_configs`: one step of each per round, in a
shuffled order, ratios to ``compiled`` in the same round). The rows' step
columns then hold those medians, and the results file gives each ratio's
spread (lowest, highest over the rounds) and, per plan, the fastest
alternative whose peak is at or below the plan's (:func:`verdicts`).

Writes ``pareto.csv`` (the main job's row schema), ``pareto.png`` (step time
against activation peak) and ``pareto.md`` (the command, torch, the device,
the rows sorted by peak, the verdicts).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import platform
import shlex
import sys
import time

import torch

import savedhooks as sh
from benchmarks.__main__ import RESULTS
from benchmarks.configs import CONFIGS, Config, lowest_budget, memory_budget, plan_or_lowest, planned, planner_for
from benchmarks.models import MODELS, Workload, make_workload
from benchmarks.report import plot_pareto, table, write_csv
from benchmarks.run import MIB, Row, error_text, measure, reference_grads, row_line, with_baselines
from benchmarks.step_time import Timing, time_configs

__all__ = ["ALTERNATIVES", "CUDA_ALTERNATIVES", "MEMORY_BUDGETS", "Verdict", "document", "main", "run_model",
           "verdicts"]


# the alternatives measured next to the plans; on CUDA also host offload, torch's and ours
ALTERNATIVES = ("compiled", "checkpoint", "sh", "torch fp8")
CUDA_ALTERNATIVES = ("save_on_cpu", "sh offload", "torch offload")
MEMORY_BUDGETS = (0.1, 0.3, 0.5, 0.7, 0.9)  # torch's activation_memory_budget values measured by default


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A plan against the fastest alternative that reaches its peak, from steps timed in turn.

    Attributes:
        model: the benchmark model.
        plan: the plan's row name (``plan <label>``).
        peak_ratio: the plan's activation peak over the compiled step's.
        step: the plan's step time over the compiled step's, median over the rounds.
        spread: the lowest and highest per-round ratio of the plan's step.
        rival: the fastest alternative (no ``plan`` row) whose peak is at or
            below the plan's and whose gradients are finite; empty where none.
        rival_peak_ratio: its activation peak over the compiled step's.
        rival_step: its median step ratio.
        rival_spread: its lowest and highest per-round ratio.
        not_counted: alternatives at or below the plan's peak left out for
            non-finite gradients (a step that returns NaN does not train).
    """

    model: str
    plan: str
    peak_ratio: float
    step: float
    spread: tuple[float, float]
    rival: str = ""
    rival_peak_ratio: float | None = None
    rival_step: float | None = None
    rival_spread: tuple[float, float] | None = None
    not_counted: tuple[str, ...] = ()

    @property
    def plan_faster(self) -> bool:
        """The plan's median step ratio is at most the rival's (True where no alternative reaches its peak)."""
        return self.rival_step is None or self.step <= self.rival_step


def verdicts(rows: list[Row], timings: list[Timing]) -> list[Verdict]:
    """Each plan row against the fastest alternative whose measured peak is at or below the plan's.

    Alternatives whose gradients are not finite (NaN SQNR) are not counted: they
    are named in :attr:`Verdict.not_counted`.

    Args:
        rows: one model's (or several models') measured rows, ``compiled`` among them.
        timings: the same rows timed in turn (:func:`benchmarks.step_time.time_configs`).

    Returns:
        One :class:`Verdict` per plan row that has a peak and a timing, in row order.

    Raises:
        KeyError: a model has no ``compiled`` row with a peak.
    """
    timed = {(t.model, t.config): t for t in timings}
    ok = [r for r in rows if not r.error and r.activation_mib is not None and (r.model, r.config) in timed]
    compiled = {r.model: r.activation_mib for r in ok if r.config == "compiled"}
    out = []
    for plan in (r for r in ok if r.config.startswith("plan")):
        base = compiled[plan.model]
        mine = timed[(plan.model, plan.config)]
        reaching = [r for r in ok if r.model == plan.model and not r.config.startswith("plan")
                    and r.activation_mib <= plan.activation_mib]  # fmt: skip
        rivals = [r for r in reaching if not _non_finite(r)]
        verdict = Verdict(plan.model, plan.config, plan.activation_mib / base, mine.ratio, (mine.low, mine.high),
                          not_counted=tuple(r.config for r in reaching if _non_finite(r)))  # fmt: skip
        if rivals:
            best = min(rivals, key=lambda r: timed[(r.model, r.config)].ratio)
            t = timed[(best.model, best.config)]
            verdict = dataclasses.replace(verdict, rival=best.config, rival_peak_ratio=best.activation_mib / base,
                                          rival_step=t.ratio, rival_spread=(t.low, t.high))  # fmt: skip
        out.append(verdict)
    return out


def _non_finite(row: Row) -> bool:
    return row.grad_sqnr_db is not None and math.isnan(row.grad_sqnr_db)


def document(rows: list[Row], timings: list[Timing], command: str, heading: str) -> str:
    """The results page: the command and setting, each model's rows sorted by peak, the plans' verdicts.

    Args:
        rows: the measured rows (step columns from ``timings`` where given).
        timings: the rows timed in turn; empty when ``--rounds 0``.
        command: the command line that ran.
        heading: torch version, device and sizes.

    Returns:
        Markdown text.
    """
    timed = {(t.model, t.config): t for t in timings}
    if timings:
        steps = f"step times timed in turn ({timings[0].rounds} rounds; lowest and highest per-round ratio given)"
    else:
        steps = "step times measured right after each row's build"
    lines = [
        "# Peak against step time",
        "",
        f"`{command}`; {heading}. Written by the command: run it again to update this file.",
        "",
        f"Ratios over the compiled step without hooks, within this run; {steps}.",
        "",
    ]
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        base = next((r.activation_mib for r in mine if r.config == "compiled" and not r.error), None)
        lines += [
            f"## {model}",
            "",
            "| config | activation MiB | activation / compiled | step / compiled | lowest, highest | grad SQNR dB |",
            "|---|---:|---:|---:|---|---:|",
        ]
        for r in sorted(mine, key=lambda r: (r.error != "", -(r.activation_mib or 0.0))):
            if r.error:
                lines.append(f"| {r.config} | ✗ {r.error[:80]} | | | | |")
                continue
            t = timed.get((r.model, r.config))
            ratio = r.activation_mib / base if base and r.activation_mib is not None else None
            sqnr = "non-finite" if _non_finite(r) else _fmt(r.grad_sqnr_db, "{:.1f}")
            spread = f"{t.low:.2f}, {t.high:.2f}" if t else ""
            step = t.ratio if t else r.step_ratio
            lines.append(f"| {r.config} | {_fmt(r.activation_mib, '{:.1f}')} | {_fmt(ratio, '{:.2f}')} | "
                         f"{_fmt(step, '{:.2f}')} | {spread} | {sqnr} |")  # fmt: skip
        lines.append("")
    found = verdicts(rows, timings) if timings else []
    if found:
        lines += [
            "## Each plan against the fastest alternative at or below its peak",
            "",
            ("| model | plan | peak | step (lowest, highest) | fastest alternative | its peak | its step (lowest, "
             "highest) | plan no slower | not counted: non-finite gradients |"),
            "|---|---|---:|---|---|---:|---|---|---|",
        ]
        for v in found:
            rival = "none reaches this peak | | "
            if v.rival:
                rival = (f"{v.rival} | {v.rival_peak_ratio:.2f} | {v.rival_step:.2f} ({v.rival_spread[0]:.2f}, "
                         f"{v.rival_spread[1]:.2f})")  # fmt: skip
            lines.append(f"| {v.model} | {v.plan} | {v.peak_ratio:.2f} | {v.step:.2f} ({v.spread[0]:.2f}, "
                         f"{v.spread[1]:.2f}) | {rival} | {'yes' if v.plan_faster else 'no'} | "
                         f"{', '.join(v.not_counted)} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def _fmt(value: float | None, fmt: str) -> str:
    return "" if value is None else fmt.format(value)


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
    rounds: int = 0,
) -> tuple[list[Row], list[Timing]]:
    """Measure one model's rows, then time them in turn (see the module docstring).

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
        rounds: rounds of steps timed in turn (0: none; the rows keep the step times measured with them).

    Returns:
        The rows, with ratios filled in (step columns from the timings where
        ``rounds``), and the timings (empty without ``rounds``).

    Raises:
        Whatever building or running a configuration raises.
    """
    workload = make_workload(name, size, device)
    workload.compiled_loss = not eager_loss
    reference = reference_grads(workload)
    alternatives = ALTERNATIVES + (CUDA_ALTERNATIVES if device == "cuda" else ())
    built: dict[str, Config] = {c: CONFIGS[c] for c in alternatives}
    built |= {c.name: c for c in map(memory_budget, memory_budgets)}
    rows = [_measured(workload, config, device, repeats, reference) for config in built.values()]
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
        config = built[f"plan {label}"] = planned(label, plan)
        rows.append(_measured(workload, config, device, repeats, reference, plan.predicted_peak_bytes))
    rows = with_baselines(rows)
    if not rounds:
        return rows, []
    del workload, planner  # the timed copies are built afresh
    names = [r.config for r in rows if not r.error]
    extra = {n: c for n, c in built.items() if n not in CONFIGS}
    timings = time_configs(name, names, size, "inductor", device, rounds, not eager_loss, extra=extra)
    by_name = {t.config: t for t in timings}
    rows = [dataclasses.replace(r, step_ms=by_name[r.config].step_ms, step_ratio=by_name[r.config].ratio)
            if r.config in by_name else r for r in rows]  # fmt: skip
    return rows, timings


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
    parser.add_argument("--memory-budgets", nargs="*", type=float, default=list(MEMORY_BUDGETS),
                        help="torch activation_memory_budget values (default "
                             f"{' '.join(map(str, MEMORY_BUDGETS))})")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per row as it is measured (default 3)")
    parser.add_argument("--rounds", type=int, default=10,
                        help="then time every row of a model in turn, this many rounds (default 10; 0: off)")
    parser.add_argument("--eager-loss", action="store_true", help="run the loss eagerly (default: compiled with it)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where to run (cuda adds save_on_cpu and sh offload rows; default cpu)")
    parser.add_argument("--min-sqnr-db", type=float, default=None,
                        help="the plans' fidelity limit: sh.plan(..., min_sqnr_db=...) (default none)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS,
                        help="folder for pareto.csv, pareto.png and pareto.md")
    args = parser.parse_args(argv)
    if args.rounds < 0:
        parser.error("--rounds must be >= 0")
    command = " ".join(["python -m benchmarks.pareto", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    start = time.perf_counter()
    rows, timings = [], []
    for name in args.models:
        got, timed = run_model(
            name, args.size, args.fractions, args.memory_budgets, args.repeats, args.eager_loss, args.device,
            args.min_sqnr_db, args.rounds,
        )
        rows, timings = rows + got, timings + timed
    print(table(rows))
    machine = f"{platform.machine()}, {torch.get_num_threads()} threads"
    if args.device == "cuda":
        machine = torch.cuda.get_device_name()
    heading = (f"torch {torch.__version__}, {args.device} ({machine}), inductor, size {args.size:g}, "
               f"loss {'eager' if args.eager_loss else 'compiled with the model'}, "
               f"{time.perf_counter() - start:.0f} s")
    text = document(rows, timings, command, heading)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    md = args.out / "pareto.md"
    md.write_text(text)
    csv = write_csv(rows, args.out / "pareto.csv")
    png = plot_pareto(rows, args.out / "pareto.png", title=f"{args.device.upper()}, inductor, --size {args.size:g}")
    print(f"\n{len(rows)} rows, {time.perf_counter() - start:.0f} s; wrote {csv}, {png}, {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
