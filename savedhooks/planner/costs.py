"""What a plan's choices cost in time, measured once per machine: codecs per byte, blocks per recompute.

Design notes
------------
* Measured on the device the plan is for: ``encode`` then ``decode`` of a
  4 MiB tensor (float: normal values; bool: random bits), compiled with the
  plan's backend (inductor generates the codec's fused kernels; aot_eager runs
  its aten ops), after one warm-up call that compiles, best of ``repeats``.
  Inside a model's graphs inductor also fuses the codec with its neighbours, so
  this is a proxy: it ranks codecs and sizes, it does not predict step time.
  The round trip is one function for every codec, dtype and backend, so it is
  compiled with dynamo's recompile limit lifted (past it, dynamo would run it
  eagerly and time aten instead).
  (Eager on CPU it would mislead: aten's float32 -> bfloat16 cast can take
  several times the compiled fp8 round trip.)
* The result is cached for the process, and on disk for later processes on
  the same machine (``costs.json`` in ``$SAVEDHOOKS_CACHE_DIR``, default
  ``~/.cache/savedhooks``; an empty value turns the file off): a calibration
  made once, so that the same model and budget give the same plan in every run
  and in every rank of a machine. Entries are keyed by torch version, host,
  device name, codec, dtype and backend; a file that cannot be read is
  measured over (with a warning), and it is replaced atomically.
* A block's recompute time (:func:`savedhooks.planner.recompute.block_seconds`)
  is kept the same way (:func:`recompute_seconds`), keyed by torch version,
  host, device name, recompute mode, the block paths and a digest of the model
  (its module tree as printed, each module class's source, its parameters' and
  buffers' names, shapes and dtypes) and of the example inputs' shapes. Measured
  per run it was noise: two runs of the main job on unchanged code chose
  different plans for the mlp and the vit under aot_eager. A
  changed ``forward`` changes the class source and is measured again; code
  that the digest does not see (a function the model calls) is not: delete
  the file to measure again.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import pathlib
import platform
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from savedhooks._torch import dynamo, pytree
from savedhooks.codecs.base import Codec
from savedhooks.planner.recompute import FULL, block_seconds, check_mode

__all__ = ["cache_file", "recompute_seconds", "seconds_per_byte"]

_Cost = float | tuple[float, ...]
_CACHE: dict[str, _Cost] = {}
_ELEMENTS = 1 << 20
_ENV = "SAVEDHOOKS_CACHE_DIR"


def cache_file() -> pathlib.Path | None:
    """Where measured costs (codecs, block recomputes) are kept between processes.

    Returns:
        ``costs.json`` in ``$SAVEDHOOKS_CACHE_DIR`` (default ``~/.cache/savedhooks``),
        or None when the variable is set and empty (no file).
    """
    folder = os.environ.get(_ENV)
    if folder == "":
        return None
    return pathlib.Path(folder or pathlib.Path.home() / ".cache" / "savedhooks") / "costs.json"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}:{platform.machine()}:{os.cpu_count()} cores"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _load(path: pathlib.Path) -> tuple[dict[str, Any], str | None]:
    """The file's mapping as it is (``{}`` where there is none), and why it could not be read (None: it could)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError) as error:
        return {}, str(error)
    return (data, None) if isinstance(data, dict) else ({}, "not a mapping of names to seconds")


def _read(path: pathlib.Path) -> dict[str, _Cost]:
    """The file's costs; an entry that is not seconds (a number, or a list of them) is left out, the rest kept."""
    data, why = _load(path)
    if why is not None:
        warnings.warn(f"savedhooks: measured costs in {path} unreadable ({why}); measuring again", stacklevel=4)
    return {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()
            if _is_number(v) or (isinstance(v, list) and all(map(_is_number, v)))}


