"""A ring of real processes: `shard-coord serve` and `shard-node join` as a volunteer runs
them, each with its own log file, started under an optional command prefix (the test bed
runs them inside network namespaces with `ip netns exec NS`).

Knows the CLI's printed lines (the banner's URL, the join line), not its internals. Every
process is killed when its `ProcRing` closes, however the test ends.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

BANNER = re.compile(r"serving \S+ at (http://[0-9.]+:\d+)/v1")
JOIN = re.compile(r"shard-node join --coordinator (\S+)")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: re.Pattern, timeout_s: float) -> re.Match:
        """The first match of `pattern` in the log; AssertionError (with the log's tail) if
        the process exits or `timeout_s` passes first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = pattern.search(self.text())
            if m:
                return m
            if self.popen.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{self.name}: no {pattern.pattern!r} (exit {self.popen.poll()}):\n{self.text()[-4000:]}")

    def kill9(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(10)


@dataclass
class ProcRing:
    """Processes started for one test; `close()` kills them all (SIGKILL)."""

    home: Path  # SHARD_HOME and logs
    prefix: Sequence[str] = ()  # e.g. ("ip", "netns", "exec", "ns1"); per spawn call otherwise
    procs: list[Proc] = field(default_factory=list)

    def spawn(self, name: str, args: Sequence[str], prefix: Sequence[str] | None = None,
              env: dict | None = None) -> Proc:
        log_path = self.home / f"{name}.{len(self.procs)}.log"
        env = {**os.environ, "SHARD_HOME": str(self.home / "shard-home"), "OMP_NUM_THREADS": "1", **(env or {})}
        with open(log_path, "w") as log:
            popen = subprocess.Popen([*(self.prefix if prefix is None else prefix), *args], stdout=log,
                                     stderr=subprocess.STDOUT, env=env)
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            proc.kill9()


def coordinator_args(model: str, store_dir: str, listen: str, key_path: str, min_nodes: int,
                     http: str = "127.0.0.1:0", extra: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "coordinator.cli", "serve", "--model", model, "--store-dir", store_dir,
            "--listen", listen, "--http", http, "--key-path", key_path, "--min-nodes", str(min_nodes),
            "--draft", "none", *extra]


def node_args(coordinator: str, model: str, store_dir: str, max_memory_bytes: int,
              extra: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "shard.cli", "join", "--coordinator", coordinator, "--model", model,
            "--store-dir", store_dir, "--max-memory-bytes", str(max_memory_bytes), "--torch-threads", "1", *extra]


def wait_ring(base: str, stages: int, timeout_s: float) -> dict:
    """GET /v1/ring until it reports a ready ring of `stages` members."""
    deadline = time.monotonic() + timeout_s
    info: dict = {}
    while time.monotonic() < deadline:
        try:
            info = httpx.get(f"{base}/v1/ring", timeout=5).json()
        except httpx.HTTPError:
            info = {}
        if info.get("ready") and len(info.get("members", ())) == stages:
            return info
        time.sleep(0.2)
    raise AssertionError(f"no ready {stages}-stage ring at {base} within {timeout_s} s: {info}")


def complete(base: str, model: str, prompt: list[int], max_tokens: int, timeout_s: float = 120) -> str:
    """The greedy completion of token ids `prompt` (raises for any HTTP error)."""
    r = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                   "temperature": 0}, timeout=timeout_s)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]
