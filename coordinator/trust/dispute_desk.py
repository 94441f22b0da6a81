"""The gateway's one book of disputes among newcomers, kept for probation's round checks
(coordinator.trust.round_verifier) and for audits after a job (coordinator.trust.audit).

Where a disagreement rests on a newcomer's word alone (coordinator.trust.disputes.lone_word:
no trusted verifier took part, no two parties agree against one), nobody is marked faulty
on it: each disagreeing pair is recorded, both sit out of rings for a while
(coordinator.swarm.unreachable, kind "disputed"), and once the book names a liar (in
dispute with two distinct partners who disputed with nobody else) it is marked faulty and
its partners may join rings again. One book for both checks: a liar that disputes once in
a probation check and once as an audit's verifier has met two partners.

The thin I/O around the pure book (coordinator.trust.disputes); the caller decides what a
dispute means for its round or audit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio

from coordinator.trust import disputes
from ring import PeerId


class DisputeDesk:
    def __init__(self, swarm: Any) -> None:
        """`swarm`: coordinator.swarm.Swarm (report_unreachable, mark_faulty, readmit)."""
        self.swarm = swarm
        self.book: disputes.Book = ()

    def dispute(self, parties: Sequence[PeerId], ids: Sequence[int], what: str) -> set[PeerId]:
        """Record each pair of `parties` whose opinion `ids` differ over `what`; both sit out.
        Returns the liars the book names now (marked faulty, their partners readmitted)."""
        now_s, found = trio.current_time(), set()
        for i, j in disputes.disputing(ids):
            self.book = disputes.record(self.book, parties[i], parties[j], now_s, what)
            for p, q in ((parties[i], parties[j]), (parties[j], parties[i])):
                self.swarm.report_unreachable(p, f"disputed with {q[-6:]} over {what}", "disputed")
        for liar in disputes.liars(self.book):
            cleared = disputes.partners(self.book, liar)
            self.book = disputes.settled(self.book, liar)
            self.swarm.mark_faulty(liar, f"in dispute with {', '.join(sorted(q[-6:] for q in cleared))}, who "
                                         f"disputed with nobody else (the last over {what})")
            self.swarm.readmit(cleared, "disputed")
            found.add(liar)
        return found

    def open(self) -> list[dict]:
        """For /v1/ring: each dispute still counting, oldest first."""
        return disputes.open_disputes(self.book, trio.current_time())
