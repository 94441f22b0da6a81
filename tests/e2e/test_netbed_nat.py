"""Rings with stages behind NATs on the namespace test bed (tests/netbed.py), real
processes, real CLI: reached through the coordinator's relay, hole-punched where the NATs
allow (issue 19).

Bugs guarded: a node behind a NAT could not be reached by its predecessor at all (it was
excluded from every ring, or each request through it failed); the path a hop reports was
not the one its stream crosses. Sound: each host is its own namespace and a home host
cannot be dialled from the bridge (test_netbed_ring pins that), so between two hosts in
two different homes no connection exists but one through the relay or one a hole punch
opened; which of the two the NATs allow is set by the router (a port-keeping MASQUERADE
lets TCP simultaneous open through, random ports do not); the text is compared with
transformers' greedy continuation.

Needs root: not being root fails these tests with the reason (CI runs as root).
"""

from __future__ import annotations

import re
import time

from tests.e2e.procring import JOIN, ProcRing, coordinator_args, node_args
from tests.e2e.ringkit import memory_for_stages
from tests.e2e.test_netbed_ring import PROMPT, TOKENS, bed, greedy_text, in_ns, wait_ring_in  # noqa: F401 (a fixture)
from tests.netbed import NetHost

BASE = "http://127.0.0.1:8000"  # the coordinator's HTTP, from inside its namespace
JOIN_LINE = re.compile(r"node (\S+) joining coordinator")


def tails(ring: ProcRing) -> str:
    return "\n".join(f"--- {p.name}\n{p.text()[-3000:]}" for p in ring.procs)


def wait_paths(host: NetHost, stages: int, timeout_s: float, ring: ProcRing) -> dict:
    """GET /v1/ring until the ready ring's every hop reports its path (a sender reports it
    when it opens its ring stream: during the first request)."""
    deadline, info = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        _, info = in_ns(host, "GET", f"{BASE}/v1/ring", timeout_s=5)
        plan = (info.get("topology") or {}).get("plan") or {}
        hops = plan.get("hops") or []
        if info.get("ready") and len(plan.get("stages", ())) == stages and hops and all(h.get("path") for h in hops):
            return plan
        time.sleep(0.5)
    raise AssertionError(f"no {stages}-stage ring with every hop's path within {timeout_s} s: {info}\n{tails(ring)}")


def serve_one(tmp_path, store, model: str, coord_host: NetHost, nodes: list[NetHost]):
    """Coordinator and `nodes` (each able to hold 1/len(nodes) of the model) as processes;
    one greedy request once the ring is ready. Returns (status, body, plan, {name: peer id}, logs)."""
    ring = ProcRing(tmp_path)
    try:
        coord = ring.spawn("coord", coordinator_args(model, str(store.root), "/ip4/0.0.0.0/tcp/4001",
                                                     str(tmp_path / "coord.key"), min_nodes=len(nodes),
                                                     http="127.0.0.1:8000"), prefix=coord_host.prefix)
        addr = coord.wait_for(JOIN, 120).group(1)
        procs = {h.name: ring.spawn(h.name, node_args(addr, model, str(store.root),
                                                      memory_for_stages(store, len(nodes)),
                                                      ["--listen", "/ip4/0.0.0.0/tcp/0"]), prefix=h.prefix)
                 for h in nodes}
        wait_ring_in(coord_host, BASE, len(nodes), 180)
        status, body = in_ns(coord_host, "POST", f"{BASE}/v1/completions", {
            "model": store.manifest.name, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}, timeout_s=120)
        plan = wait_paths(coord_host, len(nodes), 30, ring)
        peers = {name: p.wait_for(JOIN_LINE, 5).group(1) for name, p in procs.items()}
    finally:
        ring.close()
    return status, body, plan, peers, tails(ring)


def _hop(plan: dict, src: str, dst: str) -> dict:
    return next(h for h in plan["hops"] if (h["src"], h["dst"]) == (src, dst))


def test_two_stages_behind_two_nats_are_hole_punched(bed, tiny_llama, tiny_llama_store, tmp_path):
    # Two port-keeping NATs: the relayed connection between the stages is upgraded by
    # DCUtR (simultaneous open from both listen ports), and the ring stream crosses it.
    coord_host = bed.add_public("coord")
    (h1,) = bed.add_home("r1", ["h1"])
    (h2,) = bed.add_home("r2", ["h2"])
    status, body, plan, peers, logs = serve_one(tmp_path, tiny_llama_store, str(tiny_llama.path), coord_host, [h1, h2])
    head, tail = (s["peer_id"] for s in plan["stages"])
    print(f"\n[nat x2, port-keeping] hops: {[(h['src'][-4:], h['dst'][-4:], h['path']) for h in plan['hops']]}")
    assert status == 200, (body, logs)
    assert body["choices"][0]["text"] == greedy_text(tiny_llama, tiny_llama_store)
    assert {head, tail} == set(peers.values()), (plan, peers)
    assert _hop(plan, head, tail)["path"] == "hole_punched", (plan["hops"], logs)


def test_a_stage_behind_a_symmetric_nat_is_reached_through_the_relay(bed, tiny_llama, tiny_llama_store, tmp_path):
    # One NAT gives every connection a random port: the hole punch's predicted address is
    # wrong, so the two stages stay on the coordinator's relay, and the text is the same.
    coord_host = bed.add_public("coord")
    (h1,) = bed.add_home("r1", ["h1"], symmetric=True)
    (h2,) = bed.add_home("r2", ["h2"])
    status, body, plan, peers, logs = serve_one(tmp_path, tiny_llama_store, str(tiny_llama.path), coord_host, [h1, h2])
    head, tail = (s["peer_id"] for s in plan["stages"])
    print(f"\n[nat x2, one symmetric] hops: {[(h['src'][-4:], h['dst'][-4:], h['path']) for h in plan['hops']]}")
    assert status == 200, (body, logs)
    assert body["choices"][0]["text"] == greedy_text(tiny_llama, tiny_llama_store)
    assert _hop(plan, head, tail)["path"] == "relayed", (plan["hops"], logs)
    coordinator = plan["hops"][0]["src"]
    assert {_hop(plan, coordinator, head)["path"], _hop(plan, tail, coordinator)["path"]} == {"direct"}
