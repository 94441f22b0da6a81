"""Freed memory handed back to the operating system.

glibc keeps freed heap (a stage's logged frames once dropped, a prefill chunk's
activations) in its arenas for reuse, so a node's RSS never fell after load however much
it freed; malloc_trim gives the free pages back. Measured on a 5-layer SmolLM2 stage after
20 jobs of a 1024-token prompt and 10 decode steps: 452 MB with their logged frames held,
still 452 MB once the log dropped them, 336 MB after malloc_trim.

fix_mmap_threshold fixes glibc's two thresholds, which glibc otherwise raises as it runs
(the mmap threshold to the largest mmapped block freed, up to 32 MiB; the trim threshold
to twice that, up to 64 MiB). malloc_trim never trims a thread arena's top (glibc's mtrim
trims only the main arena's): a thread arena gives its top back only on a free once it
passes the trim threshold. Raised, that let a node whose forwards run in worker threads
keep ~20 MB after a hostile-frame flood whatever it trimmed (issue 20), and let logits
rows and prefill chunks fragment the gateway's arenas (coordinator.jobs.heap_sweep).
Fixed at glibc's defaults (128 KiB each), though, every block of 128 KiB or more was
mapped on allocation and unmapped on free, and every arena top past 128 KiB went back at
once: each round's temporaries (a 16-row product's 3 MB of logits, a sampled row's
196 KB probabilities and its 393 KB float64 CDF, a 64-row piece's activations) came back
as fresh zeroed pages, a page fault each (2693 faults, 6.2 ms of kernel time, for one
8-row LM-head product with a sampled row's softmax and CDF: 17.8 ms against 10.8 with the
blocks reused; on a ring at 16 streams the gateway faulted ~20k times a second). So the
thresholds are fixed above a round's temporaries and below what lives long: blocks of
MMAP_THRESHOLD_BYTES (4 MiB) and more (a long job's K/V, a kept lead state, a replay
slice's weights) are still mapped on their own and leave when freed, and an arena keeps
at most TRIM_THRESHOLD_BYTES (16 MiB) of free top for the next round, giving the rest
back on the free that passes it (tests/shard/test_heap.py: a thread that frees 40 MB
keeps ~39 with glibc's raised thresholds, at most 16 with these, 0.6 measured). Knows
nothing of what was freed.

bound_kernel_caches caps the CPU matmul kernels kept per row count. A packed oneDNN linear
(shard.linear) builds a kernel for each new number of rows and keeps it in ideep's LRU and
in oneDNN's primitive cache, 1024 entries each by default, ~0.45 MB an entry: three
SmolLM2 weight shapes fed every row count from 1 to 800 (batched forwards of ragged jobs,
prefill pieces, a hostile predecessor's frames) kept +478 MB for good, +118 MB capped at
256 (glibc thresholds fixed as above; tests/shard/test_kernel_cache_bound.py). 256 holds a
stage's working set: forwards cycling through 1..24 rows ran as fast as uncapped (at 64
they ran 28% slower, each rebuilt kernel ~0.5 ms). ideep reads its capacity when torch is
loaded, so the processes' entry points call it before importing torch. Since shard.linear
runs every packed product on 32 fixed row counts, built when a weight shape is first
loaded (a SmolLM2 stage: 4 shapes, 128 kernels; the gateway's head and EAGLE drafter: 7,
224), these caps are a backstop: a process holding more shapes than 256 / 32 would evict
and rebuild kernels (slower, not bigger).

freeze_startup_heap moves what a process built to start (imported modules, torch's and
transformers' objects, ~250k-300k of them) out of the cyclic garbage collector's view. A
full collection walks every tracked object, so each one the gateway ran under load (every
~30 s at 16 streams: its jobs' state and frame logs promote objects steadily) stopped its
event loop for 0.2-0.4 s, and every stream of the ring with it; a stage's, ~0.2 s. Frozen,
a full collection walks only what was made since (3k-30k objects on the loopback ring).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys

_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD_BYTES = 4 << 20  # above a round's temporaries (module docstring)
TRIM_THRESHOLD_BYTES = 16 << 20  # the free top an arena keeps, at most
KERNEL_CACHE_ENTRIES = 256  # per cache (ideep's LRU, oneDNN's primitives); both default to 1024


def bound_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES) -> bool:
    """Cap the kernels CPU matmuls keep per shape, unless the environment already sets the
    caps. False when torch was imported already: ideep then keeps its 1024 (oneDNN's cap
    still applies, read at its first kernel)."""
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(entries))
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(entries))
    return "torch" not in sys.modules


def return_freed_heap() -> None:
    """Give the heap's free pages back to the OS now; a no-op where libc has no
    malloc_trim (musl, macOS). Walks the arenas: call it every few seconds, not per frame."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Blocks of `nbytes` and more are mapped and unmapped on their own, for good (setting
    it stops glibc's dynamic raise), and an arena whose free top passes
    TRIM_THRESHOLD_BYTES gives it back on the next large free (undoing a raise that came
    before this call). Call it at a process' start. False where libc has no mallopt
    (musl, macOS) or refuses."""
    mallopt = getattr(_LIBC, "mallopt", None)
    return (mallopt is not None and mallopt(M_MMAP_THRESHOLD, nbytes) == 1
            and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)


def freeze_startup_heap() -> int:
    """Collect, then freeze every object alive now (gc.freeze: never collected, never walked
    again); call it once, when a process has started. Returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
