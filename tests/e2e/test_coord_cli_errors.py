"""`shard-coord serve` as a user meets it when something is wrong (issue 23): one line
naming the problem and what to do, never a traceback; Ctrl-C exits quietly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest


def serve(store, home, *args: str) -> subprocess.Popen:
    # SIGINT as a terminal's foreground process has it: a runner started in the background
    # (`cmd &` without job control) ignores SIGINT, its children inherit that, and Python
    # then leaves it ignored (that run's Ctrl-C test waited 30 s for an exit that never came).
    env = {**os.environ, "SHARD_HOME": str(home), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "coordinator.cli", "serve", "--model", str(store.root),
                             "--store-dir", str(store.root), "--listen", "/ip4/127.0.0.1/tcp/0", "--log-level", "WARNING",
                             *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def finish(proc: subprocess.Popen, timeout_s: float) -> tuple[str, str]:
    """(stdout, stderr) once `proc` exits; killed if it has not within timeout_s (a failed
    test leaves no coordinator behind)."""
    try:
        return proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"no exit within {timeout_s} s; stdout {out!r}, stderr {err!r}")


def test_port_in_use_is_one_line(tiny_llama_store, tmp_path):
    # Bug guarded: port 8000 in use printed 108 lines of traceback. Sound: the port is
    # held by a listening socket of this test for the whole run.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = serve(tiny_llama_store, tmp_path, "--http", f"127.0.0.1:{port}")
        out, err = finish(proc, 120)
    assert proc.returncode == 1, (out, err)
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (f"shard-coord serve: error: 127.0.0.1:{port} is in use (another "
                                            "shard-coord, or another server): stop it, or pass --http HOST:PORT "
                                            "with a free port")


def test_ctrl_c_exits_quietly_and_no_banner_before_a_ring(tiny_llama_store, tmp_path):
    # Bug guarded: Ctrl-C printed 83 lines; the banner said "serving" while every request
    # got 503 (no node had joined). Sound: no node joins this coordinator, so its ring
    # never forms; SIGINT is what a terminal's Ctrl-C sends.
    proc = serve(tiny_llama_store, tmp_path, "--http", "127.0.0.1:0")
    deadline, seen = time.monotonic() + 120, ""
    while "Volunteers join with" not in seen and time.monotonic() < deadline and proc.poll() is None:
        seen += proc.stdout.readline()
    if "Volunteers join with" not in seen:
        proc.kill()
        pytest.fail(f"no join line: {seen} {proc.stderr.read()}")
    assert seen.startswith("Waiting for 1 node(s) to form a ring. Volunteers join with: shard-node join --coordinator ")
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc, 30)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "serving" not in seen + out
