"""sh.plan's check: a plan modelled on the graphs compiled with its own hooks, and the search run again below the budget."""

import dataclasses
import sys

import pytest
import torch
import torch.utils._pytree as pytree
from models import measured_step_peak, planner_mlp, square_mean_loss
from torch._subclasses.fake_tensor import FakeTensorMode

import savedhooks as sh
from savedhooks.fidelity.select import SavedTensor
from savedhooks.planner.check import check_peak, choices_of, tighten
from savedhooks.planner.recompute import FULL, SELECTIVE
from savedhooks.planner.result import CODECS
from savedhooks.planner.search import Option, Unit
from savedhooks.planner.survey import Survey

plan_module = sys.modules["savedhooks.planner.driver"]


def _survey(top=100, **fields):
    """Two units on a four-point timeline: the search's choices step coarsely (peaks 100, 70, 55: the floor
    is ``top - 45``, with ``b`` kept; packing ``b`` too lowers only the first point)."""
    a = Unit("a", 60, ((1, 3, 60),), (Option("keep", 60, 0.0), Option("bf16", 30, 1.0), Option("fp8", 15, 3.0)))
    b = Unit("b", 40, ((1, 2, 40),), (Option("keep", 40, 0.0), Option("fp8", 10, 0.5)))
    saved = {u.key: (SavedTensor(f"g0:{u.key}", "mm", (4, 4), torch.float32, u.bytes),) for u in (a, b)}
    return Survey((a, b), saved, (0, top, top, 10), "aot_eager", **fields)


def _choices(plan):
    return tuple(t.choice for t in sorted(plan.tensors, key=lambda t: t.key))


def test_tighten_searches_again_below_the_budget_by_the_excess():
    found = _survey()
    checked, log = tighten(found, 75, lambda p: p.predicted_peak_bytes + 10)
    # 75: a in bf16 (modelled 70, checked 80: 5 over); 70 gives the same choice, so the target drops by the
    # excess again, to 65: a in fp8 (modelled 55, checked 65) meets the budget
    assert [(_choices(p), peak) for p, peak in checked] == [(("bf16", "keep"), 80), (("fp8", "keep"), 65)]
    assert [line.split(":")[0] for line in log] == ["check 1", "check 2"]


def test_tighten_checks_no_plan_below_the_fidelity_limit():
    found = _survey()

    def faithful(plan):  # a in fp8 is too harmful
        return dict(zip("ab", _choices(plan)))["a"] != "fp8"

    checked, log = tighten(found, 75, lambda p: p.predicted_peak_bytes + 10, faithful)
    # as above, the second round searches for 65 MiB and gets a in fp8: not checked, and nothing packed more either
    assert [(_choices(p), peak) for p, peak in checked] == [(("bf16", "keep"), 80)]
    assert log[1].endswith("below the fidelity limit, not checked")
    assert log[2] == "every candidate at its smallest payload: below the fidelity limit, not checked"


def test_tighten_checks_every_candidate_packed_when_no_search_meets_the_budget():
    found = _survey()

    def check(plan):  # only the plan with everything packed meets the budget
        return 50 if _choices(plan) == ("fp8", "fp8") else plan.predicted_peak_bytes + 30

    checked, log = tighten(found, 80, check)
    assert [peak for _, peak in checked][-1] == 50 and _choices(checked[-1][0]) == ("fp8", "fp8")
    assert all(peak > 80 for _, peak in checked[:-1]) and len(checked) <= 4
    assert log[-1].startswith("check: every candidate at its smallest payload")
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        tighten(found, 80, check, rounds=0)


def _counting(monkeypatch, losses=None):
    calls = []
    original = plan_module.check_peak

    def counted(*args, **kwargs):
        calls.append(args[2])
        if losses is not None:
            losses.append(args[5])  # loss_bytes: the survey's, not measured again
        return original(*args, **kwargs)

    monkeypatch.setattr(plan_module, "check_peak", counted)
    return calls


