"""What every codec shares: the Codec base, the pack/unpack driver, memory layout.

Design notes
------------
* A codec is a frozen dataclass (its configuration, checked in ``__post_init__``)
  with ``accepts`` (which saved tensors it packs), ``encode`` and ``decode``.
  ``Codec.hooks()`` turns it into the cached :class:`~savedhooks.HookPair`; the
  pack and unpack functions are ``functools.partial``s over the codec, so the
  pair's fingerprint covers the whole configuration.
* The driver (``pack_saved`` / ``unpack_saved``) tags each payload with the
  index of the codec that made it (-1: stored as is). A policy is a codec with
  several sub-codecs; the tag is a constant, so under compile it is decided per
  saved tensor and baked into the unpack graph.
* Layout: codecs work on a 2-D ``(rows, cols)`` view in *memory* order (the
  innermost dim in memory becomes ``cols``). For any dense tensor, transposed
  or channels_last included, that view needs no copy, and unpack gives back a
  tensor with the original strides by permuting back.
* Under compile without placement the driver stores overlapping views of one
  storage as they are (:mod:`savedhooks.codecs.placement`).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false

from savedhooks.codecs.placement import decodes_twice, inductor_compiling, saved_for_an_eager_loss, unpacks_placed
from savedhooks.hooks import HookPair, hook_context, make_hook_pair
from savedhooks.kernels import triton_available

__all__ = [
    "ALIAS_OPS",
    "BACKENDS",
    "Codec",
    "Layout",
    "as_codec",
    "backward_uses",
    "check_backend",
    "from_rows",
    "inductor_traces",
    "innermost_size",
    "is_broadcast",
    "materializes_better",
    "memory_order",
    "narrow_broadcast",
    "producing_op",
    "to_rows",
    "uses_fused",
    "uses_through_aliases",
    "uses_triton",
]

# Where a codec's kernels come from: Triton on CUDA when it imports ("auto"), always
# the Triton ops ("triton"; on CPU they run the aten reference unless Triton
# interprets), or always the aten reference ("aten"). Same bytes either way.
BACKENDS = ("auto", "triton", "aten")
# Codecs with a decomposed form (plain aten ops inductor fuses) also accept "fused";
# "auto" then picks it while a hook is traced for a compiled graph (see uses_fused).
FUSED = "fused"


@dataclasses.dataclass(frozen=True)
class Layout:
    """How to turn a ``(rows, cols)`` result back into the saved tensor's shape and strides.

    Attributes:
        dims: the tensor's dims ordered outermost to innermost in memory.
        shape: the shape in that order (the shape of the contiguous permuted tensor).
        expand: the saved tensor's shape when it had broadcast (stride-0) dims,
            which were packed once and are expanded again; else ``()``.
    """

    dims: tuple[int, ...]
    shape: tuple[Any, ...]
    expand: tuple[Any, ...] = ()

    def as_constants(self) -> tuple[Any, ...]:
        """Plain tuples, as a pack result may carry them (torch bakes them into the unpack graph)."""
        return (self.dims, self.shape, self.expand)

    @classmethod
    def from_constants(cls, constants: tuple[Any, ...]) -> Layout:
        """Invert :meth:`as_constants`."""
        dims, shape, expand = constants
        return cls(tuple(dims), tuple(shape), tuple(expand))


def to_rows(x: torch.Tensor) -> tuple[torch.Tensor, Layout]:
    """View ``x`` as ``(rows, cols)`` in memory order (copying only if x is not dense).

    Args:
        x: any tensor (0-d included).

    Returns:
        ``(x2d, layout)``: x2d is contiguous; :func:`from_rows` inverts it.

    Raises:
        Nothing.
    """
    if x.dim() == 0:
        return x.reshape(1, 1), Layout((), ())
    expand: tuple[Any, ...] = ()
    if is_broadcast(x):
        # broadcast dims (expanded K/V in grouped-query attention): pack the data once
        expand = tuple(x.shape)
        x = narrow_broadcast(x)
    dims = memory_order(x)
    permuted = x if dims == tuple(range(x.dim())) else x.permute(dims)
    permuted = permuted.contiguous()  # a no-op for dense tensors
    return permuted.view(-1, permuted.shape[-1]), Layout(dims, tuple(permuted.shape), expand)


def is_broadcast(x: torch.Tensor) -> bool:
    """Whether ``x`` has a broadcast dim (stride 0, size above 1), e.g. from ``expand``.

    Args:
        x: any tensor.

    Returns:
        True when some elements of ``x`` share memory.

    Raises:
        Nothing.
    """
    return any(stride == 0 and size != 1 for size, stride in zip(x.shape, x.stride()))


def narrow_broadcast(x: torch.Tensor) -> torch.Tensor:
    """Narrow every broadcast (stride-0) dim of ``x`` to size 1: the data it really holds.

    Args:
        x: any tensor.

    Returns:
        A view of ``x``; ``.expand(x.shape)`` gives ``x`` back.

    Raises:
        Nothing.
    """
    for dim, stride in enumerate(x.stride()):
        if stride == 0:  # narrow, not indexing: indexing sets a device guard (no CUDA on fake tensors)
            x = x.narrow(dim, 0, 1)
    return x


def memory_order(x: torch.Tensor) -> tuple[int, ...]:
    """The dims of ``x`` from outermost to innermost in memory (logical order if x is not dense).

    Args:
        x: a tensor with at least one dim.

    Returns:
        A permutation of ``range(x.dim())``.

    Raises:
        Nothing.
    """
    if x.is_contiguous() or not is_non_overlapping_and_dense_or_false(x):
        return tuple(range(x.dim()))
    # a dense permutation (transposed, channels_last): read it in memory order
    return tuple(sorted(range(x.dim()), key=lambda d: (-x.stride(d), -x.shape[d], d)))


def innermost_size(x: torch.Tensor) -> int:
    """Size of the innermost dim in memory (1 for 0-d tensors).

    Args:
        x: any tensor.

    Returns:
        The number of elements a row of :func:`to_rows` holds.

    Raises:
        Nothing.
    """
    return x.shape[memory_order(x)[-1]] if x.dim() else 1


def from_rows(y: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Invert :func:`to_rows`: reshape ``(rows, cols)`` and permute back to the original strides.

    Args:
        y: contiguous tensor with the original number of elements (any 2-D view of
            the memory-order data, e.g. ``(rows, cols)`` or ``(-1, block)``).
        layout: what :func:`to_rows` returned for the original tensor.

    Returns:
        A view of ``y`` with the original shape (and strides, for dense tensors).

    Raises:
        Nothing.
    """
    if not layout.dims:
        return y.reshape(())
    if layout.dims == tuple(range(len(layout.dims))):
        out = y.view(layout.shape)
    else:
        inverse = [0] * len(layout.dims)
        for position, dim in enumerate(layout.dims):
            inverse[dim] = position
        out = y.view(layout.shape).permute(inverse)
    return out.expand(layout.expand) if layout.expand else out


