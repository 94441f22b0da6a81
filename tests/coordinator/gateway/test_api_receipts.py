"""The receipt bundle by the response's id, and the coordinator's key at /v1/receipts/key (issue 23)."""

from __future__ import annotations

from types import SimpleNamespace

from coordinator.gateway.api import create_app
from receipts.keys import NodeKey
from tests.coordinator.gateway.test_api_http import CHAT, COMPLETIONS, HELLO, asgi


def test_the_bundle_is_found_by_the_response_id_and_the_key_is_served(scripted):
    # Bug guarded: receipts were fetched by shard.job_id only, while the response's `id`
    # (what a client keeps) answered 404; the coordinator's public key was nowhere to be
    # had, so `shard-receipts verify` could not check the signer. Sound: the fake engine
    # keeps one bundle per job id it named; any other id must still 404.
    engine = scripted(["ok"])
    key = NodeKey.generate()
    engine.receipts = SimpleNamespace(key=key)
    bundles = {}
    opened = engine.open_job

    async def open_job(prompt_ids, params):
        job = await opened(prompt_ids, params)
        job.job_id = f"{len(bundles):016x}"
        bundles[job.job_id] = {"job_id": job.job_id}
        return job

    engine.open_job, engine.bundle = open_job, bundles.get

    async def fn(c):
        chat = (await c.post(CHAT, json={"model": "scripted", "messages": HELLO})).json()
        comp = (await c.post(COMPLETIONS, json={"model": "scripted", "prompt": "x"})).json()
        return (chat, comp, [await c.get(f"/v1/receipts/{r['id']}") for r in (chat, comp)],
                await c.get("/v1/receipts/cmpl-ffff"), await c.get("/v1/receipts/key"))

    chat, comp, found, missing, served_key = asgi(create_app(engine), fn)
    assert chat["id"] == "chatcmpl-0000000000000000" and comp["id"] == "cmpl-0000000000000001"
    assert [r.json() for r in found] == [{"job_id": "0000000000000000"}, {"job_id": "0000000000000001"}]
    assert missing.status_code == 404
    assert served_key.json() == {"coordinator_public_key": key.public_bytes().hex(), "algorithm": "Ed25519"}


def test_no_key_without_receipts(scripted):
    r = asgi(create_app(scripted(["ok"])), lambda c: c.get("/v1/receipts/key"))
    assert r.status_code == 404 and r.json()["error"]["code"] == "receipts_off"
