"""What a plan is: the choice per saved tensor, the blocks recomputed, the predicted peak; JSON; the hooks that run it."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from typing import Any

import torch

from savedhooks.codecs import Bitmask, Downcast, Float8, Int8Rows, Offload, Policy
from savedhooks.codecs.base import Codec
from savedhooks.codecs.policy import readers_tolerate
from savedhooks.hooks import HookPair, hook_context
from savedhooks.planner.caches import restore_caches, turn_caches_off
from savedhooks.planner.census import plan_key, ranked_name
from savedhooks.planner.recompute import (
    FULL,
    SELECTIVE,
    check_mode,
    checkpoint_blocks,
    checkpointed_blocks,
    restore_blocks,
)

__all__ = ["CODECS", "InfeasibleBudgetError", "Plan", "Planned", "PlannedTensor", "check_budget", "check_output_held"]

_MiB = 1 << 20
_JSON_VERSION = 6  # 2: recompute, recompute_seconds; 3: recompute_mode; 4: predicted_sqnr_db, checked_sqnr_db;
# 5: output_held; 6: measured_peak_bytes, planning_seconds, compiles, steps
# the codecs a plan chooses among, by the names its JSON uses
# (offload: only tensors on an accelerator; every one the plan chooses moves, needed soon or not)
CODECS: dict[str, Codec] = {
    "bf16": Downcast(torch.bfloat16),
    "fp8": Float8(),
    "bitmask": Bitmask(),
    "offload": Offload(keep_needed_soon=False),
    "int8rows": Int8Rows(),  # the policy's codec for fused attention's value (offered only where the policy uses it)
}


class InfeasibleBudgetError(ValueError):
    """The budget is below the lowest peak the planner can reach.

    Attributes:
        budget_bytes: the budget asked for.
        floor_bytes: the lowest modelled peak (every candidate at its smallest
            payload); with ``checked``, the lowest peak of the plans checked on
            the graphs compiled with their hooks (:mod:`savedhooks.planner.check`).
        checked: whether ``floor_bytes`` comes from checked plans.
        baseline_bytes: the modelled peak without hooks.
    """

    def __init__(self, budget_bytes: int, floor_bytes: int, baseline_bytes: int, checked: bool = False) -> None:
        self.budget_bytes = budget_bytes
        self.floor_bytes = floor_bytes
        self.baseline_bytes = baseline_bytes
        self.checked = checked
        how = " (checked on steps compiled with a plan's hooks: measured under inductor)" if checked else ""
        super().__init__(
            f"sh.plan: a budget of {budget_bytes / _MiB:.2f} MiB cannot be met: the lowest peak the planner "
            f"reaches{how} is {floor_bytes / _MiB:.2f} MiB (no hooks: {baseline_bytes / _MiB:.2f} MiB); "
            f"pass budget_bytes >= {floor_bytes}"
        )


class InfeasibleFidelityError(ValueError):
    """No plan that meets the budget is predicted (or, checked, measured) to meet ``min_sqnr_db``.

    Attributes:
        budget_bytes: the budget asked for.
        min_sqnr_db: the fidelity asked for.
        best_sqnr_db: the highest SQNR of the plans found for the budget.
        checked: whether ``best_sqnr_db`` was measured on checked plans' steps (else predicted).
    """

    def __init__(self, budget_bytes: int, min_sqnr_db: float, best_sqnr_db: float, checked: bool = False) -> None:
        self.budget_bytes = budget_bytes
        self.min_sqnr_db = min_sqnr_db
        self.best_sqnr_db = best_sqnr_db
        self.checked = checked
        if checked:
            what = f"meets min_sqnr_db={min_sqnr_db:g} on its checked step: the best measured {best_sqnr_db:.2f} dB"
        else:
            what = f"is predicted to meet min_sqnr_db={min_sqnr_db:g}: the best is predicted at {best_sqnr_db:.2f} dB"
        super().__init__(
            f"sh.plan: no plan within a budget of {budget_bytes / _MiB:.2f} MiB {what} (the errors of the "
            "packed tensors add); raise the budget or lower min_sqnr_db"
        )


def _role(key: str) -> tuple[str, str, str] | None:
    """A plan key's node (``"eager"`` for an eager key), op and dtype: its shape left out; None for another string."""
    parts = key.split("|")
    return (parts[0], parts[1], parts[3]) if len(parts) == 4 else None


