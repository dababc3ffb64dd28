"""The sweep: every architecture transformers ships with a training head, one training step each, with and without savedhooks.

``python -m benchmarks.sweep [--tier eager|compiled|plan] [--heads ...] [--only ...] [--shard K/N] [--jobs N]
[--timeout S] [--redo]`` builds each architecture of
:func:`benchmarks.sweep_models.architectures` (its config's defaults, sizes
shrunk: :mod:`benchmarks.sweep_models`) and measures, per tier:

- ``eager``: the eager step without hooks, and with ``sh.policy()``: peak
  ratio and the worst parameter gradient's SQNR (rounding-noise gradients
  skipped) with its name;
- ``compiled``: the same under plain ``torch.compile`` (inductor);
- ``plan``: the compiled step without hooks and with ``sh.policy()``, then
  ``sh.plan`` at 0.7 of the compiled peak, applied and compiled: measured peak
  over the budget, predicted peak over measured, gradient SQNR, planning time.

Each row gets a status (:data:`STATUSES`): ``ok``; ``unbuilt`` (the
architecture does not build from its shrunk defaults, or lacks a library);
``transformers`` (the step without hooks fails: transformers' own failure);
``refused`` (savedhooks raised one of its own errors, which names what it does
not support; in the plan tier also an ``InfeasibleBudgetError`` whose floor is
at or below the measured ``sh.policy()`` peak, measured with the model's KV
cache off where ``sh.plan`` turns it off); ``failure`` (a crash from
inside savedhooks or torch with hooks, a gradient below
:data:`GRADIENT_DB` dB, a plan above :data:`PLAN_LIMIT` of its budget, or a
time-out). Rows are appended to ``docs/results/sweep/<tier>.jsonl`` as they
end, so that a run can stop and go on (``--redo`` measures again what is
there); ``docs/results/sweep.md`` is written from every tier's rows.
Architectures run ``--jobs`` at once in spawned worker processes, each with
its share of the threads.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import multiprocessing
import os
import pathlib
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

import savedhooks as sh
from savedhooks.planner.caches import cache_configs, caches_off
from benchmarks.sweep_models import HEADS, KINDS, Architecture, architectures, build, family_kind, loss_of
from benchmarks.zoo import (
    MIB,
    PLAN_FRACTION,
    MeasurementTimeout,
    _compiled,
    _measure,
    _policy,
    _time_limit,
    error_text,
    step_fn,
)

__all__ = ["GRADIENT_DB", "PLAN_LIMIT", "STATUSES", "TIERS", "SweepRow", "compiled_part", "document", "loaded", "measure", "run"]

TIERS = ("eager", "compiled", "plan")
STATUSES = ("ok", "refused", "failure", "transformers", "unbuilt")
GRADIENT_DB = 20.0  # a policy or plan gradient below this is a failure
PLAN_LIMIT = 1.05  # a plan's measured peak above this share of its budget is a failure
RESULTS = pathlib.Path("docs/results/sweep")
PAGE = pathlib.Path("docs/results/sweep.md")


@dataclasses.dataclass
class SweepRow:
    """One architecture's step in one tier: the schema of the JSONL files and the page's tables.

    Attributes:
        name: ``head/model_type``.
        tier: a key of :data:`TIERS`.
        status: a key of :data:`STATUSES`.
        params_mib: the parameters' bytes.
        base_mib: the step without hooks (eager, or compiled in the other tiers): its activation peak.
        policy_ratio: the step with ``sh.policy()`` over ``base_mib``.
        policy_db: its worst parameter gradient's SQNR against the step without hooks.
        policy_worst: that parameter's name.
        bf16_db: where the policy's gradient is below :data:`GRADIENT_DB`: the
            worst gradient with every floating saved tensor stored in bf16
            (``sh.downcast(torch.bfloat16)``), the rounding users know from
            bf16 training; below the bar too, the gradient is ill-conditioned
            (its terms cancel) and no lossy codec holds it.
        plan_ratio: (plan tier) the plan's measured peak over its budget (0.7 of ``base_mib``).
        plan_db: the plan's worst gradient SQNR.
        plan_predicted: the plan's predicted peak over its measured peak.
        plan_s: seconds ``sh.plan`` took.
        floor_mib: the planner's floor (its lowest modelled or checked peak; an
            ``InfeasibleBudgetError``'s floor where it raised one).
        plan_baseline: the planner's modelled peak without hooks over the measured one (``base_mib``).
        policy_planned_mib: (plan tier) where the planner's floor is above the policy's peak and the model has
            a KV cache on (``use_cache``), which ``sh.plan`` turns off (``Plan.apply``): the policy's peak
            measured with the cache off, as the plan trains; the floor is compared with it.
        base_s: the first step without hooks: in the compiled tiers its compile and one step (the process
            warmed up first by a small compiled step of its own, as ``sh.plan`` is).
        seconds: the row's wall time.
        error: what failed (type and first line), or why the status is not ``ok``.
    """

    name: str
    tier: str
    status: str = "ok"
    params_mib: float | None = None
    base_mib: float | None = None
    policy_ratio: float | None = None
    policy_db: float | None = None
    policy_worst: str = ""
    bf16_db: float | None = None
    plan_ratio: float | None = None
    plan_db: float | None = None
    plan_predicted: float | None = None
    plan_s: float | None = None
    floor_mib: float | None = None
    plan_baseline: float | None = None
    policy_planned_mib: float | None = None
    base_s: float | None = None
    seconds: float | None = None
    error: str = ""


class _Refused(Exception):
    """savedhooks refused the architecture with one of its own errors."""


def _is_savedhooks_error(exc: BaseException) -> bool:
    """Whether ``exc`` is one of savedhooks' own exception types (which say what is not supported)."""
    return type(exc).__module__.startswith("savedhooks.")


