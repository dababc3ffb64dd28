"""Pack a tensor's deviation from its per-channel mean: for the inputs of batch norm.

Why: a lossy codec's error scales with the magnitude it stores. Batch norm
subtracts each channel's mean in the backward (and under inductor, which
recomputes batch norm and ReLU from the saved convolution output, also the
forward's normalized values and the ReLU mask). When a channel's mean is large
against its spread, fp8's error on ``x`` becomes a large error on ``x - mean``:
the benchmark's cnn under inductor loses gradient SQNR this way. Packing
``x - mean`` instead keeps the error relative to the spread; a shift (one
float32 per channel, below) is added back.

The decoded values keep each channel's mean exactly (up to float32
rounding). Batch norm's input gradient sums to zero over each channel, because
the normalized values have zero mean. From rounded values it does not: each
channel's rounding errors add up to a sum that flows back whole into
everything before the batch norm. Where the true gradient of a parameter there
cancels (a bias a few layers up, whose gradient is a sum over positions, as in
transformers' MobileViTV2), that sum is the gradient's error. So the encoder
reduces its own decoded payload once (a reduction that reads the payload, fused
with the decode under inductor) and stores the shift that gives each channel
back its mean. The variance is not matched: a scale per channel would add a
multiply to the decode, and inductor then writes the decoded values out in full
where batch norm's backward reads them twice.

Non-finite values and overflow: a channel is not centered (its shift is stored
as 0, so the inner codec sees its values unchanged and keeps infinities where it
can) when it holds an inf or NaN, or when ``max |x| + |mean|`` exceeds half the
dtype's largest value (``x - mean`` could overflow there).

Not accepted (stored as they are, or by the policy's ``floating`` codec): tensors
with fewer than 2 dims or without ``channel_dim``, and broadcast (stride-0)
tensors, whose single copy of data the subtraction would expand.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from savedhooks.codecs.base import Codec, as_codec
from savedhooks.codecs.fp8 import Float8
from savedhooks.codecs.layout import is_broadcast

__all__ = ["Centered"]


@dataclasses.dataclass(frozen=True)
class Centered(Codec):
    """Pack ``x - mean`` with ``inner``, the mean taken over every dim but ``channel_dim``.

    Attributes:
        inner: the codec for the centered values (default fp8 e4m3, block 128).
        channel_dim: the dim that keeps one mean per index (1: batch norm's channels).
    """

    inner: Any = Float8()
    channel_dim: int = 1

    def __post_init__(self) -> None:
        inner = as_codec(self.inner, "Centered(inner=...)")
        if inner is None or inner.codecs() != (inner,):
            raise ValueError(f"Centered: inner must be one codec (not a policy or None), got {self.inner!r}")
        object.__setattr__(self, "inner", inner)
        if not isinstance(self.channel_dim, int) or isinstance(self.channel_dim, bool) or self.channel_dim < 0:
            raise ValueError(f"Centered: channel_dim must be a non-negative int, got {self.channel_dim!r}")

    def accepts(self, x: torch.Tensor) -> bool:
        """Floating tensors of 2 or more dims that have ``channel_dim``, are not broadcast, and ``inner`` packs."""
        return (
            x.is_floating_point()
            and x.dim() > max(1, self.channel_dim)
            and not is_broadcast(x)
            and self.inner.accepts(x)
        )

    def encode(self, x: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """``(inner payload of x - mean, shift)``: decoded, ``inner``'s values plus the shift.

        The shift is float32, one per channel, shaped to broadcast against
        ``x``: the channel's mean minus the mean of the payload's decoded
        values, so that the decoded channel has the mean of ``x`` (a channel
        that is not centered gets 0; one whose decoded values are not finite,
        its mean).
        """
        dims = [d for d in range(x.dim()) if d != self.channel_dim]
        mean = x.mean(dims, keepdim=True, dtype=torch.float32)
        # NaN or inf in a channel makes its bound NaN or inf: not centered either
        bound = x.abs().amax(dims, keepdim=True).float() + mean.abs()
        centred = bound <= torch.finfo(x.dtype).max / 2
        mean = torch.where(centred, mean, torch.zeros_like(mean))
        packed = self.inner.encode(x - mean.to(x.dtype))
        # one reduction over the payload (inductor fuses the decode into it: no full-size values)
        drift = self.inner.decode(packed).mean(dims, keepdim=True, dtype=torch.float32)
        matched = centred & torch.isfinite(drift)
        return packed, torch.where(matched, mean - drift, mean)

    def decode(self, payload: tuple[Any, torch.Tensor]) -> torch.Tensor:
        """The inner codec's values plus the shift, in the saved tensor's dtype, shape and strides."""
        packed, shift = payload
        y = self.inner.decode(packed)
        return y + shift.to(y.dtype)
