"""Every architecture transformers ships with a training head, built from its config's defaults with sizes shrunk.

:func:`architectures` walks transformers' auto model mappings for the heads of
:data:`HEADS` (each has a loss from labels); :func:`build` makes one model and
its inputs:

* the config class's defaults, with the size fields of :data:`SIZES` shrunk
  wherever a config (or a config nested in it) has them: width, MLP width,
  layers, heads, KV heads, head dim, vocabulary, experts and the experts per
  token, low-rank attention ranks, image size, convolution widths; per-layer
  lists as long as the shipped layer count are cut to the new one;
* then :data:`OVERRIDES`, a table of per-family sizes where the generic
  shrinking gets a size wrong (an attention width that must divide a stage's
  heads, a hybrid pattern whose period is longer than two layers). The table
  holds sizes only: nothing that changes what the model computes;
* dropout, layer drop and random masking (SpecAugment) at zero, so that
  gradients compare; special token ids moved into the shrunk vocabulary;
* inputs and labels of the shapes the model's main input and head expect,
  drawn from a fixed seed. The model trains in train mode on its own loss.

Nothing is downloaded: weights are random.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from benchmarks.zoo_entries import SEED, _transformers, configs_of, without_dropout

__all__ = ["HEADS", "KINDS", "OVERRIDES", "SIZES", "Architecture", "architectures", "build", "family_kind", "loss_of", "make_inputs", "shrink", "shrunk_config"]

# head -> transformers' auto mapping of the model classes for it
HEADS: dict[str, str] = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "ctc": "MODEL_FOR_CTC_MAPPING_NAMES",
    "speech-seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "semantic-segmentation": "MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES",
    "audio-classification": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
}

# The shrunk sizes: a step's saved activations outweigh the parameters and their gradients.
SIZES: dict[str, int] = {
    "width": 64, "ffn": 128, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 512, "experts": 4, "top_k": 2,
    "image": 64, "batch": 2, "seq": 128, "target": 32, "audio": 8000, "frames": 64, "conv": 32, "rank": 32,
    "source": 128,
}  # fmt: skip

# config field -> the SIZES key it takes (int fields only; a None stays None)
_FIELDS: dict[str, str] = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "n_embed", "dim", "model_dim", "word_embed_proj_dim",
                     "embedding_size", "output_hidden_size"), "width"),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "d_ff", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim",
                     "hidden_dim", "moe_intermediate_size", "shared_expert_intermediate_size", "ffn_hidden_size",
                     "expert_intermediate_size", "mlp_dim"), "ffn"),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers", "decoder_layers",
                     "num_decoder_layers"), "layers"),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads",
                     "decoder_attention_heads"), "heads"),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"), "kv_heads"),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), "experts"),
    **dict.fromkeys(("num_experts_per_tok", "moe_top_k", "num_experts_per_token", "top_k", "moe_k"), "top_k"),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), "rank"),
    **dict.fromkeys(("decoder_hidden_size", "hidden_size_decoder"), "width"),
    "vocab_size": "vocab",
    "image_size": "image",
    "max_source_positions": "source",
}  # fmt: skip
# head-dim fields: width // heads
_HEAD_DIMS = ("head_dim", "kv_channels", "attention_head_size", "d_kv", "qk_nope_head_dim", "v_head_dim")
_ROPE_DIMS = ("qk_rope_head_dim", "rotary_dim")  # at most a head
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
              "cls_token_id", "mask_token_id", "unk_token_id", "forced_eos_token_id")  # fmt: skip
_MASKING = ("mask_time_prob", "mask_feature_prob")

# model_type -> {field: value} applied after the generic shrinking, nested configs included (sizes only).
OVERRIDES: dict[str, dict[str, Any]] = {
    "mamba2": {"num_heads": 8},  # SSM heads x head dim = expand x width
}


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One architecture with one training head.

    Attributes:
        head: a key of :data:`HEADS`.
        model_type: transformers' model type (the config's ``model_type``).
        class_name: the model class for this head (``LlamaForCausalLM``).
    """

    head: str
    model_type: str
    class_name: str

    @property
    def name(self) -> str:
        """``head/model_type``: the sweep's key."""
        return f"{self.head}/{self.model_type}"


