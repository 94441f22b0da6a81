"""The ring recomputed beside itself on the coordinator, for rounds that must be verified
before their tokens are released (coordinator.trust.probation).

A Shadow holds one StageWorker per stage of the ring in force, on the slices loaded from
the coordinator's own store and quantised as each stage declared (shard.quant), each
converting to the ring's wire dtype between stages exactly as the nodes do. Fed every
frame a job sends to the ring's head, in the order sent (the order the head reads them),
it computes the Result an honest ring returns; `check` compares the ring's Result with it
(receipts.compare_outputs, each element against its row's RMS). A ring's stages batch
frames of different jobs in one forward, which moves f32 results by ~1e-5 and can flip a
wire rounding at a hop, so the tolerance is an honest stage's (coordinator.trust.tolerance)
once per stage. Costs one ring's compute on the coordinator, which is why only rings with a
node on probation are shadowed.

Error handling: a frame the shadow cannot compute (a ShardError: the ring refuses it too)
leaves no expected result, and `check` of its round answers None (unverified), as does a
round never fed. Each stage's expected output is kept as the digest of its canonical bytes
(what that stage's receipt signs as its output), so a probation catch is signed as
evidence against the blamed stage's own receipt (`stage_digest`). Resource handling: slices are cached (at most `max_slices`) until
`release`; a job's K/V is freed on its EndJob or when its ring changes; expected results
are bounded.
It does not know jobs, tokens or who is on probation.
"""

from __future__ import annotations

import dataclasses
import gc
from collections import OrderedDict
from collections.abc import Mapping

import torch
import trio

from coordinator.swarm.formation import RingState
from coordinator.trust.tolerance import stage_tolerance
from receipts import SpotCheck, Tolerance, compare_outputs, sha256_digest
from shard.activations import from_wire
from shard.errors import ShardError
from shard.heap import return_freed_heap
from shard.layers import LayerRange
from shard.quant import quantise_stage, scheme
from shard.stage import Stage
from shard.stage_worker import StageWorker, WorkerConfig
from shard.store import ModelStore
from shard.wire.codec import encode_body
from shard.wire.messages import EndJob, Forward, Result

MAX_EXPECTED = 4096  # results computed and not yet checked (rounds a job discarded stay until its end)


