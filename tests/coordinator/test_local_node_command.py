"""`shard-coord serve --local-nodes N` starts its nodes with `shard-node join` command lines
(coordinator.server.local_node_command). Guards that a node option the coordinator offers
for its local nodes (threads, --node-quant) reaches the node: the command is parsed by
shard-node's own parser into a NodeConfig, so a flag dropped from the command, misspelt,
or parsed as another value fails here rather than silently starting f32 nodes."""

from __future__ import annotations

import pytest

from coordinator.cli import build_parser as coord_parser
from coordinator.config import CoordConfig
from coordinator.server import local_node_command
from shard.cli import build_parser as node_parser
from shard.node_config import NodeConfig
from shard.options import config_from_args
from shard.quant import SCHEMES


def _node_config(*coord_argv: str) -> NodeConfig:
    config = config_from_args(CoordConfig, coord_parser().parse_args(["serve", *coord_argv]))
    cmd = local_node_command(config, "/tmp/store", "/ip4/127.0.0.1/tcp/4001/p2p/QmCoord", 1)
    assert cmd[1:4] == ["-m", "shard.cli", "join"]
    return config_from_args(NodeConfig, node_parser().parse_args(cmd[3:]))


@pytest.mark.parametrize("quant", sorted(SCHEMES))
def test_each_local_node_runs_the_quantisation_the_coordinator_was_given(quant):
    node = _node_config("--local-nodes", "2", "--node-quant", quant, "--node-threads", "3", "--model", "m")
    assert (node.quant, node.torch_threads, node.model, node.store_dir) == (quant, 3, "m", "/tmp/store")


def test_without_the_flag_a_local_node_gets_shard_nodes_own_default():
    # One home for the default: the coordinator's flag takes NodeConfig's, not a copy.
    assert CoordConfig().node_quant == NodeConfig.quant == "none"
    assert _node_config("--local-nodes", "1").quant == NodeConfig.quant


def test_a_scheme_shard_node_does_not_know_is_refused_by_the_coordinators_parser(capsys):
    with pytest.raises(SystemExit):
        coord_parser().parse_args(["serve", "--node-quant", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err


def test_each_local_node_is_told_to_leave_with_the_coordinator_process():
    # Bug guarded: a gateway killed with SIGKILL left its --local-nodes children retrying
    # the gone coordinator forever (found as orphans after test runs).
    import os
    assert _node_config("--local-nodes", "1").exit_with_parent_pid == os.getpid()