def architectures(heads: Iterable[str] | None = None) -> list[Architecture]:
    """The architectures transformers maps to each head, in the mappings' order.

    Args:
        heads: keys of :data:`HEADS` (None: all).

    Returns:
        One :class:`Architecture` per (head, model type); a model type mapped to
        several classes (a tuple) takes the first.

    Raises:
        KeyError: an unknown head.
    """
    from transformers.models.auto import modeling_auto

    out = []
    for head in heads or HEADS:
        mapping = getattr(modeling_auto, HEADS[head])
        for model_type, class_name in mapping.items():
            if isinstance(class_name, (list, tuple)):
                class_name = class_name[0]
            out.append(Architecture(head, model_type, class_name))
    return out


KINDS = ("dense", "MoE", "state-space or hybrid", "encoder", "encoder-decoder", "vision", "speech")
_SPEECH = ("ctc", "speech-seq2seq", "audio-classification")
_VISION = ("image-classification", "semantic-segmentation")
# config fields that only a model with state-space, linear-attention, short-convolution or LRU layers has
_RECURRENT = re.compile(r"ssm|mamba|state_size|d_state|lru_width|^linear_(num|key|value|conv)|conv_L_cache", re.I)
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@functools.cache
def family_kind(arch: Architecture) -> str:
    """What kind of model an architecture is, from its head and its config class's default fields.

    Speech and vision by head; then a model with state-space, linear-attention,
    short-convolution or LRU layers (a config field only they have), a
    mixture of experts (more than one expert), an encoder-decoder (the
    config's ``is_encoder_decoder``, or a seq2seq head), an encoder (masked
    LM); else dense.

    Args:
        arch: the architecture.

    Returns:
        One of :data:`KINDS`.
    """
    if arch.head in _SPEECH:
        return "speech"
    if arch.head in _VISION:
        return "vision"
    try:
        configs = configs_of(_transformers().CONFIG_MAPPING[arch.model_type]())
    except Exception:  # a config that does not build from its defaults: judged by its head alone
        configs = []
    fields = {k: v for c in configs for k, v in vars(c).items()}
    if any(_RECURRENT.search(k) for k in fields):
        return "state-space or hybrid"
    if any(isinstance(fields.get(k), int) and fields[k] > 1 for k in _EXPERTS):
        return "MoE"
    if arch.head == "seq2seq-lm" or fields.get("is_encoder_decoder"):
        return "encoder-decoder"
    return "encoder" if arch.head == "masked-lm" else "dense"


