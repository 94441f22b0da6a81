"""A verifier node's recomputation (shard.verifier) and the auditor's use of it (coordinator.trust.compare).

Guards: a verifier's rows, sent over the wire and split back per frame, must be what the
auditor's own replay gives (else an honest stage would be judged on a different
recomputation than before, and honest verifiers would disagree with each other); a
cheating stage must still fail against them; a verifier must answer every bad request
with a one-line error reply instead of raising (a request is the coordinator's, but a
bug or a missing slice must cost that request, never the node); and the wire messages
must refuse shapes that do not add up before anything reads them.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from types import SimpleNamespace

import pytest
import torch
import trio

from coordinator.trust.audit import AuditPlan
from coordinator.trust.compare import agree, compare, logged_frames, replay_here, split_reply
from receipts import sha256_digest
from ring import PeerId
from shard.errors import WireError
from shard.layers import LayerRange
from shard.manifest import layer_file
from shard.stage import Stage
from shard.stage_worker import StageWorker, WorkerConfig
from shard.store import ModelStore
from shard.verifier import Verifier
from shard.wire.codec import decode, encode, encode_body
from shard.wire.limits import Limits
from shard.wire.verify import TIMING_ERROR, VerifyReply, VerifyRequest, control_limits, is_timing, timing_request
from tests.coordinator.trust.test_audit_replay import engine_like_frames


def logged_job(stage: Stage, wire_dtype: str = "f32", corrupt: bool = False):
    """A stage's logged frames of one job with receipts over them, and the plan auditing it.
    `corrupt`: the stage adds noise to its outputs (and signs them)."""
    frames = engine_like_frames(False, stage.cfg.hidden_size)
    worker = StageWorker(stage, WorkerConfig(wire_dtype=wire_dtype))
    records, receipts = {}, {}
    for f in frames:
        out = worker.process(f)
        if corrupt:
            noise = 0.1 * torch.randn(out.hidden.shape, generator=torch.Generator().manual_seed(f.round))
            out = dataclasses.replace(out, hidden=(out.hidden.float() + noise).to(out.hidden.dtype))
        inp, body = encode_body(f), encode_body(out)
        records[f.round] = (inp, body)
        receipts[f.round] = SimpleNamespace(input_digest=sha256_digest(inp), output_digest=sha256_digest(body))
    plan = AuditPlan("j", 1, PeerId("stage"), stage.layers, False, wire_dtype, None, tuple(records), receipts)
    return plan, records


def request_for(plan, logged, **kw) -> VerifyRequest:
    data = b"".join(logged.input_bytes)
    return VerifyRequest(request_id=7, layer_start=plan.layers.start, layer_end=plan.layers.end, quant=plan.quant,
                         wire_dtype=plan.wire_dtype, frame_bytes=tuple(map(len, logged.input_bytes)),
                         frames=torch.frombuffer(bytearray(data), dtype=torch.uint8), **kw)


@pytest.fixture(scope="module")
def middle(tiny_llama_store):
    store = tiny_llama_store
    r = LayerRange(1, store.config.num_layers)
    return store, Stage(store.config, r, store.load_layers(r))


def answer(store, req, warm=None):
    limits = Limits.for_model(store.config, max_tokens_per_frame=2048)
    return trio.run(lambda: Verifier(store, "cpu", trio.CapacityLimiter(1)).answer(req, limits, warm))


@pytest.mark.parametrize("wire_dtype", ["f32", "bf16"])
def test_a_verifiers_rows_are_the_auditors_own_replay(middle, wire_dtype):
    store, stage = middle
    plan, records = logged_job(stage, wire_dtype)
    limits = Limits.for_model(store.config)
    logged = logged_frames(plan, records, limits)
    reply = answer(store, request_for(plan, logged))
    assert reply.error is None
    reply = decode(encode(reply), control_limits(limits))  # as the coordinator reads it
    remote = split_reply(reply, logged)
    local = replay_here(stage, plan, logged)
    assert remote is not None and len(remote) == len(local)
    for x, y in zip(remote, local):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
    assert compare(plan, logged, remote) is None and agree(plan, logged, remote, local)


def test_a_cheating_stage_fails_against_a_verifiers_rows(middle):
    store, stage = middle
    plan, records = logged_job(stage, corrupt=True)
    logged = logged_frames(plan, records, Limits.for_model(store.config))
    remote = split_reply(answer(store, request_for(plan, logged)), logged)
    finding = compare(plan, logged, remote)
    assert finding is not None and finding.check == "output_mismatch"


def test_recomputations_that_differ_do_not_agree(middle):
    """A lying verifier's rows (off by far more than the tolerance) form their own opinion."""
    store, stage = middle
    plan, records = logged_job(stage)
    logged = logged_frames(plan, records, Limits.for_model(store.config))
    honest = replay_here(stage, plan, logged)
    lie = [None if r is None else (r[0], r[1] * 1.05, r[2]) for r in honest]
    assert not agree(plan, logged, honest, lie) and compare(plan, logged, lie) is not None
    assert not agree(plan, logged, honest, honest[:-1])


