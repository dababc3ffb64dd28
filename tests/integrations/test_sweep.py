"""The sweep (benchmarks/sweep.py): every transformers architecture with a training head, built from its defaults.

The eager tier runs here on every architecture whose row in the committed
``docs/results/sweep/eager.jsonl`` is past building: each must still build,
its step without hooks must still train, and ``sh.policy()`` must hold (no
crash from inside savedhooks, the worst parameter gradient at least
:data:`benchmarks.sweep.GRADIENT_DB`). A test names the architecture that
stopped building. The compiled and plan tiers are extended runs whose files
are committed (``python -m benchmarks.sweep --tier compiled|plan``).
"""

from __future__ import annotations

import math
from typing import Any
import pathlib

import pytest
import torch

import savedhooks as sh

pytest.importorskip("transformers")

from benchmarks import sweep, sweep_models  # noqa: E402
from benchmarks.zoo import MIB  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECORDED = sweep.load("eager", ROOT / sweep.RESULTS)
BUILT = sorted(name for name, row in RECORDED.items() if row.status != "unbuilt")
_ARCHS = {a.name: a for a in sweep_models.architectures()}

# what a shrunk config may change from its class's defaults besides the size fields: where it holds
_NOT_SIZES = set(sweep_models._TOKEN_IDS) | set(sweep_models._MASKING)


def _keys(changes: dict, default: Any, prefix: str = "") -> set[str]:
    """The fields ``changes`` sets to a value other than ``default``'s, nested configs' fields by dotted path."""
    out = set()
    for key, value in changes.items():
        before = vars(default).get(key)
        if isinstance(value, dict) and hasattr(before, "to_dict"):
            out |= _keys({k: v for k, v in value.items() if before.to_dict().get(k) != v}, before, f"{prefix}{key}.")
        elif before != value:
            out.add(prefix + key)
    return out


def _is_size_or_id(key: str) -> bool:
    field = key.rsplit(".", 1)[-1]
    return (
        field in sweep_models._FIELDS
        or field in sweep_models._HEAD_DIMS
        or field in sweep_models._ROPE_DIMS
        or field in _NOT_SIZES
        or field == "conv_dim"
    )


@pytest.mark.parametrize("model_type", sorted({a.model_type for a in _ARCHS.values()}))
def test_the_builder_changes_sizes_token_ids_masking_and_layer_patterns_only(model_type):
    try:
        default = sweep_models._transformers().CONFIG_MAPPING[model_type]()
    except Exception as exc:  # the class's own defaults do not build: nothing to shrink
        pytest.skip(f"{model_type}: {type(exc).__name__}")
    changes = sweep_models.shrink(default)
    pattern = set(sweep_models._layer_pattern(default, sweep_models.SIZES["layers"]))
    overrides = {f for fields in sweep_models.OVERRIDES.values() for f in fields}
    assert {k for k in _keys(changes, default) if not _is_size_or_id(k) and k not in pattern} == set()
    assert all(_is_size_or_id(f) for f in overrides), overrides


def _eager_params():
    """Every recorded architecture past building; a recorded failure is a strict xfail (fixed: update the file)."""
    return [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=RECORDED[n].error))
        if RECORDED[n].status == "failure"
        else n
        for n in BUILT
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", _eager_params())
def test_sweep_eager_tier_still_builds_trains_and_holds(name):
    assert name in _ARCHS, f"{name}: transformers no longer maps this architecture to its head"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the recorded run's workers (--jobs 2 on 2 cores): the same sums, the same figures
    try:
        row = sweep.measure(_ARCHS[name], "eager", timeout_s=300)
    finally:
        torch.set_num_threads(threads)
    assert row.status != "unbuilt", f"{name} built before and no longer builds: {row.error}"
    if RECORDED[name].status == "transformers":
        return  # the step without hooks failed before too: transformers' own failure
    assert row.status != "transformers", f"{name}: the step without hooks trained before and fails now: {row.error}"
    assert row.status in ("ok", "refused"), f"{name}: {row.status}: {row.error}"
    assert row.policy_db is None or row.policy_db >= sweep.GRADIENT_DB, (row.policy_db, row.policy_worst)


def test_the_recorded_eager_tier_covers_every_mapped_architecture_and_at_least_six_heads():
    missing = sorted(set(_ARCHS) - set(RECORDED))
    assert missing == [], f"not in docs/results/sweep/eager.jsonl: run python -m benchmarks.sweep: {missing}"
    summary = sweep.summary(RECORDED.values())
    assert summary["trains"] >= 150 and summary["heads"] >= 6, summary


