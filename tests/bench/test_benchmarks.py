"""``python -m benchmarks --quick`` on one small model: every configuration gives a row, in one schema.

No timing assertions: the machine is shared. The saved bytes are checked against
the analytic count, since they do not depend on
timing. The big model is only built, never run (a step takes seconds).
"""

from __future__ import annotations

import csv
import dataclasses
import math

import pytest
import torch
from filelock import FileLock

from benchmarks.__main__ import main, parse_args
from benchmarks.configs import CONFIGS
from benchmarks.models import BIG_MODEL_CONFIGS, MODELS, make_workload
from benchmarks.report import ABOVE, COLUMNS, headline, read_csv, table, write_csv, write_markdown
from benchmarks.run import ABOVE_TOLERANCE_MIB, Row, jobs, with_baselines
from benchmarks.tools.inductor_order import replay

MIB = 2.0**20
# the default configurations and the two hook paths without savedhooks (out of the default run)
QUICK_CONFIGS = [c.name for c in CONFIGS.values()
                 if (c.in_default or c.name in ("torch hooks", "python hooks")) and not c.cuda_only]  # fmt: skip


@pytest.fixture(scope="module")
def quick_run(shared_tmp_dir):
    """One quick run for all pytest-xdist workers (in their shared directory, under a lock), about 60 s."""
    out = shared_tmp_dir / "benchmark_quick_run"
    with FileLock(f"{out}.lock"):
        if not (out / "benchmarks.csv").exists():  # written last: a failed run leaves none
            argv = ["--quick", "--models", "mlp", "--backends", "aot_eager", "--no-progress", "--out", str(out)]
            assert main([*argv, "--configs", *QUICK_CONFIGS]) == 0
    return out


@pytest.mark.slow
def test_quick_run_writes_one_row_per_configuration(quick_run, capsys):
    rows = read_csv(quick_run / "benchmarks.csv")  # raises unless the header is Row's fields
    expected = {(name, "aot_eager" if CONFIGS[name].compiled else "eager") for name in QUICK_CONFIGS}
    assert {(r.config, r.backend) for r in rows} == expected
    assert len(rows) == len(expected)
    for r in rows:
        assert r.error == "", f"{r.config} ({r.backend}) failed: {r.error}"
        assert r.model == "mlp" and r.device == "cpu"
        for field in ("activation_mib", "peak_mib", "saved_mib", "step_ms", "step_ratio", "grad_sqnr_db"):
            assert getattr(r, field) is not None, (r.config, field)
        # the memory model sees every compiled step that runs as recorded graphs
        assert (r.predicted_mib is not None) == (r.backend == "aot_eager" and r.config != "python hooks")
        # every row has its baseline in this run; the baselines are not above themselves
        assert isinstance(r.above_baseline, bool), r.config
        if r.config in ("no hooks", "compiled"):
            assert r.above_baseline is False
    assert (quick_run / "activation_memory.png").stat().st_size > 0
    assert (quick_run / "timeline_mlp.png").stat().st_size > 0
    results = (quick_run / "results.md").read_text()
    assert results.startswith("# Benchmark results\n\n`python -m benchmarks --quick --models mlp --backends aot_eager")
    assert headline(rows) in results and "| mlp | aot_eager | sh policy |" in results


