"""Rings across the namespace test bed (tests/netbed.py), timed as a user sees them.

Real `shard-coord serve` and `shard-node join` processes, one per namespace, every upload
shaped with the same tbf rate. Measures, side by side in one run: time to first token and
time per token of three 2-stage rings whose middle hop (head -> tail) is direct (two
public hosts), hole-punched (two hosts behind two port-keeping NATs) or relayed through
the coordinator (one of the two NATs gives random ports); the time from kill -9 of the
coordinator (restarted with the same key and listen address) to the first served token;
the time from a stage's death (kill -9 of the tail mid-stream) to the resumed request's
next token. The relayed pair runs twice: through the gateway, and with a public spare that
formation makes its relay (the relay role), so the hop crosses a volunteer. A relayed hop
(through the gateway's host and through a relay-role host) is also set against the two
legs it crosses with no model in the way (a ring's TTFT on 2 shared cores swings by more than a leg): one prefill chunk's
activations from a host behind the random-port NAT to the other home through the relay,
and over each leg alone (sender -> relay, relay -> destination); target: the relayed
transfer within 110% of the two legs' sum. Needs root.

  sudo .venv/bin/python scripts/bench_internet.py --json docs/results/bench_internet.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shard.store import ModelStore, default_store_dir, prepare  # noqa: E402
from tests.e2e.procring import JOIN, ProcRing, coordinator_args, node_args  # noqa: E402
from tests.e2e.ringkit import memory_for_stages  # noqa: E402
from tests.netbed import Netbed  # noqa: E402

# Run inside the coordinator's namespace: one streamed completion, the arrival time of
# each token (perf_counter, from sending), and optionally kill -9 a pid after K tokens.
CLIENT = r"""
import httpx, json, os, signal, sys, time
PROMPT = os.environ["BENCH_PROMPT"]
url, model, max_tokens, kill_pid, kill_after = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
t0, times, killed = time.perf_counter(), [], None
with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
    for line in r.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        if json.loads(line[6:])["choices"][0].get("text"):
            times.append(time.perf_counter() - t0)
            if kill_pid and killed is None and len(times) >= kill_after:
                os.kill(kill_pid, signal.SIGKILL)
                killed = time.perf_counter() - t0
print(json.dumps({"status": r.status_code, "times": times, "killed_at": killed}))
"""


# The same prompt for every ring: ~200 tokens, so the prefill chunk's transfer shows in TTFT.
PROMPT = " ".join(["The history of the printing press begins with movable type in East Asia and"] * 14)


def client(host, base: str, model: str, max_tokens: int, kill_pid: int = 0, kill_after: int = 0) -> dict:
    got = subprocess.run(["env", f"BENCH_PROMPT={PROMPT}", *host.prefix, sys.executable, "-c", CLIENT, base, model,
                          str(max_tokens), str(kill_pid), str(kill_after)], capture_output=True, text=True, timeout=600)
    if got.returncode != 0:
        raise RuntimeError(got.stderr[-2000:])
    return json.loads(got.stdout.strip().splitlines()[-1])


# Run inside the coordinator's namespace: retry a one-token request every 50 ms until it
# is served; prints the seconds that took.
POLL = r"""
import httpx, sys, time
url, model, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
t0 = time.perf_counter()
while time.perf_counter() - t0 < timeout_s:
    try:
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 1}, timeout=60)
        if r.status_code == 200:
            print(time.perf_counter() - t0)
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.05)
sys.exit(1)
"""


def wait_served(host, base: str, model: str, timeout_s: float) -> float:
    """Seconds until a one-token request is served (503s and refused connections retried)."""
    got = subprocess.run([*host.prefix, sys.executable, "-c", POLL, base, model, str(timeout_s)], capture_output=True,
                         text=True, timeout=timeout_s + 60)
    if got.returncode != 0:
        raise RuntimeError(f"nothing served within {timeout_s} s: {got.stderr[-1000:]}")
    return float(got.stdout.strip().splitlines()[-1])


def layers(proc) -> list[str]:
    """The layer ranges a node said it serves, in order (a reload would show a new range)."""
    return re.findall(r"serving layers (\[\d+, \d+\))", proc.text())


# One libp2p host per namespace (shard.transport, no model): `relay` relays and echoes;
# `dest` reserves a slot on it and echoes; `send` times sized frames to a peer (each
# answered by a 1-byte ack once read whole) and prints the best of N seconds per frame.
HOST = r"""
import json, os, sys, time, trio
sys.path.insert(0, os.getcwd())
from shard.identity import keypair_from_seed
from shard.transport import open_host
role, workdir, nbytes, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
PROTO = "/bench/transfer/1"