class _Transformers(Exception):
    """The step without hooks failed."""


def _reference(body: Callable[[], Any]) -> Any:
    try:
        return body()
    except MeasurementTimeout:
        raise
    except Exception as exc:
        raise _Transformers(error_text(exc)) from exc


def _hooked(body: Callable[[], Any]) -> Any:
    try:
        return body()
    except Exception as exc:
        if _is_savedhooks_error(exc) or _is_savedhooks_error(getattr(exc, "inner_exception", None) or exc):
            raise _Refused(error_text(exc)) from exc
        raise


def _gradient_check(row: SweepRow, db: float, name: str | None, what: str) -> None:
    if row.status == "ok" and not db >= GRADIENT_DB:
        row.status, row.error = "failure", f"{what} gradient {db:.1f} dB ({name})"


def measure(arch: Architecture, tier: str, timeout_s: float | None = None) -> SweepRow:
    """One architecture's row in one tier (see the module docstring); never raises for what the step raises.

    Args:
        arch: the architecture.
        tier: a key of :data:`TIERS`.
        timeout_s: the row's time limit (None: none); past it, status ``failure``.

    Returns:
        A :class:`SweepRow`.

    Raises:
        KeyError: an unknown tier.
    """
    if tier not in TIERS:
        raise KeyError(f"unknown tier {tier!r}; choose from {', '.join(TIERS)}")
    row, began = SweepRow(arch.name, tier), time.perf_counter()
    try:
        with _time_limit(timeout_s), warnings.catch_warnings(), _cold_compiles():
            warnings.simplefilter("ignore")
            _measure_into(row, arch, tier)
    except _Transformers as exc:
        row.status, row.error = "transformers", str(exc)
    except _Refused as exc:
        row.status, row.error = "refused", str(exc)
    except Exception as exc:  # a crash with hooks, or the time limit
        row.status, row.error = "failure", error_text(exc)
        traceback.print_exc(limit=-4)
    finally:
        torch._dynamo.reset()
    row.seconds = time.perf_counter() - began
    return row


