"""Bursts on a real ring: a group of jobs stays together hop after hop (issue 21).

Bugs guarded: a stage's outputs of one forward (or the gateway's next frames of one head
product) reaching the next hop a moment apart and splitting into several forwards, the
first alone (2.1-2.5 frames per forward at 16 streams before bursts); a burst changing
what any job computes. Sound: the same eight greedy decode jobs run together on a 3-stage
in-process ring with burst waits (50 ms bound: a group's frames land well within it, only
a job that ended costs the wait) and without (0: a frame never waits); the stages' frames
per forward over the concurrent phase must be larger with bursts, and every output must
equal the same request served alone.
"""

from __future__ import annotations

import httpx
import pytest
import trio

from coordinator.gateway.api import ApiConfig, create_app, serve_http
from coordinator.jobs.engine_config import EngineConfig
from tests.e2e.ringkit import open_local_ring

pytestmark = pytest.mark.slow

JOBS = 8


def requests() -> list[dict]:
    return [{"model": "tiny", "prompt": [3 + (11 * i + 5 * j) % 250 for j in range(6)], "max_tokens": 24,
             "temperature": 0} for i in range(JOBS)]


async def ask(client: httpx.AsyncClient, body: dict) -> str:
    r = await client.post("/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def serve_together(store, wait_ms: float) -> tuple[list[str], list[str], list[float], int]:
    """(outputs alone, outputs together, each stage's frames per forward together, the
    stages' burst waits)."""
    async def main():
        async with open_local_ring(store, 3, engine=EngineConfig(draft="none", burst_wait_ms=wait_ms),
                                   node_config={"burst_wait_ms": wait_ms}) as ring:
            ring.engine.model_id = "tiny"
            async with trio.open_nursery() as nursery:
                port = await nursery.start(serve_http, create_app(ring.engine, ApiConfig(max_concurrent_jobs=16)),
                                           "127.0.0.1", 0)
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                    with trio.fail_after(300):
                        alone = [await ask(client, body) for body in requests()]
                        before = [(n.scheduler.forwards, n.scheduler.frames_run) for n in ring.nodes]
                        together: list = [None] * JOBS

                        async def one(i, body):
                            together[i] = await ask(client, body)

                        async with trio.open_nursery() as clients:
                            for i, body in enumerate(requests()):
                                clients.start_soon(one, i, body)
                after = [(n.scheduler.forwards, n.scheduler.frames_run) for n in ring.nodes]
                waits = sum(n.scheduler.tally.waits for n in ring.nodes)
                nursery.cancel_scope.cancel()
        per_forward = [(f1 - f0) / max(b1 - b0, 1) for (b0, f0), (b1, f1) in zip(before, after)]
        return alone, together, per_forward, waits

    return trio.run(main)


def test_bursts_keep_a_group_in_one_forward_and_change_no_output(tiny_llama_store):
    alone, together, bursts, waits = serve_together(tiny_llama_store, 50.0)
    _, together_nowait, nowait, no_waits = serve_together(tiny_llama_store, 0.0)
    print(f"frames per forward: bursts {bursts} ({waits} waits), no waits {nowait}")
    assert together == alone and together_nowait == alone
    assert no_waits == 0
    assert min(bursts) > max(nowait), (bursts, nowait)