def test_select_picks_heads_names_and_shards():
    every = sweep.select(None, None, None)
    assert len(every) == len(_ARCHS)
    assert [a.name for a in sweep.select(None, ["llama"], None)] == ["causal-lm/llama"]
    assert [a.name for a in sweep.select(["ctc"], ["wav2vec2"], None)] == ["ctc/wav2vec2"]
    shards = [sweep.select(None, None, f"{k}/3") for k in (1, 2, 3)]
    assert sorted(a.name for s in shards for a in s) == sorted(a.name for a in every)
    for bad in ("0/3", "4/3", "x"):
        with pytest.raises(ValueError, match="shard"):
            sweep.select(None, None, bad)
    with pytest.raises(ValueError, match="no architecture named"):
        sweep.select(None, ["no-such-model"], None)


@sh.hook
def _crude(x):
    """Every floating saved tensor as its signs times its mean magnitude: gradients far off."""
    return x.sign() * x.abs().mean() if x.is_floating_point() else x


@_crude.unpack
def _crude(packed):
    return packed


def test_measure_statuses_a_crash_with_hooks_and_a_gradient_below_the_bar(monkeypatch):
    llama = _ARCHS["causal-lm/llama"]
    row = sweep.measure(llama, "eager")
    assert row.status == "ok" and row.policy_db >= sweep.GRADIENT_DB and 0 < row.policy_ratio < 1

    monkeypatch.setattr(sweep, "_policy", lambda: sh.saved_tensors_hooks(_crude))
    row = sweep.measure(llama, "eager")
    assert row.status == "failure" and row.policy_db < sweep.GRADIENT_DB and "gradient" in row.error
    assert row.bf16_db >= sweep.GRADIENT_DB  # the yardstick: bf16 storage holds on llama

    def crashes():
        raise RuntimeError("boom")

    monkeypatch.setattr(sweep, "_policy", crashes)
    row = sweep.measure(llama, "eager")
    assert row.status == "failure" and row.error == "RuntimeError: boom"
    # a time-out, in the step without hooks too, is a failure, not transformers' own
    row = sweep.measure(llama, "eager", timeout_s=0.01)
    assert row.status == "failure" and row.error.startswith("MeasurementTimeout"), row


def test_the_page_counts_statuses_and_round_trips_the_rows(tmp_path):
    rows = [
        sweep.SweepRow("causal-lm/a", "eager", "ok", 1.0, 4.0, 0.5, 30.0, "w"),
        sweep.SweepRow("ctc/b", "eager", "failure", 1.0, 4.0, 0.9, math.nan, "w", error="policy gradient NaN dB (w)"),
        sweep.SweepRow("ctc/c", "eager", "unbuilt", error="ValueError: x"),
    ]
    for row in rows:
        sweep._append(row, tmp_path)
    loaded = sweep.load("eager", tmp_path)
    assert list(loaded) == ["causal-lm/a", "ctc/b", "ctc/c"]
    assert loaded["causal-lm/a"] == rows[0] and math.isnan(loaded["ctc/b"].policy_db)
    page = sweep.document({"eager": loaded}, "python -m benchmarks.sweep")
    assert "3 architectures: 1 ok, 0 refused, 1 failure, 0 transformers, 1 unbuilt" in page
    assert "Of the 2 whose step without hooks trains (2 heads)" in page
    assert "| ctc/b | speech | failure |" in page and "NaN" in page
    assert "Kinds that train: dense 1, speech 1." in page
    assert torch.__version__ in page


def test_the_plan_tier_s_page_counts_plans_within_the_limit_and_lists_refusals_and_failures():
    rows = {r.name: r for r in [
        sweep.SweepRow("causal-lm/a", "plan", "ok", 1.0, 4.0, 0.5, 30.0, plan_ratio=0.98, floor_mib=1.5,
                       plan_baseline=1.01, plan_s=30.0, base_s=10.0),
        sweep.SweepRow("causal-lm/b", "plan", "refused", 1.0, 4.0, 0.5, 30.0, floor_mib=2.0, plan_baseline=1.2,
                       error="infeasible: floor 2.00 MiB"),
        sweep.SweepRow("ctc/c", "plan", "failure", 1.0, 4.0, 0.5, 30.0, plan_ratio=1.2, error="plan at 1.20 of its budget"),
    ]}  # fmt: skip
    page = sweep.document({"plan": rows}, "python -m benchmarks.sweep")
    assert "Plans: 1 of 3 (33%) within 1.05 of their budget" in page
    assert ("1 refused (33%: 1 an infeasible budget whose floor is at or below the policy's peak, 0 (0%) an error "
            "naming what is unsupported), 1 failures") in page
    assert "- refused: causal-lm/b: infeasible: floor 2.00 MiB" in page
    assert "without hooks: median 3.0, highest 3.0 (1 plans)" in page and "| 3.0 |" in page
    assert "within 5% of the measured one on 1 of 2; its floor at or below the measured `sh.policy()` peak on 2 of 2" in page
    assert "- failure: ctc/c: plan at 1.20 of its budget" in page


