"""Step time as ratios of steps timed in turn: ``python -m benchmarks.step_time --models gpt2 llama vit --size 8``.

The main job (``python -m benchmarks``) times each configuration right after
building it, one configuration after the other. When the machine slows down or
speeds up between two rows (shared CPU cores do, by 10 % and more), their
ratio moves with it from one run to the next.

Here every configuration of a model is built first, each on its own copy of the
workload (same seed, so the same weights and inputs), and then each is warmed up
(it compiles). The steps are then timed in rounds: one step of each
configuration per round, in an order shuffled per round with a fixed seed, so
that no configuration always follows the same one. A configuration's ratio is
the median over rounds of its step time divided by its baseline's
(``compiled``; the bf16 rows' ``bf16``) in the same round, so a drift of the
machine's speed that spans a few rounds cancels out. The spread of the
per-round ratios (lowest and highest) is printed with it. A timed step includes
clearing the gradients (``set_to_none``), a few microseconds.

The configurations and their baselines are the main job's
(``benchmarks.configs.CONFIGS``); a configuration's baseline is added when it
is not asked for. ``--plans 0.6 floor`` adds ``sh.plan`` at those budgets
(fractions of the planner's modelled no-hook peak, or its floor, as
``python -m benchmarks.pareto`` plans them), planned for each model before its
configurations are built: the Pareto table times each row once, right after
building it, so its plans' step ratios move with the machine as the main
job's do. Each copy is compiled with ``isolate_recompiles=True``
(:attr:`benchmarks.models.Workload.isolated`): dynamo otherwise shares one set
of cache entries among all copies of a model class, and it does not guard on
every setting a configuration changes (``activation_memory_budget`` is a
``torch._functorch.config`` patch), so a copy could run another's code. The
rounds run under ``torch.compiler.set_stance("fail_on_recompile")``: a compile
while timing raises instead of being timed. All copies stay in memory together
(parameters, gradients, compiled code): on a GPU, mind the model's size times
the number of configurations.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

import savedhooks as sh
from benchmarks.configs import CONFIGS, Config, Step, plan_at, planned, planner_for
from benchmarks.models import MODELS, Workload, make_workload

__all__ = ["Timing", "built_configs", "interleaved_times", "plan_configs", "plan_label", "round_ratios", "table", "time_configs"]


@dataclasses.dataclass(frozen=True)
class Timing:
    """One configuration's step time, from steps timed in turn with its baseline's.

    Attributes:
        model: the benchmark model.
        config: the configuration.
        backend: ``inductor``, ``aot_eager`` or ``eager``.
        step_ms: median step time over the rounds.
        ratio: median over rounds of the step time divided by the baseline's in the same round.
        low: lowest per-round ratio.
        high: highest per-round ratio.
        rounds: timed rounds.
        baseline: the configuration the ratio divides by.
    """

    model: str
    config: str
    backend: str
    step_ms: float
    ratio: float
    low: float
    high: float
    rounds: int
    baseline: str


def interleaved_times(steps: dict[str, Callable[[], None]], rounds: int, seed: int = 0) -> dict[str, list[float]]:
    """Time one call of each step per round, in an order shuffled per round (seeded).

    Args:
        steps: name -> a callable running one step (and waiting for the device).
        rounds: how many rounds.
        seed: the seed of the orders.

    Returns:
        name -> its ``rounds`` times in seconds, in round order.

    Raises:
        ValueError: ``rounds`` below 1 or no steps.
    """
    if rounds < 1 or not steps:
        raise ValueError(f"interleaved_times: need steps and rounds >= 1, got {len(steps)} steps, {rounds} rounds")
    order, shuffle = list(steps), random.Random(seed).shuffle
    times: dict[str, list[float]] = {name: [] for name in order}
    for _ in range(rounds):
        shuffle(order)
        for name in order:
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    return times


def round_ratios(times: Sequence[float], baseline: Sequence[float]) -> list[float]:
    """Each round's time divided by the baseline's time in the same round.

    Args:
        times: a step's times, one per round.
        baseline: the baseline's times, same rounds.

    Returns:
        One ratio per round.

    Raises:
        ValueError: the sequences differ in length or are empty.
    """
    if len(times) != len(baseline) or not times:
        raise ValueError(f"round_ratios: need equal, non-empty rounds, got {len(times)} and {len(baseline)}")
    return [t / b for t, b in zip(times, baseline)]


def _with_baselines(configs: Iterable[str], known: Mapping[str, Config]) -> list[str]:
    """The configurations asked for, each one's baseline before it where it is missing."""
    names: list[str] = []
    for name in configs:
        for needed in (known[name].step_baseline if name in known else name, name):
            if needed not in names:
                names.append(needed)
    return names


def _known(extra: Mapping[str, Config] | None) -> dict[str, Config]:
    """The main job's configurations and ``extra`` (plans made for this model), by name."""
    return {**CONFIGS, **(extra or {})}


