"""Rings across hosts of the namespace test bed (tests/netbed.py), real processes, real CLI.

Bugs guarded (issue 19, found on exactly this set-up): nodes listening on 0.0.0.0
advertised 0.0.0.0 and the coordinator printed a join line with 0.0.0.0, so a ring
"formed" and every request failed; a node behind a NAT was seated although its
predecessor could not dial it. Sound: each host is its own network namespace (own
addresses, own loopback), so an address that only works on one machine fails here as it
would between machines; the text is compared with transformers' greedy continuation.

Needs root: not being root fails these tests with the reason, it does not skip them
(CI runs as root).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoTokenizer

from coordinator.jobs.engine import IncrementalDetokenizer
from tests.e2e.procring import JOIN, ProcRing, coordinator_args, node_args
from tests.e2e.ringkit import memory_for_stages
from tests.netbed import Netbed, NetbedError, NetHost

PROMPT = [1, 50, 60, 70, 80, 90]
TOKENS = 8


@pytest.fixture
def bed():
    try:
        with Netbed() as netbed:
            yield netbed
    except NetbedError as exc:
        pytest.fail(f"namespace test bed unavailable: {exc}")


def in_ns(host: NetHost, method: str, url: str, body: dict | None = None, timeout_s: float = 60) -> tuple[int, dict]:
    """An HTTP request made from inside `host`'s namespace: (status, JSON body)."""
    code = ("import httpx, json, sys; r = httpx.request(sys.argv[1], sys.argv[2], json=json.loads(sys.argv[3]), "
            f"timeout={timeout_s}); print(r.status_code); print(r.text)")
    got = subprocess.run([*host.prefix, sys.executable, "-c", code, method, url, json.dumps(body)],
                         capture_output=True, text=True, timeout=timeout_s + 30)
    status, _, text = got.stdout.partition("\n")
    return int(status or 0), (json.loads(text) if text.strip().startswith("{") else {"raw": got.stderr[-500:]})


def wait_ring_in(host: NetHost, base: str, stages: int, timeout_s: float) -> dict:
    deadline, info = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        _, info = in_ns(host, "GET", f"{base}/v1/ring", timeout_s=5)
        if info.get("ready") and len(info.get("members", ())) == stages:
            return info
        time.sleep(0.5)
    raise AssertionError(f"no ready {stages}-stage ring within {timeout_s} s: {info}")


def greedy_text(tiny, store) -> str:
    with torch.no_grad():
        ids = tiny.model.generate(torch.tensor([PROMPT]), max_new_tokens=TOKENS, min_new_tokens=TOKENS,
                                  do_sample=False)[0, len(PROMPT):].tolist()
    detok = IncrementalDetokenizer(AutoTokenizer.from_pretrained(str(store.tokenizer_dir)), PROMPT)
    return "".join(detok.push(t) for t in ids) + detok.flush()


def test_a_home_host_dials_out_and_cannot_be_dialled(bed):
    public = bed.add_public("pub")
    (home,) = bed.add_home("router", ["home"])
    servers = [subprocess.Popen([*h.prefix, sys.executable, "-m", "http.server", "8000", "--bind", "0.0.0.0"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for h in (public, home)]
    try:
        from tests.netbed import can_connect
        time.sleep(1.0)  # the two servers' listen; the assertions below retry nothing
        out = can_connect(home, public.ip, 8000)
        in_lan = can_connect(public, home.ip, 8000, timeout_s=1.0)
        in_wan = can_connect(public, home.public_ip, 8000, timeout_s=1.0)
    finally:
        for s in servers:
            s.kill()
            s.wait(10)
    assert (out, in_lan, in_wan) == (True, False, False)


def test_a_three_stage_ring_across_public_hosts_answers_as_transformers(bed, tiny_llama, tiny_llama_store, tmp_path):
    store, model = tiny_llama_store, str(tiny_llama.path)
    coord_host = bed.add_public("coord", upload_mbit=100)
    node_hosts = [bed.add_public(f"n{i}", upload_mbit=50) for i in range(3)]
    ring = ProcRing(tmp_path)
    try:
        # The default listen address (every interface, port 4001) and nodes on 0.0.0.0.
        coord = ring.spawn("coord", coordinator_args(model, str(store.root), "/ip4/0.0.0.0/tcp/4001",
                                                     str(tmp_path / "coord.key"), min_nodes=3,
                                                     http="127.0.0.1:8000"), prefix=coord_host.prefix)
        addr, base = coord.wait_for(JOIN, 120).group(1), "http://127.0.0.1:8000"
        assert addr.startswith(f"/ip4/{coord_host.ip}/tcp/4001/p2p/"), addr  # dialable from the other hosts
        for h in node_hosts:
            ring.spawn(h.name, node_args(addr, model, str(store.root), memory_for_stages(store, 3),
                                         ["--listen", "/ip4/0.0.0.0/tcp/0"]), prefix=h.prefix)
        info = wait_ring_in(coord_host, base, 3, 180)
        status, body = in_ns(coord_host, "POST", f"{base}/v1/completions", {
            "model": store.manifest.name, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0})
    finally:
        ring.close()
    assert status == 200, body
    assert body["choices"][0]["text"] == greedy_text(tiny_llama, store)
    assert len(info["members"]) == 3


def test_a_ring_with_a_node_behind_a_nat_answers_as_transformers_within_seconds(bed, tiny_llama, tiny_llama_store,
                                                                                  tmp_path):
    # Two public nodes and one behind a NAT, each able to hold half the model. Seated where
    # its predecessor must dial it, the NATed node is unreachable: the predecessor's
    # successor_unreachable excludes it and the job resumes on the two public nodes
    # (before, each request failed after ~120 s and the node stayed seated). Seated as
    # the head, or reached over a connection it opened itself, it simply serves. Either
    # way the text must be transformers' and arrive within a bound well below the old 120 s.
    store, model = tiny_llama_store, str(tiny_llama.path)
    coord_host = bed.add_public("coord")
    publics = [bed.add_public(f"n{i}") for i in range(2)]
    (home,) = bed.add_home("router", ["h0"])
    ring = ProcRing(tmp_path)
    try:
        coord = ring.spawn("coord", coordinator_args(model, str(store.root), "/ip4/0.0.0.0/tcp/4001",
                                                     str(tmp_path / "coord.key"), min_nodes=3,
                                                     http="127.0.0.1:8000"), prefix=coord_host.prefix)
        addr, base = coord.wait_for(JOIN, 120).group(1), "http://127.0.0.1:8000"
        for h in (home, *publics):
            ring.spawn(h.name, node_args(addr, model, str(store.root), memory_for_stages(store, 2),
                                         ["--listen", "/ip4/0.0.0.0/tcp/0"]), prefix=h.prefix)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            _, info = in_ns(coord_host, "GET", f"{base}/v1/ring", timeout_s=5)
            if info.get("ready") and info.get("registered_nodes") == 3:
                break
            time.sleep(0.5)
        t0 = time.monotonic()
        status, body = in_ns(coord_host, "POST", f"{base}/v1/completions", {
            "model": store.manifest.name, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}, timeout_s=90)
        took_s = time.monotonic() - t0
    finally:
        ring.close()
    excluded = "is unreachable" in coord.text()
    print(f"\n[nat] request through a ring with a NATed node: {took_s:.1f} s (NATed node excluded: {excluded})")
    assert status == 200, (body, "\n".join(p.text()[-1500:] for p in ring.procs))
    assert body["choices"][0]["text"] == greedy_text(tiny_llama, store)
    assert took_s < 45, took_s
