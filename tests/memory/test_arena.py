"""Arena plans: valid for every strategy, never below the liveness peak, exact on hand-made cases."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import GraphRecorder, mlp, train_step_grads

import savedhooks as sh
from benchmarks.tools.schedule_gap import random_problem
from savedhooks.compiler.passes import graph_problem
from savedhooks.memory import (
    ARENA_STRATEGIES,
    ArenaPlan,
    Lifetime,
    build_graph_memory,
    liveness_peak,
    plan_arena,
    plan_lifetimes,
    simulate_order,
    validate_arena,
)
from savedhooks.schedule import STRATEGIES, arena_of, peak_of, schedule

CPU = torch.device("cpu")
EVERY = [*ARENA_STRATEGIES, "best"]


def _lifetimes(draw_specs) -> list[Lifetime]:
    return [Lifetime(f"b{i}", size, start, start + length) for i, (size, start, length) in enumerate(draw_specs)]


_specs = st.lists(st.tuples(st.integers(0, 4096), st.integers(0, 40), st.integers(0, 15)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(_specs, st.sampled_from([1, 8, 512]))
def test_every_strategy_plans_a_valid_arena_at_least_the_liveness_peak(specs, alignment):
    lifetimes = _lifetimes(specs)
    plans = {name: plan_lifetimes(lifetimes, name, alignment) for name in EVERY}
    for plan in plans.values():
        validate_arena(plan)
        assert plan.liveness_peak == liveness_peak(lifetimes)
        assert plan.arena_bytes >= liveness_peak(lifetimes, alignment) >= plan.liveness_peak
    assert plans["best"].arena_bytes == min(plans[name].arena_bytes for name in ARENA_STRATEGIES)
    assert plans["best"].scores == {name: plans[name].arena_bytes for name in ARENA_STRATEGIES}


@settings(max_examples=60, deadline=None)
@given(_specs, st.integers(1, 1000))
def test_linear_scan_reaches_the_liveness_peak_on_buffers_of_one_size(specs, size):
    lifetimes = [dataclasses.replace(t, nbytes=size) for t in _lifetimes(specs)]
    plan = plan_lifetimes(lifetimes, "linear_scan")
    validate_arena(plan)
    assert plan.arena_bytes == plan.liveness_peak == size * _most_alive_together(lifetimes)


def _most_alive_together(lifetimes) -> int:
    return max((sum(t.start <= p <= t.end for t in lifetimes) for p in range(60)), default=0)


def test_greedy_by_size_beats_linear_scan_on_a_hand_made_case():
    # A (2 B) and B (1 B) are born together; A dies at 1, then C (3 B) is born at 2 while B still lives.
    # Liveness: 3, 3, 4 (B + C), 3 -> peak 4.
    lifetimes = [Lifetime("A", 2, 0, 1), Lifetime("B", 1, 0, 2), Lifetime("C", 3, 2, 3)]
    # Linear scan: A at 0, B at 2 (top 3); A's 2 B hole cannot take C, so C goes on top: [3, 6).
    scan = plan_lifetimes(lifetimes, "linear_scan")
    assert (scan.offsets, scan.arena_bytes, scan.liveness_peak) == ((0, 2, 3), 6, 4)
    # Greedy by size: C at 0; A (not alive with C) at 0; B, alive with both, above them: [3, 4).
    size = plan_lifetimes(lifetimes, "greedy_by_size")
    assert (size.offsets, size.arena_bytes) == ((0, 3, 0), 4)
    # Greedy by breadth: the widest position is 2 (4 B): C then B there, then A into the 3 B gap under B.
    breadth = plan_lifetimes(lifetimes, "greedy_by_breadth")
    assert (breadth.offsets, breadth.arena_bytes) == ((0, 3, 0), 4)
    # Iterated greedy, round one (longest first): B at 0, C above B at 1, A (not alive with C) above B at 1;
    # round two puts C (at the top) first and finds 4 again, so round one's plan stays.
    iterated = plan_lifetimes(lifetimes, "iterated_greedy")
    assert (iterated.offsets, iterated.arena_bytes) == ((1, 0, 1), 4)
    best = plan_lifetimes(lifetimes, "best")
    scores = {"greedy_by_size": 4, "greedy_by_breadth": 4, "linear_scan": 6, "iterated_greedy": 4}
    assert (best.strategy, best.arena_bytes, best.scores) == ("greedy_by_size", 4, scores)
    for plan in (scan, size, breadth, iterated, best):
        validate_arena(plan)
    # Linear scan gives a block at the top back to the top: D's 4 B are reused by the larger E.
    scan = plan_lifetimes([Lifetime("D", 4, 0, 0), Lifetime("E", 8, 1, 1)], "linear_scan")
    assert (scan.offsets, scan.arena_bytes) == ((0, 0), 8)


def test_alignment_rounds_sizes_and_offsets_as_the_cuda_allocator():
    lifetimes = [Lifetime("small", 100, 0, 1), Lifetime("large", 600, 1, 2), Lifetime("view", 0, 0, 2)]
    plan = plan_lifetimes(lifetimes, "greedy_by_size", alignment=sh.memory.CUDA_ALIGNMENT)
    # 600 -> 1024 first at 0; 100 -> 512, alive with it at position 1, above it.
    assert (plan.offsets, plan.arena_bytes, plan.liveness_peak) == ((1024, 0, 0), 1536, 700)
    assert liveness_peak(lifetimes, 512) == 1536
    validate_arena(plan)
    assert plan_lifetimes(lifetimes, "greedy_by_size").arena_bytes == 700
    with pytest.raises(ValueError, match="not a multiple of 512"):
        validate_arena(dataclasses.replace(plan, offsets=(1000, 0, 0)))


def test_the_validator_names_two_overlapping_buffers_alive_together():
    lifetimes = [Lifetime("x", 64, 0, 2), Lifetime("y", 32, 2, 3), Lifetime("z", 64, 3, 4)]
    good = ArenaPlan(tuple(lifetimes), (0, 64, 0), 96, 96, "by hand", 1)
    validate_arena(good)  # x and z share bytes but never live together
    with pytest.raises(ValueError, match=r"'x' \(bytes \[0, 64\), positions 0\.\.2\) and 'y' \(bytes \[32, 64\)"):
        validate_arena(dataclasses.replace(good, offsets=(0, 32, 0)))
    with pytest.raises(ValueError, match="'y'.*and 'z'"):
        validate_arena(dataclasses.replace(good, offsets=(0, 64, 70), arena_bytes=134))
    with pytest.raises(ValueError, match="'y' .*and 'x' "):  # the later-born buffer lies below the other
        validate_arena(dataclasses.replace(good, offsets=(16, 0, 80), arena_bytes=144))
    with pytest.raises(ValueError, match="past the arena"):
        validate_arena(dataclasses.replace(good, arena_bytes=95))
    with pytest.raises(ValueError, match="3 offsets for 2 buffers"):
        validate_arena(dataclasses.replace(good, lifetimes=good.lifetimes[:2]))


@pytest.fixture(scope="module")
def mlp_fp8_graphs():
    """The aot_eager forward and backward graphs of a small MLP under sh.fp8() (its ops have scratch)."""
    torch._dynamo.reset()
    model = mlp()
    recorder = GraphRecorder(keep_inputs=False)
    train_step_grads(model, torch.compile(model, backend=recorder.backend), torch.randn(64, 8), sh.fp8())
    torch._dynamo.reset()
    (forward, _), (backward, _) = recorder.graphs
    return forward, backward


def test_traced_graphs_plan_validly_and_agree_with_the_memory_model(mlp_fp8_graphs):
    forward, backward = mlp_fp8_graphs
    memory = build_graph_memory(forward)
    assert any(memory.scratch_on(v, CPU) for v in range(len(memory.node_names)))  # scratch is planned too
    inputs = sum(b.nbytes for b in memory.buffers if b.is_input)
    for name in EVERY:
        plan = plan_arena(forward, strategy=name)
        validate_arena(plan)
        # inputs are the caller's, not in the arena: the liveness peak is the model's peak without them
        assert plan.liveness_peak + inputs == simulate_order(memory, list(range(len(memory.node_names))), CPU)
        assert plan.arena_bytes >= plan.liveness_peak
        assert not any(t.buffer is not None and memory.buffers[t.buffer].is_input for t in plan.lifetimes)
    donated = sh.memory.saved_activations(backward)
    problem, bound = graph_problem(backward, donated)
    chosen = schedule(problem, bound)
    other = next(o for o in (s(problem) for s in STRATEGIES.values()) if o != list(range(problem.size)))
    for order in (None, chosen.order, other):
        plan = plan_arena(backward, order, "best", donated=donated, alignment=512)
        validate_arena(plan)
        assert plan.arena_bytes >= plan.liveness_peak > 0
    # the scheduler's arena score is the same plan on the same buffers
    for order in (chosen.order, other):
        best = plan_arena(build_graph_memory(backward, donated), order, "best")
        assert arena_of(problem, order) == best.arena_bytes


def test_bad_input_is_refused_with_a_clear_error(mlp_fp8_graphs):
    memory = build_graph_memory(mlp_fp8_graphs[0])
    n = len(memory.node_names)
    with pytest.raises(ValueError, match="unknown arena strategy 'first_fit'"):
        plan_arena(memory, strategy="first_fit")
    for alignment in (0, 3, 384):
        with pytest.raises(ValueError, match="power of two"):
            plan_arena(memory, alignment=alignment)
    with pytest.raises(ValueError, match="permutation"):
        plan_arena(memory, order=[0, 0, *range(2, n)])
    with pytest.raises(ValueError, match="not topological"):
        plan_arena(memory, order=list(range(n))[::-1])
    with pytest.raises(TypeError, match="GraphMemory or a GraphModule"):
        plan_arena(sh.memory.estimate_peak(mlp_fp8_graphs[0]))
    with pytest.raises(ValueError, match="malformed"):
        plan_lifetimes([Lifetime("bad", 8, 3, 2)])


def test_scoring_orders_by_arena_never_picks_a_larger_arena_and_changes_some_choices():
    changed = 0
    for seed in range(8):
        problem = random_problem(60, seed)
        by_peak = schedule(problem, exact_budget=2_000)
        by_arena = schedule(problem, exact_budget=2_000, score="arena")
        assert by_peak.score == "peak" and by_peak.arena is None  # the default is unchanged
        assert by_arena.arena == arena_of(problem, by_arena.order) <= arena_of(problem, by_peak.order)
        assert by_arena.arena <= arena_of(problem, list(range(problem.size)))  # never worse than the input order
        assert by_arena.peak == peak_of(problem, by_arena.order)
        changed += by_arena.order != by_peak.order
        if by_arena.order != by_peak.order:  # changed only for a strictly smaller arena
            assert by_arena.arena < by_arena.arena_scores["peak choice"]
    assert changed
    with pytest.raises(ValueError, match="unknown score"):
        schedule(random_problem(10, 0), score="bytes")
