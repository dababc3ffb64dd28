"""One recorded training step: compile the model afresh, run forward, loss and backward, model its graphs.

Both the survey (hooks that pack nothing) and the check of a plan (the plan's
own hooks, :mod:`savedhooks.planner.check`) run it; they differ in the hooks
and in whether the recorded graphs get their saved values' names back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from savedhooks._torch import aot, dynamo, inductor, pytree
from savedhooks.fidelity.select import mark_loss
from savedhooks.fidelity.sensitivity import call_model, default_loss, kept_buffers
from savedhooks.memory.measure import measure_peak
from savedhooks.memory.sizes import allocated_bytes, storage_key, tensor_nbytes, tensor_storages
from savedhooks.planner.caches import caches_off
from savedhooks.planner.census import GraphTimeline, timeline_of
from savedhooks.planner.recompute import FULL, checkpointed, resolve_blocks
from savedhooks.planner.recording import AOT_ID, COPIED_INPUTS, GraphRecorder, recording_backend

__all__ = [
    "TALLY",
    "NotCompiledError",
    "Tally",
    "RecordedStep",
    "check_call",
    "checkpoint_regions",
    "counting_runs",
    "device_of",
    "gradient_bytes",
    "graph_timelines",
    "loss_peak",
    "output_terms",
    "record_step",
    "run_order",
    "train_step",
]


class NotCompiledError(RuntimeError):
    """The model ran eagerly: there are no compiled graphs to plan with."""


@dataclasses.dataclass(frozen=True)
class RecordedStep:
    """What one recorded step gives the memory model.

    Attributes:
        forwards: the forward graphs' timelines, in trace order.
        backwards: the backward graphs' timelines, in the order they ran.
        output: the model's output, detached.
        fused: the graphs were modelled as inductor runs them.
        runs: per entry of ``forwards``, the index of its compiled graph (in
            compile order, which a census's ``g<i>`` follows where every graph
            saves a tensor): a graph dynamo reused within the step appears once
            per run (:func:`graph_timelines`).
        measured: with ``measure``, the peak measured on a later step of the
            same compiled graphs (:func:`savedhooks.memory.measure_peak`), else None.
    """

    forwards: list[GraphTimeline]
    backwards: list[GraphTimeline]
    output: Any
    fused: bool
    runs: tuple[int, ...]
    measured: int | None = None


def device_of(example_inputs: Any) -> torch.device:
    """The device of the first tensor in ``example_inputs`` (the CPU if there is none).

    Args:
        example_inputs: a pytree of inputs.

    Returns:
        A device.
    """
    tensors = [t for t in pytree.tree_leaves(example_inputs) if isinstance(t, torch.Tensor)]
    return tensors[0].device if tensors else torch.device("cpu")


def check_call(model: torch.nn.Module, example_inputs: Any, loss_fn: Callable | None, what: str = "plan") -> None:
    """Run the model once on ``example_inputs`` (eager, no grad) and the loss on its output: the planner's input check.

    The steps the planner compiles would meet a bad input inside dynamo or
    autograd, whose messages name neither argument; this forward names them.

    Args:
        model: the module.
        example_inputs: as for :func:`savedhooks.plan`.
        loss_fn: as for :func:`savedhooks.plan` (None: the default loss).
        what: how errors name the caller.

    Raises:
        ValueError: the model raised on ``example_inputs`` (the model's error
            is the cause), or the loss is not a single value.
        TypeError: ``loss_fn`` returned something other than a floating tensor.
    """
    with torch.no_grad(), kept_buffers(model), caches_off(model), torch.random.fork_rng(devices=[]):
        try:
            output = call_model(model, example_inputs)
        except Exception as error:
            first = (str(error).strip().splitlines() or [""])[0][:300]
            raise ValueError(
                f"{what}: the model raised {type(error).__name__} on example_inputs ({first}): pass the inputs of one "
                "training step as the model takes them (a tuple of positional arguments, a dict of keyword "
                "arguments, or one tensor), with the shapes and dtypes training uses"
            ) from error
        loss = (loss_fn or default_loss)(output)
    if not isinstance(loss, torch.Tensor) or not (loss.is_floating_point() or loss.is_complex()):
        kind = f"a {loss.dtype} tensor" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(f"{what}: loss_fn must return a floating scalar tensor to call backward on, got {kind}")
    if loss.numel() != 1:
        raise ValueError(
            f"{what}: loss_fn must return a scalar (one element) to call backward on, got shape {tuple(loss.shape)}: "
            "reduce it (for example .mean() or .sum())"
        )


@dataclasses.dataclass
class Tally:
    """What planning has run in this process: compiles and training steps (read by the planner's report).

    Attributes:
        compiles: fresh compiles of the model (:func:`record_step`: one each).
        steps: training steps, compiled or eager (:func:`train_step`: one each).
    """

    compiles: int = 0
    steps: int = 0


TALLY = Tally()  # the process's counts; a planner reports the difference over its own work


def train_step(
    fn: Callable[..., Any],
    model: torch.nn.Module,
    example_inputs: Any,
    loss_fn: Callable,
    seed: int,
    grads: dict[str, torch.Tensor | None] | None = None,
) -> Any:
    """One training step (forward, loss, backward) under ``seed``, KV caches off; the model's gradients are cleared and its buffers restored after.

    Args:
        fn: the model, compiled or not.
        model: the module (its gradients are cleared before and after; its buffers,
            such as batch norm's running statistics, are restored after).
        example_inputs: as for :func:`savedhooks.plan`.
        loss_fn: turns the output into a scalar.
        seed: ``torch.manual_seed`` before the step (the global RNG is restored after).
        grads: filled, if given, with each parameter's gradient (a copy on
            the CPU; None where it has none) before they are cleared.

    Returns:
        The model's output, detached.

    Raises:
        Whatever the model or the loss raises.
    """
    model.zero_grad(set_to_none=True)
    TALLY.steps += 1
    with kept_buffers(model), caches_off(model), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        output = call_model(fn, example_inputs)
        mark_loss()  # a census tells the loss's saves from the model's eager ones
        loss_fn(output).backward()
    if grads is not None:
        grads.update((n, None if p.grad is None else p.grad.detach().cpu()) for n, p in model.named_parameters())
    model.zero_grad(set_to_none=True)
    return pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, output)


def gradient_bytes(output: Any, device: torch.device) -> int:
    """Bytes of the gradients a loss hands the backward: the output's floating tensors on ``device``.

    Args:
        output: the model's output.
        device: the device whose bytes count.

    Returns:
        Bytes.
    """
    tensors = [t for t in tensor_storages(output) if t.device == device]
    return sum(tensor_nbytes(t) for t in tensors if t.is_floating_point() or t.is_complex())


def _allocated(tree: Any, device: torch.device) -> int:
    """Bytes the allocator counts for the storages of ``tree``'s tensors on ``device`` (elements' bytes without one)."""
    storages: dict[int, int] = {}
    for t in tensor_storages(tree):
        if t.device == device:
            key = storage_key(t)
            nbytes = tensor_nbytes(t) if key is None else t.untyped_storage().nbytes()
            storages[id(t) if key is None else key] = allocated_bytes(nbytes, device)
    return sum(storages.values())


def output_terms(step: RecordedStep, device: torch.device, output_held: bool) -> tuple[bool, int]:
    """How a step's output enters its timeline: whether it outlives the loss, and the bytes the backward adds for it.

    A loop that keeps the output holds it next to its gradient in the
    backward, which the backward graphs' timelines do not count (the forward's
    retained output stands in for the gradient). An output that the last
    forward graph also saves (a ``log_softmax`` head's result) outlives the
    loss in a loop that drops it too.

    Args:
        step: the recorded step.
        device: the device whose bytes count.
        output_held: the loop keeps the output to the end of the step.

    Returns:
        ``(outlives_loss, backward_bytes)``: pass the first to
        :func:`loss_peak` as ``output_held``, the second to
        :func:`~savedhooks.planner.census.step_timeline` as ``held_output``.
    """
    saved = step.forwards[-1].saved_output if step.forwards else 0
    return output_held or saved > 0, gradient_bytes(step.output, device) if output_held else saved


class _HandedOver(torch.autograd.Function):
    """The model's output as a loop that drops it hands it to the loss: held by the loss alone; its gradient ends here."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        ctx.anchor = (anchor.dtype, anchor.device)
        return value.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        dtype, device = ctx.anchor
        return torch.zeros((), dtype=dtype, device=device), None


def loss_peak(loss_fn: Callable, output: Any, device: torch.device, seed: int, output_held: bool = False) -> int:
    """Measured peak of the loss alone, forward and backward, above the model's output (alive when it starts).

    It runs eagerly after the compiled forward graphs, and its own temporaries (a
    cross-entropy's log-softmax, a square's gradient) and the gradient it hands
    to the compiled backward are in no graph.

    Args:
        loss_fn: the loss.
        output: the model's output (detached; it is copied).
        device: where to measure.
        seed: ``torch.manual_seed`` before it.
        output_held: the training loop keeps the output to the end of the
            step (``out = model(x)``); False: the loss holds it alone
            (``loss_fn(model(x)).backward()``), and it is freed when the loss
            no longer needs it (cross-entropy: after its forward).

    Returns:
        Bytes.

    Raises:
        Whatever the loss raises.
    """
    anchor = torch.zeros((), device=device, requires_grad=True)
    copied: list[int] = []

    def hand(t: torch.Tensor) -> torch.Tensor:
        wants_grad = t.is_floating_point() or t.is_complex()
        if output_held:
            return t.requires_grad_(wants_grad)
        return _HandedOver.apply(anchor, t) if wants_grad else t

    def run() -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            # copied in here: the CPU profiler does not see the free of a block allocated before it started
            copies = pytree.tree_map_only(torch.Tensor, torch.Tensor.clone, output)
            copied.append(_allocated(copies, device))
            out = pytree.tree_map_only(torch.Tensor, hand, copies)
            if not output_held:
                del copies  # the loss's argument holds the copies alone
            loss = loss_fn(out)
            del out
            loss.backward()

    return max(measure_peak(run, device=device) - copied[0], 0)


def record_step(
    model: torch.nn.Module,
    example_inputs: Any,
    loss_fn: Callable,
    backend: str,
    seed: int,
    within: Callable[[], contextlib.AbstractContextManager],
    unhook: bool,
    recompute: Sequence[str] = (),
    recompute_mode: str = FULL,
    grads: dict[str, torch.Tensor | None] | None = None,
    measure: bool = False,
    output_held: bool = False,
) -> RecordedStep:
    """Compile ``model`` afresh with ``backend``, run one step inside ``within()``, and model its graphs.

    Every compile traces (no dynamo, AOTAutograd or FX graph cache hits), the
    blocks ``recompute`` names are checkpointed for the step, and dynamo is reset
    after it (see :mod:`savedhooks.planner.survey`: past its recompile limit the
    user's own compile of the model would run eagerly).

    Args:
        model: the module (not compiled).
        example_inputs: as for :func:`savedhooks.plan`.
        loss_fn: turns the output into a scalar.
        backend: ``"inductor"`` or ``"aot_eager"``.
        seed: ``torch.manual_seed`` before the step.
        within: a context manager factory entered around the step (the hooks).
        unhook: the hooks pack nothing: record the graphs as compiled without
            hooks (:func:`savedhooks.planner.recording.recording_backend`).
        recompute: module paths of the blocks to checkpoint.
        recompute_mode: ``"full"`` or ``"selective"``.
        grads: filled with the step's parameter gradients, if given (:func:`train_step`).
        measure: run one more step on the compiled graphs (no compile) and
            measure its peak on the inputs' device (:attr:`RecordedStep.measured`).
        output_held: the measured step holds the model's output to its end
            (else it drops it once the loss has read it).

    Returns:
        A :class:`RecordedStep`.

    Raises:
        ValueError: ``backend`` is unknown, or a ``recompute`` path names no submodule.
        NotCompiledError: the model did not compile (dynamo ran it eagerly), it
            has graph breaks that leave a forward graph without a backward one
            (the message lists them), or fewer checkpointed regions ran in
            its graphs than blocks were checkpointed.
    """
    recording, recorder, fused = recording_backend(backend, unhook=unhook)
    runs: list[int] = []
    ran, measured = 0, None
    TALLY.compiles += 1
    with (
        checkpointed(model, tuple(recompute), recompute_mode),
        dynamo.config.patch(recompile_limit=1 << 16, accumulated_recompile_limit=1 << 16),
        aot.config.patch(enable_autograd_cache=False),
        inductor.config.patch(fx_graph_cache=False),
    ):
        try:
            with within(), dynamo.graph_breaks() as breaks:
                compiled = torch.compile(model, backend=counting_runs(recording, recorder, runs))
                with recorder.kernel_order():
                    output = train_step(compiled, model, example_inputs, loss_fn, seed, grads)
                ran = len(runs)  # the measured steps' runs are not the recorded step's
                if measure:
                    measured = _measured_step(compiled, model, example_inputs, loss_fn, seed, output_held, recorder)
        finally:
            torch.compiler.reset()
    if recorder.forwards and breaks and len(recorder.forwards) != len(recorder.backwards):
        shown = "; ".join(f"'{reason}'" for reason in breaks[:3]) + ("; ..." if len(breaks) > 3 else "")
        raise NotCompiledError(
            f"plan: the model has graph breaks: dynamo compiled it into {len(recorder.forwards)} forward graphs "
            f"that need a gradient, {len(recorder.backwards)} of them with a backward graph that ran in the step, "
            "and the planner needs a backward for every such forward graph (a graph whose outputs the loss does "
            f"not use saves tensors that nothing frees in the step). Dynamo broke the graph at: {shown}. "
            "torch._dynamo.explain(model)(*inputs) shows where; remove the breaks, or plan the blocks that compile "
            "whole (plan each as its own module)."
        )
    if not recorder.forwards or len(recorder.forwards) != len(recorder.backwards):
        raise NotCompiledError(
            f"plan: the model did not compile into forward and backward graphs under {backend!r} "
            f"({len(recorder.forwards)} forward, {len(recorder.backwards)} backward): did dynamo fall back to eager? "
            "(Below a DDP or FSDP2 wrapper dynamo compiles only frames of user code: a model whose forward is "
            "torch's, such as nn.Sequential, runs eagerly, and so does a checkpointed block there.)"
        )
    order = run_order(runs[:ran], len(recorder.forwards))
    regions = sum(len(checkpoint_regions(recorder.forwards[g])) for g in order)
    blocks = len({id(b) for b in resolve_blocks(model, recompute)}) if recompute else 0
    if regions < blocks:
        raise NotCompiledError(
            f"plan: {blocks} blocks were checkpointed but the compiled forwards ran {regions} checkpointed "
            "regions: the others ran eagerly (torch.utils.checkpoint is not traced from an eager frame, such as a "
            "forward with a graph break in the loop over its blocks), which the memory model does not see"
        )
    forwards, backwards = graph_timelines(recorder, fused, order)
    return RecordedStep(forwards, backwards, output, fused, order, measured)


def _measured_step(
    compiled: Callable[..., Any], model: torch.nn.Module, example_inputs: Any, loss_fn: Callable, seed: int,
    output_held: bool, recorder: GraphRecorder,
) -> int | None:
    """The measured peak of a training step on graphs compiled already, as a training loop runs it.

    Run outside the recorder's kernel order, after the recorded step (the
    first after the compile, which can allocate what later ones do not).
    The output is dropped once the loss has read it unless ``output_held``. None where a step compiled again (a guard failed): its
    peak is not that of the recorded graphs, whose list is restored.
    """
    kept = [list(graphs) for graphs in (recorder.forwards, recorder.backwards, recorder.inferences)]

    def step() -> None:
        TALLY.steps += 1
        torch.manual_seed(seed)
        output = call_model(compiled, example_inputs)
        mark_loss()
        loss = loss_fn(output)
        if not output_held:
            del output
        loss.backward()

    # buffers, caches and the RNG state are set aside outside the measured step (their copies are not the step's)
    with kept_buffers(model), caches_off(model), torch.random.fork_rng(devices=[]):
        try:
            model.zero_grad(set_to_none=True)  # the step's gradients count in its peak, as in the recorded step
            peak = measure_peak(step, device=device_of(example_inputs))
        finally:
            model.zero_grad(set_to_none=True)
    if [len(graphs) for graphs in kept] != [len(recorder.forwards), len(recorder.backwards), len(recorder.inferences)]:
        recorder.forwards[:], recorder.backwards[:], recorder.inferences[:] = kept
        return None
    return peak


def counting_runs(compile: Callable[..., Any], recorder: GraphRecorder, runs: list[int]) -> Callable[..., Any]:
    """``compile`` as a ``torch.compile`` backend whose compiled graphs append their forward's index to ``runs`` per call.

    Dynamo reuses a compiled graph wherever its guards hold: blocks of one class
    compiled as frames of their own (a graph break in the loop over them) run one
    graph several times in a step, and each run saves its own tensors.

    Args:
        compile: the recording backend (:func:`savedhooks.planner.recording.recording_backend`).
        recorder: its recorder.
        runs: filled with the index in ``recorder.forwards`` of each forward run,
            in order (a compile that records no forward graph, or several, is not counted).

    Returns:
        The backend.

    Raises:
        Nothing (the wrapped backend's errors pass through when it compiles).
    """

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        before = len(recorder.forwards)
        compiled = compile(gm, example_inputs)
        if len(recorder.forwards) != before + 1:
            return compiled

        @functools.wraps(compiled)
        def run(*args: Any) -> Any:
            runs.append(before)
            return compiled(*args)

        return run

    return backend


def checkpoint_regions(gm: torch.fx.GraphModule) -> set[int]:
    """The activation-checkpoint regions a compiled forward graph runs (its nodes' ``ac_graph_id``).

    Args:
        gm: a recorded forward graph.

    Returns:
        The regions' ids.
    """
    return {n.meta["ac_graph_id"] for n in gm.graph.nodes if "ac_graph_id" in n.meta}


def run_order(runs: Sequence[int], graphs: int) -> tuple[int, ...]:
    """The compiled graph of each forward run: ``runs`` where it counted every graph, else each graph once in order.

    Args:
        runs: what :func:`counting_runs` filled.
        graphs: how many forward graphs were recorded.

    Returns:
        Graph indices, one per forward run.
    """
    return tuple(runs) if set(runs) == set(range(graphs)) else tuple(range(graphs))


def graph_timelines(
    recorder: GraphRecorder, fused: bool, runs: Sequence[int] | None = None
) -> tuple[list[GraphTimeline], list[GraphTimeline]]:
    """The timelines of a recorder's graphs as they ran: forwards in run order, backwards in the reverse.

    Args:
        recorder: what one step's compile kept (as many backward graphs as forward graphs).
        fused: model the graphs as inductor runs them (:func:`savedhooks.planner.census.timeline_of`).
        runs: the forward graph of each run, in order (:func:`run_order`); a
            graph that runs twice appears twice, and so do its timelines. None:
            each graph once, in trace order.

    Returns:
        ``(forwards, backwards)``; each forward's saved values are its backward's placeholders.

    Raises:
        ValueError: as :func:`savedhooks.planner.census.timeline_of`.
    """
    order = tuple(range(len(recorder.forwards))) if runs is None else tuple(runs)
    ids = [gm.meta.get(AOT_ID) for gm in recorder.forwards]
    by_id = {gm.meta.get(AOT_ID): gm for gm in recorder.backwards}
    if None not in by_id and all(i in by_id for i in ids):  # AOTAutograd's ids pair them
        backward_of = {g: by_id[i] for g, i in enumerate(ids)}
    else:  # a backward compiles when it first runs: in the backward of its graph's last forward run
        backward_of = dict(zip(dict.fromkeys(reversed(order)), recorder.backwards))
    forwards, backwards = [], []
    for g, fw in enumerate(recorder.forwards):
        bw = backward_of[g]
        forwards.append(timeline_of(fw, {n.name for n in bw.graph.find_nodes(op="placeholder")}, fused=fused))
        backwards.append(timeline_of(bw, fused=fused, copied=fw.meta.get(COPIED_INPUTS, ())))
    return [forwards[g] for g in order], [backwards[g] for g in reversed(order)]
