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

    from coordinator.trust.receipt_check import ReceiptChecker, ReceiptConfig, packed

    def bundle(i: int, rounds: int) -> dict:  # receipts as random as signatures and digests are
        rng = random.Random(i)
        return {"job_id": f"j{i}", "rounds": [{"round": r, "receipts": [rng.randbytes(300).hex() for _ in range(3)]}
                                              for r in range(rounds)]}

    checker = ReceiptChecker(tiny_llama_store, bytes(32), ReceiptConfig(recent_bundles=1000, recent_bundles_mb=1))
    for i in range(20):
        checker._keep(f"j{i}", packed(bundle(i, 100)))  # ~180 KB each as compact JSON, ~107 KB compressed
    kept = [f"j{i}" for i in range(20) if checker.bundle(f"j{i}") is not None]
    assert kept == [f"j{i}" for i in range(11, 20)]  # the newest nine, within 1 MiB
    assert checker._recent_bytes == sum(len(t) for t in checker._recent.values()) <= 1 << 20
    assert checker.bundle("j19") == bundle(19, 100)
    checker._keep("huge", packed(bundle(99, 2000)))  # alone past the bound: the newest is still kept
    assert list(checker._recent) == ["huge"] and checker.bundle("huge") == bundle(99, 2000)
    counted = ReceiptChecker(tiny_llama_store, bytes(32), ReceiptConfig(recent_bundles=3))
    for i in range(5):
        counted._keep(f"j{i}", packed(bundle(i, 1)))
    assert list(counted._recent) == ["j2", "j3", "j4"]
    with pytest.raises(ValueError, match="recent bundles must be >= 0 MB"):
        ReceiptConfig(recent_bundles_mb=-1)


def test_a_store_that_refuses_a_bundle_loses_neither_the_bundle_nor_the_audit(tiny_llama_store, tmp_path, caplog):
    # The bundle is now signed, packed and stored in a worker thread (issue 21: ~4 ms a
    # 192-round job, plus fsyncs, on the gateway's trio thread at every job's end). Bug
    # guarded on the way: a store that refused (a full disk, a directory gone) raised out
    # of the job's close, so the job was never handed to the auditor (its stages kept its
    # frames for nothing). Sound: the store is the real one, its directory removed under it.
    import logging
    import shutil

    from coordinator.trust.receipt_check import ReceiptChecker, ReceiptConfig
    from receipts import RoundRecord
    from tests.coordinator.trust.test_audit_replay import finished_job

    caplog.set_level(logging.WARNING, logger="shard.coordinator")
    finished_in, finished = trio.open_memory_channel(1)
    checker = ReceiptChecker(tiny_llama_store, bytes(32), ReceiptConfig(receipts_dir=str(tmp_path / "bundles")),
                             finished=finished_in)
    shutil.rmtree(tmp_path / "bundles")
    ran = finished_job(3, {1: [1]}, {1: 1})
    job = checker.open_job("job", bytes(16), [1, 2, 3])
    job._order, job._epochs = {1: [1]}, dict(ran.epochs)
    job._rounds = {1: RoundRecord(1, 1, bytes(32), bytes(32), ())}
    job._verified = dict(ran.verified)
    trio.run(job.finish, [7])
    assert finished.receive_nowait().job_id == "job"  # audited all the same
    assert checker.bundle("job")["job_id"] == "job"  # and its bundle kept in memory
    assert any("receipt bundle not stored" in r.getMessage() for r in caplog.records)
