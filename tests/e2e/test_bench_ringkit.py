"""The ring benchmarks' probe sees every frame through the RingObserver hooks, with no
patched methods: a 2-stage tiny ring, one greedy job.

Guards the benchmark kit against silently reporting nothing (a hook moved or no longer
called leaves empty hops and zero bytes, which a benchmark would print as figures). Sound:
every round the job sent must appear complete (sent, in and out of both stages, arrived),
and each edge's bytes must be counted.
"""

from __future__ import annotations

import pytest
import trio
from transformers import AutoTokenizer

from coordinator.jobs.engine_config import EngineConfig
from scripts.bench_ringkit import LinkSpec, open_bench_ring
from tests.e2e.ringkit import generate_greedy

pytestmark = pytest.mark.slow


def test_probe_sees_every_round_and_edge(tiny_llama_store):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_store.tokenizer_dir))
    config = EngineConfig(draft="none", prefill_chunk_tokens=8, prefill_edge_chunk_tokens=4)

    async def main():
        async with open_bench_ring(tiny_llama_store, tokenizer, 2, LinkSpec(), "bf16", config) as ring:
            await generate_greedy(ring.engine, list(range(1, 20)), 8)
            return ring

    ring = trio.run(main)
    probe = ring.probe
    (job_id,) = {job for job, _ in probe.sent_s}
    rows = probe.hops(job_id)
    assert ring.stages == 2
    assert len(rows) == len(probe.sent_s) >= 8  # prefill chunks and decode rounds, every one complete
    assert all(len(r["transport_s"]) == 3 and len(r["in_stage_s"]) == 2 and r["traversal_s"] > 0 for r in rows)
    assert [r["tokens"] for r in rows][-1] == 1  # a decode round carries one position
    assert sorted(probe.frame_sizes) == [0, 1, 2] and all(probe.frame_sizes[e] for e in range(3))
    assert probe.logits_s