def _check(model: str, names: list[str], device: str, known: Mapping[str, Config]) -> None:
    """Known model and configurations, none twice, none CUDA-only off CUDA."""
    if model not in MODELS:
        raise KeyError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    for name in names:
        if name not in known:
            raise KeyError(f"unknown configuration {name!r}; choose from {', '.join(known)}")
        if known[name].cuda_only and device != "cuda":
            raise ValueError(f"configuration {name!r} runs on CUDA only")
    if len(set(names)) != len(names):
        raise ValueError(f"a configuration is named more than once in {names}")


def _timed_step(step: Step, workload: Workload, device: str) -> Callable[[], None]:
    """One training step of a built configuration, gradients cleared first, waiting for the device."""

    def run() -> None:
        workload.model.zero_grad(set_to_none=True)
        step.forward().backward()
        if device == "cuda":
            torch.cuda.synchronize()

    return run


@contextlib.contextmanager
def built_configs(
    model: str,
    names: Iterable[str],
    size: float = 8.0,
    backend: str = "inductor",
    device: str = "cpu",
    compiled_loss: bool = False,
    warmup: int = 2,
    extra: Mapping[str, Config] | None = None,
) -> Iterator[dict[str, tuple[Step, Workload]]]:
    """Each configuration built on its own copy of a benchmark model and warmed up, side by side.

    Each copy is compiled apart from the others (:attr:`benchmarks.models.Workload.isolated`).
    All are built before any is warmed up: building one may reset dynamo (a
    plan's survey does). Dynamo is reset on entry and on exit, and each built
    step is closed on exit.

    Args:
        model: a key of ``benchmarks.models.MODELS``.
        names: keys of ``benchmarks.configs.CONFIGS`` or of ``extra``, built in this order.
        size: batch multiplier.
        backend: the ``torch.compile`` backend of the compiled configurations; the eager ones run eagerly.
        device: ``cpu`` or ``cuda``.
        compiled_loss: compile the loss with the model.
        warmup: untimed steps of each configuration after all are built (the first compiles).
        extra: configurations beyond ``CONFIGS``, by name (:func:`plan_configs`).

    Yields:
        name -> (its built step, its workload).

    Raises:
        KeyError: unknown model or configuration.
        ValueError: ``warmup`` below 1, a configuration named more than once, or
            a CUDA-only configuration off CUDA.
        Whatever building or running a configuration raises.
    """
    names, known = list(names), _known(extra)
    _check(model, names, device, known)
    if warmup < 1:
        raise ValueError(f"built_configs: warmup must be >= 1, got {warmup}")
    torch._dynamo.reset()
    built: dict[str, tuple[Step, Workload]] = {}
    with contextlib.ExitStack() as closes:
        closes.callback(torch._dynamo.reset)
        for name in names:
            config = known[name]
            workload = make_workload(model, size, device)
            workload.compiled_loss, workload.isolated = compiled_loss, True
            torch.manual_seed(0)
            built[name] = (config.build(workload, backend if config.compiled else "eager"), workload)
            closes.callback(built[name][0].close)
        for name in names:
            for _ in range(warmup):
                _timed_step(*built[name], device)()
        yield built


def time_configs(
    model: str,
    configs: Iterable[str],
    size: float = 8.0,
    backend: str = "inductor",
    device: str = "cpu",
    rounds: int = 10,
    compiled_loss: bool = False,
    warmup: int = 2,
    extra: Mapping[str, Config] | None = None,
) -> list[Timing]:
    """Build each configuration on its own copy of a benchmark model, then time their steps in turn.

    Args:
        model: a key of ``benchmarks.models.MODELS``.
        configs: keys of ``benchmarks.configs.CONFIGS`` or of ``extra``; their baselines are added.
        size: batch multiplier.
        backend: the ``torch.compile`` backend of the compiled configurations
            (``inductor`` or ``aot_eager``); the eager ones run eagerly.
        device: ``cpu`` or ``cuda``.
        rounds: timed rounds (one step of each configuration per round).
        compiled_loss: compile the loss with the model (as ``python -m benchmarks --compiled-loss``).
        warmup: untimed steps of each configuration once all are built (the first compiles).
        extra: configurations beyond ``CONFIGS``, by name (:func:`plan_configs`).

    Returns:
        One :class:`Timing` per configuration, baselines included, in build order.

    Raises:
        KeyError: unknown model or configuration.
        ValueError: a CUDA-only configuration off CUDA, ``rounds`` or ``warmup`` out of range.
        RuntimeError: something compiled while the steps were timed (dynamo's ``fail_on_recompile``).
        Whatever building or running a configuration raises.
    """
    if rounds < 1:
        raise ValueError(f"time_configs: rounds must be >= 1, got {rounds}")
    known = _known(extra)
    names = _with_baselines(configs, known)
    with built_configs(model, names, size, backend, device, compiled_loss, warmup, extra) as built:
        steps = {name: _timed_step(*built[name], device) for name in names}
        with torch.compiler.set_stance("fail_on_recompile"):
            times = interleaved_times(steps, rounds)
    timings = []
    for name in names:
        baseline = known[name].step_baseline
        ratios = round_ratios(times[name], times[baseline])
        timings.append(Timing(
            model=model, config=name, backend=backend if known[name].compiled else "eager",
            step_ms=statistics.median(times[name]) * 1e3, ratio=statistics.median(ratios),
            low=min(ratios), high=max(ratios), rounds=rounds, baseline=baseline,
        ))  # fmt: skip
    return timings


