"""The benchmark models and their generated inputs: random init, nothing downloaded.

Each model is a :class:`Workload`: a module, the keyword inputs of one training
step, the loss, and a switch for activation checkpointing per block. Sizes are
picked so that a step takes about a tenth of a second on 2 CPU cores at
``size=1`` (the default run compiles about 50 times and must stay well under
10 minutes); ``size`` multiplies the batch (so activation memory grows with it
and the parameters do not).

The transformers models are built from small configs (``transformers`` is in the
``bench`` extra); no weights, tokenizers or data sets are fetched.

One model is bigger, so that activations dominate the step's peak: ``gpt2-big``
(hidden 768, 4 layers, seq 512). A step takes seconds and an inductor compile
tens of seconds on 2 CPU cores, so its :class:`Model` entry declares a smaller
default job list (configurations and backends) than the full matrix; flags
given on the command line replace those defaults.

The loss is the same for every model: cross-entropy against soft (float) targets
made with the inputs (next-token one-hots for the language models). Integer
labels would make int64 intermediates inside the step (``nll_loss`` keeps the
masked targets for backward), and torch's own hook path, one ``make_fx``'d
GraphModule pair for every saved tensor, cannot give an int64 tensor back: it
would fail on every model for that reason alone. It still meets the int64
tensors that the models make themselves (max-pool indices, GPT-2's position ids).

The language models run with ``use_cache=False``, as training does (nothing
reads the KV cache; transformers turns it off itself under checkpointing). With
it on, each layer's K and V are forward outputs as well as saved tensors,
which the step's caller holds until it drops the model's outputs.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from savedhooks._torch.dynamo import isolated

__all__ = ["BIG_MODEL_CONFIGS", "MODELS", "Model", "ModelWithLoss", "Workload", "make_workload"]

# random init only: never reach for the hub, even by accident
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclasses.dataclass
class Workload:
    """One model with its inputs.

    Attributes:
        name: the key in :data:`MODELS`.
        description: shape and size, for the report.
        model: the module (train mode, on its device).
        inputs: keyword arguments of one forward call.
        loss_of: turns the module's output into the scalar loss.
        set_checkpointing: turns activation checkpointing per block on or off.
        compiled_loss: the compiled configurations compile the loss with the
            model (:meth:`with_loss`) instead of running it eagerly on the
            compiled model's output.
        isolated: :meth:`compiled_step` compiles with ``isolate_recompiles=True``
            (before torch 2.13: a code object of its own, :func:`savedhooks._torch.dynamo.isolated`),
            so that this copy's compiled code is its own: dynamo otherwise shares
            one set of cache entries among all copies of a model class, and a
            copy compiled under a setting it does not guard on (a
            ``torch._functorch.config`` patch) would run another copy's code.
    """

    name: str
    description: str
    model: nn.Module
    inputs: dict[str, torch.Tensor]
    loss_of: Callable[[Any], torch.Tensor]
    set_checkpointing: Callable[[bool], None]
    compiled_loss: bool = False
    isolated: bool = False

    def loss(self, fn: Callable[..., Any]) -> torch.Tensor:
        """The step's loss through ``fn`` (the module itself or a compiled wrapper of it).

        Args:
            fn: called with :attr:`inputs` as keyword arguments.

        Returns:
            A scalar tensor.

        Raises:
            Whatever ``fn`` raises.
        """
        return self.loss_of(fn(**self.inputs))

    def with_loss(self) -> nn.Module:
        """The model and its loss as one module (``forward(**inputs)`` returns the loss), to compile as one.

        Args:
            None.

        Returns:
            A :class:`ModelWithLoss` sharing :attr:`model`'s parameters.
        """
        return ModelWithLoss(self.model, self.loss_of)

    def compiled_step(self, compile: Callable[[nn.Module], Callable[..., Any]]) -> Callable[[], torch.Tensor]:
        """The step's forward through ``compile`` applied to what :attr:`compiled_loss` says to compile.

        Args:
            compile: e.g. ``functools.partial(torch.compile, backend="inductor")``; where
                :attr:`isolated` is set, the module it gets compiles to code of its own
                (``isolate_recompiles=True``, or its own code object before torch 2.13:
                ``savedhooks._torch.dynamo.isolated``).

        Returns:
            A callable running the forward to the scalar loss.

        Raises:
            Whatever ``compile`` raises.
        """
        module = self.with_loss() if self.compiled_loss else self.model
        if self.isolated:
            module, kwargs = isolated(module)
            compile = functools.partial(compile, **kwargs)
        compiled = compile(module)
        if self.compiled_loss:
            return lambda: compiled(**self.inputs)
        return lambda: self.loss(compiled)


class ModelWithLoss(nn.Module):
    """A model and the loss of its output: what ``torch.compile`` gets when the loss is compiled with the model.

    As a transformers model given labels, or torchtitan's compiled loss: the
    cross-entropy's log-softmax and its product with the targets are fused
    instead of running as eager full-size temporaries.
    """

    def __init__(self, model: nn.Module, loss_of: Callable[[Any], torch.Tensor]) -> None:
        super().__init__()
        self.model, self.loss_of = model, loss_of

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self.loss_of(self.model(**inputs))


class _Blocks(nn.Module):
    """A stem, a list of blocks (checkpointable one by one), and a head."""

    def __init__(self, stem: nn.Module, blocks: list[nn.Module], head: nn.Module) -> None:
        super().__init__()
        self.stem, self.blocks, self.head = stem, nn.ModuleList(blocks), head
        self.checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        return self.head(x)

    def set_checkpointing(self, on: bool) -> None:
        self.checkpointing = on


def _batch(base: int, size: float) -> int:
    return max(1, round(base * size))


def _soft_targets(shape: tuple[int, ...], classes: int, device: str) -> torch.Tensor:
    """One-hot float targets of random classes: ``(*shape, classes)``."""
    return nn.functional.one_hot(torch.randint(0, classes, shape, device=device), classes).float()


def _cross_entropy(targets: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten(0, -2))

    return loss_of


def _classifier(model: _Blocks, name: str, description: str, x: torch.Tensor, classes: int) -> Workload:
    targets = _soft_targets((x.shape[0],), classes, str(x.device))
    return Workload(name, description, model, {"x": x}, _cross_entropy(targets), model.set_checkpointing)


def _mlp(size: float, device: str) -> Workload:
    """An MLP: 4 blocks of Linear(512) + GELU, a 10-way head, batch 2048 x size."""
    width, batch = 512, _batch(2048, size)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(4)]
    model = _Blocks(nn.Identity(), blocks, nn.Linear(width, 10)).to(device)
    x = torch.randn(batch, width, device=device)
    return _classifier(model, "mlp", f"4 x (Linear({width}) + GELU), batch {batch}", x, 10)


def _cnn(size: float, device: str) -> Workload:
    """A small CNN: 3 blocks of conv 3x3 + batch norm + ReLU + max pool, 32 x 32 images, batch 32 x size."""
    batch, channels = _batch(32, size), (3, 32, 64, 128)

    def block(c_in: int, c_out: int) -> nn.Module:
        conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)  # batch norm's shift makes a bias's gradient 0
        return nn.Sequential(conv, nn.BatchNorm2d(c_out), nn.ReLU(), nn.MaxPool2d(2))

    blocks = [block(a, b) for a, b in itertools.pairwise(channels)]
    head = nn.Sequential(nn.Flatten(), nn.Linear(channels[-1] * 4 * 4, 10))
    model = _Blocks(nn.Identity(), blocks, head).to(device)
    x = torch.randn(batch, 3, 32, 32, device=device)
    return _classifier(model, "cnn", f"3 x (conv 3x3 + BN + ReLU + max pool), 32x32, batch {batch}", x, 10)


def _transformers():
    """Import transformers with its logging down to errors (random-init models warn about unused weights)."""
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def _hf(
    name: str, description: str, model: nn.Module, inputs: dict[str, torch.Tensor], targets: torch.Tensor
) -> Workload:
    def set_checkpointing(on: bool) -> None:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x; the old name warns
            if on:
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.activation_checkpointing_disable()
        elif on:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_disable()

    model.train()
    cross_entropy = _cross_entropy(targets)
    return Workload(name, description, model, inputs, lambda out: cross_entropy(out.logits), set_checkpointing)


_VOCAB, _LAYERS, _HIDDEN, _HEADS = 2048, 2, 256, 4


def _token_inputs(batch: int, seq: int, device: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Random token ids and the next tokens' one-hot targets."""
    ids = torch.randint(0, _VOCAB, (batch, seq + 1), device=device)
    return {"input_ids": ids[:, :-1]}, nn.functional.one_hot(ids[:, 1:], _VOCAB).float()


