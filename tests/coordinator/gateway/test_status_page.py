"""The status page's JSON (GET /v1/status) and files, over a scripted engine: what the
page's script reads is what the gateway saw."""

from __future__ import annotations

import httpx
import trio

from coordinator.errors import JobFailedError
from coordinator.gateway.operator import create_gateway

HELLO = [{"role": "user", "content": "hello"}]


def calls(app, fn):
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await fn(client)

    return trio.run(main)


def test_status_counts_jobs_and_lists_http_and_job_errors(scripted):
    # Bug guarded: the page showing requests that never ran, or hiding failures (an HTTP
    # refusal, a job that died after its stream began). Sound: one good job, one refused
    # request (404) and one job failed mid-way are each counted once, newest error first.
    engine = scripted([" one", " two"], fail_after=None)
    trust = {"receipts": {"enabled": False}, "audits": None, "faulty": {}}
    app = create_gateway(engine, trust=lambda: trust)

    async def fn(client):
        ok = await client.post("/v1/chat/completions", json={"model": "scripted", "messages": HELLO, "max_tokens": 20})
        await client.post("/v1/chat/completions", json={"model": "other", "messages": HELLO})
        engine.fail_after = 1
        failed = await client.post("/v1/chat/completions", json={"model": "scripted", "messages": HELLO,
                                                                 "max_tokens": 20, "stream": True})
        status = await client.get("/v1/status")
        page, script = await client.get("/"), await client.get("/static/status.js")
        return ok.json(), failed.text, status.json(), page, script

    ok, failed_stream, status, page, script = calls(app, fn)
    assert ok["choices"][0]["message"]["content"] == " one two" and "stage 1 vanished" in failed_stream
    window = status["window"]
    assert window["requests"] == 2 and window["failed"] == 1
    assert window["tokens"] == len(engine.ids(" one two")) + len(engine.ids(" one"))
    assert status["jobs"] == {"running": 0, "waiting": 0, "ended": 2, "failed": 1, "receipt_failures": {}}
    assert [(e["where"], e["status"]) for e in status["errors"]] == [("job", None), ("POST /v1/chat/completions", 404)]
    assert status["errors"][0]["message"] == str(JobFailedError("stage 1 vanished and no standby holds its layers"))
    assert status["errors"][1]["message"] == "The model `other` does not exist or you do not have access to it."
    assert status["trust"] == trust
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/static/status.js">' in page.text and "/v1/status" in script.text
