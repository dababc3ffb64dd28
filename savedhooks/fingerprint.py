"""Stable fingerprints of hook functions, for hook identity and cache keys.

Why: dynamo guards saved-tensor hooks by ``id(pack), id(unpack)``, so a hook
rebuilt from equal code and configuration must map to the *same* HookPair, and
AOTAutograd's on-disk cache needs a hash that is equal across processes for equal
code and different when the code changes. Neither ``id`` nor ``hash`` of a
function gives that; a digest of what the function would *do* does.

The digest covers, recursively: the bytecode, constants and names of the code
object (nested code included; file name and line numbers are left out so moving
a function does not invalidate caches), default arguments, closure cells, and
module globals the code names (constants by value, functions by their own
fingerprint, classes and modules by qualified name). Anything else that the
function captures (a tensor, an ``nn.Module``, an arbitrary object) has no
stable value: :class:`UnfingerprintableError` says which, and callers then treat
the hook as unique to this process instead of guessing.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import types
from typing import Any

import torch

__all__ = ["UnfingerprintableError", "fingerprint"]

# Scalars whose repr is their value, identical across processes.
_SCALARS = (type(None), bool, int, float, complex, str, bytes)
# torch value types with a stable str() (e.g. "torch.bfloat16", "cuda:0").
_TORCH_VALUES = (torch.dtype, torch.device, torch.layout, torch.memory_format)


class UnfingerprintableError(TypeError):
    """A hook captures a value that has no stable, process-independent digest."""


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
    canon = _canonical(obj, path="<hook>", seen=set())
    return hashlib.sha256(repr(canon).encode()).hexdigest()


def _canonical(obj: Any, path: str, seen: set[int]) -> Any:
    if isinstance(obj, _SCALARS):
        return (type(obj).__name__, obj)
    if isinstance(obj, _TORCH_VALUES):
        return (type(obj).__name__, str(obj))
    if isinstance(obj, torch.Size):
        return ("Size", tuple(obj))
    if isinstance(obj, enum.Enum):
        return ("enum", _qualname(type(obj)), obj.name)
    if isinstance(obj, (tuple, list)):
        return (type(obj).__name__, tuple(_canonical(v, f"{path}[{i}]", seen) for i, v in enumerate(obj)))
    if isinstance(obj, (set, frozenset)):
        return (type(obj).__name__, tuple(sorted(repr(_canonical(v, path, seen)) for v in obj)))
    if isinstance(obj, dict):
        items = [(repr(_canonical(k, path, seen)), _canonical(v, f"{path}[{k!r}]", seen)) for k, v in obj.items()]
        return ("dict", tuple(sorted(items, key=lambda kv: kv[0])))
    if isinstance(obj, types.ModuleType):
        return ("module", obj.__name__)
    if isinstance(obj, type):
        return ("type", _qualname(obj))
    if isinstance(obj, (types.BuiltinFunctionType, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return ("builtin", _qualname(obj))
    if isinstance(obj, types.FunctionType):
        if _is_torch(obj):  # torch's version is already part of every torch cache key
            return ("torch function", _qualname(obj))
        return _canonical_function(obj, path, seen)
    if isinstance(obj, types.MethodType):
        return ("method", _canonical(obj.__self__, f"{path}.__self__", seen), _canonical(obj.__func__, path, seen))
    if isinstance(obj, functools.partial):
        return (
            "partial",
            _canonical(obj.func, f"{path}.func", seen),
            _canonical(obj.args, f"{path}.args", seen),
            _canonical(obj.keywords, f"{path}.keywords", seen),
        )
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        return ("dataclass", _qualname(type(obj)), _canonical(fields, path, seen))
    raise UnfingerprintableError(
        f"{path} is a {type(obj).__module__}.{type(obj).__qualname__}, which has no stable value "
        "to fingerprint (supported: constants, dtypes/devices, tuples/lists/dicts of them, "
        "dataclasses, functions, classes, modules)"
    )


def _canonical_function(fn: types.FunctionType, path: str, seen: set[int]) -> Any:
    if id(fn) in seen:  # recursion (a helper calling itself): the name is enough
        return ("recursive", fn.__qualname__)
    seen = seen | {id(fn)}
    code = fn.__code__
    closure = ()
    if fn.__closure__:
        closure = tuple(
            _canonical(_cell_value(cell), f"{path}.<closure {name}>", seen)
            for name, cell in zip(code.co_freevars, fn.__closure__)
        )
    globals_used = tuple(
        (name, _canonical(fn.__globals__[name], f"{path}.<global {name}>", seen))
        for name in sorted(_names_used(code))
        if name in fn.__globals__
    )
    return (
        "function",
        _canonical_code(code),
        _canonical(fn.__defaults__, f"{path}.__defaults__", seen),
        _canonical(fn.__kwdefaults__, f"{path}.__kwdefaults__", seen),
        closure,
        globals_used,
    )


def _canonical_code(code: types.CodeType) -> Any:
    consts = tuple(_canonical_code(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts)
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


def _names_used(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_used(const)
    return names


def _cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell: the closure variable is not bound yet
        return None


def _is_torch(fn: types.FunctionType) -> bool:
    module = fn.__module__ or ""
    return module == "torch" or module.startswith("torch.")


def _qualname(obj: Any) -> str:
    module = getattr(obj, "__module__", None) or ""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or str(obj)
    return f"{module}.{name}"
