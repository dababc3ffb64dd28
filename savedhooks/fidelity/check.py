"""``sh.fidelity.check``: one step with and without hooks, the worst parameter gradients and the peak ratio.

A user who puts saved-tensor hooks around their own model runs this once to see
whether the gradients survive: the same training step (forward, loss,
backward; no optimizer step) with the same inputs and random state, without
hooks and with them, each after one warm-up step (a compiled model compiles
there), and the step's measured activation peak.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from savedhooks.codecs.base import Codec
from savedhooks.compiler import saved_tensors_hooks
from savedhooks.hooks import HookPair
from savedhooks.fidelity.sensitivity import call_model, default_loss, kept_buffers
from savedhooks.memory.measure import measure_peak
from savedhooks.metrics import sqnr

__all__ = ["GradientCheck", "check"]


@dataclasses.dataclass(frozen=True)
class GradientCheck:
    """What :func:`check` measured.

    Attributes:
        gradients: ``(parameter name, SQNR dB)`` of every parameter whose
            reference gradient is above the noise floor, worst first.
        peak_bytes: the step's measured activation peak with the hooks.
        reference_peak_bytes: the same without hooks.
        min_db: the SQNR the verdict asks of every gradient.
        missing: parameters that got a gradient without the hooks and none with
            them, or the reverse.
    """

    gradients: tuple[tuple[str, float], ...]
    peak_bytes: int
    reference_peak_bytes: int
    min_db: float
    missing: tuple[str, ...] = ()

    @property
    def worst_db(self) -> float:
        """The lowest SQNR over the gradients (inf when all are exact; -inf when one is missing)."""
        if self.missing:
            return -math.inf
        return self.gradients[0][1] if self.gradients else math.inf

    @property
    def worst(self) -> str | None:
        """The parameter with the worst gradient (a missing one first), or None when there is none."""
        if self.missing:
            return self.missing[0]
        return self.gradients[0][0] if self.gradients else None

    @property
    def peak_ratio(self) -> float:
        """Peak with the hooks over the peak without (NaN when the reference step allocated nothing)."""
        return self.peak_bytes / self.reference_peak_bytes if self.reference_peak_bytes else math.nan

    @property
    def ok(self) -> bool:
        """Whether every gradient is at ``min_db`` or better (a NaN SQNR counts as worse)."""
        return not self.missing and all(db >= self.min_db for _, db in self.gradients)

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "BAD GRADIENTS"
        lines = [
            f"{verdict}: worst parameter gradient {_db(self.worst_db)} dB ({self.worst}), "
            f"asked >= {self.min_db:g} dB; peak {self.peak_bytes / 2**20:.2f} MiB, "
            f"{self.peak_ratio:.2f}x of {self.reference_peak_bytes / 2**20:.2f} MiB without hooks"
        ]
        lines += [f"  {name}: {_db(db)} dB" for name, db in self.gradients[:5]]
        lines += [f"  {name}: a gradient on one side only" for name in self.missing]
        return "\n".join(lines)


def _db(value: float) -> str:
    return "exact" if math.isinf(value) and value > 0 else f"{value:.1f}"


@contextlib.contextmanager
def _grads_kept(model: torch.nn.Module) -> Iterator[None]:
    """Put the parameters' ``.grad`` back after the block (the check's steps are measurements)."""
    saved = [(p, p.grad) for p in model.parameters()]
    try:
        yield
    finally:
        for p, grad in saved:
            p.grad = grad


def check(
    model: torch.nn.Module,
    example_inputs: Any,
    hooks: Any,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    backend: str | Callable[..., Any] | None = "inductor",
    min_db: float = 25.0,
    noise_floor: float = 1e-5,
    seed: int = 0,
    device: Any = None,
) -> GradientCheck:
    """Run one training step without and with ``hooks``; compare the parameter gradients and the peaks.

    Each configuration runs a warm-up step (a compiled model compiles there)
    and a measured one, with ``torch.manual_seed(seed)`` before each so that
    dropout draws the same. The model's parameters, ``.grad`` and buffers
    (batch norm's running statistics) are as they were afterwards.

    Args:
        model: the module to check.
        example_inputs: a tuple of positional arguments, a dict of keyword
            arguments, or one tensor (a batch as training feeds it).
        hooks: the hooks to check: ``sh.policy()``, another codec's
            :class:`~savedhooks.HookPair` or a codec.
        loss_fn: turns the model's output into a scalar; default: the output
            if it is a scalar, a ``loss`` field of it (transformers' outputs),
            else the mean square of its floating tensors.
        backend: a ``torch.compile`` backend (default ``"inductor"``, plain
            ``torch.compile``), or None for eager mode.
        min_db: the SQNR every gradient must reach for the verdict ``ok``.
        noise_floor: a parameter whose reference gradient norm is at most this
            fraction of the largest is skipped (its true gradient is zero; its
            SQNR would compare rounding noise).
        seed: the random seed of every step.
        device: where the peak is measured (``"cuda"`` or ``"cpu"``; default
            CUDA when available).

    Returns:
        A :class:`GradientCheck`; ``print`` it for the verdict.

    Raises:
        TypeError: ``model`` is not a module, or ``hooks`` is not a savedhooks codec or hook pair.
        ValueError: no parameter gets a gradient, or ``min_db`` / ``noise_floor`` is not a number.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"check: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(hooks, Codec):
        hook_pair = hooks.hooks()
    elif isinstance(hooks, HookPair):
        hook_pair = hooks
    else:
        raise TypeError(f"check: hooks must be a savedhooks codec or hook pair (sh.policy(), @sh.hook), got {hooks!r}")
    for name, value in (("min_db", min_db), ("noise_floor", noise_floor)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ValueError(f"check: {name} must be a number, got {value!r}")
    loss_fn = loss_fn or _default_loss
    fn = model if backend is None else torch.compile(model, backend=backend)

    def run(with_hooks: bool) -> tuple[dict[str, torch.Tensor], int]:
        def step() -> None:
            torch.manual_seed(seed)
            with saved_tensors_hooks(hook_pair) if with_hooks else contextlib.nullcontext():
                loss = loss_fn(call_model(fn, example_inputs))
            loss.backward()

        model.zero_grad(set_to_none=True)
        step()  # warm-up: compiles
        model.zero_grad(set_to_none=True)
        peak = measure_peak(step, device=device)
        return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}, peak

    with _grads_kept(model), kept_buffers(model), torch.random.fork_rng():
        reference, reference_peak = run(False)
        got, peak = run(True)
    if not reference:
        raise ValueError("check: no parameter of the model got a gradient")
    largest = max(g.double().norm().item() for g in reference.values())
    scores = [
        (name, sqnr(ref, got[name]))
        for name, ref in reference.items()
        if name in got and ref.double().norm().item() > noise_floor * largest
    ]
    scores.sort(key=lambda s: -math.inf if math.isnan(s[1]) else s[1])
    missing = tuple(sorted(set(reference) ^ set(got)))
    return GradientCheck(tuple(scores), peak, reference_peak, float(min_db), missing)


def _default_loss(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    return default_loss(output)
