"""The coordinator process's config: its components' configs composed, plus what only the
process has (model, identity, addresses, local nodes).

Every component default lives once, on the component's dataclass (EngineConfig,
SwarmConfig, ApiConfig, ReceiptConfig, AuditConfig); `shard-coord serve`'s flags are
derived from this tree (shard.options: a component's `option` fields are flags under their
own names). Values one component takes from another (the topology's prefill chunk and
coordinator link latency, the swarm's first-ring size) are derived at assembly
(coordinator.assembly), not restated here. Does not build or run anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from coordinator.gateway.api import ApiConfig
from coordinator.jobs.engine_config import EngineConfig
from coordinator.swarm.formation import SwarmConfig
from coordinator.trust.audit import AuditConfig
from coordinator.trust.receipt_check import ReceiptConfig
from shard.batch_plan import PREFILL_ORDERS
from shard.node_config import NodeConfig
from shard.options import option
from shard.sources import DEFAULT_MODEL


# Where nodes join: stable by default, so a volunteer's join command survives a restart.
DEFAULT_LISTEN = "/ip4/0.0.0.0/tcp/4001"
LOOPBACK_ANY_PORT = "/ip4/127.0.0.1/tcp/0"  # in-process rings and tests: never a fixed port
# `shard-node join --quant`, whose default and choices the local nodes' flag takes as they are.
_NODE_QUANT = next(f for f in fields(NodeConfig) if f.name == "quant")


@dataclass(frozen=True)
class CoordConfig:
    """Everything `shard-coord serve` takes; its flags are derived from these fields."""

    model: str = option(DEFAULT_MODEL, "model alias, HF dir or GGUF file (prepared into the store once)")
    store_dir: str | None = option(None, "model store dir (default: the shard cache)")
    listen: str = option(DEFAULT_LISTEN, "libp2p listen multiaddr; volunteers' join commands name it, so it stays "
                                         "the same across restarts (libp2p's customary port 4001, every interface)")
    # The API's address; ApiConfig's host and port are what this flag's default is made of.
    http: str = option(f"{ApiConfig.host}:{ApiConfig.port}",
                       "HOST:PORT for the OpenAI-compatible API (port 0 picks one)")
    key_path: str | None = option(None, "identity key file (default: <cache>/coordinator.key)")
    local_nodes: int = option(0, "spawn this many nodes on loopback and serve with them, one stage each")
    local_selector_split: bool = option(False, "with --local-nodes, let the ring selector choose the stages instead "
                                               "(on loopback it seats every layer on one node: fewer hops)")
    # 0: --local-nodes, else 1 (SwarmConfig.min_nodes is set from it at assembly).
    min_nodes: int = option(0, "form a ring once this many nodes joined (default: local-nodes, else 1)")
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    node_threads: int = option(1, "torch threads per local node")
    node_batch_token_budget: int = option(NodeConfig.batch_token_budget, "rows one forward of a local node may carry across "
                                          "jobs (shard-node join --batch-token-budget; 1: one frame per forward)")
    node_prefill_order: str = option(NodeConfig.prefill_order, "which waiting prefill chunk a local node's forward "
                                     "serves first (shard-node join --prefill-order)", choices=PREFILL_ORDERS)
    node_quant: str = option(_NODE_QUANT.default, "weight-only quantisation of each local node's layers "
                                                  "(shard-node join --quant)", choices=_NODE_QUANT.metadata["choices"])
    receipts: ReceiptConfig = field(default_factory=ReceiptConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)

    @property
    def first_ring_nodes(self) -> int:
        """Nodes that must join before the first ring forms."""
        return self.min_nodes or self.local_nodes or 1
