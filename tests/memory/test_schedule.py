"""Ordering for peak memory: valid orders, unchanged results, never worse, exact = brute force."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import savedhooks as sh
from benchmarks.tools.schedule_gap import random_problem
from savedhooks.compiler.passes import ordering_edges, reorder_graph
from savedhooks.memory import build_graph_memory, simulate_order
from savedhooks.schedule import (
    STRATEGIES,
    Problem,
    beam,
    check_order,
    exact_search,
    hoist_frees,
    live_profile,
    peak_of,
    place,
    schedule,
    sink_free,
    stretch_profile,
)

CPU = torch.device("cpu")


# --- brute force ---------------------------------------------------------------------------------


def _live(problem: Problem, mask: int) -> int:
    """Live bytes after the nodes in ``mask`` ran, from scratch (no incremental state)."""
    live = problem.base + sum(problem.alloc[v] for v in range(problem.size) if mask >> v & 1)
    for b, nodes in enumerate(problem.touchers):
        if problem.freeable[b] and nodes and all(mask >> v & 1 for v in nodes):
            live -= problem.sizes[b]
    return live


def _optimum(problem: Problem) -> int:
    """The lowest peak over all topological orders: exhaustive DP over the sets of scheduled nodes."""
    n, full = problem.size, (1 << problem.size) - 1

    @functools.cache
    def rest(mask: int) -> int:
        if mask == full:
            return 0
        ready = [v for v in range(n) if not mask >> v & 1 and all(mask >> p & 1 for p in problem.preds[v])]
        return min(max(_live(problem, mask) + problem.peak_alloc[v], rest(mask | 1 << v)) for v in ready)

    peak, mask = problem.base, 0
    for v in problem.fixed:
        peak = max(peak, _live(problem, mask) + problem.peak_alloc[v])
        mask |= 1 << v
    return max(peak, rest(mask))


def _all_orders(problem: Problem):
    free = [v for v in range(problem.size) if v not in problem.fixed]
    for perm in itertools.permutations(free):
        order = list(problem.fixed) + list(perm)
        try:
            check_order(problem, order)
        except ValueError:
            continue
        yield order


@settings(max_examples=40, deadline=None)
@given(st.integers(3, 8), st.integers(0, 10_000))
def test_brute_force_dp_equals_every_order(nodes, seed):
    """The DP used as brute force below agrees with enumerating every permutation."""
    problem = random_problem(nodes, seed, window=3)
    assert _optimum(problem) == min(peak_of(problem, order) for order in _all_orders(problem))


@settings(max_examples=40, deadline=None)
@given(st.integers(3, 40), st.integers(0, 10_000), st.integers(2, 4))
def test_exact_search_matches_brute_force(nodes, seed, window):
    problem = random_problem(nodes, seed, window=window)
    best = schedule(problem, exact_budget=1_000_000)
    assert best.optimal
    assert best.peak == _optimum(problem) == peak_of(problem, best.order)
    assert best.lower_bound == best.peak and best.gap == 0.0


@pytest.mark.slow
def test_exact_search_out_of_budget_reports_a_valid_bound():
    problem = random_problem(150, seed=2)
    portfolio = schedule(problem, exact_budget=0)
    found = exact_search(problem, portfolio.peak, budget=10)
    assert not found.optimal and found.order is None
    full = exact_search(problem, portfolio.peak, budget=1_000_000)
    optimum = full.peak if full.optimal else None
    assert found.lower_bound <= (optimum if optimum is not None else portfolio.peak)
    assert found.lower_bound > 0


def _on_random_problems(test):
    """Run ``test(nodes, seed, window)`` on 40 random problems of up to 120 nodes (hypothesis)."""
    strategies = (st.integers(3, 120), st.integers(0, 10_000), st.integers(2, 8))
    return settings(max_examples=40, deadline=None)(given(*strategies)(test))


# --- the portfolio ---------------------------------------------------------------------------------


@_on_random_problems
def test_every_strategy_gives_a_valid_order_and_the_best_is_never_worse(nodes, seed, window):
    problem = random_problem(nodes, seed, window=window)
    chained = dataclasses.replace(problem, chains=frozenset(sorted(problem.early)[::2]))
    for strategy in STRATEGIES.values():
        order = strategy(problem)
        check_order(problem, order)
        check_order(problem, place(problem, order))
        check_order(problem, place(chained, order))  # pack chains skip one another as anchors
    result = schedule(problem, exact_budget=200)
    assert result.peak <= result.input_peak == peak_of(problem, list(range(problem.size)))
    assert result.peak == peak_of(problem, result.order) == min(result.scores.values())
    assert result == schedule(problem, exact_budget=200)  # deterministic


def test_place_moves_a_pack_after_the_last_use_and_an_unpack_before_the_first():
    # 0: input; 1 = f(0), 2 = g(1), 3 = pack(1) [output only], 4 = h(2)
    problem = Problem(
        preds=((), (0,), (1,), (1,), (2,)),
        fixed=(0,),
        alloc=(0, 100, 100, 10, 100),
        sizes=(8, 100, 100, 10, 100),
        touchers=((0, 1), (1, 2, 3), (2, 4), (3,), (4,)),
        freeable=(False, True, True, False, False),
        base=8,
        early=frozenset({3}),
        late=frozenset(),
    )
    assert peak_of(problem, [0, 1, 2, 4, 3]) == 8 + 100 + 100 + 100  # 1 lives on until its pack
    assert place(problem, [0, 1, 2, 4, 3]) == [0, 1, 2, 3, 4]
    assert peak_of(problem, [0, 1, 2, 3, 4]) == 8 + 100 + 10 + 100  # 1 died at its pack
    late = Problem(
        preds=((), (0,), (), (2,), (1, 3)),
        fixed=(0,),
        alloc=(0, 100, 50, 50, 10),
        sizes=(8, 100, 50, 50, 10),
        touchers=((0, 1), (1, 4), (2, 3), (3, 4), (4,)),
        freeable=(False, True, True, True, False),
        base=8,
        early=frozenset(),
        late=frozenset({1}),
    )
    assert place(late, [0, 1, 2, 3, 4]) == [0, 2, 3, 1, 4]


def test_place_moves_a_pack_chain_whose_links_read_the_tensor_side_by_side():
    # the decomposed fp8 pack: 1 = x (made, then read by 2 = its forward use; 7 = the next large op);
    # 3 = a bitcast view of x (the finite test) and 4 = abs(x) both read x's buffer, 5 = amax(3, 4),
    # 6 = codes(x, 5): every link reads x, and each was anchored to the others, so none moved and x
    # lived to the end of the forward
    problem = Problem(
        preds=((), (0,), (1,), (1,), (1,), (3, 4), (1, 5), (2,)),
        fixed=(0,),
        alloc=(0, 100, 100, 0, 100, 1, 25, 200),
        sizes=(8, 100, 100, 100, 1, 25, 200),
        touchers=((0, 1), (1, 2, 3, 4, 5, 6), (2, 7), (4, 5), (5, 6), (6,), (7,)),
        freeable=(False, True, True, True, True, False, False),
        base=8,
        early=frozenset({3, 4, 5, 6}),
        late=frozenset(),
        chains=frozenset({3, 4, 5, 6}),
    )
    given = [0, 1, 2, 7, 3, 4, 5, 6]
    placed = place(problem, given)
    assert placed == [0, 1, 2, 3, 4, 5, 6, 7]
    assert peak_of(problem, placed) < peak_of(problem, given)
    # not known to be a pack chain (a compiled loss's compute also leads only to outputs): left in place
    assert place(dataclasses.replace(problem, chains=frozenset()), given) == given


def test_place_puts_a_pack_chain_before_other_movers_after_the_same_anchor():
    # 1 = x; 2 = y = f(x), x's last reader; 3 = the next layer's op (stays); 4 = a compiled loss's compute
    # from y (early, not a chain); 5 = x's pack (a chain). 4 and 5 both go right after 2: the pack first
    # frees x before the loss's compute allocates; in their given order x would wait for it
    problem = Problem(
        preds=((), (0,), (1,), (0,), (2,), (1,)),
        fixed=(0,),
        alloc=(0, 100, 100, 30, 50, 25),
        sizes=(8, 100, 100, 30, 50, 25),
        touchers=((0, 1, 3), (1, 2, 5), (2, 4), (3,), (4,), (5,)),
        freeable=(False, True, True, False, False, False),
        base=8,
        early=frozenset({4, 5}),
        late=frozenset(),
        chains=frozenset({5}),
    )
    given = [0, 1, 2, 3, 4, 5]
    placed = place(problem, given)
    assert placed == [0, 1, 2, 5, 4, 3]
    assert peak_of(problem, placed) < peak_of(problem, [0, 1, 2, 4, 5, 3]) < peak_of(problem, given)
    # without chains known, the movers keep their given order
    assert place(dataclasses.replace(problem, chains=frozenset()), given) == [0, 1, 2, 4, 5, 3]


def test_a_dumped_problem_with_chains_loads_as_it_was(tmp_path):
    from benchmarks.tools.problem_dump import load_problems, save_problems

    problem = random_problem(30, 7, window=4)
    problem = dataclasses.replace(problem, chains=frozenset(sorted(problem.early)[::2]))
    save_problems([problem], tmp_path / "problems.json.gz")
    assert load_problems(tmp_path / "problems.json.gz") == [problem] and problem.chains


def _scheduled(nodes: int, seed: int, window: int) -> tuple[Problem, list[int]]:
    """A random problem and the portfolio's order for it (no exact search)."""
    problem = random_problem(nodes, seed, window=window)
    return problem, schedule(problem, exact_budget=0).order


