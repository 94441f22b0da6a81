"""What `shard-node join` takes (the CLI is derived from these fields), the start-up
self-benchmark a node registers with, and what a stage assignment's slice becomes under
them (the Stage loaded, its worker's config). It does not know libp2p, the ring or the
wire beyond an Assignment's fields."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from shard.assignment_rules import open_jobs_cap
from shard.batch_plan import DEFAULT_PIECE_ROWS, DEFAULT_TOKEN_BUDGET, PREFILL_ORDERS
from shard.kv_budget import node_kv_bytes
from shard.layers import LayerRange
from shard.manifest import layer_file, layer_tensor_shapes
from shard.options import option
from shard.quant import NONE, SCHEMES, QuantScheme, quantise_stage, scheme
from shard.sources import DEFAULT_MODEL
from shard.stage import Stage
from shard.stage_scheduler import SchedulerConfig
from shard.stage_worker import WorkerConfig
from shard.store import ModelStore
from shard.verifier import CACHE_BYTES
from shard.weight_plan import WeightsConfig
from shard.wire.dtypes import COMPUTE_DTYPES
from shard.wire.messages import Assignment


@dataclass(frozen=True)
class NodeConfig:
    """Everything `shard-node join` takes; the CLI is derived from these fields."""

    coordinator: str = option(help="the coordinator's multiaddr, ending in /p2p/<its peer id>")
    model: str = option(DEFAULT_MODEL, "model alias, HF dir or GGUF file (prepared into the store once)")
    store_dir: str | None = option(None, "model store dir (default: the shard cache)")
    key_path: str | None = option(None, "identity key file (default: the first of <cache>/node.key, node-1.key, ... "
                                        "no running node holds)")
    listen: str = option("/ip4/127.0.0.1/tcp/0", "libp2p listen multiaddr")
    device: str = option("cpu", "torch device for this node's layers")
    dtype: str = option("float32", "compute dtype of this node's layers", choices=tuple(COMPUTE_DTYPES))
    quant: str = option("none", "weight-only quantisation of this node's layers (shard.quant)", choices=tuple(SCHEMES))
    max_memory_bytes: int = option(4 << 30, "weights + KV cache this node may use")
    torch_threads: int = option(0, "torch threads (0 = torch's default)")
    link_latency_ms: float = option(0.0, "emulated one-way latency on this node's outgoing ring edge")
    link_upload_mbps: float = option(0.0, "emulated uplink in Mbit/s (0 = unlimited)")
    link_jitter_ms: float = option(0.0, "emulated jitter on this node's outgoing ring edge")
    probe_bytes: int = option(256 << 10, "payload timing upload and download to the coordinator")
    probe_timeout_s: float = option(30.0, "one link probe; a peer that does not answer is left unmeasured")
    # Sign a receipt per frame and log frames for audits. Off only to measure their cost:
    # a coordinator that checks receipts fails every job through a node that does not sign.
    receipts: bool = option(True, "sign a receipt per frame and log frames for audits (off only to measure "
                                  "their cost)")
    job_idle_timeout_s: float = option(WorkerConfig.job_idle_timeout_s,
                                       "free the KV of a job that ran no frame for this long")
    max_open_jobs: int = option(0, "most jobs holding KV on this node at once, a ceiling on what the coordinator "
                                "asks for (its gateway's concurrency); a frame opening one more fails its job "
                                "(0: the coordinator's, 128 if it names none)")
    weights: WeightsConfig = WeightsConfig()  # fetching and seeding weight files (shard.weight_plan)
    batch_token_budget: int = option(DEFAULT_TOKEN_BUDGET, "rows one forward may carry across the jobs waiting at "
                                     "this stage (prefill chunks and decode rows share it); 1 = one frame per forward")
    prefill_piece_tokens: int = option(DEFAULT_PIECE_ROWS, "prefill rows one forward carries while decode rows wait or "
                                       "ran within the last second (a longer chunk runs in pieces); 0 = never split")
    prefill_order: str = option(SchedulerConfig.prefill_order, "which waiting prefill chunk a forward's prefill rows go "
                                "to first: shortest remaining prompt (a chunk passed over 8 forwards goes first) "
                                "or arrival (oldest first)", choices=PREFILL_ORDERS)
    burst_wait_ms: float = option(SchedulerConfig.burst_wait_s * 1e3, "how long a forward waits for the rest of a "
                                  "burst (frames the predecessor sent together) after its latest frame came, at most "
                                  f"{SchedulerConfig.burst_span_s * 1e3:.0f} ms after its first (0: never)")
    verify_cache_mb: int = option(CACHE_BYTES >> 20, "slices loaded for audits' replays are kept while their weights "
                                  "fit this (the one in use always)")
    # shard-coord serve --local-nodes passes its own pid: a gateway killed with SIGKILL
    # cannot stop its children, which otherwise retried the gone coordinator forever.
    exit_with_parent_pid: int = option(0, "exit once this process' parent is no longer this pid (0 = never)")

    def __post_init__(self) -> None:
        if self.max_open_jobs < 0:
            raise ValueError(f"max_open_jobs must be >= 0 (0: the coordinator's), got {self.max_open_jobs}")
        if self.verify_cache_mb < 0:
            raise ValueError(f"verify_cache_mb must be >= 0 (0: keep only the slice in use), got {self.verify_cache_mb}")

    def scheduler_config(self) -> SchedulerConfig:
        """How this node's stage batches the frames waiting at it (shard.stage_scheduler)."""
        return SchedulerConfig(token_budget=self.batch_token_budget, piece_rows=self.prefill_piece_tokens,
                               prefill_order=self.prefill_order, burst_wait_s=self.burst_wait_ms / 1e3)


