"""The driver: run each (model, configuration, backend) as a training step and measure it.

For every job: ``torch._dynamo.reset()``, seeds fixed, the configuration built,
then

1. one step as warm-up (it compiles: ``compile_s`` is its time minus the
   steady-state step time);
2. the forward alone, measured: ``saved_mib`` is what it leaves alive (the saved
   activations and the loss);
3. one step, measured: ``activation_mib`` is its peak above the memory live
   before the forward, ``peak_mib`` adds that memory (parameters, buffers,
   inputs) back;
4. ``repeats`` timed steps: ``step_ms`` is their median, ``step_ratio`` divides
   it by the "compiled" (no hooks) step of the same backend (eager rows: of
   inductor, else aot_eager), and ``above_baseline`` says whether ``peak_mib``
   is above the no-hook baseline's (see :func:`with_baselines`);
5. ``grad_sqnr_db``: the lowest SQNR over the parameters' gradients of the last
   step against the eager no-hook step (gradients that are rounding noise in
   the reference, such as attention key biases, skipped);
6. ``predicted_mib``: the memory model's step peak (``sh.memory.predict_step``)
   of the recorded aot_eager graphs, blank where nothing ran as a recorded graph
   (eager, inductor, Python hooks outside the graphs).

Memory is measured on CPU from the profiler's allocation events
(``sh.memory.measure_peak``) and on CUDA from the allocator's statistics.
Gradients are cleared (``set_to_none``) before each step, outside the
measurement.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
import traceback
from collections.abc import Iterable

import torch

import savedhooks as sh
from benchmarks.configs import CONFIGS, DEFAULT_CONFIGS, Config, GraphLog, Step
from benchmarks.models import MODELS, Workload, make_workload

__all__ = [
    "ABOVE_TOLERANCE_MIB",
    "BACKENDS",
    "DEFAULT_INDUCTOR",
    "MIB",
    "Result",
    "Row",
    "jobs",
    "measure",
    "reference_grads",
    "run",
    "with_baselines",
]

BACKENDS = ("inductor", "aot_eager")
# configurations the default run compiles with inductor too ("sh + reorder" is "sh" there: the
# default path adds the same pass, so it is left to aot_eager, where it differs)
DEFAULT_INDUCTOR = ("compiled", "sh")
MIB = 2.0**20
ABOVE_TOLERANCE_MIB = 0.05  # a peak counts as above its baseline's when it exceeds it by more than this


@dataclasses.dataclass(frozen=True)
class Row:
    """One measured (model, configuration, backend): the schema of the table, the CSV and the plots.

    Attributes:
        model: model name.
        config: configuration name (``benchmarks.configs.CONFIGS``).
        backend: ``eager``, ``inductor`` or ``aot_eager``.
        device: ``cpu`` or ``cuda``.
        activation_mib: measured step peak above the memory live before the forward.
        predicted_mib: the memory model's prediction of ``activation_mib`` (blank if none).
        peak_mib: ``activation_mib`` plus the memory live before the forward.
        above_baseline: ``peak_mib`` is above the no-hook baseline's: the
            "compiled" row of the same model and backend, or for eager rows the
            "no hooks" row (``None`` where either has no peak).
        saved_mib: measured memory the forward leaves alive for backward.
        saved_ratio: ``saved_mib`` over the no-hook baseline row's (same baseline
            as ``above_baseline``).
        step_ms: median step time.
        step_ratio: ``step_ms`` over the no-hook compiled step's.
        compile_s: first step's time minus ``step_ms`` (compiled configurations).
        grad_sqnr_db: lowest gradient SQNR over the parameters vs eager, no hooks.
        error: empty, or why the configuration failed.
    """

    model: str
    config: str
    backend: str
    device: str
    activation_mib: float | None = None
    predicted_mib: float | None = None
    peak_mib: float | None = None
    above_baseline: bool | None = None
    saved_mib: float | None = None
    saved_ratio: float | None = None
    step_ms: float | None = None
    step_ratio: float | None = None
    compile_s: float | None = None
    grad_sqnr_db: float | None = None
    error: str = ""


@dataclasses.dataclass
class Result:
    """What a run produced.

    Attributes:
        rows: one per job, in run order.
        timelines: predicted live bytes per node over the forward then the
            backward graph, per ``(model, config)`` measured with aot_eager.
        descriptions: each model's one-line description.
    """

    rows: list[Row]
    timelines: dict[tuple[str, str], tuple[list[int], int]]
    descriptions: dict[str, str]


def jobs(
    configs: Iterable[str] | None, backends: Iterable[str] | None, device: str, model: str | None = None
) -> list[tuple[Config, str]]:
    """The (configuration, backend) pairs to run for one model, eager ones first.

    Args:
        configs: configuration names; ``None`` for the model's default
            (``benchmarks.models.Model.configs``; :data:`DEFAULT_CONFIGS` for a
            model that declares none).
        backends: compile backends for every compiled configuration; ``None``
            for the model's default backends (``Model.backends``), or where it
            declares none the default matrix: aot_eager for every compiled
            configuration, inductor for :data:`DEFAULT_INDUCTOR` (inductor
            compiles cost most of a run's time on CPU).
        device: ``cpu`` skips the CUDA-only configurations.
        model: the model's name in ``benchmarks.models.MODELS`` (``None``: no
            model defaults).

    Returns:
        The pairs, in run order.

    Raises:
        KeyError: an unknown model or configuration name.
    """
    spec = MODELS[model] if model is not None else None
    if configs is None:
        configs = spec.configs if spec is not None and spec.configs is not None else DEFAULT_CONFIGS
    if backends is None and spec is not None:
        backends = spec.backends
    chosen = [CONFIGS[name] for name in configs]
    compiled = [c for c in chosen if c.compiled and (device == "cuda" or not c.cuda_only)]
    pairs = [(c, "eager") for c in chosen if not c.compiled]
    for backend in BACKENDS if backends is None else backends:
        default = backends is None and backend == "inductor"
        pairs += [(c, backend) for c in compiled if not default or c.name in DEFAULT_INDUCTOR]
    return pairs


def row_line(row: Row) -> str:
    """One measured row as a line of text (the table's figures, before the baseline ratios).

    Args:
        row: a measured row.

    Returns:
        ``"measured <model> / <config> / <backend>: <field> <value>, ..."``.
    """
    figures = ", ".join(
        f"{field} {value:.1f}" for field, value in dataclasses.asdict(row).items() if isinstance(value, float)
    )
    return f"measured {row.model} / {row.config} / {row.backend}: {figures}"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _live_before(workload: Workload, device: str) -> int:
    """Memory live before the forward: allocator count on CUDA; parameters, buffers and inputs on CPU."""
    if device == "cuda":
        return torch.cuda.memory_allocated()
    tensors = [*workload.model.parameters(), *workload.model.buffers(), *workload.inputs.values()]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _saved_bytes(step: Step, device: str) -> int:
    """Memory the forward leaves alive (its loss holds the autograd graph and the saved tensors)."""
    holder: list[torch.Tensor] = []
    if device == "cuda":
        _sync(device)
        start = torch.cuda.memory_allocated()
        holder.append(step.forward())
        _sync(device)
        return torch.cuda.memory_allocated() - start
    trace = sh.memory.cpu_memory_trace(lambda: holder.append(step.forward()))
    return trace[-1] if trace else 0


def _grad_sqnr(model: torch.nn.Module, reference: list[torch.Tensor | None]) -> float:
    """Lowest SQNR over the parameters' gradients, skipping those that are rounding noise in the reference."""
    grads = {str(i): p.grad for i, p in enumerate(model.parameters())}
    return sh.metrics.worst_sqnr({str(i): ref for i, ref in enumerate(reference)}, grads)[0]


def _predict(log: GraphLog | None) -> tuple[int | None, tuple[list[int], int] | None]:
    """The model's step peak and per-node timeline, from exactly one forward and one backward graph."""
    if log is None or len(log.forward) != 1 or len(log.backward) != 1:
        return None, None
    forward, backward = log.forward[0], log.backward[0]
    try:
        predicted = sh.memory.predict_step(forward, backward)
    except ValueError:  # a node without meta["val"] (checkpointing's rng-state ops): no prediction
        return None, None
    fw = sh.memory.estimate_peak(forward)
    bw = sh.memory.estimate_peak(backward, donated=sh.memory.freed_inputs(backward))
    fw_ops, fw_in = _above_inputs(forward, fw)
    bw_ops, _ = _above_inputs(backward, bw)
    retained = (fw.live_after[-1] - fw_in) if fw.live_after else 0
    curve = fw_ops + [retained + b for b in bw_ops]
    return predicted.step_peak, (curve, len(fw_ops))


def _above_inputs(gm: torch.fx.GraphModule, estimate) -> tuple[list[int], int]:
    """Live bytes while each non-placeholder node runs, minus the graph's inputs seen so far; and all input bytes.

    Placement can move a node between placeholders, so inputs are counted where
    they appear (as :func:`savedhooks.memory.predict_step` counts them at the peak).
    """
    memory = sh.memory.build_graph_memory(gm)
    placeholders = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    seen, curve = 0, []
    for name, made, live in zip(memory.node_names, memory.allocs, estimate.live_during):
        seen += sum(memory.buffers[b].nbytes for b in made
                    if memory.buffers[b].is_input and memory.buffers[b].device == estimate.device)  # fmt: skip
        if name not in placeholders:
            curve.append(live - seen)
    return curve, seen


def measure(
    workload: Workload, config: Config, backend: str, device: str, repeats: int, reference: list[torch.Tensor | None]
) -> tuple[Row, tuple[list[int], int] | None]:
    """Build and measure one configuration (see the module docstring for the steps).

    Args:
        workload: the model and inputs.
        config: the configuration.
        backend: ``eager``, ``inductor`` or ``aot_eager``.
        device: ``cpu`` or ``cuda``.
        repeats: timed steps.
        reference: the eager no-hook gradients (CPU copies), one per parameter.

    Returns:
        ``(row, timeline)``: the row (``step_ratio`` not yet set) and the
        predicted per-node timeline when graphs were recorded.

    Raises:
        Whatever building or running the configuration raises.
    """
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = workload.model
    step = config.build(workload, backend)
    try:

        def train() -> None:
            step.forward().backward()

        model.zero_grad(set_to_none=True)
        _sync(device)
        start = time.perf_counter()
        train()
        _sync(device)
        first = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        saved = _saved_bytes(step, device)
        model.zero_grad(set_to_none=True)
        before = _live_before(workload, device)
        activation = sh.memory.measure_peak(train, device=device)
        times = []
        for _ in range(repeats):
            model.zero_grad(set_to_none=True)
            _sync(device)
            start = time.perf_counter()
            train()
            _sync(device)
            times.append(time.perf_counter() - start)
        step_s = statistics.median(times)
        sqnr = _grad_sqnr(model, reference)
        predicted, timeline = _predict(step.graphs)
        if step.predicted_bytes is not None:  # the configuration's own model (a plan's)
            predicted = step.predicted_bytes
    finally:
        step.close()
        model.zero_grad(set_to_none=True)
    row = Row(
        model=workload.name, config=config.name, backend=backend, device=device,
        activation_mib=activation / MIB, predicted_mib=None if predicted is None else predicted / MIB,
        peak_mib=(before + activation) / MIB, saved_mib=saved / MIB, step_ms=step_s * 1e3,
        compile_s=max(first - step_s, 0.0) if config.compiled else None, grad_sqnr_db=sqnr,
    )  # fmt: skip
    return row, timeline


def reference_grads(workload: Workload) -> list[torch.Tensor | None]:
    """The eager no-hook step's gradients (CPU copies), one per parameter: the SQNR reference.

    Args:
        workload: the model and inputs (its gradients are cleared afterwards).

    Returns:
        One gradient (or None) per parameter.

    Raises:
        Whatever the step raises.
    """
    torch.manual_seed(0)
    workload.model.zero_grad(set_to_none=True)
    workload.loss(workload.model).backward()
    grads = [None if p.grad is None else p.grad.detach().cpu().clone() for p in workload.model.parameters()]
    workload.model.zero_grad(set_to_none=True)
    return grads


def with_baselines(rows: list[Row]) -> list[Row]:
    """Fill in each row's ``step_ratio``, ``above_baseline`` and ``saved_ratio`` from the no-hook rows of the same model.

    A compiled row's baseline is the "compiled" row of its model and backend (or
    the row of its configuration's ``baseline``: "bf16" for the bf16 rows); an
    eager row's step time is compared with the compiled step (inductor's, else
    aot_eager's) and its peak with the eager "no hooks" row. A peak is above its
    baseline when it exceeds the baseline's by more than
    :data:`ABOVE_TOLERANCE_MIB`; a baseline row is not above itself.

    Args:
        rows: measured rows (failed ones have no values and get none).

    Returns:
        New rows, same order; ``None`` where a value or its baseline is missing.
    """
    ok = {(r.model, r.config, r.backend): r for r in rows if not r.error}
    out = []
    for r in rows:
        named = CONFIGS[r.config].baseline if r.config in CONFIGS else None
        step_config = named or "compiled"
        backends = ("inductor", "aot_eager") if r.backend == "eager" else (r.backend,)
        ref = next((ok[(r.model, step_config, b)].step_ms for b in backends if (r.model, step_config, b) in ok), None)
        ratio = r.step_ms / ref if (ref and r.step_ms is not None) else None
        b = ok.get((r.model, named or ("no hooks" if r.backend == "eager" else "compiled"), r.backend))
        base = b.peak_mib if b is not None else None
        above = None if (base is None or r.peak_mib is None) else r.peak_mib > base + ABOVE_TOLERANCE_MIB
        saved = r.saved_mib / b.saved_mib if (b is not None and b.saved_mib and r.saved_mib is not None) else None
        out.append(dataclasses.replace(r, step_ratio=ratio, above_baseline=above, saved_ratio=saved))
    return out


def error_text(exc: BaseException) -> str:
    """What a failed row's ``error`` column says: the exception's type and first line.

    Args:
        exc: what building or running a configuration raised (a backend's failure unwrapped).

    Returns:
        ``"<type>: <first line>"``, at most 160 characters.
    """
    exc = getattr(exc, "inner_exception", None) or exc  # BackendCompilerFailed: what the backend raised
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:160]


