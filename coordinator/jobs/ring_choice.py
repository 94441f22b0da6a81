"""Which ring a new request goes to when the pool holds several, pure (issue 21).

Each ring is described by what the coordinator measures of it: whether it is ready, its
decode round time at the batch it runs, its prefill time per prompt token, how many jobs
it runs and at most batches, the requests already waiting for it and the tokens its
running jobs still owe. A request goes to the ready ring that predicts its earliest
completion: the wait for a place in the ring's batch (the tokens and the prompt tokens
still to prefill of the jobs ahead), its prefill, and its tokens at the ring's round time. Ties go to the lower ring id, so the choice is deterministic. Nothing
here forms rings or moves jobs: the swarm decides which rings exist (and a broken one is
reported not ready while it re-forms), the engine sends each job where this says.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RingLoad:
    """One ring as measured now. `round_s`: seconds per decode round with its current batch
    (one token per running job); `prefill_s_per_token`: a prompt token's share of a
    prefill traversal; `owed_tokens`: tokens its running and waiting jobs still have to make;
    `owed_prefill_tokens`: prompt tokens of theirs the ring has not prefilled yet."""

    ring_id: str
    ready: bool
    round_s: float
    prefill_s_per_token: float
    running: int
    max_batch: int
    waiting: int = 0
    owed_tokens: int = 0
    owed_prefill_tokens: int = 0


def predicted_completion_s(ring: RingLoad, prompt_tokens: int, max_tokens: int) -> float:
    """Seconds until a request of `prompt_tokens` + up to `max_tokens` would finish on `ring`.

    While the batch has room the request starts at once. Otherwise it waits for the tokens
    owed ahead of it to drain: the ring makes `max_batch` tokens a round, so that takes
    owed / max_batch rounds, and for the prompts ahead to prefill (at the measured cost per
    prompt token, not divided by the batch: a stage's prefill rows cost the same batched or
    alone on a CPU, and a long prompt ahead is what holds a ring up). Then its own prefill,
    then one token a round.
    """
    full = ring.running + ring.waiting >= ring.max_batch
    wait_rounds = ring.owed_tokens / max(ring.max_batch, 1) if full else 0.0
    wait_prefill = ring.owed_prefill_tokens if full else 0
    return ((wait_rounds + max_tokens) * ring.round_s
            + (wait_prefill + prompt_tokens) * ring.prefill_s_per_token)


def choose_ring(rings: Sequence[RingLoad], prompt_tokens: int, max_tokens: int) -> str | None:
    """The id of the ready ring predicting the earliest completion; None if none is ready."""
    ready = [r for r in rings if r.ready]
    if not ready:
        return None
    return min(ready, key=lambda r: (predicted_completion_s(r, prompt_tokens, max_tokens), r.ring_id)).ring_id
