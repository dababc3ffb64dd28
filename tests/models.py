"""Tiny models, reference hooks and graph-capturing backends shared by the tests."""

from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager, boxed_nop

import savedhooks as sh
from savedhooks._torch.version import BUGS, has_bug


def torch_bug(name: str, **kwargs) -> pytest.MarkDecorator:
    """A strict xfail pinning a torch bug of ``savedhooks._torch.version.BUGS`` on the releases that have it.

    On a release that fixed it the test runs as a plain test (and must pass); on
    one that has it, a pass fails the run: the table then lists a fixed bug.
    """
    return pytest.mark.xfail(has_bug(name), strict=True, reason=f"torch {torch.__version__}: {BUGS[name].summary}",
                             **kwargs)  # fmt: skip


# Where inductor's reorder_for_peak_memory gives wrong conv gradients for conv -> relu -> max_pool on
# CPU, with or without hooks (BUGS["reorder_conv_relu_maxpool"], pinned by test_compile.py's
# test_torch_inductor_reorder_bug_conv_relu_maxpool), CNN runs under inductor keep that pass off so
# that they test our hooks, not the torch bug.
INDUCTOR_CNN_OPTIONS = {"reorder_for_peak_memory": False} if has_bug("reorder_conv_relu_maxpool") else {}

POLICY_DB = 25.0  # sh.policy()'s fidelity goal: gradients at >= 25 dB SQNR


def worst_sqnr(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The worst SQNR (dB) of ``got`` against ``want``, gradient by gradient (NaN counts as worst)."""
    return sh.metrics.worst_sqnr(dict(enumerate(want)), dict(enumerate(got)))[0]


@sh.hook
def bf16(x):
    """Round-trip floating tensors through bfloat16; leave other dtypes untouched."""
    if not x.is_floating_point():
        return x
    return x.to(torch.bfloat16)


@bf16.unpack
def bf16(packed):
    return packed.to(torch.float32) if packed.dtype == torch.bfloat16 else packed


def cast_hook(dtype: torch.dtype) -> sh.HookPair:
    """A hook that keeps saved floating tensors in ``dtype``, built from fresh functions."""

    @sh.hook
    def cast(x):
        return x.dtype, (x.to(dtype) if x.is_floating_point() else x)

    @cast.unpack
    def cast(packed):
        orig, y = packed
        return y.to(orig)

    return cast


class Registry:
    """Module-level state a forward sets and resets, as transformers' attention layers do with the kernels registry."""

    def __init__(self) -> None:
        self.active = None


REGISTRY = Registry()  # set to a non-constant inside a forward: torch lets a constant set and restored pass


def mlp(width: int = 16) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 4),
    )  # fmt: skip


