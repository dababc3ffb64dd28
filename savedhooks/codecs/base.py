"""What every codec shares: the Codec base and the pack/unpack driver.

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
* Layout (:mod:`savedhooks.codecs.layout`): codecs work on a 2-D
  ``(rows, cols)`` view in *memory* order; kernels come from
  :mod:`savedhooks.codecs.backends`.
* Under compile without placement the driver stores overlapping views of one
  storage as they are (:mod:`savedhooks.codecs.placement`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from savedhooks.codecs.backends import kernel_backend
from savedhooks.codecs.bits import SignBits
from savedhooks.codecs.placement import decodes_twice, saved_for_an_eager_loss, unpacks_placed
from savedhooks.hooks import HookPair, hook_context, make_hook_pair
from savedhooks.memory.graph import backward_uses

__all__ = ["Codec", "as_codec", "pack_saved", "sign_only_in_backward", "unpack_saved"]

class Codec:
    """Base of all codecs: a frozen-dataclass configuration plus encode / decode.

    Subclasses set ``accepts`` (which saved tensors they pack; others are stored
    as they are), ``encode`` (tensor -> payload pytree) and ``decode`` (payload ->
    tensor of the saved tensor's dtype, shape and strides).
    """

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether this codec packs ``x`` (default: non-empty floating tensors)."""
        return x.is_floating_point() and x.numel() > 0

    @property
    def lossy(self) -> bool:
        """Whether decoding may return other values than were packed (default True: unknown codecs count as lossy).

        :func:`savedhooks.policy` sends a floating tensor to a lossy codec only
        where every backward reader tolerates its error
        (:mod:`savedhooks.codecs.tolerance`); lossless codecs apply everywhere.
        """
        return True

    def encode(self, x: torch.Tensor) -> Any:  # pragma: no cover - abstract
        """The payload kept for backward in place of ``x``: a pytree of tensors and Python values."""
        raise NotImplementedError

    def decode(self, payload: Any) -> torch.Tensor:  # pragma: no cover - abstract
        """The tensor :meth:`encode` packed into ``payload``, with the saved tensor's dtype, shape and strides."""
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
        return _SIGN_ONLY, SignBits(kernel_backend(getattr(codec, "backend", "auto"))).encode(x)
    return index, codec.codecs()[index].encode(x)


def unpack_saved(codec: Codec, packed: tuple[int, Any]) -> torch.Tensor:
    """Invert :func:`pack_saved`."""
    index, payload = packed
    if index == _AS_IS:
        return payload
    if index == _SIGN_ONLY:
        return SignBits(kernel_backend(getattr(codec, "backend", "auto"))).decode(payload)
    return codec.codecs()[index].decode(payload)


def sign_only_in_backward() -> bool:
    """Whether the saved value being packed is only compared with 0 in backward.

    True when, under torch.compile, every backward use of the value (looking
    through ``detach``) is ``threshold_backward(grad, value, 0)``: ReLU's saved
    output. Then 1 bit per element restores the gradient exactly.

    Returns:
        False in eager mode, where there is no backward graph to look at.
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