def _write(path: pathlib.Path, key: str, value: _Cost) -> None:
    """Add ``key`` to the file, keeping every entry it has (also those :func:`_read` leaves out)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {**_load(path)[0], key: value}  # an unreadable file was warned about by _read
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(f.name, path)
    except OSError as error:
        warnings.warn(f"savedhooks: could not keep measured costs in {path} ({error})", stacklevel=4)


def _kept(key: str, measure: Callable[[], _Cost], fits: Callable[[_Cost], bool], on_disk: bool = True) -> _Cost:
    """The cost kept under ``key`` (in the process, then in :func:`cache_file`), else ``measure()``'s, kept.

    What the process holds wins over the file (another process may have
    measured the same key since); a kept value that does not ``fit`` (another
    kind of cost under the key) is measured over.
    """
    path = cache_file() if on_disk else None
    if key not in _CACHE and path is not None:
        for k, v in _read(path).items():
            _CACHE.setdefault(k, v)
    if key not in _CACHE or not fits(_CACHE[key]):
        _CACHE[key] = measure()
        if path is not None:
            _write(path, key, _CACHE[key])
    return _CACHE[key]


def _sample(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return (torch.rand(1024, _ELEMENTS // 1024, generator=generator) > 0.5).to(device)
    return torch.randn(1024, _ELEMENTS // 1024, generator=generator).to(device=device, dtype=dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_byte(
    codec: Codec, dtype: torch.dtype, device: torch.device | str, backend: Any = "inductor", repeats: int = 3
) -> float:
    """Seconds ``codec`` takes to pack and unpack one byte of ``dtype`` on ``device``, compiled with ``backend``.

    Args:
        codec: a savedhooks codec that accepts ``dtype``.
        dtype: the saved tensors' dtype.
        device: where they live.
        backend: the ``torch.compile`` backend the round trip is compiled with
            (a name; a backend object's costs are kept for the process only).
        repeats: timed calls (the best counts).

    Returns:
        Seconds per input byte (cached per codec, dtype, device and backend, in
        the process and in :func:`cache_file`).

    Raises:
        ValueError: ``repeats`` is not positive, or the codec does not accept ``dtype``.
    """
    if repeats < 1:
        raise ValueError(f"seconds_per_byte: repeats must be positive, got {repeats}")
    device = torch.device(device)
    key = "|".join((torch.__version__, platform.node(), _device_name(device), repr(codec), str(dtype), str(backend)))

    def measure() -> float:
        x = _sample(dtype, device)
        if not codec.accepts(x):
            raise ValueError(f"seconds_per_byte: {codec!r} does not accept {dtype}")
        round_trip = torch.compile(lambda t: codec.decode(codec.encode(t)), backend=backend, dynamic=False)
        # one code object for every codec, dtype and backend: past dynamo's recompile limit it would run eagerly
        with dynamo.config.patch(recompile_limit=1 << 16, accumulated_recompile_limit=1 << 16):
            round_trip(x)
            best = float("inf")
            for _ in range(repeats):
                _sync(x.device)
                start = time.perf_counter()
                round_trip(x)
                _sync(x.device)
                best = min(best, time.perf_counter() - start)
        return best / (x.numel() * x.element_size())

    # a backend object names no run but this one: kept for the process only
    return _kept(key, measure, _is_number, on_disk=isinstance(backend, str))


def recompute_seconds(
    model: torch.nn.Module, example_inputs: Any, paths: Sequence[str], mode: str = FULL
) -> tuple[float, ...]:
    """Each block's recompute time (:func:`~savedhooks.planner.recompute.block_seconds`), measured once per machine.

    Args:
        model: the module.
        example_inputs: as for :func:`savedhooks.plan`.
        paths: the blocks' module paths.
        mode: ``"full"`` or ``"selective"``.

    Returns:
        Seconds per block, in the order of ``paths`` (kept in the process and
        in :func:`cache_file`, keyed by the model's and inputs' digest, the
        paths, the mode and the device; see the design notes).

    Raises:
        ValueError: a path names no submodule, an unknown ``mode``, or a block
            did not run in the forward.
    """
    check_mode(mode)
    device = next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))
    key = "|".join((torch.__version__, platform.node(), _device_name(device), "recompute", mode, ",".join(paths),
                    _digest(model, example_inputs)))

    def fits(value: _Cost) -> bool:
        return isinstance(value, tuple) and len(value) == len(paths)

    return _kept(key, lambda: block_seconds(model, example_inputs, paths, mode=mode), fits)


def _digest(model: torch.nn.Module, example_inputs: Any) -> str:
    """A digest of what a block's time depends on: the module tree, its classes' sources, tensors' shapes."""
    parts = [repr(model), f"training={model.training}"]
    for cls in sorted({type(m) for m in model.modules()}, key=lambda c: f"{c.__module__}.{c.__qualname__}"):
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):  # defined in an interpreter session, or built in
            source = ""
        parts.append(f"{cls.__module__}.{cls.__qualname__}:{source}")
    named = [*model.named_parameters(), *model.named_buffers()]
    leaves = [(name, t) for name, t in named] + [(str(i), t) for i, t in enumerate(pytree.tree_leaves(example_inputs))]
    for name, t in leaves:
        if isinstance(t, torch.Tensor):
            parts.append(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.device.type}:{t.requires_grad}")
        else:
            parts.append(f"{name}:{type(t).__name__}:{t!r}" if isinstance(t, (bool, int, float, str, type(None)))
                         else f"{name}:{type(t).__name__}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]
