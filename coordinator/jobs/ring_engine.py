"""The Engine that generates over a ring of stages: prefill, decode, and resume.

It owns the model's two ends (the head stage embeds; the coordinator keeps the final norm
and LM head), sends token frames to the head, receives the tail's hidden states directly,
and delivers each to its job's inbox (coordinator.jobs.ring_job), which turns them into
committed tokens; a job asks the engine only through the port built for it (EnginePort).
Prefill, decode and recovery are one procedure: "bring the ring's KV up to the committed
context, then give me the next logits" — after a ring change the ring holds nothing for
the job, so the same call re-prefills it. A dead node therefore costs time, not tokens. It
does not choose rings (swarm) or speak HTTP.
"""

from __future__ import annotations

import logging
import os
from contextlib import suppress
from typing import Any

import trio

from receipts import sha256_digest
from coordinator.errors import JobFailedError, KVRoomTimeout, NotReadyError, RingLost
from coordinator.trust import opinions, probation
from coordinator.trust.receipt_check import ReceiptChecker
from coordinator.trust.round_verifier import RoundVerifier
from coordinator.trust.shadow import Shadow
from coordinator.spec import adapt
from coordinator.spec.drafting import Drafter, NgramDrafter, grammar_pruned
from coordinator.spec.eagle import EagleDrafter, EagleHead, shipped_head_dir
from coordinator.jobs.engine_config import EngineConfig
from coordinator.jobs.port import Arrived
from coordinator.jobs.release_gate import ReleaseGate
from coordinator.jobs.ring_job import RingJob
from coordinator.jobs.prefix_cache import PrefixIndex
from coordinator.jobs.prefix_sources import PrefixSources
from coordinator.jobs.ring_router import Pinned, RingRouter
from coordinator.spec.sampling import SamplingParams
from coordinator.jobs.burst_gate import BurstGate
from coordinator.jobs.engine_port import EnginePort
from coordinator.jobs.head_batch import HeadBatcher
from coordinator.jobs.heap_sweep import sweep_heap
from coordinator.jobs.liveness import Liveness
from coordinator.swarm.swarm import RingState, Swarm
from ring import PeerId
from shard.errors import DialError, ShardError, WireError
from shard.layers import LayerRange
from shard.manifest import layer_file
from shard.stage import OutputHead
from shard.stage_worker import DRAFT_SLACK_SLOTS
from shard.transport import FramedStream, Host, TransportError
from shard.node import RING_PROTOCOL
from shard.ring_observer import NO_OBSERVER, ObservedHead, RingObserver
from shard.wire.codec import decode_frame
from shard.wire.messages import EndJob, Forward, JobError, Result

log = logging.getLogger("shard.coordinator")


