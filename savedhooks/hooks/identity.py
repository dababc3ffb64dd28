"""Stable fingerprints of hook functions, for hook identity and cache keys.

Why: dynamo guards saved-tensor hooks by ``id(pack), id(unpack)``, so a hook
rebuilt from equal code and configuration must map to the *same* HookPair, and
AOTAutograd's on-disk cache needs a hash that is equal across processes for equal
code and different when the code changes. Neither ``id`` nor ``hash`` of a
function gives that; a digest of what the function would *do* does.

What the digest covers, recursively:

* the code object: bytecode, constants (canonicalized, so a set constant does
  not depend on ``PYTHONHASHSEED``), names, nested code; not file names or line
  numbers, so moving a function keeps caches valid;
* default arguments and closure cells (tuples and frozensets by value; lists,
  dicts and sets are refused, since their contents can change after the hook is
  built);
* the globals the code *loads* (read from the bytecode, so attribute names such
  as ``.to`` are not mistaken for globals): constants by value, functions by
  their own fingerprint, user classes by their methods and attributes, modules by
  name plus the attributes the code names on them (``cfg.DTYPE``);
* bound builtins with their object (``{...}.get``), and decorated functions
  through ``__wrapped__``.

torch's and savedhooks' own functions and classes are named, not walked: torch's
version is part of every torch cache key, and savedhooks puts a digest of its own
source into every hook's cache hash. A value with no stable digest (a tensor, an
``nn.Module``, an arbitrary object) raises :class:`UnfingerprintableError`, and
callers then treat the hook as unique to this process instead of guessing.
Globals that do not exist yet when the hook is fingerprinted (assigned later,
e.g. in ``main()``) are reported by :func:`fingerprint_details` so that the
digest can be taken again when the hook is used.
"""

from __future__ import annotations

import builtins
import dataclasses
import dis
import enum
import functools
import hashlib
import pathlib
import types
from typing import Any

import torch

import savedhooks.kernels
from savedhooks._torch.ops import OpOverload, OpOverloadPacket

__all__ = ["Fingerprint", "UnfingerprintableError", "fingerprint", "fingerprint_details", "source_digest"]

# Scalars whose repr is their value, identical across processes.
_SCALARS = (type(None), type(...), bool, int, float, complex, str, bytes)
# torch value types with a stable str() (e.g. "torch.bfloat16", "cuda:0").
_TORCH_VALUES = (torch.dtype, torch.device, torch.layout, torch.memory_format)
_GLOBAL_LOADS = {"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL"}


class UnfingerprintableError(TypeError):
    """A hook captures a value that has no stable, process-independent digest."""


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """A digest and what it could not see yet.

    Attributes:
        digest: sha256 hex digest.
        late_globals: names the code loads as globals that were not defined
            when the digest was taken (their values are not in it).
    """

    digest: str
    late_globals: tuple[str, ...]


def fingerprint(obj: Any) -> str:
    """Return a hex digest of what ``obj`` computes, stable across processes.

    Args:
        obj: a Python function, bound method, ``functools.partial``, class, or a
            (nested) constant such as an int, str, tuple or ``torch.dtype``.

    Returns:
        A 64-character sha256 hex digest. Equal code with equal captured
        configuration gives the same digest in any process on the same Python
        version; changing the code or any captured value changes it.

    Raises:
        UnfingerprintableError: ``obj`` (or something it captures) has no stable
            value, e.g. a tensor or an arbitrary object. The message names the
            path to the offending value.
    """
    return fingerprint_details(obj).digest


def fingerprint_details(obj: Any) -> Fingerprint:
    """Like :func:`fingerprint`, and also report globals that are not defined yet.

    Args:
        obj: as for :func:`fingerprint`.

    Returns:
        A :class:`Fingerprint`.

    Raises:
        UnfingerprintableError: as for :func:`fingerprint`.
    """
    walker = _Walker()
    canon = walker.canonical(obj, "<hook>")
    digest = hashlib.sha256(repr(canon).encode()).hexdigest()
    return Fingerprint(digest, tuple(sorted(walker.late_globals)))


