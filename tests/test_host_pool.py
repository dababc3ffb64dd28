"""The host pool for offload: exact sizes, reuse across steps, events, the capacity (savedhooks.hostmem)."""

import pytest
import torch

from savedhooks.hostmem import HostPool, HostPoolExhaustedError, pinned_bytes


class _Counting:
    """An allocator that counts what it allocates (pageable memory)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, nbytes: int) -> torch.Tensor:
        self.sizes.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)


class _Event:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_slabs_have_exact_sizes_and_a_later_step_allocates_nothing():
    allocate = _Counting()
    pool = HostPool(allocate=allocate)
    step = [1000, 4096, 1000, 24]  # one step's saved tensors, in bytes (no power of two needed)
    for _ in range(3):
        slabs = [pool.take(n) for n in step]
        assert [s.numel() for s in slabs] == step and len({s.data_ptr() for s in slabs}) == len(step)
        for slab in slabs:
            pool.give(slab)
    assert sorted(allocate.sizes) == sorted(step)  # the first step only
    stats = pool.stats
    assert (stats.slabs, stats.bytes, stats.lent, stats.allocations, stats.hits) == (4, 6120, 0, 4, 8)


def test_a_slab_given_with_an_event_is_reused_only_once_the_copy_is_done():
    allocate = _Counting()
    pool = HostPool(allocate=allocate)
    first = pool.take(512)
    event = _Event()
    pool.give(first, event)
    second = pool.take(512)  # the copy out of `first` may still run: a new slab
    assert second.data_ptr() != first.data_ptr() and len(allocate.sizes) == 2
    pool.give(second)
    event.done = True
    a, b = pool.take(512), pool.take(512)
    assert {a.data_ptr(), b.data_ptr()} == {first.data_ptr(), second.data_ptr()} and len(allocate.sizes) == 2


def test_the_capacity_drops_free_slabs_of_other_sizes_then_raises_or_falls_back():
    pool = HostPool(capacity_bytes=1000, allocate=_Counting())
    big = pool.take(600)
    exhausted = r"500 bytes do not fit: the pool holds 600 bytes .* capacity 1000"
    with pytest.raises(HostPoolExhaustedError, match=exhausted):
        pool.take(500)
    pool.give(big)
    small = pool.take(500)  # the free 600-byte slab is dropped to make room
    assert pool.stats.evictions == 1 and pool.stats.bytes == 500
    lenient = HostPool(capacity_bytes=100, fallback=True, allocate=_Counting())
    spare = lenient.take(200)
    assert spare.numel() == 200 and lenient.stats.fallbacks == 1 and lenient.stats.bytes == 0
    lenient.give(spare)  # accepted and dropped
    pool.give(small)
    with pytest.raises(ValueError, match="not lent by the pool"):
        pool.give(small)
    with pytest.raises(ValueError, match="not lent by the pool"):
        lenient.give(torch.empty(200, dtype=torch.uint8))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostPool(capacity_bytes=-1)
    with pytest.raises(TypeError, match="allocate must be callable"):
        HostPool(allocate=None)
    pool = HostPool(allocate=lambda n: torch.empty(n, dtype=torch.float32))
    with pytest.raises(ValueError, match="nbytes must be a positive int"):
        pool.take(0)
    with pytest.raises(ValueError, match="1-d uint8 tensor"):
        pool.take(8)
    assert pool.stats.bytes == 0


def test_clear_drops_free_slabs_and_keeps_lent_ones():
    pool = HostPool(allocate=_Counting())
    kept, dropped = pool.take(64), pool.take(128)
    pool.give(dropped)
    pool.clear()
    assert (pool.stats.slabs, pool.stats.bytes, pool.stats.lent) == (1, 64, 1)
    pool.give(kept)


@pytest.mark.gpu
def test_pinned_slabs_take_an_asynchronous_copy_and_come_back_after_its_event():
    pool = HostPool()
    x = torch.randn(1 << 20, device="cuda")
    slab = pool.take(x.numel() * x.element_size())
    assert slab.is_pinned()
    host = slab.view(torch.float32)
    host.copy_(x, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    pool.give(slab, event)
    event.synchronize()
    assert torch.equal(host, x.cpu()) and pool.take(slab.numel()).data_ptr() == slab.data_ptr()
    assert pinned_bytes(16).is_pinned()
