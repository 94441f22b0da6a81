"""A real node runs a long prefill chunk in pieces beside other jobs' decode rows (issue 21).

Bugs guarded: a node sending a piece's output (the successor must see one frame, whole), a
job's next frame overtaking its part-done chunk, the chunk's Result differing from the
chunk run alone, a piece that fails leaving the rest of its frame to run (or failing its
batch-mates), a lone prompt cut up for nobody. Sound: the test holds the node's compute
limiter while frames arrive, so what waits together is known; a spy on the scheduler's
run_batch records each forward's (job, piece) as the node ran it; each Result is compared
with the same job run alone on a local stage.
"""

from __future__ import annotations

import dataclasses
import os

import trio

from shard.node import RING_PROTOCOL
from shard.wire.codec import encode
from shard.wire.messages import JobError, Result
from test_node_batching import alone, fwd, receive, until
from test_node_edges import run_scenario


def spy_on(sched) -> list:
    seen, run = [], sched.run_batch

    async def recording(state, batch):
        seen.append([(w.job_id, w.piece) for w in batch])
        return await run(state, batch)

    sched.run_batch = recording
    return seen


def test_a_chunk_runs_in_pieces_beside_decode_rows_and_a_failed_piece_ends_its_frame_alone(tiny_llama_store):
    store = tiny_llama_store
    vocab = store.config.vocab_size
    prompt, bad = [5, 9, 77, 3, 14, 15, 92, 65, 35, 8], [4, 6, 8, 10, 12, vocab, 16, 18]

    async def script(ctx):
        node = ctx["node"]
        sched = node.scheduler
        sched.config = dataclasses.replace(sched.config, piece_rows=4)
        seen = spy_on(sched)
        stream = await ctx["coord"].open_stream(node.host.peer_id, RING_PROTOCOL)
        await stream.send_frame(encode(fwd("solo", 1, prompt)))
        await receive(ctx, 1)
        assert seen == [[("solo", None)]]  # nobody else about: the chunk runs whole
        async with node.compute_limiter:
            await stream.send_frame(encode(fwd("a", 1, [5, 9, 77])))
            await until(lambda: sched.forwards == 2)
            for f in (fwd("p", 1, prompt), fwd("f", 1, bad), fwd("a", 2, [11], ctx=3), fwd("c", 1, [42]),
                      fwd("p", 2, [7], ctx=10), fwd("f", 2, [1, 2, 3])):
                await stream.send_frame(encode(f))
            await until(lambda: len(sched.waiting) == 6)
        got = await receive(ctx, 7)  # a 1 as well
        assert seen[2:] == [
            [("p", (0, 4)), ("a", None), ("c", None)],  # 4 prefill rows in all: f waits its turn
            [("p", (4, 8))],
            [("p", (8, 10)), ("f", (0, 2))],
            [("f", (2, 6)), ("p", None)],  # f's piece holds the bad id; p's round 2 after its chunk
            [("f", None)],  # f's failed frame left; its next frame (a re-prefill) runs
        ]
        assert isinstance(got[("f", 1)], JobError) and "token id" in got[("f", 1)].message
        for key, want in {("p", 1): alone(store, prompt), ("p", 2): alone(store, prompt, [7]),
                          ("a", 2): alone(store, [5, 9, 77], [11]), ("c", 1): alone(store, [42]),
                          ("f", 2): alone(store, [1, 2, 3])}.items():
            out = got[key]
            assert isinstance(out, Result) and (out.hidden - want).abs().max().item() <= 1e-4, key
        assert not node.state.worker.pieces and sched.done == {} and sched.waiting_bytes == 0

    trio.run(run_scenario, store, os.urandom(32), script)

