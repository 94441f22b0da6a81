"""The gateway's freed memory handed back to the operating system while it serves.

Every round the gateway allocates and frees logits (SmolLM2: 196 KB a row, 3 MB for a
16-row product), decoded frames, receipt chains and sampling buffers, on the event loop
and in worker threads, each with its own glibc arena; glibc keeps what they free for
reuse, so its RSS climbed under load and stayed up. Measured in-process (SmolLM2, 3
local stages, receipts, audits and probation on, 16 closed-loop clients, 24-token
requests): the largest growth tracemalloc found over 111 jobs was 0.15 MB (receipt
bundles, bounded); after 448 jobs RSS was 1326 MB, and 992 MB right after one malloc_trim
(shard.heap.return_freed_heap); with this sweep running it was 991 MB when the load
ended. So: every `period_s` in which a job ended, trim once, in a worker thread (it walks
every arena). And the mmap threshold is fixed (shard.heap.fix_mmap_threshold): glibc raises
it to the largest mmapped block freed (up to 32 MiB), after which long-lived blocks too
come from the arenas and fragment them. Over a 180 s run at 32 streams (bench_load, short
prompts, load 7-10) the gateway's RSS grew 4.4% after its first 60 s with a moving
threshold, steadily, and 0.3% with it fixed at 128 KiB (MALLOC_MMAP_THRESHOLD_; 1036 ->
1044 MB over the last 60 s). It is fixed at 4 MiB now, above a round's temporaries, which
128 KiB turned into page faults (shard.heap). Knows nothing of jobs beyond a count that
grows as they end.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from shard.heap import fix_mmap_threshold, return_freed_heap

PERIOD_S = 10.0


async def trim_in_thread() -> None:
    await trio.to_thread.run_sync(return_freed_heap)


async def sweep_heap(jobs_ended: Callable[[], int], period_s: float = PERIOD_S,
                     trim: Callable[[], Awaitable[None]] = trim_in_thread) -> None:
    """Forever: every `period_s`, `trim()` if `jobs_ended()` grew since the last look (an
    idle gateway is not woken for nothing). Fixes the mmap threshold first."""
    fix_mmap_threshold()
    seen = jobs_ended()
    while True:
        await trio.sleep(period_s)
        now = jobs_ended()
        if now != seen:
            seen = now
            await trim()
