"""Host memory for offload.

:mod:`savedhooks.hostmem.pool`: a pool of exact-size host buffers reused across
steps. ``sh.offload``'s pinned copies write into its :func:`default_pool`, and
so do the overlapped copies of compiled CUDA graphs (``savedhooks::offload``,
placed by :mod:`savedhooks.compiler.overlap`).
"""

from savedhooks.hostmem.pool import HostPool, HostPoolExhaustedError, PoolStats, default_pool, pinned_bytes

__all__ = [
    "HostPool",
    "HostPoolExhaustedError",
    "PoolStats",
    "default_pool",
    "pinned_bytes",
]
