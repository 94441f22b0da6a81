"""`shard-node join --exit-with-parent-pid` (shard.join._exit_with_parent): a node started by
`shard-coord serve --local-nodes` leaves once the gateway process is gone.

Bug guarded: a gateway killed with SIGKILL cannot stop its children, and they retried the
gone coordinator forever. Sound: a real process tree — a shell starts a python process
running the watcher under its own pid, the shell is killed with SIGKILL, and the child must
then exit by itself (it would otherwise sleep for an hour)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

CHILD = """
import os, trio
from shard.join import _exit_with_parent
async def main():
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_exit_with_parent, os.getppid(), nursery.cancel_scope)
        print(os.getpid(), flush=True)
        await trio.sleep(3600)
trio.run(main)
print("left", flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie awaiting its reaper has left too
        return f.read().split(") ", 1)[1][0] != "Z"


def test_the_watcher_ends_the_node_once_its_parent_is_killed(tmp_path):
    out = tmp_path / "child.out"
    shell = subprocess.Popen(["sh", "-c", f'"{sys.executable}" -c "$CHILD" > "{out}" 2>&1 & wait'],
                             env={**os.environ, "CHILD": CHILD})
    deadline = time.monotonic() + 60
    while not out.exists() or not out.read_text().strip():
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.1)
    child = int(out.read_text().split()[0])
    assert _alive(child)
    shell.send_signal(signal.SIGKILL)
    shell.wait(10)
    deadline = time.monotonic() + 15
    while _alive(child):
        assert time.monotonic() < deadline, "the child outlived its parent"
        time.sleep(0.2)
    assert "left" in out.read_text()
