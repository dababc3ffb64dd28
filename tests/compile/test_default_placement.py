"""Plain ``torch.compile`` inside ``sh.saved_tensors_hooks`` gets the reorder pass (no backend argument)."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from models import bf16, train_step, train_step_grads, transformer
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import savedhooks as sh
import savedhooks.compiler.api
import savedhooks.compiler.passes
from benchmarks.reorder_inductor import measured_peaks
from savedhooks.codecs.downcast import Downcast
from savedhooks.codecs.fp8 import Float8
from savedhooks.codecs.policy import Policy
from savedhooks.compiler.api import ReorderPass
from savedhooks.compiler.passes import has_hook_chains, is_backward_graph
from savedhooks.fidelity import Census, keyed_run
from savedhooks.memory.fusion import inlined_nodes, is_view
from savedhooks.planner.census import plan_key
from savedhooks.planner.result import Planned


@pytest.fixture(scope="module")
def _results_cache(shared_tmp_dir):
    """One inductor cache for the tests that only read what the compiled step computes or allocates.

    The graphs they have in common compile once (the slowest part of these tests); a test
    opts in with ``@pytest.mark.usefixtures("_results_cache")``. The directory is shared
    by all pytest-xdist workers (inductor writes its cache entries atomically).
    """
    cache = shared_tmp_dir / "default_placement_inductor_cache"
    cache.mkdir(exist_ok=True)
    return cache


@pytest.fixture(autouse=True)
def _fresh_inductor_cache(request, monkeypatch):
    """A cached graph skips post-grad passes: every other test here compiles from scratch."""
    from torch._inductor.utils import fresh_cache

    if "_results_cache" in request.fixturenames:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(request.getfixturevalue("_results_cache")))
        yield
        return
    with fresh_cache():
        yield


class Recorder(CustomGraphPass):
    """A user's post-grad pass: counts the graphs it sees, keeps the backward graphs' node order."""

    def __init__(self) -> None:
        self.calls = 0
        self.backward: list[list[torch.fx.Node]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.calls += 1
        if is_backward_graph(graph):
            self.backward.append(list(graph.nodes))

    def uuid(self) -> str:
        return "tests.Recorder"


def gelu_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 128), torch.nn.GELU(), torch.nn.Linear(128, 1)
    )


def misplaced_unpacks(nodes: list[torch.fx.Node]) -> list[str]:
    """Unpack-chain nodes with something other than unpack chains between them and their first user.

    An unpack chain is what is computed from packed inputs (``*_hook_<i>``
    placeholders) alone; placed right, each chain runs just before the compute
    node that first reads its result. Only nodes that inductor stores are
    judged, and only they count as between: a pointwise node fused into its
    consumers runs in their kernel and a view allocates nothing, wherever
    either stands in the graph (``sink_free`` puts them right before their users).
    """
    fused = inlined_nodes(nodes[0].graph) | {n for n in nodes if is_view(n)}
    chain: set[torch.fx.Node] = set()
    for node in nodes:
        inputs = node.all_input_nodes
        if node.op == "placeholder":
            if savedhooks.compiler.passes._HOOK_VALUE.search(node.name):
                chain.add(node)
        elif node.op == "call_function" and inputs and all(i in chain for i in inputs):
            chain.add(node)
    position = {node: i for i, node in enumerate(nodes)}
    wrong = []
    for node in chain - fused:
        if node.op == "placeholder":  # inputs stay first
            continue
        outside = [position[u] for u in node.users if u not in chain]
        if outside and any(n not in chain and n not in fused for n in nodes[position[node] + 1 : min(outside)]):
            wrong.append(node.name)
    return wrong


def _step_recording(hooks: sh.HookPair, reorder: bool) -> Recorder:
    """One training step of the GELU MLP, compiled with plain torch.compile; a user pass records after ours."""
    model = gelu_mlp()
    compiled = torch.compile(model)
    recorder = Recorder()
    with sh.saved_tensors_hooks(hooks, reorder=reorder):
        slot = inductor_config.post_grad_custom_post_pass
        slot = tuple(slot) if isinstance(slot, tuple) else (() if slot is None else (slot,))
        # without placement torch compiles the backward lazily: have it compiled here, where the recorder is
        with inductor_config.patch(post_grad_custom_post_pass=(*slot, recorder)), \
                functorch_config.patch(force_non_lazy_backward_lowering=True):  # fmt: skip
            loss = compiled(torch.randn(1024, 64)).square().sum()  # activations dominate the peak
    loss.backward()  # after the block: the backward graph must have been placed already
    return recorder


@pytest.mark.slow
@pytest.mark.parametrize("hooks", [sh.fp8(), bf16], ids=["fp8", "user_hook"])
def test_plain_compile_places_each_unpack_right_before_its_first_user(hooks):
    placed = _step_recording(hooks, reorder=True)
    assert len(placed.backward) == 1
    assert has_hook_chains(placed.backward[0][0].graph)
    assert misplaced_unpacks(placed.backward[0]) == []
    if hooks is not bf16:
        return  # torch's order already puts sh.fp8()'s fused dequantize chains next to their users
    torch._dynamo.reset()
    unplaced = _step_recording(hooks, reorder=False)  # torch's order: the casts at the start
    assert len(unplaced.backward) == 1
    assert len(misplaced_unpacks(unplaced.backward[0])) >= 2


@pytest.mark.slow
def test_a_users_post_grad_pass_still_runs_and_the_slot_is_restored():
    user = Recorder()
    with inductor_config.patch(post_grad_custom_post_pass=user):
        with sh.saved_tensors_hooks(sh.fp8()):
            slot = inductor_config.post_grad_custom_post_pass
            assert isinstance(slot, tuple) and slot[0] is user and isinstance(slot[1], ReorderPass)
            assert functorch_config.force_non_lazy_backward_lowering
            assert not inductor_config.allow_buffer_reuse
            with sh.saved_tensors_hooks(sh.bitmask()):  # nested: the pass is not added twice
                assert inductor_config.post_grad_custom_post_pass == slot
            model = gelu_mlp()
            loss = torch.compile(model)(torch.randn(8, 64)).sum()
        assert inductor_config.post_grad_custom_post_pass is user
        assert not functorch_config.force_non_lazy_backward_lowering
        assert inductor_config.allow_buffer_reuse
        loss.backward()
    assert user.calls == 2  # forward and backward
    assert inductor_config.post_grad_custom_post_pass is None


def test_the_opt_out_leaves_inductor_alone():
    with sh.saved_tensors_hooks(sh.fp8(), reorder=False):
        assert inductor_config.post_grad_custom_post_pass is None
        assert not functorch_config.force_non_lazy_backward_lowering
        assert inductor_config.allow_buffer_reuse
    with pytest.raises(TypeError, match="reorder must be a bool"):
        sh.saved_tensors_hooks(sh.fp8(), reorder="yes")


@pytest.mark.slow
def test_graphs_without_hook_chains_are_untouched(monkeypatch):
    reordered = []
    original = savedhooks.compiler.api.reorder_for_memory
    monkeypatch.setattr(savedhooks.compiler.api, "reorder_for_memory",
                        lambda gm, is_backward, **kw: reordered.append(is_backward) or original(gm, is_backward, **kw))
    linear = torch.nn.Linear(16, 16)  # saves only its input and weight: graph inputs, never hooked
    train_step(linear, torch.compile(linear), torch.randn(4, 16), sh.fp8())
    assert reordered == []
    torch._dynamo.reset()
    model = gelu_mlp()
    train_step(model, torch.compile(model), torch.randn(4, 64), sh.fp8())
    assert reordered == [True]  # the backward graph; forward graphs keep inductor's order
    assert not has_hook_chains(torch.fx.symbolic_trace(lambda tangents_1: tangents_1 * 2).graph)


def test_the_cache_key_covers_the_pass_and_its_options():
    uuids = {ReorderPass(forward=f, hooked_only=h).uuid() for f in (False, True) for h in (False, True)}
    assert len(uuids) == 4
    assert ReorderPass(hooked_only=True).uuid() == ReorderPass(hooked_only=True).uuid()


@pytest.mark.slow
def test_inductor_graph_cache_hits_with_the_default_pass(monkeypatch, tmp_path):
    """The slot holds only CustomGraphPasses: inductor caches (no bypass) and hits on a second compile."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    counters = torch._dynamo.utils.counters
    model = gelu_mlp()
    x = torch.randn(8, 64)
    with inductor_config.patch(fx_graph_cache=True, fx_graph_remote_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):  # fmt: skip
        counters.clear()
        train_step(model, torch.compile(model), x, sh.fp8())
        assert counters["inductor"]["fxgraph_cache_miss"] == 2 and counters["inductor"]["fxgraph_cache_bypass"] == 0
        torch._dynamo.reset()
        counters.clear()
        train_step(model, torch.compile(model), x, sh.fp8())
        assert counters["inductor"]["fxgraph_cache_hit"] == 2
        torch._dynamo.reset()
        counters.clear()
        train_step(model, torch.compile(model), x, sh.fp8(), reorder=False)  # another pass slot: another key
        assert counters["inductor"]["fxgraph_cache_hit"] == 0


