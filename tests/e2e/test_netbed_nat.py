"""Rings with stages behind NATs on the namespace test bed (tests/netbed.py), real
processes, real CLI: reached through the coordinator's relay, hole-punched where the NATs
allow (issue 19).

Bugs guarded: a node behind a NAT could not be reached by its predecessor at all (it was
excluded from every ring, or each request through it failed); the path a hop reports was
not the one its stream crosses; a NATed middle stage (reached through a NAT and sending
through one) was never tested, since the selector seats a NATed node at the head when
it can (the three-NAT rings leave it no such choice). Sound: each host is its own namespace and a home host
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


def key_path(tmp_path, host: NetHost):
    """Where `host`'s node keeps its identity (serve_one): made beforehand, its peer id is known."""
    return tmp_path / f"{host.name}.key"


def serve_one(tmp_path, store, model: str, coord_host: NetHost, nodes: list[NetHost], spares: list[NetHost] = (),
              coord_extra: tuple[str, ...] = ()):
    """Coordinator and `nodes` (each able to hold 1/len(nodes) of the model) as processes,
    and `spares` that can hold no layer (off the ring: relays, at most); one greedy
    request once the ring is ready. Returns (status, body, plan, {name: peer id}, logs, info)."""
    ring = ProcRing(tmp_path)
    try:
        coord = ring.spawn("coord", coordinator_args(model, str(store.root), "/ip4/0.0.0.0/tcp/4001",
                                                     str(tmp_path / "coord.key"), min_nodes=len(nodes) + len(spares),
                                                     http="127.0.0.1:8000", extra=coord_extra), prefix=coord_host.prefix)
        addr = coord.wait_for(JOIN, 120).group(1)
        procs = {h.name: ring.spawn(h.name, node_args(addr, model, str(store.root),
                                                      memory_for_stages(store, len(nodes)) if h in nodes else 1 << 16,
                                                      ["--listen", "/ip4/0.0.0.0/tcp/0",
                                                       "--key-path", str(key_path(tmp_path, h))]), prefix=h.prefix)
                 for h in (*spares, *nodes)}
        wait_ring_in(coord_host, BASE, len(nodes), 180)
        status, body = in_ns(coord_host, "POST", f"{BASE}/v1/completions", {
            "model": store.manifest.name, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}, timeout_s=120)
        plan = wait_paths(coord_host, len(nodes), 30, ring)
        _, info = in_ns(coord_host, "GET", f"{BASE}/v1/ring", timeout_s=5)
        peers = {name: p.wait_for(JOIN_LINE, 5).group(1) for name, p in procs.items()}
    finally:
        ring.close()
    return status, body, plan, peers, tails(ring), info


def _hop(plan: dict, src: str, dst: str) -> dict:
    return next(h for h in plan["hops"] if (h["src"], h["dst"]) == (src, dst))


def test_two_stages_behind_two_nats_are_hole_punched(bed, tiny_llama, tiny_llama_store, tmp_path):
    # Two port-keeping NATs: the relayed connection between the stages is upgraded by
    # DCUtR (simultaneous open from both listen ports), and the ring stream crosses it.
    coord_host = bed.add_public("coord")
    (h1,) = bed.add_home("r1", ["h1"])
    (h2,) = bed.add_home("r2", ["h2"])
    status, body, plan, peers, logs, _ = serve_one(tmp_path, tiny_llama_store, str(tiny_llama.path), coord_host, [h1, h2])
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
    status, body, plan, peers, logs, _ = serve_one(tmp_path, tiny_llama_store, str(tiny_llama.path), coord_host, [h1, h2])
    head, tail = (s["peer_id"] for s in plan["stages"])
    print(f"\n[nat x2, one symmetric] hops: {[(h['src'][-4:], h['dst'][-4:], h['path']) for h in plan['hops']]}")
    assert status == 200, (body, logs)
    assert body["choices"][0]["text"] == greedy_text(tiny_llama, tiny_llama_store)
    assert _hop(plan, head, tail)["path"] == "relayed", (plan["hops"], logs)
    coordinator = plan["hops"][0]["src"]
    assert {_hop(plan, coordinator, head)["path"], _hop(plan, tail, coordinator)["path"]} == {"direct"}


# Inside the coordinator's namespace: stream a greedy completion of token ids, kill -9 a
# pid once `kill_after` tokens arrived; prints the status, the text and when the kill was.
STREAM_AND_KILL = r"""
import httpx, json, os, signal, sys, time
url, model, prompt, max_tokens, pid, kill_after = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
text, n, killed, error = [], 0, False, ""
for attempt in range(10):  # a 503 before any token (the ring re-forming: a link dropped) says when to retry
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=180) as r:
        if r.status_code == 503 and attempt < 9:
            error = r.read().decode()[:300]
            time.sleep(float(r.headers.get("retry-after", "1")))
            continue
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = json.loads(line[6:])["choices"][0].get("text") or ""
            text.append(piece)
            n += 1
            if not killed and n >= kill_after:
                os.kill(pid, signal.SIGKILL)
                killed = True
        break
print(json.dumps({"status": r.status_code, "text": "".join(text), "killed": killed, "retried": attempt, "last_503": error}))
"""