@_on_random_problems
def test_sink_free_puts_what_allocates_nothing_right_before_its_first_successor(nodes, seed, window):
    problem, order = _scheduled(nodes, seed, window)
    sunk = sink_free(problem, order)
    check_order(problem, sunk)
    free = {v for v in order if problem.peak_alloc[v] == 0 and v not in problem.fixed}
    assert [v for v in sunk if v not in free] == [v for v in order if v not in free]
    position = {v: i for i, v in enumerate(sunk)}
    for v in free:
        after = [position[u] for u in problem.succs[v]]
        if after:  # right before the first successor, or before another free node that leads there
            between = sunk[position[v] + 1 : min(after)]
            assert all(u in free for u in between), (v, between)


def test_sink_free_moves_a_zero_byte_chain_from_the_start_to_its_consumer():
    # 0: input; 1 = view(0) and 2 = inlined(1) cost nothing; 3 = big(0); 4 = use(2, 3)
    problem = Problem(
        preds=((), (0,), (1,), (0,), (2, 3)),
        fixed=(0,),
        alloc=(0, 0, 0, 100, 10),
        sizes=(8, 100, 10),
        touchers=((0, 1, 2, 3, 4), (3, 4), (4,)),
        freeable=(False, True, False),
        base=8,
        early=frozenset(),
        late=frozenset({1, 2, 3}),
    )
    assert sink_free(problem, [0, 1, 2, 3, 4]) == [0, 3, 1, 2, 4]
    assert sink_free(problem, [0, 3, 1, 2, 4]) == [0, 3, 1, 2, 4]