def cnn() -> torch.nn.Module:
    """Conv + max pool: max_pool2d_with_indices saves an int64 tensor."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
        torch.nn.Linear(4 * 7 * 7, 3),
    )  # fmt: skip


class TransformerBlock(torch.nn.Module):
    """Pre-norm attention + MLP block (layer norm, sdpa, GELU), as in GPT-2."""

    def __init__(self, dim: int = 64, heads: int = 4, dropout: float | None = None) -> None:
        super().__init__()
        self.heads = heads
        # dropout given (0.0 included), SDPA is passed dropout_p as transformers' models pass it:
        # then it is a random op, whose generator state checkpointing saves for the recompute
        self.dropout = dropout
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.fc, self.out = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        kwargs = {} if self.dropout is None else {"dropout_p": self.dropout}
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))


def transformer(layers: int = 2, dim: int = 64, dropout: float | None = None) -> torch.nn.Module:
    # The head matters: sum(LayerNorm(x)^2) is constant per row, so without it every
    # gradient before the final norm is rounding noise.
    blocks = [TransformerBlock(dim, dropout=dropout) for _ in range(layers)]
    return torch.nn.Sequential(*blocks, torch.nn.LayerNorm(dim), torch.nn.Linear(dim, 16))


class GraphRecorder:
    """torch's aot_eager backend, keeping each compiled graph and, optionally, its first real inputs.

    Graphs run as aot_eager runs them (an Interpreter that drops inputs after last
    use). With ``keep_inputs``, the first call's inputs are kept by reference (not
    cloned, so aliasing between them is what the graph saw), which also keeps them
    alive: leave it off when measuring memory. ``transform(gm, is_backward)``, if
    given, runs on each graph before it is kept (e.g. hook placement).
    """

    def __init__(self, keep_inputs: bool = True, transform=None) -> None:
        self.keep_inputs = keep_inputs
        self.transform = transform
        self.graphs: list[tuple[torch.fx.GraphModule, list]] = []
        self.is_backward: list[bool] = []
        self.codes: list[str] = []  # as compiled (boxed_nop switches the graph to boxed calling code)

    def _compiler(self, is_backward: bool):
        def compile_graph(gm: torch.fx.GraphModule, example_inputs):
            if self.transform is not None:
                self.transform(gm, is_backward)
            self.codes.append(gm.code.strip())
            run_graph = boxed_nop(gm, example_inputs)
            entry = (gm, [])
            self.graphs.append(entry)
            self.is_backward.append(is_backward)

            def run(args):
                if self.keep_inputs and not entry[1]:
                    entry[1].extend(args)
                return run_graph(args)

            run._boxed_call = True
            return run

        return compile_graph

    @property
    def backend(self):
        return functools.partial(aot_eager, fw_compiler=self._compiler(False), bw_compiler=self._compiler(True))


class GraphCapture(GraphRecorder):
    """A :class:`GraphRecorder` for graph shapes: the forward and backward graph code, no inputs."""

    def __init__(self, transform=None) -> None:
        super().__init__(keep_inputs=False, transform=transform)

    def _code(self, backward: bool) -> list[str]:
        return [code for code, b in zip(self.codes, self.is_backward) if b == backward]

    @property
    def fw(self) -> list[str]:
        return self._code(False)

    @property
    def bw(self) -> list[str]:
        return self._code(True)


def train_step(model: torch.nn.Module, fn, x: torch.Tensor, hooks: sh.HookPair | None = None,
               reorder: bool = True) -> None:
    """One step of sum(fn(x)^2): grads cleared, forward (under hooks if given), backward after the block."""
    model.zero_grad(set_to_none=True)
    if hooks is None:
        loss = fn(x).square().sum()
    else:
        with sh.saved_tensors_hooks(hooks, reorder=reorder):
            loss = fn(x).square().sum()
    loss.backward()


def train_step_grads(model: torch.nn.Module, fn, x: torch.Tensor, hooks: sh.HookPair | None = None,
                     reorder: bool = True):
    """Gradients of sum(fn(x)^2) w.r.t. model's parameters, optionally under hooks."""
    train_step(model, fn, x, hooks, reorder)
    return [p.grad.clone() for p in model.parameters()]


def planner_mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    """The planner tests' model, seeded: three Linear-GELU-Linear blocks (64 -> 256 -> 64), and a 512 x 64 input."""
    torch.manual_seed(0)
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)) for _ in range(3)
    ]
    return torch.nn.Sequential(*blocks), torch.randn(512, 64)


def square_mean_loss(y: torch.Tensor) -> torch.Tensor:
    """mean(y^2): the planner tests' loss."""
    return y.square().mean()


def measured_step_peak(model: torch.nn.Module, x: torch.Tensor, hooks: sh.HookPair, backend: str = "aot_eager"):
    """The measured CPU peak of one compiled step under ``hooks`` (after a warm-up step), and its gradients.

    Under aot_eager the compile takes ``sh.backend("aot_eager")`` (the placement plain inductor gets).
    """
    compiled = torch.compile(model, backend=sh.backend("aot_eager") if backend == "aot_eager" else backend)

    def step():
        with sh.saved_tensors_hooks(hooks):
            square_mean_loss(compiled(x)).backward()

    step()
    model.zero_grad(set_to_none=True)
    peak = sh.memory.measure_peak(step, device="cpu")
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return peak, grads
