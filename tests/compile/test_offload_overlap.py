"""Offload copies as single graph nodes, and their asynchronous form placed to overlap compute.

Graphs are traced on fake CUDA tensors (no GPU needed); the node times are given
(1 unit per matmul) so that the placement is deterministic. The GPU tests run the
copies for real.
"""

from __future__ import annotations

import functools
import logging
import random

import expecttest
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import savedhooks as sh
import savedhooks.kernels.offload  # the savedhooks::offload and savedhooks::reload ops
from savedhooks._torch.offload import HAS_AO_OPS
from savedhooks.codecs.base import pack_saved, unpack_saved
from savedhooks.compiler.overlap import Transfer, hoist_starts, overlap_transfers, sink_waits
from savedhooks.hostmem import default_pool
from savedhooks.memory import estimate_peak
from savedhooks.memory.timing import TransferModel, nominal_seconds
from tests.models import train_step_grads

pytestmark = pytest.mark.skipif(not HAS_AO_OPS, reason="torch's ao offload ops: torch 2.12+")

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
N = 256
TILE = N * N * 4  # bytes of one (N, N) float32 tensor


def _matmul_units(node: torch.fx.Node) -> float:
    return 1.0 if node.target is torch.ops.aten.mm.default else 0.0


def _model(copy_units: float, limit_bytes: int | None = None) -> TransferModel:
    """Copies of one (N, N) float32 tensor take ``copy_units`` matmuls."""
    return TransferModel(copy_bytes_per_s=TILE / copy_units, node_seconds=_matmul_units, limit_bytes=limit_bytes)


def _forward(x, w1, w2, w3):
    a = torch.mm(x, w1)
    b = torch.mm(torch.relu(a), w2)
    host = torch.ops.savedhooks.offload(a, CPU, True)  # pack, right after a's last use
    c = torch.mm(b, w3)
    d = torch.mm(c, w3)
    return torch.mm(d, w3), host


def _backward(host, tangents, w2, w3):
    y = torch.mm(tangents, w3)
    y = torch.mm(y, w3)
    y = torch.mm(y, w2)
    a = torch.ops.savedhooks.reload(host, CUDA, True)  # unpack, right before its first use
    return torch.mm(a.t(), y)


def _trace(fn, *devices):
    with FakeTensorMode():
        return make_fx(torch.func.functionalize(fn))(*(torch.empty(N, N, device=d) for d in devices))


def _device_peak(gm) -> int:
    return estimate_peak(gm).peak_bytes


def _targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


class TestOverlapGraphs(expecttest.TestCase):
    def test_forward_copy_then_wait_then_free(self):
        gm = _trace(_forward, "cuda", "cuda", "cuda", "cuda")
        before = _device_peak(gm)
        assert overlap_transfers(gm, is_backward=False, model=_model(copy_units=2.5)) == 1
        # the copy starts where the pack was; the wait comes after 3 matmuls (3 >= 2.5 units of copy),
        # and mm (the saved tensor) is read last by the wait: it is freed after the copy has ended
        self.assertExpectedInline(
            gm.code.strip(),
            """\
def forward(self, x_1, w1_1, w2_1, w3_1):
    mm = torch.ops.aten.mm.default(x_1, w1_1);  x_1 = w1_1 = None
    relu = torch.ops.aten.relu.default(mm)
    mm_1 = torch.ops.aten.mm.default(relu, w2_1);  relu = w2_1 = None
    offload_async_default = torch.ops.savedhooks.offload_async.default(mm)
    mm_2 = torch.ops.aten.mm.default(mm_1, w3_1);  mm_1 = None
    mm_3 = torch.ops.aten.mm.default(mm_2, w3_1);  mm_2 = None
    mm_4 = torch.ops.aten.mm.default(mm_3, w3_1);  mm_3 = w3_1 = None
    wait_tensor_default = torch.ops.ao.wait_tensor.default(offload_async_default, None, mm);  offload_async_default = mm = None
    return (mm_4, wait_tensor_default)""",
        )
        assert _device_peak(gm) <= before

    def test_prefetch_starts_by_the_modelled_copy_time_when_memory_allows(self):
        gm = _trace(_backward, "cpu", "cuda", "cuda", "cuda")
        assert overlap_transfers(gm, is_backward=True, model=_model(copy_units=2.5, limit_bytes=1 << 30)) == 1
        # 2.5 units of copy: the reload starts 3 matmuls before its wait, which stays at the first use
        self.assertExpectedInline(
            gm.code.strip(),
            """\
def forward(self, host_1, tangents_1, w2_1, w3_1):
    reload_default = torch.ops.ao.reload.default(host_1, device(type='cuda', index=0))
    mm = torch.ops.aten.mm.default(tangents_1, w3_1);  tangents_1 = None
    mm_1 = torch.ops.aten.mm.default(mm, w3_1);  mm = w3_1 = None
    mm_2 = torch.ops.aten.mm.default(mm_1, w2_1);  mm_1 = w2_1 = None
    wait_tensor_default = torch.ops.ao.wait_tensor.default(reload_default, None, host_1);  reload_default = host_1 = None
    t = torch.ops.aten.t.default(wait_tensor_default);  wait_tensor_default = None
    mm_3 = torch.ops.aten.mm.default(t, mm_2);  t = mm_2 = None
    return mm_3""",
        )

    def test_a_short_copy_starts_late(self):
        gm = _trace(_backward, "cpu", "cuda", "cuda", "cuda")
        overlap_transfers(gm, is_backward=True, model=_model(copy_units=0.5, limit_bytes=1 << 30))
        names = [n.name for n in gm.graph.nodes]
        assert names.index("reload_default") == names.index("mm_2") - 1  # one matmul hides half a unit


