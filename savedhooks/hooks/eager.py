"""Running hook pairs: the trampolines their GraphModules call, and the eager-mode rules.

Design notes
------------
* A hook GraphModule's single node calls a *top-level* trampoline (``_run_pack``
  / ``_run_unpack``) with a constant registry key, never the user's function
  directly: the trampoline is importable, so the GraphModule pickles into
  AOTAutograd's cache key. A hook without a stable fingerprint calls a per-pair
  closure instead (:func:`_local_trampoline`), which dies with its graphs.
* Eager mode has no partitioner to filter saved tensors, so the trampoline skips
  what packing cannot free, as the compiled default ("donated": intermediates
  only) does: parameters, other leaves that require grad, floating leaves (the
  input batch) and views of them. Bool masks and int64 indices made in the forward
  are leaves too, and are packed, as under compile.
* Eager autograd saves one tensor several times (relu's output is saved by relu
  and by the next matmul). Inside ``savedhooks.saved_tensors_hooks`` a tensor is
  packed once per version and the payload shared, also with a view that reads all
  of it (relu's ``(B, T, C)`` output and the ``(B*T, C)`` view a matmul saves); the
  cache holds the tensor weakly and is cleared when backward starts unpacking.
* Eager autograd saves a node's inputs before the node exists, so a pack hook
  cannot tell which op reads them. A codec with ``eager_window = n > 0`` has the
  last ``n`` tensors packed in its context that its ``eager_holds(x)`` accepts
  (default: all) held as they are and packed late:
  when an op that also saves an output saves it (its inputs were saved just
  before), the held tensors that are inputs of that op's autograd node (directly
  or through a view) learn it as a reader, and the codec sees those readers
  while packing them (:func:`eager_readers`; fused attention's query, key and
  value). Held tensors are packed when ``n`` newer ones are held, when the
  context exits, or not at all when backward reads them first.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import torch

from savedhooks._torch import pytree
from savedhooks._torch.fixes import align_rng_state_names
from savedhooks._torch.tensors import base_of, is_traced, is_view, version_counter
from savedhooks.hooks.contract import HookError, _HookFunctions, _pack_checked, _unpack_checked, hook_context
from savedhooks.memory.sizes import storage_key


class _Passthrough:
    """Eager-mode marker: the saved tensor was not packed (a leaf or a view of one)."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.version = version_counter(tensor)


class _Aliasing:
    """Eager-mode wrapper of a payload that holds the saved tensor's storage.

    With a pack hook active, torch no longer checks that a saved tensor was not
    modified in place before backward; a payload that aliases it must do that itself.
    """

    __slots__ = ("packed", "tensor", "version")

    def __init__(self, packed: Any, tensor: torch.Tensor) -> None:
        self.packed, self.tensor, self.version = packed, tensor, version_counter(tensor)


class _Held:
    """Eager-mode payload of a tensor held as it is until its readers are known (``eager_window``)."""

    __slots__ = ("tensor", "version", "edge", "readers", "packed")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.version = version_counter(tensor)
        self.edge = (tensor.grad_fn, tensor.output_nr)
        self.readers: set[str] = set()
        self.packed: Any = None


class _Frame:
    """One active ``savedhooks.saved_tensors_hooks`` context: its hook functions and eager-mode state."""

    __slots__ = ("fns", "cache", "window", "holds", "held")

    def __init__(self, fns: _HookFunctions | None, codec: Any = None) -> None:
        self.fns = fns
        self.cache: dict[int, tuple[Any, int, Any]] = {}
        # a codec's eager_window, and which tensors it holds (eager_holds; default: all)
        self.window: int = getattr(codec, "eager_window", 0) if fns is not None else 0
        self.holds: Callable[[torch.Tensor], bool] = getattr(codec, "eager_holds", lambda x: True)
        self.held: list[_Held] = []


class _ViewOf:
    """Eager-mode payload of a view that covers its whole base: the base's payload, shared."""

    __slots__ = ("packed", "size", "stride", "offset")

    def __init__(self, packed: Any, view: torch.Tensor) -> None:
        self.packed, self.size, self.stride, self.offset = packed, view.size(), view.stride(), view.storage_offset()


def _check_version(fns: _HookFunctions, tensor: torch.Tensor, version: int) -> None:
    if version_counter(tensor) != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: {tuple(tensor.shape)} {tensor.dtype} is at version {version_counter(tensor)}; "
            f"expected version {version} instead (it was saved as is by {fns.label('pack')})"
        )


_FUNCTIONS: dict[str, _HookFunctions] = {}
# Per thread: the stack of active savedhooks contexts (_Frame), and the readers of the tensor being packed late.
_active = threading.local()

# Autograd nodes that return a view of their input: a held base is an input of a node that reads a view of it.
VIEW_NODES = frozenset(
    {"ViewBackward0", "UnsafeViewBackward0", "TransposeBackward0", "TransposeBackward1", "PermuteBackward0",
     "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "AliasBackward0", "TBackward0",
     "ReshapeAliasBackward0", "ExpandBackward0", "SliceBackward0", "SelectBackward0", "AsStridedBackward0"}
)  # fmt: skip


