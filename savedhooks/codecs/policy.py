"""Choose a codec per saved tensor: by dtype, by size, and by the op that made it.

Under ``torch.compile`` the hook context gives the saved value's FX node, so the
policy can keep what is small but precision-critical (normalization statistics)
as it is. In eager mode there is no graph: the policy decides by dtype and size.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch

from savedhooks.codecs.base import ALIAS_OPS, Codec, as_codec
from savedhooks.codecs.bitmask import Bitmask
from savedhooks.codecs.fp8 import Float8
from savedhooks.hooks import hook_context

__all__ = ["DEFAULT_KEEP_OPS", "Policy", "is_statistic_of", "policy", "producing_op"]

# Statistics saved by normalization and fused attention: small, and their error is
# amplified (rstd multiplies every element of a row; the logsumexp of attention
# re-normalizes every probability in backward).
DEFAULT_KEEP_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "native_layer_norm",
    "native_group_norm",
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training",
    "_fused_rms_norm",
)


def _through_aliases(node: torch.fx.Node) -> torch.fx.Node:
    while node.op == "call_function" and node.target in ALIAS_OPS:
        node = node.args[0]
    return node


def producing_op(node: torch.fx.Node) -> str | None:
    """Name of the aten op that produced a saved value, looking through ``detach`` and ``getitem``.

    Args:
        node: the saved value's node in the forward graph.

    Returns:
        The op's overload-packet name (``"native_layer_norm"``), or None when the
        node is not an op call.

    Raises:
        Nothing.
    """
    node = _through_aliases(node)
    while node.op == "call_function" and node.target is operator.getitem:
        node = _through_aliases(node.args[0])
    return _op_name(node.target)


def _op_name(target: Any) -> str | None:
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", None) if packet is not None else getattr(target, "__name__", None)


def is_statistic_of(node: torch.fx.Node, ops: tuple[str, ...]) -> bool:
    """Whether a saved value is a statistic of one of ``ops``.

    A statistic is an output after the first of a multi-output op (layer norm's
    mean and rstd, not its normalized output), or the output of a single-output
    op. Under inductor the op arrives decomposed (``var_mean``, ``rsqrt``, ...):
    then its nodes carry ``meta["original_aten"]``, and a statistic is a value
    smaller than the largest tensor the decomposed op reads.

    Args:
        node: the saved value's node in the forward graph.
        ops: aten overload-packet names.

    Returns:
        True when the value should be kept as it is.

    Raises:
        Nothing.
    """
    node = _through_aliases(node)
    if producing_op(node) in ops:
        index = node.args[1] if node.op == "call_function" and node.target is operator.getitem else None
        return index != 0
    original = node.meta.get("original_aten")
    if _op_name(original) not in ops:
        return False
    if len(original._schema.returns) == 1:
        return True
    return _numel(node) < _largest_input_numel(node, original)


def _numel(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() if isinstance(val, torch.Tensor) else 0


def _largest_input_numel(node: torch.fx.Node, original: Any, limit: int = 64) -> int:
    """Largest tensor read by the nodes decomposed from the same op as ``node``."""
    name = str(original)  # compared by name: the meta holds equal but not always identical op objects
    largest, frontier, seen = 0, [node], set()
    while frontier and len(seen) < limit:
        current = frontier.pop()
        if current in seen:
            continue
        seen.add(current)
        for arg in current.all_input_nodes:
            largest = max(largest, _numel(arg))
            # getitem nodes carry no original_aten: they are structure, walk through them
            if str(arg.meta.get("original_aten")) == name or arg.target is operator.getitem:
                frontier.append(arg)
    return largest


@dataclasses.dataclass(frozen=True)
class Policy(Codec):
    """Configuration of the policy codec (see :func:`policy`)."""

    floating: Codec | None = Float8()
    boolean: Codec | None = Bitmask()
    integer: Codec | None = None
    min_bytes: int = 1024
    keep_ops: tuple[str, ...] = DEFAULT_KEEP_OPS

    def __post_init__(self) -> None:
        for name in ("floating", "boolean", "integer"):
            object.__setattr__(self, name, as_codec(getattr(self, name), f"policy({name}=...)"))
        if not isinstance(self.min_bytes, int) or self.min_bytes < 0:
            raise ValueError(f"policy: min_bytes must be a non-negative int, got {self.min_bytes!r}")
        if isinstance(self.keep_ops, str) or not all(isinstance(op, str) for op in self.keep_ops):
            raise ValueError(f"policy: keep_ops must be a tuple of op names, got {self.keep_ops!r}")
        object.__setattr__(self, "keep_ops", tuple(self.keep_ops))

    def codecs(self) -> tuple[Codec, ...]:
        """The configured codecs, in the fixed order floating, boolean, integer."""
        return tuple(c for c in (self.floating, self.boolean, self.integer) if c is not None)

    def choose(self, x: torch.Tensor) -> int:
        """Pick the codec for ``x`` (index into :meth:`codecs`), or -1 to keep it as is."""
        if x.numel() * x.element_size() < self.min_bytes:
            return -1
        ctx = hook_context()
        if ctx is not None and is_statistic_of(ctx.node, self.keep_ops):
            return -1
        if x.dtype == torch.bool:
            codec = self.boolean
        elif x.is_floating_point():
            codec = self.floating
        else:
            codec = self.integer
        if codec is None or not codec.accepts(x):
            return -1
        return self.codecs().index(codec)


def policy(
    floating: Any = Float8(),
    boolean: Any = Bitmask(),
    integer: Any = None,
    min_bytes: int = 1024,
    keep_ops: tuple[str, ...] = DEFAULT_KEEP_OPS,
):
    """Hooks that pick a codec for each saved tensor.

    Args:
        floating: codec for floating tensors (default fp8 e4m3 block 128), or None.
        boolean: codec for bool tensors (default bitmask), or None.
        integer: codec for integer tensors (default None: stored as they are).
        min_bytes: tensors smaller than this are stored as they are (a kernel
            launch costs more than it saves).
        keep_ops: ops (aten overload-packet names) whose saved statistics are
            stored as they are: the outputs after the first of a multi-output op
            (layer norm's mean and rstd, not its normalized output), the output
            of a single-output op (add ``"_softmax"`` to keep attention
            probabilities). Known only under ``torch.compile``.

    Returns:
        The cached :class:`~savedhooks.HookPair`.

    Raises:
        TypeError: a codec argument is not a savedhooks codec.
        ValueError: ``min_bytes`` or ``keep_ops`` is malformed.
    """
    return Policy(floating, boolean, integer, min_bytes, tuple(keep_ops)).hooks()