def _dims(shape: str) -> tuple[int, ...]:
    """A plan key's shape (``"8x64x64"``, ``"scalar"``) as sizes."""
    return () if shape == "scalar" else tuple(int(size) for size in shape.split("x"))


def _resized(planned: str, shape: str) -> bool:
    """Whether ``shape`` can be ``planned`` at other input sizes: as many dims, one of them the same at least."""
    a, b = _dims(planned), _dims(shape)
    return len(a) == len(b) and (not a or any(x == y for x, y in zip(a, b, strict=True)))


def _one_choice(choices: dict[str, str]) -> str | None:
    """The choice all of ``choices`` (plan key -> choice) make, None where they differ."""
    names = set(choices.values())
    return names.pop() if len(names) == 1 else None


@dataclasses.dataclass(frozen=True)
class Planned(Codec):
    """The codec a plan runs: its choice per plan key; the policy for saved tensors it does not name.

    A plan key names a saved tensor's graph node, op, shape and dtype; it
    matches only at the input shapes the plan was made for. At other input
    shapes (a smaller last batch, a longer sequence; compiled again, with static
    or dynamic shapes) a saved tensor gets, in this order:

    1. the choice of the plan key of its node, op and dtype (its *role*) at
       another shape, where the plan has one and the two shapes have as many
       dims, one of them equal at least. The node is named by its rank among
       the graph's tensor nodes (:func:`~savedhooks.planner.census.ranked_name`),
       so that size arithmetic in a graph compiled with dynamic shapes does
       not shift it;
    2. else, where the plan made one choice for every tensor of its op and
       dtype (among the compiled ones, or among the eager ones for an eager
       tensor: its key names no node), that choice;
    3. else what the fallback (the policy with fp8 for int8 blocks) chooses, as for tensors the plan
       does not name.

    So the plan's choices, and its fidelity, hold at other shapes, and the step
    keeps about its share of the peak without hooks (the bound and its caveat:
    ``docs/integrations.md``, "Shapes that change"): within the budget at a
    smaller batch, above it where the saved tensors grow. Where a tensor of
    step 1 is larger than in the plan, a warning says so once per compiled graph.
    """

    choices: tuple[tuple[str, str], ...]
    # the policy without int8 blocks: a plan's one-byte codec is fp8, and what it falls back on packs the same way
    fallback: Codec | None = dataclasses.field(default_factory=lambda: Policy(blocks=None))

    def __post_init__(self) -> None:
        unknown = {name for _, name in self.choices if name != "keep" and name not in CODECS}
        if unknown:
            raise ValueError(f"Planned: unknown codec names {sorted(unknown)}; known: keep, {', '.join(CODECS)}")
        object.__setattr__(self, "_lookup", dict(self.choices))
        roles: dict[tuple[str, str, str], dict[str, str]] = {}
        ops: dict[tuple[str, str], dict[str, str]] = {}
        for key, name in self.choices:
            role = _role(key)
            if role is not None:
                roles.setdefault(role, {})[key] = name
                ops.setdefault((role[0] == "eager", role[1], role[2]), {})[key] = name
        object.__setattr__(self, "_roles", roles)
        object.__setattr__(self, "_ops", {op: _one_choice(named) for op, named in ops.items()})
        object.__setattr__(self, "_warned", set())

    def codecs(self) -> tuple[Codec, ...]:
        return tuple(CODECS.values()) + (self.fallback.codecs() if self.fallback is not None else ())

    @property
    def eager_window(self) -> int:
        """In eager mode, floating tensors are held until their savers are known, as the policy holds them."""
        return Policy().eager_window

    def eager_holds(self, x: torch.Tensor) -> bool:
        """Whether eager mode holds ``x`` until its savers are known: a floating tensor."""
        return x.is_floating_point()

    def choose(self, x: torch.Tensor) -> int:
        """The plan's codec for ``x``; a lossy one only where its backward readers tolerate it, as in the policy."""
        key = plan_key(x)
        name = self._lookup.get(key)
        if name is None:
            name = self._choice_elsewhere(key)
        if name is None:
            index = self.fallback.choose(x) if self.fallback is not None else -1
            return -1 if index < 0 else len(CODECS) + index
        codec = CODECS.get(name)
        if codec is None or not codec.accepts(x):
            return -1
        if codec.lossy and not readers_tolerate(x, getattr(self.fallback, "allow", ())):
            return -1
        return list(CODECS).index(name)

    def _choice_elsewhere(self, key: str) -> str | None:
        """The plan's choice for a key it does not name (steps 1 and 2 of the class notes); None: none."""
        context = hook_context()
        role = _role(key)
        if role is None:
            return None
        node, op, dtype = role
        shape = key.split("|")[2]
        ranked = (ranked_name(context.node), op, dtype) if context is not None else None
        resized = {k: name for k, name in self._roles.get(ranked, {}).items() if _resized(k.split("|")[2], shape)}
        name = _one_choice(resized)
        if name is None:
            return self._ops.get((context is None, op, dtype))
        largest = max((k.split("|")[2] for k in resized), key=lambda s: math.prod(_dims(s)))
        growth = math.prod(_dims(shape)) / max(math.prod(_dims(largest)), 1)
        graph = id(context.fw_graph)
        if growth > 1 and graph not in self._warned:
            self._warned.add(graph)
            warnings.warn(
                f"sh.plan: the plan was made for smaller input shapes (saved tensor {node} ({op}) is {shape} here, "
                f"{largest} in the plan: {growth:.2f}x its elements). The plan's choices hold and the step keeps about "
                "its share of the peak without hooks, which grows with the saved tensors: the budget does not hold "
                "at these shapes. Plan again with inputs of these shapes to meet it",
                UserWarning,
                stacklevel=3,
            )
        return name