class _Walker:
    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.late_globals: set[str] = set()

    def canonical(self, obj: Any, path: str) -> Any:  # noqa: C901 - one case per kind of value
        if isinstance(obj, _SCALARS):
            return (type(obj).__name__, obj)
        if isinstance(obj, _TORCH_VALUES):
            return (type(obj).__name__, str(obj))
        if isinstance(obj, torch.Size):
            return ("Size", tuple(obj))
        if isinstance(obj, enum.Enum):
            return ("enum", _qualname(type(obj)), obj.name)
        if isinstance(obj, tuple):
            return ("tuple", tuple(self.canonical(v, f"{path}[{i}]") for i, v in enumerate(obj)))
        if isinstance(obj, frozenset):
            return ("frozenset", tuple(sorted(repr(self.canonical(v, path)) for v in obj)))
        if isinstance(obj, (list, dict, set, bytearray)):
            # Its contents can change after the hook is built: a digest of today's contents
            # would share one pair between hooks that write to different lists, and keep
            # serving a cached graph after the values it was traced with changed.
            raise UnfingerprintableError(
                f"{path} is a mutable {type(obj).__name__}, whose contents can change after the hook is "
                "built (capture a tuple or frozenset instead)"
            )
        if isinstance(obj, types.ModuleType):
            return ("module", obj.__name__)
        if isinstance(obj, type):
            return self._class(obj, path)
        if isinstance(obj, (OpOverload, OpOverloadPacket)):
            return ("op", str(obj))
        if isinstance(obj, types.BuiltinFunctionType):
            owner = getattr(obj, "__self__", None)
            if owner is None or isinstance(owner, types.ModuleType):
                return ("builtin", _qualname(obj))
            return ("bound builtin", obj.__name__, self.canonical(owner, f"{path}.__self__"))
        if isinstance(obj, types.FunctionType):
            return self._function(obj, path)
        if isinstance(obj, types.MethodType):
            return ("method", self.canonical(obj.__self__, f"{path}.__self__"), self.canonical(obj.__func__, path))
        if isinstance(obj, functools.partial):
            return (
                "partial",
                self.canonical(obj.func, f"{path}.func"),
                self.canonical(obj.args, f"{path}.args"),
                self._mapping(obj.keywords, f"{path}.keywords"),
            )
        if dataclasses.is_dataclass(obj):
            fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
            return ("dataclass", self._class(type(obj), path), self._mapping(fields, path))
        wrapped = getattr(obj, "__wrapped__", None)  # functools.lru_cache and other wrappers
        if wrapped is not None:
            return ("wrapper", _qualname(type(obj)), self.canonical(wrapped, f"{path}.__wrapped__"))
        raise UnfingerprintableError(
            f"{path} is a {type(obj).__module__}.{type(obj).__qualname__}, which has no stable value "
            "to fingerprint (supported: constants, dtypes/devices, tuples/lists/dicts of them, "
            "dataclasses, functions, classes, modules)"
        )

    def _mapping(self, mapping: dict[str, Any] | None, path: str) -> Any:
        """A dict the fingerprinted object owns (keyword arguments, dataclass fields), by contents."""
        items = sorted((mapping or {}).items())
        return ("mapping", tuple((k, self.canonical(v, f"{path}[{k!r}]")) for k, v in items))

    def _function(self, fn: types.FunctionType, path: str) -> Any:
        if _is_library(fn.__module__):
            return ("library function", _qualname(fn))
        if id(fn) in self.seen:  # recursion (a helper calling itself): the name is enough
            return ("recursive", fn.__qualname__)
        self.seen.add(id(fn))
        wrapped = getattr(fn, "__wrapped__", None)
        if wrapped is not None:  # a decorator's wrapper: its closure holds the decorator, not config
            return ("decorated", _canonical_code(fn.__code__, self, path), self.canonical(wrapped, f"{path}.__wrapped__"))
        code = fn.__code__
        closure = ()
        if fn.__closure__:
            closure = tuple(
                self.canonical(_cell_value(cell), f"{path}.<closure {name}>")
                for name, cell in zip(code.co_freevars, fn.__closure__)
            )
        return (
            "function",
            _canonical_code(code, self, path),
            self.canonical(fn.__defaults__, f"{path}.__defaults__"),
            self._mapping(fn.__kwdefaults__, f"{path}.__kwdefaults__"),
            closure,
            self._globals(code, fn.__globals__, path),
        )

    def _globals(self, code: types.CodeType, namespace: dict[str, Any], path: str) -> tuple[Any, ...]:
        out = []
        attrs = _attribute_names(code)
        for name in sorted(_global_loads(code)):
            if name in namespace:
                value = namespace[name]
                entry = self.canonical(value, f"{path}.<global {name}>")
                if isinstance(value, types.ModuleType):
                    entry = (entry, self._module_attributes(value, attrs, f"{path}.<global {name}>"))
                out.append((name, entry))
            elif not hasattr(builtins, name):
                self.late_globals.add(name)
                out.append((name, "<undefined>"))
        return tuple(out)

    def _module_attributes(self, module: types.ModuleType, names: set[str], path: str) -> tuple[Any, ...]:
        # cfg.DTYPE: the code names DTYPE as an attribute; its value belongs in the digest.
        # Library modules are named, not walked, so their opaque attributes are tolerated.
        out = []
        for name in sorted(names):
            if not hasattr(module, name):
                continue
            value = getattr(module, name)
            try:
                out.append((name, self.canonical(value, f"{path}.{name}")))
            except UnfingerprintableError:
                if _is_user_module(module):
                    raise
                out.append((name, ("opaque", _qualname(type(value)))))
        return tuple(out)

    def _class(self, cls: type, path: str) -> Any:
        # exec'd code puts its classes in "builtins"; only real builtins are named
        real_builtin = cls.__module__ == "builtins" and getattr(builtins, cls.__name__, None) is cls
        library = _is_library(cls.__module__) and (cls.__module__ != "builtins" or real_builtin)
        if library or id(cls) in self.seen:
            return ("type", _qualname(cls))
        self.seen.add(id(cls))
        members = []
        for name, value in sorted(vars(cls).items()):
            if name.startswith("__") and name not in ("__init__", "__call__", "__post_init__"):
                continue
            value = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            if isinstance(value, property):
                value = (value.fget, value.fset)
            members.append((name, self.canonical(value, f"{path}.{name}")))
        bases = tuple(self.canonical(b, f"{path}.<base>") for b in cls.__bases__ if b is not object)
        return ("class", _qualname(cls), bases, tuple(members))


