"""The gateway as `shard-coord serve` runs it: the OpenAI API (coordinator.gateway.api)
over a metered engine, plus the operator's surface: the status page at /, Prometheus
metrics at /metrics, and API keys with per-key limits in front of it all.

Composition only: each piece documents itself. The order of the layers is the point:
the HTTP tap outermost (it counts refusals by keys too), then the key gate, then the
routes (the operator's own, then the API's for everything else).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.routing import Mount, Route
from starlette.types import ASGIApp

from coordinator.gateway.api import ApiConfig, create_app
from coordinator.gateway.auth import KeyGate, KeyLimits
from coordinator.gateway.metering import MeteredEngine
from coordinator.gateway.metrics import GatewayMetrics, HttpTap
from coordinator.gateway.status_page import RecentRequests, status_routes
from coordinator.jobs.engine import Engine

# What the status page's own files need: never a key (they hold no data; the page asks
# for a key when its JSON answers 401).
PAGE_PATHS = frozenset({"/", "/favicon.ico"})
PAGE_PREFIXES = ("/static/",)


def public_paths(config: ApiConfig) -> frozenset[str]:
    """The paths served without a key when keys are on, from the config's flags."""
    paths = set(PAGE_PATHS)
    if config.public_health:
        paths.add("/health")
    if config.public_status:
        paths.update({"/v1/ring", "/v1/status"})
    if config.public_metrics:
        paths.add("/metrics")
    return frozenset(paths)


def create_gateway(engine: Engine, config: ApiConfig = ApiConfig(), *, metrics: GatewayMetrics | None = None,
                   trust: Callable[[], dict[str, Any]] = dict) -> ASGIApp:
    """The whole gateway over `engine`. `metrics`: the one also given to open_coordinator
    as its ring observer (None: a fresh one, ring rounds unobserved); `trust`: the receipt
    and audit report (coordinator.trust.report) for the page and the scrape."""
    metrics = metrics if metrics is not None else GatewayMetrics()
    recent = RecentRequests()
    api = create_app(MeteredEngine(engine, [metrics, recent]), config)
    metrics.set_sources(engine.info, trust, api.state.slots, getattr(engine, "clock_offsets_s", None))  # ring engines only
    routes = [*status_routes(recent, trust, metrics.ring_info), Route("/metrics", metrics.endpoint, methods=["GET"]),
              Mount("", app=api)]
    app = Starlette(routes=routes)
    gate = KeyGate(app, config.api_keys, KeyLimits(config.key_max_concurrent_jobs, config.key_tokens_per_minute),
                   public=public_paths(config), public_prefixes=PAGE_PREFIXES,
                   on_refused=lambda reason: metrics.key_refusals.labels(reason).inc())
    return HttpTap(gate, metrics, on_error=recent.http_error)
