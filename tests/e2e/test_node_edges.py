"""A real node (libp2p, Noise, yamux) driven by a test that plays the coordinator.

Guards the node's edge rules (DESIGN.md invariants): frames are accepted only from the
predecessor the current epoch names, garbage from that predecessor costs one frame and
never the node, and the node's output equals the local stage forward bit for bit.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shard.identity import identity_signing_key, keypair_from_seed
from shard.kvcache import KVCache
from shard.layers import LayerRange
from shard.node import CONTROL_PROTOCOL, RING_PROTOCOL, Node, NodeConfig
from shard.stage import Stage
from shard.transport import TransportError, open_host
from shard.wire.codec import decode, encode
from shard.wire.limits import Limits
from shard.wire.messages import Assignment, Forward, JobError, Ping, Pong, Ready, Register, Result


def forward(round_: int, ids: list[int], epoch: int = 1, ctx: int = 0) -> Forward:
    return Forward(job_id="job-1", epoch=epoch, round=round_, nonce=b"n" * 16, phase="prefill", ctx_len=ctx,
                   positions=torch.arange(ctx, ctx + len(ids)), tokens=torch.tensor(ids))


async def run_scenario(store, node_seed: bytes, script):
    """Start a coordinator host and one node serving all layers; run `script(ctx)`."""
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
        node = Node(NodeConfig(coordinator=coord.addrs[0], model="tiny"), node_host, store)
        async with trio.open_nursery() as nursery:
            await nursery.start(node.serve)
            await control_ready.wait()
            ctx.update(coord=coord, node=node, node_addr=node_host.addrs[0])
            with trio.fail_after(30):
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
            stream = await stranger.open_stream(ctx["node"].host.peer_id, RING_PROTOCOL)
            await stream.send_frame(encode(forward(1, [1, 2, 3])))  # perfectly valid, wrong sender
            # The node closes the stranger's stream without computing anything...
            with pytest.raises(TransportError):
                with trio.fail_after(10):
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
        node_id = ctx["node"].host.peer_id
        a = Assignment(epoch=2, peer_id=node_id, role="weight_seeder", layer_start=0, layer_end=0,
                       predecessor=None, successor=None, model="tiny", manifest_digest=store.digest, wire_dtype="f32")
        signed = dataclasses.replace(a, signature=Ed25519PrivateKey.from_private_bytes(ctx["coord_seed"]).sign(a.signing_bytes()))
        await ctx["control"].send_frame(encode(signed))
        ready = await ctx["results"].receive()
        assert isinstance(ready, Ready) and ready.epoch == 2
        assert ctx["node"].state is None  # off the ring: no stage serves frames this epoch

    trio.run(run_scenario, store, os.urandom(32), script)