def _gradient_kept_to_the_end() -> Problem:
    """The tied-weight case: 1 = a large gradient, read by 2 at once and by 5 = a small weight gradient,
    which also reads 4 (made from the input alone); 3 is the step's peak, elsewhere."""
    return Problem(
        preds=((), (0,), (1,), (2,), (0,), (1, 4), (3, 5)),
        fixed=(0,),
        alloc=(0, 320, 40, 500, 40, 20, 1),
        sizes=(8, 320, 40, 500, 40, 20, 1),
        touchers=((0, 1, 4), (1, 2, 5), (2, 3), (3, 6), (4, 5), (5, 6), (6,)),
        freeable=(False, True, True, True, True, True, False),
        base=8,
        early=frozenset(),
        late=frozenset({1, 4}),
    )


def test_hoist_frees_runs_a_small_reader_of_a_large_buffer_right_after_its_other_reader():
    problem = _gradient_kept_to_the_end()
    order = [0, 1, 2, 3, 4, 5, 6]  # 5 runs last: 1 (320) stays alive while 3 allocates 500
    hoisted = hoist_frees(problem, order)
    assert hoisted == [0, 1, 2, 4, 5, 3, 6]  # 5 and its ancestor 4 right after 2, the other reader of 1
    before, after = live_profile(problem, order), live_profile(problem, hoisted)
    assert max(after) < max(before) and sum(after) < sum(before)
    assert hoist_frees(problem, hoisted) == hoisted  # nothing left to move


def test_hoist_frees_moves_a_small_gain_unless_a_threshold_is_asked_for():
    # 1 is 10 bytes: running 5 early frees 1 and 4 (10 + 40) for its own 20, under 1/16 of the 578-byte peak.
    # The default moves it (a 1/16 threshold refuses moves gpt2-big needs at batch 8); min_gain=1/16 leaves it.
    problem = _gradient_kept_to_the_end()
    problem = dataclasses.replace(problem, alloc=(0, 10, *problem.alloc[2:]), sizes=(8, 10, *problem.sizes[2:]))
    order = [0, 1, 2, 3, 4, 5, 6]
    moved = hoist_frees(problem, order)
    assert moved == [0, 1, 4, 5, 2, 3, 6]
    assert sum(live_profile(problem, moved)) < sum(live_profile(problem, order))
    assert max(live_profile(problem, moved)) <= max(live_profile(problem, order))
    assert hoist_frees(problem, order, min_gain=1 / 16) == order


