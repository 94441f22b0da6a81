"""The frames attack of bench_hostile_ring.py, run as a process of its own.

Sends `--frames` of scripts.bench_hostile's mutated frames at ring epoch `--epoch` into the
stage `--target` (at `--addr`) from a host holding `--key` (its predecessor's own identity
file, so the stage takes them for its predecessor's), on one ring stream (a stream the
stage resets is replaced), then `--stranger-frames` valid frames from fresh identities,
each on its own stream, 100 streams per identity. Prints one JSON object: the frames sent
by kind, streams reset, seconds, strangers' frames refused, and this process' RSS.

Its own process so that what the attackers allocate (their hosts, 100k encoded frames)
is not counted as the coordinator's RSS, which bench_hostile_ring.py measures in its own.

    python scripts/bench_hostile_frames.py --key K --addr A --target P --epoch E [--frames N] [--stranger-frames M] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import trio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_hostile import MODEL, expect_refused, forward, hostile_frame, rss_mb  # noqa: E402
from shard.errors import TransportError  # noqa: E402
from shard.identity import keypair_from_seed, load_or_create_identity  # noqa: E402
from shard.node import RING_PROTOCOL  # noqa: E402
from shard.store import open_or_prepare  # noqa: E402
from shard.transport import open_host  # noqa: E402
from shard.wire.codec import encode  # noqa: E402


async def attack(args) -> dict:
    store = await trio.to_thread.run_sync(lambda: open_or_prepare(MODEL, None, progress=False))
    rng, kinds, resets = random.Random(args.seed), {}, 0
    t0 = time.perf_counter()
    async with open_host(load_or_create_identity(args.key), "/ip4/127.0.0.1/tcp/0") as host:
        await host.connect(args.addr)
        stream = await host.open_stream(args.target, RING_PROTOCOL)
        for i in range(args.frames):
            kind, body = hostile_frame(rng, i, store.config, epoch=args.epoch)
            kinds[kind] = kinds.get(kind, 0) + 1
            try:
                await stream.send_frame(body)
            except TransportError:  # the node reset the stream (a frame it refused whole): open another
                resets += 1
                stream = await host.open_stream(args.target, RING_PROTOCOL)
    predecessor_s = time.perf_counter() - t0
    refused = 0
    for block in range(0, args.stranger_frames, 100):  # 100 streams per stranger identity
        async with open_host(keypair_from_seed(os.urandom(32)), "/ip4/127.0.0.1/tcp/0") as stranger:
            await stranger.connect(args.addr)
            for i in range(block, min(block + 100, args.stranger_frames)):
                refused += await expect_refused(lambda: stranger.open_stream(args.target, RING_PROTOCOL),  # noqa: B023
                                                encode(forward(f"s{i}", [1, 2, 3], epoch=args.epoch)))
    return {"kinds": kinds, "predecessor_streams_reset": resets, "predecessor_s": round(predecessor_s, 1),
            "stranger_frames": args.stranger_frames, "stranger_frames_refused": refused,
            "attacker_rss_mb": round(rss_mb(os.getpid()), 1)}


def main() -> None:
    import logging

    logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # refused streams are the point, not news
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--key", required=True, help="the predecessor's identity key file")
    p.add_argument("--addr", required=True, help="the target stage's listen multiaddr")
    p.add_argument("--target", required=True, help="the target stage's peer id")
    p.add_argument("--epoch", type=int, required=True, help="the ring's epoch")
    p.add_argument("--frames", type=int, default=10_000)
    p.add_argument("--stranger-frames", type=int, default=1_000)
    p.add_argument("--seed", type=int, default=0)
    print(json.dumps(trio.run(attack, p.parse_args())))


if __name__ == "__main__":
    main()
