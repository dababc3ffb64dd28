"""The memory model: predicted live bytes equal measured ones, node by node; bounds hold."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import GraphRecorder, mlp, train_step, train_step_grads, transformer
from torch.fx.experimental.proxy_tensor import make_fx

import savedhooks as sh
from savedhooks._torch.version import release
from savedhooks.memory import build_graph_memory, simulate_order

CPU = torch.device("cpu")


def _recorded(make_model, shape, hooks=None, train=True):
    model = make_model()
    model.train(train)
    recorder = GraphRecorder()
    train_step_grads(model, torch.compile(model, backend=recorder.backend), torch.randn(*shape), hooks)
    assert len(recorder.graphs) == 2  # forward, backward
    return recorder.graphs


def _cnn_bn():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
        torch.nn.Linear(8 * 7 * 7, 4),
    )  # fmt: skip


MODELS = {
    "mlp": (mlp, (16, 8), None),
    "cnn_bn_maxpool": (_cnn_bn, (4, 3, 16, 16), None),
    "transformer_block": (lambda: transformer(layers=1), (2, 32, 64), None),
    "mlp_fp8": (mlp, (16, 8), sh.fp8()),
    "transformer_fp8": (lambda: transformer(layers=1), (2, 32, 64), sh.fp8()),
}


def _assert_model_matches_measurement(gm, args):
    estimate = sh.memory.estimate_peak(gm)
    measured = sh.memory.profile_graph(gm, *args)
    mismatched = [(n, p, m) for n, p, m in zip(estimate.node_names, estimate.live_after, measured) if p != m]
    assert not mismatched, mismatched[:5]
    assert estimate.lower_bound <= estimate.peak_bytes
    assert estimate.peak_bytes == max(estimate.live_during)
    return estimate


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_predicted_live_bytes_equal_measured_per_node(name):
    make_model, shape, hooks = MODELS[name]
    for gm, args in _recorded(make_model, shape, hooks):
        _assert_model_matches_measurement(gm, args)


def test_fp8_hooks_shrink_what_the_model_sees_saved():
    def saved_bytes(hooks):
        (fw, fw_args), _ = _recorded(lambda: transformer(layers=1), (2, 32, 64), hooks)
        estimate = sh.memory.estimate_peak(fw)
        inputs = sum(b.nbytes for b in build_graph_memory(fw).buffers if b.is_input)
        return estimate.live_after[-1] - inputs  # what the forward leaves alive besides its inputs

    plain, packed = saved_bytes(None), saved_bytes(sh.fp8())
    assert packed < 0.45 * plain  # fp8 payloads (+ kept statistics) instead of fp32 activations


def _in_place_and_views(x, y):
    t = x * 2
    v = t.view(8, 4)
    v.add_(y)  # writes t's storage
    w = v.transpose(0, 1)
    u = w.contiguous()
    return u.sum(0), t


def _multi_output(x, w, b):
    a, c = torch.split(x * 3, 2, dim=1)
    out, mean, rstd = torch.ops.aten.native_layer_norm(a, [2], w, b, 1e-5)
    return out + c, rstd


@pytest.mark.parametrize(
    "fn, inputs",
    [
        (_in_place_and_views, (torch.randn(4, 8), torch.randn(8, 4))),
        (_multi_output, (torch.randn(6, 4), torch.randn(2), torch.randn(2))),
    ],
    ids=["in_place_and_views", "multi_output"],
)
def test_make_fx_graphs_with_aliasing(fn, inputs):
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    estimate = _assert_model_matches_measurement(gm, [t.clone() for t in inputs])
    memory = build_graph_memory(gm)
    if fn is _in_place_and_views:  # t, its view and the in-place add share one buffer
        names = {memory.node_names[i] for i, made in enumerate(memory.allocs) if made}
        assert not any(name.startswith(("view", "add_", "transpose")) for name in names)
    assert estimate.at_peak and estimate.at_peak[0].nbytes >= estimate.at_peak[-1].nbytes


def _late_statistics(x, w, b):
    out, _mean, rstd = torch.ops.aten.native_layer_norm(x, [8], w, b, 1e-5)
    return torch.mm(out, out.t()), rstd


def test_under_inductor_a_late_getitem_holds_only_its_own_output():
    """A saved log-sum-exp that inductor's order puts at the end holds only itself there, not attention's output."""
    gm = make_fx(_late_statistics, tracing_mode="fake")(torch.randn(64, 8), torch.randn(8), torch.randn(8))
    rstd = next(n for n in gm.graph.nodes if n.op == "call_function" and n.args[0].name.startswith("native_layer_norm")
                and n.args[1] == 2)
    gm.graph.output_node().prepend(rstd)  # placed last, as inductor's order places a saved getitem
    gm.recompile()

    def freed_at(memory):
        out = next(b for b in memory.buffers if b.name.startswith("native_layer_norm") and b.nbytes == 64 * 8 * 4)
        return memory.node_names[next(i for i, f in enumerate(memory.frees) if out.index in f)]

    # the Python code torch generates holds the op's tuple to its last getitem; inductor frees each output apart
    assert freed_at(build_graph_memory(gm)) == rstd.name
    assert freed_at(build_graph_memory(gm, fused=True)) == "mm"


def test_donated_inputs_are_freed_after_last_use():
    gm = make_fx(lambda x: (x * 2).sum(), tracing_mode="fake")(torch.randn(64, 64))
    kept = sh.memory.estimate_peak(gm)
    donated = sh.memory.estimate_peak(gm, donated=("x_1",))
    assert donated.live_after[-1] == kept.live_after[-1] - 64 * 64 * 4
    measured = sh.memory.profile_graph(gm, torch.randn(64, 64), donated=("x_1",))
    assert list(donated.live_after) == measured


def test_a_device_named_without_index_is_the_graphs_device():
    """Traced values say ``cuda:0``, and ``torch.device("cuda") != torch.device("cuda:0")``: "cuda" must
    still count them (counting nothing, the predicted peak would be 0)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        gm = make_fx(lambda x, c: (torch.relu(x @ x.t()), c * 2))(torch.empty(32, 16, device="cuda"), torch.empty(8))
    on_cuda = sh.memory.estimate_peak(gm, device="cuda:0")
    assert on_cuda.peak_bytes == 32 * 16 * 4 + 2 * 32 * 32 * 4
    for named in ("cuda", torch.device("cuda"), None):
        estimate = sh.memory.estimate_peak(gm, device=named)
        assert (estimate.device, estimate.peak_bytes) == (torch.device("cuda:0"), on_cuda.peak_bytes)
    assert sh.memory.estimate_peak(gm, device="cpu").peak_bytes == 2 * 8 * 4
    assert sh.memory.estimate_peak(gm, device="cuda:1").peak_bytes == 0


