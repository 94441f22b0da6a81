"""SpeedProbes against real recomputations when the gateway cannot recompute, and retries.

Guards (issue 20's probe gaps): a node whose store kept no layer was seated on its claimed
speed unprobed; a probe that timed out or lost its stream once excluded the node for good;
and a layerless gateway could not check a newcomer's rows at all. Here every node answers
with shard.verifier's real recompute on a tiny Llama's layers (a liar adds 1.0 to its
rows); the gateway's store is the same model with no layer files. Sound: the storeless
newcomer is measured on a layer another probed member keeps and vouched for by that
member's recompute, the liar is refused by it, a node losing its first request is
measured on the second attempt, and one that never answers fails after exactly
`attempts` tries.
"""

from __future__ import annotations

import dataclasses
import shutil
from types import SimpleNamespace

import trio

from coordinator.swarm.speed_probe import ProbeConfig, SpeedProbes, probe_layer, retry_wait_s
from shard.errors import TransportError
from shard.manifest import layer_file
from shard.store import ModelStore
from shard.verifier import Verifier
from shard.wire.limits import Limits
from shard.wire.messages import Register


def _reg(peer: str, stored: tuple[str, ...] = ()) -> Register:
    return Register(peer_id=peer, model="m", manifest_digest="d", device="cpu", memory_bytes=1 << 30,
                    decode_s_per_layer=1e-3, prefill_s_per_layer_token=1e-4, upload_bytes_per_s=0.0,
                    download_bytes_per_s=0.0, stored_files=stored)


def _layerless(store: ModelStore, tmp_path) -> ModelStore:
    root = tmp_path / "gateway-store"
    shutil.copytree(store.root, root)
    shutil.rmtree(root / "layers")
    return ModelStore.open(root)


def _run(node_store, gateway_store, newcomer: str, *, liar: bool = False, drops: int = 0):
    """Probe "old" (keeps layer 1), then `newcomer` (keeps nothing); (probes, send counts)."""
    limits = Limits.for_model(node_store.config, max_tokens_per_frame=2048)
    sent: dict[str, int] = {}
    left = {newcomer: drops}

    async def main():
        changed = trio.Event()

        def notify():
            nonlocal changed
            changed.set()
            changed = trio.Event()

        async def send(peer, req):
            sent[peer] = sent.get(peer, 0) + 1
            if left.get(peer, 0) > 0:
                left[peer] -= 1
                raise TransportError("stream reset", peer)
            reply = await verifiers[peer].answer(req, limits)
            if liar and peer == newcomer and reply.hidden is not None:
                reply = dataclasses.replace(reply, hidden=reply.hidden + 1.0)
            probes.answer(peer, reply)

        verifiers = {p: Verifier(node_store, "cpu", trio.CapacityLimiter(1)) for p in ("old", newcomer)}
        config = ProbeConfig(repeats=1, prefill_rows=8, timeout_s=30.0, retry_after_s=0.01)
        probes = SpeedProbes(gateway_store, config, "f32", 1 << 24, send, notify)
        members = {"old": SimpleNamespace(register=_reg("old", (layer_file(1),)))}
        async with trio.open_nursery() as nursery:
            await nursery.start(probes.serve)
            with trio.fail_after(60):
                while "speed probe pending" in probes.hold_back(members).values():
                    await changed.wait()
                members[newcomer] = SimpleNamespace(register=_reg(newcomer))
                while "speed probe pending" in probes.hold_back(members).values():
                    await changed.wait()
            nursery.cancel_scope.cancel()
        return probes

    return trio.run(main), sent


def test_a_storeless_newcomer_is_probed_and_checked_by_a_member_that_keeps_the_layer(tiny_llama_store, tmp_path):
    probes, _ = _run(tiny_llama_store, _layerless(tiny_llama_store, tmp_path), "new")
    assert probes.measured["old"].checked_by == ""  # the first node: nobody could recompute its layer
    m = probes.measured["new"]
    assert m.layer == 1 and m.checked and m.checked_by == "old" and not probes.unprobed


def test_a_storeless_liar_is_refused_by_the_verifiers_recompute(tiny_llama_store, tmp_path):
    probes, sent = _run(tiny_llama_store, _layerless(tiny_llama_store, tmp_path), "liar", liar=True)
    assert "liar" not in probes.measured and probes.attempts["liar"] == 1  # wrong rows: no second attempt
    assert probes.failed["liar"].startswith("speed probe failed: its rows for layer 1 differ from the recompute "
                                            "of verifier(s) old")


def test_a_lost_request_is_retried_and_a_silent_node_fails_after_its_attempts(tiny_llama_store, tmp_path):
    gateway = _layerless(tiny_llama_store, tmp_path)
    probes, _ = _run(tiny_llama_store, gateway, "flaky", drops=1)
    assert probes.attempts["flaky"] == 2 and probes.measured["flaky"].checked_by == "old"
    probes, sent = _run(tiny_llama_store, gateway, "gone", drops=100)
    assert probes.attempts["gone"] == ProbeConfig().attempts == sent["gone"] == 3
    assert probes.failed["gone"] == "speed probe failed 3 times: stream reset (peer gone)"


def test_the_wait_between_attempts_doubles_and_ends_with_the_attempts():
    cfg = ProbeConfig(attempts=3, retry_after_s=2.0)
    assert [retry_wait_s(a, cfg) for a in range(3)] == [2.0, 4.0, None]


def test_a_node_keeping_no_layer_is_probed_on_a_checkable_one():
    assert probe_layer(_reg("p"), 8, checkable=[0, 4, 6]) == 4  # layer 0 takes tokens, not rows
    assert probe_layer(_reg("p"), 8) == 1  # nobody can check: still timed, on layer 1
    assert probe_layer(_reg("p", (layer_file(5),)), 8, checkable=[2]) == 5  # what it keeps comes first
    assert probe_layer(_reg("p"), 1) is None  # no layer past the embedding's