def test_hoist_frees_keeps_a_move_that_would_raise_the_peak_out():
    # 4 is huge and read to the end (by 6); 3 (500) dies at once. Running 5 early needs 4 early,
    # beside 1 and 2, and then 3 runs on top of it: 1468 against 1248 in the given order.
    problem = Problem(
        preds=((), (0,), (1,), (2,), (0,), (1, 4), (4, 5)),
        fixed=(0,),
        alloc=(0, 320, 40, 500, 900, 20, 1),
        sizes=(8, 320, 40, 500, 900, 20, 1),
        touchers=((0, 1, 4), (1, 2, 5), (2, 3), (3,), (4, 5, 6), (5, 6), (6,)),
        freeable=(False, True, True, True, True, True, False),
        base=8,
        early=frozenset(),
        late=frozenset({1, 4}),
    )
    order = [0, 1, 2, 3, 4, 5, 6]
    assert peak_of(problem, order) == 1248 and peak_of(problem, [0, 1, 2, 4, 5, 3, 6]) == 1468
    assert hoist_frees(problem, order) == order


@_on_random_problems
def test_hoist_frees_never_raises_the_peak_nor_the_area(nodes, seed, window):
    problem, order = _scheduled(nodes, seed, window)
    hoisted = hoist_frees(problem, order)
    check_order(problem, hoisted)
    before, after = live_profile(problem, order), live_profile(problem, hoisted)
    assert max(after) <= max(before) and sum(after) <= sum(before)
    assert max(after) == peak_of(problem, hoisted)
    assert (hoisted == order) == (sum(after) == sum(before))


def _random_topological_order(problem: Problem, nodes: list[int], rng: random.Random) -> list[int]:
    """``nodes`` in a random order that runs each after its predecessors among them."""
    pending, out = list(nodes), []
    while pending:
        ready = [u for u in pending if not any(p in pending for p in problem.preds[u])]
        out.append(pending.pop(pending.index(rng.choice(ready))))
    return out


@_on_random_problems
def test_hoist_frees_profile_of_a_reordered_stretch_equals_the_whole_profile(nodes, seed, window):
    # hoist_frees judges a move by the profile of the stretch it reorders, the rest kept from before
    problem, order = _scheduled(nodes, seed, window)
    rng = random.Random(seed)
    profile, position = live_profile(problem, order), {v: i for i, v in enumerate(order)}
    for _ in range(10):
        start = rng.randrange(len(problem.fixed), problem.size)
        stop = rng.randrange(start, problem.size) + 1
        segment = _random_topological_order(problem, order[start:stop], rng)
        live = profile[start] - problem.peak_alloc[order[start]]
        spliced = profile[:start] + stretch_profile(problem, segment, start, position, live) + profile[stop:]
        assert spliced == live_profile(problem, order[:start] + segment + order[stop:])


def _hoist_frees_by_whole_profiles(problem: Problem, order: list[int], min_gain: float) -> list[int]:
    """hoist_frees as first written: every candidate order's whole profile computed and checked."""
    profile = live_profile(problem, order)
    peak, area = max(profile), sum(profile)
    floor, descendants = len(problem.fixed) - 1, problem.descendants
    for v in list(order):
        position = {u: i for i, u in enumerate(order)}
        here = position[v]
        freed = [b for b in problem.touched[v]
                 if problem.freeable[b] and max(position[u] for u in problem.touchers[b]) == here]  # fmt: skip
        gain = sum(problem.sizes[b] for b in freed) - problem.alloc[v]
        if here <= floor or gain <= 0 or gain < peak * min_gain:
            continue
        largest = max(freed, key=problem.sizes.__getitem__)
        after = max([floor] + [position[u] for u in problem.touchers[largest] if u != v and not descendants[u] >> v & 1])
        movers = [u for u in order[after + 1 : here + 1] if u == v or descendants[u] >> v & 1]
        candidate = order[: after + 1] + movers + [u for u in order[after + 1 :] if u not in set(movers)]
        profile = live_profile(problem, candidate)  # checks that the candidate is topological
        if max(profile) <= peak and sum(profile) < area:
            order, peak, area = candidate, max(profile), sum(profile)
    return order