@pytest.mark.slow
def test_a_checked_plan_at_the_floor_predicts_the_measured_peak_under_inductor(monkeypatch):
    """At the modelled floor under inductor the hooks change the compiled graphs; the plan's check models
    the graphs compiled with them, and the floor plan measures within 1 % of that model (the graphs are
    modelled in inductor's calls, census._per_call). A floor below every plan's check is tested on faked
    surveys: ``test_a_budget_below_the_modelled_floor_is_met_by_a_checked_smallest_payload_plan``.

    The eager loss's saved tensor (the model's output, which ``pow`` saves) is no candidate: it is held as it
    is until its saver is known, and the backward reads it first.
    """
    losses = []
    calls = _counting(monkeypatch, losses)
    model, x = planner_mlp()
    planner = sh.planner.Planner(model, (x,), loss_fn=square_mean_loss, backend="inductor", blocks=())
    assert not [u for u in planner.survey(0).units if u.key.startswith("eager|")]
    plan = planner.plan(planner.floor_bytes)
    assert plan.predicted_peak_bytes <= plan.budget_bytes and any(
        line.startswith("recompute 0 blocks: check") for line in plan.log
    )
    measured, _ = measured_step_peak(model, x, plan.hooks, backend="inductor")
    assert abs(measured - plan.predicted_peak_bytes) <= 0.01 * measured  # the check models the graphs the step runs
    # planning the same budget again compiles nothing more: checked plans are kept per choice
    before = len(calls)
    assert planner.plan(planner.floor_bytes) == plan
    assert len(calls) == before and len({choices_of(p) for p in calls}) == len(calls)
    assert losses and set(losses) == {planner.survey(0).loss_bytes} and losses[0] > 0


