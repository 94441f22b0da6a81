"""A ring job's counters, folded from its round events in one place.

`apply(event, stats) -> stats` is the only code that changes a count: a job reports what
happened (a round committed, a round sent ahead, rounds discarded, a resume, drafters not
asked) and reads `JobStats` back. `figures` is the one home of the names a response's
`shard` object and the benchmarks read them by. This module does not know the ring,
frames, drafters or time: events carry the figures they count.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from coordinator.spec import adapt


@dataclass(frozen=True)
class RoundCommitted:
    """A traversal's result was accepted and its tokens committed."""

    family: str | None  # the drafter family of its draft ("ngram", "eagle", "merged"); None: no draft
    tokens: int  # tokens it committed (accepted path and bonus, clipped to the context)
    pipelined: bool  # it was sent ahead, before the round it built on was verified
    since_start_s: float  # seconds from the job's start to this commit
    traversal_s: float = 0.0  # the round's own traversal: its send to its result


@dataclass(frozen=True)
class RoundSentAhead:
    in_flight: int  # rounds of the job in the ring once it was sent, the awaited one included


@dataclass(frozen=True)
class RoundsDiscarded:
    rounds: int  # rounds sent ahead on an assumption that failed (their results ignored)


@dataclass(frozen=True)
class Resumed:
    """The job started over on a new ring after it had traversed one."""


@dataclass(frozen=True)
class DrafterSkipped:
    names: tuple[str, ...]  # drafters not asked this round: they could not pay for it


Event = RoundCommitted | RoundSentAhead | RoundsDiscarded | Resumed | DrafterSkipped


@dataclass(frozen=True)
class JobStats:
    traversals: int = 0  # rounds whose result came back and was committed
    resumes: int = 0
    ttft_s: float | None = None  # the first commit, which the prefill's traversal makes
    undrafted_rounds: int = 0  # rounds since the last one that carried a draft
    drafted: Mapping[str, int] = field(default_factory=dict)  # rounds per drafter family
    drafted_tokens: Mapping[str, int] = field(default_factory=dict)  # tokens those rounds committed
    skipped: Mapping[str, int] = field(default_factory=dict)  # rounds a drafter was not asked
    pipelined: int = 0  # traversals whose round was sent ahead and turned out valid
    most_in_flight: int = 1  # the most rounds this job had in the ring at once
    discarded: int = 0  # rounds sent ahead on an assumption that failed
    traversal_s: Mapping[str, float] = field(default_factory=dict)  # committed rounds' seconds; "none": undrafted


def _counted(counts: Mapping[str, float], keys: Iterable[str], by: float = 1) -> dict[str, float]:
    out = dict(counts)
    for key in keys:
        out[key] = out.get(key, 0) + by
    return out


def apply(event: Event, stats: JobStats) -> JobStats:
    """Fold one event into the counters; returns new counters."""
    if isinstance(event, RoundCommitted):
        drafted = event.family is not None
        return replace(
            stats, traversals=stats.traversals + 1, pipelined=stats.pipelined + event.pipelined,
            ttft_s=event.since_start_s if stats.ttft_s is None else stats.ttft_s,
            undrafted_rounds=0 if drafted else stats.undrafted_rounds + 1,
            drafted=_counted(stats.drafted, [event.family] if drafted else []),
            drafted_tokens=_counted(stats.drafted_tokens, [event.family] if drafted else [], event.tokens),
            traversal_s=_counted(stats.traversal_s, [event.family or "none"], event.traversal_s))
    if isinstance(event, RoundSentAhead):
        return replace(stats, most_in_flight=max(stats.most_in_flight, event.in_flight))
    if isinstance(event, RoundsDiscarded):
        return replace(stats, discarded=stats.discarded + event.rounds)
    if isinstance(event, Resumed):
        return replace(stats, resumes=stats.resumes + 1)
    if isinstance(event, DrafterSkipped):
        return replace(stats, skipped=_counted(stats.skipped, event.names))
    raise TypeError(f"not a job event: {event!r}")


def figures(stats: JobStats, *, generated: int, ring_epoch: int, drafter: str, planner: adapt.AdaptState,
            job_id: str) -> dict[str, Any]:
    """The job's figures as JSON-safe values (coordinator.jobs.engine.Job.stats)."""
    # The first traversal (prefill) commits the first token, so tokens per traversal is
    # generated / traversals; plain decoding gives exactly 1.0.
    return {"traversals": stats.traversals,
            "tokens_per_traversal": generated / stats.traversals if stats.traversals else 0.0,
            "ring_epoch": ring_epoch, "ttft_s": stats.ttft_s, "resumes": stats.resumes,
            "drafter": drafter, "draft_rounds": dict(stats.drafted),
            "draft_round_tokens": dict(stats.drafted_tokens), "drafter_skipped_rounds": dict(stats.skipped),
            "traversal_s_by_drafter": dict(stats.traversal_s),
            "pipelined_rounds": stats.pipelined, "most_rounds_in_flight": stats.most_in_flight,
            "pipelined_rounds_discarded": stats.discarded, "planner": planner_figures(planner), "job_id": job_id}


def planner_figures(state: adapt.AdaptState) -> dict[str, float | None]:
    """What the planner measured of the ring (ms): a traversal's fixed part and cost per
    row, and the queue one round in flight makes for another (None: unmeasured)."""
    fixed_s, per_row_s = adapt.traversal_line(state) if state.traversal else (None, None)
    return {name: None if v is None else round(v * 1e3, 2) for name, v in (
        ("traversal_fixed_ms", fixed_s), ("traversal_per_row_ms", per_row_s), ("queue_ms", state.queue_s))}