@_on_random_problems
def test_hoist_frees_moves_as_with_whole_profiles(nodes, seed, window):
    problem, scheduled = _scheduled(nodes, seed, window)
    rng = random.Random(seed)
    shuffled = list(problem.fixed) + _random_topological_order(problem, scheduled[len(problem.fixed) :], rng)
    for order in (scheduled, shuffled):
        for min_gain in (0.0, 1 / 16):
            assert hoist_frees(problem, order, min_gain) == _hoist_frees_by_whole_profiles(problem, order, min_gain)


def test_bad_input_raises():
    problem = random_problem(10, 0)
    with pytest.raises(ValueError, match="unknown strategies"):
        schedule(problem, strategies=("input", "magic"))
    with pytest.raises(ValueError, match="permutation"):
        peak_of(problem, [0, 1])
    with pytest.raises(ValueError, match="fixed nodes"):
        check_order(problem, list(range(1, 10)) + [0])
    with pytest.raises(ValueError, match="out of range"):
        Problem(preds=((5,),), fixed=(), alloc=(0,), sizes=(), touchers=(), freeable=(), base=0,
                early=frozenset(), late=frozenset())
    assert beam(problem, width=1) and len(beam(problem)) == 10


# --- FX graphs: views, in-place writes and RNG ---------------------------------------------------


def _random_program(draw_ints, n_ops: int) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """Random 1-D programs of cats, scalings, slices (views), in-place adds on them, and rand_like."""
    aten = torch.ops.aten
    graph = torch.fx.Graph()
    inputs = [torch.randn(draw_ints(1, 16)) for _ in range(2)]
    values = [(graph.placeholder(f"x{i}"), False) for i in range(len(inputs))]  # (node, owns a fresh buffer)
    for _ in range(n_ops):
        op = draw_ints(0, 4)
        pick = values[draw_ints(0, len(values) - 1)]
        if op == 0:
            chosen = sorted({draw_ints(0, len(values) - 1) for _ in range(draw_ints(1, 3))})
            node = graph.call_function(aten.cat.default, ([values[i][0] for i in chosen],)), True
        elif op == 1:
            node = graph.call_function(aten.mul.Tensor, (pick[0], 1.5)), True
        elif op == 2:
            node = graph.call_function(aten.slice.Tensor, (pick[0], 0, 0, draw_ints(1, 8))), pick[1]
        elif op == 3 and pick[1]:  # write in place, through a view or not, never into an input
            node = graph.call_function(aten.add_.Scalar, (pick[0], 1.0)), True
        else:
            node = graph.call_function(aten.rand_like.default, (pick[0],)), True
        values.append(node)
    outputs = [values[-1][0]] + [v for v, _ in values[2:-1] if draw_ints(0, 3) == 0]
    graph.output(tuple(outputs))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    sh.memory.estimate_peak(gm, *inputs)  # fills meta["val"]
    return gm, inputs


def _run(gm, inputs):
    torch.manual_seed(0)
    return [t.clone() for t in gm(*[x.clone() for x in inputs])]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_reordering_random_programs_keeps_results_and_never_raises_the_peak(data):
    gm, inputs = _random_program(lambda lo, hi: data.draw(st.integers(lo, hi)), data.draw(st.integers(1, 25)))
    expected = _run(gm, inputs)
    before = sh.memory.estimate_peak(gm).peak_bytes
    memory = build_graph_memory(gm)
    result = reorder_graph(gm, exact_budget=500)
    gm.graph.lint()  # every node after its arguments: a topological order
    assert result.input_peak == before >= result.peak
    assert sh.memory.estimate_peak(gm).peak_bytes == result.peak  # the model agrees with the schedule
    assert simulate_order(memory, result.order, CPU) == result.peak
    for got, want in zip(_run(gm, inputs), expected):
        assert torch.equal(got, want)


def test_reorder_graph_reports_the_peak_of_the_order_it_applies_after_hoisting():
    """When hoist_frees lowers the peak, the schedule reports the peak of the order it applies, not the search's."""
    aten = torch.ops.aten
    graph = torch.fx.Graph()
    x0, x1 = graph.placeholder("x0"), graph.placeholder("x1")
    kept = [graph.call_function(aten.mul.Tensor, (x0, 1.5)) for _ in range(20)]  # outputs: alive to the end
    joined = graph.call_function(aten.cat.default, ([x0, x1],))
    graph.call_function(aten.cat.default, ([x0, joined],))  # read by nothing: frees what it reads
    graph.output((graph.call_function(aten.mul.Tensor, (x0, 1.5)), *kept))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    before = sh.memory.estimate_peak(gm, torch.randn(1), torch.randn(1)).peak_bytes
    result = reorder_graph(gm, exact_budget=500)
    assert result.method.endswith("+hoist")
    assert result.peak == sh.memory.estimate_peak(gm).peak_bytes < before