def check_backend(what: str, backend: Any, fused: bool = False) -> None:
    """Validate a codec's ``backend`` field.

    Args:
        what: the codec's name, for the message.
        backend: the value given.
        fused: the codec has a decomposed form, so ``"fused"`` is valid too.

    Returns:
        None.

    Raises:
        ValueError: ``backend`` is not one of :data:`BACKENDS` (or ``"fused"``), or
            is ``"triton"`` without the triton package.
    """
    choices = BACKENDS + ((FUSED,) if fused else ())
    if backend not in choices:
        raise ValueError(f"{what}: backend must be one of {choices}, got {backend!r}")
    if backend == "triton" and not triton_available():
        raise ValueError(f"{what}: backend='triton' needs the triton package; use 'auto' or 'aten'")


def uses_triton(backend: str, x: torch.Tensor) -> bool:
    """Whether a codec with ``backend`` runs the Triton ops for tensors like ``x``.

    Args:
        backend: one of :data:`BACKENDS`.
        x: the tensor to encode, or the payload to decode (its device decides "auto").

    Returns:
        True for ``"triton"``, and for ``"auto"`` on CUDA when triton imports.

    Raises:
        Nothing.
    """
    return backend == "triton" or (backend == "auto" and x.device.type == "cuda" and triton_available())


