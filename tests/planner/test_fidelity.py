"""sh.fidelity.sensitivity: which saved tensors hurt the gradients when packed, and the worst-gradient metric."""

import contextlib
import dataclasses
import functools
import math

import pytest
import torch
from models import INDUCTOR_CNN_OPTIONS, POLICY_DB, train_step_grads, transformer, worst_sqnr
from torch import nn

import savedhooks as sh
import savedhooks.compiler.api
from savedhooks.fidelity import Census, Selected, keyed_run


class _Classifier(nn.Module):
    """An MLP and its cross-entropy per sample: a compiled step saves the (batch, 10) log-softmax."""

    def __init__(self, targets: torch.Tensor) -> None:
        super().__init__()
        blocks = [m for _ in range(3) for m in (nn.Linear(256, 256), nn.GELU())]
        self.net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), *blocks, nn.Linear(256, 10))
        self.register_buffer("targets", targets)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -(self.net(x).log_softmax(-1) * self.targets).sum(-1)


def _classifier(batch: int = 1024) -> tuple[nn.Module, torch.Tensor, callable]:
    """A classifier whose loss saves a (batch, 10) log-softmax: the tensor fp8 hurts most.

    Its values share a binade, so their rounding errors have one sign and add up
    over the batch in the gradients (3.5 dB all packed, 30 dB with it kept). The
    cross-entropy is in the model, so that a compiled model saves the
    log-softmax: an eager loss's log-softmax is stored as it is by every codec.
    """
    targets = nn.functional.one_hot(torch.randint(0, 10, (batch,)), 10).float()
    return _Classifier(targets), torch.randn(batch, 64), torch.mean


@pytest.mark.slow
def test_sensitivity_finds_the_loss_heads_log_softmax():
    model, x, loss_fn = _classifier()
    before = [p.detach().clone() for p in model.parameters()]
    report = sh.fidelity.sensitivity(model, (x,), loss_fn=loss_fn, backend="aot_eager", individually=2, verbose=False)

    worst = report.groups[0]
    assert [(t.op, t.shape) for t in worst.tensors] == [("_log_softmax", (1024, 10))]
    assert all(t.key.startswith("g0:") for t in worst.tensors)
    # alone it costs as much as everything packed; keeping it recovers more than 20 dB
    assert worst.only_db < report.all_db + 1
    assert worst.all_but_db > report.all_db + 20
    assert all(g.only_db > worst.only_db + 20 for g in report.groups[1:])
    # bounded cost, stated: the 2 largest alone, the rest by producing op, 2 steps each
    assert report.backward_passes == 2 + 2 * len(report.groups)
    assert sum(len(g.tensors) == 1 for g in report.groups) >= 2
    # the model comes back as it was, without gradients
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    table = report.table()
    assert "_log_softmax" in table and f"{report.backward_passes} backward passes" in table


def test_an_eager_log_softmax_is_stored_as_it_is_by_fp8():
    # in eager mode the same model's log-softmax is the loss's tail: fp8 stores it as it is, and the rest costs
    # little (what sh.fidelity.sensitivity lists is what the codec packs)
    model, x, loss_fn = _classifier()
    report = sh.fidelity.sensitivity(model, (x,), loss_fn=loss_fn, backend=None, individually=2, verbose=False)
    listed = [t for g in report.groups for t in g.tensors]
    assert listed and "LogSoftmax" not in {t.op for t in listed}
    assert report.all_db > 25


def test_sensitivity_keys_name_compiled_nodes_and_groups_stay_within_individually():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    report = sh.fidelity.sensitivity(model, torch.randn(256, 32), backend="aot_eager", individually=8, verbose=False)
    keys = [t.key for g in report.groups for t in g.tensors]
    assert keys and all(k.startswith("g0:") for k in keys) and len(set(keys)) == len(keys)
    assert all(len(g.tensors) == 1 for g in report.groups)  # fewer than 8 saved: each alone
    assert {"relu", "tanh"} <= {g.op for g in report.groups}
    assert all(20 < g.only_db < 80 for g in report.groups)  # packed lossily, not broken


@pytest.mark.slow
def test_a_model_compiles_again_after_sensitivity():
    """Its compiles would leave the model's code past dynamo's recompile limit: the next compile would run eagerly."""
    blocks = [nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)) for _ in range(3)]
    model, x = nn.Sequential(*blocks), torch.randn(256, 64)
    report = sh.fidelity.sensitivity(model, x, backend="aot_eager", individually=8, verbose=False)
    assert report.backward_passes > torch._dynamo.config.recompile_limit
    captured = torch._dynamo.utils.counters["stats"]["calls_captured"]
    with sh.saved_tensors_hooks(sh.fp8()):
        torch.compile(model, backend=sh.backend("aot_eager"))(x).sum().backward()
    assert torch._dynamo.utils.counters["stats"]["calls_captured"] > captured


