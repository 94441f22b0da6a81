"""`shard-node join --fetch-weights` with the real CLI, one process each (issue 24).

Bugs guarded: the flag not reaching the node (it would prepare or fail on a missing
model), a node with an empty --store-dir refused or crashing at start-up (it has no layer
to time its compute on), its fetch not shown. Sound: the ring of three forms with the
empty node on it, its store dir ends with its slice's files and the one layer its speed
probe fetched to run on (issue 20) only, its log shows progress
with a rate and the fetch's end, GET /v1/ring lists that fetch with its prediction, and the
ring answers as the same ring of full nodes does before it.
"""

from __future__ import annotations

import re

import httpx

from shard.layers import LayerRange
from shard.manifest import MANIFEST_NAME, layer_file, slice_files
from tests.e2e.procring import JOIN, ProcRing, complete, coordinator_args, node_args, wait_ring
from tests.e2e.ringkit import memory_for_stages
from tests.e2e.test_restart_processes import free_loopback_port, members

PROMPT = [1, 50, 60, 70, 80, 90]
TOKENS = 8
NODE_ID = re.compile(r"node (\S+) joining coordinator")


def test_a_node_joining_with_fetch_weights_and_an_empty_store_serves_its_fetched_slice(tiny_llama, tiny_llama_store,
                                                                                      tmp_path):
    store, model = tiny_llama_store, str(tiny_llama.path)
    ring = ProcRing(tmp_path)
    base = f"http://127.0.0.1:{free_loopback_port()}"
    memory = memory_for_stages(store, 3)
    empty = tmp_path / "empty-store"
    coord = coordinator_args(model, str(store.root), "/ip4/127.0.0.1/tcp/0", str(tmp_path / "c.key"), min_nodes=3,
                             http=base.removeprefix("http://"))
    try:
        ring.spawn("coord", coord)
        addr = ring.procs[0].wait_for(JOIN, 120).group(1)
        for _ in range(2):
            ring.spawn("node", node_args(addr, model, str(store.root), memory))
        newcomer = ring.spawn("newcomer", node_args(addr, "no-such-model", str(empty), memory, ["--fetch-weights"]))
        info = wait_ring(base, 3, 180)
        text = complete(base, store.manifest.name, PROMPT, TOKENS)
        topology = httpx.get(f"{base}/v1/ring", timeout=10).json()["topology"]
    finally:
        ring.close()
    log = newcomer.text()
    peer = NODE_ID.search(log).group(1)
    layers = LayerRange(*members(info)[peer])
    on_disk = {p.relative_to(empty).as_posix() for p in empty.rglob("*") if p.is_file()}
    probed = layer_file(topology["speed_probes"]["measured"][peer]["layer"])
    assert on_disk == set(slice_files(layers)) | {probed, MANIFEST_NAME}, log[-3000:]
    assert re.search(r"fetched layers \[\d+, \d+\): \d+ files, [0-9.]+ MB in [0-9.]+ s \([0-9.]+ MB/s\)", log)
    (record,) = [f for f in topology["fetches"] if f["peer"] == peer and f["layers"] == [layers.start, layers.end]]
    assert record["bytes"] == sum(store.manifest.files[f].bytes for f in set(slice_files(layers)) - {probed})
    assert record["predicted_s"] is not None
    assert text  # served through the fetched slice; token-exactness is tests/e2e/test_weights_from_peers.py's