def _measure_into(row: SweepRow, arch: Architecture, tier: str) -> None:
    try:
        model, inputs = build(arch)
    except MeasurementTimeout:
        raise
    except Exception as exc:
        row.status, row.error = "unbuilt", error_text(exc)
        return
    row.params_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / MIB

    def fn() -> Any:
        return model if tier == "eager" else _compiled(model)

    if tier != "eager":
        _warm_up()
    first: list[float] = []
    step = _first_timed(step_fn(fn(), model, inputs, loss_of), first)
    base, want = _reference(lambda: _measure(step, model))
    row.base_s = first[0] if first else None
    row.base_mib = base / MIB
    peak, got = _hooked(lambda: _measure(step_fn(fn(), model, inputs, loss_of, _policy), model))
    row.policy_ratio = peak / base
    db, row.policy_worst = sh.metrics.worst_sqnr(want, got)
    row.policy_db = db
    _gradient_check(row, db, row.policy_worst, "policy")
    if not db >= GRADIENT_DB:
        bf16 = lambda: sh.saved_tensors_hooks(sh.downcast(torch.bfloat16))  # noqa: E731
        _, rounded = _measure(step_fn(fn(), model, inputs, loss_of, bf16), model)
        row.bf16_db, _ = sh.metrics.worst_sqnr(want, rounded)
    if tier == "plan":
        _plan_into(row, model, inputs, base, peak, want)


def _cold_compiles() -> contextlib.ExitStack:
    """Compiles that trace (no FX graph or AOTAutograd cache read from disk): timed as a first compile, as the planner's."""
    import torch._functorch.config
    import torch._inductor.config

    stack = contextlib.ExitStack()
    stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
    stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
    return stack


@functools.cache
def _warm_up() -> None:
    """Compile and run a small training step once per process: what any first compile pays, paid before timing."""
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    torch.compile(net)(torch.randn(8, 16)).sum().backward()
    torch._dynamo.reset()


def _first_timed(step: Callable[[], None], into: list[float]) -> Callable[[], None]:
    """``step``, appending the seconds its first call took to ``into``."""

    def run() -> None:
        began = time.perf_counter()
        step()
        if not into:
            into.append(time.perf_counter() - began)

    return run


def _plan_into(row: SweepRow, model: Any, inputs: dict[str, torch.Tensor], base: int, policy_peak: int,
               want: dict[str, torch.Tensor | None]) -> None:  # fmt: skip
    budget = int(PLAN_FRACTION * base)
    began = time.perf_counter()
    try:
        chosen = _hooked(lambda: sh.plan(model, inputs, budget_bytes=budget, loss_fn=loss_of))
    except _Refused as exc:
        cause = exc.__cause__
        if isinstance(cause, sh.InfeasibleBudgetError) and cause.floor_bytes is not None:
            row.floor_mib, row.plan_baseline = cause.floor_bytes / MIB, cause.baseline_bytes / base
            if cause.floor_bytes > policy_peak and cache_configs(model):
                policy_peak = _policy_as_planned(model, inputs)
                row.policy_planned_mib = policy_peak / MIB
            if cause.floor_bytes <= policy_peak and row.status == "ok":
                row.status, row.error = "refused", f"infeasible: floor {row.floor_mib:.2f} MiB"
                return
            cache = " (KV cache off, as the plan trains)" if row.policy_planned_mib is not None else ""
            row.status = "failure"
            row.error = (f"infeasible: floor {row.floor_mib:.2f} MiB above the policy's {policy_peak / MIB:.2f} MiB"
                         f"{cache}")  # fmt: skip
            return
        raise
    finally:
        row.plan_s = time.perf_counter() - began
    chosen.apply(model)
    try:
        hooks = chosen.hooks
        step = step_fn(_compiled(model), model, inputs, loss_of, lambda: sh.saved_tensors_hooks(hooks))
        peak, got = _hooked(lambda: _measure(step, model, steps=2))
    finally:
        chosen.revert(model)
    row.plan_ratio = peak / budget
    row.plan_predicted = chosen.predicted_peak_bytes / peak
    row.floor_mib, row.plan_baseline = chosen.floor_bytes / MIB, chosen.baseline_peak_bytes / base
    row.plan_db, worst = sh.metrics.worst_sqnr(want, got)
    _gradient_check(row, row.plan_db, worst, "plan")
    if row.status == "ok" and row.plan_ratio > PLAN_LIMIT:
        row.status, row.error = "failure", f"plan at {row.plan_ratio:.2f} of its budget"