# measure_compute's rounds (one prefill, four decodes each) and the pause between them.
MEASURE_ROUNDS, MEASURE_PAUSE_S = 12, 0.02


def load_stage(config: NodeConfig, store: ModelStore, r: LayerRange) -> Stage:
    """Layers `r` of `store` (and the embedding with layer 0) as a Stage under the node's
    dtype, device and quantisation. Blocking: run it in a worker thread."""
    dtype = COMPUTE_DTYPES[config.dtype]
    weights = store.load_layers(r, dtype, config.device)
    # The head stage's embedding is copied out of its file mapping: looked up row by row,
    # mapped pages became resident as token ids were first seen, so RSS grew with the
    # variety of tokens (+110 MB of SmolLM2's after a flood of random ids, bench_hostile,
    # issue 20) and the first use of a token paid a page fault. Like every layer's weights
    # (packed at load), it is resident from the start now: RSS is what the node will hold.
    embedding = store.load_embedding(dtype, config.device).clone() if r.start == 0 else None
    stage = Stage(store.config, r, weights, dtype=dtype, device=config.device, embedding=embedding)
    return quantise_stage(stage, scheme(config.quant))


def worker_config(config: NodeConfig, store: ModelStore, a: Assignment, r: LayerRange) -> WorkerConfig:
    """What the worker of stage assignment `a` (layers `r`) runs under: the wire's dtypes,
    the model's context, the node's K/V budget and the jobs held at once (the coordinator's
    need under the node's own ceiling, open_jobs_cap)."""
    return WorkerConfig(wire_dtype=a.wire_dtype, aux_dtype=a.aux_dtype, is_tail=a.successor is None,
                        max_context_tokens=store.config.max_context_tokens, job_idle_timeout_s=config.job_idle_timeout_s,
                        max_kv_bytes=node_kv_bytes(config, store, r),
                        max_open_jobs=open_jobs_cap(config.max_open_jobs, a.max_open_jobs))


def measure_compute(store: ModelStore, dtype: torch.dtype, device: str, quant: QuantScheme = NONE) -> tuple[float, float]:
    """(decode seconds per layer per token, prefill seconds per layer per token), measured
    on layer 0 of this model under `quant`: a short self-benchmark run once at start-up."""
    from shard.kvcache import KVCache

    cfg = store.config
    r = LayerRange(0, 1)
    # A node that joined with no weights times random weights of layer 0's shapes: a forward's
    # time does not depend on the values.
    weights = (store.load_layers(r, dtype, device) if (store.root / layer_file(0)).exists() else
               {0: {n: torch.randn(s, dtype=dtype, device=device) * 0.02 for n, s in layer_tensor_shapes(cfg, 0).items()}})
    stage = quantise_stage(Stage(cfg, r, weights, dtype=dtype, device=device), quant)
    cache = KVCache(1, cfg.num_kv_heads, cfg.head_dim, dtype, 1 << 30, device)
    job = cache.open("bench", 512)
    x = torch.randn(128, cfg.hidden_size, dtype=dtype)

    # On one CPU thread, the measuring thread's CPU time: a run descheduled on a loaded box
    # (a 6 ms prefill rarely ran unpreempted at load 7 on 2 cores: 47-340 us per token
    # in wall time) does not read as a slower node. Torch's own threads would not be in
    # it, nor a GPU's work, so with those it is wall time.
    clock = time.thread_time if device == "cpu" and torch.get_num_threads() == 1 else time.perf_counter

    def timed(t: int) -> float:
        t0 = clock()
        stage.forward(job, x[:t], ctx_len=0 if t > 1 else 128, positions=torch.arange(t) + (0 if t > 1 else 128))
        return clock() - t0

    timed(128)
    # The minimum, not the median: other processes only ever add time, so the fastest run
    # is the best estimate of what this node can do. The runs are spread over ~0.3 s, as
    # rounds of one prefill and four decodes with a pause between: nodes started together
    # load and measure at once, and a minimum over a few ms of back-to-back runs read the
    # contention of that moment (three local-ring nodes measuring together on 2 cores:
    # decode 0.51-1.47 ms per layer, prefill 47-174 us per token, one machine).
    prefill, decode = math.inf, math.inf
    for _ in range(MEASURE_ROUNDS):
        prefill = min(prefill, timed(128) / 128)
        decode = min(decode, *(timed(1) for _ in range(4)))
        time.sleep(MEASURE_PAUSE_S)
    return decode, prefill