class _Config:
    use_cache = True


class _Cached(torch.nn.Module):
    """A module whose config has a KV cache on, as a transformers decoder's has."""

    def __init__(self):
        super().__init__()
        self.config = _Config()


@pytest.mark.parametrize("floor_mib, status", [(5.0, "refused"), (7.0, "failure")])
def test_an_infeasible_floor_is_compared_with_the_policy_s_peak_with_the_kv_cache_off_as_the_plan_trains(
    monkeypatch, floor_mib, status
):
    """The policy measured 4 MiB with the cache on, 6 MiB with it off (the configuration sh.plan trains in)."""
    model, seen = _Cached(), []

    def infeasible(*args, **kwargs):
        raise sh.InfeasibleBudgetError(int(2.8 * MIB), int(floor_mib * MIB), int(8 * MIB), checked=True)

    def measure(step, model_):
        seen.append(model.config.use_cache)
        return int(6 * MIB), {}

    monkeypatch.setattr(sh, "plan", infeasible)
    monkeypatch.setattr(sweep, "_measure", measure)
    monkeypatch.setattr(sweep, "_compiled", lambda m: m)
    row = sweep.SweepRow("causal-lm/a", "plan", "ok", 1.0, 4.0, 1.0, 30.0)
    sweep._plan_into(row, model, {}, int(4 * MIB), int(4 * MIB), {})
    assert seen == [False] and model.config.use_cache is True  # measured with the cache off, then restored
    assert row.status == status and row.policy_planned_mib == 6.0, row
    if status == "failure":
        assert row.error == "infeasible: floor 7.00 MiB above the policy's 6.00 MiB (KV cache off, as the plan trains)"
    page = sweep.document({"plan": {row.name: row}}, "python -m benchmarks.sweep")
    assert f"its floor at or below the measured `sh.policy()` peak on {int(status == 'refused')} of 1" in page


@pytest.mark.parametrize("name, kind", [
    ("causal-lm/llama", "dense"), ("causal-lm/mixtral", "MoE"), ("causal-lm/mamba", "state-space or hybrid"),
    ("causal-lm/jamba", "state-space or hybrid"), ("seq2seq-lm/t5", "encoder-decoder"), ("masked-lm/bert", "encoder"),
    ("image-classification/vit", "vision"), ("ctc/wav2vec2", "speech"),
])  # fmt: skip
def test_family_kind_reads_the_head_and_the_config_s_fields(name, kind):
    head, model_type = name.split("/")
    assert sweep_models.family_kind(sweep_models.Architecture(head, model_type, "")) == kind


def test_the_plan_tier_s_compiled_steps_count_in_the_compiled_tier_without_the_plan_s_outcome(tmp_path):
    rows = [
        sweep.SweepRow("causal-lm/a", "plan", "failure", 1.0, 4.0, 0.5, 30.0, "w", plan_ratio=1.2,
                       error="plan at 1.20 of its budget"),
        sweep.SweepRow("causal-lm/b", "plan", "failure", 1.0, 4.0, 0.5, 12.0, "v", error="policy gradient 12.0 dB (v)"),
        sweep.SweepRow("causal-lm/c", "plan", "refused", 1.0, 4.0, error="NotCompiledError: graph breaks"),
        sweep.SweepRow("ctc/d", "plan", "transformers", 1.0, error="ValueError: x"),
    ]  # fmt: skip
    for row in rows:
        sweep._append(row, tmp_path)
    sweep._append(sweep.SweepRow("ctc/d", "compiled", "ok", 1.0, 4.0, 0.5, 35.0, "u"), tmp_path)
    compiled = sweep.loaded(tmp_path)["compiled"]
    assert [(n, r.status) for n, r in compiled.items()] == [
        ("causal-lm/a", "ok"), ("causal-lm/b", "failure"), ("causal-lm/c", "refused"), ("ctc/d", "ok")]
    assert compiled["causal-lm/a"].plan_ratio is None and compiled["causal-lm/a"].error == ""
    assert compiled["causal-lm/b"].error == "policy gradient 12.0 dB (v)" and compiled["ctc/d"].policy_db == 35.0