class Shadow:
    def __init__(self, store: ModelStore, *, max_slices: int = 8, max_kv_bytes: int = 1 << 30) -> None:
        self.store, self.max_slices, self.max_kv_bytes = store, max_slices, max_kv_bytes
        self._slices: OrderedDict[tuple[LayerRange, str], Stage] = OrderedDict()
        self._chain: tuple[int, list[StageWorker]] | None = None  # (ring epoch, one worker per stage)
        self._expected: OrderedDict[tuple[str, int, int], Result] = OrderedDict()  # (job, epoch, round)
        # Per (job, epoch, round): each stage's expected output digest, in ring order; the
        # last checked round's move to _checked for stage_digest.
        self._digests: dict[tuple[str, int, int], tuple[bytes, ...]] = {}
        self._checked: tuple[tuple[str, int, int], tuple[bytes, ...]] | None = None
        self._limiter = trio.CapacityLimiter(1)  # the workers share caches: one frame at a time
        self._releases = 0  # bumped by release: a feed queued before one is dropped, not run

    async def feed(self, ring: RingState, msg: Forward | EndJob, quant_of: Mapping[str, str]) -> None:
        """Run one frame the coordinator sent to `ring`'s head through the shadow ring
        (`quant_of`: each stage's declared quantisation scheme, "none" if absent)."""
        await trio.to_thread.run_sync(self._feed, ring, msg, quant_of, self._releases, limiter=self._limiter)

    def _feed(self, ring: RingState, msg: Forward | EndJob, quant_of: Mapping[str, str], releases: int) -> None:
        if releases != self._releases:
            # Released while this frame waited for the limiter (its ring's probation ended):
            # running it would load every slice again for a round nobody checks, and the next
            # round's release drop them again (~1 s of CPU per reload, once per queued frame).
            return
        workers = self._workers(ring, quant_of)
        if isinstance(msg, EndJob):
            for w in workers:
                w.end_job(msg.job_id)
            return
        out: Forward | Result = msg
        digests = []
        try:
            for w in workers:
                out = w.process(out)  # type: ignore[arg-type]
                digests.append(sha256_digest(encode_body(out)))
        except ShardError:
            return
        if isinstance(out, Result):
            key = (msg.job_id, msg.epoch, msg.round)
            self._expected[key], self._digests[key] = out, tuple(digests)
            while len(self._expected) > MAX_EXPECTED:
                self._digests.pop(self._expected.popitem(last=False)[0], None)

    def _workers(self, ring: RingState, quant_of: Mapping[str, str]) -> list[StageWorker]:
        if self._chain is not None and self._chain[0] == ring.epoch:
            return self._chain[1]
        cfg, last = self.store.config, len(ring.stages) - 1
        assignment_of = {a.peer_id: a for a in ring.assignments}
        workers = []
        for i, (peer, r) in enumerate(ring.stages):
            a, stage = assignment_of[peer], self._stage(r, quant_of.get(peer, "none"))
            workers.append(StageWorker(stage, WorkerConfig(wire_dtype=a.wire_dtype, aux_dtype=a.aux_dtype, is_tail=i == last,
                                                           max_kv_bytes=self.max_kv_bytes,
                                                           max_context_tokens=cfg.max_context_tokens)))
        self._chain = (ring.epoch, workers)  # the old ring's caches go with its workers
        self._expected.clear()
        self._digests.clear()
        return workers

    def _stage(self, r: LayerRange, quant: str) -> Stage:
        key = (r, quant)
        if key not in self._slices:
            emb = self.store.load_embedding() if r.start == 0 else None
            stage = Stage(self.store.config, r, self.store.load_layers(r), dtype=torch.float32, device="cpu", embedding=emb)
            self._slices[key] = quantise_stage(stage, scheme(quant))
            while len(self._slices) > self.max_slices:
                self._slices.popitem(last=False)
        self._slices.move_to_end(key)
        return self._slices[key]

    def release(self) -> None:
        """Drop the slices, caches and expected results (no ring needs a shadow now); the
        next feed loads again. glibc keeps much of what a slice freed for reuse (a whole
        SmolLM2 shadow: 791 MB loaded, 524-676 MB after release, 340 MB after a trim), so
        the freed memory is handed back to the system too."""
        self._releases += 1
        self._slices.clear()
        self._chain = None
        self._expected.clear()
        self._digests.clear()
        gc.collect()
        return_freed_heap()

    @property
    def loaded(self) -> bool:
        return bool(self._slices)

    def check(self, ring: RingState, result: Result, quant_of: Mapping[str, str]) -> SpotCheck | None:
        """The ring's `result` against the shadow's for the same round; None if the shadow
        has none (the round was not fed, or the shadow could not compute it)."""
        key = (result.job_id, result.epoch, result.round)
        expected = self._expected.pop(key, None)
        if expected is None:
            return None
        self._checked = (key, self._digests.pop(key, ()))
        e = from_wire(expected.hidden, expected.hidden_scale, torch.float32)  # (T, H)
        a = from_wire(result.hidden, result.hidden_scale, torch.float32)
        tol = ring_tolerance(ring, quant_of)
        if a.shape != e.shape:
            return compare_outputs([0.0], [float("inf")], tol)  # a failed check, with its shape
        rms = e.pow(2).mean(dim=1, keepdim=True).sqrt().expand_as(e)  # (T, H): each element's row RMS
        return compare_outputs(e.reshape(-1).numpy(), a.reshape(-1).numpy(), tol, scale=rms.reshape(-1).numpy())


    def stage_digest(self, result: Result, stage_index: int) -> bytes | None:
        """The digest of what the ring's `stage_index`-th stage should have sent for the
        round `check` last compared (`result`'s); None for another round."""
        if self._checked is None or self._checked[0] != (result.job_id, result.epoch, result.round):
            return None
        digests = self._checked[1]
        return digests[stage_index] if 0 <= stage_index < len(digests) else None


def ring_tolerance(ring: RingState, quant_of: Mapping[str, str]) -> Tolerance:
    """An honest stage's tolerance, coarsest over the ring, once per stage."""
    tols = [stage_tolerance(a.wire_dtype, quant_of.get(a.peer_id, "none")) for a in ring.assignments]
    n = max(len(tols), 1)
    worst = max(tols, key=lambda t: (t.rel_tol, t.abs_tol)) if tols else stage_tolerance("f32")
    return dataclasses.replace(worst, abs_tol=worst.abs_tol * n, rel_tol=worst.rel_tol * n)
