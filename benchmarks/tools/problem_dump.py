"""Save the scheduling problems the reorder pass meets: ``python -m benchmarks.tools.problem_dump``.

Compiles one step of a benchmark model under a configuration with inductor
(a fresh inductor cache, so the pass runs) and writes every
:class:`savedhooks.schedule.Problem` the pass scheduled, in order, as gzipped
JSON. Tests replay them (``tests/memory/test_schedule.py``): the backward of a model
too large to compile in a test is scheduled in about a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import tempfile
from pathlib import Path
from unittest import mock

from savedhooks.compiler import passes
from savedhooks.schedule import Problem

__all__ = ["load_problems", "record_problems", "save_problems"]


def record_problems(model: str, size: float = 1.0, config: str = "sh") -> list[Problem]:
    """The problems the reorder pass schedules in one inductor step of a benchmark model.

    Args:
        model: a name of :data:`benchmarks.models.MODELS`.
        size: the batch multiplier.
        config: a name of :data:`benchmarks.configs.CONFIGS` (compiled).

    Returns:
        The problems, in the order the pass met them.

    Raises:
        KeyError: an unknown model or configuration.
    """
    from benchmarks.configs import CONFIGS
    from benchmarks.models import make_workload

    problems: list[Problem] = []
    scheduled = passes.schedule

    def recording(problem: Problem, *args, **kwargs):
        problems.append(problem)
        return scheduled(problem, *args, **kwargs)

    workload = make_workload(model, size)
    with tempfile.TemporaryDirectory() as cache, mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": cache}), \
            mock.patch.object(passes, "schedule", recording):  # fmt: skip
        step = CONFIGS[config].build(workload, "inductor")
        try:
            step.forward().backward()
        finally:
            step.close()
    return problems


def save_problems(problems: list[Problem], path: str | Path) -> None:
    """Write problems as gzipped JSON (tuples as lists, the frozensets sorted), for :func:`load_problems`.

    Args:
        problems: the problems.
        path: the ``.json.gz`` file to write.

    Returns:
        None.

    Raises:
        OSError: the file cannot be written.
    """
    records = [
        {k: sorted(v) if isinstance(v, frozenset) else v for k, v in dataclasses.asdict(p).items()} for p in problems
    ]
    with gzip.open(path, "wt") as f:
        json.dump(records, f, separators=(",", ":"))


def load_problems(path: str | Path) -> list[Problem]:
    """Read problems written by :func:`save_problems`.

    Args:
        path: a ``.json.gz`` file.

    Returns:
        The problems.

    Raises:
        OSError, ValueError: the file cannot be read or is not JSON.
        TypeError: an entry is not a problem's fields.
    """
    with gzip.open(path, "rt") as f:
        records = json.load(f)
    frozen = {"early", "late", "chains"}
    return [Problem(**{k: frozenset(v) if k in frozen else _tuples(v) for k, v in r.items()}) for r in records]


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def main() -> None:
    """Record one step's problems and write them (see the module docstring and ``--help``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tools.problem_dump", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-big")
    parser.add_argument("--size", type=float, default=1.0)
    parser.add_argument("--config", default="sh")
    parser.add_argument("--out", required=True, help="the .json.gz file to write")
    args = parser.parse_args()
    problems = record_problems(args.model, args.size, args.config)
    save_problems(problems, args.out)
    print(f"{len(problems)} problems ({', '.join(str(p.size) + ' nodes' for p in problems)}) -> {args.out}")


if __name__ == "__main__":
    main()
