"""A real node (libp2p, Noise, yamux) driven by a test that plays the coordinator.

Guards the node's edge rules (DESIGN.md invariants, issue 20): frames are accepted only
from the predecessor the current epoch names, garbage from that predecessor costs one
frame (and its job) and never the node, streams and idle jobs hold bounded resources,
assignments only move forward, and the node's output equals the local stage forward bit
for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import msgpack
import pytest
import torch
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from libp2p.peer.id import ID

from shard.identity import identity_signing_key, keypair_from_seed
from shard.kvcache import KVCache
from shard.layers import LayerRange
from shard.node import CONTROL_PROTOCOL, RING_PROTOCOL, Node, NodeConfig
from shard.ring_inbox import InboxConfig
from shard.stage import Stage
from shard.transport import BodyDeadline, TransportError, open_host
from shard.wire.codec import HEADER_PREFIX, decode, encode
from shard.wire.limits import FRAME_PREFIX, Limits
from shard.wire.messages import Assignment, Forward, JobError, Ping, Pong, Ready, Register, Result


def forward(round_: int, ids: list[int], epoch: int = 1, ctx: int = 0) -> Forward:
    return Forward(job_id="job-1", epoch=epoch, round=round_, nonce=b"n" * 16, phase="prefill", ctx_len=ctx,
                   positions=torch.arange(ctx, ctx + len(ids)), tokens=torch.tensor(ids))


async def run_scenario(store, node_seed: bytes, script, timeout_s: float = 30, **node_kwargs):
    """Start a coordinator host and one node serving all layers; run `script(ctx)`.
    `node_kwargs`: extra Node fields (signing_seed, inbox_config...)."""
    coord_seed = os.urandom(32)
    coord_kp = keypair_from_seed(coord_seed)
    limits = Limits.for_model(store.config, max_tokens_per_frame=2048)
    results: trio.MemorySendChannel
    results, results_out = trio.open_memory_channel(64)
    control_ready = trio.Event()
    ctx: dict = {"results": results_out, "limits": limits, "coord_seed": coord_seed}

    async def on_control(stream):
        reg = decode(await stream.recv_frame(limits.max_frame_bytes), limits)
        while isinstance(reg, Ping):  # the node's link probes (rtt, upload, download) before it registers
            await stream.send_frame(encode(Pong(nonce=reg.nonce, sent_ns=reg.sent_ns, payload=bytes(reg.reply_bytes))))
            reg = decode(await stream.recv_frame(limits.max_frame_bytes), limits)
        assert isinstance(reg, Register) and reg.peer_id == stream.remote_peer_id
        a = Assignment(epoch=1, peer_id=reg.peer_id, role="stage", layer_start=0, layer_end=store.num_layers,
                       predecessor=None, successor=None, model="tiny", manifest_digest=store.digest, wire_dtype="f32")
        signed = dataclasses.replace(a, signature=Ed25519PrivateKey.from_private_bytes(coord_seed).sign(a.signing_bytes()))
        await stream.send_frame(encode(signed))
        ready = decode(await stream.recv_frame(limits.max_frame_bytes), limits)
        assert isinstance(ready, Ready) and ready.epoch == 1
        ctx["control"] = stream
        control_ready.set()
        while True:  # job errors arrive here
            msg = decode(await stream.recv_frame(limits.max_frame_bytes), limits)
            await results.send(msg)

    async def on_ring(stream):
        while True:
            await results.send(decode(await stream.recv_frame(limits.max_frame_bytes), limits))

    async with open_host(coord_kp) as coord, open_host(keypair_from_seed(node_seed)) as node_host:
        coord.set_handler(CONTROL_PROTOCOL, on_control)
        coord.set_handler(RING_PROTOCOL, on_ring)
        node = Node(NodeConfig(coordinator=coord.addrs[0], model="tiny"), node_host, store, **node_kwargs)
        async with trio.open_nursery() as nursery:
            await nursery.start(node.serve)
            await control_ready.wait()
            ctx.update(coord=coord, node=node, node_addr=node_host.addrs[0])
            with trio.fail_after(timeout_s):
                await script(ctx)
            nursery.cancel_scope.cancel()


def reference_hidden(store, ids: list[int]) -> torch.Tensor:
    cfg = store.config
    r = LayerRange(0, cfg.num_layers)
    stage = Stage(cfg, r, store.load_layers(r), embedding=store.load_embedding())
    job = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, 1 << 26).open("j", 64)
    h, _ = stage.forward(job, torch.tensor(ids), ctx_len=0, positions=torch.arange(len(ids)))
    return h


def test_garbage_from_the_predecessor_costs_one_frame_not_the_node(tiny_llama_store):
    store = tiny_llama_store
    ids = [5, 9, 77, 3]

    async def script(ctx):
        stream = await ctx["coord"].open_stream(ctx["node"].host.peer_id, RING_PROTOCOL)
        await stream.send_frame(os.urandom(300))  # not msgpack at all
        bad_dtype = bytearray(encode(forward(1, ids)))
        await stream.send_frame(bytes(bad_dtype[:40]))  # truncated header
        huge = dataclasses.replace(forward(2, ids), positions=torch.arange(4), tokens=torch.tensor([1, 2, 3, 10**6]))
        await stream.send_frame(encode(huge))  # decodes, but token id past the vocab: a job error
        await stream.send_frame(encode(forward(3, ids)))  # a good frame still works
        first = await ctx["results"].receive()
        assert isinstance(first, JobError) and first.round == 2 and "token id" in first.message
        out = await ctx["results"].receive()
        assert isinstance(out, Result) and out.round == 3
        # The tail returns only the last prompt row on prefill; it must equal the local forward.
        assert torch.equal(out.hidden, reference_hidden(store, ids)[-1:])

    trio.run(run_scenario, store, os.urandom(32), script)


def test_a_peer_that_is_not_the_predecessor_cannot_inject(tiny_llama_store):
    store = tiny_llama_store

    async def script(ctx):
        async with open_host(keypair_from_seed(os.urandom(32))) as stranger:
            await stranger.connect(ctx["node_addr"])
            # A perfectly valid frame, wrong sender: the node resets the stream before
            # reading a byte of it (the open, the send or the read fails, none answers)...
            with pytest.raises(TransportError):
                with trio.fail_after(10):
                    stream = await stranger.open_stream(ctx["node"].host.peer_id, RING_PROTOCOL)
                    await stream.send_frame(encode(forward(1, [1, 2, 3])))
                    await stream.recv_frame(1 << 20)
        # ...and nothing reached the coordinator; the real predecessor still gets served.
        with trio.move_on_after(0.5):
            leaked = await ctx["results"].receive()
            raise AssertionError(f"stranger's frame produced {leaked}")
        stream = await ctx["coord"].open_stream(ctx["node"].host.peer_id, RING_PROTOCOL)
        await stream.send_frame(encode(forward(2, [1, 2, 3])))
        out = await ctx["results"].receive()
        assert isinstance(out, Result) and out.round == 2

    trio.run(run_scenario, store, os.urandom(32), script)


def test_a_role_that_holds_no_layers_is_taken_not_fatal(tiny_llama_store):
    # Bug guarded: the node built LayerRange(0, 0) from a role assignment that names no
    # layers (a seeder or relay), which raises, so the coordinator could never send one.
    # Sound: the node must answer Ready for the new epoch and then refuse ring frames,
    # neither of which happens if _assume raised.
    store = tiny_llama_store

    async def script(ctx):
        seeder = signed_assignment(ctx, epoch=2, role="weight_seeder", layer_start=0, layer_end=0)
        await ctx["control"].send_frame(encode(seeder))
        ready = await ctx["results"].receive()
        assert isinstance(ready, Ready) and ready.epoch == 2
        assert ctx["node"].state is None  # off the ring: no stage serves frames this epoch

    trio.run(run_scenario, store, os.urandom(32), script)


def tampered(msg, **header) -> bytes:
    """msg's frame body with header fields replaced after encoding: what a hostile peer
    sends when it skips the checks our encoder runs."""
    body = encode(msg)
    (n,) = HEADER_PREFIX.unpack_from(body, 0)
    head = msgpack.unpackb(body[HEADER_PREFIX.size:HEADER_PREFIX.size + n], raw=False)
    head.update(header)
    packed = msgpack.packb(head, use_bin_type=True)
    return HEADER_PREFIX.pack(len(packed)) + packed + body[HEADER_PREFIX.size + n:]


def signed_assignment(ctx, **fields) -> Assignment:
    a = Assignment(**{**dict(epoch=2, peer_id=ctx["node"].host.peer_id, role="stage", layer_start=0,
                             layer_end=ctx["node"].store.num_layers, predecessor=None, successor=None, model="tiny",
                             manifest_digest=ctx["node"].store.digest, wire_dtype="f32"), **fields})
    return dataclasses.replace(a, signature=Ed25519PrivateKey.from_private_bytes(ctx["coord_seed"]).sign(a.signing_bytes()))


def test_frames_that_killed_the_node_end_their_job_not_the_node(tiny_llama_store):
    # Bug guarded: each of these frames from the predecessor killed the node (exit 1): a
    # 3-byte nonce (the receipt signer raised MalformedError), a job id outside the receipt
    # alphabet (same), positions holding 2^40 (the rotary table tried to allocate 4.4 TB).
    # Sound: the node signs receipts here (the path that raised), answers the two frames
    # that name their job with a JobError saying what broke, drops the one whose job id is
    # itself invalid (no JobError can name it), and still serves the next good frame.
    store = tiny_llama_store
    seed = os.urandom(32)

    async def script(ctx):
        stream = await ctx["coord"].open_stream(ctx["node"].host.peer_id, RING_PROTOCOL)
        await stream.send_frame(tampered(forward(1, [5, 9]), nonce=b"abc"))
        await stream.send_frame(tampered(forward(2, [5, 9]), job_id="job 1/../x"))
        await stream.send_frame(encode(dataclasses.replace(forward(3, [5, 9]), positions=torch.tensor([0, 1 << 40]))))
        await stream.send_frame(encode(forward(4, [5, 9, 77, 3])))
        nonce_error = await ctx["results"].receive()
        assert isinstance(nonce_error, JobError) and nonce_error.round == 1 and nonce_error.code == "malformed_frame"
        assert nonce_error.message == "field 'nonce' length (limit 16..32, got 3)"
        position_error = await ctx["results"].receive()
        assert isinstance(position_error, JobError) and position_error.round == 3
        assert position_error.message == ("tensor 'positions' values (limit < 256 (the model's context), "
                                          "got 1099511627776)")
        out = await ctx["results"].receive()
        assert isinstance(out, Result) and out.round == 4 and len(out.receipts) == 1
        assert torch.equal(out.hidden, reference_hidden(store, [5, 9, 77, 3])[-1:])

    trio.run(functools.partial(run_scenario, store, seed, script,
                               signing_seed=identity_signing_key(keypair_from_seed(seed))))


def test_replayed_or_misaddressed_assignments_are_refused(tiny_llama_store):
    # Bug guarded: _assume checked the signature and the model digest only, so an old
    # assignment replayed (or one for another node) re-seated this node; and a control
    # message that failed to decode ended the node. Sound: no refused message is answered
    # with Ready or changes the epoch served, the node stays up, and a newer assignment
    # for this node is then taken (Ready, epoch 2).
    store = tiny_llama_store

    async def script(ctx):
        node = ctx["node"]
        other = ID.from_pubkey(keypair_from_seed(os.urandom(32)).public_key).to_base58()
        await ctx["control"].send_frame(os.urandom(100))  # not a message: dropped, not fatal
        await ctx["control"].send_frame(encode(signed_assignment(ctx, layer_end=node.store.num_layers + 1)))
        await ctx["control"].send_frame(encode(signed_assignment(ctx, peer_id=other)))
        await ctx["control"].send_frame(encode(signed_assignment(ctx, epoch=0)))
        await ctx["control"].send_frame(encode(signed_assignment(ctx, epoch=1, layer_end=1)))
        await ctx["control"].send_frame(encode(signed_assignment(ctx, epoch=2)))
        ready = await ctx["results"].receive()
        assert isinstance(ready, Ready) and ready.epoch == 2
        assert node.state.assignment.epoch == 2
        stream = await ctx["coord"].open_stream(node.host.peer_id, RING_PROTOCOL)
        await stream.send_frame(encode(forward(1, [1, 2, 3], epoch=2)))
        out = await ctx["results"].receive()
        assert isinstance(out, Result) and out.epoch == 2

    trio.run(run_scenario, store, os.urandom(32), script)


def test_the_node_serves_the_open_jobs_cap_its_assignment_names(tiny_llama_store):
    # Bug guarded (issue 20): the open-jobs cap was the node's flag alone (128), so a
    # gateway running more jobs failed them until every volunteer raised it. Sound: a node
    # whose volunteer set no cap serves 128 while the coordinator names none, then exactly
    # what its next assignment names (2: a third job's first frame fails that job alone);
    # an assignment naming a cap past the wire's limit is dropped at decode, not taken.
    store = tiny_llama_store

    async def script(ctx):
        node = ctx["node"]
        assert node.state.worker.config.max_open_jobs == 128
        await ctx["control"].send_frame(tampered(signed_assignment(ctx, max_open_jobs=2), max_open_jobs=1 << 20))
        await ctx["control"].send_frame(encode(signed_assignment(ctx, max_open_jobs=2)))
        ready = await ctx["results"].receive()
        assert isinstance(ready, Ready) and ready.epoch == 2  # the tampered one got no Ready
        assert node.state.worker.config.max_open_jobs == 2
        stream = await ctx["coord"].open_stream(node.host.peer_id, RING_PROTOCOL)
        for i, job in enumerate(("a", "b", "c")):
            await stream.send_frame(encode(dataclasses.replace(forward(i + 1, [5, 9], epoch=2), job_id=job)))
        got = [await ctx["results"].receive() for _ in range(3)]
        assert sorted(m.job_id for m in got if isinstance(m, Result)) == ["a", "b"]
        [refused] = [m for m in got if isinstance(m, JobError)]
        assert refused.job_id == "c" and refused.message == ("KV cache full: open jobs (--max-open-jobs) needs 3 "
                                                             "but the limit is 2")

    trio.run(run_scenario, store, os.urandom(32), script)


def test_an_idle_job_frees_its_kv_and_a_late_frame_of_it_fails(tiny_llama_store):
    # Bug guarded: a predecessor could open jobs and never end them, holding the KV budget
    # for good. Sound: after the idle timeout the job's KV is gone from the worker's cache,
    # a frame continuing it (ctx_len > 0) gets a JobError instead of running on an empty
    # cache, and a fresh prefill of the same job is served. The clock is the worker's.
    store = tiny_llama_store

    async def script(ctx):
        node = ctx["node"]
        stream = await ctx["coord"].open_stream(node.host.peer_id, RING_PROTOCOL)
        await stream.send_frame(encode(forward(1, [5, 9, 77])))
        assert isinstance(await ctx["results"].receive(), Result)
        worker = node.state.worker
        assert await node.evict_idle_jobs() == []  # not idle yet
        later = worker.clock() + worker.config.job_idle_timeout_s + 1
        worker.clock = lambda: later
        assert await node.evict_idle_jobs() == ["job-1"]
        assert "job-1" not in worker.cache.jobs and worker.cache.reserved_bytes == 0
        await stream.send_frame(encode(forward(2, [3], ctx=3)))
        late = await ctx["results"].receive()
        assert isinstance(late, JobError) and late.round == 2 and "was freed after" in late.message
        await stream.send_frame(encode(forward(3, [5, 9, 77])))
        assert isinstance(await ctx["results"].receive(), Result)

    trio.run(run_scenario, store, os.urandom(32), script)


def test_a_slow_sender_loses_its_stream_and_a_peer_holds_few_streams(tiny_llama_store, caplog):
    # Bug guarded: a sender could announce a frame and trickle it forever, holding the
    # stream and its half-read body; and a predecessor could open streams without bound.
    # Sound: the stalled stream is reset once its BodyDeadline passes (its reader sees the
    # stream gone), a third stream displaces the oldest of the peer's two, and the newest
    # stream still serves a good frame.
    store = tiny_llama_store

    async def script(ctx):
        node = ctx["node"]
        stalled = await ctx["coord"].open_stream(node.host.peer_id, RING_PROTOCOL)
        await stalled._stream.write(FRAME_PREFIX.pack(1000) + b"x" * 10)  # 10 of 1000 bytes, then nothing
        with pytest.raises(TransportError):
            await stalled.recv_frame(1 << 20)
        first = await ctx["coord"].open_stream(node.host.peer_id, RING_PROTOCOL)
        await first.send_frame(encode(forward(1, [1, 2])))
        assert isinstance(await ctx["results"].receive(), Result)
        streams = [await ctx["coord"].open_stream(node.host.peer_id, RING_PROTOCOL) for _ in range(2)]
        with pytest.raises(TransportError):
            await first.recv_frame(1 << 20)  # displaced: reset by the node
        await streams[-1].send_frame(encode(forward(2, [1, 2])))
        out = await ctx["results"].receive()
        assert isinstance(out, Result) and out.round == 2
        # A displaced stream's handler once raised on its way out (caught by the
        # transport, logged as an error): nothing of ours may log one.
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("shard")] == []

    trio.run(functools.partial(run_scenario, store, os.urandom(32), script,
                               inbox_config=InboxConfig(body_deadline=BodyDeadline(base_s=0.5, min_bytes_per_s=1e9))))
