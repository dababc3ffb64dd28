"""``python -m benchmarks``: the benchmark suite (see ``benchmarks/run.py`` for what is measured).

Prints a markdown table and writes, under ``--out`` (default
``benchmarks/results/``): ``benchmarks.csv`` (one row per model, configuration
and backend), ``results.md`` (the command, its setting, the headline ratios and
every row), ``activation_memory.png`` (bar chart) and ``timeline_<model>.png``
(the memory model's live bytes over one aot_eager training step).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import shlex
import sys
import tempfile
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        The parsed flags, with ``--quick`` defaults filled in, and ``command``:
        the command line as a shell reads it back (arguments quoted where needed).

    Raises:
        SystemExit: bad flags, or ``--help``.
    """
    from benchmarks.configs import CONFIGS, DEFAULT_CONFIGS
    from benchmarks.models import MODELS
    from benchmarks.run import BACKENDS, DEFAULT_INDUCTOR

    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=None, choices=list(MODELS), metavar="MODEL",
                        help=f"models to run (default: all of {' '.join(m for m in MODELS if not MODELS[m].cuda_only)}; "
                             f"with --device cuda also {' '.join(m for m in MODELS if MODELS[m].cuda_only)})")
    reduced = "; ".join(f"{name}: {', '.join(m.configs)}" for name, m in MODELS.items() if m.configs is not None)
    own = "; ".join(f"{name}: {', '.join(m.backends)}" for name, m in MODELS.items() if m.backends is not None)
    parser.add_argument("--configs", nargs="+", default=None, choices=list(CONFIGS), metavar="CONFIG",
                        help=f"configurations to run (default: all but {', '.join(c for c in CONFIGS if c not in DEFAULT_CONFIGS)}, "
                             f"and {reduced}; CUDA-only ones are skipped on CPU)")
    parser.add_argument("--backends", nargs="+", default=None, choices=list(BACKENDS), metavar="BACKEND",
                        help="run every compiled configuration with these torch.compile backends (default: aot_eager "
                             f"for all, inductor for {', '.join(DEFAULT_INDUCTOR)}, but {own}; "
                             "--quick: aot_eager only)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu (default) or cuda")
    parser.add_argument("--size", type=float, default=None, help="batch multiplier (default 1; --quick: 0.5)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per config (default 3; --quick: 2)")
    parser.add_argument("--quick", action="store_true", help="half-size batches, 2 timed steps, aot_eager only")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS, help="folder for the CSV and plots")
    parser.add_argument("--timeline-model", default=None, help="model for the timeline plot (default: llama if run)")
    parser.add_argument("--keep-cache", action="store_true",
                        help="use torch's inductor cache (default: a fresh one, so compile times are cold)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--compiled-loss", action="store_true",
                        help="compile the loss with the model (default: eager loss on the compiled model's output)")  # fmt: skip
    parser.add_argument("--no-layout-optimization", action="store_true",
                        help="run every configuration with torch._inductor.config.layout_optimization = False (inductor's "
                             "channels_last copies of convolution inputs and weights, kept for backward, pass through "
                             "no saved-tensor hook)")  # fmt: skip
    args = parser.parse_args(argv)
    args.command = " ".join(["python -m benchmarks", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device")
    if args.models is None:
        args.models = [name for name, m in MODELS.items() if args.device == "cuda" or not m.cuda_only]
    args.size = args.size if args.size is not None else (0.5 if args.quick else 1.0)
    args.repeats = args.repeats if args.repeats is not None else (2 if args.quick else 3)
    if args.quick and args.backends is None:
        args.backends = ["aot_eager"]
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the suite, print the table, write the CSV, the results file and the plots.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        0 (failed configurations are reported in the table's error column).

    Raises:
        SystemExit: bad flags.
    """
    args = parse_args(argv)
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="savedhooks-bench-") as cache:
        if not args.keep_cache:  # read by inductor whenever it looks for its cache
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        try:
            return _run(args)
        finally:
            if previous is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


def _run(args: argparse.Namespace) -> int:
    import torch
    import torch._inductor.config

    from benchmarks import report
    from benchmarks.configs import CONFIGS, DEFAULT_CONFIGS
    from benchmarks.run import run

    command = args.command
    machine = f"{os.cpu_count()} CPU cores, {platform.machine()}"
    if args.device == "cuda":
        machine += f", {torch.cuda.get_device_name()}"
    heading = f"torch {torch.__version__}, {args.device}, {machine}, size {args.size:g}, {args.repeats} timed steps"
    heading += ", loss compiled with the model" if args.compiled_loss else ""
    heading += ", inductor layout optimization off" if args.no_layout_optimization else ""
    print(heading, flush=True)
    if args.device != "cuda":
        asked = args.configs if args.configs is not None else DEFAULT_CONFIGS
        skipped = [name for name in asked if CONFIGS[name].cuda_only]
        if skipped:
            print(f"skipped on {args.device} (CUDA only): {', '.join(skipped)}", flush=True)
    start = time.perf_counter()
    layout = {"layout_optimization": False} if args.no_layout_optimization else {}
    with torch._inductor.config.patch(layout):
        result = run(args.models, args.configs, args.backends, args.size, args.device, args.repeats,
                     progress=not args.no_progress, compiled_loss=args.compiled_loss)  # fmt: skip
    elapsed = time.perf_counter() - start
    print()
    for name, description in result.descriptions.items():
        print(f"- {name}: {description}")
    print()
    print(report.table(result.rows))
    csv_path = report.write_csv(result.rows, args.out / "benchmarks.csv")
    chart = report.plot_activation_memory(result.rows, args.out / "activation_memory.png", f"{command}\n{heading}")
    configs = {name: config.description for name, config in CONFIGS.items()}
    results = report.write_markdown(result.rows, args.out / "results.md", command, heading, result.descriptions, configs)
    written = [csv_path, results, chart]
    timeline_model = args.timeline_model or ("llama" if "llama" in args.models else args.models[0])
    timelines = {config: t for (model, config), t in result.timelines.items() if model == timeline_model}
    if timelines:
        title = f"{timeline_model}, aot_eager, predicted by sh.memory ({result.descriptions.get(timeline_model, '')})"
        written.append(report.plot_timeline(timelines, args.out / f"timeline_{timeline_model}.png", title))
    failed = sum(bool(r.error) for r in result.rows)
    print(f"\n{len(result.rows)} rows, {failed} failed, {elapsed:.0f} s; wrote {', '.join(map(str, written))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
