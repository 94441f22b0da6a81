"""The receipts route: GET /v1/receipts/{id} serves the engine's bundle and 404s otherwise.

(Audit planning and batched replay are tested in test_audit_replay.py.)
"""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import trio

from coordinator.gateway.api import create_app


class _Engine(SimpleNamespace):
    """The two things the route reads: model facts for the app, and bundle(job_id)."""

    def info(self):
        return {"ready": True}


def test_receipts_route_serves_bundles_and_404s(tiny_tokenizer):
    engine = _Engine(model_id="m", tokenizer=tiny_tokenizer, max_context_tokens=64, eos_token_ids=frozenset({2}),
                     bundle=lambda job_id: {"job_id": job_id} if job_id == "known" else None)

    async def main():
        app = create_app(engine)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.get("/v1/receipts/known"), await client.get("/v1/receipts/other")

    ok, missing = trio.run(main)
    assert ok.status_code == 200 and ok.json() == {"job_id": "known"}
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "receipts_not_found"
