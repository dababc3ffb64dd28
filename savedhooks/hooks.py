"""Saved-tensor hook pairs that AOTAutograd inlines, built from plain Python.

Design notes
------------
* torch 2.13 inlines saved-tensor hooks into the compiled forward and backward
  graphs only when both hooks are ``torch.fx.GraphModule``s. It re-traces them
  once per saved tensor, so a GraphModule whose single node calls back into
  Python keeps per-tensor Python logic: the user's body runs on the traced
  (fake/functional) tensor and whatever it branches on is decided per tensor.
* The node calls a *top-level* trampoline (``_run_pack`` / ``_run_unpack``) with
  a constant registry key, never the user's function directly: the trampoline
  is importable, so the GraphModule pickles into AOTAutograd's cache key, and
  the key string carries the hook's fingerprint. ``meta["is_wrapped"]`` and
  ``meta["user_cache_hash"]`` are what AOTAutograd checks to cache graphs that
  contain such calls instead of bypassing its cache.
* Dynamo guards on ``id(pack), id(unpack)``: :func:`make_hook_pair` returns one
  cached HookPair per (name, fingerprint), so rebuilding an equal hook is free.
  A hook without a stable fingerprint is not registered at all: its graph calls
  a per-pair closure, so it lives and dies with its GraphModules, and
  AOTAutograd bypasses its cache for it. A hook that reads globals not yet
  defined at decoration gets its cache hash when it is entered.
* The trampolines check the hook contract (no input mutation, unpack returns one
  tensor of the saved tensor's dtype, device and shape) and name the hook when
  it is broken, because torch's own errors do not say which hook failed.
* Eager mode has no partitioner to filter saved tensors, so the trampoline skips
  what packing cannot free, as the compiled default ("donated": intermediates
  only) does: parameters, other leaves that require grad, floating leaves (the
  input batch) and views of them. Bool masks and int64 indices made in the forward
  are leaves too, and are packed, as under compile.
* Eager autograd saves one tensor several times (relu's output is saved by relu
  and by the next matmul). Inside :class:`saved_tensors_hooks` a tensor is packed
  once per version and the payload shared, also with a view that reads all of it
  (relu's ``(B, T, C)`` output and the ``(B*T, C)`` view a matmul saves); the cache
  holds the tensor weakly and is cleared when backward starts unpacking.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import pathlib
import threading
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.fx
import torch.utils._pytree as pytree

from savedhooks.identity import UnfingerprintableError, fingerprint_details

__all__ = [
    "HookContext",
    "HookError",
    "HookMismatchError",
    "HookMutationError",
    "HookPair",
    "HookTypeError",
    "PackHook",
    "hook",
    "hook_context",
    "make_hook_pair",
    "saved_tensors_hooks",
]

# Any change to savedhooks' own code (codecs, kernels, this file) can change what a
# hook traces to, and fingerprints name savedhooks functions without walking them:
# key caches on all of its source.
_PACKAGE_ROOT = pathlib.Path(__file__).resolve().parent
_MODULE_HASH = hashlib.sha256(
    b"".join(p.read_bytes() for p in sorted(_PACKAGE_ROOT.rglob("*.py")))
    + b"".join(p.read_bytes() for p in sorted((_PACKAGE_ROOT.parent / "kernels").glob("*.py")))
).hexdigest()

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
_PAIRS: dict[str, HookPair] = {}


@dataclasses.dataclass(frozen=True, eq=False)
class HookPair:
    """A pack/unpack pair of GraphModules that AOTAutograd inlines.

    Build one with :func:`hook` (from plain Python), a codec such as
    ``savedhooks.fp8()``, or :func:`make_hook_pair`. Equal configurations give the
    same object, so dynamo's hook guard does not recompile. The GraphModules are
    callable, so the same pair works in eager mode.

    Attributes:
        name: readable name used in error messages and logs.
        pack: GraphModule taking the saved tensor, returning the packed pytree.
        unpack: GraphModule taking the packed pytree, returning one tensor.
        cache_hash: stable digest of the hook's code and configuration (set on
            the graph nodes as ``user_cache_hash``), or None when the hook
            captures values without a stable digest; AOTAutograd then bypasses
            its cache rather than risk a stale hit.
        codec: the ``savedhooks.codecs.Codec`` this pair applies, or None for
            hooks written with :func:`hook` (lets codecs nest, as in
            ``offload(fp8())``).
    """

    name: str
    pack: torch.fx.GraphModule
    unpack: torch.fx.GraphModule
    cache_hash: str | None
    codec: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.pack, torch.fx.GraphModule) or not isinstance(self.unpack, torch.fx.GraphModule):
            raise HookTypeError(
                f"HookPair {self.name!r}: pack and unpack must be torch.fx.GraphModules "
                f"(got {type(self.pack).__name__}, {type(self.unpack).__name__}); use savedhooks.hook to build "
                "a pair from plain Python functions"
            )

    def __repr__(self) -> str:
        return f"HookPair({self.name!r})"


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

    Args:
        None.

    Returns:
        A :class:`HookContext` while AOTAutograd inlines hooks into a compiled
        graph; None in eager mode, where there is no graph.

    Raises:
        Nothing.
    """
    from torch._functorch._aot_autograd.graph_compile import _get_saved_tensor_hook_context

    state = _get_saved_tensor_hook_context()
    if not state:
        return None
    return HookContext(node=state["_node"], fw_graph=state["_fw_graph"], bw_graph=state["_bw_graph"])


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
        return _pack_checked(fns, x)
    if _frees_nothing(x):
        return _Passthrough(x)
    cache = _eager_cache(fns)
    if cache is None:  # torch's own hooks entered directly: no sharing within the forward
        return _pack_cached(fns, x, None)
    base = x._base if x._is_view() else None
    if base is not None and _covers(x, base) and not _frees_nothing(base):
        # relu's (B, T, C) output and the (B*T, C) view the next matmul saves: one payload
        packed = _pack_cached(fns, base, cache)
        return packed if isinstance(packed, _Aliasing) else _ViewOf(packed, x)
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


