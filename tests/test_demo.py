"""The `python -m benchmarks` demo measures what the analytic count of saved bytes says."""

from __future__ import annotations

import pytest

from benchmarks.demo import run, table

WIDTH, DEPTH, BATCH = 128, 2, 64
MIB = 2.0**20


def test_demo_saved_bytes_match_the_analytic_count():
    rows = {r.config: r for r in run(WIDTH, DEPTH, BATCH)}
    # Each Linear+GELU layer saves the GELU input and the next Linear's input, fp32.
    fp32_saved = 2 * DEPTH * BATCH * WIDTH * 4 / MIB
    slack = 1024 / MIB  # the loss scalar and allocator-level small tensors
    for config in ("eager, no hooks", "aot_eager, no hooks"):
        assert rows[config].saved_mib == pytest.approx(fp32_saved, abs=slack)
    for config in ("eager, @sh.hook bf16", "aot_eager, @sh.hook bf16 (inlined)"):
        assert rows[config].saved_mib == pytest.approx(fp32_saved / 2, abs=slack)
    # fp8 block 128: one byte per element plus one float32 scale per 128 elements
    fp8_saved = 2 * DEPTH * BATCH * (WIDTH + 4 * WIDTH // 128) / MIB
    for config in ("eager, sh.fp8()", "aot_eager, sh.fp8() (inlined)"):
        assert rows[config].saved_mib == pytest.approx(fp8_saved, abs=slack)
    # aot_eager leaves the inlined packs at the forward's end: no lower step peak
    # (the reorder pass fixes that); eager hooks pack as they go and lower it.
    assert rows["eager, @sh.hook bf16"].step_peak_mib < rows["eager, no hooks"].step_peak_mib
    # placement never makes a step worse (the halving at real sizes: tests/test_passes.py)
    for hooks in ("@sh.hook bf16", "sh.fp8()"):
        inlined = [r for c, r in rows.items() if c.startswith("aot_eager") and hooks in c][0]
        placed = [r for c, r in rows.items() if c.startswith("sh.backend") and hooks in c][0]
        assert placed.saved_mib == pytest.approx(inlined.saved_mib, abs=slack)
        assert placed.step_peak_mib <= inlined.step_peak_mib
    assert "| eager, no hooks |" in table(list(rows.values()))
