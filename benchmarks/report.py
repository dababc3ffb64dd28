"""Report a run: the markdown table, the CSV and the plots, all from the same :class:`~benchmarks.run.Row`s."""

from __future__ import annotations

import csv
import dataclasses
import math
import pathlib

from benchmarks.run import Row

__all__ = [
    "COLUMNS",
    "HEADLINE_CONFIGS",
    "headline",
    "plot_activation_memory",
    "plot_pareto",
    "plot_timeline",
    "read_csv",
    "table",
    "write_csv",
    "write_markdown",
]

ABOVE = "▲"  # the table's marker for a peak above its no-hook baseline (Row.above_baseline)

# (field, table header, format; for a bool the text shown when true): every Row field, in table order
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("model", "model", "{}"),
    ("config", "config", "{}"),
    ("backend", "backend", "{}"),
    ("device", "device", "{}"),
    ("activation_mib", "activation MiB", "{:.1f}"),
    ("predicted_mib", "predicted MiB", "{:.1f}"),
    ("peak_mib", "peak MiB", "{:.1f}"),
    ("above_baseline", "above baseline", ABOVE),
    ("saved_mib", "saved MiB", "{:.1f}"),
    ("saved_ratio", "saved / no hooks", "{:.2f}"),
    ("step_ms", "step ms", "{:.0f}"),
    ("step_ratio", "step / compiled", "{:.2f}"),
    ("compile_s", "compile s", "{:.1f}"),
    ("grad_sqnr_db", "grad SQNR dB", "{:.1f}"),
    ("error", "error", "{}"),
)
assert [c[0] for c in COLUMNS] == [f.name for f in dataclasses.fields(Row)], "COLUMNS must list every Row field"


def _cell(value, fmt: str) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, bool):
        return fmt if value else ""
    if isinstance(value, float) and math.isinf(value):
        return "exact" if value > 0 else "-inf"
    if isinstance(value, float) and math.isnan(value):  # a worst SQNR is NaN only for non-finite gradients
        return "non-finite"
    return fmt.format(value).replace("|", "/")


def table(rows: list[Row], drop: tuple[str, ...] = ("device",)) -> str:
    """Render rows as a markdown table (numbers right-aligned; infinite SQNR reads "exact", NaN "non-finite";
    ▲ marks a peak above its no-hook baseline).

    Args:
        rows: the rows.
        drop: fields to leave out (by default the device, which is in the heading).

    Returns:
        The table, one line per row after the header.
    """
    columns = [c for c in COLUMNS if c[0] not in drop]
    if not any(r.error for r in rows):
        columns = [c for c in columns if c[0] != "error"]
    header = "| " + " | ".join(c[1] for c in columns) + " |"
    align = "|" + "|".join("---" if c[2] == "{}" else ":---:" if c[2] == ABOVE else "---:" for c in columns) + "|"
    lines = [header, align]
    for r in rows:
        lines.append("| " + " | ".join(_cell(getattr(r, c[0]), c[2]) for c in columns) + " |")
    return "\n".join(lines)


# The headline's configurations, in its order: what a user would otherwise pick beside savedhooks' own.
HEADLINE_CONFIGS: tuple[str, ...] = (
    "sh",
    "sh policy",
    "sh + reorder",
    "sh plan",
    "sh + checkpoint",
    "checkpoint",
    "budget 0.5",
    "torch fp8",
)


def headline(rows: list[Row]) -> str:
    """The headline table: each configuration's activation peak and step time over the compiled step without hooks.

    One line per (model, backend, configuration) of :data:`HEADLINE_CONFIGS` that
    has a "compiled" row of the same model and backend to compare with; ratios
    are taken within the rows given (one run).

    Args:
        rows: the rows of one run.

    Returns:
        A markdown table: model, backend, configuration, activation peak over
        compiled, step time over compiled, worst gradient SQNR (or the error).
    """
    compiled = {(r.model, r.backend): r for r in rows if r.config == "compiled" and not r.error}
    lines = [
        "| model | backend | config | activation / compiled | step / compiled | grad SQNR dB |",
        "|---|---|---|---:|---:|---:|",
    ]
    order = {name: i for i, name in enumerate(HEADLINE_CONFIGS)}
    chosen = [r for r in rows if r.config in order and (r.model, r.backend) in compiled]
    for r in sorted(chosen, key=lambda r: (r.model, r.backend, order[r.config])):
        base = compiled[(r.model, r.backend)]
        if r.error:
            cells = ["", "", f"✗ {r.error}"]
        else:
            ratio = None if r.activation_mib is None or not base.activation_mib else r.activation_mib / base.activation_mib
            cells = [_cell(ratio, "{:.2f}"), _cell(r.step_ratio, "{:.2f}"), _cell(r.grad_sqnr_db, "{:.1f}")]
        lines.append("| " + " | ".join([r.model, r.backend, r.config, *cells]) + " |")
    return "\n".join(lines)