def uses_fused(backend: str, x: torch.Tensor | None = None) -> bool:
    """Whether a codec with ``backend`` uses its decomposed form (plain aten ops) rather than its ops.

    Args:
        backend: one of :data:`BACKENDS` or ``"fused"``.
        x: the tensor to encode (None: decided for a float32 one).

    Returns:
        True for ``"fused"``, and for ``"auto"`` while AOTAutograd traces the hook
        into a graph that inductor compiles (:func:`savedhooks.hook_context` is set
        and inductor's compile is on the call stack): inductor fuses the decomposed
        form into the neighbouring kernels. Elsewhere ``"auto"`` keeps the ops: in
        eager mode and under ``aot_eager`` each aten op of the decomposed form would
        run as a full-size pass with full-size temporaries. One exception, measured:
        ``"auto"`` keeps the ops for a 16-bit floating tensor on the CPU
        (:func:`materializes_better`).

    Raises:
        Nothing.
    """
    if backend == FUSED:
        return True
    if backend != "auto" or not inductor_traces():
        return False
    return x is None or not materializes_better(x)


def inductor_traces() -> bool:
    """Whether a hook runs while AOTAutograd traces it into a graph that inductor compiles.

    Returns:
        True when :func:`savedhooks.hook_context` is set and inductor's compile
        is on the call stack.

    Raises:
        Nothing.
    """
    return hook_context() is not None and inductor_compiling()


def materializes_better(x: torch.Tensor) -> bool:
    """A 16-bit floating tensor on the CPU: its opaque decode (a materialized bf16/fp16 tensor) measured lower.

    Under bf16 autocast, inductor fused the decomposed decode of the benchmark
    cnn's conv outputs into the kernels that recompute batch norm in the backward
    and held float32 intermediates of the full shape there: step peak 1.46x of no
    hooks at size 1 (17.8 against 12.2 MiB) and 1.50x at size 8; with the ops,
    1.02x and 0.86x. The mlp, gpt2 and llama measured the same either way, the vit
    0.05 MiB higher (README, "Codec ops that inductor fuses"). Not measured on CUDA.

    Args:
        x: the tensor to encode (only its dtype and device are read).

    Returns:
        True for a bf16 or fp16 tensor on the CPU.

    Raises:
        Nothing.
    """
    return x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)


def kernel_backend(backend: str) -> str:
    """The kernel backend (one of :data:`BACKENDS`) for a codec without a decomposed form.

    Args:
        backend: a codec's ``backend`` field.

    Returns:
        ``backend``, or ``"auto"`` for ``"fused"``.

    Raises:
        Nothing.
    """
    return "auto" if backend == FUSED else backend


