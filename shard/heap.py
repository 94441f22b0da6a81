"""Freed memory handed back to the operating system.

glibc keeps freed heap (a stage's logged frames once dropped, a prefill chunk's
activations) in its arenas for reuse, so a node's RSS never fell after load however much
it freed; malloc_trim gives the free pages back. Measured on a 5-layer SmolLM2 stage after
20 jobs of a 1024-token prompt and 10 decode steps: 452 MB with their logged frames held,
still 452 MB once the log dropped them, 336 MB after malloc_trim. fix_mmap_threshold stops
glibc raising its mmap threshold, so large blocks keep leaving the arenas
(coordinator.jobs.heap_sweep measures why), and puts its trim threshold back: malloc_trim
never trims a thread arena's top (glibc's mtrim trims only the main arena's), a thread
arena gives its top back only on a free once it passes the trim threshold, and glibc had
raised that to twice the largest mmapped block freed (up to 64 MiB). So a node whose
forwards run in worker threads kept ~20 MB after a hostile-frame flood whatever it
trimmed (issue 20; tests/shard/test_heap.py reproduces it in a fresh process: 11 MB
kept, 0.2 MB with the thresholds fixed). Knows nothing of what was freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's default
TRIM_THRESHOLD_BYTES = 128 * 1024  # glibc's default


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
