"""AOTAutograd's activation-offloading ops (``torch._functorch._activation_offloading.offload_ops``).

Importing that module registers ``ao::offload``, ``ao::reload`` and
``ao::wait_tensor``; it also keeps, per device, the stream host copies run on and
the events ``ao::wait_tensor`` waits for. savedhooks' own offload op copies on
that stream and registers its event there, so torch's wait finds it. Imported
on first use: ``import savedhooks`` does not load it.

torch 2.11 has no such module (:data:`HAS_AO_OPS` is False): there, offload
copies stay synchronous on the compute stream (``savedhooks.compiler.overlap``
says so once in a log line).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

__all__ = ["HAS_AO_OPS", "ao_ops", "register_wait", "transfer_stream"]

# torch 2.12+: torch._functorch._activation_offloading.offload_ops (ao::offload, ao::reload, ao::wait_tensor)
HAS_AO_OPS = importlib.util.find_spec("torch._functorch._activation_offloading.offload_ops") is not None


def _offload_ops() -> Any:
    """torch's offloading module, imported (and its ``ao::`` ops registered) on first use."""
    from torch._functorch._activation_offloading import offload_ops  # registers the ao:: ops

    return offload_ops


def ao_ops() -> Any:
    """The ``torch.ops.ao`` namespace, with its offloading ops registered.

    Returns:
        ``torch.ops.ao`` (``offload``, ``reload``, ``wait_tensor``).
    """
    _offload_ops()
    return torch.ops.ao


def transfer_stream(device: torch.device) -> Any:
    """The stream the offloading ops copy on, for a device (created on first use).

    Args:
        device: an accelerator device.

    Returns:
        The device's transfer stream.
    """
    return _offload_ops()._get_or_create_transfer_stream(device)


def register_wait(host: torch.Tensor, device: torch.device) -> Any:
    """Register the event a later ``ao::wait_tensor`` on ``host`` waits for.

    Args:
        host: the host tensor a copy is filling.
        device: the accelerator the copy comes from.

    Returns:
        The event to record on the transfer stream once the copy is queued.
    """
    return _offload_ops()._register_wait(host, device)