def _canonical_code(code: types.CodeType, walker: _Walker, path: str) -> Any:
    consts = tuple(
        _canonical_code(c, walker, path) if isinstance(c, types.CodeType) else walker.canonical(c, f"{path}.<const>")
        for c in code.co_consts
    )
    return (
        code.co_code,
        consts,
        code.co_names,
        code.co_varnames,
        code.co_freevars,
        code.co_argcount,
        code.co_kwonlyargcount,
        code.co_flags,
    )


def _global_loads(code: types.CodeType) -> set[str]:
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in _GLOBAL_LOADS}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_loads(const)
    return names


def _attribute_names(code: types.CodeType) -> set[str]:
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in ("LOAD_ATTR", "LOAD_METHOD")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _attribute_names(const)
    return names


def _cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell: the closure variable is not bound yet
        return None


# Named, not walked: their versions are in the cache hash (torch's by torch,
# savedhooks' by savedhooks.hooks), and the rest is the standard library.
_LIBRARIES = ("torch", "savedhooks", "builtins", "typing", "functools", "collections", "enum", "dataclasses", "abc")


def _is_library(module: str | None) -> bool:
    return (module or "").split(".")[0] in _LIBRARIES


def _is_user_module_name(module: str | None) -> bool:
    return not _is_library(module)


def _is_user_module(module: types.ModuleType) -> bool:
    return _is_user_module_name(module.__name__) and "site-packages" not in (getattr(module, "__file__", "") or "")


def _qualname(obj: Any) -> str:
    module = getattr(obj, "__module__", None) or ""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or str(obj)
    return f"{module}.{name}"


@functools.cache
def source_digest() -> str:
    """A digest of every Python file of the installed savedhooks, its kernels included.

    What a hook traces to and what the reorder pass does can change with any of
    savedhooks' own files; fingerprints name savedhooks' functions without
    walking them, so caches key on this. The files are found from the packages'
    own ``__path__`` (``savedhooks.kernels`` lives wherever the install put it),
    read once per process.

    Returns:
        A hex SHA-256 over the files' paths relative to their package and their bytes.
    """
    roots = [pathlib.Path(p).resolve() for p in (*savedhooks.__path__, *savedhooks.kernels.__path__)]
    digest = hashlib.sha256()
    seen = set()
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if path in seen:
                continue
            seen.add(path)
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()
