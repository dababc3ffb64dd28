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
  tensors packed in its context that its ``eager_holds(x)`` accepts (default: all)
  held as they are and packed late, the last ``n`` at most: each later pack walks
  the autograd graph back from the new tensor's ``grad_fn`` and finds, in the
  nodes it has not seen, the saved variables whose payload (``SavedTensor.data``,
  read without unpacking) is a held tensor's: the nodes that saved it. When as
  many savers are found as times the tensor was saved, they are all known, and
  the codec sees them while packing it (:func:`eager_savers`; None while some
  are unknown). A held tensor is packed as soon as its savers are all found (at a
  later pack), else when ``n`` newer ones are held, when the context exits or a
  backward inside it starts unpacking (the forward is over), or not at all when
  that backward reads it first. A tensor saved
  again after it was packed into something new gets a payload of its own: the
  codec did not see that saver.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import torch

from savedhooks._torch import pytree
from savedhooks._torch.autograd import named_payloads
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
    """Eager-mode payload of a tensor held as it is until the nodes that saved it are known (``eager_window``)."""

    __slots__ = ("tensor", "version", "saves", "savers", "names", "packed")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.version = version_counter(tensor)
        self.saves = 1  # how many times autograd saved it: one saver each
        self.savers: list[Any] = []  # the autograd nodes found holding this payload
        self.names: list[str] = []  # the saved variable of each saver that holds it ("query", "self")
        self.packed: Any = None


class _Frame:
    """One active ``savedhooks.saved_tensors_hooks`` context: its hook functions and eager-mode state."""

    __slots__ = ("fns", "cache", "window", "holds", "held", "seen", "pending", "largest")

    def __init__(self, fns: _HookFunctions | None, codec: Any = None) -> None:
        self.fns = fns
        self.cache: dict[int, tuple[Any, int, Any]] = {}
        # a codec's eager_window, and which tensors it holds (eager_holds; default: all)
        self.window: int = getattr(codec, "eager_window", 0) if fns is not None else 0
        self.holds: Callable[[torch.Tensor], bool] = getattr(codec, "eager_holds", lambda x: True)
        self.held: list[_Held] = []
        self.seen: set[Any] = set()  # autograd nodes already searched for held payloads
        self.pending: Any = None  # the last pack's grad_fn, searched at the next pack (complete by then)
        self.largest = 0  # bytes of the largest floating tensor packed in this context so far


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


def eager_savers() -> tuple[Any, ...] | None:
    """The autograd nodes that saved the tensor being packed, in eager mode, when all of them are known.

    Set while a tensor held under a codec's ``eager_window`` is packed late:
    every node that saved it (one per time autograd saved it), found by their
    saved variables' payloads. Outside such a late pack, or while some saver
    was not found, None: the codec cannot tell who reads the tensor.

    Returns:
        A tuple of autograd nodes, or None.
    """
    return getattr(_active, "savers", None)


def eager_largest_saved() -> int | None:
    """Bytes of the largest floating tensor saved so far in the innermost ``savedhooks.saved_tensors_hooks`` context.

    Eager mode's counterpart of the largest value a compiled graph saves:
    what was saved before (and, for a tensor held under ``eager_window``,
    until it is packed). Leaves and parameters, which packing does not
    free, are not counted.

    Returns:
        The byte count, or None outside such a context (or before anything was saved).
    """
    stack = getattr(_active, "stack", None)
    return (stack[-1].largest or None) if stack else None


def eager_saved_as() -> tuple[tuple[Any, str], ...] | None:
    """:func:`eager_savers` with the name of the saved variable each one holds the tensor in.

    Returns:
        ``(node, name)`` pairs (``(ScaledDotProductFlashAttentionForCpuBackward0, "query")``),
        or None when :func:`eager_savers` is None.
    """
    return getattr(_active, "saved_as", None)


def eager_readers() -> frozenset[str]:
    """The class names of :func:`eager_savers` (``"MmBackward0"``); empty when they are not all known.

    Returns:
        A frozenset of autograd node class names.
    """
    savers = eager_savers()
    return frozenset(type(node).__name__ for node in savers) if savers else frozenset()


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
    if x.is_floating_point():
        frame.largest = max(frame.largest, x.numel() * x.element_size())
    if frame.window:
        _find_savers(frame, x.grad_fn)
        _settle_complete(frame, x)
    hit = frame.cache.get(id(x))
    if hit is not None and hit[0]() is x and hit[1] == version_counter(x):
        payload = hit[2]
        if not isinstance(payload, _Held):
            return payload
        if payload.tensor is not None:  # still held: one more saver to find
            payload.saves += 1
            return payload
        if payload.packed is None or isinstance(payload.packed, _Aliasing):
            return payload  # changed in place (unpack refuses it), or stored as it is: nothing to decide again
        # packed into something new for the savers the codec saw: this one it did not see
    if frame.window and frame.holds(x):
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