@pytest.mark.slow
def test_saved_bytes_match_the_analytic_count(quick_run):
    rows = {r.config + "/" + r.backend: r for r in read_csv(quick_run / "benchmarks.csv")}
    width, batch, blocks, classes = 512, 1024, 4, 10  # models.mlp at --quick (size 0.5)
    # each Linear + GELU block saves the GELU input and the next Linear's input; the loss its log-softmax
    fp32 = (2 * blocks * batch * width + batch * classes) * 4 / MIB
    # sh.fp8(): one byte per element plus a float32 scale per block of 128 along the rows; the eager
    # loss's log-softmax is stored as it is (float32) by every codec
    hidden_fp8 = batch * (width + 4 * width // 128) / MIB
    loss_fp32 = batch * classes * 4 / MIB
    loss_fp8 = (batch * classes + 4 * batch * classes // 128) / MIB  # the (batch, 10) rows as one flat row of blocks
    fp8 = 2 * blocks * hidden_fp8 + loss_fp32
    slack = 4096 / MIB  # the loss scalar and small allocator-level tensors
    for key in ("no hooks/eager", "compiled/aot_eager"):
        assert rows[key].saved_mib == pytest.approx(fp32, abs=slack), key
    for key in ("sh eager/eager", "sh/aot_eager", "sh + reorder/aot_eager"):
        assert rows[key].saved_mib == pytest.approx(fp8, abs=slack), key
    # sh.policy(): the GELU input and the Linear input are read linearly: int8, a float32 scale per 64 values
    policy = 2 * blocks * batch * (width + 4 * width // 64) / MIB + loss_fp32
    assert rows["sh policy/aot_eager"].saved_mib == pytest.approx(policy, abs=slack)
    # torch's own path keeps row scales (one float32 per row of the innermost dim)
    row_fp8 = (2 * blocks * batch * (width + 4) + batch * (classes + 4)) / MIB
    # torch's hooks pack one more (batch, classes) tensor of the loss (an alias savedhooks packs once);
    # plain Python hooks (the codec's encode, no rules) pack the loss's log-softmax twice, and also see the
    # compiled region's input batch, and pack a copy of it
    assert rows["torch hooks/aot_eager"].saved_mib == pytest.approx(row_fp8 + batch * (classes + 4) / MIB, abs=slack)
    python_hooks = fp8 - loss_fp32 + 2 * loss_fp8 + hidden_fp8
    assert rows["python hooks/aot_eager"].saved_mib == pytest.approx(python_hooks, abs=slack)
    # checkpointing keeps whole (batch, width) tensors at block boundaries and the loss's log-softmax;
    # with the policy on top, the block tensors in int8 blocks and the narrow log-softmax as it is
    kept = (rows["checkpoint/aot_eager"].saved_mib - batch * classes * 4 / MIB) / (batch * width * 4 / MIB)
    assert kept == pytest.approx(round(kept), abs=0.01) and round(kept) >= 1
    both = round(kept) * batch * (width + 4 * width // 64) / MIB + batch * classes * 4 / MIB  # int8 blocks of 64
    assert rows["sh + checkpoint/aot_eager"].saved_mib == pytest.approx(both, abs=slack)
    # placement lowers the step's peak; the model predicts what is measured (within 5 %, plus the fp8
    # aten reference's workspace: a few float32 copies of a 2^18-element chunk, which no graph shows)
    assert rows["sh + reorder/aot_eager"].activation_mib < rows["sh/aot_eager"].activation_mib
    # sh.plan, halfway between its modelled no-hook peak and its floor: its own prediction, below no hooks,
    # and what it packs lowers the saved bytes
    plan = rows["sh plan/aot_eager"]
    assert plan.activation_mib < rows["compiled/aot_eager"].activation_mib
    assert rows["sh policy/aot_eager"].saved_mib < plan.saved_mib < rows["compiled/aot_eager"].saved_mib
    # it may recompute blocks here (the choice hangs on measured times), which the model over-predicts (the strict
    # xfail in test_planner.py): at most its prediction, at least the prediction less one block's input
    block_input = 1024 * 512 * 4 / MIB
    assert plan.predicted_mib - block_input <= plan.activation_mib <= 1.05 * plan.predicted_mib
    workspace = 2.0
    for r in rows.values():
        if r.predicted_mib is not None and r.config != "sh plan":
            excess = r.activation_mib - r.predicted_mib
            assert -0.05 * r.activation_mib <= excess <= 0.05 * r.activation_mib + workspace, r.config


def test_table_and_csv_share_the_row_schema():
    assert [c[0] for c in COLUMNS] == [f.name for f in dataclasses.fields(Row)]
    row = Row("m", "c", "eager", "cpu", activation_mib=1.0, grad_sqnr_db=float("inf"))
    text = table([row])
    assert text.splitlines()[0].startswith("| model | config | backend | activation MiB")
    assert "| exact |" in text and "device" not in text and "error" not in text
    assert "| boom |" in table([dataclasses.replace(row, error="boom")])
    assert "| non-finite |" in table([dataclasses.replace(row, grad_sqnr_db=float("nan"))])


def _row(config: str, backend: str, peak: float | None, model: str = "m", error: str = "") -> Row:
    return Row(model, config, backend, "cpu", peak_mib=peak, step_ms=None if peak is None else 10.0, error=error)


def test_above_baseline_compares_with_the_no_hook_row_of_the_same_model_and_backend():
    rows = [
        _row("no hooks", "eager", 100.0),
        _row("sh eager", "eager", 100.0 + 2 * ABOVE_TOLERANCE_MIB),  # above the eager no-hook row
        _row("compiled", "inductor", 120.0),
        _row("sh", "inductor", 110.0),  # above eager's 100 but below its own baseline
        _row("sh + reorder", "inductor", 120.0 + ABOVE_TOLERANCE_MIB / 2),  # within the tolerance
        _row("compiled", "aot_eager", 90.0),
        _row("sh", "aot_eager", 95.0),  # above aot_eager's 90, below inductor's 120
        _row("checkpoint", "aot_eager", None, error="boom"),  # failed: no value
        _row("sh", "inductor", 130.0, model="other"),  # no baseline for this model
        _row("compiled", "inductor", 500.0, model="third", error="boom"),  # a failed baseline is none
        _row("sh", "inductor", 10.0, model="third"),
    ]
    marks = [(r.model, r.config, r.backend, r.above_baseline) for r in with_baselines(rows)]
    assert marks == [
        ("m", "no hooks", "eager", False),
        ("m", "sh eager", "eager", True),
        ("m", "compiled", "inductor", False),
        ("m", "sh", "inductor", False),
        ("m", "sh + reorder", "inductor", False),
        ("m", "compiled", "aot_eager", False),
        ("m", "sh", "aot_eager", True),
        ("m", "checkpoint", "aot_eager", None),
        ("other", "sh", "inductor", None),
        ("third", "compiled", "inductor", None),
        ("third", "sh", "inductor", None),
    ]


def test_bf16_rows_compare_with_the_bf16_row_and_run_only_when_asked():
    rows = [
        _row("compiled", "aot_eager", 100.0),
        _row("bf16", "aot_eager", 60.0),
        _row("bf16 sh policy", "aot_eager", 55.0),
        _row("bf16 checkpoint", "aot_eager", 70.0),  # above bf16's 60, below compiled's 100
    ]
    rows = [dataclasses.replace(r, saved_mib=r.peak_mib / 2, step_ms=r.peak_mib) for r in rows]
    marks = [(r.config, r.above_baseline, r.saved_ratio, r.step_ratio) for r in with_baselines(rows)]
    assert marks == [
        ("compiled", False, 1.0, 1.0),
        ("bf16", False, 1.0, 1.0),
        ("bf16 sh policy", False, 55 / 60, 55 / 60),
        ("bf16 checkpoint", True, 70 / 60, 70 / 60),
    ]
    names = {c.name for c, _ in jobs(None, None, "cpu", "mlp")}
    assert "compiled" in names and not names & {"bf16", "bf16 sh policy", "bf16 checkpoint"}
    assert {c.name for c, _ in jobs(["bf16", "bf16 sh policy"], ["aot_eager"], "cpu", "mlp")} == {
        "bf16",
        "bf16 sh policy",
    }


def test_above_baseline_is_marked_in_the_table_and_a_bool_in_the_csv(tmp_path):
    rows = with_baselines([_row("compiled", "inductor", 10.0), _row("sh", "inductor", 11.0),
                           _row("sh", "aot_eager", 11.0)])  # fmt: skip
    lines = table(rows).splitlines()
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    column = header.index("above baseline")
    marks = [line.strip("|").split("|")[column].strip() for line in lines[2:]]
    assert marks == ["", ABOVE, ""]
    back = read_csv(write_csv(rows, tmp_path / "rows.csv"))
    assert [r.above_baseline for r in back] == [False, True, None]
    assert back == rows


def test_big_model_runs_its_reduced_job_list_by_default():
    big = MODELS["gpt2-big"]
    assert big.configs == BIG_MODEL_CONFIGS and big.backends == ("inductor",)
    assert {"compiled", "sh", "checkpoint"} <= set(big.configs) <= set(CONFIGS)
    assert jobs(None, None, "cpu", "gpt2-big") == [(CONFIGS[name], "inductor") for name in BIG_MODEL_CONFIGS]
    # what the command line names replaces the model's defaults
    assert jobs(["sh"], ["aot_eager"], "cpu", "gpt2-big") == [(CONFIGS["sh"], "aot_eager")]
    assert [b for _, b in jobs(["compiled"], None, "cpu", "gpt2-big")] == ["inductor"]
    # the other models run the full default matrix: every configuration with aot_eager, a few with inductor
    small = jobs(None, None, "cpu", "mlp")
    assert {c.name for c, _ in small} == {c.name for c in CONFIGS.values() if c.in_default and not c.cuda_only}
    assert {c.name for c, b in small if b == "inductor"} == {"compiled", "sh"}
    args = parse_args([])
    assert args.configs is None and args.backends is None and "gpt2-big" in args.models


def test_the_offload_model_runs_by_default_only_on_cuda_with_the_offload_comparison():
    medium = MODELS["gpt2-medium"]
    assert medium.cuda_only and "gpt2-medium" not in parse_args([]).models
    assert parse_args(["--models", "gpt2-medium"]).models == ["gpt2-medium"]
    named = parse_args(["--configs", "sh", "torch fp8", "--out", "r"])
    assert named.command == "python -m benchmarks --configs sh 'torch fp8' --out r"  # a shell reads it back
    offload = ["bf16", "bf16 checkpoint", "bf16 save_on_cpu", "bf16 offload", "bf16 sh offload"]
    assert [(c.name, b) for c, b in jobs(None, None, "cuda", "gpt2-medium")] == [(n, "inductor") for n in offload]
    assert [c.name for c, _ in jobs(None, None, "cpu", "gpt2-medium")] == ["bf16", "bf16 checkpoint"]
    assert all(CONFIGS[n].baseline == "bf16" and not CONFIGS[n].in_default for n in offload[1:])


def test_big_model_is_the_size_its_description_says():
    workload = make_workload("gpt2-big", size=1.0)
    config = workload.model.config
    assert (config.n_embd, config.n_layer, config.n_head) == (768, 4, 12)
    assert workload.inputs["input_ids"].shape == (1, 512)
    params = sum(p.numel() for p in workload.model.parameters())
    assert 25e6 < params < 35e6
    assert "768" in workload.description and "activations" in workload.description


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_language_models_return_no_kv_cache(name):
    """K and V returned by the forward would be outputs, which torch never packs: training runs without the cache."""
    workload = make_workload(name, size=0.5)
    with torch.no_grad():
        out = workload.model(**workload.inputs)
    assert out.past_key_values is None


@pytest.mark.slow
def test_peak_ops_finds_the_phase_of_the_peak():
    """An MLP without hooks peaks in its backward (gradients join the saved activations), above the forward's bytes."""
    from benchmarks.tools.peak_ops import peak_ops

    result = peak_ops("mlp", 0.25, "compiled")
    assert result["ops"][0] == "## backward"
    assert result["peak"] > result["forward"] > result["backward"] >= 0


def test_peak_ops_with_checkpointing_or_bf16_keeps_less_after_the_forward():
    from benchmarks.tools.peak_ops import peak_ops

    plain = peak_ops("mlp", 0.25, "compiled", backend="aot_eager")
    checkpointed = peak_ops("mlp", 0.25, "compiled", backend="aot_eager", checkpoint=True)
    assert checkpointed["forward"] < 0.5 * plain["forward"]  # block inputs only, not every GELU input and output
    autocast = peak_ops("mlp", 0.25, "compiled", backend="aot_eager", bf16=True)
    # bf16 activations (measured 0.75x with the weights' bf16 copies, also saved): half to 0.8x of fp32's bytes
    assert 0.5 * plain["forward"] < autocast["forward"] < 0.8 * plain["forward"]


@pytest.mark.slow
def test_train_learns_and_reports_each_configuration_against_no_hooks(tmp_path, capsys):
    from benchmarks import train

    assert train.main(["--models", "mlp", "--configs", "no hooks", "sh.fp8()", "--steps", "12", "--size", "0.25",
                       "--lr", "3e-3", "--warmup", "2", "--out", str(tmp_path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    rows = list(csv.DictReader((tmp_path / "train.csv").open()))
    assert [r["config"] for r in rows] == ["no hooks", "sh.fp8()"]
    assert list(rows[0])[: len(train.COLUMNS)] == [c[0] for c in train.COLUMNS]
    for r in rows:
        losses = [float(v) for v in r["losses"].split()]
        assert len(losses) == 12 and losses[-1] < 0.8 * losses[0]  # the teacher's task is learnable
        assert float(r["held_out_loss"]) < 0.8 * losses[0]  # and what is learned holds on batches it never saw
    assert float(rows[0]["final_vs_no_hooks"]) == 0.0 == float(rows[0]["held_out_vs_no_hooks"])
    # the same data and init: fp8 changes the curve a little, not at all would mean no packing
    assert rows[0]["losses"] != rows[1]["losses"] and abs(float(rows[1]["final_vs_no_hooks"])) < 10
    assert "| mlp | sh.fp8() | 0 | 12 |" in out and (tmp_path / "train_loss.png").stat().st_size > 0


@pytest.mark.slow
def test_train_seeds_compare_each_run_with_no_hooks_at_its_own_seed(tmp_path, capsys):
    from benchmarks import train

    assert train.main(["--models", "mlp", "--configs", "no hooks", "sh.fp8()", "--steps", "3", "--size", "0.25",
                       "--backend", "eager", "--seeds", "2", "--out", str(tmp_path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    rows = list(csv.DictReader((tmp_path / "train.csv").open()))
    assert [(r["config"], r["seed"]) for r in rows] == [
        ("no hooks", "0"),
        ("sh.fp8()", "0"),
        ("no hooks", "1"),
        ("sh.fp8()", "1"),
    ]
    # another seed: other weights and batches, so another first loss; each config starts from its seed's weights
    assert rows[0]["first_loss"] != rows[2]["first_loss"]
    assert rows[0]["first_loss"] == rows[1]["first_loss"] and rows[2]["first_loss"] == rows[3]["first_loss"]
    for base, packed in ((rows[0], rows[1]), (rows[2], rows[3])):
        expected = 100 * (float(packed["final_loss"]) / float(base["final_loss"]) - 1)
        assert float(packed["final_vs_no_hooks"]) == pytest.approx(expected, abs=1e-9)
    deltas = [float(rows[i]["final_vs_no_hooks"]) for i in (1, 3)]
    summary = f"| mlp | sh.fp8() | 2 | {sum(deltas) / 2:+.2f} ({min(deltas):+.2f} .. {max(deltas):+.2f}) |"
    assert summary in out and "| mlp | no hooks | 2 |" not in out


def test_train_seed_zero_is_the_default_stream_and_seeds_do_not_reach_the_held_out_batches():
    from benchmarks import train
    from benchmarks.models import make_workload

    workload = make_workload("mlp", 0.25)
    assert torch.equal(train._task(workload, 5)[0]["x"], train._task(workload, 5, 0)[0]["x"])
    assert not torch.equal(train._task(workload, 5)[0]["x"], train._task(workload, 5, 1)[0]["x"])
    last = 1000 + 9 * train._SEED_STRIDE + train._SEED_STRIDE - 1  # seed 9, the last step allowed
    assert last < 1000 + train._HELD_OUT_STEP
    with pytest.raises(ValueError, match="seed"):
        train.train("mlp", "no hooks", steps=1, seed=10)


@pytest.mark.parametrize("kwargs", [{"steps": 0}, {"lr": 0.0}, {"clip": -1.0}, {"warmup": -1}])
def test_train_rejects_a_bad_recipe(kwargs):
    from benchmarks import train

    with pytest.raises(ValueError):
        train.train("mlp", "no hooks", **{"steps": 1, **kwargs})


def test_train_tasks_are_the_same_for_every_configuration_and_lm_text_follows_the_chain():
    from benchmarks import train
    from benchmarks.models import make_workload

    workload = make_workload("gpt2", 0.5)
    (a, _), (b, _) = train._task(workload, 3), train._task(workload, 3)
    assert torch.equal(a["input_ids"], b["input_ids"]) and not torch.equal(
        a["input_ids"], train._task(workload, 4)[0]["input_ids"]
    )
    ids = a["input_ids"]
    pairs = {(int(x), int(y)) for x, y in zip(ids[:, :-1].flatten(), ids[:, 1:].flatten())}
    assert ids.max() < 64 and len(pairs) <= 64 * 4  # each token has at most 4 successors
    images = make_workload("cnn", 0.5)
    (a, _), (b, _), (c, _) = train._task(images, 3), train._task(images, 3), train._task(images, 4)
    assert torch.equal(a["x"], b["x"]) and not torch.equal(a["x"], c["x"]) and a["x"].shape == (16, 3, 32, 32)
    # a faint class signal in unit noise: class means over two independent batches agree class by class
    means = []
    for seed in (0, 1):
        x, labels = train._images(torch.empty(40000, 1, 4, 4), torch.Generator().manual_seed(seed))
        assert labels.min() == 0 and labels.max() == 9 and 0.98 < x.std() < 1.02
        means.append(torch.stack([x[labels == k].mean(0).flatten() for k in range(10)]))
    corr = torch.corrcoef(torch.cat(means))[:10, 10:]  # class k of batch 0 against class j of batch 1
    assert corr.diagonal().min() > 0.6 and torch.equal(corr.argmax(1), torch.arange(10))


def test_saved_ratio_divides_by_the_no_hook_rows_saved_bytes():
    rows = [dataclasses.replace(r, saved_mib=s) for r, s in zip(
        [_row("compiled", "inductor", 10.0), _row("sh policy", "inductor", 9.0), _row("sh", "aot_eager", 9.0),
         _row("no hooks", "eager", 10.0), _row("sh eager", "eager", 9.0)], [20.0, 5.0, 5.0, 40.0, 8.0])]  # fmt: skip
    assert [r.saved_ratio for r in with_baselines(rows)] == [1.0, 0.25, None, 1.0, 0.2]
    assert "saved / no hooks" in table(with_baselines(rows)).splitlines()[0]


def test_arena_rows_show_each_strategy_against_the_liveness_peak():
    from benchmarks.arena import ARENA_HEADER, arena_row
    from savedhooks.memory import ARENA_STRATEGIES, Lifetime, plan_lifetimes

    lifetimes = [Lifetime("A", 2 * 2**20, 0, 1), Lifetime("B", 2**20, 0, 2), Lifetime("C", 3 * 2**20, 2, 3)]
    plans = {s: plan_lifetimes(lifetimes, s) for s in ARENA_STRATEGIES}
    row = arena_row("toy forward", "torch", 4, plans, plan_lifetimes(lifetimes, "best", alignment=512))
    assert row == (
        "| toy forward | 4 | 3 | torch | 4.000 | 4.000 (1.000) | 4.000 (1.000) | 6.000 (1.500) | 4.000 (1.000) "
        "| 4.000 (1.000) | not measured (CPU) |"
    )
    assert row.count("|") == ARENA_HEADER.splitlines()[0].count("|")


def test_compiled_loss_puts_the_loss_in_the_compiled_graph():
    workload = make_workload("mlp", 0.25)
    reference = workload.loss(workload.model)
    for compiled_loss, log_softmax_in_graph in ((False, False), (True, True)):
        torch._dynamo.reset()
        workload.compiled_loss = compiled_loss
        step = CONFIGS["compiled"].build(workload, "aot_eager")
        loss = step.forward()
        torch.testing.assert_close(loss, reference)
        targets = {str(n.target) for gm in step.graphs.forward for n in gm.graph.nodes}
        assert ("aten._log_softmax.default" in targets) == log_softmax_in_graph, compiled_loss


@pytest.mark.slow
def test_reorder_inductor_predicts_the_forward_that_inductor_runs_in_fx_order():
    """With inductor's reorder off the model's forward prediction is checked against the measurement (CPU, deterministic).

    ``python -m benchmarks.reorder_inductor`` prints the prediction next to the measurement for each order.
    """
    from benchmarks.reorder_inductor import CONFIGS as INDUCTOR_CONFIGS
    from benchmarks.reorder_inductor import MODELS as INDUCTOR_MODELS
    from benchmarks.reorder_inductor import measured_peaks

    make, shape = INDUCTOR_MODELS["4-layer MLP"]
    backend, options, reorder, recorder = INDUCTOR_CONFIGS["inductor, its reorder off + savedhooks pass, forward too"]()
    with torch._inductor.utils.fresh_cache():
        forward, _ = measured_peaks(make(), backend, options, torch.randn(*shape), reorder)
    assert len(recorder.peaks) == 1  # the forward graph only
    assert 0.85 * forward <= recorder.peaks[0] <= forward
    assert INDUCTOR_CONFIGS["inductor"]()[3] is None  # inductor reorders after the passes: nothing to predict


def test_memory_budget_configs_are_named_by_their_fraction_and_checked():
    from benchmarks.configs import memory_budget

    assert CONFIGS["budget 0.5"].name == memory_budget(0.5).name == "budget 0.5"
    assert memory_budget(0.25).description == "partitioner recompute, activation_memory_budget=0.25"
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"in \(0, 1\]"):
            memory_budget(bad)


def test_pareto_plot_joins_the_plans_and_marks_the_others(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.report import plot_pareto

    rows = [
        Row("m", c, "inductor", "cpu", activation_mib=mib, step_ms=ms)
        for c, mib, ms in (
            ("compiled", 10.0, 100.0),
            ("checkpoint", 6.0, 120.0),
            ("plan 0.8", 8.0, 101.0),
            ("plan floor", 4.0, 110.0),
        )
    ]
    png = plot_pareto(with_baselines(rows), tmp_path / "pareto.png", title="t")
    assert png.exists() and png.stat().st_size > 10_000


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_pareto_and_sensitivity_on_cuda_need_a_cuda_device(capsys):
    from benchmarks import pareto, sensitivity

    with pytest.raises(SystemExit) as exit_info:
        pareto.main(["--device", "cuda", "--models", "mlp"])
    assert exit_info.value.code == 2 and "--device cuda: torch sees no CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        sensitivity.main(["--device", "cuda", "--models", "mlp"])
    assert exit_info.value.code == 2 and "--device cuda: torch sees no CUDA device" in capsys.readouterr().err
    # on CUDA the plans are measured next to host offload too, torch's and ours, both CUDA-only configurations
    assert pareto.CUDA_ALTERNATIVES == ("save_on_cpu", "sh offload", "torch offload")
    assert all(CONFIGS[name].cuda_only for name in pareto.CUDA_ALTERNATIVES)


def _timing(config, ratio, low, high):
    from benchmarks.step_time import Timing

    return Timing("m", config, "inductor", 100.0 * ratio, ratio, low, high, 10, "compiled")


def test_pareto_verdict_compares_each_plan_with_the_fastest_alternative_at_or_below_its_peak():
    from benchmarks.pareto import document, verdicts

    peaks = {"compiled": 10.0, "checkpoint": 5.0, "budget 0.5": 6.0, "torch fp8": 4.5, "sh": 7.0,
             "plan checkpoint": 5.0, "plan 0.6": 6.0, "plan floor": 3.0}  # fmt: skip
    steps = {"compiled": 1.0, "checkpoint": 1.3, "budget 0.5": 1.1, "torch fp8": 1.2, "sh": 1.05,
             "plan checkpoint": 1.15, "plan 0.6": 1.12, "plan floor": 1.4}  # fmt: skip
    rows = [Row("m", c, "inductor", "cpu", activation_mib=mib) for c, mib in peaks.items()]
    rows.append(Row("m", "broken", "inductor", "cpu", activation_mib=4.0, grad_sqnr_db=math.nan))
    steps["broken"] = 0.9  # the fastest at 4.0 MiB, but its gradients are NaN: never the rival
    timings = [_timing(c, r, r - 0.02, r + 0.03) for c, r in steps.items()]
    found = {v.plan: v for v in verdicts(rows, timings)}
    # at checkpoint's peak (5.0): checkpoint (1.3) and torch fp8 (4.5, 1.2) reach it; torch fp8 is the faster
    assert (found["plan checkpoint"].rival, found["plan checkpoint"].rival_step) == ("torch fp8", 1.2)
    assert found["plan checkpoint"].plan_faster and found["plan checkpoint"].peak_ratio == 0.5
    assert found["plan checkpoint"].not_counted == ("broken",)
    # at 6.0 torch's budget 0.5 (1.1) reaches it too, and is faster than the plan (1.12)
    assert found["plan 0.6"].rival == "budget 0.5" and not found["plan 0.6"].plan_faster
    assert found["plan 0.6"].rival_spread == pytest.approx((1.08, 1.13))
    # nothing reaches 3.0: the plan stands alone
    assert found["plan floor"].rival == "" and found["plan floor"].plan_faster
    page = document(rows, timings, "python -m benchmarks.pareto", "torch x")
    assert "| m | plan 0.6 | 0.60 | 1.12 (1.10, 1.15) | budget 0.5 | 0.60 | 1.10 (1.08, 1.13) | no | broken |" in page
    assert "| plan floor | 3.0 | 0.30 | 1.40 | 1.38, 1.43 |  |" in page  # rows sorted by peak, spread given
    assert page.index("| compiled |") < page.index("| sh |") < page.index("| plan floor |")


def test_a_planned_configuration_recomputes_the_plan_s_blocks_and_close_reverts_them():
    import savedhooks as sh
    from benchmarks.configs import planned

    workload = make_workload("mlp", 0.25, "cpu")
    paths = sh.planner.find_blocks(workload.model)
    plan = sh.Plan(
        tensors=(),
        budget_bytes=1,
        predicted_peak_bytes=1,
        baseline_peak_bytes=1,
        floor_bytes=1,
        backend="aot_eager",
        recompute=paths[:2],
    )
    config = planned("t", plan)
    assert config.name == "plan t" and "recompute 2 blocks" in config.description
    step = config.build(workload, "aot_eager")
    try:
        assert ["forward" in vars(workload.model.get_submodule(p)) for p in paths] == [True, True] + [False] * (
            len(paths) - 2
        )
        step.forward().backward()
    finally:
        step.close()
    assert not any("forward" in vars(workload.model.get_submodule(p)) for p in paths)


def test_pareto_s_floor_is_the_lowest_budget_the_planner_s_error_names():
    import savedhooks as sh
    from benchmarks.configs import lowest_budget

    class Planner:  # checked: a plan with every candidate packed peaks at 45 bytes, below the modelled 55
        def plan(self, budget_bytes):
            raise sh.InfeasibleBudgetError(budget_bytes, 45 if budget_bytes < 45 else 55, 100, checked=True)

    assert lowest_budget(Planner()) == 45


def test_pareto_s_floor_row_raises_a_budget_until_a_plan_meets_min_sqnr(capsys):
    import savedhooks as sh
    from benchmarks.configs import FIDELITY_STEP, plan_or_lowest

    class Planner:  # plans above 120 bytes meet the fidelity limit; checked, 100 bytes peaks at 110
        baseline_bytes = 200

        def __init__(self):
            self.asked = []

        def plan(self, budget_bytes):
            self.asked.append(budget_bytes)
            if budget_bytes == 100:
                raise sh.InfeasibleBudgetError(100, 110, 200, checked=True)
            if budget_bytes < 120:
                raise sh.InfeasibleFidelityError(budget_bytes, 30.0, 25.0)
            return budget_bytes

    planner = Planner()
    assert plan_or_lowest(planner, 100) == planner.asked[-1] >= 120
    assert planner.asked[:2] == [100, 110] and all(b < 120 for b in planner.asked[1:-1])  # the checked peak, then up
    steps = zip(planner.asked[1:], planner.asked[2:])
    assert all(after == max(int(before * (1 + FIDELITY_STEP)), before + 1) for before, after in steps)
    assert "predicted to meet min_sqnr_db=30" in capsys.readouterr().err  # out of the tables on stdout
    stuck = Planner()
    stuck.baseline_bytes = 115  # the no-hook peak itself is below 120: the error is raised
    with pytest.raises(sh.InfeasibleFidelityError):
        plan_or_lowest(stuck, 111)
    assert stuck.asked[0] == 111 and stuck.asked[-1] == 115 and all(b < 115 for b in stuck.asked[:-1])


def test_pareto_passes_its_fidelity_limit_to_the_planner(monkeypatch, tmp_path):
    from benchmarks import pareto
    from benchmarks.configs import planner_for

    seen = []
    monkeypatch.setattr(pareto, "run_model", lambda *args: seen.append(args[-2:]) or ([], []))
    monkeypatch.setattr(pareto, "table", lambda rows: "")
    monkeypatch.setattr(pareto, "write_csv", lambda rows, path: path)
    monkeypatch.setattr(pareto, "plot_pareto", lambda rows, path, title: path)
    assert pareto.main(["--models", "mlp", "--min-sqnr-db", "25", "--out", str(tmp_path)]) == 0
    assert pareto.main(["--models", "mlp", "--rounds", "0", "--out", str(tmp_path)]) == 0
    assert seen == [(25.0, 10), (None, 0)]  # the fidelity limit, and the rounds timed in turn
    assert (tmp_path / "pareto.md").read_text().startswith("# Peak against step time")
    assert planner_for(make_workload("mlp", 0.25), "aot_eager", 25.0).min_sqnr_db == 25.0


_WRAPPER = """
def call(self, args):
    arg0_1, tangents_1 = args
    args.clear()
    buf0 = empty_strided_cpu((4, 4), (4, 1), torch.float32)
    cpp_fused_0(arg0_1, buf0)
    del arg0_1
    buf1 = empty_strided_cpu((2, 8), (1, 2), torch.float32)
    buf2 = reinterpret_tensor(buf0, (16, ), (1, ), 0); del buf0  # reuse
    del buf2
    del tangents_1
    buf3 = empty_strided_cpu((4, 4), (8, 1), torch.int8)
    return (buf1, buf3, )


def get_args():
    from torch._dynamo.testing import rand_strided
    arg0_1 = rand_strided((4, 4), (4, 1), device='cpu', dtype=torch.float32)
    tangents_1 = rand_strided((2, ), (1, ), device='cpu', dtype=torch.int64)
    return [arg0_1, tangents_1]
"""


def test_inductor_order_replays_a_wrappers_allocations_and_frees():
    run = replay(_WRAPPER)
    assert run.input_bytes == 64 + 16
    # buf0 (64) on top of the inputs is the peak: arg0_1 is freed before buf1 (16 floats by its strides)
    assert run.peak_bytes == 80 + 64 and run.peak_line.startswith("buf0 =")
    assert replay(_WRAPPER.replace("    del arg0_1\n", "")).peak_bytes == 80 + 64 + 64
    # a reuse renames a buffer (its del frees it once); buf3 spans 3 * 8 + 3 + 1 bytes
    assert replay(_WRAPPER.replace("    del buf2\n", "")).peak_bytes == 80 + 64 + 64 + 28 - 64
    with pytest.raises(ValueError, match="no 'def call"):
        replay("print(1)")


def test_a_run_without_progress_bar_prints_each_row_as_it_is_measured(capsys):
    from benchmarks.run import run

    result = run(["mlp"], ["compiled"], ["aot_eager"], size=0.25, repeats=1, progress=False)
    (row,) = result.rows
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("measured "))
    assert line.startswith("measured mlp / compiled / aot_eager: activation_mib ")
    assert f"step_ms {row.step_ms:.1f}" in line  # a run cut short keeps the figures of the rows it finished


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_host_copies_needs_a_cuda_device_and_refuses_unknown_settings(capsys):
    from benchmarks import host_copies

    with pytest.raises(SystemExit) as exit_info:
        host_copies.main([])
    assert exit_info.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown variant"):
        host_copies.offload_stress("inductor", "overlapped")
    with pytest.raises(ValueError, match="direction"):
        host_copies.copy_gb_per_s("up", pinned=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "compiled_loss"),
    [("gpt2", True), ("gpt2", False), ("mlp", True)],
    ids=["gpt2, compiled loss", "gpt2, eager loss", "mlp, compiled loss"],
)
def test_inductor_prediction_models_inductor_graphs_of_a_benchmark_model(model, compiled_loss):
    # the mlp's step checks that a C++ function's dying inputs are freed after the function, not node by node
    from benchmarks.tools.inductor_prediction import predicted_and_measured

    predicted, measured = predicted_and_measured(model, 1.0, "sh", compiled_loss=compiled_loss)
    assert measured > 0
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)


def test_the_cuda_trace_finds_the_peak_and_the_blocks_alive_there(capsys):
    from benchmarks.tools import cuda_trace

    def event(action, addr, size, line=1):
        return {
            "action": action,
            "addr": addr,
            "size": size,
            "frames": [{"name": "call", "filename": "/x/k.py", "line": line}],
        }

    events = [
        event("free_completed", 99, 1 << 20),  # a block from before the trace: ignored
        event("alloc", 1, 4 << 20, 10),
        event("segment_alloc", 7, 64 << 20),  # the allocator's own segments: not blocks
        event("alloc", 2, 16 << 20, 20),
        event("alloc", 3, 2 << 20, 30),
        event("free_completed", 2, 16 << 20),
        event("alloc", 4, 8 << 20, 40),  # 4 + 2 + 8 = 14 MiB: below the 22 MiB peak
    ]
    peak = cuda_trace.peak_of_trace(events)
    assert (peak.nbytes, peak.event) == (22 << 20, 4)
    assert peak.live == ((16 << 20, ("call@k.py:20",)), (4 << 20, ("call@k.py:10",)), (2 << 20, ("call@k.py:30",)))
    assert cuda_trace.peak_of_trace([]) == cuda_trace.TracePeak(0, -1, ())
    for argv, message in ((["--config", "nonsense"], "no configuration"), (["--config", "plan 2"], "no configuration")):
        with pytest.raises(SystemExit):
            cuda_trace.main(argv)
        assert message in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            cuda_trace.main(["--config", "plan floor"])
        assert "needs a CUDA device" in capsys.readouterr().err


def test_step_time_runs_each_step_once_per_round_in_orders_that_change():
    from benchmarks.step_time import interleaved_times

    calls: list[str] = []
    steps = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    times = interleaved_times(steps, rounds=6)
    rounds = [calls[i : i + 3] for i in range(0, len(calls), 3)]
    assert len(rounds) == 6 and all(sorted(r) == ["a", "b", "c"] for r in rounds)
    # no step always follows the same one (a fixed cycle would: its carry-over would be systematic)
    assert len({r[r.index("a") - 1] if r.index("a") else None for r in rounds}) > 1
    assert {name: len(t) for name, t in times.items()} == {"a": 6, "b": 6, "c": 6}
    calls.clear()
    interleaved_times(steps, rounds=6)
    assert [calls[i : i + 3] for i in range(0, len(calls), 3)] == rounds  # seeded
    with pytest.raises(ValueError, match="rounds >= 1"):
        interleaved_times(steps, rounds=0)


@pytest.mark.slow
def test_step_time_ratio_divides_by_the_baseline_in_the_same_round(monkeypatch):
    from benchmarks import step_time

    # a machine that slows to half speed in round 2: the per-round ratio does not move
    assert step_time.round_ratios([1.1, 2.2, 1.1], [1.0, 2.0, 1.0]) == pytest.approx([1.1, 1.1, 1.1])
    with pytest.raises(ValueError, match="equal, non-empty"):
        step_time.round_ratios([1.0], [1.0, 2.0])
    scripted = {"bf16": [1.0, 2.0, 1.0], "bf16 sh policy": [1.2, 2.0, 1.5]}
    monkeypatch.setattr(step_time, "interleaved_times", lambda steps, rounds: {n: scripted[n] for n in steps})
    timings = step_time.time_configs("mlp", ["bf16 sh policy"], size=0.5, backend="aot_eager", rounds=3, warmup=1)
    assert [(t.config, t.baseline) for t in timings] == [("bf16", "bf16"), ("bf16 sh policy", "bf16")]
    hooked = timings[1]
    assert (hooked.ratio, hooked.low, hooked.high) == pytest.approx((1.2, 1.0, 1.5))
    assert hooked.step_ms == pytest.approx(1500.0)


def test_step_time_builds_each_configuration_with_its_baseline_and_times_them_in_turn():
    from benchmarks.step_time import table, time_configs

    timings = time_configs("mlp", ["sh"], size=0.5, backend="aot_eager", rounds=3, warmup=1)
    assert [(t.config, t.baseline, t.backend, t.rounds) for t in timings] == [
        ("compiled", "compiled", "aot_eager", 3), ("sh", "compiled", "aot_eager", 3)]  # fmt: skip
    compiled, hooked = timings
    assert (compiled.ratio, compiled.low, compiled.high) == (1.0, 1.0, 1.0)
    assert hooked.step_ms > 0
    rows = table(timings).splitlines()
    assert len(rows) == 4 and rows[3].startswith("| mlp | sh | aot_eager |")
    assert table(timings, header=False).splitlines() == rows[2:]
    with pytest.raises(KeyError, match="unknown configuration"):
        time_configs("mlp", ["no such config"])
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        time_configs("mlp", ["sh"], rounds=0)
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        time_configs("mlp", ["sh"], warmup=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA only"):
            time_configs("mlp", ["sh offload"])


@pytest.mark.slow
def test_step_time_times_plans_made_for_the_model_in_turn_with_the_rest(capsys):
    from benchmarks.run import _saved_bytes
    from benchmarks.step_time import built_configs, plan_configs, plan_label, time_configs

    for bad in ("0", "1.5", "-0.5", "nan", "half"):
        with pytest.raises(ValueError, match="fraction in"):
            plan_label(bad)
    assert [plan_label(x) for x in ("floor", "0.6", "1")] == ["floor", "0.6", "1"]
    assert plan_configs("mlp", []) == {}
    plans = plan_configs("mlp", ["0.8", "0.01", "floor"], size=0.25, backend="aot_eager")
    assert list(plans) == ["plan 0.8", "plan floor"]  # 0.01 is below the floor: said on stderr, the rest planned
    captured = capsys.readouterr()
    assert "mlp: plan 0.01: " in captured.err and "not timed" in captured.err and "plan 0.01" not in captured.out
    with built_configs("mlp", ["compiled", *plans], size=0.25, backend="aot_eager", warmup=1, extra=plans) as built:
        saved = {name: _saved_bytes(step, "cpu") for name, (step, _) in built.items()}
    # each built copy runs its plan: the floor keeps less than the plan at 0.8, which keeps less than no hooks
    assert saved["plan floor"] < saved["plan 0.8"] < saved["compiled"], saved
    timings = time_configs("mlp", ["plan floor"], size=0.25, backend="aot_eager", rounds=2, warmup=1, extra=plans)
    assert [(t.config, t.baseline) for t in timings] == [("compiled", "compiled"), ("plan floor", "compiled")]
    with pytest.raises(KeyError, match="unknown configuration"):
        time_configs("mlp", ["plan 0.5"], extra=plans)


@pytest.mark.slow
def test_step_time_keeps_each_configuration_s_own_compiled_code_side_by_side():
    # Under inductor all copies of a model class share dynamo's cache entries unless compiled apart:
    # the memory-budget copy (a functorch config patch, which dynamo does not guard on) then ran the
    # plain copy's code. Each forward here must leave its own configuration's saved bytes.
    from benchmarks.run import _saved_bytes
    from benchmarks.step_time import built_configs

    with built_configs("mlp", ["compiled", "sh", "budget 0.5"], size=0.5, backend="inductor", warmup=1) as built:
        saved = {name: _saved_bytes(step, "cpu") for name, (step, _) in built.items()}
        assert all(workload.isolated for _, workload in built.values())
    assert saved["sh"] < 0.5 * saved["compiled"], saved
    assert saved["budget 0.5"] < saved["compiled"], saved
    with pytest.raises(ValueError, match="more than once"), built_configs("mlp", ["sh", "sh"]):
        pass
    with pytest.raises(KeyError, match="unknown configuration"), built_configs("mlp", ["nope"]):
        pass


def test_step_time_command_line_refuses_what_cannot_run(capsys):
    from benchmarks.step_time import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--rounds", "0"])
    assert exit_info.value.code == 2 and "--rounds must be >= 1" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exit_info:
            main(["--configs", "sh offload"])
        assert exit_info.value.code == 2 and "CUDA only" in capsys.readouterr().err


@pytest.mark.slow
def test_long_run_compares_the_smoothed_loss_with_no_hooks_after_warm_up(tmp_path, capsys):
    pytest.importorskip("transformers")
    from benchmarks import long_run

    tokens = long_run.corpus()
    assert len(tokens) > 500_000 and int(tokens.max()) < 256 and torch.equal(tokens, long_run.corpus())
    assert long_run.smoothed([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    out = tmp_path / "long.md"
    rows = long_run.main(["--steps", "6", "--warmup", "2", "--window", "2", "--configs", "no hooks", "sh.policy()",
                          "--out", str(out), "--csv", str(tmp_path / "long.csv")])  # fmt: skip
    assert [r.config for r in rows] == ["no hooks", "sh.policy()"]
    plain, policy = rows
    assert plain.first_loss == pytest.approx(policy.first_loss, rel=1e-3)  # same weights, same first batch
    assert policy.losses[-1] < policy.first_loss  # it learns
    expected = [
        (100 * (m - b) / b, i)
        for i, (m, b) in enumerate(zip(long_run.smoothed(policy.losses, 2), long_run.smoothed(plain.losses, 2)))
        if i >= 2
    ]
    assert (policy.max_rel_diff_pct, policy.at_step) == max(expected, key=lambda d: abs(d[0]))
    assert "python -m benchmarks.long_run --steps 6" in out.read_text() and out.with_suffix(".png").exists()
    assert len((tmp_path / "long.csv").read_text().splitlines()) == 1 + 2 * 6
    with pytest.raises(SystemExit):
        long_run.main(["--configs", "sh.policy()"])


def test_results_file_names_its_command_and_gives_ratios_within_the_run(tmp_path):
    rows = [
        Row("m", "compiled", "inductor", "cpu", activation_mib=40.0, step_ratio=1.0, grad_sqnr_db=float("inf")),
        Row("m", "sh", "inductor", "cpu", activation_mib=10.0, step_ratio=1.25, grad_sqnr_db=30.04),
        Row("m", "checkpoint", "inductor", "cpu", error="boom"),
        Row("m", "sh", "aot_eager", "cpu", activation_mib=5.0),  # no compiled row of its backend: not in the headline
        Row("m", "no hooks", "eager", "cpu", activation_mib=50.0),  # not a headline configuration
    ]
    lines = headline(rows).splitlines()
    assert lines[2:] == ["| m | inductor | sh | 0.25 | 1.25 | 30.0 |", "| m | inductor | checkpoint |  |  | ✗ boom |"]
    path = write_markdown(rows, tmp_path / "r" / "results.md", "python -m benchmarks --x", "torch 9, cpu",
                          {"m": "a model"}, {"sh": "fp8", "checkpoint": "per block", "unused": "never ran"})  # fmt: skip
    text = path.read_text()
    assert "`python -m benchmarks --x`; torch 9, cpu." in text
    assert "- sh: fp8" in text and "- m: a model" in text and "unused" not in text
    assert table(rows) in text and headline(rows) in text


def test_plan_time_page_summarizes_ratios_and_leaves_missing_values_blank():
    from benchmarks.plan_time import PlanTimeRow, document

    rows = [
        PlanTimeRow("a", first_s=10.0, base_mib=100.0, policy_mib=60.0, budget_mib=70.0, plan_s=30.0, compiles=3,
                    steps=4, modelled_base_mib=103.0, floor_mib=55.0, plan_mib=70.0),
        PlanTimeRow("b", first_s=10.0, base_mib=100.0, policy_mib=60.0, budget_mib=70.0, plan_s=70.0, compiles=6,
                    steps=7, modelled_base_mib=120.0, floor_mib=65.0, plan_mib=80.0),
        PlanTimeRow("c", first_s=10.0, base_mib=100.0, policy_mib=60.0, budget_mib=70.0, plan_s=50.0,
                    modelled_base_mib=100.0, floor_mib=75.0, error="infeasible"),
    ]
    page = document(rows, "header")
    assert "3 models. Planning time over the first compiled step: median 5.00x, largest 7.00x." in page
    assert "within 5 % of the measured on 2 of 3; floor at or below the policy's measured peak on 1 of 3" in page
    assert "plan within 1.05 of its budget on 1 of 2." in page
    assert "| a | 10.0 | 30.0 | 3.00 | 3 | 4 | 100.00 | 1.030 | 60.00 | 0.917 | 70.00 | 1.000 |  |" in page
    assert "| c | 10.0 | 50.0 | 5.00 |  |  | 100.00 | 1.000 | 60.00 | 1.250 | 70.00 |  | infeasible |" in page
