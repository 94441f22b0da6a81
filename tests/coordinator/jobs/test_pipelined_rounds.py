"""Rounds sent ahead (`RingJob._send_ahead`): how long a chain each carries.

Guards a bug measured on the WAN benchmark (2e4ee68): a round sent ahead was capped at
the length of the round before it, so a quote whose first round drafted a short chain
(a short match, or little room) kept every following round short while the pipeline
stayed full (one quoting prompt took 18 traversals pipelined against 8 unpipelined).
Each round sent ahead must be sized like a fresh round on its own evidence.
The job runs against a fake port that only records what it was asked to send: the
sizing is a pure choice of the job, not of the ring.
"""

from __future__ import annotations

import time

import trio

from coordinator.spec import adapt
from coordinator.spec.adapt import AcceptanceStats, AdaptState, TraversalFit
from coordinator.spec.draft_round import draft_ahead
from coordinator.spec.draft_tree import DraftTree
from coordinator.spec.drafting import DraftBudget, NgramDrafter
from coordinator.jobs.engine_config import EngineConfig
from coordinator.jobs.ring_job import RingJob
from coordinator.spec.sampling import SamplingParams
from coordinator.spec.source import DraftSource
from coordinator.swarm.swarm import RingState

QUOTE = list(range(100, 140))
PROMPT = [1, 2, *QUOTE, 3, *QUOTE[:4]]  # ends inside a second copy of the quote


class RecordingPort:
    """The one verb of the job's port (coordinator.jobs.port) `_send_ahead` uses: a send."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    async def send_body(self, ring: RingState, body: bytes, sent=None) -> None:
        self.sent.append(body)


def latency_bound_state(rates: dict[DraftSource, float]) -> AdaptState:
    """A WAN-like ring (200 ms a traversal, 1 ms a row, 5 ms of queue per round ahead)
    with the given per-source acceptance: long chains and deep pipelines pay."""
    n, var, fixed_s, per_row_s = 5.0, 4.0, 0.2, 0.001
    t = fixed_s + per_row_s * n
    return AdaptState(acceptance={k: AcceptanceStats(r * 10, 10.0) for k, r in rates.items()},
                      traversal=TraversalFit(n=n, t=t, nn=n * n + var, nt=n * t + per_row_s * var),
                      rounds=50, queue_s=0.005)


def send_ahead(state: AdaptState, base: DraftTree, committed: list[int] = PROMPT, depth: int = 4) -> RingJob:
    """A job with `committed` context whose awaited round is `base`, after `_send_ahead`."""
    port = RecordingPort()
    _, inbox = trio.open_memory_channel(1)
    config = EngineConfig(draft="ngram", max_pipeline_depth=depth)
    job = RingJob(port, "job", list(committed), SamplingParams(temperature=0.0), inbox, config,
                  head=None, max_context_tokens=4096, drafters=[NgramDrafter()], adapt=state)
    job.committed, job.ring_epoch = list(committed), 1
    ring = RingState(epoch=1, stages=(), assignments=())
    trio.run(job._send_ahead, ring, base, len(committed) - 1, 4096, time.monotonic())
    assert len(port.sent) == len(job.ahead)  # every round recorded was sent
    return job


def test_a_round_sent_ahead_is_as_long_as_its_own_evidence_asks():
    state = latency_bound_state({DraftSource("ngram"): 0.95, DraftSource("ngram", "4"): 0.95})
    chains = adapt.AdaptConfig(max_pipeline_depth=4, kinds=(adapt.DraftKind.CHAIN,))
    wanted = adapt.plan(state, chains, source=DraftSource("ngram", "4"))
    # Sound only if the planner itself wants long, pipelined chains on this evidence.
    assert wanted.nodes >= 8 and wanted.pipeline_depth >= 2, wanted
    base = DraftTree.chain(QUOTE[4:6], source=DraftSource("ngram", "4"))  # the awaited round: 2 drafts
    job = send_ahead(state, base)
    assert job.ahead, "nothing was sent ahead"
    first = job.ahead[0]
    # The guess continues the quote: bonus QUOTE[6], then as many drafts as planned.
    assert first.root_token == QUOTE[6]
    assert first.tree.tokens.tolist() == QUOTE[7:7 + wanted.nodes]
    assert first.root == len(PROMPT) - 1 + 1 + base.num_nodes
    for before, after in zip(job.ahead, list(job.ahead)[1:]):  # each builds on the last
        assert after.root == before.root + 1 + before.tree.num_nodes


def test_evidence_whose_record_says_no_draft_pays_sends_nothing_ahead():
    # The awaited round's evidence pipelines, but the guess for the next round comes from
    # evidence measured as always wrong: a round carrying it would be discarded.
    state = latency_bound_state({DraftSource("ngram"): 0.95, DraftSource("ngram", "4"): 0.95, DraftSource("ngram", "1"): 0.0})
    chains = adapt.AdaptConfig(max_pipeline_depth=4, kinds=(adapt.DraftKind.CHAIN,))
    assert adapt.plan(state, chains, source=DraftSource("ngram", "1")).nodes == 0
    committed = [1, 2, 77, 5, 6, 8]
    # The assumed context ends 9, 77: only the 1-token match 77 -> 5 6 8 ... is found.
    assert NgramDrafter().propose([*committed, 9, 77], DraftBudget.chain(3)).source == DraftSource("ngram", "1")
    job = send_ahead(state, DraftTree.chain([9, 77], source=DraftSource("ngram", "4")), committed)
    assert not job.ahead and not job.port.sent


def test_a_round_sent_ahead_fits_the_context_left():
    # The guess never drafts past the context limit: `room` nodes below its root at
    # most, and nothing at all without room.
    state = latency_bound_state({DraftSource("ngram"): 0.95, DraftSource("ngram", "4"): 0.95})
    assumed = [*PROMPT, *QUOTE[4:6]]
    root, chain = draft_ahead(NgramDrafter(), assumed, state, room=3, max_pipeline_depth=4)
    assert (root, chain.tokens.tolist()) == (QUOTE[6], QUOTE[7:10])
    assert draft_ahead(NgramDrafter(), assumed, state, room=0, max_pipeline_depth=4) is None
