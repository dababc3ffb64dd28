"""The zoo's entries: transformers architectures, each built from its library's default config with only sizes shrunk.

Everything but the sizes is as shipped: dropout, ``use_cache`` (True for most
decoders), attention implementation, activation, tied embeddings. The model
runs in train mode and returns its own loss (``labels`` given). Weights are
random (seed :data:`SEED`), inputs drawn with a fixed seed; nothing is
downloaded. :mod:`benchmarks.zoo` measures them.

Two sizes: ``tiny`` (hidden 64, 2 layers: a compile takes tens of seconds on 2
CPU cores; 512 tokens a step, so that saved activations outweigh the parameters
and their gradients) and ``base`` (hidden 256, 4 layers, seq 256, batch 4).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["SEED", "SIZES", "ZOO", "Dims", "ZooModel", "configs_of", "without_dropout"]

# random init only: never reach for the hub, even by accident
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SEED = 0  # weights, inputs, and torch.manual_seed before every step


@dataclasses.dataclass(frozen=True)
class Dims:
    """The sizes an entry shrinks its default config to.

    Attributes:
        layers: transformer layers (each of encoder and decoder for seq2seq).
        hidden: hidden size (``d_model``).
        heads: attention heads.
        kv_heads: key/value heads where the architecture has grouped-query attention.
        intermediate: MLP width.
        vocab: vocabulary size.
        seq: tokens per sequence (encoder and decoder each).
        batch: sequences (or images) per step.
        experts: routed experts of a mixture-of-experts layer.
        image: image side in pixels.
        patch: ViT's patch side.
        stages: stages of the hierarchical vision models (Swin, ConvNeXt).
        window: Swin's attention window side.
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    seq: int
    batch: int
    experts: int
    image: int
    patch: int
    stages: int
    window: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SIZES: dict[str, Dims] = {
    "tiny": Dims(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256, seq=128, batch=4, experts=8,
                 image=64, patch=4, stages=2, window=4),
    "base": Dims(layers=4, hidden=256, heads=4, kv_heads=2, intermediate=688, vocab=2048, seq=256, batch=4,
                 experts=8, image=224, patch=16, stages=2, window=7),
    # a decoder's step where activations dominate (about 0.8 GiB compiled for a Qwen2, 133 MiB of parameters):
    # 2048 tokens, a 16k vocabulary
    "large": Dims(layers=6, hidden=512, heads=8, kv_heads=2, intermediate=1536, vocab=16384, seq=512, batch=4,
                  experts=8, image=224, patch=16, stages=2, window=7),
}  # fmt: skip


def _transformers():
    """Import transformers with its logging down to errors (random-init models warn about unused weights)."""
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def configs_of(config: Any) -> list[Any]:
    """The config and the configs nested in it (MPT's ``attn_config``)."""
    out = [config]
    for value in vars(config).values():
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            out.extend(configs_of(value))
    return out


def without_dropout(config: Any) -> Any:
    """Set every dropout probability of a transformers config (nested ones too) to zero, in place.

    Args:
        config: a ``PretrainedConfig``.

    Returns:
        The same config.
    """
    for c in configs_of(config):
        for key, value in list(vars(c).items()):
            if "drop" in key and isinstance(value, float | int) and not isinstance(value, bool) and value:
                setattr(c, key, 0.0)
    return config


def _tokens(dims: Dims, generator: torch.Generator, length: int | None = None) -> torch.Tensor:
    """Token ids of shape ``(batch, length or seq)`` in ``[4, vocab)``, clear of the low special ids (pad, bos, eos)."""
    return torch.randint(4, dims.vocab, (dims.batch, length or dims.seq), generator=generator)


