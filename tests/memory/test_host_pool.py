"""The host pool for offload: exact sizes, reuse across steps, events, the capacity (savedhooks.hostmem)."""

import threading

import pytest
import torch

import savedhooks as sh
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


def test_a_tensor_on_a_slab_gives_it_back_when_its_last_view_is_freed():
    events: list[_Event] = []

    def on_free() -> _Event:
        events.append(_Event())
        return events[-1]

    pool = HostPool(allocate=_Counting(), on_free=on_free)
    x = pool.empty_strided((3, 5), (1, 3), torch.float32)  # transposed: 15 floats, strides kept
    assert x.stride() == (1, 3) and x.untyped_storage().nbytes() == 60 and pool.stats.lent == 1
    x.copy_(torch.arange(15.0).view(5, 3).t())
    view = x[1:].view(torch.int32)  # a view of the same storage keeps the slab lent
    address = x.data_ptr()
    del x
    assert pool.stats.lent == 1 and view.view(torch.float32)[0, 0].item() == 1.0
    del view
    assert pool.stats.lent == 0 and len(events) == 1  # given back with the event on_free returned
    assert pool.take(60).data_ptr() != address  # its copy is not done yet: a new slab
    events[0].done = True
    assert pool.take(60).data_ptr() == address and pool.stats.allocations == 2


def test_tensors_on_slabs_are_reused_across_steps_and_freed_on_any_thread():
    allocate = _Counting()
    pool = HostPool(allocate=allocate)
    for _ in range(3):  # a step's offloaded copies, freed after its backward
        copies = [pool.empty_strided((n,), (1,), torch.float16) for n in (100, 7, 100)]
        assert [c.untyped_storage().nbytes() for c in copies] == [200, 14, 200]
        worker = threading.Thread(target=copies.clear)  # autograd frees saved tensors on its own threads
        worker.start()
        worker.join()
    assert sorted(allocate.sizes) == [14, 200, 200] and pool.stats.hits == 6 and pool.stats.lent == 0
    assert pool.empty_strided((0, 4), (4, 1), torch.float32).numel() == 0  # no bytes, no slab
    assert pool.stats.slabs == 3
    with pytest.raises(ValueError, match="2 sizes but 1 strides"):
        pool.empty_strided((2, 2), (1,), torch.float32)


def test_past_the_capacity_a_tensor_falls_back_to_its_own_memory():
    pool = HostPool(capacity_bytes=100, fallback=True, allocate=_Counting())
    kept = pool.empty_strided((20,), (1,), torch.float32)  # 80 bytes: pooled
    extra = pool.empty_strided((10,), (1,), torch.float32)  # 40 more do not fit: unpooled
    assert pool.stats.fallbacks == 1 and pool.stats.lent == 1 and extra.shape == (10,)
    del kept, extra
    assert pool.stats.lent == 0 and pool.stats.bytes == 80


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_offload_copies_write_into_pinned_slabs_reused_from_the_second_step(backend):
    """Eager: savedhooks::offload's copies. Inductor: the asynchronous copies the pass puts in the graphs
    (savedhooks::offload_async), gradients at >= 100 dB there (inductor fuses around the copies)."""
    from savedhooks.hostmem import default_pool
    from tests.models import train_step_grads

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(256, 256), torch.nn.GELU())]).cuda()
    fn = model if backend == "eager" else torch.compile(model)
    x = torch.randn(64, 256, device="cuda")
    pool = default_pool()
    want = train_step_grads(model, model, x)
    for step in range(3):
        got = train_step_grads(model, fn, x, sh.offload(keep_needed_soon=False))
        if backend == "eager":
            assert all(torch.equal(w, g) for w, g in zip(want, got))
        else:
            assert min(sh.fidelity.sqnr(w, g) for w, g in zip(want, got)) >= 100.0
        if step == 0:
            allocations = pool.stats.allocations
    assert allocations > 0 and pool.stats.allocations == allocations and pool.stats.hits > 0


def test_a_custom_op_may_return_a_tensor_on_a_slab_eager_and_compiled():
    """What savedhooks::offload does with the pool on CUDA, on CPU: its output is a tensor of its own on a slab."""
    pool = HostPool(allocate=_Counting())

    @torch.library.custom_op("savedhooks_test::copy_to_slab", mutates_args=())
    def copy_to_slab(x: torch.Tensor) -> torch.Tensor:
        return pool.empty_strided(x.size(), x.stride(), x.dtype).copy_(x)

    @copy_to_slab.register_fake
    def _(x):
        return torch.empty_like(x)

    x = torch.randn(8, 4).t()
    for fn in (copy_to_slab, torch.compile(copy_to_slab, backend="aot_eager", fullgraph=True)):
        y = fn(x)
        assert torch.equal(y, x) and y.stride() == x.stride() and y._base is None and pool.stats.lent == 1
        del y
        assert pool.stats.lent == 0


def test_evict_on_miss_keeps_two_steps_of_sizes_when_shapes_change_every_step():
    allocate = _Counting()
    pool = HostPool(allocate=allocate, evict_on_miss=True)
    for length in (100, 120, 100, 140):  # a sequence length per step, and a tensor of fixed size
        copies = [pool.empty_strided((length, 8), (8, 1), torch.float32) for _ in range(2)]
        copies.append(pool.empty_strided((64,), (1,), torch.float32))
        assert pool.stats.slabs <= 2 * 2 + 1  # this step's and the step before's sizes, no more
        del copies
    # length 100 came back one step later (hits), 120 was dropped when 140 missed; the fixed size always hit
    assert (pool.stats.evictions, pool.stats.hits, len(allocate.sizes)) == (2, 5, 7)
    same = HostPool(allocate=_Counting(), evict_on_miss=True)
    for _ in range(3):
        copies = [same.empty_strided((100, 8), (8, 1), torch.float32) for _ in range(3)]
        del copies
    assert (same.stats.allocations, same.stats.hits, same.stats.evictions) == (3, 6, 0)  # steady shapes


def test_a_slab_waits_on_its_last_noted_copy_and_a_free_never_waits_on_the_pool():
    pool = HostPool(allocate=_Counting())
    x = pool.empty_strided((16,), (1,), torch.float32)
    copy = _Event()
    pool.note_copy(x, copy)  # a copy on another stream still reads the slab
    pool.note_copy(torch.empty(3), _Event())  # not on a slab of this pool: ignored
    address = x.data_ptr()
    del x
    assert pool.stats.lent == 0 and pool.take(64).data_ptr() != address
    copy.done = True
    assert pool.take(64).data_ptr() == address
    # a storage freed while another thread is inside the pool: the free only queues the slab
    box = [pool.empty_strided((16,), (1,), torch.float32)]
    inside, release = threading.Event(), threading.Event()

    def hold_the_lock() -> None:
        with pool._lock:
            inside.set()
            release.wait(10)

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    inside.wait(10)
    freer = threading.Thread(target=box.clear)  # the finalizer runs here, while the pool is busy
    freer.start()
    freer.join(5)
    blocked = freer.is_alive()
    release.set()
    holder.join()
    freer.join()
    assert not blocked
    assert pool.stats.lent == 2  # the two taken above; the freed tensor's slab came back
