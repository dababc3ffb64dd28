"""A pool of host buffers for offload: exact-size slabs, reused across steps.

Design notes
------------
* Why: allocating pinned host memory per saved tensor costs milliseconds and
  synchronizes (``cudaHostAlloc``), which kills the overlap of copies with
  compute; torch's own host allocator rounds every request up to a power of two
  (up to ~1.9x the bytes).
* Exact sizes: a slab serves only requests of its byte size. A training step
  saves the same shapes every step, so the first step allocates what the step
  needs and every later step finds its slabs free again: no rounding, no
  allocation after the first step.
* A slab given back with an event (the CUDA event recorded after the copy that
  reads it) is reused only once the event has completed; without one, at once.
* ``capacity_bytes`` bounds the pool. A request that does not fit first drops
  free slabs of other sizes; if it still does not fit, :class:`HostPoolExhaustedError`
  names the request, what the pool holds and the capacity, or, with
  ``fallback=True``, an unpooled buffer is returned and counted.
* The allocator is a parameter (bytes -> uint8 tensor): pinned host memory when
  CUDA is present, pageable memory otherwise, or a test's own. Nothing here
  needs a GPU.
* Tensors on slabs (:meth:`HostPool.empty_strided`, what ``sh.offload``'s copies
  write into): the slab comes back when the tensor's *storage* is freed, that is
  when the last view of it is gone, never while a view still reads it. The
  tensor is made with ``torch.frombuffer`` over a ctypes array at the slab's
  address; the storage holds the array (its buffer) until it is freed, and a
  ``weakref.finalize`` on the array gives the slab back, with the event that
  ``on_free`` returns then (for pinned slabs, a CUDA event recorded on the
  current stream: a copy still reading the slab is finished before the slab is
  lent again), together with the event of the last copy noted on it
  (:meth:`HostPool.note_copy`: a copy on another stream is covered too).
  Storages can be freed on autograd's device threads, and a finalizer can run
  in the middle of the pool's own work (the garbage collector runs them at
  allocations): it only queues the slab, which the next call under the pool's
  lock takes back.
* ``evict_on_miss``: a request that no free slab serves drops the free slabs
  of sizes asked for neither since the pool last had nothing lent nor in the
  period before (a training step lends its saved tensors' slabs and gets them
  all back by the end of its backward: two steps' sizes stay).
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import threading
import weakref
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

__all__ = ["HostPool", "HostPoolExhaustedError", "PoolStats", "default_pool", "pinned_bytes"]


class HostPoolExhaustedError(RuntimeError):
    """A request does not fit in the pool's capacity."""


def pinned_bytes(nbytes: int) -> torch.Tensor:
    """A host buffer of exactly ``nbytes`` bytes: pinned when CUDA is available, pageable otherwise.

    Args:
        nbytes: its size.

    Returns:
        A one-dimensional ``uint8`` CPU tensor of ``nbytes`` elements.

    Raises:
        RuntimeError: the allocation failed.
    """
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


@dataclasses.dataclass(frozen=True)
class PoolStats:
    """What a :class:`HostPool` holds and has done.

    Attributes:
        slabs: slabs allocated and held (free, lent or waiting on an event).
        bytes: their total size.
        lent: slabs taken and not given back.
        hits: requests served by a free slab.
        allocations: slabs allocated.
        evictions: free slabs dropped to make room.
        fallbacks: unpooled buffers handed out (``fallback=True``).
    """

    slabs: int
    bytes: int
    lent: int
    hits: int
    allocations: int
    evictions: int
    fallbacks: int