def _pack_checked(fns: _HookFunctions, x: torch.Tensor) -> tuple[Any, _SavedMeta]:
    version = x._version
    packed = fns.call("pack", x)
    if x._version != version:
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
    versions = [t._version for t in tensors]
    out = fns.call("unpack", packed)
    if [t._version for t in tensors] != versions:
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


# --- building pairs ------------------------------------------------------------------


def _hook_graph_module(target: Callable[..., Any], args: tuple[Any, ...], cache_hash: str | None, stage: str) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    call = graph.call_function(target, (graph.placeholder("x" if stage == "pack" else "packed"), *args))
    # AOTAutograd caches graphs containing wrapped Python calls only with a user hash.
    call.meta["is_wrapped"] = True
    if cache_hash is not None:
        call.meta["user_cache_hash"] = cache_hash
    graph.output(call)
    return torch.fx.GraphModule(torch.nn.Module(), graph, class_name=stage.capitalize() + "Hook")


def _cache_hash(digest: str) -> str:
    return hashlib.sha256(f"{digest}:{_MODULE_HASH}".encode()).hexdigest()


def make_hook_pair(
    name: str,
    pack: Callable[[torch.Tensor], Any],
    unpack: Callable[[Any], torch.Tensor],
    config: Any = None,
    codec: Any = None,
) -> HookPair:
    """Build (or fetch the cached) :class:`HookPair` for two Python functions.

    Args:
        name: readable name for errors and logs.
        pack: called with each saved tensor (the real one in eager mode; a fake
            one, twice, while compiling); returns a pytree of tensors and constants.
        unpack: called with what ``pack`` returned; returns one tensor with the
            saved tensor's dtype, device and shape.
        config: extra configuration that changes what the functions compute and
            that they do not capture themselves (fingerprinted with them).
        codec: the codec object the functions apply, kept on the pair (not
            fingerprinted: the functions must capture it themselves).

    Returns:
        The HookPair for this (name, code, configuration). Calling again with
        equal arguments returns the same object, except for hooks that capture a
        value without a stable fingerprint (a warning says so): those get a new,
        unregistered pair each time.

    Raises:
        HookTypeError: ``pack`` or ``unpack`` is not callable, or ``name`` is not
            a string.
    """
    if not isinstance(name, str):
        raise HookTypeError(f"savedhooks hook name must be a str, got {type(name).__name__}")
    for stage, fn in (("pack", pack), ("unpack", unpack)):
        if not callable(fn):
            raise HookTypeError(f"savedhooks hook {name!r}: {stage} must be callable, got {type(fn).__name__}")
    try:
        details = fingerprint_details((name, pack, unpack, config))
    except UnfingerprintableError as e:
        warnings.warn(
            f"savedhooks hook {name!r}: {e}. The hook gets a process-local identity: equal hooks built "
            "again recompile, and AOTAutograd's cache is bypassed for graphs using it.",
            stacklevel=3,
        )
        fns = _HookFunctions(name, pack, unpack, config)
        return HookPair(
            name=name,
            pack=_hook_graph_module(_local_trampoline(fns, "pack"), (), None, "pack"),
            unpack=_hook_graph_module(_local_trampoline(fns, "unpack"), (), None, "unpack"),
            cache_hash=None,
            codec=codec,
        )
    key = f"{name}:{details.digest}"
    if key not in _PAIRS:
        # Globals assigned after decoration are not in the digest yet: no cache hash
        # until saved_tensors_hooks takes the digest again (see _refresh_cache_hash).
        cache_hash = None if details.late_globals else _cache_hash(details.digest)
        _FUNCTIONS[key] = _HookFunctions(name, pack, unpack, config, details.late_globals)
        _PAIRS[key] = HookPair(
            name=name,
            pack=_hook_graph_module(_run_pack, (key,), cache_hash, "pack"),
            unpack=_hook_graph_module(_run_unpack, (key,), cache_hash, "unpack"),
            cache_hash=cache_hash,
            codec=codec,
        )
    return _PAIRS[key]


