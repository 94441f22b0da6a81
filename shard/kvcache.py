"""Per-job KV caches for one stage, addressed by slot, under one memory bound.

A slot is where a token's K/V lives; for committed context slot == absolute position.
Draft-tree nodes occupy slots past the committed context (siblings share a rotary
position but never a slot). Committing an accepted tree path gathers its slots to the
end of the context; discarding speculation is just writing over slots past `ctx_len`.
Does not know layers' weights, the wire or which peer sent a frame.
"""

from __future__ import annotations

import math
import mmap
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shard.errors import CacheError, CacheFullError

INITIAL_SLOTS = 256


def _kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros for K or V. On CPU each block is its own private anonymous mmap: the kernel
    hands out zero pages as slots are first written, so a job is resident only for the slots
    it touched (torch.zeros wrote all 256 slots of a new job: 11.8 MB for SmolLM2, whatever
    its length), and dropping the tensor unmaps it, so a freed job's memory leaves the
    process at once instead of staying in the allocator's heap. Private, not shared: a
    first write to a shared anonymous page cost ~1.5x as much (14.6 MB of fresh K copied in:
    9.2 against 6.3 ms, this VM)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # the tensor keeps it mapped
    return torch.frombuffer(pages, dtype=torch.uint8, count=nbytes).view(dtype).reshape(shape)


@dataclass
class _Room:
    """A CPU job's K and V at its most slots, (layers, kv_heads, max_slots, head_dim) each,
    nothing resident until written: growing the job is a longer view of it, not a copy into
    fresh pages. Both live in one memory file (`fd`, closed with the room) that the job maps
    shared, so a prefix fork can map it privately: copy-on-write, the source's pages read in
    place and only the pages the fork writes copied (`fd` None: such a private map). A 1.9k-token
    prefix fork grew its job twice, copying and first-touching ~58 MB of a 10-layer SmolLM2
    stage, 46 ms of a forward that every job batched beside it waited for; a copy into a room,
    ~15 ms; a private map, none (docs/batching.md, "Forks and the forwards beside them"). The
    price: a first write to a memory file's page costs what a shared page does (~1.5x a
    private one, _kv_zeros), ~15 KB of K/V a token on such a stage."""

    k: torch.Tensor
    v: torch.Tensor
    fd: int | None
    release: Callable[[], None] = lambda: None

    @classmethod
    def make(cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
             source: _Room | None = None) -> _Room | None:
        """A fresh room, or with `source` a private map of its file; None off CPU, without
        memory files (not Linux), or where the kernel refuses the mapping."""
        if torch.device(device).type != "cpu" or not hasattr(os, "memfd_create") or source is not None and source.fd is None:
            return None
        numel, fd = math.prod(shape), None if source is None else source.fd
        try:
            if source is None:
                fd = os.memfd_create("shard-kv", os.MFD_CLOEXEC)
                os.ftruncate(fd, 2 * numel * torch.empty((), dtype=dtype).element_size())
            both = torch.from_file(f"/proc/self/fd/{fd}", shared=source is None, size=2 * numel, dtype=dtype)
        except (OSError, RuntimeError, ValueError):
            if source is None and fd is not None:
                os.close(fd)
            return None
        room = cls(both[:numel].view(shape), both[numel:].view(shape), fd if source is None else None)
        if room.fd is not None:
            room.release = weakref.finalize(room, os.close, room.fd)  # at the job's close, or its collection
        return room


@dataclass
class _Budget:
    """Bytes of K/V the stage may hold, shared by all its jobs."""

    max_bytes: int
    used_bytes: int = 0

    def take(self, what: str, nbytes: int) -> None:
        if self.used_bytes + nbytes > self.max_bytes:
            raise CacheFullError(what, self.max_bytes, self.used_bytes + nbytes)
        self.used_bytes += nbytes


