"""Prometheus metrics for the gateway, on a registry of its own (two apps in one process,
as in tests, never share or collide), served as text at GET /metrics.

Three feeds, each where the fact is first known: the HTTP tap (`HttpTap`: every response's
route and status, refusals by keys included), the job watcher (coordinator.gateway.metering:
TTFT, inter-token latency, tokens, traversals per drafter, receipt failures), and a
RingObserver handed to open_coordinator (each round's traversal from send to the tail's
Result, each stage's compute from the Result's per-stage times, the rest of the traversal
as transport, and each hop's transfer from the stages' clock stamps: hop_times.py). The
ring's state, each hop's path and the audit counts are read at scrape time from
`engine.info()` and a trust report. Does not decide anything, and knows no engine
internals beyond those dicts.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coordinator.gateway.hop_times import HopWindow, hop_transfers_s, with_measured_hops
from coordinator.gateway.metering import JobRecord
from shard.ring_observer import RingObserver
from shard.wire.messages import Forward, Result

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKENS_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
# Rounds sent whose Result has not come (a ring lost mid-round): the oldest are forgotten.
MAX_ROUNDS_IN_FLIGHT = 4096
# Route labels are the gateway's own paths; anything else is "other" (a scanner probing
# random paths must not create a time series per path).
ROUTES = frozenset({"/", "/metrics", "/health", "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/ring",
                    "/v1/status"})
ROUTE_PREFIXES = ("/v1/models", "/v1/receipts", "/static")  # routes with a path parameter


def route_of(path: str) -> str:
    if path in ROUTES:
        return path
    return next((p for p in ROUTE_PREFIXES if path.startswith(p + "/")), "other")


class GatewayMetrics(RingObserver):
    """Every gateway metric, on `self.registry`. Pass it to open_coordinator as its observer
    and to the gateway as a job watcher; `set_sources` names what scrapes read."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.http_requests = Counter("shard_http_requests", "HTTP responses by route and status",
                                     ["route", "status"], registry=r)
        self.key_refusals = Counter("shard_api_key_refusals", "requests refused by API keys and their limits",
                                    ["reason"], registry=r)
        self.prompt_tokens = Counter("shard_prompt_tokens", "prompt tokens of the jobs opened", registry=r)
        self.generated_tokens = Counter("shard_generated_tokens", "tokens the engine committed, counted as each "
                                        "block is delivered (a block that crosses a stop string counts whole)",
                                        registry=r)
        self.jobs = Counter("shard_jobs", "jobs ended, by outcome", ["outcome"], registry=r)
        self.ttft = Histogram("shard_time_to_first_token_seconds", "job opened to its first committed token "
                              "(prefill traversal included)", buckets=TTFT_BUCKETS_S, registry=r)
        self.inter_token = Histogram("shard_inter_token_latency_seconds", "gap before a block divided by its tokens, "
                                     "observed once per token", buckets=LATENCY_BUCKETS_S, registry=r)
        self.running = Gauge("shard_jobs_running", "jobs producing tokens", registry=r)
        self.waiting = Gauge("shard_jobs_waiting", "jobs opened and waiting for their first token (prefill)",
                             registry=r)
        self.traversals = Counter("shard_traversals", "ring traversals committed, by drafter family (none: "
                                  "no draft, the prefill's included)", ["drafter"], registry=r)
        self.traversal_tokens = Counter("shard_traversal_tokens", "tokens those traversals committed", ["drafter"],
                                        registry=r)
        self.traversal_seconds = Counter("shard_traversal_seconds", "seconds those traversals took, each from its "
                                         "send to its result (÷ shard_traversals_total: the mean)", ["drafter"],
                                         registry=r)
        self.tokens_per_traversal = Histogram("shard_tokens_per_traversal", "a job's mean tokens per traversal, "
                                              "per drafter family", ["drafter"], buckets=TOKENS_BUCKETS, registry=r)
        self.traversal_s = Histogram("shard_ring_traversal_seconds", "a round from send to the tail's Result, "
                                     "by frame phase (verify: carries a draft)", ["phase"], buckets=LATENCY_BUCKETS_S,
                                     registry=r)
        self.transport_s = Histogram("shard_ring_transport_seconds", "a round's traversal less its stages' compute: "
                                     "every hop's transfer together", buckets=LATENCY_BUCKETS_S, registry=r)
        self.stage_compute_s = Histogram("shard_stage_compute_seconds", "a stage's compute for one frame, by its "
                                         "index in the ring", ["stage"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.hop_transfer_s = Histogram("shard_hop_transfer_seconds", "a frame's transfer over one hop of the ring "
                                        "(0: coordinator to head, last: tail to coordinator), sender's hand-off to "
                                        "receiver's take-in by their wall clocks, each node's corrected by its estimated offset "
                                        "(shard_node_clock_offset_seconds), clamped at 0", ["hop", "phase"],
                                        buckets=LATENCY_BUCKETS_S, registry=r)
        self.lm_head_s = Histogram("shard_lm_head_seconds", "the coordinator's final norm and LM head over a batch",
                                   buckets=LATENCY_BUCKETS_S, registry=r)
        self.receipt_failures = Counter("shard_receipt_failures", "jobs failed closed by a receipt check, by check",
                                        ["check"], registry=r)
        self._sent: OrderedDict[tuple[str, int], tuple[float, str, float]] = OrderedDict()  # monotonic, phase, wall
        self.hops = HopWindow()
        self._ring_info: Callable[[], dict[str, Any]] = dict
        self._trust: Callable[[], dict[str, Any]] = dict
        self._slots: Any = None  # the API's JobQueue (coordinator.gateway.job_queue), when known
        self._clock_offsets: Callable[[int], Sequence[float] | None] = lambda epoch: None
        r.register(_ScrapeCollector(self))

    def set_sources(self, ring_info: Callable[[], dict[str, Any]], trust: Callable[[], dict[str, Any]],
                    slots: Any = None, clock_offsets: Callable[[int], Sequence[float] | None] | None = None) -> None:
        """What a scrape reads: the engine's info(), the trust report and the API's job slots;
        `clock_offsets(epoch)`: that ring's stages' clock offsets (RingEngine.clock_offsets_s)
        that hop times correct stamps by (None: an engine without stages, none to correct)."""
        self._ring_info, self._trust, self._slots = ring_info, trust, slots
        self._clock_offsets = clock_offsets or (lambda epoch: None)

    def ring_info(self) -> dict[str, Any]:
        """The engine's info with each plan hop's measured transfer (GET /v1/ring)."""
        return with_measured_hops(self._ring_info() or {}, self.hops)

    # -- JobWatcher -----------------------------------------------------------------------------
    def job_opened(self) -> None:
        self.waiting.inc()

    def first_token(self, ttft_s: float, tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.waiting.dec()
        self.running.inc()
        self.generated_tokens.inc(tokens)

    def block(self, tokens: int, gap_s: float) -> None:
        for _ in range(tokens):
            self.inter_token.observe(gap_s / tokens)
        self.generated_tokens.inc(tokens)

    def job_ended(self, record: JobRecord) -> None:  # its tokens were counted as they came (first_token, block)
        (self.running if record.ttft_s is not None else self.waiting).dec()
        self.prompt_tokens.inc(record.prompt_tokens)
        self.jobs.labels("error" if record.error else "ok").inc()
        for family, (rounds, tokens, seconds) in record.drafted.items():
            self.traversals.labels(family).inc(rounds)
            self.traversal_tokens.labels(family).inc(tokens)
            self.traversal_seconds.labels(family).inc(seconds)
            if rounds:
                self.tokens_per_traversal.labels(family).observe(tokens / rounds)
        if record.receipt_check is not None:
            self.receipt_failures.labels(record.receipt_check).inc()

    # -- RingObserver (trio thread; logits_computed: a worker thread) ---------------------------
    def round_sent(self, fwd: Forward) -> None:
        self._sent[(fwd.job_id, fwd.round)] = (time.monotonic(), fwd.phase, time.time())
        while len(self._sent) > MAX_ROUNDS_IN_FLIGHT:
            self._sent.popitem(last=False)

    def result_arrived(self, result: Result) -> None:
        sent = self._sent.pop((result.job_id, result.round), None)
        for i, s in enumerate(result.compute_s):
            self.stage_compute_s.labels(str(i)).observe(s)
        if sent is None:
            return
        traversal_s = time.monotonic() - sent[0]
        self.traversal_s.labels(sent[1]).observe(traversal_s)
        self.transport_s.observe(max(0.0, traversal_s - sum(result.compute_s)))
        hops = hop_transfers_s(sent[2], result.clock_s, time.time(), len(result.compute_s),
                               self._clock_offsets(result.epoch))
        if hops is not None:
            self.hops.add(result.epoch, sent[1], hops)
            for i, hop_s in enumerate(hops):
                self.hop_transfer_s.labels(str(i), sent[1]).observe(max(0.0, hop_s))

    def logits_computed(self, seconds: float) -> None:
        self.lm_head_s.observe(seconds)

    async def endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class _ScrapeCollector(Collector):
    """The ring's state and the audits' counts, read when Prometheus scrapes."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list:
        return []  # the families depend on the sources; nothing to check at registration

    def collect(self) -> Iterator[Any]:
        info = self.metrics._ring_info() or {}
        yield _gauge("shard_ring_ready", "1 when a ring is formed", int(bool(info.get("ready"))))
        yield _gauge("shard_ring_epoch", "the current ring's epoch (0: none)", info.get("epoch") or 0)
        yield _gauge("shard_ring_stages", "stages in the current ring", len(info.get("members") or ()))
        yield _gauge("shard_rings", "rings formed over disjoint nodes (--max-rings)", len(info.get("rings") or ()))
        yield _gauge("shard_jobs_moved", "jobs routed to another ring because theirs broke", info.get("jobs_moved") or 0)
        yield _gauge("shard_registered_nodes", "nodes registered with the coordinator", info.get("registered_nodes") or 0)
        slots = self.metrics._slots
        if slots is not None:
            yield _gauge("shard_job_slots_in_use", "job slots held by running requests (one per choice; "
                         "--max-concurrent-jobs)", slots.in_use)
            yield _gauge("shard_jobs_queued", "requests waiting in the gateway's queue for job slots "
                         "(--max-queued-jobs)", slots.waiting)
        prefix = info.get("prefix_cache") or {}  # coordinator.jobs.prefix_cache
        yield _counter("shard_prefix_forks", "jobs started from a kept job's K/V (prefix cache hits)", prefix.get("hits", 0))
        yield _counter("shard_prefix_tokens_reused", "prompt tokens those forks did not compute again",
                       prefix.get("tokens_reused", 0))
        yield _gauge("shard_prefix_sources", "finished jobs whose K/V the stages keep for later prompts",
                     prefix.get("sources", 0))
        yield _gauge("shard_prefix_source_tokens", "tokens those sources hold (--prefix-cache-tokens)", prefix.get("tokens", 0))
        plan = (info.get("topology") or {}).get("plan") or {}
        hop_latency = GaugeMetricFamily("shard_hop_latency_seconds", "one-way latency of each hop of the ring "
                                        "(probe-measured; estimated=1 where no probe ran)", labels=["hop", "estimated"])
        hop_send = GaugeMetricFamily("shard_hop_round_send_seconds", "predicted time to put one decode round on "
                                     "each hop at its sender's measured upload", labels=["hop"])
        for i, hop in enumerate(plan.get("hops") or ()):
            hop_latency.add_metric([str(i), str(int(bool(hop.get("latency_estimated"))))], hop.get("latency_s") or 0.0)
            hop_send.add_metric([str(i)], hop.get("round_send_s") or 0.0)
        yield hop_latency
        yield hop_send
        yield hop_paths(plan.get("hops") or ())
        yield from clock_offsets((info.get("topology") or {}).get("clocks") or {})
        trust = self.metrics._trust() or {}
        audits = trust.get("audits") or {}
        yield _counter("shard_audits", "stage audits done (replayed and compared)", audits.get("audits", 0))
        yield _counter("shard_audit_frames", "frames audits compared", audits.get("frames_compared", 0))
        skipped = CounterMetricFamily("shard_audits_skipped", "audits not done, by reason", labels=["reason"])
        skipped.add_metric(["stale"], audits.get("skipped_stale", 0))
        skipped.add_metric(["stage_gone"], audits.get("skipped_gone", 0))
        skipped.add_metric(["no_verifier"], audits.get("skipped_no_verifier", 0))
        skipped.add_metric(["no_prefix"], audits.get("skipped_no_prefix", 0))  # a fork's source unknown
        yield skipped
        # Who recomputed audited slices: verifier-role nodes, other members keeping the slice
        # (a stage auditing another: rings with no verifier role), or this gateway itself.
        by = CounterMetricFamily("shard_audit_recomputations", "audited slices recomputed, by whom", labels=["by"])
        for label, key in (("verifier", "by_verifiers"), ("member", "by_members"), ("gateway", "by_coordinator")):
            by.add_metric([label], audits.get(key, 0))
        yield by
        yield _counter("shard_audit_evidence", "signed evidence records against stages", audits.get("evidence", 0))
        yield _gauge("shard_faulty_nodes", "nodes excluded from rings by audits", len(trust.get("faulty") or ()))


def hop_paths(hops: Iterable[dict[str, Any]]) -> GaugeMetricFamily:
    """1 per hop, labelled by the path its sender's connection crosses ("direct",
    "hole_punched", "relayed"); a hop whose path is not known yet has no sample."""
    family = GaugeMetricFamily("shard_hop_path", "each hop of the ring by the path its sender's connection crosses "
                               "(1: the current path)", labels=["hop", "path"])
    for i, hop in enumerate(hops):
        if hop.get("path"):
            family.add_metric([str(i), str(hop["path"])], 1)
    return family


def clock_offsets(clocks: dict[str, dict[str, Any]]) -> Iterator[GaugeMetricFamily]:
    """Each node's estimated wall-clock offset against the coordinator and its bound
    (coordinator.swarm.clock_offset; /v1/ring's topology.clocks)."""
    offset = GaugeMetricFamily("shard_node_clock_offset_seconds", "a node's wall clock less the coordinator's, "
                               "estimated from its minimum-RTT Ping/Pong", labels=["peer"])
    bound = GaugeMetricFamily("shard_node_clock_offset_uncertainty_seconds", "the bound on that estimate's error "
                              "(half its round trip)", labels=["peer"])
    for peer, clock in sorted(clocks.items()):
        offset.add_metric([peer], clock["offset_s"])
        bound.add_metric([peer], clock["uncertainty_s"])
    yield offset
    yield bound


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class HttpTap:
    """ASGI middleware: counts every response by route and status, and hands an error
    response's message (OpenAI's `error.message`, from at most 8 KiB of body) to `on_error`."""

    MAX_ERROR_BODY_BYTES = 8192

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics,
                 on_error: Callable[[str, str, int, str], None] = lambda method, path, status, message: None) -> None:
        self.app, self.metrics, self.on_error = app, metrics, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status, body = 0, bytearray()

        async def tapped(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                self.metrics.http_requests.labels(route_of(scope["path"]), str(status)).inc()
            elif message["type"] == "http.response.body" and status >= 400 and len(body) < self.MAX_ERROR_BODY_BYTES:
                body.extend(message.get("body", b"")[: self.MAX_ERROR_BODY_BYTES - len(body)])
            await send(message)

        try:
            await self.app(scope, receive, send=tapped)
        finally:
            if status >= 400:
                self.on_error(scope["method"], scope["path"], status, _error_message(bytes(body)))


def _error_message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace")[:200]