def test_prefetch_never_raises_the_modelled_device_peak_by_default():
    gm = _trace(_backward, "cpu", "cuda", "cuda", "cuda")
    before = _device_peak(gm)
    overlap_transfers(gm, is_backward=True, model=_model(copy_units=2.5))
    names = [n.name for n in gm.graph.nodes]
    # starting before mm_1 would hold the reloaded tile while mm_1 runs at the peak
    assert names.index("mm_1") < names.index("reload_default") < names.index("mm_2")
    assert _device_peak(gm) == before


def test_sunk_waits_respect_an_explicit_limit():
    gm = _trace(_forward, "cuda", "cuda", "cuda", "cuda")
    peak = _device_peak(gm)
    overlap_transfers(gm, is_backward=False, model=_model(copy_units=10.0, limit_bytes=peak))
    assert _device_peak(gm) <= peak
    assert [n.name for n in gm.graph.nodes][-2] == "wait_tensor_default"  # a long copy: waited on last


def test_the_reorder_pass_makes_offload_copies_asynchronous():
    gm = _trace(_forward, "cuda", "cuda", "cuda", "cuda")
    sh.compiler.reorder_pass()(gm.graph)  # a forward graph: not reordered, but its copies overlap
    assert "savedhooks.offload_async.default" in _targets(gm) and "savedhooks.offload.default" not in _targets(gm)
    gm = _trace(_backward, "cpu", "cuda", "cuda", "cuda")
    sh.compiler.reorder_pass()(gm.graph)
    assert "ao.reload.default" in _targets(gm) and "savedhooks.reload.default" not in _targets(gm)


def test_without_torchs_ao_ops_the_copies_stay_synchronous_and_a_warning_says_so_once(monkeypatch, caplog):
    """torch 2.11 has no ao::offload / ao::reload / ao::wait_tensor: the graph is left as it is."""
    from savedhooks.compiler import overlap

    monkeypatch.setattr(overlap, "HAS_AO_OPS", False)
    overlap._log_synchronous_once.cache_clear()
    with caplog.at_level("WARNING", logger="savedhooks.compiler.overlap"):
        for _ in range(2):
            gm = _trace(_forward, "cuda", "cuda", "cuda", "cuda")
            assert overlap_transfers(gm, is_backward=False) == 0
            assert "savedhooks.offload.default" in _targets(gm) and "savedhooks.offload_async.default" not in _targets(gm)
    assert sum("offload copies stay synchronous" in r.getMessage() for r in caplog.records) == 1
    overlap._log_synchronous_once.cache_clear()


def test_strided_and_pageable_copies_stay_synchronous():
    # torch's ao::offload returns a contiguous host tensor: a transposed source keeps our own copy
    def forward(x):
        a = torch.relu(x)
        return torch.ops.savedhooks.offload(a.t(), CPU, True), torch.ops.savedhooks.offload(a, CPU, False)

    gm = _trace(forward, "cuda")
    assert overlap_transfers(gm, is_backward=False) == 0
    assert _targets(gm).count("savedhooks.offload.default") == 2

    # an empty tensor too: the copies' events are keyed by data pointer, and empty tensors may share one
    with FakeTensorMode():
        gm = make_fx(lambda x: torch.ops.savedhooks.offload(x, CPU, True))(torch.empty(0, 4, device="cuda"))
    assert overlap_transfers(gm, is_backward=False) == 0

    # a pageable payload's copy back stays synchronous too (torch's ao::reload needs pinned memory)
    gm = _trace(lambda host: torch.ops.savedhooks.reload(host, CUDA, False) * 2, "cpu")
    assert overlap_transfers(gm, is_backward=True) == 0
    assert _targets(gm).count("savedhooks.reload.default") == 1