@dataclass
class JobCache:
    """K and V for one job across a stage's layers: each (layers, kv_heads, capacity, head_dim)."""

    job_id: str
    max_slots: int
    k: torch.Tensor
    v: torch.Tensor
    budget: _Budget
    bytes_per_slot: int
    # K and V at max_slots (_Room), of which k and v view [0, capacity); None: growing
    # allocates and copies.
    room: _Room | None = None

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def ensure(self, slots: int) -> None:
        """Make slots [0, slots) addressable, growing by doubling up to `max_slots`.
        Growth past the stage's memory bound raises CacheFullError and changes nothing."""
        if slots > self.max_slots:
            raise CacheFullError(f"slots for job {self.job_id!r}", self.max_slots, slots)
        if slots <= self.capacity:
            return
        new_cap = min(self.max_slots, max(slots, 2 * self.capacity))
        self.budget.take(f"KV bytes to grow job {self.job_id!r} to {new_cap} slots",
                         (new_cap - self.capacity) * self.bytes_per_slot)
        if self.room is not None:  # slots past the capacity: zero pages (a fork's, its source's, written before read)
            self.k, self.v = self.room.k[:, :, :new_cap], self.room.v[:, :, :new_cap]
            return
        shape = (*self.k.shape[:2], new_cap, self.k.shape[3])
        k = _kv_zeros(shape, self.k.dtype, self.k.device)
        v = _kv_zeros(shape, self.v.dtype, self.v.device)
        k[:, :, : self.capacity] = self.k
        v[:, :, : self.capacity] = self.v
        self.k, self.v = k, v

    def commit(self, src: list[int], dst: int) -> None:
        """Move the K/V at slots `src` (in order) to slots [dst, dst + len(src))."""
        if not src:
            return
        if min(src) < 0 or max(src) >= self.capacity or dst < 0 or dst + len(src) > self.capacity:
            raise CacheError(
                f"commit of slots {min(src)}..{max(src)} to [{dst}, {dst + len(src)}) "
                f"is outside job {self.job_id!r}'s {self.capacity} slots"
            )
        idx = torch.tensor(src, dtype=torch.long, device=self.k.device)
        # Advanced indexing copies first, so overlapping source and destination are safe.
        self.k[:, :, dst : dst + len(src)] = self.k[:, :, idx]
        self.v[:, :, dst : dst + len(src)] = self.v[:, :, idx]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (kv_heads, T, D) at slots [start, start+T) of local layer `layer`;
        return the views of slots [0, start+T) to attend over."""
        end = start + k.shape[1]
        self.ensure(end)
        self.k[layer, :, start:end] = k
        self.v[layer, :, start:end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]


@dataclass
class KVCache:
    """All jobs' caches on one stage; refuses (CacheFullError) rather than exceed max_bytes.

    A job holds only the slots it has used (grown by doubling, up to its max_slots), so a
    short request does not pin a whole context's worth of memory; admitting a job or
    growing one past the bound is refused with the figures, and nothing else changes.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    max_bytes: int
    device: torch.device | str = "cpu"
    jobs: dict[str, JobCache] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._budget = _Budget(self.max_bytes)

    @property
    def bytes_per_slot(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @property
    def reserved_bytes(self) -> int:
        return self._budget.used_bytes

    def open(self, job_id: str, max_slots: int, source: JobCache | None = None) -> JobCache:
        """Job `job_id`'s cache, `min(max_slots, INITIAL_SLOTS)` slots to start; with `source`
        a copy-on-write map of its slots where it can (same max_slots, both on CPU: the new
        room's `fd` None), else a room or blocks of its own (the caller copies)."""
        if job_id in self.jobs:
            raise CacheError(f"job {job_id!r} already has a cache on this stage")
        if max_slots <= 0:
            raise CacheError(f"job {job_id!r} asked for {max_slots} slots")
        cap = min(max_slots, INITIAL_SLOTS)
        self._budget.take(f"KV bytes to admit job {job_id!r}", cap * self.bytes_per_slot)
        shape = (self.num_layers, self.num_kv_heads, max_slots, self.head_dim)
        room = None
        if source is not None and source.room is not None and source.max_slots == max_slots:
            room = _Room.make(shape, self.dtype, self.device, source.room)  # the source's pages, copy-on-write
        if room is None:
            room = _Room.make(shape, self.dtype, self.device)
        if room is not None:
            job = JobCache(job_id, max_slots, room.k[:, :, :cap], room.v[:, :, :cap], self._budget,
                           self.bytes_per_slot, room=room)
        else:
            shape = (self.num_layers, self.num_kv_heads, cap, self.head_dim)
            job = JobCache(job_id, max_slots, _kv_zeros(shape, self.dtype, self.device),
                           _kv_zeros(shape, self.dtype, self.device), self._budget, self.bytes_per_slot)
        self.jobs[job_id] = job
        return job

    def fork(self, job_id: str, source_id: str, slots: int, max_slots: int) -> JobCache:
        """Job `job_id`'s cache (opened if new) with slots [0, slots) copied from job
        `source_id`'s: a prefix cache hit. Raises CacheError when the source holds no cache
        here or fewer slots, CacheFullError past the bound; a refused fork opens nothing.
        A new job maps the source's slots copy-on-write (_Room): the source must not write
        its slots below `slots` again (a kept source writes nothing; a running job writes
        only past its context)."""
        source = self.jobs.get(source_id)
        if source is None:
            raise CacheError(f"prefix source job {source_id!r} holds no KV cache on this stage (re-prefill from 0)")
        if slots > source.capacity:
            raise CacheError(f"prefix of {slots} slots from job {source_id!r}, which holds {source.capacity}")
        opened = job_id not in self.jobs
        job = self.jobs[job_id] if not opened else self.open(job_id, max_slots, source)
        try:
            job.ensure(slots)
        except CacheFullError:
            if opened:
                self.close(job_id)
            raise
        if not (opened and job.room is not None and job.room.fd is None):  # not a private map of the source's
            job.k[:, :, :slots] = source.k[:, :, :slots]
            job.v[:, :, :slots] = source.v[:, :, :slots]
        return job

    def get(self, job_id: str) -> JobCache:
        try:
            return self.jobs[job_id]
        except KeyError:
            raise CacheError(f"no KV cache for job {job_id!r} on this stage") from None

    def close(self, job_id: str) -> None:
        job = self.jobs.pop(job_id, None)
        if job is not None:
            self._budget.used_bytes -= job.capacity * self.bytes_per_slot
            if job.room is not None:
                job.room.release()  # its memory file; the pages go with the last map of them