def test_estimate_with_example_inputs_fills_fake_values():
    gm = torch.fx.symbolic_trace(lambda x: torch.relu(x @ x.t()))  # no meta["val"]
    with pytest.raises(ValueError, match="pass example inputs"):
        sh.memory.estimate_peak(gm)
    estimate = sh.memory.estimate_peak(gm, torch.randn(32, 16))
    assert estimate.peak_bytes == 32 * 16 * 4 + 2 * 32 * 32 * 4  # x, x @ x.t(), relu's output


# --- lower bound against every order ------------------------------------------------------------


def _random_dag(draw_ints, draw_bools, n_nodes: int) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """A random graph of cats (new buffers) and slices (views) over 1-D tensors."""
    graph = torch.fx.Graph()
    inputs = [torch.randn(draw_ints(1, 16)) for _ in range(2)]
    values = [graph.placeholder(f"x{i}") for i in range(len(inputs))]
    for _ in range(n_nodes):
        picked = sorted({draw_ints(0, len(values) - 1) for _ in range(draw_ints(1, 3))})
        node = graph.call_function(torch.ops.aten.cat.default, ([values[i] for i in picked],))
        if draw_bools():
            node = graph.call_function(torch.ops.aten.slice.Tensor, (node, 0, 0, draw_ints(1, 8)))
        values.append(node)
    outputs = [values[-1]] + [v for v in values[2:-1] if draw_bools() and draw_bools()]
    graph.output(tuple(outputs))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    sh.memory.estimate_peak(gm, *inputs)  # fills meta["val"]
    return gm, inputs