def eager_readers() -> frozenset[str]:
    """The autograd nodes known to read the tensor being packed, in eager mode (empty when none is known).

    Set only while a tensor held under a codec's ``eager_window`` is packed late:
    the class names (``type(node).__name__``) of the nodes that saved an output
    while it was held and read it, directly or through a view.

    Returns:
        A frozenset of autograd node class names.
    """
    return getattr(_active, "readers", frozenset())


# --- trampolines: the only functions the hook GraphModules call --------------------


def _run_pack(x: torch.Tensor, key: str) -> Any:
    return _pack_outside_dynamo(_lookup(key), x)


def _run_unpack(packed: Any, key: str) -> torch.Tensor:
    return _unpack_outside_dynamo(_lookup(key), packed)


def _local_trampoline(fns: _HookFunctions, stage: str) -> Callable[[Any], Any]:
    """The call target for a hook without a stable fingerprint: not registered, dies with its graph."""
    if stage == "pack":

        def savedhooks_local_pack(x: torch.Tensor) -> Any:
            return _pack_outside_dynamo(fns, x)

        savedhooks_local_pack.hook_functions = fns  # type: ignore[attr-defined]
        return savedhooks_local_pack

    def savedhooks_local_unpack(packed: Any) -> torch.Tensor:
        return _unpack_outside_dynamo(fns, packed)

    savedhooks_local_unpack.hook_functions = fns  # type: ignore[attr-defined]
    return savedhooks_local_unpack


def _saves_a_graph_input() -> bool:
    """Whether AOTAutograd is inlining the hooks for a graph input or a view of one.

    The caller holds such a value's storage for the whole step (the parameters,
    the batch, a tangent), so a packed copy would add bytes and free none: under
    compile as in eager mode (:func:`_frees_nothing`), it is stored as it is.
    """
    ctx = hook_context()
    if ctx is None:
        return False
    if ctx.node.op == "placeholder":
        return True
    key = _storage_key_of(ctx.node)
    return key is not None and any(
        _storage_key_of(p) == key for p in ctx.fw_graph.find_nodes(op="placeholder"))


def _storage_key_of(node: torch.fx.Node) -> int | None:
    val = node.meta.get("val")
    return storage_key(val) if isinstance(val, torch.Tensor) else None


def _pack(fns: _HookFunctions, x: torch.Tensor) -> Any:
    if not _is_eager(x):
        if _saves_a_graph_input():  # the caller holds it: stored as it is, in pack and in unpack alike
            return x
        ctx = hook_context()
        if ctx is not None:
            align_rng_state_names(ctx.fw_graph, ctx.bw_graph)  # torch < 2.14: checkpointed random ops (_torch.fixes)
        return _pack_checked(fns, x)
    if _frees_nothing(x):
        return _Passthrough(x)
    frame = _eager_frame(fns)
    if frame is None:  # torch's own hooks entered directly: no sharing within the forward
        return _pack_now(fns, x, None)
    base = base_of(x) if is_view(x) else None
    if base is not None and _covers(x, base) and not _frees_nothing(base):
        # relu's (B, T, C) output and the (B*T, C) view the next matmul saves: one payload
        # the view keeps its own shape, also when the base's payload is the base itself
        return _ViewOf(_pack_cached(frame, base), x)
    return _pack_cached(frame, x)


def _pack_cached(frame: _Frame, x: torch.Tensor) -> Any:
    hit = frame.cache.get(id(x))
    if hit is not None and hit[0]() is x and hit[1] == version_counter(x):
        return hit[2]
    if frame.window:
        _note_readers(frame, x)
        if frame.holds(x):
            return _hold(frame, x)
    return _pack_now(frame.fns, x, frame.cache)


def _pack_now(fns: _HookFunctions, x: torch.Tensor, cache: dict[int, tuple[Any, int, Any]] | None) -> Any:
    packed = _pack_checked(fns, x)
    if _holds_storage_of(packed, x):  # not cached: the cache would keep x alive
        return _Aliasing(packed, x)
    if cache is None:
        return packed
    cache[id(x)] = (weakref.ref(x, lambda _, k=id(x): cache.pop(k, None)), version_counter(x), packed)
    return packed


def _note_readers(frame: _Frame, x: torch.Tensor) -> None:
    """Tell the held tensors that the autograd node which made ``x`` reads them, where it does."""
    if x.grad_fn is None or not frame.held:
        return
    inputs = _input_edges(x.grad_fn)
    name = type(x.grad_fn).__name__
    for held in frame.held:
        if held.edge[0] is not None and any(held.edge[0] is fn and held.edge[1] == nr for fn, nr in inputs):
            held.readers.add(name)


