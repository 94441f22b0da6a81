"""Chunked prefill over a real in-process ring: the chunk plan changes time, never tokens.

Guards the engine's use of coordinator.jobs.prefill: a ramped plan (small first and last
chunks) must feed every prompt token exactly once at its position, so greedy output
equals that of fixed-size chunks and of one blob. The frame count of the prefill
traversal proves each plan really was sent as planned (a plan silently ignored would
pass the output check trivially)."""

from __future__ import annotations

import dataclasses

import trio

from coordinator.jobs.prefill import prefill_chunks
from coordinator.jobs.ring_engine import EngineConfig
from tests.e2e.ringkit import generate_greedy, open_local_ring

PROMPT = [1] + [3 + (7 * i) % 250 for i in range(99)]  # 100 tokens
NEW_TOKENS = 8
PLANS = {"ramp": (16, 2), "fixed": (16, 16), "blob": (len(PROMPT), len(PROMPT))}  # (largest, edge)


def test_ramped_fixed_and_one_blob_prefill_give_the_same_greedy_tokens(tiny_llama_store):
    async def main():
        async with open_local_ring(tiny_llama_store, 3, engine=EngineConfig(draft="none")) as ring:
            engine = ring.engine
            frames: list[int] = []
            record = engine.swarm.record_traversal

            def counting(traversal):
                frames.append(traversal.frames)
                record(traversal)

            engine.swarm.record_traversal = counting
            out = {}
            for name, (largest, edge) in PLANS.items():
                engine.config = dataclasses.replace(engine.config, prefill_chunk_tokens=largest,
                                                    prefill_edge_chunk_tokens=edge)
                frames.clear()
                out[name] = await generate_greedy(engine, PROMPT, NEW_TOKENS)
                assert frames[0] == len(prefill_chunks(0, len(PROMPT), largest, edge)), (name, frames)
            return out

    out = trio.run(main)
    assert len(prefill_chunks(0, len(PROMPT), *PLANS["ramp"])) == 11  # 2, 4, 8, 5 x 14-15, 8, 4, 2
    assert out["ramp"] == out["fixed"] == out["blob"], out
    assert len(out["blob"]) == NEW_TOKENS