def test_sensitivity_rejects_bad_arguments():
    model, x, _ = _classifier(8)
    with pytest.raises(ValueError, match="individually"):
        sh.fidelity.sensitivity(model, (x,), individually=-1)
    with pytest.raises(TypeError, match="codec"):
        sh.fidelity.sensitivity(model, (x,), codec="fp8")
    with pytest.raises(TypeError, match="Module"):
        sh.fidelity.sensitivity(lambda x: x, (x,))
    with pytest.raises(ValueError, match="no floating tensor"):
        sh.fidelity.sensitivity(_IntOutput(), (torch.randn(2, 4),), backend=None, verbose=False)


class _IntOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).argmax(-1)


def test_selected_codec_needs_a_keyed_run_and_runs_do_not_nest():
    codec = Selected(sh.codecs.Float8(), frozenset())
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="keyed_run"), sh.saved_tensors_hooks(codec.hooks()):
        (x.exp() * 2).sum()
    with keyed_run(), pytest.raises(RuntimeError, match="nest"), keyed_run():
        pass


def test_worst_sqnr_skips_noise_and_ranks_nan_worst():
    big = torch.randn(100)
    noise = torch.full((3,), 1e-9)
    reference = {"w": big, "noise": noise, "frozen": None}
    # noise is "wrong" by 100 %, but its reference is rounding noise: skipped
    db, name = sh.metrics.worst_sqnr(reference, {"w": big * 1.01, "noise": -noise})
    assert name == "w" and db == pytest.approx(40.0, abs=0.01)
    nan = big.clone()
    nan[3] = float("nan")
    assert math.isnan(sh.metrics.worst_sqnr(reference, {"w": nan, "noise": noise})[0])
    assert sh.metrics.worst_sqnr(reference, {"w": big, "noise": noise}) == (math.inf, "w")
    with pytest.raises(ValueError, match="no approximation"):
        sh.metrics.worst_sqnr(reference, {"noise": noise})
    inf = big.clone()
    inf[0] = float("inf")
    assert sh.fidelity.sqnr(big, inf) == -math.inf


# --- the policy's rules, from the sensitivity evidence ------------------------------------------


def _census(codec, fn, *inputs) -> list[tuple]:
    """Shapes of the saved tensors that ``codec`` would pack in one forward of ``fn``."""
    with keyed_run() as run, sh.saved_tensors_hooks(Census(codec).hooks()):
        fn(*inputs)
    return [t.shape for t in run.census]


@pytest.mark.slow
def test_policy_keeps_the_narrow_loss_head_and_beats_fp8():
    model, x, loss_fn = _classifier()
    fp8 = sh.fidelity.sensitivity(model, (x,), loss_fn=loss_fn, backend="aot_eager", individually=0, verbose=False)
    policy = sh.fidelity.sensitivity(
        model, (x,), codec=sh.policy(), loss_fn=loss_fn, backend="aot_eager", individually=0, verbose=False
    )
    assert fp8.all_db < 10 and policy.all_db > fp8.all_db + 15
    assert (1024, 10) not in [t.shape for g in policy.groups for t in g.tensors]
    # the narrow-softmax rule alone keeps it (without the rule on size relative to the graph's largest saved
    # tensor, which keeps this small one too); with rows of at most 8 values it is packed
    try:
        for narrow_softmax, packed in ((256, False), (8, True)):
            torch._dynamo.reset()
            step = functools.partial(lambda fn: loss_fn(fn(x)).backward(), torch.compile(model, backend="aot_eager"))
            census = _census(sh.codecs.Policy(narrow_softmax=narrow_softmax, relative_bytes=0.0), step)
            assert ((1024, 10) in census) == packed, narrow_softmax
    finally:
        torch._dynamo.reset()


class _EagerAttentionClassifier(nn.Module):
    """Attention written out (softmax, then a matrix product with the values) over 16 positions, and a
    10-class loss head in the model: two softmaxes narrower than the policy's 256, one of them a loss head."""

    def __init__(self):
        super().__init__()
        self.qkv, self.head = nn.Linear(32, 96), nn.Linear(32, 10)

    def forward(self, x, target):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        probs = torch.softmax(q @ k.transpose(-1, -2) / 32**0.5, dim=-1)
        return nn.functional.cross_entropy(self.head((probs @ v).mean(1)), target)


