"""Saved-tensor hook pairs that AOTAutograd inlines, built from plain Python.

Design notes
------------
* torch 2.13 inlines saved-tensor hooks into the compiled forward and backward
  graphs only when both hooks are ``torch.fx.GraphModule``s. It re-traces them
  once per saved tensor, so a GraphModule whose single node calls back into
  Python keeps per-tensor Python logic: the user's body runs on the traced
  (fake/functional) tensor and whatever it branches on is decided per tensor.
* Dynamo guards on ``id(pack), id(unpack)``: :func:`make_hook_pair` returns one
  cached HookPair per (name, fingerprint), so rebuilding an equal hook is free.
  A hook without a stable fingerprint is not registered at all: its graph calls
  a per-pair closure, so it lives and dies with its GraphModules, and
  AOTAutograd bypasses its cache for it. A hook that reads globals not yet
  defined at decoration gets its cache hash when it is entered.
* What the hook graphs call, and the eager-mode rules, live in
  :mod:`savedhooks.hooks.eager`; the contract checks in :mod:`savedhooks.hooks.contract`.
* Entering :class:`saved_tensors_hooks` also makes inductor place the inlined
  hooks (:mod:`savedhooks.compiler.api`): see its docstring.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import warnings
from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.fx

from savedhooks.hooks.contract import (
    HookContext,
    HookError,
    HookMismatchError,
    HookMutationError,
    HookTypeError,
    _HookFunctions,
    _probe,
    hook_context,
)
from savedhooks.hooks.eager import (
    _FUNCTIONS,
    _active,
    _Frame,
    _local_trampoline,
    _run_pack,
    _run_unpack,
    eager_largest_saved,
    eager_readers,
    eager_saved_as,
    eager_savers,
    settle_held,
)
from savedhooks.hooks.identity import UnfingerprintableError, fingerprint_details, source_digest

__all__ = [
    "HookContext",
    "HookError",
    "HookMismatchError",
    "HookMutationError",
    "HookPair",
    "HookTypeError",
    "PackHook",
    "applied",
    "check_hook_pair",
    "eager_largest_saved",
    "eager_readers",
    "eager_saved_as",
    "eager_savers",
    "hook",
    "hook_context",
    "make_hook_pair",
]


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


# --- building pairs ------------------------------------------------------------------


def _hook_graph_module(
    target: Callable[..., Any], args: tuple[Any, ...], cache_hash: str | None, stage: str
) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    call = graph.call_function(target, (graph.placeholder("x" if stage == "pack" else "packed"), *args))
    # AOTAutograd caches graphs containing wrapped Python calls only with a user hash.
    call.meta["is_wrapped"] = True
    if cache_hash is not None:
        call.meta["user_cache_hash"] = cache_hash
    graph.output(call)
    return torch.fx.GraphModule(torch.nn.Module(), graph, class_name=stage.capitalize() + "Hook")


def _cache_hash(digest: str) -> str:
    return hashlib.sha256(f"{digest}:{source_digest()}".encode()).hexdigest()


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


def check_hook_pair(hooks: Any, what: str = "savedhooks.saved_tensors_hooks") -> HookPair:
    """Accept a :class:`HookPair`; anything else raises an error that says what to pass.

    Args:
        hooks: what the user passed.
        what: the function that takes it, for the message.

    Returns:
        ``hooks``.

    Raises:
        HookTypeError: ``hooks`` is a :class:`PackHook` without an unpack function.
        TypeError: ``hooks`` is anything else that is not a HookPair.
    """
    if isinstance(hooks, PackHook):
        raise HookTypeError(f"savedhooks hook {hooks.name!r} has no unpack function: add one with @{hooks.name}.unpack")
    if not isinstance(hooks, HookPair):
        raise TypeError(
            f"{what} expects a savedhooks.HookPair (from @savedhooks.hook or a "
            f"codec such as savedhooks.fp8()), got {type(hooks).__name__}: {hooks!r}"
        )
    return hooks


@contextlib.contextmanager
def applied(hooks: HookPair) -> Iterator[HookPair]:
    """torch's ``saved_tensors_hooks`` with ``hooks``, plus what savedhooks' eager path keeps per block.

    The pair's eager trampolines see the block (held payloads are settled on
    exit), and a hook that read undefined globals has its cache digest taken
    again. No placement: :class:`savedhooks.saved_tensors_hooks` adds that.

    Args:
        hooks: the pair to apply.

    Returns:
        A context manager yielding ``hooks``.
    """
    functions = _functions_of(hooks)  # None for pairs built elsewhere: no eager cache
    if functions is not None and functions.late_globals:
        _refresh_cache_hash(functions, hooks)
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
        if not hasattr(_active, "stack"):
            _active.stack = []
        _active.stack.append(_Frame(functions, hooks.codec))
        try:
            yield hooks
        finally:
            settle_held(_active.stack.pop())