def _topological_orders(memory):
    n = len(memory.node_names)
    deps = [set(d) for d in memory.inputs]

    def extend(order, placed):
        if len(order) == n:
            yield list(order)
            return
        for i in range(n):
            if i not in placed and deps[i] <= placed:
                order.append(i)
                placed.add(i)
                yield from extend(order, placed)
                order.pop()
                placed.discard(i)

    yield from extend([], set())


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_lower_bound_never_exceeds_the_best_order(data):
    n_nodes = data.draw(st.integers(1, 5))
    gm, inputs = _random_dag(
        lambda lo, hi: data.draw(st.integers(lo, hi)), lambda: data.draw(st.booleans()), n_nodes
    )
    estimate = sh.memory.estimate_peak(gm)
    memory = build_graph_memory(gm)
    best = min(simulate_order(memory, order, CPU) for order in itertools.islice(_topological_orders(memory), 5000))
    assert estimate.lower_bound <= best <= estimate.peak_bytes
    assert simulate_order(memory, list(range(len(memory.node_names))), CPU) == estimate.peak_bytes
    assert list(estimate.live_after) == sh.memory.profile_graph(gm, *inputs)


@pytest.mark.slow
@pytest.mark.parametrize("hooks", [None, sh.fp8()], ids=["plain", "fp8"])
@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_measured_training_step_matches_the_prediction(name, hooks):
    torch.manual_seed(0)
    if name == "mlp":
        model = torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 1)
        )  # fmt: skip
        x = torch.randn(256, 256)
    else:
        model, x = transformer(layers=2), torch.randn(4, 64, 64)
    recorder = GraphRecorder(keep_inputs=False)  # kept inputs would stay alive in the measured steps
    compiled = torch.compile(model, backend=recorder.backend)

    def step():
        train_step(model, compiled, x, hooks)

    step()  # compile
    (forward, _), (backward, _) = recorder.graphs[:2]
    model.zero_grad(set_to_none=True)
    measured = sh.memory.measure_peak(step, device="cpu")
    predicted = sh.memory.predict_step(forward, backward)
    if hooks is None:
        assert predicted.step_peak == pytest.approx(measured, rel=0.05)
    else:
        # The aten reference of fp8_quantize/dequantize holds a few float32/bool copies
        # of one chunk of rows while it runs; the model counts them as measured on one
        # chunk (op_scratch_bytes), which can differ from the op's last, shorter chunk.
        from savedhooks.kernels.fp8 import _CHUNK_ELEMS

        largest = max(v.numel() for n in forward.graph.nodes for v in [n.meta.get("val")] if isinstance(v, torch.Tensor))
        workspace = 16 * min(largest, _CHUNK_ELEMS)
        assert abs(measured - predicted.step_peak) <= workspace


