"""A node's sessions with its coordinator (shard.reconnect): what is retried, and how often.

Bug guarded: losing the coordinator's control stream ended every node (kill -9 of the
coordinator ended all nodes within 0.2 s), and what ended them surfaced as a 72-line
ExceptionGroup traceback. Sound: sessions are scripted fakes on trio's mock clock, so
each backoff is read exactly.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from shard.errors import StreamClosedError
from shard.reconnect import ReconnectPolicy, RegistrationRefused, connection_lost, serve_reconnecting


def test_the_backoff_doubles_to_its_cap():
    policy = ReconnectPolicy(first_s=0.5, max_s=5.0)
    assert [policy.delay_s(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]


def test_a_lost_connection_inside_a_nursery_group_is_recognised():
    lost = StreamClosedError("peer", "closed", 0, 4)
    assert connection_lost(ExceptionGroup("nursery", [lost])) is lost
    assert connection_lost(ExceptionGroup("nursery", [lost, ValueError("bug")])) is None


def test_sessions_are_retried_after_backoffs_and_registering_resets_them():
    starts: list[float] = []

    async def session(registered) -> None:
        starts.append(trio.current_time())
        if len(starts) == 3:
            registered()  # this one got in, then lost the coordinator too
        if len(starts) < 5:
            async with trio.open_nursery():  # as a node's session fails: inside its nursery
                raise StreamClosedError("coordinator", "reset", 0, 4)

    async def main():
        await serve_reconnecting(session, ReconnectPolicy(first_s=1.0, max_s=8.0))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps == pytest.approx([1.0, 2.0, 1.0, 2.0])


def test_a_refusal_ends_the_node_bare_so_the_cli_prints_one_line():
    async def session(registered) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            raise RegistrationRefused("model_mismatch", "rejoin with --model tiny")

    with pytest.raises(RegistrationRefused) as caught:
        trio.run(serve_reconnecting, session)
    assert str(caught.value) == "the coordinator refused this node: rejoin with --model tiny"