def _gpt2(size: float, device: str) -> Workload:
    """GPT-2 (transformers), 2 layers, hidden 256, 4 heads, vocab 2048, seq 256, batch 2 x size."""
    batch, seq = _batch(2, size), 256
    model = _gpt2_model(_LAYERS, _HIDDEN, _HEADS, seq, device, "sdpa")
    desc = f"{_LAYERS} layers, hidden {_HIDDEN}, seq {seq}, batch {batch}"
    return _hf("gpt2", desc, model, *_token_inputs(batch, seq, device))


def _gpt2_model(layers: int, hidden: int, heads: int, seq: int, device: str, attention: str) -> nn.Module:
    """A random-init GPT-2 LM (vocab 2048, no dropout) with transformers' ``attention`` implementation."""
    transformers = _transformers()
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=_VOCAB, n_positions=seq, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attention,
        use_cache=False,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).to(device)


def _gpt2_big(size: float, device: str) -> Workload:
    """GPT-2 (transformers), 4 layers, hidden 768, 12 heads, vocab 2048, seq 512, batch 1 x size (at least 1).

    About 29 M parameters (116 MiB). Attention is GPT-2's own ("eager": the
    softmax probabilities, 12 x 512 x 512 per layer, are materialized and saved),
    so the forward saves about 235 MiB per sequence in fp32 (eager; inductor
    about 160): saved activations, not the weights, are the largest part of the
    step's peak (the rest: weights, and their gradients made in backward). (With SDPA, torch's checkpointing
    under compile saves the attention's rng state, which torch's inlining of
    saved-tensor hooks cannot place; "sh + checkpoint" would fail.)
    """
    layers, hidden, heads, seq = 4, 768, 12, 512
    batch = _batch(1, size)
    model = _gpt2_model(layers, hidden, heads, seq, device, "eager")
    params = sum(p.numel() * p.element_size() for p in model.parameters()) / 2.0**20
    desc = (f"{layers} layers, hidden {hidden}, {heads} heads, eager attention, seq {seq}, batch {batch}; "
            f"saved activations (~235 MiB per sequence in fp32 eager, attention probabilities included) outweigh "
            f"the {params:.0f} MiB of parameters and are the largest part of the peak")  # fmt: skip
    return _hf("gpt2-big", desc, model, *_token_inputs(batch, seq, device))


