"""Pack only some saved tensors, named by keys that are the same from run to run.

Design notes
------------
* A key names one saved tensor. Under ``torch.compile`` it is the forward graph's
  number (in the order the graphs are traced) and the saved value's node name,
  ``"g0:mm_3"``; names repeat across graphs only. In eager mode (the loss run
  after a compiled model, or no compile at all) it is the pack call's position in
  the forward, ``"eager:12"``. Both are stable across runs of the same model and
  inputs: dynamo retraces the same graphs in the same order, and eager autograd
  saves the same tensors in the same order.
* Keys are handed out while a :func:`keyed_run` is active, by the codecs below
  (their ``choose`` runs once per saved tensor: at trace time under compile, at
  every forward in eager mode). A new key set is a new codec, hence a new hook
  pair, hence a recompile under torch.compile: the hooks are part of the graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from savedhooks.codecs.base import Codec
from savedhooks.hooks import hook_context
from savedhooks.hooks.eager import settle_innermost
from savedhooks.memory.graph import producing_op

__all__ = ["Census", "SavedTensor", "Selected", "keyed_run", "mark_loss"]


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    """One saved tensor that a codec would pack.

    Attributes:
        key: stable name (see the module notes).
        op: the producing op (aten overload-packet name under compile, autograd
            node name without ``Backward0`` in eager mode), or None.
        shape: its shape (concrete sizes; symbolic ones as strings).
        dtype: its dtype.
        bytes: ``numel * element_size`` before packing.
        packed_as: the codec the census's ``inner`` picks for it (None where
            not recorded).
    """

    key: str
    op: str | None
    shape: tuple[int | str, ...]
    dtype: torch.dtype
    bytes: int
    packed_as: Codec | None = None


@dataclasses.dataclass
class _Run:
    eager_calls: int = 0
    graphs: list[torch.fx.Graph] = dataclasses.field(default_factory=list)
    census: list[SavedTensor] = dataclasses.field(default_factory=list)
    loss_from: int | None = None  # the first eager save of the loss (mark_loss), None: not marked

    def saved_by_loss(self, key: str) -> bool:
        """Whether the census key is an eager save made after :func:`mark_loss`."""
        return self.loss_from is not None and key.startswith("eager:") and int(key[6:]) >= self.loss_from


_RUN: _Run | None = None


@contextlib.contextmanager
def keyed_run() -> Iterator[_Run]:
    """Number saved tensors from the start: one forward (and its compiles) per run.

    Returns:
        A context manager yielding the run's state; ``census`` lists what a
        :class:`Census` codec saw.

    Raises:
        RuntimeError: a keyed run is already active (runs do not nest).
    """
    global _RUN
    if _RUN is not None:
        raise RuntimeError("savedhooks.fidelity: keyed runs do not nest")
    _RUN = _Run()
    try:
        yield _RUN
    finally:
        _RUN = None


def mark_loss() -> None:
    """Mark that the loss starts: the eager saves from here on are the loss's (no-op outside a keyed run).

    The tensors the innermost hooks context still holds (``eager_window``) are
    the model's: they are packed first, so that their keys come before the mark.
    """
    if _RUN is not None:
        settle_innermost()
        _RUN.loss_from = _RUN.eager_calls


def _key(x: torch.Tensor) -> tuple[str, str | None]:
    if _RUN is None:
        raise RuntimeError("savedhooks.fidelity codecs only run inside savedhooks.fidelity.keyed_run()")
    ctx = hook_context()
    if ctx is None:
        _RUN.eager_calls += 1
        name = type(x.grad_fn).__name__.removesuffix("Backward0") if x.grad_fn is not None else None
        return f"eager:{_RUN.eager_calls - 1}", name
    index = next((i for i, g in enumerate(_RUN.graphs) if g is ctx.fw_graph), None)
    if index is None:
        _RUN.graphs.append(ctx.fw_graph)
        index = len(_RUN.graphs) - 1
    return f"g{index}:{ctx.node.name}", producing_op(ctx.node)


def concrete_size(s: object) -> int | str:
    """A concrete size: the value, or a symbolic size's hint (dynamic shapes), else its expression.

    Args:
        s: an int or a SymInt.

    Returns:
        The int, the hint's int, or the expression as a string.
    """
    if isinstance(s, int):
        return s
    hint = getattr(getattr(s, "node", None), "hint", None)
    return int(hint) if hint is not None else str(s)


class _Wrapper(Codec):
    """A codec around ``inner`` that holds in eager mode what ``inner`` holds (its savers are then known)."""

    inner: Codec

    @property
    def lossy(self) -> bool:
        """Whether ``inner`` is lossy."""
        return self.inner.lossy

    @property
    def eager_window(self) -> int:
        """``inner``'s eager window (0 when it has none): the same tensors are held, so eager keys line up."""
        return getattr(self.inner, "eager_window", 0)

    def eager_holds(self, x: torch.Tensor) -> bool:
        """Whether ``inner`` holds ``x`` in eager mode (True when it does not say)."""
        holds = getattr(self.inner, "eager_holds", None)
        return holds is None or holds(x)

    def codecs(self) -> tuple[Codec, ...]:
        """``inner``'s codecs."""
        return self.inner.codecs()


@dataclasses.dataclass(frozen=True)
class Census(_Wrapper):
    """Packs nothing; records every saved tensor that ``inner`` would pack, with the codec it would pick."""

    inner: Codec

    def choose(self, x: torch.Tensor) -> int:
        key, op = _key(x)
        # AOTAutograd may trace a hook more than once per saved value: list it once
        index = self.inner.choose(x)
        if index >= 0 and all(t.key != key for t in _RUN.census):
            nbytes, codec = x.numel() * x.element_size(), self.inner.codecs()[index]
            _RUN.census.append(SavedTensor(key, op, tuple(map(concrete_size, x.shape)), x.dtype, int(nbytes), codec))
        return -1


@dataclasses.dataclass(frozen=True)
class Selected(_Wrapper):
    """Applies ``inner`` to the saved tensors named in ``keys`` (or, with ``invert``, to all others)."""

    inner: Codec
    keys: frozenset[str]
    invert: bool = False

    def choose(self, x: torch.Tensor) -> int:
        key, _ = _key(x)
        return self.inner.choose(x) if (key in self.keys) != self.invert else -1