def test_the_incoming_gradient_is_freed_at_its_last_use_where_torch_frees_it():
    """torch 2.13+ hands a compiled backward its gradients as a list that it empties: the model frees
    them too. Before 2.13 the caller holds them to the end, and the model holds them as well.

    The backward reads the logits' gradient (1 MiB) first and peaks later, in the
    ReLU's backward: held to the end, it adds its bytes to that peak.
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 2048, bias=False), torch.nn.ReLU(), torch.nn.Linear(2048, 512, bias=False)
    )  # fmt: skip
    x = torch.randn(512, 64)
    recorder = GraphRecorder(keep_inputs=False)
    compiled = torch.compile(model, backend=recorder.backend)
    train_step(model, compiled, x)  # compile
    (forward, _), (backward, _) = recorder.graphs[:2]
    measured = sh.memory.measure_peak(lambda: train_step(model, compiled, x), device="cpu")
    predicted = sh.memory.predict_step(forward, backward).step_peak
    gradient = 512 * 512 * 4
    saved = sh.memory.saved_activations(backward)
    freed = (*saved, "tangents_1") if release() >= (2, 13) else saved
    assert sh.memory.freed_inputs(backward) == freed
    held = sh.memory.estimate_peak(backward, donated=saved).peak_bytes
    freed_peak = sh.memory.estimate_peak(backward, donated=(*saved, "tangents_1")).peak_bytes
    assert held - freed_peak == gradient
    assert abs(measured - predicted) < gradient / 8, (measured, predicted)


@pytest.mark.parametrize("train", [True, False])
def test_dropout_in_training_counts_its_float_mask_as_scratch_on_cpu(train):
    """aten's CPU native_dropout draws its mask in the input's dtype, then casts it to bool."""
    from savedhooks.memory.scratch import _scratch

    x = torch.randn(300, 77)
    gm = make_fx(lambda x: torch.ops.aten.native_dropout.default(x, 0.1, train), tracing_mode="fake")(x)
    (node,) = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.native_dropout.default)
    measured = _scratch(lambda: torch.ops.aten.native_dropout.default(x, 0.1, train))
    assert sh.memory.op_scratch_bytes(node) == measured == (x.nbytes if train else 0)


def test_json_export_and_timeline_plot(tmp_path):
    pytest.importorskip("matplotlib")
    (forward, args), _ = _recorded(mlp, (16, 8), sh.fp8())
    data = sh.memory.graph_to_json(forward, path=tmp_path / "graph.json")
    assert (tmp_path / "graph.json").exists()
    assert len(data["nodes"]) == len(sh.memory.estimate_peak(forward).node_names)
    packed = [b for b in data["buffers"] if b["name"].startswith("fp8_quantize")]  # payloads and scales
    assert packed and all(b["nbytes"] < 16 * 16 * 4 for b in packed)
    estimate = sh.memory.estimate_peak(forward)
    png = sh.memory.plot_timeline(estimate, tmp_path / "timeline.png", sh.memory.profile_graph(forward, *args), "mlp fp8")
    assert png.stat().st_size > 10_000


@pytest.mark.gpu
def test_measured_cuda_training_step_matches_the_prediction():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1)).cuda()
    x = torch.randn(2048, 1024, device="cuda")
    recorder = GraphRecorder(keep_inputs=False)
    compiled = torch.compile(model, backend=recorder.backend)

    def step():
        train_step(model, compiled, x)

    step()
    (forward, _), (backward, _) = recorder.graphs[:2]
    model.zero_grad(set_to_none=True)
    measured = sh.memory.measure_peak(step, device="cuda")
    predicted = sh.memory.predict_step(forward, backward, device="cuda")
    assert predicted.step_peak == pytest.approx(measured, rel=0.05)


def test_scratch_of_our_ops_is_measured_and_never_disturbs_a_users_profiler():
    from torch.fx.experimental.proxy_tensor import make_fx

    def pack(x):
        return torch.ops.savedhooks.fp8_quantize(x, torch.float8_e4m3fn, "row", 128, False)

    def quantize_node(rows):
        gm = make_fx(pack)(torch.randn(rows, 96))
        return next(n for n in gm.graph.nodes if n.op == "call_function" and "fp8_quantize" in str(n.target))

    # below one chunk of elements (12288 and 9600): the reference runs, not the compiled form
    assert sh.memory.op_scratch_bytes(quantize_node(128)) > 128 * 96  # a float32 temporary per element at least
    unseen = quantize_node(100)  # a shape not measured (cached) yet
    with torch.profiler.profile() as prof:
        inside = sh.memory.op_scratch_bytes(unseen)
        torch.ones(3).add_(1)
    assert inside == 0  # not measured while the user profiles: no nested profiler
    assert any(e.name == "aten::add_" for e in prof.events())  # the user's trace is intact
    assert sh.memory.op_scratch_bytes(unseen) > 100 * 96  # measured once the user's profiler is gone


def test_measuring_on_cpu_prints_no_profiler_markers_and_keeps_other_stderr(capfd):
    x = torch.randn(64, 64)
    assert sh.memory.measure_peak(lambda: x @ x, device="cpu") > 0
    assert "USDT" not in capfd.readouterr().err  # kineto's profiler_start / profiler_stop lines
    from savedhooks.memory.measure import _without_kineto_markers

    with _without_kineto_markers():
        os.write(2, b"USDT:2026-01-01 00:00:00 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a warning that matters\n")
        os.write(2, b"STAGE:2026-01-01 00:00:00 1:1 SyncActivityProfilerHandler.cpp:51] Completed Stage: Warm Up\n")
    assert capfd.readouterr().err == "a warning that matters\n"


def test_one_threads_bytes_leave_out_other_threads_buffers_and_count_its_blocks_freed_elsewhere():
    from savedhooks.memory.measure import Allocation, traced_bytes

    records = [
        Allocation(0, 1, 0xA, 400),  # the caller keeps 400 bytes
        Allocation(1, 2, 0xB, 1000),  # a gloo worker's buffer, freed after the trace stopped: not the caller's
        Allocation(2, 1, 0xC, 100),  # the caller's input copy, freed by the worker when it drops the work
        Allocation(3, 3, 0xD, 50),  # another worker's block, freed by the caller: not counted either way
        Allocation(4, 2, 0xC, -100),
        Allocation(5, 1, 0xD, -50),
        Allocation(6, 1, 0xE, -30),  # a block from before the trace, freed by the caller: not counted
    ]
    assert [live for _, live in traced_bytes(records[::-1], thread=1)] == [400, 500, 400]  # in time order
    assert [live for _, live in traced_bytes(records, thread=2)] == [1000]
    assert traced_bytes(records) == [(0, 400), (1, 1400), (2, 1500), (3, 1550), (4, 1450), (5, 1400)]
    # an address freed and taken again at one timestamp: the free first, whatever the records' order
    reused = [Allocation(0, 1, 0xA, 400), Allocation(1, 1, 0xA, 64), Allocation(1, 1, 0xA, -400)]
    assert [live for _, live in traced_bytes(reused)] == [400, 0, 64]


def test_a_free_of_a_block_from_before_the_trace_is_not_counted():
    """torch's CPU memory reporter sizes such a free only where an earlier profiling session recorded
    the address: with the block's size (here), dropped, or with an older block's size once the address
    was reused. Which one happens varies from process to process, so none is counted."""
    recorded = []
    trace = sh.memory.cpu_memory_trace(lambda: recorded.append(torch.empty(1 << 18)))  # 1 MiB, size recorded
    assert trace == [1 << 20]

    def step() -> None:
        recorded.clear()  # frees the 1 MiB block from before the call
        torch.empty(1 << 16).zero_()  # 256 KiB of its own, freed at its end

    assert sh.memory.cpu_memory_trace(step) == [1 << 18, 0]
    assert sh.memory.measure_peak(step, device="cpu") == 1 << 18


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="gloo")
def test_a_trace_of_the_calling_thread_leaves_out_gloos_worker_buffers(tmp_path):
    import torch.distributed as dist

    from savedhooks.memory.measure import cpu_allocations, profiled_nodes

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        x, kept = torch.randn(4096), []

        def gather() -> None:
            kept.append(torch.empty(4096))
            dist.all_gather_into_tensor(kept[-1], x, async_op=True).wait()

        every = [(a.thread, a.nbytes) for a in cpu_allocations(profiled_nodes(gather))]
        caller = sh.memory.cpu_memory_trace(gather, calling_thread_only=True)
    finally:
        dist.destroy_process_group()
    assert len({thread for thread, _ in every}) > 1  # gloo's worker allocated its own copy, on its own thread
    assert len(caller) < len(every)
    assert caller[-1] == 4096 * 4  # what the call keeps: its output


@pytest.mark.parametrize("op", ["quantize", "dequantize", "stochastic quantize"])
def test_the_fp8_references_scratch_stays_under_256_kib_per_call(op):
    """Measured on CPU: the aten reference's temporaries on a 16 MiB tensor (its work is chunked by rows).

    Stochastic rounding's int64 random bits take a quarter of the elements per chunk (about 230 KiB).
    """
    from savedhooks.kernels.fp8 import torch_fp8_dequantize, torch_fp8_quantize
    from savedhooks.memory.scratch import _scratch

    x = torch.randn(32768, 128)
    q, scale = torch_fp8_quantize(x, torch.float8_e4m3fn, "block", 128, False)
    if op != "dequantize":
        seed = torch.tensor(7) if op.startswith("stochastic") else None
        x = x[:8192] if seed is not None else x  # 4 MiB: 256 of its (4096-element) chunks
        scratch = _scratch(lambda: torch_fp8_quantize(x, torch.float8_e4m3fn, "block", 128, False, seed))
    else:
        scratch = _scratch(lambda: torch_fp8_dequantize(q, scale, torch.float32, 128))
    assert 0 < scratch <= 256 * 1024


def _patch_conv_weight_grad(g, x, w):
    return torch.ops.aten.convolution_backward.default(
        g, x, w, [w.shape[0]], [16, 16], [0, 0], [1, 1], False, [0, 0], 1, [False, True, True]
    )[1:]


def _sdpa_backward(go, q, k, v, out, lse):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(go, q, k, v, out, lse, 0.0, False)


def _sdpa_case():
    q, k, v = (torch.randn(4, 4, 197, 64) for _ in range(3))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v)
    return _sdpa_backward, (torch.randn_like(out), q, k, v, out, lse)


SCRATCH_CASES = {  # the vit's patch embedding (weight gradient only) and attention, at its size-1 shapes
    "patch_convolution_backward": lambda: (
        _patch_conv_weight_grad, (torch.randn(4, 256, 14, 14), torch.randn(4, 3, 224, 224), torch.randn(256, 3, 16, 16))
    ),
    "sdpa_backward": _sdpa_case,
}


@pytest.mark.parametrize("case", list(SCRATCH_CASES))
def test_measured_aten_ops_count_their_cpu_scratch(case):
    """The vit's step under inductor with the codec peaks in its patch convolution's backward (module notes)."""
    from savedhooks.memory.scratch import MEASURED_ATEN, _scratch

    fn, args = SCRATCH_CASES[case]()
    gm = make_fx(fn, tracing_mode="fake")(*args)
    (node,) = [n for n in gm.graph.nodes if n.target in MEASURED_ATEN]
    measured_scratch = _scratch(lambda: fn(*args))
    assert sh.memory.op_scratch_bytes(node) == measured_scratch > 0
    # the model of the whole graph: its outputs and the op's scratch over the inputs
    inputs = sum(a.nbytes for a in args)
    predicted = sh.memory.estimate_peak(gm).peak_bytes - inputs
    measured = sh.memory.measure_peak(lambda: gm(*args), device="cpu")
    assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured)


def test_cuda_aten_ops_are_measured_on_their_device_and_count_0_without_a_gpu(monkeypatch):
    """A bias gradient's ``sum(g, [0])`` on CUDA is measured on the GPU (module notes), the same op on CPU is not."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from savedhooks.memory import scratch

    def bias_grad(g):
        return torch.ops.aten.sum.dim_IntList(g, [0], True)

    nodes = {}
    for device in ("cuda", "cpu"):
        with FakeTensorMode():
            gm = make_fx(bias_grad)(torch.empty(2048, 4096, device=device))
        (nodes[device],) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.sum.dim_IntList]
    if not torch.cuda.is_available():
        assert sh.memory.op_scratch_bytes(nodes["cuda"]) == 0  # fake CUDA tensors: nothing to run them on
    calls = []
    monkeypatch.setattr(scratch, "_can_measure", lambda device: True)
    monkeypatch.setattr(scratch, "_measured_aten_scratch", lambda op, frozen: calls.append((op, frozen)) or 12345)
    assert sh.memory.op_scratch_bytes(nodes["cuda"]) == 12345
    assert sh.memory.op_scratch_bytes(nodes["cpu"]) == 0  # no scratch on the CPU: not measured
    # modelled as inductor runs it: inductor compiles the reduction itself (no aten staging buffer)
    assert sh.memory.op_scratch_bytes(nodes["cuda"], fused=True) == 0
    ((op, ((zeros, dims, keep), kwargs)),) = calls
    assert op is torch.ops.aten.sum.dim_IntList and (dims, keep, kwargs) == ((0,), True, ())
    assert zeros == scratch._Zeros((2048, 4096), (4096, 1), torch.float32, str(nodes["cuda"].args[0].meta["val"].device))


