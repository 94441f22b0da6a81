"""A worker thread at the operating system's lowest CPU priority, for a node's background compute.

A node's audit replays (shard.verifier) are background work: on a machine whose cores the
node's own forwards keep busy (and, on a shared host, other processes), they should take
the CPU nobody else wants first, and the rest only as the scheduler's fair share for the
lowest priority allows. Linux schedules each thread as a task of its own, so one thread's
nice value can be raised (its priority lowered) alone, which any unprivileged process may
do, but never lowered back without privilege (RLIMIT_NICE): hence one thread kept for this
work, not trio's shared worker threads. Where the OS cannot lower one thread's priority
(not Linux, or it refused), `lowered` reads False and the work runs there all the same, at
the priority it has; callers that need it to yield fall back to their own means then.

Measured (issue 21, docs/batching.md "Audits at the lowest priority"): on a 3-stage
loopback ring at 16 streams, audits' replays cost ~2.5 ms of CPU a generated token and lift
the ITL p95 from ~0.16 s (audits off) to 0.23-0.26 s; the same replays on such a thread
read 0.20-0.21 s. Knows nothing of replays, stages or trio's limiters beyond its wait.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import trio

T = TypeVar("T")
LOWEST_NICE = 19  # the nice value of the lowest priority on Linux (and the BSDs)


def lower_this_thread(nice: int = LOWEST_NICE) -> bool:
    """Lower the calling thread's CPU priority to `nice` (never raise it: a thread already
    at or past it stays). True when the thread now runs at `nice` or lower priority."""
    if sys.platform != "linux":  # elsewhere setpriority(PRIO_PROCESS, tid) would name a process
        return False
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        return os.getpriority(os.PRIO_PROCESS, tid) >= nice
    except OSError:
        return False


class LowPriorityThread:
    """One worker thread, started on first use, whose priority it lowers before any work."""

    def __init__(self, nice: int = LOWEST_NICE, name: str = "shard-background") -> None:
        self.nice, self.name = nice, name
        self._pool: ThreadPoolExecutor | None = None
        self.lowered: bool | None = None  # None until the thread has started

    def start(self) -> bool:
        """Start the thread and lower it, once (a thread start: well under a millisecond);
        whether it was lowered."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=self.name)
            self.lowered = self._pool.submit(lower_this_thread, self.nice).result()
        return bool(self.lowered)

    async def run(self, fn: Callable[[], T]) -> T:
        """fn() on the thread (one call at a time, in order), waited for in a trio worker
        thread (so the event loop runs on). Like trio.to_thread.run_sync, a cancel does not
        abandon it: the wait ends when fn does."""
        self.start()
        pool = self._pool
        assert pool is not None
        return await trio.to_thread.run_sync(lambda: pool.submit(fn).result())

    def close(self) -> None:
        """Let the thread end once its work is done (a later `run` starts another)."""
        pool, self._pool, self.lowered = self._pool, None, None
        if pool is not None:
            pool.shutdown(wait=False)