async def ack(stream):
    while True:
        await stream.recv_frame(nbytes + 16)
        await stream.send_frame(b"k")

async def send(host, peer):
    stream = await host.open_stream(peer, PROTO)
    best = float("inf")
    for _ in range(n):
        t0 = trio.current_time()
        await stream.send_frame(bytes(nbytes))
        await stream.recv_frame(16)
        best = min(best, trio.current_time() - t0)
    return best, host.path_of(stream)

def wait_file(name):
    while not os.path.exists(os.path.join(workdir, name)):
        time.sleep(0.05)
    return open(os.path.join(workdir, name)).read()

async def main():
    async with open_host(keypair_from_seed(os.urandom(32)), "/ip4/0.0.0.0/tcp/0", relay_hop=(role == "relay")) as host:
        host.set_handler(PROTO, ack)
        if role == "node_relay":  # as a node given the relay role starts relaying
            host.reach.enable_hop()
        if role in ("relay", "node_relay"):
            open(os.path.join(workdir, "relay"), "w").write(host.addrs[0])
            dest = await trio.to_thread.run_sync(wait_file, "dest")
            await trio.to_thread.run_sync(wait_file, "measure")  # after the sender's runs: one transfer at a time
            best, path = await send(host, dest.rsplit("/", 1)[1])  # over the dest's own connection
            print(json.dumps({"s": best, "path": path}), flush=True)
            await trio.to_thread.run_sync(wait_file, "done")
        elif role == "dest":
            relay = await trio.to_thread.run_sync(wait_file, "relay")
            await host.connect(relay)
            circuit = await host.reach.reserve(relay)
            open(os.path.join(workdir, "dest"), "w").write(circuit)
            await trio.to_thread.run_sync(wait_file, "done")
        else:
            target = await trio.to_thread.run_sync(wait_file, role.split(":")[1])
            await host.connect(target)
            peer = target.rsplit("/", 1)[1]
            best, path = await send(host, peer)
            print(json.dumps({"s": best, "path": path}), flush=True)