@pytest.mark.slow
@pytest.mark.usefixtures("_results_cache")
def test_plain_compile_gets_the_measured_backward_peak_of_the_pass():
    """Measured on CPU (deterministic): the default usage as low as sh.backend("inductor"), below torch's order.

    With the opaque op torch's order dequantizes everything at the start (there
    the pass halves the backward peak); the decomposed form fuses each dequantize
    into its consumer, so torch's own order is already lower and the gain smaller.
    """
    x = torch.randn(4096, 64)  # activations dominate
    fw_torch, bw_torch = measured_peaks(gelu_mlp(), "inductor", None, x, reorder=False)
    fw_default, bw_default = measured_peaks(gelu_mlp(), "inductor", None, x, reorder=True)
    fw_backend, bw_backend = measured_peaks(gelu_mlp(), sh.backend("inductor"), None, x)
    assert bw_default == bw_backend
    # forward graphs keep inductor's order; with its reuse pool off they hold no more
    assert fw_default <= min(fw_torch, fw_backend)
    assert bw_default < 0.95 * bw_torch


@pytest.mark.slow
def test_no_freed_dequantized_buffer_is_held_for_reuse():
    """Measured on CPU: inductor's reuse pool (off inside the block) raises the 2-layer transformer's backward peak.

    With the pool, a dequantized activation freed after its matmul stays
    allocated until a later buffer of the same size takes it over (the next
    layer's); freed at its last use, the backward peak is lower with the opaque
    op, which makes each dequantized activation a buffer of its own. The
    decomposed decode is fused into the kernels that read it; with its few ops
    (savedhooks/kernels/fp8_fused.py) inductor does not compute it into a buffer of its own
    here, and the pool costs nothing.
    """
    x = torch.randn(4, 64, 64)  # the smallest batch where the pool costs the opaque op (at 2 it costs about nothing)
    peaks = {}
    for backend in ("aten", "fused"):
        hooks = sh.fp8(backend=backend)
        pool_on = {"allow_buffer_reuse": True}
        _, pool = measured_peaks(transformer(2, 64), "inductor", pool_on, x, reorder=True, hooks=hooks)
        _, default = measured_peaks(transformer(2, 64), "inductor", None, x, reorder=True, hooks=hooks)
        peaks[backend] = (default, pool)
    assert peaks["aten"][0] < 0.95 * peaks["aten"][1], peaks
    assert peaks["fused"][0] <= peaks["fused"][1], peaks