def test_a_measured_op_of_data_dependent_size_counts_0():
    """A size with no hint (a mask's count) cannot be rebuilt as zeros: 0, not an error (CPU: the convolution set)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    def masked_conv(x, w):
        rows = x[x[:, 0, 0, 0] > 0]  # a data-dependent batch
        return torch.ops.aten.convolution.default(rows, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)

    with FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True):
        gm = make_fx(masked_conv, tracing_mode="real")(torch.randn(4, 3, 8, 8), torch.randn(2, 3, 3, 3))
    (node,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.convolution.default]
    assert sh.memory.op_scratch_bytes(node) == 0


@pytest.mark.gpu
def test_a_cuda_reduction_across_rows_counts_its_staging_buffer():
    """Measured on the GPU: a tall ``sum(x, [0])`` stages partial sums in torch's allocator: counted as its scratch."""
    from savedhooks.memory.scratch import _scratch

    x = torch.randn(2048, 4096, device="cuda")
    gm = make_fx(lambda x: torch.ops.aten.sum.dim_IntList(x, [0], True), tracing_mode="fake")(x)
    (node,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.sum.dim_IntList]
    measured = _scratch(lambda: x.sum(0, keepdim=True), "cuda")
    assert sh.memory.op_scratch_bytes(node) == measured > 0


