"""Rings across the namespace test bed (tests/netbed.py), timed as a user sees them.

Real `shard-coord serve` and `shard-node join` processes, one per namespace, uploads shaped
with tbf. Measures, side by side in one run: time to first token and time per token of
a direct ring; the time from kill -9 of the coordinator (restarted with the same key and
listen address) to the first served token; the time from a stage's death (kill -9 of the
tail mid-stream) to the resumed request's next token. Relayed and hole-punched hops are
not measured: shard has no circuit relay yet (issue 19), and the JSON says so rather
than leaving them out. Needs root.

  sudo .venv/bin/python scripts/bench_internet.py --json docs/results/bench_internet.json
"""

from __future__ import annotations

import argparse
import json
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
url, model, max_tokens, kill_pid, kill_after = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
body = {"model": model, "prompt": "The history of the printing press", "max_tokens": max_tokens, "temperature": 0,
        "stream": True}
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


def client(host, base: str, model: str, max_tokens: int, kill_pid: int = 0, kill_after: int = 0) -> dict:
    got = subprocess.run([*host.prefix, sys.executable, "-c", CLIENT, base, model, str(max_tokens), str(kill_pid),
                          str(kill_after)], capture_output=True, text=True, timeout=600)
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="where to write the figures and their conditions")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--upload-mbit", type=float, default=20.0, help="tbf upload of every host")
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    out: dict = {"conditions": {
        "model": args.model, "hosts": "coordinator + 3 nodes, one network namespace each on one bridge",
        "upload_mbit_each": args.upload_mbit, "latency": "none (netem unavailable)", "drafter": "none",
        "wire_dtype": "f32", "decode_tokens": args.tokens, "machine": "2 shared CPU cores, one torch thread a node",
        "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()}}
    with tempfile.TemporaryDirectory() as tmp, Netbed() as bed:
        home = Path(tmp)
        coord_host = bed.add_public("coord", args.upload_mbit)
        hosts = [bed.add_public(f"n{i}", args.upload_mbit) for i in range(3)]
        ring = ProcRing(home)
        base = "http://127.0.0.1:8000"
        store_dir = str(default_store_dir(args.model))
        prepare(args.model, store_dir, progress=False)
        memory = memory_for_stages(ModelStore.open(store_dir), 2)
        coord_cmd = coordinator_args(args.model, store_dir, "/ip4/0.0.0.0/tcp/4001", str(home / "coord.key"),
                                     min_nodes=2, http="127.0.0.1:8000")
        try:
            coord = ring.spawn("coord", coord_cmd, prefix=coord_host.prefix)
            addr = coord.wait_for(JOIN, 600).group(1)
            # Each node can hold about half the model: a 2-stage ring and a spare to resume on.
            nodes = [ring.spawn(h.name, node_args(addr, args.model, store_dir, memory,
                                                  ["--listen", "/ip4/0.0.0.0/tcp/0"]), prefix=h.prefix) for h in hosts]
            wait_served(coord_host, base, args.model, 600)
            runs = [client(coord_host, base, args.model, args.tokens) for _ in range(3)]
            best = min(runs, key=lambda r: r["times"][-1])
            t = best["times"]
            ring_info = json.loads(subprocess.run([*coord_host.prefix, sys.executable, "-c", "import httpx, sys; "
                                                   "print(httpx.get(sys.argv[1] + '/v1/ring').text)", base],
                                                  capture_output=True, text=True, timeout=60).stdout)
            out["direct"] = {"ttft_s": t[0], "s_per_token": (t[-1] - t[0]) / max(len(t) - 1, 1), "tokens": len(t),
                             "stages": [m["layers"] for m in ring_info["members"]], "best_of": len(runs)}
            out["relayed"] = out["hole_punched"] = {"measured": False, "why": "no circuit relay / DCUtR in shard yet"}

            before = [layers(n)[-1:] for n in nodes]
            coord.kill9()
            t0 = time.monotonic()
            coord = ring.spawn("coord", coord_cmd, prefix=coord_host.prefix)
            first = wait_served(coord_host, base, args.model, 120)
            out["coordinator_restart"] = {"kill_to_first_token_s": time.monotonic() - t0, "served_after_s": first,
                                          "same_layers_each_node": [layers(n)[-1:] for n in nodes] == before,
                                          "includes": "coordinator process start (python, torch, tokenizer)"}

            tail = next(n for n in nodes if "succ coordinator" in n.text().rsplit("serving layers", 1)[-1])
            got = client(coord_host, base, args.model, args.tokens, kill_pid=tail.popen.pid, kill_after=4)
            after = [x for x in got["times"] if x > got["killed_at"]]
            out["node_death"] = {"kill_to_next_token_s": after[0] - got["killed_at"] if after else None,
                                 "tokens": len(got["times"]), "victim": "the ring's tail, kill -9 after 4 tokens"}
        finally:
            ring.close()
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