def _causal(dims: Dims, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A causal LM's inputs: the tokens, and the same tokens as labels (the model shifts them)."""
    ids = _tokens(dims, generator)
    return {"input_ids": ids, "labels": ids.clone()}


def _masked(dims: Dims, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A masked LM's inputs: the tokens, a sixth of them (at least one per row) scored, the rest labelled -100."""
    ids = _tokens(dims, generator)
    scored = torch.rand(ids.shape, generator=generator) < 1 / 6
    scored[:, 0] = True
    return {"input_ids": ids, "labels": torch.where(scored, ids, torch.full_like(ids, -100))}


def _seq2seq(dims: Dims, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A seq2seq LM's inputs: source tokens and target labels (the model makes the decoder's inputs from them)."""
    return {"input_ids": _tokens(dims, generator), "labels": _tokens(dims, generator)}


def _images(dims: Dims, generator: torch.Generator, classes: int) -> dict[str, torch.Tensor]:
    """An image classifier's inputs: random pixels and class labels."""
    pixels = torch.randn(dims.batch, 3, dims.image, dims.image, generator=generator)
    return {"pixel_values": pixels, "labels": torch.randint(0, classes, (dims.batch,), generator=generator)}


def _model_loss(out: Any) -> torch.Tensor:
    """The model's own loss (it was given ``labels``)."""
    return out.loss


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """A zoo entry.

    Attributes:
        name: the key in :data:`ZOO` and the ``--models`` name.
        family: ``decoder``, ``moe``, ``encoder``, ``seq2seq`` or ``vision``.
        config: ``config(dims) -> (config, model class name)``: the default
            config of the model's class with its sizes set to ``dims``.
        inputs: ``inputs(dims, generator, config) -> inputs``: one step's keyword inputs, labels included.
        loss_of: the step's scalar loss from the model's output.
        dropout: the comparisons keep the shipped dropout (same masks in a
            step and its reference under the same seed); False: they zero it.
        note: what the entry keeps from its default config that matters here.
        wrap: turns the built model into the one trained (PEFT's LoRA), or None.
    """

    name: str
    family: str
    config: Callable[[Dims], tuple[Any, str]]
    inputs: Callable[[Dims, torch.Generator, Any], dict[str, torch.Tensor]]
    loss_of: Callable[[Any], torch.Tensor] = _model_loss
    dropout: bool = True
    note: str = ""
    wrap: Callable[[nn.Module], nn.Module] | None = None

    def build(self, size: str = "tiny", dropout: bool = True) -> tuple[nn.Module, dict[str, torch.Tensor]]:
        """The model in train mode (random init, seed :data:`SEED`) and one step's inputs.

        Args:
            size: a key of :data:`SIZES`.
            dropout: keep the config's dropout probabilities; False: set them all to zero.

        Returns:
            ``(model, inputs)``: call ``loss_of(model(**inputs))``.

        Raises:
            KeyError: an unknown size.
        """
        dims = SIZES[size]
        transformers = _transformers()
        config, cls = self.config(dims)
        if not dropout:
            without_dropout(config)
        torch.manual_seed(SEED)
        model = getattr(transformers, cls)(config)
        if self.wrap is not None:
            model = self.wrap(model)
        model.train()
        generator = torch.Generator().manual_seed(SEED)
        return model, self.inputs(dims, generator, config)

    def shipped_dropout(self, size: str = "tiny") -> bool:
        """Whether the default config at ``size`` has a nonzero dropout probability.

        Args:
            size: a key of :data:`SIZES`.

        Returns:
            True where some ``*drop*`` probability of the config is nonzero.

        Raises:
            KeyError: an unknown size.
        """
        _transformers()
        config, _ = self.config(SIZES[size])
        return any(
            "drop" in key and isinstance(v, float | int) and not isinstance(v, bool) and v
            for c in configs_of(config)
            for key, v in vars(c).items()
        )


def _cfg(name: str, cls: str, **sizes: Any) -> tuple[Any, str]:
    """``transformers.<name>(**sizes)``: the default config but for the sizes, and the model class to build."""
    return getattr(_transformers(), name)(**sizes), cls


def _llama_like(name: str, cls: str, **extra: Any) -> Callable[[Dims], tuple[Any, str]]:
    """A Llama-style config (``hidden_size``, ``num_key_value_heads``, ``head_dim``, ...) shrunk to the dims."""

    def config(d: Dims) -> tuple[Any, str]:
        return _cfg(name, cls, num_hidden_layers=d.layers, hidden_size=d.hidden, num_attention_heads=d.heads,
                    num_key_value_heads=d.kv_heads, head_dim=d.head_dim, intermediate_size=d.intermediate,
                    vocab_size=d.vocab, **extra)  # fmt: skip

    return config


def _bert_like(name: str, cls: str) -> Callable[[Dims], tuple[Any, str]]:
    """A config without KV heads (``hidden_size``, ``intermediate_size``, ...) shrunk to the dims."""

    def config(d: Dims) -> tuple[Any, str]:
        return _cfg(name, cls, num_hidden_layers=d.layers, hidden_size=d.hidden, num_attention_heads=d.heads,
                    intermediate_size=d.intermediate, vocab_size=d.vocab)  # fmt: skip

    return config


def _gpt2(d: Dims) -> tuple[Any, str]:
    return _cfg("GPT2Config", "GPT2LMHeadModel", n_layer=d.layers, n_embd=d.hidden, n_head=d.heads, vocab_size=d.vocab)


def _opt(d: Dims) -> tuple[Any, str]:
    return _cfg("OPTConfig", "OPTForCausalLM", num_hidden_layers=d.layers, hidden_size=d.hidden,
                word_embed_proj_dim=d.hidden, num_attention_heads=d.heads, ffn_dim=d.intermediate,
                vocab_size=d.vocab)  # fmt: skip


def _mpt(d: Dims) -> tuple[Any, str]:
    return _cfg("MptConfig", "MptForCausalLM", n_layers=d.layers, d_model=d.hidden, n_heads=d.heads, vocab_size=d.vocab)


def _qwen2_moe(d: Dims) -> tuple[Any, str]:
    return _cfg("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_hidden_layers=d.layers, hidden_size=d.hidden,
                num_attention_heads=d.heads, num_key_value_heads=d.kv_heads, intermediate_size=d.intermediate,
                moe_intermediate_size=d.intermediate // 2, shared_expert_intermediate_size=d.intermediate,
                num_experts=d.experts, vocab_size=d.vocab)  # fmt: skip


def _t5(d: Dims) -> tuple[Any, str]:
    # the default T5Config has no decoder_start_token_id, which shifting the labels needs; T5's checkpoints set
    # it to the pad id, 0
    return _cfg("T5Config", "T5ForConditionalGeneration", num_layers=d.layers, num_decoder_layers=d.layers,
                d_model=d.hidden, d_kv=d.head_dim, d_ff=d.intermediate, num_heads=d.heads, vocab_size=d.vocab,
                decoder_start_token_id=0)  # fmt: skip


def _bart(d: Dims) -> tuple[Any, str]:
    return _cfg("BartConfig", "BartForConditionalGeneration", encoder_layers=d.layers, decoder_layers=d.layers,
                d_model=d.hidden, encoder_attention_heads=d.heads, decoder_attention_heads=d.heads,
                encoder_ffn_dim=d.intermediate, decoder_ffn_dim=d.intermediate, vocab_size=d.vocab)  # fmt: skip


def _vit(d: Dims) -> tuple[Any, str]:
    return _cfg("ViTConfig", "ViTForImageClassification", num_hidden_layers=d.layers, hidden_size=d.hidden,
                num_attention_heads=d.heads, intermediate_size=d.intermediate, image_size=d.image,
                patch_size=d.patch)  # fmt: skip


def _swin(d: Dims) -> tuple[Any, str]:
    # the patch stays Swin's 4; each stage doubles the width and the heads, as shipped
    return _cfg("SwinConfig", "SwinForImageClassification", image_size=d.image, embed_dim=d.hidden // 2,
                depths=[d.layers] * d.stages, num_heads=[d.heads // 2 * 2**i for i in range(d.stages)],
                window_size=d.window)  # fmt: skip


def _convnext(d: Dims) -> tuple[Any, str]:
    return _cfg(
        "ConvNextConfig",
        "ConvNextForImageClassification",
        image_size=d.image,
        num_stages=d.stages,
        hidden_sizes=[d.hidden // 2 * 2**i for i in range(d.stages)],
        depths=[d.layers] * d.stages,
    )


def _lm(dims: Dims, generator: torch.Generator, config: Any) -> dict[str, torch.Tensor]:
    return _causal(dims, generator)


def _mlm(dims: Dims, generator: torch.Generator, config: Any) -> dict[str, torch.Tensor]:
    return _masked(dims, generator)


def _s2s(dims: Dims, generator: torch.Generator, config: Any) -> dict[str, torch.Tensor]:
    return _seq2seq(dims, generator)


def _img(dims: Dims, generator: torch.Generator, config: Any) -> dict[str, torch.Tensor]:
    return _images(dims, generator, config.num_labels)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _lora(model: nn.Module) -> nn.Module:
    """PEFT's LoRA (rank 8, its default config otherwise) on every projection; the base model frozen."""
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=list(LORA_TARGETS)))


_ENTRIES = (
    ZooModel("gpt2", "decoder", _gpt2, _lm),
    ZooModel("llama", "decoder", _llama_like("LlamaConfig", "LlamaForCausalLM"), _lm),
    ZooModel("llama-lora", "decoder", _llama_like("LlamaConfig", "LlamaForCausalLM"), _lm, wrap=_lora,
             note="PEFT LoRA r=8 on every projection, base frozen"),
    ZooModel("qwen2", "decoder", _llama_like("Qwen2Config", "Qwen2ForCausalLM"), _lm),
    ZooModel("qwen3", "decoder", _llama_like("Qwen3Config", "Qwen3ForCausalLM"), _lm, note="q/k RMS norms"),
    ZooModel("mistral", "decoder", _llama_like("MistralConfig", "MistralForCausalLM"), _lm,
             note="sliding window 4096 (longer than seq)"),
    ZooModel("olmo", "decoder", _llama_like("OlmoConfig", "OlmoForCausalLM"), _lm, note="non-parametric layer norm"),
    ZooModel("gemma", "decoder", _llama_like("GemmaConfig", "GemmaForCausalLM"), _lm, note="tied, scaled embeddings"),
    ZooModel("opt", "decoder", _opt, _lm, note="learned positions"),
    ZooModel("mpt", "decoder", _mpt, _lm, note="ALiBi; use_cache False as shipped"),
    ZooModel("gpt-neox", "decoder", _bert_like("GPTNeoXConfig", "GPTNeoXForCausalLM"), _lm,
             note="parallel residual, partial rotary"),
    ZooModel("phi", "decoder", _bert_like("PhiConfig", "PhiForCausalLM"), _lm, note="parallel residual, partial rotary"),
    ZooModel("qwen2-moe", "moe", _qwen2_moe, _lm, note="8 experts, top 4, a shared expert"),
    ZooModel("bert", "encoder", _bert_like("BertConfig", "BertForMaskedLM"), _mlm, note="masked LM"),
    ZooModel("roberta", "encoder", _bert_like("RobertaConfig", "RobertaForMaskedLM"), _mlm, note="masked LM"),
    ZooModel("t5", "seq2seq", _t5, _s2s, note="relative position buckets; decoder start id 0 set"),
    ZooModel("bart", "seq2seq", _bart, _s2s),
    ZooModel("vit", "vision", _vit, _img),
    ZooModel("swin", "vision", _swin, _img, note="shifted windows; drop path 0.1 as shipped"),
    ZooModel("convnext", "vision", _convnext, _img),
)  # fmt: skip

ZOO: dict[str, ZooModel] = {entry.name: entry for entry in _ENTRIES}