def _hold(frame: _Frame, x: torch.Tensor) -> _Held:
    """Hold ``x`` as it is in ``frame``'s window; the oldest held tensor beyond the window is packed."""
    held = _Held(x)
    frame.cache[id(x)] = (weakref.ref(x, lambda _, k=id(x), c=frame.cache: c.pop(k, None)), version_counter(x), held)
    frame.held.append(held)
    while len(frame.held) > frame.window:
        _settle(frame, frame.held.pop(0))
    return held


def _input_edges(node: Any) -> list[tuple[Any, int]]:
    """The edges to ``node``'s inputs, and below each input, the edges through views down to the viewed tensor."""
    edges = []
    for fn, nr in node.next_functions:
        while fn is not None:
            edges.append((fn, nr))
            if type(fn).__name__ not in VIEW_NODES or not fn.next_functions:
                break
            fn, nr = fn.next_functions[0]
    return edges


def _settle(frame: _Frame, held: _Held) -> None:
    """Pack a held tensor now, its readers visible to the codec; one changed in place stays for unpack to refuse."""
    x = held.tensor
    if x is None or version_counter(x) != held.version:
        return
    _active.readers = frozenset(held.readers)
    try:
        held.packed = _pack_now(frame.fns, x, None)
    finally:
        _active.readers = frozenset()
    held.tensor, held.edge = None, (None, 0)


def settle_held(frame: _Frame) -> None:
    """Pack every tensor ``frame`` holds (its context exits: the forward that saved them is over)."""
    while frame.held:
        _settle(frame, frame.held.pop(0))


def _covers(view: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether a view reads all of a contiguous base (a reshape, a permutation)."""
    return (
        view.numel() == base.numel()
        and base.is_contiguous()
        and base.storage_offset() == 0
        and view.storage_offset() == 0
        and view.dtype == base.dtype
    )


def _unpack(fns: _HookFunctions, packed: Any) -> torch.Tensor:
    if isinstance(packed, torch.Tensor) and not _is_eager(packed) and _saves_a_graph_input():
        return packed  # what _pack stored as it is
    if isinstance(packed, _Held):
        if packed.tensor is not None:  # backward reads it before it was packed
            _check_version(fns, packed.tensor, packed.version)
            frame = _eager_frame(fns)
            if frame is not None:  # backward has started: the forward's sharing is over
                frame.cache.clear()
                if packed in frame.held:
                    frame.held.remove(packed)
            return packed.tensor
        packed = packed.packed
    if isinstance(packed, _ViewOf):
        base = _unpack(fns, packed.packed).contiguous()  # contiguous, like the base it was packed from
        return base.as_strided(packed.size, packed.stride, packed.offset)
    if isinstance(packed, (_Passthrough, _Aliasing)):
        _check_version(fns, packed.tensor, packed.version)
        if isinstance(packed, _Passthrough):
            return packed.tensor
        packed = packed.packed
    frame = _eager_frame(fns)
    if frame is not None:  # backward has started: the forward's sharing is over, drop the entries
        frame.cache.clear()
    return _unpack_checked(fns, packed)


# A hook entered inside a torch.compile'd function is called from frames dynamo
# compiles; its body must still run eagerly on real tensors (the eager rules above),
# so dynamo never traces it. AOTAutograd's re-trace of the hook graphs is unaffected.
_pack_outside_dynamo = torch.compiler.disable(_pack)
_unpack_outside_dynamo = torch.compiler.disable(_unpack)


def _eager_frame(fns: _HookFunctions) -> _Frame | None:
    stack = getattr(_active, "stack", None)
    if not stack or stack[-1].fns is not fns:  # torch's own hooks were pushed above ours
        return None
    return stack[-1]


def _holds_storage_of(packed: Any, x: torch.Tensor) -> bool:
    ptr = x.untyped_storage().data_ptr()
    return any(
        isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == ptr for t in pytree.tree_leaves(packed)
    )


def _lookup(key: str) -> _HookFunctions:
    try:
        return _FUNCTIONS[key]
    except KeyError:
        raise HookError(
            f"savedhooks hook {key!r} is not defined in this process; define the hook (import the module "
            "that decorates it) before running graphs that use it"
        ) from None


def _is_eager(x: torch.Tensor) -> bool:
    # AOTAutograd traces hooks on FakeTensor / FunctionalTensor subclasses.
    return not is_traced(x)


def _frees_nothing(x: torch.Tensor) -> bool:
    # What the caller still holds, as compile's "donated" filter sees it: parameters
    # (frozen ones too), leaves that require grad, floating leaves (the input batch),
    # and views of them. Eager autograd cannot tell a no-grad float input from a float
    # tensor made inside an op, so both are kept (CPU eager dropout's float noise is
    # one); bool masks and int64 indices made in the forward are packed.
    base = base_of(x) if is_view(x) else x
    return isinstance(base, torch.nn.Parameter) or (base.is_leaf and (base.requires_grad or base.is_floating_point()))
