"""`shard-node join`'s process: the model store, an identity, a host, and the node on it.

Prepares (or opens) the store, claims an identity (`--key-path`, else the first default key
no running node on this machine holds), opens the libp2p host (which reserves a relay slot
on the coordinator whenever the coordinator cannot dial it back) and serves the node until
cancelled, with glibc's thresholds fixed so what the node frees can leave the process
(shard.heap). Knows nothing of what the node does once it serves.
"""

from __future__ import annotations

import logging
import os

import multiaddr
import torch
import trio
from libp2p.peer.peerinfo import InvalidAddrError, info_from_p2p_addr

from shard.errors import DeviceError, DialError
from shard.heap import fix_mmap_threshold
from shard.identity import claim_key_path, identity_signing_key, load_or_create_identity
from shard.node import Node, NodeConfig
from shard.store import cache_root, open_or_prepare
from shard.transport import open_host
from shard.weight_fetch import open_fetched_store

log = logging.getLogger("shard.node")


def check_device(device: str) -> None:
    """DeviceError unless torch can use `device` here (a CUDA device needs CUDA)."""
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise DeviceError(device, f"not a torch device ({exc}); use cpu, cuda or cuda:N") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(device, "this machine has no CUDA device torch can use; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise DeviceError(device, f"this machine has {torch.cuda.device_count()} CUDA devices")


def coordinator_peer_id(addr: str) -> str:
    """The coordinator's peer id from its multiaddr, or DialError saying what to pass."""
    try:
        return info_from_p2p_addr(multiaddr.Multiaddr(addr)).peer_id.to_base58()
    except (InvalidAddrError, ValueError) as exc:
        raise DialError(addr, "not a coordinator address: pass the /ip4/<host>/tcp/<port>/p2p/<peer id> "
                              "line shard-coord serve prints") from exc


async def run_node(config: NodeConfig, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Prepare (or verify) the model store, start the host and serve until cancelled.
    Resource handling: the default key's claim (a lock file descriptor) is held until
    this returns, when the process' exit releases it."""
    check_device(config.device)
    fix_mmap_threshold()  # before the forwards' worker threads: what they free can leave (shard.heap)
    if not config.exit_with_parent_pid:
        return await _run_node(config, task_status)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_exit_with_parent, config.exit_with_parent_pid, nursery.cancel_scope)
        await _run_node(config, task_status)
        nursery.cancel_scope.cancel()


async def _exit_with_parent(pid: int, scope: trio.CancelScope) -> None:
    """Cancel `scope` once this process' parent is no longer `pid` (it ended: we were
    re-parented), checked every second."""
    while os.getppid() == pid:
        await trio.sleep(1.0)
    log.warning("the process that started this node (pid %d) is gone; leaving", pid)
    scope.cancel()


async def _run_node(config: NodeConfig, task_status) -> None:
    coordinator_id = coordinator_peer_id(config.coordinator)  # a malformed address fails before the model loads
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    store = None if config.weights.fetch_weights else await trio.to_thread.run_sync(
        lambda: open_or_prepare(config.model, config.store_dir))
    key_path, _claim = (config.key_path, None) if config.key_path else claim_key_path(cache_root(), "node")
    keypair = load_or_create_identity(key_path)
    async with open_host(keypair, config.listen) as host:
        host.reach.use_relay(config.coordinator)  # not dialable: reachable through the coordinator
        if store is None:  # joins with no weights: the coordinator's signed manifest, each slice fetched from peers
            store = await open_fetched_store(host, config.coordinator, config.store_dir)
        print(f"node {host.peer_id} joining coordinator {coordinator_id} at {config.coordinator}", flush=True)
        node = Node(config, host, store, signing_seed=identity_signing_key(keypair))
        await node.serve(task_status=task_status)