def _functions_of(pair: HookPair) -> _HookFunctions | None:
    """The Python functions behind a pair, or None for pairs built elsewhere (make_fx graphs)."""
    for node in pair.pack.graph.nodes:
        if node.target is _run_pack:
            return _FUNCTIONS.get(node.args[1])
        if hasattr(node.target, "hook_functions"):
            return node.target.hook_functions
    return None


def _refresh_cache_hash(fns: _HookFunctions, pair: HookPair) -> None:
    """Take the digest again for a hook that read undefined globals; set it where AOTAutograd reads it."""
    try:
        details = fingerprint_details((fns.name, fns.pack, fns.unpack, fns.config))
    except UnfingerprintableError:
        details = None
    cache_hash = None if details is None or details.late_globals else _cache_hash(details.digest)
    for gm in (pair.pack, pair.unpack):
        for node in gm.graph.nodes:
            if node.op == "call_function":
                node.meta.pop("user_cache_hash", None)
                if cache_hash is not None:
                    node.meta["user_cache_hash"] = cache_hash


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


class PackHook:
    """A pack function waiting for its unpack function (returned by :func:`hook`).

    Complete it with ``@<name>.unpack``, which returns the :class:`HookPair`.
    Calling a PackHook calls the pack function.
    """

    def __init__(self, pack: Callable[[torch.Tensor], Any], name: str) -> None:
        self._pack = pack
        self.name = name

    def __call__(self, x: torch.Tensor) -> Any:
        return self._pack(x)

    def unpack(self, fn: Callable[[Any], torch.Tensor]) -> HookPair:
        """Attach the unpack function and return the complete :class:`HookPair`.

        Args:
            fn: called with what pack returned; returns one tensor of the saved
                tensor's dtype, device and shape.

        Returns:
            The HookPair (the same object for equal code and configuration).

        Raises:
            HookTypeError: ``fn`` is not callable, or a probe run on a small meta
                tensor shows unpack returning a non-tensor or pack returning an
                unsupported value.
            HookMutationError: the probe shows pack or unpack mutating its input.
            HookMismatchError: the probe shows unpack returning a tensor of the
                wrong dtype, device or shape.
        """
        if not callable(fn):
            raise HookTypeError(
                f"savedhooks hook {self.name!r}: @{self.name}.unpack must decorate a function, got {type(fn).__name__}"
            )
        _probe(_HookFunctions(self.name, self._pack, fn))
        return make_hook_pair(self.name, self._pack, fn)

    def __repr__(self) -> str:
        return f"PackHook({self.name!r}, no unpack yet)"