def test_symbolic_sizes_are_placed_by_their_hints():
    """Under ``dynamic=True`` the copy sizes are SymInts: placement reads their hints, as with static sizes."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    host = [mode.from_tensor(torch.empty(N, N), static_shapes=False) for _ in range(4)]
    with mode:
        args = [torch.empty(t.shape, device="cuda") for t in host]
    static = _trace(_forward, "cuda", "cuda", "cuda", "cuda")
    symbolic = make_fx(torch.func.functionalize(_forward), tracing_mode="symbolic")(*args)
    assert any(
        isinstance(s, torch.SymInt) for n in symbolic.graph.nodes for s in getattr(n.meta.get("val"), "shape", ())
    )
    for gm in (static, symbolic):
        assert overlap_transfers(gm, is_backward=False, model=_model(copy_units=2.0)) == 1
    assert _targets(symbolic) == _targets(static)


def test_symbolic_node_times_are_read_at_their_hints_without_a_guard():
    """A time from symbolic sizes (a SymFloat) is read at its hint: ``float()`` would guard the graph on it."""
    shape_env = ShapeEnv()
    x = FakeTensorMode(shape_env=shape_env).from_tensor(torch.empty(N, N), static_shapes=False)
    ms = x.shape[0] * 0.5  # what an estimate computed from symbolic sizes returns
    assert isinstance(ms, torch.SymFloat)
    gm = _trace(lambda host, x: (torch.relu(host), torch.relu(x)), "cpu", "cuda")
    relu = next(n for n in gm.graph.nodes if n.name == "relu")
    assert TransferModel(node_seconds=lambda n: ms).seconds(relu) == N * 0.5
    assert not shape_env.guards, shape_env.guards


def test_only_call_functions_take_time():
    gm = _trace(lambda host, x: (torch.relu(host), torch.relu(x)), "cpu", "cuda")
    seconds = {n.name: TransferModel().seconds(n) for n in gm.graph.nodes}
    assert seconds["host_1"] == seconds["x_1"] == seconds["output"] == 0.0
    relu = next(n for n in gm.graph.nodes if n.name == "relu")
    assert seconds["relu"] == seconds["relu_1"] == nominal_seconds(relu) > 0.0


def test_graphs_without_device_host_copies_are_left_alone():
    gm = _trace(lambda x, w: torch.mm(torch.relu(x), w), "cuda", "cuda")
    code = gm.code
    assert overlap_transfers(gm, is_backward=False) == 0 and gm.code == code


def test_the_offload_codec_traces_to_one_node_per_payload_under_functionalization():
    # torch's ao::wait_tensor cannot be traced here (test_codec_models pins it); our copies can
    codec = sh.codecs.Offload(sh.codecs.Float8())
    with FakeTensorMode():
        x = torch.empty(4, 256, device="cuda")
        pack = make_fx(torch.func.functionalize(functools.partial(pack_saved, codec)))(x)
        unpack = make_fx(torch.func.functionalize(functools.partial(unpack_saved, codec)))(pack_saved(codec, x))
    assert _targets(pack).count("savedhooks.offload.default") == 2  # fp8 codes and scales
    assert _targets(unpack).count("savedhooks.reload.default") == 2
    assert not any("copy" in t for t in _targets(pack) + _targets(unpack))


def test_the_async_copy_out_is_torch_s_with_the_pool_s_memory():
    """savedhooks::offload_async uses torch's transfer stream and event registry (what ao::wait_tensor pops):
    those private helpers must keep their names and arguments. On fake CUDA tensors it makes a contiguous host
    tensor; it refuses a tensor on the CPU. Any device layout is accepted: inductor applies no layout
    constraint to a node a pass inserts, so a padded layout may reach it (the copy makes it contiguous)."""
    import inspect

    from torch._functorch._activation_offloading import offload_ops as ao

    assert list(inspect.signature(ao._register_wait).parameters) == ["tensor", "device"]
    assert list(inspect.signature(ao._get_or_create_transfer_stream).parameters) == ["device"]
    assert list(inspect.signature(ao._pop_wait).parameters) == ["tensor"]  # keyed by the tensor alone
    with FakeTensorMode():
        host = torch.ops.savedhooks.offload_async(torch.empty(8, 4, device="cuda"))
        assert host.device == CPU and host.shape == (8, 4) and host.is_contiguous()
        host = torch.ops.savedhooks.offload_async(torch.empty(8, 4, device="cuda").t())
        assert host.shape == (4, 8) and host.is_contiguous()
        with pytest.raises(ValueError, match="needs a tensor on an accelerator"):
            torch.ops.savedhooks.offload_async(torch.empty(8, 4))
    with pytest.raises(ValueError, match="needs a tensor on an accelerator"):
        torch.ops.savedhooks.offload_async(torch.randn(8, 4))


def test_the_copy_ops_refuse_a_tensor_already_on_the_target_device():
    with pytest.raises(ValueError, match="already lives on cpu"):
        torch.ops.savedhooks.offload(torch.randn(2), CPU, True)
    with pytest.raises(ValueError, match="already lives on cpu"):
        torch.ops.savedhooks.reload(torch.randn(2), CPU, True)


def test_copy_ops_keep_dense_strides_and_make_the_rest_contiguous():
    meta = torch.device("meta")  # a device other than the CPU that needs none
    t = torch.randn(8, 4).t()
    assert torch.ops.savedhooks.offload(t, meta, True).stride() == t.stride()
    sliced = torch.randn(8, 8)[:, :3]
    assert torch.ops.savedhooks.offload(sliced, meta, True).is_contiguous()


# --- what is offloaded ------------------------------------------------------------------


class _Captured(Exception):
    pass


def _offloaded(hooks, model, x) -> list[str]:
    """Saved values that the compiled forward copies to the host (traced only: nothing runs)."""
    from functorch.compile import aot_function

    graphs = []

    def capture(gm, _inputs):
        graphs.append(gm)
        raise _Captured

    def loss(x, params):
        return torch.func.functional_call(model, params, (x,)).square().sum()

    with sh.saved_tensors_hooks(hooks), pytest.raises(_Captured):
        aot_function(loss, fw_compiler=capture)(x, dict(model.named_parameters()))
    return [n.args[0].name for n in graphs[0].graph.nodes if n.target is torch.ops.savedhooks.offload.default]


def test_what_the_backward_needs_before_a_copy_back_could_end_stays_on_the_device():
    # CPU tensors "offloaded" to the meta device: a device type other than the CPU, no GPU needed
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(256, 256), torch.nn.GELU())])
    x = torch.randn(512, 256)
    everything = _offloaded(sh.offload(device="meta", keep_needed_soon=False), model, x)
    assert len(everything) == 16  # each layer's matmul output and GELU output
    moved = _offloaded(sh.offload(device="meta"), model, x)
    # read first by the backward, the last layers' tensors stay (a copy of one takes as long as about
    # four layers' backward at the nominal rates); the first layers' move
    layers = [int(name.split("_")[1]) if "_" in name else 0 for name in moved]
    assert 0 < len(moved) < len(everything) and set(moved) < set(everything)
    assert sorted(layers) == [k for k in range(max(layers) + 1) for _ in range(2)]  # layers 0..k, both tensors


def test_tensors_below_min_bytes_are_stored_as_they_are():
    x = torch.randn(16, 16) * 2  # 1 KiB
    assert pack_saved(sh.codecs.Offload(device="meta"), x)[0] == 0  # moved
    assert pack_saved(sh.codecs.Offload(device="meta", min_bytes=1025), x)[0] == -1  # as it is
    with pytest.raises(ValueError, match="min_bytes"):
        sh.offload(min_bytes=-1)
    with pytest.raises(ValueError, match="keep_needed_soon"):
        sh.offload(keep_needed_soon=1)


# --- the placement rules on their own ---------------------------------------------------


def test_copies_on_one_stream_queue_behind_each_other():
    ends = [float(i + 1) for i in range(10)]  # one unit per node
    during = [0] * 10
    waits = [Transfer(at=1, seconds=2.0, nbytes=0), Transfer(at=2, seconds=2.0, nbytes=0)]
    # the first copy is issued at t=0 and ends at 2 (node 1 ends then); the second, issued at t=1,
    # queues behind it and ends at 4, not 3 (node 3)
    assert sink_waits(waits, [0, 1], ends, during, limit=0) == [1, 3]


def test_hoisted_reloads_keep_their_order_and_queue():
    ends = [float(i + 1) for i in range(10)]
    during = [0] * 10
    reloads = [Transfer(at=6, seconds=2.0, nbytes=0), Transfer(at=7, seconds=2.0, nbytes=0)]
    # the first must end by t=6 (start at position 4); the second by t=7, but the stream is busy until 6
    starts = hoist_starts(reloads, [0, 0], ends, during, limit=0)
    assert starts[0] == 4 and starts[1] >= starts[0]


@pytest.mark.parametrize("seed", range(20))
def test_moves_never_exceed_the_limit(seed):
    rng = random.Random(seed)
    n = 30
    during = [rng.randrange(0, 100) for _ in range(n)]
    limit = max(during) + rng.randrange(0, 50)
    ends, clock = [], 0.0
    for _ in range(n):
        clock += rng.random()
        ends.append(clock)
    waits = sorted(rng.sample(range(1, n - 1), 4))
    sunk = list(during)
    spots = sink_waits(
        [Transfer(at, rng.random() * 3, rng.randrange(1, 40)) for at in waits],
        [at - 1 for at in waits],
        ends,
        sunk,
        limit,
    )
    assert all(k >= at for k, at in zip(spots, waits)) and max(sunk) <= limit
    hoisted = list(during)
    starts = hoist_starts(
        [Transfer(at, rng.random() * 3, rng.randrange(1, 40)) for at in waits], [0] * len(waits), ends, hoisted, limit
    )
    assert all(j <= at for j, at in zip(starts, waits)) and starts == sorted(starts) and max(hoisted) <= limit


def test_nominal_times_rank_a_matmul_above_a_view():
    gm = _trace(lambda x, w: torch.mm(x, w).t(), "cuda", "cuda")
    times = {n.name: nominal_seconds(n) for n in gm.graph.nodes}
    flops, moved = 2 * N**3, 3 * TILE  # FLOPs at 100 TFLOP/s or bytes at 2 TB/s, the longer
    assert times["mm"] == pytest.approx(max(flops / 100e12, moved / 2e12)) and times["t"] == 0.0


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"copy_bytes_per_s": 0}, ValueError),
        ({"node_seconds": 3}, TypeError),
        ({"limit_bytes": -1}, ValueError),
    ],
)
def test_transfer_model_refuses_bad_settings(kwargs, error):
    with pytest.raises(error):
        TransferModel(**kwargs)


# --- on a GPU ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_async_offload_is_bit_exact_over_many_steps_of_changing_sizes(backend, caplog):
    """Stress: many steps, batch sizes drawn at random, the copies' host buffers reused by torch's
    host allocator: gradients must equal those without hooks on every step, and the compiled graphs
    must use the asynchronous copies (the pass logs each graph it rewrote).

    Equal bit for bit under aot_eager. Under inductor, >= 100 dB: steps may differ in float32 rounding,
    with the copies asynchronous or synchronous alike: inductor fuses the graph around the copies
    otherwise, as in test_offload_on_cuda_gradients. A copy read before it ends, or a slab reused too soon, gives
    stale or foreign data: tens of dB at best."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(256, 256), torch.nn.GELU())]).cuda()
    compiled = torch.compile(model, backend=sh.backend(backend), dynamic=True)
    rng = random.Random(0)
    hits = default_pool().stats.hits
    with caplog.at_level(logging.INFO, logger="savedhooks.compiler.overlap"):
        for _ in range(30):
            x = torch.randn(rng.choice([8, 64, 200, 512]), 256, device="cuda")
            want = train_step_grads(model, compiled, x)
            got = train_step_grads(model, compiled, x, sh.offload(keep_needed_soon=False))
            if backend == "inductor":
                assert min(sh.fidelity.sqnr(w, g) for w, g in zip(want, got)) >= 100.0
            else:
                assert all(torch.equal(w, g) for w, g in zip(want, got))
    # the asynchronous copies out write into the host pool's slabs, reused across steps (savedhooks::offload_async)
    assert default_pool().stats.hits > hits
    rewrites = [r.getMessage() for r in caplog.records if "async copies" in r.getMessage()]
    assert any(m.startswith("savedhooks overlap (forward)") for m in rewrites), rewrites
    assert any(m.startswith("savedhooks overlap (backward)") for m in rewrites), rewrites


