"""What a codec costs in time: seconds per byte, measured once per codec, dtype and device.

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
  (Eager on CPU it would mislead: aten's float32 -> bfloat16 cast measured 6x
  the compiled fp8 round trip on the project's machine.)
* The result is cached for the process, and on disk for later processes on
  the same machine (``costs.json`` in ``$SAVEDHOOKS_CACHE_DIR``, default
  ``~/.cache/savedhooks``; an empty value turns the file off): a calibration
  made once, so that the same model and budget give the same plan in every run
  and in every rank of a machine. Entries are keyed by torch version, host,
  device name, codec, dtype and backend; a file that cannot be read is
  measured over (with a warning), and it is replaced atomically.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import tempfile
import time
import warnings
from typing import Any

import torch

from savedhooks.codecs.base import Codec

__all__ = ["cache_file", "seconds_per_byte"]

_CACHE: dict[str, float] = {}
_ELEMENTS = 1 << 20
_ENV = "SAVEDHOOKS_CACHE_DIR"


def cache_file() -> pathlib.Path | None:
    """Where measured codec costs are kept between processes.

    Args:
        None.

    Returns:
        ``costs.json`` in ``$SAVEDHOOKS_CACHE_DIR`` (default ``~/.cache/savedhooks``),
        or None when the variable is set and empty (no file).

    Raises:
        Nothing.
    """
    folder = os.environ.get(_ENV)
    if folder == "":
        return None
    return pathlib.Path(folder or pathlib.Path.home() / ".cache" / "savedhooks") / "costs.json"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}:{platform.machine()}:{os.cpu_count()} cores"


def _read(path: pathlib.Path) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not all(isinstance(v, (int, float)) for v in data.values()):
            raise ValueError("not a mapping of names to seconds per byte")
        return data
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        warnings.warn(f"savedhooks: codec costs in {path} unreadable ({error}); measuring again", stacklevel=3)
        return {}


def _write(path: pathlib.Path, key: str, value: float) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {**_read(path), key: value}
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(f.name, path)
    except OSError as error:
        warnings.warn(f"savedhooks: could not keep codec costs in {path} ({error})", stacklevel=3)


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
    path = cache_file() if isinstance(backend, str) else None  # a backend object names no run but this one
    if key not in _CACHE and path is not None:
        _CACHE.update(_read(path))
    if key not in _CACHE:
        x = _sample(dtype, device)
        if not codec.accepts(x):
            raise ValueError(f"seconds_per_byte: {codec!r} does not accept {dtype}")
        round_trip = torch.compile(lambda t: codec.decode(codec.encode(t)), backend=backend, dynamic=False)
        # one code object for every codec, dtype and backend: past dynamo's recompile limit it would run eagerly
        with torch._dynamo.config.patch(recompile_limit=1 << 16, accumulated_recompile_limit=1 << 16):
            round_trip(x)
            best = float("inf")
            for _ in range(repeats):
                _sync(x.device)
                start = time.perf_counter()
                round_trip(x)
                _sync(x.device)
                best = min(best, time.perf_counter() - start)
        _CACHE[key] = best / (x.numel() * x.element_size())
        if path is not None:
            _write(path, key, _CACHE[key])
    return _CACHE[key]
