"""KV cache bookkeeping: admission under a memory bound, growth, commits, isolation."""

import os

import pytest
import torch

from shard.errors import CacheError, CacheFullError
from shard import kvcache
from shard.kvcache import KVCache


def cache(max_bytes: int) -> KVCache:
    return KVCache(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, max_bytes=max_bytes)


def test_admission_refuses_past_the_bound_with_figures():
    # Bug guarded: a stage that grows without bound and OOMs instead of refusing one job.
    c = cache(max_bytes=128 * 100)  # 100 slots: K+V x 2 layers x 2 heads x 4 dims x 4 bytes = 128 B each
    c.open("a", 60)
    with pytest.raises(CacheFullError) as e:
        c.open("b", 41)
    assert (e.value.limit, e.value.actual) == (12800, 101 * 128)
    assert "b" not in c.jobs and c.reserved_bytes == 60 * 128
    c.close("a")
    c.open("b", 100)  # freed reservation is reusable


@pytest.fixture(params=["room", "copy"])
def growth(request, monkeypatch):
    """Both ways a job grows: a longer view of its reserved address space (CPU), or fresh
    blocks and a copy (other devices, or a kernel that refuses the reservation)."""
    if request.param == "copy":
        monkeypatch.setattr(kvcache._Room, "make", classmethod(lambda *a: None))
    return request.param


def test_growth_keeps_contents_and_stops_at_max_slots(growth):
    c = cache(1 << 30)
    job = c.open("a", 600)
    k = torch.randn(2, 10, 4)
    job.write(1, 250, k, k + 1)  # crosses the initial 256-slot allocation
    job.ensure(520)
    assert job.capacity >= 520
    assert torch.equal(job.k[1, :, 250:260], k) and torch.equal(job.v[1, :, 250:260], k + 1)
    with pytest.raises(CacheFullError, match="slots for job 'a'"):
        job.ensure(601)


def test_growth_on_cpu_is_a_longer_view_not_a_copy():
    # Bug guarded: a prefix fork of a 1.9k-token prompt grew its job twice, each time into
    # fresh pages with a copy (46 ms of a 10-layer SmolLM2 stage's forward, which every job
    # batched beside it waited for). Sound: the job's K keeps its address when it grows
    # (the same reserved block, viewed longer), its contents stay, and the slots it opens
    # read as zeros.
    c = cache(1 << 30)
    job = c.open("a", 4000)
    job.write(0, 0, torch.ones(2, 3, 4), torch.full((2, 3, 4), 2.0))
    before = job.k.data_ptr()
    job.ensure(3000)
    assert job.capacity == 3000 and job.k.data_ptr() == before
    assert torch.equal(job.v[0, :, :3], torch.full((2, 3, 4), 2.0)) and job.k[:, :, 3:].abs().sum() == 0
    forked = c.fork("b", "a", 3, 4000)
    forked.ensure(2000)
    assert torch.equal(forked.k[0, :, :3], torch.ones(2, 3, 4)) and forked.k[:, :, 3:].abs().sum() == 0


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_fork_maps_its_source_copy_on_write():
    # Bug guarded: a fork copying its prefix into fresh pages inside the batched forward
    # (~15 ms for a 1.9k-token prefix on a 10-layer SmolLM2 stage, each copy a stall for
    # the rows beside it), and, once mapped instead, a fork's writes reaching its source (the
    # next fork of it would read them) or a source's close taking the fork's prefix with it.
    # Sound: the fork reads the source's slots, its own writes (inside the prefix, too)
    # stay its own, the source closed leaves the fork's slots whole, and the memory files
    # close with their jobs.
    c = cache(1 << 30)
    fds = _open_fds()
    src = c.open("src", 64)
    src.write(1, 0, torch.arange(24.0).view(2, 3, 4), -torch.arange(24.0).view(2, 3, 4))
    fork = c.fork("f", "src", 3, 64)
    assert fork.room is not None and fork.room.fd is None  # a private map, not a copy
    assert torch.equal(fork.k[1, :, :3], src.k[1, :, :3]) and torch.equal(fork.v[1, :, :3], src.v[1, :, :3])
    fork.write(1, 1, torch.full((2, 1, 4), 7.0), torch.full((2, 1, 4), 7.0))
    assert src.k[1, 0, 1].tolist() == [4.0, 5.0, 6.0, 7.0] and fork.k[1, 0, 1].tolist() == [7.0] * 4
    c.close("src")
    assert fork.k[1, 1, 2].tolist() == [20.0, 21.0, 22.0, 23.0]
    other = c.fork("g", "f", 2, 64)  # a fork's own map is no file: its fork copies
    assert other.room is not None and other.room.fd is not None and torch.equal(other.k[1, :, :2], fork.k[1, :, :2])
    for job in ("f", "g"):
        c.close(job)
    assert _open_fds() == fds


