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
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from savedhooks.contract import HookError, _HookFunctions, _pack_checked, _unpack_checked, hook_context
from savedhooks.torchfixes import align_rng_state_names


class _Passthrough:
    """Eager-mode marker: the saved tensor was not packed (a leaf or a view of one)."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.version = tensor._version


class _Aliasing:
    """Eager-mode wrapper of a payload that holds the saved tensor's storage.

    With a pack hook active, torch no longer checks that a saved tensor was not
    modified in place before backward; a payload that aliases it must do that itself.
    """

    __slots__ = ("packed", "tensor", "version")

    def __init__(self, packed: Any, tensor: torch.Tensor) -> None:
        self.packed, self.tensor, self.version = packed, tensor, tensor._version


class _ViewOf:
    """Eager-mode payload of a view that covers its whole base: the base's payload, shared."""

    __slots__ = ("packed", "size", "stride", "offset")

    def __init__(self, packed: Any, view: torch.Tensor) -> None:
        self.packed, self.size, self.stride, self.offset = packed, view.size(), view.stride(), view.storage_offset()


def _check_version(fns: _HookFunctions, tensor: torch.Tensor, version: int) -> None:
    if tensor._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: {tuple(tensor.shape)} {tensor.dtype} is at version {tensor._version}; expected version "
            f"{version} instead (it was saved as is by {fns.label('pack')})"
        )


_FUNCTIONS: dict[str, _HookFunctions] = {}
# Per thread: the stack of active savedhooks contexts, as (hook functions, eager pack cache).
_active = threading.local()


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


def _pack(fns: _HookFunctions, x: torch.Tensor) -> Any:
    if not _is_eager(x):
        ctx = hook_context()
        if ctx is not None:
            align_rng_state_names(ctx)  # torch 2.13: checkpointed random ops (savedhooks.torchfixes)
        return _pack_checked(fns, x)
    if _frees_nothing(x):
        return _Passthrough(x)
    cache = _eager_cache(fns)
    if cache is None:  # torch's own hooks entered directly: no sharing within the forward
        return _pack_cached(fns, x, None)
    base = x._base if x._is_view() else None
    if base is not None and _covers(x, base) and not _frees_nothing(base):
        # relu's (B, T, C) output and the (B*T, C) view the next matmul saves: one payload
        # the view keeps its own shape, also when the base's payload is the base itself
        return _ViewOf(_pack_cached(fns, base, cache), x)
    return _pack_cached(fns, x, cache)


def _pack_cached(fns: _HookFunctions, x: torch.Tensor, cache: dict[int, tuple[Any, int, Any]] | None) -> Any:
    hit = cache.get(id(x)) if cache is not None else None
    if hit is not None and hit[0]() is x and hit[1] == x._version:
        return hit[2]
    packed = _pack_checked(fns, x)
    if _holds_storage_of(packed, x):  # not cached: the cache would keep x alive
        return _Aliasing(packed, x)
    if cache is None:
        return packed
    cache[id(x)] = (weakref.ref(x, lambda _, k=id(x): cache.pop(k, None)), x._version, packed)
    return packed


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
    if isinstance(packed, _ViewOf):
        base = _unpack(fns, packed.packed).contiguous()  # contiguous, like the base it was packed from
        return base.as_strided(packed.size, packed.stride, packed.offset)
    if isinstance(packed, (_Passthrough, _Aliasing)):
        _check_version(fns, packed.tensor, packed.version)
        if isinstance(packed, _Passthrough):
            return packed.tensor
        packed = packed.packed
    cache = _eager_cache(fns)
    if cache:  # backward has started: the forward's sharing is over, drop the entries
        cache.clear()
    return _unpack_checked(fns, packed)


# A hook entered inside a torch.compile'd function is called from frames dynamo
# compiles; its body must still run eagerly on real tensors (the eager rules above),
# so dynamo never traces it. AOTAutograd's re-trace of the hook graphs is unaffected.
_pack_outside_dynamo = torch._dynamo.disable(_pack)
_unpack_outside_dynamo = torch._dynamo.disable(_unpack)


def _eager_cache(fns: _HookFunctions) -> dict[int, tuple[Any, int, Any]] | None:
    stack = getattr(_active, "stack", None)
    if not stack or stack[-1][0] is not fns:  # torch's own hooks were pushed above ours
        return None
    return stack[-1][1]


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
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return not isinstance(x, (FakeTensor, FunctionalTensor))


def _frees_nothing(x: torch.Tensor) -> bool:
    # What the caller still holds, as compile's "donated" filter sees it: parameters
    # (frozen ones too), leaves that require grad, floating leaves (the input batch),
    # and views of them. Eager autograd cannot tell a no-grad float input from a float
    # tensor made inside an op, so both are kept (CPU eager dropout's float noise is
    # one); bool masks and int64 indices made in the forward are packed.
    base = x._base if x._is_view() else x
    return isinstance(base, torch.nn.Parameter) or (base.is_leaf and (base.requires_grad or base.is_floating_point()))
