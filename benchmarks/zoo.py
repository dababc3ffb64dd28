"""A zoo of transformers architectures, each trained one step with savedhooks' policy, its plan, and without hooks.

Every entry is built from its library's default config with only the sizes
shrunk (layers, hidden size, heads, KV heads, MLP width, vocabulary, experts,
image size and patch); everything else is as shipped: dropout, ``use_cache``
(True for most decoders: the model then returns each layer's K and V in
training too), attention implementation, activation, tied embeddings. The
model runs in train mode and returns its own loss (``labels`` given). Weights
are random, inputs drawn with a fixed seed; nothing is downloaded.

Three sizes: ``tiny`` (hidden 64, 2 layers: a compile takes tens of seconds on 2
CPU cores; 512 tokens a step, so that saved activations outweigh the parameters
and their gradients), ``base`` (hidden 256, 4 layers, seq 256, batch 4) and
``large`` (hidden 512, 6 layers, 2 KV heads, vocabulary 16384, seq 512, batch
4: a decoder's step of about 0.8 GiB). In all three, saved activations are most
of the step's peak.

``python -m benchmarks.zoo [--models ...] [--size tiny|base|large] [--jobs N] [--out docs/results/zoo.md]``
measures, per model, one training step (forward and backward, the gradients
made in it counted) as the activation peak above the memory live before it
(``sh.memory.measure_peak``):

- ``compiled``: plain ``torch.compile`` (inductor), no hooks: the baseline;
- (a) ``sh.policy()`` around the same compile: peak over the baseline's, and
  the worst parameter-gradient SQNR against the baseline's gradients
  (:func:`savedhooks.metrics.worst_sqnr`: gradients that are rounding noise in
  the reference are skipped);
- (b) the same without compiling, against the eager step without hooks;
- (e) torch's own fp8 activation pass (:data:`benchmarks.torch_options.TORCH_FP8`:
  e4m3, row scales, every floating saved value but the graph's inputs) around
  plain ``torch.compile``, no hooks: peak over the baseline's and worst
  gradient SQNR ("non-finite" where a gradient has NaN or inf in it);
- (c) ``sh.plan`` at 0.7 of the baseline's measured peak, applied and
  compiled inside ``sh.saved_tensors_hooks(plan.hooks)``: measured peak over
  the budget, the worst SQNR against the baseline, and the plan's predicted peak;
- (d) (a) under ``torch.autocast("cpu", dtype=torch.bfloat16)``, against the
  compiled step without hooks under the same autocast;
- transformers' gradient checkpointing (non-reentrant), compiled and eager,
  over the baseline without hooks of the same mode: a reference point.

Each step runs after ``torch.manual_seed``, so dropout draws the same masks in
the step and in its reference where the two run the same random ops (an entry's
``dropout`` says whether its comparisons keep the shipped dropout). Each
measurement compiles afresh (``torch._dynamo.reset()``), runs one step to
compile, then measures the next one. A measurement that raises records the
exception's type and first line in its cells; the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import pathlib
import platform
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

import savedhooks as sh
from benchmarks.torch_options import TORCH_FP8, torch_fp8_pass
from benchmarks.zoo_entries import SEED, SIZES, ZOO, Dims, ZooModel, without_dropout

__all__ = [
    "COLUMNS",
    "SIZES",
    "ZOO",
    "Dims",
    "ZooModel",
    "ZooRow",
    "measure_model",
    "run",
    "step_fn",
    "table",
    "without_dropout",
]

MIB = 2.0**20
PLAN_FRACTION = 0.7  # (c)'s budget: this share of the compiled step's measured peak
ERROR_CHARS = 160  # an error's text: type and first line, cut here (the list under the table)
CELL_ERROR_CHARS = 60  # the same in a table cell
# the measurements, in run order: the baselines come before what is compared with them; (c) last but one, as
# it applies the plan's recompute to the model (reverted after)
MEASUREMENTS = ("compiled", "a", "e", "eager", "b", "c", "bf16", "d", "ckpt", "ckpt eager")
NEEDS = {"a": "compiled", "e": "compiled", "b": "eager", "c": "compiled", "d": "bf16", "ckpt": "compiled",
         "ckpt eager": "eager"}




# ---------------------------------------------------------------------------------------------------- measuring


def step_fn(
    fn: Callable[..., Any],
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    loss_of: Callable[[Any], torch.Tensor],
    *contexts: Callable[[], Any],
) -> Callable[[], None]:
    """One training step: gradients cleared, ``torch.manual_seed``, forward inside ``contexts``, backward.

    Args:
        fn: the module, or a compiled wrapper of it.
        model: the module (its gradients are cleared first).
        inputs: the keyword inputs.
        loss_of: the scalar loss from the output.
        *contexts: context-manager factories entered around the forward (hooks, autocast).

    Returns:
        A callable running the step; the gradients stay on the parameters.

    Raises:
        Nothing (calling it raises what the step raises).
    """

    def step() -> None:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(SEED)
        with contextlib.ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context())
            loss = loss_of(fn(**inputs))
        loss.backward()

    return step


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def _measure(step: Callable[[], None], model: nn.Module, steps: int = 1) -> tuple[int, dict[str, torch.Tensor | None]]:
    """``steps`` steps to warm up (compile), then one measured: its peak in bytes and its gradients."""
    for _ in range(steps):
        step()
    model.zero_grad(set_to_none=True)  # the step's gradients count in its peak
    peak = sh.memory.measure_peak(step, device="cpu")
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return peak, grads


def _compiled(model: nn.Module) -> Callable[..., Any]:
    torch._dynamo.reset()
    return torch.compile(model)


def _bf16() -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _policy() -> Any:
    return sh.saved_tensors_hooks(sh.policy())


def error_text(exc: BaseException) -> str:
    """The exception's type and the first line of its message (a backend's failure unwrapped), cut to length.

    Args:
        exc: what a measurement raised.

    Returns:
        ``"<type>: <first line>"``, at most :data:`ERROR_CHARS` characters.
    """
    exc = getattr(exc, "inner_exception", None) or exc  # BackendCompilerFailed: what the backend raised
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0].strip() if lines else ''}"[:ERROR_CHARS]


@dataclasses.dataclass
class ZooRow:
    """One model's figures: the schema of the table.

    Peaks are MiB of one step above the memory live before it; ratios divide
    a peak by its baseline's; SQNRs are the worst parameter gradient's, in dB.

    Attributes:
        model: the entry's name.
        family: the entry's family.
        dropout: the comparisons ran with the shipped dropout (``-``: the
            config has none; ``off``: zeroed for the comparisons).
        params_mib: the parameters' bytes.
        compiled_mib: plain ``torch.compile`` (inductor), no hooks.
        a_ratio: (a) ``sh.policy()`` compiled, over ``compiled_mib``.
        a_sqnr: (a) against the compiled step's gradients.
        e_ratio: (e) torch's fp8 activation pass (:data:`benchmarks.torch_options.TORCH_FP8`)
            around the same compile, no hooks, over ``compiled_mib``.
        e_sqnr: (e) against the compiled step's gradients (NaN: some gradient is not finite).
        eager_mib: eager, no hooks.
        b_ratio: (b) ``sh.policy()`` eager, over ``eager_mib``.
        b_sqnr: (b) against the eager step's gradients.
        budget_mib: (c)'s budget.
        c_ratio: (c) the plan's measured peak over its budget.
        c_sqnr: (c) against the compiled step's gradients.
        c_predicted_mib: (c) the plan's predicted peak.
        bf16_mib: compiled under bf16 autocast, no hooks.
        d_ratio: (d) ``sh.policy()`` compiled under bf16 autocast, over ``bf16_mib``.
        d_sqnr: (d) against the bf16 compiled step's gradients.
        ckpt_ratio: transformers' gradient checkpointing compiled, over ``compiled_mib``.
        ckpt_eager_ratio: the same eager, over ``eager_mib``.
        seconds: the model's wall time (all its measurements).
        errors: what failed, by measurement (``compiled``, ``a``, ``e``, ``eager``,
            ``b``, ``c``, ``bf16``, ``d``, ``ckpt``, ``ckpt eager``, ``build``).
        worst: the worst parameter's name, by measurement.
    """

    model: str
    family: str = ""
    dropout: str = ""
    params_mib: float | None = None
    compiled_mib: float | None = None
    a_ratio: float | None = None
    a_sqnr: float | None = None
    e_ratio: float | None = None
    e_sqnr: float | None = None
    eager_mib: float | None = None
    b_ratio: float | None = None
    b_sqnr: float | None = None
    budget_mib: float | None = None
    c_ratio: float | None = None
    c_sqnr: float | None = None
    c_predicted_mib: float | None = None
    bf16_mib: float | None = None
    d_ratio: float | None = None
    d_sqnr: float | None = None
    ckpt_ratio: float | None = None
    ckpt_eager_ratio: float | None = None
    seconds: float | None = None
    errors: dict[str, str] = dataclasses.field(default_factory=dict)
    worst: dict[str, str] = dataclasses.field(default_factory=dict)


# (field, header, format, the measurement whose error the cell shows): every figure of a ZooRow, in table order
COLUMNS: tuple[tuple[str, str, str, str], ...] = (
    ("model", "model", "{}", "build"),
    ("family", "family", "{}", "build"),
    ("dropout", "dropout", "{}", "build"),
    ("params_mib", "params MiB", "{:.2f}", "build"),
    ("compiled_mib", "compiled MiB", "{:.2f}", "compiled"),
    ("a_ratio", "(a) policy / compiled", "{:.2f}", "a"),
    ("a_sqnr", "(a) SQNR dB", "{:.1f}", "a"),
    ("e_ratio", "(e) torch fp8 / compiled", "{:.2f}", "e"),
    ("e_sqnr", "(e) SQNR dB", "{:.1f}", "e"),
    ("eager_mib", "eager MiB", "{:.2f}", "eager"),
    ("b_ratio", "(b) policy eager / eager", "{:.2f}", "b"),
    ("b_sqnr", "(b) SQNR dB", "{:.1f}", "b"),
    ("budget_mib", "(c) budget MiB", "{:.2f}", "compiled"),
    ("c_ratio", "(c) plan / budget", "{:.2f}", "c"),
    ("c_sqnr", "(c) SQNR dB", "{:.1f}", "c"),
    ("c_predicted_mib", "(c) predicted MiB", "{:.2f}", "c"),
    ("bf16_mib", "bf16 MiB", "{:.2f}", "bf16"),
    ("d_ratio", "(d) bf16 policy / bf16", "{:.2f}", "d"),
    ("d_sqnr", "(d) SQNR dB", "{:.1f}", "d"),
    ("ckpt_ratio", "HF ckpt / compiled", "{:.2f}", "ckpt"),
    ("ckpt_eager_ratio", "HF ckpt eager / eager", "{:.2f}", "ckpt eager"),
    ("seconds", "s", "{:.0f}", "build"),
)
assert {c[0] for c in COLUMNS} == {f.name for f in dataclasses.fields(ZooRow)} - {"errors", "worst"}, (
    "COLUMNS must list every ZooRow figure"
)


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _sqnr(reference: dict[str, torch.Tensor | None], got: dict[str, torch.Tensor | None]) -> tuple[float, str]:
    db, name = sh.metrics.worst_sqnr(reference, got)
    return db, name or ""


class MeasurementTimeout(Exception):
    """A measurement ran past its time limit (raised in it by ``SIGALRM``)."""


@contextlib.contextmanager
def _time_limit(seconds: float | None):
    """Raise :class:`MeasurementTimeout` in the block after ``seconds`` (None or 0: no limit; main thread only)."""
    if not seconds:
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise MeasurementTimeout(f"no result within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def measure_model(entry: ZooModel, size: str = "tiny", dropout: bool | None = None,
                  only: Iterable[str] | None = None, timeout_s: float | None = None,
                  log: Callable[[str], None] = lambda line: None) -> ZooRow:  # fmt: skip
    """Measure one entry (see the module docstring); a measurement that raises is recorded in ``errors``.

    Args:
        entry: the zoo entry.
        size: a key of :data:`SIZES`.
        dropout: keep the shipped dropout in every measurement; None: the entry's :attr:`ZooModel.dropout`.
        only: the measurements to run (keys of :data:`MEASUREMENTS`; the
            baselines they are compared with are added); None: all.
        timeout_s: a measurement running longer is stopped and recorded as a
            :class:`MeasurementTimeout` (None: no limit).
        log: gets a line per measurement as it ends.

    Returns:
        A :class:`ZooRow`.

    Raises:
        KeyError: an unknown measurement in ``only``.
        Nothing else but ``KeyboardInterrupt`` and the like: every ``Exception`` is recorded.
    """
    wanted = set(MEASUREMENTS if only is None else only)
    unknown = wanted - set(MEASUREMENTS)
    if unknown:
        raise KeyError(f"unknown measurements {sorted(unknown)}; choose from {', '.join(MEASUREMENTS)}")
    wanted |= {NEEDS[m] for m in wanted if m in NEEDS}
    start = time.perf_counter()
    keep_dropout = entry.dropout if dropout is None else dropout
    row = ZooRow(entry.name, entry.family)
    try:
        shipped = entry.shipped_dropout(size)
        row.dropout = "-" if not shipped else ("on" if keep_dropout else "off")
        model, inputs = entry.build(size, dropout=keep_dropout)
        row.params_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / MIB
    except Exception as exc:
        row.errors["build"] = error_text(exc)
        log(f"{entry.name}: build failed: {row.errors['build']}")
        log(traceback.format_exc(limit=-6))
        row.seconds = time.perf_counter() - start
        return row
    loss_of = entry.loss_of
    refs: dict[str, dict[str, torch.Tensor | None]] = {}

    def attempt(key: str, body: Callable[[], None]) -> None:
        began = time.perf_counter()
        try:
            with _time_limit(timeout_s):
                body()
        except Exception as exc:
            row.errors[key] = error_text(exc)
            log(f"{entry.name}: {key} failed ({time.perf_counter() - began:.0f} s): {row.errors[key]}")
            log("".join(traceback.format_exception(exc)[-8:]).rstrip())
        else:
            log(f"{entry.name}: {key} done ({time.perf_counter() - began:.0f} s)")
        finally:
            model.zero_grad(set_to_none=True)
            torch._dynamo.reset()

    def compiled_ref() -> None:
        peak, refs["compiled"] = _measure(step_fn(_compiled(model), model, inputs, loss_of), model)
        row.compiled_mib = peak / MIB
        row.budget_mib = int(PLAN_FRACTION * peak) / MIB

    def policy_compiled() -> None:
        peak, grads = _measure(step_fn(_compiled(model), model, inputs, loss_of, _policy), model)
        row.a_ratio = _ratio(peak / MIB, row.compiled_mib)
        if "compiled" in refs:
            row.a_sqnr, row.worst["a"] = _sqnr(refs["compiled"], grads)

    def torch_fp8() -> None:
        step = step_fn(_compiled(model), model, inputs, loss_of, lambda: torch_fp8_pass(TORCH_FP8))
        peak, grads = _measure(step, model)
        row.e_ratio = _ratio(peak / MIB, row.compiled_mib)
        if "compiled" in refs:
            row.e_sqnr, row.worst["e"] = _sqnr(refs["compiled"], grads)

    def eager_ref() -> None:
        peak, refs["eager"] = _measure(step_fn(model, model, inputs, loss_of), model)
        row.eager_mib = peak / MIB

    def policy_eager() -> None:
        peak, grads = _measure(step_fn(model, model, inputs, loss_of, _policy), model)
        row.b_ratio = _ratio(peak / MIB, row.eager_mib)
        if "eager" in refs:
            row.b_sqnr, row.worst["b"] = _sqnr(refs["eager"], grads)

    def bf16_ref() -> None:
        peak, refs["bf16"] = _measure(step_fn(_compiled(model), model, inputs, loss_of, _bf16), model)
        row.bf16_mib = peak / MIB

    def bf16_policy() -> None:
        peak, grads = _measure(step_fn(_compiled(model), model, inputs, loss_of, _bf16, _policy), model)
        row.d_ratio = _ratio(peak / MIB, row.bf16_mib)
        if "bf16" in refs:
            row.d_sqnr, row.worst["d"] = _sqnr(refs["bf16"], grads)

    def checkpointing(compiled: bool) -> Callable[[], None]:
        def body() -> None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            try:
                fn = _compiled(model) if compiled else model
                peak, _ = _measure(step_fn(fn, model, inputs, loss_of), model)
            finally:
                model.gradient_checkpointing_disable()
            if compiled:
                row.ckpt_ratio = _ratio(peak / MIB, row.compiled_mib)
            else:
                row.ckpt_eager_ratio = _ratio(peak / MIB, row.eager_mib)

        return body

    def planned() -> None:
        if row.compiled_mib is None:
            raise RuntimeError("no budget: the compiled step without hooks failed")
        budget = int(row.budget_mib * MIB)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="sh.plan: ", category=UserWarning)
            chosen = sh.plan(model, inputs, budget_bytes=budget, loss_fn=loss_of)
        row.c_predicted_mib = chosen.predicted_peak_bytes / MIB
        chosen.apply(model)
        try:
            hooks = chosen.hooks
            step = step_fn(_compiled(model), model, inputs, loss_of, lambda: sh.saved_tensors_hooks(hooks))
            peak, grads = _measure(step, model, steps=2)
        finally:
            chosen.revert(model)
        row.c_ratio = peak / budget
        if "compiled" in refs:
            row.c_sqnr, row.worst["c"] = _sqnr(refs["compiled"], grads)

    bodies = {"compiled": compiled_ref, "a": policy_compiled, "e": torch_fp8, "eager": eager_ref, "b": policy_eager, "c": planned,
              "bf16": bf16_ref, "d": bf16_policy, "ckpt": checkpointing(True), "ckpt eager": checkpointing(False)}
    for key in MEASUREMENTS:
        if key in wanted:
            attempt(key, bodies[key])
    row.seconds = time.perf_counter() - start
    return row


# ---------------------------------------------------------------------------------------------------- reporting


def _cell(row: ZooRow, field: str, fmt: str, measurement: str) -> str:
    value = getattr(row, field)
    if value is None or value == "":
        error = row.errors.get(measurement) or row.errors.get("build")
        return f"✗ {error[:CELL_ERROR_CHARS]}".replace("|", "/") if error else ""
    if isinstance(value, float) and math.isinf(value):
        return "exact" if value > 0 else "-inf"
    if isinstance(value, float) and math.isnan(value):
        return "non-finite"  # worst_sqnr's NaN: a gradient with NaN or inf in it
    return fmt.format(value).replace("|", "/")


def table(rows: list[ZooRow]) -> str:
    """The rows as a markdown table: figures, or ``✗`` and the error of the measurement that failed.

    Args:
        rows: measured rows.

    Returns:
        The table, one line per model after the header.
    """
    header = "| " + " | ".join(c[1] for c in COLUMNS) + " |"
    align = "|" + "|".join("---" if c[2] == "{}" else "---:" for c in COLUMNS) + "|"
    lines = [header, align]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r, field, fmt, m) for field, _, fmt, m in COLUMNS) + " |")
    return "\n".join(lines)


def _versions() -> str:
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}"


def _threads_per_job(jobs: int) -> int:
    return max(1, torch.get_num_threads() // jobs)


def _device(jobs: int = 1) -> str:
    cpu = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    if jobs == 1:
        return f"{cpu}, {torch.get_num_threads()} threads)"
    return f"{cpu}; {jobs} entries at once, {_threads_per_job(jobs)} threads each)"


def document(rows: list[ZooRow], command: str, size: str, seconds: float, jobs: int = 1) -> str:
    """The markdown page: a heading naming the command, versions and device, the table, the errors in full.

    Args:
        rows: measured rows.
        command: the command line that ran.
        size: the size tier.
        seconds: the run's wall time.
        jobs: how many entries ran at once (as :func:`run`).

    Returns:
        Markdown text.
    """
    lines = [
        f"# Model zoo, size {size}",
        "",
        f"`{command}`; {_versions()}; device {_device(jobs)}; {seconds / 60:.1f} min.",
        "",
        f"Peaks: one training step's activation peak above the memory live before it (MiB). (a) sh.policy() around "
        f"plain torch.compile, over the compiled step without hooks; (b) the same eager, over eager; (e) torch's "
        f"fp8 activation pass (e4m3, row scales) around plain torch.compile, no hooks, over the compiled step "
        f"(non-finite: a gradient holds NaN or inf); (c) sh.plan at "
        f"{PLAN_FRACTION:g} of the compiled peak, measured peak over that budget; (d) (a) under bf16 autocast, over "
        f"compiled bf16 without hooks; HF ckpt: gradient_checkpointing_enable(use_reentrant=False). SQNR: the worst "
        f"parameter gradient against the reference of the same mode (rounding-noise gradients skipped). ✗: the "
        f"measurement raised (type and first line).",
        "",
        table(rows),
        "",
    ]
    notes = [(r.model, key, text) for r in rows for key, text in r.errors.items()]
    if notes:
        lines += ["## Errors", ""] + [f"- {model} / {key}: `{text}`" for model, key, text in notes] + [""]
    worst = [(r.model, key, name) for r in rows for key, name in r.worst.items() if name]
    if worst:
        lines += ["## Worst gradient", ""]
        lines += [f"- {model} / ({key}): `{name}`" for model, key, name in worst] + [""]
    return "\n".join(lines)


def run(names: Iterable[str], size: str = "tiny", dropout: bool | None = None, only: Iterable[str] | None = None,
        timeout_s: float | None = None, log: Callable[[str], None] = lambda line: None,
        jobs: int = 1) -> list[ZooRow]:  # fmt: skip
    """Measure each named entry, in turn or ``jobs`` at a time.

    With ``jobs > 1`` each entry runs in a fresh process of its own (``spawn``),
    at most ``jobs`` at once, each with ``torch.get_num_threads() // jobs``
    intra-op threads (at least one; the page's heading says so). The peaks and
    gradient SQNRs are those of a run in turn, but where an op's scratch depends
    on the thread count (a CPU convolution's); a plan (c) is chosen from times
    measured as it runs. The wall times (``s``) grow with the load, and so does
    the time a measurement takes against ``timeout_s``.

    Args:
        names: keys of :data:`ZOO`.
        size: a key of :data:`SIZES`.
        dropout: see :func:`measure_model`.
        only: see :func:`measure_model`.
        timeout_s: see :func:`measure_model`.
        log: gets progress lines (with ``jobs > 1``, the processes write theirs
            to stderr, each line led by the entry's name, and ``log`` gets each table row).
        jobs: how many entries run at once.

    Returns:
        One row per entry, in the order of ``names``.

    Raises:
        KeyError: an unknown name or size, before anything runs.
        ValueError: ``jobs`` below 1.
    """
    names = list(names)
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        raise KeyError(f"unknown models {unknown}; choose from {', '.join(ZOO)}")
    SIZES[size]  # KeyError before anything runs
    unknown = set(only or ()) - set(MEASUREMENTS)
    if unknown:
        raise KeyError(f"unknown measurements {sorted(unknown)}; choose from {', '.join(MEASUREMENTS)}")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an int >= 1, got {jobs!r}")
    if jobs > 1 and len(names) > 1:
        return _run_in_processes(names, size, dropout, only, timeout_s, log, jobs)
    rows = []
    for name in names:
        log(f"== {name} ({size})")
        rows.append(measure_model(ZOO[name], size, dropout, only, timeout_s, log))
        log(table(rows[-1:]))
    return rows


def _run_in_processes(names: list[str], size: str, dropout: bool | None, only: Iterable[str] | None,
                      timeout_s: float | None, log: Callable[[str], None], jobs: int) -> list[ZooRow]:  # fmt: skip
    """:func:`run` with one fresh ``spawn`` process per entry, ``jobs`` at once, rows in the order of ``names``."""
    import multiprocessing

    threads = _threads_per_job(jobs)
    only = None if only is None else list(only)
    tasks = [(name, size, dropout, only, timeout_s) for name in names]
    context = multiprocessing.get_context("spawn")
    with context.Pool(min(jobs, len(names)), initializer=torch.set_num_threads, initargs=(threads,),
                      maxtasksperchild=1) as pool:  # fmt: skip
        rows = []
        for row in pool.imap(_measure_in_process, tasks):
            log(table([row]))
            rows.append(row)
    return rows


def _measure_in_process(task: tuple[str, str, bool | None, list[str] | None, float | None]) -> ZooRow:
    """One entry's :func:`measure_model` in a worker process, its progress lines on stderr led by its name."""
    name, size, dropout, only, timeout_s = task

    def log(line: str) -> None:
        print(f"[{name}] {line}", file=sys.stderr, flush=True)

    log(f"== {name} ({size})")
    return measure_model(ZOO[name], size, dropout, only, timeout_s, log)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.zoo", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(ZOO), choices=list(ZOO), metavar="MODEL",
                        help=f"entries to run (default: all): {', '.join(ZOO)}")
    parser.add_argument("--size", default="tiny", choices=list(SIZES))
    parser.add_argument("--out", default=None, help="markdown file to write (its folder is made)")
    parser.add_argument("--no-dropout", action="store_true", help="zero every dropout probability in every entry")
    parser.add_argument("--only", nargs="+", choices=MEASUREMENTS, metavar="MEASUREMENT", default=None,
                        help=f"measurements to run (default: all; their baselines are added): {', '.join(MEASUREMENTS)}")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="stop a measurement running longer and record it as failed (default: no limit)")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="entries measured at once, each in a process of its own with its share of the "
                        "threads (default 1: in turn); the wall times grow with the load, so give a longer --timeout")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    command = "python -m benchmarks.zoo " + " ".join(sys.argv[1:] if argv is None else argv)
    began = time.perf_counter()

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    rows = run(args.models, args.size, False if args.no_dropout else None, args.only, args.timeout, log, args.jobs)
    text = document(rows, command.strip(), args.size, time.perf_counter() - began, args.jobs)
    print(text)
    if args.out:
        path = pathlib.Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
