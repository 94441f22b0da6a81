"""return_freed_heap: memory a node freed leaves the process (issue 21's RSS that never fell).

Bug guarded: a node's RSS stayed at its peak after load (2633 MB idle five minutes after
the runs) because glibc keeps freed heap in its arenas. Sound: the test frees ~180 MB of
100 KB blocks (below glibc's mmap threshold, so they live on the heap) while every tenth
block stays alive, so the free space is in the middle of the heap where glibc's automatic
trimming of its top never reaches; RSS must stay up after the free and fall after the call.
"""

from __future__ import annotations

import gc
import sys

import pytest

from shard.heap import return_freed_heap


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc heap and /proc only on Linux")
def test_freed_heap_leaves_the_process():
    blocks = [bytearray(100_000) for _ in range(2000)]  # ~200 MB, touched (zeroed)
    for b in blocks:
        b[::4096] = b"\x01" * len(b[::4096])
    keep = blocks[::10]  # pins the heap so its top cannot shrink
    del b
    blocks.clear()
    gc.collect()
    held = rss_mb()
    return_freed_heap()
    after = rss_mb()
    assert held - after > 100, (held, after)  # most of the ~180 MB freed is handed back
    assert len(keep) == 200
