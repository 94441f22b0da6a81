"""`shard-node join`'s process: the model store, an identity, a host, and the node on it.

Prepares (or opens) the store, claims an identity (`--key-path`, else the first default key
no running node on this machine holds), opens the libp2p host and serves the node until
cancelled. Knows nothing of what the node does once it serves.
"""

from __future__ import annotations

import torch
import trio

from shard.identity import claim_key_path, identity_signing_key, load_or_create_identity
from shard.node import Node, NodeConfig
from shard.store import cache_root, open_or_prepare
from shard.transport import open_host


async def run_node(config: NodeConfig, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Prepare (or verify) the model store, start the host and serve until cancelled.
    Resource handling: the default key's claim (a lock file descriptor) is held until
    this returns, when the process' exit releases it."""
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    store = await trio.to_thread.run_sync(lambda: open_or_prepare(config.model, config.store_dir))
    key_path, _claim = (config.key_path, None) if config.key_path else claim_key_path(cache_root(), "node")
    keypair = load_or_create_identity(key_path)
    async with open_host(keypair, config.listen) as host:
        node = Node(config, host, store, signing_seed=identity_signing_key(keypair))
        await node.serve(task_status=task_status)