def test_policy_packs_attention_probabilities_however_short_the_sequence_and_keeps_the_loss_head():
    model, x, target = _EagerAttentionClassifier(), torch.randn(8, 16, 32), torch.randint(0, 10, (8,))
    try:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager")
        step = functools.partial(lambda fn: fn(x, target).backward(), compiled)
        census = _census(sh.codecs.Policy(min_bytes=0, relative_bytes=0.0), step)
    finally:
        torch._dynamo.reset()
    assert (8, 16, 16) in census and (8, 10) not in census, census


class _Rotary(nn.Module):
    """A batch-independent (T, C) table multiplies every sequence, as rotary embeddings do (a gelu, not
    sin: the table's argument would otherwise be kept as a periodic function's, whatever its size)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(128, 128)
        self.register_buffer("freq", torch.randn(1, 128))

    def forward(self, x):
        positions = torch.arange(x.shape[1], dtype=x.dtype).view(-1, 1)
        table = nn.functional.gelu(positions @ self.freq)  # from a matmul: saved, not recomputed in backward
        return nn.functional.gelu(self.lin(x) * table)


class _Pooled(nn.Module):
    """A classifier on the mean of a sequence: its few pooled rows are all the head's weight gradient sums."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(128, 128), nn.Linear(128, 8)

    def forward(self, x):
        return self.head(nn.functional.gelu(self.body(x)).mean(1))


def test_eager_policy_keeps_what_is_small_next_to_the_largest_tensor_saved_so_far():
    torch.manual_seed(0)
    model, x = _Pooled(), torch.randn(4, 512, 128)  # pooled rows 2 KiB, activations 1 MiB

    def step(x):
        return model(x).square().sum()  # a later save finds the head that saved the pooled rows

    assert sorted(_census(sh.codecs.Policy(), step, x)) == [(2048, 128)]  # the body's output, gelu's input
    assert sorted(_census(sh.codecs.Policy(relative_bytes=0), step, x)) == [(4, 128), (2048, 128)]


def test_policy_keeps_what_is_small_next_to_the_graphs_largest_saved_tensor():
    model, x = _Rotary(), torch.randn(32, 64, 128)  # table 32 KiB, activations 1 MiB
    fn = torch.compile(model, backend="aot_eager")
    packed = _census(sh.codecs.Policy(), fn, x)
    assert packed == [(2048, 128)]
    assert sorted(_census(sh.codecs.Policy(relative_bytes=0), fn, x)) == [(64, 128), (2048, 128)]


class _RotaryAngles(nn.Module):
    """A linear layer rotated by angles up to the sequence length, as rotary embeddings are: the
    partitioner saves the (T, C) angles and recomputes their cosine and sine in the backward."""

    def __init__(self, dim: int = 64, seq: int = 256) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("positions", torch.arange(seq).float())

    def forward(self, x):
        angles = torch.outer(self.positions, self.inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        q = self.lin(x)
        half = q.shape[-1] // 2
        return q * angles.cos() + torch.cat([-q[..., half:], q[..., :half]], dim=-1) * angles.sin()


def test_policy_keeps_angles_whose_sine_and_cosine_the_backward_recomputes():
    torch.manual_seed(0)
    model, x = _RotaryAngles(), torch.randn(8, 256, 64)  # angles 64 KiB: above 1/16 of the 512 KiB output
    fn = torch.compile(model, backend="aot_eager")
    assert _census(sh.codecs.Float8(), lambda: fn(x)) == [(256, 64)]  # the angles are what the graph saves
    want = train_step_grads(model, fn, x)
    fp8 = worst_sqnr(train_step_grads(model, fn, x, sh.fp8()), want)
    policy = worst_sqnr(train_step_grads(model, fn, x, sh.policy()), want)
    assert fp8 < 15 and policy >= POLICY_DB  # measured 9.2 and 45.9 dB: a large angle loses its phase in fp8
    assert _census(sh.codecs.Policy(), lambda: fn(x)) == []  # kept as they are


@pytest.mark.parametrize(
    "kwargs, match",
    [({"narrow_softmax": -1}, "narrow_softmax"), ({"narrow_softmax": True}, "narrow_softmax"),
     ({"relative_bytes": 1.0}, "relative_bytes"), ({"relative_bytes": "1/16"}, "relative_bytes")],
)  # fmt: skip
def test_policy_rejects_bad_rules(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sh.policy(**kwargs)


def _pool_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1),
                         nn.MaxPool2d(2), nn.Flatten(), nn.LazyLinear(4))  # fmt: skip