def plan_label(text: str) -> str:
    """Check a plan's budget as ``--plans`` takes it: a fraction in (0, 1] or ``floor``.

    Args:
        text: the label.

    Returns:
        ``text``.

    Raises:
        ValueError: neither ``floor`` nor a number in (0, 1].
    """
    try:
        fine = text == "floor" or 0.0 < float(text) <= 1.0
    except ValueError:
        fine = False
    if not fine:
        raise ValueError(f"a plan's budget is a fraction in (0, 1] of the modelled no-hook peak, or 'floor'; got {text!r}")
    return text


def plan_configs(
    model: str,
    labels: Iterable[str],
    size: float = 8.0,
    backend: str = "inductor",
    device: str = "cpu",
    compiled_loss: bool = False,
) -> dict[str, Config]:
    """``sh.plan`` for a benchmark model at each budget, as configurations ``"plan <label>"`` to time in turn.

    A fraction ``f`` plans for ``f`` times the planner's modelled no-hook peak;
    ``floor`` for the lowest peak it reaches, as ``python -m benchmarks.pareto``
    does. A fraction the planner cannot meet (below its floor, or no plan
    predicted to meet its ``min_sqnr_db``) is said on stderr and left out, so
    the other labels and models still run. Planning compiles the model several
    times (its survey and checks).

    Args:
        model: a key of ``benchmarks.models.MODELS``.
        labels: :func:`plan_label` values.
        size: batch multiplier.
        backend: the backend the plans are made for and compiled with.
        device: ``cpu`` or ``cuda``.
        compiled_loss: plan the model with its loss (as ``--compiled-loss`` runs it).

    Returns:
        Name -> configuration (for ``extra`` of :func:`time_configs`), in the order of ``labels``,
        without those it cannot meet (empty, and nothing built, without labels).

    Raises:
        KeyError: unknown model.
        ValueError: a label that :func:`plan_label` refuses.
    """
    labels = [plan_label(label) for label in labels]
    if not labels:  # nothing to plan: no model built
        return {}
    workload = make_workload(model, size, device)
    workload.compiled_loss = compiled_loss
    planner = planner_for(workload, backend)
    configs = {}
    for label in labels:
        try:
            plan = plan_at(planner, label)
        except (sh.InfeasibleBudgetError, sh.InfeasibleFidelityError) as error:
            print(f"{model}: plan {label}: {error}; not timed", file=sys.stderr, flush=True)
            continue
        config = planned(label, plan)
        configs[config.name] = config
    return configs


def table(timings: Iterable[Timing], header: bool = True) -> str:
    """A markdown table of timings.

    Args:
        timings: the rows.
        header: start with the header lines.

    Returns:
        The table (its rows only where ``header`` is False), without a final newline.
    """
    lines = [
        "| model | config | backend | step ms | step / baseline | lowest, highest | baseline |",
        "|---|---|---|---:|---:|---|---|",
    ] if header else []  # fmt: skip
    for t in timings:
        lines.append(
            f"| {t.model} | {t.config} | {t.backend} | {t.step_ms:.0f} | {t.ratio:.2f} | "
            f"{t.low:.2f}, {t.high:.2f} | {t.baseline} |"
        )
    return "\n".join(lines)


def main(argv: Any = None) -> None:
    """Print the step-time table (see the module docstring).

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
        None.

    Raises:
        SystemExit: bad arguments.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_time", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=["gpt2", "llama", "vit"])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=["compiled", "sh", "checkpoint", "torch fp8"])
    parser.add_argument("--size", type=float, default=8.0, help="batch multiplier (default 8)")
    parser.add_argument("--backend", choices=("inductor", "aot_eager"), default="inductor")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds, one step of each configuration per round")
    parser.add_argument("--compiled-loss", action="store_true", help="compile the loss with the model")
    parser.add_argument(
        "--plans", nargs="+", default=[], type=_argument(plan_label), metavar="BUDGET",
        help="also time sh.plan at these budgets (fractions of its modelled no-hook peak, or floor), planned per model first",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device")
    only_cuda = [name for name in args.configs if CONFIGS[name].cuda_only]
    if only_cuda and args.device != "cuda":
        parser.error(f"{', '.join(only_cuda)} run on CUDA only (--device cuda)")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    print(table([]), flush=True)
    for model in args.models:  # each model's rows as they are measured
        plans = plan_configs(model, args.plans, args.size, args.backend, args.device, args.compiled_loss)
        for config in plans.values():
            print(f"{model}: {config.name}: {config.description}", file=sys.stderr, flush=True)
        timings = time_configs(model, [*args.configs, *plans], args.size, args.backend, args.device, args.rounds,
                               args.compiled_loss, extra=plans)  # fmt: skip
        print(table(timings, header=False), flush=True)


def _argument(check: Callable[[str], str]) -> Callable[[str], str]:
    """``check`` as an argparse type: its ValueError becomes a usage error with the message."""

    def parse(text: str) -> str:
        try:
            return check(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


if __name__ == "__main__":
    main()