def _policy_as_planned(model: Any, inputs: dict[str, torch.Tensor]) -> int:
    """The compiled ``sh.policy()`` step's peak with the model's KV caches off, as ``sh.plan`` plans and trains it.

    A transformers model's training step can peak otherwise with ``use_cache`` on
    than off (another mask or attention path), so a planner's floor is compared
    with the policy's peak in the configuration the plan runs in.
    """
    with caches_off(model):
        peak, _ = _hooked(lambda: _measure(step_fn(_compiled(model), model, inputs, loss_of, _policy), model))
    return peak


# ---------------------------------------------------------------------------------------------------- files


def load(tier: str, results: pathlib.Path = RESULTS) -> dict[str, SweepRow]:
    """The rows of one tier's JSONL file by name (the last of a name wins); empty when there is none.

    Args:
        tier: a key of :data:`TIERS`.
        results: the folder of the JSONL files.

    Returns:
        ``{name: SweepRow}``.
    """
    path = results / f"{tier}.jsonl"
    rows: dict[str, SweepRow] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = SweepRow(**json.loads(line))
                rows[row.name] = row
    return rows


def compiled_part(row: SweepRow) -> SweepRow:
    """A plan tier row's compiled step without hooks and with ``sh.policy()``: the compiled tier's row for it.

    The plan tier measures both before it plans; the plan's own outcome (its
    peak, gradient, refusal, crash or time-out) is left out.

    Args:
        row: a plan tier row.

    Returns:
        A compiled tier row: the plan row's status where the policy's step did
        not end (the build, the step without hooks or the policy's step failed
        or was refused), else ok or a failure by the policy's gradient.
    """
    # base_s stays: the compiled step's
    out = dataclasses.replace(row, tier="compiled", plan_ratio=None, plan_db=None, plan_predicted=None, plan_s=None,
                              floor_mib=None, plan_baseline=None, policy_planned_mib=None)  # fmt: skip
    if row.policy_ratio is None:
        return out
    out.status, out.error = "ok", ""
    _gradient_check(out, row.policy_db if row.policy_db is not None else math.nan, row.policy_worst, "policy")
    return out


def loaded(results: pathlib.Path = RESULTS) -> dict[str, dict[str, SweepRow]]:
    """Every tier's rows by name; the compiled tier also holds the plan tier's compiled steps (:func:`compiled_part`).

    Args:
        results: the folder of the JSONL files.

    Returns:
        ``{tier: {name: row}}``; a compiled tier row of its own wins over one from the plan tier.
    """
    tiers = {tier: load(tier, results) for tier in TIERS}
    tiers["compiled"] = {**{n: compiled_part(r) for n, r in tiers["plan"].items()}, **tiers["compiled"]}
    return tiers


def _append(row: SweepRow, results: pathlib.Path) -> None:
    results.mkdir(parents=True, exist_ok=True)
    with (results / f"{row.tier}.jsonl").open("a") as f:
        f.write(json.dumps(dataclasses.asdict(row), allow_nan=True) + "\n")


def _fmt(value: float | None, fmt: str) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    return fmt.format(value)