def _gpt2_medium(size: float, device: str) -> Workload:
    """GPT-2-medium-sized (transformers): 24 layers, hidden 1024, 16 heads, vocab 2048, seq 1024, batch 4 x size.

    About 300 M parameters: the model of the offload measurements (bf16 autocast,
    ``--device cuda``); too large for the CPU suite, so only ``--device cuda``
    runs it by default.
    """
    layers, hidden, heads, seq = 24, 1024, 16, 1024
    batch = _batch(4, size)
    model = _gpt2_model(layers, hidden, heads, seq, device, "sdpa")
    desc = f"{layers} layers, hidden {hidden}, {heads} heads, seq {seq}, batch {batch}"
    return _hf("gpt2-medium", desc, model, *_token_inputs(batch, seq, device))


def _llama(size: float, device: str) -> Workload:
    """Llama (transformers), 2 layers, hidden 256, 4 heads (2 KV), MLP 688, vocab 2048, seq 256, batch 2 x size."""
    transformers = _transformers()
    batch, seq = _batch(2, size), 256
    config = transformers.LlamaConfig(
        num_hidden_layers=_LAYERS, hidden_size=_HIDDEN, intermediate_size=688, num_attention_heads=_HEADS,
        num_key_value_heads=2, vocab_size=_VOCAB, max_position_embeddings=seq, bos_token_id=0, eos_token_id=0,
        pad_token_id=0, use_cache=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).to(device)
    desc = f"{_LAYERS} layers, hidden {_HIDDEN}, GQA 4/2, seq {seq}, batch {batch}"
    return _hf("llama", desc, model, *_token_inputs(batch, seq, device))


