"""Property: no Forward from the real predecessor kills a real node (issue 20).

Hypothesis generates Forward frames, many of them hostile (job ids outside the receipt
alphabet, nonces of any length, positions and ctx_len past the model's context, token ids
past the vocab, hidden states where the head wants token ids, commits past the cache,
layer indices past the model, epochs the node does not serve), sends them on the
coordinator's own ring stream (the head's real predecessor) to a node that signs
receipts, and checks that each frame naming a valid job is answered exactly once, with a
Result or a JobError, that one naming no valid job is not answered, and that the node
still serves a good frame after it. Hypothesis runs in a worker thread and drives the
trio side through trio.from_thread, so one node serves every example.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shard.errors import WireError
from shard.identity import identity_signing_key, keypair_from_seed
from shard.node import RING_PROTOCOL
from shard.wire.codec import encode
from shard.wire.messages import JOB_ID, EndJob, Result
from tests.e2e.test_node_edges import forward, run_scenario, tampered

EXAMPLES = 200
VALID_IDS = st.from_regex(r"\Ah[A-Za-z0-9._-]{0,20}\Z")  # never the sentinel's "sentinel-…"
ANY_IDS = st.text(max_size=70)


def names_a_job(job_id: object) -> bool:
    try:
        JOB_ID.check("job_id", job_id, None)
    except WireError:
        return False
    return True


@st.composite
def hostile_forwards(draw, vocab: int, hidden: int):
    """(Forward, header fields to overwrite once encoded) from a hostile predecessor."""
    n = draw(st.integers(1, 6))
    # Each field is valid more often than not, so whole valid frames (Results) occur too.
    ctx = draw(st.one_of(st.just(0), st.just(0), st.integers(0, 300), st.just(1 << 40)))
    positions = draw(st.one_of(
        st.just(list(range(min(ctx, 1 << 20), min(ctx, 1 << 20) + n))),
        st.lists(st.integers(0, 1 << 40), min_size=n, max_size=n)))
    src = draw(st.one_of(st.just([]), st.lists(st.integers(0, 400), max_size=4)))
    fwd = dataclasses.replace(
        forward(0, [3] * n), job_id="h", epoch=draw(st.sampled_from([1, 1, 1, 0, 7])), ctx_len=0,
        positions=torch.tensor(positions),
        tree_parents=draw(st.one_of(st.none(), st.just(torch.arange(-1, n - 1, dtype=torch.int32)))),
        want_aux_layers=tuple(draw(st.lists(st.integers(0, 9), max_size=3))))
    if draw(st.integers(0, 3)):
        ids = st.one_of(st.integers(0, vocab - 1), st.integers(0, vocab - 1), st.integers(0, 1 << 40))
        fwd = dataclasses.replace(fwd, tokens=torch.tensor(draw(st.lists(ids, min_size=n, max_size=n))))
    else:  # the head wants token ids: a StageInputError
        fwd = dataclasses.replace(fwd, tokens=None, hidden=torch.randn(n, hidden))
    job_id = draw(st.one_of(VALID_IDS, ANY_IDS))
    nonce = draw(st.one_of(st.binary(min_size=16, max_size=32), st.binary(min_size=0, max_size=40)))
    # The header edits skip our encoder's own checks, as a hostile peer's encoder would.
    commit_dst = draw(st.integers(0, max(ctx, 0)))
    return fwd, dict(job_id=job_id, nonce=nonce, ctx_len=ctx, commit_src=src, commit_dst=commit_dst)


def test_generated_frames_from_the_predecessor_never_kill_the_node(tiny_llama_store):
    store = tiny_llama_store
    seed = os.urandom(32)
    cfg = store.config
    answers: list[tuple[str, int, str]] = []  # (job id, round, answer type) per example

    async def script(ctx):
        stream = await ctx["coord"].open_stream(ctx["node"].host.peer_id, RING_PROTOCOL)
        rounds = iter(range(1, 10**6))

        async def one(fwd, header: dict) -> tuple[list, int]:
            """Send a hostile frame (on a fresh round), then a good frame of a fresh sentinel
            job; what arrived before the sentinel's Result (and just after), and the round."""
            r, sentinel_round = next(rounds), next(rounds)
            job_id = header["job_id"]
            await stream.send_frame(tampered(fwd, round=r, **header))
            sentinel = f"sentinel-{sentinel_round}"
            await stream.send_frame(encode(dataclasses.replace(forward(sentinel_round, [5, 9, 7]), job_id=sentinel)))
            got = []
            while True:
                msg = await ctx["results"].receive()
                if isinstance(msg, Result) and msg.job_id == sentinel:
                    break
                got.append(msg)
            await trio.testing.wait_all_tasks_blocked(cushion=0.02)  # a JobError racing the Result lands
            while True:
                try:
                    got.append(ctx["results"].receive_nowait())
                except trio.WouldBlock:
                    break
            await stream.send_frame(encode(EndJob(job_id=sentinel, epoch=1)))
            if names_a_job(job_id):
                await stream.send_frame(encode(EndJob(job_id=job_id, epoch=1)))
            return [(m.job_id, m.round, type(m).__name__) for m in got], r

        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(hostile_forwards(cfg.vocab_size, cfg.hidden_size))
        def check(case):
            fwd, header = case
            got, r = trio.from_thread.run(one, fwd, header)
            job_id = header["job_id"]
            if names_a_job(job_id):
                assert len(got) == 1 and got[0][:2] == (job_id, r) and got[0][2] in ("Result", "JobError"), got
                answers.append(got[0])
            else:
                assert got == [], got

        await trio.to_thread.run_sync(check)

    trio.run(functools.partial(run_scenario, store, seed, script, timeout_s=600,
                               signing_seed=identity_signing_key(keypair_from_seed(seed))))
    # Sound only if the examples reached both answers, not just one refusal path.
    kinds = {kind for _, _, kind in answers}
    assert kinds == {"Result", "JobError"}, kinds

