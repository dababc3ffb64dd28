"""The hook contract: what pack and unpack may take and return, checked with errors naming the hook.

Pack takes the saved tensor and returns a pytree of tensors and constants; unpack
takes exactly that and returns one tensor of the saved tensor's dtype, device and
shape; neither modifies its input. torch's own errors do not say which hook broke
the contract, so every check here raises a :class:`HookError` naming it.

What a hook may know while AOTAutograd traces it into compiled graphs: the
graphs (:func:`hook_context`) and whether the compile's graph compilers will
move each unpack to its first use (:func:`placing_requested`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.fx

from savedhooks._torch import pytree
from savedhooks._torch.aot import saved_tensor_hook_context
from savedhooks._torch.tensors import version_counter

__all__ = [
    "HookContext",
    "HookError",
    "HookMismatchError",
    "HookMutationError",
    "HookTypeError",
    "hook_context",
    "placed_compile",
    "placing_requested",
]

# Values a pack function may return besides tensors: torch bakes them into the
# unpack graph as constants, so they must be plain, printable values.
_CONSTANT_TYPES = (
    type(None), bool, int, float, str,
    torch.dtype, torch.device, torch.layout, torch.memory_format,
    torch.SymInt, torch.SymFloat, torch.SymBool,
)  # fmt: skip


class HookError(Exception):
    """A saved-tensor hook breaks the hook contract. The message names the hook."""


class HookTypeError(HookError, TypeError):
    """A hook is not callable, lacks an unpack function, or returns the wrong type."""


class HookMutationError(HookError, RuntimeError):
    """A hook mutated the tensor it was given (pack: the saved tensor; unpack: the payload)."""


class HookMismatchError(HookError, ValueError):
    """Unpack returned a tensor whose dtype, device or shape differs from the saved one."""


@dataclasses.dataclass(frozen=True)
class _HookFunctions:
    name: str
    pack: Callable[[torch.Tensor], Any]
    unpack: Callable[[Any], torch.Tensor]
    config: Any = None
    late_globals: tuple[str, ...] = ()

    def where(self, fn: Callable[..., Any]) -> str:
        code = getattr(fn, "__code__", None)
        return f" ({code.co_filename}:{code.co_firstlineno})" if code else ""

    def error(self, cls: type[HookError], stage: str, problem: str) -> HookError:
        return cls(f"{self.label(stage)}: {stage} {problem}")

    def label(self, stage: str) -> str:
        return f"savedhooks hook {self.name!r}{self.where(self.pack if stage == 'pack' else self.unpack)}"

    def call(self, stage: str, arg: Any) -> Any:
        """Call pack or unpack; an exception from user code gets a note naming the hook."""
        try:
            return (self.pack if stage == "pack" else self.unpack)(arg)
        except HookError:
            raise
        except Exception as e:
            if hasattr(e, "add_note"):  # Python >= 3.11
                e.add_note(f"raised in {stage} of {self.label(stage)}")
            raise


# What unpack must give back, as (dtype, device, shape) with symbolic dims as -1.
# A plain tuple of constants: torch bakes it into the unpack graph (a dataclass
# would become a constructor node in the traced pack graph).
_SavedMeta = tuple[torch.dtype, torch.device, tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class HookContext:
    """Where the saved tensor being packed comes from (compiled mode only).

    Attributes:
        node: the saved value's node in the forward graph; ``node.target`` is the
            producing op and ``node.meta["val"]`` its fake value.
        fw_graph: the forward graph being compiled.
        bw_graph: the backward graph being compiled.
    """

    node: torch.fx.Node
    fw_graph: torch.fx.Graph
    bw_graph: torch.fx.Graph


def hook_context() -> HookContext | None:
    """Return the graph context of the saved tensor being packed, if any.

    Call it inside a pack or unpack function to decide per producing op (for
    example keep layer-norm statistics unpacked). Wraps torch's private
    ``_get_saved_tensor_hook_context`` so that a change there is fixed here once.

    Returns:
        A :class:`HookContext` while AOTAutograd inlines hooks into a compiled
        graph; None in eager mode, where there is no graph.
    """
    state = saved_tensor_hook_context()
    if state is None:
        return None
    node, fw_graph, bw_graph = state
    return HookContext(node=node, fw_graph=fw_graph, bw_graph=bw_graph)


_PLACED: contextvars.ContextVar[bool] = contextvars.ContextVar("savedhooks_placed_compile", default=False)


@contextlib.contextmanager
def placed_compile() -> Iterator[None]:
    """Mark the compiles run inside as ones whose graph compilers place each unpack right before its first use.

    AOTAutograd traces the hooks into the graphs (and torch puts every unpack
    at the start of the backward) before any graph compiler runs, so a codec
    cannot tell from the graphs whether the unpacks will move. A backend whose
    compilers move them (``sh.backend("aot_eager")``) compiles inside this.

    Returns:
        A context manager.
    """
    token = _PLACED.set(True)
    try:
        yield
    finally:
        _PLACED.reset(token)


def placing_requested() -> bool:
    """Whether the running compile is inside :func:`placed_compile`.

    Returns:
        True inside :func:`placed_compile`.
    """
    return _PLACED.get()


def _pack_checked(fns: _HookFunctions, x: torch.Tensor) -> tuple[Any, _SavedMeta]:
    version = version_counter(x)
    packed = fns.call("pack", x)
    if version_counter(x) != version:
        raise fns.error(HookMutationError, "pack", "mutated the saved tensor in place; return a new tensor instead")
    for leaf in pytree.tree_leaves(packed):
        if not isinstance(leaf, (torch.Tensor, *_CONSTANT_TYPES)):
            raise fns.error(
                HookTypeError,
                "pack",
                f"returned a {type(leaf).__name__}; a pack result may hold tensors and constants "
                "(None, bool, int, float, str, dtype, device) in tuples, lists and dicts",
            )
    shape = tuple(d if isinstance(d, int) else -1 for d in x.shape)
    return packed, (x.dtype, x.device, shape)


def _unpack_checked(fns: _HookFunctions, packed_and_meta: tuple[Any, _SavedMeta]) -> torch.Tensor:
    packed, (dtype, device, shape) = packed_and_meta
    tensors = [t for t in pytree.tree_leaves(packed) if isinstance(t, torch.Tensor)]
    versions = [version_counter(t) for t in tensors]
    out = fns.call("unpack", packed)
    if [version_counter(t) for t in tensors] != versions:
        raise fns.error(
            HookMutationError, "unpack", "mutated the packed payload in place; backward may unpack it more than once"
        )
    if not isinstance(out, torch.Tensor):
        raise fns.error(HookTypeError, "unpack", f"must return one torch.Tensor, got {type(out).__name__}")
    if out.dtype != dtype:
        raise fns.error(HookMismatchError, "unpack", f"returned dtype {out.dtype}, the saved tensor was {dtype}")
    if out.device != device:
        raise fns.error(HookMismatchError, "unpack", f"returned a tensor on {out.device}, the saved tensor was on {device}")
    ctx = hook_context()  # under compile: the saved value's symbolic shape
    want = tuple(ctx.node.meta["val"].shape) if ctx is not None else shape
    got = tuple(out.shape)
    if len(got) != len(want) or not all(_same_size(have, size) for have, size in zip(got, want)):
        raise fns.error(HookMismatchError, "unpack", f"returned shape {_hints(got)}, the saved tensor had {_hints(want)}")
    return out


def _hint(size: Any) -> int | None:
    return size if isinstance(size, int) else getattr(size.node, "hint", None)


def _hints(shape: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(_hint(s) if _hint(s) is not None else s for s in shape)


def _same_size(have: Any, want: Any) -> bool:
    """Equal sizes, symbolic ones included, without adding guards.

    Provably equal: yes. Different example values: no. Equal example values but
    not provably equal: accepted (guarding would specialize the graph).
    """
    if want == -1:  # eager meta of a symbolic dim (not reachable in eager mode)
        return True
    if isinstance(have, int) and isinstance(want, int):
        return have == want
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if statically_known_true(have == want):
        return True
    have_hint, want_hint = _hint(have), _hint(want)
    return have_hint is None or want_hint is None or have_hint == want_hint



def _probe(fns: _HookFunctions) -> None:
    """Run the hook once on a small CPU tensor to catch contract errors at decoration.

    Only contract errors are raised: a hook that cannot run on a small CPU tensor
    (device-specific code) is checked when it first runs instead. Values are
    compared too, which catches mutation through ``.data`` (its own version counter).
    """
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    before = x.clone()
    try:
        packed = _pack_checked(fns, x)
        if not torch.equal(x, before):
            raise fns.error(HookMutationError, "pack", "mutated the saved tensor's values (through .data?)")
        payload = [t.clone() for t in pytree.tree_leaves(packed[0]) if isinstance(t, torch.Tensor)]
        _unpack_checked(fns, packed)
        after = [t for t in pytree.tree_leaves(packed[0]) if isinstance(t, torch.Tensor)]
        if any(not torch.equal(a, b) for a, b in zip(after, payload)):
            raise fns.error(HookMutationError, "unpack", "mutated the packed payload's values (through .data?)")
    except HookError:
        raise
    except Exception:  # noqa: BLE001 - not a contract error; the real run decides
        pass
