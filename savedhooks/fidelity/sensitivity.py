"""Which saved tensors a lossy codec must leave alone: gradient SQNR per saved tensor.

Design notes
------------
* One training step (forward, loss, backward; no optimizer step) is run several
  times with the same inputs and random state, each time packing a different
  selection of the saved tensors with the codec, and the parameters' gradients
  are compared with those of a step that packs nothing (which also lists the
  saved tensors: :class:`~savedhooks.fidelity.select.Census`).
* For each group of saved tensors two steps run: the group alone packed (how much
  it hurts by itself) and everything but the group packed (how much is left when
  it is kept). The cost is bounded: the ``individually`` largest tensors are
  groups of one, the rest are grouped by producing op, and the report states the
  number of backward passes (``2 + 2 * groups``).
* Under torch.compile each step recompiles (the hooks are part of the graphs);
  dynamo's recompile limit is raised for the duration.
* Worst gradient: :func:`savedhooks.metrics.worst_sqnr`, which skips parameters
  whose reference gradient is rounding noise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.nn.parameter import UninitializedBuffer

from savedhooks._torch import dynamo, pytree
from savedhooks._torch.nn import own_buffers
from savedhooks.codecs import fp8
from savedhooks.codecs.base import Codec, as_codec
from savedhooks.compiler.api import saved_tensors_hooks
from savedhooks.fidelity.select import Census, SavedTensor, Selected, keyed_run
from savedhooks.metrics import worst_sqnr

__all__ = ["SavedGroup", "Sensitivity", "kept_buffers", "sensitivity"]

_MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class SavedGroup:
    """Saved tensors measured together, and what packing them does to the gradients.

    Attributes:
        tensors: the saved tensors of the group.
        only_db: worst parameter-gradient SQNR when only this group is packed.
        all_but_db: worst parameter-gradient SQNR when every other saved tensor is packed.
        only_worst: the parameter with the worst gradient when only this group is packed.
    """

    tensors: tuple[SavedTensor, ...]
    only_db: float
    all_but_db: float
    only_worst: str | None

    @property
    def bytes(self) -> int:
        """Bytes of the group before packing."""
        return sum(t.bytes for t in self.tensors)

    @property
    def op(self) -> str:
        """The producing op(s), comma-separated."""
        return ", ".join(sorted({str(t.op) for t in self.tensors}))

    def describe(self) -> str:
        """The key and shape of a single tensor, or the count of a group."""
        if len(self.tensors) == 1:
            t = self.tensors[0]
            return f"{t.key} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
        return f"{len(self.tensors)} tensors"


@dataclasses.dataclass(frozen=True)
class Sensitivity:
    """What :func:`sensitivity` measured.

    Attributes:
        groups: one entry per group, most harmful (lowest ``only_db``, NaN first) first.
        all_db: worst parameter-gradient SQNR with every candidate packed.
        all_worst: the parameter with the worst gradient then.
        backward_passes: the steps it took (one census, one all-packed, two per group).
        codec: the codec measured.
    """

    groups: tuple[SavedGroup, ...]
    all_db: float
    all_worst: str | None
    backward_passes: int
    codec: Codec

    def table(self) -> str:
        """A Markdown table, one row per group, most harmful first."""
        heading = (
            f"codec {self.codec!r}: {len(self.groups)} groups, {self.backward_passes} backward passes; "
            f"all packed: {_db(self.all_db)} dB (worst {self.all_worst})"
        )
        lines = [
            heading,
            "",
            "| saved | op | MiB | only this packed dB | all but this packed dB | worst parameter |",
            "|---|---|---:|---:|---:|---|",
        ]
        for g in self.groups:
            lines.append(
                f"| {g.describe()} | {g.op} | {g.bytes / _MiB:.2f} | {_db(g.only_db)} | {_db(g.all_but_db)} | {g.only_worst or ''} |"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _db(value: float) -> str:
    return "exact" if math.isinf(value) and value > 0 else f"{value:.1f}"


def default_loss(output: Any) -> torch.Tensor:
    """The output itself when it is a scalar; else the mean square of its floating tensors.

    Args:
        output: what the model returned.

    Returns:
        A scalar tensor.

    Raises:
        ValueError: the output has no floating tensor.
    """
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise ValueError("the model returned no floating tensor; pass loss_fn")
    return sum(t.float().pow(2).mean() for t in leaves)


def call_model(fn: Callable[..., Any], inputs: Any) -> Any:
    """Call ``fn`` with example inputs given as a tuple, a dict of keyword arguments or one tensor.

    Args:
        fn: the model or its compiled form.
        inputs: positional arguments (tuple), keyword arguments (dict) or one tensor.

    Returns:
        What ``fn`` returns.

    Raises:
        Whatever ``fn`` raises.
    """
    if isinstance(inputs, Mapping):
        return fn(**inputs)
    if isinstance(inputs, torch.Tensor):
        return fn(inputs)
    return fn(*inputs)


@contextlib.contextmanager
def kept_buffers(model: torch.nn.Module) -> Iterator[None]:
    """Restore the model's buffers after the ``with`` block: the steps run to measure it change nothing of it.

    A training step updates buffers in place (batch norm's running statistics
    and ``num_batches_tracked``); the steps that :func:`sensitivity` and
    ``sh.plan`` run are measurements, not training. Each buffer is copied (on
    its device) before and written back after; a buffer the step replaced is
    put back. Lazy modules' uninitialized buffers and inference tensors are
    left alone.

    Args:
        model: the module.

    Returns:
        A context manager.

    Raises:
        Nothing (what the block raises passes through, after the buffers are restored).
    """
    saved = [
        (module, name, b, b.detach().clone())
        for module in model.modules()
        for name, b in own_buffers(module).items()
        if b is not None and not isinstance(b, UninitializedBuffer) and not b.is_inference()
    ]  # lazy modules' buffers have no values yet; inference tensors cannot be written here (and a step cannot either)
    try:
        yield
    finally:
        with torch.no_grad():
            for module, name, b, value in saved:  # every one: batch norm's kernel updates its stats unversioned
                own_buffers(module)[name] = b  # a buffer the step replaced gets its own tensor back
                b.copy_(value)


def _groups(saved: Sequence[SavedTensor], individually: int) -> list[tuple[SavedTensor, ...]]:
    """The ``individually`` largest tensors alone, the rest grouped by producing op."""
    by_size = sorted(saved, key=lambda t: -t.bytes)
    groups = [(t,) for t in by_size[:individually]]
    rest: dict[str | None, list[SavedTensor]] = {}
    for t in by_size[individually:]:
        rest.setdefault(t.op, []).append(t)
    return groups + [tuple(ts) for ts in rest.values()]


def sensitivity(
    model: torch.nn.Module,
    example_inputs: Any,
    codec: Any = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    backend: str | None = "aot_eager",
    individually: int = 8,
    seed: int = 0,
    verbose: bool = True,
) -> Sensitivity:
    """Measure, per saved tensor, how much packing it with ``codec`` costs the parameters' gradients.

    Runs one training step (forward, ``loss_fn``, backward; no optimizer step)
    ``2 + 2 * groups`` times: once packing nothing (the reference, which also
    lists the saved tensors the codec would pack), once packing all of them, and
    per group once packing only the group and once packing all but the group.
    The loss runs under the same hooks, as in a training loop.

    Args:
        model: the module (its gradients are overwritten; parameters are unchanged).
        example_inputs: a tuple of positional arguments, a dict of keyword
            arguments, or one tensor.
        codec: a lossy savedhooks codec or its hooks (default ``savedhooks.fp8()``).
        loss_fn: turns the model's output into a scalar; default: the output if
            it is a scalar, else the mean square of its floating tensors.
        backend: a ``torch.compile`` backend (``"aot_eager"``: the saved tensors
            are those of the compiled graphs; ``"inductor"`` recompiles slowly),
            or None for eager mode. Under compile it ends with
            ``torch.compiler.reset()``: its compiles, one per selection of packed
            tensors, would leave the model's code past dynamo's recompile
            limit, and a later ``torch.compile`` of it would run eagerly.
            Compile the model for training after it.
        individually: how many of the largest saved tensors are measured alone;
            the rest are grouped by producing op.
        seed: ``torch.manual_seed`` before every step (dropout draws the same).
        verbose: print the table.

    Returns:
        A :class:`Sensitivity`.

    Raises:
        TypeError: ``codec`` is not a savedhooks codec; ``model`` is not a module.
        ValueError: ``individually`` is negative, the model has no parameter that
            gets a gradient, or the output has no floating tensor and no ``loss_fn``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"sensitivity: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(individually, int) or individually < 0:
        raise ValueError(f"sensitivity: individually must be a non-negative int, got {individually!r}")
    codec = as_codec(fp8() if codec is None else codec, "sensitivity(codec=...)")
    loss_fn = loss_fn or default_loss
    fn = model if backend is None else torch.compile(model, backend=backend)

    def step(hooks_codec: Codec) -> tuple[dict[str, torch.Tensor | None], list[SavedTensor]]:
        model.zero_grad(set_to_none=True)
        with keyed_run() as run, kept_buffers(model), torch.random.fork_rng(), saved_tensors_hooks(hooks_codec.hooks()):
            torch.manual_seed(seed)
            loss_fn(call_model(fn, example_inputs)).backward()
        grads = {name: p.grad.detach().clone() if p.grad is not None else None for name, p in model.named_parameters()}
        return grads, run.census

    # every step recompiles (new hooks): never fall back to eager half way
    with dynamo.config.patch(recompile_limit=1 << 16, accumulated_recompile_limit=1 << 16):
        reference, saved = step(Census(codec))
        if all(g is None for g in reference.values()):
            raise ValueError("sensitivity: no parameter of the model got a gradient")
        all_db, all_worst = worst_sqnr(reference, step(Selected(codec, frozenset(), invert=True))[0])
        groups = []
        for group in _groups(saved, individually):
            keys = frozenset(t.key for t in group)
            only_db, only_worst = worst_sqnr(reference, step(Selected(codec, keys))[0])
            all_but_db, _ = worst_sqnr(reference, step(Selected(codec, keys, invert=True))[0])
            groups.append(SavedGroup(group, only_db, all_but_db, only_worst))
    model.zero_grad(set_to_none=True)
    if backend is not None:
        # its compiles fill dynamo's cache for the model's code past the recompile limit: a later compile would run eagerly
        torch.compiler.reset()
    groups.sort(key=lambda g: -math.inf if math.isnan(g.only_db) else g.only_db)
    report = Sensitivity(tuple(groups), all_db, all_worst, 2 + 2 * len(groups), codec)
    if verbose:
        print(report.table())
    return report