def _size_of(field: str, value: Any, sizes: dict[str, int]) -> Any:
    """The shrunk value of a config field, or ``value`` where the field is not a size we shrink."""
    if value is None and field in ("head_dim", "num_key_value_heads"):  # None: derived from the shipped sizes
        return sizes["width"] // sizes["heads"] if field == "head_dim" else sizes["kv_heads"]
    if isinstance(value, bool) or not isinstance(value, int):
        return value
    if field in _FIELDS:
        key = _FIELDS[field]
        if key == "top_k":
            return min(value, sizes["top_k"])
        if key == "kv_heads":
            return min(value, sizes["kv_heads"]) if value > 1 else value
        return sizes[key] if value > sizes[key] or key in ("width", "heads") else value
    if field in _HEAD_DIMS:
        return sizes["width"] // sizes["heads"]
    if field in _ROPE_DIMS:
        return min(value, sizes["width"] // sizes["heads"])
    return value


def _shrunk_values(config: Any, sizes: dict[str, int]) -> dict[str, Any]:
    """The changed fields of one config (not its nested ones)."""
    changed = {}
    for field, value in vars(config).items():
        if field.startswith("_"):
            continue
        new = _size_of(field, value, sizes)
        if isinstance(value, (list, tuple)) and field in ("conv_dim",):
            new = type(value)(min(v, sizes["conv"]) for v in value)
        if field in _MASKING and isinstance(value, float) and value:
            new = 0.0
        if new is not value and new != value:
            changed[field] = new
    heads = [v for f, v in vars(config).items() if _FIELDS.get(f) == "heads" and isinstance(v, int)]
    for field, value in vars(config).items():  # multi-head attention stays multi-head (low-rank attention needs it)
        if _FIELDS.get(field) == "kv_heads" and isinstance(value, int) and value in heads:
            changed[field] = sizes["heads"]
    return changed


def _token_ids(config: Any, vocab: int) -> dict[str, Any]:
    """Special token ids past the shrunk vocabulary, moved to the low ids (0 to 3) it keeps for them."""
    changed = {}
    for i, field in enumerate(_TOKEN_IDS):
        value = getattr(config, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= vocab:
            changed[field] = min(i, 3)
        elif isinstance(value, (list, tuple)) and any(isinstance(v, int) and v >= vocab for v in value):
            changed[field] = [v if v < vocab else min(i, 3) for v in value]
    return changed


def shrink(default: Any, sizes: dict[str, int] | None = None) -> dict[str, Any]:
    """The keyword arguments that rebuild ``default`` with its sizes shrunk: what the builder changes.

    Args:
        default: a config class's default instance.
        sizes: :data:`SIZES` or a variant of it.

    Returns:
        ``{field: value}``: size fields, special token ids, per-layer lists of
        a hybrid pattern and the layer count, masking probabilities; a nested
        config's changes as a dict of its own values with them applied.
    """
    sizes = dict(SIZES, **(sizes or {}))
    kwargs = _shrunk_values(default, sizes)
    for field, value in vars(default).items():  # nested configs: shrunk as dicts, which config classes accept
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            kwargs[field] = dict(value.to_dict(), **_shrunk_values(value, sizes), **_token_ids(value, sizes["vocab"]))
    kwargs.update(_token_ids(default, sizes["vocab"]))
    kwargs.update(_layer_pattern(default, sizes["layers"]))
    return kwargs


def shrunk_config(model_type: str, sizes: dict[str, int] | None = None) -> Any:
    """The config class's defaults with the sizes shrunk (see the module docstring).

    :func:`shrink`'s arguments rebuild the config (so that the fields the
    class derives from sizes follow), per-layer lists are cut to the new layer
    count, :data:`OVERRIDES` apply, and dropout goes to zero.

    Args:
        model_type: a key of transformers' ``CONFIG_MAPPING``.
        sizes: :data:`SIZES` or a variant of it.

    Returns:
        A ``PretrainedConfig``, dropout and random masking at zero.

    Raises:
        KeyError: an unknown model type.
        Exception: what the config class raises for the shrunk values.
    """
    cls = _transformers().CONFIG_MAPPING[model_type]
    default = cls()
    config = cls(**shrink(default, sizes))
    _cut_layer_lists(default, config)
    for c in configs_of(config):
        for field, value in OVERRIDES.get(getattr(c, "model_type", ""), {}).items():
            setattr(c, field, value)
    return without_dropout(config)


MAX_PATTERN_LAYERS = 8  # a hybrid pattern whose kinds all show within this many layers keeps them all


def _layer_counts(config: Any) -> dict[str, int]:
    return {f: v for f, v in vars(config).items() if _FIELDS.get(f) == "layers" and isinstance(v, int)
            and not isinstance(v, bool)}  # fmt: skip


def _layer_pattern(default: Any, layers: int) -> dict[str, Any]:
    """Layer count and per-layer lists for a hybrid model: the shortest prefix of its shipped pattern holding every kind.

    A per-layer list (or string) of kinds as long as the shipped layer count
    (``layer_types``: sliding and full attention, linear attention, mamba)
    is cut to its first ``n`` entries, ``n`` the fewest that hold each kind
    it has (at least ``layers``, at most :data:`MAX_PATTERN_LAYERS`); the layer
    count follows. Without such a list: ``{}``.
    """
    counts = _layer_counts(default)
    if not counts:
        return {}
    shipped = max(counts.values())
    lists = {f: v for f, v in vars(default).items() if not f.startswith("_") and isinstance(v, (list, tuple, str))
             and len(v) == shipped and shipped > layers and all(isinstance(k, (str, int)) for k in v)}  # fmt: skip
    kinds = [v for v in lists.values() if len(set(v)) > 1 and all(isinstance(k, str) for k in v)]
    if not kinds:
        return {}
    n = max(max(v.index(kind) for kind in set(v)) + 1 for v in kinds)
    n = max(layers, n) if n <= MAX_PATTERN_LAYERS else layers
    out = {f: v[:n] for f, v in lists.items()}
    out.update({f: n for f, v in counts.items() if v == shipped})
    return out


def _cut_layer_lists(default: Any, config: Any) -> None:
    """Per-layer lists of the shipped layer count, cut to the shrunk count (in place, nested configs too)."""
    for before, after in zip(configs_of(default), configs_of(config)):
        layers = [(f, getattr(before, f), getattr(after, f)) for f in _FIELDS if _FIELDS[f] == "layers"
                  and isinstance(getattr(before, f, None), int) and isinstance(getattr(after, f, None), int)]  # fmt: skip
        for field, value in list(vars(after).items()):
            if not isinstance(value, (list, tuple)):
                continue
            for _, old, new in layers:
                if old > new and len(value) == old:
                    setattr(after, field, type(value)(value[:new]))
                    break


# ---------------------------------------------------------------------------------------------------- inputs


def _tokens(generator: torch.Generator, vocab: int, *shape: int) -> torch.Tensor:
    """Token ids in ``[4, vocab)``, clear of the low special ids."""
    return torch.randint(4, vocab, shape, generator=generator)


def _vocab(config: Any) -> int:
    for c in configs_of(config):
        if isinstance(getattr(c, "vocab_size", None), int):
            return c.vocab_size
    raise ValueError(f"{type(config).__name__} has no vocab_size")


def _image_shape(config: Any) -> tuple[int, int, int]:
    for c in configs_of(config):
        size = getattr(c, "image_size", None)
        if size is not None:
            size = size if isinstance(size, int) else tuple(size)[-1]
            return getattr(c, "num_channels", 3), size, size
    return 3, SIZES["image"], SIZES["image"]


def _features(config: Any, batch: int) -> torch.Tensor:
    """Speech features of the shape the encoder takes (mel bins by frames, or frames by features)."""
    generator = torch.Generator().manual_seed(SEED)
    if isinstance(getattr(config, "num_mel_bins", None), int) and isinstance(getattr(config, "max_source_positions", None), int):
        return torch.randn(batch, config.num_mel_bins, 2 * config.max_source_positions, generator=generator)
    per_channel = getattr(config, "input_feat_per_channel", None) or getattr(config, "feature_size", None) or 80
    channels = getattr(config, "input_channels", 1) or 1
    return torch.randn(batch, SIZES["frames"] * 4, per_channel * channels, generator=generator)


def make_inputs(arch: Architecture, config: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    """Inputs and labels of the shapes ``model``'s main input and ``arch.head`` expect, from a fixed seed.

    Args:
        arch: the architecture.
        config: its config.
        model: the built model (its ``main_input_name``).

    Returns:
        Keyword inputs, ``labels`` among them.

    Raises:
        ValueError: a main input this builder does not know.
    """
    generator = torch.Generator().manual_seed(SEED)
    batch, seq = SIZES["batch"], SIZES["seq"]
    main = getattr(model, "main_input_name", "input_ids")
    if main == "input_ids":
        vocab = _vocab(config)
        ids = _tokens(generator, vocab, batch, seq)
        inputs = {"input_ids": ids}
    elif main == "pixel_values":
        inputs = {"pixel_values": torch.randn(batch, *_image_shape(config), generator=generator)}
    elif main == "input_values":
        inputs = {"input_values": torch.randn(batch, SIZES["audio"], generator=generator)}
    elif main == "input_features":
        inputs = {"input_features": _features(config, batch)}
    else:
        raise ValueError(f"{arch.name}: main input {main!r} is not one the sweep makes")
    head = arch.head
    if head == "causal-lm":
        inputs["labels"] = inputs["input_ids"].clone()
    elif head == "masked-lm":
        ids = inputs["input_ids"]
        scored = torch.rand(ids.shape, generator=generator) < 1 / 6
        scored[:, 0] = True
        inputs["labels"] = torch.where(scored, ids, torch.full_like(ids, -100))
    elif head in ("seq2seq-lm", "speech-seq2seq"):
        inputs["labels"] = _tokens(generator, _vocab(config), batch, SIZES["target"])
    elif head == "ctc":
        inputs["labels"] = torch.randint(1, _vocab(config), (batch, 8), generator=generator)
    elif head in ("image-classification", "audio-classification"):
        inputs["labels"] = torch.randint(0, config.num_labels, (batch,), generator=generator)
    elif head == "semantic-segmentation":
        _, height, width = inputs["pixel_values"].shape[1:]
        inputs["labels"] = torch.randint(0, config.num_labels, (batch, height, width), generator=generator)
    return inputs


def build(arch: Architecture, sizes: dict[str, int] | None = None) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model of ``arch`` from its shrunk config, in train mode, and its inputs.

    Args:
        arch: the architecture.
        sizes: :data:`SIZES` or a variant of it.

    Returns:
        ``(model, inputs)``; ``model(**inputs).loss`` is its training loss.

    Raises:
        Exception: what transformers raises building it, or ValueError for an
            input the builder does not know.
    """
    transformers = _transformers()
    config = shrunk_config(arch.model_type, sizes)
    torch.manual_seed(SEED)
    model = getattr(transformers, arch.class_name)(config)
    model.train()
    return model, make_inputs(arch, config, model)


def loss_of(out: Any) -> torch.Tensor:
    """The model's own loss (``labels`` were given)."""
    loss = out["loss"] if isinstance(out, dict) else out.loss
    if loss is None:
        raise ValueError("the model returned no loss for its labels")
    return loss