def test_growth_past_the_bound_is_refused_and_keeps_the_job_intact(growth):
    # Bug guarded: a job growing into memory another job needs (or past the stage's
    # bound) must fail that job's frame with the figures, not allocate, not corrupt.
    c = cache(max_bytes=128 * 400)
    a = c.open("a", 1000)  # holds 256 slots at first
    a.write(0, 0, torch.ones(2, 3, 4), torch.ones(2, 3, 4))
    with pytest.raises(CacheFullError, match="grow job 'a' to 512 slots") as e:
        a.ensure(300)
    assert (e.value.limit, e.value.actual) == (128 * 400, 128 * 512)
    assert a.capacity == 256 and torch.equal(a.k[0, :, :3], torch.ones(2, 3, 4))
    c.close("a")
    assert c.reserved_bytes == 0


def test_commit_gathers_in_order_even_when_overlapping():
    # Accepting tree nodes [12, 10, 11] must place them at [10, 11, 12] in that order even
    # though sources and destinations overlap (a naive in-place loop would clobber slot 12).
    c = cache(1 << 30)
    job = c.open("a", 32)
    for s in range(16):
        job.k[:, :, s] = s
        job.v[:, :, s] = -s
    job.commit([12, 10, 11], 10)
    assert job.k[0, 0, 10:13, 0].tolist() == [12, 10, 11]
    assert job.v[1, 1, 10:13, 0].tolist() == [-12, -10, -11]
    with pytest.raises(CacheError, match="outside job"):
        job.commit([40], 0)


def test_jobs_are_isolated():
    c = cache(1 << 30)
    a, b = c.open("a", 16), c.open("b", 16)
    a.write(0, 0, torch.ones(2, 3, 4), torch.ones(2, 3, 4))
    assert b.k.abs().sum() == 0
    with pytest.raises(CacheError, match="already has a cache"):
        c.open("a", 16)
    with pytest.raises(CacheError, match="no KV cache for job 'zz'"):
        c.get("zz")


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_a_job_holds_only_what_it_touched_and_gives_it_back():
    # Bug guarded: admitting a job made its whole first block resident (torch.zeros wrote
    # it), so jobs a predecessor opened and never used cost their full admission in RSS.
    # Each CPU block is now its own anonymous mapping: resident only where written,
    # unmapped with the tensor. Sound: admitting a
    # job (2 x 16 MiB for its first 256 slots) and writing one slot adds far less than the
    # blocks to this process's RSS, writing every slot adds about all of it, and closing
    # the job takes it back out (an 8 MiB margin covers the interpreter's own noise).
    cache = KVCache(16, 8, 128, torch.float32, 1 << 30)  # 16 * 8 * 128 * 4 B = 64 KiB of K a slot
    before = _rss_bytes()
    job = cache.open("big", 1024)
    assert job.capacity == 256
    one = torch.ones(8, 1, 128)  # (kv_heads, T, head_dim)
    job.write(0, 0, one, one)
    assert _rss_bytes() - before < 8 << 20
    for layer in range(16):
        job.write(layer, 0, torch.ones(8, 256, 128), torch.ones(8, 256, 128))
    assert _rss_bytes() - before > 28 << 20
    cache.close("big")
    del job
    assert _rss_bytes() - before < 8 << 20
