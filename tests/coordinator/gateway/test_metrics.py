"""Prometheus metrics (coordinator.gateway.metrics) and the status page's window
(coordinator.gateway.status_page, coordinator.gateway.metering): names, and that they move."""

from __future__ import annotations

import dataclasses
import functools
import re

import httpx
import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from coordinator.gateway.api import ApiConfig
from coordinator.gateway.metering import JobRecord, drafted_rounds
from coordinator.gateway.metrics import GatewayMetrics, route_of
from coordinator.gateway.operator import create_gateway
from coordinator.gateway.status_page import window_summary
from shard.wire.messages import Forward, Result

HELLO = [{"role": "user", "content": "hello"}]
# The names the issue asks for, as Prometheus exposes them (counters end in _total).
EXPECTED = {
    "shard_http_requests_total", "shard_generated_tokens_total", "shard_prompt_tokens_total", "shard_jobs_total",
    "shard_time_to_first_token_seconds", "shard_inter_token_latency_seconds", "shard_jobs_running",
    "shard_jobs_waiting", "shard_traversals_total", "shard_traversal_tokens_total", "shard_traversal_seconds_total",
    "shard_tokens_per_traversal",
    "shard_ring_traversal_seconds", "shard_ring_transport_seconds", "shard_stage_compute_seconds",
    "shard_hop_latency_seconds", "shard_hop_round_send_seconds", "shard_receipt_failures_total",
    "shard_audits_total", "shard_audit_evidence_total", "shard_api_key_refusals_total", "shard_ring_ready",
    "shard_hop_transfer_seconds", "shard_hop_path", "shard_jobs_queued", "shard_job_slots_in_use",
}


