"""Probe before seating, on a real in-process coordinator (issue 20): a node is not seated
on the speed it claims.

The red team's staller registered claiming fast compute and was seated as the sole stage
within seconds. Here a Node registers claiming 100x the decode and prefill speed it
measured; the coordinator times VerifyRequests through it and compares its rows with its
own recompute before it may be seated, and the selector's inputs (formation's snapshot)
must carry the measured figures while the member keeps its claim for display. A second
Node whose recomputed rows are wrong is never seated.
"""

from __future__ import annotations

import dataclasses
import os

import trio

from coordinator.assembly import open_coordinator
from coordinator.config import LOOPBACK_ANY_PORT, CoordConfig
from coordinator.jobs.engine_config import EngineConfig
from coordinator.swarm.formation import SwarmConfig
from coordinator.swarm.speed_probe import ProbeConfig, seated_speed
from shard.identity import keypair_from_seed
from shard.node import Node, NodeConfig
from shard.wire.verify import VerifyReply
from tests.e2e.test_stalling_stage import _generate, _serve_host, _stages, _tokenizer

BOAST = 100.0


class BoastingNode(Node):
    """Registers claiming BOAST times the speed it measured."""

    async def _serve_registered(self, control, decode_s, prefill_s, registered) -> None:
        self.true_speeds = (decode_s, prefill_s)
        await super()._serve_registered(control, decode_s / BOAST, prefill_s / BOAST, registered)


class WrongRowsNode(Node):
    """Answers every verify request with its rows shifted by one."""

    async def _send_control(self, msg) -> None:
        if isinstance(msg, VerifyReply) and msg.hidden is not None:
            msg = dataclasses.replace(msg, hidden=msg.hidden + 1.0)
        await super()._send_control(msg)


def test_a_node_claiming_100x_its_speed_is_seated_on_the_measured_figure_and_a_wrong_one_not_at_all(tiny_llama_store):
    # Sound: the boaster's claim is its own measurement over 100, so a seated figure equal
    # to the probe's (and over the slack times the claim) can only have come from the probe; the member's
    # register still holds the claim. The wrong-rows node differs from the coordinator's
    # recompute by a whole unit per element, far past the 1e-2 row-RMS tolerance.
    config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=1, swarm=SwarmConfig(ready_timeout_s=30, planner="all_nodes"),
                         engine=EngineConfig(draft="none"))

    async def main():
        with trio.fail_after(120):
            async with open_coordinator(config, tiny_llama_store, _tokenizer(), keypair_from_seed(os.urandom(32))) as c:
                swarm, nursery = c.swarm, c.nursery
                nodes = []
                for cls in (BoastingNode, WrongRowsNode):
                    seed = os.urandom(32)
                    host = await nursery.start(_serve_host, seed)
                    node = cls(NodeConfig(coordinator=c.addr), host, tiny_llama_store, signing_seed=seed)
                    await nursery.start(node.serve)
                    nodes.append(node)
                    if cls is BoastingNode:
                        stages = await _stages(swarm, 1)
                        tokens = await _generate(c.engine, 4)
                boaster, wrong = (n.host.peer_id for n in nodes)
                while wrong not in swarm.probes.failed:
                    await swarm.wait_change(swarm.ring.epoch, 1)
                seated = swarm.snapshot().registrations[boaster]
                out = (stages, tokens, nodes[0].true_speeds, swarm.members[boaster].register, seated,
                       swarm.probes.measured[boaster], dict(swarm.probes.failed), swarm.ring.stages, swarm._eligible())
                nursery.cancel_scope.cancel()
                return boaster, wrong, out

    boaster, wrong, (stages, tokens, true, claimed, seated, measured, failed, ring, eligible) = trio.run(main)
    assert stages == {boaster} and len(tokens) == 4
    assert claimed.decode_s_per_layer == true[0] / BOAST and claimed.prefill_s_per_layer_token == true[1] / BOAST
    assert measured.checked and measured.decode_s_per_layer > ProbeConfig().slack * claimed.decode_s_per_layer
    assert seated.decode_s_per_layer == measured.decode_s_per_layer
    assert seated.prefill_s_per_layer_token == seated_speed(claimed.prefill_s_per_layer_token,
                                                            measured.prefill_s_per_layer_token, ProbeConfig().slack)
    assert "differ from the coordinator's recompute" in failed[wrong]
    assert wrong not in {p for p, _ in ring} and wrong not in eligible
    print(f"true decode {true[0] * 1e3:.3f} ms/layer, claimed {claimed.decode_s_per_layer * 1e3:.4f}, "
          f"measured {measured.decode_s_per_layer * 1e3:.3f}; true prefill {true[1] * 1e3:.4f} ms/layer-token, "
          f"measured {measured.prefill_s_per_layer_token * 1e3:.4f}")
