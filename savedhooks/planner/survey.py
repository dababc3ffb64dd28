"""The survey: what planning needs from a model, measured once per recompute setting; then a search per budget.

Design notes
------------
* The survey compiles the model once, with the target backend, and runs one
  training step (forward, loss, backward; no optimizer step):
  1. the census: under ``Census(Policy(blocks=None))`` hooks (fp8: the plans'
     one-byte codec), which pack nothing, it lists
     the saved tensors the policy would pack (the candidates; what the policy
     keeps stays kept) with their keys;
  2. the timeline: the step's AOTAutograd graphs, kept
     (:func:`savedhooks.planner.recording.recording_backend`) and laid end to end
     by the memory model (:func:`~savedhooks.planner.census.step_timeline`). Hooks
     that pack nothing leave the graphs as they are without hooks but for the
     names of the saved values, which the recording gives back
     (:func:`savedhooks.compiler.passes.unhook_names`): a second compile without hooks
     would cost as much again for the same graphs (``tests/planner/test_planner.py``
     compares them).
  Planning a budget is then the search alone (:mod:`savedhooks.planner.search`):
  the choice is modelled, not measured.
* Blocks that a setting recomputes are checkpointed during both steps
  (:mod:`savedhooks.planner.recompute`): the census and the graphs are those of
  the model as the plan will run it (block inputs saved, the blocks' forwards
  recomputed in the backward graph).
* Each survey ends with ``torch.compiler.reset()``: its compiles leave cache
  entries for the model's frames under backends used once, and a planner
  surveys up to nine settings; past dynamo's recompile limit (8 per frame) the
  user's own ``torch.compile`` of the model would run eagerly, without
  placement, and peak above the plan's prediction. The reset drops every
  compiled frame of the process: plan before compiling.
* Units: the census entries of one plan key, or of several whose tensors are
  views of one storage (they free it together, so they get one choice).
* Options per candidate: keep; bf16 (float32 and float64 tensors); fp8 (the
  policy's codec, e4m3 blocks of 128); a bitmask for bool tensors; offload to
  pinned host memory for tensors on an accelerator (no device payload). Where
  the policy holds a tensor in a 16-bit float or in int8 rows (fused
  attention's operands, ``Policy.attention``), fp8 is not offered (plans keep
  them or hold them in bf16, or in int8 rows where the policy does: a plan
  packing every candidate is then never larger than the policy's choice): the backward recomputes the
  attention probabilities from them, and fp8's rounding there lands whole in
  the query and key gradients (:func:`savedhooks.codecs.policy.is_attention_operand`). Payload
  bytes (device bytes) come from encoding a fake tensor of the candidate's
  shape; time from :func:`savedhooks.planner.costs.seconds_per_byte` on the
  inputs' device (for offload: the copies there and back, as if unhidden).
* An eager loss's saved tensors are kept, never candidates (the training step
  marks where the loss starts: :func:`savedhooks.fidelity.select.mark_loss`;
  the model's own eager saves, outside its compiled graphs, stay candidates).
  The loss point of the timeline is the loss's own peak, and a loss peaks in
  its backward, where each saved tensor is unpacked to its full size while its
  payload is still held: packing it adds the payload there and frees nothing
  (the tests' MLP under inductor, whose ``square_mean_loss`` saves the model's
  output with ``pow``, peaks higher with that output packed in fp8 than kept).
* What the prediction covers: the compiled graphs and the tensors an eager loss
  saves, with placement (the reorder pass, which plain ``torch.compile`` gets
  inside :class:`savedhooks.saved_tensors_hooks`, ``sh.backend("aot_eager")``
  under aot_eager). An eager loss's own temporaries are not in it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch

from savedhooks._torch import pytree
from savedhooks._torch.tensors import FakeTensorMode
from savedhooks.codecs import Downcast, Int8Rows, Policy
from savedhooks.codecs.backends import materializes_better
from savedhooks.compiler.api import saved_tensors_hooks
from savedhooks.fidelity.select import Census, SavedTensor, keyed_run
from savedhooks.fidelity.sensitivity import default_loss
from savedhooks.memory.sizes import tensor_nbytes
from savedhooks.planner.census import GraphTimeline, Scope, StepTimeline, key_of_saved, step_timeline
from savedhooks.planner.costs import recompute_seconds as blocks_recompute_seconds
from savedhooks.planner.costs import seconds_per_byte
from savedhooks.planner.recompute import FULL, SAVED_OPS, SELECTIVE
from savedhooks.planner.result import CODECS, Plan, PlannedTensor, check_budget, check_output_held
from savedhooks.planner.search import Option, SearchResult, Unit, floor_of, result_of, search, search_within, sqnr_db
from savedhooks.planner.step import NotCompiledError, device_of, loss_peak, output_terms, record_step

__all__ = ["NotCompiledError", "Survey", "survey"]

_SELECTIVE_SAVED = frozenset(op.__name__ for op in SAVED_OPS)
# the codecs whose decode inductor fuses into the readers (decomposed forms): they hold only the payload to the last read
_FUSED_DECODES = ("bf16", "fp8")


def _options(
    tensors: list[SavedTensor], device: torch.device, backend: str, by_loss: bool = False
) -> tuple[Option, ...]:
    """Keep, and each codec that accepts the tensors, with device payload bytes (fake encode) and time.

    Keep alone where ``by_loss`` (the eager loss saves one of them). No fp8
    where the policy packs one of them in a 16-bit float or int8 rows (module notes).

    Offload is a choice for tensors on an accelerator (its payload on the device
    is 0 bytes; host bytes are not counted); its time is the copies' round trip,
    measured once per device like the codecs' (:func:`seconds_per_byte`), as if
    no copy overlapped compute.
    """
    first = tensors[0]
    total = sum(t.bytes for t in tensors)
    options = [Option("keep", total, 0.0)]
    if not all(isinstance(s, int) for s in first.shape):
        return tuple(options)  # symbolic sizes: kept (the payload is not known)
    if by_loss:
        return tuple(options)  # packing frees nothing at the loss's peak (module notes)
    names = ("bitmask",) if first.dtype == torch.bool else ("bf16", "fp8") if first.dtype.is_floating_point else ()
    if any(isinstance(t.packed_as, (Downcast, Int8Rows)) for t in tensors):
        names = tuple(n for n in names if n != "fp8")
        if all(isinstance(t.packed_as, Int8Rows) for t in tensors):
            names = (*names, "int8rows")  # what the policy holds them in: the planner's floor is never above it
    for name in (*names, "offload"):
        codec = CODECS[name]
        if name == "bf16" and first.dtype not in (torch.float32, torch.float64):
            continue
        with FakeTensorMode():
            x = torch.empty(first.shape, dtype=first.dtype, device=device)
            if not codec.accepts(x):
                continue
            leaves = pytree.tree_leaves(codec.encode(x))
            payload = sum(tensor_nbytes(t) for t in leaves if isinstance(t, torch.Tensor) and t.device == x.device)
        seconds = seconds_per_byte(codec, first.dtype, device, backend) * total
        options.append(Option(name, payload * len(tensors), seconds, fused=name in _FUSED_DECODES))
    return tuple(options)


@dataclasses.dataclass(frozen=True)
class Survey:
    """What planning needs from a model, measured once (:func:`survey`); :meth:`plan` for each budget.

    Attributes:
        units: the candidates, in key order (:class:`savedhooks.planner.search.Unit`).
        saved: unit key (a plan key, or several joined by ``" + "``) -> the census
            entries of its saved tensors.
        live: the step's timeline with nothing packed.
        backend: the ``torch.compile`` backend surveyed.
        recompute: the blocks checkpointed during the survey (module paths).
        recompute_seconds: modelled time of their recompute per step.
        recompute_mode: how they are recomputed (``"full"`` or ``"selective"``).
        loss_bytes: the measured peak of the eager loss alone, forward and
            backward, on the model's output (:func:`~savedhooks.planner.step.loss_peak`;
            0 when unknown). A check reuses it rather than measure it again.
        max_harm: the most harm a plan may have (its options' ``harm`` set by
            :mod:`savedhooks.planner.fidelity`), or None: fidelity not measured.
        output_held: the step modelled keeps the model's output to its end
            (:func:`survey`).
        loss_saved: the plan keys of the tensors the eager loss saves (kept;
            the model's own eager saves, outside its compiled graphs, are not
            among them).
        scopes: timeline key (``"g<run>:<node>"``) -> each saved value's
            :class:`~savedhooks.planner.census.Scope` and span (candidates or
            not): read by :meth:`preview`.
    """

    units: tuple[Unit, ...]
    saved: Mapping[str, tuple[SavedTensor, ...]]
    live: tuple[int, ...]
    backend: str
    recompute: tuple[str, ...] = ()
    recompute_seconds: float = 0.0
    recompute_mode: str = FULL
    loss_bytes: int = 0
    max_harm: float | None = None
    output_held: bool = False
    loss_saved: frozenset[str] = frozenset()
    scopes: Mapping[str, tuple[Scope, tuple[int, int]]] = dataclasses.field(default_factory=dict)

    @property
    def baseline_bytes(self) -> int:
        """The modelled peak with nothing packed."""
        return max(self.live, default=0)

    @functools.cached_property
    def floor_bytes(self) -> int:
        """The lowest modelled peak: where the search stops with a budget of 0 (see :mod:`~savedhooks.planner.search`)."""
        return search(self.live, self.units, 0).peak

    def plan(self, budget_bytes: int, verbose: bool = False) -> Plan:
        """The plan for one budget (no compile, no step: the search alone).

        Args:
            budget_bytes: as for :func:`plan`.
            verbose: print the report.

        Returns:
            A :class:`Plan`: with :attr:`max_harm`, the least time whose harm
            is within it, else the least harm found
            (:func:`~savedhooks.planner.search.search_within`; compare its
            ``predicted_sqnr_db``).

        Raises:
            TypeError: ``budget_bytes`` is not an int.
            ValueError: ``budget_bytes`` is not positive.
            InfeasibleBudgetError: the budget is below :attr:`floor_bytes`.
        """
        check_budget(budget_bytes, self.floor_bytes, self.baseline_bytes)
        limit = math.inf if self.max_harm is None else self.max_harm
        planned = self._planned(search_within(self.live, self.units, budget_bytes, limit), budget_bytes)
        if verbose:
            print(planned.report())
        return planned

    def plan_smallest(self, budget_bytes: int) -> Plan:
        """The plan that packs every candidate at its smallest payload (:func:`~savedhooks.planner.search.floor_of`).

        The search stops at the modelled floor packing only what covers its
        peak; this packs the rest too, for when the graphs compiled with a
        plan's hooks peak elsewhere (:mod:`savedhooks.planner.check`).

        Args:
            budget_bytes: the budget it is made for (recorded in the plan).

        Returns:
            A :class:`Plan`.

        Raises:
            TypeError: ``budget_bytes`` is not an int.
            ValueError: ``budget_bytes`` is not positive.
        """
        check_budget(budget_bytes)
        log = ("every candidate at its smallest payload",)
        return self._planned(result_of(self.live, self.units, floor_of(self.units), log), budget_bytes)

    def preview(self, blocks: Sequence[str], mode: str, seconds: float) -> Survey:
        """A model of this survey's step with ``blocks`` checkpointed too, from its own timeline (no compile).

        A survey of a recompute setting costs a compile and a step; this
        estimate tells the planner which settings are worth one. A saved
        value that a recomputed block makes and only that block reads
        (:attr:`scopes`) is no longer saved (``"selective"``: unless a
        matrix product or attention made its storage,
        :data:`~savedhooks.planner.recompute.SAVED_OPS`): it is held again
        only from the first backward use of any value its block saves (where
        the recompute runs) to its own first use. Its forward life up to its
        last forward reader is left out (a few ops), and so is the recompute's
        own workspace; values the partitioner saves only with recompute (a
        product's input) are not added. A block's output, which the next
        block reads, stays saved (as the checkpoint of that block saves its
        input). A unit all of whose values are recomputed leaves the candidates.

        Args:
            blocks: module paths of the blocks to recompute in addition to
                :attr:`recompute`.
            mode: ``"full"`` or ``"selective"``.
            seconds: the modelled recompute time of the result (all its blocks).

        Returns:
            A :class:`Survey` of the estimate: its floor and its plans' times
            estimate a survey of the setting (its keys are this survey's, not
            the setting's graphs'); this survey itself where no saved value
            is the blocks' own (no scope names them: no basis for an estimate).
        """
        owned = set(blocks)
        gone: dict[tuple[int, int], tuple[str, int]] = {}  # span -> (block, bytes)
        first_use: dict[str, int] = {}  # block -> the first backward use of a value it saves: its recompute runs there
        for scope, span in self.scopes.values():
            owner = next((p for p in scope.paths if p in owned), None)
            if owner is None:
                continue
            first_use[owner] = min(first_use.get(owner, span[1]), span[1])
            if not (mode == SELECTIVE and scope.made_by in _SELECTIVE_SAVED):
                gone[span] = (owner, gone.get(span, (owner, 0))[1] + scope.nbytes)
        if not gone:
            return self
        delta = [0] * (len(self.live) + 1)
        for (start, end), (owner, nbytes) in gone.items():
            stop = min(first_use[owner], end)
            if start < stop:
                delta[start] -= nbytes
                delta[stop] += nbytes
        live, change = [], 0
        for point, value in enumerate(self.live):
            change += delta[point]
            live.append(value + change)
        units = tuple(u for u in self.units if not u.spans or any((a, b) not in gone for a, b, _ in u.spans))
        return dataclasses.replace(
            self, units=units, live=tuple(live), recompute=(*self.recompute, *blocks),
            recompute_seconds=seconds, recompute_mode=mode,
        )  # fmt: skip

    def _planned(self, result: SearchResult, budget_bytes: int) -> Plan:
        """The :class:`Plan` of a search result."""
        tensors = []
        for unit, o in sorted(zip(self.units, result.choice), key=lambda uo: (-uo[0].bytes, uo[0].key)):
            first, option = self.saved[unit.key][0], unit.options[o]
            held = (*unit.spans, *unit.reread) if option.fused else unit.spans
            at_peak = any(start <= result.at < end for start, end, _ in held)
            dtype = str(first.dtype).removeprefix("torch.")
            tensors.append(
                PlannedTensor(
                    unit.key,
                    first.op,
                    first.shape,
                    dtype,
                    unit.bytes,
                    len(self.saved[unit.key]),
                    option.name,
                    option.payload,
                    option.seconds,
                    at_peak,
                )
            )
        return Plan(
            tuple(tensors),
            budget_bytes,
            result.peak,
            self.baseline_bytes,
            self.floor_bytes,
            self.backend,
            result.log,
            self.recompute,
            self.recompute_seconds,
            self.recompute_mode,
            None if self.max_harm is None else sqnr_db(result.harm),
            output_held=self.output_held,
        )


def survey(
    model: torch.nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    backend: str = "inductor",
    seed: int = 0,
    recompute: Sequence[str] = (),
    recompute_seconds: float | None = None,
    recompute_mode: str = FULL,
    output_held: bool = False,
) -> Survey:
    """Census the saved tensors and model the step's memory, once, to plan for any budget.

    Compiles the model once and runs one training step, under hooks that pack
    nothing (a census of the saved tensors), its graphs kept for the memory
    model; the model's gradients are cleared, its parameters unchanged.
    Calibrates each codec's time once per process.

    Args:
        model: as for :func:`savedhooks.plan` (the survey compiles it).
        example_inputs: as for :func:`savedhooks.plan`.
        loss_fn: as for :func:`savedhooks.plan`.
        backend: as for :func:`savedhooks.plan`.
        seed: as for :func:`savedhooks.plan`.
        recompute: module paths of blocks to checkpoint during the survey (as
            the plan will run them: :meth:`Plan.apply`).
        recompute_seconds: their recompute time per step; ``None``: measured
            once per machine (:func:`savedhooks.planner.costs.recompute_seconds`).
        recompute_mode: ``"full"`` or ``"selective"``
            (:func:`savedhooks.planner.recompute.checkpoint_blocks`).
        output_held: as for :func:`savedhooks.plan`.

    Returns:
        A :class:`Survey`.

    Raises:
        TypeError: ``model`` is not a module, or ``output_held`` not a bool.
        ValueError: ``backend`` is unknown, the output has no floating tensor
            and no ``loss_fn``, or a ``recompute`` path names no submodule.
        NotCompiledError: as :func:`savedhooks.planner.step.record_step`.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"plan: model must be a torch.nn.Module, got {type(model).__name__}")
    check_output_held(output_held, "plan")
    loss_fn = loss_fn or default_loss
    recompute = tuple(recompute)
    if recompute_seconds is None:
        seconds = blocks_recompute_seconds(model, example_inputs, recompute, recompute_mode) if recompute else ()
        recompute_seconds = sum(seconds, 0.0)
    with keyed_run() as run:
        census = functools.partial(saved_tensors_hooks, Census(Policy(blocks=None)).hooks(), reorder=False)
        step = record_step(model, example_inputs, loss_fn, backend, seed, census, True, recompute, recompute_mode)
    forwards, backwards, fused = step.forwards, step.backwards, step.fused
    device = device_of(example_inputs)
    eager = [t for t in run.census if t.key.startswith("eager:")]
    by_loss = frozenset(key_of_saved(t) for t in eager if run.saved_by_loss(t.key))
    outlives_loss, held = output_terms(step, device, output_held)
    loss = loss_peak(loss_fn, step.output, device, seed, outlives_loss)
    timeline = step_timeline(forwards, backwards, eager, loss, held)
    runs = step.runs
    first = {g: r for r, g in reversed(list(enumerate(runs)))}  # a graph's first run: its census index's timeline
    groups, blocked = _choice_groups(run.census, [forwards[first[g]] for g in sorted(first)])
    at = {t.key: _run_keys(t.key, runs) for ts in groups.values() for t in ts if t.key not in blocked}
    units = tuple(
        Unit(
            key,
            sum(t.bytes for t in ts),
            tuple((*timeline.spans[k], t.bytes) for t in ts for k in at.get(t.key, ()) if k in timeline.spans),
            _per_run(
                _merged_options(
                    [_options(same, device, backend, key_of_saved(same[0]) in by_loss) for same in _by_plan_key(ts)]
                ),
                sum(t.bytes * max(len(at.get(t.key, ())), 1) for t in ts) / max(sum(t.bytes for t in ts), 1),
            ),
            tuple(span for t in ts for span in _reread(t, at.get(t.key, ()), timeline, device, fused)),
        )
        for key, ts in sorted(groups.items())
    )
    return Survey(
        units,
        groups,
        timeline.live,
        backend,
        recompute,
        recompute_seconds,
        recompute_mode,
        loss,
        output_held=output_held,
        loss_saved=by_loss,
        scopes=_scopes(forwards, timeline),
    )