def scrape(client_get) -> dict[str, float]:
    """`name{labels}` -> value for every sample of a /metrics body."""
    out = {}
    for family in text_string_to_metric_families(client_get("/metrics").text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def asgi_calls(app, fn):
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await fn(client)

    return trio.run(main)


def test_metric_names_are_present_and_move_after_a_request(scripted):
    # Bug guarded: a metric the issue names missing, misnamed against Prometheus's
    # conventions, or never fed. Sound: the exposition is parsed by prometheus_client's own
    # parser; every counter asked for moves by exactly what one request did.
    engine = scripted([" one", " two", " three"])
    engine.info = lambda: {"ready": True, "members": [{"layers": [0, 2]}, {"layers": [2, 5]}], "epoch": 3,
                           "rings": [{"ring_id": 0}, {"ring_id": 1}], "jobs_moved": 2,
                           "prefix_cache": {"hits": 5, "tokens_reused": 600, "sources": 3, "tokens": 900},
                           "topology": {"plan": {"hops": [{"latency_s": 0.01, "latency_estimated": False,
                                                           "round_send_s": 0.001, "path": p}
                                                          for p in ("direct", "relayed", None)]}}}
    metrics = GatewayMetrics()
    app = create_gateway(engine, ApiConfig(), metrics=metrics,
                         trust=lambda: {"audits": {"audits": 4, "evidence": 1, "frames_compared": 9,
                                                    "by_members": 3, "by_verifiers": 1, "skipped_no_verifier": 2}})

    async def fn(client):
        first = await client.get("/metrics")
        before = scrape_text(first)
        r = await client.post("/v1/chat/completions", json={"model": "scripted", "messages": HELLO, "max_tokens": 40})
        refused = await client.post("/v1/chat/completions", json={"model": "nope", "messages": HELLO})
        after = scrape_text(await client.get("/metrics"))
        return first, before, r.json(), refused.status_code, after

    first, before, body, refused, after = asgi_calls(app, fn)
    assert first.headers["content-type"].startswith("text/plain")
    # Declared (HELP and TYPE) from the start, before any series of a labelled one exists.
    names = set(re.findall(r"^# TYPE (\S+) ", first.text, re.M))
    assert EXPECTED <= names, EXPECTED - names
    tokens = len(engine.ids(" one two three"))
    assert body["usage"]["completion_tokens"] == tokens and refused == 404
    moved = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert moved['shard_http_requests_total{route="/v1/chat/completions",status="200"}'] == 1
    assert moved['shard_http_requests_total{route="/v1/chat/completions",status="404"}'] == 1
    assert moved["shard_generated_tokens_total"] == tokens
    assert moved["shard_prompt_tokens_total"] == body["usage"]["prompt_tokens"]
    assert moved['shard_jobs_total{outcome="ok"}'] == 1
    assert moved["shard_time_to_first_token_seconds_count"] == 1
    # One observation per token after the first block's: the inter-token histogram counts tokens.
    assert moved["shard_inter_token_latency_seconds_count"] == tokens - len(engine.ids(" one"))
    assert after["shard_jobs_running"] == 0 and after["shard_jobs_waiting"] == 0
    assert after["shard_ring_stages"] == 2 and after["shard_ring_epoch"] == 3
    assert after["shard_rings"] == 2 and after["shard_jobs_moved"] == 2  # replica rings (issue 21)
    assert after['shard_hop_latency_seconds{estimated="0",hop="2"}'] == 0.01
    assert after["shard_audits_total"] == 4 and after["shard_audit_evidence_total"] == 1
    # Who recomputed audits (issue 20: stages audit each other on rings with no verifier role).
    assert after['shard_audit_recomputations_total{by="member"}'] == 3
    assert after['shard_audit_recomputations_total{by="verifier"}'] == 1
    assert after['shard_audit_recomputations_total{by="gateway"}'] == 0
    assert after['shard_audits_skipped_total{reason="no_verifier"}'] == 2
    # The prefix cache as /v1/ring reports it (coordinator.jobs.prefix_cache).
    assert after["shard_prefix_forks_total"] == 5 and after["shard_prefix_tokens_reused_total"] == 600
    assert after["shard_prefix_sources"] == 3 and after["shard_prefix_source_tokens"] == 900
    # Each hop's path as /v1/ring reports it; a hop with no path yet has no series.
    assert after['shard_hop_path{hop="0",path="direct"}'] == 1 and after['shard_hop_path{hop="1",path="relayed"}'] == 1
    assert not [k for k in after if k.startswith("shard_hop_path{") and 'hop="2"' in k]


def scrape_text(response) -> dict[str, float]:
    return scrape(lambda path: response)


def test_queued_requests_and_slots_in_use_are_exported(scripted):
    # Bug guarded (issue 23: "active and queued jobs"): requests waiting in the gateway's
    # queue invisible to Prometheus. Sound: with one slot and the first job held by its
    # gate, the second request must wait in the queue while the scrape is taken; once the
    # gate opens both finish and the gauges return to 0.
    engine = scripted([" one", " two"])
    engine.gate = trio.Event()
    app = create_gateway(engine, ApiConfig(max_concurrent_jobs=1, max_queued_jobs=4), metrics=GatewayMetrics())
    body = {"model": "scripted", "prompt": "hi", "max_tokens": 40}

    async def fn(client):
        statuses = []

        async def post():
            statuses.append((await client.post("/v1/completions", json=body)).status_code)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(post)
            nursery.start_soon(post)
            await trio.testing.wait_all_tasks_blocked()
            during = scrape_text(await client.get("/metrics"))
            engine.gate.set()
        return statuses, during, scrape_text(await client.get("/metrics"))

    statuses, during, after = asgi_calls(app, fn)
    assert statuses == [200, 200]
    assert during["shard_job_slots_in_use"] == 1 and during["shard_jobs_queued"] == 1
    assert after["shard_job_slots_in_use"] == 0 and after["shard_jobs_queued"] == 0


def test_generated_tokens_count_as_delivered_and_once_for_a_failed_job(scripted):
    # Bug guarded: shard_generated_tokens_total counted a job's tokens only when it ended,
    # so a scrape during a long generation read 0 for it; counting them as they come must
    # not count them again at the end, and a job that fails after some blocks counts what
    # it delivered. Sound: the scripted engine's gate holds the job after its first block
    # while the scrape is taken (its one block delivered, the job running); the job then
    # fails at its third block, so exactly two blocks' tokens were delivered.
    engine = scripted([" one", " two", " three"], fail_after=2)
    engine.gate = trio.Event()
    app = create_gateway(engine, ApiConfig(), metrics=GatewayMetrics())
    body = {"model": "scripted", "prompt": "hi", "max_tokens": 40, "stream": True}

    async def fn(client):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(client.post, "/v1/completions", json=body))
            await trio.testing.wait_all_tasks_blocked()
            during = scrape_text(await client.get("/metrics"))
            engine.gate.set()
        return during, scrape_text(await client.get("/metrics"))

    during, after = asgi_calls(app, fn)
    assert during["shard_jobs_running"] == 1 and during["shard_generated_tokens_total"] == len(engine.ids(" one"))
    assert after['shard_jobs_total{outcome="error"}'] == 1
    assert after["shard_generated_tokens_total"] == len(engine.ids(" one")) + len(engine.ids(" two"))