trio.run(main)
"""


def hop_transfers(bed_hosts: dict, nbytes: int, tmp: Path, runs: int = 5, relay_role: str = "relay") -> dict:
    """Seconds to move one `nbytes` frame over each path (best of `runs`, a 1-byte ack
    back): sender -> relay and relay -> destination (the two legs, each a direct
    connection), and sender -> destination through the relay (a symmetric NAT in front of
    the sender: no punching). `relay_role`: "relay" (a host made to relay, as the gateway)
    or "node_relay" (one that starts relaying later, as a node given the relay role)."""
    work = tmp / f"hops_{relay_role}"
    work.mkdir()
    args = [str(work), str(nbytes), str(runs)]
    relay = subprocess.Popen([*bed_hosts["relay"].prefix, sys.executable, "-c", HOST, relay_role, *args],
                             stdout=subprocess.PIPE, text=True)
    dest = subprocess.Popen([*bed_hosts["dest"].prefix, sys.executable, "-c", HOST, "dest", *args],
                            stdout=subprocess.PIPE, text=True)
    try:
        legs = {}
        for name, role in (("sender_to_relay", "send:relay"), ("through_relay", "send:dest")):
            got = subprocess.run([*bed_hosts["sender"].prefix, sys.executable, "-c", HOST, role, *args],
                                 capture_output=True, text=True, timeout=300)
            legs[name] = json.loads(got.stdout.strip().splitlines()[-1]) if got.returncode == 0 else got.stderr[-500:]
        (work / "measure").write_text("")
        legs["relay_to_dest"] = json.loads(relay.stdout.readline())
    finally:
        (work / "done").write_text("")
        for proc in (relay, dest):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    two_legs = legs["sender_to_relay"]["s"] + legs["relay_to_dest"]["s"]
    return {"frame_bytes": nbytes, "best_of": runs, **legs, "two_legs_s": two_legs,
            "ratio_to_two_legs": legs["through_relay"]["s"] / two_legs, "target": "<= 1.10",
            "met": legs["through_relay"]["s"] <= 1.10 * two_legs}


def ring_info(host, base: str) -> dict:
    return json.loads(subprocess.run([*host.prefix, sys.executable, "-c", "import httpx, sys; "
                                      "print(httpx.get(sys.argv[1] + '/v1/ring').text)", base],
                                     capture_output=True, text=True, timeout=60).stdout)


def roles_of(host, base: str) -> dict:
    """The off-ring roles /v1/ring reports: {peer id: (role, stage index)}."""
    roles = ring_info(host, base)["topology"].get("roles") or {}
    return {p: (r["role"], r["stage_index"]) for p, r in roles.items()}


def timed(coord_host, base: str, model: str, tokens: int, runs: int = 3) -> dict:
    """Best of `runs` streamed completions: TTFT, time per token, and each hop's path."""
    got = [client(coord_host, base, model, tokens) for _ in range(runs)]
    t = min(got, key=lambda r: r["times"][-1])["times"]
    info = ring_info(coord_host, base)
    hops = info["topology"]["plan"]["hops"]
    roles = info["topology"].get("roles") or {}
    return {"ttft_s": t[0], "s_per_token": (t[-1] - t[0]) / max(len(t) - 1, 1), "tokens": len(t), "best_of": runs,
            "stages": [m["layers"] for m in info["members"]], "hop_paths": [h["path"] for h in hops],
            "hop_relays": [("gateway" if h.get("via") == hops[0]["src"] else f"{roles.get(h['via'], {}).get('role')} node")
                           if h.get("via") else None for h in hops]}