@pytest.mark.slow
@pytest.mark.usefixtures("_results_cache")
def test_gradients_are_unchanged_by_the_default_pass():
    model = gelu_mlp()
    x = torch.randn(4096, 64)  # the measured-peak test's graphs: inductor's FX graph cache serves them
    plain = train_step_grads(model, torch.compile(model), x, sh.fp8(), reorder=False)
    torch._dynamo.reset()
    placed = train_step_grads(model, torch.compile(model), x, sh.fp8())
    for p, q in zip(plain, placed):
        assert torch.equal(p, q)


@pytest.mark.parametrize("hooks", [sh.fp8(), sh.policy()], ids=["fp8", "policy"])
def test_an_eager_loss_keeps_its_log_softmax_and_peaks_no_higher_than_without_hooks(hooks):
    """``cross_entropy(compiled(x), y)`` with the loss eager: its log-softmax is stored as it is.

    The forward holds the log-softmax until the NLL has read it and the backward
    reads it right after, so a packed copy would only be added at the loss's
    peak. The compiled part saves nothing
    (a product with a constant), so the gradient is bit-exact exactly when the
    loss packed nothing.
    """
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(512, 2048))
    targets = torch.randint(0, 2048, (512,))
    compiled = torch.compile(lambda w: w * 2.0, backend="aot_eager")

    def peak_and_grad(context):
        def step():
            with context():
                torch.nn.functional.cross_entropy(compiled(weight), targets).backward()

        step()  # compiles
        weight.grad = None
        peak = sh.memory.measure_peak(step, device="cpu")
        grad, weight.grad = weight.grad, None
        return peak, grad

    peak_without, grad_without = peak_and_grad(contextlib.nullcontext)
    peak_with, grad_with = peak_and_grad(lambda: sh.saved_tensors_hooks(hooks))
    assert torch.equal(grad_with, grad_without)
    assert peak_with <= peak_without