class HostPool:
    """Exact-size host buffers, reused (see the module notes)."""

    def __init__(
        self,
        capacity_bytes: int | None = None,
        fallback: bool = False,
        allocate: Callable[[int], torch.Tensor] = pinned_bytes,
        on_free: Callable[[], Any] | None = None,
        evict_on_miss: bool = False,
    ) -> None:
        """Set up an empty pool.

        Args:
            capacity_bytes: the most bytes the pool holds (``None``: no bound).
            fallback: past the capacity, hand out an unpooled buffer instead of raising.
            allocate: bytes -> a one-dimensional ``uint8`` tensor of that many elements.
            on_free: called when the storage of a tensor from :meth:`empty_strided`
                is freed; what it returns is the event its slab waits on (None: reused at once).
            evict_on_miss: a request no free slab serves first drops the free slabs
                of sizes not asked for in this period or the one before (a period
                ends when nothing is lent: a training step's end). Shapes that
                change every step (sequence lengths) would otherwise leave free
                slabs of every size ever seen; steps of the same shapes miss only
                in the first.

        Raises:
            ValueError: ``capacity_bytes`` is negative or not an int.
            TypeError: ``allocate`` or ``on_free`` is not callable.
        """
        if capacity_bytes is not None and (isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int)
                                           or capacity_bytes < 0):
            raise ValueError(f"HostPool: capacity_bytes must be a non-negative int or None, got {capacity_bytes!r}")
        if not callable(allocate):
            raise TypeError(f"HostPool: allocate must be callable, got {type(allocate).__name__}")
        if on_free is not None and not callable(on_free):
            raise TypeError(f"HostPool: on_free must be callable or None, got {type(on_free).__name__}")
        self.capacity_bytes, self.fallback, self._allocate, self._on_free = capacity_bytes, fallback, allocate, on_free
        self.evict_on_miss = evict_on_miss
        self._lock = threading.RLock()
        self._free: dict[int, list[torch.Tensor]] = {}
        self._waiting: list[tuple[torch.Tensor, Any]] = []
        self._lent: dict[int, torch.Tensor] = {}  # id -> slab
        self._unpooled: dict[int, weakref.ref[torch.Tensor]] = {}  # fallback buffers handed out
        self._returned: collections.deque[tuple[torch.Tensor, Any]] = collections.deque()  # from finalizers
        self._copies: dict[int, Any] = {}  # id(slab) -> the event of the last copy noted on it
        self._by_ptr: dict[int, torch.Tensor] = {}  # address -> slab, for slabs under empty_strided tensors
        self._asked: set[int] = set()  # sizes asked for since nothing was lent
        self._asked_before: set[int] = set()  # ... and in the period before
        self._bytes = 0
        self._counts = {"hits": 0, "allocations": 0, "evictions": 0, "fallbacks": 0}

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of exactly ``nbytes`` bytes: a free slab of that size, else a new one.

        Args:
            nbytes: the size, in bytes.

        Returns:
            A one-dimensional ``uint8`` tensor of ``nbytes`` elements; give it back with :meth:`give`.

        Raises:
            ValueError: ``nbytes`` is not a positive int.
            HostPoolExhaustedError: it does not fit in the capacity (and ``fallback`` is off).
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"HostPool.take: nbytes must be a positive int, got {nbytes!r}")
        with self._lock:
            return self._take(nbytes)

    def empty_strided(self, size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized host tensor on a slab of the pool, which comes back when the tensor's storage is freed.

        Args:
            size: the tensor's sizes.
            stride: its strides (in elements); they must not overlap.
            dtype: its dtype.

        Returns:
            A CPU tensor whose storage is exactly the bytes ``size`` and ``stride``
            span (an empty tensor of its own if that is 0). Its slab is given back,
            with the event ``on_free`` returns, once every view of its storage is gone.

        Raises:
            ValueError: ``size`` and ``stride`` differ in length.
            HostPoolExhaustedError: as :meth:`take`.
        """
        if len(size) != len(stride):
            raise ValueError(f"HostPool.empty_strided: {len(size)} sizes but {len(stride)} strides")
        span = 0 if 0 in size else 1 + sum((n - 1) * s for n, s in zip(size, stride))
        nbytes = span * dtype.itemsize
        if not nbytes:
            return torch.empty_strided(size, stride, dtype=dtype)
        slab = self.take(nbytes)
        with self._lock:
            if id(slab) not in self._lent:  # an unpooled fallback buffer: freed with its tensor
                self._unpooled.pop(id(slab), None)
                return torch.empty(0, dtype=dtype).set_(slab.untyped_storage(), 0, size, stride)
            self._by_ptr[slab.data_ptr()] = slab
        holder = (ctypes.c_uint8 * nbytes).from_address(slab.data_ptr())  # views the slab, owns nothing
        weakref.finalize(holder, self._freed, slab).atexit = False
        storage = torch.frombuffer(holder, dtype=torch.uint8).untyped_storage()
        return torch.empty(0, dtype=dtype).set_(storage, 0, size, stride)  # not a view: its own tensor

    def note_copy(self, tensor: torch.Tensor, event: Any) -> None:
        """Note that a copy reading or writing ``tensor`` (from :meth:`empty_strided`) ends with ``event``.

        When the tensor's storage is freed, its slab waits on this event (the
        last one noted) as well as on the one ``on_free`` returns. A tensor
        not on a slab of this pool is ignored.

        Args:
            tensor: the tensor the copy read or wrote.
            event: an object with ``query() -> bool`` (a ``torch.cuda.Event``
                recorded after the copy, on the copy's stream).
        """
        with self._lock:
            slab = self._by_ptr.get(tensor.untyped_storage().data_ptr())
            if slab is not None and id(slab) in self._lent:
                self._copies[id(slab)] = event

    def _freed(self, slab: torch.Tensor) -> None:
        # a finalizer: it may run inside the pool's own calls (at a garbage collection) or on another thread
        self._returned.append((slab, self._on_free() if self._on_free is not None else None))

    def _take(self, nbytes: int) -> torch.Tensor:
        self._reclaim()
        self._asked.add(nbytes)
        free = self._free.get(nbytes)
        if free:
            self._counts["hits"] += 1
            return self._lend(free.pop())
        if self.evict_on_miss:
            self._drop_free(keep=self._asked | self._asked_before)
        if not self._make_room(nbytes):
            if not self.fallback:
                raise HostPoolExhaustedError(
                    f"HostPool: {nbytes} bytes do not fit: the pool holds {self._bytes} bytes "
                    f"({len(self._lent)} slabs lent, {len(self._waiting)} waiting on copies) of its capacity "
                    f"{self.capacity_bytes}; raise capacity_bytes, keep fewer tensors on the host, or pass "
                    "fallback=True"
                )
            self._counts["fallbacks"] += 1
            buffer = self._allocate(nbytes)
            self._unpooled[id(buffer)] = weakref.ref(buffer)
            return buffer
        slab = self._allocate(nbytes)
        if slab.dtype != torch.uint8 or slab.dim() != 1 or slab.numel() != nbytes:
            raise ValueError(f"HostPool: allocate({nbytes}) must return a 1-d uint8 tensor of {nbytes} elements")
        self._bytes += nbytes
        self._counts["allocations"] += 1
        return self._lend(slab)

    def give(self, slab: torch.Tensor, event: Any = None) -> None:
        """Return a slab that :meth:`take` lent; it is reused once ``event`` (if any) has completed.

        Args:
            slab: the tensor :meth:`take` returned (a fallback buffer is accepted and dropped).
            event: an object with ``query() -> bool`` (a ``torch.cuda.Event`` recorded
                after the copy that reads the slab), or None.

        Raises:
            ValueError: ``slab`` is not lent by this pool (given back twice, or another tensor).
        """
        with self._lock:
            self._give(slab, event)

    def _give(self, slab: torch.Tensor, event: Any) -> None:
        if id(slab) not in self._lent:
            unpooled = self._unpooled.pop(id(slab), None)
            if unpooled is not None and unpooled() is slab:
                return  # a fallback buffer: freed with its last reference
            raise ValueError("HostPool.give: this tensor is not lent by the pool (given back twice, or another one)")
        del self._lent[id(slab)]
        if self._by_ptr.get(slab.data_ptr()) is slab:
            del self._by_ptr[slab.data_ptr()]
        event = _AllOf.of(self._copies.pop(id(slab), None), event)
        if not self._lent:  # a period ends (a training step's backward gave back its last slab)
            self._asked_before, self._asked = self._asked, set()
        if event is None:
            self._free.setdefault(slab.numel(), []).append(slab)
        else:
            self._waiting.append((slab, event))

    @property
    def stats(self) -> PoolStats:
        """The pool's :class:`PoolStats`."""
        with self._lock:
            self._reclaim()
            slabs = sum(map(len, self._free.values())) + len(self._waiting) + len(self._lent)
            return PoolStats(slabs, self._bytes, len(self._lent), **self._counts)

    def clear(self) -> None:
        """Drop the free slabs (lent and waiting ones stay).
        """
        with self._lock:
            self._reclaim()
            self._drop_free(count=False)

    def _drop_free(self, keep: Collection[int] = (), count: bool = True) -> None:
        for size in [size for size in self._free if size not in keep]:
            slabs = self._free.pop(size)
            self._bytes -= size * len(slabs)
            self._counts["evictions"] += len(slabs) if count else 0

    def _lend(self, slab: torch.Tensor) -> torch.Tensor:
        self._lent[id(slab)] = slab
        return slab

    def _reclaim(self) -> None:
        while self._returned:  # slabs whose tensors' storages were freed
            self._give(*self._returned.popleft())
        waiting, self._waiting = self._waiting, []
        for slab, event in waiting:
            if event.query():
                self._free.setdefault(slab.numel(), []).append(slab)
            else:
                self._waiting.append((slab, event))

    def _make_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit, after dropping free slabs of other sizes (largest first) if needed."""
        if self.capacity_bytes is None:
            return True
        for size in sorted(self._free, reverse=True):
            while self._bytes + nbytes > self.capacity_bytes and self._free[size]:
                self._free[size].pop()
                self._bytes -= size
                self._counts["evictions"] += 1
        return self._bytes + nbytes <= self.capacity_bytes


class _AllOf:
    """Several events as one: done when each is."""

    def __init__(self, events: tuple[Any, ...]) -> None:
        self.events = events

    @classmethod
    def of(cls, *events: Any) -> Any:
        present = tuple(e for e in events if e is not None)
        return None if not present else present[0] if len(present) == 1 else cls(present)

    def query(self) -> bool:
        return all(e.query() for e in self.events)


_DEFAULT: HostPool | None = None
_DEFAULT_LOCK = threading.Lock()


def default_pool() -> HostPool:
    """The process's pool of pinned host slabs, which ``sh.offload``'s copies from CUDA write into.

    Unbounded, and a request that no free slab serves drops the free slabs of
    sizes not asked for in this step or the one before (``evict_on_miss``):
    steps of the same shapes reuse one step's slabs, steps of changing shapes
    do not pile up slabs of every size. A slab comes back when the saved
    tensor's host copy is freed, after the event of its last copy
    (:meth:`HostPool.note_copy`) and one recorded then on the current stream.

    Returns:
        The pool (made on the first call).
    """
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = HostPool(on_free=_event_on_current_stream, evict_on_miss=True)
    return _DEFAULT


def _event_on_current_stream() -> Any:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    event = torch.cuda.Event()
    event.record()
    return event