def test_two_gateways_keep_their_own_registries(scripted):
    # Bug guarded: metrics on the global registry, where a second app in one process (tests,
    # a restart in-process) raises "Duplicated timeseries" or mixes counts. Sound: both
    # build, and a request to one leaves the other's counters where they were.
    a, b = GatewayMetrics(), GatewayMetrics()
    app_a = create_gateway(scripted([" x"]), metrics=a)
    create_gateway(scripted([" x"]), metrics=b)
    asgi_calls(app_a, lambda c: c.post("/v1/completions", json={"model": "scripted", "prompt": "hi", "max_tokens": 2}))
    assert a.generated_tokens._value.get() == 2 and b.generated_tokens._value.get() == 0


def test_ring_observer_times_each_round_and_each_stage():
    # Bug guarded: traversal time taken from the wrong round (pipelined rounds overlap) or
    # compute attributed to the wrong stage. Sound: a round's time is its own send to its
    # own Result; per-stage compute comes from the Result's per-stage times.
    m = GatewayMetrics()
    for rnd, phase in ((1, "prefill"), (2, "verify")):
        m.round_sent(_forward("job", rnd, phase))
    m.result_arrived(_result("job", 2, (0.002, 0.003)))
    m.result_arrived(_result("job", 1, (0.004, 0.005)))
    m.result_arrived(_result("job", 9, (0.001,)))  # never sent (another gateway's): compute only
    assert _count(m, "shard_ring_traversal_seconds", {"phase": "prefill"}) == 1
    assert _count(m, "shard_ring_traversal_seconds", {"phase": "verify"}) == 1
    assert _count(m, "shard_stage_compute_seconds", {"stage": "0"}) == 3
    assert _count(m, "shard_stage_compute_seconds", {"stage": "1"}) == 2
    assert m.registry.get_sample_value("shard_stage_compute_seconds_sum", {"stage": "1"}) == 0.008
    assert _count(m, "shard_ring_transport_seconds", {}) == 2


def test_ring_observer_splits_each_frame_into_its_hops():
    # Bug guarded: transfer attributed to the wrong hop, or a frame whose stamps do not fit
    # its ring (a stage that does not stamp) producing figures. Sound: stamps are made up
    # with known gaps per hop and the histogram's sums are those gaps; the clamp at 0 shows
    # on a hop whose receiver's clock runs behind.
    m = GatewayMetrics()
    m.round_sent(_forward("job", 1, "decode"))
    sent_at = m._sent[("job", 1)][2]
    # coordinator -> s0 5 ms, s0 computes 2 ms, s0 -> s1 30 ms, s1 computes 1 ms, s1 -> coordinator.
    clock = (sent_at + 0.005, sent_at + 0.007, sent_at + 0.037, sent_at + 0.038)
    m.result_arrived(_result("job", 1, (0.002, 0.001), clock))
    sums = [m.registry.get_sample_value("shard_hop_transfer_seconds_sum", {"hop": str(i), "phase": "decode"})
            for i in range(3)]
    # Unix-time stamps hold ~0.2 µs: compared to 1 µs.
    assert sums[0] == pytest.approx(0.005, abs=1e-6) and sums[1] == pytest.approx(0.030, abs=1e-6) and 0 <= sums[2] < 1.0
    assert m.hops.summary()[1] == {"transfer_s": {"decode": pytest.approx(0.030, abs=1e-6), "prefill": None},
                                   "frames": {"decode": 1, "prefill": 0}}
    m.round_sent(_forward("job", 2, "decode"))
    m.result_arrived(_result("job", 2, (0.002, 0.001), clock[:3]))  # one stamp short: no hop figures
    m.round_sent(_forward("job", 3, "prefill"))
    m.result_arrived(_result("job", 3, (0.002, 0.001), (clock[0] - 10, *clock[1:])))  # s0's clock 10 s behind
    assert _count(m, "shard_hop_transfer_seconds", {"hop": "0", "phase": "decode"}) == 1
    assert m.registry.get_sample_value("shard_hop_transfer_seconds_sum", {"hop": "0", "phase": "prefill"}) == 0.0
    assert m.hops.summary()[0]["transfer_s"]["prefill"] < -9  # /v1/ring reports it as measured