def test_every_codec_stores_an_eager_log_softmax_as_it_is_and_packs_other_eager_tensors():
    x = torch.randn(64, 300, requires_grad=True) * 2  # made by an op that records grad: not a leaf
    log_probs, probs, scaled = x.log_softmax(-1), x.softmax(-1), x * 3
    # the policy's narrow-softmax rule is about rows of at most 256 values: these rows have 300
    for codec in (Float8(), Downcast()):
        assert codec.choose(log_probs) == -1, codec
        assert codec.choose(probs) >= 0 and codec.choose(scaled) >= 0, codec
    # the policy and a plan pack lossy only what readers they know tolerate: outside a hooks context none
    w = torch.randn(300, 8, requires_grad=True)
    for codec in (Policy(), Planned(choices=())):
        assert codec.choose(probs) == -1 and codec.choose(scaled) == -1, codec
        with keyed_run() as run, sh.saved_tensors_hooks(Census(codec).hooks()):
            # mm reads each (a product); the squares' saves show the mm nodes as their savers
            sum((t @ w).square().sum() for t in (log_probs, probs, scaled))
        packed = sorted(t.op for t in run.census if t.shape == (64, 300))
        assert packed == ["Mul", "Softmax"], (codec, packed)  # log_probs kept
    # a plan's explicit choice names its tensor: taken where its readers are known to tolerate it
    planned = Planned(choices=((plan_key(log_probs), "fp8"),))
    assert planned.choose(log_probs) == -1
    with keyed_run() as run, sh.saved_tensors_hooks(Census(planned).hooks()):
        (log_probs @ w).square().sum()
    assert [t.op for t in run.census if t.shape == (64, 300)] == ["LogSoftmax"]


def _fp8_forward(x, w):
    """Four matmuls, then the decomposed fp8 packs of the first three, where torch inlines them."""
    codec = Float8(backend="fused")  # the form inductor gets
    a = torch.mm(x, w)
    b = torch.mm(torch.relu(a), w)
    c = torch.mm(torch.relu(b), w)
    d = torch.mm(torch.relu(c), w)
    return (d, *(part for t in (a, b, c) for part in codec.encode(t)[:2]))


def _hooked_forward_graph(device: str) -> torch.fx.GraphModule:
    """``_fp8_forward`` traced, its payloads named as AOTAutograd names packs, its values on ``device``.

    Traced on the CPU (slicing a fake CUDA tensor asks this CPU build for CUDA), then every node's
    value is replaced by a fake tensor of the same layout on ``device``: what the pass reads.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(_fp8_forward, tracing_mode="fake")(torch.randn(256, 688), torch.randn(688, 688))
    for i, node in enumerate(gm.graph.output_node().all_input_nodes[1:]):
        node.name = f"saved{i // 2}_hook_{i % 2 + 1}"
    with FakeTensorMode():
        for node in gm.graph.nodes:
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor):
                node.meta["val"] = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
    gm.recompile()
    return gm


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_hooked_forward_on_cuda_gets_its_packs_placed_and_a_cpu_one_keeps_inductors_order(device):
    """On CUDA inductor runs each pack kernel it fuses with nothing where torch inlined it, at the end of the
    forward: unplaced, every float32 activation is alive at the forward's end. The fp8 pack's links read the
    tensor side by side (a bitcast view and ``abs``): placement does not treat them as anchors
    (``Problem.chains``), which would have each hold the others back."""
    from savedhooks.schedule import peak_of

    def modelled_peak(gm) -> int:  # as inductor runs the graph: a pack's links fused
        problem, _ = savedhooks.compiler.passes.graph_problem(gm, fused=True)
        return peak_of(problem, list(range(problem.size)))

    gm = _hooked_forward_graph(device)
    chains = savedhooks.compiler.passes.pack_chain_nodes(gm.graph)
    mms = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    relus = [n for n in gm.graph.nodes if n.target is torch.ops.aten.relu.default]
    assert len(mms) == 4 and len(relus) == 3 and not chains & {*mms, *relus}
    assert {n for n in gm.graph.nodes if n.name.startswith("saved")} <= chains
    before, peak = [n.name for n in gm.graph.nodes], modelled_peak(gm)
    ReorderPass(hooked_only=True)(gm.graph)
    order = [n for n in gm.graph.nodes if n.op == "call_function"]
    if device == "cpu":
        assert [n.name for n in gm.graph.nodes] == before
        return
    for source, following in itertools.pairwise(mms[:3]):  # a's and b's packs end before the next matmul
        links = [n for n in order if n in chains and source in n.all_input_nodes]
        assert links and max(order.index(n) for n in links) < order.index(following), gm.code
    assert modelled_peak(gm) < 0.9 * peak  # 0.85x: a, b and their codes no longer alive together