def test_a_forward_that_offloads_gets_its_copies_placed_after_the_last_use():
    """torch inlines every pack at the end of the forward, and inductor runs an extern copy where the
    graph has it: the pass (forward graphs not reordered) places the copies first, so each source
    dies after its own copy instead of living to the end of the forward."""

    def forward(x, w):
        a = torch.mm(x, w)
        b = torch.mm(torch.relu(a), w)
        c = torch.mm(torch.relu(b), w)
        d = torch.mm(torch.relu(c), w)
        saved = [torch.ops.savedhooks.offload(t, CPU, True) for t in (a, b, c)]  # where torch inlines them
        return (d, *saved)

    gm = _trace(forward, "cuda", "cuda")
    before = _device_peak(gm)
    sh.compiler.reorder_pass()(gm.graph)
    order = [n for n in gm.graph.nodes if n.op == "call_function"]
    starts = [n for n in order if n.target is torch.ops.savedhooks.offload_async.default]
    assert len(starts) == 3
    for start in starts:  # each copy starts right after the last compute that reads its source
        source = start.args[0]
        readers = [
            u
            for u in source.users
            if u.target not in (torch.ops.savedhooks.offload_async.default, torch.ops.ao.wait_tensor.default)
        ]
        assert order.index(start) == max(order.index(u) for u in readers) + 1, gm.code
    # before: a, b and c alive together at the end (3 tiles besides d and its operands); after: at most 2
    assert _device_peak(gm) <= before - TILE, (before, _device_peak(gm))