def _vit(size: float, device: str) -> Workload:
    """ViT (transformers), 2 layers, hidden 256, 4 heads, 224 x 224 images in 16 x 16 patches, batch 4 x size."""
    transformers = _transformers()
    batch = _batch(4, size)
    config = transformers.ViTConfig(
        num_hidden_layers=_LAYERS, hidden_size=_HIDDEN, intermediate_size=4 * _HIDDEN, num_attention_heads=_HEADS,
        image_size=224, patch_size=16, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = transformers.ViTForImageClassification(config).to(device)
    inputs = {"pixel_values": torch.randn(batch, 3, 224, 224, device=device)}
    desc = f"{_LAYERS} layers, hidden {_HIDDEN}, 197 tokens, batch {batch}"
    return _hf("vit", desc, model, inputs, _soft_targets((batch,), 10, device))


@dataclasses.dataclass(frozen=True)
class Model:
    """A registered model: how to build it, and which jobs it runs when the command line does not say.

    Attributes:
        build: ``build(size, device) -> Workload``.
        configs: configuration names it runs by default (``None``: all of them).
        backends: compile backends of its compiled configurations by default
            (``None``: the suite's default matrix, see ``benchmarks.run.jobs``).
        cuda_only: run by default only with ``--device cuda`` (named with
            ``--models``, it runs anywhere).
    """

    build: Callable[[float, str], Workload]
    configs: tuple[str, ...] | None = None
    backends: tuple[str, ...] | None = None
    cuda_only: bool = False


# gpt2-big: a step takes seconds and a compile minutes on a CPU, so only these 4 rows;
# enough to compare the codec with recompute and torch's fp8 pass at scale ("sh + checkpoint" with --configs)
BIG_MODEL_CONFIGS = ("compiled", "sh", "checkpoint", "torch fp8")

# gpt2-medium (CUDA): offload against torch's save_on_cpu and checkpointing, all under bf16 autocast
OFFLOAD_CONFIGS = ("bf16", "bf16 checkpoint", "bf16 save_on_cpu", "bf16 offload", "bf16 sh offload")

# name -> Model; make_workload is the entry point
MODELS: dict[str, Model] = {
    "mlp": Model(_mlp), "cnn": Model(_cnn), "gpt2": Model(_gpt2), "llama": Model(_llama), "vit": Model(_vit),
    "gpt2-big": Model(_gpt2_big, configs=BIG_MODEL_CONFIGS, backends=("inductor",)),
    "gpt2-medium": Model(_gpt2_medium, configs=OFFLOAD_CONFIGS, backends=("inductor",), cuda_only=True),
}  # fmt: skip


def make_workload(name: str, size: float = 1.0, device: str = "cpu", seed: int = 0) -> Workload:
    """Build a model and its inputs with fixed seeds.

    Args:
        name: a key of :data:`MODELS`.
        size: batch multiplier.
        device: ``"cpu"`` or ``"cuda"``.
        seed: the seed for weights and inputs.

    Returns:
        A :class:`Workload`.

    Raises:
        KeyError: unknown model name.
        ImportError: a transformers model without transformers installed
            (``pip install -e ".[bench]"``).
    """
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    torch.manual_seed(seed)
    return MODELS[name].build(size, device)
