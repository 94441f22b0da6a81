"""The receipts route: GET /v1/receipts/{id} serves the engine's bundle and 404s otherwise.

(Audit planning and batched replay are tested in test_audit_replay.py.)
"""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
import trio

from coordinator.gateway.api import create_app


class _Engine(SimpleNamespace):
    """The two things the route reads: model facts for the app, and bundle(job_id)."""

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


def test_recent_bundles_are_bounded_by_bytes_as_well_as_count(tiny_llama_store):
    # Bug guarded: 1024 bundles kept in memory whatever their size (a 160-round job's is
    # ~220 KB: 1000 such bundles held 543 MB of the gateway's RSS). Sound: the kept bytes
    # are counted from what is stored (compressed), and what comes back equals what was kept.
    import random

    from coordinator.trust.receipt_check import ReceiptChecker, ReceiptConfig

    def bundle(i: int, rounds: int) -> dict:  # receipts as random as signatures and digests are
        rng = random.Random(i)
        return {"job_id": f"j{i}", "rounds": [{"round": r, "receipts": [rng.randbytes(300).hex() for _ in range(3)]}
                                              for r in range(rounds)]}

    checker = ReceiptChecker(tiny_llama_store, bytes(32), ReceiptConfig(recent_bundles=1000, recent_bundles_mb=1))
    for i in range(20):
        checker._keep(f"j{i}", bundle(i, 100))  # ~180 KB each as compact JSON, ~107 KB compressed
    kept = [f"j{i}" for i in range(20) if checker.bundle(f"j{i}") is not None]
    assert kept == [f"j{i}" for i in range(11, 20)]  # the newest nine, within 1 MiB
    assert checker._recent_bytes == sum(len(t) for t in checker._recent.values()) <= 1 << 20
    assert checker.bundle("j19") == bundle(19, 100)
    checker._keep("huge", bundle(99, 2000))  # alone past the bound: the newest is still kept
    assert list(checker._recent) == ["huge"] and checker.bundle("huge") == bundle(99, 2000)
    counted = ReceiptChecker(tiny_llama_store, bytes(32), ReceiptConfig(recent_bundles=3))
    for i in range(5):
        counted._keep(f"j{i}", bundle(i, 1))
    assert list(counted._recent) == ["j2", "j3", "j4"]
    with pytest.raises(ValueError, match="recent bundles must be >= 0 MB"):
        ReceiptConfig(recent_bundles_mb=-1)