def run(
    models: Iterable[str],
    configs: Iterable[str] | None = None,
    backends: Iterable[str] | None = None,
    size: float = 1.0,
    device: str = "cpu",
    repeats: int = 3,
    strict: bool = False,
    progress: bool = True,
    compiled_loss: bool = False,
) -> Result:
    """Run every (model, configuration, backend) and measure it.

    Args:
        models: model names (``benchmarks.models.MODELS``).
        configs: configuration names (``benchmarks.configs.CONFIGS``; ``None``:
            each model's default, see :func:`jobs`).
        backends: compile backends for the compiled configurations (``None``:
            each model's default, see :func:`jobs`).
        size: batch multiplier.
        device: ``cpu`` or ``cuda``.
        repeats: timed steps per configuration.
        strict: raise on the first failing configuration instead of recording
            it in the row's ``error`` column.
        progress: show a progress bar (tqdm).
        compiled_loss: compile the loss with the model (``Workload.compiled_loss``);
            default: the loss runs eagerly on the compiled model's output.

    Returns:
        A :class:`Result`.

    Raises:
        KeyError: an unknown model or configuration name.
        Exception: with ``strict``, whatever a configuration raised.
    """
    from tqdm.auto import tqdm

    models = list(models)
    configs = None if configs is None else list(configs)
    backends = None if backends is None else list(backends)
    todo = {name: jobs(configs, backends, device, name) for name in models}  # KeyError before anything runs
    rows: list[Row] = []
    timelines: dict[tuple[str, str], tuple[list[int], int]] = {}
    descriptions: dict[str, str] = {}
    bar = tqdm(total=sum(map(len, todo.values())), disable=not progress, unit="config", dynamic_ncols=True)
    # torch's own path (make_fx'd hook graphs) cannot be pickled into AOTAutograd's cache key:
    # torch logs a traceback per compile and compiles without the cache, which is all this run needs
    cache_log = logging.getLogger("torch._inductor.codecache")
    cache_level = cache_log.level
    cache_log.setLevel(logging.ERROR)
    try:
        for name in models:
            bar.set_description(f"{name}: building")
            workload = make_workload(name, size, device)
            workload.compiled_loss = compiled_loss
            descriptions[name] = workload.description
            reference = reference_grads(workload)
            for config, backend in todo[name]:
                bar.set_description(f"{name}: {config.name} ({backend})")
                try:
                    row, timeline = measure(workload, config, backend, device, repeats, reference)
                    if timeline is not None:
                        timelines[(name, config.name)] = timeline
                except Exception as exc:  # one failing configuration must not end the run
                    if strict:
                        raise
                    row = Row(name, config.name, backend, device, error=error_text(exc))
                    bar.write(f"FAILED {name} / {config.name} / {backend}: {row.error}")
                    bar.write("".join(traceback.format_exception_only(exc)).strip()[-2000:])
                rows.append(row)
                if not progress and not row.error:  # each row as it is measured: a run cut short keeps what it did
                    bar.write(row_line(row))
                bar.update()
            del workload
            torch._dynamo.reset()
    finally:
        bar.close()
        cache_log.setLevel(cache_level)
    return Result(with_baselines(rows), timelines, descriptions)