@pytest.mark.parametrize("copy_units, warns", [(10.0, True), (1.0, False)])
def test_copies_longer_than_the_graph_s_compute_are_reported(copy_units, warns, caplog):
    """No placement hides copies that take longer than all the compute around them (a large model whose
    saved bytes take longer to copy than its step computes); the pass says so, with both modelled times."""
    gm = _trace(_forward, "cuda", "cuda", "cuda", "cuda")  # 5 matmuls of compute, one copy
    with caplog.at_level(logging.WARNING, logger="savedhooks.compiler.overlap"):
        overlap_transfers(gm, is_backward=False, model=_model(copy_units=copy_units))
    messages = [r.getMessage() for r in caplog.records if "longer than the graph's modelled compute" in r.getMessage()]
    assert bool(messages) == warns, messages
    if warns:
        assert "copies take 1e+04 ms" in messages[0] and "compute (5e+03 ms)" in messages[0], messages


@pytest.mark.parametrize("write", ["copy_", "resize_storage_bytes_"])
def test_a_forward_wait_never_sinks_past_a_write_to_memory_the_copy_may_still_read(write):
    """The copy out runs on another stream: a node that writes or frees its source (an input's mutation,
    kept as copy_ by functionalization; inductor's storage resize, whose schema marks no write) must come
    after the wait, however long the copy."""
    import torch._inductor  # registers inductor::resize_storage_bytes_

    def forward(x, w):
        a = torch.mm(x, w)
        host = torch.ops.savedhooks.offload(x, CPU, True)  # x is saved, then written
        d = torch.mm(torch.mm(torch.mm(a, w), w), w)
        if write == "copy_":
            x.mul_(2)
        else:
            torch.ops.inductor.resize_storage_bytes_(x, 0)
        return d, host

    with FakeTensorMode():
        args = [torch.empty(N, N, device="cuda") for _ in range(2)]
        gm = make_fx(torch.func.functionalize(forward) if write == "copy_" else forward)(*args)
    assert overlap_transfers(gm, is_backward=False, model=_model(copy_units=10.0, limit_bytes=1 << 30)) == 1
    order = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    barrier = next(i for i, t in enumerate(order) if t.endswith(f"{write}.default"))
    assert order.index("ao.wait_tensor.default") == barrier - 1, order
    assert order.index("ao.wait_tensor.default") > order.index("aten.mm.default") + 3, order  # it did sink


def test_copies_of_data_dependent_size_stay_synchronous():
    """An unbacked size may be 0 at run time, and empty tensors may share the data pointer that keys the events."""
    gm = _trace(lambda x: torch.ops.savedhooks.offload(torch.relu(x), CPU, True), "cuda")
    shape_env = ShapeEnv()
    with FakeTensorMode(shape_env=shape_env):
        rows = shape_env.create_unbacked_symint()
        relu, copy = (n for n in gm.graph.nodes if n.op == "call_function")
        relu.meta["val"], copy.meta["val"] = torch.empty(rows, N, device="cuda"), torch.empty(rows, N)
    assert overlap_transfers(gm, is_backward=False) == 0
    assert _targets(gm) == ["aten.relu.default", "savedhooks.offload.default"]