def hook(
    pack: Callable[[torch.Tensor], Any] | None = None,
    *,
    unpack: Callable[[Any], torch.Tensor] | None = None,
    name: str | None = None,
) -> Any:
    """Turn a plain Python pack function into a saved-tensor hook.

    Use as a decorator, then attach the unpack function with the same name::

        @savedhooks.hook
        def bf16(x):
            return x.dtype, x.to(torch.bfloat16)

        @bf16.unpack
        def bf16(packed):
            dtype, y = packed
            return y.to(dtype)

    The functions run once per saved tensor: in eager mode on the real tensor,
    under ``torch.compile`` on the traced one (so branches on dtype, shape or
    :func:`hook_context` are decided per tensor and the ops they run are inlined
    into the compiled graphs).

    Args:
        pack: the pack function, taking the saved tensor and returning a pytree
            of tensors and constants.
        unpack: optionally the unpack function, to build the pair in one call.
        name: name for errors and logs; defaults to the pack function's name.

    Returns:
        A :class:`PackHook` (complete it with ``@<name>.unpack``), or the
        :class:`HookPair` when ``unpack`` is given. Without ``pack``, a decorator.

    Raises:
        HookTypeError: ``pack`` or ``unpack`` is not callable, or a probe run shows
            a broken contract (see :meth:`PackHook.unpack`).
        HookMutationError, HookMismatchError: as for :meth:`PackHook.unpack`.
    """
    if pack is None:
        return lambda fn: hook(fn, unpack=unpack, name=name)
    if not callable(pack):
        raise HookTypeError(f"savedhooks.hook decorates a pack function, got {type(pack).__name__}: {pack!r}")
    pending = PackHook(pack, name or getattr(pack, "__name__", type(pack).__name__))
    return pending if unpack is None else pending.unpack(unpack)


class saved_tensors_hooks(contextlib.ContextDecorator):  # noqa: N801 - mirrors torch's name
    """Apply a :class:`HookPair` to tensors saved for backward inside the block.

    Works around eager code and around ``torch.compile``d models (the hooks are
    then inlined into the compiled graphs). Nested blocks behave like torch's:
    the innermost pair wins. Usable as a decorator; re-entrant.

    Args:
        hooks: a HookPair, e.g. from :func:`hook` or a codec such as ``savedhooks.fp8()``.

    Raises:
        HookTypeError: ``hooks`` is a :class:`PackHook` without an unpack function.
        TypeError: ``hooks`` is anything else that is not a HookPair.
    """

    def __init__(self, hooks: HookPair) -> None:
        if isinstance(hooks, PackHook):
            raise HookTypeError(
                f"savedhooks hook {hooks.name!r} has no unpack function: add one with @{hooks.name}.unpack"
            )
        if not isinstance(hooks, HookPair):
            raise TypeError(
                "savedhooks.saved_tensors_hooks expects a savedhooks.HookPair (from @savedhooks.hook or a "
                f"codec such as savedhooks.fp8()), got {type(hooks).__name__}: {hooks!r}"
            )
        self.hooks = hooks
        self._functions = _functions_of(hooks)  # None for pairs built elsewhere: no eager cache
        self._entered: list[torch.autograd.graph.saved_tensors_hooks] = []

    def __enter__(self) -> HookPair:
        if self._functions is not None and self._functions.late_globals:
            _refresh_cache_hash(self._functions, self.hooks)
        torch_hooks = torch.autograd.graph.saved_tensors_hooks(self.hooks.pack, self.hooks.unpack)
        torch_hooks.__enter__()
        self._entered.append(torch_hooks)
        if not hasattr(_active, "stack"):
            _active.stack = []
        _active.stack.append((self._functions, {}))
        return self.hooks

    def __exit__(self, *exc_info: object) -> None:
        _active.stack.pop()
        self._entered.pop().__exit__(*exc_info)