def test_a_plan_that_packs_nothing_or_check_false_compiles_nothing_more(monkeypatch):
    calls = _counting(monkeypatch)
    model, x = planner_mlp()
    planner = sh.planner.Planner(model, (x,), loss_fn=square_mean_loss, backend="aot_eager", blocks=())
    assert all(t.choice == "keep" for t in planner.plan(planner.baseline_bytes).tensors)
    unchecked = planner.plan((planner.baseline_bytes + planner.floor_bytes) // 2, check=False)
    assert {t.choice for t in unchecked.tensors} - {"keep"} and not calls
    assert not any(": check" in line for line in unchecked.log) and unchecked.log[-2].startswith("not checked")
    # under aot_eager the hooks leave the graphs as modelled: the check agrees with the survey
    checked = planner.plan(unchecked.budget_bytes)
    assert len(calls) == 1 and checked.predicted_peak_bytes == unchecked.predicted_peak_bytes


def test_check_is_on_by_default_and_its_argument_checked():
    """Several processes check too, in lockstep (tests/integrations/test_distributed.py runs them)."""
    import savedhooks.planner.check as check_module

    assert check_module.resolve_check(None) and check_module.resolve_check(True)
    assert not check_module.resolve_check(False)
    with pytest.raises(TypeError, match="check must be True, False or None"):
        check_module.resolve_check("yes")


def test_a_buffer_read_only_inside_its_own_fused_kernel_is_not_stored():
    """Inductor removes a buffer whose every reader is in the kernel that writes it (llama's SwiGLU backward:
    the sigmoid fused with its readers); counted as stored, it would put the check of llama's plans above
    their measured peak."""
    from types import SimpleNamespace

    from savedhooks.planner.recording import _stored

    def user(name, weak=False):
        return SimpleNamespace(get_name=lambda: name, is_weak=weak)

    def buffer(name, users, mutations=()):
        return SimpleNamespace(name=name, users=users, get_mutations=lambda: list(mutations))

    local = buffer("buf1", [user("op2")])  # read only by op2, fused with op1
    escapes = buffer("buf2", [user("op2"), user("op3")])  # also read by op3, another kernel
    weak = buffer("buf3", [user("op2"), user("op9", weak=True)])
    mutated = buffer("buf4", [user("op2")], mutations=["buf0"])
    output = buffer("buf5", [user("OUTPUT")])
    subs = [SimpleNamespace(get_name=lambda: "op1", get_outputs=lambda: [local, escapes, weak, mutated]),
            SimpleNamespace(get_name=lambda: "op2", get_outputs=lambda: [output])]
    fused = SimpleNamespace(get_nodes=lambda: subs)
    assert [b.name for b in _stored(fused)] == ["buf2", "buf4", "buf5"]


def _faked_planner(monkeypatch, peaks):
    """A planner over three hand-made surveys (codecs alone, one block selectively, one block whole), its
    check replaced by ``peaks``: (recompute mode or "codecs", choices) -> checked peak, else modelled + 10."""
    calls = []

    def check(model, inputs, plan, *rest):
        calls.append(plan)
        setting = plan.recompute_mode if plan.recompute else "codecs"
        return peaks.get((setting, _choices(plan)), plan.predicted_peak_bytes + 10)

    monkeypatch.setattr(plan_module, "check_peak", check)
    model, x = planner_mlp()
    planner = sh.planner.Planner(model, (x,), loss_fn=square_mean_loss, backend="aot_eager", blocks=())
    planner.blocks = ("x",)
    planner.strategies = ((0, FULL), (1, SELECTIVE), (1, FULL))
    planner._surveys = {
        (0, FULL): _survey(),  # modelled floor 55
        (1, SELECTIVE): _survey(103, recompute=("x",), recompute_seconds=0.01, recompute_mode=SELECTIVE),  # 58
        (1, FULL): _survey(130, recompute=("x",), recompute_seconds=0.02),  # 85: not within 10 % of 55
    }
    return planner, calls


def test_a_budget_below_the_modelled_floor_is_met_by_a_checked_smallest_payload_plan(monkeypatch):
    """With every candidate packed, the graphs compiled with the hooks can peak below the modelled floor
    (llama at size 1 under inductor with fp8 everywhere, for one)."""
    packed = ("fp8", "fp8")
    planner, calls = _faked_planner(monkeypatch, {("codecs", packed): 52, ("selective", packed): 45})
    assert planner.floor_bytes == 55
    # below every checked peak: the error names the lowest, and the setting outside the margin is not checked
    with pytest.raises(sh.InfeasibleBudgetError, match="checked on steps compiled with a plan.s hooks") as info:
        planner.plan(40)
    assert info.value.checked and info.value.floor_bytes == 45
    assert sorted(p.recompute_mode if p.recompute else "codecs" for p in calls) == ["codecs", "selective"]
    # both meet 53: the least modelled time wins (codecs alone; the other recomputes too), at its checked peak
    cheaper = planner.plan(53)
    assert (cheaper.recompute, _choices(cheaper), cheaper.predicted_peak_bytes) == ((), packed, 52)
    assert cheaper.budget_bytes == 53 and cheaper.floor_bytes == 55 and cheaper.log[-1].startswith(
        "kept: recompute 0 blocks, the least modelled time among the checked plans that meet it"
    )
    lowest = planner.plan(info.value.floor_bytes)
    assert (lowest.recompute, lowest.recompute_mode, lowest.predicted_peak_bytes) == (("x",), SELECTIVE, 45)
    assert len(calls) == 2  # checked plans are kept per choice
    # at or above the modelled floor nothing changes: the search's plan, checked (bf16 checks at 80, fp8 at 65)
    above = planner.plan(70)
    assert (_choices(above), above.predicted_peak_bytes) == (("fp8", "keep"), 65)
    # check=False keeps the modelled floor
    with pytest.raises(sh.InfeasibleBudgetError) as unchecked:
        planner.plan(53, check=False)
    assert not unchecked.value.checked and unchecked.value.floor_bytes == 55


def test_below_the_modelled_floor_the_error_names_the_lowest_checked_peak_even_above_it(monkeypatch):
    # it named the modelled floor (55), and a plan for 55 then failed its check too: the advice did not hold
    planner, _ = _faked_planner(monkeypatch, {})  # every check: modelled + 10 (65 codecs, 68 selective)
    with pytest.raises(sh.InfeasibleBudgetError, match="budget_bytes >= 65") as info:
        planner.plan(54)
    assert info.value.checked and info.value.floor_bytes == 65
    followed = planner.plan(info.value.floor_bytes)
    assert (followed.recompute, followed.predicted_peak_bytes) == ((), 65)


def test_below_the_modelled_floor_the_error_names_the_floor_where_the_search_s_plan_there_checks_within_it(
    monkeypatch,
):
    # the smallest-payload plans check above the floor (65, 68), the search's plan for 55 checks at 54
    planner, _ = _faked_planner(monkeypatch, {("codecs", ("fp8", "keep")): 54})
    with pytest.raises(sh.InfeasibleBudgetError, match="budget_bytes >= 54") as info:
        planner.plan(50)
    assert info.value.checked and info.value.floor_bytes == 54
    followed = planner.plan(info.value.floor_bytes)
    assert (_choices(followed), followed.predicted_peak_bytes) == (("fp8", "keep"), 54)


def test_a_check_that_fails_warns_and_keeps_the_survey_s_plan(monkeypatch):
    planner, _ = _faked_planner(monkeypatch, {})

    def fails(*args):
        raise ValueError("the memory model cannot read this graph")

    monkeypatch.setattr(plan_module, "check_peak", fails)
    with pytest.warns(UserWarning, match="recompute 0 blocks: not checked: ValueError: the memory model cannot"):
        planned = planner.plan(70)
    unchecked = planner.plan(70, check=False)  # the same plan, bf16 modelled at 70
    assert dataclasses.replace(planned, log=()) == dataclasses.replace(unchecked, log=())
    assert planned.log[-1] == "kept: recompute 0 blocks, its check failed: the survey's model alone"
    # below the modelled floor a failing check leaves the modelled floor
    with pytest.warns(UserWarning, match="not checked"), pytest.raises(sh.InfeasibleBudgetError) as info:
        planner.plan(50)
    assert not info.value.checked and info.value.floor_bytes == 55


def test_just_above_the_modelled_floor_a_plan_that_meets_a_lower_budget_still_meets_it(monkeypatch):
    """A larger budget must not fail where a smaller one succeeded."""
    packed = ("fp8", "fp8")
    planner, _ = _faked_planner(monkeypatch, {("codecs", packed): 60, ("selective", packed): 45})
    below = planner.plan(54)  # below the modelled floor (55): the selective plan with everything packed
    assert (below.recompute_mode, below.predicted_peak_bytes) == (SELECTIVE, 45)
    # at the floor: the codecs' plans check at 65 and 60, above it; the checked 45 still meets it
    at = planner.plan(55)
    assert (at.recompute, at.recompute_mode, at.predicted_peak_bytes) == (("x",), SELECTIVE, 45)
    assert any(line.startswith("recompute 0 blocks: check") for line in at.log)


def test_a_check_that_fails_after_a_checked_round_goes_on_to_the_next_setting(monkeypatch):
    planner, calls = _faked_planner(monkeypatch, {})
    faked = plan_module.check_peak

    def second_codecs_check_fails(model, inputs, plan, *rest):
        if not plan.recompute and len(calls) == 1:
            raise ValueError("unreadable")
        return faked(model, inputs, plan, *rest)

    monkeypatch.setattr(plan_module, "check_peak", second_codecs_check_fails)
    with pytest.warns(UserWarning, match="recompute 0 blocks: not checked: ValueError: unreadable"):
        planned = planner.plan(70)
    # codecs alone: bf16 checked at 80 (over), then the fp8 check raised; the selective setting's fp8 plan
    # (modelled 58) checks at 68 and meets the budget
    assert (planned.recompute_mode, planned.predicted_peak_bytes) == (SELECTIVE, 68)
    assert planned.log[-1] == "kept: recompute 1 blocks selectively, " + plan_module._CHECKED


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="gloo")
def test_a_lockstep_check_sorts_what_a_check_raises(tmp_path):
    """One process of a gloo group: the gather's verdict (two ranks: tests/integrations/test_distributed.py)."""
    import torch.distributed as dist

    from savedhooks.planner.lockstep import CheckFailed, ChecksAborted, checked_together

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert checked_together((0, FULL), "{}", lambda: 123) == 123

        def raises(error):
            def check():
                raise error

            return check

        with pytest.raises(CheckFailed, match="unreadable"):
            checked_together((0, FULL), "{}", raises(ValueError("unreadable")))
        with pytest.raises(CheckFailed):
            checked_together((0, FULL), "{}", raises(sh.planner.NotCompiledError("eager")))
        with pytest.raises(ChecksAborted, match="out of memory") as info:
            checked_together((0, FULL), "{}", raises(MemoryError("out of memory")))
        assert isinstance(info.value.__cause__, MemoryError)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_under_inductor_the_check_measures_a_step_and_the_measurement_is_the_plans_peak(monkeypatch):
    model, x = planner_mlp()
    planner = sh.planner.Planner(model, (x,), loss_fn=square_mean_loss, backend="inductor", blocks=())
    budget = (planner.baseline_bytes + planner.floor_bytes) // 2
    plan = planner.plan(budget)
    readings = {}
    peak = check_peak(model, (x,), plan, square_mean_loss, readings=readings)
    assert peak == readings["measured"] == plan.predicted_peak_bytes == plan.measured_peak_bytes
    assert abs(readings["measured"] - readings["modelled"]) <= 0.02 * readings["modelled"]  # this MLP: modelled right
    assert f"checked: measured peak {plan.measured_peak_bytes / 2**20:.2f} MiB" in plan.report()
    # the step as a training loop runs it measures what the planner measured
    compiled = torch.compile(model)
    step = lambda: square_mean_loss(compiled(x)).backward()  # noqa: E731
    plan.apply(model)
    try:
        with sh.saved_tensors_hooks(plan.hooks):
            step()
            model.zero_grad(set_to_none=True)
            assert sh.memory.measure_peak(step, device="cpu") == plan.predicted_peak_bytes
    finally:
        plan.revert(model)
        model.zero_grad(set_to_none=True)
        torch._dynamo.reset()
    # a step that measures above the model: the measurement is the plan's peak, and the log says how far off
    import savedhooks.planner.step as step_module

    monkeypatch.setattr(step_module, "measure_peak", lambda fn, device=None: (fn(), 2 * budget)[1])
    again = sh.planner.Planner(model, (x,), loss_fn=square_mean_loss, backend="inductor", blocks=())
    with pytest.raises(sh.InfeasibleBudgetError) as info:
        again.plan(budget)
    assert info.value.checked
    checked = [p for p, _ in again._checked.values()]
    assert checked and all(p.measured_peak_bytes == 2 * budget for p in checked)
    assert all(any(line.startswith("checked: modelled") and "the measurement is the plan's peak" in line
                   for line in p.log) for p in checked)  # fmt: skip


@pytest.mark.slow
def test_a_plan_that_packs_nothing_is_measured_under_inductor_and_modelled_under_aot_eager():
    model, x = planner_mlp()
    for backend, measured in (("inductor", True), ("aot_eager", False)):
        planner = sh.planner.Planner(model, (x,), loss_fn=square_mean_loss, backend=backend, blocks=())
        plan = planner.plan(2 * planner.baseline_bytes)
        assert {t.choice for t in plan.tensors} == {"keep"}
        assert (plan.measured_peak_bytes is not None) is measured
        if measured:
            assert plan.predicted_peak_bytes == plan.measured_peak_bytes
