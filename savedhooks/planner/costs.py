"""What a codec costs in time: seconds per byte, measured once per codec, dtype and device.

Design notes
------------
* Measured on the device the plan is for: ``encode`` then ``decode`` of a
  4 MiB tensor (float: normal values; bool: random bits), compiled with the
  plan's backend (inductor generates the codec's fused kernels; aot_eager runs
  its aten ops), after one warm-up call that compiles, best of ``repeats``.
  Inside a model's graphs inductor also fuses the codec with its neighbours, so
  this is a proxy: it ranks codecs and sizes, it does not predict step time.
  (Eager on CPU it would mislead: aten's float32 -> bfloat16 cast measured 6x
  the compiled fp8 round trip on the project's machine.)
* The result is cached for the process: a plan of a large model measures each
  codec once per dtype, device and backend.
"""

from __future__ import annotations

import time

import torch

from savedhooks.codecs.base import Codec

__all__ = ["seconds_per_byte"]

_CACHE: dict[tuple[str, torch.dtype, str, str], float] = {}
_ELEMENTS = 1 << 20


def _sample(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return (torch.rand(1024, _ELEMENTS // 1024, generator=generator) > 0.5).to(device)
    return torch.randn(1024, _ELEMENTS // 1024, generator=generator).to(device=device, dtype=dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_byte(
    codec: Codec, dtype: torch.dtype, device: torch.device, backend: str = "inductor", repeats: int = 3
) -> float:
    """Seconds ``codec`` takes to pack and unpack one byte of ``dtype`` on ``device``, compiled with ``backend``.

    Args:
        codec: a savedhooks codec that accepts ``dtype``.
        dtype: the saved tensors' dtype.
        device: where they live.
        backend: the ``torch.compile`` backend the round trip is compiled with.
        repeats: timed calls (the best counts).

    Returns:
        Seconds per input byte (cached per codec, dtype, device and backend).

    Raises:
        ValueError: ``repeats`` is not positive, or the codec does not accept ``dtype``.
    """
    if repeats < 1:
        raise ValueError(f"seconds_per_byte: repeats must be positive, got {repeats}")
    key = (repr(codec), dtype, str(device), backend)
    if key not in _CACHE:
        x = _sample(dtype, torch.device(device))
        if not codec.accepts(x):
            raise ValueError(f"seconds_per_byte: {codec!r} does not accept {dtype}")
        round_trip = torch.compile(lambda t: codec.decode(codec.encode(t)), backend=backend, dynamic=False)
        round_trip(x)
        best = float("inf")
        for _ in range(repeats):
            _sync(x.device)
            start = time.perf_counter()
            round_trip(x)
            _sync(x.device)
            best = min(best, time.perf_counter() - start)
        _CACHE[key] = best / (x.numel() * x.element_size())
    return _CACHE[key]