def write_markdown(
    rows: list[Row],
    path: str | pathlib.Path,
    command: str,
    heading: str,
    models: dict[str, str],
    configs: dict[str, str],
) -> pathlib.Path:
    """Write a run's results file: the command and setting that made it, the headline, what ran, every row.

    Args:
        rows: the rows of one run.
        path: the file to write (its folder is created).
        command: the command line that made the rows.
        heading: the setting (torch version, device, sizes), as the run printed it.
        models: model name -> its one-line description.
        configs: configuration name -> what it runs (those without rows are left out).

    Returns:
        The path written.

    Raises:
        OSError: the file cannot be written.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    used = {r.config for r in rows}
    text = "\n".join(
        [
            "# Benchmark results",
            "",
            f"`{command}`; {heading}. Written by the command: run it again to update this file.",
            "",
            "Activation peak: one training step's peak above the memory live before it. Ratios are within this run.",
            "",
            "## Against the compiled step without hooks",
            "",
            headline(rows),
            "",
            "## Models",
            "",
            *[f"- {name}: {text}" for name, text in models.items()],
            "",
            "## Configurations",
            "",
            *[f"- {name}: {text}" for name, text in configs.items() if name in used],
            "",
            "## Every row",
            "",
            table(rows),
            "",
        ]
    )
    path.write_text(text)
    return path


def write_csv(rows: list[Row], path: str | pathlib.Path) -> pathlib.Path:
    """Write rows as CSV, one column per :class:`Row` field (blank for missing values, ``True`` / ``False`` for bools).

    Args:
        rows: the rows.
        path: the file to write (its folder is created).

    Returns:
        The path written.

    Raises:
        OSError: the file cannot be written.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([field.name for field in dataclasses.fields(Row)])
        for r in rows:
            writer.writerow(["" if v is None else v for v in dataclasses.astuple(r)])
    return path


def read_csv(path: str | pathlib.Path) -> list[Row]:
    """Read rows written by :func:`write_csv`.

    Args:
        path: the CSV file.

    Returns:
        The rows (numbers as floats, bools as bools, blanks as ``None``).

    Raises:
        ValueError: the header is not :class:`Row`'s fields, or a value does not parse.
    """
    fields = dataclasses.fields(Row)
    with pathlib.Path(path).open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        if header != [field.name for field in fields]:
            raise ValueError(f"read_csv: header {header} is not Row's fields")
        rows = []
        for values in reader:
            kwargs = {}
            for field, value in zip(fields, values):
                kwargs[field.name] = _parse(field.type, value)
            rows.append(Row(**kwargs))
    return rows


def _parse(kind: str, value: str):
    """A CSV cell as the Row field of annotation ``kind`` (``"str"``, ``"float | None"``, ``"bool | None"``)."""
    if kind == "str":
        return value
    if value == "":
        return None
    if kind.startswith("bool"):
        if value not in ("True", "False"):
            raise ValueError(f"read_csv: {value!r} is not a bool")
        return value == "True"
    return float(value)


def _label(r: Row) -> str:
    return r.config if r.backend == "eager" else f"{r.config} ({r.backend})"