def _scopes(forwards: list[GraphTimeline], timeline: StepTimeline) -> dict[str, tuple[Scope, tuple[int, int]]]:
    """Timeline key ``"g<run>:<node>"`` -> the saved value's scope and span, for each value with a span."""
    return {
        key: (scope, timeline.spans[key])
        for r, fw in enumerate(forwards)
        for name, scope in fw.scopes.items()
        if (key := f"g{r}:{name}") in timeline.spans
    }

def _run_keys(key: str, runs: tuple[int, ...]) -> list[str]:
    """The timeline keys of a census key: ``"g<i>:<node>"`` once per run of graph ``i`` (see :attr:`RecordedStep.runs`).

    A census lists what the hooks saw while the graphs were traced, once per
    compiled graph; a graph that dynamo reused runs, and saves, once per call,
    each run under the same plan key. Eager keys are their own.
    """
    graph, _, name = key.partition(":")
    if not graph.startswith("g") or not graph[1:].isdigit():
        return [key]
    return [f"g{r}:{name}" for r, g in enumerate(runs) if g == int(graph[1:])]


def _reread(
    saved: SavedTensor, keys: Collection[str], timeline: StepTimeline, device: torch.device, fused: bool
) -> list[tuple[int, int, int]]:
    """Under inductor, the points after the first use of ``saved`` (at each of its timeline ``keys``) where a fused decode holds only the payload.

    Floating tensors only, and not the 16-bit ones on the CPU, which the codecs
    decode with their materializing ops (:func:`savedhooks.codecs.backends.uses_fused`).
    """
    if not fused or not saved.dtype.is_floating_point:
        return []
    if materializes_better(torch.empty(0, dtype=saved.dtype, device=device)):
        return []
    return [(a, b, saved.bytes) for k in keys if k in timeline.spans for a, b in timeline.reread.get(k, ())]


