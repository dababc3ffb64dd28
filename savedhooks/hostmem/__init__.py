"""Host memory for offload.

* :mod:`savedhooks.hostmem.pool`: a pool of exact-size host buffers reused across
  steps. ``sh.offload``'s pinned copies write into its :func:`default_pool`; the
  overlapped form of compiled CUDA graphs (``ao::offload``) allocates through
  torch's host allocator.
* :mod:`savedhooks.hostmem.overlap`: turns the offload codec's copy nodes in a
  compiled CUDA graph into torch's asynchronous copy ops and places them to
  overlap compute (run by the reorder pass).
"""

from savedhooks.hostmem.overlap import (
    Transfer,
    TransferModel,
    backward_seconds_before_use,
    nominal_seconds,
    overlap_transfers,
)
from savedhooks.hostmem.pool import HostPool, HostPoolExhaustedError, PoolStats, default_pool, pinned_bytes

__all__ = [
    "HostPool",
    "HostPoolExhaustedError",
    "PoolStats",
    "Transfer",
    "TransferModel",
    "backward_seconds_before_use",
    "default_pool",
    "nominal_seconds",
    "overlap_transfers",
    "pinned_bytes",
]
