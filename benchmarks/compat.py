"""What savedhooks does on the installed torch, and the fast test tier's result there: one column of a results table.

``python -m benchmarks.compat [--tests] [--out docs/results/compatibility.md]``
reads, from savedhooks' torch compatibility layer (``savedhooks._torch``), what
differs on the installed release (each piece detected by asking torch for it,
see ``docs/compatibility.md``), and with ``--tests`` runs the fast test tier
(``pytest -q -n auto -m "not slow"``) and records its summary line and wall
time. The column replaces the column of the same torch version in ``--out``
(a markdown table with a row per item and a column per torch version, created
when missing); the other columns stay, so one file gathers the runs of several
torch installations, each with the command, torch version and device it ran with.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import pathlib
import platform
import re
import subprocess
import sys
import time

import torch

COLUMNS = ("torch", "every saved value hooked", "fp8 codec on CPU", "Triton", "async offload", "offload timing",
           "backward frees its gradients", "isolated benchmark copies", "torch bugs worked around or pinned",
           "fast tier (-m \"not slow\")", "device, Python")  # fmt: skip
_HEADING = "# savedhooks on each torch release\n"
_FIRST = "torch"  # the table's first header cell: the rows' names, then one column per torch version
_SUMMARY = re.compile(r"^=* ?(\d+ (?:passed|failed).*?) in ([\d.]+)s", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class Row:
    """One torch installation's entries: what savedhooks detects there and what ran (a column of the table).

    Attributes:
        version: ``torch.__version__``.
        cells: its entries, in :data:`COLUMNS` order after ``torch``.
    """

    version: str
    cells: tuple[str, ...]

    def markdown(self) -> str:
        """The entries as one markdown table line, version first (what the command prints)."""
        return "| " + " | ".join((self.version, *self.cells)) + " |"


def features() -> dict[str, str]:
    """What savedhooks does on the installed torch, by :data:`COLUMNS` name (detected, not looked up by version).

    Returns:
        The cells of every column but ``torch``, the fast tier and the device.
    """
    from savedhooks._torch import aot, dynamo, inductor, offload
    from savedhooks._torch.version import BUGS

    triton = importlib.util.find_spec("triton")
    triton_cell = "no"
    if triton is not None:
        import triton as triton_module

        triton_cell = triton_module.__version__
    filtering = hasattr(aot.config, "saved_tensors_hooks_filtering_mode")
    return {
        "every saved value hooked": "yes" if filtering else "no: graph intermediates only",
        "fp8 codec on CPU": "precompiled (aot_compile)" if dynamo.has_aot_compile() else "compiled per process",
        "Triton": triton_cell,
        "async offload": "torch's ao ops" if offload.HAS_AO_OPS else "synchronous copies",
        "offload timing": "roofline" if inductor.estimate_roofline_runtime_ms is not None else "nominal",
        "backward frees its gradients": "yes" if aot.BACKWARD_FREES_GRADIENTS else "no: held to the end",
        "isolated benchmark copies": "isolate_recompiles" if dynamo.HAS_ISOLATE_RECOMPILES else "own code object",
        "torch bugs worked around or pinned": ", ".join(name for name, bug in BUGS.items() if bug.present()) or "none",
    }


def fast_tier(workers: str = "auto") -> str:
    """Run the fast test tier in a subprocess; its summary.

    Args:
        workers: pytest-xdist's ``-n``.

    Returns:
        pytest's summary counts and wall time, e.g. ``"760 passed, 137 skipped in 85 s"``,
        or ``"exit code N, no summary"``.
    """
    command = [sys.executable, "-m", "pytest", "-q", "-n", workers, "-m", "not slow", "-p", "no:randomly"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    match = None
    for match in _SUMMARY.finditer(done.stdout):
        pass
    if match is None:
        return f"exit code {done.returncode}, no summary"
    counts = re.sub(r", \d+ warnings?", "", match.group(1))
    return f"{counts} in {seconds:.0f} s"


def current_row(tests: bool) -> Row:
    """This installation's entries.

    Args:
        tests: run the fast test tier (else its cell says it did not run).

    Returns:
        Its :class:`Row`.
    """
    found = features()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    tier = fast_tier() if tests else "not run"
    cells = tuple(found[c] for c in COLUMNS[1:-2]) + (tier, f"{device}, Python {platform.python_version()}")
    return Row(torch.__version__, cells)


def merge(text: str, row: Row, command: str) -> str:
    """A results file with ``row``'s column in place of the column of the same torch version (added otherwise).

    The table has a row per :data:`COLUMNS` entry after ``torch`` and a column
    per torch version, sorted by version.

    Args:
        text: the file's text ("" for a new file).
        row: this installation's cells.
        command: the command that made them, written under the table.

    Returns:
        The new text: heading, table, and one line per torch version naming the
        command that wrote its column.
    """
    columns: dict[str, tuple[str, ...]] = {}
    commands: dict[str, str] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] == _FIRST:
            versions = cells[1:]
            body = {}
            for below in lines[i + 2:]:
                if not below.startswith("| "):
                    break
                values = [c.strip() for c in below.strip().strip("|").split("|")]
                body[values[0]] = values[1:]
            for k, version in enumerate(versions):
                columns[version] = tuple(body.get(name, [""] * len(versions))[k] for name in COLUMNS[1:])
        found = re.match(r"^- torch (\S+): `(.*)`$", line)
        if found:
            commands[found.group(1)] = found.group(2)
    columns[row.version] = row.cells
    commands[row.version] = command

    def order(version: str) -> tuple:
        return tuple(int(p) if p.isdigit() else 0 for p in re.split(r"[.+]", version)[:3])

    versions = sorted(columns, key=order)
    out = [_HEADING, "| " + " | ".join((_FIRST, *versions)) + " |", "|" + "---|" * (len(versions) + 1)]
    for k, name in enumerate(COLUMNS[1:]):
        out.append("| " + " | ".join((name, *(columns[v][k] for v in versions))) + " |")
    out += ["", "Each column was written by `python -m benchmarks.compat`, run in an environment with that torch:", ""]
    out += [f"- torch {v}: `{commands.get(v, 'unknown')}`" for v in versions]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write this torch installation's column into the results file.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        0.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compat", description=__doc__.splitlines()[0])
    parser.add_argument("--tests", action="store_true", help="run the fast test tier and record its summary")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/results/compatibility.md"),
                        help="the results table (default: %(default)s)")  # fmt: skip
    args = parser.parse_args(argv)
    row = current_row(args.tests)
    command = "python -m benchmarks.compat" + (" --tests" if args.tests else "")
    if args.out != parser.get_default("out"):
        command += f" --out {args.out}"
    old = args.out.read_text() if args.out.exists() else ""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(merge(old, row, command))
    print(row.markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