def _by_plan_key(tensors: tuple[SavedTensor, ...]) -> list[list[SavedTensor]]:
    by_key: dict[str, list[SavedTensor]] = {}
    for t in tensors:
        by_key.setdefault(key_of_saved(t), []).append(t)
    return list(by_key.values())


def _choice_groups(
    census: list[SavedTensor], forwards: list[GraphTimeline]
) -> tuple[dict[str, tuple[SavedTensor, ...]], set[str]]:
    """Census entries by unit: one plan key, or the plan keys of views sharing a storage (joined by " + ").

    Returns the units and the census keys whose storage also holds a tensor that
    is not a candidate (the policy keeps it): packing them frees nothing.
    """
    key_of = {t.key: key_of_saved(t) for t in census}
    root = {k: k for k in key_of.values()}

    def find(k: str) -> str:
        while root[k] != k:
            k = root[k]
        return k

    blocked: set[str] = set()
    for g, fw in enumerate(forwards):
        for group in set(fw.together.values()):
            keys = [f"g{g}:{name}" for name in group]
            if not all(k in key_of for k in keys):
                blocked.update(keys)
                continue
            for k in keys[1:]:
                root[find(key_of[k])] = find(key_of[keys[0]])
    members: dict[str, list[str]] = {}
    for k in sorted(root):
        members.setdefault(find(k), []).append(k)
    unit_of = {k: " + ".join(ks) for ks in members.values() for k in ks}
    units: dict[str, list[SavedTensor]] = {}
    for t in census:
        units.setdefault(unit_of[key_of[t.key]], []).append(t)
    return {k: tuple(v) for k, v in units.items()}, blocked


def _per_run(options: tuple[Option, ...], runs: float) -> tuple[Option, ...]:
    """Options whose times count every run of a reused graph (``runs``: the unit's runs, weighted by bytes)."""
    return options if runs == 1 else tuple(dataclasses.replace(o, seconds=o.seconds * runs) for o in options)


def _merged_options(per_key: list[tuple[Option, ...]]) -> tuple[Option, ...]:
    """The options every plan key of a unit has, payloads and times summed (fused where every key's is)."""
    names = [o.name for o in per_key[0] if all(any(p.name == o.name for p in opts) for opts in per_key)]
    return tuple(
        Option(
            name,
            sum(o.payload for opts in per_key for o in opts if o.name == name),
            sum(o.seconds for opts in per_key for o in opts if o.name == name),
            all(o.fused for opts in per_key for o in opts if o.name == name),
        )
        for name in names
    )