# planes 32x32 and 16x16 fit int16; 256x256 (65536 indices) needs int32, its pooled 128x128 int16
@pytest.mark.parametrize("side, narrow", [(32, {torch.int16}), (256, {torch.int32, torch.int16})])
def test_policy_narrows_max_pool_indices_losslessly_under_compile(side, narrow, monkeypatch):
    model, x = _pool_net(), torch.randn(2, 3, side, side)
    model(x)  # materialize the lazy layer
    reference = [g.clone() for g in _grads(model, model, x, None)]
    widths = []
    encode = sh.codecs.PoolIndices.encode
    monkeypatch.setattr(
        sh.codecs.PoolIndices, "encode", lambda self, t: widths.append(encode(self, t)[0].dtype) or encode(self, t)
    )
    got = _grads(model, torch.compile(model, backend="aot_eager"), x, sh.policy(floating=None, boolean=None))
    assert set(widths) == narrow and len(widths) >= 2  # both pools' indices (traced once or more each)
    assert all(torch.equal(a, b) for a, b in zip(reference, got))  # lossless: the same gradients, bit for bit


@pytest.mark.slow
def test_policy_packs_inductors_max_pool_offsets_into_bits_losslessly(monkeypatch):
    """Under inductor the pools save int8 window offsets (below 4 for 2 x 2): 2 bits each, 4 per byte."""
    model, x = _pool_net(), torch.randn(2, 3, 16, 16)
    model(x)
    compiled = torch.compile(model, backend="inductor", options=INDUCTOR_CNN_OPTIONS)
    reference = [g.clone() for g in _grads(model, compiled, x, None)]
    packed = []
    encode = sh.codecs.PoolIndices.encode

    def recording_encode(self, t):
        payload = encode(self, t)
        packed.append((t.dtype, t.numel(), payload[0].dtype, payload[0].numel(), payload[1:2]))
        return payload

    monkeypatch.setattr(sh.codecs.PoolIndices, "encode", recording_encode)
    # a cache hit would skip tracing, and with it the spy
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        got = _grads(model, compiled, x, sh.policy(floating=None, boolean=None, min_bytes=0, relative_bytes=0))
    # both pools' offsets (2*8*8*8 and 2*8*4*4 values), 4 per byte
    assert sorted(set(packed)) == [(torch.int8, n, torch.uint8, n // 4, (2,)) for n in (256, 1024)]
    assert all(torch.equal(a, b) for a, b in zip(reference, got))  # lossless: the same gradients, bit for bit


def _grads(model, fn, x, hooks):
    model.zero_grad(set_to_none=True)
    with sh.saved_tensors_hooks(hooks) if hooks is not None else torch.enable_grad():
        fn(x).square().sum().backward()
    return [p.grad for p in model.parameters()]


def test_pool_plane_reads_the_input_plane_of_the_indices_only():
    model, x = _pool_net(), torch.randn(2, 3, 32, 32)
    model(x)
    seen = []

    @sh.hook
    def record(t):
        ctx = sh.hook_context()
        if ctx is not None:
            seen.append((str(t.dtype), sh.codecs.indices.pool_plane(ctx.node)))
        return t

    @record.unpack
    def record(t):
        return t

    with sh.saved_tensors_hooks(record):
        torch.compile(model, backend="aot_eager")(x).sum().backward()
    assert sorted({p for d, p in seen if d == "torch.int64"}) == [16 * 16, 32 * 32]  # traced once or more
    assert all(p is None for d, p in seen if d != "torch.int64")


@pytest.mark.slow
@pytest.mark.parametrize("placement", [True, False], ids=["placement", "opt-out"])
def test_inductor_layout_optimization_keeps_channels_last_copies_that_no_hook_sees(placement, monkeypatch):
    """Under inductor, channels_last copies of a convolution's inputs are saved bytes that no hook sees.

    On CPU inductor runs convolutions channels_last and its forward returns
    channels_last copies of the convolutions' input and weights for the backward.
    They are copies of graph inputs (saved inputs never reach saved-tensor hooks),
    so the policy keeps them whole: with the layout optimization off, what the
    forward leaves alive drops by exactly their float32 bytes. With the hooks'
    placement (the default) the forward returns the image and the weights
    themselves (:mod:`savedhooks.compiler.input_layout`); the opt-out (``reorder=False``)
    leaves inductor's behaviour as it is. The backward copies both weights back
    to channels_last where the forward's layout is optimized. Gradients agree to
    float32 rounding either way.
    """
    torch.manual_seed(0)
    convs = [nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.Conv2d(16, 16, 3, padding=1, bias=False)]
    model = nn.Sequential(convs[0], nn.BatchNorm2d(16), nn.ReLU(), convs[1])
    x = torch.randn(8, 3, 16, 16)
    restored = {}
    restore = savedhooks.compiler.api.restore_input_layout
    monkeypatch.setattr(
        savedhooks.compiler.api, "restore_input_layout", lambda graph: restored.setdefault(layout_now[0], restore(graph))
    )
    layout_now = [None]

    def saved_bytes(layout: bool) -> tuple[int, list[torch.Tensor]]:
        torch._dynamo.reset()
        layout_now[0] = layout
        compiled = torch.compile(model, options={**INDUCTOR_CNN_OPTIONS, "layout_optimization": layout})
        held = []

        def forward():
            with sh.saved_tensors_hooks(sh.policy(), reorder=placement):
                held.append(compiled(x).square().mean())

        with torch._inductor.utils.fresh_cache():  # the pass runs (a cache hit would skip it)
            forward()
            held.pop().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return sh.memory.cpu_memory_trace(forward)[-1], grads

    (saved, grads) = zip(*(saved_bytes(layout) for layout in (True, False)))
    weights = sum(conv.weight.nbytes for conv in convs)
    assert saved[0] - saved[1] == (0 if placement else weights + x.nbytes)
    # the two weights, each once; nothing where the layout is not optimized; no pass with the opt-out
    assert {k: len(v) for k, v in restored.items()} == ({True: 2, False: 0} if placement else {})
    for on, off in zip(*grads):
        assert (on - off).norm() <= 1e-5 * off.norm()


class _Attention(nn.Module):
    """An attention block as transformers writes it: query, key and value projections, fused SDPA, output projection."""

    def __init__(self, dim: int = 128, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, c // self.heads).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(out.transpose(1, 2).reshape(b, t, c))


_CHOSEN: list[tuple[tuple[int, ...], sh.codecs.Codec | None]] = []


@dataclasses.dataclass(frozen=True)
class _Chosen(sh.codecs.Policy):
    """The policy, its choice for every saved tensor recorded in ``_CHOSEN`` as it packs it."""

    def choose(self, x: torch.Tensor) -> int:
        index = super().choose(x)
        _CHOSEN.append((tuple(x.shape), None if index < 0 else self.codecs()[index]))
        return index


def _chosen(fn, x, **rules) -> dict[tuple[int, ...], set]:
    _CHOSEN.clear()
    with sh.saved_tensors_hooks(_Chosen(**rules).hooks()):
        loss = fn(x).sum()
    loss.backward()
    chosen = {}
    for shape, codec in _CHOSEN:
        chosen.setdefault(shape, set()).add(type(codec).__name__ if codec is not None else None)
    return chosen


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:savedhooks hook")
def test_policy_packs_fused_attention_s_value_in_int8_rows_and_keeps_query_key_and_output():
    torch.manual_seed(0)
    model, x = _Attention(), torch.randn(4, 256, 128)
    heads = (4, 4, 256, 32)

    def codecs(shape):
        return sorted(type(c).__name__ for s, c in _CHOSEN if s == shape)

    try:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager")
        # the value: int8 rows; the query and key (an exponent's input in the backward), the output (a
        # cancelling rowsum) and the logsumexp: kept
        assert _chosen(compiled, x) == {heads: {"Int8Rows", None}, (4, 4, 256): {None}}
        assert codecs(heads).count("Int8Rows") * 2 == codecs(heads).count("NoneType")  # the value, of q, k, v, out
        torch._dynamo.reset()
        # attention=None: the value goes to the codec of a product's factor (int8 blocks)
        assert _chosen(torch.compile(model, backend="aot_eager"), x, attention=None)[heads] == {"Int8Blocks", None}
    finally:
        torch._dynamo.reset()
    # eager: the query, key and value are saved before the op runs, as views of the projections' outputs, and
    # told apart by the saved variable of the node that reads them (held until it saves its output); the
    # output, and the output projection's input (its saver is the last node that saves anything before the
    # context exits, and no later save shows it), are kept
    assert _chosen(model, x) == {heads: {None}, (1024, 128): {"Int8Rows", None}}
    assert codecs((1024, 128)) == ["Int8Rows"] + ["NoneType"] * 3
    assert _chosen(model, x, attention=None) == {heads: {None}, (1024, 128): {"Int8Blocks", None}}


def _autocast_grads(model, x, hooks, compiled):
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    fn = torch.compile(model, backend="aot_eager") if compiled else model
    hooked = sh.saved_tensors_hooks(hooks) if hooks is not None else contextlib.nullcontext()
    with torch.autocast("cpu", dtype=torch.bfloat16), hooked:
        y = fn(x)
    y.float().square().mean().backward()
    torch._dynamo.reset()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:savedhooks hook")
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_policy_keeps_autocast_s_weight_copies(compiled):
    """Under bf16 autocast the matmuls save the weights' bf16 copies: kept as they are, the activations packed."""
    torch.manual_seed(0)
    model, x = transformer(2, 64), torch.randn(8, 128, 64)
    weights = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    weights |= {shape[::-1] for shape in weights}
    _CHOSEN.clear()
    got = _autocast_grads(model, x, _Chosen().hooks(), compiled)
    copies = [codec for shape, codec in _CHOSEN if shape in weights]
    packed = [codec for shape, codec in _CHOSEN if shape not in weights and codec is not None]
    assert copies and all(codec is None for codec in copies)
    allowed = (sh.codecs.Float8, sh.codecs.Int8Blocks, sh.codecs.Int8Rows)
    assert packed and all(isinstance(codec, allowed) for codec in packed)
    want = _autocast_grads(model, x, None, compiled)
    names = [name for name, _ in model.named_parameters()]
    assert all(g.isfinite().all() for g in want), [n for n, g in zip(names, want) if not g.isfinite().all()]
    db, worst = sh.metrics.worst_sqnr(dict(zip(names, want)), dict(zip(names, got)))
    assert db >= POLICY_DB, (db, worst)


def test_eager_policy_holds_tensors_until_their_reader_is_known_and_nothing_is_lost():
    torch.manual_seed(0)
    model, x = _Attention(), torch.randn(4, 256, 128)
    want = train_step_grads(model, model, x)
    outside = worst_sqnr(train_step_grads(model, model, x, sh.policy()), want)  # all packed when the context exits
    model.zero_grad(set_to_none=True)
    with sh.saved_tensors_hooks(sh.policy()):  # backward reads what is still held as it is
        model(x).square().sum().backward()
    inside = worst_sqnr([p.grad for p in model.parameters()], want)
    assert outside >= POLICY_DB and inside >= outside
    # a held tensor changed in place before it is packed is refused at backward, as torch refuses it
    lin = nn.Linear(64, 64)
    with sh.saved_tensors_hooks(sh.policy()):
        a = lin(torch.randn(32, 64))
        b = a.sin()  # saves a: held
        a.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        b.sum().backward()


def test_attention_nodes_name_torchs_autograd_nodes():
    from savedhooks.codecs.policy import ATTENTION_NODES, ATTENTION_OPS

    assert len(ATTENTION_NODES) == len(ATTENTION_OPS)
    assert [n for n in ATTENTION_NODES if not hasattr(torch._C._functions, n)] == []
    assert [op for op in ATTENTION_OPS if not hasattr(torch.ops.aten, op)] == []


class _ReturnsWhatItSaves(nn.Module):
    """A wide head whose output is returned and also saved for the backward (a causal LM's logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(128, 128), nn.Linear(128, 4096)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(nn.functional.gelu(self.lin(x)))
        return torch.stack([logits.sum(), logits.square().sum()]), logits


def test_policy_packs_activations_small_only_next_to_a_value_the_forward_returns():
    torch.manual_seed(0)
    model, x = _ReturnsWhatItSaves(), torch.randn(8, 64, 128)  # activations 256 KiB, logits 8 MiB
    try:
        torch._dynamo.reset()
        fn = torch.compile(model, backend="aot_eager")
        packed = _census(sh.codecs.Policy(), lambda: fn(x)[0].sum().backward())
        # the logits are stored as they are (returned); gelu's input and output are packed, not kept as
        # smaller than a sixteenth of the logits
        assert (8 * 64, 4096) not in packed and (8, 64, 4096) not in packed
        assert packed and all(math.prod(s) == 8 * 64 * 128 for s in packed)
    finally:
        torch._dynamo.reset()
