"""Restarts and refusals with the real CLI on loopback (issue 19), one process each.

Bugs guarded: kill -9 of the coordinator ended every node within 0.2 s and a restart with
the same key had 0 nodes forever; two nodes started without --key-path shared one
identity (the second silently replaced the first); a node with another model got a
traceback. Sound: the restarted coordinator must serve the same greedy text through the
same node processes (their PIDs alive, the same layers each), and the refusals are read
from the refused process's own stderr and exit status.
"""

from __future__ import annotations

import re
import socket
import time

from tests.e2e.procring import JOIN, ProcRing, complete, coordinator_args, node_args, wait_ring
from tests.e2e.ringkit import memory_for_stages

PROMPT = [1, 50, 60, 70, 80, 90]
TOKENS = 8


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def members(info: dict) -> dict[str, list[int]]:
    return {m["peer_id"]: m["layers"] for m in info["members"]}


def roles(info: dict) -> dict[str, tuple[str, int | None]]:
    return {p: (r["role"], r["stage_index"]) for p, r in ((info.get("topology") or {}).get("roles") or {}).items()}


def test_kill_9_of_the_coordinator_and_a_restart_serve_the_same_text_on_the_warm_ring(tiny_llama, tiny_llama_store,
                                                                                         tmp_path):
    store, model = tiny_llama_store, str(tiny_llama.path)
    ring = ProcRing(tmp_path)
    base = f"http://127.0.0.1:{free_loopback_port()}"
    coord = coordinator_args(model, str(store.root), f"/ip4/127.0.0.1/tcp/{free_loopback_port()}",
                             str(tmp_path / "coord.key"), min_nodes=3, http=base.removeprefix("http://"))
    try:
        first = ring.spawn("coord", coord)
        addr = first.wait_for(JOIN, 120).group(1)
        # No --key-path: each node claims its own default key. Two stages and a hot standby
        # holding one of their slices, which must not take that stage's place on restart.
        nodes = [ring.spawn("node", node_args(addr, model, str(store.root), memory_for_stages(store, 2)))
                 for _ in range(3)]
        info = wait_ring(base, 2, 120)
        before, roles_before = members(info), roles(info)
        assert len(before) == 2 and len(roles_before) == 1, info  # three identities, not one registered twice
        text = complete(base, store.manifest.name, PROMPT, TOKENS)

        first.kill9()
        t0 = time.monotonic()
        second = ring.spawn("coord", coord)
        served = None
        while served is None and time.monotonic() - t0 < 60:
            try:
                served = complete(base, store.manifest.name, PROMPT, TOKENS, timeout_s=30)
            except Exception:  # 503 until the ring re-forms
                time.sleep(0.1)
        restart_s = time.monotonic() - t0
        info = wait_ring(base, 2, 5) if served is not None else {"members": [], "topology": {}}
        after, roles_after = members(info), roles(info)
    finally:
        ring.close()
    logs = "\n".join(p.text()[-2500:] for p in (second, *nodes))
    assert served == text, logs
    assert after == before  # the same nodes hold the same layers
    assert roles_after == roles_before  # and the spare stands by for the stage whose slice it keeps warm
    assert all(n.popen.returncode == -9 for n in nodes)  # alive until close() killed them: none had exited
    assert all(re.search(r"lost the coordinator .* reconnecting in [0-9.]+ s \(attempt 1\)", n.text()) for n in nodes)
    print(f"\n[restart] kill -9 to first served request: {restart_s:.1f} s (coordinator start included)")
    assert restart_s < 30, restart_s


def test_a_second_node_with_the_same_key_and_a_node_with_another_model_are_refused_in_one_line(
        tiny_llama, tiny_llama_store, tiny_qwen2, tiny_qwen2_store, tmp_path):
    store = tiny_llama_store
    ring = ProcRing(tmp_path)
    base = f"http://127.0.0.1:{free_loopback_port()}"
    coord = coordinator_args(str(tiny_llama.path), str(store.root), "/ip4/127.0.0.1/tcp/0", str(tmp_path / "c.key"),
                             min_nodes=1, http=base.removeprefix("http://"))
    key = ["--key-path", str(tmp_path / "shared.key")]
    try:
        c = ring.spawn("coord", coord)
        addr = c.wait_for(JOIN, 120).group(1)
        ring.spawn("node", node_args(addr, str(tiny_llama.path), str(store.root), 1 << 30, key))
        wait_ring(base, 1, 120)
        twin = ring.spawn("node", node_args(addr, str(tiny_llama.path), str(store.root), 1 << 30, key))
        other = ring.spawn("node", node_args(addr, str(tiny_qwen2.path), str(tiny_qwen2_store.root), 1 << 30))
        twin_status, other_status = twin.popen.wait(120), other.popen.wait(120)
    finally:
        ring.close()
    assert (twin_status, other_status) == (1, 1), twin.text()[-3000:] + other.text()[-3000:]
    twin_line = twin.text().strip().splitlines()[-1]
    assert twin_line.startswith("shard-node join: error: the coordinator refused this node: peer id ")
    assert "share one identity key file; give each node its own --key-path" in twin_line
    other_line = other.text().strip().splitlines()[-1]
    assert other_line == (f"shard-node join: error: the coordinator refused this node: this node holds model "
                          f"{str(tiny_qwen2.path)!r} with digest {tiny_qwen2_store.digest}, but the ring serves "
                          f"{store.manifest.name!r} with digest {store.digest}: rejoin with --model {store.manifest.name}")
