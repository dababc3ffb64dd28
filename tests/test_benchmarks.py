"""``python -m benchmarks --quick`` on one small model: every configuration gives a row, in one schema.

No timing assertions: the machine is shared. The saved bytes are checked against
the analytic count (what the old demo test checked), since they do not depend on
timing.
"""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.__main__ import main
from benchmarks.configs import CONFIGS
from benchmarks.report import COLUMNS, read_csv, table
from benchmarks.run import Row

MIB = 2.0**20


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert main(["--quick", "--models", "mlp", "--backends", "aot_eager", "--no-progress", "--out", str(out)]) == 0
    return out


def test_quick_run_writes_one_row_per_configuration(quick_run, capsys):
    rows = read_csv(quick_run / "benchmarks.csv")  # raises unless the header is Row's fields
    expected = {(c.name, "aot_eager" if c.compiled else "eager") for c in CONFIGS.values() if not c.cuda_only}
    assert {(r.config, r.backend) for r in rows} == expected
    assert len(rows) == len(expected)
    for r in rows:
        assert r.error == "", f"{r.config} ({r.backend}) failed: {r.error}"
        assert r.model == "mlp" and r.device == "cpu"
        for field in ("activation_mib", "peak_mib", "saved_mib", "step_ms", "step_ratio", "grad_sqnr_db"):
            assert getattr(r, field) is not None, (r.config, field)
        # the memory model sees every compiled step that runs as recorded graphs
        assert (r.predicted_mib is not None) == (r.backend == "aot_eager" and r.config != "python hooks")
    assert (quick_run / "activation_memory.png").stat().st_size > 0
    assert (quick_run / "timeline_mlp.png").stat().st_size > 0


def test_saved_bytes_match_the_analytic_count(quick_run):
    rows = {r.config + "/" + r.backend: r for r in read_csv(quick_run / "benchmarks.csv")}
    width, batch, blocks, classes = 512, 1024, 4, 10  # models.mlp at --quick (size 0.5)
    # each Linear + GELU block saves the GELU input and the next Linear's input; the loss its log-softmax
    fp32 = (2 * blocks * batch * width + batch * classes) * 4 / MIB
    # fp8 with row scales: one byte per element plus a float32 scale per row
    fp8 = (2 * blocks * batch * (width + 4) + batch * (classes + 4)) / MIB
    slack = 4096 / MIB  # the loss scalar and small allocator-level tensors
    for key in ("no hooks/eager", "compiled/aot_eager"):
        assert rows[key].saved_mib == pytest.approx(fp32, abs=slack), key
    for key in ("sh eager/eager", "sh/aot_eager", "sh + reorder/aot_eager"):
        assert rows[key].saved_mib == pytest.approx(fp8, abs=slack), key
    # hooks outside savedhooks pack one more (batch, classes) tensor of the loss (an alias savedhooks packs once);
    # plain Python hooks also see the compiled region's input batch, and pack a copy of it
    loss_alias, input_fp8 = batch * (classes + 4) / MIB, batch * (width + 4) / MIB
    assert rows["torch hooks/aot_eager"].saved_mib == pytest.approx(fp8 + loss_alias, abs=slack)
    assert rows["python hooks/aot_eager"].saved_mib == pytest.approx(fp8 + loss_alias + input_fp8, abs=slack)
    # placement lowers the step's peak; the model predicts what is measured (within 5 %, plus the fp8
    # aten reference's workspace: a few float32 copies of a 2^18-element chunk, which no graph shows)
    assert rows["sh + reorder/aot_eager"].activation_mib < rows["sh/aot_eager"].activation_mib
    workspace = 2.0
    for r in rows.values():
        if r.predicted_mib is not None:
            excess = r.activation_mib - r.predicted_mib
            assert -0.05 * r.activation_mib <= excess <= 0.05 * r.activation_mib + workspace, r.config


def test_table_and_csv_share_the_row_schema():
    assert [c[0] for c in COLUMNS] == [f.name for f in dataclasses.fields(Row)]
    row = Row("m", "c", "eager", "cpu", activation_mib=1.0, grad_sqnr_db=float("inf"))
    text = table([row])
    assert text.splitlines()[0].startswith("| model | config | backend | activation MiB")
    assert "| exact |" in text and "device" not in text and "error" not in text
    assert "| boom |" in table([dataclasses.replace(row, error="boom")])