def test_hops_are_corrected_by_the_ring_stages_clock_offsets_and_the_offsets_are_gauges():
    # Bug guarded: a stage's clock offset applied to the wrong stage or to another ring's
    # frames, or the estimate missing from /metrics. Sound: s1's stamps are made 7 s ahead
    # and its offset is given for epoch 1 only; the epoch-2 frame must stay uncorrected.
    m = GatewayMetrics()
    clocks = {"s0": {"offset_s": 0.0, "uncertainty_s": 0.001}, "s1": {"offset_s": 7.0, "uncertainty_s": 0.002}}
    m.set_sources(lambda: {"topology": {"clocks": clocks}}, dict,
                  clock_offsets=lambda epoch: (0.0, 7.0) if epoch == 1 else None)
    m.round_sent(_forward("job", 1, "decode"))
    sent_at = m._sent[("job", 1)][2]
    clock = (sent_at + 0.005, sent_at + 0.007, sent_at + 7.037, sent_at + 7.038)  # s1 7 s ahead
    m.result_arrived(_result("job", 1, (0.002, 0.001), clock))
    assert [h["transfer_s"]["decode"] for h in m.hops.summary()[:2]] == [pytest.approx(0.005, abs=1e-6),
                                                                          pytest.approx(0.030, abs=1e-6)]
    fwd = dataclasses.replace(_forward("job", 2, "decode"), epoch=2)
    m.round_sent(fwd)
    m.result_arrived(dataclasses.replace(_result("job", 2, (0.002, 0.001), clock), epoch=2))
    assert m.hops.summary()[1]["transfer_s"]["decode"] == pytest.approx(7.030, abs=1e-5)  # another ring: no offsets
    assert m.registry.get_sample_value("shard_node_clock_offset_seconds", {"peer": "s1"}) == 7.0
    assert m.registry.get_sample_value("shard_node_clock_offset_uncertainty_seconds", {"peer": "s1"}) == 0.002


def _count(m, name, labels):
    return m.registry.get_sample_value(name + "_count", labels)


def _forward(job, rnd, phase):
    import torch

    return Forward(job_id=job, epoch=1, round=rnd, nonce=b"\0" * 16, phase=phase, ctx_len=0,
                   positions=torch.zeros(1, dtype=torch.int64), tokens=torch.zeros(1, dtype=torch.int64))


def _result(job, rnd, compute, clock=()):
    import torch

    return Result(job_id=job, epoch=1, round=rnd, hidden=torch.zeros(1, 4), compute_s=compute, clock_s=clock)


def test_route_labels_are_bounded():
    # Bug guarded: a label per requested path, so a scanner creates unbounded series.
    assert route_of("/v1/receipts/abc123") == "/v1/receipts" and route_of("/v1/models/x/y") == "/v1/models"
    assert route_of("/wp-login.php") == "other" and route_of("/static/status.js") == "/static"


def test_drafted_rounds_counts_the_undrafted_rounds_as_none():
    # Sound: 5 traversals, 3 drafted by ngram committing 7 tokens; the other 2 (the prefill
    # among them) committed the rest of the 10 tokens.
    stats = {"traversals": 5, "draft_rounds": {"ngram": 3}, "draft_round_tokens": {"ngram": 7},
             "traversal_s_by_drafter": {"ngram": 0.5, "none": 0.25}}
    assert drafted_rounds(stats, 10) == {"ngram": (3, 7, 0.5), "none": (2, 3, 0.25)}
    assert drafted_rounds({"engine": "local"}, 10) == {}


def _job(ended_at, tokens=10, ttft=0.1, traversals=5, error=None):
    return JobRecord(ended_at=ended_at, prompt_tokens=3, tokens=tokens, ttft_s=ttft, duration_s=1.0,
                     traversals=traversals, drafted={"ngram": (traversals, tokens, traversals * 0.01)}, error=error)


def test_window_summary_counts_only_the_window_and_divides_by_the_time_it_covers():
    # Bug guarded: old jobs kept in the rates, or a young gateway's rate divided by the
    # whole window. Sound: the arithmetic is done by hand for three jobs.
    jobs = [_job(1000.0 - 400), _job(1000.0 - 100, tokens=30, ttft=0.3, traversals=10), _job(1000.0 - 5, error="x")]
    full = window_summary(jobs, 1000.0, window_s=300, bucket_s=10)
    assert full["requests"] == 2 and full["failed"] == 1 and full["tokens"] == 40
    assert full["tokens_per_s"] == 40 / 300 and full["tokens_per_traversal"] == 40 / 15
    assert full["ttft_s"] == {"median": 0.2, "p90": 0.3}
    assert full["drafters"]["ngram"] == {"traversals": 15, "tokens": 40, "tokens_per_traversal": 40 / 15,
                                         "traversal_s": pytest.approx(0.01)}
    assert len(full["series"]) == 30 and sum(b["requests"] for b in full["series"]) == 2
    assert full["series"][-1]["requests"] == 1 and full["series"][-1]["ago_s"] == 0
    young = window_summary(jobs, 1000.0, window_s=300, bucket_s=10, since=1000.0 - 120)
    assert young["tokens_per_s"] == 40 / 120
