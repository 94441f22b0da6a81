"""The auditor's kept frames of forked jobs' sources (coordinator.trust.source_frames).

Guards its bounds and what it keeps: a stage's records of a source's rounds are fetched
once per (stage, source, epoch, rounds) and then served kept; a fetch that came back short
(a record missing: the audit's finding) is not kept, nor one larger than the bound; past
`max_bytes` the least recently used goes first; a fetch's error passes through, keeping nothing.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import trio

from coordinator.trust.audit_plan import plan_audits
from coordinator.trust.source_frames import SourceFrames
from shard.errors import TransportError
from tests.coordinator.trust.test_audit_replay import finished_job


def _plan(job_id: str, peer: int = 0, rounds: int = 2):
    job = finished_job(2, {1: list(range(1, rounds + 1))}, {r: 1 for r in range(1, rounds + 1)})
    return dataclasses.replace(plan_audits(job, 1.0, random.Random(0))[peer], job_id=job_id)


def _fetcher(sizes: dict[str, int], calls: list, short: bool = False):
    async def fetch(plan):
        calls.append((plan.peer_id, plan.job_id))
        rounds = plan.rounds[:-1] if short else plan.rounds
        return {r: (b"i" * sizes[plan.job_id], b"o" * sizes[plan.job_id]) for r in rounds}
    return fetch


def test_a_source_is_fetched_once_a_stage_then_kept():
    kept, calls = SourceFrames(1 << 20), []
    fetch = _fetcher({"src": 100}, calls)
    first = trio.run(kept.records, _plan("src"), fetch)
    again = trio.run(kept.records, _plan("src"), fetch)
    other_stage = trio.run(kept.records, _plan("src", peer=1), fetch)
    assert first == again == other_stage and set(first) == {1, 2}
    assert calls == [("peer0", "src"), ("peer1", "src")] and (kept.fetches, kept.hits) == (2, 1)
    assert kept.held == 2 * 2 * 200 and len(kept) == 2


def test_short_or_oversized_fetches_are_not_kept_and_errors_pass_through():
    kept, calls = SourceFrames(1000), []
    trio.run(kept.records, _plan("src"), _fetcher({"src": 100}, calls, short=True))
    trio.run(kept.records, _plan("big"), _fetcher({"big": 300}, calls))  # 1200 bytes > 1000
    assert len(kept) == 0 and kept.held == 0

    async def gone(plan):
        raise TransportError("left")

    with pytest.raises(TransportError):
        trio.run(kept.records, _plan("src"), gone)
    assert len(kept) == 0


def test_past_the_bound_the_least_recently_used_goes_first():
    kept, calls = SourceFrames(1000), []
    fetch = _fetcher({"a": 100, "b": 100, "c": 100}, calls)  # 400 bytes each
    for job in ("a", "b", "a", "c"):  # a used again after b: b is the oldest when c comes
        trio.run(kept.records, _plan(job), fetch)
    assert calls == [("peer0", "a"), ("peer0", "b"), ("peer0", "c")] and kept.held == 800
    trio.run(kept.records, _plan("b"), fetch)
    assert calls[-1] == ("peer0", "b")  # fetched again: it had gone
