"""Coordinator receipts pieces that need no ring: audit planning, batched replay, the route.

Guards: plan_audits replays from the first frame of the epoch up to the last selected
round (KV state needs every earlier frame) and selects nothing at rate 0; the batched
replay the auditor uses equals frame-by-frame stage processing (else honest stages would
be accused); GET /v1/receipts/{id} serves the engine's bundle and 404s otherwise.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import httpx
import torch
import trio

from coordinator.api import create_app
from coordinator.audit import _batches, plan_audits, replay
from coordinator.receipt_check import EpochView, FinishedJob, VerifiedRound
from coordinator.swarm import RingState
from shard.layers import LayerRange
from shard.stage import Stage
from shard.stage_worker import StageWorker, WorkerConfig
from shard.wire.messages import Forward


def _job(rate_rounds=(1, 2, 3, 4)):
    stages = (("a", LayerRange(0, 2)), ("b", LayerRange(2, 5)))
    ring = RingState(7, stages, (SimpleNamespace(wire_dtype="bf16"), SimpleNamespace(wire_dtype="bf16")))
    view = EpochView(ring, {}, (), {})
    verified = {r: VerifiedRound(7, [f"ra{r}", f"rb{r}"]) for r in rate_rounds}
    return FinishedJob("job", {7: [1, 2, 3, 4]}, verified, {7: view})


def test_plan_audits_replays_from_the_first_frame_to_the_last_pick():
    assert plan_audits(_job(), 0.0, random.Random(0)) == []
    plans = plan_audits(_job(), 1.0, random.Random(0))
    assert [(p.peer_id, p.rounds, p.is_tail, p.wire_dtype) for p in plans] == [
        ("a", (1, 2, 3, 4), False, "bf16"), ("b", (1, 2, 3, 4), True, "bf16")]
    assert plans[1].receipts == {r: f"rb{r}" for r in (1, 2, 3, 4)}
    # Round 3 never verified: still replayed (it wrote KV) but has no receipt to compare.
    [plan, _] = plan_audits(_job(rate_rounds=(1, 2, 4)), 1.0, random.Random(0))
    assert plan.rounds == (1, 2, 3, 4) and set(plan.receipts) == {1, 2, 4}


def _frames(cfg, n_decode=4):
    torch.manual_seed(0)
    h = torch.randn(6 + n_decode, cfg.hidden_size)
    frames = [Forward(job_id="j", epoch=1, round=1, nonce=b"n" * 16, phase="prefill", ctx_len=0,
                      positions=torch.arange(6), hidden=h[:6])]
    for i in range(n_decode):
        frames.append(Forward(job_id="j", epoch=1, round=2 + i, nonce=b"n" * 16, phase="decode", ctx_len=6 + i,
                              positions=torch.tensor([6 + i]), hidden=h[6 + i:7 + i]))
    return frames


def test_batched_replay_equals_frame_by_frame(tiny_llama_store):
    store = tiny_llama_store
    r = LayerRange(1, 3)
    stage = Stage(store.config, r, store.load_layers(r))
    frames = _frames(store.config)
    assert _batches(frames) == [[0, 1, 2, 3, 4]]  # plain, contiguous: one forward
    worker = StageWorker(stage, WorkerConfig(wire_dtype="f32"))
    sequential = [worker.process(f).hidden for f in frames]
    for (got, _), want in zip(replay(stage, "f32", frames), sequential):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # A gap in slots (a rollback) starts a new batch.
    moved = frames[:3] + [Forward(**{**frames[3].__dict__, "ctx_len": 7, "positions": torch.tensor([7])})]
    assert _batches(moved) == [[0, 1, 2], [3]]


class _Engine(SimpleNamespace):
    def info(self):
        return {"ready": True}


def test_receipts_route_serves_bundles_and_404s(tiny_tokenizer):
    engine = _Engine(model_id="m", tokenizer=tiny_tokenizer, max_context_tokens=64, eos_token_ids=frozenset({2}),
                     bundle=lambda job_id: {"job_id": job_id} if job_id == "known" else None)

    async def main():
        app = create_app(engine)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.get("/v1/receipts/known"), await client.get("/v1/receipts/other")

    ok, missing = trio.run(main)
    assert ok.status_code == 200 and ok.json() == {"job_id": "known"}
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "receipts_not_found"
