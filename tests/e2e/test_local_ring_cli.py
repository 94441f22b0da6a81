"""`shard-coord serve --local-nodes N` as a newcomer runs it (issue 23): an N-stage ring,
and the serving banner only once requests are answered."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import pytest


# The default listen address is the wildcard (0.0.0.0:4001); port 0 here, as tests must.
@pytest.mark.parametrize("listen", ["/ip4/127.0.0.1/tcp/0", "/ip4/0.0.0.0/tcp/0"])
def test_local_nodes_form_one_stage_each_and_the_banner_means_ready(tiny_llama_store, tmp_path, listen):
    # Bug guarded: "a local 3-node ring" was one stage holding every layer plus idle nodes
    # (the selector prefers fewer hops on loopback), and the banner said "serving" while
    # requests got 503. And on the wildcard listen address local nodes dial the
    # coordinator's interface address; it took them for remote nodes and withheld their
    # loopback addresses from each other: every hop failed and the ring shrank to one stage. Sound: the first request
    # is sent the moment the banner is read, and /v1/ring lists the stages the coordinator
    # has after serving it.
    env = {**os.environ, "SHARD_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "serve", "--model", str(tiny_llama_store.root),
                             "--store-dir", str(tiny_llama_store.root), "--local-nodes", "2", "--http", "127.0.0.1:0",
                             "--listen", listen, "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline, seen, m = time.monotonic() + 180, "", None
        while m is None and time.monotonic() < deadline and proc.poll() is None:
            seen += proc.stdout.readline()
            m = re.search(r"serving (\S+) at (http://127\.0\.0\.1:\d+)/v1", seen)
        if m is None:
            pytest.fail(f"no banner: {seen}")
        model, base = m.groups()
        while "Receipts are signed" not in seen and proc.poll() is None:
            seen += proc.stdout.readline()
        key = re.search(r"Receipts are signed by coordinator key ([0-9a-f]{64}) \(GET /v1/receipts/key\); check a "
                        r"bundle with: shard-receipts verify BUNDLE --coordinator-key ([0-9a-f]{64})", seen)
        assert key and key.group(1) == key.group(2), seen
        # Each local node says who it is and whom it joins (issue 23: join printed neither).
        assert len(re.findall(r"node 12D3Koo\w+ joining coordinator 12D3Koo\w+ at /ip4/[\d.]+/tcp/\d+/p2p/", seen)) == 2, seen
        r = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "abc",
                                                       "max_tokens": 4, "temperature": 0}, timeout=60)
        ring = httpx.get(f"{base}/v1/ring", timeout=10).json()
        served_key = httpx.get(f"{base}/v1/receipts/key", timeout=10).json()["coordinator_public_key"]
    finally:
        proc.terminate()
        proc.wait(30)
    assert r.status_code == 200, r.text
    assert served_key == key.group(1)  # the key printed is the key served
    # Two stages tiling the model, one per node. Where the cut falls follows each node's
    # measured speed (sub-millisecond per tiny layer, so noisy: a clean-clone CI run cut
    # 1 / 4), which is not what this test guards.
    stages = sorted(m["layers"] for m in ring["members"] if m["role"] == "stage")
    assert len(stages) == 2 and stages[0][0] == 0 and stages[0][1] == stages[1][0] and stages[1][1] == 5, ring["members"]
    assert all(a < b for a, b in stages), ring["members"]