@dataclasses.dataclass(frozen=True)
class PlannedTensor:
    """One choice of a plan.

    Attributes:
        key: the plan key (see :mod:`savedhooks.planner.census`); views of one
            storage get one choice, their keys joined by ``" + "``.
        op: the producing op.
        shape: its shape.
        dtype: its dtype name (``"float32"``).
        bytes: bytes kept without packing (all tensors of the key).
        count: saved tensors with this key.
        choice: ``"keep"`` or a codec name.
        payload: bytes held with the choice.
        seconds: modelled time of the choice per step.
        at_peak: whether it is held at the predicted peak.
    """

    key: str
    op: str | None
    shape: tuple[int | str, ...]
    dtype: str
    bytes: int
    count: int
    choice: str
    payload: int
    seconds: float
    at_peak: bool

    @property
    def keys(self) -> tuple[str, ...]:
        """The plan keys the choice applies to (several for views of one storage: ``key`` joins them with " + ")."""
        return tuple(self.key.split(" + "))


@dataclasses.dataclass(frozen=True)
class Plan:
    """What :func:`plan` chose, and what it predicts.

    Attributes:
        tensors: one entry per plan key, largest first.
        budget_bytes: the budget asked for.
        predicted_peak_bytes: the modelled peak of the planned step.
        baseline_peak_bytes: the modelled peak without hooks.
        floor_bytes: the lowest modelled peak reachable over the recompute
            settings the planner surveyed (the survey's model; a plan checked
            on the graphs compiled with its hooks may peak lower). A setting
            whose recompute alone models more time than the plan is not
            surveyed; :attr:`Planner.floor_bytes` surveys them all.
        backend: the ``torch.compile`` backend the plan is for.
        log: the search's moves.
        recompute: module paths (relative to the planned model) of the blocks
            the plan recomputes in the backward (:meth:`apply`).
        recompute_seconds: modelled time of those recomputes per step.
        recompute_mode: ``"full"`` (whole blocks) or ``"selective"`` (all but
            their matrix products and attention, which stay saved).
        predicted_sqnr_db: the worst parameter-gradient SQNR the plan's lossy
            choices are predicted at (:mod:`savedhooks.planner.fidelity`;
            ``inf``: none lossy), or None where fidelity was not measured
            (no ``min_sqnr_db``).
        checked_sqnr_db: the worst parameter-gradient SQNR measured on the
            check's step against a step without hooks (``min_sqnr_db``, in one
            process), or None.
        output_held: the step predicted keeps the model's output to its end
            (``out = model(x)``); False: the loss holds it alone
            (``loss_fn(model(x)).backward()``). Plans read from JSON of
            version 4 or earlier: False.
        measured_peak_bytes: the peak the check measured on a step with the
            plan's hooks (:func:`savedhooks.planner.check.check_peak`), or None
            (not checked, checked under aot_eager, or in several processes);
            where it is known, ``predicted_peak_bytes`` of a checked plan is it.
        planning_seconds: wall time the planner spent on the model until this
            plan (its surveys and checks, for this and earlier budgets).
        compiles: fresh compiles of the model in that time (one per survey and per check).
        steps: training steps in that time (compiled and eager).
    """

    tensors: tuple[PlannedTensor, ...]
    budget_bytes: int
    predicted_peak_bytes: int
    baseline_peak_bytes: int
    floor_bytes: int
    backend: str
    log: tuple[str, ...] = ()
    recompute: tuple[str, ...] = ()
    recompute_seconds: float = 0.0
    recompute_mode: str = FULL
    predicted_sqnr_db: float | None = None
    checked_sqnr_db: float | None = None
    output_held: bool = False
    measured_peak_bytes: int | None = dataclasses.field(default=None, compare=False)
    planning_seconds: float = dataclasses.field(default=0.0, compare=False)  # what planning took: not the plan
    compiles: int = dataclasses.field(default=0, compare=False)
    steps: int = dataclasses.field(default=0, compare=False)

    def __post_init__(self) -> None:
        check_mode(self.recompute_mode, "Plan: recompute_mode")
        check_output_held(self.output_held, "Plan")

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """Checkpoint the blocks the plan recomputes (``torch.utils.checkpoint``, non-reentrant), in place.

        In mode ``"selective"`` the checkpoint carries torch's selective
        activation checkpointing with :func:`~savedhooks.planner.recompute.save_products`.

        Call it on the module that was planned, before ``torch.compile``;
        :meth:`revert` undoes it. The module tree and ``state_dict`` are unchanged.
        A model whose configs (``module.config``, transformers) have
        ``use_cache=True`` gets ``use_cache=False`` with a warning, recompute
        or not: the plan was made, and trains, without a KV cache
        (:mod:`savedhooks.planner.caches`).

        Args:
            model: the planned module.

        Returns:
            ``model``.

        Raises:
            ValueError: ``model`` lacks a block the plan names, or has blocks
                checkpointed otherwise (another plan applied: revert it first).
                Applying the same plan again changes nothing.
        """
        mode = self.recompute_mode
        other = [path for path, m in checkpointed_blocks(model).items() if path not in self.recompute or m != mode]
        if other:
            raise ValueError(
                f"Plan.apply: blocks {other} are checkpointed already, not as this plan recomputes them "
                "(another plan applied?): revert that plan first"
            )
        checkpoint_blocks(model, self.recompute, mode)
        changed = turn_caches_off(model)
        if changed:
            warnings.warn(
                f"Plan.apply: set use_cache=False on the model's config ({len(changed)} config(s) had it on): a plan "
                "trains without a KV cache, as it was planned (a recomputed block would append to the cache again); "
                "Plan.revert restores it",
                stacklevel=2,
            )
        return model

    def revert(self, model: torch.nn.Module) -> torch.nn.Module:
        """Undo :meth:`apply`: the blocks run as before, and configs it set to ``use_cache=False`` get it back.

        Args:
            model: the module :meth:`apply` changed.

        Returns:
            ``model``.

        Raises:
            ValueError: ``model`` lacks a block the plan names.
        """
        restore_blocks(model, self.recompute)
        restore_caches(model)
        return model

    @property
    def hooks(self) -> HookPair:
        """The hook pair that runs the plan: use it in ``sh.saved_tensors_hooks(plan.hooks)``.

        At input shapes other than the planned ones it applies the plan's
        choices per saved-tensor role (:class:`Planned`).
        """
        return Planned(tuple(sorted((key, t.choice) for t in self.tensors for key in t.keys))).hooks()

    @property
    def seconds(self) -> float:
        """Modelled time the plan adds per step: its codecs and its recomputes."""
        return sum(t.seconds for t in self.tensors) + self.recompute_seconds

    def report(self) -> str:
        """A Markdown table: per plan key, op, bytes, choice and modelled cost, under a heading.

        The heading: the budget and peaks, the blocks recomputed, the predicted
        fidelity, whether the step keeps the model's output, and what planning
        took (time, compiles, training steps).
        """
        heading = (
            f"plan for {self.backend}: budget {self.budget_bytes / _MiB:.2f} MiB, predicted peak "
            f"{self.predicted_peak_bytes / _MiB:.2f} MiB (no hooks {self.baseline_peak_bytes / _MiB:.2f}, "
            f"modelled floor {self.floor_bytes / _MiB:.2f}), modelled time {self.seconds * 1e3:.2f} ms per step"
        )
        recompute = ", ".join(self.recompute) or "none"
        selective = self.recompute and self.recompute_mode == SELECTIVE
        how = " (selective: matrix products and attention saved)" if selective else ""
        heading += f"\nrecomputed blocks: {recompute}{how} ({self.recompute_seconds * 1e3:.2f} ms per step)"
        if self.predicted_sqnr_db is not None:
            heading += f"\npredicted worst parameter-gradient SQNR: {self.predicted_sqnr_db:.1f} dB"
        if self.checked_sqnr_db is not None:
            heading += f", checked {self.checked_sqnr_db:.1f} dB"
        held = "kept to the end of the step" if self.output_held else "dropped once the loss has read it"
        heading += f"\nthe model's output: {held}"
        if self.measured_peak_bytes is not None:
            heading += f"\nchecked: measured peak {self.measured_peak_bytes / _MiB:.2f} MiB on a step with the plan's hooks"
        if self.compiles:
            heading += (
                f"\nplanning: {self.planning_seconds:.1f} s, {self.compiles} compiles, {self.steps} training steps"
            )
        lines = [
            heading,
            "",
            "| saved tensor | op | shape | dtype | count | MiB | choice | payload MiB | ms | at peak |",
            "|---|---|---|---|---:|---:|---|---:|---:|:---:|",
        ]
        for t in self.tensors:
            name = ", ".join(key.split("|")[0] for key in t.keys)
            shape = "x".join(map(str, t.shape))
            lines.append(
                f"| {name} | {t.op} | {shape} | {t.dtype} | {t.count} | {t.bytes / _MiB:.2f} | {t.choice} | "
                f"{t.payload / _MiB:.2f} | {t.seconds * 1e3:.3f} | {'yes' if t.at_peak else ''} |"
            )
        return "\n".join(lines)

    def to_json(self) -> str:
        """The plan as JSON text (:meth:`from_json` reads it back)."""
        return json.dumps({"version": _JSON_VERSION, **dataclasses.asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read a plan written by :meth:`to_json`.

        Args:
            text: the JSON text.

        Returns:
            The :class:`Plan`.

        Raises:
            ValueError: not a plan, another version, an unknown codec name or recompute mode.
            TypeError: ``output_held`` is not a bool.
        """
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") not in range(1, _JSON_VERSION + 1):
            raise ValueError(f"Plan.from_json: expected a savedhooks plan of version 1 to {_JSON_VERSION}")
        data.pop("version")
        data["recompute"] = tuple(data.get("recompute", ()))
        tensors = tuple(PlannedTensor(**{**t, "shape": tuple(t["shape"])}) for t in data.pop("tensors"))
        unknown = {t.choice for t in tensors} - {"keep", *CODECS}
        if unknown:
            raise ValueError(f"Plan.from_json: unknown codec names {sorted(unknown)}")
        return cls(tensors=tensors, **{**data, "log": tuple(data.get("log", ()))})


def check_budget(budget_bytes: Any, floor_bytes: int | None = None, baseline_bytes: int = 0) -> None:
    """Raise unless ``budget_bytes`` is a positive int (and, given a floor, at least the floor).

    Args:
        budget_bytes: the value to check.
        floor_bytes: the lowest modelled peak, if known.
        baseline_bytes: the modelled peak without hooks (for the error message).

    Raises:
        TypeError: not an int (or a bool).
        ValueError: not positive.
        InfeasibleBudgetError: below ``floor_bytes``.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise TypeError(f"plan: budget_bytes must be an int, got {budget_bytes!r}")
    if budget_bytes <= 0:
        raise ValueError(f"plan: budget_bytes must be positive, got {budget_bytes}")
    if floor_bytes is not None and budget_bytes < floor_bytes:
        raise InfeasibleBudgetError(budget_bytes, floor_bytes, baseline_bytes)


def check_output_held(output_held: Any, where: str) -> None:
    """Raise unless ``output_held`` is a bool.

    Args:
        output_held: the value to check.
        where: what takes it (for the message).

    Raises:
        TypeError: not a bool.
    """
    if not isinstance(output_held, bool):
        raise TypeError(f"{where}: output_held must be a bool, got {type(output_held).__name__}")