def test_rows_that_do_not_fit_the_frames_are_refused(middle):
    store, stage = middle
    plan, records = logged_job(stage)
    logged = logged_frames(plan, records, Limits.for_model(store.config))
    reply = answer(store, request_for(plan, logged))
    n = len(logged.inputs)
    assert split_reply(VerifyReply(request_id=7, frame_rows=reply.frame_rows[:-1], keep=reply.keep[:-1],
                                   hidden=reply.hidden[:-1]), logged) is None  # a frame short
    t0 = logged.inputs[0].positions.shape[0]
    rows = reply.frame_rows
    keep = reply.keep.clone()
    keep[rows[0] - 1] = t0  # a row index past its frame
    assert split_reply(VerifyReply(request_id=7, frame_rows=rows, keep=keep, hidden=reply.hidden), logged) is None
    assert len(split_reply(reply, logged)) == n


def test_bad_requests_get_error_replies(middle, tmp_path):
    store, stage = middle
    plan, records = logged_job(stage)
    logged = logged_frames(plan, records, Limits.for_model(store.config))
    good = request_for(plan, logged)
    # A frame that is not a Forward: the stage's output (a Forward here) cut short does not decode.
    bad = VerifyRequest(request_id=1, layer_start=1, layer_end=3, wire_dtype="f32", frame_bytes=(5,),
                        frames=torch.zeros(5, dtype=torch.uint8))
    reply = answer(store, bad)
    assert reply.request_id == 1 and reply.error and reply.hidden is None
    # Too small a reply budget.
    reply = answer(store, request_for(plan, logged, max_reply_bytes=100))
    assert reply.error.startswith("the recomputed rows take ") and "over the request's max_reply_bytes 100" in reply.error
    # A store without the slice's files (a volunteer that holds only another slice).
    shutil.copytree(store.root, tmp_path / "s")
    (tmp_path / "s" / layer_file(2)).unlink()
    reply = answer(ModelStore.open(tmp_path / "s"), good)
    assert reply.error is not None and reply.hidden is None


def test_the_speed_probes_timing_request_is_answered_at_once_without_a_warning(middle, caplog):
    # Bug guarded: every speed probe's timing request logged "verify request ... not answered:
    # frame shorter than its header length field" at WARNING on the probed node; a malformed
    # request (a frame that does not decode) must still warn, once per WARN_EVERY_S (then INFO).
    store, _ = middle
    req = timing_request(9, 1, "f32")
    assert is_timing(decode(encode(req), control_limits(Limits.for_model(store.config))))
    with caplog.at_level(logging.DEBUG, logger="shard.node"):
        reply = answer(store, req)
    assert reply.request_id == 9 and reply.error == TIMING_ERROR and reply.hidden is None
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    caplog.clear()
    bad = VerifyRequest(request_id=10, layer_start=1, layer_end=2, wire_dtype="f32", frame_bytes=(1,),
                        frames=torch.ones(1, dtype=torch.uint8))
    assert not is_timing(bad)
    limits = Limits.for_model(store.config, max_tokens_per_frame=2048)

    async def twice():  # one verifier, two bad requests in a row: the second is not a warning again
        verifier = Verifier(store, "cpu", trio.CapacityLimiter(1))
        return [await verifier.answer(bad, limits) for _ in range(2)]

    with caplog.at_level(logging.DEBUG, logger="shard.node"):
        replies = trio.run(twice)
    assert all(r.error != TIMING_ERROR and r.hidden is None for r in replies)
    assert [r.levelno for r in caplog.records if "not answered" in r.getMessage()] == [logging.WARNING, logging.INFO]


def test_the_warm_slice_is_used_only_as_loaded_for_the_request(middle):
    """A warm slice of another quantisation or dtype would recompute something else."""
    store, stage = middle
    plan, records = logged_job(stage)
    logged = logged_frames(plan, records, Limits.for_model(store.config))
    poisoned = Stage(store.config, stage.layers, {i: {k: torch.zeros_like(v) for k, v in w.items()}
                                                  for i, w in store.load_layers(stage.layers).items()})
    on_warm = split_reply(answer(store, request_for(plan, logged), (poisoned, "none")), logged)
    assert compare(plan, logged, on_warm) is not None  # it did use the warm slice
    loaded = split_reply(answer(store, request_for(plan, logged), (poisoned, "int8")), logged)
    assert compare(plan, logged, loaded) is None  # another quantisation: loaded from the store


