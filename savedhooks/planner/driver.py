"""The ``Planner`` behind ``sh.plan``: meet a peak-memory budget at the least modelled time, mixing recompute and codecs.

Design notes
------------
* Strategies, one signature (a recompute setting -> a survey -> a plan for the
  budget): recompute the first ``k`` of the model's blocks, whole or
  selectively (:mod:`savedhooks.planner.recompute`: matrix products and
  attention saved, the rest recomputed), and choose a codec per saved tensor
  of what is still saved (:mod:`savedhooks.planner.survey`,
  :mod:`savedhooks.planner.search`). Each setting is surveyed once (a
  compile and a step), lazily, and kept for other budgets: a setting whose
  recompute time alone (its blocks timed eagerly, no compile) models no less
  than a plan already found is not surveyed, unless that plan's check misses
  the budget (then every setting is, and the choice is the one a full survey
  makes). The plan reports what planning took: time, compiles, steps.
* The driver tries ``k = 0 .. L`` (``L`` blocks; at most :data:`MAX_STRATEGIES`
  values spread evenly over them), each ``k > 0`` selective and full, plans the
  budget with each whose floor meets it, and keeps the least modelled time
  (codec time + the recomputed ops' forward time); ties go to the setting
  tried first (fewer blocks; selective before full). Its log says what each
  strategy reached and why the kept one won.
* Floors are not monotone in ``k``: a recomputed block's backward materializes
  its whole forward again, so the floor is the least over the strategies.
* A recompute setting whose graphs the memory model cannot read, or that
  leaves nothing compiled (below DDP or FSDP2, dynamo compiles only user-code
  frames, and a checkpointed block's frames run eagerly), is skipped with a
  warning and a log line. (Checkpointed random ops are read: their
  ``run_and_save_rng_state`` nodes have no fake value under aot_eager, and the
  memory model takes it from their ``getitem`` users.)
* Fidelity: the policy's keeps are never candidates. With ``min_sqnr_db``,
  :mod:`savedhooks.planner.fidelity` gives each lossy option a harm measured
  by :func:`savedhooks.fidelity.sensitivity`; each setting's search meets the plan's
  limit at the least time (bf16, keep or offload for fp8), and a setting
  whose plan is still predicted below it is not ranked (recompute settings
  that pack less can win). Plans predicted below it are not checked; in one
  process the check measures gradients too, and a plan below it is not kept.
* Checked: the chosen plan is compiled once more with
  its own hooks and its graphs modelled (:mod:`savedhooks.planner.check`); while they peak above
  the budget the search runs again below it by the excess. The first setting
  (by modelled time) with a checked plan that meets the budget is kept, its
  checked peak the plan's prediction; checked plans are kept per choice, so
  later budgets reuse them. A budget below every modelled floor is checked
  too: with every candidate packed, the hooked graphs can peak below the
  modelled floor (:meth:`Planner._below_floor`). A check that raises
  ``ValueError`` or ``NotCompiledError`` warns: what its setting checked
  before counts, the next setting is tried, and a setting that checked
  nothing keeps the survey's model of its plan.
* Not chosen yet: recompute policies other than "save matrix products and
  attention".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from savedhooks._torch.dynamo import is_compiled_module
from savedhooks.metrics import worst_sqnr
from savedhooks.planner.caches import check_no_cache_input
from savedhooks.planner.check import (
    cheapest,
    check_peak,
    choices_of,
    measures,
    packs_nothing,
    resolve_check,
    tighten,
    warn_unchecked,
)
from savedhooks.planner.costs import recompute_seconds
from savedhooks.planner.fidelity import (
    FidelityLimit,
    check_min_sqnr,
    fidelity_line,
    measure_limit,
    meets_limit,
    predicted_db,
)
from savedhooks.planner.lockstep import checked_together, follow, is_leader, lead, several
from savedhooks.planner.recompute import (
    FULL, SELECTIVE, called_modules, check_mode, checkpointed_blocks, find_blocks, resolve_blocks,
)
from savedhooks.planner.result import (
    InfeasibleBudgetError,
    InfeasibleFidelityError,
    Plan,
    check_budget,
    check_output_held,
)
from savedhooks.planner.step import TALLY, check_call
from savedhooks.planner.survey import NotCompiledError, Survey, survey

__all__ = ["CALIBRATED_MARGIN", "ESTIMATE_MARGIN", "FLOOR_MARGIN", "MAX_STRATEGIES", "MODEL_TOLERANCE", "Planner"]

_MiB = 1 << 20
MAX_STRATEGIES = 5  # recompute settings tried at most (k = 0 .. L blocks, spread evenly)
# below the modelled floor, the settings whose modelled floor is within this share of the least are checked
# with every candidate packed: the margin covers the model's error at the floor (under 10 % on the benchmark models)
FLOOR_MARGIN = 0.10
# a setting not surveyed yet whose estimate (Planner._estimate) misses the budget, or the time of a plan found, by
# more than this share is not surveyed once a plan is found
ESTIMATE_MARGIN = 0.10
# the same share for an estimated floor once a setting of its mode is surveyed (the estimates calibrated by it)
CALIBRATED_MARGIN = 0.02
MODEL_TOLERANCE = 0.05  # a check's modelled and measured peaks further apart than this share are logged
_CHECKED = "the first setting by modelled time whose checked plan meets the budget"
_SMALLEST = "the least modelled time among the checked plans that meet it (every candidate packed, or checked before)"


class Planner:
    """Plans for one model and input shape: surveys each recompute setting once, then plans any budget.

    Attributes:
        blocks: the module paths of the blocks a plan may recompute.
        strategies: the recompute settings tried, ``(k, mode)``: the first ``k``
            blocks, recomputed ``"selective"`` or ``"full"`` (``(0, "full")`` first).
        min_sqnr_db: the fidelity limit (:mod:`savedhooks.planner.fidelity`), or None.
        output_held: whether the training loop keeps the model's output to the end of the step.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        example_inputs: Any,
        *,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        backend: str = "inductor",
        seed: int = 0,
        blocks: Sequence[str] | None = None,
        min_sqnr_db: float | None = None,
        output_held: bool = False,
    ) -> None:
        """Set up the planner: one eager forward (no grad) checks the inputs; nothing is compiled until a survey is needed.

        Args:
            model: the module to train (not compiled: the planner compiles it).
            example_inputs: as for :func:`plan`.
            loss_fn: as for :func:`plan`.
            backend: as for :func:`plan`.
            seed: as for :func:`plan`.
            blocks: as for :func:`plan`.
            min_sqnr_db: as for :func:`plan`.
            output_held: as for :func:`plan`.

        Raises:
            TypeError: ``model`` is not a module, ``blocks`` is a string,
                ``min_sqnr_db`` is not a number, ``output_held`` not a bool,
                or ``loss_fn`` returns other than a floating tensor.
            ValueError: ``model`` is compiled already, ``backend`` is unknown,
                a block path names no submodule, ``min_sqnr_db`` is not
                finite, the model has blocks checkpointed by a plan's
                ``apply`` (revert it first), ``example_inputs`` ask for a KV
                cache (``use_cache=True``), the model raises on
                ``example_inputs`` (its error is the cause), or the loss is
                not a scalar.
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"plan: model must be a torch.nn.Module, got {type(model).__name__}")
        if _compiled(model):
            raise ValueError(
                "plan: model is compiled already (torch.compile(model) or model.compile()): plan the module itself "
                "(the planner compiles it for each survey), then plan.apply(model) and compile it"
            )
        if backend not in ("inductor", "aot_eager"):
            raise ValueError(f"plan: backend must be 'inductor' or 'aot_eager', got {backend!r}")
        if isinstance(blocks, str):
            raise TypeError(f"plan: blocks must be a sequence of module paths, got the string {blocks!r}")
        check_min_sqnr(min_sqnr_db)
        check_output_held(output_held, "plan")
        check_no_cache_input(example_inputs)
        self.min_sqnr_db = min_sqnr_db
        self.output_held = output_held
        self._limit: FidelityLimit | None = None
        self._limited: dict[tuple[int, str], int] = {}  # choices (units) that lost a lossy option, per setting
        applied = checkpointed_blocks(model)
        if applied:
            raise ValueError(
                f"plan: blocks {list(applied)} are checkpointed by a plan's apply: plan the model as it runs "
                "without them (plan.revert(model) first), or its surveys would model them as never recomputed"
            )
        if blocks is None:
            with called_modules(model) as ran:
                check_call(model, example_inputs, loss_fn)  # bad inputs and a loss that is not a scalar fail here
            self.blocks = find_blocks(model, ran)  # the largest list whose blocks all run on these inputs
        else:
            self.blocks = tuple(blocks)
            resolve_blocks(model, self.blocks)  # a bad path fails here, before any compile
            check_call(model, example_inputs, loss_fn)
        self._args = (model, example_inputs, loss_fn, backend, seed)
        count = len(self.blocks)
        steps = min(count + 1, MAX_STRATEGIES)
        ks = sorted({round(i * count / max(steps - 1, 1)) for i in range(steps)})
        self.strategies = tuple((k, mode) for k in ks for mode in ((SELECTIVE, FULL) if k else (FULL,)))
        self._surveys: dict[tuple[int, str], Survey] = {}
        self._previews: dict[tuple[int, str], Survey] = {}  # estimates of settings from the survey without recompute
        self._estimated: dict[tuple[int, str, int], float] = {}  # (k, mode, budget) -> the preview's plan time
        # settings not planned (nothing compiled, or graphs the memory model cannot read), and why
        self._skipped: dict[tuple[int, str], str] = {}
        # plans checked on the graphs compiled with their hooks: (setting, choices) -> (plan, checked peak)
        self._checked: dict[tuple[tuple[int, str], tuple], tuple[Plan, int]] = {}
        # what planning took: seconds inside the planner's calls (the outermost), compiles and steps since made
        self._seconds, self._depth, self._entered = 0.0, 0, 0.0
        self._tally = (TALLY.compiles, TALLY.steps)

    @contextlib.contextmanager
    def _busy(self) -> Any:
        """Count the time inside the outermost of the planner's calls (surveys, limits, plans)."""
        if not self._depth:
            self._entered = time.perf_counter()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth:
                self._seconds += time.perf_counter() - self._entered

    def _cost(self) -> dict[str, Any]:
        """The plan's fields that say what planning took so far."""
        running = time.perf_counter() - self._entered if self._depth else 0.0
        compiles, steps = self._tally
        return {"planning_seconds": self._seconds + running, "compiles": TALLY.compiles - compiles,
                "steps": TALLY.steps - steps}  # fmt: skip

    def survey(self, k: int, mode: str = FULL) -> Survey:
        """The survey with the first ``k`` blocks recomputed (made once, then kept).

        Args:
            k: leading blocks to recompute, ``0 <= k <= len(blocks)``.
            mode: ``"full"`` or ``"selective"``
                (:func:`~savedhooks.planner.recompute.checkpoint_blocks`).

        Returns:
            A :class:`~savedhooks.planner.survey.Survey`.

        Raises:
            ValueError: ``k`` out of range, or an unknown ``mode``.
            NotCompiledError: the model did not compile.
        """
        if not 0 <= k <= len(self.blocks):
            raise ValueError(f"Planner.survey: k must be in 0..{len(self.blocks)}, got {k}")
        check_mode(mode, "Planner.survey: mode")
        mode = mode if k else FULL
        if (k, mode) not in self._surveys:
            with self._busy():
                model, inputs, loss_fn, backend, seed = self._args
                seconds = self._recompute_seconds(k, mode)
                found = survey(model, inputs, loss_fn, backend, seed, self.blocks[:k], seconds, mode, self.output_held)
                if self.min_sqnr_db is not None:
                    found, self._limited[k, mode] = self.limit().restrict(found)
                self._surveys[k, mode] = found
        return self._surveys[k, mode]

    def _recompute_seconds(self, k: int, mode: str) -> float:
        """The modelled recompute time of the first ``k`` blocks (timed eagerly, once per mode: no compile)."""
        model, inputs, *_ = self._args
        return sum(recompute_seconds(model, inputs, self.blocks, mode)[:k]) if k else 0.0

    def limit(self) -> FidelityLimit:
        """The fidelity limit (:mod:`savedhooks.planner.fidelity`), measured once on the first call.

        Returns:
            A :class:`~savedhooks.planner.fidelity.FidelityLimit`.

        Raises:
            ValueError: the planner has no ``min_sqnr_db``.
        """
        if self.min_sqnr_db is None:
            raise ValueError("Planner.limit: the planner was made without min_sqnr_db")
        if self._limit is None:
            with self._busy():
                model, inputs, loss_fn, backend, seed = self._args
                self._limit = measure_limit(model, inputs, loss_fn, backend, seed, self.min_sqnr_db)
        return self._limit

    def _usable(self) -> list[tuple[tuple[int, str], Survey]]:
        """The strategies' surveys, by setting; a setting that leaves no graphs, or unreadable ones, is skipped."""
        return [(setting, found) for setting in self.strategies if (found := self._usable_one(setting)) is not None]

    def _usable_one(self, setting: tuple[int, str]) -> Survey | None:
        """One setting's survey, or None where it is skipped (warned once: no graphs, or unreadable ones)."""
        if setting in self._skipped:
            return None
        k, mode = setting
        try:
            return self.survey(k, mode)
        except (ValueError, NotCompiledError) as error:
            if not k:
                raise
            self._skipped[setting] = str(error)
            warnings.warn(f"sh.plan: {_name(k, mode, 'recomputing')} is not planned: {error}", stacklevel=4)
            return None

    @property
    def baseline_bytes(self) -> int:
        """The modelled peak with nothing packed and nothing recomputed."""
        return self.survey(0).baseline_bytes

    @property
    def floor_bytes(self) -> int:
        """The lowest modelled peak over the strategies (surveys them all)."""
        return min(found.floor_bytes for _, found in self._usable())

    def plan(self, budget_bytes: int, *, verbose: bool = False, check: bool | None = None) -> Plan:
        """The least-time plan meeting ``budget_bytes`` over the strategies (surveys them all).

        Args:
            budget_bytes: as for :func:`plan`.
            verbose: print the report.
            check: as for :func:`plan`.

        Returns:
            A :class:`Plan`.

        Raises:
            TypeError: ``budget_bytes`` is not an int, or ``check`` not a bool or None.
            ValueError: ``budget_bytes`` is not positive.
            InfeasibleBudgetError: the budget is below :attr:`floor_bytes`
                (with ``check``: and below what every smallest-payload plan
                checked near that floor peaks at), or (``check``) every plan
                checked peaks above it.
            InfeasibleFidelityError: every plan meeting the budget is predicted (checked: measured) below ``min_sqnr_db``.
            RuntimeError: (several processes, with ``check``) rank 0's search raised.
        """
        check_budget(budget_bytes)
        check = resolve_check(check)
        with self._busy():
            if check and several():
                self.floor_bytes  # noqa: B018  every rank surveys every setting, in order: one step each, together
                if not is_leader():
                    chosen = follow(self._check_here)
                    if verbose:
                        print(chosen.report())
                    return chosen
                return lead(lambda: self._plan(budget_bytes, verbose, check))
            return self._plan(budget_bytes, verbose, check)

    def _plan(self, budget_bytes: int, verbose: bool, check: bool) -> Plan:
        """The driver (:meth:`plan` in one process, or on rank 0; its checks run on every rank).

        The steps, in order, each a method below:

        1. survey and search the settings whose floor meets the budget, each
           surveyed only while its recompute alone models less time than the
           best plan found (:meth:`_search`);
        2. none meets it (every setting surveyed): below every modelled floor
           (``check``), the all-packed plans near the floor, checked
           (:meth:`_plan_below_floor`); else the error;
        3. none within the fidelity limit: a plan checked before, or the error
           (:meth:`_checked_before`);
        4. check the settings by modelled time, searching lower while a check
           peaks above the budget (:meth:`_check_lazily`);
        5. choose: the plan returned, with the driver's log (:meth:`_chosen`).
        """
        log: list[str] = []
        ranked, unfaithful = self._search(budget_bytes, log)  # 1.
        if not ranked and not unfaithful:  # 2. every setting surveyed, each floor above the budget
            if not check:
                raise InfeasibleBudgetError(budget_bytes, self.floor_bytes, self.baseline_bytes)
            best, kept = self._plan_below_floor(budget_bytes, log)
        elif not ranked:
            best, kept = self._checked_before(budget_bytes, unfaithful, check)  # 3.
        elif check:
            best, kept = self._check_lazily(ranked, budget_bytes, log)  # 4.
        else:
            best, kept = ranked[0][2], "the least modelled time"
            log.append("not checked (check=False)")
        return self._chosen(best, log, kept, verbose)  # 5.

    def _plan_below_floor(self, budget_bytes: int, log: list[str]) -> tuple[Plan, str]:
        """Step 2: a budget below every modelled floor, checked (:meth:`_below_floor`), and why it was kept.

        Raises:
            InfeasibleBudgetError: no plan checked meets the budget; where every
                smallest-payload plan checked above the modelled floor, it names
                what a budget of that floor gets (its checked plan's peak, or
                that budget's own error).
        """
        floor = self.floor_bytes
        try:
            return self._below_floor(budget_bytes, log), _SMALLEST
        except InfeasibleBudgetError as error:
            if error.floor_bytes <= floor:
                raise
        # every smallest-payload plan checked above the modelled floor; the search's own plan at that
        # floor may check within it: name what a budget of the floor gets (planned, checked) or its error
        try:
            lowest = self._plan(floor, False, True).predicted_peak_bytes
        except InfeasibleBudgetError as above:
            lowest = above.floor_bytes
        raise InfeasibleBudgetError(budget_bytes, lowest, self.baseline_bytes, checked=True) from None

    def _search(
        self, budget_bytes: int, log: list[str], lazy: bool = True
    ) -> tuple[list[tuple[tuple[int, str], Survey, Plan]], list[Plan]]:
        """Step 1: each usable setting's plan for the budget, by modelled time, and the plans below the fidelity limit.

        A plan's modelled time is its recompute time plus its codecs' time, and
        the recompute time is known before a survey (blocks timed eagerly). With
        ``lazy``, a setting not surveyed yet whose recompute time alone is no
        less than the least time of a plan found so far is not surveyed: it
        could not be ranked first (ties go to the setting tried first). While
        no plan is found, every setting is surveyed.

        Returns:
            ``(ranked, unfaithful)``: ``(setting, survey, plan)`` for each setting
            whose floor meets the budget and whose plan meets the fidelity limit,
            least modelled time first (ties: the setting tried first); the plans
            that do not meet the limit.
        """
        ranked: list[tuple[tuple[int, str], Survey, Plan]] = []
        unfaithful: list[Plan] = []
        best = math.inf
        pending = list(self.strategies)
        while pending:
            setting = min(pending, key=lambda s: self._survey_order(s, budget_bytes)) if lazy else pending[0]
            pending.remove(setting)
            if setting in self._skipped:
                log.append(f"{_name(*setting)}: not planned: {self._skipped[setting]}")
                continue
            if lazy and setting not in self._surveys:
                bound = self._recompute_seconds(*setting) if setting[0] else 0.0
                if bound >= best:
                    log.append(f"{_name(*setting)}: not surveyed: its recompute alone models {bound * 1e3:.2f} ms, "
                               f"no less than a plan found ({best * 1e3:.2f} ms)")  # fmt: skip
                    continue
                ruled_out = self._estimate_rules_out(setting, budget_bytes, best)
                if ruled_out:
                    log.append(f"{_name(*setting)}: not surveyed: {ruled_out}")
                    continue
            found = self._usable_one(setting)
            if found is None:
                log.append(f"{_name(*setting)}: not planned: {self._skipped[setting]}")
                continue
            if budget_bytes < found.floor_bytes:
                log.append(f"{_name(*setting)}: floor {found.floor_bytes / _MiB:.2f} MiB is above the budget")
                continue
            candidate = found.plan(budget_bytes)
            log.append(
                f"{_name(*setting)}: peak {candidate.predicted_peak_bytes / _MiB:.2f} MiB, "
                f"{candidate.seconds * 1e3:.2f} ms (recompute {candidate.recompute_seconds * 1e3:.2f})"
                + predicted_db(candidate)
            )
            if self._faithful(candidate):
                ranked.append((setting, found, candidate))
                best = min(best, candidate.seconds)
            else:
                unfaithful.append(candidate)
        ranked.sort(key=lambda r: (r[2].seconds, self.strategies.index(r[0])))  # ties: the setting listed first
        return ranked, unfaithful

    def _estimate(self, setting: tuple[int, str], budget_bytes: int) -> tuple[float, float] | None:
        """A setting's floor and plan time, estimated without surveying it; None without a basis.

        The estimate is the survey without recompute, previewed with the
        setting's blocks recomputed (:meth:`Survey.preview`), its floor moved
        by what the surveys of that mode measured: the error of the preview of
        the surveyed setting with the most blocks, scaled by the blocks
        (calibrated by measurement). The time is the preview's plan for the
        budget (for its own floor where that is above the budget). None also
        where the preview finds none of the blocks' own saved values (their
        module paths not in the graphs' module stacks).
        """
        if self.strategies[0] not in self._surveys or not setting[0]:
            return None
        k, mode = setting
        preview = self._preview(k, mode)
        if preview is self._surveys[self.strategies[0]]:
            return None  # no saved value is known to be the blocks' own
        floor = preview.floor_bytes + (self._floor_error(mode) or 0.0) * k
        if (k, mode, budget_bytes) not in self._estimated:
            try:
                seconds = preview.plan(max(budget_bytes, preview.floor_bytes)).seconds
            except InfeasibleBudgetError:  # the search's floor is the preview's: reached only by rounding
                seconds = math.inf
            self._estimated[k, mode, budget_bytes] = seconds
        return floor, self._estimated[k, mode, budget_bytes]

    def _preview(self, k: int, mode: str) -> Survey:
        """The survey without recompute, previewed with the first ``k`` blocks recomputed (kept)."""
        if (k, mode) not in self._previews:
            base = self._surveys[self.strategies[0]]
            self._previews[k, mode] = base.preview(self.blocks[:k], mode, self._recompute_seconds(k, mode))
        return self._previews[k, mode]

    def _floor_error(self, mode: str) -> float | None:
        """Per recomputed block, how far the surveyed floor of ``mode`` with the most blocks lies above its preview.

        None while no setting of ``mode`` is surveyed (the estimates are not calibrated).
        """
        surveyed = [k for (k, m) in self._surveys if k and m == mode]
        if not surveyed:
            return None
        k = max(surveyed)
        return (self._surveys[k, mode].floor_bytes - self._preview(k, mode).floor_bytes) / k

    def _survey_order(self, setting: tuple[int, str], budget_bytes: int) -> tuple[int, float, int]:
        """Sort key of the settings still to survey: surveyed first, then those estimated to meet the budget by
        their estimated time, then the others, each group as listed."""
        index = self.strategies.index(setting)
        if setting in self._surveys or setting in self._skipped or not setting[0]:
            return (0, 0.0, index)
        estimate = self._estimate(setting, budget_bytes)
        if estimate is None:
            return (1, 0.0, index)
        floor, seconds = estimate
        return (1, seconds, index) if floor <= budget_bytes else (2, 0.0, index)

    def _estimate_rules_out(self, setting: tuple[int, str], budget_bytes: int, best: float) -> str | None:
        """Why a setting need not be surveyed once a plan is found (its estimate cannot beat it), or None."""
        estimate = None if math.isinf(best) else self._estimate(setting, budget_bytes)
        if estimate is None:
            return None
        floor, seconds = estimate
        margin = ESTIMATE_MARGIN if self._floor_error(setting[1]) is None else CALIBRATED_MARGIN
        if floor > budget_bytes * (1 + margin):
            return f"its estimated floor {floor / _MiB:.2f} MiB is above the budget"
        if floor <= budget_bytes and seconds >= best * (1 + ESTIMATE_MARGIN):
            return f"its plan is estimated at {seconds * 1e3:.2f} ms, above a plan found ({best * 1e3:.2f} ms)"
        return None

    def _check_lazily(
        self, ranked: list[tuple[tuple[int, str], Survey, Plan]], budget_bytes: int, log: list[str]
    ) -> tuple[Plan, str]:
        """Step 4: the first ranked setting checked alone while settings are left unsurveyed; if its checked plans
        miss the budget, every setting surveyed and ranked again (:meth:`_check_ranked`: the same choice as
        with every setting surveyed from the start, checks kept)."""
        if all(s in self._surveys or s in self._skipped for s in self.strategies):
            return self._check_ranked(ranked, budget_bytes, log)
        try:
            return self._checked_best(ranked[:1], budget_bytes, log)
        except (InfeasibleBudgetError, InfeasibleFidelityError):
            log.append(f"{_name(*ranked[0][0])}: checked above the budget: the settings not surveyed are surveyed")
        ranked, _ = self._search(budget_bytes, log, lazy=False)
        return self._check_ranked(ranked, budget_bytes, log)

    def _checked_before(self, budget_bytes: int, unfaithful: list[Plan], check: bool) -> tuple[Plan, str]:
        """Step 3, no setting within the fidelity limit: a plan checked for an earlier budget that meets this one.

        Raises:
            InfeasibleFidelityError: none (or ``check`` is off); it names the best predicted SQNR.
        """
        reused = [(p, peak) for p, peak in self._checked.values() if peak <= budget_bytes and self._faithful(p)]
        if check and reused:
            return cheapest(reused, budget_bytes), "a plan checked before"
        raise InfeasibleFidelityError(budget_bytes, self.min_sqnr_db, max(p.predicted_sqnr_db for p in unfaithful))

    def _check_ranked(
        self, ranked: list[tuple[tuple[int, str], Survey, Plan]], budget_bytes: int, log: list[str]
    ) -> tuple[Plan, str]:
        """Step 4: the first setting whose checked plan meets the budget (:meth:`_checked_best`), and why it was kept.

        Just above the modelled floor (within :data:`FLOOR_MARGIN`), where no
        searched plan checks within the budget, the all-packed plans are
        checked as below it (:meth:`_below_floor`): a plan that meets a lower
        budget must meet this one.

        Raises:
            InfeasibleBudgetError: no plan checked meets the budget.
            InfeasibleFidelityError: every plan checked measured below ``min_sqnr_db``.
        """
        try:
            return self._checked_best(ranked, budget_bytes, log)
        except InfeasibleBudgetError as error:
            if budget_bytes > self.floor_bytes * (1 + FLOOR_MARGIN):
                raise
            try:
                return self._below_floor(budget_bytes, log), _SMALLEST
            except InfeasibleBudgetError as below:  # it names the lowest checked peak if below the floor
                lowest = below.floor_bytes if below.checked else error.floor_bytes
                raise InfeasibleBudgetError(budget_bytes, lowest, self.baseline_bytes, checked=True) from None

    def _chosen(self, best: Plan, log: list[str], kept: str, verbose: bool) -> Plan:
        """Step 5: the plan returned: ``best`` with the planner's baseline and floor, and the driver's log after its own."""
        setting = (len(best.recompute), best.recompute_mode if best.recompute else FULL)
        if self.min_sqnr_db is not None:
            log.append(fidelity_line(best, self.min_sqnr_db, self._limited.get(setting, 0)))
        log.append(f"kept: {_name(*setting)}, {kept}")
        floor = min(found.floor_bytes for found in self._surveys.values())  # over the settings surveyed
        chosen = dataclasses.replace(
            best, baseline_peak_bytes=self.baseline_bytes, floor_bytes=floor, log=(*best.log, *log), **self._cost()
        )
        if verbose:
            print(chosen.report())
        return chosen

    def _below_floor(self, budget_bytes: int, log: list[str]) -> Plan:
        """A budget below every modelled floor, checked: the smallest-payload plans of the settings near the floor.

        With every candidate packed, the hooked graphs can peak below the
        floor modelled on the graphs surveyed without hooks. Each setting
        whose modelled floor is within :data:`FLOOR_MARGIN` of the least is checked so; of those
        and the plans checked before that meet the budget, the least modelled time wins.

        Raises:
            InfeasibleBudgetError: none meets the budget; it names the lowest
                checked peak (``checked``; above the modelled floor where every
                check peaked above it), else, where nothing was checked, the modelled floor.
        """
        floor = self.floor_bytes
        near = [(s, found) for s, found in self._usable() if found.floor_bytes <= floor * (1 + FLOOR_MARGIN)]
        near.sort(key=lambda sf: sf[1].floor_bytes)  # stable: ties go to the setting tried first
        for setting, found in near:
            smallest = found.plan_smallest(budget_bytes)
            if packs_nothing(smallest) or not self._faithful(smallest):
                why = "packs nothing" if packs_nothing(smallest) else f"every candidate packed{predicted_db(smallest)}"
                log.append(f"{_name(*setting)}: below its modelled floor: {why}")
                continue
            try:
                peak = self._check(setting, smallest)
            except (ValueError, NotCompiledError) as error:
                warn_unchecked(log, _name(*setting), error, "not used below the modelled floor")
                continue
            log.append(
                f"{_name(*setting)}: below its modelled floor {found.floor_bytes / _MiB:.2f} MiB: every candidate "
                f"at its smallest payload, {peak / _MiB:.2f} MiB on the graphs compiled with its hooks"
            )
        checked = [(p, peak) for p, peak in self._checked.values() if self._faithful(p)]  # with earlier budgets' checks
        meets = [(p, peak) for p, peak in checked if peak <= budget_bytes]
        if not meets:  # a checked peak is a budget that is met; the modelled floor, where none was checked, may not be
            lowest = min((peak for _, peak in checked), default=floor)
            raise InfeasibleBudgetError(budget_bytes, lowest, self.baseline_bytes, checked=bool(checked))
        return cheapest(meets, budget_bytes)

    def _checked_best(
        self, ranked: list[tuple[tuple[int, str], Survey, Plan]], budget_bytes: int, log: list[str]
    ) -> tuple[Plan, str]:
        """The first setting, by modelled time, with a plan whose checked peak meets the budget, and why it was kept.

        See :mod:`savedhooks.planner.check`. A setting whose check raises
        (its hooked graphs did not compile, or the memory model cannot read
        them) warns; what it checked before still counts, and where it
        checked nothing, its unchecked plan is kept.
        """
        lowest: int | None = None
        for setting, found, first in ranked:
            name = _name(*setting)
            if packs_nothing(first) and not measures(first):  # under inductor measured: the model can be off
                log.append(f"{name}: packs nothing: its graphs are those surveyed")
                return first, "packing nothing: the surveyed graphs, modelled already"
            failed = False
            try:
                _, lines = tighten(found, budget_bytes, functools.partial(self._check, setting), self._faithful)
                log.extend(f"{name}: {line}" for line in lines)
            except (ValueError, NotCompiledError) as error:  # the hooked graphs did not compile, or read
                warn_unchecked(log, name, error, "the survey's model of its plan is kept if nothing else was checked")
                failed = True
            mine = [(p, peak) for (s, _), (p, peak) in self._checked.items() if s == setting and self._faithful(p)]
            meets = [(p, peak) for p, peak in mine if peak <= budget_bytes]
            if meets:
                return cheapest(meets, budget_bytes), _CHECKED
            if failed and not mine:
                return first, "its check failed: the survey's model alone"
            if mine:
                least = min(peak for _, peak in mine)
                lowest = least if lowest is None else min(lowest, least)
        if lowest is None:  # every plan checked measured below min_sqnr_db: the best that meets the budget's peak
            settings = {setting for setting, _, _ in ranked}
            checked = [(p, peak) for (s, _), (p, peak) in self._checked.items() if s in settings]
            within = [p for p, peak in checked if peak <= budget_bytes] or [p for p, _ in checked]
            best = max(p.checked_sqnr_db for p in within)
            raise InfeasibleFidelityError(budget_bytes, self.min_sqnr_db, best, checked=True)
        # packing nothing runs the surveyed graphs: their modelled peak is checked already
        raise InfeasibleBudgetError(budget_bytes, min(lowest, self.baseline_bytes), self.baseline_bytes, checked=True)

    def _faithful(self, plan: Plan) -> bool:
        """Whether a plan's SQNR (checked, else predicted) meets ``min_sqnr_db`` (always, without one)."""
        return meets_limit(plan, self.min_sqnr_db)

    def _check(self, setting: tuple[int, str], plan: Plan) -> int:
        """A plan's checked peak, once per choice; with several processes, on every rank (the highest)."""
        key = (setting, choices_of(plan))
        if key not in self._checked:
            if several():
                peak = checked_together(setting, plan.to_json(), functools.partial(self._check_here, setting, plan))
            else:
                grads = None if self.min_sqnr_db is None else {}  # in one process the check measures fidelity too
                readings: dict[str, int] = {}
                peak = self._check_here(setting, plan, grads, readings)
                if grads:
                    plan = dataclasses.replace(plan, checked_sqnr_db=worst_sqnr(self.limit().reference, grads)[0])
                plan = _with_readings(plan, readings)
            self._checked[key] = (plan, peak)
        return self._checked[key][1]

    def _check_here(
        self, setting: tuple[int, str], plan: Plan, grads: dict | None = None, readings: dict | None = None
    ) -> int:
        """This process's check of a plan (:func:`~savedhooks.planner.check.check_peak`).

        ``grads`` and ``readings`` are filled if given.
        """
        model, inputs, loss_fn, _, seed = self._args
        # the eager loss's peak on the same output, measured by the survey (0: unknown, measured again)
        # (never surveyed here: under several processes a survey alone on one rank would run its collectives alone)
        found = self._surveys.get(setting)
        loss = found.loss_bytes if found is not None and found.loss_bytes else None
        return check_peak(model, inputs, plan, loss_fn, seed, loss, grads, found.loss_saved if found else None, readings)


def _with_readings(plan: Plan, readings: dict[str, int]) -> Plan:
    """``plan`` with its check's measured peak, and a log line where the model and the measure differ by over 5 %."""
    measured, modelled = readings.get("measured"), readings.get("modelled")
    if measured is None or modelled is None:
        return plan
    log = plan.log
    if abs(measured - modelled) > MODEL_TOLERANCE * max(measured, 1):
        log = (*log, f"checked: modelled {modelled / _MiB:.2f} MiB, measured {measured / _MiB:.2f} MiB "
                     f"({modelled / max(measured, 1):.2f}x): the measurement is the plan's peak")  # fmt: skip
    return dataclasses.replace(plan, measured_peak_bytes=measured, log=log)


def _name(k: int, mode: str, verb: str = "recompute") -> str:
    """A recompute setting in the log: ``"recompute 2 blocks"``, ``"recompute 2 blocks selectively"``."""
    return f"{verb} {k} blocks" + (" selectively" if k and mode == SELECTIVE else "")


def _compiled(model: torch.nn.Module) -> bool:
    """Whether ``model`` is ``torch.compile``'s wrapper of a module, or a module compiled in place by ``.compile()``."""
    return is_compiled_module(model)