def test_storage_key_is_shared_by_views_only_and_none_without_a_storage():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from savedhooks.memory.sizes import storage_key

    x, y = torch.randn(4, 6), torch.randn(4, 6)
    assert storage_key(x) == storage_key(x.t()) == storage_key(x[1:, ::2]) != storage_key(y)
    assert len({storage_key(x), storage_key(x.view(-1)), storage_key(y)}) == 2  # hashable, by storage
    with FakeTensorMode():
        a = torch.empty(8, 8, device="cuda")
        assert storage_key(a) == storage_key(a.t()) != storage_key(torch.empty(8, 8, device="cuda"))
    assert storage_key(torch.eye(3).to_sparse()) is None


def test_cuda_buffers_are_counted_as_the_caching_allocator_rounds_them():
    """torch.cuda.memory_allocated() counts each block rounded up to 512 bytes (0 bytes: no block)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def parts(x):
        return x * 2, x.sum(), x.new_zeros(0)  # 400 bytes, 4 bytes, none

    for device, sizes in (("cuda", [512, 512, 0]), ("cpu", [400, 4, 0])):
        with FakeTensorMode():
            gm = make_fx(parts)(torch.empty(100, device=device))
        memory = sh.memory.build_graph_memory(gm)
        made = [memory.buffers[b].nbytes for b in range(len(memory.buffers)) if not memory.buffers[b].is_input]
        assert made == sizes, (device, made)


def test_peaks_measured_in_turn_count_what_a_later_call_frees_of_an_earlier_ones_blocks():
    held = []

    def forward() -> None:
        held.append(torch.empty(1 << 18))  # 1 MiB "saved"

    def backward() -> None:
        held.clear()  # frees the forward's 1 MiB
        torch.empty(1 << 17).zero_()  # 512 KiB freed at its end: below what the backward started with

    assert sh.memory.measure_peaks(forward, backward, device="cpu") == [1 << 20, 0]
    forward()
    assert sh.memory.measure_peak(backward, device="cpu") == 1 << 19  # alone, the 1 MiB free is not counted
    with pytest.raises(ValueError, match="at least one call"):
        sh.memory.measure_peaks(device="cpu")
