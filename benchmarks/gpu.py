"""One GPU command: the checks and measurements a CUDA machine is for, one results file per device and torch.

``python -m benchmarks.gpu MODE [--out-dir docs/results] [--dry-run]`` runs, on
whatever torch is installed (nothing is installed into it), the steps of one
mode, each a command of its own, and writes their output into
``docs/results/gpu-<device>-torch<version>.md``: one section per mode, which a
later run of the same mode replaces, with the commands, torch version and
device. Each mode fits a run of under 9 minutes on an H100/H200:

* ``check``: the ``gpu``-marked tests (first installing, from the wheels in
  ``benchmarks/wheels``, the test requirements the machine lacks: pytest,
  expecttest, hypothesis, filelock; pure Python but hypothesis, whose wheel is
  for CPython 3.12 on x86-64), the kernel bandwidth of the Triton
  kernels and the aten path (``benchmarks.kernels``), and the host-copy
  bandwidth with the offload stress test (``benchmarks.host_copies``), whose
  asynchronous copies must keep the gradients.
* ``frontier``: ``benchmarks.pareto --device cuda`` on the main benchmark's
  Llama: compiled, checkpointing, torch's memory budget, torch's fp8 pass and
  partitioner offload, ``sh.policy()`` and ``sh.plan`` at the budgets
  ``--fractions``, peak and step time of each, every row timed in turn.
* ``offload``: ``benchmarks.step_time --device cuda`` on the model built for
  offload (``gpt2-medium``): ``sh.offload()`` and ``sh.offload(fp8)`` under bf16
  autocast (against the bf16 step) and torch's partitioner offload (against
  the compiled step), beside the pinned copy bandwidth that bounds them
  (``benchmarks.host_copies``).

Without a CUDA device the command refuses (exit code 2); ``--dry-run`` prints
the commands of a mode instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import pathlib
import re
import shlex
import subprocess
import sys
import time

import torch

MODES = ("check", "frontier", "offload")
WHEELS = pathlib.Path(__file__).parent / "wheels"  # the test requirements, for a GPU machine that lacks them
TEST_REQUIREMENTS = ("pytest", "expecttest", "hypothesis", "filelock")
_SECTION = re.compile(r"^## (\w+)\n", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class Step:
    """One command of a mode.

    Attributes:
        name: what it measures, a heading in the results file.
        argv: the command, run with the same Python as this one.
    """

    name: str
    argv: tuple[str, ...]


def missing_test_requirements() -> tuple[str, ...]:
    """The test requirements this Python cannot import.

    Returns:
        The names of :data:`TEST_REQUIREMENTS` without an importable module.
    """
    return tuple(name for name in TEST_REQUIREMENTS if importlib.util.find_spec(name) is None)


def steps(mode: str, size: float = 8.0, fractions: tuple[float, ...] = (0.8, 0.6),
          missing: tuple[str, ...] | None = None) -> list[Step]:  # fmt: skip
    """The commands of a mode (see the module notes).

    Args:
        mode: one of :data:`MODES`.
        size: the models' batch multiplier (``--size`` of the benchmark commands).
        fractions: ``frontier``'s plan budgets, fractions of the modelled no-hook peak.
        missing: ``check``'s test requirements to install first (None: those
            :func:`missing_test_requirements` finds).

    Returns:
        The steps, in the order they run.

    Raises:
        ValueError: an unknown mode, a size or fraction out of range.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
    if not size > 0 or not all(0 < f <= 1 for f in fractions):
        raise ValueError(f"size must be positive and fractions in (0, 1], got {size!r}, {fractions!r}")
    py, sized = sys.executable, ("--size", f"{size:g}")
    if mode == "check":
        missing = missing_test_requirements() if missing is None else missing
        install = [Step("test requirements", (py, "-m", "pip", "install", "--no-index", "--find-links", str(WHEELS),
                                              *missing))] if missing else []  # fmt: skip
        return install + [
            Step("gpu tests", (py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:randomly", "tests")),
            Step("kernel bandwidth", (py, "-m", "benchmarks.kernels", "--sizes", "16,256,1024")),
            Step("host copies", (py, "-m", "benchmarks.host_copies", "--steps", "10")),
        ]
    if mode == "frontier":
        budgets = tuple(f"{f:g}" for f in fractions)
        return [Step("pareto", (py, "-m", "benchmarks.pareto", "--device", "cuda", "--models", "llama", *sized,
                                "--fractions", *budgets, "--rounds", "5", "--out", "{tmp}"))]  # fmt: skip
    return [
        Step("step time", (py, "-m", "benchmarks.step_time", "--device", "cuda", "--models", "gpt2-medium", *sized,
                           "--configs", "bf16 offload", "bf16 sh offload", "torch offload", "--rounds", "5")),
        Step("host copies", (py, "-m", "benchmarks.host_copies", "--steps", "5")),
    ]  # fmt: skip


def results_path(out_dir: pathlib.Path, device: str, version: str) -> pathlib.Path:
    """Where a device's results on a torch release go.

    Args:
        out_dir: the results folder.
        device: the device's name (``torch.cuda.get_device_name()``).
        version: ``torch.__version__``.

    Returns:
        ``out_dir / "gpu-<device>-torch<version>.md"``, the names reduced to
        lowercase letters, digits, dots and dashes.
    """

    def slug(text: str) -> str:
        return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")

    return out_dir / f"gpu-{slug(device)}-torch{slug(version)}.md"


def section(mode: str, command: str, heading: str, outputs: list[tuple[Step, int, float, str]]) -> str:
    """A mode's section of the results file.

    Args:
        mode: the mode.
        command: the command line that ran it.
        heading: torch version and device.
        outputs: per step, ``(step, exit code, seconds, its output)``.

    Returns:
        Markdown: ``## <mode>``, the command, and each step's command, exit code,
        time and output.
    """
    lines = [f"## {mode}", "", f"`{command}`; {heading}", ""]
    for step, code, seconds, text in outputs:
        lines += [f"### {step.name}", "", f"`{shlex.join(step.argv)}`: exit code {code}, {seconds:.0f} s", "",
                  "```text", text.rstrip(), "```", ""]  # fmt: skip
    return "\n".join(lines)


def merge(text: str, mode: str, new: str, title: str) -> str:
    """The results file with ``new`` in place of the mode's section (added after the others otherwise).

    Args:
        text: the file's text ("" for a new file).
        mode: the mode whose section ``new`` is.
        new: the section (from :func:`section`).
        title: the file's first line, used when ``text`` is empty.

    Returns:
        The file's new text, sections in :data:`MODES` order.
    """
    found = list(_SECTION.finditer(text))
    first = text[: found[0].start()] if found else f"# {title}\n\n"
    sections = {m.group(1): text[m.start(): (found[i + 1].start() if i + 1 < len(found) else len(text))].rstrip()
                for i, m in enumerate(found)}  # fmt: skip
    sections[mode] = new.rstrip()
    ordered = [sections[m] for m in MODES if m in sections] + [v for k, v in sections.items() if k not in MODES]
    return first.rstrip() + "\n\n" + "\n\n".join(ordered) + "\n"


def _run(step: Step, tmp: pathlib.Path) -> tuple[int, float, str]:
    argv = [a.replace("{tmp}", str(tmp)) for a in step.argv]
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    return done.returncode, time.perf_counter() - start, done.stdout + done.stderr


def main(argv: list[str] | None = None) -> int:
    """Run one mode's steps and write its section of the results file.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        0 when every step exited 0, else 1.

    Raises:
        SystemExit: bad arguments, or no CUDA device without ``--dry-run`` (exit code 2).
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--size", type=float, default=8.0, help="the models' batch multiplier (default 8)")
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.8, 0.6],
                        help="frontier: plan budgets, fractions of the modelled no-hook peak (default 0.8 0.6)")
    parser.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("docs/results"))
    parser.add_argument("--dry-run", action="store_true", help="print the mode's commands and run nothing")
    args = parser.parse_args(argv)
    try:
        todo = steps(args.mode, args.size, tuple(args.fractions))
    except ValueError as error:
        parser.error(str(error))
    if args.dry_run:
        for step in todo:
            print(f"{step.name}: {shlex.join(step.argv)}")
        return 0
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (torch sees none); --dry-run prints the commands")
    device = torch.cuda.get_device_name()
    tmp = args.out_dir / f"gpu-{args.mode}-files"
    tmp.mkdir(parents=True, exist_ok=True)
    outputs = []
    for step in todo:
        code, seconds, text = _run(step, tmp)
        print(f"{step.name}: exit code {code}, {seconds:.0f} s", flush=True)
        outputs.append((step, code, seconds, text))
    command = " ".join(["python -m benchmarks.gpu", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    heading = f"torch {torch.__version__}, {device}"
    path = results_path(args.out_dir, device, torch.__version__)
    old = path.read_text() if path.exists() else ""
    path.write_text(merge(old, args.mode, section(args.mode, command, heading, outputs), f"savedhooks on {heading}"))
    print(f"wrote {path}")
    return 0 if all(code == 0 for _, code, _, _ in outputs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