def _find_savers(frame: _Frame, start: Any) -> None:
    """Search the autograd nodes behind ``start`` not searched before for saved variables holding held payloads.

    ``start`` itself is searched at the next call (or when the context exits):
    it may be the node saving the tensor being packed now, its saved variables
    not all set yet; every node behind it is complete.
    """
    todo = [frame.pending] if frame.pending is not None else []
    frame.pending = start
    if start is not None:
        todo.extend(fn for fn, _ in start.next_functions if fn is not None)
    while todo and frame.held:
        node = todo.pop()
        if node in frame.seen:
            continue
        frame.seen.add(node)
        _note_savers(frame, node)
        todo.extend(fn for fn, _ in node.next_functions if fn is not None)


def _note_savers(frame: _Frame, node: Any) -> None:
    """Count ``node`` as a saver of each held tensor whose payload one of its saved variables holds."""
    for name, payload in named_payloads(node):
        if isinstance(payload, _ViewOf):
            payload = payload.packed
        if isinstance(payload, _Held) and payload.tensor is not None:
            payload.savers.append(node)
            payload.names.append(name)


def _settle_complete(frame: _Frame, x: torch.Tensor) -> None:
    """Pack each held tensor but ``x`` whose savers are all found: its codec can decide now, and frees it sooner.

    A tensor is saved once per reader, its pack hook called each time; as many
    savers found as saves means none is missing so far. A later save of it gets
    a payload of its own (:func:`_pack_cached`).
    """
    for held in [h for h in frame.held if h.tensor is not None and h.tensor is not x and len(h.savers) == h.saves]:
        frame.held.remove(held)
        _settle(frame, held)


def _hold(frame: _Frame, x: torch.Tensor) -> _Held:
    """Hold ``x`` as it is in ``frame``'s window; the oldest held tensor beyond the window is packed."""
    held = _Held(x)
    frame.cache[id(x)] = (weakref.ref(x, lambda _, k=id(x), c=frame.cache: c.pop(k, None)), version_counter(x), held)
    frame.held.append(held)
    while len(frame.held) > frame.window:
        _settle(frame, frame.held.pop(0))
    return held


def _settle(frame: _Frame, held: _Held) -> None:
    """Pack a held tensor now, its savers visible to the codec; one changed in place stays for unpack to refuse."""
    x = held.tensor
    if x is None or version_counter(x) != held.version:
        return
    complete = len(held.savers) == held.saves
    _active.savers = tuple(held.savers) if complete else None
    _active.saved_as = tuple(zip(held.savers, held.names)) if complete else None
    try:
        held.packed = _pack_now(frame.fns, x, None)
    finally:
        _active.savers = _active.saved_as = None
    held.tensor, held.savers, held.names = None, [], []


def settle_held(frame: _Frame) -> None:
    """Pack every tensor ``frame`` holds and drop the frame's sharing: the forward is over.

    Called when the context exits, and when a backward inside it unpacks a
    first saved tensor (the one it reads then, still held, stays as it is).
    """
    for held in frame.held:  # every node is complete now: the last pack's, and those that saved their output
        _find_savers(frame, held.tensor.grad_fn if held.tensor is not None else None)
    _find_savers(frame, None)
    while frame.held:
        _settle(frame, frame.held.pop(0))
    frame.seen.clear()
    frame.pending = None
    # the forward's sharing is over: a held tensor's entry would keep it alive (as its payload, when it was
    # stored as it is) until the cache's reference cycle is collected, past the backward's release of it
    frame.cache.clear()


def settle_innermost() -> None:
    """Pack what the innermost active ``savedhooks.saved_tensors_hooks`` context holds, as if its forward ended.

    A step that computes its loss inside the context calls it where the
    model's forward ends (:func:`savedhooks.fidelity.select.mark_loss`): the
    model's held tensors are then packed with the savers found so far, before
    the loss saves anything. No-op outside such a context.
    """
    stack = getattr(_active, "stack", None)
    if stack:
        settle_held(stack[-1])


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
        if packed.tensor is not None:  # backward reads it before it was packed: kept as it is
            _check_version(fns, packed.tensor, packed.version)
            frame = _eager_frame(fns)
            if frame is not None:
                if packed in frame.held:
                    frame.held.remove(packed)
                settle_held(frame)  # backward has started: the forward is over, as when the context exits
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
    if frame is not None:  # backward has started: the forward is over, as when the context exits
        settle_held(frame)
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