def _pyplot():
    """matplotlib's pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str | pathlib.Path, title: str) -> pathlib.Path:
    """Title, lay out, write ``path`` (its folder made) and close the figure."""
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_activation_memory(rows: list[Row], path: str | pathlib.Path, title: str = "") -> pathlib.Path:
    """Bar chart of measured activation memory (and the predicted one, where there is one), one panel per model.

    Bars of rows whose peak is above their no-hook baseline are hatched red.

    Args:
        rows: the rows (failed ones are left out).
        path: the PNG to write.
        title: the figure's title.

    Returns:
        The path written.

    Raises:
        ImportError: matplotlib is not installed.
    """
    plt = _pyplot()

    ok = [r for r in rows if not r.error and r.activation_mib is not None]
    models = list(dict.fromkeys(r.model for r in ok))
    labels = list(dict.fromkeys(_label(r) for r in ok))
    panels = max(len(models), 1)
    figsize = (3.2 * panels + 2.5, 0.28 * len(labels) + 1.6)
    fig, axes = plt.subplots(1, panels, figsize=figsize, sharey=True, squeeze=False)
    colors = {"eager": "tab:gray", "inductor": "tab:blue", "aot_eager": "tab:orange"}
    for ax, model in zip(axes[0], models):
        by_label = {_label(r): r for r in ok if r.model == model}
        ys = range(len(labels))
        values = [by_label[lab].activation_mib if lab in by_label else 0.0 for lab in labels]
        bars = ax.barh(ys, values, color=[colors.get(by_label[lab].backend, "tab:green") if lab in by_label
                                          else "white" for lab in labels])  # fmt: skip
        above = False
        for bar, lab in zip(bars, labels):
            if lab in by_label and by_label[lab].above_baseline:
                bar.set(hatch="////", edgecolor="tab:red", label="" if above else "peak above baseline")
                above = True
        predicted = [(y, by_label[lab].predicted_mib) for y, lab in zip(ys, labels)
                     if lab in by_label and by_label[lab].predicted_mib is not None]  # fmt: skip
        if predicted:
            ax.plot([p for _, p in predicted], [y for y, _ in predicted], "k|", ms=10, label="predicted")
        if predicted or above:
            ax.legend(fontsize=7, loc="lower right")
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("activation MiB", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].set_yticks(range(len(labels)), labels)
    axes[0][0].invert_yaxis()  # shared: the first configuration on top in every panel
    return _save(plt, fig, path, title)


def plot_pareto(rows: list[Row], path: str | pathlib.Path, title: str = "") -> pathlib.Path:
    """Step time (over compiled) against activation peak, one panel per model; plans joined by a line.

    Args:
        rows: the rows (failed ones and rows without a step ratio are left out).
        path: the PNG to write.
        title: the figure's title.

    Returns:
        The path written.

    Raises:
        ImportError: matplotlib is not installed.
    """
    plt = _pyplot()

    ok = [r for r in rows if not r.error and r.activation_mib is not None and r.step_ratio is not None]
    models = list(dict.fromkeys(r.model for r in ok))
    fig, axes = plt.subplots(1, max(len(models), 1), figsize=(5.0 * max(len(models), 1), 4.0), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in ok if r.model == model]
        plans = sorted((r for r in mine if r.config.startswith("plan")), key=lambda r: r.activation_mib)
        ax.plot([r.activation_mib for r in plans], [r.step_ratio for r in plans], "o-", color="black",
                label="sh.plan")
        for r in mine:
            if not r.config.startswith("plan"):
                ax.plot(r.activation_mib, r.step_ratio, "s", label=r.config)
        for r in plans:
            ax.annotate(r.config.removeprefix("plan "), (r.activation_mib, r.step_ratio), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("activation MiB", fontsize=8)
        ax.set_ylabel("step time / compiled", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7)
    return _save(plt, fig, path, title)


def plot_timeline(
    timelines: dict[str, tuple[list[int], int]], path: str | pathlib.Path, title: str = ""
) -> pathlib.Path:
    """Predicted live memory per node over one training step (forward graph, then backward), one line per config.

    Args:
        timelines: ``{config: (live bytes per node, forward node count)}`` as
            :class:`~benchmarks.run.Result` keeps them for aot_eager.
        path: the PNG to write.
        title: the plot's title.

    Returns:
        The path written.

    Raises:
        ImportError: matplotlib is not installed.
    """
    plt = _pyplot()
    mib = 2.0**20
    fig, ax = plt.subplots(figsize=(10, 4))
    for config, (curve, n_forward) in timelines.items():
        xs = [i / max(n_forward, 1) for i in range(n_forward)]
        n_backward = len(curve) - n_forward
        xs += [1 + i / max(n_backward, 1) for i in range(n_backward)]
        ax.plot(xs, [b / mib for b in curve], lw=1, label=f"{config} (peak {max(curve, default=0) / mib:.1f} MiB)")
    ax.axvline(1.0, color="grey", ls=":")
    ax.set_xlabel("forward graph (0-1, by node) | backward graph (1-2)")
    ax.set_ylabel("predicted live MiB above the step's inputs")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    return _save(plt, fig, path, "")
