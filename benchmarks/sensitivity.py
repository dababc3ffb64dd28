"""Which saved tensors fp8 hurts: ``python -m benchmarks.sensitivity --models llama --codec fp8``.

Runs :func:`savedhooks.fidelity.sensitivity` on benchmark models (their own inputs and
loss, run eagerly after the compiled model, as in the main job) and prints one
table per model: each saved tensor (the largest ``--individually`` alone, the
rest grouped by producing op) with the worst parameter-gradient SQNR when only
it is packed and when all but it are packed.
"""

from __future__ import annotations

import argparse

import torch

import savedhooks as sh
from benchmarks.models import MODELS, make_workload

__all__ = ["CODECS", "main"]

CODECS = {"fp8": sh.fp8, "policy": sh.policy, "fp8 stochastic": lambda: sh.fp8(rounding="stochastic")}


def main(argv: list[str] | None = None) -> int:
    """Command line: see ``python -m benchmarks.sensitivity --help``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sensitivity", description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "gpt2", "llama", "vit"], choices=list(MODELS))
    parser.add_argument("--codec", default="fp8", choices=list(CODECS))
    parser.add_argument("--size", type=float, default=1.0)
    parser.add_argument("--backend", default="aot_eager", help='torch.compile backend, or "eager" for none')
    parser.add_argument("--individually", type=int, default=6)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu (default) or cuda")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    for name in args.models:
        torch._dynamo.reset()  # models share forward code: start each from static shapes
        workload = make_workload(name, args.size, args.device)
        print(f"\n### {name} ({workload.description}), backend {args.backend}\n", flush=True)
        backend = None if args.backend == "eager" else args.backend
        sh.fidelity.sensitivity(workload.model, workload.inputs, CODECS[args.codec](), workload.loss_of, backend, args.individually)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