def test_writes_and_rng_keep_their_order():
    aten = torch.ops.aten
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    fresh = graph.call_function(aten.mul.Tensor, (x, 2.0))
    view = graph.call_function(aten.slice.Tensor, (fresh, 0, 0, 4))
    read_before = graph.call_function(aten.mul.Tensor, (view, 3.0))
    write = graph.call_function(aten.add_.Scalar, (fresh, 1.0))
    read_after = graph.call_function(aten.mul.Tensor, (view, 5.0))
    rand_a = graph.call_function(aten.rand_like.default, (x,))
    rand_b = graph.call_function(aten.rand_like.default, (x,))
    graph.output((read_before, write, read_after, rand_a, rand_b))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    sh.memory.estimate_peak(gm, torch.randn(8))
    memory = build_graph_memory(gm)
    index = {name: i for i, name in enumerate(memory.node_names)}
    edges = set(ordering_edges(gm, memory))
    assert (index[read_before.name], index[write.name]) in edges  # read the old value first
    assert (index[write.name], index[read_after.name]) in edges  # through a view made before the write
    assert (index[rand_a.name], index[rand_b.name]) in edges  # the RNG stream's order


# --- a recorded model backward ---------------------------------------------------------------------


def test_dfs_smallest_finds_the_lowest_order_of_gpt2_big_s_backward():
    """gpt2-big's backward under ``sh.fp8()`` (batch 1, inductor): only the smallest-first DFS gets it low.

    Recorded with ``python -m benchmarks.tools.problem_dump --model gpt2-big --size 1
    --config sh --out tests/data/gpt2_big_sh_problems.json.gz``. The next best
    strategy, ``dfs``, models a peak about 10 % higher. Weighing what a node
    makes once, as inductor does, models about 0.93 of ``dfs``: the bound below
    tells the two weights apart.
    """
    from pathlib import Path

    from benchmarks.tools.problem_dump import load_problems

    (problem,) = load_problems(Path(__file__).parents[1] / "data" / "gpt2_big_sh_problems.json.gz")
    ours = STRATEGIES["dfs_smallest"](problem)
    check_order(problem, ours)
    others = [
        order
        for name, strategy in STRATEGIES.items()
        if name != "dfs_smallest"
        for order in (strategy(problem), place(problem, strategy(problem)))
    ]
    assert peak_of(problem, ours) < 0.92 * min(peak_of(problem, o) for o in others)
    chosen = schedule(problem, exact_budget=0)
    assert chosen.method.startswith("dfs_smallest") and chosen.peak == peak_of(problem, ours)


def test_dfs_smallest_weighs_what_a_node_makes_twice_and_visits_the_smallest_predecessor_first():
    # inputs 0 (16 B) and 1 (60 B); node 2 reads 0 and makes 40 B, node 3 reads 1 and makes 1 B;
    # node 4 reads both. Sizes (reads + 2 x made): 2: 96, 3: 62, 4: 43 -> 4 first, after 3 then 2.
    # Weighing what is made once (inductor's 56, 61, 42) would run 2 before 3, as the input order does.
    problem = Problem(
        preds=((), (), (0,), (1,), (2, 3)),
        fixed=(0, 1),
        alloc=(0, 0, 40, 1, 1),
        sizes=(16, 60, 40, 1, 1),
        touchers=((0, 2), (1, 3), (2, 4), (3, 4), (4,)),
        freeable=(False, False, True, True, False),
        base=76,
        early=frozenset(),
        late=frozenset(),
    )
    assert STRATEGIES["dfs_smallest"](problem) == [0, 1, 3, 2, 4]


def test_dfs_smallest_refuses_a_cycle():
    problem = Problem(
        preds=((), (0, 2), (1,)),
        fixed=(0,),
        alloc=(0, 1, 1),
        sizes=(1, 1, 1),
        touchers=((0, 1), (1, 2), (2, 1)),
        freeable=(False, True, True),
        base=1,
        early=frozenset(),
        late=frozenset(),
    )
    with pytest.raises(ValueError, match="cycle"):
        STRATEGIES["dfs_smallest"](problem)