def _table(rows: list[SweepRow], tier: str) -> list[str]:
    plan = tier == "plan"
    header = ["architecture", "kind", "status", "params MiB", "base MiB", "policy / base", "policy dB", "bf16 dB"]
    header += ["plan / budget", "plan dB", "predicted / measured", "modelled base / base", "floor / policy",
               "plan s", "plan s / base s"] if plan else []  # fmt: skip
    header += ["s", "worst gradient, or what failed"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [r.name, _kind(r.name), r.status, _fmt(r.params_mib, "{:.2f}"), _fmt(r.base_mib, "{:.2f}"),
                 _fmt(r.policy_ratio, "{:.2f}"), _fmt(r.policy_db, "{:.1f}"), _fmt(r.bf16_db, "{:.1f}")]  # fmt: skip
        if plan:
            floor = r.floor_mib / (r.policy_ratio * r.base_mib) if r.floor_mib and r.policy_ratio else None
            cells += [_fmt(r.plan_ratio, "{:.2f}"), _fmt(r.plan_db, "{:.1f}"), _fmt(r.plan_predicted, "{:.2f}"),
                      _fmt(r.plan_baseline, "{:.2f}"), _fmt(floor, "{:.2f}"), _fmt(r.plan_s, "{:.0f}"),
                      _fmt(r.plan_s / r.base_s if r.plan_s and r.base_s else None, "{:.1f}")]  # fmt: skip
        note = r.error or (f"`{r.policy_worst}`" if r.policy_worst else "")
        cells += [_fmt(r.seconds, "{:.0f}"), note.replace("|", "\\|")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _kind(name: str) -> str:
    head, _, model_type = name.partition("/")
    return family_kind(Architecture(head, model_type, ""))


def summary(rows: Iterable[SweepRow]) -> dict[str, Any]:
    """Counts per status, and over the rows whose step without hooks trains: gradients and peaks.

    Args:
        rows: one tier's rows.

    Returns:
        ``{"statuses": {status: n}, "trains": n, "heads": n, "db20": n, "db25": n, "below": n}``:
        ``trains`` counts rows past build and the step without hooks; ``db20``
        / ``db25`` those with a policy gradient at or above 20 / 25 dB;
        ``below`` those whose policy peak is below the step without hooks;
        ``ill`` those whose gradient bf16 storage also puts below :data:`GRADIENT_DB`;
        ``kinds``: per kind of :data:`benchmarks.sweep_models.KINDS`, how many train;
        ``planned``: rows whose plan's measured peak is within :data:`PLAN_LIMIT`
        of its budget and whose gradient holds (plan tier).
    """
    rows = list(rows)
    trains = [r for r in rows if r.status not in ("unbuilt", "transformers")]
    return {
        "statuses": {s: sum(r.status == s for r in rows) for s in STATUSES},
        "trains": len(trains),
        "heads": len({r.name.split("/")[0] for r in trains}),
        "db20": sum(r.policy_db is not None and r.policy_db >= 20 for r in trains),
        "db25": sum(r.policy_db is not None and r.policy_db >= 25 for r in trains),
        "below": sum(r.policy_ratio is not None and r.policy_ratio < 1 for r in trains),
        "ill": sum(r.bf16_db is not None and not r.bf16_db >= GRADIENT_DB for r in trains),
        "kinds": {k: n for k in KINDS if (n := sum(_kind(r.name) == k for r in trains))},
        "planned": sum(r.status == "ok" and r.plan_ratio is not None and r.plan_ratio <= PLAN_LIMIT for r in trains),
    }


def document(tiers: dict[str, dict[str, SweepRow]], command: str) -> str:
    """The page: per tier, counts per status, the share of gradients and peaks that hold, and one row per architecture.

    Args:
        tiers: ``{tier: {name: row}}`` (tiers without rows are left out).
        command: the command that writes the page.

    Returns:
        Markdown text.
    """
    import transformers

    lines = [
        "# Sweep: every transformers architecture with a training head",
        "",
        f"`{command}` (each tier: `python -m benchmarks.sweep --tier TIER`); torch {torch.__version__}, "
        f"transformers {transformers.__version__}; device cpu ({os.cpu_count()} cores).",
        "",
        "Each architecture is built from its config's defaults with only its sizes shrunk "
        "(`benchmarks/sweep_models.py`), dropout and random masking at zero, and trains one step on its own loss. "
        "base: the step without hooks (eager in the eager tier, plain `torch.compile` otherwise), its activation "
        "peak; policy: `sh.policy()` around the same step, peak over base and the worst parameter gradient's SQNR "
        f"against base (rounding-noise gradients skipped); plan: `sh.plan` at {PLAN_FRACTION:g} of the compiled "
        f"peak. Statuses: ok; refused (a savedhooks error naming what it does not support, or an infeasible budget "
        "whose floor is at or below the policy's peak, measured with the KV cache off where the plan turns it "
        f"off); failure (a crash with hooks, a gradient below {GRADIENT_DB:g} dB, a plan above {PLAN_LIMIT:g} of "
        "its budget, a time-out); transformers (the step without hooks fails); unbuilt (the shrunk defaults do not build, or a library is missing). bf16 dB: where "
        "the policy's gradient is below the bar, the worst gradient with every floating saved tensor stored in bf16 "
        "(sh.downcast(torch.bfloat16)), the rounding of bf16 training: below the bar too, the gradient's terms "
        "cancel and no lossy codec holds it.",
        "",
    ]
    for tier in TIERS:
        rows = sorted(tiers.get(tier, {}).values(), key=lambda r: r.name)
        if not rows:
            continue
        s = summary(rows)
        counts = ", ".join(f"{n} {status}" for status, n in s["statuses"].items())
        trains = max(s["trains"], 1)
        lines += [
            f"## Tier {tier}",
            "",
            f"{len(rows)} architectures: {counts}. Of the {s['trains']} whose step without hooks trains "
            f"({s['heads']} heads): policy gradient >= 20 dB on {s['db20']} ({s['db20'] / trains:.0%}), >= 25 dB "
            f"on {s['db25']} ({s['db25'] / trains:.0%}); policy peak below the step without hooks on {s['below']} "
            f"({s['below'] / trains:.0%}); on {s['ill']} of those below {GRADIENT_DB:g} dB, bf16 storage of every "
            f"saved tensor is below it too (bf16 dB); {sum(r.seconds or 0 for r in rows) / 60:.0f} min of work. "
            f"Kinds that train: {', '.join(f'{k} {n}' for k, n in s['kinds'].items())}.",
            "",
            *(_plan_summary(rows, s) if tier == "plan" else []),
            *_table(rows, tier),
            "",
        ]
    return "\n".join(lines)


def _policy_mib(row: SweepRow) -> float:
    """The policy's peak a plan tier row compares the planner's floor with (:attr:`SweepRow.policy_planned_mib`)."""
    return row.policy_planned_mib if row.policy_planned_mib is not None else row.policy_ratio * row.base_mib


def _plan_summary(rows: list[SweepRow], s: dict[str, Any]) -> list[str]:
    refused = [r for r in rows if r.status == "refused"]
    unsupported = [r for r in refused if not (r.error or "").startswith("infeasible:")]
    failed = [r for r in rows if r.status == "failure"]
    modelled = [r for r in rows if r.plan_baseline is not None]
    floors = [r for r in rows if r.floor_mib is not None and r.policy_ratio is not None and r.base_mib]
    times = [r.plan_s / r.base_s for r in rows if r.plan_s and r.base_s]
    trains = max(s["trains"], 1)
    lines = [
        f"Plans: {s['planned']} of {s['trains']} ({s['planned'] / trains:.0%}) within {PLAN_LIMIT:g} of their budget "
        f"with gradients at {GRADIENT_DB:g} dB or more; {len(refused)} refused ({len(refused) / trains:.0%}: "
        f"{len(refused) - len(unsupported)} an infeasible budget whose floor is at or below the policy's peak, "
        f"{len(unsupported)} ({len(unsupported) / trains:.0%}) an error naming what is unsupported), "
        f"{len(failed)} failures. The planner's modelled peak without hooks within 5% of the measured one on "
        f"{sum(abs(r.plan_baseline - 1) <= 0.05 for r in modelled)} of {len(modelled)}; its floor at or below the "
        f"measured `sh.policy()` peak on {sum(r.floor_mib <= _policy_mib(r) for r in floors)} of "
        f"{len(floors)}."
        + (f" Planning time over the first compiled step without hooks: median {statistics.median(times):.1f}, "
           f"highest {max(times):.1f} ({len(times)} plans)." if times else ""),
        "",
    ]
    lines += [f"- refused: {r.name}: {r.error}" for r in refused] + [f"- failure: {r.name}: {r.error}" for r in failed]
    return [*lines, ""] if refused or failed else lines


# ---------------------------------------------------------------------------------------------------- running


def _measure_task(task: tuple[Architecture, str, float | None]) -> SweepRow:
    arch, tier, timeout_s = task
    print(f"[{arch.name}] {tier}", file=sys.stderr, flush=True)
    return measure(arch, tier, timeout_s)


def run(archs: list[Architecture], tier: str, jobs: int = 1, timeout_s: float | None = None,
        results: pathlib.Path = RESULTS, log: Callable[[str], None] = lambda line: None) -> list[SweepRow]:  # fmt: skip
    """Measure each architecture in ``tier``, ``jobs`` at once, appending each row to the tier's file as it ends.

    Args:
        archs: the architectures.
        tier: a key of :data:`TIERS`.
        jobs: worker processes (spawned; a compiled tier uses a fresh one per architecture).
        timeout_s: see :func:`measure`; a worker that gives no row within
            twice this (plus a minute) is taken as dead, its row a failure.
        results: the folder of the JSONL files.
        log: gets a line per row.

    Returns:
        The rows, in the order they ended.

    Raises:
        KeyError: an unknown tier.
        ValueError: ``jobs`` below 1.
    """
    if tier not in TIERS:
        raise KeyError(f"unknown tier {tier!r}; choose from {', '.join(TIERS)}")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an int >= 1, got {jobs!r}")
    threads = max(1, (os.cpu_count() or 1) // jobs)
    context = multiprocessing.get_context("spawn")
    rows: list[SweepRow] = []
    # a fresh process per architecture past the eager tier (dynamo's and inductor's state); eager ones share
    with context.Pool(jobs, initializer=torch.set_num_threads, initargs=(threads,),
                      maxtasksperchild=1 if tier != "eager" else 20) as pool:  # fmt: skip
        pending = {a.name: pool.apply_async(_measure_task, ((a, tier, timeout_s),)) for a in archs}
        last = time.perf_counter()
        while pending:
            time.sleep(0.2)
            # a worker that died (a segfault) loses its task: once nothing has ended for long, what is left failed
            stalled = timeout_s is not None and time.perf_counter() - last > 2 * timeout_s + 60
            for name, result in list(pending.items()):
                if result.ready():
                    try:
                        row = result.get()
                    except Exception as exc:  # what measure did not catch: a row of its own
                        row = SweepRow(name, tier, "failure", error=error_text(exc))
                elif stalled:
                    row = SweepRow(name, tier, "failure", error="no row from the worker (it died or hung)")
                else:
                    continue
                del pending[name]
                last = time.perf_counter()
                _append(row, results)
                rows.append(row)
                log(f"{row.name}: {row.status} {row.error}")
    return rows


def select(heads: Iterable[str] | None, only: Iterable[str] | None, shard: str | None) -> list[Architecture]:
    """The architectures of ``heads``, those named in ``only`` (``head/type`` or a model type), shard ``K/N``.

    Raises:
        ValueError: a malformed shard, or a name in ``only`` that no architecture has.
    """
    archs = architectures(heads)
    if only:
        wanted = set(only)
        archs = [a for a in archs if a.name in wanted or a.model_type in wanted]
        known = {a.name for a in archs} | {a.model_type for a in archs}
        if wanted - known:
            raise ValueError(f"no architecture named {sorted(wanted - known)}")
    if shard:
        try:
            k, n = (int(v) for v in shard.split("/"))
        except ValueError:
            raise ValueError(f"shard must be K/N, got {shard!r}") from None
        if not 1 <= k <= n:
            raise ValueError(f"shard must be K/N with 1 <= K <= N, got {shard!r}")
        archs = archs[k - 1 :: n]
    return archs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--tier", default="eager", choices=TIERS)
    parser.add_argument("--heads", nargs="+", choices=list(HEADS), default=None, help="heads (default: all)")
    parser.add_argument("--only", nargs="+", default=None, metavar="NAME", help="head/model_type or model types")
    parser.add_argument("--shard", default=None, metavar="K/N", help="every N-th architecture from the K-th")
    parser.add_argument("--jobs", type=int, default=1, metavar="N", help="architectures at once (default 1)")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="per architecture")
    parser.add_argument("--redo", action="store_true", help="measure again what the tier's file holds")
    parser.add_argument("--results", default=str(RESULTS), help="folder of the tiers' JSONL files")
    parser.add_argument("--out", default=str(PAGE), help="the page written from every tier's rows")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    try:
        archs = select(args.heads, args.only, args.shard)
    except ValueError as exc:
        parser.error(str(exc))
    results = pathlib.Path(args.results)
    done = load(args.tier, results)
    if args.tier == "compiled":  # the plan tier measured these compiled steps already
        done = {**load("plan", results), **done}
    if not args.redo:
        archs = [a for a in archs if a.name not in done]
    print(f"{len(archs)} architectures to measure in tier {args.tier}", file=sys.stderr, flush=True)
    run(archs, args.tier, args.jobs, args.timeout, results, log=lambda line: print(line, file=sys.stderr, flush=True))
    tiers = loaded(results)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(document(tiers, "python -m benchmarks.sweep --jobs 2 --timeout 600"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