def serve_ring(ring: ProcRing, coord_host, nodes, model: str, store_dir: str, home: Path, memory: int, spares=()):
    """A coordinator on `coord_host`, a node on each of `nodes` and a layer-less one (64 KiB
    of memory: off the ring, a relay at most) on each of `spares`; returns once it serves."""
    coord_cmd = coordinator_args(model, store_dir, "/ip4/0.0.0.0/tcp/4001", str(home / "coord.key"),
                                 min_nodes=len(nodes) + len(spares), http="127.0.0.1:8000")
    coord = ring.spawn("coord", coord_cmd, prefix=coord_host.prefix)
    addr = coord.wait_for(JOIN, 600).group(1)
    procs = [ring.spawn(h.name, node_args(addr, model, store_dir, memory if h in nodes else 1 << 16,
                                          ["--listen", "/ip4/0.0.0.0/tcp/0"]), prefix=h.prefix) for h in (*spares, *nodes)]
    wait_served(coord_host, "http://127.0.0.1:8000", model, 600)
    return coord, coord_cmd, procs[len(spares):]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="where to write the figures and their conditions")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--upload-mbit", type=float, default=20.0, help="tbf upload of every host and home router")
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    out: dict = {"conditions": {
        "model": args.model, "hosts": "a coordinator and 2-3 nodes per ring, one network namespace each on one "
        "bridge; homes behind a MASQUERADE router namespace (port-keeping, or --random-fully for the relayed ring)",
        "upload_mbit_each": args.upload_mbit, "latency": "none (netem unavailable)", "drafter": "none",
        "wire_dtype": "f32", "decode_tokens": args.tokens, "prompt": "196 tokens (SmolLM2's tokenizer), the same for every ring",
        "machine": "2 shared CPU cores, one torch thread a node; rings run one after another",
        "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "load_average_1min_at_start": os.getloadavg()[0]}}
    with tempfile.TemporaryDirectory() as tmp, Netbed() as bed:
        home = Path(tmp)
        coord_host = bed.add_public("coord", args.upload_mbit)
        hosts = [bed.add_public(f"n{i}", args.upload_mbit) for i in range(3)]
        relay_host = bed.add_public("relay", args.upload_mbit)
        punched = bed.add_home("r1", ["h1"], args.upload_mbit) + bed.add_home("r2", ["h2"], args.upload_mbit)
        relayed = bed.add_home("r3", ["h3"], args.upload_mbit, symmetric=True) + bed.add_home("r4", ["h4"],
                                                                                              args.upload_mbit)
        base = "http://127.0.0.1:8000"
        store_dir = str(default_store_dir(args.model))
        prepare(args.model, store_dir, progress=False)
        store = ModelStore.open(store_dir)
        memory = memory_for_stages(store, 2)  # each node holds about half the model: 2 stages
        # The relay's cost with no model in the way: a prefill chunk's activations (256
        # tokens, f32) from the symmetric-NAT host to the other home, through the relay.
        out["relayed_hop_vs_two_legs"] = hop_transfers(
            {"relay": coord_host, "sender": relayed[0], "dest": relayed[1]}, 256 * store.config.hidden_size * 4, home)
        print(json.dumps(out["relayed_hop_vs_two_legs"]), flush=True)
        out["relayed_hop_vs_two_legs_via_relay_node"] = hop_transfers(
            {"relay": relay_host, "sender": relayed[0], "dest": relayed[1]}, 256 * store.config.hidden_size * 4, home,
            relay_role="node_relay")
        print(json.dumps(out["relayed_hop_vs_two_legs_via_relay_node"]), flush=True)
        # The same relayed pair twice: through the gateway, then with a public spare that
        # formation makes their relay (the relay role), so the hop crosses a volunteer.
        for name, nodes, spares in (("hole_punched", punched, ()), ("relayed", relayed, ()),
                                    ("relayed_via_relay_node", relayed, (relay_host,))):
            (home / name).mkdir()
            ring = ProcRing(home / name)
            try:
                serve_ring(ring, coord_host, nodes, args.model, store_dir, home / name, memory, spares)
                out[name] = timed(coord_host, base, args.model, args.tokens)
            finally:
                ring.close()
        ring = ProcRing(home)
        try:
            # Three public nodes: a 2-stage ring and a spare to resume on.
            coord, coord_cmd, nodes = serve_ring(ring, coord_host, hosts, args.model, store_dir, home, memory)
            out["direct"] = timed(coord_host, base, args.model, args.tokens)

            before, roles_before = [layers(n)[-1:] for n in nodes], roles_of(coord_host, base)
            coord.kill9()
            t0 = time.monotonic()
            coord = ring.spawn("coord", coord_cmd, prefix=coord_host.prefix)
            first = wait_served(coord_host, base, args.model, 120)
            kill_to_first = time.monotonic() - t0
            time.sleep(2.0)  # roles are sent right after the ring forms
            out["coordinator_restart"] = {"kill_to_first_token_s": kill_to_first, "served_after_s": first,
                                          "same_layers_each_node": [layers(n)[-1:] for n in nodes] == before,
                                          "same_roles": roles_of(coord_host, base) == roles_before,
                                          "roles": roles_before,
                                          "includes": "coordinator process start (python, torch, tokenizer)"}

            tail = next(n for n in nodes if "succ coordinator" in n.text().rsplit("serving layers", 1)[-1])
            got = client(coord_host, base, args.model, args.tokens, kill_pid=tail.popen.pid, kill_after=4)
            after = [x for x in got["times"] if x > got["killed_at"]]
            out["node_death"] = {"kill_to_next_token_s": after[0] - got["killed_at"] if after else None,
                                 "tokens": len(got["times"]), "victim": "the ring's tail, kill -9 after 4 tokens"}
        finally:
            ring.close()
    out["conditions"]["load_average_1min_at_end"] = os.getloadavg()[0]
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