class RingEngine:
    def __init__(self, swarm: Swarm, host: Host, tokenizer: Any, config: EngineConfig,
                 receipts: ReceiptChecker | None = None, *, job_errors: trio.MemoryReceiveChannel[JobError],
                 ring_changes: trio.MemoryReceiveChannel[RingState | None], observer: RingObserver = NO_OBSERVER,
                 round_verifier: RoundVerifier | None = None) -> None:
        """`job_errors` and `ring_changes` carry what the swarm reports (its JobErrors, its
        RingState or None on every change); serve() hands them to the jobs they concern.
        `observer` watches its frames, its jobs' rounds and their logits (benchmarks).
        `round_verifier`: checks newcomers' rounds by verifier nodes when this store cannot."""
        self.receipts = receipts  # None: rounds are not checked (receipts off)
        store = swarm.store
        self.swarm, self.host, self.tokenizer, self.config = swarm, host, tokenizer, config
        self.cfg = store.config
        self.model_id = store.manifest.name
        self.max_context_tokens = self.cfg.max_context_tokens
        eos = set(self.cfg.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        norm, lm_head = store.load_head()
        self.head = OutputHead(self.cfg, norm, lm_head if lm_head is not None else store.load_embedding())
        self.observer = observer
        if observer is not NO_OBSERVER:
            self.head = ObservedHead(self.head, observer)
        self.head_batch = HeadBatcher(self.head, burst_wait_s=config.burst_wait_ms / 1e3, groups=max(config.max_groups, 0),
                                      group_wait_s=config.group_wait_ms / 1e3)  # (coordinator.jobs.head_batch)
        self._jobs: dict[str, trio.MemorySendChannel] = {}
        self.jobs_ended = 0
        # Which of the swarm's rings each job runs on; one ring at a time with rounds the shadow recomputes.
        # A job's K/V past its tokens: the draft nodes of its rounds in flight; with no drafter
        # every frame writes one slot at its context's end, so none.
        self.router = RingRouter(swarm, probation=lambda ring: self.on_probation(ring) if self.shadow is not None else (),
                                 kv_step=config.prefill_chunk_tokens,
                                 kv_slack=0 if config.draft == "none" else DRAFT_SLACK_SLOTS)
        self.eagle_head = self._load_eagle(store)
        # Finished jobs' K/V kept for prompts that start the same (coordinator.jobs.prefix_sources).
        self.prefixes = PrefixSources(
            PrefixIndex(config.prefix_cache_tokens), ring_by_epoch=swarm.ring_by_epoch, on_probation=self.on_probation,
            send_end=self._send_end, slots=lambda n: self.router.slots(Pinned(-1, n, 1)))
        self.router.kept_slots, self.router.free_kept = self.prefixes.index.slots_on, self.prefixes.free
        self._head_streams: dict[int, FramedStream] = {}
        self._send_lock = trio.Lock()
        self.gate = BurstGate(self.send_bodies)  # a head product's next frames leave together (coordinator.jobs.burst_gate)
        self._links: trio.Nursery | None = None  # set by serve(); needed only for link emulation
        self.hop_times: dict[str, float] = {}
        # What finished jobs measured (acceptance per drafter, calibration, traversal time)
        # and on which ring epoch: a new job starts from it rather than from the priors,
        # which a 50-token request would otherwise spend most of its rounds unlearning.
        self.learned_adapt: tuple[int, adapt.AdaptState] = (-1, adapt.AdaptState())
        self._job_errors, self._ring_changes = job_errors, ring_changes
        # Round deadlines (with the frames in flight ahead) and stall blame: coordinator.jobs.liveness.
        self.liveness = Liveness(swarm, config.frame_timeout_s, config.prefill_chunk_tokens)
        # Probation (coordinator.trust.probation): rounds of rings with a newcomer are
        # recomputed here (coordinator.trust.shadow) and checked before their tokens go out.
        self.probation = probation.ProbationPolicy(config.probation_rounds, frozenset(config.trusted_nodes)
                                                   | frozenset(swarm.config.topology.trusted_peers))
        self.probation_counts: dict[str, int] = {}  # rounds_unverified (released), rounds_refused (release_gate)
        self.clean_rounds: probation.Book = {}
        self.shadow: Shadow | None = Shadow(store)  # None: this store cannot recompute (no layers)
        self.probation_off: str | None = None  # why newcomers' rounds go out unverified, for /v1/ring
        self.round_verifier = round_verifier  # used once the shadow is off (coordinator.jobs.release_gate)
        swarm.unverifiable = self.unverifiable  # formation seats a newcomer nothing trusted checks only if it must
        swarm.seat_for_capacity = lambda: self.config.unverified_newcomers != "refuse"  # else its rounds only 503
        swarm.trusted = lambda: frozenset(p for p in swarm.members if not probation.on_probation(self.clean_rounds, p, self.probation))

    def make_drafters(self) -> list[Drafter]:
        """Fresh drafters for one job; several means the router picks per round (hybrid),
        none means plain decoding."""
        mode = self.config.draft
        drafters: list[Drafter] = []
        if mode in ("ngram", "hybrid"):
            drafters.append(NgramDrafter())
        if mode in ("eagle", "hybrid") and self.eagle_head is not None:
            drafters.append(EagleDrafter(self.eagle_head, keep_features=self.prefixes.index.enabled))  # to fork
        return drafters

    def _load_eagle(self, store) -> EagleHead | None:
        """The EAGLE head for this model: --eagle-head PATH, else the one shipped for it."""
        if self.config.draft not in ("eagle", "hybrid"):
            return None
        path = self.config.eagle_head or shipped_head_dir(store.manifest.name)
        if path is None:
            if self.config.draft == "eagle":
                raise NotReadyError(f"--draft eagle needs a head: none is shipped for {store.manifest.name}; pass --eagle-head")
            log.info("no EAGLE head for %s: hybrid drafting uses n-gram only", store.manifest.name)
            return None
        return EagleHead.load(path, self.cfg, store.load_embedding(), target_digest=store.digest)

    # -- Engine interface ----------------------------------------------------------------
    async def open_job(self, prompt_ids: list[int], params: SamplingParams) -> "RingJob":
        if self.swarm.ring is None:
            raise NotReadyError("no ring is formed yet (waiting for nodes)")
        job_id = os.urandom(8).hex()
        self.router.route(job_id, len(prompt_ids), params.max_tokens)
        try:  # no ring's K/V has room: wait for a job to finish (coordinator.jobs.kv_room), then 429
            if not await self.router.wait_room(job_id, self.config.kv_wait_s):
                raise KVRoomTimeout(self.config.kv_wait_s, self.router.retry_after_s())
        except BaseException:
            self.router.drop(job_id)
            raise
        ring = self.router.ring_for(job_id)
        send, recv = trio.open_memory_channel(256)
        self._jobs[job_id] = send
        self.liveness.job_opened(job_id)
        job = RingJob(EnginePort(self, job_id), job_id, list(prompt_ids), params, recv, self.config, self.head_batch,
                      self.max_context_tokens, drafters=self.make_drafters(),
                      adapt=self.starting_adapt(ring.epoch if ring else -1), observer=self.observer)
        self.router.attach(job_id, job)
        job.drafters = grammar_pruned(job.drafters, params.constraint, len(job.prompt_ids))  # no draft the grammar forbids
        inner = self.receipts.open_job(job_id, job.nonce, job.prompt_ids) if self.receipts is not None else None
        job.receipts = ReleaseGate(inner, self)
        return job

    def starting_adapt(self, epoch: int) -> adapt.AdaptState:
        """The planner state a job on ring `epoch` starts from: what earlier jobs learned,
        without their traversal times if those were measured on another ring."""
        learned_epoch, state = self.learned_adapt
        return state if learned_epoch == epoch else adapt.apply(adapt.RingChanged(), state)

    def bundle(self, job_id: str) -> dict[str, Any] | None:
        """The signed receipt bundle of a finished job as JSON, None if unknown."""
        return self.receipts.bundle(job_id) if self.receipts is not None else None

    def info(self) -> dict[str, Any]:
        """/v1/ring: the first ring's fields as ever, and every ring (coordinator.jobs.ring_router)."""
        verified = "off" if self.probation.clean_rounds == 0 else "no" if self.probation_off else "before release"
        by = None if verified != "before release" else "gateway" if self.shadow is not None else "verifier nodes"
        disputes = self.round_verifier.open_disputes() if self.round_verifier is not None else []
        return {**self.router.status(self.model_id, len(self._jobs)),
                "prefix_cache": self.prefixes.index.info(),
                "probation": {"clean_rounds": self.probation.clean_rounds, "rounds_verified": verified, "verified_by": by,
                              "why_not": self.probation_off, "policy": self.config.unverified_newcomers, "disputes": disputes,
                              "seated_unverified": self.swarm.seated_unverified, **self.probation_counts}}

    def clock_offsets_s(self, epoch: int) -> tuple[float, ...] | None:
        """Ring `epoch`'s stages' clock offsets against ours, in ring order (hop_times
        corrects their stamps by them); None once that ring is gone."""
        ring = self.swarm.ring_by_epoch(epoch)
        return self.swarm.clocks.stage_offsets_s([p for p, _ in ring.stages]) if ring else None

    # -- frames ----------------------------------------------------------------------------
    async def send_bodies(self, ring: RingState, bodies: list[bytes]) -> None:
        """Send encoded frame bodies to the ring's head, in one write."""
        async with self._send_lock:
            stream = self._head_streams.get(ring.epoch)
            if stream is None:
                for gone in [e for e in self._head_streams if self.swarm.ring_by_epoch(e) is None]:
                    del self._head_streams[gone]  # its ring re-formed or broke; other rings' streams stay
                try:
                    stream = await self.host.open_stream(ring.head, RING_PROTOCOL)
                except DialError as exc:  # a head we cannot reach is treated as gone (re-formed without it)
                    self.swarm.report_unreachable(ring.head, f"the coordinator could not reach it: {exc}")
                    raise
                self.swarm.traversals.paths[(self.swarm.peer_id, ring.head)] = self.host.path_of(stream)
                stream = await self._emulate(stream)
                self._head_streams[ring.epoch] = stream
            for body in bodies:
                self.observer.frame_sent(self.host.peer_id, len(body) + 4)
            await stream.send_frames(bodies)

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Hand the swarm's job errors and ring changes to the jobs, and hold the nursery
        that pumps emulated links; never returns."""
        async with trio.open_nursery() as self._links:
            self._links.start_soon(self._serve_job_errors)
            self._links.start_soon(self._serve_ring_changes)
            self._links.start_soon(sweep_heap, lambda: self.jobs_ended)  # freed memory back to the OS
            self._links.start_soon(self.prefixes.serve)
            task_status.started()
            await trio.sleep_forever()

    async def _serve_job_errors(self) -> None:
        async for error in self._job_errors:
            self._deliver(error)

    async def _serve_ring_changes(self) -> None:
        async for ring in self._ring_changes:
            self._on_ring_change(ring)

    async def _emulate(self, stream):
        from shard.linkemu import EmulatedLink, link_settings

        c = self.config
        settings = link_settings(c.link_latency_ms, c.link_upload_mbps, c.link_jitter_ms)
        if settings is None:
            return stream
        link = EmulatedLink(stream, **settings)
        await self._links.start(link.serve)
        return link

    async def handle_ring_stream(self, stream: FramedStream) -> None:
        """Results from the tail. Frames from any other peer are refused (and logged)."""
        remote = stream.remote_peer_id
        limits = self.swarm.limits
        reported = False
        try:
            while True:
                body = await stream.recv_frame(limits.max_frame_bytes)
                ring = self.router.ring_with_tail(remote)
                if ring is None:
                    log.warning("refused a frame from %s: not the tail of the current ring", remote)
                    return
                if not reported:  # the tail's hop: the path of the connection this stream crosses
                    self.swarm.traversals.paths[(PeerId(remote), self.swarm.peer_id)] = self.host.path_of(stream)
                    reported = True
                try:
                    msg, canonical_len = decode_frame(body, limits)
                except WireError as exc:
                    log.warning("dropped a malformed frame from tail %s: %s", remote, exc)
                    continue
                if isinstance(msg, Result):
                    self.observer.result_arrived(msg)
                    self.liveness.result_arrived(ring, msg)
                    digest = sha256_digest(memoryview(body)[:canonical_len]) if self.receipts is not None else b""
                    if self._deliver(Arrived(msg, digest)):  # its job's ask is work in hand (head_batch)
                        self.head_batch.received(msg.burst, msg.job_id)
        except (TransportError, WireError) as exc:
            log.info("ring stream from %s ended: %s", remote, exc)
        finally:
            await stream.aclose()

    # -- liveness --------------------------------------------------------------------------
    def round_missed(self, ring: RingState, round: int) -> None:
        """A round on `ring` missed its deadline: one stage sits out (coordinator.jobs.liveness)."""
        self.liveness.round_missed(ring, round)

    # -- probation ----------------------------------------------------------------------
    def on_probation(self, ring: RingState) -> tuple[PeerId, ...]:
        """`ring`'s stages whose rounds are verified before release (none with neither a shadow
        nor verifier nodes)."""
        if self.shadow is None and self.round_verifier is None:
            return ()
        return probation.probation_stages(self.clean_rounds, [p for p, _ in ring.stages], self.probation)

    def unverifiable(self, stages: tuple[tuple[PeerId, LayerRange], ...]) -> tuple[PeerId, ...]:
        """`stages` on probation nothing trusted could check (coordinator.trust.opinions.unverifiable)."""
        regs = {p: m.register for p, m in self.swarm.members.items()} if self.round_verifier is not None else {}
        return opinions.unverifiable(stages, lambda p: probation.on_probation(self.clean_rounds, p, self.probation), regs,
                                     set(self.swarm.faulty), lambda r: self.shadow is not None and all(
                                         (self.swarm.store.root / layer_file(i)).exists() for i in r))

    def quant_of(self) -> dict[str, str]:
        return {p: m.register.quant for p, m in self.swarm.members.items()}

    async def shadow_feed(self, ring: RingState, body: bytes) -> None:
        """Recompute a frame just sent to `ring`'s head, if the ring has a stage on probation."""
        if not self.on_probation(ring) or self.shadow is None:
            return
        msg, _ = decode_frame(body, self.swarm.limits)  # our own frame: it decodes
        if isinstance(msg, (Forward, EndJob)):
            try:
                await self.shadow.feed(ring, msg, self.quant_of())
            except (OSError, KeyError, ShardError) as exc:  # the store lacks a slice: verifier nodes check instead
                self.shadow = None
                if self.round_verifier is not None:
                    log.info("this gateway cannot recompute the ring (%s): verifier nodes check newcomers' rounds", exc)
                    return
                self.probation_off = (f"this gateway cannot recompute the ring ({exc}) and receipts are off, so no "
                                      f"verifier node can check its rounds: audits alone vouch for newcomers")
                log.warning("probation checks are off: %s", self.probation_off)

    def verify_round(self, ring: RingState, result: Result) -> None:
        """Before a round's tokens are released: on a ring with stages on probation, its
        result must match the shadow's. A mismatch excludes the newest of them, or has it sit
        out (coordinator.trust.probation.blame); either way the round fails and the job
        resumes from its committed, verified tokens. Raises JobFailedError."""
        suspects = self.on_probation(ring)
        if not suspects or self.shadow is None:
            if self.shadow is not None and self.shadow.loaded and not any(map(self.on_probation, self.swarm.rings.values())):
                self.shadow.release()  # the ring in force needs none: its slices' memory goes back
            return
        spot = self.shadow.check(ring, result, self.quant_of())
        if spot is not None and spot.passed:
            self.clean_rounds = probation.credit(self.clean_rounds, suspects)
            return
        what = (f"round {result.round} on ring epoch {ring.epoch} could not be recomputed" if spot is None else
                f"round {result.round} on ring epoch {ring.epoch} differs from the coordinator's recomputation "
                f"({spot.num_outliers}/{spot.num_elements} elements off, max abs error {spot.max_abs_error:.3g})")
        if spot is not None:
            verdict = probation.blame(self.clean_rounds, suspects)
            if verdict.faulty is not None:
                self.swarm.mark_faulty(verdict.faulty, f"on probation: {what}")
                if self.receipts is not None:  # signed evidence against its receipt, as an audit's catch
                    at = [p for p, _ in ring.stages].index(verdict.faulty)
                    self.receipts.sign_catch(result, verdict.faulty, self.shadow.stage_digest(result, at), spot)
            for peer in verdict.sit_out:
                self.swarm.report_unreachable(peer, f"on probation, as new as another: {what}", "unverified")
        raise JobFailedError(f"{what}; its tokens were not released")

    def _deliver(self, msg: Arrived | JobError) -> bool:
        """Whether `msg` reached its job's inbox."""
        channel = self._jobs.get(msg.result.job_id if isinstance(msg, Arrived) else msg.job_id)
        with suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            if channel is not None:
                channel.send_nowait(msg)
                return True
        return False

    async def _send_end(self, ring: RingState, body: bytes) -> None:
        """An EndJob the engine sends itself (a prefix source let go), as a job's own goes."""
        await self.gate.send(ring, body, None)
        await self.shadow_feed(ring, body)

    def _on_ring_change(self, ring: RingState | None) -> None:
        self.prefixes.ring_changed()
        for channel in self._jobs.values():
            with suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                channel.send_nowait(RingLost())

    def close_job(self, job_id: str) -> None:
        channel = self._jobs.pop(job_id, None)
        self.liveness.job_ended(job_id)
        self.jobs_ended += channel is not None
        self.router.forget(job_id)
        self.head_batch.forget(job_id)  # no LM-head product waits for its next ask
        if channel is not None:
            channel.close()