class Codec:
    """Base of all codecs: a frozen-dataclass configuration plus encode / decode.

    Subclasses set ``accepts`` (which saved tensors they pack; others are stored
    as they are), ``encode`` (tensor -> payload pytree) and ``decode`` (payload ->
    tensor of the saved tensor's dtype, shape and strides).
    """

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether this codec packs ``x`` (default: non-empty floating tensors)."""
        return x.is_floating_point() and x.numel() > 0

    def encode(self, x: torch.Tensor) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def decode(self, payload: Any) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def choose(self, x: torch.Tensor) -> int:
        """Index into :meth:`codecs` of the codec for ``x``, or -1 to store it as is.

        An eager loss's log-softmax is stored as is: packing it adds its payload
        at the loss's peak (:func:`savedhooks.codecs.placement.saved_for_an_eager_loss`).
        """
        return 0 if self.accepts(x) and not saved_for_an_eager_loss(x, hook_context()) else -1

    def codecs(self) -> tuple[Codec, ...]:
        """The codecs :meth:`choose` picks from (a policy has several)."""
        return (self,)

    def hooks(self) -> HookPair:
        """The cached :class:`HookPair` that applies this codec to saved tensors."""
        return _hooks_for(self)


@functools.cache
def _hooks_for(codec: Codec) -> HookPair:
    pack = functools.partial(pack_saved, codec)
    return make_hook_pair(repr(codec), pack, functools.partial(unpack_saved, codec), codec=codec)


_AS_IS = -1
_SIGN_ONLY = -2
# Ops through which a saved value reaches its real backward users unchanged.
ALIAS_OPS = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def pack_saved(codec: Codec, x: torch.Tensor) -> tuple[int, Any]:
    """Pack one saved tensor: ``(index of the codec used, payload)``.

    Index -1 stores x as is; -2 stores only its sign (see :func:`sign_only_in_backward`).
    Under compile without placement, a value whose decode would hold bytes
    twice is stored as is (:func:`savedhooks.codecs.placement.decodes_twice`).
    """
    ctx = hook_context()
    if ctx is not None and not unpacks_placed() and decodes_twice(ctx):
        return _AS_IS, x
    index = codec.choose(x)
    if index < 0:
        return _AS_IS, x
    if x.is_floating_point() and sign_only_in_backward():
        from savedhooks.codecs.bitmask import SignBits

        return _SIGN_ONLY, SignBits(kernel_backend(getattr(codec, "backend", "auto"))).encode(x)
    return index, codec.codecs()[index].encode(x)


def unpack_saved(codec: Codec, packed: tuple[int, Any]) -> torch.Tensor:
    """Invert :func:`pack_saved`."""
    index, payload = packed
    if index == _AS_IS:
        return payload
    if index == _SIGN_ONLY:
        from savedhooks.codecs.bitmask import SignBits

        return SignBits(kernel_backend(getattr(codec, "backend", "auto"))).decode(payload)
    return codec.codecs()[index].decode(payload)


def uses_through_aliases(nodes: list[torch.fx.Node]) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """The nodes that read ``nodes``, looking through ``detach`` / ``alias``.

    Args:
        nodes: values of one graph.

    Returns:
        ``(user, value it reads)`` pairs, the value being one of ``nodes`` or
        one of their aliases.
    """
    frontier, uses = list(nodes), []
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.target in ALIAS_OPS:
                frontier.append(user)
            else:
                uses.append((user, node))
    return uses


def backward_uses(name: str, bw_graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """The backward nodes that read a saved value, looking through ``detach`` / ``alias``.

    Args:
        name: the saved value's name (a placeholder of ``bw_graph``).
        bw_graph: the backward graph being compiled.

    Returns:
        ``(user, value it reads)`` pairs, the value being the placeholder or one
        of its aliases; empty when no placeholder has that name.
    """
    return uses_through_aliases([n for n in bw_graph.find_nodes(op="placeholder") if n.name == name])


def sign_only_in_backward() -> bool:
    """Whether the saved value being packed is only compared with 0 in backward.

    True when, under torch.compile, every backward use of the value (looking
    through ``detach``) is ``threshold_backward(grad, value, 0)``: ReLU's saved
    output. Then 1 bit per element restores the gradient exactly.

    Args:
        None.

    Returns:
        False in eager mode, where there is no backward graph to look at.

    Raises:
        Nothing.
    """
    ctx = hook_context()
    if ctx is None:
        return False
    uses = backward_uses(ctx.node.name, ctx.bw_graph)
    return bool(uses) and all(
        user.target is torch.ops.aten.threshold_backward.default
        and user.args[1] is value
        and user.args[0] is not value
        and user.args[2] == 0
        for user, value in uses
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


def as_codec(value: Any, what: str) -> Codec | None:
    """Accept a Codec, a HookPair built from one, or None; anything else is a TypeError.

    Args:
        value: what the user passed.
        what: the argument's name, for the error message.

    Returns:
        The codec, or None.

    Raises:
        TypeError: ``value`` is a HookPair from ``@savedhooks.hook`` (no codec
            inside) or not a codec at all.
    """
    if value is None or isinstance(value, Codec):
        return value
    codec = getattr(value, "codec", None) if isinstance(value, HookPair) else None
    if codec is None:
        raise TypeError(
            f"{what} must be a savedhooks codec such as savedhooks.fp8() or savedhooks.bitmask(), "
            f"got {value!r}; hooks written with @savedhooks.hook cannot be nested inside codecs"
        )
    return codec