def test_verify_messages_refuse_shapes_that_do_not_add_up():
    limits = Limits(hidden_size=4, num_layers=5)
    frames = torch.zeros(5, dtype=torch.uint8)
    ok = dict(request_id=1, layer_start=1, layer_end=3, wire_dtype="f32", frame_bytes=(2, 3), frames=frames)
    assert decode(encode(VerifyRequest(**ok)), limits).frame_bytes == (2, 3)
    for change, text in [({"frame_bytes": (2, 2)}, "tensor 'frames' shape"),
                         ({"layer_end": 6}, "field 'layer_end'"),
                         ({"layer_end": 1}, "field 'layer_end' vs 'layer_start'"),
                         ({"frame_bytes": (), "frames": torch.zeros(0, dtype=torch.uint8)}, "field 'frame_bytes' length")]:
        with pytest.raises(WireError, match=text):
            decode(encode(VerifyRequest(**{**ok, **change})), limits)
    rows = dict(request_id=1, frame_rows=(1, 2), keep=torch.tensor([0, 0, 1]), hidden=torch.zeros(3, 4))
    assert decode(encode(VerifyReply(**rows)), limits).frame_rows == (1, 2)
    for change, text in [({"keep": torch.tensor([0, 1])}, "tensor 'keep' shape"),
                         ({"hidden": torch.zeros(3, 5)}, "tensor 'hidden' shape"),
                         ({"aux": torch.zeros(3, 6)}, "tensor 'aux' shape"),
                         ({"keep": torch.tensor([0, 0, 9999])}, "tensor 'keep' value"),
                         ({"error": "x"}, "a verify reply with an error carries no rows")]:
        with pytest.raises(WireError, match=text):
            decode(encode(VerifyReply(**{**rows, **change})), limits)
    with pytest.raises(WireError, match="needs tensors 'keep' and 'hidden'"):
        decode(encode(VerifyReply(request_id=1, frame_rows=(1,))), limits)


def test_a_verifier_fetches_the_files_of_a_slice_its_store_lacks_before_loading_it(middle, tmp_path):
    """A volunteer verifier may hold only its own slice: `fetch` (shard.weight_fetch on a
    node) must run for the audited range before the load, and its files then serve."""
    store, stage = middle
    plan, records = logged_job(stage)
    logged = logged_frames(plan, records, Limits.for_model(store.config))
    shutil.copytree(store.root, tmp_path / "s")
    (tmp_path / "s" / layer_file(2)).unlink()
    asked = []

    async def fetch(r):  # stands in for the peers: the missing file arrives, checked on load
        asked.append(r)
        shutil.copy(store.root / layer_file(2), tmp_path / "s" / layer_file(2))

    partial = ModelStore.open(tmp_path / "s")
    limits = Limits.for_model(store.config, max_tokens_per_frame=2048)
    reply = trio.run(lambda: Verifier(partial, "cpu", trio.CapacityLimiter(1), fetch).answer(
        request_for(plan, logged), limits))
    assert asked == [stage.layers] and reply.error is None
    assert compare(plan, logged, split_reply(reply, logged)) is None


class LoggedLimiter:
    """A CapacityLimiter that notes, in `log`, each hold a worker thread takes of it."""

    def __init__(self, log: list[str]) -> None:
        self.inner, self.log = trio.CapacityLimiter(1), log

    async def acquire_on_behalf_of(self, borrower) -> None:
        await self.inner.acquire_on_behalf_of(borrower)
        self.log.append("replay")

    def release_on_behalf_of(self, borrower) -> None:
        self.inner.release_on_behalf_of(borrower)

    async def __aenter__(self):
        await self.inner.acquire()

    async def __aexit__(self, *exc):
        self.inner.release()


def test_a_replay_lets_the_nodes_own_forwards_in_between_its_steps(middle):
    # Bug guarded: a verifier on a ring stage holding the node's compute limiter for a whole
    # audited job (1931 rows: ~10 s at load 4), so every job on the ring stalled behind the
    # audit (issue 21: ITL p95 12 s at 16 streams). Now it holds it one replay forward (at
    # most step_rows rows) at a time, and the rows are the one-forward replay's. Sound: the
    # stage's forwards stand in as a task that takes the same limiter in a loop, and the
    # limiter logs who held it in turn (trio's limiter is first come, first served).
    store, stage = middle
    plan, records = logged_job(stage)
    limits = Limits.for_model(store.config, max_tokens_per_frame=2048)
    logged = logged_frames(plan, records, limits)
    whole = answer(store, request_for(plan, logged), warm=(stage, plan.quant))
    log: list[str] = []

    async def main():
        limiter, done = LoggedLimiter(log), trio.Event()
        verifier = Verifier(store, "cpu", limiter, step_rows=4)  # type: ignore[arg-type]

        async def ask():
            replies.append(await verifier.answer(request_for(plan, logged), limits, (stage, plan.quant)))
            done.set()

        async def stage_forwards():
            while not done.is_set():
                async with limiter:
                    log.append("stage")
                await trio.sleep(0.001)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            nursery.start_soon(stage_forwards)

    replies: list[VerifyReply] = []
    trio.run(main)
    got = replies[0]
    assert got.error is None and whole.error is None and got.frame_rows == whole.frame_rows
    assert torch.allclose(got.hidden, whole.hidden, rtol=1e-5, atol=1e-5)
    steps = log.count("replay")
    assert steps >= 4  # the engine-like job's 20 rows, at most 4 (whole frames) a forward
    first, last = log.index("replay"), len(log) - 1 - log[::-1].index("replay")
    assert log[first:last + 1].count("stage") >= steps - 1  # a stage forward between every two steps