def test_kill_9_of_a_natted_stage_mid_request_resumes_with_the_same_text(bed, tiny_llama, tiny_llama_store, tmp_path):
    # Two NATed nodes and a public one, each holding half the model: a 2-stage ring and a
    # spare. A NATed stage dies mid-stream; the job resumes on the re-formed ring and the
    # whole text equals an uninterrupted greedy run (DESIGN: a death costs time, not tokens).
    import json
    import subprocess
    import sys

    import torch
    from transformers import AutoTokenizer

    from coordinator.jobs.engine import IncrementalDetokenizer

    store, model, tokens = tiny_llama_store, str(tiny_llama.path), 24
    coord_host = bed.add_public("coord")
    (pub,) = [bed.add_public("n0")]
    (h1,) = bed.add_home("r1", ["h1"])
    (h2,) = bed.add_home("r2", ["h2"])
    ring = ProcRing(tmp_path)
    try:
        coord = ring.spawn("coord", coordinator_args(model, str(store.root), "/ip4/0.0.0.0/tcp/4001",
                                                     str(tmp_path / "coord.key"), min_nodes=2,
                                                     http="127.0.0.1:8000"), prefix=coord_host.prefix)
        addr = coord.wait_for(JOIN, 120).group(1)
        procs = {h.name: ring.spawn(h.name, node_args(addr, model, str(store.root), memory_for_stages(store, 2),
                                                      ["--listen", "/ip4/0.0.0.0/tcp/0"]), prefix=h.prefix)
                 for h in (h1, h2, pub)}
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            _, info = in_ns(coord_host, "GET", f"{BASE}/v1/ring", timeout_s=5)
            if info.get("ready") and info.get("registered_nodes") == 3:
                break
            time.sleep(0.5)
        peers = {name: p.wait_for(JOIN_LINE, 5).group(1) for name, p in procs.items()}
        members = {m["peer_id"] for m in info["members"]}
        victim = next(name for name in ("h1", "h2") if peers[name] in members)
        got = subprocess.run([*coord_host.prefix, sys.executable, "-c", STREAM_AND_KILL, BASE, store.manifest.name,
                              json.dumps(PROMPT), str(tokens), str(procs[victim].popen.pid), "3"],
                             capture_output=True, text=True, timeout=300)
    finally:
        ring.close()
    with torch.no_grad():
        ids = tiny_llama.model.generate(torch.tensor([PROMPT]), max_new_tokens=tokens, min_new_tokens=tokens,
                                        do_sample=False)[0, len(PROMPT):].tolist()
    detok = IncrementalDetokenizer(AutoTokenizer.from_pretrained(str(store.tokenizer_dir)), PROMPT)
    expected = "".join(detok.push(t) for t in ids) + detok.flush()
    assert got.returncode == 0, (got.stderr[-2000:], tails(ring))
    result = json.loads(got.stdout.strip().splitlines()[-1])
    assert result["status"] == 200 and result["killed"], (result, tails(ring))
    assert result["text"] == expected, (result, expected, tails(ring))


def _middle_behind_a_nat(bed, tiny_llama, tiny_llama_store, tmp_path, symmetric: bool, path: str) -> None:
    # Three stages, each host in its own home: the selector seats a NATed node where no
    # frame crosses the relay (the head) when it can, so here every arrangement it could
    # choose has a NATed middle stage, whose incoming and outgoing hops both go through a
    # NAT (issue 19's "a ring whose middle stage is behind a NAT").
    coord_host = bed.add_public("coord")
    homes = [bed.add_home(f"r{i}", [f"h{i}"], symmetric=symmetric)[0] for i in (1, 2, 3)]
    status, body, plan, peers, logs, _ = serve_one(tmp_path, tiny_llama_store, str(tiny_llama.path), coord_host, homes)
    head, middle, tail = (s["peer_id"] for s in plan["stages"])
    print(f"\n[3 stages, 3 NATs, {'random ports' if symmetric else 'port-keeping'}] "
          f"hops: {[(h['src'][-4:], h['dst'][-4:], h['path']) for h in plan['hops']]}")
    assert status == 200, (body, logs)
    assert body["choices"][0]["text"] == greedy_text(tiny_llama, tiny_llama_store)
    assert {head, middle, tail} == set(peers.values()), (plan, peers)
    assert (_hop(plan, head, middle)["path"], _hop(plan, middle, tail)["path"]) == (path, path), (plan["hops"], logs)
    coordinator = plan["hops"][0]["src"]
    assert {_hop(plan, coordinator, head)["path"], _hop(plan, tail, coordinator)["path"]} == {"direct"}


