"""A node's session that ends on a bug is started again, a bounded number of times (issue 20).

Bugs guarded: an exception out of a node's session that is no lost connection (a
negative trio timeout in the scheduler's burst wait, 4c6d32a) ending the process; a
deterministic crash restarting forever; a refusal, a configuration error or a
cancellation being retried as if it were a bug. Sound: sessions are scripted fakes on
trio's mock clock, so each restart's delay is read exactly, and the policy is pure.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from shard.errors import DeviceError, StreamClosedError
from shard.reconnect import (CrashLoopError, CrashPolicy, ReconnectPolicy, RegistrationRefused, ending,
                             serve_reconnecting)


def test_restarts_back_off_and_the_one_past_the_bound_within_the_window_ends_the_node():
    policy = CrashPolicy(max_restarts=3, window_s=60.0, first_s=1.0, max_s=3.0)
    crashes: list[float] = []
    delays = []
    for now in (0.0, 1.0, 3.0, 6.0):
        crashes.append(now)
        delays.append(policy.delay_s(crashes, now))
    assert delays == [1.0, 2.0, 3.0, None]
    # Crashes older than the window no longer count: an occasional bug never ends the node.
    assert policy.delay_s([0.0, 1.0, 3.0, 70.0], 70.0) == 1.0
    assert policy.delay_s([0.0, 1.0, 3.0, 60.5], 60.5) == 3.0  # 1.0 and 3.0 still count: the third (4 s), capped
    assert policy.delay_s([0.0, 1.0, 3.0, 62.0], 62.0) == 2.0  # 3.0 alone still counts


@pytest.mark.parametrize(("exc", "how"), [
    (RuntimeError("bug"), "bug"),
    (ExceptionGroup("nursery", [ValueError("bug")]), "bug"),
    (ExceptionGroup("nursery", [StreamClosedError("c", "reset", 0, 4), ValueError("bug")]), "bug"),
    (ExceptionGroup("nursery", [StreamClosedError("c", "reset", 0, 4)]), "lost"),
    (trio.TooSlowError(), "lost"),
    (RegistrationRefused("model_mismatch", "wrong model"), "fatal"),
    (ExceptionGroup("nursery", [RegistrationRefused("x", "y"), ValueError("bug")]), "fatal"),
    (DeviceError("cuda:3", "no such device"), "fatal"),
    (KeyboardInterrupt(), "fatal"),
    (BaseExceptionGroup("nursery", [KeyboardInterrupt(), ValueError("bug")]), "fatal"),
])
def test_how_a_session_ended(exc, how):
    assert ending(exc) == how


def test_a_session_that_fails_on_a_bug_is_dropped_and_started_again():
    starts: list[float] = []
    dropped: list[float] = []

    async def session(registered) -> None:
        starts.append(trio.current_time())
        registered()
        if len(starts) < 3:
            async with trio.open_nursery() as nursery:  # as a node's session fails: inside its nursery
                nursery.start_soon(trio.sleep_forever)
                raise RuntimeError("negative timeout")

    async def main():
        policy = ReconnectPolicy(crashes=CrashPolicy(first_s=1.0, max_s=8.0))
        await serve_reconnecting(session, policy, on_crash=lambda: dropped.append(trio.current_time()))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert [b - a for a, b in zip(starts, starts[1:])] == [1.0, 2.0]  # registering resets no crash count
    assert dropped == starts[:2]  # the jobs went at once, before the backoff


def test_a_crash_loop_ends_the_node_with_one_line_after_the_bound():
    starts: list[float] = []

    async def session(registered) -> None:
        starts.append(trio.current_time())
        raise RuntimeError("the same bug every time")

    policy = ReconnectPolicy(crashes=CrashPolicy(max_restarts=2, window_s=60.0, first_s=1.0))
    with pytest.raises(CrashLoopError) as caught:
        trio.run(serve_reconnecting, session, policy, clock=trio.testing.MockClock(autojump_threshold=0))
    assert starts == [0.0, 1.0, 3.0]
    assert str(caught.value) == ("the node's session failed 3 times within 60 s, last with RuntimeError: the same "
                                 "bug every time; giving up (the tracebacks are logged above)")
    assert "\n" not in str(caught.value)


def test_a_configuration_error_in_a_session_ends_the_node_at_once():
    async def session(registered) -> None:
        async with trio.open_nursery():
            raise DeviceError("cuda:3", "this machine has 1 CUDA devices")

    with pytest.raises(DeviceError):
        trio.run(serve_reconnecting, session, clock=trio.testing.MockClock(autojump_threshold=0))
