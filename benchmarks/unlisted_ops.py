"""Models whose backward reads saved tensors with ops off the policy's list: ``python -m benchmarks.unlisted_ops``.

A loss computed by a recursion in log space (as CTC's and an HMM's are), a
sampling op (``grid_sample``), a cumulative product, a spectral op (``rfft``,
then a log magnitude) and a custom ``autograd.Function``. For each, eager and
under plain ``torch.compile``, ``sh.fidelity.check`` runs a step with
``sh.policy()`` and with unguarded ``sh.fp8()`` against the step without hooks:
the worst parameter gradient and the peak ratio. ``--out`` writes a Markdown
file with the command, torch version and device (``--device cuda`` on a GPU).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

import savedhooks as sh

__all__ = ["MODELS", "build", "main", "rows"]


class LogSpaceRecursion(nn.Module):
    """A loss by a forward recursion in log space (as CTC's and an HMM's are): alpha_t = logsumexp(alpha + A) + e_t."""

    def __init__(self, states: int = 16, steps: int = 24) -> None:
        super().__init__()
        self.emit, self.steps = nn.Linear(32, states), steps
        self.transition = nn.Parameter(torch.randn(states, states))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        emissions = F.log_softmax(self.emit(x), dim=-1)  # (B, T, S)
        alpha = emissions[:, 0]
        for t in range(1, self.steps):
            alpha = torch.logsumexp(alpha.unsqueeze(-1) + self.transition.log_softmax(-1), dim=1) + emissions[:, t]
        return -torch.logsumexp(alpha, dim=-1).mean()


class Sampler(nn.Module):
    """A spatial transformer: features sampled at learned locations (grid_sample reads both in its backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.loc = nn.Conv2d(3, 16, 3, padding=1), nn.Linear(3, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = F.gelu(self.conv(x))
        theta = self.loc(x.mean((2, 3))).view(-1, 2, 3) + torch.tensor([[1.0, 0, 0], [0, 1.0, 0]])
        grid = F.affine_grid(theta, list(features.shape), align_corners=False)
        return F.grid_sample(features, grid, align_corners=False).square().mean()


class Cumulative(nn.Module):
    """Stick-breaking weights: a cumulative product of gates (its backward divides by its input)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.out = nn.Linear(32, 64), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.cumprod(torch.sigmoid(self.gate(x)), dim=1)  # along the sequence
        return self.out(weights).square().mean()


class Spectral(nn.Module):
    """A log-magnitude spectrum of learned features along time (rfft, abs, log)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.rfft(F.gelu(self.lin(x)), dim=1).abs()
        return torch.log(spectrum + 1e-3).mean()


class _ExpNormalize(torch.autograd.Function):
    """log(sum(exp(z))) along the last dim, its backward g * exp(z - y) from the saved input and output."""

    @staticmethod
    def forward(ctx, z):
        y = torch.logsumexp(z, dim=-1, keepdim=True)
        ctx.save_for_backward(z, y)
        return y

    @staticmethod
    def backward(ctx, grad):
        z, y = ctx.saved_tensors
        return grad * torch.exp(z - y)


class CustomFunction(nn.Module):
    """A custom autograd.Function whose backward exponentiates large saved values."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ExpNormalize.apply(20 * self.lin(x)).mean()


MODELS = {
    "log-space recursion": (LogSpaceRecursion, lambda: torch.randn(16, 24, 32)),
    "sampling": (Sampler, lambda: torch.randn(8, 3, 32, 32)),
    "cumulative": (Cumulative, lambda: torch.randn(16, 64, 32)),
    "spectral": (Spectral, lambda: torch.randn(16, 128, 32)),
    "custom Function": (CustomFunction, lambda: torch.randn(16, 64, 32)),
}




def build(name: str, device: str = "cpu") -> tuple[nn.Module, torch.Tensor]:
    """The model ``name`` of :data:`MODELS` and its batch, seeded 0, on ``device``.

    Raises:
        KeyError: ``name`` is not in :data:`MODELS`.
    """
    torch.manual_seed(0)
    make, inputs = MODELS[name]
    return make().to(device), inputs().to(device)


def rows(device: str = "cpu", backends: tuple[str | None, ...] = (None, "inductor")) -> list[tuple[str, ...]]:
    """One row per model and mode: worst gradient and peak ratio of ``sh.policy()`` and ``sh.fp8()``."""
    out = []
    for name in MODELS:
        for backend in backends:
            cells = [name, backend or "eager"]
            for hooks in (sh.policy(), sh.fp8()):
                torch._dynamo.reset()
                model, x = build(name, device)
                result = sh.fidelity.check(model, x, hooks, backend=backend, device=device)
                cells += [f"{result.worst_db:.1f}", f"{result.peak_ratio:.2f}"]
            torch._dynamo.reset()
            out.append(tuple(cells))
    return out


def main(argv: list[str] | None = None) -> None:
    """Print the table; with ``--out``, write it with its command, torch version and device."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--out", help="write the Markdown table here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    table = rows(args.device)
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({platform.machine()})"
    lines = [
        "# Models with ops off the policy's list",
        "",
        f"`python -m benchmarks.unlisted_ops{' --device cuda' if args.device == 'cuda' else ''}"
        f"{' --out ' + args.out if args.out else ''}`; torch {torch.__version__}; device {device}; "
        f"{(time.perf_counter() - started) / 60:.1f} min.",
        "",
        "Worst parameter gradient (dB SQNR against the same mode without hooks) and measured activation "
        "peak over the step without hooks, from `sh.fidelity.check`.",
        "",
        "| model | mode | sh.policy() dB | sh.policy() peak | sh.fp8() dB | sh.fp8() peak |",
        "|---|---|---:|---:|---:|---:|",
        *(f"| {' | '.join(r)} |" for r in table),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main(sys.argv[1:])