def test_a_middle_stage_behind_a_symmetric_nat_is_reached_through_the_relay(bed, tiny_llama, tiny_llama_store,
                                                                            tmp_path):
    _middle_behind_a_nat(bed, tiny_llama, tiny_llama_store, tmp_path, symmetric=True, path="relayed")


def test_a_middle_stage_behind_a_port_keeping_nat_is_hole_punched(bed, tiny_llama, tiny_llama_store, tmp_path):
    _middle_behind_a_nat(bed, tiny_llama, tiny_llama_store, tmp_path, symmetric=False, path="hole_punched")


def test_a_natted_stage_is_reached_through_a_relay_role_node_not_the_gateway(bed, tiny_llama, tiny_llama_store,
                                                                             tmp_path):
    # Two stages behind two NATs (one gives random ports: no hole punch) and a public spare
    # that can hold no layer. The gateway is far (40 ms emulated on its links, which the
    # cost model adds to every leg through it); the spare is on the bridge with the homes.
    # Formation gives the spare the relay role, the tail reserves on it, and the head's
    # ring stream crosses it: /v1/ring shows the hop relayed via the spare, and the text
    # is transformers'. Sound: via is read off the connection the head's stream crosses
    # (its circuit address names the relay), and the two relays are distinct hosts.
    coord_host = bed.add_public("coord")
    relay_host = bed.add_public("relay")
    (h1,) = bed.add_home("r1", ["h1"], symmetric=True)
    (h2,) = bed.add_home("r2", ["h2"])
    status, body, plan, peers, logs, info = serve_one(tmp_path, tiny_llama_store, str(tiny_llama.path), coord_host,
                                                      [h1, h2], spares=[relay_host],
                                                      coord_extra=("--link-latency-ms", "40"))
    head, tail = (s["peer_id"] for s in plan["stages"])
    print(f"\n[relay role] hops: {[(h['src'][-4:], h['dst'][-4:], h['path'], (h['via'] or '')[-4:]) for h in plan['hops']]}")
    assert status == 200, (body, logs)
    assert body["choices"][0]["text"] == greedy_text(tiny_llama, tiny_llama_store)
    assert {head, tail} == {peers["h1"], peers["h2"]}, (plan, peers)
    hop = _hop(plan, head, tail)
    assert (hop["path"], hop["via"]) == ("relayed", peers["relay"]), (plan["hops"], peers, logs)
    roles = info["topology"]["roles"]
    assert roles[peers["relay"]]["role"] == "relay", roles



def test_public_ends_and_a_natted_middle_answer_as_transformers(bed, tiny_llama, tiny_llama_store, tmp_path):
    # Issue 19's "public head and tail, NATed middle": three nodes, each able to hold a
    # third of the model, the two public ones trusted with the ring's ends (--trusted-peers:
    # the head sees token ids, the tail the final states), so the NATed one must be the
    # middle stage. Its NAT gives random ports, yet the head's hop into it ends up on a
    # direct connection: one the middle opened to the public head itself (its link probe:
    # "direct"), or DCUtR's dial from the middle once the head reached it through the
    # gateway's relay (a reversal, no port prediction needed: "hole_punched"), whichever
    # came first. So "relayed" is not the answer here while the middle may dial the head;
    # it is only where both ends are behind NATs (the tests above). Sound: without the
    # constraint the selector seats a NATed node at the head (test_relayed_topology), and
    # each path is read off the sender's own ring stream.
    from shard.identity import load_or_create_identity, peer_id_of

    coord_host = bed.add_public("coord")
    ends = [bed.add_public(f"n{i}") for i in (1, 2)]
    (home,) = bed.add_home("r1", ["h1"], symmetric=True)
    trusted = [peer_id_of(load_or_create_identity(key_path(tmp_path, h))) for h in ends]
    status, body, plan, peers, logs, _ = serve_one(tmp_path, tiny_llama_store, str(tiny_llama.path), coord_host,
                                                   [*ends, home], coord_extra=("--trusted-peers", ",".join(trusted)))
    head, middle, tail = (s["peer_id"] for s in plan["stages"])
    print(f"\n[public ends, NATed middle] hops: {[(h['src'][-4:], h['dst'][-4:], h['path']) for h in plan['hops']]}")
    assert status == 200, (body, logs)
    assert body["choices"][0]["text"] == greedy_text(tiny_llama, tiny_llama_store)
    assert middle == peers["h1"] and {head, tail} == set(trusted), (plan, peers)
    # Out of the middle: its own dial to the public tail (labelled hole_punched when the
    # tail's link probe had opened a circuit to it first).
    assert _hop(plan, head, middle)["path"] in ("direct", "hole_punched"), (plan["hops"], logs)
    assert _hop(plan, middle, tail)["path"] in ("direct", "hole_punched"), (plan["hops"], logs)
