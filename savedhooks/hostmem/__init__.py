"""Host memory for offload.

* :mod:`savedhooks.hostmem.pool`: a pool of exact-size host buffers reused across
  steps. Not yet used by ``sh.offload``: its copies allocate through torch's host
  allocator (``ao::offload`` in the overlapped form).
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
from savedhooks.hostmem.pool import HostPool, HostPoolExhaustedError, PoolStats, pinned_bytes

__all__ = [
    "HostPool",
    "HostPoolExhaustedError",
    "PoolStats",
    "Transfer",
    "TransferModel",
    "backward_seconds_before_use",
    "nominal_seconds",
    "overlap_transfers",
    "pinned_bytes",
]
