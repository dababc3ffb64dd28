"""Host memory for offload: a pool of exact-size buffers reused across steps (:mod:`savedhooks.hostmem.pool`).

Not yet used by ``sh.offload``: that needs the in-graph asynchronous copy ops of
the offload work (issue 14), whose pack takes a slab and whose unpack gives it
back with the event of its copy.
"""

from savedhooks.hostmem.pool import HostPool, HostPoolExhaustedError, PoolStats, pinned_bytes

__all__ = ["HostPool", "HostPoolExhaustedError", "PoolStats", "pinned_bytes"]
