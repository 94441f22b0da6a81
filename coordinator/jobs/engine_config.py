"""The ring engine's settings: one frozen dataclass holds every default, and the CLI is
derived from it (coordinator.cli). This module does not know what uses them.
"""

from __future__ import annotations

from dataclasses import dataclass

from shard.options import option

MAX_EAGLE_TREE = 256  # draft nodes in one verify frame
MAX_PIPELINE_DEPTH = 8  # rounds in flight for one job


def parse_peer_ids(text: str) -> tuple[str, ...]:
    """'ID,ID' (the --trusted-nodes flag) -> peer ids, each an Ed25519 libp2p peer id (a typo
    would otherwise trust nobody, silently)."""
    from shard.assignment_rules import public_key_of_peer
    from shard.errors import ShardError

    ids = tuple(p.strip() for p in text.split(",") if p.strip())
    for peer in ids:
        try:
            public_key_of_peer(peer)
        except (ValueError, ShardError):
            raise ValueError(f"--trusted-nodes takes comma-separated Ed25519 peer ids (12D3KooW...), got {peer!r}") from None
    return ids


def parse_tree(text: str | None) -> tuple[int, int] | None:
    """'NODES,DEPTH' (the --eagle-tree flag) -> (nodes, depth); None stays None."""
    if text is None:
        return None
    try:
        nodes, depth = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--eagle-tree takes NODES,DEPTH (two integers), got {text!r}") from None
    return nodes, depth


@dataclass(frozen=True)
class EngineConfig:
    # The largest prefill chunk (coordinator.jobs.prefill), and the first and last: short
    # pipeline fill and drain.
    prefill_chunk_tokens: int = option(256, "largest prefill chunk; chunks are pipelined through the ring")
    prefill_edge_chunk_tokens: int = option(64, "first and last prefill chunk (sizes ramp up and down by doubling)")
    frame_timeout_s: float = 120.0  # one traversal; past it the job resumes on a new ring
    max_resumes: int = 3
    resume_wait_s: float = 10.0  # after a stage error, how long to wait for the ring to re-form
    # A job waiting for a ring (none formed, or re-forming after a node left) fails with
    # a 503 after this long rather than holding its client forever.
    ring_wait_s: float = option(60.0, "how long a request waits for a ring to re-form before it fails (503)")
    kv_wait_s: float = option(30.0, "how long a request (or a round a stage refused for K/V) waits for K/V room "
                              "on a ring; a new request then gets 429 with Retry-After")
    # coordinator.trust.probation: a newcomer's rounds are recomputed here before release.
    probation_rounds: int = option(64, "rounds a new node serves with each one recomputed by the coordinator before "
                                   "its tokens are released (0: no probation; audits alone vouch for newcomers)")
    # Keys whose recomputations vouch for newcomers (coordinator.trust.probation): the
    # bootstrap of a swarm whose gateway holds no layers. The topology's --trusted-peers
    # (head and tail) count too.
    trusted_nodes: tuple[str, ...] = option((), "comma-separated peer ids never on probation whose recomputations "
                                                "earn newcomers their clean rounds (default: none; nodes earn it "
                                                "through the gateway's or a trusted node's checks)",
                                            parse=parse_peer_ids, show=",".join)
    # serve: a layerless gateway with no trusted verifier still answers (newcomers checking
    # each other catch any lone liar; audits follow); refuse: 503 rather than tokens no
    # trusted party checked. The default serves: a gateway holding the layers (the usual
    # `shard-coord serve`) checks every newcomer itself, so only a layerless one with no
    # trusted node is affected, and refusing would leave such a swarm unable to answer.
    unverified_newcomers: str = option("serve", "a round of a ring with a newcomer no trusted party could check: "
                                       "release it (serve) or answer 503 naming the newcomer (refuse)",
                                       choices=("serve", "refuse"))
    # Emulated on the coordinator -> head edge; `shard-coord serve` gives its local nodes the same.
    link_latency_ms: float = option(0.0, "emulated one-way latency on every ring edge")
    link_upload_mbps: float = option(0.0, "emulated uplink of every ring sender in Mbit/s (0 = unlimited)")
    link_jitter_ms: float = option(0.0, "emulated jitter on every ring edge")
    # Frames sent together carry a burst (shard.wire.trailer); `shard-coord serve` gives its
    # local nodes the same bound (shard-node join --burst-wait-ms).
    burst_wait_ms: float = option(2.0, "how long the head product (and each local node's forward) waits for the "
                                       "rest of a burst of results (frames) that arrived together (0: never)")
    # Where the ring's stages share a few cores (serve's local nodes on a small machine), more
    # groups of jobs in flight than cores make every forward smaller (coordinator.jobs.head_batch).
    max_groups: int = option(-1, "most groups of jobs in flight: an LM-head product waits (up to --group-wait-ms) "
                                 "until its jobs are 1/N of those running (0: no bound; default -1: the machine's "
                                 "cores where serve's --local-nodes (on loopback, not emulated links) and the gateway "
                                 "outnumber them, else no bound)")
    group_wait_ms: float = option(120.0, "longest an LM-head product waits to gather a group (--max-groups)")
    draft: str = option("hybrid", "speculative drafter (hybrid = n-gram and the EAGLE head, routed per round)",
                        choices=("none", "ngram", "eagle", "hybrid"))
    eagle_head: str | None = option(None, "EAGLE head directory (default: the head shipped for the model)")
    eagle_tree: tuple[int, int] | None = option(
        None, "fixed EAGLE tree NODES,DEPTH (default: each round sized by the head's confidence and the measured "
              "ring time)", parse=parse_tree)
    # coordinator.jobs.prefix_cache: what the ring's stages keep of finished jobs for prompts
    # that start the same (a system prompt, a document, a conversation's earlier turns).
    prefix_cache_tokens: int = option(8192, "tokens of finished requests' K/V each ring's stages keep for later "
                                            "prompts that start with the same tokens (0: no prefix cache)")
    # Most rounds in flight (later ones sent before earlier are verified); 1 = off. The
    # planner picks the depth below this cap from acceptance and the measured queue a round
    # in flight makes (coordinator/spec/adapt.py), so on a compute-bound ring it rarely sends a
    # round ahead whatever the cap (docs/benchmarks.md).
    max_pipeline_depth: int = option(4, "most speculative rounds in flight per request, later ones sent before "
                                        "earlier ones are verified (1 = no pipelining)", flag="--pipeline-depth")

    def __post_init__(self) -> None:
        if self.max_groups < -1:
            raise ValueError(f"max groups must be -1 (auto), 0 (no bound) or more, got {self.max_groups}")
        if self.prefix_cache_tokens < 0:
            raise ValueError(f"prefix cache must be >= 0 tokens (0: off), got {self.prefix_cache_tokens}")
        if self.group_wait_ms < 0:
            raise ValueError(f"group wait must be >= 0 ms, got {self.group_wait_ms}")
        if not 1 <= self.max_pipeline_depth <= MAX_PIPELINE_DEPTH:
            raise ValueError(f"pipeline depth (rounds in flight) must be 1..{MAX_PIPELINE_DEPTH}, "
                             f"got {self.max_pipeline_depth}")
        if self.eagle_tree is not None and not (1 <= self.eagle_tree[1] <= self.eagle_tree[0] <= MAX_EAGLE_TREE):
            raise ValueError(f"eagle_tree (nodes, depth) needs 1 <= depth <= nodes <= {MAX_EAGLE_TREE}, "
                             f"got {self.eagle_tree}")

